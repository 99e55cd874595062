"""Smoke check of the xla path and the shared oracle (the kernels' own tests go further)."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import pkvattn
from pkvattn import xla_attention
from attention_utils import FORMATS, assert_close, assert_lse_close, dense_attention, make_paged
from attention_utils import primitive_names


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_xla_matches_oracle(fmt, rng):
  """Rows of 0 to 24 keys (a row with none: zeros and -inf)."""
  kv_lens = [1, 7, 0, 8, 9, 24]
  p = make_paged(rng, kv_lens, page_size=8, num_kv_heads=2, head_dim=64,
                 dtype=jnp.float32, fmt=fmt)
  q = rng.standard_normal((6, 8, 64)).astype(np.float32)
  out, lse = pkvattn.paged_decode(jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table),
                                  jnp.asarray(p.kv_lens), return_lse=True, impl="xla")
  for b, n in enumerate(kv_lens):
    exp, exp_lse = dense_attention(q[b:b + 1], p.k[b], p.v[b], [n - 1], n,
                                   sm_scale=1 / 8)
    assert_close(out[b:b + 1], exp, jnp.float32, f"b={b}")
    assert_lse_close(lse[b], exp_lse[0], jnp.float32)
  np.testing.assert_array_equal(np.asarray(out[2]), 0.0)
  assert np.isneginf(np.asarray(lse[2])).all()


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_with_few_tokens_runs_as_decode_rows(impl, causal, rng):
  """num_tokens <= batch_size takes the per-token decode route where it is
  causal: same semantics. Not causal, a sequence's every token sees all its
  keys (the prefill route)."""
  kv_lens = np.array([9, 1, 17, 8, 16, 5], np.int32)
  q_lens = np.array([1, 1, 2, 0, 1, 0], np.int32)  # a 2-token row, idle rows
  q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  num_tokens = 6  # == batch_size; one padding token past q_indptr[-1] = 5
  p = make_paged(rng, kv_lens, page_size=8, num_kv_heads=2, head_dim=64,
                 dtype=jnp.float32, fmt="pool")
  q = rng.standard_normal((num_tokens, 8, 64)).astype(np.float32)
  sinks = rng.standard_normal(8).astype(np.float32)
  call = lambda q: pkvattn.paged_prefill(  # noqa: E731
      q, p.kv_cache, jnp.asarray(p.page_table), jnp.asarray(q_indptr),
      jnp.asarray(kv_lens), window_left=6, logits_soft_cap=5.0,
      sinks=jnp.asarray(sinks), return_lse=True, impl=impl, causal=causal)
  out, lse = call(jnp.asarray(q))
  if impl == "xla":  # the flash-style prefill loops over query tiles
    names = primitive_names(jax.make_jaxpr(call)(jnp.asarray(q)).jaxpr)
    assert ("scan" in names) == (not causal)
  for b in range(len(kv_lens)):
    lo, hi = q_indptr[b], q_indptr[b + 1]
    if hi == lo:
      continue
    positions = kv_lens[b] - (hi - lo) + np.arange(hi - lo)
    exp, exp_lse = dense_attention(q[lo:hi], p.k[b], p.v[b], positions, kv_lens[b],
                                   causal=causal, window_left=6, sm_scale=1 / 8,
                                   logits_soft_cap=5.0, sinks=sinks)
    assert_close(out[lo:hi], exp, jnp.float32, f"b={b}")
    assert_lse_close(lse[lo:hi], exp_lse, jnp.float32)
  np.testing.assert_array_equal(np.asarray(out[q_indptr[-1]:]), 0.0)
  assert np.isneginf(np.asarray(lse[q_indptr[-1]:])).all()


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("gap", [100.0, -100.0])
def test_sink_far_from_the_logits_keeps_the_lse_finite(impl, gap, rng):
  """A sink 100 above a sequence's only logit: its weight `exp(-100)`
  underflows f32, yet the LSE covers the keys alone and stays finite. A
  sink 100 below: the output is that key's value, no overflow."""
  kv_lens = [1, 5]
  p = make_paged(rng, kv_lens, page_size=8, num_kv_heads=2, head_dim=64,
                 dtype=jnp.float32, fmt="pair")
  q = rng.standard_normal((2, 8, 64)).astype(np.float32)
  k0 = np.repeat(p.k[0][0], 4, axis=0)  # row 0's one key, per query head
  q[0] = -95.0 * 8 * k0 / (k0 * k0).sum(-1, keepdims=True)  # logit -95
  sinks = np.full(8, -95.0 + gap, np.float32)
  out, lse = pkvattn.paged_decode(
      jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table),
      jnp.asarray(p.kv_lens), return_lse=True, impl=impl, sinks=jnp.asarray(sinks))
  for b, n in enumerate(kv_lens):
    exp, exp_lse = dense_attention(q[b:b + 1], p.k[b], p.v[b], [n - 1], n,
                                   sm_scale=1 / 8, sinks=sinks)
    assert_close(out[b:b + 1], exp, jnp.float32, f"b={b}")
    assert_lse_close(lse[b], exp_lse[0], jnp.float32)
  np.testing.assert_allclose(np.asarray(lse[0]), -95.0, rtol=1e-4)


def test_impl_picks_the_kernels_or_xla(rng):
  """`impl="pallas"` runs a kernel (a `pallas_call`, interpreted on a CPU);
  `impl="xla"`, and the default on a CPU, only XLA ops."""
  kv_lens = np.array([9, 17], np.int32)
  p = make_paged(rng, kv_lens, page_size=8, num_kv_heads=2, head_dim=64,
                 dtype=jnp.float32, fmt="pair")
  table, lens = jnp.asarray(p.page_table), jnp.asarray(kv_lens)
  q_indptr = jnp.asarray([0, 3, 8], jnp.int32)
  calls = {
      "decode": lambda impl: pkvattn.paged_decode(
          jnp.zeros((2, 8, 64)), p.kv_cache, table, lens, impl=impl),
      "prefill": lambda impl: pkvattn.paged_prefill(
          jnp.zeros((8, 8, 64)), p.kv_cache, table, q_indptr, lens,
          impl=impl),
      "prefill as decode rows": lambda impl: pkvattn.paged_prefill(
          jnp.zeros((2, 8, 64)), p.kv_cache, table,
          jnp.asarray([0, 1, 2], jnp.int32), lens, impl=impl)}
  for name, call in calls.items():
    for impl, want in (("pallas", True), ("xla", False), (None, False)):
      names = primitive_names(jax.make_jaxpr(lambda: call(impl))().jaxpr)
      assert ("pallas_call" in names) == want, (name, impl)


def test_a_soft_cap_of_zero_is_off(rng):
  """`logits_soft_cap` <= 0 turns the cap off (FlashInfer's 0.0 default), as
  None does."""
  kv_lens = np.array([9, 17], np.int32)
  p = make_paged(rng, kv_lens, page_size=8, num_kv_heads=2, head_dim=64,
                 dtype=jnp.float32, fmt="pair")
  q = jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.float32)
  run = lambda cap: pkvattn.paged_decode(  # noqa: E731
      q, p.kv_cache, jnp.asarray(p.page_table), jnp.asarray(kv_lens),
      logits_soft_cap=cap, return_lse=True, impl="xla")
  off = run(None)
  for cap in (0.0, -3.0):
    for a, b in zip(off, run(cap)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_static_arguments_given_as_arrays(rng):
  """`sm_scale` and `logits_soft_cap` given as numpy or jax scalars give
  what Python floats give (read as floats; the call is not one jitted
  program then, as its statics would not hash)."""
  kv_lens = np.array([9, 17], np.int32)
  p = make_paged(rng, kv_lens, page_size=8, num_kv_heads=2, head_dim=64,
                 dtype=jnp.float32, fmt="pair")
  q = jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.float32)
  run = lambda scale, cap: pkvattn.paged_decode(  # noqa: E731
      q, p.kv_cache, jnp.asarray(p.page_table), jnp.asarray(kv_lens),
      sm_scale=scale, logits_soft_cap=cap, impl="xla")
  want = np.asarray(run(0.1, 4.0))
  for scale, cap in ((jnp.float32(0.1), 4.0), (0.1, jnp.float32(4.0)),
                     (np.float32(0.1), np.float32(4.0))):
    np.testing.assert_allclose(np.asarray(run(scale, cap)), want, rtol=1e-6,
                               atol=1e-7)


# ------------------------------------------------- the flash-style prefill
# `pkvattn.xla_attention.paged_prefill`, called directly with small tiles
# and key blocks (or through `pkvattn.paged_prefill` with its default ones).


def _xla_prefill(p, q, q_lens, *, sinks=None, **kw):
  """`xla_attention.paged_prefill` over `make_paged`'s cache `p` (sm_scale
  `d ** -0.5`): `(out, lse, q_indptr)`."""
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  view = pkvattn._kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
  out, lse = xla_attention.paged_prefill(
      jnp.asarray(q), view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(indptr), jnp.asarray(p.kv_lens, np.int32),
      None if sinks is None else jnp.asarray(sinks),
      sm_scale=q.shape[-1]**-0.5, **kw)
  return out, lse, indptr


def _check_prefill(out, lse, q, p, indptr, *, causal=True, window_left=-1,
                   sinks=None):
  """Each sequence's tokens against `dense_attention` (its new tokens are
  its last positions); padding tokens past `q_indptr[-1]`: zeros, -inf."""
  for b, n in enumerate(p.kv_lens):
    lo, hi = indptr[b], indptr[b + 1]
    if hi == lo:
      continue
    pos = np.arange(n - (hi - lo), n)
    want, want_lse = dense_attention(q[lo:hi], p.k[b], p.v[b], pos, n,
                                     causal=causal, window_left=window_left,
                                     sm_scale=q.shape[-1]**-0.5, sinks=sinks)
    assert_close(out[lo:hi], want, jnp.float32, f"b={b}")
    assert_lse_close(lse[lo:hi], want_lse, jnp.float32, f"lse b={b}")
  np.testing.assert_array_equal(np.asarray(out[indptr[-1]:]), 0.0)
  assert np.isneginf(np.asarray(lse[indptr[-1]:])).all()


def test_prefill_block_sizes_rule_over_many_shapes():
  """`xla_attention.block_sizes` against its documented rule, for every
  token count up to 1100: `block_q` is at most `num_tokens`; where less, it
  is the even share `num_tokens // batch_size` rounded up to a power of two
  and clamped to `[MIN_BLOCK_Q, BLOCK_Q]` (so at least the share, up to
  `BLOCK_Q`, and under twice it unless clamped up to `MIN_BLOCK_Q`);
  `batch_size` defaults to one sequence. `block_k` is whole pages, at most
  `max(min(BLOCK_K, max_keys), page_size)`. Spot checks alone pass
  with off-by-one bounds, a wrong default or a wrong rounding (a share of
  2^k + 1 rounded down)."""
  bs = xla_attention.block_sizes
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


def test_prefill_wide_table_default_blocks(rng):
  """The public op's default sizes over a table of 80 pages of 8 keys (640
  keys, more than `page_size ** 2` pages and more than `BLOCK_K` keys): the
  key block is `min(BLOCK_K, max_pages * page_size)` keys, whole pages; a
  sequence of 600 keys walks two such blocks, the second one past the
  table's end (padded with never-visible pages)."""
  lens, q_lens = [600, 30, 9], [40, 30, 1]
  p = make_paged(rng, lens, page_size=8, num_kv_heads=2, head_dim=64,
                 dtype=jnp.float32, fmt="pair", max_pages=80)
  q = rng.standard_normal((sum(q_lens) + 3, 4, 64)).astype(np.float32)
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  assert xla_attention.block_sizes(len(q), 8, batch_size=3,
                                   max_keys=640)[1] == xla_attention.BLOCK_K
  out, lse = pkvattn.paged_prefill(
      jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table),
      jnp.asarray(indptr), jnp.asarray(lens), impl="xla", return_lse=True)
  _check_prefill(out, lse, q, p, indptr)


@pytest.mark.parametrize("q_lens, block_q", [
    ([4, 0, 0, 4, 0, 8], 4),  # whole tiles beside idle rows: 4 of 8 tiles
    ([9, 1, 17, 1], 8),       # one token past whole tiles: 7 of 7 tiles
])
def test_prefill_tile_budget_met_exactly(q_lens, block_q, rng):
  """No padding token, so the tile budget `min(T, (T + B (block_q - 1)) //
  block_q)` is at its smallest: a chunk of whole tiles or an idle row counted
  one tile too many, or a budget one short, maps the last sequence's tokens
  past the last tile (whose rows are then another tile's)."""
  lens = [20, 5, 30, 9, 3, 30][:len(q_lens)]
  lens = [max(n, k) for n, k in zip(lens, q_lens)]
  p = make_paged(rng, lens, page_size=8, num_kv_heads=2, head_dim=64,
                 dtype=jnp.float32, fmt="pair")
  q = rng.standard_normal((sum(q_lens), 4, 64)).astype(np.float32)
  out, lse, indptr = _xla_prefill(p, q, q_lens, block_q=block_q, block_k=8)
  _check_prefill(out, lse, q, p, indptr)


def test_prefill_one_token_rows_not_causal(rng):
  """Non-causal, one token per sequence (`num_tokens == batch_size`): the
  public op takes the prefill route, with tiles of `num_tokens` rows and a
  budget of exactly one tile per sequence."""
  lens = [9, 1, 17, 8, 30]
  p = make_paged(rng, lens, page_size=8, num_kv_heads=2, head_dim=64,
                 dtype=jnp.float32, fmt="flashinfer")
  q = rng.standard_normal((len(lens), 8, 64)).astype(np.float32)
  indptr = np.arange(len(lens) + 1, dtype=np.int32)
  out, lse = pkvattn.paged_prefill(
      jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table),
      jnp.asarray(indptr), jnp.asarray(lens), impl="xla", return_lse=True,
      causal=False)
  _check_prefill(out, lse, q, p, indptr, causal=False)


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
  p = make_paged(rng, lens, page_size=8, num_kv_heads=2, head_dim=64,
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
  out, lse, indptr = _xla_prefill(p, q, q_lens, sinks=sinks, block_q=8,
                                  block_k=block_k, window_left=window_left,
                                  causal=causal)
  _check_prefill(out, lse, q, p, indptr, causal=causal,
                 window_left=window_left, sinks=sinks)
