"""The host side of the engine's paged KV cache: sizes, buffers, usage.

The cache itself (allocator, prefix reuse, page tables) runs on the device,
inside the engine's programs (`serving.programs`, `pkvattn.cache`). What the
host needs of it is small and lives here: the cache config an engine config
implies (one slot space, or one per window group for models whose layers
differ in `window_left`), the KV pool, cache state and token buffer it
starts from (the pool sharded on the kv-head axis under a tensor-parallel
mesh), how a request's size
compares with the pool (`pool_text`, `max_slots`), and the peak-usage
figures of `EngineStats`.

FP8 pages are stored as what the step's attention dispatch reads best
(`storage_dtype`): on the Pallas path (`impl="pallas"`, or None on a GPU)
as float8_e4m3fn, which the kernels read and write natively; on the XLA
path (`impl="xla"`, or None elsewhere) as their `uint8` bytes
(`pkvattn._kv.as_bytes`), end to end: allocated so, passed so through
every program (`pkvattn.models.forward` and `pkvattn.parallel.tp_forward`
take and return the bytes) and the host tier's copies. XLA's CPU backend
has no FP8 scatter: a float8_e4m3fn pool given to a step is converted to
bytes and back around its in-place update, two passes over the whole pool
per step whatever the step's size, where a byte pool is updated in place
(measured: docs/performance.md). The page dtype (`dtype`, and
`EngineStats.kv_cache_dtype`) stays float8_e4m3fn either way; read a byte
pool's values with `pkvattn._kv.from_bytes`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pkvattn import _checks
from pkvattn import _kv
from pkvattn import cache as _cache
from pkvattn.serving.config import EngineConfig
from pkvattn.serving.config import cache_config as _cache_config
from pkvattn.serving.config import group_slots as _group_slots
from pkvattn.serving.config import num_pool_pages as _num_pool_pages
from pkvattn.serving.stats import EngineStats


def storage_dtype(dtype, impl) -> jnp.dtype:
  """The dtype an engine's pool of `dtype` pages is stored in under the
  attention implementation `impl` ("pallas", "xla" or None = pallas on a
  GPU, xla elsewhere, as `pkvattn.paged_prefill` resolves it): `uint8` (the
  pages' bytes) for float8_e4m3fn pages on the XLA path, `dtype` otherwise
  (module docstring)."""
  dtype = jnp.dtype(dtype)
  pallas = _checks.resolve_impl(impl) == "pallas"
  return jnp.dtype(jnp.uint8) if _kv.is_fp8(dtype) and not pallas else dtype


class KVCacheManager:
  """Sizes of an engine's KV cache and the accounting of its use.

  Attributes:
    cache_config: a `pkvattn.cache.CacheConfig`, or a `HybridCacheConfig`
      with one slot space per window group.
    group_configs: the per-space configs (one entry for a flat cache).
    hybrid: whether there are per-window-group slot spaces.
    scratch: whether SWA scratch reuse is active in some space (a prompt is
      then prefilled in one step: scratch blocks live for one step).
    max_slots: slots of the smallest slot space (bounds one request).
    block_bytes: bytes of one block of one layer, K and V.
    pool_shape: `(num_pages, page_size, num_kv_heads, head_dim)`.
    dtype: the page dtype.
    storage_dtype: the pool array's dtype (`storage_dtype`): `dtype`, or
      `uint8` for FP8 pages on the XLA path.
  """

  def __init__(self, config: EngineConfig, model_cfg, dtype):
    """Raises ValueError: a slot budget the cache config rejects
    (`serving.config.cache_config`)."""
    self.cache_config = _cache_config(config, model_cfg)
    self.hybrid = isinstance(self.cache_config, _cache.HybridCacheConfig)
    self.group_configs = (self.cache_config.group_configs if self.hybrid
                          else (self.cache_config,))
    self.scratch = any(c.swa_scratch_active for c in self.group_configs)
    self.max_slots = min(_group_slots(self.cache_config))
    self.dtype = jnp.dtype(dtype)
    self.storage_dtype = storage_dtype(self.dtype, config.impl)
    self.block_bytes = (2 * config.page_size * model_cfg.num_kv_heads
                        * model_cfg.head_dim * self.dtype.itemsize)
    self.pool_shape = (_num_pool_pages(self.cache_config), config.page_size,
                       model_cfg.num_kv_heads, model_cfg.head_dim)
    self._num_slots = config.num_slots
    self._token_shape = (config.max_seqs, config.max_model_len)
    self._num_layers = model_cfg.num_layers

  def allocate(self, mesh: jax.sharding.Mesh | None = None):
    """`(pool, state, seq_tokens)`: a zeroed pool (`pool_shape`,
    `storage_dtype`),
    an empty cache state and a zeroed token buffer (i32[max_seqs,
    max_model_len]: each row's tokens, which `commit` hashes for prefix
    reuse). On a mesh the pool is allocated sharded on its kv-head axis, so
    no device ever holds all of it, and the state and token buffer are
    replicated (the bookkeeping runs identically on every device)."""
    shape, dtype = self.pool_shape, self.storage_dtype
    cache_config, token_shape = self.cache_config, self._token_shape

    # One program builds all three: built op by op, each zeroed buffer of a
    # new shape compiled a program of its own, before the first step's
    # lowering could start (measured: docs/performance.md).
    def build():
      return (jnp.zeros(shape, dtype), _cache.init_cache(cache_config),
              jnp.zeros(token_shape, jnp.int32))

    if mesh is None:
      # Committed to the device, as the programs' outputs are, so every
      # program (the steps, the host tier's) sees one placement and
      # compiles once.
      shardings = jax.sharding.make_single_device_sharding(jax.devices()[0])
    else:
      from pkvattn import parallel as _parallel  # parallel imports models
      replicated = _parallel.replicated(mesh)
      shardings = (_parallel.pool_sharding(mesh), replicated, replicated)
    return jax.jit(build, out_shardings=shardings)()

  @property
  def pool_text(self) -> str:
    """The pool's size in words, for error messages."""
    if not self.hybrid:
      return f"num_slots={self._num_slots}"
    return (f"group_num_slots={self.cache_config.group_num_slots} (per window "
            f"group; the smallest bounds one request)")

  def start_stats(self, stats: EngineStats) -> None:
    """Sets the fields of `stats` that describe this cache (the pool's dtype
    and bytes; which optional peak figures apply)."""
    if self.scratch and not self.hybrid:
      stats.slots_saved_by_scratch = 0
    stats.peak_group_slots = (0,) * len(self.group_configs)
    if self.hybrid and self.cache_config.groups[0].window_left < 0:
      stats.flat_peak_kv_bytes = 0
    stats.kv_cache_dtype = str(self.dtype)
    stats.kv_cache_bytes = int(np.prod(self.pool_shape)) * self.dtype.itemsize

  def record_usage(self, stats: EngineStats, used_slots) -> None:
    """Raises the peaks of `stats`: slots per slot space and KV bytes held
    (slots in use x their layers x `block_bytes`), and, with a global group,
    what a flat layout (every layer keeping the global group's blocks) would
    hold. `used_slots`: i32[] or i32[groups], a program's output."""
    used = np.atleast_1d(np.asarray(used_slots)).astype(int)
    stats.peak_group_slots = tuple(
        max(a, int(b)) for a, b in zip(stats.peak_group_slots, used))
    stats.peak_used_slots = stats.peak_group_slots[0]
    held = sum(int(u) * c.num_layers for u, c in zip(used, self.group_configs))
    stats.peak_kv_bytes = max(stats.peak_kv_bytes, held * self.block_bytes)
    if stats.flat_peak_kv_bytes is not None:
      flat = int(used[0]) * self._num_layers * self.block_bytes
      stats.flat_peak_kv_bytes = max(stats.flat_peak_kv_bytes, flat)
