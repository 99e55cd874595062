"""`pkvattn.serving.kv_manager`: the host side of the engine's KV cache.

The pool's storage dtype per attention path, the sizes a manager derives
(one slot space or one per window group, SWA scratch in some space, the
smallest space bounding a request), the buffers it allocates, and how it
fills `EngineStats`' pool fields and peaks. Sizes are written out from
their definitions (a block = a page of K and V of one layer).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pkvattn import cache as pcache
from pkvattn.models import tiny
from pkvattn.serving.config import EngineConfig
from pkvattn.serving.kv_manager import KVCacheManager, storage_dtype
from pkvattn.serving.stats import EngineStats

LLAMA = tiny.TINY_CONFIGS["tiny-llama"]      # windows (-1, -1)
GEMMA3 = tiny.TINY_CONFIGS["tiny-gemma3"]    # windows (15, 15, -1)
SLIDING = tiny.replace(GEMMA3, layer_windows=(15, 7, 7))  # no global layer
ALL_SWA = tiny.replace(GEMMA3, layer_windows=(15, 15, 15))

CFG = EngineConfig(page_size=8, num_slots=40, max_seqs=4, max_num_tokens=64,
                   max_model_len=96, impl="xla")


def _manager(model_cfg=LLAMA, dtype=jnp.float32, **kw):
  return KVCacheManager(dataclasses.replace(CFG, **kw), model_cfg, dtype)


@pytest.mark.parametrize("impl,fp8_storage", [
    ("xla", jnp.uint8), ("pallas", jnp.float8_e4m3fn)])
def test_storage_dtype(impl, fp8_storage):
  # FP8 pages are bytes on the XLA path only; other pages are themselves.
  assert storage_dtype(jnp.float8_e4m3fn, impl) == fp8_storage
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    assert storage_dtype(dtype, impl) == dtype
  # None resolves as the ops do: the kernels on a GPU, XLA elsewhere.
  on_gpu = jax.default_backend() == "gpu"
  assert storage_dtype(jnp.float8_e4m3fn, None) == (
      jnp.float8_e4m3fn if on_gpu else jnp.uint8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16,
                                   jnp.float8_e4m3fn])
def test_flat_sizes_and_buffers(dtype):
  kv = _manager(dtype=dtype)
  assert not kv.hybrid and not kv.scratch
  assert isinstance(kv.cache_config, pcache.CacheConfig)
  assert kv.group_configs == (kv.cache_config,)
  assert kv.max_slots == 40
  item = np.dtype(dtype).itemsize
  assert kv.block_bytes == 2 * 8 * LLAMA.num_kv_heads * LLAMA.head_dim * item
  pages = 40 * LLAMA.num_layers * 2
  assert kv.pool_shape == (pages, 8, LLAMA.num_kv_heads, LLAMA.head_dim)
  assert kv.dtype == dtype
  assert kv.storage_dtype == (jnp.uint8 if dtype == jnp.float8_e4m3fn
                              else dtype)
  pool, state, tokens = kv.allocate()
  assert pool.shape == kv.pool_shape and pool.dtype == kv.storage_dtype
  assert not np.asarray(pool.astype(jnp.float32)).any()
  assert tokens.shape == (4, 96) and tokens.dtype == jnp.int32
  assert not np.asarray(tokens).any()
  pcache.validate(state)
  assert kv.pool_text == "num_slots=40"


def test_window_groups_bound_a_request_by_the_smallest_space():
  kv = _manager(GEMMA3, group_num_slots=(30, 13))
  assert kv.hybrid and not kv.scratch
  assert [c.num_slots for c in kv.group_configs] == [30, 13]
  assert kv.max_slots == 13
  # One pool page per slot, layer and K / V, over every group's layers.
  assert kv.pool_shape[0] == 30 * 1 * 2 + 13 * 2 * 2
  assert "group_num_slots=(30, 13)" in kv.pool_text
  # The global space may be the smaller one.
  assert _manager(GEMMA3, group_num_slots=(12, 20)).max_slots == 12


def test_scratch_in_some_space():
  # The sliding group of a model with a global layer has scratch; so has a
  # flat cache whose layers all slide; a global-only model has none.
  assert _manager(GEMMA3, enable_swa_scratch_reuse=True).scratch
  assert _manager(ALL_SWA, enable_swa_scratch_reuse=True).scratch
  assert _manager(ALL_SWA, kv_groups=False,
                  enable_swa_scratch_reuse=True).scratch
  assert not _manager(GEMMA3, kv_groups=False,
                      enable_swa_scratch_reuse=True).scratch
  assert not _manager(LLAMA, enable_swa_scratch_reuse=True).scratch
  assert not _manager(ALL_SWA).scratch


@pytest.mark.parametrize("model_cfg,kw,saved,flat", [
    (LLAMA, {}, None, None),
    (ALL_SWA, dict(kv_groups=False, enable_swa_scratch_reuse=True), 0, None),
    # Per-group spaces: scratch is counted by the cache, not at claims; the
    # flat layout's bytes are tracked only where a global group exists.
    (GEMMA3, dict(enable_swa_scratch_reuse=True), None, 0),
    (GEMMA3, {}, None, 0),
    (SLIDING, {}, None, None),
    # Window 0 (a token sees itself only) is a sliding window too.
    (tiny.replace(GEMMA3, layer_windows=(0, 0, 0)), dict(kv_groups=True),
     None, None),
])
def test_start_stats(model_cfg, kw, saved, flat):
  kv = _manager(model_cfg, dtype=jnp.bfloat16, **kw)
  stats = EngineStats()
  kv.start_stats(stats)
  assert stats.slots_saved_by_scratch == saved
  assert stats.flat_peak_kv_bytes == flat
  assert stats.peak_group_slots == (0,) * len(kv.group_configs)
  assert stats.kv_cache_dtype == "bfloat16"
  assert stats.kv_cache_bytes == int(np.prod(kv.pool_shape)) * 2


def test_fp8_pool_bytes_count_pages_not_storage():
  kv = _manager(dtype=jnp.float8_e4m3fn)
  stats = EngineStats()
  kv.start_stats(stats)
  assert stats.kv_cache_dtype == "float8_e4m3fn"
  assert stats.kv_cache_bytes == int(np.prod(kv.pool_shape))


def test_record_usage_keeps_peaks_per_space():
  kv = _manager(GEMMA3, group_num_slots=(30, 13))
  stats = EngineStats()
  kv.start_stats(stats)
  layers = [g.num_layers for g in kv.cache_config.groups]   # [1, 2]
  bb = kv.block_bytes
  kv.record_usage(stats, np.array([5, 9], np.int32))
  assert stats.peak_group_slots == (5, 9)
  assert stats.peak_used_slots == 5
  assert stats.peak_kv_bytes == (5 * layers[0] + 9 * layers[1]) * bb
  assert stats.flat_peak_kv_bytes == 5 * GEMMA3.num_layers * bb
  # Each peak moves on its own: a later, smaller use lowers none of them.
  kv.record_usage(stats, np.array([7, 2], np.int32))
  assert stats.peak_group_slots == (7, 9)
  assert stats.peak_used_slots == 7
  assert stats.peak_kv_bytes == (5 * 1 + 9 * 2) * bb
  assert stats.flat_peak_kv_bytes == 7 * 3 * bb
  kv.record_usage(stats, np.array([1, 1], np.int32))
  assert stats.peak_group_slots == (7, 9)
  assert stats.peak_kv_bytes == 23 * bb and stats.flat_peak_kv_bytes == 21 * bb


def test_record_usage_of_one_space():
  kv = _manager()
  stats = EngineStats()
  kv.start_stats(stats)
  kv.record_usage(stats, np.int32(6))
  kv.record_usage(stats, np.int32(4))
  assert (stats.peak_group_slots, stats.peak_used_slots) == ((6,), 6)
  assert stats.peak_kv_bytes == 6 * LLAMA.num_layers * kv.block_bytes
  assert stats.flat_peak_kv_bytes is None


@pytest.mark.parametrize("kv_heads,head_dim", [(2, 32), (4, 16)])
def test_sizes_scale_with_kv_heads(kv_heads, head_dim):
  """A block is a page of K and V of one layer: 2 * page_size * kv_heads *
  head_dim items, an exact int of bytes (the tiny models have one KV head,
  which hides how the heads enter)."""
  model_cfg = tiny.replace(LLAMA, num_qo_heads=kv_heads,
                           num_kv_heads=kv_heads, head_dim=head_dim)
  kv = _manager(model_cfg, dtype=jnp.bfloat16)
  assert type(kv.block_bytes) is int
  assert kv.block_bytes == 2 * 8 * kv_heads * head_dim * 2
  assert kv.pool_shape == (40 * LLAMA.num_layers * 2, 8, kv_heads, head_dim)
  stats = EngineStats()
  kv.start_stats(stats)
  kv.record_usage(stats, np.int32(3))
  assert stats.peak_kv_bytes == 3 * LLAMA.num_layers * kv.block_bytes
  assert stats.kv_cache_bytes == kv.pool_shape[0] * kv.block_bytes // 2
