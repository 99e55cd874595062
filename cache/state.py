"""The functional KV-cache state: a static config and a pytree of device arrays.

Pool layout (TensorRT-LLM's PER_LAYER mode). A **slot** holds one block
(`page_size` tokens) of every layer, K and V. The model's KV pool is
`[num_slots * num_layers * 2, page_size, num_kv_heads, head_dim]`, and block
`slot` of layer `layer` lives at pool page `(slot * num_layers + layer) * 2`
(K) and `+ 1` (V). `cache.page_table` turns the slot table of a sequence into
these per-layer indices, so the kernels never see layers.

Slot life cycle:
  free    refcount 0, not published: allocated first, lowest index first.
  used    refcount > 0: held by live sequences (shared only when full).
  cached  refcount 0, published: its key and tokens stay in the prefix cache
          until the slot is evicted, by `(slot_last_use ascending, slot_depth
          descending, index ascending)`: least recently released first, and
          of one released chain its tail first (vLLM frees a request's
          blocks in reverse order for the same reason): evicting a chain's
          head would orphan every block after it, since a prompt only reuses
          a leading run of blocks.
Conservation: free + used + cached = num_slots.

SWA scratch reuse (`cache/window.py`). With
`enable_swa_scratch_reuse=True` and every layer sliding-window, `claim_batch`
and `extend` give the step's *scratch* blocks (new blocks out of the window of
every future query) to scratch slots: a scratch slot's `num_layers` sub-pages
serve `num_layers` scratch blocks of the layer now running. They are recorded
in `seq_scratch_*`, count as used (refcount 1, owner: the sequence), are never
published, and return to the pool at the sequence's next `extend`, at
`finish_step` or at `release`. Scratch blocks are `NULL_PAGE` in `seq_slots`,
during the step and after it. See `CacheConfig.swa_scratch_active` for mixed
models.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import jax
import jax.numpy as jnp

from . import _checks
from . import hashing

NULL_PAGE: Final = -1  # table entry with no block
NULL_SEQ: Final = -1   # padding entry in seq_ids: no request
# Most pages a pool may hold: page ids (num_slots * num_layers * 2 of them)
# are int32.
MAX_POOL_PAGES: Final = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """Static sizes of the cache state (hashable; a jit static argument).

  Attributes:
    num_slots: slots in the pool; each holds one block of every layer, K and V.
    page_size: tokens per block.
    num_layers: layers sharing a slot.
    max_seqs: sequence ids are `0 .. max_seqs - 1`.
    max_pages: blocks per sequence; the capacity of one sequence is
      `max_pages * page_size` tokens.
    hash_ways: entries per bucket of the prefix-cache hash table. A block whose
      bucket is full is simply not published (never unsafe; the rest of its
      sequence's chain is not published either). With `hash_ways >=
      num_slots` no bucket can overflow.
    hash_buckets: buckets (a power of two); `None` picks the smallest power of
      two `>= 4 * num_slots / hash_ways` (load factor <= 1/4: with 16 ways, a
      bucket overflows with probability ~1e-6 even when every slot is
      published).
    layer_windows: `window_left` per layer (key `j` visible to the query at
      `p` iff `p - window_left <= j <= p`), -1 = full attention; `None` = all
      layers full attention.
    enable_swa_scratch_reuse: SWA scratch reuse: `claim_batch` and
      `extend` put the step's new blocks that no future query can see into
      scratch slots (`cache/window.py`). Only takes effect when
      `swa_scratch_active` (every layer sliding-window).
    max_rewind_len: tokens at the end of each step that may be rolled back
      and re-queried (speculative drafts); blocks they can see are never
      scratch. `>= 0`.

  Mixed models (some layers global). One slot space serves every layer: a slot
  holds one block of every layer. A block that is stale for the SWA layers is
  still needed by the global layers, so its slot must stay and scratch would
  save nothing; the scratch blocks of a step are therefore the blocks that
  EVERY layer treats as scratch. With a global layer there are none. Such
  models want one slot space per window group instead
  (`HybridCacheConfig`, `cache/hybrid.py`), where a sliding group keeps only
  its window and takes scratch of its own. With several SWA windows in one
  space, the widest one decides (`scratch_window_left`), and the scratch
  slot's sub-pages are all `num_layers` layer pages of a slot.
  """
  num_slots: int
  page_size: int
  num_layers: int
  max_seqs: int
  max_pages: int
  hash_ways: int = 16
  hash_buckets: int | None = None
  layer_windows: tuple[int, ...] | None = None
  enable_swa_scratch_reuse: bool = False
  max_rewind_len: int = 0

  def __post_init__(self):
    for name in ("num_slots", "page_size", "num_layers", "max_seqs",
                 "max_pages", "hash_ways"):
      _checks.check_positive_int(getattr(self, name), name)
    _checks.check_power_of_two(self.hash_buckets, "hash_buckets")
    if self.layer_windows is not None:
      if len(self.layer_windows) != self.num_layers:
        raise ValueError(
            f"Invalid layer_windows: expected {self.num_layers} entries (one "
            f"per layer), got {len(self.layer_windows)}")
      if any(w < -1 for w in self.layer_windows):
        raise ValueError(
            "Invalid layer_windows: expected window_left >= -1 per layer, got "
            f"{self.layer_windows}")
    if self.max_rewind_len < 0:
      raise ValueError(
          f"Invalid max_rewind_len: expected >= 0, got {self.max_rewind_len}")
    total = self.num_slots * self.num_layers * 2
    if total > MAX_POOL_PAGES:
      raise ValueError(
          f"Invalid num_slots: expected num_slots * num_layers * 2 < 2**31 "
          f"pool pages (int32 page ids), got {self.num_slots} * "
          f"{self.num_layers} * 2 = {total}")

  @property
  def swa_scratch_active(self) -> bool:
    """Scratch reuse enabled and possible: every layer sliding-window."""
    return bool(self.enable_swa_scratch_reuse
                and self.layer_windows is not None
                and all(w >= 0 for w in self.layer_windows))

  @property
  def scratch_window_left(self) -> int:
    """`window_left` that decides scratch (the widest window), -1 = none."""
    return max(self.layer_windows) if self.swa_scratch_active else -1

  @property
  def max_scratch_slots(self) -> int:
    """Width of `seq_scratch_slots`: `cdiv(max_pages, num_layers)`."""
    return -(-self.max_pages // self.num_layers)

  @property
  def num_buckets(self) -> int:
    return hashing.num_buckets(self.num_slots, self.hash_ways,
                               self.hash_buckets)

  @property
  def max_seq_len(self) -> int:
    """Capacity of one sequence in tokens."""
    return self.max_pages * self.page_size

  @property
  def num_pool_pages(self) -> int:
    """Pages of the multi-layer KV pool: `num_slots * num_layers * 2`."""
    return self.num_slots * self.num_layers * 2


def _static():
  return dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheState:
  """Device-side cache bookkeeping; every function maps state -> state.

  Fields are device arrays except `config` (static). Invariants are checked
  host-side by `cache.validate`.
  """
  config: CacheConfig = _static()
  # --- per slot ---
  slot_refcount: jax.Array    # i32[num_slots], live (sequence, block) owners
  slot_last_use: jax.Array    # i32[num_slots], clock of the last release (LRU)
  slot_published: jax.Array   # bool[num_slots], in the prefix cache
  slot_key: jax.Array         # u32[num_slots, 2], chained key when published
  slot_tokens: jax.Array      # i32[num_slots, page_size], tokens when published
  slot_scope: jax.Array       # i32[num_slots], reuse_scope when published
  slot_parent: jax.Array      # i32[num_slots], parent block's slot, -1 = first
  slot_parent_gen: jax.Array  # i32[num_slots], parent's slot_gen at publication
  slot_gen: jax.Array         # i32[num_slots], bumped on every publication
  slot_depth: jax.Array       # i32[num_slots], block index in its sequence at
                              # publication (0 = first block): eviction order
  slot_hash_pos: jax.Array    # i32[num_slots], flat index in hash_table, -1
  # --- prefix-cache index: set-associative table key -> slot ---
  hash_table: jax.Array       # i32[num_buckets, hash_ways], slot or -1
  # --- per sequence ---
  seq_slots: jax.Array        # i32[max_seqs, max_pages], slot per block or -1
  seq_lens: jax.Array         # i32[max_seqs], tokens reserved (claim + extend)
  seq_live: jax.Array         # bool[max_seqs]
  seq_scope: jax.Array        # i32[max_seqs], reuse_scope of the sequence
  # --- SWA scratch of the running step (all -1 / 0 when scratch is off) ---
  seq_scratch_slots: jax.Array  # i32[max_seqs, max_scratch_slots], slot or -1
  seq_scratch_first: jax.Array  # i32[max_seqs], first scratch block (absolute)
  seq_scratch_count: jax.Array  # i32[max_seqs], scratch blocks, 0 = none
  # --- counters ---
  clock: jax.Array            # i32[], bumped by every release
  num_lookups: jax.Array      # i32[], prefix blocks looked up (admitted claims)
  num_hits: jax.Array         # i32[], of those, blocks reused

  @property
  def num_slots(self) -> int:
    return self.slot_refcount.shape[0]

  @property
  def page_size(self) -> int:
    return self.slot_tokens.shape[1]


def init_cache(config: CacheConfig) -> CacheState:
  """Returns an empty cache: every slot free, no sequence live.

  Example:
    >>> cfg = CacheConfig(num_slots=16, page_size=4, num_layers=2, max_seqs=4,
    ...                   max_pages=8)
    >>> state = init_cache(cfg)
    >>> state.seq_slots.shape
    (4, 8)
  """
  if not isinstance(config, CacheConfig):
    raise ValueError(
        f"Invalid config: expected a CacheConfig, got {type(config).__name__}")
  c = config
  i32 = jnp.int32
  return CacheState(
      config=c,
      slot_refcount=jnp.zeros((c.num_slots,), i32),
      slot_last_use=jnp.zeros((c.num_slots,), i32),
      slot_published=jnp.zeros((c.num_slots,), bool),
      slot_key=jnp.zeros((c.num_slots, 2), jnp.uint32),
      slot_tokens=jnp.zeros((c.num_slots, c.page_size), i32),
      slot_scope=jnp.zeros((c.num_slots,), i32),
      slot_parent=jnp.full((c.num_slots,), -1, i32),
      slot_parent_gen=jnp.zeros((c.num_slots,), i32),
      slot_gen=jnp.zeros((c.num_slots,), i32),
      slot_depth=jnp.zeros((c.num_slots,), i32),
      slot_hash_pos=jnp.full((c.num_slots,), -1, i32),
      hash_table=jnp.full((c.num_buckets, c.hash_ways), -1, i32),
      seq_slots=jnp.full((c.max_seqs, c.max_pages), NULL_PAGE, i32),
      seq_lens=jnp.zeros((c.max_seqs,), i32),
      seq_live=jnp.zeros((c.max_seqs,), bool),
      seq_scope=jnp.zeros((c.max_seqs,), i32),
      seq_scratch_slots=jnp.full((c.max_seqs, c.max_scratch_slots), NULL_PAGE,
                                 i32),
      seq_scratch_first=jnp.zeros((c.max_seqs,), i32),
      seq_scratch_count=jnp.zeros((c.max_seqs,), i32),
      clock=jnp.zeros((), i32),
      num_lookups=jnp.zeros((), i32),
      num_hits=jnp.zeros((), i32),
  )


@jax.jit
def stats(state: CacheState) -> dict[str, jax.Array]:
  """Slot usage and prefix-cache hit rate (device scalars, no host sync).

  Returns:
    dict of i32[] `num_slots`, `num_free` (refcount 0, unpublished),
    `num_used` (refcount > 0), `num_cached` (refcount 0, published),
    `num_published` (all published, used or not), `num_scratch` (scratch
    slots of running steps, part of `num_used`), `num_live_seqs`,
    `num_lookups` / `num_hits` (prefix blocks looked up / reused by admitted
    claims), and f32[] `hit_rate = num_hits / max(num_lookups, 1)`.
    `num_free + num_used + num_cached == num_slots`.
  """
  unref = state.slot_refcount == 0
  i32 = jnp.int32
  return dict(
      num_slots=jnp.asarray(state.num_slots, i32),
      num_free=jnp.sum(unref & ~state.slot_published, dtype=i32),
      num_used=jnp.sum(~unref, dtype=i32),
      num_cached=jnp.sum(unref & state.slot_published, dtype=i32),
      num_published=jnp.sum(state.slot_published, dtype=i32),
      num_scratch=jnp.sum(state.seq_scratch_slots >= 0, dtype=i32),
      num_live_seqs=jnp.sum(state.seq_live, dtype=i32),
      num_lookups=state.num_lookups,
      num_hits=state.num_hits,
      hit_rate=state.num_hits / jnp.maximum(state.num_lookups, 1).astype(
          jnp.float32),
  )
