"""The engine's device programs: model programs and the cache programs.

Everything here runs on the device; the host (`serving.scheduler`) only fills
the inputs, and `serving.compiler` compiles the bounded set of programs
(`compiler.program_keys`). Model programs: one `step` program per token
bucket (`EngineConfig.buckets`) and, with `decode_steps > 1`, one `burst`
program per row bucket (`EngineConfig.burst_buckets`), split into a
greedy-only and a sampled variant on GPU backends. Cache programs: the
step's (`step[no tokens]`, which every step runs after its model program,
and alone for a step that feeds nothing) and, with bursts, the burst's
(`reserve`, run before every burst program). Every program takes the
engine's `(params, pool, state, seq_tokens)` and its inputs and returns
`(pool, state, seq_tokens, outputs)`; a model program reads the state
without changing it, a cache program passes the pool through.

The cache ops of a step (`commit` of finished prompts, `release` of finished
/ preempted sequences, `extend`, `claim_batch` of admitted requests) always
run, masked by `-1` ids when a step has none, and always with eviction built
in (its `lax.cond` is taken once per step or burst). A static variant per
combination of cache ops would multiply the programs (dozens), each compiled
at start-up or, worse, the first time a combination shows up while serving.

Sampling: a step samples under a `lax.cond` (the sort over the vocabulary
only when some row samples). A GPU reads the cond's predicate back on the
host, which waits for the step's outputs right after anyway; a variant per
sampling mode would compile every bucket's forward twice (measured:
docs/performance.md). A burst is dispatched while the previous one runs, and
a read back would serialize them, so on GPU backends the burst keeps a
static `greedy_only` variant (the argmax alone) and a sampled one the host
runs only when some row samples, without the cond (`sample_cond=False`: the
sort always runs). On a CPU backend, where a `lax.cond` costs no such sync,
the burst is not split either.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.experimental import checkify

from pkvattn import cache as _cache
from pkvattn.flax import AttentionPlan
from pkvattn.models import decoder as _decoder
from pkvattn.sampling import sample as _sample
from pkvattn.serving.config import EngineConfig

# Name scope of the cache bookkeeping inside the jitted step and burst (shows
# in profiler traces and HLO metadata).
CACHE_OPS_SCOPE = "pkvattn_cache_ops"

MAX_STOP_IDS = 8  # stop tokens per request handled on device in a burst


@struct.dataclass
class StepInputs:
  tokens: jax.Array         # i32[num_tokens]: 0 or one of cfg.buckets
  q_indptr: jax.Array       # i32[max_seqs + 1]
  kv_lens: jax.Array        # i32[max_seqs]
  sample_rows: jax.Array    # bool[max_seqs]
  temperature: jax.Array    # f32[max_seqs]
  top_k: jax.Array          # i32[max_seqs]
  top_p: jax.Array          # f32[max_seqs]
  seeds: jax.Array          # u32[max_seqs]
  gen_index: jax.Array      # i32[max_seqs]
  commit_ids: jax.Array     # i32[max_seqs], finished rows to publish, -1 = none
  commit_lens: jax.Array    # i32[max_seqs]
  prompt_commit_ids: jax.Array  # i32[max_seqs], rows whose prompt ends in
  #   this step: committed up to kv_lens after the forward, before `extend`
  release_ids: jax.Array    # i32[max_seqs], -1 = none
  extend_ids: jax.Array     # i32[max_seqs], -1 = none
  admit_ids: jax.Array      # i32[num_admit], -1 = none
  admit_tokens: jax.Array   # i32[num_admit, max_model_len]
  admit_lens: jax.Array     # i32[num_admit]
  admit_scope: jax.Array    # i32[num_admit], prefix-reuse scope (tenant salt)


@struct.dataclass
class StepOutputs:
  sampled: jax.Array        # i32[max_seqs]
  extend_ok: jax.Array      # bool[max_seqs]
  claim_ok: jax.Array       # bool[num_admit]
  claim_reused: jax.Array   # i32[num_admit]
  claim_new_blocks: jax.Array  # i32[num_admit] (or [num_admit, groups]), slots taken (scratch: fewer)
  used_slots: jax.Array     # i32[] (or [groups]), slots referenced by live sequences
  num_free: jax.Array       # i32[] (or [groups]), free slots (unreferenced, not cached)


@struct.dataclass
class BurstInputs:
  active: jax.Array         # bool[max_seqs], rows decoding in this burst
  last: jax.Array           # i32[max_seqs], last sampled token (fed first)
  computed: jax.Array       # i32[max_seqs], tokens in the cache (= its position)
  remaining: jax.Array      # i32[max_seqs], tokens the request may still emit
  stop_ids: jax.Array       # i32[max_seqs, MAX_STOP_IDS], -1 = none
  temperature: jax.Array    # f32[max_seqs]
  top_k: jax.Array          # i32[max_seqs]
  top_p: jax.Array          # f32[max_seqs]
  seeds: jax.Array          # u32[max_seqs]
  gen_index: jax.Array      # i32[max_seqs]
  commit_ids: jax.Array     # i32[max_seqs], finished rows to publish, -1 = none
  commit_lens: jax.Array    # i32[max_seqs], tokens of each to publish
  release_ids: jax.Array    # i32[max_seqs], finished / preempted rows, -1 = none


@struct.dataclass
class BurstCarry:
  """A burst's per-row decode state at its end: the next burst's inputs of
  the same name (`chain_inputs`), left on the device."""
  active: jax.Array         # bool[max_seqs], rows that keep decoding
  last: jax.Array           # i32[max_seqs]
  computed: jax.Array       # i32[max_seqs]
  remaining: jax.Array      # i32[max_seqs]
  gen_index: jax.Array      # i32[max_seqs]


@struct.dataclass
class BurstOutputs:
  tokens: jax.Array         # i32[decode_steps, max_seqs], -1 = row idle
  preempted: jax.Array      # bool[max_seqs], extend refused: out of slots
  used_slots: jax.Array     # i32[] (or [groups]), slots referenced during the burst
  num_free: jax.Array       # i32[] (or [groups]), free slots at the end
  carry: BurstCarry | None = None  # stays on the device (`Engine` chains bursts)


def chain_inputs(prev: BurstInputs, carry: BurstCarry, commit_ids,
                 commit_lens, release_ids) -> BurstInputs:
  """The inputs of the burst after one whose inputs were `prev` and whose
  end state is `carry` (device arrays: the host need not read them first).
  The batch is the same (nothing admitted in between), so the per-row
  sampling parameters and stop ids carry over; the rows to publish and
  release are the host's (those it has seen finish so far)."""
  return prev.replace(active=carry.active, last=carry.last,
                      computed=carry.computed, remaining=carry.remaining,
                      gen_index=carry.gen_index, commit_ids=commit_ids,
                      commit_lens=commit_lens, release_ids=release_ids)


def step_input_shapes(cfg: EngineConfig, num_tokens: int) -> StepInputs:
  """`jax.ShapeDtypeStruct`s of a step's inputs at bucket `num_tokens`."""
  S, A = cfg.max_seqs, cfg.num_admit
  i32, f32 = jnp.int32, jnp.float32
  sds = jax.ShapeDtypeStruct
  return StepInputs(
      tokens=sds((num_tokens,), i32), q_indptr=sds((S + 1,), i32),
      kv_lens=sds((S,), i32), sample_rows=sds((S,), jnp.bool_),
      temperature=sds((S,), f32), top_k=sds((S,), i32), top_p=sds((S,), f32),
      seeds=sds((S,), jnp.uint32), gen_index=sds((S,), i32),
      commit_ids=sds((S,), i32), commit_lens=sds((S,), i32),
      prompt_commit_ids=sds((S,), i32), release_ids=sds((S,), i32), extend_ids=sds((S,), i32),
      admit_ids=sds((A,), i32), admit_tokens=sds((A, cfg.max_model_len), i32),
      admit_lens=sds((A,), i32), admit_scope=sds((A,), i32))


def burst_input_shapes(cfg: EngineConfig) -> BurstInputs:
  """`jax.ShapeDtypeStruct`s of a burst's inputs."""
  S = cfg.max_seqs
  i32, f32 = jnp.int32, jnp.float32
  sds = jax.ShapeDtypeStruct
  return BurstInputs(
      active=sds((S,), jnp.bool_), last=sds((S,), i32),
      computed=sds((S,), i32), remaining=sds((S,), i32),
      stop_ids=sds((S, MAX_STOP_IDS), i32), temperature=sds((S,), f32),
      top_k=sds((S,), i32), top_p=sds((S,), f32), seeds=sds((S,), jnp.uint32),
      gen_index=sds((S,), i32), commit_ids=sds((S,), i32),
      commit_lens=sds((S,), i32), release_ids=sds((S,), i32))


def layer_tables(state, num_layers: int, max_seqs: int):
  """`i32[num_layers, max_seqs, 2, max_pages]`: each layer's split table.

  Vectorised over the layers (`cache.layer_page_tables`: one fused
  computation per slot space, not one per layer)."""
  del num_layers  # the cache config knows it
  return _cache.layer_page_tables(state, jnp.arange(max_seqs, dtype=jnp.int32))


def cache_ops_before(state, seq_tokens, inp: StepInputs | BurstInputs, *,
                     commit: bool):
  """A burst's cache ops before its decode iterations: `commit` of the
  finished rows the host publishes (static `commit=False` when prefix reuse
  is off) then `release`, both masked by `-1` ids. (A step runs them after
  its forward, in its one commit: `cache_ops_after`.)"""
  if commit:
    state = _cache.commit(state, inp.commit_ids,
                          finished_tokens(seq_tokens, inp), inp.commit_lens)
  return _cache.release(state, inp.release_ids)


def finished_tokens(seq_tokens, inp: StepInputs | BurstInputs):
  """`i32[max_seqs, max_model_len]`: the token rows of `inp.commit_ids` (the
  finished rows to publish), gathered before the cache program writes the
  admitted prompts (a burst's reservation writes none). The commit runs
  after the writes, and the program does not rely on the host never
  admitting a request into a row it releases in the same step (the
  scheduler frees released rows for the next step): an admission writes
  its prompt over the row. The model program's fed tokens never land in a
  finished row (a finished row feeds nothing)."""
  return seq_tokens[jnp.clip(inp.commit_ids, 0, seq_tokens.shape[0] - 1)]


def cache_ops_after(state, seq_tokens, inp: StepInputs, *, commit: bool,
                    finished=None):
  """A step's cache ops, after its forward: one `commit` (static
  `commit=False` when prefix reuse is off) of the prompts completed in this
  step (up to `kv_lens`) and of the finished rows the host publishes
  (`commit_ids`, their tokens `finished`: `finished_tokens`), `release` of
  the finished and preempted rows, `extend` by one token for rows that keep
  decoding, then `claim_batch` for the admitted requests (all masked by `-1`
  ids). One commit for both kinds: each commit is a few dozen small kernels
  of every step program (its scatters and sorts), and no row is both (a
  prompt that completes runs; a finished row does not). Releasing after the
  forward changes nothing for it (released rows feed nothing); the released
  slots are free for this step's `extend` and claims, as before. The prompt
  is published before `extend`: a per-window-group cache releases the
  sliding layers' old blocks there, and they must be published first to be
  reusable."""
  if commit:
    rows = jnp.clip(inp.prompt_commit_ids, 0, seq_tokens.shape[0] - 1)
    state = _cache.commit(
        state, jnp.concatenate([inp.prompt_commit_ids, inp.commit_ids]),
        jnp.concatenate([seq_tokens[rows], finished]),
        jnp.concatenate([inp.kv_lens[rows], inp.commit_lens]))
  state = _cache.release(state, inp.release_ids)
  ones = jnp.ones_like(inp.extend_ids)
  state, ext = _cache.extend(state, inp.extend_ids, ones)
  state, claim = _cache.claim_batch(state, inp.admit_ids, inp.admit_tokens,
                                    inp.admit_lens, inp.admit_scope)
  return state, ext, claim


def _forward(params, model_cfg, tokens, pool, plan, *, logits_indices, impl,
             mesh):
  if mesh is None:
    return _decoder.forward(params, model_cfg, tokens, pool, plan,
                            logits_indices=logits_indices, impl=impl)
  from pkvattn import parallel as _parallel  # only engines on a mesh need it
  return _parallel.tp_forward(params, model_cfg, tokens, pool, plan, mesh,
                              logits_indices=logits_indices, impl=impl)


def _sample_logits(logits, inp, gen_index, *, greedy_only: bool, mesh,
                   sample_cond: bool, impl):
  """`sampling.sample` of the rows' logits (`impl`: its kept-set floor's
  backend, the engine's `impl`). On a mesh the logits come vocab-sharded
  (`parallel.tp_forward`): greedy takes the per-shard argmax and gathers
  `(max, index)` only (`parallel.greedy_tokens`); otherwise the logits are
  gathered and every device samples its replicated copy under `shard_map`
  (the floor kernel, a custom call, never meets the SPMD partitioner). With
  `sample_cond` the `lax.cond` picks between the two, so an all-greedy call
  gathers no logits."""
  def sample(logits, temperature, top_k, top_p, seeds, gen_index, cond):
    return _sample(logits, temperature, top_k, top_p, seeds, gen_index,
                   greedy_only=greedy_only, cond=cond, impl=impl)
  args = (inp.temperature, inp.top_k, inp.top_p, inp.seeds, gen_index)
  if mesh is None:
    return sample(logits, *args, cond=sample_cond)
  from pkvattn import parallel as _parallel  # only engines on a mesh need it
  per_shard = logits.shape[-1] % _parallel.tp_size(mesh) == 0
  if greedy_only and per_shard:
    return _parallel.greedy_tokens(logits, mesh)

  def gathered(cond: bool):
    replicated = jax.sharding.PartitionSpec()
    return _parallel.shard_map(
        functools.partial(sample, cond=cond), mesh=mesh,
        in_specs=(replicated,) * 6, out_specs=replicated)(
            _parallel.gather_logits(logits, mesh), *args)
  if sample_cond and per_shard:
    return lax.cond(jnp.any(inp.temperature > 0),
                    lambda: gathered(cond=False),
                    lambda: _parallel.greedy_tokens(logits, mesh))
  return gathered(sample_cond)


def _write_fed(seq_tokens, inp: StepInputs, plan: AttentionPlan):
  """Records the step's fed tokens in the per-sequence token buffer."""
  rows = jnp.where(plan.batch_indices >= 0, plan.batch_indices,
                   seq_tokens.shape[0])
  return seq_tokens.at[rows, plan.positions].set(inp.tokens, mode="drop")


def _write_admitted(seq_tokens, inp: StepInputs):
  """Records the admitted prompts in the per-sequence token buffer."""
  admit_rows = jnp.where(inp.admit_ids >= 0, inp.admit_ids, seq_tokens.shape[0])
  return seq_tokens.at[admit_rows].set(inp.admit_tokens, mode="drop")


def device_step(params, pool, state, seq_tokens, inp: StepInputs, *,
                model_cfg: _decoder.DecoderConfig, cfg: EngineConfig,
                mesh=None):
  """A step's model program (`step[N tokens]`): the page tables of `state`,
  the forward over the fed tokens, sampling (under a `lax.cond`: module
  docstring), and the fed tokens recorded in `seq_tokens`. The state is
  read, not changed: the step's cache ops run next, in the program of no
  tokens (`device_step_cache`).

  Returns `(pool, state, seq_tokens, sampled)`, `sampled` `i32[max_seqs]`
  (-1 for rows that do not sample).
  """
  tables = layer_tables(state, model_cfg.num_layers, cfg.max_seqs)
  plan = AttentionPlan.create(tables, inp.q_indptr, inp.kv_lens,
                              inp.tokens.shape[0])
  last = jnp.maximum(inp.q_indptr[1:] - 1, 0)
  logits, pool = _forward(params, model_cfg, inp.tokens, pool, plan,
                          logits_indices=last, impl=cfg.impl, mesh=mesh)
  sampled = _sample_logits(logits, inp, inp.gen_index, greedy_only=False,
                           mesh=mesh, sample_cond=True, impl=cfg.impl)
  sampled = jnp.where(inp.sample_rows, sampled, -1)
  return pool, state, _write_fed(seq_tokens, inp, plan), sampled


def device_step_cache(params, pool, state, seq_tokens, inp: StepInputs, *,
                      cfg: EngineConfig):
  """A step's cache program (`step[no tokens]`): the admitted prompts
  recorded in `seq_tokens`, then `cache_ops_after`. Every step runs it, after
  its model program when it feeds tokens (`device_step`), alone when it
  only admits, publishes or releases.

  The cache ops live in one program of their own rather than in each token
  bucket's: they are about half of a step's distinct kernels, and compiled
  once instead of once per model program they shorten the engine's warmup
  (measured: docs/performance.md). The finished rows' tokens are read here,
  after the model program wrote its fed tokens: no row is both fed and
  published as finished (a finished row feeds nothing). `params` and `pool`
  pass through (the engine's programs share one signature).

  Returns `(pool, state, seq_tokens, StepOutputs)` (`sampled` all -1: the
  engine takes the model program's).
  """
  with jax.named_scope(CACHE_OPS_SCOPE):
    finished = (finished_tokens(seq_tokens, inp)
                if cfg.enable_prefix_reuse else None)
    seq_tokens = _write_admitted(seq_tokens, inp)
    state, ext, claim = cache_ops_after(state, seq_tokens, inp,
                                        commit=cfg.enable_prefix_reuse,
                                        finished=finished)
  del params
  usage = _cache.stats(state)
  out = StepOutputs(
      sampled=jnp.full(inp.sample_rows.shape, -1, jnp.int32),
      extend_ok=ext.ok, claim_ok=claim.ok,
      claim_reused=claim.num_reused_tokens,
      claim_new_blocks=claim.num_new_blocks,
      used_slots=usage["num_used"], num_free=usage["num_free"])
  return pool, state, seq_tokens, out


def release_only(cfg: EngineConfig, inp: StepInputs | BurstInputs
                 ) -> StepInputs:
  """A step of no tokens that only publishes and releases the finished
  rows of `inp` (a step's or a burst's host inputs: their `commit_*` and
  `release_ids`), run by the `step[no tokens]` program: zeros of
  `step_input_shapes`, no row to commit a prompt of, extend or admit (the
  cache program reads no sampling field)."""
  zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype),
                       step_input_shapes(cfg, 0))
  return zeros.replace(
      commit_ids=np.asarray(inp.commit_ids),
      commit_lens=np.asarray(inp.commit_lens),
      release_ids=np.asarray(inp.release_ids),
      prompt_commit_ids=np.full(cfg.max_seqs, -1, np.int32),
      extend_ids=np.full(cfg.max_seqs, -1, np.int32),
      admit_ids=np.full(cfg.num_admit, -1, np.int32))


def without_release(inp: StepInputs | BurstInputs):
  """`inp` with no row to publish or release (`release_only` did it)."""
  S = inp.release_ids.shape[0]
  return inp.replace(commit_ids=np.full(S, -1, np.int32),
                     commit_lens=np.zeros(S, np.int32),
                     release_ids=np.full(S, -1, np.int32))


def step_cache_inputs(inp: StepInputs) -> StepInputs:
  """A step's inputs as its cache program takes them: without the fed tokens
  (one `step[no tokens]` program serves every token bucket)."""
  if not inp.tokens.shape[0]:
    return inp
  return inp.replace(tokens=np.zeros((0,), np.int32))


def reserve_burst(state, seq_tokens, inp: BurstInputs, *, decode_steps: int,
                  commit: bool):
  """A burst's cache work, done once up front: the rows that finished before
  it are published and released (`cache_ops_before`), then
  one `extend` reserves every active row's tokens for the burst
  (`min(decode_steps, remaining - 1)` beyond the fed one), with no
  `lax.cond`. Returns the state; a row's reserved tokens are its
  `seq_lens`."""
  state = cache_ops_before(state, seq_tokens, inp, commit=commit)
  rows = jnp.arange(inp.active.shape[0], dtype=jnp.int32)
  grow = jnp.clip(inp.remaining - 1, 0, decode_steps)
  # The fed token's position is reserved but not computed: the burst's first
  # query is at `computed` (a per-window-group cache releases the sliding
  # layers' blocks out of its reach). The eviction order is sorted on every
  # call (`evict="branchless"`), not under a `lax.cond`: its predicate would
  # make the host wait for the burst in flight before dispatching the next
  # one's programs.
  state, _ = _cache.extend(state, jnp.where(inp.active, rows, -1),
                           jnp.where(inp.active, grow, 0),
                           num_computed=inp.computed, evict="branchless")
  return state


def device_burst_reserve(params, pool, state, seq_tokens, inp: BurstInputs,
                         *, cfg: EngineConfig):
  """A burst's cache program (`reserve`): `reserve_burst`, run before every
  burst program of any row bucket (one program for all: the cache ops see
  every row). Kept apart from the burst programs for the reason the step's
  cache ops are (`device_step_cache`). `params` and `pool` pass through.

  Returns `(pool, state, seq_tokens, ())`."""
  del params
  with jax.named_scope(CACHE_OPS_SCOPE):
    state = reserve_burst(state, seq_tokens, inp,
                          decode_steps=cfg.decode_steps,
                          commit=cfg.enable_prefix_reuse)
  return pool, state, seq_tokens, ()


def device_decode_burst(params, pool, state, seq_tokens, inp: BurstInputs, *,
                        model_cfg: _decoder.DecoderConfig,
                        cfg: EngineConfig, mesh=None,
                        greedy_only: bool = False, rows: int | None = None,
                        sample_cond: bool = True):
  """A burst's model program (`burst[R tokens, ...]`): `cfg.decode_steps`
  decode iterations, each `device_step` restricted to decode rows, with the
  sampled token fed back on device. The state is read, not changed.

  The cache work is done once, up front, by the burst's cache program
  (`device_burst_reserve`, vLLM's multi-step lookahead slots): rows that
  finished before the burst are published and released (so a burst follows
  a burst while requests finish one after the other), then one `extend`
  reserves every row's tokens for the whole burst (`min(decode_steps,
  remaining - 1)` beyond the fed one), and here one set of page tables of
  `state` serves every iteration. A row whose reservation was refused (out
  of slots; all-or-nothing, first come first served) keeps what it had: it
  runs while its next token has a reserved position, then stops with
  `preempted=True` (the host recomputes it later).

  `greedy_only` (static, chosen by the host): all rows greedy, so the
  decode iterations hold no `lax.cond` (no device-to-host sync).

  `rows` (static, one of `cfg.burst_buckets`; None = `max_seqs`): the
  iterations run the model over the first `rows` rows only, so a few
  requests do not pay for `max_seqs` rows of matmuls (at Llama-3.2-1B's
  shape a 256-row decode step is compute-bound, a 64-row one reads the
  weights at the same cost as one row). The host picks the smallest bucket
  above every active row (`Scheduler.burst_rows`); rows from `rows` on
  must be inactive and come out as they went in (tokens -1). The inputs,
  outputs and cache work keep their `max_seqs` rows, so bursts of any
  bucket chain into each other.
  """
  S, k = cfg.max_seqs, cfg.decode_steps
  R = S if rows is None else rows
  if not 0 < R <= S:
    raise ValueError(f"Invalid rows: expected an int in [1, {S}], got {rows!r}")
  with jax.named_scope(CACHE_OPS_SCOPE):
    tables = layer_tables(state, model_cfg.num_layers, R)
    usage = _cache.stats(state)
  reserved = state.seq_lens[:R]  # tokens with a slot, per row
  # The iterations see the first R rows (`rows`); the rest pass through.
  head = lambda x: x[:R]
  sub = inp.replace(**{f: head(getattr(inp, f)) for f in (
      "active", "last", "computed", "remaining", "stop_ids", "temperature",
      "top_k", "top_p", "seeds", "gen_index")})
  row_ids = jnp.arange(R, dtype=jnp.int32)

  def one(carry, _):
    pool, seq_tokens, active, last, computed, remaining, gen, pre = carry
    q_lens = active.astype(jnp.int32)
    q_indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens)])
    tokens = jnp.zeros((R,), jnp.int32).at[
        jnp.where(active, q_indptr[:-1], R)].set(last, mode="drop")
    kv_lens = jnp.where(active, computed + 1, 0)
    plan = AttentionPlan.create(tables, q_indptr, kv_lens, R)
    logits, pool = _forward(
        params, model_cfg, tokens, pool, plan,
        logits_indices=jnp.maximum(q_indptr[1:] - 1, 0), impl=cfg.impl,
        mesh=mesh)
    tok = _sample_logits(logits, sub, gen, greedy_only=greedy_only,
                         mesh=mesh, sample_cond=sample_cond, impl=cfg.impl)
    seq_tokens = seq_tokens.at[jnp.where(active, row_ids, S), computed].set(
        last, mode="drop")
    step = active.astype(jnp.int32)
    computed, gen, remaining = computed + step, gen + step, remaining - step
    stop = jnp.any(tok[:, None] == sub.stop_ids, axis=1) | (remaining <= 0)
    need = active & ~stop
    fits = computed + 1 <= reserved  # the next fed token has its slot
    pre = pre | (need & ~fits)
    emitted = jnp.where(active, tok, -1)
    last = jnp.where(active, tok, last)
    return (pool, seq_tokens, need & fits, last, computed, remaining, gen,
            pre), emitted

  carry = (pool, seq_tokens, sub.active, sub.last, sub.computed,
           sub.remaining, sub.gen_index, jnp.zeros((R,), bool))
  carry, emitted = lax.scan(one, carry, None, length=k)
  pool, seq_tokens, active, last, computed, remaining, gen, pre = carry
  if R < S:  # rows R.. as they came in: inactive, no tokens
    tail = lambda x, y: jnp.concatenate([x, y[R:]])
    active, last, computed, remaining, gen = (
        tail(active, inp.active), tail(last, inp.last),
        tail(computed, inp.computed), tail(remaining, inp.remaining),
        tail(gen, inp.gen_index))
    pre = jnp.concatenate([pre, jnp.zeros((S - R,), bool)])
    emitted = jnp.concatenate(
        [emitted, jnp.full((k, S - R), -1, jnp.int32)], axis=1)
  return pool, state, seq_tokens, BurstOutputs(
      emitted, pre, usage["num_used"], usage["num_free"],
      BurstCarry(active, last, computed, remaining, gen))


def compiler_options() -> dict:
  """XLA debug options of every engine program, set per compilation (the
  process's `XLA_FLAGS` and other programs are left alone).

  On a GPU:

  * `xla_gpu_enable_triton_gemm=False`, the projections as cuBLAS gemms. At
    decode batch sizes XLA's autotuner picks split-K Triton gemm fusions
    whose partial sums then need a separate reduction kernel (the autotuner
    times the gemm alone), which makes the decode step slower than cuBLAS
    (measured: docs/performance.md).
  * `xla_gpu_autotune_level=0`: cuBLAS's own heuristics pick each gemm's
    algorithm, with no timing of candidates on the device while compiling
    (the programs compile at once on one GPU). The SmolLM2-shaped
    warmup is shorter, and the decode step and throughput are unchanged at
    the SmolLM2 and Llama-3.2-1B shapes (measured: docs/performance.md).
  * `xla_gpu_enable_command_buffer`: XLA's default command types plus
    `WHILE`, so a decode burst's `lax.scan` over its steps replays as one
    CUDA graph with a conditional node for the loop instead of launching
    every kernel of every step from the host (vLLM captures its decode step
    as a CUDA graph for the same reason). `CONDITIONAL` stays off: as graph
    nodes the programs' `lax.cond`s made a burst iteration timed alone
    slower, while serving throughput moved within its run-to-run spread
    (measured: docs/performance.md).

  Elsewhere none.
  """
  if jax.default_backend() != "gpu":
    return {}
  return {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0,
          "xla_gpu_enable_command_buffer": ",".join(_COMMAND_BUFFER_TYPES)}


# XLA's default command buffer types (`DebugOptions`) and WHILE.
_COMMAND_BUFFER_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN",
                         "DYNAMIC_SLICE_FUSION", "WHILE")


@functools.lru_cache(maxsize=64)
def jitted_program(model_cfg: _decoder.DecoderConfig, cfg: EngineConfig,
                   mesh, kind: str, greedy_only: bool,
                   rows: int | None = None, sample_cond: bool = True):
  """The `jax.jit` of one program kind (shared by engines with one config):
  "step" (`device_step`), "step_cache" (`device_step_cache`), "reserve"
  (`device_burst_reserve`) or "burst" (`device_decode_burst`). The pool, the
  cache state and the token buffer are donated. `rows`: a burst's row
  bucket (None = `max_seqs`); `greedy_only`, `sample_cond`: a burst's
  variant and its sampler's `lax.cond` (False where the variants are split:
  the host runs the sampled one only when some row samples). With
  `cfg.check` the program is functionalized by `checkify` (it returns
  `(error, outputs)`) and must be traced inside `pkvattn.checked()`."""
  if kind == "step":
    body = functools.partial(device_step, model_cfg=model_cfg, cfg=cfg,
                             mesh=mesh)
  elif kind == "step_cache":
    body = functools.partial(device_step_cache, cfg=cfg)
  elif kind == "reserve":
    body = functools.partial(device_burst_reserve, cfg=cfg)
  elif kind == "burst":
    body = functools.partial(device_decode_burst, model_cfg=model_cfg,
                             cfg=cfg, mesh=mesh, greedy_only=greedy_only,
                             rows=rows, sample_cond=sample_cond)
  else:
    raise ValueError("Invalid kind: expected 'step', 'step_cache', 'reserve' "
                     f"or 'burst', got {kind!r}")
  if cfg.check:  # returns (checkify.Error, outputs); trace under checked()
    body = checkify.checkify(body)
  return jax.jit(body, donate_argnums=(1, 2, 3),
                 compiler_options=compiler_options() or None)
