"""The flash-style XLA prefill (`pkvattn.xla_attention`) and the pure-jnp
reference prefill against the float64 oracle.

Every page no sequence owns and every row past `kv_lens` is NaN
(`attention_utils.make_paged`). Small tiles and key blocks make each case
walk several query tiles per sequence and several key blocks per tile, with
blocks skipped before the window and past the diagonal; the public op runs
with the default sizes.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import attention_utils as au
import pkvattn
from pkvattn import xla_attention
from pkvattn.pallas_kernels import reference

CASES = [  # (fmt, group, head_dim, page_size, kwargs)
    ("pair", 3, 64, 8, {}),
    ("pool", 4, 128, 8, dict(window_left=13)),
    ("flashinfer", 1, 64, 16, dict(logits_soft_cap=5.0, sinks=True)),
    ("pair", 2, 64, 8, dict(causal=False, window_left=9, sinks=True)),
    ("pool", 3, 64, 16, dict(causal=False)),
    ("pair", 2, 64, 8, dict(window_left=0)),  # each query sees itself alone
]


def _ragged(rng, lens, q_lens, fmt, g, d, ps, dtype=jnp.float32, hkv=2):
  p = au.make_paged(rng, lens, page_size=ps, num_kv_heads=hkv, head_dim=d,
                    dtype=dtype, fmt=fmt, max_pages=-(-max(lens) // ps) + 2)
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  n_tok = int(indptr[-1]) + 5  # padding tokens past q_indptr[-1]
  q = np.asarray(jnp.asarray(rng.standard_normal((n_tok, g * hkv, d)),
                             dtype).astype(jnp.float32))
  return p, indptr, q


def _check(out, lse, q, k, v, indptr, lens, dtype, *, d, sinks=None,
           causal=True, window_left=-1, logits_soft_cap=None):
  for b, n in enumerate(lens):
    rows = slice(indptr[b], indptr[b + 1])
    pos = np.arange(n - (indptr[b + 1] - indptr[b]), n)
    want, want_lse = au.dense_attention(
        q[rows], k[b], v[b], pos, n, causal=causal, sm_scale=d**-0.5,
        window_left=window_left, logits_soft_cap=logits_soft_cap, sinks=sinks)
    au.assert_close(out[rows], want, dtype, f"b={b}")
    au.assert_lse_close(lse[rows], want_lse, dtype)
  np.testing.assert_array_equal(np.asarray(out[indptr[-1]:], np.float32), 0.0)
  assert np.isneginf(np.asarray(lse[indptr[-1]:])).all()


@pytest.mark.parametrize("fmt, g, d, ps, kw", CASES)
def test_flash_prefill_matches_oracle(fmt, g, d, ps, kw, rng):
  """Ragged batch: a chunk over a cached prefix, a decode row, an idle row,
  a whole prompt, and a sequence longer than several tiles. Also the
  pure-jnp reference (`reference.paged_prefill_reference`, the op's stated
  semantics), 8 tokens a chunk so the last chunk is part padding."""
  lens = [70, 1, 9, 29, 45]
  q_lens = [37, 1, 0, 29, 3]
  kw = dict(kw)
  sinks = (rng.standard_normal(g * 2).astype(np.float32) * 2
           if kw.pop("sinks", False) else None)
  p, indptr, q = _ragged(rng, lens, q_lens, fmt, g, d, ps)
  view = pkvattn._kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
  for bq, bk in ((8, 16),) if kw else ((8, 16), (16, 48)):
    out, lse = xla_attention.paged_prefill(
        jnp.asarray(q), view.k_pool, view.v_pool, view.k_table, view.v_table,
        jnp.asarray(indptr), jnp.asarray(lens, np.int32),
        None if sinks is None else jnp.asarray(sinks), sm_scale=d**-0.5,
        block_q=bq, block_k=bk, **kw)
    _check(out, lse, q, p.k, p.v, indptr, lens, jnp.float32, d=d, sinks=sinks,
           **kw)
  out, lse = pkvattn.paged_prefill(
      jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table),
      jnp.asarray(indptr), jnp.asarray(lens), impl="xla", return_lse=True,
      sinks=None if sinks is None else jnp.asarray(sinks), **kw)
  _check(out, lse, q, p.k, p.v, indptr, lens, jnp.float32, d=d, sinks=sinks,
         **kw)
  out, lse = reference.paged_prefill_reference(
      jnp.asarray(q), view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(indptr), jnp.asarray(lens, np.int32),
      None if sinks is None else jnp.asarray(sinks), sm_scale=d**-0.5,
      chunk=8, **kw)
  _check(out, lse, q, p.k, p.v, indptr, lens, jnp.float32, d=d, sinks=sinks,
         **kw)


def test_flash_prefill_with_few_spare_tiles(rng):
  """Five sequences of 7 tokens in 8-token tiles, no padding token: the
  tile budget (`(T + B (block_q - 1)) // block_q` = 8) spares 3 tiles, so
  one tile too many counted per sequence would push the last sequence's
  tile past it."""
  lens, q_lens = [30, 7, 9, 7, 20], [7] * 5
  p = au.make_paged(rng, lens, page_size=8, num_kv_heads=2, head_dim=64,
                    dtype=jnp.float32, fmt="pair")
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = rng.standard_normal((int(indptr[-1]), 4, 64)).astype(np.float32)
  view = pkvattn._kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
  out, lse = xla_attention.paged_prefill(
      jnp.asarray(q), view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(indptr), jnp.asarray(lens, np.int32), sm_scale=64**-0.5,
      block_q=8, block_k=16)
  _check(out, lse, q, p.k, p.v, indptr, lens, jnp.float32, d=64)


def test_flash_prefill_sink_far_below_the_logits(rng):
  """A sink 200 below every logit takes no weight: the output is the one
  without it, with no overflow (`exp(m - sink)` would be inf)."""
  lens, q_lens = [30, 12], [20, 12]
  p, indptr, q = _ragged(rng, lens, q_lens, "pair", 2, 64, 8)
  view = pkvattn._kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
  run = lambda sinks: xla_attention.paged_prefill(  # noqa: E731
      jnp.asarray(q), view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(indptr), jnp.asarray(lens, np.int32), sinks,
      sm_scale=64**-0.5, block_q=8, block_k=16)
  want, want_lse = run(None)
  out, lse = run(jnp.full((4,), -200.0, jnp.float32))
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6,
                             atol=1e-7)
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


def test_flash_prefill_bf16_long_prompt(rng):
  """One prompt of several default-sized tiles and key blocks, bf16."""
  lens, q_lens = [1100], [1100]
  p, indptr, q = _ragged(rng, lens, q_lens, "pair", 3, 64, 16,
                         dtype=jnp.bfloat16, hkv=1)
  out, lse = pkvattn.paged_prefill(
      jnp.asarray(q, jnp.bfloat16), p.kv_cache, jnp.asarray(p.page_table),
      jnp.asarray(indptr), jnp.asarray(lens), impl="xla", return_lse=True)
  _check(out, lse, q, p.k, p.v, indptr, lens, jnp.bfloat16, d=64)


@pytest.mark.parametrize("fmt, g, d, ps, kw", CASES[:3])
def test_flash_prefill_fp8_pages(fmt, g, d, ps, kw, rng):
  """FP8 pages, several tiles and blocks: the oracle runs on the
  dequantized pages (the quantization is the input, not the error)."""
  lens, q_lens = [70, 1, 29], [37, 1, 29]
  kw = dict(kw)
  sinks = (rng.standard_normal(g * 2).astype(np.float32)
           if kw.pop("sinks", False) else None)
  p, cache, tk, tv, ks, vs = au.fp8_paged(rng, lens, page_size=ps,
                                          num_kv_heads=2, head_dim=d, fmt=fmt)
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = np.asarray(jnp.asarray(rng.standard_normal((indptr[-1] + 2, g * 2, d)),
                             jnp.float32))
  view = pkvattn._kv.make_view(cache, jnp.asarray(p.page_table))
  out, lse = xla_attention.paged_prefill(
      jnp.asarray(q), view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(indptr), jnp.asarray(lens, np.int32),
      None if sinks is None else jnp.asarray(sinks), jnp.float32(ks),
      jnp.float32(vs), sm_scale=d**-0.5, block_q=8, block_k=16, **kw)
  _check(out, lse, q, tk, tv, indptr, lens, jnp.float32, d=d, sinks=sinks,
         **kw)


def test_block_sizes_rule():
  bs = xla_attention.block_sizes
  # One long prompt: the largest tile and key block.
  assert bs(4096, 16) == (xla_attention.BLOCK_Q, xla_attention.BLOCK_K)
  assert bs(5, 16) == (5, xla_attention.BLOCK_K)
  # Eight sequences in 256 tokens, 64-key tables: short tiles and blocks.
  assert bs(256, 16, batch_size=8, max_keys=64) == (32, 64)
  assert bs(256, 16, batch_size=256)[0] == xla_attention.MIN_BLOCK_Q
  # Whole pages per key block.
  assert bs(4096, 32, block_k=40)[1] == 32
