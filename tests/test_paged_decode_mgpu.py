"""The Mosaic-GPU decode backend (`pallas_kernels/paged_decode_mgpu.py`).

On the CPU CI: the backend choice and its errors, and a cross-lowering of the
kernel for CUDA (Pallas -> Mosaic GPU MLIR) through `paged_decode`, which
runs the layout / shape / shared-memory checks of the lowering without a GPU.
Mosaic GPU has no interpret mode for warp-specialised kernels, so the
numerics run only on a Hopper GPU (`test_matches_oracle_gpu`, skipped
elsewhere; `bench/bench_decode_mosaic.py` checks more cases there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_utils import assert_close, assert_lse_close, dense_attention
from attention_utils import make_paged
from pkvattn import _kv
from pkvattn.pallas_kernels import paged_decode as kernel
from pkvattn.pallas_kernels import paged_decode_mgpu as mgpu

_C = kernel.Config


def _mosaic(b=4, hkv=2, ps=16, max_pages=64, d=128, **over):
  cfg = _C.default_for(batch_size=b, num_kv_heads=hkv, page_size=ps,
                       max_pages=max_pages, head_dim=d, backend="mosaic")
  return dataclasses.replace(cfg, **over)


def test_backend_choice_and_errors():
  # No Hopper GPU here: never the default, whatever the shape.
  for g, d in ((3, 64), (4, 128), (8, 128)):
    cfg = _C.default_for(batch_size=8, num_kv_heads=2, page_size=16,
                         max_pages=64, head_dim=d, group_size=g,
                         dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16)
    if not mgpu.supports(dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
                         head_dim=d, page_size=16, group_size=g):
      assert cfg.backend == "triton"
  # Cases the kernel does not serve, whatever the GPU.
  base = dict(dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, head_dim=128,
              page_size=16, group_size=4)
  for kw in (dict(dtype=jnp.float32, kv_dtype=jnp.float32),
             dict(kv_dtype=jnp.float8_e4m3fn), dict(head_dim=256),
             dict(group_size=9), dict(page_size=4), dict(page_size=256)):
    assert not mgpu.supports(**{**base, **kw})
  cfg = _mosaic()
  assert cfg.backend == "mosaic"
  assert cfg.pages_per_block * 16 == 128
  with pytest.raises(ValueError, match="backend"):
    _C(pages_per_block=1, k_splits=1, backend="cuda")
  with pytest.raises(ValueError, match="backend"):
    _C.default_for(batch_size=1, num_kv_heads=1, page_size=16, max_pages=4,
                   head_dim=128, backend="cuda")
  q = jnp.zeros((2, 8, 128), jnp.bfloat16)
  pool = jnp.zeros((4, 16, 2, 128), jnp.bfloat16)
  table = jnp.zeros((2, 4), jnp.int32)
  lens = jnp.array([3, 5], jnp.int32)
  with pytest.raises(ValueError, match="mosaic backend"):
    kernel.paged_decode(q, pool, pool, table, table, lens, sm_scale=0.1,
                        config=cfg, interpret=True)
  pool8 = pool.astype(jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="mosaic backend"):
    kernel.paged_decode(q, pool8, pool8, table, table, lens, sm_scale=0.1,
                        config=cfg, k_scale=1.0, v_scale=1.0)
  for kw, match in ((dict(head_dim=256), "head_dim"),
                    (dict(block_kv=32), "block_kv"),
                    (dict(hq=18), "group"),
                    (dict(num_stages=3), "shared memory"),
                    (dict(num_stages=3, block_kv=64, consumers=2),
                     "consumers"),
                    (dict(final=True, k_splits=2), "final")):
    kw = dict(kw)
    d, hq = kw.pop("head_dim", 128), kw.pop("hq", 8)
    with pytest.raises(ValueError, match=match):
      mgpu.paged_decode_mgpu(
          jnp.zeros((2, hq, d), jnp.bfloat16),
          jnp.zeros((4, 16, 2, d), jnp.bfloat16),
          jnp.zeros((4, 16, 2, d), jnp.bfloat16), table, table, lens,
          sm_scale=0.1, **kw)


@pytest.mark.parametrize(
    "hq,hkv,d,page_size,k_splits,window_left,soft_cap,sinks,warps", [
        (32, 8, 128, 16, 1, -1, None, False, 4),    # Llama-3-8B heads
        (32, 8, 128, 16, 1, -1, None, False, 8),    # two consumers
        (9, 3, 64, 16, 2, 100, 30.0, True, 8),      # two consumers, split
        (9, 3, 64, 16, 2, -1, None, False, 4),      # SmolLM2: group 3
        (14, 2, 128, 128, 4, 100, 30.0, False, 4),  # group 7, big pages
        (4, 4, 64, 8, 1, 7, None, True, 4),         # group 1, sinks
        (5, 1, 128, 32, 4, -1, None, False, 4),     # group 5, 5 heads
    ])
def test_kernel_lowers_to_mosaic_gpu(hq, hkv, d, page_size, k_splits,
                                     window_left, soft_cap, sinks, warps):
  """Cross-lowers `paged_decode` with the mosaic backend for CUDA on the CPU:
  every TMA slice, layout and barrier of the lowering must be accepted."""
  b, pages = 3, 40
  sds = jax.ShapeDtypeStruct
  cfg = _mosaic(b=b, hkv=hkv, ps=page_size, max_pages=12, d=d,
                k_splits=k_splits, num_warps=warps)
  args = [sds((b, hq, d), jnp.bfloat16),
          sds((pages, page_size, hkv, d), jnp.bfloat16),
          sds((pages, page_size, hkv, d), jnp.bfloat16),
          sds((b, 12), jnp.int32), sds((b, 12), jnp.int32), sds((b,), jnp.int32),
          sds((hq,), jnp.float32) if sinks else None]
  lowered = jax.jit(
      lambda *a: kernel.paged_decode(
          *a, sm_scale=d ** -0.5, window_left=window_left,
          logits_soft_cap=soft_cap, config=cfg)).trace(*args).lower(
              lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


def _hopper() -> bool:
  return mgpu.supports(dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
                       head_dim=128, page_size=16, group_size=4)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("group,d,page_size,fmt,kw,k_splits,warps", [
    (1, 128, 16, "pair", {}, 1, 4),
    (3, 64, 16, "flashinfer", dict(window_left=100), 4, 4),
    (5, 128, 32, "pool", dict(sinks=True), 1, 4),
    (6, 128, 8, "pair", dict(logits_soft_cap=30.0), 2, 4),
    (7, 64, 128, "pool", {}, 2, 4),
    (8, 128, 64, "flashinfer", dict(window_left=37, sinks=True), 2, 4),
    (4, 128, 16, "pair", {}, 1, 8),            # two consumers
    (3, 64, 16, "pool", dict(window_left=300, sinks=True), 2, 8),
])
def test_matches_oracle_gpu(group, d, page_size, fmt, kw, k_splits, warps):
  """NaN in every page a sequence does not own and past kv_len; odd
  lengths; the group's rows only are written."""
  rng = np.random.default_rng(group * 100 + page_size)
  hkv, kv_lens = 2, [0, 1, 7, 129, 4095]
  p = make_paged(rng, kv_lens, page_size=page_size, num_kv_heads=hkv,
                 head_dim=d, dtype=jnp.bfloat16, fmt=fmt)
  hq = group * hkv
  q = jnp.asarray(rng.standard_normal((len(kv_lens), hq, d)), jnp.bfloat16)
  kw = dict(kw)
  sinks = (jnp.asarray(rng.standard_normal(hq) * 2, jnp.float32)
           if kw.pop("sinks", False) else None)
  view = _kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
  cfg = _mosaic(b=len(kv_lens), hkv=hkv, ps=page_size,
                max_pages=view.k_table.shape[1], d=d, k_splits=k_splits,
                num_warps=warps)
  out, lse = kernel.paged_decode(
      q, view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(p.kv_lens), sinks, sm_scale=d ** -0.5, config=cfg, **kw)
  qf = np.asarray(q.astype(jnp.float32))
  for b, n in enumerate(kv_lens):
    exp, exp_lse = dense_attention(
        qf[b:b + 1], p.k[b], p.v[b], [n - 1], n, sm_scale=d ** -0.5,
        window_left=kw.get("window_left", -1),
        logits_soft_cap=kw.get("logits_soft_cap"),
        sinks=None if sinks is None else np.asarray(sinks))
    assert_close(out[b:b + 1], exp, jnp.bfloat16, f"b={b}")
    assert_lse_close(lse[b], exp_lse[0], jnp.bfloat16)
