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

from attention_utils import assert_close, assert_decode_matches
from attention_utils import assert_lse_close, dense_attention, make_paged
from attention_utils import paged_decode_case
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
             dict(kv_dtype=jnp.float16), dict(head_dim=96),
             dict(head_dim=256, kv_dtype=jnp.float8_e4m3fn),
             dict(group_size=9), dict(page_size=4), dict(page_size=256)):
    assert not mgpu.supports(**{**base, **kw})
  cfg = _mosaic()
  assert cfg.backend == "mosaic"
  assert cfg.pages_per_block * 16 == 128
  with pytest.raises(ValueError, match="backend"):
    _C(pages_per_block=1, k_splits=1, backend="cuda")
  with pytest.raises(ValueError, match="num_warps"):
    _C(pages_per_block=8, k_splits=1, num_warps=8, backend="mosaic")
  with pytest.raises(ValueError, match="num_ctas"):
    _C(pages_per_block=8, k_splits=1, num_ctas=4)
  with pytest.raises(ValueError, match="num_ctas"):
    _C(pages_per_block=8, k_splits=1, num_ctas=0, backend="mosaic")
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
  for kw, match in (
      (dict(), "scales"),                             # FP8 pages, no scales
      (dict(k_scale=1.0), "scales"),                  # one scale
      (dict(k_scale=1.0, v_scale=1.0, fp8_stages=0), "fp8_stages"),
      (dict(k_scale=1.0, v_scale=1.0, v8=False), "dtype")):  # mixed pools
    kw = dict(kw)
    v_pool = pool8 if kw.pop("v8", True) else pool
    with pytest.raises(ValueError, match=match):
      mgpu.paged_decode_mgpu(q, pool8, v_pool, table, table, lens,
                             sm_scale=0.1, **kw)
  with pytest.raises(ValueError, match="scales"):  # scales on bf16 pages
    mgpu.paged_decode_mgpu(q, pool, pool, table, table, lens, sm_scale=0.1,
                           k_scale=1.0, v_scale=1.0)
  # cp.async page loads: bf16 / f16 pages with the q rows in M only.
  for kw in (dict(k_pool=pool8, k_scale=1.0, v_scale=1.0),
             dict(keys_m=True)):
    kw = dict(kw)
    k = kw.pop("k_pool", pool)
    with pytest.raises(ValueError, match="cp_async"):
      mgpu.paged_decode_mgpu(q, k, k, table, table, lens, sm_scale=0.1,
                             cp_async=True, **kw)
  with pytest.raises(ValueError, match="cp_async"):
    _C(pages_per_block=8, k_splits=1, cp_async=True)  # the Triton kernel
  for kw, match in ((dict(head_dim=96), "head_dim"),
                    (dict(block_kv=32), "block_kv"),
                    (dict(hq=18), "group"),
                    (dict(num_stages=3), "shared memory"),
                    (dict(num_ctas=0), "num_ctas"),
                    (dict(final=True, k_splits=2), "final")):
    kw = dict(kw)
    d, hq = kw.pop("head_dim", 128), kw.pop("hq", 8)
    with pytest.raises(ValueError, match=match):
      mgpu.paged_decode_mgpu(
          jnp.zeros((2, hq, d), jnp.bfloat16),
          jnp.zeros((4, 16, 2, d), jnp.bfloat16),
          jnp.zeros((4, 16, 2, d), jnp.bfloat16), table, table, lens,
          sm_scale=0.1, **kw)


def test_default_rule_on_hopper(monkeypatch):
  """On Hopper the per-warp Mosaic kernel (`paged_decode_mma`) is the
  default for bf16 / f16 q over pages of that dtype or FP8 ones, head_dim
  64 / 128 / 256, groups 1..8, pages of 8..128 tokens; Triton for f32,
  mixed 16-bit dtypes and interpret mode. The TMA Mosaic kernel runs only
  when asked for (`backend="mosaic"`)."""
  from pkvattn.pallas_kernels import _compat  # noqa: PLC0415
  monkeypatch.setattr(_compat, "is_hopper", lambda: True)

  def cfg_for(ps, d=64, g=3, kv_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
              interpret=False):
    return _C.default_for(batch_size=64, num_kv_heads=3, page_size=ps,
                          max_pages=4096 // ps, head_dim=d, group_size=g,
                          dtype=dtype, kv_dtype=kv_dtype,
                          interpret=interpret)

  def backend(*a, **kw):
    return cfg_for(*a, **kw).backend

  for d in (64, 128, 256):
    for g in (1, 3, 4, 6, 8):
      for ps in (8, 16, 64, 128):
        assert backend(ps, d, g) == "mosaic_mma", (d, g, ps)
        fp8 = cfg_for(ps, d, g, kv_dtype=jnp.float8_e4m3fn)
        assert fp8.backend == "mosaic_mma", (d, g, ps)
        # FP8 pages: 32-key steps up to head_dim 128.
        assert fp8.mma_tiles == (2 if d <= 128 else None), (d, fp8)
        assert cfg_for(ps, d, g).mma_tiles is None
  assert backend(16, dtype=jnp.float16, kv_dtype=jnp.float16) == "mosaic_mma"
  assert backend(128, dtype=jnp.float16,
                 kv_dtype=jnp.float8_e4m3fn) == "mosaic_mma"
  assert backend(16, dtype=jnp.float32, kv_dtype=jnp.float32) == "triton"
  assert backend(16, dtype=jnp.float32,
                 kv_dtype=jnp.float8_e4m3fn) == "triton"
  assert backend(16, kv_dtype=jnp.float16) == "triton"
  assert backend(16, g=9) == "triton"
  assert backend(16, interpret=True) == "triton"
  assert backend(128, interpret=True) == "triton"
  monkeypatch.setattr(_compat, "is_hopper", lambda: False)
  assert backend(16) == "triton"
  assert backend(16, kv_dtype=jnp.float8_e4m3fn) == "triton"
  monkeypatch.setattr(_compat, "is_hopper", lambda: True)
  cfg = _C.default_for(batch_size=64, num_kv_heads=3, page_size=128,
                       max_pages=32, head_dim=64, group_size=3,
                       dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
                       backend="mosaic")
  assert (cfg.pages_per_block, cfg.num_stages, cfg.num_warps) == (1, 2, 4)
  assert not cfg.keys_m and not cfg.cp_async
  # The Mosaic kernel loads 8-token pages by cp.async, larger ones by TMA;
  # FP8 pages (keys in M) always by TMA.
  assert kernel.CP_ASYNC_MAX_PAGE_SIZE == 8
  for ps, want in ((8, True), (16, False), (32, False), (128, False)):
    for kv_dtype, fp8 in ((jnp.bfloat16, False), (jnp.float8_e4m3fn, True)):
      cfg = _C.default_for(batch_size=64, num_kv_heads=3, page_size=ps,
                           max_pages=4096 // ps, head_dim=64, group_size=3,
                           dtype=jnp.bfloat16, kv_dtype=kv_dtype,
                           backend="mosaic")
      assert cfg.cp_async == (want and not fp8), (ps, kv_dtype, cfg)
  # Asked for, the Mosaic kernel on FP8 pages puts the keys in M, 128-key
  # steps; head_dim 256 takes 64-key steps.
  for d, keys in ((128, 128), (64, 128)):
    cfg = _C.default_for(batch_size=64, num_kv_heads=8, page_size=16,
                         max_pages=256, head_dim=d, group_size=4,
                         dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn,
                         backend="mosaic")
    assert cfg.keys_m and cfg.pages_per_block * 16 == keys, (d, cfg)
  cfg = _C.default_for(batch_size=64, num_kv_heads=1, page_size=16,
                       max_pages=256, head_dim=256, group_size=4,
                       backend="mosaic")
  assert not cfg.keys_m and cfg.pages_per_block * 16 == 64


@pytest.mark.parametrize(
    "hq,hkv,d,page_size,k_splits,window_left,soft_cap,sinks,num_ctas", [
        (32, 8, 128, 16, 1, -1, None, False, None),  # Llama-3-8B heads
        (32, 8, 128, 16, 1, -1, None, False, 5),     # 24 items on 5 CTAs
        (9, 3, 64, 16, 2, 100, 30.0, True, 1),       # one CTA, split
        (9, 3, 64, 16, 2, -1, None, False, None),    # SmolLM2: group 3
        (14, 2, 128, 128, 4, 100, 30.0, False, 7),   # group 7, big pages
        (4, 4, 64, 8, 1, 7, None, True, None),       # group 1, sinks
        (5, 1, 128, 32, 4, -1, None, False, 2),      # group 5, 5 heads
        (4, 1, 256, 16, 1, -1, None, False, None),   # Gemma 3 270M heads
        (8, 2, 256, 128, 2, 50, 30.0, True, 3),      # head_dim 256, split
    ])
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_kernel_lowers_to_mosaic_gpu(hq, hkv, d, page_size, k_splits,
                                     window_left, soft_cap, sinks, num_ctas,
                                     kv_dtype):
  """Cross-lowers `paged_decode` with the mosaic backend for CUDA on the CPU:
  every TMA slice, layout and barrier of the lowering must be accepted,
  with bf16 pages and with FP8 pages (staging ring, converter warpgroup,
  q converted in place, traced scales)."""
  b, pages = 3, 40
  sds = jax.ShapeDtypeStruct
  fp8 = kv_dtype == jnp.float8_e4m3fn
  # One q buffer and 64-key steps at head_dim 256 (FP8 pages: 64 / 128 only).
  assert mgpu.q_buffers(d) == (1 if d == 256 else 2)
  cfg = _mosaic(b=b, hkv=hkv, ps=page_size, max_pages=12, d=d,
                k_splits=k_splits, num_ctas=num_ctas)
  args = [sds((b, hq, d), jnp.bfloat16),
          sds((pages, page_size, hkv, d), kv_dtype),
          sds((pages, page_size, hkv, d), kv_dtype),
          sds((b, 12), jnp.int32), sds((b, 12), jnp.int32), sds((b,), jnp.int32),
          sds((hq,), jnp.float32) if sinks else None,
          sds((), jnp.float32) if fp8 else None,
          sds((), jnp.float32) if fp8 else None]

  def run(q, k, v, kt, vt, n, s, ks, vs):
    return kernel.paged_decode(
        q, k, v, kt, vt, n, s, sm_scale=d ** -0.5, window_left=window_left,
        logits_soft_cap=soft_cap, config=cfg, k_scale=ks, v_scale=vs)
  lower = lambda: jax.jit(run).trace(*args).lower(  # noqa: E731
      lowering_platforms=("cuda",)).as_text()
  if fp8 and d > 128:
    with pytest.raises(ValueError, match="head_dim"):
      lower()
    return
  assert "mosaic_gpu" in lower()


def _hopper() -> bool:
  return mgpu.supports(dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
                       head_dim=128, page_size=16, group_size=4)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("group,d,page_size,fmt,kw,k_splits,num_ctas", [
    (1, 128, 16, "pair", {}, 1, None),
    (3, 64, 16, "flashinfer", dict(window_left=100), 4, None),
    (5, 128, 32, "pool", dict(sinks=True), 1, None),
    (6, 128, 8, "pair", dict(logits_soft_cap=30.0), 2, None),
    (7, 64, 128, "pool", {}, 2, None),
    (8, 128, 64, "flashinfer", dict(window_left=37, sinks=True), 2, None),
    # Several items per CTA: the ring and q buffers run across items,
    # empty ones (kv_len 0, splits past the end) included.
    (4, 128, 16, "pair", {}, 1, 3),
    (3, 64, 16, "pool", dict(window_left=300, sinks=True), 2, 1),
    (2, 64, 8, "flashinfer", dict(logits_soft_cap=30.0), 8, 7),
    (8, 128, 128, "pair", {}, 2, 4),
    # Head_dim 256 (Gemma 3 270M heads: group 4): one q buffer, 64-key
    # steps (two per 128-token page).
    (4, 256, 16, "pair", {}, 1, None),
    (4, 256, 128, "flashinfer", dict(window_left=100, sinks=True), 2, 3),
    (2, 256, 32, "pool", dict(logits_soft_cap=30.0), 4, None),
])
def test_matches_oracle_gpu(group, d, page_size, fmt, kw, k_splits, num_ctas):
  """NaN in every page a sequence does not own and past kv_len; odd
  lengths; the group's rows only are written; one CTA per SM or fewer CTAs
  serving several items each."""
  _check_oracle(group, d, page_size, fmt, kw, k_splits, num_ctas)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("group,d,page_size,fmt,kw,k_splits,cp_async", [
    (3, 64, 8, "flashinfer", dict(window_left=100), 2, True),
    (4, 128, 32, "pair", {}, 1, True),
    (7, 64, 128, "pool", dict(logits_soft_cap=30.0), 2, True),
    (4, 256, 16, "pair", dict(sinks=True), 1, True),
    (3, 64, 16, "pool", {}, 2, True),
    (8, 64, 8, "pair", dict(window_left=37), 1, False),
])
def test_page_loads_match_oracle_gpu(group, d, page_size, fmt, kw, k_splits,
                                     cp_async):
  """Each page-load path where the default picks the other: cp.async at
  pages of 16, 32 and 128 tokens, TMA at 8."""
  _check_oracle(group, d, page_size, fmt, kw, k_splits, None,
                cp_async=cp_async, seed=None)


def _check_oracle(group, d, page_size, fmt, kw, k_splits, num_ctas,
                  seed=0, **over):
  rng = np.random.default_rng(
      None if seed is None else group * 100 + page_size)
  p, q, sinks, kw = paged_decode_case(rng, group=group, head_dim=d,
                                      page_size=page_size, fmt=fmt, kw=kw)
  view = _kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
  cfg = _mosaic(b=q.shape[0], hkv=2, ps=page_size,
                max_pages=view.k_table.shape[1], d=d, k_splits=k_splits,
                num_ctas=num_ctas, **over)
  out, lse = kernel.paged_decode(
      q, view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(p.kv_lens), sinks, sm_scale=d ** -0.5, config=cfg, **kw)
  assert_decode_matches(
      out, lse, np.asarray(q.astype(jnp.float32)), p.k, p.v, p.kv_lens,
      jnp.bfloat16, sm_scale=d ** -0.5, sinks=None if sinks is None
      else np.asarray(sinks), **kw)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("group,d,page_size,fmt,kw,k_splits,num_ctas", [
    (4, 128, 16, "pair", {}, 1, None),               # Llama-3-8B group
    (3, 64, 16, "flashinfer", dict(window_left=100), 2, None),  # SmolLM2
    (8, 64, 8, "pool", dict(sinks=True), 1, 3),
    (1, 128, 128, "pair", dict(logits_soft_cap=30.0), 4, None),
    (5, 128, 64, "flashinfer", dict(window_left=37, sinks=True), 2, 1),
    (7, 64, 32, "pair", {}, 8, 5),
])
def test_fp8_matches_oracle_gpu(group, d, page_size, fmt, kw, k_splits,
                                num_ctas):
  """FP8 pages with per-tensor scales: the f64 oracle over the DEQUANTIZED
  pages (the quantization is the input, not the error) to bf16 tolerance;
  NaN in every page a sequence does not own and past kv_len; a bf16 q."""
  from attention_utils import fp8_paged as _fp8_paged  # noqa: PLC0415
  from attention_utils import query_and_sinks  # noqa: PLC0415
  rng = np.random.default_rng()
  hkv, kv_lens = 2, [0, 1, 7, 129, 4095]
  p, cache, tk, tv, ks, vs = _fp8_paged(rng, kv_lens, page_size=page_size,
                                        num_kv_heads=hkv, head_dim=d, fmt=fmt)
  q, sinks, kw = query_and_sinks(rng, len(kv_lens), group * hkv, d, kw)
  view = _kv.make_view(cache, jnp.asarray(p.page_table))
  cfg = dataclasses.replace(
      _C.default_for(batch_size=len(kv_lens), num_kv_heads=hkv,
                     page_size=page_size, max_pages=view.k_table.shape[1],
                     head_dim=d, kv_dtype=jnp.float8_e4m3fn,
                     backend="mosaic"),
      k_splits=k_splits, num_ctas=num_ctas, keys_m=False)  # rows in M
  out, lse = kernel.paged_decode(
      jnp.asarray(q, jnp.bfloat16), view.k_pool, view.v_pool, view.k_table,
      view.v_table, jnp.asarray(p.kv_lens),
      None if sinks is None else jnp.asarray(sinks), sm_scale=d ** -0.5,
      config=cfg, k_scale=jnp.float32(ks), v_scale=jnp.float32(vs), **kw)
  assert out.dtype == jnp.bfloat16
  for b, n in enumerate(kv_lens):
    exp, exp_lse = dense_attention(
        q[b:b + 1], tk[b], tv[b], [n - 1], n, sm_scale=d ** -0.5,
        window_left=kw.get("window_left", -1),
        logits_soft_cap=kw.get("logits_soft_cap"), sinks=sinks)
    assert_close(out[b:b + 1], exp, jnp.bfloat16, f"b={b}")
    assert_lse_close(lse[b], exp_lse[0], jnp.bfloat16)


@pytest.mark.parametrize("hq,hkv,d,page_size,block_kv,cp_async", [
    (9, 3, 64, 8, 128, True),      # a pass of 16 rows spans two pages
    (9, 3, 64, 16, 64, True),
    (32, 8, 128, 32, 128, True),
    (14, 2, 128, 128, 64, True),   # half a page per step
    (4, 1, 256, 16, 64, True),     # 4 column tiles per row
    (32, 8, 128, 16, 128, False),  # TMA at 16-token pages
    (9, 3, 64, 8, 64, False),
])
def test_page_loads_lower_to_mosaic_gpu(hq, hkv, d, page_size, block_kv,
                                        cp_async):
  """Both page-load paths of the kernel (one TMA copy per page, or
  `cp.async` by the producer warpgroup with its own barriers) cross-lower
  for CUDA at every page size / step shape the config allows; the cp.async
  build carries the PTX (copies, barrier arrivals and waits)."""
  b, pages = 3, 40
  sds = jax.ShapeDtypeStruct
  args = [sds((b, hq, d), jnp.bfloat16),
          sds((pages, page_size, hkv, d), jnp.bfloat16),
          sds((pages, page_size, hkv, d), jnp.bfloat16),
          sds((b, 12), jnp.int32), sds((b, 12), jnp.int32),
          sds((b,), jnp.int32)]

  def run(*a):
    return mgpu.paged_decode_mgpu(*a, sm_scale=d ** -0.5, block_kv=block_kv,
                                  k_splits=2, num_ctas=5, cp_async=cp_async)
  text = jax.jit(run).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  for ptx in ("cp.async.cg.shared.global",
              "cp.async.mbarrier.arrive.noinc"):
    assert (ptx in text) == cp_async, ptx


@pytest.mark.parametrize("hq,hkv,d,page_size,block,k_splits,kv_dtype", [
    (32, 8, 128, 16, 128, 1, jnp.bfloat16),
    (9, 3, 64, 16, 128, 2, jnp.bfloat16),
    (4, 1, 256, 16, 64, 1, jnp.bfloat16),
    (32, 8, 128, 16, 128, 2, jnp.float8_e4m3fn),
    (8, 8, 64, 128, 64, 1, jnp.float8_e4m3fn),
])
def test_keys_m_lowers_to_mosaic_gpu(hq, hkv, d, page_size, block, k_splits,
                                     kv_dtype):
  """The keys-in-M build (S^T = K q^T, O^T = V^T P^T: axis-0 reductions,
  a 32-byte swizzle shared by V and P^T) cross-lowers for CUDA."""
  b, pages = 3, 40
  sds = jax.ShapeDtypeStruct
  fp8 = kv_dtype == jnp.float8_e4m3fn
  cfg = _C(pages_per_block=max(1, block // page_size), k_splits=k_splits,
           num_stages=2, backend="mosaic", keys_m=True)
  args = [sds((b, hq, d), jnp.bfloat16),
          sds((pages, page_size, hkv, d), kv_dtype),
          sds((pages, page_size, hkv, d), kv_dtype),
          sds((b, 12), jnp.int32), sds((b, 12), jnp.int32), sds((b,), jnp.int32),
          sds((), jnp.float32) if fp8 else None,
          sds((), jnp.float32) if fp8 else None]

  def run(q, k, v, kt, vt, n, ks, vs):
    return kernel.paged_decode(q, k, v, kt, vt, n, sm_scale=d ** -0.5,
                               window_left=30, config=cfg, k_scale=ks,
                               v_scale=vs)
  text = jax.jit(run).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  with pytest.raises(ValueError, match="keys_m"):
    _C(pages_per_block=8, k_splits=1, keys_m=True)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("group,d,page_size,fmt,kw,k_splits,num_ctas,fp8", [
    (4, 128, 16, "pair", {}, 1, None, False),
    (3, 64, 16, "flashinfer", dict(window_left=100, sinks=True), 2, None,
     False),
    (1, 128, 128, "pool", dict(logits_soft_cap=30.0), 4, 3, False),
    (8, 64, 8, "pair", {}, 2, 1, False),
    (5, 128, 32, "flashinfer", dict(window_left=37), 1, None, False),
    (4, 256, 16, "pool", dict(sinks=True), 2, None, False),
    (7, 64, 64, "pair", {}, 1, 5, False),
    (4, 128, 16, "pair", {}, 1, None, True),
    (3, 64, 16, "flashinfer", dict(window_left=100, sinks=True), 2, None,
     True),
    (8, 128, 64, "pool", dict(logits_soft_cap=30.0), 2, 3, True),
])
def test_keys_m_matches_oracle_gpu(group, d, page_size, fmt, kw, k_splits,
                                   num_ctas, fp8):
  """The keys-in-M build against the f64 oracle: NaN in every page a
  sequence does not own and past kv_len, odd lengths, bf16 and FP8 pages
  (FP8: the oracle runs on the dequantized pages)."""
  from attention_utils import fp8_paged as _fp8_paged  # noqa: PLC0415
  rng = np.random.default_rng()
  hkv, kv_lens = 2, [0, 1, 7, 129, 4095]
  hq = group * hkv
  kw = dict(kw)
  sinks = (jnp.asarray(rng.standard_normal(hq) * 2, jnp.float32)
           if kw.pop("sinks", False) else None)
  if fp8:
    p, cache, tk, tv, ks, vs = _fp8_paged(
        rng, kv_lens, page_size=page_size, num_kv_heads=hkv, head_dim=d,
        fmt=fmt)
    scales = dict(k_scale=jnp.float32(ks), v_scale=jnp.float32(vs))
  else:
    p = make_paged(rng, kv_lens, page_size=page_size, num_kv_heads=hkv,
                   head_dim=d, dtype=jnp.bfloat16, fmt=fmt)
    cache, tk, tv, scales = p.kv_cache, p.k, p.v, {}
  q = jnp.asarray(rng.standard_normal((len(kv_lens), hq, d)), jnp.bfloat16)
  view = _kv.make_view(cache, jnp.asarray(p.page_table))
  block = 64 if d == 256 else 128
  cfg = _C(pages_per_block=max(1, block // page_size), k_splits=k_splits,
           num_stages=2, backend="mosaic", num_ctas=num_ctas, keys_m=True)
  out, lse = kernel.paged_decode(
      q, view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(p.kv_lens), sinks, sm_scale=d ** -0.5, config=cfg,
      **scales, **kw)
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape
  qf = np.asarray(q.astype(jnp.float32))
  for b, n in enumerate(kv_lens):
    exp, exp_lse = dense_attention(
        qf[b:b + 1], tk[b], tv[b], [n - 1], n, sm_scale=d ** -0.5,
        window_left=kw.get("window_left", -1),
        logits_soft_cap=kw.get("logits_soft_cap"),
        sinks=None if sinks is None else np.asarray(sinks))
    assert_close(out[b:b + 1], exp, jnp.bfloat16, f"b={b}")
    assert_lse_close(lse[b], exp_lse[0], jnp.bfloat16)
