"""`paged_decode.TritonConfig.pack_heads`: kv heads packed into one program.

The pools are viewed with `pack_heads` adjacent kv heads as one wider head
and each query row keeps its own head's columns, so the result must be the
unpacked attention: checked against the float64 oracle
(`attention_utils.dense_attention`) over pages with NaN in every unowned
page and every row past `kv_lens`, for bf16 and FP8 pages (FP8: the oracle
reads the dequantized pages), all three kv_cache formats, splits, window,
soft cap, sinks and LSE. Interpret mode on the CPU; the same cases with odd
lengths on a GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import attention_utils as au
from pkvattn import _kv
from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import paged_decode as kernel
from attention_utils import fp8_paged as _fp8_paged
from attention_utils import query_and_sinks

FP8 = jnp.float8_e4m3fn

CASES = [  # (fmt, fp8, group, num_kv_heads, head_dim, pack, k_splits, kwargs)
    ("pair", True, 3, 4, 64, 2, 1, {}),
    ("pool", True, 4, 2, 64, 2, 4, dict(window_left=20)),
    ("flashinfer", False, 1, 4, 64, 4, 2, dict(logits_soft_cap=8.0)),
    ("pair", False, 8, 2, 128, 2, 1, dict(sinks=True)),
    ("flashinfer", True, 2, 8, 64, 2, 2, dict(sinks=True)),
]


def _check(rng, fmt, fp8, g, hkv, d, pack, ksplit, kw, lens, *, interpret,
           fp8_convert="loaded", ppb=2, ps=8, num_warps=None, num_stages=3):
  if fp8:
    p, cache, tk, tv, ks, vs = _fp8_paged(rng, lens, page_size=ps,
                                          num_kv_heads=hkv, head_dim=d,
                                          fmt=fmt)
    scales = dict(k_scale=jnp.float32(ks), v_scale=jnp.float32(vs))
  else:
    p = au.make_paged(rng, lens, page_size=ps, num_kv_heads=hkv, head_dim=d,
                      dtype=jnp.bfloat16, fmt=fmt)
    cache = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), p.kv_cache)
    tk, tv, scales = p.k, p.v, {}
  view = _kv.make_view(cache, jnp.asarray(p.page_table))
  q, sinks, kw = query_and_sinks(rng, len(lens), g * hkv, d, kw)
  cfg = kernel.TritonConfig(pages_per_block=ppb, k_splits=ksplit,
                            pack_heads=pack,
                            num_warps=num_warps or (
                                2 if fp8_convert == "pairs" else 4),
                            num_stages=num_stages, fp8_convert=fp8_convert)
  out, lse = kernel.paged_decode(
      jnp.asarray(q, jnp.bfloat16), view.k_pool, view.v_pool, view.k_table,
      view.v_table, jnp.asarray(lens),
      None if sinks is None else jnp.asarray(sinks), sm_scale=d**-0.5,
      interpret=interpret, config=cfg, **kw, **scales)
  assert out.shape == q.shape and lse.shape == q.shape[:2]
  au.assert_decode_matches(out, lse, q, tk, tv, lens, jnp.bfloat16,
                           sm_scale=d**-0.5,
                           window_left=kw.get("window_left", -1),
                           logits_soft_cap=kw.get("logits_soft_cap"),
                           sinks=sinks)


@pytest.mark.parametrize("fmt, fp8, g, hkv, d, pack, ksplit, kw", CASES)
def test_packed_heads_match_oracle(fmt, fp8, g, hkv, d, pack, ksplit, kw,
                                   rng):
  _check(rng, fmt, fp8, g, hkv, d, pack, ksplit, kw, [1, 7, 33, 0, 70],
         interpret=True)


@pytest.mark.parametrize("fmt, fp8, g, hkv, d, pack, ksplit, kw",
                         [c for c in CASES if c[1]])
def test_packed_heads_pairs_match_oracle(fmt, fp8, g, hkv, d, pack, ksplit,
                                         kw, rng):
  """FP8 pages read as column pairs (the FP8 default) with packed heads."""
  _check(rng, fmt, fp8, g, hkv, d, pack, ksplit, kw, [1, 7, 33, 0, 70],
         interpret=True, fp8_convert="pairs")


def _on_gpu_with_fp8_cvt():
  return dispatch.current_gpu().has_fp8_cvt


@pytest.mark.skipif(not _on_gpu_with_fp8_cvt(),
                    reason="needs a GPU of compute capability >= 8.9")
@pytest.mark.parametrize("g", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("mode", ["loaded", "pairs"])
def test_packed_heads_gpu(g, mode, rng):
  """On the GPU, the FP8 default's form (2 heads of 64, 64-key steps):
  group sizes 1-8, odd lengths, splits, NaN in unowned pages and tail rows."""
  for ksplit in (1, 4):
    _check(rng, "pair", True, g, 4, 64, 2, ksplit, {},
           [1, 7, 129, 0, 4095, 300], interpret=False, fp8_convert=mode,
           ppb=4, ps=16)
  _check(rng, "flashinfer", False, g, 4, 64, 2, 2, dict(sinks=True),
         [1, 7, 129, 4095], interpret=False, ppb=4, ps=16)


@pytest.mark.skipif(dispatch.current_gpu().interpret, reason="needs a GPU")
@pytest.mark.parametrize("g, d", [(4, 128), (4, 64), (8, 64), (1, 128)])
def test_packed_heads_many_rows_gpu(g, d, rng):
  """On the GPU, Hopper's default for many one-token rows over 16-bit pages
  with an even number of kv heads (2 packed, 32-key steps on 2 warps, 2
  stages): odd lengths, splits, sinks, NaN in unowned pages and tail rows."""
  for ksplit, kw in ((1, {}), (2, dict(sinks=True, window_left=90))):
    _check(rng, "flashinfer", False, g, 8, d, 2, ksplit, kw,
           [1, 7, 129, 0, 1023, 80, 33], interpret=False, ppb=2, ps=16,
           num_warps=2, num_stages=2)


def test_pack_heads_many_rows_rule():
  """Hopper, 16-token pages of 16 bits at head_dim <= 128, one query row
  per sequence and >= 8 (row, kv head) items per SM (an engine's step at
  hundreds of rows): two kv heads per program where their number is even,
  32-token steps on 2 warps, 2 stages, splits counted in packed programs;
  odd kv heads keep one head and 64-token steps; fewer items, Ada, FP8
  pages and two query rows per sequence do not pack."""
  kw = dict(max_pages=64, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
            page_size=16)

  def cfg(gpu=dispatch.HOPPER, **over):
    return dispatch.decode(**{**dict(gpu=gpu), **kw, **over}).config

  for d, hkv in ((128, 8), (64, 8), (64, 2), (128, 4)):
    rows = -(-8 * dispatch.DECODE_NUM_SMS // hkv)
    c = cfg(batch_size=rows, num_kv_heads=hkv, head_dim=d, group_size=4)
    assert (c.pack_heads, c.pages_per_block, c.num_warps, c.num_stages,
            c.k_splits) == (2, 2, 2, 2, 1), (d, hkv, c)
    fewer = cfg(batch_size=rows - 1, num_kv_heads=hkv, head_dim=d,
                group_size=4)
    assert fewer.pack_heads == 1 and fewer.pages_per_block == 4, fewer
  odd = cfg(batch_size=512, num_kv_heads=3, head_dim=64, group_size=3)
  assert (odd.pack_heads, odd.pages_per_block, odd.num_warps) == (1, 4, 2)
  for other in (dict(gpu=dispatch.ADA), dict(kv_dtype=FP8),
                dict(q_tokens_per_seq=2)):
    c = dispatch.decode(**{**dict(gpu=dispatch.HOPPER), **kw, **dict(
        batch_size=256, num_kv_heads=8, head_dim=128, group_size=4),
                           **other}).config
    assert getattr(c, "pack_heads", 1) == 1, other


def test_pack_heads_default_rule():
  """FP8 pages at head_dim 64 with an even number of kv heads pack two per
  program on a GPU that converts e4m3 pairs, with the tiling of head_dim
  128 for half the kv heads; odd kv heads, bf16 pages, interpret mode and
  older GPUs do not pack. (Ada: on Hopper the per-warp Mosaic kernel takes
  FP8 pages.)"""
  kw = dict(max_pages=64, group_size=4, dtype=jnp.bfloat16, page_size=16,
            head_dim=64)

  def cfg(gpu=dispatch.ADA, **over):
    return dispatch.decode(**{**dict(gpu=gpu), **kw, **over}).config

  for batch in (8, 64, 256):
    d128 = cfg(batch_size=batch, num_kv_heads=4, kv_dtype=FP8, head_dim=128)
    assert cfg(batch_size=batch, num_kv_heads=8, kv_dtype=FP8) == (
        dataclasses.replace(d128, pack_heads=2))
  for other in (dict(num_kv_heads=3, kv_dtype=FP8),
                dict(num_kv_heads=8, kv_dtype=jnp.bfloat16),
                dict(num_kv_heads=8, kv_dtype=FP8, gpu=dispatch.INTERPRET),
                dict(num_kv_heads=8, kv_dtype=FP8, gpu=dispatch.AMPERE)):
    assert cfg(batch_size=64, **other).pack_heads == 1, other


def test_pack_heads_bad_config():
  with pytest.raises(ValueError, match="pack_heads"):
    kernel.TritonConfig(pages_per_block=2, k_splits=1, pack_heads=3)
  q = jnp.zeros((2, 6, 64), jnp.bfloat16)
  pages = jnp.zeros((4, 8, 3, 64), jnp.bfloat16)
  table, lens = jnp.array([[0, 1], [2, 3]]), jnp.array([9, 3])
  for pack, qq, pp in ((2, q, pages),  # 3 kv heads
                       (4, jnp.zeros((2, 8, 128), jnp.bfloat16),
                        jnp.zeros((4, 8, 4, 128), jnp.bfloat16))):  # > 256
    with pytest.raises(ValueError, match="pack_heads"):
      kernel.paged_decode(qq, pp, pp, table, table, lens, sm_scale=0.1,
                          interpret=True,
                          config=kernel.TritonConfig(pages_per_block=1,
                                                     k_splits=1,
                                                     pack_heads=pack))


@pytest.mark.parametrize("k_splits, scale_shape", [(1, ()), (2, ()),
                                                   (2, (8,))])
def test_packed_kernel_lowers_for_cuda(k_splits, scale_shape, cuda_lowering):
  """Cross-lowered for CUDA on any host (the Triton lowering, not interpret
  mode): the packed kernel, its block-diagonal q load and its 3-D output
  select lower with this jax, into a kernel whose pools are 128 wide; with
  per-KV-head scales (`scale_shape` `(8,)`), its per-row scale gathers."""
  sds = jax.ShapeDtypeStruct
  args = [sds((3, 32, 64), jnp.bfloat16), sds((64, 16, 8, 64), FP8),
          sds((64, 16, 8, 64), FP8), sds((3, 16), jnp.int32),
          sds((3, 16), jnp.int32), sds((3,), jnp.int32),
          sds(scale_shape, jnp.float32), sds(scale_shape, jnp.float32)]
  cfg = kernel.TritonConfig(pages_per_block=4, k_splits=k_splits,
                            num_warps=4, pack_heads=2)
  f = jax.jit(lambda q, kp, vp, kt, vt, n, a, b: kernel.paged_decode(
      q, kp, vp, kt, vt, n, sm_scale=0.125, config=cfg, k_scale=a,
      v_scale=b))
  text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "paged_decode_g8_d128_ps16_ppb4" in text and "_pk2" in text
  assert ("_hs" in text) == bool(scale_shape)
