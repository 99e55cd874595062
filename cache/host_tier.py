"""A host-memory tier for the prefix cache: bookkeeping as a pytree, pure ops.

The device pool keeps published blocks until they are evicted (least recently
released first, a chain's tail before its head: `cache/alloc.py`,
`eviction_order`). The host tier keeps copies of such blocks
in a second, larger pool of `num_slots` host slots, so a later prompt whose
prefix was evicted from the device brings its KV back instead of recomputing
it (TensorRT-LLM's secondary memory pool, vLLM's CPU offloading, SGLang's
HiCache). As with the device cache, only the bookkeeping lives here, a small
pytree of device arrays (`HostTierState`); the page data is a host buffer the
caller owns, `[num_slots, num_layers * 2, page_size, num_kv_heads, head_dim]`
(a host slot holds one block of every layer, K and V, laid out as a device
slot's pages: `pool.reshape(num_device_slots, num_layers * 2, page_size,
num_kv_heads, head_dim)[slot]`).

Mirror ahead, not copy at eviction. `host_offload_plan(state, host,
num_new_slots)` names the device slots that the next `num_new_slots`
allocations would evict (the device's eviction order: free slots are taken
first, then cached slots, i.e. published and unreferenced, by `(slot_last_use
ascending, slot_depth descending, index ascending)`, `alloc.eviction_order`),
and gives each a host slot. The caller copies them BEFORE running
the allocating op, so the device ops stay unchanged: the copy reads the old
data and the allocation may then overwrite it. A block already on the host
(same key, tokens, scope and parent key) is not copied again: its host LRU
entry is refreshed. A block whose parent slot was republished since
(`slot_parent_gen != slot_gen[slot_parent]`, an orphan) is skipped: the device
would never match it either, and its parent's key is no longer known.

Host slots. A free host slot is taken first (lowest index), else the least
recently used valid entry (by `(last_use, index)`) is evicted from the host
(unhashed; its data is overwritten by the copy). Entries found or reloaded
are refreshed: `last_use` takes the tier's `clock`, bumped by every plan and
lookup.

Verification. `host_lookup` finds each block of a prompt by its chained key
(`cache/hashing.block_keys`), then verifies the entry: the very same tokens
and scope, and a parent key equal to the key of the prompt's previous block
(`is_first` for block 0). Keys only find candidates; the tokens and scope are
compared exactly, and the chain through the parent is verified by the 64-bit
chained key of the parent (the device cache verifies its chain by slot and
generation instead; a host entry has no slot on the device to point at).
Two different prefixes whose blocks `i - 1` share a 64-bit key and whose
blocks `i` hold the same tokens would be confused: probability about
`2**-64` per pair.

Every op is a pure function of `(state, host, args)`, jitted once per config
(static fields of the pytrees) and per static size, with no host sync.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks
from . import hashing
from .alloc import _oob_scatter_index as _drop_index
from .alloc import eviction_order
from .state import CacheState

_I32_MAX = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class HostTierConfig:
  """Static sizes of the host tier (hashable; a jit static argument).

  Attributes:
    num_slots: host slots; each holds one block of every layer, K and V.
    page_size: tokens per block (the device cache's).
    hash_ways: entries per bucket of the key -> host slot table. An entry
      whose bucket is full is not kept (its copy is dropped: lost reuse,
      never a wrong hit).
    hash_buckets: buckets (a power of two); None = the smallest power of two
      `>= 4 * num_slots / hash_ways` (as `CacheConfig`).
  """
  num_slots: int
  page_size: int
  hash_ways: int = 16
  hash_buckets: int | None = None

  def __post_init__(self):
    for name in ("num_slots", "page_size", "hash_ways"):
      _checks.check_positive_int(getattr(self, name), name)
    _checks.check_power_of_two(self.hash_buckets, "hash_buckets")

  @property
  def num_buckets(self) -> int:
    return hashing.num_buckets(self.num_slots, self.hash_ways,
                               self.hash_buckets)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostTierState:
  """Bookkeeping of the host tier (device arrays; `config` static).

  Per host slot `h` (`H = config.num_slots`): the block it holds when
  `valid[h]`. A slot is free iff not valid, so `valid + free == H`.
  """
  config: HostTierConfig = dataclasses.field(metadata=dict(static=True))
  key: jax.Array         # u32[H, 2], chained key of the block
  tokens: jax.Array      # i32[H, page_size]
  scope: jax.Array       # i32[H], reuse_scope
  parent_key: jax.Array  # u32[H, 2], key of the previous block (0 if first)
  is_first: jax.Array    # bool[H], block 0 of its chain
  valid: jax.Array       # bool[H]
  last_use: jax.Array    # i32[H], `clock` when stored, found or reloaded
  hash_pos: jax.Array    # i32[H], flat index in hash_table, -1 if not valid
  hash_table: jax.Array  # i32[num_buckets, hash_ways], host slot or -1
  clock: jax.Array       # i32[], bumped by every plan and lookup
  num_offloaded: jax.Array  # i32[], blocks given a host slot (copies asked)
  num_lookups: jax.Array    # i32[], blocks looked up by host_lookup
  num_hits: jax.Array       # i32[], of those, found (to reload)

  @property
  def num_slots(self) -> int:
    return self.valid.shape[0]


def init_host_tier(config: HostTierConfig) -> HostTierState:
  """An empty host tier: every host slot free.

  Raises:
    ValueError: `config` is not a `HostTierConfig`.
  """
  if not isinstance(config, HostTierConfig):
    raise ValueError("Invalid config: expected a HostTierConfig, got "
                     f"{type(config).__name__}")
  H, i32 = config.num_slots, jnp.int32
  return HostTierState(
      config=config,
      key=jnp.zeros((H, 2), jnp.uint32),
      tokens=jnp.zeros((H, config.page_size), i32),
      scope=jnp.zeros((H,), i32),
      parent_key=jnp.zeros((H, 2), jnp.uint32),
      is_first=jnp.zeros((H,), bool),
      valid=jnp.zeros((H,), bool),
      last_use=jnp.zeros((H,), i32),
      hash_pos=jnp.full((H,), -1, i32),
      hash_table=jnp.full((config.num_buckets, config.hash_ways), -1, i32),
      clock=jnp.zeros((), i32),
      num_offloaded=jnp.zeros((), i32),
      num_lookups=jnp.zeros((), i32),
      num_hits=jnp.zeros((), i32),
  )


def _find(host: HostTierState, keys):
  """Host slot whose key is `keys` (`u32[..., 2]`), else -1; and the bucket."""
  cfg = host.config
  bucket = (keys[..., 0] & jnp.uint32(cfg.num_buckets - 1)).astype(jnp.int32)
  ways = host.hash_table[bucket]
  h = jnp.clip(ways, 0)
  match = ((ways >= 0) & (host.key[h, 0] == keys[..., None, 0])
           & (host.key[h, 1] == keys[..., None, 1]))
  return jnp.max(jnp.where(match, ways, -1), axis=-1), bucket


def _unhash(host: HostTierState, slots):
  """Makes `slots` (any shape, -1 = skip) free: out of the table, invalid."""
  H = host.num_slots
  mask = slots >= 0
  s = jnp.clip(slots, 0)
  flat = host.hash_table.reshape(-1)
  pos = host.hash_pos[s]
  flat = flat.at[_drop_index(mask & (pos >= 0), pos, flat.size)].set(
      -1, mode="drop")
  drop = _drop_index(mask, s, H)
  return dataclasses.replace(
      host, hash_table=flat.reshape(host.hash_table.shape),
      valid=host.valid.at[drop].set(False, mode="drop"),
      hash_pos=host.hash_pos.at[drop].set(-1, mode="drop"))


def _rank_in_group(group, mask):
  """Rank of each `mask` entry among the `mask` entries of its `group`, in
  index order (`i32[k]`; a sort, no `k x k` matrix)."""
  k = group.shape[0]
  pos = jnp.arange(k, dtype=jnp.int32)
  g = jnp.where(mask, group, jnp.iinfo(jnp.int32).max)
  perm = jnp.lexsort((pos, g))
  sg = g[perm]
  start = jnp.concatenate([jnp.ones((1,), bool), sg[1:] != sg[:-1]])
  seg = jax.lax.cummax(jnp.where(start, pos, 0), axis=0)
  return jnp.zeros((k,), jnp.int32).at[perm].set(pos - seg)


def _identical(host, cand, keys, tokens, scope, parent_key, is_first):
  """Host entry `cand` holds exactly this block (`[...]` each)."""
  c = jnp.clip(cand, 0)
  return ((cand >= 0) & host.valid[c]
          & jnp.all(host.tokens[c] == tokens, axis=-1)
          & (host.scope[c] == scope)
          & (host.is_first[c] == is_first)
          & (is_first | jnp.all(host.parent_key[c] == parent_key, axis=-1))
          & jnp.all(host.key[c] == keys, axis=-1))


@functools.partial(jax.jit, static_argnames=("max_blocks",))
def host_offload_plan(state: CacheState, host: HostTierState,
                      num_new_slots, *, max_blocks: int):
  """Host slots for the device blocks the next allocations would evict.

  The device allocates `num_new_slots` slots from its free slots first, then
  by evicting cached slots (published, refcount 0) by `(slot_last_use
  ascending, slot_depth descending, index ascending)`: least recently
  released first, the blocks of one release tail first (`cache/alloc.py`,
  `eviction_order`, the very function `_take_slots` uses). This picks
  those cached slots, at most `max_blocks` of them, in that order, and gives
  each picked block a host slot (module docstring): free host slots first,
  then the least recently used host entries. Skipped: orphans (their parent
  slot was republished), and blocks already on the host with the same key,
  tokens, scope and parent key (their host entry is refreshed instead). A
  block whose hash bucket has no free way is dropped (lost reuse only).

  Args:
    state: the device cache (a flat `CacheState`); not changed.
    host: the host tier; its `page_size` must be the device's.
    num_new_slots: `i32[]`, slots the next allocations may take (an upper
      bound: a larger value only mirrors more blocks).
    max_blocks: static, the most blocks one plan copies (the width of the
      result).

  Returns:
    `(host, src i32[max_blocks], dst i32[max_blocks])`: copy device slot
    `src[j]` into host slot `dst[j]` (every layer, K and V) for the leading
    entries `j < count`, then -1. The caller must do the copies before the
    device op that allocates, and before a `host_lookup` that may hit them.

  Raises:
    ValueError: page sizes differ, or `max_blocks < 1` (trace time).
  """
  cfg = state.config
  if host.config.page_size != cfg.page_size:
    raise ValueError(
        f"Invalid host: expected page_size={cfg.page_size} (the device's), "
        f"got {host.config.page_size}")
  _checks.check_positive_int(max_blocks, "max_blocks")
  S, H = state.num_slots, host.num_slots
  unref = state.slot_refcount == 0
  free = unref & ~state.slot_published
  evictable = unref & state.slot_published
  num_free = jnp.sum(free, dtype=jnp.int32)
  n_evict = jnp.clip(jnp.asarray(num_new_slots, jnp.int32) - num_free, 0,
                     max_blocks)
  k = min(max_blocks, S)
  order = eviction_order(state, evictable)[:k]
  pos = jnp.arange(k, dtype=jnp.int32)
  picked = (pos < n_evict) & evictable[order]
  src = order
  parent = state.slot_parent[src]
  pc = jnp.clip(parent, 0)
  is_first = parent < 0
  orphan = ~is_first & (state.slot_parent_gen[src] != state.slot_gen[pc])
  picked &= ~orphan
  keys, toks, scope = state.slot_key[src], state.slot_tokens[src], \
      state.slot_scope[src]
  pkey = jnp.where(is_first[:, None], jnp.uint32(0), state.slot_key[pc])

  existing, bucket = _find(host, keys)
  same = _identical(host, existing, keys, toks, scope, pkey, is_first)
  hit = picked & same
  need = picked & ~same
  clock = host.clock + 1
  ex = jnp.clip(existing, 0)
  host = dataclasses.replace(
      host, clock=clock,
      last_use=host.last_use.at[_drop_index(hit, ex, H)].set(clock,
                                                             mode="drop"))
  # Same key, other content (a collision or a stale chain): replaced.
  host = _unhash(host, jnp.where(need & (existing >= 0), existing, -1))
  protected = jnp.zeros((H,), bool).at[_drop_index(hit, ex, H)].set(
      True, mode="drop")
  sort_key = jnp.where(~host.valid, -1,
                       jnp.where(protected, _I32_MAX, host.last_use))
  horder = jnp.argsort(sort_key, stable=True).astype(jnp.int32)
  eligible = H - jnp.sum(protected, dtype=jnp.int32)
  rank = jnp.cumsum(need.astype(jnp.int32)) - 1
  has_slot = need & (rank < eligible)
  dst = jnp.where(has_slot, horder[jnp.clip(rank, 0, H - 1)], -1)
  host = _unhash(host, jnp.where(has_slot & host.valid[jnp.clip(dst, 0)],
                                 dst, -1))
  # A way in its bucket for each new entry, in plan order.
  ways = host.hash_table[bucket]                       # [k, hash_ways]
  way_rank = _rank_in_group(bucket, has_slot)
  free_way = ways < 0
  nth = jnp.cumsum(free_way.astype(jnp.int32), axis=-1)
  way = jnp.argmax(free_way & (nth == way_rank[:, None] + 1), axis=-1)
  ok = has_slot & (way_rank < jnp.sum(free_way, axis=-1))
  hpos = bucket * host.config.hash_ways + way.astype(jnp.int32)
  d = _drop_index(ok, dst, H)
  flat = host.hash_table.reshape(-1).at[
      _drop_index(ok, hpos, host.hash_table.size)].set(dst, mode="drop")
  host = dataclasses.replace(
      host,
      hash_table=flat.reshape(host.hash_table.shape),
      hash_pos=host.hash_pos.at[d].set(hpos, mode="drop"),
      key=host.key.at[d].set(keys, mode="drop"),
      tokens=host.tokens.at[d].set(toks, mode="drop"),
      scope=host.scope.at[d].set(scope, mode="drop"),
      parent_key=host.parent_key.at[d].set(pkey, mode="drop"),
      is_first=host.is_first.at[d].set(is_first, mode="drop"),
      valid=host.valid.at[d].set(True, mode="drop"),
      last_use=host.last_use.at[d].set(clock, mode="drop"),
      num_offloaded=host.num_offloaded + jnp.sum(ok, dtype=jnp.int32),
  )
  # Leading entries first (stable), padded with -1 to max_blocks.
  perm = jnp.argsort(~ok, stable=True)
  src = jnp.where(ok, src, -1)[perm]
  dst = jnp.where(ok, dst, -1)[perm]
  pad = max_blocks - k
  if pad:
    src = jnp.concatenate([src, jnp.full((pad,), -1, jnp.int32)])
    dst = jnp.concatenate([dst, jnp.full((pad,), -1, jnp.int32)])
  return host, src, dst


@jax.jit
def host_lookup(host: HostTierState, tokens, lengths, start_blocks,
                scope=None):
  """Blocks of each prompt found on the host, from `start_blocks` on.

  For row `r`, blocks `start_blocks[r], start_blocks[r] + 1, ...` are looked
  up while each is on the host and verified (module docstring: the same
  tokens and scope, parent key = the key of block `i - 1`, `is_first` for
  block 0). The block holding the last prompt token is never counted (as
  `claim_batch`: at least that token is computed, for its logits), so at most
  `(lengths[r] - 1) // page_size - start_blocks[r]` blocks. The found
  entries are refreshed (host LRU).

  Args:
    host: the host tier.
    tokens: `i32[n, max_len]`, the prompts; entries past `lengths` ignored.
    lengths: `i32[n]`, prompt tokens; 0 = no lookup (padding).
    start_blocks: `i32[n]`, the first block to look up (blocks before it are
      served otherwise, e.g. the device's prefix reuse).
    scope: `i32[n]` reuse scope; None = 0 for all.

  Returns:
    `(host, num_blocks i32[n], slots i32[n, max_len // page_size])`: the
    number of consecutive blocks found from `start_blocks[r]`, and the host
    slot of each found block at its block position (-1 elsewhere).

  Raises:
    ValueError: array ranks or sizes do not match (trace time).
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  lengths = jnp.asarray(lengths, jnp.int32)
  start = jnp.asarray(start_blocks, jnp.int32)
  if tokens.ndim != 2 or lengths.shape != tokens.shape[:1] or \
      start.shape != lengths.shape:
    raise ValueError(
        "Invalid tokens / lengths / start_blocks: expected shapes [n, max_len]"
        f", [n], [n], got {tokens.shape}, {lengths.shape}, {start.shape}")
  n = tokens.shape[0]
  scope = (jnp.zeros((n,), jnp.int32) if scope is None
           else jnp.asarray(scope, jnp.int32))
  ps = host.config.page_size
  nbt = tokens.shape[1] // ps
  if nbt == 0:
    return host, jnp.zeros((n,), jnp.int32), jnp.zeros((n, 0), jnp.int32)
  blocks = tokens[:, :nbt * ps].reshape(n, nbt, ps)
  keys = hashing.block_keys(blocks, scope)
  cand, _ = _find(host, keys)
  pos = jnp.arange(nbt, dtype=jnp.int32)[None, :]
  first = pos == 0
  prev = jnp.concatenate([jnp.zeros((n, 1, 2), jnp.uint32), keys[:, :-1]],
                         axis=1)
  found = _identical(host, cand, keys, blocks, scope[:, None], prev, first)
  matchable = jnp.clip(jnp.where(lengths > 0, (lengths - 1) // ps, 0), 0, nbt)
  window = (pos >= start[:, None]) & (pos < matchable[:, None])
  run = jnp.cumprod(jnp.where(pos < start[:, None], True, found & window),
                    axis=1).astype(bool) & window
  slots = jnp.where(run, cand, -1)
  clock = host.clock + 1
  H = host.num_slots
  host = dataclasses.replace(
      host, clock=clock,
      last_use=host.last_use.at[_drop_index(run, slots, H)].set(
          clock, mode="drop"),
      num_lookups=host.num_lookups + jnp.sum(
          jnp.maximum(matchable - start, 0), dtype=jnp.int32),
      num_hits=host.num_hits + jnp.sum(run, dtype=jnp.int32))
  return host, jnp.sum(run, axis=1, dtype=jnp.int32), slots


@jax.jit
def host_invalidate(host: HostTierState, slots) -> HostTierState:
  """Frees host slots whose data the caller dropped (`i32[n]`, -1 = skip).

  The caller owns the page data and may free it in units larger than one
  block (the engine keeps copies in batches and frees a batch whole); the
  blocks it held must then leave the bookkeeping, or a lookup would name
  data that no longer exists. Freed slots are out of the hash table and
  free for the next plan. Freeing a free slot is a no-op.
  """
  slots = jnp.asarray(slots, jnp.int32)
  return _unhash(host, jnp.where(slots < host.num_slots, slots, -1))


@jax.jit
def host_tier_stats(host: HostTierState) -> dict[str, jax.Array]:
  """Device scalars: `num_slots`, `num_valid`, `num_free` (`num_valid +
  num_free == num_slots`), `num_offloaded`, `num_lookups`, `num_hits`."""
  v = jnp.sum(host.valid, dtype=jnp.int32)
  return dict(num_slots=jnp.asarray(host.num_slots, jnp.int32), num_valid=v,
              num_free=host.num_slots - v, num_offloaded=host.num_offloaded,
              num_lookups=host.num_lookups, num_hits=host.num_hits)


class HostTierInvariantError(ValueError):
  """Raised by `validate_host_tier` with one line per broken invariant."""


def validate_host_tier(host: HostTierState) -> None:
  """Checks the host tier's invariants on the host (tests, debugging).

  Checked: shapes; every table entry is a valid slot whose `hash_pos`
  points back at it and whose key hashes to that bucket; every valid slot is
  in the table exactly once; free slots have `hash_pos == -1`; no two valid
  slots share a key; counters are non-negative and hits <= lookups.

  Raises:
    HostTierInvariantError: listing every violated invariant.
  """
  cfg = host.config
  f = {k: np.asarray(v) for k, v in vars(host).items() if k != "config"}
  errors = []
  H, B, W = cfg.num_slots, cfg.num_buckets, cfg.hash_ways
  if f["valid"].shape != (H,) or f["hash_table"].shape != (B, W) or \
      f["tokens"].shape != (H, cfg.page_size):
    raise HostTierInvariantError("shapes do not match the config")
  table = f["hash_table"].reshape(-1)
  seen = np.zeros(H, np.int64)
  for p, h in enumerate(table):
    if h < 0:
      continue
    if h >= H or not f["valid"][h]:
      errors.append(f"hash_table entry {p} -> {h}: not a valid host slot")
      continue
    seen[h] += 1
    if f["hash_pos"][h] != p:
      errors.append(f"slot {h}: hash_pos {f['hash_pos'][h]} != {p}")
    if int(f["key"][h, 0]) & (B - 1) != p // W:
      errors.append(f"slot {h}: key in bucket {p // W}, hashes elsewhere")
  for h in range(H):
    if f["valid"][h] and seen[h] != 1:
      errors.append(f"valid slot {h} is in the table {seen[h]} times")
    if not f["valid"][h] and f["hash_pos"][h] != -1:
      errors.append(f"free slot {h} has hash_pos {f['hash_pos'][h]}")
  keys = [tuple(k) for k in f["key"][f["valid"]].tolist()]
  if len(set(keys)) != len(keys):
    errors.append("two valid host slots share a key")
  if min(f["num_offloaded"], f["num_lookups"], f["num_hits"]) < 0 or \
      f["num_hits"] > f["num_lookups"]:
    errors.append("counters negative or hits > lookups")
  if errors:
    raise HostTierInvariantError("\n".join(errors))
