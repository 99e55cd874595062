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
  """Spot checks, then `xla_attention.block_sizes` against its documented
  rule for every token count up to 1100: `block_q` is at most `num_tokens`;
  where less, it is the even share `num_tokens // batch_size` rounded up to
  a power of two and clamped to `[MIN_BLOCK_Q, BLOCK_Q]` (so at least the
  share, up to `BLOCK_Q`, and under twice it unless clamped up to
  `MIN_BLOCK_Q`); `batch_size` defaults to one sequence. `block_k` is whole
  pages, at most `max(min(BLOCK_K, max_keys), page_size)`. Spot checks alone
  pass with off-by-one bounds, a wrong default or a wrong rounding (a share
  of 2^k + 1 rounded down)."""
  bs = xla_attention.block_sizes
  # One long prompt: the largest tile and key block.
  assert bs(4096, 16) == (xla_attention.BLOCK_Q, xla_attention.BLOCK_K)
  assert bs(5, 16) == (5, xla_attention.BLOCK_K)
  # Eight sequences in 256 tokens, 64-key tables: short tiles and blocks.
  assert bs(256, 16, batch_size=8, max_keys=64) == (32, 64)
  assert bs(256, 16, batch_size=256)[0] == xla_attention.MIN_BLOCK_Q
  # Whole pages per key block.
  assert bs(4096, 32, block_k=40)[1] == 32
  lo, hi = xla_attention.MIN_BLOCK_Q, xla_attention.BLOCK_Q
  for bound in (lo, hi):
    assert bound & (bound - 1) == 0, bound  # the clamps keep powers of two
  for n in range(1, 1100):
    assert bs(n, 16) == bs(n, 16, batch_size=1), n
    for batch in (1, 3, 8, 40):
      bq = bs(n, 16, batch_size=batch)[0]
      share = max(1, n // batch)
      assert 1 <= bq <= n, (n, batch, bq)
      if bq < n:
        assert bq & (bq - 1) == 0, (n, batch, bq)
        assert lo <= bq <= hi, (n, batch, bq)
        assert bq >= min(share, hi), (n, batch, bq)
        assert bq < 2 * share or bq == lo, (n, batch, bq)
  for ps in (8, 16, 128):
    for max_keys in (1, 5, 64, 100, 4096):
      bk = bs(64, ps, max_keys=max_keys)[1]
      assert bk % ps == 0 and ps <= bk <= max(min(xla_attention.BLOCK_K,
                                                   max_keys), ps)


def _flash(p, q, indptr, lens, sinks=None, **kw):
  """`xla_attention.paged_prefill` over `make_paged`'s cache `p`
  (`sm_scale = head_dim ** -0.5`): `(out, lse)`."""
  view = pkvattn._kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
  return xla_attention.paged_prefill(
      jnp.asarray(q), view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(indptr), jnp.asarray(lens, np.int32),
      None if sinks is None else jnp.asarray(sinks),
      sm_scale=q.shape[-1]**-0.5, **kw)


def test_prefill_wide_table_default_blocks(rng):
  """The public op's default sizes over a table of 80 pages of 8 keys (640
  keys, more than `page_size ** 2` pages and more than `BLOCK_K` keys): the
  key block is `min(BLOCK_K, max_pages * page_size)` keys, whole pages; a
  sequence of 600 keys walks two such blocks, the second one past the
  table's end (padded with never-visible pages)."""
  lens, q_lens = [600, 30, 9], [40, 30, 1]
  p = au.make_paged(rng, lens, page_size=8, num_kv_heads=2, head_dim=64,
                    dtype=jnp.float32, fmt="pair", max_pages=80)
  q = rng.standard_normal((sum(q_lens) + 3, 4, 64)).astype(np.float32)
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  assert xla_attention.block_sizes(len(q), 8, batch_size=3,
                                   max_keys=640)[1] == xla_attention.BLOCK_K
  out, lse = pkvattn.paged_prefill(
      jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table),
      jnp.asarray(indptr), jnp.asarray(lens), impl="xla", return_lse=True)
  _check(out, lse, q, p.k, p.v, indptr, lens, jnp.float32, d=64)


@pytest.mark.parametrize("lens, q_lens, block_q", [
    ([20, 5, 30, 9, 3, 30], [4, 0, 0, 4, 0, 8], 4),  # whole tiles beside
                                                     # idle rows: 4 of 8
    ([20, 5, 30, 9], [9, 1, 17, 1], 8),  # a token past whole tiles: 7 of 7
    ([30, 7, 9, 7, 20], [7] * 5, 8),     # 5 of 8 tiles: 3 spare
])
def test_prefill_tile_budget(lens, q_lens, block_q, rng):
  """No padding token, so the tile budget `min(T, (T + B (block_q - 1)) //
  block_q)` is at or near its smallest: a chunk of whole tiles or an idle
  row counted one tile too many, or a budget one short, maps the last
  sequence's tokens past the last tile (whose rows are then another
  tile's)."""
  p = au.make_paged(rng, lens, page_size=8, num_kv_heads=2, head_dim=64,
                    dtype=jnp.float32, fmt="pair")
  q = rng.standard_normal((sum(q_lens), 4, 64)).astype(np.float32)
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  out, lse = _flash(p, q, indptr, lens, block_q=block_q, block_k=8)
  _check(out, lse, q, p.k, p.v, indptr, lens, jnp.float32, d=64)


def test_prefill_one_token_rows_not_causal(rng):
  """Non-causal, one token per sequence (`num_tokens == batch_size`): the
  public op takes the prefill route, with tiles of `num_tokens` rows and a
  budget of exactly one tile per sequence."""
  lens = [9, 1, 17, 8, 30]
  p = au.make_paged(rng, lens, page_size=8, num_kv_heads=2, head_dim=64,
                    dtype=jnp.float32, fmt="flashinfer")
  q = rng.standard_normal((len(lens), 8, 64)).astype(np.float32)
  indptr = np.arange(len(lens) + 1, dtype=np.int32)
  out, lse = pkvattn.paged_prefill(
      jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table),
      jnp.asarray(indptr), jnp.asarray(lens), impl="xla", return_lse=True,
      causal=False)
  _check(out, lse, q, p.k, p.v, indptr, lens, jnp.float32, d=64,
         causal=False)


@pytest.mark.parametrize("block_k", [8, None])
@pytest.mark.parametrize("window_left, causal", [(0, True), (9, True),
                                                 (9, False)])
def test_prefill_pages_before_the_window_are_never_read(window_left, causal,
                                                        block_k, rng):
  """Sliding window: a sequence's pages wholly before its first query's
  window need not be valid (the contract checks pages from there on; SWA
  scratch reuse frees them). Their table entries here point at a NaN page,
  and no NaN may reach an output (a masked key's weight is 0, and 0 * NaN
  is NaN). With one page per key block (`block_k == page_size`) blocks
  before a tile's window are never gathered; with the default blocks (the
  table's 88 keys in one block) the first block gathers those pages, whose
  V rows must be zeroed. `window_left=0`: each query sees itself alone."""
  lens, q_lens = [70, 30, 45, 20], [37, 1, 3, 20]
  p = au.make_paged(rng, lens, page_size=8, num_kv_heads=2, head_dim=64,
                    dtype=jnp.float32, fmt="pool", max_pages=11)
  table = p.page_table.copy()
  spare = sorted(set(range(p.kv_cache.shape[0])) - set(table[table >= 0]))[0]
  assert np.isnan(np.asarray(p.kv_cache[spare])).all()
  for b, (n, k) in enumerate(zip(lens, q_lens)):
    free = max(n - k - window_left, 0) // 8  # pages wholly before the window
    table[b, :, :free] = spare
  assert (table == spare).any()
  p.page_table = table
  q = rng.standard_normal((sum(q_lens) + 4, 6, 64)).astype(np.float32)
  sinks = rng.standard_normal(6).astype(np.float32)
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  out, lse = _flash(p, q, indptr, lens, sinks=sinks, block_q=8,
                    block_k=block_k, window_left=window_left, causal=causal)
  _check(out, lse, q, p.k, p.v, indptr, lens, jnp.float32, d=64, sinks=sinks,
         causal=causal, window_left=window_left)
