"""Released sliding-window blocks never reach an attention output.

A Gemma-3-like per-window-group cache (five 16-token-window layers per global
layer) is driven through claims with a shared prefix, commits, decode
extends (the sliding group releases its old blocks), a release and a claim
that reuses the prefix past the window. Then every pool page that no layer's
table references is NaN, the referenced ones random, and `paged_decode` /
`paged_prefill` of every layer must equal the float64 oracle over the
positions its window sees: a -1 entry (a released or never-held block) lies
wholly before every query's window, so nothing NaN is ever read.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from attention_utils import assert_close, dense_attention
from pkvattn import cache, paged_decode, paged_prefill

PS, HKV, HQ, D = 8, 1, 2, 64
W = 15
WINDOWS = (W,) * 5 + (-1,)


def _drive(rng):
  cfg = cache.HybridCacheConfig(WINDOWS, group_num_slots=(48, 24),
                                page_size=PS, max_seqs=4, max_pages=16)
  st = cache.init_cache(cfg)
  prefix = rng.integers(1, 500, 44).tolist()
  prompts = [prefix + rng.integers(1, 500, int(n)).tolist() for n in (9, 3)]
  width = 128
  pad = lambda ps: np.array([p + [0] * (width - len(p)) for p in ps], np.int32)
  st, res = cache.claim_batch(st, [0, 1], pad(prompts), [len(p) for p in prompts])
  assert res.ok.all()
  st = cache.commit(st, [0, 1], pad(prompts), [len(p) for p in prompts])
  for _ in range(11):  # decode: the sliding group releases old blocks
    st, res = cache.extend(st, [0, 1], [1, 1])
    assert res.ok.all()
  st = cache.release(st, [1])
  third = prefix + rng.integers(1, 500, 21).tolist()
  st, res = cache.claim_batch(st, [2], pad([third]), [len(third)])
  assert res.ok.all() and int(res.num_reused_tokens[0]) == 40
  st, res = cache.extend(st, [2], [2])
  cache.validate(st)
  return cfg, st, np.array([0, 2])


def test_released_blocks_never_reach_an_output():
  rng = np.random.default_rng(0)
  cfg, st, seqs = _drive(rng)
  tables = np.asarray(cache.layer_page_tables(st, seqs))  # [L, n, 2, pages]
  lens = np.asarray(st.seq_lens)[seqs]
  pool = np.full((cfg.num_pool_pages, PS, HKV, D), np.nan, np.float32)
  used = np.unique(tables[tables >= 0])
  pool[used] = rng.standard_normal((len(used), PS, HKV, D))
  # The sliding layers hold fewer blocks than the global one: some -1s.
  assert (tables[0] < 0).sum() > (tables[5] < 0).sum()
  q_lens = np.array([1, 3])
  q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  for layer, w in enumerate(WINDOWS):
    table = tables[layer]
    q = rng.standard_normal((int(q_indptr[-1]), HQ, D)).astype(np.float32)
    dec = paged_decode(jnp.asarray(q[q_indptr[1:] - 1]), jnp.asarray(pool),
                       table, lens, window_left=w, impl="xla")
    pre = paged_prefill(jnp.asarray(q), jnp.asarray(pool), table, q_indptr,
                        lens, window_left=w, impl="xla")
    for b, n in enumerate(lens):
      positions = np.arange(n - q_lens[b], n)
      first_visible = positions[0] - w if w >= 0 else 0
      blocks = -(-n // PS)
      held = table[b, 0, :blocks] >= 0
      # Every block without a page lies wholly before the first query's
      # window.
      assert all((i + 1) * PS <= first_visible for i in np.nonzero(~held)[0])
      k = np.zeros((blocks * PS, HKV, D))
      v = np.zeros((blocks * PS, HKV, D))
      for i in np.nonzero(held)[0]:
        k[i * PS:(i + 1) * PS] = pool[table[b, 0, i]]
        v[i * PS:(i + 1) * PS] = pool[table[b, 1, i]]
      rows = slice(q_indptr[b], q_indptr[b + 1])
      want, _ = dense_attention(q[rows], k, v, positions, n, window_left=w,
                                sm_scale=D ** -0.5)
      assert_close(pre[rows], want, jnp.float32, f"prefill layer {layer}")
      assert_close(dec[b], want[-1], jnp.float32, f"decode layer {layer}")


if __name__ == "__main__":
  pytest.main([__file__])
