"""The engine's host-memory KV tier: the host buffer, its copies, its stats.

`pkvattn.cache.host_tier` keeps the bookkeeping (which block is in which
host slot, verified lookups) as a pytree on the device; this module owns the
page data, a numpy array `[host_num_slots, num_layers * 2, page_size,
num_kv_heads, head_dim]` of the pool's dtype (FP8 included: the FP8 scales
are per-layer constants, so nothing per block moves besides the pages), and
the copies between it and the pool:

* **Offload** (`offload`, before a program that may allocate): when the
  pool's free slots may not cover what the program can take, the blocks
  that its allocations would evict are planned (`cache.host_offload_plan`:
  the device's eviction order, blocks already on the host skipped), gathered
  from the pool by a small program dispatched BEFORE the step (stream order:
  it reads the old data, whatever the step then writes), and their device ->
  host copy started (`copy_to_host_async`). `flush` writes them into the host
  buffer after the step's results were read, so the copy overlaps the step.
  A bound that is too small only loses reuse (a block evicted unmirrored is
  recomputed later), never correctness: a lookup only finds blocks whose
  copy was written.
* **Reload** (`reload`, after a step's claims settled): the admitted
  requests are looked up from their device-reused blocks on
  (`cache.host_lookup`); the hits' pages are gathered from the host buffer,
  put on the device as one array per step, and scattered into the slots
  the claim gave them (read from the cache state inside the jitted,
  pool-donating program). Each request then starts its prefill after the
  reloaded blocks; the block with its last prompt token is always computed.

Every program here is compiled by `warmup` at fixed padded sizes, so an
engine with the tier on compiles nothing after `Engine.warmup()`.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from pkvattn import cache as _cache
from pkvattn.serving.config import EngineConfig
from pkvattn.serving.stats import EngineStats


def _sizes(largest: int, smallest: int = 8) -> tuple[int, ...]:
  """Padded copy sizes: `smallest`, x4 each, up to `largest` (included)."""
  out, n = [], min(smallest, largest)
  while n < largest:
    out.append(n)
    n *= 4
  return tuple(out) + (largest,)


@functools.partial(jax.jit, static_argnames=("num_slots",))
def _gather(pool, src, *, num_slots):
  """Pages of device slots `src` (`i32[n]`, -1 = padding: garbage), in pool
  layout `[n * num_layers * 2, page_size, num_kv_heads, head_dim]`."""
  slots = pool.reshape((num_slots, -1) + pool.shape[1:])
  out = slots[jnp.clip(src, 0, num_slots - 1)]
  return out.reshape((-1,) + pool.shape[1:])


@functools.partial(jax.jit, static_argnames=("num_slots",), donate_argnums=0)
def _scatter(pool, seq_slots, rows, blocks, pages, *, num_slots):
  """Writes `pages` (pool layout, `n` slots) into the slots of block
  `blocks[j]` of sequence `rows[j]` (`state.seq_slots`; -1 rows skipped)."""
  r = jnp.clip(rows, 0, seq_slots.shape[0] - 1)
  b = jnp.clip(blocks, 0, seq_slots.shape[1] - 1)
  dst = jnp.where(rows >= 0, seq_slots[r, b], -1)
  dst = jnp.where(dst >= 0, dst, num_slots)
  slots = pool.reshape((num_slots, -1) + pool.shape[1:])
  pages = pages.reshape((rows.shape[0],) + slots.shape[1:]).astype(pool.dtype)
  return slots.at[dst].set(pages, mode="drop").reshape(pool.shape)


class HostTier:
  """The host tier of one engine (see the module docstring).

  Attributes:
    num_slots: host slots (`host_kv_cache_bytes // slot_bytes`).
    slot_bytes: bytes of one slot, every layer, K and V.
    buffer: the host pages, numpy `[num_slots, num_layers * 2, page_size,
      num_kv_heads, head_dim]`.
    state: the `cache.HostTierState` bookkeeping (device).
    max_plan: the most blocks one offload plan mirrors.
  """

  def __init__(self, config: EngineConfig, cache_config, pool_shape, dtype,
               num_layers: int, block_bytes: int, *, hybrid: bool,
               scratch: bool, mesh: jax.sharding.Mesh | None = None):
    """Raises ValueError: per-window-group caches or SWA scratch (not
    supported), or `host_kv_cache_bytes` below one slot."""
    if hybrid or scratch:
      raise ValueError(
          "Invalid host_kv_cache_bytes: the host tier supports one flat slot "
          "space without SWA scratch; got "
          + ("per-window-group caches" if hybrid else "SWA scratch reuse")
          + " (pass kv_groups=False and enable_swa_scratch_reuse=False, or "
          "host_kv_cache_bytes=0)")
    self.slot_bytes = num_layers * block_bytes
    self.num_slots = config.host_kv_cache_bytes // self.slot_bytes
    if self.num_slots < 1:
      raise ValueError(
          f"Invalid host_kv_cache_bytes: expected at least one slot of "
          f"{self.slot_bytes} bytes ({num_layers} layers x {block_bytes}), "
          f"got {config.host_kv_cache_bytes}")
    self.config = config
    self.device_slots = cache_config.num_slots
    ps = config.page_size
    self.page_shape = tuple(pool_shape[1:])
    self.slot_shape = (num_layers * 2,) + self.page_shape
    self.buffer = np.zeros((self.num_slots,) + self.slot_shape,
                           jnp.dtype(dtype))
    self.host_config = _cache.HostTierConfig(num_slots=self.num_slots,
                                             page_size=ps)
    self.state = _cache.init_host_tier(self.host_config)
    # A step takes at most its admissions' prompts and one block per
    # extended row; a burst `cdiv(decode_steps, page_size) + 1` per row.
    self.burst_blocks = config.max_seqs * (-(-config.decode_steps // ps) + 1)
    step_blocks = config.num_admit * config.max_pages + config.max_seqs
    self.max_plan = max(1, min(step_blocks + self.burst_blocks,
                               self.device_slots, self.num_slots))
    self.gather_sizes = _sizes(self.max_plan)
    self.reload_sizes = _sizes(max(1, min(
        config.num_admit * config.max_pages, self.num_slots, 4096)))
    self._plan = functools.partial(_cache.host_offload_plan,
                                   max_blocks=self.max_plan)
    self._pending: list[tuple[jax.Array, np.ndarray]] = []
    self._mesh = mesh
    if mesh is not None:  # the bookkeeping is replicated, as the cache's
      from pkvattn import parallel as _parallel  # parallel imports models
      self.state = jax.device_put(self.state, _parallel.replicated(mesh))

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

  # ---------------------------------------------------------------- offload
  def offload(self, pool, state, num_new_slots: int, num_free: int,
              stats: EngineStats) -> None:
    """Mirrors the blocks that `num_new_slots` allocations would evict
    (nothing when the `num_free` slots last seen cover them). Dispatches
    the gathers (before the caller's program) and starts their device ->
    host copies; `flush` writes them."""
    if num_new_slots <= num_free:
      return
    t0 = time.perf_counter()
    self.state, src, dst = self._plan(state, self.state, num_new_slots)
    src, dst = jax.device_get((src, dst))
    n = int(np.sum(src >= 0))
    for lo in range(0, n, self.gather_sizes[-1]):
      m = min(n - lo, self.gather_sizes[-1])
      size = next(s for s in self.gather_sizes if s >= m)
      idx = np.full(size, -1, np.int32)
      idx[:m] = src[lo:lo + m]
      pages = _gather(pool, idx, num_slots=self.device_slots)
      pages.copy_to_host_async()
      self._pending.append((pages, dst[lo:lo + m]))
    stats.host_blocks_offloaded += n
    stats.host_bytes_offloaded += n * self.slot_bytes
    stats.host_transfer_s += time.perf_counter() - t0

  def flush(self, stats: EngineStats) -> None:
    """Writes the started device -> host copies into the host buffer."""
    if not self._pending:
      return
    t0 = time.perf_counter()
    for pages, dst in self._pending:
      data = np.asarray(pages).reshape((-1,) + self.slot_shape)
      self.buffer[dst] = data[:len(dst)]
    self._pending = []
    stats.host_transfer_s += time.perf_counter() - t0

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
    self.flush(stats)
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
      hslots = np.concatenate(hslots)
      pool = self._scatter_all(pool, state, rows, blocks, hslots)
      stats.host_hits += len(rows)
      stats.host_blocks_reloaded += len(rows)
      stats.host_bytes_reloaded += len(rows) * self.slot_bytes
    stats.host_transfer_s += time.perf_counter() - t0
    return pool, done

  def _scatter_all(self, pool, state, rows, blocks, hslots):
    big = self.reload_sizes[-1]
    for lo in range(0, len(rows), big):
      m = min(len(rows) - lo, big)
      size = next(s for s in self.reload_sizes if s >= m)
      r = np.full(size, -1, np.int32)
      b = np.zeros(size, np.int32)
      pages = np.zeros((size,) + self.slot_shape, self.buffer.dtype)
      r[:m], b[:m] = rows[lo:lo + m], blocks[lo:lo + m]
      np.take(self.buffer, hslots[lo:lo + m], axis=0, out=pages[:m])
      pool = self._scatter(pool, state, r, b, pages)
    return pool

  def _scatter(self, pool, state, rows, blocks, pages):
    pages = pages.reshape((-1,) + self.page_shape)
    # On a mesh the pages go straight to the pool's sharding (kv heads).
    pages = (jax.device_put(pages, pool.sharding)
             if self._mesh is not None else jax.device_put(pages))
    return _scatter(pool, state.seq_slots, rows, blocks, pages,
                    num_slots=self.device_slots)

  # ----------------------------------------------------------------- warmup
  def warmup(self, pool, state, inputs_shape):
    """Compiles every program of the tier (plan, lookup, each gather and
    scatter size) on `pool` and `state` (their shardings); returns the pool
    (a scatter donates it). `inputs_shape`: `(num_admit, max_model_len)`.
    The tier's state is left unchanged."""
    saved = self.state
    self._plan(state, self.state, 0)
    A, T = inputs_shape
    _cache.host_lookup(self.state, np.zeros((A, T), np.int32),
                       np.zeros(A, np.int32), np.zeros(A, np.int32),
                       np.zeros(A, np.int32))
    for size in self.gather_sizes:
      _gather(pool, np.full(size, -1, np.int32), num_slots=self.device_slots)
    for size in self.reload_sizes:
      pool = self._scatter(pool, state, np.full(size, -1, np.int32),
                           np.zeros(size, np.int32),
                           np.zeros((size,) + self.slot_shape,
                                    self.buffer.dtype))
    self.state = saved
    return pool

  def stats_into(self, stats: EngineStats) -> None:
    """Sets the tier's sizes in `stats`."""
    stats.host_num_slots = self.num_slots
    stats.host_kv_cache_bytes = self.num_slots * self.slot_bytes
