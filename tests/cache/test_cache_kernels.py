"""The cache state with real KV pools: copy_pages, fork copy-on-write, NaN safety."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pkvattn
from pkvattn import cache

PS = 8
HEAD_DIM = 64
NUM_KV_HEADS = 1
NUM_QO_HEADS = 2
CFG = cache.CacheConfig(num_slots=8, page_size=PS, num_layers=2, max_seqs=4,
                        max_pages=4)


def _formats(pool):
  """The split pool in all three kv_cache formats (same numbering)."""
  n2 = pool.shape[0]
  return dict(
      pool=pool,
      pair=(pool[0::2], pool[1::2]),
      flashinfer=pool.reshape(n2 // 2, 2, *pool.shape[1:]),
  )


def _as_pool(kv, fmt):
  if fmt == "pool":
    return kv
  if fmt == "pair":
    k, v = kv
    return jnp.stack([k, v], axis=1).reshape(-1, *k.shape[1:])
  return kv.reshape(-1, *kv.shape[2:])


@pytest.mark.parametrize("fmt", ["pool", "pair", "flashinfer"])
def test_copy_pages_all_formats(fmt):
  pool = jax.random.normal(jax.random.key(0), (12, PS, NUM_KV_HEADS, HEAD_DIM))
  src = jnp.array([3, 4, -1, 10, 5], jnp.int32)
  dst = jnp.array([7, 8, 2, -1, 1], jnp.int32)
  expected = np.array(pool)
  for s, d in zip(src.tolist(), dst.tolist()):
    if s >= 0 and d >= 0:
      expected[d] = np.asarray(pool)[s]
  kv = _formats(pool)[fmt]
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), kv)
  fn = jax.jit(pkvattn.copy_pages, donate_argnums=0)
  # Donated: the compiled update aliases the cache buffer(s) in place.
  hlo = fn.lower(kv, src, dst).as_text()
  assert hlo.count("tf.aliasing_output") == len(jax.tree.leaves(kv)), hlo[:2000]
  actual = fn(kv, src, dst)
  if fmt == "pair":
    assert isinstance(actual, tuple) and len(actual) == 2
  chex.assert_trees_all_equal_shapes_and_dtypes(
      actual, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like))
  np.testing.assert_array_equal(_as_pool(actual, fmt), expected)


def test_copy_pages_errors():
  pool = jnp.zeros((4, PS, 1, HEAD_DIM))
  with pytest.raises(ValueError, match="dst_pages"):
    pkvattn.copy_pages(pool, jnp.array([0, 1]), jnp.array([2]))
  with pytest.raises(ValueError, match="src_pages"):
    pkvattn.copy_pages(pool, jnp.array([0.0]), jnp.array([2]))


@pytest.mark.parametrize("fmt", ["pool", "pair", "flashinfer"])
def test_copy_pages_crosses_k_v_and_the_pool_ends(fmt, rng):
  """A numpy gather-then-scatter in split numbering (the docstring): K->V and
  V->K copies, the first and last pages swapped (all reads before all
  writes), padding. Every page that is no valid source is NaN-poisoned: a
  stray read puts NaN into a destination, a stray write replaces a NaN. The
  pool has more shared pages than page_size or head_dim."""
  n = 12
  last = 2 * n - 1
  a, b, c, d, e, f, g, h, x, y = rng.permutation(np.arange(1, n - 1))
  pairs = [(0, last), (last, 0),  # K->V and V->K, a swap of the pool's ends
           (2 * a, 2 * b + 1), (2 * c + 1, 2 * d),  # K->V, V->K
           (2 * e, 2 * f), (2 * g + 1, 2 * h + 1),  # K->K, V->V
           (-1, 2 * x), (2 * y + 1, -1), (-1, -1)]  # padding: skipped
  src, dst = np.array(pairs, np.int32)[rng.permutation(len(pairs))].T
  ok = (src >= 0) & (dst >= 0)
  pool = rng.standard_normal((2 * n, 4, 2, 3)).astype(np.float32)
  pool[[p for p in range(2 * n) if p not in src[ok]]] = np.nan
  expected = pool.copy()
  expected[dst[ok]] = pool[src[ok]]
  assert np.isfinite(expected[dst[ok]]).all()
  kv = _formats(jnp.asarray(pool))[fmt]
  actual = pkvattn.copy_pages(kv, jnp.asarray(src), jnp.asarray(dst))
  np.testing.assert_array_equal(_as_pool(actual, fmt), expected)


@pytest.mark.parametrize("fmt", ["pool", "pair"])
def test_fork_copy_on_write(fmt):
  st = cache.init_cache(CFG)
  tokens = jnp.zeros((1, 32), jnp.int32)
  st, _ = cache.claim_batch(st, jnp.array([0]), tokens, jnp.array([13]))
  pool = jax.random.normal(jax.random.key(1), (CFG.num_pool_pages, PS,
                                               NUM_KV_HEADS, HEAD_DIM))
  st, res = cache.fork(st, jnp.array([0, 0, -1]), jnp.array([1, 2, 3]))
  cache.validate(st)
  np.testing.assert_array_equal(res.ok, [True, True, False])
  chex.assert_shape(res.src_pages, (3 * CFG.num_layers * 2,))
  kv = pkvattn.copy_pages(_formats(pool)[fmt], res.src_pages, res.dst_pages)
  out = np.asarray(_as_pool(kv, fmt))
  for layer in range(CFG.num_layers):
    table = np.asarray(cache.page_table(st, jnp.array([0, 1, 2]), layer))
    # Full block 0 shared; partial block 1 copied into distinct pages.
    assert (table[:, :, 0] == table[0, :, 0]).all()
    assert len({tuple(t) for t in table[:, :, 1].tolist()}) == 3
    for child in (1, 2):
      for kv_row in (0, 1):
        np.testing.assert_array_equal(out[table[child, kv_row, 1]],
                                      out[table[0, kv_row, 1]])
  # Untouched pages keep their values.
  touched = set(np.asarray(res.dst_pages).tolist()) - {-1}
  keep = [p for p in range(CFG.num_pool_pages) if p not in touched]
  np.testing.assert_array_equal(out[keep], np.asarray(pool)[keep])


def _write_kv(pool, table, k, v, start):
  """Writes tokens `start..start+len-1` into the split pool through `table`."""
  pool = np.array(pool)
  for t in range(k.shape[0]):
    p = start + t
    pool[table[0, p // PS], p % PS] = k[t]
    pool[table[1, p // PS], p % PS] = v[t]
  return jnp.asarray(pool)


def _dense_causal(q, k, v):
  """f64 causal attention of all tokens, GQA: q head h reads kv head h // g."""
  g = NUM_QO_HEADS // NUM_KV_HEADS
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  k = np.repeat(k, g, axis=1)
  v = np.repeat(v, g, axis=1)
  s = np.einsum("thd,shd->hts", q, k) / np.sqrt(HEAD_DIM)
  n = q.shape[0]
  s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hts,shd->thd", p, v)


@pytest.mark.parametrize("fmt", ["pool", "pair", "flashinfer"])
def test_released_nan_pages_never_reach_new_owner(fmt):
  rng = np.random.default_rng(0)
  st = cache.init_cache(CFG)
  shape = (CFG.num_pool_pages, PS, NUM_KV_HEADS, HEAD_DIM)
  pool = jnp.zeros(shape, jnp.float32)
  # Sequence 0 fills 3 blocks, then is released (not committed): its slots
  # go back to the free list.
  st, res = cache.claim_batch(st, jnp.array([0]), jnp.zeros((1, 32), jnp.int32),
                              jnp.array([20]))
  old_slots = set(np.asarray(st.seq_slots[0])[:3].tolist())
  for layer in range(CFG.num_layers):
    table = np.asarray(cache.page_table(st, jnp.array([0]), layer))[0]
    kv = rng.normal(size=(2, 20, NUM_KV_HEADS, HEAD_DIM))
    pool = _write_kv(pool, table, kv[0], kv[1], 0)
  st = cache.release(st, jnp.array([0]))
  # Every page of a slot nobody holds is garbage: poison it with NaN.
  free = np.asarray(st.slot_refcount) == 0
  page_free = np.repeat(free, CFG.num_layers * 2)
  pool = jnp.where(page_free[:, None, None, None], jnp.nan, pool)

  # Sequence 1 takes the released slots and writes 13 tokens: the tail of its
  # last page (3 positions) and every other page stay NaN.
  n = 13
  st, res = cache.claim_batch(st, jnp.array([1]), jnp.ones((1, 32), jnp.int32),
                              jnp.array([n]))
  new_slots = set(np.asarray(st.seq_slots[1])[:2].tolist())
  assert new_slots <= old_slots
  cache.validate(st)
  for layer in range(CFG.num_layers):
    split = cache.page_table(st, jnp.array([1]), layer)
    q = rng.normal(size=(n, NUM_QO_HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.normal(size=(n, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.normal(size=(n, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    pool = _write_kv(pool, np.asarray(split)[0], k, v, 0)
    kv_cache = _formats(pool)[fmt]
    table = split if fmt == "pool" else cache.page_table(
        st, jnp.array([1]), layer, split=False)
    actual = pkvattn.paged_prefill(
        jnp.asarray(q), kv_cache, table, jnp.array([0, n], jnp.int32),
        jnp.array([n], jnp.int32), impl="xla")
    chex.assert_shape(actual, (n, NUM_QO_HEADS, HEAD_DIM))
    assert np.isfinite(np.asarray(actual)).all()
    np.testing.assert_allclose(actual, _dense_causal(q, k, v), atol=1e-5,
                               rtol=1e-5)
