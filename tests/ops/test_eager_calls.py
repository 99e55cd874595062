"""Eager calls of the attention ops: one jitted program per call, traced once
per shape (`pkvattn.attention`'s module docstring), with the results and
errors of the op as written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pkvattn
from attention_utils import (assert_close, assert_lse_close, dense_attention,
                             make_paged)
from pkvattn import attention

IMPLS = ["xla", "pallas"]


@pytest.fixture
def traces(monkeypatch):
  """Counts how often the ops' checks run: once per trace of an op's body."""
  count = [0]
  checks = attention._common_checks

  def counted(*args, **kwargs):
    count[0] += 1
    return checks(*args, **kwargs)
  monkeypatch.setattr(attention, "_common_checks", counted)
  attention._decode_program.clear_cache()
  attention._prefill_program.clear_cache()
  return count


def _case(rng, kv_lens):
  p = make_paged(rng, kv_lens, page_size=8, num_kv_heads=2, head_dim=64,
                 dtype=jnp.float32, fmt="pair", max_pages=4)
  q = rng.standard_normal((len(kv_lens), 6, 64)).astype(np.float32)
  return p, q


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_traces_once_per_shape(traces, impl, rng):
  """Two eager calls of one shape on fresh inputs trace the op once, a new
  batch size once more; each result matches the float64 oracle (NaN in every
  page a sequence does not own) and the op staged in a caller's jit."""
  calls = []
  # The first two batches hold six pages each: the same pool shape.
  for kv_lens, expected_traces in (([9, 17, 1], 1), ([4, 30, 8], 1),
                                   ([5, 12], 2)):
    p, q = _case(rng, kv_lens)
    args = (jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table),
            jnp.asarray(p.kv_lens))
    out, lse = pkvattn.paged_decode(*args, window_left=7, return_lse=True,
                                    impl=impl)
    assert traces[0] == expected_traces
    for b, n in enumerate(kv_lens):
      exp, exp_lse = dense_attention(q[b:b + 1], p.k[b], p.v[b], [n - 1], n,
                                     window_left=7, sm_scale=1 / 8)
      assert_close(out[b:b + 1], exp, jnp.float32, f"b={b}")
      assert_lse_close(lse[b], exp_lse[0], jnp.float32)
    calls.append((args, (out, lse)))
  staged = jax.jit(lambda *a: pkvattn.paged_decode(
      *a, window_left=7, return_lse=True, impl=impl))
  for args, result in calls:
    jax.tree.map(np.testing.assert_array_equal, result, staged(*args))


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_traces_once_per_shape_and_plan(traces, impl, rng):
  """Eager prefill calls of one shape trace once, with or without a plan
  (a pytree argument); a Python list for `q_indptr` runs the op as written
  (its checks on every call) with the same result."""
  kv_lens = np.array([20, 9, 3], np.int32)
  q_lens = np.array([12, 1, 3], np.int32)
  indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  results = []
  for step in range(2):
    p, _ = _case(rng, kv_lens)
    q = rng.standard_normal((18, 6, 64)).astype(np.float32)
    args = (jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table),
            jnp.asarray(indptr), jnp.asarray(kv_lens))
    out, lse = pkvattn.paged_prefill(*args, return_lse=True, impl=impl)
    assert traces[0] == 1
    for b in range(len(kv_lens)):
      lo, hi = indptr[b], indptr[b + 1]
      pos = kv_lens[b] - (hi - lo) + np.arange(hi - lo)
      exp, exp_lse = dense_attention(q[lo:hi], p.k[b], p.v[b], pos,
                                     kv_lens[b], sm_scale=1 / 8)
      assert_close(out[lo:hi], exp, jnp.float32, f"step {step}, b={b}")
      assert_lse_close(lse[lo:hi], exp_lse, jnp.float32)
    np.testing.assert_array_equal(np.asarray(out[indptr[-1]:]), 0.0)
    results.append((args, out))
  args, out = results[-1]
  plan = pkvattn.plan_prefill(args[3], args[4], num_tokens=18, num_qo_heads=6,
                              num_kv_heads=2, head_dim=64, dtype=jnp.float32)
  for _ in range(2):
    planned = pkvattn.paged_prefill(*args, plan=plan, impl=impl)
  assert traces[0] == 2
  np.testing.assert_array_equal(np.asarray(planned), np.asarray(out))
  for _ in range(2):
    listed = pkvattn.paged_prefill(*args[:3], indptr.tolist(), args[4],
                                   impl=impl)
  assert traces[0] == 4
  np.testing.assert_array_equal(np.asarray(listed), np.asarray(out))


def test_eager_errors_name_the_argument(traces, rng):
  """A bad argument raises the op's ValueError while the call's program is
  traced, on every call (a failed trace is not cached)."""
  p, q = _case(rng, [9, 17, 1])
  args = (jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table))
  for _ in range(2):
    with pytest.raises(ValueError, match=r"Invalid shape of kv_lens: "
                       r"expected \(3,\), got \(2,\)"):
      pkvattn.paged_decode(*args, jnp.array([9, 17]), impl="xla")
    with pytest.raises(ValueError, match="Invalid window_left"):
      pkvattn.paged_decode(*args, jnp.asarray(p.kv_lens), window_left=-2,
                           impl="xla")
  assert traces[0] == 4
