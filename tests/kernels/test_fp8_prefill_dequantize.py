"""FP8 pages in prefill through `paged_prefill.PrefillConfig.fp8_pages`.

"dequantize" gathers the pages the tables name into a compact pool in q's
dtype (scaled) and runs the 16-bit kernels; "kernel" converts tiles in the
kernels. Both must give the float64 oracle's attention over the dequantized
pages (`attention_utils.dense_attention`), with NaN in every unowned page
and every row past `kv_lens`, -1 table entries, decode rows beside chunks,
padding tokens, in all three kv_cache formats (interpret mode).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_utils as au
from pkvattn import _kv
from pkvattn.pallas_kernels import _fp8
from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import paged_prefill as kernel
from attention_utils import fp8_paged as _fp8_paged

FP8 = jnp.float8_e4m3fn


@pytest.mark.parametrize("mode", ["dequantize", "kernel"])
@pytest.mark.parametrize("fmt, kw", [
    ("pair", {}), ("pool", dict(window_left=20)),
    ("flashinfer", dict(logits_soft_cap=8.0))])
def test_fp8_pages_modes_match_oracle(mode, fmt, kw, rng):
  g, hkv, d, ps = 4, 2, 64, 8
  lens = [40, 1, 29, 9]
  q_lens = [17, 1, 29, 1]
  p, cache, tk, tv, ks, vs = _fp8_paged(rng, lens, page_size=ps,
                                        num_kv_heads=hkv, head_dim=d, fmt=fmt)
  view = _kv.make_view(cache, jnp.asarray(p.page_table))
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  n_tok = int(indptr[-1]) + 3  # padding tokens
  q = np.asarray(jnp.asarray(rng.standard_normal((n_tok, g * hkv, d)),
                             jnp.bfloat16).astype(jnp.float32))
  cfg = dataclasses.replace(_default(dispatch.INTERPRET, g, d, ps, n_tok,
                                     len(lens)), fp8_pages=mode)
  assert cfg.dequantizes_fp8(num_tokens=n_tok, batch_size=len(lens),
                             group_size=g) == (mode == "dequantize")
  out, lse = kernel.paged_prefill(
      jnp.asarray(q, jnp.bfloat16), view.k_pool, view.v_pool, view.k_table,
      view.v_table, jnp.asarray(indptr), jnp.asarray(lens), sm_scale=d**-0.5,
      interpret=True, config=cfg, k_scale=jnp.float32(ks),
      v_scale=jnp.float32(vs), **kw)
  au.assert_prefill_matches(out, lse, q, tk, tv, indptr, lens, jnp.bfloat16,
                            sm_scale=d**-0.5,
                            window_left=kw.get("window_left", -1),
                            logits_soft_cap=kw.get("logits_soft_cap"))


@pytest.mark.parametrize("scale", [0.02, np.float32([0.02, 0.5])])
def test_dequantize_pages_gathers_and_scales(scale, rng):
  """A scale per tensor, or one per KV head (`f32[num_kv_heads]`, over
  the pages' head axis)."""
  pool = _kv.quantize(jnp.asarray(rng.standard_normal((6, 8, 2, 64)) * 3,
                                  jnp.float32), 0.02)
  table = jnp.asarray([[4, 0, -1], [2, 5, 1]], jnp.int32)
  pages, new_table = _fp8.dequantize_pages(pool, table, scale, jnp.bfloat16)
  assert pages.shape == (6, 8, 2, 64) and pages.dtype == jnp.bfloat16
  assert new_table.shape == table.shape
  want = np.asarray(pool, np.float32).astype(np.float64) * np.reshape(
      np.float32(scale), (-1, 1))
  for b in range(2):
    for i in range(3):
      if table[b, i] >= 0:
        np.testing.assert_allclose(
            np.asarray(pages[new_table[b, i]], np.float64),
            want[int(table[b, i])], rtol=2**-8)


def _default(gpu, group_size, head_dim, page_size, num_tokens, batch_size):
  return dispatch.prefill(
      gpu=gpu, dtype=jnp.bfloat16, kv_dtype=FP8, head_dim=head_dim,
      group_size=group_size, page_size=page_size, num_tokens=num_tokens,
      batch_size=batch_size).config


def test_fp8_pages_rule_and_bad_value():
  cfg = kernel.TritonConfig()
  rows = kernel.DEQUANTIZE_MIN_ROWS
  assert cfg.dequantizes_fp8(num_tokens=rows // 4 * 8, batch_size=8,
                             group_size=4)
  assert not cfg.dequantizes_fp8(num_tokens=rows // 4 * 8 - 1, batch_size=8,
                                 group_size=4)
  assert not cfg.dequantizes_fp8(num_tokens=8192, batch_size=256,
                                 group_size=4)  # an engine's mixed step
  # A window doubles the rows (its kernel reads only the window's keys).
  assert not cfg.dequantizes_fp8(num_tokens=rows // 4 * 8, batch_size=8,
                                 group_size=4, window_left=511)
  assert cfg.dequantizes_fp8(num_tokens=rows // 2 * 8, batch_size=8,
                             group_size=4, window_left=511)
  assert not cfg.dequantizes_fp8(num_tokens=rows // 2 * 8 - 1, batch_size=8,
                                 group_size=4, window_left=511)
  assert kernel.TritonConfig(fp8_pages="dequantize").dequantizes_fp8(
      num_tokens=1, batch_size=256, group_size=1)
  assert not kernel.MosaicConfig(fp8_pages="kernel").dequantizes_fp8(
      num_tokens=10**6, batch_size=1, group_size=8)
  with pytest.raises(ValueError, match="fp8_pages"):
    kernel.TritonConfig(fp8_pages="fast")
  # The default names the mode the rule picks, on every GPU; 16-bit pages
  # keep "auto" (nothing to read as FP8).
  for gpu in dispatch.GPUS.values():
    for tokens, mode in ((rows // 4 * 8, "dequantize"),
                         (rows // 4 * 8 - 1, "kernel")):
      cfg = _default(gpu, 4, 128, 16, tokens, 8)
      assert cfg.fp8_pages == mode, (gpu, tokens, cfg)
      assert cfg.dequantizes_fp8(num_tokens=tokens, batch_size=8,
                                 group_size=4) == (mode == "dequantize")
  assert dispatch.prefill(
      gpu=dispatch.HOPPER, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
      head_dim=128, group_size=4, page_size=16, num_tokens=8192,
      batch_size=1).config.fp8_pages == "auto"


def _on_gpu():
  return any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.skipif(not _on_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mode", ["dequantize", "kernel"])
def test_fp8_pages_modes_gpu(mode, d, rng):
  """The compiled kernels (Mosaic GPU at head_dim 128 on Hopper, Triton
  otherwise) on dequantized and in-kernel FP8 pages: odd lengths, chunks
  over a cached prefix, decode rows, NaN in unowned pages and tail rows."""
  g, hkv, ps = 4, 2, 16
  lens = [4095, 129, 7, 300, 1]
  q_lens = [1000, 129, 7, 1, 1]
  p, cache, tk, tv, ks, vs = _fp8_paged(rng, lens, page_size=ps,
                                        num_kv_heads=hkv, head_dim=d,
                                        fmt="flashinfer")
  view = _kv.make_view(cache, jnp.asarray(p.page_table))
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  n_tok = int(indptr[-1]) + 5
  q = np.asarray(jnp.asarray(rng.standard_normal((n_tok, g * hkv, d)),
                             jnp.bfloat16).astype(jnp.float32))
  cfg = dataclasses.replace(
      _default(dispatch.current_gpu(), g, d, ps, n_tok, len(lens)),
      fp8_pages=mode)
  out, lse = kernel.paged_prefill(
      jnp.asarray(q, jnp.bfloat16), view.k_pool, view.v_pool, view.k_table,
      view.v_table, jnp.asarray(indptr), jnp.asarray(lens), sm_scale=d**-0.5,
      config=cfg, k_scale=jnp.float32(ks), v_scale=jnp.float32(vs))
  au.assert_prefill_matches(out, lse, q, tk, tv, indptr, lens, jnp.bfloat16,
                            sm_scale=d**-0.5)
