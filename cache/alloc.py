"""Pure, vectorised cache ops: extend, release, finish_step, and the rules
every op shares (`claim_batch` lives in `cache/claim.py`, `commit` in
`cache/publish.py`, `fork` in `cache/forking.py`; all build on this module's
helpers).

Every function is `f(state, ...) -> (state, result)` (`commit` and `release`
return the state only), jitted once per `CacheConfig` (the config is a static
field of the state pytree) and free of Python loops over requests: per-request
work is masks, `cumsum`, one sort or binary search over the slots, and masked
scatters (the one exception, `head_of_line=False`, is a `lax.scan` over the
requests of a call: "Admission" below). The one data-dependent branch is the
LRU eviction sort, under a `lax.cond` taken only when the free slots run out;
on GPU its predicate is read by the host. `extend` and `claim_batch` take `evict=False` (static) for callers
that know the free count covers the call: no eviction, no cond. `extend`
also takes `evict="branchless"`: the eviction order is sorted on every call
and there is no cond, for callers that must not wait on the device (the
engine's burst reservation, dispatched while the burst before it runs).

Common rules:
  * `seq_ids` entries equal to `NULL_SEQ = -1` are padding: `ok=False`, no
    effect. So are ids out of `[0, max_seqs)`, ids that appear more than once in
    one call (every occurrence is refused; `release` and `finish_step`, which
    only end things, act once instead), and ids in the wrong liveness
    (claiming a live id, extending a dead one). Checked mode
    (`pkvattn.checked`, `check=True`) turns these into errors instead.
  * Integer array arguments may be given as Python lists (converted to int32
    arrays; an empty list too).
  * New blocks come from free slots (lowest index first), then from evicting
    cached slots (published, unreferenced) by `eviction_order`: least
    recently released first, then deepest block of its chain first (a
    released chain loses its tail first, so its prefix stays reusable), then
    lowest index. Evicted slots leave the prefix cache.

Admission (`claim_batch`, `extend`, `fork`; all or nothing per request, in
batch order). The supply is the `F` free slots plus, unless `evict=False`, the
`E` cached ones. Admitting request `r` takes its `need[r]` new slots from the
supply and, when cached slots count, also the cached blocks it reuses
(`R_r`, `claim_batch` only: they become used, so nobody may evict them). A set
`A` of requests fits iff

    sum(need[r] for r in A) + |union(R_r for r in A)| <= F + E

(without eviction: `sum(need) <= F`; reuse never takes free slots). Only
admitted requests protect their reused blocks: a refused request's matches
stay evictable, so protection by a refused request never starves the others.
  * `head_of_line=True` (default, first come first served): `A` is the longest
    prefix of the valid requests that fits; once a valid request does not
    fit, every later one is refused. The left side above only grows along
    the batch, so this is one cumulative sum (vectorised). In particular the
    first valid request is admitted whenever it fits alone.
  * `head_of_line=False`: greedy, skipping refusals: request `r` is admitted
    iff it fits together with the requests admitted before it. Inherently
    sequential (first-fit knapsack), so a `lax.scan` over the `n` requests of
    the call, `O(max_pages)` work per step (see `_admit`).
A refused request holds nothing afterwards and its sequence is unchanged.

SWA scratch reuse (only when `config.swa_scratch_active`). A step
grows a sequence from `history_len` to `capacity` tokens: `claim_batch` from
the reused tokens to the prompt length, `extend` from the old to the new
length. Per `window.swa_scratch_plan(history_len, capacity, page_size,
config.scratch_window_left, num_layers, config.max_rewind_len)`, the step's
oldest new blocks, which no query at or after `capacity - max_rewind_len` can
see, are *scratch*: they get `cdiv(num_scratch_blocks, num_layers)` scratch
slots (recorded in `seq_scratch_slots`, refcount 1 each) instead of one slot
each, and `seq_slots` holds -1 for them. The other new blocks get slots as
usual. Request `r`'s slots take allocation ranks `offset_r + j` for its
scratch slots `j`, then the normal blocks in block order. `page_table` maps
the scratch blocks of the running step to sub-pages of the scratch slots
(`window.scratch_page_indices`). The scratch slots go back to the pool (free,
never published) when the step ends: at the sequence's next `extend` (which
retires the previous step's scratch of every valid listed sequence first,
whether or not its growth is granted), at `finish_step`, or at `release`.
`commit` never publishes a scratch block (nor, since chains start at block 0,
any block after one). Later queries never see scratch blocks (they are out of
the window), so the -1 entries are never read by the kernels.

Prefix-cache verification. A published slot stores its key, tokens, scope and
its parent slot with that parent's publication generation. A request's block
`i` matches slot `c_i` only if `c_i` holds the block's key, the very same
tokens and scope, and its parent is `c_{i-1}` at the generation it had when
`c_i` was published (`-1` for block 0). Keys only find candidates; a collision
or an orphan (parent evicted and reused) never matches.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _checks
from . import _contract
from . import window
from .state import CacheState

_I32_MAX = jnp.iinfo(jnp.int32).max


class ExtendResult(NamedTuple):
  ok: jax.Array              # bool[n], grown (num_new_tokens == 0 counts as ok)
  num_new_blocks: jax.Array  # i32[n], slots allocated at page boundaries
  #                            (with scratch: normal blocks + scratch slots)


def _cdiv(a, b):
  return (a + b - 1) // b


def _oob_scatter_index(mask, idx, size):
  """Index for a masked `.at[...].xxx(mode="drop")`: `size` drops the entry."""
  return jnp.where(mask, idx, size)


def _check_ids(x, name):
  _checks.check_int(x, name)
  _checks.check_ndim(x, (1,), name)


def _check_token_batch(seq_ids, tokens, lengths) -> int:
  """Checks `seq_ids i32[n]`, `tokens i32[n, max_len]`, `lengths i32[n]`; returns n."""
  _check_ids(seq_ids, "seq_ids")
  n = seq_ids.shape[0]
  _checks.check_int(tokens, "tokens")
  _checks.check_shape(tokens, (n, None), "tokens")
  _checks.check_int(lengths, "lengths")
  _checks.check_shape(lengths, (n,), "lengths")
  return n


def _select(state: CacheState, seq_ids, want_live: bool,
            dedupe: bool = False):
  """Clipped row indices and the validity mask of a batch of sequence ids.

  An id listed more than once is invalid everywhere (every occurrence), or,
  with `dedupe` (static), valid at its first occurrence only.
  """
  max_seqs = state.config.max_seqs
  seq_ids = seq_ids.astype(jnp.int32)
  in_range = (seq_ids >= 0) & (seq_ids < max_seqs)
  idx = jnp.where(in_range, seq_ids, 0)
  same = (seq_ids[:, None] == seq_ids[None, :]) & in_range[None, :]
  if dedupe:
    unique = ~jnp.any(jnp.tril(same, k=-1), axis=1)
  else:
    unique = jnp.sum(same, axis=1) == 1
  live = state.seq_live[idx]
  valid = in_range & unique & (live if want_live else ~live)
  return idx, valid


def _prefix_count(mask):
  """Inclusive running count of a `bool[n]` mask, `i32[n]` (== cumsum).

  XLA's GPU cumsum of a long vector is a tree of reduce-windows (several
  kernels); over the slots this is instead two small matmuls: counts within
  blocks of `_COUNT_BLOCK` by an upper-triangular ones matrix, plus the
  running total of the preceding blocks. Exact: 0/1 inputs, f32 sums below
  2**24.
  """
  n = mask.shape[0]
  b = _COUNT_BLOCK
  if n <= 2 * b:
    return jnp.cumsum(mask.astype(jnp.int32))
  m = _cdiv(n, b)
  x = jnp.pad(mask.astype(jnp.float32), (0, m * b - n)).reshape(m, b)
  hi = jax.lax.Precision.HIGHEST
  within = jnp.dot(x, jnp.triu(jnp.ones((b, b), jnp.float32)), precision=hi)
  before = jnp.dot(within[:, -1],
                   jnp.triu(jnp.ones((m, m), jnp.float32), k=1), precision=hi)
  return (within + before[:, None]).reshape(-1)[:n].astype(jnp.int32)


_COUNT_BLOCK = 256


def _supply(state: CacheState, protected):
  """(free, evictable) slot masks; `protected` slots are never evictable."""
  unref = state.slot_refcount == 0
  free = unref & ~state.slot_published
  evictable = unref & state.slot_published & ~protected
  return free, evictable


def _admit(state: CacheState, valid, need, *, evict: bool = True,
           head_of_line: bool = True, cand=None, matched=None):
  """Which requests get their blocks (all or nothing each); vectorised.

  The supply is the `F` free slots plus, when `evict` (static), the `E`
  evictable ones (cached: published, unreferenced). Admitting request `r`
  takes `need[r]` new slots from it and, when `evict`, also takes out of it
  the cached blocks that `r` reuses (`R_r`: its `matched` blocks in `cand`
  that are evictable; they become used). A set `A` of requests fits iff

      sum(need[r] for r in A) + w * |union(R_r for r in A)| <= F + w * E,

  `w = 1` if `evict` else 0. Only admitted requests protect their reused
  blocks: a refused request's matches stay evictable for the others.

  head_of_line=True (static): `A` is the longest feasible prefix of the valid
  requests in batch order (the left side only grows along the batch, so
  request `r` is admitted iff the valid requests `0..r` fit together). One
  cumsum plus a scatter-min over the slots (the first request reusing each
  cached block): `O(n * nbt + num_slots)`, no loop.

  head_of_line=False: greedy in batch order, skipping refusals: `r` is
  admitted iff it fits together with the requests admitted before it. Whether
  `r` fits depends on which earlier requests were admitted, which depends on
  theirs (first-fit knapsack), so this is a `lax.scan` over the `n` requests
  of the call: `n` steps of `O(nbt)` work (a gather and a scatter over `r`'s
  reused blocks, carried `bool[num_slots]` mask updated in place). `n` is one
  call's batch (the admit candidates of one step), small next to the slots.

  Args:
    state: the cache state.
    valid: `bool[n]`, requests that may be admitted.
    need: `i32[n]`, new slots each request takes (ignored where not valid).
    evict, head_of_line: static, as above.
    cand: `i32[n, nbt]`, slot of each reusable block, or None (no reuse).
    matched: `bool[n, nbt]`, blocks actually reused (a leading run per row).

  Returns:
    `(ok bool[n], need i32[n] zeroed where refused, protected bool[num_slots]
    = the blocks reused by admitted requests)`.
  """
  n = valid.shape[0]
  num_slots = state.num_slots
  free, evictable = _supply(state, jnp.zeros((num_slots,), bool))
  budget = jnp.sum(free, dtype=jnp.int32)
  if evict:
    budget += jnp.sum(evictable, dtype=jnp.int32)
  # Kept out of the fusions below: XLA:GPU (jaxlib 0.12) fuses these slot
  # reductions with the per-block gathers of `cand` into one Triton fusion and
  # then fails to tile the gathers' flattened `[n, nbt]` index ("Reshape is
  # non-contiguous [2, 2] -> [4]", n = nbt = 2). A scalar: no cost.
  budget = jax.lax.optimization_barrier(budget)
  need = jnp.where(valid, need, 0).astype(jnp.int32)
  if cand is None or cand.shape[1] == 0:
    cand = jnp.zeros((n, 0), jnp.int32)
    matched = jnp.zeros((n, 0), bool)
  slot = jnp.clip(cand, 0)
  matched = matched & valid[:, None]
  # Reused blocks that the supply counts (only with eviction: without it the
  # supply is the free slots, which reuse never touches).
  takes = matched & evictable[slot] if evict else jnp.zeros_like(matched)
  reuse = evict and takes.shape[1] > 0  # static: reuse costs supply
  if head_of_line and not reuse:
    ok = valid & (jnp.cumsum(need) <= budget)
  elif head_of_line:
    # |union of R_0..R_r| = number of cached blocks whose first reuser is <= r.
    rows = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None],
                            cand.shape)
    first = jnp.full((num_slots,), n, jnp.int32).at[
        _oob_scatter_index(takes, cand, num_slots)].min(rows, mode="drop")
    newly = jnp.sum(takes & (first[slot] == rows), axis=1, dtype=jnp.int32)
    ok = valid & (jnp.cumsum(need) + jnp.cumsum(newly) <= budget)
  elif not reuse:
    def step(spent, x):
      v, nd = x
      fits = v & (spent + nd <= budget)
      return spent + jnp.where(fits, nd, 0), fits
    _, ok = jax.lax.scan(step, jnp.zeros((), jnp.int32), (valid, need))
  else:
    def step(carry, x):
      spent, prot = carry
      v, nd, c, t = x
      extra = jnp.sum(t & ~prot[jnp.clip(c, 0)], dtype=jnp.int32)
      fits = v & (spent + nd + extra <= budget)
      prot = prot.at[_oob_scatter_index(t & fits, c, num_slots)].set(
          True, mode="drop")
      return (spent + jnp.where(fits, nd + extra, 0), prot), fits
    init = (jnp.zeros((), jnp.int32), jnp.zeros((num_slots,), bool))
    _, ok = jax.lax.scan(step, init, (valid, need, cand, takes))
  protected = jnp.zeros((num_slots,), bool).at[
      _oob_scatter_index(matched & ok[:, None], cand, num_slots)].set(
          True, mode="drop")
  return ok, jnp.where(ok, need, 0), protected


def _take_slots(state: CacheState, ranks, total, protected, evict=True):
  """Allocates the blocks numbered by `ranks` (vectorised, no serial scan).

  Block `g` (a rank in `[0, total)`) gets the `g`-th slot in allocation order:
  free slots by index, then evictable slots by `eviction_order`. Evicted
  slots are removed from the prefix cache. Callers guarantee `total <= supply`.

  This is the single allocation primitive; a scratch-slot path (SWA) can call
  it with its own ranks.

  Args:
    state: the cache state.
    ranks: `i32[...]`, the allocation rank of each wanted block, -1 = none.
    total: `i32[]`, number of ranks in use (`max(ranks) + 1`).
    protected: `bool[num_slots]`, slots that must not be evicted.
    evict: static. False: callers guarantee `total <= num_free` and the
      eviction path is not built (no `lax.cond`, which costs a device-to-host
      sync on GPU). True: the eviction order is computed under a
      `lax.cond`, only when the free slots run out. "branchless": it is
      computed on every call (a sort over the slots; no `lax.cond`).

  Returns:
    `(state, slots)`: `slots i32[...]` like `ranks`, -1 where `ranks < 0`. The
    slots' refcounts are NOT updated (callers add their owners).
  """
  num_slots = state.num_slots
  free, evictable = _supply(state, protected)
  free_cs = _prefix_count(free)
  num_free = free_cs[-1]
  want = ranks >= 0
  # The first `k` free slots in index order, by one scatter (no search loop:
  # a while loop costs a host round trip per iteration on GPU).
  k = max(1, min(num_slots, ranks.size))
  free_rank = free_cs - 1
  free_list = jnp.full((k,), -1, jnp.int32).at[
      _oob_scatter_index(free & (free_rank < k), free_rank, k)].set(
          jnp.arange(num_slots, dtype=jnp.int32), mode="drop")

  def from_free():
    return free_list[jnp.clip(ranks, 0, k - 1)]

  def with_eviction():
    order = eviction_order(state, evictable)
    evict_idx = jnp.clip(ranks - num_free, 0, num_slots - 1)
    return jnp.where(ranks < num_free, from_free(), order[evict_idx])

  if not evict:
    return state, jnp.where(want, from_free(), -1)
  if evict == "branchless":
    slots = with_eviction()
  else:
    slots = jax.lax.cond(total > num_free, with_eviction, from_free)
  slots = jnp.where(want, slots, -1)
  evicted = want & (ranks >= num_free)
  state = _unpublish(state, jnp.where(evicted, slots, -1))
  return state, slots


def eviction_order(state: CacheState, evictable):
  """Slots in eviction order, `evictable` ones first (`i32[num_slots]`).

  The order is `(slot_last_use ascending, slot_depth descending, index
  ascending)`, one stable `lexsort` (deterministic): least recently released
  first and, among the blocks of one release (they share its clock), the
  deepest block of its chain first. A prompt reuses only a leading run of
  blocks and a block whose parent was evicted is never matched again
  (`slot_parent_gen`), so evicting a chain's head would strand its whole
  tail; evicting tail first keeps the shared prefix reusable longest (as
  vLLM frees a request's blocks in reverse order). `slot_depth` is the
  block's index in its sequence, stored at publication (`commit`), so no
  walk over `slot_parent` is needed.

  Args:
    state: the cache state.
    evictable: `bool[num_slots]`, the candidates; the other slots follow them
      (their order among themselves is unspecified for callers).

  Returns:
    `i32[num_slots]`, a permutation of the slot ids.
  """
  lru = jnp.where(evictable, state.slot_last_use, _I32_MAX)
  depth = jnp.where(evictable, state.slot_depth, 0)
  idx = jnp.arange(state.num_slots, dtype=jnp.int32)
  # lexsort: the last key is the primary one.
  return jnp.lexsort((idx, -depth, lru)).astype(jnp.int32)


def _unpublish(state: CacheState, slots):
  """Removes `slots` (any shape, -1 = skip) from the prefix cache."""
  num_slots = state.num_slots
  mask = slots >= 0
  s = jnp.clip(slots, 0)
  table = state.hash_table
  flat = table.reshape(-1)
  pos = state.slot_hash_pos[s]
  flat = flat.at[_oob_scatter_index(mask & (pos >= 0), pos, flat.size)].set(
      -1, mode="drop")
  drop = _oob_scatter_index(mask, s, num_slots)
  return _replace(
      state,
      hash_table=flat.reshape(table.shape),
      slot_published=state.slot_published.at[drop].set(False, mode="drop"),
      slot_hash_pos=state.slot_hash_pos.at[drop].set(-1, mode="drop"),
  )


def _replace(state, **kw):
  return dataclasses.replace(state, **kw)


def _open_seqs(state: CacheState, ok, idx, rows, lengths, scope):
  """The state with sequences `idx[r]` live where `ok[r]`: slot rows `rows`
  (`i32[n, max_pages]`, -1 for none; one more reference on each slot
  named), lengths and scopes. Returns `(state, row_idx)`, the sequences'
  rows as scatter indices (out of range where not `ok`)."""
  owners = _oob_scatter_index(rows >= 0, rows, state.num_slots)
  row_idx = _oob_scatter_index(ok, idx, state.config.max_seqs)
  return _replace(
      state,
      slot_refcount=state.slot_refcount.at[owners].add(1, mode="drop"),
      seq_slots=state.seq_slots.at[row_idx].set(rows, mode="drop"),
      seq_lens=state.seq_lens.at[row_idx].set(lengths, mode="drop"),
      seq_live=state.seq_live.at[row_idx].set(True, mode="drop"),
      seq_scope=state.seq_scope.at[row_idx].set(scope, mode="drop"),
  ), row_idx


def _find(state: CacheState, keys):
  """Slot in the hash table holding exactly `keys` (`u32[..., 2]`), else -1."""
  cfg = state.config
  bucket = (keys[..., 0] & jnp.uint32(cfg.num_buckets - 1)).astype(jnp.int32)
  ways = state.hash_table[bucket]  # [..., hash_ways]
  s = jnp.clip(ways, 0)
  match = ((ways >= 0)
           & (state.slot_key[s, 0] == keys[..., None, 0])
           & (state.slot_key[s, 1] == keys[..., None, 1]))
  return jnp.max(jnp.where(match, ways, -1), axis=-1), bucket, ways


def _block_view(tokens, page_size, num_blocks):
  n = tokens.shape[0]
  return tokens[:, :num_blocks * page_size].reshape(n, num_blocks, page_size)


def _content_ok(state, cand, blocks, scope):
  """Candidate slot holds these tokens and this scope (`[n, num_blocks]`)."""
  c = jnp.clip(cand, 0)
  tok_ok = jnp.all(state.slot_tokens[c] == blocks, axis=-1)
  return (cand >= 0) & tok_ok & (state.slot_scope[c] == scope[:, None])


def _parent_ok(state, cand, parent, parent_gen):
  """Candidate's recorded parent (and its generation) equal the given ones."""
  c = jnp.clip(cand, 0)
  return ((state.slot_parent[c] == parent)
          & ((parent < 0) | (state.slot_parent_gen[c] == parent_gen)))


def _leading_run(mask):
  """`mask[r, i]` and all before it in row r (`bool[n, k]`)."""
  return jnp.cumprod(mask.astype(jnp.int32), axis=1).astype(bool)


def _shift_right(x, fill):
  pad = jnp.full(x.shape[:1] + (1,), fill, x.dtype)
  return jnp.concatenate([pad, x[:, :-1]], axis=1)


def _retire_scratch(state: CacheState, idx, mask):
  """Ends the running step's scratch of rows `idx[mask]`: slots to the pool.

  Scratch slots are never published, so they become free; `slot_last_use` is
  left alone (it orders cached slots only). No-op when scratch is inactive.
  """
  cfg = state.config
  if not cfg.swa_scratch_active:
    return state
  slots = state.seq_scratch_slots[idx]                      # [n, max_scratch]
  owned = mask[:, None] & (slots >= 0)
  s = _oob_scatter_index(owned, slots, state.num_slots)
  row = _oob_scatter_index(mask, idx, cfg.max_seqs)
  return _replace(
      state,
      slot_refcount=state.slot_refcount.at[s].add(-1, mode="drop"),
      seq_scratch_slots=state.seq_scratch_slots.at[row].set(-1, mode="drop"),
      seq_scratch_first=state.seq_scratch_first.at[row].set(0, mode="drop"),
      seq_scratch_count=state.seq_scratch_count.at[row].set(0, mode="drop"),
  )


class _StepPlan(NamedTuple):
  """Where a step's new blocks go (`[n]` each; scratch-free when inactive)."""
  first_new: jax.Array      # i32[n], first new block
  normal_first: jax.Array   # i32[n], first normal new block (= scratch end)
  end_new: jax.Array        # i32[n], exclusive end of the new blocks
  num_scratch: jax.Array    # i32[n], scratch blocks
  scratch_slots: jax.Array  # i32[n], scratch slots for them


def _step_plan(cfg, history_len, capacity) -> _StepPlan:
  """The step's split into scratch and normal new blocks (module docstring)."""
  ps = cfg.page_size
  if not cfg.swa_scratch_active:
    first = _cdiv(history_len, ps)
    end = jnp.maximum(first, _cdiv(capacity, ps))
    zero = jnp.zeros_like(first)
    return _StepPlan(first, first, end, zero, zero)
  plan = window.swa_scratch_plan(
      history_len, capacity, ps, cfg.scratch_window_left, cfg.num_layers,
      cfg.max_rewind_len)
  return _StepPlan(plan.first_new_block, plan.scratch_last, plan.end_new_block,
                   plan.num_scratch_blocks, plan.num_scratch_slots)


def _step_ranks(cfg, plan: _StepPlan, ok, offset):
  """Allocation ranks `i32[n, max_pages + max_scratch_slots]` of a step.

  Columns `[0, max_pages)` are the sequence's normal new blocks (by block
  position), the last `max_scratch_slots` columns its scratch slots; request
  `r` uses ranks `offset[r] + j` for scratch slot `j`, then
  `offset[r] + scratch_slots[r] + (b - normal_first[r])` for normal block `b`.
  """
  pos = jnp.arange(cfg.max_pages)[None, :]
  normal = (ok[:, None] & (pos >= plan.normal_first[:, None])
            & (pos < plan.end_new[:, None]))
  normal_ranks = jnp.where(
      normal, (offset + plan.scratch_slots)[:, None] + pos
      - plan.normal_first[:, None], -1)
  if not cfg.swa_scratch_active:
    return normal, normal_ranks
  j = jnp.arange(cfg.max_scratch_slots)[None, :]
  scratch = ok[:, None] & (j < plan.scratch_slots[:, None])
  scratch_ranks = jnp.where(scratch, offset[:, None] + j, -1)
  return normal, jnp.concatenate([normal_ranks, scratch_ranks], axis=1)


def _set_scratch(state: CacheState, row_idx, plan: _StepPlan, slots):
  """Records the step's scratch and takes a reference on its slots.

  `slots i32[n, max_pages + max_scratch_slots]` is `_take_slots`' result for
  `_step_ranks`; its scratch columns are recorded for rows `row_idx` (the
  out-of-range index `max_seqs` drops a row).
  """
  if not state.config.swa_scratch_active:
    return state
  slots = slots[:, state.config.max_pages:]
  owners = _oob_scatter_index(slots >= 0, slots, state.num_slots)
  return _replace(
      state,
      slot_refcount=state.slot_refcount.at[owners].add(1, mode="drop"),
      seq_scratch_slots=state.seq_scratch_slots.at[row_idx].set(
          slots, mode="drop"),
      seq_scratch_first=state.seq_scratch_first.at[row_idx].set(
          jnp.where(plan.num_scratch > 0, plan.first_new, 0), mode="drop"),
      seq_scratch_count=state.seq_scratch_count.at[row_idx].set(
          plan.num_scratch, mode="drop"),
  )


def extend(
    state: CacheState,
    seq_ids: jax.Array,         # i32[n]
    num_new_tokens: jax.Array,  # i32[n]
    *,
    evict: bool = True,
    head_of_line: bool = True,
    check: bool | None = None,
) -> tuple[CacheState, ExtendResult]:
  """Grows live sequences by `num_new_tokens`, allocating blocks as needed.

  Used every decode step (one token) and for chunked prefill. Requests are
  all-or-nothing, admitted in batch order (module docstring, "Admission";
  no reuse here, so request `r` needs only its own new slots). With SWA
  scratch active, every valid listed sequence's previous step ends first
  (`finish_step`), then the step's stale new blocks take scratch slots.

  Args:
    state: the cache state.
    seq_ids: `i32[n]` (array or list), live ids; -1 = padding.
    num_new_tokens: `i32[n]`, `>= 0`; the new length must stay within
      `max_pages * page_size`.
    evict: static. True: the supply is free + evictable cached slots, the
      eviction order sorted under a `lax.cond` only when the free slots run
      out (its predicate is read by the host on a GPU). "branchless": the
      same supply, the order sorted on every call, no `lax.cond` (no
      device-to-host sync: for a caller that dispatches the next program
      without waiting, such as an engine's burst reservation). False: free
      slots only; requests beyond them are refused (`ok=False`) and no
      cached block is touched (no sort, no `lax.cond`).
    head_of_line: static. True (first come, first served): once a valid
      request does not fit, every later one is refused. False: later requests
      that still fit are admitted (a `lax.scan` over the batch).
      Example: 2 free slots, requests needing `[1, 2, 1]` slots: True admits
      `[True, False, False]`, False admits `[True, False, True]`.
    check: checked mode for this call (`pkvattn.checked`): ids in range,
      unique and live, `num_new_tokens >= 0` and the new length within
      capacity. `None` follows `checked()`; unchecked, such requests are
      refused.

  Returns:
    `(state, ExtendResult(ok, num_new_blocks))`; `num_new_blocks` counts the
    slots taken (normal new blocks + scratch slots). Refused requests leave
    their sequence unchanged (except that a valid one's previous scratch is
    retired).

  Raises:
    ValueError: shapes or dtypes of the arguments, or `evict` not True,
      False or "branchless" (trace time).
    checkify.JaxRuntimeError: (a ValueError) checked mode, a violated
      contract.
  """
  seq_ids, num_new_tokens = map(_checks.as_index_array, (seq_ids, num_new_tokens))
  _check_extend_args(seq_ids, num_new_tokens, evict)
  if _contract.enabled(check):
    _contract.run(_extend_contract, state, seq_ids, num_new_tokens)
  with _contract.unchecked():
    return _extend(state, seq_ids, num_new_tokens, evict=evict,
                   head_of_line=head_of_line)


def _check_extend_args(seq_ids, num_new_tokens, evict=True) -> None:
  _check_ids(seq_ids, "seq_ids")
  _checks.check_int(num_new_tokens, "num_new_tokens")
  _checks.check_shape(num_new_tokens, seq_ids.shape, "num_new_tokens")
  if not (isinstance(evict, bool) or evict == "branchless"):
    raise ValueError("Invalid evict: expected True, False or 'branchless', "
                     f"got {evict!r}")


def _require_live(state: CacheState, seq_ids, name: str, op: str):
  """Checked mode: every non-padding id of `seq_ids` is live."""
  ids = seq_ids.astype(jnp.int32)
  idx = jnp.clip(ids, 0, state.config.max_seqs - 1)
  dead = (ids >= 0) & ~state.seq_live[idx]
  i = _contract.first_true(dead)
  _contract.require(~jnp.any(dead),
                    f"Invalid {name}: {name}[{{}}] = {{}} is not a live "
                    f"sequence ({op} needs live ids)", i, ids[i])


def _extend_contract(state: CacheState, seq_ids, num_new_tokens):
  if seq_ids.shape[0] == 0:
    return
  cfg = state.config
  _contract.require_ids(seq_ids, cfg.max_seqs, "seq_ids")
  _require_live(state, seq_ids, "seq_ids", "extend")
  ids = seq_ids.astype(jnp.int32)
  add = num_new_tokens.astype(jnp.int32)
  old = jnp.where(ids >= 0, state.seq_lens[jnp.clip(ids, 0, cfg.max_seqs - 1)],
                  0)
  bad = (ids >= 0) & ((add < 0) | (add > cfg.max_seq_len - old))
  i = _contract.first_true(bad)
  _contract.require(
      ~jnp.any(bad),
      f"Invalid num_new_tokens: num_new_tokens[{{}}] = {{}} for a sequence of "
      f"{{}} tokens, expected in [0, max_pages * page_size - length] "
      f"(capacity {cfg.max_seq_len})", i, add[i], old[i])


@functools.partial(jax.jit, static_argnames=("evict", "head_of_line"))
def _extend(state, seq_ids, num_new_tokens, *, evict=True, head_of_line=True):
  """`extend` on arrays, unchecked (jitted once per config and statics)."""
  state, inp, plan, need = _extend_prepare(state, seq_ids, num_new_tokens)
  ok, need, _ = _admit(state, inp.valid, need, evict=evict,
                       head_of_line=head_of_line)
  return _extend_apply(state, inp, ok, need, plan, evict=evict)


class _ExtendInputs(NamedTuple):
  idx: jax.Array      # i32[n], clipped rows
  valid: jax.Array    # bool[n], requests that may grow
  new_len: jax.Array  # i32[n], length if granted


def _extend_prepare(state, seq_ids, num_new_tokens):
  """Validates an extend and retires the listed sequences' previous scratch.

  Returns `(state, _ExtendInputs, plan, need i32[n])`.
  """
  cfg = state.config
  _check_extend_args(seq_ids, num_new_tokens)
  num_new_tokens = num_new_tokens.astype(jnp.int32)
  idx, valid = _select(state, seq_ids, want_live=True)
  # The previous step of every valid listed sequence is over: its scratch
  # slots go back to the pool before this step allocates (module docstring).
  state = _retire_scratch(state, idx, valid)
  old_len = state.seq_lens[idx]
  valid &= (num_new_tokens >= 0) & (num_new_tokens <= cfg.max_seq_len - old_len)
  new_len = old_len + jnp.where(valid, num_new_tokens, 0)
  plan = _step_plan(cfg, old_len, new_len)
  need = jnp.where(
      valid, plan.scratch_slots + plan.end_new - plan.normal_first, 0)
  return state, _ExtendInputs(idx, valid, new_len), plan, need


def _extend_apply(state, inp: _ExtendInputs, ok, need, plan, *, evict):
  """Allocates and records the granted extensions (`ok`)."""
  cfg = state.config
  offset = jnp.cumsum(need) - need
  new_mask, ranks = _step_ranks(cfg, plan, ok, offset)
  state, taken = _take_slots(
      state, ranks, jnp.sum(need), jnp.zeros((state.num_slots,), bool),
      evict=evict)
  new_slots = taken[:, :cfg.max_pages]
  rows = state.seq_slots[inp.idx]
  rows = jnp.where(new_mask, new_slots, rows)
  owners = _oob_scatter_index(new_mask, new_slots, state.num_slots)
  row_idx = _oob_scatter_index(ok, inp.idx, cfg.max_seqs)
  state = _replace(
      state,
      slot_refcount=state.slot_refcount.at[owners].add(1, mode="drop"),
      seq_slots=state.seq_slots.at[row_idx].set(rows, mode="drop"),
      seq_lens=state.seq_lens.at[row_idx].set(inp.new_len, mode="drop"),
  )
  state = _set_scratch(state, row_idx, plan, taken)
  return state, ExtendResult(ok=ok, num_new_blocks=need)


extend.__wrapped__ = _extend.__wrapped__


def release(
    state: CacheState,
    seq_ids: jax.Array,  # i32[n]
    *,
    check: bool | None = None,
) -> CacheState:
  """Ends live sequences: drops their block references.

  A block whose last reference goes becomes free (private) or cached
  (published; it stays reusable until evicted, least recently released
  first, a chain's tail before its head: `eviction_order`). Scratch slots of a running step are freed (`finish_step`).
  Padding (-1), out-of-range and dead ids are ignored. An id listed more than
  once is released once (ending is idempotent; refusing it, as the growing
  ops do with duplicates, would leak the sequence).

  Args:
    state: the cache state.
    seq_ids: `i32[n]` (array or list), live ids to end.
    check: checked mode for this call (`pkvattn.checked`): ids -1 or in
      range, and unique. `None` follows `checked()`.

  Returns:
    The new state (`clock` advances by one).

  Raises:
    ValueError: `seq_ids` not an integer vector (trace time).
    checkify.JaxRuntimeError: (a ValueError) checked mode, a violated
      contract.
  """
  seq_ids = _checks.as_index_array(seq_ids)
  _check_ids(seq_ids, "seq_ids")
  if _contract.enabled(check):
    _contract.run(_ids_contract, state, seq_ids, name="seq_ids")
  with _contract.unchecked():
    return _release(state, seq_ids)


def _ids_contract(state: CacheState, seq_ids, *, name: str):
  _contract.require_ids(seq_ids, state.config.max_seqs, name)


@jax.jit
def _release(state, seq_ids):
  """`release` on arrays, unchecked."""
  cfg = state.config
  _check_ids(seq_ids, "seq_ids")
  idx, valid = _select(state, seq_ids, want_live=True, dedupe=True)
  state = _retire_scratch(state, idx, valid)
  rows = state.seq_slots[idx]
  owned = (rows >= 0) & valid[:, None]
  s = _oob_scatter_index(owned, rows, state.num_slots)
  row_idx = _oob_scatter_index(valid, idx, cfg.max_seqs)
  return _replace(
      state,
      slot_refcount=state.slot_refcount.at[s].add(-1, mode="drop"),
      slot_last_use=state.slot_last_use.at[s].set(state.clock, mode="drop"),
      seq_slots=state.seq_slots.at[row_idx].set(-1, mode="drop"),
      seq_lens=state.seq_lens.at[row_idx].set(0, mode="drop"),
      seq_live=state.seq_live.at[row_idx].set(False, mode="drop"),
      seq_scope=state.seq_scope.at[row_idx].set(0, mode="drop"),
      clock=state.clock + 1,
  )


def finish_step(
    state: CacheState,
    seq_ids: jax.Array,  # i32[n]
    *,
    check: bool | None = None,
) -> CacheState:
  """Ends the running step of live sequences: scratch slots return to the pool.

  Call after the step's last layer has run (scratch KV is dead then). The
  sequences keep their normal blocks; their scratch blocks stay -1 in
  `seq_slots` (out of every later query's window, so never read) and
  `page_table` no longer maps them. `extend` and `release` do the same for
  the sequences they are given, so a caller that extends or releases every
  sequence after each step needs no `finish_step`. No-op when scratch is
  inactive or a sequence has no scratch; invalid, padding (-1) or dead ids
  are ignored, duplicated ones act once.

  Args:
    state: the cache state.
    seq_ids: `i32[n]` (array or list), live ids.
    check: checked mode for this call (`pkvattn.checked`): ids -1 or in
      range, and unique. `None` follows `checked()`.

  Returns:
    The new state.

  Raises:
    ValueError: `seq_ids` not an integer vector (trace time).
    checkify.JaxRuntimeError: (a ValueError) checked mode, a violated
      contract.

  Example:
    >>> from pkvattn import cache
    >>> cfg = cache.CacheConfig(num_slots=8, page_size=4, num_layers=2,
    ...                         max_seqs=1, max_pages=4, layer_windows=(3, 3),
    ...                         enable_swa_scratch_reuse=True)
    >>> st = cache.init_cache(cfg)
    >>> st, res = cache.claim_batch(st, jnp.array([0]), jnp.zeros((1, 16), int),
    ...                             jnp.array([16]))
    >>> int(res.num_new_blocks[0])  # blocks 0-2 stale: 2 scratch slots + 1
    3
    >>> st = cache.finish_step(st, jnp.array([0]))
    >>> st.seq_slots[0].tolist(), int(cache.stats(st)["num_used"])
    ([-1, -1, -1, 2], 1)
  """
  seq_ids = _checks.as_index_array(seq_ids)
  _check_ids(seq_ids, "seq_ids")
  if _contract.enabled(check):
    _contract.run(_ids_contract, state, seq_ids, name="seq_ids")
  with _contract.unchecked():
    return _finish_step(state, seq_ids)


@jax.jit
def _finish_step(state, seq_ids):
  """`finish_step` on arrays, unchecked."""
  _check_ids(seq_ids, "seq_ids")
  idx, valid = _select(state, seq_ids, want_live=True, dedupe=True)
  return _retire_scratch(state, idx, valid)


release.__wrapped__ = _release.__wrapped__
finish_step.__wrapped__ = _finish_step.__wrapped__
