"""Smoke check of the xla path and the shared oracle (the kernels' own tests go further)."""

import numpy as np
import jax.numpy as jnp
import pytest

import pkvattn
from attention_utils import FORMATS, assert_close, assert_lse_close, dense_attention, make_paged


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_xla_matches_oracle(fmt, rng):
  kv_lens = [1, 7, 8, 9, 24]
  p = make_paged(rng, kv_lens, page_size=8, num_kv_heads=2, head_dim=64,
                 dtype=jnp.float32, fmt=fmt)
  q = rng.standard_normal((5, 8, 64)).astype(np.float32)
  out, lse = pkvattn.paged_decode(jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table),
                                  jnp.asarray(p.kv_lens), return_lse=True, impl="xla")
  for b, n in enumerate(kv_lens):
    exp, exp_lse = dense_attention(q[b:b + 1], p.k[b], p.v[b], [n - 1], n,
                                   sm_scale=1 / 8)
    assert_close(out[b:b + 1], exp, jnp.float32, f"b={b}")
    assert_lse_close(lse[b], exp_lse[0], jnp.float32)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_prefill_with_few_tokens_runs_as_decode_rows(impl, rng):
  """num_tokens <= batch_size takes the per-token decode route: same semantics."""
  kv_lens = np.array([9, 1, 17, 8, 16, 5], np.int32)
  q_lens = np.array([1, 1, 2, 0, 1, 0], np.int32)  # a 2-token row, idle rows
  q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  num_tokens = 6  # == batch_size; one padding token past q_indptr[-1] = 5
  p = make_paged(rng, kv_lens, page_size=8, num_kv_heads=2, head_dim=64,
                 dtype=jnp.float32, fmt="pool")
  q = rng.standard_normal((num_tokens, 8, 64)).astype(np.float32)
  sinks = rng.standard_normal(8).astype(np.float32)
  out, lse = pkvattn.paged_prefill(
      jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table), jnp.asarray(q_indptr),
      jnp.asarray(kv_lens), window_left=6, logits_soft_cap=5.0,
      sinks=jnp.asarray(sinks), return_lse=True, impl=impl)
  for b in range(len(kv_lens)):
    lo, hi = q_indptr[b], q_indptr[b + 1]
    if hi == lo:
      continue
    positions = kv_lens[b] - (hi - lo) + np.arange(hi - lo)
    exp, exp_lse = dense_attention(q[lo:hi], p.k[b], p.v[b], positions, kv_lens[b],
                                   window_left=6, sm_scale=1 / 8,
                                   logits_soft_cap=5.0, sinks=sinks)
    assert_close(out[lo:hi], exp, jnp.float32, f"b={b}")
    assert_lse_close(lse[lo:hi], exp_lse, jnp.float32)
  np.testing.assert_array_equal(np.asarray(out[q_indptr[-1]:]), 0.0)
  assert np.isneginf(np.asarray(lse[q_indptr[-1]:])).all()


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_sink_far_above_the_logits_keeps_the_lse_finite(impl, rng):
  """A sink 100 above a sequence's only logit: its weight `exp(-100)`
  underflows f32, yet the LSE covers the keys alone and stays finite."""
  kv_lens = [1, 5]
  p = make_paged(rng, kv_lens, page_size=8, num_kv_heads=2, head_dim=64,
                 dtype=jnp.float32, fmt="pair")
  q = rng.standard_normal((2, 8, 64)).astype(np.float32)
  k0 = np.repeat(p.k[0][0], 4, axis=0)  # row 0's one key, per query head
  q[0] = -95.0 * 8 * k0 / (k0 * k0).sum(-1, keepdims=True)  # logit -95
  sinks = np.full(8, 5.0, np.float32)
  out, lse = pkvattn.paged_decode(
      jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table),
      jnp.asarray(p.kv_lens), return_lse=True, impl=impl, sinks=jnp.asarray(sinks))
  for b, n in enumerate(kv_lens):
    exp, exp_lse = dense_attention(q[b:b + 1], p.k[b], p.v[b], [n - 1], n,
                                   sm_scale=1 / 8, sinks=sinks)
    assert_close(out[b:b + 1], exp, jnp.float32, f"b={b}")
    assert_lse_close(lse[b], exp_lse[0], jnp.float32)
  np.testing.assert_allclose(np.asarray(lse[0]), -95.0, rtol=1e-4)
