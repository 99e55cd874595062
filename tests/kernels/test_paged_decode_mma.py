"""The per-warp Mosaic-GPU decode backend (`pallas_kernels/paged_decode_mma.py`).

On the CPU CI: the config and its errors, and a cross-lowering of the kernel
for CUDA (Pallas -> Mosaic GPU, the per-thread MLIR built by
`inline_mgpu`) through `paged_decode` for every head_dim, page size,
table kind and option. The numerics run on a Hopper GPU only
(`test_matches_oracle_gpu`, skipped elsewhere): Mosaic GPU has no
interpret mode for per-thread code.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_utils import assert_close, assert_decode_matches, assert_lse_close
from attention_utils import dense_attention, make_paged, paged_decode_case
from pkvattn import _kv
from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import paged_decode as kernel
from pkvattn.pallas_kernels import paged_decode_mma as mma


def _config(b=4, hkv=2, ps=16, max_pages=64, d=128, **over):
  """The per-warp kernel's config for a shape (`dispatch.decode` with the
  backend forced), fields replaced by `over`."""
  cfg = dispatch.decode(
      gpu=dispatch.HOPPER, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
      head_dim=d, group_size=4, page_size=ps, batch_size=b, num_kv_heads=hkv,
      max_pages=max_pages, backend="mosaic_mma").config
  return dataclasses.replace(cfg, **over)


def test_config_and_errors():
  cfg = _config()
  assert isinstance(cfg, kernel.MmaConfig) and cfg.backend == "mosaic_mma"
  assert cfg.tiles == 1
  # Splits: about MMA_CTAS_PER_SM CTAs per SM, none without >= 2 rounds of
  # the four warps' steps.
  many = _config(b=64, hkv=3, ps=16, max_pages=256, d=64)
  assert many.k_splits == 2   # 192 items -> 384 CTAs on 132 SMs
  short = _config(b=1, hkv=1, ps=16, max_pages=8, d=64)
  assert short.k_splits == 1  # 128 keys: one round of 4 x 32 keys
  for kw, match in ((dict(tiles=3), "tiles"), (dict(k_splits=6), "k_splits")):
    with pytest.raises(ValueError, match=match):
      kernel.MmaConfig(**{**dict(k_splits=1), **kw})
  with pytest.raises(ValueError, match="backend"):
    dispatch.decode(gpu=dispatch.HOPPER, dtype=jnp.bfloat16,
                    kv_dtype=jnp.bfloat16, head_dim=128, group_size=4,
                    page_size=16, batch_size=1, num_kv_heads=1, max_pages=4,
                    backend="mosaic")
  base = dict(dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, head_dim=128,
              page_size=16, group_size=4)
  assert mma.supports(**base) is None
  assert mma.supports(**{**base, "kv_dtype": jnp.float8_e4m3fn}) is None
  for kw, word in ((dict(dtype=jnp.float32, kv_dtype=jnp.float32), "dtype"),
                   (dict(kv_dtype=jnp.float16), "pages"),
                   (dict(head_dim=96), "head_dim"),
                   (dict(group_size=9), "group"),
                   (dict(page_size=4), "page_size"),
                   (dict(page_size=48), "page_size")):
    assert word in mma.supports(**{**base, **kw})
  q = jnp.zeros((2, 8, 128), jnp.bfloat16)
  pool = jnp.zeros((4, 16, 2, 128), jnp.bfloat16)
  table = jnp.zeros((2, 4), jnp.int32)
  lens = jnp.array([3, 5], jnp.int32)
  with pytest.raises(ValueError, match="mosaic_mma"):
    kernel.paged_decode(q, pool, pool, table, table, lens, sm_scale=0.1,
                        config=cfg, interpret=True)
  fp8 = pool.astype(jnp.float8_e4m3fn)
  for kw in (dict(), dict(k_scale=1.0), dict(v_scale=1.0)):
    with pytest.raises(ValueError, match="k_scale / v_scale"):
      mma.paged_decode_mma(q, fp8, fp8, table, table, lens, sm_scale=0.1,
                           **kw)
  with pytest.raises(ValueError, match="k_scale / v_scale"):
    mma.paged_decode_mma(q, pool, pool, table, table, lens, sm_scale=0.1,
                         k_scale=1.0, v_scale=1.0)
  for kw, match in ((dict(k_splits=0), "k_splits"), (dict(tiles=3), "tiles"),
                    (dict(k_splits=2), "final"),
                    (dict(load_hint=".L3"), "load_hint"),
                    (dict(final=False, sinks=jnp.zeros(8)), "sinks"),
                    (dict(sinks=jnp.zeros(7)), "sinks")):
    with pytest.raises(ValueError, match=match):
      mma.paged_decode_mma(q, pool, pool, table, table, lens, sm_scale=0.1,
                           **kw)
  with pytest.raises(ValueError, match="group"):
    mma.paged_decode_mma(jnp.zeros((2, 18, 128), jnp.bfloat16), pool, pool,
                         table, table, lens, sm_scale=0.1)


def test_fp8_needs_compute_capability_8_9(fake_gpu):
  """FP8 pages on the per-warp kernel are refused by name where the GPU is
  below compute capability 8.9 (no e4m3 pair conversion)."""
  fake_gpu(dispatch.AMPERE)
  jax.clear_caches()  # paged_decode is jitted: trace it again
  q = jnp.zeros((2, 8, 128), jnp.bfloat16)
  fp8 = jnp.zeros((4, 16, 2, 128), jnp.float8_e4m3fn)
  table = jnp.zeros((2, 4), jnp.int32)
  with pytest.raises(ValueError, match="mosaic_mma.*8.9"):
    kernel.paged_decode(q, fp8, fp8, table, table, jnp.array([3, 5]),
                        sm_scale=0.1, config=_config(), k_scale=1.0,
                        v_scale=1.0)
  jax.clear_caches()


def test_default_rule_on_hopper():
  """On Hopper the per-warp kernel is the default for bf16 / f16 q over
  pages of that dtype or FP8 ones, head_dim 64 / 128 / 256, groups 1..8,
  pages of 8..128 tokens (FP8 pages: 32-key steps up to head_dim 128);
  Triton for f32, mixed 16-bit dtypes, groups past 8, interpret mode and
  other GPUs."""
  def choice(ps, d=64, g=3, kv_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
             gpu=dispatch.HOPPER):
    return dispatch.decode(gpu=gpu, dtype=dtype, kv_dtype=kv_dtype,
                           head_dim=d, group_size=g, page_size=ps,
                           batch_size=64, num_kv_heads=3,
                           max_pages=4096 // ps)

  for d in (64, 128, 256):
    for g in (1, 3, 4, 6, 8):
      for ps in (8, 16, 64, 128):
        bf16 = choice(ps, d, g)
        assert bf16.backend == "mosaic_mma", (d, g, ps)
        assert bf16.config.tiles == 1
        fp8 = choice(ps, d, g, kv_dtype=jnp.float8_e4m3fn)
        assert fp8.backend == "mosaic_mma", (d, g, ps)
        assert fp8.config.tiles == (2 if d <= 128 else 1), (d, fp8)
  assert choice(16, dtype=jnp.float16, kv_dtype=jnp.float16).backend == (
      "mosaic_mma")
  assert choice(128, dtype=jnp.float16,
                kv_dtype=jnp.float8_e4m3fn).backend == "mosaic_mma"
  for kw in (dict(dtype=jnp.float32, kv_dtype=jnp.float32),
             dict(dtype=jnp.float32, kv_dtype=jnp.float8_e4m3fn),
             dict(kv_dtype=jnp.float16), dict(g=9),
             dict(gpu=dispatch.INTERPRET), dict(gpu=dispatch.ADA),
             dict(gpu=dispatch.ADA, kv_dtype=jnp.float8_e4m3fn)):
    assert choice(16, **kw).backend == "triton", kw
  assert choice(128, gpu=dispatch.INTERPRET).backend == "triton"


@settings(max_examples=200, deadline=None)
@given(b=st.integers(1, 256), hkv=st.integers(1, 8),
       log_ps=st.integers(3, 7), max_pages=st.integers(1, 4096),
       d=st.sampled_from(mma.HEAD_DIMS), num_sms=st.sampled_from([78, 132]))
def test_split_rule(b, hkv, log_ps, max_pages, d, num_sms):
  """The default splits: a power of two in [1, 64], each split keeping
  >= 2 rounds of the four warps' 16-key steps, and the power of two
  nearest the CTAs-per-SM target unless that cap binds; the Triton kernel
  from `TRITON_ITEMS_PER_SM` items per SM at head_dim <= 128 with
  16-token pages."""
  ps = 1 << log_ps
  choice = dispatch.decode(
      gpu=dispatch.HOPPER, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
      head_dim=d, group_size=4, page_size=ps, batch_size=b,
      num_kv_heads=hkv, max_pages=max_pages, num_sms=num_sms)
  if (d <= 128 and ps == 16 and
      b * hkv >= dispatch.TRITON_ITEMS_PER_SM * num_sms):
    # Many one-token rows over 16-token pages of 16 bits: the Triton kernel.
    assert choice.backend == "triton"
    return
  assert choice.backend == "mosaic_mma"
  k = choice.config.k_splits
  assert 1 <= k <= 64 and k & (k - 1) == 0
  rounds = -(-max_pages // max(1, mma.WARPS * mma.KEYS // ps))
  assert k == 1 or 2 * k <= rounds
  target = (dispatch.MMA_CTAS_PER_SM / (2 if d > 128 else 1) * num_sms
            / (b * hkv))
  if 2 * k * 2 <= rounds and k < 64:   # the cap did not bind
    assert abs(np.log2(max(target, 1.0)) - np.log2(k)) <= 0.5 + 1e-9


@pytest.mark.parametrize("hq,hkv,d,page_size,fmt,kw,k_splits,tiles,fp8", [
    (9, 3, 64, 16, "flashinfer", {}, 4, None, False),   # SmolLM2 heads
    (32, 8, 128, 8, "pair", dict(window_left=100), 1, None, False),
    (4, 1, 256, 128, "pool", dict(logits_soft_cap=30.0), 2, None, False),
    (6, 1, 128, 32, "pair", dict(sinks=True), 1, 4, False),
    (16, 2, 64, 64, "flashinfer", dict(window_left=37, sinks=True), 2, 1,
     False),
    (9, 3, 64, 16, "flashinfer", dict(sinks=True), 1, None, True),
    (32, 8, 128, 8, "pair", dict(logits_soft_cap=30.0), 4, 2, True),
    (4, 1, 256, 32, "pool", dict(window_left=100), 2, None, True),
    (9, 3, 64, 16, "flashinfer", {}, 2, None, "head"),   # per-KV-head scales
    (8, 2, 256, 16, "pair", dict(sinks=True), 1, None, "head"),
])
def test_lowers_to_mosaic_gpu(hq, hkv, d, page_size, fmt, kw, k_splits,
                              tiles, fp8):
  """Pallas -> Mosaic GPU cross-lowering for CUDA (no GPU needed): the
  kernel's MLIR is built and verified for each table kind and option, on
  bf16 and FP8 pages (FlashInfer's cache through its one interleaved
  table, as `pkvattn.paged_decode` calls the kernel), the FP8 scales per
  tensor or per KV head (`fp8="head"`: the kernel takes `f32[hkv]`
  vectors)."""
  rng = np.random.default_rng(0)
  p = make_paged(rng, [5, 40], page_size=page_size, num_kv_heads=hkv,
                 head_dim=d, dtype=jnp.bfloat16, fmt=fmt)
  cache = (jax.tree.map(lambda x: x.astype(jnp.float8_e4m3fn), p.kv_cache)
           if fp8 else p.kv_cache)
  view = _kv.make_view(cache, jnp.asarray(p.page_table))
  cfg = _config(b=2, hkv=hkv, ps=page_size, max_pages=view.k_table.shape[1],
                d=d, k_splits=k_splits, tiles=tiles or 1)
  kw = dict(kw)
  sinks = jnp.zeros((hq,), jnp.float32) if kw.pop("sinks", False) else None
  q = jnp.zeros((2, hq, d), jnp.bfloat16)

  k_table, v_table, interleaved = view.decode_tables()

  def f(q, kp, vp, kt, vt, n, s, ks, vs):
    scales = dict(k_scale=ks, v_scale=vs) if fp8 else {}
    return kernel.paged_decode(q, kp, vp, kt, vt, n, s, sm_scale=d ** -0.5,
                               config=cfg, interleaved_kv=interleaved,
                               **scales, **kw)
  scales = (jnp.float32(0.5), jnp.float32(2.0))
  if fp8 == "head":
    scales = (jnp.linspace(0.5, 1.0, hkv, dtype=jnp.float32),
              jnp.linspace(2.0, 3.0, hkv, dtype=jnp.float32))
  text = jax.jit(f).trace(
      q, view.k_pool, view.v_pool, k_table, v_table,
      jnp.asarray(p.kv_lens), sinks,
      *scales).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
  # FP8 pages: the e4m3 -> f16 conversions are in the kernel's PTX.
  assert ("cvt.rn.f16x2.e4m3x2" in text) == bool(fp8)
  # The scales enter the kernel as f32[1] each, or f32[hkv] per head.
  if fp8:
    call = next(ln for ln in text.splitlines()
                if "stablehlo.custom_call @mosaic_gpu" in ln)
    n = hkv if fp8 == "head" else 1
    assert call.count(f"tensor<{n}xf32>") >= 2, call
  # One split: the kernel stores the output, sinks added (no combine).
  assert (k_splits > 1) == ("exponential" in text)
  assert ("_il" in text) == (fmt == "flashinfer")  # the interleaved table


@pytest.mark.parametrize("fmt", ["flashinfer", "pair"])
def test_public_decode_reads_flashinfer_table_in_place(fmt, fake_gpu,
                                                       monkeypatch):
  """`pkvattn.paged_decode` hands FlashInfer's cache to the kernel with its
  one table, read as page pairs (no K and V tables computed first), other
  formats with their own tables: cross-lowered for a Hopper GPU."""
  from pkvattn import _checks  # noqa: PLC0415
  import pkvattn  # noqa: PLC0415
  fake_gpu(dispatch.HOPPER)
  monkeypatch.setattr(_checks, "is_gpu", lambda: True)
  jax.clear_caches()
  p = make_paged(np.random.default_rng(0), [5, 40], page_size=16,
                 num_kv_heads=3, head_dim=64, dtype=jnp.bfloat16, fmt=fmt)
  f = jax.jit(lambda q, c, t, n: pkvattn.paged_decode(q, c, t, n))
  text = f.trace(jnp.zeros((2, 9, 64), jnp.bfloat16), p.kv_cache,
                 jnp.asarray(p.page_table), jnp.asarray(p.kv_lens)).lower(
                     lowering_platforms=("cuda",)).as_text()
  jax.clear_caches()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
  assert ("_il" in text) == (fmt == "flashinfer")


def _hopper() -> bool:
  return dispatch.current_gpu().is_hopper


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("group,d,page_size,fmt,kw,k_splits,tiles", [
    (1, 128, 16, "pair", {}, 1, None),
    (2, 64, 8, "flashinfer", dict(logits_soft_cap=30.0), 8, None),
    (3, 64, 16, "flashinfer", dict(window_left=100), 4, None),
    (3, 64, 16, "pool", dict(window_left=300, sinks=True), 2, 4),
    (4, 128, 16, "pair", {}, 1, 2),
    (4, 256, 16, "pair", {}, 1, None),
    (4, 256, 128, "flashinfer", dict(window_left=100, sinks=True), 2, None),
    (2, 256, 32, "pool", dict(logits_soft_cap=30.0), 4, 2),
    (5, 128, 32, "pool", dict(sinks=True), 1, None),
    (6, 128, 8, "pair", dict(logits_soft_cap=30.0), 2, None),
    (7, 64, 128, "pool", {}, 2, 1),
    (8, 128, 64, "flashinfer", dict(window_left=37, sinks=True), 2, None),
    (8, 64, 8, "pair", {}, 16, 2),
])
def test_matches_oracle_gpu(group, d, page_size, fmt, kw, k_splits, tiles):
  """Against the float64 dense oracle: NaN in every page a sequence does
  not own and past kv_len; kv lengths 0, 1, 7, 129, 4095; GQA groups 1..8;
  the three kv_cache formats (FlashInfer's through its one interleaved
  table); window, soft cap, sinks; splits past the end of short
  sequences."""
  rng = np.random.default_rng(group * 1000 + d + page_size)
  p, q, sinks, kw = paged_decode_case(rng, group=group, head_dim=d,
                                      page_size=page_size, fmt=fmt, kw=kw)
  view = _kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
  cfg = _config(b=q.shape[0], hkv=2, ps=page_size,
                max_pages=view.k_table.shape[1], d=d, k_splits=k_splits,
                tiles=tiles or 1)
  k_table, v_table, interleaved = view.decode_tables()
  out, lse = kernel.paged_decode(
      q, view.k_pool, view.v_pool, k_table, v_table,
      jnp.asarray(p.kv_lens), sinks, sm_scale=d ** -0.5, config=cfg,
      interleaved_kv=interleaved, **kw)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == q.shape[:2]
  assert_decode_matches(
      out, lse, np.asarray(q.astype(jnp.float32)), p.k, p.v, p.kv_lens,
      jnp.bfloat16, sm_scale=d ** -0.5, sinks=None if sinks is None
      else np.asarray(sinks), **kw)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_f16_and_partials_match_oracle_gpu():
  """f16 q and pages; the per-split partials and their LSE as the kernel
  returns them (rows past the group included in the shape)."""
  rng = np.random.default_rng(7)
  hkv, group, d, ps, kv_lens = 3, 3, 64, 16, [300, 1, 0, 77]
  p = make_paged(rng, kv_lens, page_size=ps, num_kv_heads=hkv, head_dim=d,
                 dtype=jnp.float16, fmt="pair")
  q = jnp.asarray(rng.standard_normal((len(kv_lens), group * hkv, d)),
                  jnp.float16)
  view = _kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
  out, lse = mma.paged_decode_mma(
      q, view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(p.kv_lens), sm_scale=0.125)
  o_part, lse_part = mma.paged_decode_mma(
      q, view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(p.kv_lens), sm_scale=0.125, k_splits=3, final=False)
  assert o_part.shape == (len(kv_lens), hkv, 3, 8, d)
  assert lse_part.shape == (len(kv_lens), hkv, 3, 8)
  qf = np.asarray(q.astype(jnp.float32))
  assert_decode_matches(out, lse, qf, p.k, p.v, kv_lens, jnp.float16,
                        sm_scale=0.125)
  for b, n in enumerate(kv_lens):
    # The splits' LSEs combine to the whole.
    _, exp_lse = dense_attention(qf[b:b + 1], p.k[b], p.v[b], [n - 1], n,
                                 sm_scale=0.125)
    part = np.asarray(lse_part[b, :, :, :group])       # [hkv, 3, group]
    with np.errstate(invalid="ignore"):
      tot = np.logaddexp.reduce(part, axis=1).reshape(-1)
    assert_lse_close(jnp.asarray(tot), exp_lse[0], jnp.float16)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("group,d,page_size,fmt,kw,k_splits,tiles,dtype", [
    (3, 64, 16, "flashinfer", {}, 1, None, jnp.bfloat16),   # SmolLM2
    (4, 128, 16, "pair", dict(window_left=100), 4, None, jnp.bfloat16),
    (1, 256, 16, "pool", dict(sinks=True), 1, None, jnp.bfloat16),
    (4, 256, 128, "flashinfer", dict(logits_soft_cap=30.0), 2, None,
     jnp.float16),
    (2, 64, 8, "pair", dict(window_left=37, sinks=True), 8, 2,
     jnp.bfloat16),
    (5, 128, 32, "pool", dict(logits_soft_cap=30.0), 2, 4, jnp.float16),
    (6, 128, 64, "flashinfer", dict(sinks=True), 1, 2, jnp.bfloat16),
    (7, 64, 128, "pair", {}, 16, None, jnp.float16),
    (8, 64, 16, "flashinfer", dict(window_left=300), 2, None, jnp.bfloat16),
])
def test_fp8_matches_oracle_gpu(group, d, page_size, fmt, kw, k_splits,
                                tiles, dtype, rng):
  """FP8 pages with per-tensor scales: the float64 oracle over the
  DEQUANTIZED pages (the quantization is the input, not the error) to the
  q dtype's tolerance; NaN in every page a sequence does not own and past
  kv_len; kv lengths 0, 1, 7, 129, 4095; groups 1..8; bf16 and f16 q; a
  bf16 q beyond f16's range is clamped to +-65504 (the matmuls run in f16),
  never inf."""
  from attention_utils import fp8_paged as _fp8_paged  # noqa: PLC0415
  from attention_utils import query_and_sinks  # noqa: PLC0415
  hkv, kv_lens = 2, [0, 1, 7, 129, 4095]
  p, cache, tk, tv, ks, vs = _fp8_paged(rng, kv_lens, page_size=page_size,
                                        num_kv_heads=hkv, head_dim=d, fmt=fmt)
  q, sinks, kw = query_and_sinks(rng, len(kv_lens), group * hkv, d, kw)
  q = np.array(jnp.asarray(q, dtype).astype(jnp.float32))
  big = dtype == jnp.bfloat16 and "logits_soft_cap" not in kw
  if big:   # row 2 (7 keys), head 1: past f16's largest finite value
    q[2, 1, :3] = np.asarray(jnp.asarray([1e5, -3e5, 7e4], jnp.bfloat16),
                             np.float32)
  view = _kv.make_view(cache, jnp.asarray(p.page_table))
  cfg = _config(b=len(kv_lens), hkv=hkv, ps=page_size,
                max_pages=view.k_table.shape[1], d=d, k_splits=k_splits,
                tiles=tiles or 1)
  k_table, v_table, interleaved = view.decode_tables()
  out, lse = kernel.paged_decode(
      jnp.asarray(q, dtype), view.k_pool, view.v_pool, k_table, v_table,
      jnp.asarray(p.kv_lens), None if sinks is None else jnp.asarray(sinks),
      sm_scale=d ** -0.5, config=cfg, k_scale=jnp.float32(ks),
      v_scale=jnp.float32(vs), interleaved_kv=interleaved, **kw)
  assert out.dtype == dtype and out.shape == q.shape
  assert np.isfinite(np.asarray(out, np.float32)).all()
  q_f16 = np.clip(q, -65504, 65504)
  for b, n in enumerate(kv_lens):
    exp, exp_lse = dense_attention(
        q_f16[b:b + 1], tk[b], tv[b], [n - 1], n, sm_scale=d ** -0.5,
        window_left=kw.get("window_left", -1),
        logits_soft_cap=kw.get("logits_soft_cap"), sinks=sinks)
    assert_close(out[b:b + 1], exp, dtype, f"b={b}")
    if not (big and b == 2):   # logits ~1e4: the LSE's tolerance is relative
      assert_lse_close(lse[b], exp_lse[0], dtype)


def _rows_case(rng, group, d, page_size, fmt, kw, kv_lens=(0, 1, 7, 129,
                                                          4095, 300),
               rows_per_seq=1):
  """A decode-rows case: a token-major q of `3 * B * R + 2` rows, a random
  `out` / `lse` to write into, `q_rows` naming distinct rows for all
  rows but two (`num_tokens` and -1: no row; R = `rows_per_seq` rows per
  sequence), and each row's keys (R > 1: sequence b's token r of R sees
  `kv_lens[b] - (R - 1 - r)` keys, as a multi-token decode)."""
  p, _, sinks, kw = paged_decode_case(rng, group=group, head_dim=d,
                                      page_size=page_size, fmt=fmt, kw=kw,
                                      kv_lens=kv_lens)
  n, hq = len(kv_lens) * rows_per_seq, 2 * group
  t = 3 * n + 2
  q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.bfloat16)
  out = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.bfloat16)
  lse = jnp.asarray(rng.standard_normal((t, hq)), jnp.float32)
  # Row 0 is never named: a row-less sequence's output sent there would
  # show.
  rows = 1 + rng.permutation(t - 1)[:n].astype(np.int32)
  rows[1], rows[-1] = t, -1
  r = np.arange(rows_per_seq)
  keys = np.maximum(np.asarray(p.kv_lens)[:, None] - (rows_per_seq - 1 - r),
                    0).reshape(-1).astype(np.int32)
  return p, q, out, lse, rows, keys, sinks, kw


def _check_rows(p, q, out0, lse0, rows, keys, sinks, kw, out, lse, d):
  out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
  written = [r for r in rows if 0 <= r < q.shape[0]]
  kept = np.setdiff1d(np.arange(q.shape[0]), written)
  np.testing.assert_array_equal(out[kept], np.asarray(
      out0.astype(jnp.float32))[kept])
  np.testing.assert_array_equal(lse[kept], np.asarray(lse0)[kept])
  qf = np.asarray(q.astype(jnp.float32))
  rows_per_seq = len(rows) // len(p.kv_lens)
  for i, r in enumerate(rows):
    b = i // rows_per_seq
    if 0 <= r < q.shape[0]:
      assert_decode_matches(
          out[r:r + 1], lse[r:r + 1], qf[r:r + 1], p.k[b:b + 1],
          p.v[b:b + 1], keys[i:i + 1], jnp.bfloat16, sm_scale=d ** -0.5,
          sinks=None if sinks is None else np.asarray(sinks), **kw)


@pytest.mark.parametrize("k_splits,pack,gpu", [
    (1, 1, False), (2, 1, False), (1, 2, False),
    pytest.param(1, 1, True, marks=pytest.mark.skipif(
        dispatch.current_gpu().interpret, reason="needs a GPU")),
    pytest.param(4, 1, True, marks=pytest.mark.skipif(
        dispatch.current_gpu().interpret, reason="needs a GPU")),
    pytest.param(1, 2, True, marks=pytest.mark.skipif(
        dispatch.current_gpu().interpret, reason="needs a GPU"))])
def test_decode_rows_triton_and_errors(k_splits, pack, gpu, cuda_lowering):
  """`paged_decode_rows` on the Triton kernel (interpret mode, and on a GPU
  where there is one): the named
  rows of a token-major q decoded into `out` / `lse` (in place with one
  split, combined and scattered with two), every other row (and those of
  sequences without one, `num_tokens` or -1) kept; with one row per
  sequence and with three (each token its own key count, the rest of the
  sequence's keys masked), with both kv heads in one program too
  (`pack_heads=2`); against the float64 oracle with NaN in unowned pages;
  its program for a GPU without a gather or (one split) a scatter. And its
  shape errors."""
  cfg = kernel.TritonConfig(pages_per_block=2, k_splits=k_splits,
                            num_warps=2, pack_heads=pack)
  for rows_per_seq in (1, 3):
    rng = np.random.default_rng(11 + rows_per_seq + 10 * k_splits)
    p, q, out0, lse0, rows, keys, sinks, kw = _rows_case(
        rng, 3, 64, 16, "pair", dict(window_left=50, sinks=True),
        kv_lens=(3, 1, 70, 20), rows_per_seq=rows_per_seq)
    view = _kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
    args = (view.k_pool, view.v_pool, view.k_table, view.v_table,
            jnp.asarray(keys), sinks)
    out, lse = kernel.paged_decode_rows(
        out0, lse0, q, jnp.asarray(rows), *args, sm_scale=0.125,
        interpret=not gpu, config=cfg, **kw)
    _check_rows(p, q, out0, lse0, rows, keys, sinks, kw, out, lse, 64)
    # For a GPU: q's rows read in the kernel (no gather); with one split
    # `out` / `lse` alias the kernel's outputs (no scatter).
    text = jax.jit(functools.partial(
        kernel.paged_decode_rows, sm_scale=0.125, config=cfg, **kw)).trace(
            out0, lse0, q, jnp.asarray(rows), *args).lower(
                lowering_platforms=("cuda",)).as_text()
    assert text.count("@__gpu$xla.gpu.triton") == 1
    assert "stablehlo.gather" not in text
    assert ("stablehlo.scatter" in text) == (k_splits > 1)
    assert ("output_operand_aliases" in text) == (k_splits == 1)
  if k_splits > 1 or pack > 1 or gpu:
    return
  with pytest.raises(ValueError, match="q_rows"):
    kernel.paged_decode_rows(out0, lse0, q, jnp.asarray(rows[:2]), *args,
                             sm_scale=0.125, interpret=True)
  with pytest.raises(ValueError, match="q_rows"):  # not R rows a sequence
    kernel.paged_decode_rows(out0, lse0, q, jnp.asarray(rows[:-1]),
                             *args[:4], jnp.asarray(keys[:-1]), sinks,
                             sm_scale=0.125, interpret=True)
  with pytest.raises(ValueError, match="out / lse"):
    kernel.paged_decode_rows(out0, lse0[:, :2], q, jnp.asarray(rows), *args,
                             sm_scale=0.125, interpret=True)
  with pytest.raises(ValueError, match="into"):
    mma.paged_decode_mma(q, *args[:5], sm_scale=0.1, q_rows=jnp.asarray(rows))
  with pytest.raises(ValueError, match="into"):
    mma.paged_decode_mma(q, *args[:5], sm_scale=0.1, into=(out0, lse0))
  with pytest.raises(ValueError, match="k_table"):  # tables of 4 rows, 12 seqs
    mma.paged_decode_mma(q[:12], *args[:5], sm_scale=0.1)
  with pytest.raises(ValueError, match="tokens_per_item"):  # without q_rows
    mma.paged_decode_mma(q[:4], *args[:4], jnp.asarray(keys[:4]),
                         sm_scale=0.1, tokens_per_item=2)
  # 2 does not divide R = 3.
  with pytest.raises(ValueError, match="tokens_per_item"):
    mma.paged_decode_mma(q, *args[:5], sm_scale=0.1, final=False,
                         q_rows=jnp.asarray(rows), tokens_per_item=2)


def test_row_packing_fills_the_columns():
  """`row_packing`: T token rows of G heads fit the CTA's 8 n_tiles
  columns, T divides R, a second n-tile only at head_dim <= 128 and only
  where it takes more rows, and no larger power of two would fit."""
  for group in range(1, 9):
    for r in (1, 2, 3, 5, 8, 16):
      for d in (64, 128, 256):
        t, nt = mma.row_packing(group, r, d)
        assert t * group <= 8 * nt and r % t == 0, (group, r, d)
        assert nt == 1 or (d <= 128 and t * group > 8), (group, r, d)
        assert 2 * t * group > 8 * nt or r % (2 * t), (group, r, d)
        if d <= 128:
          assert 2 * t * group > 16 or r % (2 * t), (group, r, d)


@pytest.mark.parametrize("k_splits,fmt,kw,group,rows_per_seq,fp8", [
    (1, "pair", dict(sinks=True), 3, 1, False),
    (2, "flashinfer", dict(window_left=40), 3, 1, False),
    (1, "pool", dict(window_left=40, sinks=True), 4, 8, False),
    (2, "pair", dict(logits_soft_cap=20.0), 1, 16, False),
    (2, "flashinfer", dict(window_left=40), 4, 8, True),
])
def test_decode_rows_lower_in_place(k_splits, fmt, kw, group, rows_per_seq,
                                    fp8):
  """Cross-lowered for CUDA: the decode rows of a token-major q are read
  in the kernel (no gather); with one split the kernel also writes the
  output rows in place (no scatter), with several a combine and a scatter
  follow; with several token rows per sequence a CTA serves
  `tokens_per_item` of them (a grid of `rows / T` items per kv head and
  split), on bf16 or FP8 pages."""
  rng = np.random.default_rng(3)
  p, q, out0, lse0, rows, keys, sinks, kw = _rows_case(
      rng, group, 64, 16, fmt, kw, kv_lens=(5, 40, 9),
      rows_per_seq=rows_per_seq)
  cache = p.kv_cache.astype(jnp.float8_e4m3fn) if fp8 else p.kv_cache
  view = _kv.make_view(cache, jnp.asarray(p.page_table))
  if fp8:
    kw = dict(kw, k_scale=jnp.float32(0.5), v_scale=jnp.float32(2.0))
  cfg = _config(b=len(rows), hkv=2, ps=16, max_pages=view.k_table.shape[1],
                d=64, k_splits=k_splits)
  # At head_dim 64 a second n-tile (16 columns) takes more rows.
  tokens, n_tiles = mma.row_packing(group, rows_per_seq, 64)
  assert (tokens, n_tiles) == {1: (1, 1), 8: (4, 2), 16: (16, 2)}[
      rows_per_seq]

  def f(out, lse, q, rows, kp, vp, kt, vt, n, s):
    return kernel.paged_decode_rows(out, lse, q, rows, kp, vp, kt, vt, n, s,
                                    sm_scale=0.125, config=cfg, **kw)
  text = jax.jit(f).trace(
      out0, lse0, q, jnp.asarray(rows), view.k_pool, view.v_pool,
      view.k_table, view.v_table, jnp.asarray(keys),
      sinks).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
  # The partials: one block of 8 columns per item (T rows of the group).
  scales = {k: kw[k] for k in ("k_scale", "v_scale") if k in kw}
  o, lse = jax.eval_shape(functools.partial(
      mma.paged_decode_mma, sm_scale=0.125, k_splits=k_splits, final=False,
      q_rows=jnp.asarray(rows), **scales), q, view.k_pool, view.v_pool,
      view.k_table, view.v_table, jnp.asarray(keys))
  assert o.shape == (len(rows) // tokens, 2, k_splits, 8 * n_tiles, 64)
  assert lse.shape == o.shape[:-1]
  assert "gather" not in text
  assert ("scatter" in text) == (k_splits > 1)
  # One split: `out` / `lse` alias the kernel's outputs.
  assert ("output_operand_aliases" in text) == (k_splits == 1)
  # FP8 pages: the e4m3 -> f16 conversions are in the kernel's PTX.
  assert ("cvt.rn.f16x2.e4m3x2" in text) == fp8


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("group,d,page_size,fmt,kw,k_splits,rows_per_seq", [
    (3, 64, 16, "flashinfer", dict(window_left=100, sinks=True), 1, 1),
    (3, 64, 16, "pair", {}, 4, 1),
    (4, 256, 16, "pool", dict(logits_soft_cap=30.0), 1, 1),
    (8, 128, 8, "flashinfer", dict(sinks=True), 2, 1),
    (1, 128, 64, "pool", {}, 1, 1),
    (4, 256, 16, "pool", dict(window_left=200, sinks=True), 1, 8),
    (3, 64, 16, "pair", dict(logits_soft_cap=20.0), 2, 3),
    (6, 128, 32, "flashinfer", {}, 4, 5),
    # Several token rows per CTA (`row_packing`: tokens_per_item, n_tiles
    # 16, 2 / 4, 1 / 8, 2 / 4, 2 / 4, 2 / 2, 2).
    (1, 128, 16, "pair", dict(window_left=30), 1, 16),
    (2, 64, 16, "flashinfer", dict(sinks=True), 2, 4),
    (2, 64, 16, "pool", dict(window_left=300), 1, 8),
    (3, 64, 8, "pool", dict(window_left=100, logits_soft_cap=20.0), 4, 8),
    (4, 128, 32, "pair", {}, 2, 8),
    (8, 128, 16, "flashinfer", dict(sinks=True), 1, 8),
])
def test_decode_rows_match_oracle_gpu(group, d, page_size, fmt, kw,
                                      k_splits, rows_per_seq):
  """`paged_decode_rows` on the Mosaic-GPU kernel against the float64
  oracle: q's rows read in the kernel, the output rows written in place
  (one split) or combined and scattered (several); rows of sequences
  without one (`num_tokens`, -1) and every other row of `out` / `lse`
  kept bit for bit; NaN in unowned pages; kv lengths 0, 1, 7, 129, 4095;
  several token rows per sequence (each with its own key count, the
  sequence's later keys masked), several of them per CTA in the MMA's
  columns (`tokens_per_item`), with rows that have no query among them."""
  rng = np.random.default_rng(group * 100 + d + k_splits + rows_per_seq)
  p, q, out0, lse0, rows, keys, sinks, kw = _rows_case(
      rng, group, d, page_size, fmt, kw, rows_per_seq=rows_per_seq)
  view = _kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
  cfg = _config(b=len(rows), hkv=2, ps=page_size,
                max_pages=view.k_table.shape[1], d=d, k_splits=k_splits)
  out, lse = jax.jit(functools.partial(
      kernel.paged_decode_rows, sm_scale=d ** -0.5, config=cfg, **kw))(
          out0, lse0, q, jnp.asarray(rows), view.k_pool, view.v_pool,
          view.k_table, view.v_table, jnp.asarray(keys), sinks)
  _check_rows(p, q, out0, lse0, rows, keys, sinks, kw, out, lse, d)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("group,d,page_size,fmt,kw,k_splits,rows_per_seq", [
    # (tokens_per_item, n_tiles) = (4, 2), (2, 2), (8, 2), (2, 1), (1, 1)
    (3, 64, 16, "flashinfer", dict(window_left=100, sinks=True), 1, 8),
    (6, 128, 16, "pair", dict(logits_soft_cap=20.0), 2, 4),
    (2, 128, 32, "pool", {}, 1, 8),
    (4, 256, 16, "flashinfer", dict(window_left=300), 1, 8),
    (8, 256, 64, "pair", dict(sinks=True), 4, 2),
])
def test_fp8_decode_rows_match_oracle_gpu(group, d, page_size, fmt, kw,
                                          k_splits, rows_per_seq, rng):
  """`paged_decode_rows` on FP8 pages (per-tensor scales) with several
  token rows per sequence packed into a CTA's MMA columns: each row
  against the float64 oracle over the DEQUANTIZED pages, with its own key
  count; NaN in unowned pages and past kv_len; every row not named kept
  bit for bit."""
  from attention_utils import fp8_paged as _fp8_paged  # noqa: PLC0415
  hkv, kv_lens = 2, [0, 1, 7, 129, 4095, 300]
  p, cache, tk, tv, ks, vs = _fp8_paged(rng, kv_lens, page_size=page_size,
                                        num_kv_heads=hkv, head_dim=d, fmt=fmt)
  kw = dict(kw)
  sinks = None
  if kw.pop("sinks", False):
    sinks = jnp.asarray(rng.standard_normal(group * hkv), jnp.float32)
  n = len(kv_lens) * rows_per_seq
  t = 2 * n + 3
  q = jnp.asarray(rng.standard_normal((t, group * hkv, d)), jnp.bfloat16)
  out0 = jnp.asarray(rng.standard_normal((t, group * hkv, d)), jnp.bfloat16)
  lse0 = jnp.asarray(rng.standard_normal((t, group * hkv)), jnp.float32)
  rows = rng.permutation(t)[:n].astype(np.int32)
  rows[1], rows[-1] = t, -1      # rows without a query
  r = np.arange(rows_per_seq)
  keys = np.maximum(np.asarray(kv_lens)[:, None] - (rows_per_seq - 1 - r),
                    0).reshape(-1).astype(np.int32)
  view = _kv.make_view(cache, jnp.asarray(p.page_table))
  cfg = _config(b=n, hkv=hkv, ps=page_size, max_pages=view.k_table.shape[1],
                d=d, k_splits=k_splits)
  out, lse = jax.jit(functools.partial(
      kernel.paged_decode_rows, sm_scale=d ** -0.5, config=cfg,
      k_scale=jnp.float32(ks), v_scale=jnp.float32(vs), **kw))(
          out0, lse0, q, jnp.asarray(rows), view.k_pool, view.v_pool,
          view.k_table, view.v_table, jnp.asarray(keys), sinks)
  out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
  written = [w for w in rows if 0 <= w < t]
  kept = np.setdiff1d(np.arange(t), written)
  np.testing.assert_array_equal(out[kept], np.asarray(
      out0.astype(jnp.float32))[kept])
  np.testing.assert_array_equal(lse[kept], np.asarray(lse0)[kept])
  qf = np.asarray(q.astype(jnp.float32))
  for i, w in enumerate(rows):
    if not 0 <= w < t:
      continue
    b = i // rows_per_seq
    exp, exp_lse = dense_attention(
        qf[w:w + 1], tk[b], tv[b], [keys[i] - 1], keys[i],
        sm_scale=d ** -0.5, window_left=kw.get("window_left", -1),
        logits_soft_cap=kw.get("logits_soft_cap"),
        sinks=None if sinks is None else np.asarray(sinks))
    assert_close(out[w:w + 1], exp, jnp.bfloat16, f"row {i}")
    assert_lse_close(lse[w], exp_lse[0], jnp.bfloat16, f"lse row {i}")
