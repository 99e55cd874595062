"""Smoke check of the xla path and the shared oracle (the kernels' own tests go further)."""

import numpy as np
import jax.numpy as jnp
import pytest

import pkvattn
from attention_utils import FORMATS, assert_close, assert_lse_close, dense_attention, make_paged


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_xla_matches_oracle(fmt):
  rng = np.random.default_rng()
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
