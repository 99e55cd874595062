"""Public ops at the edges of their input space: Python lists for index
arrays, empty batches, and `SamplingParams` validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pkvattn
from pkvattn.sampling import SamplingParams

H, KV, D, PS = 2, 1, 64, 8
IMPLS = ["xla", "pallas"]


def _pool(num_pages=4, seed=0):
  rng = np.random.default_rng(seed)
  k, v = rng.standard_normal((2, num_pages, PS, KV, D)).astype(np.float32)
  return jnp.asarray(k), jnp.asarray(v)


def test_index_arguments_accept_lists(rng):
  kv = _pool()
  q = jnp.asarray(rng.standard_normal((2, H, D)), jnp.float32)
  table, lens, indptr = [[0, 1], [3, -1]], [9, 5], [0, 1, 2]

  def same(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)

  same(pkvattn.paged_decode(q, kv, table, lens, impl="xla"),
       pkvattn.paged_decode(q, kv, jnp.array(table), jnp.array(lens),
                            impl="xla"))
  same(pkvattn.paged_prefill(q, kv, table, indptr, lens, impl="xla"),
       pkvattn.paged_prefill(q, kv, jnp.array(table), jnp.array(indptr),
                             jnp.array(lens), impl="xla"))
  k = jnp.asarray(rng.standard_normal((2, KV, D)), jnp.float32)
  bidx, pos = [0, -1], [8, 0]
  same(pkvattn.append_paged_kv(k, k, bidx, pos, kv, table, impl="xla"),
       pkvattn.append_paged_kv(k, k, jnp.array(bidx), jnp.array(pos), kv,
                               jnp.array(table), impl="xla"))
  rope = pkvattn.RopeConfig()
  same(pkvattn.apply_rope_and_append(q, k, k, bidx, pos, kv, table, rope,
                                     impl="xla"),
       pkvattn.apply_rope_and_append(q, k, k, jnp.array(bidx), jnp.array(pos),
                                     kv, jnp.array(table), rope, impl="xla"))
  same(pkvattn.apply_rope(q, k, pos, rope),
       pkvattn.apply_rope(q, k, jnp.array(pos), rope))
  same(pkvattn.get_batch_indices_positions(indptr, lens, 3),
       pkvattn.get_batch_indices_positions(jnp.array(indptr), jnp.array(lens),
                                           3))
  same(pkvattn.copy_pages(kv, [0], [3]),
       pkvattn.copy_pages(kv, jnp.array([0]), jnp.array([3])))
  plan = pkvattn.plan_prefill(indptr, lens, num_tokens=2, num_qo_heads=H,
                              num_kv_heads=KV, head_dim=D)
  assert plan.batch_size == 2
  with pytest.raises(ValueError, match="Invalid dtype of kv_lens"):
    pkvattn.paged_decode(q, kv, table, [9.0, 5.0], impl="xla")


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batches_give_empty_or_padding_outputs(impl, rng):
  kv = _pool()
  no_rows = jnp.zeros((0, 2), jnp.int32)
  # Decode of no sequences.
  out, lse = pkvattn.paged_decode(jnp.zeros((0, H, D)), kv, no_rows, [],
                                  return_lse=True, impl=impl)
  assert out.shape == (0, H, D) and lse.shape == (0, H)
  # Prefill of no sequences: every token is padding (zeros, lse -inf).
  q = jnp.asarray(rng.standard_normal((4, H, D)), jnp.float32)
  for causal in (True, False):
    out, lse = pkvattn.paged_prefill(q, kv, no_rows, [0], [], causal=causal,
                                     return_lse=True, impl=impl)
    assert out.shape == (4, H, D) and lse.shape == (4, H)
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()
  # Prefill of no tokens.
  out, lse = pkvattn.paged_prefill(jnp.zeros((0, H, D)), kv, [[0, 1]], [0, 0],
                                   [9], return_lse=True, impl=impl)
  assert out.shape == (0, H, D) and lse.shape == (0, H)
  # Appends of no tokens, or of padding only: the cache comes back as is.
  empty = jnp.zeros((0, KV, D))
  assert pkvattn.append_paged_kv(empty, empty, [], [], kv, [[0, 1]],
                                 impl=impl) is kv
  k = jnp.asarray(rng.standard_normal((2, KV, D)), jnp.float32)
  assert pkvattn.append_paged_kv(k, k, [-1, -1], [0, 3], kv, no_rows,
                                 impl=impl) is kv
  rope = pkvattn.RopeConfig()
  q2 = jnp.asarray(rng.standard_normal((2, H, D)), jnp.float32)
  rotated, same = pkvattn.apply_rope_and_append(q2, k, k, [-1, -1], [0, 3], kv,
                                                no_rows, rope, impl=impl)
  assert same is kv
  np.testing.assert_allclose(rotated, pkvattn.apply_rope(q2, k, [0, 3],
                                                         rope)[0], atol=1e-6)
  qkv = jnp.concatenate([q2.reshape(2, -1), k.reshape(2, -1),
                         k.reshape(2, -1)], axis=1)
  rotated, same = pkvattn.apply_rope_and_append_qkv(qkv, [-1, -1], [0, 3], kv,
                                                    no_rows, rope, impl=impl)
  assert same is kv
  np.testing.assert_allclose(rotated, pkvattn.apply_rope(q2, k, [0, 3],
                                                         rope)[0], atol=1e-6)
  b, p = pkvattn.get_batch_indices_positions([0], [], 3)
  assert b.tolist() == [-1, -1, -1] and p.tolist() == [0, 0, 0]


@pytest.mark.parametrize("field,value", [
    ("max_new_tokens", 2.5), ("max_new_tokens", 0), ("max_new_tokens", True),
    ("max_new_tokens", "8"), ("temperature", -0.1),
    ("temperature", float("nan")), ("temperature", "hot"), ("top_k", -1),
    ("top_k", 1.5), ("top_p", 0.0), ("top_p", 1.5), ("top_p", None),
    ("seed", 1.0), ("seed", None), ("stop_token_ids", (1, -2)),
    ("stop_token_ids", (1.0,)), ("stop_token_ids", 5),
    ("stop_token_ids", "12"), ("ignore_eos", "yes"),
    # One past the int32 / float32 range of the device programs.
    ("max_new_tokens", 2**31), ("top_k", 2**31), ("stop_token_ids", (2**31,)),
    ("temperature", 2 * float(np.finfo(np.float32).max)),
])
def test_sampling_params_reject_bad_fields(field, value):
  with pytest.raises(ValueError, match=f"Invalid {field}: expected"):
    SamplingParams(**{field: value})


def test_sampling_params_accept_valid_fields():
  p = SamplingParams(max_new_tokens=np.int64(3), temperature=0, top_k=5,
                     top_p=1, seed=-7, stop_token_ids=(2, np.int32(3)),
                     ignore_eos=True)
  assert p.max_new_tokens == 3 and p.top_p == 1
  SamplingParams(temperature=0.7, top_p=0.9, seed=2**40)
  # Each range's ends.
  SamplingParams(max_new_tokens=1, top_k=0, top_p=1.0)
  big = 2**31 - 1
  SamplingParams(max_new_tokens=big, top_k=big, stop_token_ids=(0, big),
                 temperature=float(np.finfo(np.float32).max))
