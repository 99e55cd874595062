"""The engine's host-memory KV tier: its page data, the copies, the stats.

`pkvattn.cache.host_tier` keeps the bookkeeping (which block is in which
host slot, verified lookups) as a pytree on the device; this module owns the
page data and the copies between it and the pool.

Page data in batches. A host<->device copy runs near the link's speed only
when it moves one large, page-locked (`pinned_host`) buffer: many small
copies, or copies from pageable numpy memory, run several times slower
(measured: docs/performance.md). So the data is held as *batches* of
`batch_blocks` host slots' pages, each one JAX array in the device's
`pinned_host` memory (`[batch_blocks, num_layers * 2, page_size,
num_kv_heads, head_dim]`, the pool's dtype, FP8 included (as the pool
stores them: `uint8` bytes on the XLA path, `serving.kv_manager`; the copies
move them unconverted): the FP8 scales
are per-layer constants, so nothing per block moves besides the pages), and
a host slot maps to a (batch, row) pair. A batch is freed whole: when its
last live row is reassigned, or, when the batches would exceed the byte
budget, least recently used batch first (its live slots leave the
bookkeeping through `cache.host_invalidate`).

* **Offload** (`offload`, before a program that may allocate; `flush`,
  after its outputs are read): when the pool's free slots may not cover
  what the program can take, the blocks that its allocations would evict
  are planned (`cache.host_offload_plan`: the device's eviction order,
  blocks already on the host skipped) and gathered from the pool into
  batches by one program dispatched BEFORE the step (stream order: it
  reads the old data, whatever the step then writes). The batches enter
  the tier at once, in device memory; `flush` queues their copies to
  pinned host memory (`jax.device_put`, asynchronous) a few at a time,
  after the engine has read a program's outputs, so that they run beside
  the next program: a read of outputs waits for every copy to the host
  queued before it (see `flush`). A later reload of a batch waits for its
  copy (JAX orders the transfers). A bound that is too small only loses
  reuse (a block evicted unmirrored is recomputed later), never
  correctness.
* **Reload** (`reload`, after a step's claims settled): the admitted
  requests are looked up from their device-reused blocks on
  (`cache.host_lookup`); each batch holding hits is put on the device in one
  copy (all of them in one `jax.device_put`), and a pool-donating program
  per batch scatters the hit rows into the slots the claim gave them (read
  from the cache state inside the program). Each request then starts its
  prefill after the reloaded blocks; the block with its last prompt token is
  always computed.

Every program here has fixed shapes (one batch; the gather, a power of two
of batches) and is compiled by `warmup`, so an engine with the tier on
compiles nothing after `Engine.warmup()`.
"""

from __future__ import annotations

import collections
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pkvattn import cache as _cache
from pkvattn.serving.config import EngineConfig
from pkvattn.serving.stats import EngineStats

# Blocks per host batch: large enough that one copy runs near the link's
# speed, small enough that a reload moves few rows it does not need.
BATCH_BLOCKS = 32
# A plan mirrors this many steps' worth of evictions ahead, so the steps
# after it plan nothing (a plan reads its result on the host: a sync).
PLAN_HORIZON = 4
# Batches `warmup` copies to the host to time a copy (`flush` sizes its
# copies by that speed).
COPY_PROBE_BATCHES = 8


@functools.partial(jax.jit, static_argnames=("num_slots", "batch_blocks"))
def _gather(pool, src, *, num_slots, batch_blocks):
  """The pages of device slots `src` (`i32[n * batch_blocks]`, -1 =
  padding: garbage rows) as `n` batches `[batch_blocks, num_layers * 2,
  page_size, num_kv_heads, head_dim]` (one program for all of them)."""
  slots = pool.reshape((num_slots, -1) + pool.shape[1:])
  pages = slots[jnp.clip(src, 0, num_slots - 1)]
  return tuple(pages[i:i + batch_blocks]
               for i in range(0, src.shape[0], batch_blocks))


@functools.partial(jax.jit, static_argnames=("num_slots",), donate_argnums=0)
def _scatter(pool, seq_slots, rows, blocks, batch_rows, batch, *, num_slots):
  """Writes row `batch_rows[j]` of `batch` into the slot of block
  `blocks[j]` of sequence `rows[j]` (`state.seq_slots`; -1 rows skipped)."""
  r = jnp.clip(rows, 0, seq_slots.shape[0] - 1)
  b = jnp.clip(blocks, 0, seq_slots.shape[1] - 1)
  dst = jnp.where(rows >= 0, seq_slots[r, b], -1)
  dst = jnp.where(dst >= 0, dst, num_slots)
  slots = pool.reshape((num_slots, -1) + pool.shape[1:])
  pages = batch[jnp.clip(batch_rows, 0, batch.shape[0] - 1)]
  return slots.at[dst].set(pages.astype(pool.dtype),
                           mode="drop").reshape(pool.shape)


@jax.jit
def _chain_fields(host, slots):
  """`(key, parent_key, is_first)` of host slots `slots` (-1: slot 0's)."""
  h = jnp.clip(slots, 0)
  return host.key[h], host.parent_key[h], host.is_first[h]


def _chain_order(key, parent, first) -> np.ndarray:
  """A permutation of `n` blocks (`key`/`parent` u32[n, 2], `first`
  bool[n]) that lists each chain's blocks together, root to leaf: blocks
  are grouped by their oldest ancestor among the `n`, groups in the order
  their first block appears, then by depth. Vectorised: each block's parent
  among the `n` by a sorted search, then ancestors and depths by pointer
  jumping (`log2(n)` rounds; a (corrupt) cycle still yields a
  permutation)."""
  n = len(first)
  if n == 0:
    return np.zeros(0, np.int64)
  as64 = lambda a: (a[:, 0].astype(np.uint64) << np.uint64(32)) | a[:, 1]  # noqa: E731
  k, p = as64(np.asarray(key)), as64(np.asarray(parent))
  by_key = np.argsort(k, kind="stable")
  pos = np.minimum(np.searchsorted(k[by_key], p), n - 1)
  found = (k[by_key][pos] == p) & ~np.asarray(first, bool)
  anc = np.where(found, by_key[pos], np.arange(n))
  depth = found.astype(np.int64)
  for _ in range(n.bit_length() + 1):
    nxt = anc[anc]
    if np.array_equal(nxt, anc):
      break
    depth, anc = depth + depth[anc], nxt
  root = anc
  first_seen = np.full(n, n, np.int64)
  np.minimum.at(first_seen, root, np.arange(n))
  return np.lexsort((depth, first_seen[root])).astype(np.int64)


def _pow2_at_least(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def host_memory_bytes() -> int | None:
  """The machine's physical memory in bytes (`sysconf`), or None where the
  system does not say."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, ValueError, OSError):
    return None


def _host_memory_kind(pool) -> str:
  """`pinned_host` where the pool's device has it, else `unpinned_host`; on
  a CPU `device`: its memory is host memory already, so the batches stay
  plain arrays and no copy between memory kinds is made."""
  devices = pool.sharding.device_set
  if all(d.platform == "cpu" for d in devices):
    return "device"
  kinds = {m.kind for d in devices for m in d.addressable_memories()}
  for kind in ("pinned_host", "unpinned_host"):
    if kind in kinds:
      return kind
  raise ValueError(
      "Invalid host_kv_cache_bytes: the device has no host memory kind "
      f"(expected pinned_host or unpinned_host, got {sorted(kinds)})")


class HostTier:
  """The host tier of one engine (see the module docstring).

  Attributes:
    num_slots: host slots (`host_kv_cache_bytes // slot_bytes`, rounded
      down to whole batches).
    slot_bytes: bytes of one slot, every layer, K and V.
    batch_blocks: host slots per batch (one copy each way).
    dtype: the page dtype (float8_e4m3fn for FP8 pages, whether the pool
      holds them as such or as their bytes; the copies use the pool's own
      dtype).
    state: the `cache.HostTierState` bookkeeping (device).
    max_plan: the most blocks one offload plan mirrors.
    num_plans: offload plans made (each reads its result on the host).
    copy_bytes_per_s: copy speed to the host timed by `warmup` (`flush`
      sizes its copies by it; inf where nothing is copied: a CPU).
  """

  def __init__(self, config: EngineConfig, cache_config, pool_shape, dtype,
               num_layers: int, block_bytes: int, *, hybrid: bool,
               scratch: bool, mesh: jax.sharding.Mesh | None = None):
    """Raises ValueError: per-window-group caches or SWA scratch (not
    supported), or `host_kv_cache_bytes` below one slot or above the
    machine's memory (`host_memory_bytes`; the batches are allocated as
    blocks are offloaded, so a tier that cannot fit would fail mid-run) or
    2**31 - 1 slots (the bookkeeping's int32 slot ids)."""
    if hybrid or scratch:
      raise ValueError(
          "Invalid host_kv_cache_bytes: the host tier supports one flat slot "
          "space without SWA scratch; got "
          + ("per-window-group caches" if hybrid else "SWA scratch reuse")
          + " (pass kv_groups=False and enable_swa_scratch_reuse=False, or "
          "host_kv_cache_bytes=0)")
    self.slot_bytes = num_layers * block_bytes
    slots = config.host_kv_cache_bytes // self.slot_bytes
    memory = host_memory_bytes()
    if memory is not None and config.host_kv_cache_bytes > memory:
      raise ValueError(
          f"Invalid host_kv_cache_bytes: expected at most the host's memory "
          f"({memory} bytes), got {config.host_kv_cache_bytes}")
    if slots > np.iinfo(np.int32).max:
      raise ValueError(
          f"Invalid host_kv_cache_bytes: expected at most 2**31 - 1 slots "
          f"of {self.slot_bytes} bytes, got {slots}")
    if slots < 1:
      raise ValueError(
          f"Invalid host_kv_cache_bytes: expected at least one slot of "
          f"{self.slot_bytes} bytes ({num_layers} layers x {block_bytes}), "
          f"got {config.host_kv_cache_bytes}")
    # At least 8 batches, so freeing one whole frees a small part.
    self.batch_blocks = max(1, min(BATCH_BLOCKS, slots // 8))
    self.max_batches = slots // self.batch_blocks
    self.num_slots = self.max_batches * self.batch_blocks
    self.config = config
    self.device_slots = cache_config.num_slots
    ps = config.page_size
    self.page_shape = tuple(pool_shape[1:])
    self.slot_shape = (num_layers * 2,) + self.page_shape
    self.dtype = jnp.dtype(dtype)
    self.host_config = _cache.HostTierConfig(num_slots=self.num_slots,
                                             page_size=ps)
    self.state = _cache.init_host_tier(self.host_config)
    # A step takes at most its admissions' prompts and one block per
    # extended row; a burst `cdiv(decode_steps, page_size) + 1` per row.
    self.burst_blocks = config.max_seqs * (-(-config.decode_steps // ps) + 1)
    step_blocks = config.num_admit * config.max_pages + config.max_seqs
    self.max_plan = max(1, min(
        PLAN_HORIZON * (step_blocks + self.burst_blocks), self.device_slots,
        self.num_slots))
    # Evictions the last plans mirrored ahead and later steps have not
    # consumed yet (counted by their upper bounds).
    self._covered = 0
    self.num_plans = 0
    self._plan = functools.partial(_cache.host_offload_plan,
                                   max_blocks=self.max_plan)
    # Batches, least recently used first: id -> [array, live rows].
    self._batches: collections.OrderedDict[int, list] = (
        collections.OrderedDict())
    self._next_batch = 0
    self._batch_of = np.full(self.num_slots, -1, np.int64)
    self._row_of = np.zeros(self.num_slots, np.int32)
    # Batches still in device memory (gathered, their copy to the host not
    # queued yet by `flush`), oldest first.
    self._pending: collections.deque[int] = collections.deque()
    self._memory_kind = "device"
    self.copy_bytes_per_s = float("inf")
    # Host-side seconds per phase of the copies (plan, gather, put, lookup,
    # load, free): where `EngineStats.host_transfer_s` goes.
    self.phase_s: collections.Counter[str] = collections.Counter()
    self._mesh = mesh
    if mesh is not None:  # the bookkeeping is replicated, as the cache's
      from pkvattn import parallel as _parallel  # parallel imports models
      self.state = jax.device_put(self.state, _parallel.replicated(mesh))
    else:  # committed, as the cache state (one placement, one compile)
      self.state = jax.device_put(self.state, jax.devices()[0])

  # ----------------------------------------------------------------- bounds
  def step_bound(self, inputs) -> int:
    """Slots a step with `inputs` (`programs.StepInputs`, host arrays) can
    take: its claims' whole prompts plus one block per extended row, plus
    one burst's worth (chained bursts plan nothing)."""
    ps = self.config.page_size
    lens = np.asarray(inputs.admit_lens)
    claims = int(np.sum(-(-lens[np.asarray(inputs.admit_ids) >= 0] // ps)))
    return claims + int(np.sum(np.asarray(inputs.extend_ids) >= 0)) + \
        self.burst_blocks

  def burst_bound(self) -> int:
    """Slots a burst and the one chained after it can take."""
    return 2 * self.burst_blocks

  # ---------------------------------------------------------------- batches
  def _drop_row(self, batch: int) -> None:
    entry = self._batches[batch]
    entry[1] -= 1
    if entry[1] <= 0:
      del self._batches[batch]

  def _evict_batch(self, batch: int) -> None:
    """Frees a batch whole; its live host slots leave the bookkeeping."""
    live = np.flatnonzero(self._batch_of == batch)
    pad = np.full(self.batch_blocks, -1, np.int32)
    pad[:len(live)] = live
    self.state = _cache.host_invalidate(self.state, pad)
    self._batch_of[live] = -1
    del self._batches[batch]

  def host_pages(self, slot: int) -> np.ndarray | None:
    """The pages held by host slot `slot` (`slot_shape`), None if none."""
    batch = int(self._batch_of[slot])
    if batch < 0:
      return None
    return np.asarray(self._batches[batch][0])[self._row_of[slot]]

  # ---------------------------------------------------------------- offload
  def would_plan(self, num_new_slots: int, num_free: int) -> bool:
    """Whether `offload` with these arguments plans (and mirrors) blocks:
    the allocations may evict more than the earlier plans mirrored."""
    need = num_new_slots - num_free
    return need > 0 and need > self._covered

  def offload(self, pool, state, num_new_slots: int, num_free: int,
              stats: EngineStats) -> None:
    """Mirrors the blocks that `num_new_slots` allocations would evict
    (nothing when the `num_free` slots last seen cover them): dispatches
    one program gathering them into batches, before the caller's program
    (stream order: it reads the old data); `flush` then queues their copies
    to the host. A plan mirrors `PLAN_HORIZON` times the blocks
    needed, and the next calls plan nothing until their bounds have used
    that up: the mirrored blocks stay at the head of the eviction order (a
    block released later joins its tail), so they are the ones evicted
    next; one reused in between shifts the head by a block (lost reuse at
    worst, never a wrong hit). Blocks of rows that the caller's program
    releases are not evictable yet, so no plan sees them: where a plan is
    due (`would_plan`), the engine releases such rows in a program of their
    own first."""
    need = num_new_slots - num_free
    if not self.would_plan(num_new_slots, num_free):
      self._covered -= max(need, 0)  # mirrored by an earlier plan
      return
    t0 = time.perf_counter()
    ahead = min(PLAN_HORIZON * need, self.max_plan)
    self._covered = max(0, ahead - need)
    self.num_plans += 1
    self.state, src, dst = self._plan(state, self.state, num_free + ahead)
    src, dst, (key, parent, first) = jax.device_get(
        (src, dst, _chain_fields(self.state, dst)))
    t1 = time.perf_counter()
    self.phase_s["plan"] += t1 - t0
    n = int(np.sum(src >= 0))
    if n == 0:
      stats.host_transfer_s += t1 - t0
      return
    # Any order of the planned blocks is a valid copy; one that keeps each
    # chain's blocks together puts a returning prompt's blocks in few
    # batches, and a reload moves little it does not need.
    order = _chain_order(key[:n], parent[:n], first[:n])
    src, dst = src[:n][order], dst[:n][order]
    S = self.batch_blocks
    nb = -(-n // S)
    # At most one plan's batches wait in device memory besides these.
    excess = len(self._pending) - (-(-self.max_plan // S))
    t_put = time.perf_counter()
    if excess > 0:  # phase "put", counted in this call's total
      self.flush(batches=excess)
    put_s = time.perf_counter() - t_put
    idx = np.full(_pow2_at_least(nb) * S, -1, np.int32)
    idx[:n] = src
    self._memory_kind = _host_memory_kind(pool)
    pages = _gather(pool, idx, num_slots=self.device_slots, batch_blocks=S)
    t2 = time.perf_counter()
    self.phase_s["gather"] += t2 - t1 - put_s
    new = set()
    for i in range(nb):
      d = dst[i * S:(i + 1) * S]
      batch, self._next_batch = self._next_batch, self._next_batch + 1
      self._batches[batch] = [pages[i], len(d)]
      self._pending.append(batch)
      new.add(batch)
      for old in self._batch_of[d]:
        if old >= 0:
          self._drop_row(int(old))
      self._batch_of[d] = batch
      self._row_of[d] = np.arange(len(d), dtype=np.int32)
    while len(self._batches) > self.max_batches:
      oldest = next(iter(self._batches))
      if oldest in new:
        break
      self._evict_batch(oldest)
    self.phase_s["free"] += time.perf_counter() - t2
    stats.host_blocks_offloaded += n
    stats.host_bytes_offloaded += n * self.slot_bytes
    stats.host_transfer_s += time.perf_counter() - t0

  def flush(self, stats: EngineStats | None = None,
            seconds: float | None = None, batches: int | None = None) -> int:
    """Queues the copies to the host of the batches `offload` gathered
    (`jax.device_put` to the host memory kind, asynchronous), oldest first:
    `batches` of them, or those that `copy_bytes_per_s` moves in `seconds`
    (at least one), or all. Returns the batches still on the device.

    The engine calls it after reading a program's outputs, with a part of
    that program's time: the copies then run beside the next program. A
    copy to the host waits for the programs queued before it, and a read of
    a program's outputs waits for the copies to the host queued before it
    (one copy queue), so copies queued before a read would stall the host
    and then the device for their whole length (measured:
    docs/performance.md). Until its copy is queued a batch serves reloads
    from device memory."""
    if not self._pending:
      return 0
    t0 = time.perf_counter()
    limit = len(self._pending) if batches is None else batches
    if seconds is not None and self.copy_bytes_per_s < float("inf"):
      batch_bytes = self.batch_blocks * self.slot_bytes
      limit = max(1, int(seconds * self.copy_bytes_per_s // batch_bytes))
    while self._pending and limit > 0:
      batch = self._pending.popleft()
      entry = self._batches.get(batch)
      if entry is None:  # freed before its copy
        continue
      entry[0] = jax.device_put(
          entry[0], entry[0].sharding.with_memory_kind(self._memory_kind))
      limit -= 1
    self.phase_s["put"] += time.perf_counter() - t0
    if stats is not None:
      stats.host_transfer_s += time.perf_counter() - t0
    return len(self._pending)

  # ----------------------------------------------------------------- reload
  def reload(self, pool, state, inputs, reqs, stats: EngineStats):
    """Brings back the blocks of newly admitted requests found on the host.

    Args:
      pool, state: the engine's pool (donated: use the returned one) and
        cache state after the step whose claims admitted `reqs`.
      inputs: that step's `StepInputs` (host arrays: `admit_*`).
      reqs: `(i, request)` pairs: admission `i` held; each request starts
        its prefill at `num_computed` (its device-reused tokens).

    Returns:
      `(pool, {request_id: tokens reloaded})`; the requests'
      `num_computed` is advanced by those tokens.
    """
    if not reqs or stats.host_blocks_offloaded == 0:
      return pool, {}
    t0 = time.perf_counter()
    ps = self.config.page_size
    A = len(inputs.admit_ids)
    lengths = np.zeros(A, np.int32)
    start = np.zeros(A, np.int32)
    for i, req in reqs:
      lengths[i] = inputs.admit_lens[i]
      start[i] = req.num_computed // ps
    self.state, count, slots = _cache.host_lookup(
        self.state, inputs.admit_tokens, lengths, start, inputs.admit_scope)
    count, slots = jax.device_get((count, slots))
    self.phase_s["lookup"] += time.perf_counter() - t0
    rows, blocks, hslots, done = [], [], [], {}
    for i, req in reqs:
      n = int(count[i])
      if n <= 0:
        continue
      b = np.arange(start[i], start[i] + n)
      rows.append(np.full(n, inputs.admit_ids[i], np.int32))
      blocks.append(b.astype(np.int32))
      hslots.append(slots[i, b])
      done[req.request_id] = n * ps
      req.num_computed += n * ps
    stats.host_lookups += int(np.sum(np.maximum(
        np.where(lengths > 0, (lengths - 1) // ps, 0) - start, 0)))
    if done:
      rows, blocks = np.concatenate(rows), np.concatenate(blocks)
      t1 = time.perf_counter()
      pool = self.load(pool, state, rows, blocks, np.concatenate(hslots))
      self.phase_s["load"] += time.perf_counter() - t1
      stats.host_hits += len(rows)
      stats.host_blocks_reloaded += len(rows)
      stats.host_bytes_reloaded += len(rows) * self.slot_bytes
    stats.host_transfer_s += time.perf_counter() - t0
    return pool, done

  def load(self, pool, state, rows, blocks, hslots):
    """Copies host slots `hslots` into the slots of block `blocks[j]` of
    sequence `rows[j]` (rows -1: copied, then dropped). Returns the pool
    (donated). Every batch holding one of them moves to the device in one
    `jax.device_put` (one copy per batch; none for a batch whose copy to
    the host `flush` has not queued yet) and becomes the most recently
    used.

    Raises:
      RuntimeError: a host slot holds no data (the bookkeeping and the
        batches disagree: a bug, never silently skipped).
    """
    batch = self._batch_of[hslots]
    if np.any(batch < 0):
      raise RuntimeError(
          f"host slots {hslots[batch < 0].tolist()} hold no data")
    ids = [int(b) for b in dict.fromkeys(batch.tolist())]
    arrays = [self._batches[b][0] for b in ids]
    on_device = jax.device_put(
        arrays, [a.sharding.with_memory_kind("device") for a in arrays])
    S = self.batch_blocks
    for b, dev in zip(ids, on_device):
      self._batches.move_to_end(b)
      sel = np.flatnonzero(batch == b)
      for lo in range(0, len(sel), S):
        part = sel[lo:lo + S]
        r = np.full(S, -1, np.int32)
        k = np.zeros(S, np.int32)
        br = np.zeros(S, np.int32)
        r[:len(part)], k[:len(part)] = rows[part], blocks[part]
        br[:len(part)] = self._row_of[hslots[part]]
        pool = _scatter(pool, state.seq_slots, r, k, br, dev,
                        num_slots=self.device_slots)
    return pool

  # ----------------------------------------------------------------- warmup
  def warmup(self, pool, state, inputs_shape):
    """Compiles every program of the tier (plan, lookup, invalidate, the
    gather and the scatter) on `pool` and `state` (their shardings); returns
    the pool (the scatter donates it). `inputs_shape`: `(num_admit,
    max_model_len)`. The tier's state is left unchanged."""
    saved = self.state
    _, _, dst = self._plan(state, self.state, 0)
    _chain_fields(self.state, dst)
    A, T = inputs_shape
    _cache.host_lookup(self.state, np.zeros((A, T), np.int32),
                       np.zeros(A, np.int32), np.zeros(A, np.int32),
                       np.zeros(A, np.int32))
    S = self.batch_blocks
    _cache.host_invalidate(self.state, np.full(S, -1, np.int32))
    nb = 1  # a gather per power of two of batches a plan can fill
    while True:
      pages = _gather(pool, np.full(nb * S, -1, np.int32),
                      num_slots=self.device_slots, batch_blocks=S)[0]
      if nb * S >= self.max_plan:
        break
      nb *= 2
    kind = _host_memory_kind(pool)
    host = jax.device_put(pages, pages.sharding.with_memory_kind(kind))
    dev = jax.device_put(host, host.sharding.with_memory_kind("device"))
    # Reserve the tier's host memory now: a first pinned allocation
    # page-locks new memory (slow, and it blocks the caller), while the
    # allocator hands a freed buffer out again cheaply. (On a CPU the
    # batches are plain arrays: nothing to reserve.)
    if not self._batches and kind != "device":
      reserve = [jax.device_put(pages, host.sharding)
                 for _ in range(self.max_batches)]
      jax.block_until_ready(reserve)
      del reserve
      # The copies' speed, for `flush`, timed on buffers the allocator
      # hands out again: the reservation's own time is mostly page-locking,
      # many times slower than a copy, and a speed that low makes `flush`
      # queue one batch a program, leaving the rest to be queued at the
      # next plan, before a read, which then waits for them.
      n = min(COPY_PROBE_BATCHES, self.max_batches)
      t0 = time.perf_counter()
      probe = [jax.device_put(pages, host.sharding) for _ in range(n)]
      jax.block_until_ready(probe)
      self.copy_bytes_per_s = (n * self.batch_blocks * self.slot_bytes
                               / max(time.perf_counter() - t0, 1e-9))
      del probe
    pool = _scatter(pool, state.seq_slots, np.full(S, -1, np.int32),
                    np.zeros(S, np.int32), np.zeros(S, np.int32), dev,
                    num_slots=self.device_slots)
    self.state = saved
    return pool

  def stats_into(self, stats: EngineStats) -> None:
    """Sets the tier's sizes in `stats`."""
    stats.host_num_slots = self.num_slots
    stats.host_kv_cache_bytes = self.num_slots * self.slot_bytes
