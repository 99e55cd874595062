"""A continuous-batching generation engine over the paged pool and the functional cache.

Each `step()`:

1. **Host scheduling** (plain Python over a few dozen requests): every running
   request gets a row of the step's ragged batch: decode rows feed their last
   sampled token (1 token), prefill rows feed the next chunk of their prompt
   under a static token budget (`max_num_tokens`, chunked prefill), all in ONE
   mixed batch. Waiting requests are admitted while rows are free.
2. **One jitted device step** (`_device_step`; the pool, the cache state and
   the token buffer are donated and carried through):
   `commit` (publish the full blocks of prompts finished last step, and of
   sequences ending) → `release` (finished / preempted) → per-layer page tables
   → model forward (every layer runs `paged_prefill` on the mixed batch) →
   sampling (greedy / temperature / top-k / top-p, seeded per request) →
   `extend` by one token for rows that keep decoding (reserving the slot the
   next token needs) → `claim_batch` for the admitted requests (prefix reuse,
   two-phase). Admitted requests start their prefill in the next step, from
   `num_reused_tokens`.
3. **Host bookkeeping** of the results (one device→host transfer per step):
   append sampled tokens, stop on EOS / `max_new_tokens`, and when the pool is
   full (an `extend` or a claim refused) the request waits, or is preempted
   and later recomputed from its prompt + generated tokens (vLLM's recompute
   preemption), never failed.

Multi-step decode (`EngineConfig.decode_steps > 1`): when every running request
is decoding and nothing waits for a free row, `decode_steps` decode iterations
run in one device call (`lax.scan`, sampled tokens fed back on device, stop
tokens / max lengths checked on device; one `extend` up front reserves the
burst's tokens and one set of page tables serves it), amortising the host work.

Shapes are static: the step is padded to a token bucket (`token_buckets`,
default `(max_seqs, max_num_tokens)`: decode-only steps use the small one), so
the step compiles once per bucket and never retraces on batch contents. What
the host knows is static too (`_StepOps`: which of commit / release / claim
run, greedy-only sampling, whether eviction can be needed), so no compiled
step or burst holds a `lax.cond` (a device-to-host sync on GPU); each variant
seen compiles once per bucket. With
SWA scratch reuse active (issue 5's cache; all-SWA models) a prompt is
prefilled in one step, because scratch blocks live for one step only.

Row `r` of the batch is always sequence id `r` of the cache, so the page tables
are the cache's tables for `seq_ids = arange(max_seqs)`, rows without tokens
this step simply have `q_len = 0`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from pkvattn import _checks
from pkvattn import attention as _attention
from pkvattn import cache as _cache
from pkvattn.flax import AttentionPlan
from pkvattn.models import Model
from pkvattn.models import decoder as _decoder
from pkvattn.sampling import SamplingParams
from pkvattn.sampling import sample as _sample
from pkvattn.types import Implementation

__all__ = ["Engine", "EngineConfig", "Request", "SamplingParams"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static sizes of the engine (one jit compile per config).

  Attributes:
    page_size: tokens per KV block.
    num_slots: slots in the pool (a slot = one block of every layer, K and V).
    max_seqs: rows of the step batch = sequences running at once.
    max_num_tokens: token budget of one step (the static `num_tokens`); decode
      rows take one token each, prefill chunks share the rest. `>= max_seqs`.
    max_model_len: prompt + generated tokens of one request at most.
    max_admit: claims per step; None = `max_seqs`.
    enable_prefix_reuse: publish full blocks (`commit`) so later prompts with
      the same prefix reuse them.
    enable_swa_scratch_reuse: passed to the cache (issue 5) for models with
      sliding-window layers; scratch blocks are handled by `claim_batch` /
      `extend` and `page_table`. Where scratch is active (all layers SWA) the
      engine prefills a prompt in one step, so `len(prompt) + max_new_tokens`
      must fit `max_num_tokens`.
    impl: attention / rope implementation ("pallas", "xla", None = auto).
    hash_ways: prefix-cache hash-table associativity.
    token_buckets: padded step sizes; a step runs at the smallest bucket that
      holds its tokens (one compile per bucket, like CUDA-graph capture sizes).
      None = `(max_seqs, max_num_tokens)`: decode-only steps stop paying for
      the prefill budget.
    decode_steps: when every running request is decoding and nothing waits
      for a free row, run this many decode iterations in one device call
      (`lax.scan`: tokens fed back, stop tokens, max lengths and `extend`
      checked on device; vLLM's multi-step scheduling). 1 = off. Amortises
      the host's per-step work; a request finishing mid-burst frees its row
      only at the end of the burst.
    scan_layers: run the layers under `lax.scan` over stacked weights (True)
      or as an unrolled loop over per-layer weights (False: the engine keeps
      `pkvattn.models.unstack_layers(params)`, MaxText's `scan_layers`).
      None = False on GPU, where a scanned layer copies each weight slice
      before its matmul every step (`pkvattn.models.decoder`), True elsewhere
      (faster compiles).
  """
  page_size: int = 16
  num_slots: int = 256
  max_seqs: int = 8
  max_num_tokens: int = 256
  max_model_len: int = 1024
  max_admit: int | None = None
  enable_prefix_reuse: bool = True
  enable_swa_scratch_reuse: bool = False
  impl: Implementation | None = None
  hash_ways: int = 8
  token_buckets: tuple[int, ...] | None = None
  decode_steps: int = 1
  scan_layers: bool | None = None

  def __post_init__(self):
    for name in ("page_size", "num_slots", "max_seqs", "max_num_tokens",
                 "max_model_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"Invalid {name}: expected a positive int, got {value!r}")
    if self.max_num_tokens < self.max_seqs:
      raise ValueError(
          f"Invalid max_num_tokens: expected >= max_seqs={self.max_seqs}, got "
          f"{self.max_num_tokens}")
    if self.impl is not None:
      _checks.check_choice(self.impl, ("pallas", "xla"), "impl")
    if not isinstance(self.decode_steps, int) or self.decode_steps < 1:
      raise ValueError(
          f"Invalid decode_steps: expected an int >= 1, got {self.decode_steps!r}")
    if self.token_buckets is not None and any(
        int(b) <= 0 for b in self.token_buckets):
      raise ValueError(
          f"Invalid token_buckets: expected positive sizes, got "
          f"{self.token_buckets}")

  @property
  def buckets(self) -> tuple[int, ...]:
    """Sorted step sizes, the last one `max_num_tokens`."""
    sizes = self.token_buckets or (self.max_seqs,)
    return tuple(sorted({min(int(b), self.max_num_tokens) for b in sizes}
                        | {self.max_num_tokens}))

  @property
  def max_pages(self) -> int:
    return -(-self.max_model_len // self.page_size)

  @property
  def num_admit(self) -> int:
    return self.max_admit or self.max_seqs


@dataclasses.dataclass
class Request:
  """A generation request and its progress (host side)."""
  request_id: int
  prompt: list[int]
  params: SamplingParams
  stop_ids: frozenset
  output: list[int] = dataclasses.field(default_factory=list)
  status: str = "waiting"        # waiting | prefill | decode | finished
  seq_id: int = -1
  num_computed: int = 0          # tokens whose KV is in the cache
  num_reused: int = 0            # prompt tokens served by the prefix cache
  finish_reason: str | None = None
  num_preemptions: int = 0
  first_token_step: int | None = None
  reuse_scope: int = 0           # prefix-cache scope (tenant / adapter salt)

  @property
  def tokens(self) -> list[int]:
    """What the cache must hold before the next sample: prompt + generated."""
    return self.prompt + self.output

  @property
  def done(self) -> bool:
    return self.status == "finished"


@struct.dataclass
class _StepInputs:
  tokens: jax.Array         # i32[num_tokens], num_tokens one of cfg.buckets
  q_indptr: jax.Array       # i32[max_seqs + 1]
  kv_lens: jax.Array        # i32[max_seqs]
  sample_rows: jax.Array    # bool[max_seqs]
  temperature: jax.Array    # f32[max_seqs]
  top_k: jax.Array          # i32[max_seqs]
  top_p: jax.Array          # f32[max_seqs]
  seeds: jax.Array          # u32[max_seqs]
  gen_index: jax.Array      # i32[max_seqs]
  commit_ids: jax.Array     # i32[max_seqs], -1 = none
  commit_lens: jax.Array    # i32[max_seqs]
  release_ids: jax.Array    # i32[max_seqs], -1 = none
  extend_ids: jax.Array     # i32[max_seqs], -1 = none
  admit_ids: jax.Array      # i32[num_admit], -1 = none
  admit_tokens: jax.Array   # i32[num_admit, max_model_len]
  admit_lens: jax.Array     # i32[num_admit]
  admit_scope: jax.Array    # i32[num_admit], prefix-reuse scope (tenant salt)


@struct.dataclass
class _StepOutputs:
  sampled: jax.Array        # i32[max_seqs]
  extend_ok: jax.Array      # bool[max_seqs]
  claim_ok: jax.Array       # bool[num_admit]
  claim_reused: jax.Array   # i32[num_admit]
  claim_new_blocks: jax.Array  # i32[num_admit], slots taken (scratch: fewer)
  used_slots: jax.Array     # i32[], slots referenced by live sequences
  num_free: jax.Array       # i32[], free slots (unreferenced, not cached)


# Name scope of the cache bookkeeping inside the jitted step and burst (shows
# in profiler traces and HLO metadata).
CACHE_OPS_SCOPE = "pkvattn_cache_ops"


def _layer_tables(state, num_layers: int, max_seqs: int):
  """`i32[num_layers, max_seqs, 2, max_pages]`: each layer's split table.

  Vectorised over the layers (one fused computation, not one per layer)."""
  seq_ids = jnp.arange(max_seqs, dtype=jnp.int32)
  return jax.vmap(lambda layer: _cache.page_table(state, seq_ids, layer,
                                                  split=True))(
      jnp.arange(num_layers, dtype=jnp.int32))


@dataclasses.dataclass(frozen=True)
class _StepOps:
  """Which cache ops a step runs (static: known on the host, so the compiled
  step holds no `lax.cond`, each of which costs a device-to-host sync on GPU).
  Most steps commit, release and admit nothing; each combination seen
  compiles once per token bucket."""
  commit: bool = False
  release: bool = False
  admit: bool = False
  greedy_only: bool = True
  evict: bool = True   # False: the free slots cover extend + claim


def _cache_ops_before(state, seq_tokens, inp: _StepInputs, ops: _StepOps):
  if ops.commit:
    # commit reads tokens[i] for seq_ids[i]: gather each committed row.
    rows = jnp.clip(inp.commit_ids, 0, seq_tokens.shape[0] - 1)
    state = _cache.commit(state, inp.commit_ids, seq_tokens[rows],
                          inp.commit_lens)
  if ops.release:
    state = _cache.release(state, inp.release_ids)
  return state


def _cache_ops_after(state, inp: _StepInputs, ops: _StepOps):
  ones = jnp.ones_like(inp.extend_ids)
  state, ext = _cache.extend(state, inp.extend_ids, ones, evict=ops.evict)
  if ops.admit:
    state, claim = _cache.claim_batch(state, inp.admit_ids, inp.admit_tokens,
                                      inp.admit_lens, inp.admit_scope,
                                      evict=ops.evict)
  else:
    claim = _no_claim(inp)
  return state, ext, claim


def _copy_tree(tree):
  """Fresh device copies of every array of `tree` (for donating calls)."""
  return jax.tree.map(jnp.copy, tree)


def _no_claim(inp: _StepInputs):
  """The ClaimResult of a step that admits nothing (all refused, zeros)."""
  zeros = jnp.zeros(inp.admit_ids.shape, jnp.int32)
  return _cache.ClaimResult(zeros.astype(bool), zeros, zeros, zeros)


def _write_tokens(seq_tokens, inp: _StepInputs, plan: AttentionPlan):
  """Records fed tokens and admitted prompts in the per-sequence token buffer."""
  rows = jnp.where(plan.batch_indices >= 0, plan.batch_indices,
                   seq_tokens.shape[0])
  seq_tokens = seq_tokens.at[rows, plan.positions].set(inp.tokens, mode="drop")
  admit_rows = jnp.where(inp.admit_ids >= 0, inp.admit_ids, seq_tokens.shape[0])
  return seq_tokens.at[admit_rows].set(inp.admit_tokens, mode="drop")


def _device_step(params, pool, state, seq_tokens, inp: _StepInputs,
                 tables=None, *, model_cfg: _decoder.DecoderConfig,
                 cfg: EngineConfig, mesh=None, ops: _StepOps = _StepOps()):
  """One engine step. `tables` given (profiling only): the cache ops are
  skipped and these page tables used."""
  bookkeeping = tables is None
  if bookkeeping:
    with jax.named_scope(CACHE_OPS_SCOPE):
      state = _cache_ops_before(state, seq_tokens, inp, ops)
      tables = _layer_tables(state, model_cfg.num_layers, cfg.max_seqs)
  plan = AttentionPlan.create(tables, inp.q_indptr, inp.kv_lens,
                              inp.tokens.shape[0])
  last = jnp.maximum(inp.q_indptr[1:] - 1, 0)
  logits, pool = _decoder.forward(params, model_cfg, inp.tokens, pool, plan,
                                  logits_indices=last, impl=cfg.impl,
                                  mesh=mesh)
  sampled = _sample(logits, inp.temperature, inp.top_k, inp.top_p, inp.seeds,
                    inp.gen_index, greedy_only=ops.greedy_only)
  sampled = jnp.where(inp.sample_rows, sampled, -1)
  seq_tokens = _write_tokens(seq_tokens, inp, plan)
  if bookkeeping:
    with jax.named_scope(CACHE_OPS_SCOPE):
      state, ext, claim = _cache_ops_after(state, inp, ops)
  else:
    ext = _cache.ExtendResult(jnp.ones(inp.extend_ids.shape, bool),
                              jnp.zeros(inp.extend_ids.shape, jnp.int32))
    claim = _no_claim(inp)
  usage = _cache.stats(state)
  out = _StepOutputs(
      sampled=sampled, extend_ok=ext.ok, claim_ok=claim.ok,
      claim_reused=claim.num_reused_tokens,
      claim_new_blocks=claim.num_new_blocks,
      used_slots=usage["num_used"], num_free=usage["num_free"])
  return pool, state, seq_tokens, out


@functools.lru_cache(maxsize=32)
def _jitted_step(model_cfg: _decoder.DecoderConfig, cfg: EngineConfig,
                 mesh=None, ops: _StepOps = _StepOps()):
  """One jitted step per (model config, engine config, mesh, ops), shared by
  engines.

  It compiles once per token bucket (the only shape that varies)."""
  return jax.jit(
      functools.partial(_device_step, model_cfg=model_cfg, cfg=cfg, mesh=mesh,
                        ops=ops),
      donate_argnums=(1, 2, 3))


MAX_STOP_IDS = 8  # stop tokens per request handled on device in a burst


@struct.dataclass
class _BurstInputs:
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


@struct.dataclass
class _BurstOutputs:
  tokens: jax.Array         # i32[decode_steps, max_seqs], -1 = row idle
  preempted: jax.Array      # bool[max_seqs], extend refused: out of slots
  used_slots: jax.Array     # i32[], slots referenced during the burst
  num_free: jax.Array       # i32[], free slots at the end


def _reserve_burst(state, inp: _BurstInputs, *, num_layers: int,
                   decode_steps: int, evict: bool):
  """A burst's cache work, done once up front: one `extend` reserves every
  active row's tokens for the burst (`min(decode_steps, remaining - 1)`
  beyond the fed one) and the page tables are built once. Returns
  `(state, tables, ok)`."""
  rows = jnp.arange(inp.active.shape[0], dtype=jnp.int32)
  grow = jnp.clip(inp.remaining - 1, 0, decode_steps)
  state, ext = _cache.extend(state, jnp.where(inp.active, rows, -1),
                             jnp.where(inp.active, grow, 0), evict=evict)
  return (state, _layer_tables(state, num_layers, rows.shape[0]), ext.ok)


def _device_decode_burst(params, pool, state, seq_tokens, inp: _BurstInputs,
                         tables=None, *, model_cfg: _decoder.DecoderConfig,
                         cfg: EngineConfig, mesh=None,
                         greedy_only: bool = False, evict: bool = True):
  """`cfg.decode_steps` decode iterations; each is `_device_step` restricted to
  decode rows, with the sampled token fed back on device.

  The cache work is done once, up front (vLLM's multi-step lookahead slots):
  one `extend` reserves every row's tokens for the whole burst
  (`min(decode_steps, remaining - 1)` beyond the fed one) and one set of page
  tables serves every iteration. A row whose reservation is refused (out of
  slots; all-or-nothing, first come first served) keeps what it had: it runs
  while its next token has a reserved position, then stops with
  `preempted=True` (the host recomputes it later).

  `greedy_only` / `evict` (static, chosen by the host): all rows greedy / the
  free slots may not cover the burst. With both False the burst has no
  `lax.cond` (no device-to-host sync). `tables` given (profiling only): no
  cache op runs and these page tables (which must cover the burst) are used.
  """
  S, k = cfg.max_seqs, cfg.decode_steps
  rows = jnp.arange(S, dtype=jnp.int32)
  if tables is None:
    with jax.named_scope(CACHE_OPS_SCOPE):
      state, tables, _ = _reserve_burst(
          state, inp, num_layers=model_cfg.num_layers, decode_steps=k,
          evict=evict)
      reserved = state.seq_lens  # tokens with a slot, per row
  else:
    reserved = jnp.full((S,), jnp.iinfo(jnp.int32).max, jnp.int32)
  usage = _cache.stats(state)  # the state is not touched again in the burst

  def one(carry, _):
    pool, seq_tokens, active, last, computed, remaining, gen, pre = carry
    q_lens = active.astype(jnp.int32)
    q_indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens)])
    tokens = jnp.zeros((S,), jnp.int32).at[
        jnp.where(active, q_indptr[:-1], S)].set(last, mode="drop")
    kv_lens = jnp.where(active, computed + 1, 0)
    plan = AttentionPlan.create(tables, q_indptr, kv_lens, S)
    logits, pool = _decoder.forward(
        params, model_cfg, tokens, pool, plan,
        logits_indices=jnp.maximum(q_indptr[1:] - 1, 0), impl=cfg.impl,
        mesh=mesh)
    tok = _sample(logits, inp.temperature, inp.top_k, inp.top_p, inp.seeds, gen,
                  greedy_only=greedy_only)
    seq_tokens = seq_tokens.at[jnp.where(active, rows, S), computed].set(
        last, mode="drop")
    step = active.astype(jnp.int32)
    computed, gen, remaining = computed + step, gen + step, remaining - step
    stop = jnp.any(tok[:, None] == inp.stop_ids, axis=1) | (remaining <= 0)
    need = active & ~stop
    fits = computed + 1 <= reserved  # the next fed token has its slot
    pre = pre | (need & ~fits)
    emitted = jnp.where(active, tok, -1)
    last = jnp.where(active, tok, last)
    return (pool, seq_tokens, need & fits, last, computed, remaining, gen,
            pre), emitted

  carry = (pool, seq_tokens, inp.active, inp.last, inp.computed,
           inp.remaining, inp.gen_index, jnp.zeros((S,), bool))
  carry, emitted = lax.scan(one, carry, None, length=k)
  pool, seq_tokens = carry[:2]
  return pool, state, seq_tokens, _BurstOutputs(
      emitted, carry[7], usage["num_used"], usage["num_free"])


@functools.lru_cache(maxsize=32)
def _jitted_burst(model_cfg: _decoder.DecoderConfig, cfg: EngineConfig,
                  mesh=None, greedy_only: bool = False, evict: bool = True):
  return jax.jit(
      functools.partial(_device_decode_burst, model_cfg=model_cfg, cfg=cfg,
                        mesh=mesh, greedy_only=greedy_only, evict=evict),
      donate_argnums=(1, 2, 3))


@dataclasses.dataclass
class EngineStats:
  """Counters of one engine's life (host side)."""
  num_steps: int = 0
  prompt_tokens: int = 0        # prompt tokens of admitted claims
  reused_tokens: int = 0        # of those, served by the prefix cache
  prefill_tokens: int = 0       # prompt tokens computed
  decode_tokens: int = 0        # tokens fed as decode rows
  generated_tokens: int = 0     # tokens sampled
  prefill_time_s: float = 0.0   # wall time of steps that carried prefill tokens
  decode_time_s: float = 0.0    # wall time of decode-only steps
  host_time_s: float = 0.0      # host scheduling + result handling
  compile_time_s: float = 0.0   # first step per bucket (trace + compile + run)
  peak_used_slots: int = 0
  # Slot allocations that SWA scratch reuse avoided at admission (new blocks
  # of the prompts minus slots taken); None when scratch is not active.
  slots_saved_by_scratch: int | None = None
  num_preemptions: int = 0
  num_refused_claims: int = 0

  @property
  def prefix_hit_rate(self) -> float:
    return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

  @property
  def prefill_tokens_per_s(self) -> float:
    return self.prefill_tokens / self.prefill_time_s if self.prefill_time_s else 0.0

  @property
  def decode_tokens_per_s(self) -> float:
    return self.decode_tokens / self.decode_time_s if self.decode_time_s else 0.0

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(prefix_hit_rate=self.prefix_hit_rate,
             prefill_tokens_per_s=self.prefill_tokens_per_s,
             decode_tokens_per_s=self.decode_tokens_per_s)
    return d


class Engine:
  """Continuous-batching generation with paged attention and prefix reuse.

  Example:
    >>> from pkvattn.models import load_model
    >>> engine = Engine(load_model("tiny-llama"), EngineConfig(page_size=8))
    >>> outs = engine.generate([[256, 72, 105]], SamplingParams(max_new_tokens=4))
    >>> len(outs[0])
    4

  Tensor parallel (`pkvattn.parallel`): pass `mesh=pkvattn.parallel.make_mesh(2)`
  (a mesh with a "tp" axis). The model is laid out by
  `pkvattn.parallel.shard_model` (heads / MLP columns sliced, kv heads
  replicated when tp > num_kv_heads; `engine.model` is the sharded model),
  the pool is sharded on its kv-head axis, and the cache state, token buffer
  and step inputs are replicated; each step's forward runs under one
  `shard_map`.
  """

  def __init__(self, model: Model, config: EngineConfig = EngineConfig(),
               *, pool_dtype=None, mesh: jax.sharding.Mesh | None = None):
    """Raises ValueError: the model's heads do not split over `mesh` ("tp")."""
    self.mesh = mesh
    if mesh is not None:
      from pkvattn import parallel as _parallel  # parallel imports models
      model = _parallel.shard_model(model, mesh)
    scan = config.scan_layers
    if scan is None:
      scan = not _checks.is_gpu()
    if not scan:
      params = _decoder.unstack_layers(model.params)
      if mesh is not None:
        params = jax.device_put(params, jax.tree.map(
            lambda s: jax.sharding.NamedSharding(mesh, s),
            _parallel.param_specs(params)))
      model = dataclasses.replace(model, params=params)
    self.model = model
    self.config = config
    mcfg = model.cfg
    self.cache_config = _cache.CacheConfig(
        num_slots=config.num_slots, page_size=config.page_size,
        num_layers=mcfg.num_layers, max_seqs=config.max_seqs,
        max_pages=config.max_pages, hash_ways=config.hash_ways,
        layer_windows=tuple(mcfg.windows),
        enable_swa_scratch_reuse=bool(
            config.enable_swa_scratch_reuse and mcfg.has_sliding_window))
    dtype = pool_dtype or jax.tree.leaves(model.params)[0].dtype
    pool_shape = mcfg.pool_shape(config.num_slots, config.page_size)
    self.state = _cache.init_cache(self.cache_config)
    self.seq_tokens = jnp.zeros((config.max_seqs, config.max_model_len),
                                jnp.int32)
    self._inputs_sharding = None
    if mesh is None:
      self.pool = jnp.zeros(pool_shape, dtype)
    else:
      # Allocated sharded: no device ever holds the whole pool.
      self.pool = jax.jit(lambda: jnp.zeros(pool_shape, dtype),
                          out_shardings=_parallel.pool_sharding(mesh))()
      self._inputs_sharding = _parallel.replicated(mesh)
      self.state, self.seq_tokens = jax.device_put(
          (self.state, self.seq_tokens), self._inputs_sharding)
    # Scratch blocks live for one step: with scratch active (all-SWA models
    # in issue 5's cache) a prompt must be prefilled in one step.
    self._scratch = bool(getattr(self.cache_config, "swa_scratch_active",
                                 self.cache_config.enable_swa_scratch_reuse))
    self._num_free = config.num_slots  # free slots, from the last step
    # Jitted programs by static variant: `_StepOps` for a step,
    # (greedy_only, evict) for a decode burst.
    self._step_fns = functools.partial(_jitted_step, mcfg, config, mesh)
    self._burst_fns = functools.partial(_jitted_burst, mcfg, config, mesh)
    self._ops = _StepOps()  # variant of the last step

    self._requests: dict[int, Request] = {}
    self._waiting: collections.deque[Request] = collections.deque()
    self._running: list[Request] = []       # admitted, in admission order
    self._free_rows = list(range(config.max_seqs))
    self._to_release: list[tuple[int, int]] = []   # (row, committed len)
    self._to_commit: list[tuple[int, int]] = []    # (row, len)
    self._next_id = 0
    self._default_stop = frozenset(mcfg.eos_token_ids)
    self.stats = EngineStats()
    if getattr(self.cache_config, "swa_scratch_active", False):
      self.stats.slots_saved_by_scratch = 0
    self.last_inputs: _StepInputs | None = None
    self._seen_buckets: set[tuple] = set()  # compiled variants seen

  @property
  def _step_fn(self):
    """The jitted step of the variant the last step used."""
    return self._step_fns(self._ops)

  # ------------------------------------------------------------------ API
  def add_request(self, prompt: Sequence[int],
                  params: SamplingParams = SamplingParams(),
                  reuse_scope: int = 0) -> int:
    """Queues a request; returns its id.

    `reuse_scope` salts the prefix cache (tenant / adapter): blocks are
    reused only between requests of the same scope.

    Raises:
      ValueError: empty prompt, or prompt + max_new_tokens over max_model_len,
        or token ids outside the vocabulary.
    """
    prompt = [int(t) for t in prompt]
    if not prompt:
      raise ValueError("Invalid prompt: expected at least one token, got none")
    total = len(prompt) + params.max_new_tokens
    if total > self.config.max_model_len:
      raise ValueError(
          f"Invalid request: len(prompt) + max_new_tokens = {total} exceeds "
          f"max_model_len={self.config.max_model_len}")
    if (self._scratch
        and total > self.config.max_num_tokens):
      # Scratch blocks live for one step only, so a prompt (or a recompute of
      # prompt + output) must be prefilled in a single step.
      raise ValueError(
          f"Invalid request: with SWA scratch reuse, len(prompt) + "
          f"max_new_tokens = {total} must fit max_num_tokens="
          f"{self.config.max_num_tokens}")
    if min(prompt) < 0 or max(prompt) >= self.model.cfg.vocab_size:
      raise ValueError(
          f"Invalid prompt: token ids must be in [0, {self.model.cfg.vocab_size}),"
          f" got range [{min(prompt)}, {max(prompt)}]")
    if params.stop_token_ids is not None:
      stop = frozenset(params.stop_token_ids)
    else:
      stop = frozenset() if params.ignore_eos else self._default_stop
    req = Request(self._next_id, prompt, params, stop,
                  reuse_scope=int(reuse_scope))
    self._next_id += 1
    self._requests[req.request_id] = req
    self._waiting.append(req)
    return req.request_id

  def get_request(self, request_id: int) -> Request:
    return self._requests[request_id]

  def has_unfinished(self) -> bool:
    return bool(self._waiting or self._running)

  def generate(self, prompts: Sequence[Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
               progress: Callable[[int], Any] | None = None) -> list[list[int]]:
    """Runs all prompts to completion; returns generated ids per prompt.

    `progress(n)` is called after each step with the tokens generated in it.
    """
    if isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
    while self.has_unfinished():
      n = self.step()
      if progress is not None:
        progress(n)
    return [self._requests[i].output for i in ids]

  # ----------------------------------------------------------------- step
  def _schedule(self):
    cfg = self.config
    S, T, A = cfg.max_seqs, cfg.max_num_tokens, cfg.num_admit
    tokens = np.zeros(T, np.int32)
    q_lens = np.zeros(S, np.int32)
    kv_lens = np.zeros(S, np.int32)
    sample_rows = np.zeros(S, bool)
    temperature = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    seeds = np.zeros(S, np.uint32)
    gen_index = np.zeros(S, np.int32)
    extend_ids = np.full(S, -1, np.int32)
    rows = []   # (request, q_len, samples)
    feeds = {}  # row -> tokens fed this step
    budget = T
    # Decode rows first (one token each), then prefill chunks in arrival order.
    order = ([r for r in self._running if r.status == "decode"]
             + [r for r in self._running if r.status == "prefill"])
    for req in order:
      if req.status == "decode":
        # All but the last sampled token are in the cache: feed that one.
        feed, total = req.output[-1:], req.num_computed + 1
      else:
        todo = req.tokens
        total = len(todo)
        remaining = total - req.num_computed
        # With SWA scratch reuse a prompt is prefilled in one step (scratch
        # blocks live for one step); otherwise chunked under the budget.
        chunk = remaining if self._scratch else min(
            remaining, budget)
        if chunk > budget or chunk <= 0:
          continue
        feed = todo[req.num_computed:req.num_computed + chunk]
      n = len(feed)
      if n > budget:
        continue
      budget -= n
      r = req.seq_id
      feeds[r] = feed
      q_lens[r] = n
      kv_lens[r] = req.num_computed + n
      samples = req.num_computed + n == total
      rows.append((req, n, samples))
      if samples:
        sample_rows[r] = True
        sp = req.params
        temperature[r], top_k[r], top_p[r] = sp.temperature, sp.top_k, sp.top_p
        seeds[r] = np.uint32(sp.seed & 0xFFFFFFFF)
        gen_index[r] = len(req.output)
        if len(req.output) + 1 < sp.max_new_tokens:
          extend_ids[r] = r
    # Tokens are laid out in row order (q_indptr is cu_seqlens over rows).
    q_indptr = np.zeros(S + 1, np.int32)
    q_indptr[1:] = np.cumsum(q_lens)
    bucket = next(b for b in cfg.buckets if b >= q_indptr[-1])
    tokens = tokens[:bucket]
    for r, feed in feeds.items():
      tokens[q_indptr[r]:q_indptr[r] + len(feed)] = feed

    # Admissions: while rows are free and the prefill backlog is short.
    admit_ids = np.full(A, -1, np.int32)
    admit_tokens = np.zeros((A, cfg.max_model_len), np.int32)
    admit_lens = np.zeros(A, np.int32)
    admit_scope = np.zeros(A, np.int32)
    admitted = []
    backlog = sum(len(r.tokens) - r.num_computed for r in self._running
                  if r.status == "prefill")
    while (self._waiting and self._free_rows and len(admitted) < A
           and backlog < 2 * T):
      req = self._waiting.popleft()
      row = self._free_rows.pop(0)
      req.seq_id = row
      toks = req.tokens
      i = len(admitted)
      admit_ids[i] = row
      admit_tokens[i, :len(toks)] = toks
      admit_lens[i] = len(toks)
      admit_scope[i] = req.reuse_scope
      admitted.append(req)
      backlog += len(toks)

    commit_ids = np.full(S, -1, np.int32)
    commit_lens = np.zeros(S, np.int32)
    release_ids = np.full(S, -1, np.int32)
    commits = {}  # one entry per row: a duplicated id would void the commit
    for row, n in self._to_commit + self._to_release:
      commits[row] = max(n, commits.get(row, 0))
    for i, (row, n) in enumerate(sorted(commits.items())):
      commit_ids[i], commit_lens[i] = row, n
    for i, (row, _) in enumerate(self._to_release):
      release_ids[i] = row
    inputs = _StepInputs(
        tokens=tokens, q_indptr=q_indptr, kv_lens=kv_lens,
        sample_rows=sample_rows, temperature=temperature, top_k=top_k,
        top_p=top_p, seeds=seeds, gen_index=gen_index, commit_ids=commit_ids,
        commit_lens=commit_lens, release_ids=release_ids,
        extend_ids=extend_ids, admit_ids=admit_ids, admit_tokens=admit_tokens,
        admit_lens=admit_lens, admit_scope=admit_scope)
    return inputs, rows, admitted

  def step(self) -> int:
    """Runs one engine step; returns the number of tokens sampled in it.

    Raises:
      RuntimeError: a waiting request can never be admitted (its prompt needs
        more slots than the whole pool has).
    """
    if self._burst_eligible():
      return self._burst()
    t0 = time.perf_counter()
    inputs, rows, admitted = self._schedule()
    released = self._to_release
    self._to_release, self._to_commit = [], []
    for row, _ in released:
      self._free_rows.append(row)
    self._free_rows.sort()
    self.last_inputs = inputs
    t1 = time.perf_counter()
    # The first step at each bucket size compiles; keep it out of tokens/s.
    # Slots the step may take: one per extended row, every admitted
    # prompt's blocks. Releases only add free slots (commits none), so the
    # last step's free count is a lower bound.
    ps = self.config.page_size
    need = int(np.sum(inputs.extend_ids >= 0)) + int(np.sum(
        np.where(inputs.admit_ids >= 0, -(-inputs.admit_lens // ps), 0)))
    self._ops = _StepOps(
        commit=bool(self.config.enable_prefix_reuse
                    and np.any(inputs.commit_ids >= 0)),
        release=bool(np.any(inputs.release_ids >= 0)),
        admit=bool(np.any(inputs.admit_ids >= 0)),
        greedy_only=not np.any(inputs.temperature > 0),
        evict=self._scratch or need > self._num_free)
    first = (inputs.tokens.shape[0], self._ops) not in self._seen_buckets
    self._seen_buckets.add((inputs.tokens.shape[0], self._ops))
    self.pool, self.state, self.seq_tokens, out = self._step_fns(self._ops)(
        self.model.params, self.pool, self.state, self.seq_tokens,
        jax.device_put(inputs, self._inputs_sharding))
    out = jax.device_get(out)  # the one device -> host sync
    self._num_free = int(out.num_free)
    t2 = time.perf_counter()

    num_sampled = 0
    has_prefill = False
    for req, n, samples in rows:
      if req.status == "prefill":
        has_prefill = True
        self.stats.prefill_tokens += n
      else:
        self.stats.decode_tokens += n
      req.num_computed += n
      if not samples:
        continue
      r = req.seq_id
      if req.status == "prefill":
        req.status = "decode"
        if self.config.enable_prefix_reuse:
          self._to_commit.append((r, req.num_computed))
      token = int(out.sampled[r])
      req.output.append(token)
      num_sampled += 1
      self.stats.generated_tokens += 1
      if req.first_token_step is None:
        req.first_token_step = self.stats.num_steps
      if (token in req.stop_ids and not req.params.ignore_eos) or len(
          req.output) >= req.params.max_new_tokens:
        req.status = "finished"
        req.finish_reason = "stop" if token in req.stop_ids else "length"
        self._finish(req)
      elif not out.extend_ok[r]:
        self._preempt(req)
    refused = []
    for i, req in enumerate(admitted):
      if out.claim_ok[i]:
        req.status = "prefill"
        self.stats.prompt_tokens += len(req.tokens)
        req.num_reused = int(out.claim_reused[i])
        req.num_computed = req.num_reused
        self.stats.reused_tokens += req.num_reused
        if self.stats.slots_saved_by_scratch is not None:
          ps = self.config.page_size
          wanted = -(-len(req.tokens) // ps) - req.num_reused // ps
          self.stats.slots_saved_by_scratch += wanted - int(
              out.claim_new_blocks[i])
        self._running.append(req)
      else:  # out of slots: back to the queue front, in arrival order
        self.stats.num_refused_claims += 1
        self._free_rows.append(req.seq_id)
        req.seq_id = -1
        refused.append(req)
    self._waiting.extendleft(reversed(refused))
    self._free_rows.sort()
    if refused and not rows and not self._running and not self._to_release:
      raise RuntimeError(
          f"Request {refused[0].request_id} needs "
          f"{-(-len(refused[0].tokens) // self.config.page_size)} slots but the "
          f"pool has only num_slots={self.config.num_slots}")
    self.stats.peak_used_slots = max(self.stats.peak_used_slots,
                                     int(out.used_slots))
    self.stats.num_steps += 1
    t3 = time.perf_counter()
    self.stats.host_time_s += (t1 - t0) + (t3 - t2)
    if first:
      self.stats.compile_time_s += t2 - t1
    elif has_prefill:
      self.stats.prefill_time_s += t3 - t0
    elif rows:
      self.stats.decode_time_s += t3 - t0
    return num_sampled

  def _burst_eligible(self) -> bool:
    """Multi-step decode applies when nothing but decoding can happen."""
    if self.config.decode_steps <= 1 or not self._running:
      return False
    if self._to_release or self._to_commit or (self._waiting and self._free_rows):
      return False
    return all(r.status == "decode" and len(r.stop_ids) <= MAX_STOP_IDS
               for r in self._running)

  def _burst_variant(self) -> tuple[bool, bool]:
    """(greedy_only, evict) of the next burst, from what the host knows.

    Eviction is built in only when the free slots might not cover every
    running request's blocks for `decode_steps` more tokens (or SWA scratch
    takes slots of its own); without it and with all rows greedy the burst
    has no `lax.cond`, i.e. no device-to-host sync per iteration.
    """
    ps, k = self.config.page_size, self.config.decode_steps
    greedy = all(r.params.temperature <= 0 for r in self._running)
    # A decoding request has num_computed + 1 tokens reserved; the burst
    # extends it to at most num_computed + 1 + k.
    need = sum(-(-(r.num_computed + 1 + k) // ps) - -(-(r.num_computed + 1) // ps)
               for r in self._running)
    evict = self._scratch or need > self._num_free
    return greedy, evict

  def _burst_inputs(self) -> _BurstInputs:
    """Host inputs of a burst over the running (decoding) requests."""
    S = self.config.max_seqs
    active = np.zeros(S, bool)
    last = np.zeros(S, np.int32)
    computed = np.zeros(S, np.int32)
    remaining = np.zeros(S, np.int32)
    stop_ids = np.full((S, MAX_STOP_IDS), -1, np.int32)
    temperature = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    seeds = np.zeros(S, np.uint32)
    gen_index = np.zeros(S, np.int32)
    for req in self._running:
      r, sp = req.seq_id, req.params
      active[r] = True
      last[r] = req.output[-1]
      computed[r] = req.num_computed
      remaining[r] = sp.max_new_tokens - len(req.output)
      stops = [] if sp.ignore_eos else sorted(req.stop_ids)
      stop_ids[r, :len(stops)] = stops
      temperature[r], top_k[r], top_p[r] = sp.temperature, sp.top_k, sp.top_p
      seeds[r] = np.uint32(sp.seed & 0xFFFFFFFF)
      gen_index[r] = len(req.output)
    return _BurstInputs(active, last, computed, remaining, stop_ids,
                        temperature, top_k, top_p, seeds, gen_index)

  def _burst(self) -> int:
    """`decode_steps` decode iterations in one device call (see EngineConfig)."""
    t0 = time.perf_counter()
    inputs = self._burst_inputs()
    t1 = time.perf_counter()
    greedy, evict = self._burst_variant()
    first = ("burst", greedy, evict) not in self._seen_buckets
    self._seen_buckets.add(("burst", greedy, evict))
    self.pool, self.state, self.seq_tokens, out = self._burst_fns(
        greedy, evict)(
            self.model.params, self.pool, self.state, self.seq_tokens,
            jax.device_put(inputs, self._inputs_sharding))
    out = jax.device_get(out)
    self._num_free = int(out.num_free)
    t2 = time.perf_counter()
    num_sampled = 0
    for req in list(self._running):
      r = req.seq_id
      toks = [int(t) for t in out.tokens[:, r] if t >= 0]
      req.output.extend(toks)
      req.num_computed += len(toks)
      num_sampled += len(toks)
      token = req.output[-1]
      stopped = token in req.stop_ids and not req.params.ignore_eos
      if stopped or len(req.output) >= req.params.max_new_tokens:
        req.status = "finished"
        req.finish_reason = "stop" if stopped else "length"
        self._finish(req)
      elif out.preempted[r]:
        self._preempt(req)
    self.stats.decode_tokens += num_sampled
    self.stats.generated_tokens += num_sampled
    self.stats.peak_used_slots = max(self.stats.peak_used_slots,
                                     int(out.used_slots))
    self.stats.num_steps += self.config.decode_steps
    t3 = time.perf_counter()
    self.stats.host_time_s += (t1 - t0) + (t3 - t2)
    if first:
      self.stats.compile_time_s += t2 - t1
    else:
      self.stats.decode_time_s += t3 - t0
    return num_sampled

  def _finish(self, req: Request):
    self._running.remove(req)
    self._to_release.append((req.seq_id, req.num_computed))

  def _preempt(self, req: Request):
    """Out of slots for the next token: free the sequence, recompute later."""
    self._running.remove(req)
    self._to_release.append((req.seq_id, req.num_computed))
    req.status = "waiting"
    req.seq_id = -1
    req.num_computed = 0
    req.num_preemptions += 1
    self.stats.num_preemptions += 1
    self._waiting.appendleft(req)

  # -------------------------------------------------------------- profile
  def _profile_programs(self) -> dict:
    """The programs `profile` times, on copies of the current state.

    Keys: `step` (jitted step or burst) with `step_args()` / `bare_args()`
    (the latter adds precomputed page tables: no cache op runs), `per` (steps
    per call), `cache_ops` (jitted, donating: the step's cache ops alone) with
    `cache_ops_args()`, `attention_inputs` (a `_StepInputs` of the step).

    Raises:
      ValueError: nothing to profile yet (no step run, no burst pending).
    """
    cfg, mcfg = self.config, self.model.cfg
    L, S, k = mcfg.num_layers, cfg.max_seqs, cfg.decode_steps
    if self._burst_eligible():
      # `_schedule` admits, commits and releases nothing in this state: its
      # inputs are one decode step of the current batch (for attention).
      attention_inputs = self._schedule()[0]
      greedy, evict = self._burst_variant()
      fn = self._burst_fns(greedy, evict)
      binp = jax.tree.map(jnp.asarray, self._burst_inputs())
      ids = jnp.where(binp.active, jnp.arange(S, dtype=jnp.int32), -1)
      # Tables that already hold the burst's new blocks (timing only).
      grown, _ = _cache.extend(self.state, ids, jnp.full((S,), k, jnp.int32))
      tables = _layer_tables(grown, L, S)
      args = lambda: (self.model.params, _copy_tree(self.pool), _copy_tree(self.state),
                      _copy_tree(self.seq_tokens), binp)
      cache_ops = functools.partial(  # as the burst does, once
          _reserve_burst, inp=binp, num_layers=L, decode_steps=k, evict=evict)
      per = k
    elif self.last_inputs is None:
      raise ValueError("Invalid call: profile() needs at least one step() first")
    else:
      attention_inputs = self.last_inputs
      inp = jax.tree.map(jnp.asarray, self.last_inputs)
      fn = self._step_fn
      tables = _layer_tables(self.state, L, S)
      args = lambda: (self.model.params, _copy_tree(self.pool), _copy_tree(self.state),
                      _copy_tree(self.seq_tokens), inp)
      ops, seq_tokens = self._ops, self.seq_tokens

      def cache_ops(state):
        state = _cache_ops_before(state, seq_tokens, inp, ops)
        t = _layer_tables(state, L, S)
        state, ext, claim = _cache_ops_after(state, inp, ops)
        return state, t, ext.ok, claim.ok
      per = 1
    return dict(step=fn, step_args=args, bare_args=lambda: args() + (tables,),
                per=per, cache_ops=jax.jit(cache_ops, donate_argnums=0),
                cache_ops_args=lambda: (_copy_tree(self.state),),
                attention_inputs=jax.tree.map(jnp.asarray, attention_inputs))

  def profile(self, iters: int = 10) -> dict:
    """Times the pieces of the next step on copies of the state (GPU runs).

    While the engine decodes in bursts (`decode_steps > 1`) the step profiled
    is one decode iteration of the current batch inside a burst (burst time /
    `decode_steps`); otherwise the last step.

    Returns milliseconds per step:
      * `step_ms`: the jitted step (or burst iteration) as the engine runs it;
      * `bookkeeping_ms`: what the cache ops add to it: `step_ms` minus the
        same program with the cache ops removed (page tables precomputed; no
        commit / release / extend / claim);
      * `bookkeeping_in_jit_ms`: the cache ops alone (page tables + commit /
        release / extend / claim; in a burst, its one `extend` + page tables,
        divided by `decode_steps`) in one jit on a donated state, less the
        time of a trivial jitted call (the dispatch floor), per step;
      * `attention_ms`: every layer's `paged_prefill` on the step's plan (q
        random), alone;
      * `rest_ms = step_ms - attention_ms - bookkeeping_ms` (projections,
        MLP, RoPE + append, sampling).
    Nothing here changes the engine's state.

    Raises:
      NotImplementedError: the engine runs on a mesh (the split times
        single-device pieces only).
      ValueError: nothing to profile yet (no step run, no burst pending).
    """
    if self.mesh is not None:
      raise NotImplementedError(
          "Engine.profile() times a single-device step; got an engine with a "
          "mesh")
    prog = self._profile_programs()
    cfg, mcfg = self.config, self.model.cfg
    L, S = mcfg.num_layers, cfg.max_seqs
    inp = prog["attention_inputs"]

    def timed(fn, make_args, per=1):
      jax.block_until_ready(fn(*make_args()))
      times = []
      for _ in range(iters):
        args = jax.block_until_ready(make_args())
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3 / per)
      return float(np.median(times))

    per = prog["per"]
    step_ms = timed(prog["step"], prog["step_args"], per=per)
    bare_ms = timed(prog["step"], prog["bare_args"], per=per)

    def attention_only(pool, state, inp):
      tables = _layer_tables(state, L, S)
      q = jnp.ones((inp.tokens.shape[0], mcfg.num_qo_heads, mcfg.head_dim),
                   pool.dtype)
      acc = jnp.zeros((), jnp.float32)
      kernel_plan = None
      if _decoder._uses_pallas(cfg.impl):  # as the model does: one plan a step
        kernel_plan = _attention.plan_prefill(
            inp.q_indptr, inp.kv_lens, num_tokens=q.shape[0],
            num_qo_heads=mcfg.num_qo_heads, num_kv_heads=mcfg.num_kv_heads,
            head_dim=mcfg.head_dim, dtype=pool.dtype,
            window_left=max(mcfg.windows))
      for layer in range(L):
        spec = mcfg.attention_spec(layer)
        o = _attention.paged_prefill(
            q, pool, tables[layer], inp.q_indptr, inp.kv_lens,
            sm_scale=spec.sm_scale, window_left=spec.window_left,
            logits_soft_cap=spec.logits_soft_cap, impl=cfg.impl,
            plan=kernel_plan)
        acc = acc + o[0, 0, 0].astype(jnp.float32)
        q = q + o * 0  # keep the layers sequential, as in the model
      return acc

    floor = timed(jax.jit(lambda st: st.seq_lens + 1, donate_argnums=0),
                  lambda: (_copy_tree(self.state),))
    ops = timed(prog["cache_ops"], prog["cache_ops_args"])
    result = {
        "step_ms": step_ms,
        "bookkeeping_ms": max(step_ms - bare_ms, 0.0),
        "bookkeeping_in_jit_ms": max(ops - floor, 0.0) / per,
        "attention_ms": timed(jax.jit(attention_only), lambda: (
            self.pool, self.state, inp)),
    }
    result["rest_ms"] = (result["step_ms"] - result["attention_ms"]
                         - result["bookkeeping_ms"])
    return result
