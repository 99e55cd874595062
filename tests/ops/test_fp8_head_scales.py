"""Per-KV-head FP8 scales (`k_scale` / `v_scale` of shape `[num_kv_heads]`).

The heads of a pool hold values of very different magnitudes (head 1's are
40x head 0's), so one scale per tensor would flush head 0 to a few FP8
steps. Pages are quantized per head in numpy; the attention oracle is
`attention_utils.dense_attention` (float64) over the dequantized pages, with
NaN in every page no sequence owns and every row past `kv_lens`: the public
ops (both impls), the Triton decode kernel itself in interpret mode (one or
two kv heads per program, "loaded" and "pairs" conversion, splits, window,
soft cap, sinks, an f32 query), the per-warp Mosaic-GPU decode kernel (on a
Hopper GPU) and the prefill path that dequantizes pages per head (its
oracle reads the pages as it does: rounded once to q's dtype). The append
ops are checked against the numpy storage rule per head, and the prefill
kernels' FP8 tiles, which read one scale per tensor, refuse per-head ones.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.experimental import checkify
import numpy as np
import pytest

import attention_utils as au
import pkvattn
from pkvattn import _kv
from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import paged_decode as decode_kernel
from pkvattn.pallas_kernels import paged_prefill as prefill_kernel
import rope_utils

FP8 = jnp.float8_e4m3fn
HKV = 2
MAGNITUDE = np.array([1.0, 40.0])  # per KV head


def _per_head_paged(rng, lens, *, page_size, head_dim, fmt, round_to=None,
                    shared=None):
  """FP8 pages quantized per head: (paged, kv_cache, dequantized K / V
  truths per sequence, k_scale f32[HKV], v_scale f32[HKV]). With
  `round_to` (a dtype), each truth value is `value * scale` in f32 rounded
  once to it, as `_fp8.dequantize_pages` writes the pages. `shared` ("k" or
  "v"): that tensor's heads share one scale (its vector's equal values),
  the largest head's."""
  p = au.make_paged(rng, lens, page_size=page_size, num_kv_heads=HKV,
                    head_dim=head_dim, dtype=jnp.float32, fmt=fmt)
  mag = MAGNITUDE[None, None, :, None]
  ks = (MAGNITUDE * 3.0 / 448).astype(np.float32)
  vs = (MAGNITUDE * 2.5 / 448).astype(np.float32)
  if shared == "k":
    ks = np.full_like(ks, ks.max())
  elif shared == "v":
    vs = np.full_like(vs, vs.max())
  if fmt == "pair":
    k_pool, v_pool = (np.asarray(x) * mag for x in p.kv_cache)
  else:  # flashinfer: [pages, 2, page_size, heads, dim]
    k_pool = np.asarray(p.kv_cache[:, 0]) * mag
    v_pool = np.asarray(p.kv_cache[:, 1]) * mag

  def quantize(pool, scale):
    return au.quantize_np(pool / scale[None, None, :, None], 1.0)

  kq, vq = quantize(k_pool, ks), quantize(v_pool, vs)
  if fmt == "pair":
    cache = (jnp.asarray(kq), jnp.asarray(vq))
  else:
    cache = jnp.asarray(np.stack([kq, vq], axis=1))

  def truth(xs, scale):
    out = []
    for x in xs:
      q8 = au.quantize_np(x * MAGNITUDE[None, :, None] / scale[None, :, None],
                          1.0)
      if round_to is None:
        out.append(q8.astype(np.float64) * scale[None, :, None])
      else:
        deq = q8.astype(np.float32) * scale[None, :, None]
        out.append(np.asarray(jnp.asarray(deq, round_to), np.float64))
    return out
  return p, cache, truth(p.k, ks), truth(p.v, vs), ks, vs


def _in_head_units(out, tv, g):
  """`out [T, HKV * g, D]` and the V truths in units of each kv head's
  value range (divided by its `MAGNITUDE`; attention is linear in V):
  rounding in `P @ V` is relative to the values, 40x larger in head 1,
  so tolerances meant for values of about 1 hold there."""
  per_q_head = np.repeat(MAGNITUDE, g)[None, :, None]
  return (np.asarray(jnp.asarray(out, jnp.float32)) / per_q_head,
          [v / MAGNITUDE[None, :, None] for v in tv])


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("fmt, g, kw", [
    ("pair", 3, {}), ("flashinfer", 2, dict(logits_soft_cap=8.0)),
    ("pair", 4, dict(sinks=True, window_left=20))])
def test_decode_per_head_scales(impl, fmt, g, kw, rng):
  d, lens = 64, [1, 7, 33, 0, 70]
  p, cache, tk, tv, ks, vs = _per_head_paged(rng, lens, page_size=16,
                                             head_dim=d, fmt=fmt)
  q, sinks, kw = au.query_and_sinks(rng, len(lens), g * HKV, d, kw)
  if sinks is not None:
    kw["sinks"] = jnp.asarray(sinks)
  out, lse = pkvattn.paged_decode(
      jnp.asarray(q, jnp.bfloat16), cache, jnp.asarray(p.page_table),
      jnp.asarray(lens), return_lse=True, impl=impl, k_scale=jnp.asarray(ks),
      v_scale=vs, **kw)
  au.assert_decode_matches(out, lse, q, tk, tv, lens, jnp.bfloat16,
                           sm_scale=d**-0.5,
                           window_left=kw.get("window_left", -1),
                           logits_soft_cap=kw.get("logits_soft_cap"),
                           sinks=sinks)


@pytest.mark.parametrize("fmt, pack, convert, k_splits, kw, q_dtype", [
    ("pair", 1, "loaded", 2, dict(window_left=20), jnp.bfloat16),
    ("flashinfer", 2, "pairs", 2, dict(logits_soft_cap=8.0), jnp.bfloat16),
    ("pair", 2, "loaded", 1, dict(sinks=True, window_left=40), jnp.float32)])
def test_decode_kernel_per_head_scales(fmt, pack, convert, k_splits, kw,
                                       q_dtype, rng):
  """The Triton kernel reads each kv head's scales: with `pack_heads=2` one
  program's rows belong to both heads (40x apart), so each row's logits
  and output take its own head's (errors in `_in_head_units`)."""
  g, d, lens = 3, 64, [1, 7, 33, 0, 70]
  p, cache, tk, tv, ks, vs = _per_head_paged(rng, lens, page_size=8,
                                             head_dim=d, fmt=fmt)
  view = _kv.make_view(cache, jnp.asarray(p.page_table))
  q, sinks, kw = au.query_and_sinks(rng, len(lens), g * HKV, d, kw)
  cfg = decode_kernel.TritonConfig(pages_per_block=2, k_splits=k_splits,
                                   num_warps=2, fp8_convert=convert,
                                   pack_heads=pack)
  out, lse = decode_kernel.paged_decode(
      jnp.asarray(q, q_dtype), view.k_pool, view.v_pool, view.k_table,
      view.v_table, jnp.asarray(lens),
      None if sinks is None else jnp.asarray(sinks), sm_scale=d**-0.5,
      interpret=True, config=cfg, k_scale=jnp.asarray(ks),
      v_scale=jnp.asarray(vs), **kw)
  assert out.shape == q.shape and out.dtype == q_dtype
  out, tv = _in_head_units(out, tv, g)
  au.assert_decode_matches(out, lse, q, tk, tv, lens, q_dtype,
                           sm_scale=d**-0.5,
                           window_left=kw.get("window_left", -1),
                           logits_soft_cap=kw.get("logits_soft_cap"),
                           sinks=sinks)


HOPPER = dispatch.current_gpu().is_hopper


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_prefill_per_head_scales_mixed_batch(impl, rng):
  """Chunks beside decode rows: off Hopper the pallas path dequantizes the
  pages per head into bf16 (the oracle reads them so) and runs the 16-bit
  kernels, on Hopper the Mosaic-GPU kernel reads them (exact dequantized
  values); the xla path scales q and the output per head in f32. Errors in
  `_in_head_units` (bf16 `P @ V`)."""
  g, d, lens, q_lens = 2, 64, [40, 1, 29, 9], [17, 1, 29, 1]
  p, cache, tk, tv, ks, vs = _per_head_paged(
      rng, lens, page_size=8, head_dim=d, fmt="pair",
      round_to=jnp.bfloat16 if impl == "pallas" and not HOPPER else None)
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = np.asarray(jnp.asarray(rng.standard_normal((int(indptr[-1]) + 3,
                                                  g * HKV, d)),
                             jnp.bfloat16).astype(jnp.float32))
  out, lse = pkvattn.paged_prefill(
      jnp.asarray(q, jnp.bfloat16), cache, jnp.asarray(p.page_table),
      jnp.asarray(indptr), jnp.asarray(lens), return_lse=True, impl=impl,
      k_scale=ks, v_scale=jnp.asarray(vs))
  assert out.shape == q.shape and out.dtype == jnp.bfloat16
  out, tv = _in_head_units(out, tv, g)
  au.assert_prefill_matches(out, lse, q, tk, tv, indptr, lens, jnp.bfloat16,
                            sm_scale=d**-0.5)


@pytest.mark.skipif(not dispatch.current_gpu().is_hopper,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("fmt, g, d, k_splits, kw, per_head", [
    ("pair", 3, 64, 1, {}, "both"),
    ("flashinfer", 4, 128, 2, dict(logits_soft_cap=8.0), "both"),
    ("pair", 2, 256, 1, dict(sinks=True, window_left=20), "k"),
    ("flashinfer", 1, 64, 4, dict(sinks=True, window_left=40), "v")])
def test_mma_decode_kernel_per_head_scales_gpu(fmt, g, d, k_splits, kw,
                                               per_head, rng):
  """The per-warp Mosaic-GPU kernel reads each CTA's kv head's scales (the
  heads are 40x apart: one head's scale for both would be 40x off); a
  scalar beside a per-head vector is broadcast. One split stores the
  output itself, several go through the combine. Errors in
  `_in_head_units`."""
  lens = [1, 7, 33, 0, 70]
  shared = {"both": None, "k": "v", "v": "k"}[per_head]
  p, cache, tk, tv, ks, vs = _per_head_paged(rng, lens, page_size=16,
                                             head_dim=d, fmt=fmt,
                                             shared=shared)
  view = _kv.make_view(cache, jnp.asarray(p.page_table))
  k_table, v_table, interleaved = view.decode_tables()
  q, sinks, kw = au.query_and_sinks(rng, len(lens), g * HKV, d, kw)
  # The shared tensor's scale as a Python scalar beside the other's vector.
  k_arg = float(ks[0]) if shared == "k" else jnp.asarray(ks)
  v_arg = float(vs[0]) if shared == "v" else jnp.asarray(vs)
  out, lse = decode_kernel.paged_decode(
      jnp.asarray(q, jnp.bfloat16), view.k_pool, view.v_pool, k_table,
      v_table, jnp.asarray(lens),
      None if sinks is None else jnp.asarray(sinks), sm_scale=d**-0.5,
      config=decode_kernel.MmaConfig(k_splits=k_splits), k_scale=k_arg,
      v_scale=v_arg, interleaved_kv=interleaved, **kw)
  assert out.shape == q.shape and out.dtype == jnp.bfloat16
  out, tv = _in_head_units(out, tv, g)
  au.assert_decode_matches(out, lse, q, tk, tv, lens, jnp.bfloat16,
                           sm_scale=d**-0.5,
                           window_left=kw.get("window_left", -1),
                           logits_soft_cap=kw.get("logits_soft_cap"),
                           sinks=sinks)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("g, d, kw", [
    (3, 64, {}),                                 # packed GQA, persistent
    (4, 128, dict(logits_soft_cap=8.0)),         # a query head per CTA
    (2, 256, dict(window_left=20)),
    (1, 128, dict(window_left=50, logits_soft_cap=20.0))])
def test_mosaic_prefill_per_head_scales_gpu(g, d, kw, rng):
  """The Mosaic-GPU prefill kernel reads FP8 pages with each item's kv
  head's scales (heads 40x apart: one head's scale for both would be 40x
  off), and the call's decode rows the decode kernel's; the default config
  reads them in the kernel (checked), so the oracle takes the exact
  dequantized values. Chunks, whole prompts, multi-token decode and decode
  rows in one call; NaN in unowned pages. Errors in `_in_head_units`."""
  lens, q_lens = [40, 1, 29, 9, 130, 3], [17, 1, 29, 3, 70, 3]
  p, cache, tk, tv, ks, vs = _per_head_paged(rng, lens, page_size=16,
                                             head_dim=d, fmt="pair")
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = np.asarray(jnp.asarray(rng.standard_normal((int(indptr[-1]) + 3,
                                                  g * HKV, d)),
                             jnp.bfloat16).astype(jnp.float32))
  choice = dispatch.prefill(
      gpu=dispatch.current_gpu(), dtype=jnp.bfloat16, kv_dtype=FP8,
      head_dim=d, group_size=g, page_size=16, num_tokens=q.shape[0],
      batch_size=len(lens), window_left=kw.get("window_left", -1),
      head_scales=True)
  assert choice.backend == "mosaic", choice
  assert not choice.config.dequantizes_fp8(
      num_tokens=q.shape[0], batch_size=len(lens), group_size=g,
      head_scales=True, window_left=kw.get("window_left", -1)), choice
  out, lse = pkvattn.paged_prefill(
      jnp.asarray(q, jnp.bfloat16), cache, jnp.asarray(p.page_table),
      jnp.asarray(indptr), jnp.asarray(lens), return_lse=True,
      impl="pallas", k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs), **kw)
  assert out.shape == q.shape and out.dtype == jnp.bfloat16
  out, tv = _in_head_units(out, tv, g)
  au.assert_prefill_matches(out, lse, q, tk, tv, indptr, lens, jnp.bfloat16,
                            sm_scale=d**-0.5,
                            window_left=kw.get("window_left", -1),
                            logits_soft_cap=kw.get("logits_soft_cap"))


def test_prefill_fp8_tiles_refuse_per_head_scales():
  """The Pallas-Triton prefill tiles read one scale per tensor: per-head
  scales with `fp8_pages="kernel"` are refused (trace time), not applied
  as one, in a `TritonConfig` and in a `MosaicConfig` with a (Triton)
  short launch; a `MosaicConfig` without one reads them (here it stops
  only at the GPU it needs)."""
  cache = jnp.zeros((4, 8, HKV, 64), FP8)
  table, lens = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
  q = jnp.zeros((1, 4, 64), jnp.bfloat16)
  heads = jnp.ones((HKV,), jnp.float32)
  run = lambda cfg: prefill_kernel.paged_prefill(  # noqa: E731
      q, cache, cache, table, table, jnp.asarray([0, 1]), lens,
      sm_scale=0.125, interpret=True, config=cfg, k_scale=1.0,
      v_scale=heads)
  for cfg in (prefill_kernel.TritonConfig(block_q=16, fp8_pages="kernel"),
              prefill_kernel.MosaicConfig(short_block_q=8,
                                          fp8_pages="kernel")):
    assert not cfg.reads_head_scales
    with pytest.raises(ValueError, match=r"Invalid config.fp8_pages: "
                       r"'kernel' .*per-KV-head scales"):
      run(cfg)
  cfg = prefill_kernel.MosaicConfig(fp8_pages="kernel")
  assert cfg.reads_head_scales
  with pytest.raises(ValueError, match=r"mosaic backend needs a GPU"):
    run(cfg)


def test_equal_head_scales_match_the_tensor_scale(rng):
  """Per-head scales all equal to the tensor scale give its result, K's and
  V's each per head or per tensor (the two may differ in form)."""
  p = au.make_paged(rng, [9, 30], page_size=8, num_kv_heads=HKV, head_dim=64,
                    dtype=jnp.float32, fmt="pair")
  cache = tuple(jnp.asarray(x, FP8) for x in p.kv_cache)
  q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
  run = lambda ks, vs: pkvattn.paged_decode(  # noqa: E731
      q, cache, jnp.asarray(p.page_table), jnp.asarray([9, 30]), impl="xla",
      k_scale=ks, v_scale=vs, return_lse=True)
  heads = jnp.full((HKV,), 0.25)
  one = run(0.25, 0.25)
  for ks, vs in ((heads, heads), (heads, 0.25), (0.25, heads)):
    for a, b in zip(one, run(ks, vs)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                                 atol=1e-6)


def _written(cache, table, bidx, pos, page_size):
  """`{(token, "k" | "v"): f32[HKV, D]}` rows written (pair format)."""
  k_pool, v_pool = (np.asarray(x).astype(np.float32) for x in cache)
  out = {}
  for t in range(len(bidx)):
    if bidx[t] >= 0:
      blk, row = divmod(int(pos[t]), page_size)
      page = table[bidx[t], blk]
      out[t, "k"], out[t, "v"] = k_pool[page, row], v_pool[page, row]
  return out


@pytest.mark.parametrize("op", ["append_paged_kv", "apply_rope_and_append",
                                "apply_rope_and_append_qkv"])
@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("v_per_head", [True, False])
def test_append_quantizes_per_head(op, impl, v_per_head, rng):
  """K's scale per head; V's per head too, or one for the tensor."""
  n, hq, d, ps, pages = 19, 4, 64, 8, 8
  q = rng.standard_normal((n, hq, d)).astype(np.float32)
  k = rng.standard_normal((n, HKV, d)) * MAGNITUDE[None, :, None] * 4
  v = rng.standard_normal((n, HKV, d)) * MAGNITUDE[None, :, None]
  k[0, 1, :2] = [1e6, -1e6]  # saturates at +-448 of its head's scale
  k, v = k.astype(np.float32), v.astype(np.float32)
  table = rng.permutation(pages)[:6].reshape(2, 3).astype(np.int32)
  bidx = np.r_[np.zeros(10), np.ones(8), [-1]].astype(np.int32)
  pos = np.r_[np.arange(10), np.arange(4, 12), [0]].astype(np.int32)
  nan = jnp.full((pages, ps, HKV, d), jnp.nan, FP8)
  ks = (MAGNITUDE * 4 * 3 / 448).astype(np.float32)
  vs = jnp.asarray(MAGNITUDE * 3 / 448 if v_per_head else
                   MAGNITUDE.max() * 3 / 448, jnp.float32)
  rope = pkvattn.RopeConfig()
  args = (bidx, pos, (nan, nan), table)
  if op == "append_paged_kv":
    cache = pkvattn.append_paged_kv(jnp.asarray(k), jnp.asarray(v), *args,
                                    impl=impl, k_scale=ks, v_scale=vs)
    k_want = k.astype(np.float64)
  elif op == "apply_rope_and_append":
    _, cache = pkvattn.apply_rope_and_append(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), *args, rope,
        impl=impl, k_scale=ks, v_scale=vs)
    k_want = rope_utils.np_rope(k, pos, rope_utils.np_inv_freq(d, rope.theta), rope.style)
  else:
    qkv = np.concatenate([q, k, v], axis=1).reshape(n, -1)
    _, cache = pkvattn.apply_rope_and_append_qkv(
        jnp.asarray(qkv), *args, rope, impl=impl, k_scale=ks, v_scale=vs)
    k_want = rope_utils.np_rope(k, pos, rope_utils.np_inv_freq(d, rope.theta), rope.style)
  got = _written(cache, table, bidx, pos, ps)
  vs = np.broadcast_to(np.asarray(vs), (HKV,))
  for (t, which), row in got.items():
    assert not np.isnan(row).any()
    if which == "k":  # one FP8 step where f32 and f64 rotations round apart
      want = np.clip(k_want[t] / ks[:, None], -448, 448)
      np.testing.assert_allclose(row, want, rtol=2**-3, atol=2**-9)
    else:
      np.testing.assert_array_equal(
          row, au.quantize_np(v[t] / vs[:, None], 1.0).astype(np.float32))
  assert np.abs(got[0, "k"][1, :2]).tolist() == [448.0, 448.0]
  # Pages and rows nobody wrote keep their NaN.
  k_pool = np.asarray(cache[0]).astype(np.float32)
  owned = {(table[b, p // ps], p % ps) for b, p in zip(bidx, pos) if b >= 0}
  for page in range(pages):
    for row in range(ps):
      if (page, row) not in owned:
        assert np.isnan(k_pool[page, row]).all()


@pytest.mark.parametrize("shape", [(3,), (1, 2), (2, 1)])
def test_scale_of_another_shape_is_refused(shape):
  cache = (jnp.zeros((4, 8, HKV, 64), FP8),) * 2
  with pytest.raises(ValueError, match=r"Invalid shape of k_scale: expected "
                     r"\(\) \(one scale per tensor\) or \(2,\) \(one per KV "
                     rf"head\), got {re.escape(str(shape))}"):
    pkvattn.paged_decode(jnp.zeros((1, 4, 64), jnp.bfloat16), cache,
                         jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32),
                         k_scale=np.ones(shape, np.float32), v_scale=1.0)


def test_bad_head_scale_refused_on_the_host_and_in_checked_mode():
  cache = (jnp.zeros((4, 8, HKV, 64), FP8),) * 2
  call = lambda s: pkvattn.paged_decode(  # noqa: E731
      jnp.zeros((1, 4, 64), jnp.bfloat16), cache, jnp.zeros((1, 2), jnp.int32),
      jnp.ones((1,), jnp.int32), k_scale=1.0, v_scale=s, impl="xla")
  with pytest.raises(ValueError, match=r"Invalid v_scale: expected a finite "
                     r"scale >= .*got \[0.5, 0.0\]"):
    call([0.5, 0.0])
  staged = jax.jit(checkify.checkify(call))
  with pkvattn.checked():
    err, out = staged(jnp.asarray([0.5, 2.0**-127]))
    assert "Invalid v_scale: v_scale = 5.877" in err.get(), err.get()
    assert np.isnan(np.asarray(out, np.float32)).all()
    err, _ = staged(jnp.asarray([0.5, 2.0]))
    assert err.get() is None
