"""Smoke check of the xla path and the shared oracle (the kernels' own tests go further)."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import pkvattn
from attention_utils import FORMATS, assert_close, assert_lse_close, dense_attention, make_paged
from attention_utils import primitive_names, runs_a_kernel


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
  """`impl="pallas"` runs a kernel (interpreted on a CPU); `impl="xla"` only
  XLA ops; the default, the kernels on a GPU and XLA elsewhere."""
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
    for impl, want in (("pallas", True), ("xla", False),
                       (None, jax.default_backend() == "gpu")):
      assert runs_a_kernel(lambda: call(impl)) == want, (name, impl)


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
