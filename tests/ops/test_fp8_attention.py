"""FP8 KV pages: decode, prefill and RoPE + append against independent oracles.

Pages are float8_e4m3fn with per-tensor scales (stored = x / scale). The
attention oracle is `attention_utils.dense_attention` (float64 numpy) over
the DEQUANTIZED pages, so the quantization is the test's input, not its
error: both implementations (the Triton kernels in interpret mode, and the
xla reference) must match it to the q dtype's tolerance. Every page no
sequence owns and every row past `kv_lens` is NaN. The error against the
unquantized values is bounded loosely (it is what FP8 costs). RoPE + append
writes are checked between the kernel and the xla path (equal but for rare
one-step roundings of the f32 rotation), and against a numpy oracle
(rotation in float64, division, saturation, the ml_dtypes cast) to one FP8
step.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_utils as au
import pkvattn

FP8 = jnp.float8_e4m3fn


CASES = [  # (fmt, group, head_dim, page_size, kwargs)
    ("pair", 3, 64, 16, {}),
    ("pool", 4, 128, 8, dict(window_left=20)),
    ("flashinfer", 1, 64, 16, dict(logits_soft_cap=8.0)),
    ("pair", 8, 64, 32, dict(sinks=True)),
]


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("fmt, g, d, ps, kw", CASES)
def test_decode_fp8_pages(impl, fmt, g, d, ps, kw, rng):
  hkv = 2
  lens = [1, 7, 33, 0, 70]
  p, cache, tk, tv, ks, vs = au.fp8_paged(rng, lens, page_size=ps,
                                        num_kv_heads=hkv, head_dim=d, fmt=fmt)
  q, sinks, kw = au.query_and_sinks(rng, len(lens), g * hkv, d, kw)
  if sinks is not None:
    kw["sinks"] = jnp.asarray(sinks)
  out, lse = pkvattn.paged_decode(
      jnp.asarray(q, jnp.bfloat16), cache, jnp.asarray(p.page_table),
      jnp.asarray(lens), return_lse=True, impl=impl, k_scale=ks,
      v_scale=jnp.float32(vs), **kw)
  for b, n in enumerate(lens):
    want, want_lse = au.dense_attention(
        q[b:b + 1], tk[b], tv[b], [n - 1], n, sm_scale=d**-0.5,
        window_left=kw.get("window_left", -1),
        logits_soft_cap=kw.get("logits_soft_cap"), sinks=sinks)
    au.assert_close(out[b:b + 1], want, jnp.bfloat16, f"b={b}")
    au.assert_lse_close(lse[b], want_lse[0], jnp.bfloat16)
    if n:  # what FP8 costs against the unquantized values: loose
      raw, _ = au.dense_attention(q[b:b + 1], p.k[b], p.v[b], [n - 1], n,
                                  sm_scale=d**-0.5,
                                  window_left=kw.get("window_left", -1),
                                  logits_soft_cap=kw.get("logits_soft_cap"),
                                  sinks=sinks)
      err = np.abs(np.asarray(out[b:b + 1], np.float32) - raw).max()
      assert err < 2**-3 * np.abs(raw).max() + 2e-2  # 3 mantissa bits


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("fmt, g, d, ps, kw", CASES[:3])
def test_prefill_fp8_pages_mixed_batch(impl, fmt, g, d, ps, kw, rng):
  """Decode rows beside chunks over a cached prefix, and a whole prompt."""
  hkv = 2
  lens = [40, 1, 29, 9]
  q_lens = [17, 1, 29, 1]
  p, cache, tk, tv, ks, vs = au.fp8_paged(rng, lens, page_size=ps,
                                        num_kv_heads=hkv, head_dim=d, fmt=fmt)
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  n_tok = int(indptr[-1]) + 3  # padding tokens
  q = np.asarray(jnp.asarray(rng.standard_normal((n_tok, g * hkv, d)),
                             jnp.bfloat16).astype(jnp.float32))
  out, lse = pkvattn.paged_prefill(
      jnp.asarray(q, jnp.bfloat16), cache, jnp.asarray(p.page_table),
      jnp.asarray(indptr), jnp.asarray(lens), return_lse=True, impl=impl,
      k_scale=ks, v_scale=vs, **kw)
  au.assert_prefill_matches(out, lse, q, tk, tv, indptr, lens, jnp.bfloat16,
                            sm_scale=d**-0.5,
                            window_left=kw.get("window_left", -1),
                            logits_soft_cap=kw.get("logits_soft_cap"))


def _rope_np(x, pos, theta, d):
  """NeoX rotation in float64 (`pkvattn.RopeConfig()` default style)."""
  half = d // 2
  inv = 1.0 / theta ** (np.arange(half, dtype=np.float64) * 2 / d)
  ang = pos[:, None].astype(np.float64) * inv[None, :]
  c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
  x = np.asarray(x, np.float64)
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


@pytest.mark.parametrize("fmt", au.FORMATS)
def test_rope_append_quantizes_on_write(fmt, rng):
  n, hq, hkv, d, ps, pages = 23, 4, 2, 64, 8, 10
  q = jnp.asarray(rng.standard_normal((n, hq, d)), jnp.bfloat16)
  k = np.asarray(rng.standard_normal((n, hkv, d)) * 4, np.float32)
  k[0, 0, :3] = [1e6, -1e6, 900.0]  # overflow saturates, never NaN
  k = jnp.asarray(k, jnp.bfloat16)
  v = np.asarray(rng.standard_normal((n, hkv, d)), np.float32)
  v[1, 1, :2] = [np.inf, -np.inf]
  v = jnp.asarray(v, jnp.bfloat16)
  table = rng.permutation(pages)[:8].reshape(2, 4).astype(np.int32)
  bidx = np.r_[np.zeros(12), np.ones(10), [-1]].astype(np.int32)
  pos = np.r_[np.arange(12), np.arange(3, 13), [0]].astype(np.int32)
  nan = jnp.full((pages, ps, hkv, d), jnp.nan, FP8)
  if fmt == "pair":
    cache, tbl = (nan, nan), table
  elif fmt == "pool":
    cache = jnp.concatenate([nan, nan])
    tbl = np.stack([table, table + pages], axis=1)
  else:
    cache, tbl = jnp.stack([nan, nan], axis=1), table
  ks, vs = 0.03, 0.005
  out = {}
  for impl in ("pallas", "xla"):
    out[impl] = pkvattn.apply_rope_and_append(
        q, k, v, bidx, pos, cache, tbl, pkvattn.RopeConfig(), impl=impl,
        k_scale=ks, v_scale=vs)
  # Kernel vs xla path: the same math; an f32 rotation may round apart
  # (fused multiply-adds), moving a value across an FP8 rounding boundary:
  # at most one step, rarely.
  got = [np.asarray(x).astype(np.float64)
         for x in jax.tree.leaves(out["pallas"][1])]
  ref = [np.asarray(x).astype(np.float64)
         for x in jax.tree.leaves(out["xla"][1])]
  for a, b in zip(got, ref):
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    a, b = np.nan_to_num(a), np.nan_to_num(b)
    off = a != b
    assert off.mean() < 1e-3, off.mean()
    np.testing.assert_allclose(a[off], b[off], rtol=2**-3)
  # Independent oracle: the written rows, K rotated in float64.
  leaves = [np.asarray(x).astype(np.float32)
            for x in jax.tree.leaves(out["xla"][1])]
  if fmt == "pair":
    k_pool, v_pool, k_tab, v_tab = leaves[0], leaves[1], table, table
  elif fmt == "pool":
    k_pool = v_pool = leaves[0]
    k_tab, v_tab = table, table + pages
  else:
    flat = leaves[0].reshape(2 * pages, ps, hkv, d)
    k_pool = v_pool = flat
    k_tab, v_tab = 2 * table, 2 * table + 1
  k_rot = _rope_np(np.asarray(k, np.float32), pos, 10000.0, d)
  written = set()
  for t in range(n):
    if bidx[t] < 0:
      continue
    blk, row = divmod(int(pos[t]), ps)
    kp, vp = k_tab[bidx[t], blk], v_tab[bidx[t], blk]
    written |= {(kp, row), (vp, row)}
    want_k = np.clip(k_rot[t] / ks, -448, 448)
    got_k = k_pool[kp, row]
    assert not np.isnan(got_k).any()
    # one FP8 step (3 mantissa bits) where f32 and f64 rotations round apart
    np.testing.assert_allclose(got_k, want_k, rtol=2**-3, atol=2**-9)
    np.testing.assert_array_equal(
        v_pool[vp, row], au.quantize_np(np.asarray(v[t], np.float32),
                                      vs).astype(np.float32))
  assert np.abs(k_pool[k_tab[0, 0], 0, 0, :3]).max() == 448.0
  assert (v_pool[v_tab[0, 0], 1, 1, :2] == [448.0, -448.0]).all()
  # Rows nobody wrote keep their NaN.
  for pg in range(k_pool.shape[0]):
    for row in range(ps):
      if (pg, row) not in written:
        assert np.isnan(k_pool[pg, row]).all()


def test_fp8_bad_inputs():
  q = jnp.zeros((2, 4, 64), jnp.bfloat16)
  pages = jnp.zeros((4, 8, 2, 64), FP8)
  table, lens = jnp.array([[0, 1], [2, 3]]), jnp.array([9, 3])
  with pytest.raises(ValueError, match="k_scale"):
    pkvattn.paged_decode(q, (pages, pages), table, lens, impl="xla")
  with pytest.raises(ValueError, match=r"shape of v_scale: expected \(\) "
                     r"\(one scale per tensor\) or \(2,\) \(one per KV head\), "
                     r"got \(3,\)"):
    pkvattn.paged_prefill(q, (pages, pages), table, jnp.array([0, 1, 2]),
                          lens, impl="xla", k_scale=1.0,
                          v_scale=jnp.ones(3))
  bf16 = jnp.zeros((4, 8, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="k_scale"):
    pkvattn.paged_decode(q, (bf16, bf16), table, lens, impl="xla",
                         k_scale=1.0, v_scale=1.0)
  with pytest.raises(ValueError, match="v_scale"):
    pkvattn.append_paged_kv(jnp.zeros((1, 2, 64)), jnp.zeros((1, 2, 64)),
                            [0], [0], (pages, pages), table, k_scale=1.0)
  with pytest.raises(ValueError, match="head_dim"):
    pkvattn.paged_decode(jnp.zeros((2, 4, 128), jnp.bfloat16),
                         (pages, pages), table, lens, impl="xla",
                         k_scale=1.0, v_scale=1.0)


def _on_gpu_with_fp8_cvt():
  from pkvattn.pallas_kernels import dispatch
  return dispatch.current_gpu().has_fp8_cvt


@pytest.mark.parametrize("mode,prefetch", [
    ("loaded", False), ("loaded", True), ("pairs", False), ("pairs", True)])
def test_decode_kernel_fp8_convert_modes(mode, prefetch, rng):
  """Both placements of the conversion (`TritonConfig.fp8_convert`) compute
  the oracle's attention ("pairs" runs its jnp twin in interpret mode; its
  PTX is checked on the GPU below); a bf16 query beyond f16's range (the
  FP8 dots run in f16) is clamped to +-65504, never inf (the oracle clamps
  it too)."""
  from pkvattn.pallas_kernels import paged_decode as kernel
  hkv, g, d, ps = 2, 4, 64, 8
  lens = [1, 15, 40, 0, 23]
  p, cache, tk, tv, ks, vs = au.fp8_paged(rng, lens, page_size=ps,
                                        num_kv_heads=hkv, head_dim=d,
                                        fmt="pair")
  q = rng.standard_normal((len(lens), g * hkv, d)).astype(np.float32)
  q[2, 1, :4] = [1e5, -3e5, 7e4, 2.0]  # past f16's largest finite value
  q = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
  table = jnp.asarray(p.page_table)
  cfg = kernel.TritonConfig(pages_per_block=2, k_splits=2, fp8_convert=mode,
                            prefetch_ids=prefetch)
  out, lse = kernel.paged_decode(
      jnp.asarray(q, jnp.bfloat16), cache[0], cache[1], table, table,
      jnp.asarray(lens), sm_scale=d**-0.5, interpret=True, config=cfg,
      k_scale=jnp.float32(ks), v_scale=jnp.float32(vs))
  assert np.isfinite(np.asarray(out, np.float32)).all()
  q_f16 = np.clip(q, -65504, 65504)
  for b, n in enumerate(lens):
    want, want_lse = au.dense_attention(q_f16[b:b + 1], tk[b], tv[b],
                                        [n - 1], n, sm_scale=d**-0.5)
    au.assert_close(out[b:b + 1], want, jnp.bfloat16, f"b={b}")
    if b != 2:  # lse of logits ~1e4: bf16 tolerance is relative
      au.assert_lse_close(lse[b], want_lse[0], jnp.bfloat16)
  with pytest.raises(ValueError, match="fp8_convert"):
    kernel.TritonConfig(pages_per_block=2, k_splits=1, fp8_convert="smem")


@pytest.mark.skipif(not _on_gpu_with_fp8_cvt(),
                    reason="needs a GPU of compute capability >= 8.9")
@pytest.mark.parametrize("g, d, ps, ppb, warps", [
    (4, 128, 16, 4, 2), (3, 64, 16, 8, 4), (8, 128, 64, 1, 2),
    (1, 128, 8, 8, 4), (4, 256, 16, 2, 2), (5, 64, 16, 2, 2)])
def test_decode_kernel_fp8_convert_gpu(g, d, ps, ppb, warps, rng):
  """The inline-PTX column pairs ("pairs") and the loaded-layout placement
  on the GPU against the oracle on the dequantized pages (NaN in unowned
  pages and past kv_lens), splits, page-id prefetch and odd lengths
  included."""
  from pkvattn.pallas_kernels import paged_decode as kernel
  hkv = 2
  lens = [1, 7, 129, 0, 4095, 300]
  p, cache, tk, tv, ks, vs = au.fp8_paged(rng, lens, page_size=ps,
                                        num_kv_heads=hkv, head_dim=d,
                                        fmt="pair")
  q = np.asarray(jnp.asarray(rng.standard_normal((len(lens), g * hkv, d)),
                             jnp.bfloat16).astype(jnp.float32))
  table = jnp.asarray(p.page_table)
  for ksplit, prefetch, mode in ((1, False, "loaded"), (4, True, "loaded"),
                                 (1, False, "pairs"), (1, True, "pairs"),
                                 (4, True, "pairs")):
    cfg = kernel.TritonConfig(pages_per_block=ppb, k_splits=ksplit,
                              num_warps=warps, fp8_convert=mode,
                              prefetch_ids=prefetch)
    out, lse = kernel.paged_decode(
        jnp.asarray(q, jnp.bfloat16), cache[0], cache[1], table, table,
        jnp.asarray(lens), sm_scale=d**-0.5, config=cfg,
        k_scale=jnp.float32(ks), v_scale=jnp.float32(vs))
    au.assert_decode_matches(out, lse, q, tk, tv, lens, jnp.bfloat16,
                             sm_scale=d**-0.5)


@pytest.mark.skipif(not _on_gpu_with_fp8_cvt(),
                    reason="needs a GPU of compute capability >= 8.9")
@pytest.mark.parametrize("d", [64, 128])
def test_decode_kernel_fp8_pairs_f32_query_gpu(d, rng):
  """An f32 query over FP8 pages with the column-pair default: the words
  split by integer ops (no PTX: the dots run in f32) on the GPU, against
  the oracle on the dequantized pages, splits and NaN-poisoned pages
  included."""
  from pkvattn.pallas_kernels import paged_decode as kernel
  lens = [1, 7, 129, 0, 300]
  p, cache, tk, tv, ks, vs = au.fp8_paged(rng, lens, page_size=16,
                                        num_kv_heads=2, head_dim=d,
                                        fmt="pair")
  q = rng.standard_normal((len(lens), 8, d)).astype(np.float32)
  table = jnp.asarray(p.page_table)
  for ksplit in (1, 4):
    cfg = kernel.TritonConfig(pages_per_block=2, k_splits=ksplit,
                              num_warps=2, fp8_convert="pairs",
                              prefetch_ids=True)
    out, lse = kernel.paged_decode(
        jnp.asarray(q), cache[0], cache[1], table, table, jnp.asarray(lens),
        sm_scale=d**-0.5, config=cfg, k_scale=jnp.float32(ks),
        v_scale=jnp.float32(vs))
    au.assert_decode_matches(out, lse, q, tk, tv, lens, jnp.float32,
                             sm_scale=d**-0.5)


@pytest.mark.parametrize("batch_size,max_pages", [(64, 256), (8, 1024),
                                                  (256, 64)])
def test_decode_default_fp8_pairs_rule(batch_size, max_pages):
  """The FP8 decode default where the GPU converts e4m3 pairs: column pairs
  on 2 warps, 3 stages; 64-token steps, 32 at head_dim 256 or with > 4
  programs per SM; splits for about 2 programs per SM, each keeping >= 2
  steps; page ids a step ahead unless a step covers more than 64 tokens;
  head_dim 64 packs two kv heads where their number is even. bf16 pages,
  interpret mode and older GPUs keep the bf16 tiling with "loaded". (Ada:
  on Hopper the per-warp Mosaic kernel takes FP8 pages,
  `test_paged_decode_mma.test_default_rule_on_hopper`.)"""
  from pkvattn.pallas_kernels import dispatch
  kw = dict(batch_size=batch_size, max_pages=max_pages, dtype=jnp.bfloat16)
  sms = dispatch.DECODE_NUM_SMS

  def cfg(head_dim=128, num_kv_heads=8, ps=16, kv_dtype=FP8,
          gpu=dispatch.ADA):
    choice = dispatch.decode(
        gpu=gpu, page_size=ps, head_dim=head_dim, num_kv_heads=num_kv_heads,
        group_size=4, kv_dtype=kv_dtype, **kw)
    assert choice.backend == "triton"
    return choice.config

  for head_dim, hkv, pack in ((128, 8, 1), (64, 8, 2), (256, 1, 1),
                              (64, 3, 1)):
    for ps in (16, 64, 128):
      c = cfg(head_dim, hkv, ps)
      assert (c.fp8_convert, c.num_warps, c.num_stages, c.pack_heads) == (
          "pairs", 2, 3, pack), (head_dim, hkv, ps, c)
      programs = batch_size * hkv // pack
      step = 64 if head_dim == 64 and pack == 1 else (
          32 if head_dim > 128 or programs > 4 * sms else 64)
      assert c.pages_per_block == max(1, step // ps)
      tokens = c.pages_per_block * ps
      assert c.prefetch_ids == (tokens <= 64)
      per_sm = 4 if head_dim == 64 and pack == 1 else 2
      steps = max_pages // c.pages_per_block
      assert c.k_splits == 1 or c.k_splits <= steps // 2
      if programs * 2 <= per_sm * sms and steps >= 4:
        assert programs * c.k_splits >= per_sm * sms // 2, c
      bf16 = cfg(head_dim, hkv, ps, kv_dtype=jnp.bfloat16)
      assert bf16.fp8_convert == "loaded" and bf16.pack_heads == 1
      assert cfg(head_dim, hkv, ps, gpu=dispatch.INTERPRET) == cfg(
          head_dim, hkv, ps, kv_dtype=jnp.bfloat16, gpu=dispatch.INTERPRET)
  for head_dim, hkv in ((128, 8), (64, 8)):
    assert cfg(head_dim, hkv, gpu=dispatch.AMPERE) == cfg(
        head_dim, hkv, kv_dtype=jnp.bfloat16, gpu=dispatch.AMPERE)


def test_decode_kernel_fp8_pairs_lowers_for_cuda(fake_gpu, cuda_lowering):
  """Cross-lowered for CUDA on any host, `fp8_convert="pairs"` puts the
  byte permute and the e4m3x2 -> f16x2 PTX into the Triton kernel (and
  "loaded" does not); on a GPU below compute capability 8.9 it is refused
  by name."""
  from pkvattn.pallas_kernels import dispatch
  from pkvattn.pallas_kernels import paged_decode as kernel
  sds = jax.ShapeDtypeStruct
  args = [sds((3, 8, 128), jnp.bfloat16), sds((64, 16, 2, 128), FP8),
          sds((64, 16, 2, 128), FP8), sds((3, 16), jnp.int32),
          sds((3, 16), jnp.int32), sds((3,), jnp.int32),
          sds((), jnp.float32), sds((), jnp.float32)]

  def lowered(mode):
    cfg = kernel.TritonConfig(pages_per_block=4, k_splits=2, num_warps=2,
                              fp8_convert=mode)
    f = jax.jit(lambda q, kp, vp, kt, vt, n, a, b: kernel.paged_decode(
        q, kp, vp, kt, vt, n, sm_scale=0.1, config=cfg, k_scale=a,
        v_scale=b))
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

  pairs = lowered("pairs")
  assert "cvt.rn.f16x2.e4m3x2" in pairs and "prmt.b32" in pairs
  assert "cvt.rn.f16x2.e4m3x2" not in lowered("loaded")
  fake_gpu(dispatch.AMPERE)
  jax.clear_caches()  # paged_decode is jitted: trace it again
  with pytest.raises(ValueError, match="fp8_convert"):
    lowered("pairs")
  assert "cvt.rn.f16x2.e4m3x2" not in lowered("loaded")
  jax.clear_caches()


def test_pair_view_splits_columns(rng):
  """`pair_view` is a bitcast whose word `i` holds columns `2i` (low byte)
  and `2i + 1`, and `split_pairs` (its jnp form) returns those columns'
  values exactly, for every e4m3 bit pattern but NaN."""
  from pkvattn.pallas_kernels import _fp8
  bits = np.arange(256, dtype=np.uint8)
  bits = bits[(bits & 0x7F) != 0x7F]  # NaN patterns
  pool = rng.choice(bits, size=(5, 8, 3, 64)).astype(np.uint8)
  pool = jax.lax.bitcast_convert_type(jnp.asarray(pool), FP8)
  words = _fp8.pair_view(pool)
  assert words.shape == (5, 8, 3, 32) and words.dtype == jnp.uint16
  flat = words.reshape(-1, 32)
  for dtype in (jnp.float16, jnp.float32):
    even, odd = _fp8.split_pairs(flat, dtype, interpret=True)
    want = np.asarray(pool.astype(jnp.float32)).reshape(-1, 64)
    np.testing.assert_array_equal(np.asarray(even, np.float32), want[:, 0::2])
    np.testing.assert_array_equal(np.asarray(odd, np.float32), want[:, 1::2])

