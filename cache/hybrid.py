"""Per-window-group slot spaces: KV memory for hybrid sliding-window models.

A model whose layers differ in `window_left` (Gemma 2: local/global 1:1,
Gemma 3: 5 local per global, gpt-oss: 128-token windows and full attention)
gets one slot space per *window group* (layers with equal `window_left`),
TensorRT-LLM's one life cycle per window size. A group slot holds one block
(`page_size` tokens, K and V) of every layer of its group:

  * a global group (`window_left = -1`) keeps every block of a sequence;
  * a sliding group keeps only the blocks a current or future query can see:
    at every `extend`, the blocks wholly before `first_query - window_left`
    (`first_query = num_computed - max_rewind_len`) return to the group's
    pool (their table entries become -1; the kernels never read them), and
    in prefill its stale new blocks take scratch slots
    (`enable_swa_scratch_reuse`, `cache/window.py`) as in an all-SWA cache.

Design: ONE pool buffer, partitioned. Group `g` owns the pool pages
`[group_page_base[g], group_page_base[g] + num_slots_g * L_g * 2)`; its
block of slot `s` in its `j`-th layer is at page
`group_page_base[g] + (s * L_g + j) * 2 (+ 1 for V)` (PER_LAYER within the
group). `page_table` returns each model layer's table with these absolute
indices, so the model, the kernels and the engine see one pool array and
one table per layer, exactly as for a flat cache (no model change, one
donated buffer). The budgets are static (TensorRT-LLM splits its memory per
window size the same way): a byte budget is split between the groups by
`HybridCacheConfig.from_budget`. One shared pool of interchangeable pages
(vLLM's hybrid allocator) would let the split float, but a group's slot
then has a different size per group (L_g layers), which needs equal group
sizes or padding; with static budgets each group is an ordinary
`CacheState` and every rule of `cache/alloc.py` holds per group.

The state is one `CacheState` per group (`HybridCacheState.groups`, group 0
first). The ops keep the groups in step:

  * Sequences are the same in every group (ids, lengths, liveness, scope).
  * Admission (`claim_batch`, `extend`, `fork`) is all or nothing across the
    groups: a request is admitted iff it fits every group. With
    `head_of_line=True` that is the shortest of the groups' admitted prefixes;
    with `head_of_line=False` a `lax.scan` over the batch checks every group
    per request (`_admit_joint`).
  * Prefix reuse. Group 0 is the *anchor* group: a global group if the model
    has one (else the widest window). Its blocks are published and matched
    exactly as in a flat cache (token-verified chain from block 0). A sliding
    group's block is published with its anchor (group 0's slot of the same
    block, at its publication generation) as its parent, so it is matched
    only together with the very same group-0 chain, on its own, without
    needing the earlier sliding blocks (which are released as the sequence
    grows). A prompt reuses `n` blocks iff group 0 matches blocks `[0, n)`
    and every sliding group `g` matches the blocks the first recomputed
    query can see, `[lo_g(n), n)` with `lo_g(n) = max(0, min(n * page_size,
    length - max_rewind_len) - window_left_g) // page_size`; the largest such
    `n` is taken. A prefix whose sliding blocks were released is reused only
    as far as every group can serve it.
  * Released blocks: `extend` drops a sliding group's blocks out of reach;
    published ones stay cached (reusable until evicted), the others become
    free.

This module depends only on jax/numpy (the `cache` package never imports
`pkvattn`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks
from . import _contract
from . import alloc as _alloc
from . import claim as _claim
from . import forking as _forking
from . import publish as _publish
from . import tables as _tables
from . import validate as _validate
from .state import (MAX_POOL_PAGES, NULL_PAGE, CacheConfig, CacheState,
                    init_cache)
from .state import stats as _flat_stats
from .window import FULL_ATTENTION, LayerGroup, PageIndexMode


@dataclasses.dataclass(frozen=True)
class HybridCacheConfig:
  """Static sizes of a cache with one slot space per window group.

  Attributes:
    layer_windows: `window_left` per model layer (-1 = full attention); layers
      with equal values form a group. Groups are ordered global first, then
      by decreasing window (`groups`).
    group_num_slots: slots of each group, in `groups` order. A slot of group
      `g` holds `page_size` tokens of each of its `L_g` layers, K and V.
    page_size, max_seqs, max_pages, hash_ways, hash_buckets,
      enable_swa_scratch_reuse, max_rewind_len: as in `CacheConfig`, for
      every group (scratch applies to the sliding groups).
  """
  layer_windows: tuple[int, ...]
  group_num_slots: tuple[int, ...]
  page_size: int
  max_seqs: int
  max_pages: int
  hash_ways: int = 16
  hash_buckets: int | None = None
  enable_swa_scratch_reuse: bool = False
  max_rewind_len: int = 0

  def __post_init__(self):
    windows = tuple(self.layer_windows)
    if not windows or any(
        not isinstance(w, (int, np.integer)) or w < -1 for w in windows):
      raise ValueError(
          "Invalid layer_windows: expected one int >= -1 per layer, got "
          f"{self.layer_windows!r}")
    object.__setattr__(self, "layer_windows", tuple(int(w) for w in windows))
    slots = tuple(self.group_num_slots)
    if len(slots) != len(self.groups):
      raise ValueError(
          f"Invalid group_num_slots: expected {len(self.groups)} entries (one "
          f"per window group, windows {[g.window_left for g in self.groups]}),"
          f" got {len(slots)}")
    if any(not isinstance(s, (int, np.integer)) or s <= 0 for s in slots):
      raise ValueError(
          f"Invalid group_num_slots: expected positive ints, got {slots!r}")
    object.__setattr__(self, "group_num_slots", tuple(int(s) for s in slots))
    self.group_configs  # noqa: B018 -- validates the shared sizes
    if self.num_pool_pages > MAX_POOL_PAGES:
      raise ValueError(
          f"Invalid group_num_slots: {self.num_pool_pages} pool pages overflow "
          "int32")

  @functools.cached_property
  def groups(self) -> tuple[LayerGroup, ...]:
    """Window groups: global first, then by decreasing `window_left`."""
    members: dict[int, list[int]] = {}
    for layer, w in enumerate(self.layer_windows):
      members.setdefault(w, []).append(layer)
    order = sorted(members, key=lambda w: (w != FULL_ATTENTION, -w))
    return tuple(LayerGroup(w, tuple(members[w])) for w in order)

  @functools.cached_property
  def group_configs(self) -> tuple[CacheConfig, ...]:
    """The `CacheConfig` of each group's slot space."""
    return tuple(
        CacheConfig(
            num_slots=n, page_size=self.page_size, num_layers=g.num_layers,
            max_seqs=self.max_seqs, max_pages=self.max_pages,
            hash_ways=self.hash_ways, hash_buckets=self.hash_buckets,
            layer_windows=(g.window_left,) * g.num_layers,
            enable_swa_scratch_reuse=self.enable_swa_scratch_reuse,
            max_rewind_len=self.max_rewind_len)
        for g, n in zip(self.groups, self.group_num_slots))

  @property
  def num_layers(self) -> int:
    return len(self.layer_windows)

  @property
  def num_groups(self) -> int:
    return len(self.groups)

  @property
  def max_seq_len(self) -> int:
    return self.max_pages * self.page_size

  @functools.cached_property
  def layer_group(self) -> tuple[int, ...]:
    """The group of each model layer."""
    out = [0] * self.num_layers
    for gid, g in enumerate(self.groups):
      for layer in g.layers:
        out[layer] = gid
    return tuple(out)

  @functools.cached_property
  def layer_index(self) -> tuple[int, ...]:
    """Each model layer's index within its group."""
    out = [0] * self.num_layers
    for g in self.groups:
      for j, layer in enumerate(g.layers):
        out[layer] = j
    return tuple(out)

  @functools.cached_property
  def group_page_base(self) -> tuple[int, ...]:
    """First pool page of each group."""
    base, out = 0, []
    for g, n in zip(self.groups, self.group_num_slots):
      out.append(base)
      base += n * g.num_layers * 2
    return tuple(out)

  @property
  def num_pool_pages(self) -> int:
    """Pages of the pool: `sum_g group_num_slots[g] * L_g * 2`."""
    return sum(n * g.num_layers * 2
               for g, n in zip(self.groups, self.group_num_slots))

  def flat_pool_pages(self, num_slots: int) -> int:
    """Pages a flat (one slot space) pool of `num_slots` slots takes."""
    return num_slots * self.num_layers * 2

  @classmethod
  def from_budget(cls, num_slots: int, layer_windows, *, page_size: int,
                  max_seqs: int, max_pages: int, max_num_tokens: int | None = None,
                  **kw) -> "HybridCacheConfig":
    """Splits the pages of a flat `num_slots`-slot pool between the groups.

    Every group gets the slots its sequences can use at most, and the global
    groups then share what is left (so the same bytes hold more tokens):
    a sliding group with window `w` needs per sequence at most
    `cdiv(w + 1 + max_rewind_len, page_size) + 1` blocks in decode, plus the
    prompts being prefilled (`max_num_tokens` tokens per step, default
    `max_pages * page_size`, held in full by a step without scratch), and
    never more than `num_slots`. TensorRT-LLM weighs its per-window pools
    the same way (window size x layers).

    Args:
      num_slots: slots of the flat pool this replaces (its bytes are the
        budget).
      layer_windows: `window_left` per layer.
      page_size, max_seqs, max_pages: as in `CacheConfig`.
      max_num_tokens: tokens one step may prefill; None = one whole sequence.
      **kw: the other `HybridCacheConfig` fields.

    Raises:
      ValueError: the budget cannot give every group one sequence's worth.
    """
    probe = cls(tuple(layer_windows), (1,) * len(set(layer_windows)),
                page_size=page_size, max_seqs=max_seqs, max_pages=max_pages,
                **kw)
    rewind = kw.get("max_rewind_len", 0)
    step_tokens = max_num_tokens or max_pages * page_size
    budget = num_slots * probe.num_layers  # layer-blocks
    sliding = {}
    for gid, g in enumerate(probe.groups):
      if g.window_left == FULL_ATTENTION:
        continue
      per_seq = -(-(g.window_left + 1 + rewind) // page_size) + 1
      want = max_seqs * per_seq + -(-step_tokens // page_size) + max_pages
      sliding[gid] = min(num_slots, want)
    left = budget - sum(sliding[g] * probe.groups[g].num_layers
                        for g in sliding)
    global_layers = sum(g.num_layers for gid, g in enumerate(probe.groups)
                        if gid not in sliding)
    slots = []
    for gid, g in enumerate(probe.groups):
      slots.append(sliding[gid] if gid in sliding
                   else left // max(global_layers, 1))
    if min(slots) < max_pages:
      raise ValueError(
          f"Invalid num_slots: {num_slots} flat slots split into {slots} per "
          f"group leave a group fewer than max_pages={max_pages} slots")
    return cls(tuple(layer_windows), tuple(slots), page_size=page_size,
               max_seqs=max_seqs, max_pages=max_pages, **kw)


def _static():
  return dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCacheState:
  """One `CacheState` per window group (`config.groups` order)."""
  config: HybridCacheConfig = _static()
  groups: tuple[CacheState, ...]

  @property
  def seq_lens(self) -> jax.Array:
    """`i32[max_seqs]`, tokens reserved (the same in every group)."""
    return self.groups[0].seq_lens

  @property
  def seq_live(self) -> jax.Array:
    return self.groups[0].seq_live

  @property
  def seq_scope(self) -> jax.Array:
    return self.groups[0].seq_scope


def init_hybrid_cache(config: HybridCacheConfig) -> HybridCacheState:
  """An empty per-window-group cache (`init_cache` for each group)."""
  if not isinstance(config, HybridCacheConfig):
    raise ValueError(
        "Invalid config: expected a HybridCacheConfig, got "
        f"{type(config).__name__}")
  return HybridCacheState(config, tuple(init_cache(c)
                                        for c in config.group_configs))


# ------------------------------------------------------------------ helpers


def _sliding(cfg: HybridCacheConfig):
  """`(group id, window_left)` of the sliding groups."""
  return [(gid, g.window_left) for gid, g in enumerate(cfg.groups)
          if g.window_left != FULL_ATTENTION]


def _drop_stale(state: CacheState, idx, valid, first_query, window_left):
  """Releases a sliding group's blocks no query at `>= first_query` can see.

  Block `b` goes iff `(b + 1) * page_size <= first_query - window_left`.
  A published block whose last reference goes becomes cached (LRU clock of
  this call), any other one free; its table entry becomes -1.
  """
  cfg = state.config
  ps = cfg.page_size
  cut = jnp.maximum(first_query - window_left, 0) // ps
  rows = state.seq_slots[idx]
  pos = jnp.arange(cfg.max_pages, dtype=jnp.int32)[None, :]
  drop = valid[:, None] & (pos < cut[:, None]) & (rows >= 0)
  s = _alloc._oob_scatter_index(drop, rows, state.num_slots)
  row_idx = _alloc._oob_scatter_index(valid, idx, cfg.max_seqs)
  return _alloc._replace(
      state,
      slot_refcount=state.slot_refcount.at[s].add(-1, mode="drop"),
      slot_last_use=state.slot_last_use.at[s].set(state.clock, mode="drop"),
      seq_slots=state.seq_slots.at[row_idx].set(
          jnp.where(drop, NULL_PAGE, rows), mode="drop"),
      clock=state.clock + 1,
  )


def _admit_joint(states, valid, needs, cands=None, matcheds=None, *,
                 evict=True, head_of_line=True):
  """Requests admitted by every group (all or nothing across the groups).

  Per group the rule is `alloc._admit`'s. `head_of_line=True`: each group
  admits the longest prefix of the valid requests that fits it, so the
  requests fitting every group are the shortest of those prefixes.
  `head_of_line=False`: request `r` is admitted iff it fits every group
  together with the requests admitted before it (a `lax.scan`, carrying each
  group's spent supply and protected reused blocks).

  Returns `ok bool[n]`.
  """
  n = valid.shape[0]
  G = len(states)
  if cands is None:
    cands = [jnp.zeros((n, 0), jnp.int32)] * G
    matcheds = [jnp.zeros((n, 0), bool)] * G
  if head_of_line:
    ok = valid
    for st, need, cand, matched in zip(states, needs, cands, matcheds):
      ok_g, _, _ = _alloc._admit(st, valid, need, evict=evict,
                                 head_of_line=True, cand=cand, matched=matched)
      ok = ok & ok_g
    return ok
  budgets, takes = [], []
  for st, cand, matched in zip(states, cands, matcheds):
    free, evictable = _alloc._supply(st, jnp.zeros((st.num_slots,), bool))
    budget = jnp.sum(free, dtype=jnp.int32)
    if evict:
      budget += jnp.sum(evictable, dtype=jnp.int32)
    budgets.append(budget)
    if evict and cand.shape[1] > 0:
      takes.append(matched & valid[:, None] & evictable[jnp.clip(cand, 0)])
    else:
      takes.append(jnp.zeros(cand.shape, bool))
  needs = [jnp.where(valid, nd, 0).astype(jnp.int32) for nd in needs]

  def step(carry, x):
    spent, prot = carry
    v, nds, cs, ts = x
    fits, extras = v, []
    for g in range(G):
      extra = jnp.sum(ts[g] & ~prot[g][jnp.clip(cs[g], 0)], dtype=jnp.int32)
      extras.append(extra)
      fits &= spent[g] + nds[g] + extra <= budgets[g]
    spent = tuple(spent[g] + jnp.where(fits, nds[g] + extras[g], 0)
                  for g in range(G))
    prot = tuple(
        prot[g].at[_alloc._oob_scatter_index(
            ts[g] & fits, cs[g], prot[g].shape[0])].set(True, mode="drop")
        for g in range(G))
    return (spent, prot), fits

  init = (tuple(jnp.zeros((), jnp.int32) for _ in range(G)),
          tuple(jnp.zeros((st.num_slots,), bool) for st in states))
  _, ok = jax.lax.scan(step, init, (valid, tuple(needs), tuple(cands),
                                    tuple(takes)))
  return ok


def _protected(state: CacheState, ok, cand, matched):
  return jnp.zeros((state.num_slots,), bool).at[
      _alloc._oob_scatter_index(matched & ok[:, None], cand,
                                state.num_slots)].set(True, mode="drop")


def _check_state(state) -> None:
  if not isinstance(state, HybridCacheState):
    raise ValueError(
        f"Invalid state: expected a HybridCacheState, got "
        f"{type(state).__name__}")


# ---------------------------------------------------------------------- ops


def claim_batch(state: HybridCacheState, seq_ids, tokens, lengths,
                reuse_scope=None, *, evict: bool = True,
                head_of_line: bool = True, check: bool | None = None):
  """`cache.claim_batch` for a per-window-group cache.

  Arguments and rules as `cache.claim_batch`; reuse per the module docstring
  (group 0's chain, each sliding group's visible blocks). Returns `(state,
  ClaimResult)` whose `num_new_blocks` is `i32[n, num_groups]` (slots taken
  in each group).
  """
  _check_state(state)
  seq_ids, tokens, lengths = map(_checks.as_index_array,
                                 (seq_ids, tokens, lengths))
  if reuse_scope is not None:
    reuse_scope = _checks.as_index_array(reuse_scope)
  _alloc._check_token_batch(seq_ids, tokens, lengths)
  if _contract.enabled(check):
    _contract.run(_claim._claim_contract, state.groups[0], seq_ids, tokens,
                  lengths)
  with _contract.unchecked():
    return _claim_batch(state, seq_ids, tokens, lengths, reuse_scope,
                        evict=evict, head_of_line=head_of_line)


def _reuse_floor(n_blocks, lengths, window_left, page_size, max_rewind_len):
  """`lo_g(n)`: the first block a query at or after the reuse point sees."""
  first_query = jnp.minimum(n_blocks * page_size, lengths - max_rewind_len)
  return jnp.maximum(first_query - window_left, 0) // page_size


@functools.partial(jax.jit, static_argnames=("evict", "head_of_line"))
def _claim_batch(state, seq_ids, tokens, lengths, reuse_scope=None, *,
                 evict=True, head_of_line=True):
  cfg = state.config
  ps = cfg.page_size
  groups = state.groups
  g0 = groups[0]
  inp = _claim._claim_inputs(g0, seq_ids, tokens, lengths, reuse_scope)
  cand0, ver0 = _claim._claim_lookup(g0, inp)
  nbt = cand0.shape[1]
  pos = jnp.arange(nbt, dtype=jnp.int32)[None, :]
  in_reach = pos < inp.matchable[:, None]
  matched0 = _alloc._leading_run(ver0 & in_reach) & inp.valid[:, None]
  reused = jnp.sum(matched0, axis=1, dtype=jnp.int32)
  cands, matcheds = [cand0], [matched0]
  sliding = [(gid, w) for gid, w in _sliding(cfg) if gid > 0]
  if nbt > 0 and sliding:
    anchor = (jnp.where(matched0, cand0, -1),
              g0.slot_gen[jnp.clip(cand0, 0)])
    nn = jnp.arange(nbt + 1, dtype=jnp.int32)[None, :]  # reuse lengths
    feasible = nn <= reused[:, None]
    found = {}
    for gid, w in sliding:
      cand, ver = _claim._claim_lookup(groups[gid], inp, anchor)
      found[gid] = cand
      cs = jnp.concatenate([jnp.zeros((ver.shape[0], 1), jnp.int32),
                            jnp.cumsum(ver.astype(jnp.int32), axis=1)], axis=1)
      lo = _reuse_floor(nn, inp.lengths[:, None], w, ps, cfg.max_rewind_len)
      have = cs[:, :] - jnp.take_along_axis(cs, lo, axis=1)
      feasible &= have == nn - lo
    reused = jnp.max(jnp.where(feasible, nn, 0), axis=1).astype(jnp.int32)
    cands, matcheds = [cand0], [matched0 & (pos < reused[:, None])]
    for gid, w in sliding:
      lo = _reuse_floor(reused, inp.lengths, w, ps, cfg.max_rewind_len)
      cands.append(found[gid])
      matcheds.append((pos >= lo[:, None]) & (pos < reused[:, None])
                      & inp.valid[:, None])
  else:  # no whole block (nbt == 0) or no sliding group: nothing to align
    for _ in groups[1:]:
      cands.append(cand0)
      matcheds.append(jnp.zeros_like(matched0) if sliding else matched0)
  plans, needs = [], []
  for st in groups:
    plan, need = _claim._claim_need(st.config, inp, reused)
    plans.append(plan)
    needs.append(need)
  ok = _admit_joint(groups, inp.valid, needs, cands, matcheds, evict=evict,
                    head_of_line=head_of_line)
  new_groups, news, results = [], [], []
  for st, plan, need, cand, matched in zip(groups, plans, needs, cands,
                                           matcheds):
    need = jnp.where(ok, need, 0)
    st, res = _claim._claim_apply(st, inp, ok, need, plan,
                                  _protected(st, ok, cand, matched), cand,
                                  matched, reused, evict=evict)
    new_groups.append(st)
    news.append(res.num_new_blocks)
    results.append(res)
  return (dataclasses.replace(state, groups=tuple(new_groups)),
          results[0]._replace(num_new_blocks=jnp.stack(news, axis=1)))


def extend(state: HybridCacheState, seq_ids, num_new_tokens, *,
           num_computed=None, evict: bool = True, head_of_line: bool = True,
           check: bool | None = None):
  """`cache.extend` for a per-window-group cache.

  First, every sliding group releases the blocks of the listed valid
  sequences that no query at or after `num_computed - max_rewind_len` can
  see (module docstring); then the growth is admitted across the groups
  (all or nothing) and allocated in each.

  Args:
    state, seq_ids, num_new_tokens, evict, head_of_line, check: as
      `cache.extend`.
    num_computed: `i32[n]` or None, tokens of each sequence whose KV is
      written (no later query is before it, up to `max_rewind_len`); None =
      the current lengths (the step `extend` starts queries only its new
      tokens). Clipped to `[0, length]`.

  Returns:
    `(state, ExtendResult)` with `num_new_blocks i32[n, num_groups]`. A
    refused request keeps its blocks, except the out-of-reach ones released
    first (and, as for a flat cache, its previous step's scratch).
  """
  _check_state(state)
  seq_ids, num_new_tokens = map(_checks.as_index_array,
                                (seq_ids, num_new_tokens))
  _alloc._check_extend_args(seq_ids, num_new_tokens, evict)
  if num_computed is not None:
    num_computed = _checks.as_index_array(num_computed)
    _checks.check_int(num_computed, "num_computed")
    _checks.check_shape(num_computed, seq_ids.shape, "num_computed")
  if _contract.enabled(check):
    _contract.run(_alloc._extend_contract, state.groups[0], seq_ids,
                  num_new_tokens)
  with _contract.unchecked():
    return _extend(state, seq_ids, num_new_tokens, num_computed, evict=evict,
                   head_of_line=head_of_line)


@functools.partial(jax.jit, static_argnames=("evict", "head_of_line"))
def _extend(state, seq_ids, num_new_tokens, num_computed=None, *, evict=True,
            head_of_line=True):
  cfg = state.config
  groups = list(state.groups)
  idx, valid = _alloc._select(groups[0], seq_ids.astype(jnp.int32),
                              want_live=True)
  length = groups[0].seq_lens[idx]
  done = length if num_computed is None else jnp.clip(
      num_computed.astype(jnp.int32), 0, length)
  for gid, w in _sliding(cfg):
    groups[gid] = _drop_stale(groups[gid], idx, valid,
                              done - cfg.max_rewind_len, w)
  preps = [_alloc._extend_prepare(st, seq_ids, num_new_tokens)
           for st in groups]
  ok = _admit_joint([p[0] for p in preps], preps[0][1].valid,
                    [p[3] for p in preps], evict=evict,
                    head_of_line=head_of_line)
  new_groups, news = [], []
  for st, inp, plan, need in preps:
    st, res = _alloc._extend_apply(st, inp, ok, jnp.where(ok, need, 0), plan,
                                   evict=evict)
    new_groups.append(st)
    news.append(res.num_new_blocks)
  return (dataclasses.replace(state, groups=tuple(new_groups)),
          _alloc.ExtendResult(ok=ok, num_new_blocks=jnp.stack(news, axis=1)))


def commit(state: HybridCacheState, seq_ids, tokens, lengths, *,
           check: bool | None = None) -> HybridCacheState:
  """`cache.commit` for a per-window-group cache.

  Group 0 publishes as a flat cache does; a sliding group publishes each of
  its held full blocks whose group-0 block is published, anchored to it
  (module docstring).
  """
  _check_state(state)
  seq_ids, tokens, lengths = map(_checks.as_index_array,
                                 (seq_ids, tokens, lengths))
  _alloc._check_token_batch(seq_ids, tokens, lengths)
  if _contract.enabled(check):
    _contract.run(_publish._commit_contract, state.groups[0], seq_ids, lengths)
  with _contract.unchecked():
    return _commit(state, seq_ids, tokens, lengths)


@jax.jit
def _commit(state, seq_ids, tokens, lengths):
  groups = list(state.groups)
  g0 = _publish._commit_impl(groups[0], seq_ids, tokens, lengths)
  groups[0] = g0
  if len(groups) > 1:
    idx, _ = _alloc._select(g0, seq_ids.astype(jnp.int32), want_live=True)
    own = g0.seq_slots[idx]
    pub = (own >= 0) & g0.slot_published[jnp.clip(own, 0)]
    anchor = (jnp.where(pub, own, -1), g0.slot_gen[jnp.clip(own, 0)])
    for gid in range(1, len(groups)):
      groups[gid] = _publish._commit_impl(groups[gid], seq_ids, tokens,
                                          lengths, anchor=anchor)
  return dataclasses.replace(state, groups=tuple(groups))


def release(state: HybridCacheState, seq_ids, *,
            check: bool | None = None) -> HybridCacheState:
  """`cache.release` in every group."""
  _check_state(state)
  return dataclasses.replace(state, groups=tuple(
      _alloc.release(st, seq_ids, check=check) for st in state.groups))


def finish_step(state: HybridCacheState, seq_ids, *,
                check: bool | None = None) -> HybridCacheState:
  """`cache.finish_step` in every group."""
  _check_state(state)
  return dataclasses.replace(state, groups=tuple(
      _alloc.finish_step(st, seq_ids, check=check) for st in state.groups))


def fork(state: HybridCacheState, parent_ids, child_ids, *,
         head_of_line: bool = True, check: bool | None = None):
  """`cache.fork` for a per-window-group cache.

  The child shares every block its parent holds in each group (a sliding
  group's released blocks stay -1) and gets a copy of the partial last block
  in each group. `ForkResult.src_pages` / `dst_pages` are pool pages
  (`i32[n * num_layers * 2]`, -1 = none) for `pkvattn.copy_pages`.
  """
  _check_state(state)
  parent_ids, child_ids = map(_checks.as_index_array, (parent_ids, child_ids))
  _forking._check_fork_args(parent_ids, child_ids)
  if _contract.enabled(check):
    _contract.run(_forking._fork_contract, state.groups[0], parent_ids,
                  child_ids)
  with _contract.unchecked():
    return _fork(state, parent_ids, child_ids, head_of_line=head_of_line)


@functools.partial(jax.jit, static_argnames=("head_of_line",))
def _fork(state, parent_ids, child_ids, *, head_of_line=True):
  cfg = state.config
  preps = [_forking._fork_prepare(st, parent_ids, child_ids)
           for st in state.groups]
  ok = _admit_joint(state.groups, preps[0][0].valid, [p[1] for p in preps],
                    head_of_line=head_of_line)
  n = parent_ids.shape[0]
  new_groups, srcs, dsts = [], [], []
  for gid, (st, (inp, need)) in enumerate(zip(state.groups, preps)):
    st, res = _forking._fork_apply(st, inp, ok, jnp.where(ok, need, 0))
    base = cfg.group_page_base[gid]
    # Explicit width (K and V of each of the group's layers): `reshape(n,
    # -1)` cannot infer it for an empty batch.
    width = 2 * st.config.num_layers
    srcs.append(jnp.where(res.src_pages >= 0, res.src_pages + base,
                          -1).reshape(n, width))
    dsts.append(jnp.where(res.dst_pages >= 0, res.dst_pages + base,
                          -1).reshape(n, width))
    new_groups.append(st)
  return (dataclasses.replace(state, groups=tuple(new_groups)),
          _forking.ForkResult(ok=ok,
                            src_pages=jnp.concatenate(srcs, 1).reshape(-1),
                            dst_pages=jnp.concatenate(dsts, 1).reshape(-1)))


def page_table(state: HybridCacheState, seq_ids, layer, split: bool = True,
               mode=PageIndexMode.PER_LAYER, *, check: bool | None = None):
  """`cache.page_table` for a per-window-group cache: model layer `layer`'s
  table with absolute pool pages (module docstring). `layer` may be traced
  (e.g. under `jax.vmap` over the layers); checked mode (`check`, as in
  `cache.page_table`) checks it against the model's `num_layers`. SHARED
  mode is refused (a slot id means nothing without its group).

  Raises:
    ValueError: as `cache.page_table`, and SHARED mode.
    checkify.JaxRuntimeError: (a ValueError) checked mode, an array `layer`
      out of range.
  """
  _check_state(state)
  cfg = state.config
  if mode in (PageIndexMode.SHARED, "shared"):
    raise ValueError(
        "Invalid mode: expected PageIndexMode.PER_LAYER for a per-window-group "
        "cache (a SHARED slot id has no group), got SHARED")
  if isinstance(layer, (int, np.integer)):
    if not 0 <= layer < cfg.num_layers:
      raise ValueError(
          f"Invalid layer: expected 0 <= layer < {cfg.num_layers}, got {layer}")
    gid = cfg.layer_group[layer]
    t = _tables.page_table(state.groups[gid], seq_ids, cfg.layer_index[layer],
                           split=split)
    return _offset(t, cfg.group_page_base[gid], split)
  ok = _tables.run_layer_contract(layer, cfg.num_layers, check)

  def body():
    layer_ = jnp.asarray(layer, jnp.int32)
    group_of = jnp.asarray(np.array(cfg.layer_group, np.int32))[layer_]
    index_of = jnp.asarray(np.array(cfg.layer_index, np.int32))[layer_]
    out = None
    for gid, g in enumerate(cfg.groups):
      t = _tables.page_table(state.groups[gid], seq_ids,
                             jnp.clip(index_of, 0, g.num_layers - 1),
                             split=split, check=False)
      t = _offset(t, cfg.group_page_base[gid], split)
      out = t if out is None else jnp.where(group_of == gid, t, out)
    return out

  with _contract.unchecked():
    return _tables.guard_table(ok, body)


def _offset(table, base, split):
  step = base if split else base // 2
  return jnp.where(table >= 0, table + step, NULL_PAGE)


def layer_page_tables(state: HybridCacheState, seq_ids):
  """`i32[num_layers, n, 2, max_pages]`: every layer's split table."""
  cfg = state.config
  per_group = []
  for gid, g in enumerate(cfg.groups):
    t = jax.vmap(lambda j, st=state.groups[gid]: _tables.page_table(
        st, seq_ids, j, split=True, check=False))(jnp.arange(g.num_layers, dtype=jnp.int32))
    per_group.append(_offset(t, cfg.group_page_base[gid], True))
  order = np.argsort(np.concatenate([np.array(g.layers) for g in cfg.groups]))
  return jnp.concatenate(per_group, axis=0)[order]


@jax.jit
def stats(state: HybridCacheState) -> dict[str, jax.Array]:
  """`cache.stats` per group: the slot counters are `i32[num_groups]`
  (`num_slots`, `num_free`, `num_used`, `num_cached`, `num_published`,
  `num_scratch`); `num_live_seqs`, `num_lookups`, `num_hits`, `hit_rate`
  are scalars (group 0's: every group reuses the same blocks)."""
  per = [_flat_stats(st) for st in state.groups]
  out = {k: jnp.stack([p[k] for p in per])
         for k in ("num_slots", "num_free", "num_used", "num_cached",
                   "num_published", "num_scratch")}
  for k in ("num_live_seqs", "num_lookups", "num_hits", "hit_rate"):
    out[k] = per[0][k]
  return out


def validate(state: HybridCacheState) -> None:
  """Host check of every group's invariants (`cache.validate`, with a
  sliding group's released blocks allowed) and that the groups hold the same
  sequences (ids, lengths, scopes).

  Raises:
    CacheInvariantError: with one line per broken invariant.
  """
  _check_state(state)
  errors = []
  for gid, st in enumerate(state.groups):
    sliding = state.config.groups[gid].window_left != FULL_ATTENTION
    try:
      _validate.validate(
          st, allow_window_holes=sliding,
          anchor_num_slots=state.groups[0].num_slots if gid else None)
    except _validate.CacheInvariantError as e:
      errors.append(f"group {gid}: {e}")
  g0 = jax.device_get(state.groups[0])
  for gid, st in enumerate(state.groups[1:], 1):
    st = jax.device_get(st)
    for name in ("seq_live", "seq_lens", "seq_scope"):
      if not np.array_equal(getattr(st, name), getattr(g0, name)):
        errors.append(f"group {gid}: {name} differs from group 0")
  if errors:
    raise _validate.CacheInvariantError("\n".join(errors))
