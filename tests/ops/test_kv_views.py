"""`pkvattn._kv` on its own: the view of the three cache formats, its
validation, `rebuild`, and the FP8 scale helpers.

The oracles are the formats as the module docstring states them (pair:
`(k_pages, v_pages)` and a shared table; pool: one 4-D pool and a split
table, row 0 = K page, row 1 = V page; flashinfer: `[num_pages, 2, ...]`,
K at `[t, 0]` and V at `[t, 1]`), read from the caller's cache with numpy.
Inputs are fresh random values; unowned pages are NaN, so a view that
reads another page shows it. No kernel runs.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from attention_utils import FORMATS, FP8, make_paged
from pkvattn import _kv

def _cache(rng, fmt, *, batch=3, max_pages=4, page_size=8, heads=2,
           head_dim=64, dtype=jnp.float32):
  """`attention_utils.make_paged` of whole pages: 1 to `max_pages` blocks
  a sequence, -1 in unused table entries, unowned pages NaN. Returns
  `(cache, table, k, v)` with `k[b][i]` / `v[b][i]` the K / V page of block
  `i` of sequence `b`."""
  used = rng.integers(1, max_pages + 1, batch)
  paged = make_paged(rng, used * page_size, page_size=page_size,
                     num_kv_heads=heads, head_dim=head_dim, dtype=dtype,
                     fmt=fmt, max_pages=max_pages, extra_pages=2)
  pages = lambda x: list(x.reshape(-1, page_size, heads, head_dim))  # noqa: E731
  return (paged.kv_cache, paged.page_table, [pages(x) for x in paged.k],
          [pages(x) for x in paged.v])


@pytest.mark.parametrize("fmt", FORMATS)
def test_view_reads_every_block_of_every_format(fmt, rng):
  """`k_pool[k_table[b, i]]` / `v_pool[v_table[b, i]]` is the K / V page
  of block `i` of sequence `b`; unused (-1) entries stay -1; the shape
  properties, `num_pages` (the caller's pages, not the reshaped pool's),
  `table_kind`, `same_pool` and `table` follow the format; and
  `decode_tables` reads the same pages (interleaved FlashInfer: `2 t` and
  `2 t + 1` of the pool)."""
  ps, heads, d = int(rng.choice([8, 16])), int(rng.integers(1, 4)), 64
  cache, table, k, v = _cache(rng, fmt, page_size=ps, heads=heads, head_dim=d)
  view = _kv.make_view(cache, jnp.asarray(table, jnp.int16))
  assert (view.page_size, view.num_kv_heads, view.head_dim) == (ps, heads, d)
  assert view.num_pages == len(cache[0] if fmt == "pair" else cache)
  assert view.table_kind == {"pair": "shared", "pool": "split",
                             "flashinfer": "flashinfer"}[fmt]
  assert view.same_pool == (fmt != "pair")
  assert view.table.dtype == jnp.int32
  np.testing.assert_array_equal(view.table, table)
  dk, dv, interleaved = view.decode_tables()
  assert interleaved == (fmt == "flashinfer")
  if interleaved:
    dk, dv = 2 * np.asarray(dk), 2 * np.asarray(dv) + 1
  pools = [np.asarray(view.k_pool), np.asarray(view.v_pool)]
  for kt, vt in ((view.k_table, view.v_table), (dk, dv)):
    kt, vt = np.asarray(kt), np.asarray(vt)
    for b in range(len(k)):
      n = len(k[b])
      np.testing.assert_array_equal(pools[0][kt[b, :n]], np.stack(k[b]))
      np.testing.assert_array_equal(pools[1][vt[b, :n]], np.stack(v[b]))
  unused = (table[:, 0] if fmt == "pool" else table) < 0
  for t in (view.k_table, view.v_table):
    assert t.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(t) == -1, unused)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rebuild_returns_the_callers_format(fmt, rng):
  """`rebuild(view, k_pool, v_pool)` gives back the cache in its format:
  unchanged pools give the cache itself, and a page written through the
  view's tables lands where the format keeps that block's K and V."""
  cache, table, k, v = _cache(rng, fmt)
  view = _kv.make_view(cache, jnp.asarray(table))
  same = _kv.rebuild(view, view.k_pool, view.v_pool)
  assert type(same) is type(cache) and len(same) == len(cache)
  for got, want in zip(same if fmt == "pair" else [same],
                       cache if fmt == "pair" else [cache]):
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
  b = int(rng.integers(len(k)))
  i = int(rng.integers(len(k[b])))
  new_k, new_v = rng.standard_normal((2,) + view.k_pool.shape[1:])
  kt, vt = int(view.k_table[b, i]), int(view.v_table[b, i])
  k_pool = view.k_pool.at[kt].set(new_k)
  v_pool = (k_pool if view.same_pool else view.v_pool).at[vt].set(new_v)
  out = _kv.rebuild(view, v_pool if view.same_pool else k_pool, v_pool)
  if fmt == "pair":
    got_k, got_v = out[0][table[b, i]], out[1][table[b, i]]
  elif fmt == "pool":
    got_k, got_v = out[table[b, 0, i]], out[table[b, 1, i]]
  else:
    got_k, got_v = out[table[b, i], 0], out[table[b, i], 1]
  np.testing.assert_array_equal(got_k, new_k.astype(np.float32))
  np.testing.assert_array_equal(got_v, new_v.astype(np.float32))


def _arr(shape, dtype=jnp.float32):
  return jnp.zeros(shape, dtype)


POOL = (4, 8, 2, 64)
BAD_CACHES = [  # (kv_cache, table shape, message)
    ((_arr(POOL),) * 3, (1, 2),
     r"expected a pair \(k_pages, v_pages\), got a sequence of length 3"),
    ([_arr(POOL)], (1, 2), r"got a sequence of length 1"),
    (_arr((4, 3, 8, 2, 64)), (1, 2), r"Invalid shape of kv_cache: expected "
     r"\[num_pages, 2, page_size, num_kv_heads, head_dim\], got "
     r"\(4, 3, 8, 2, 64\)"),
    (_arr((4, 1, 8, 2, 64)), (1, 2), r"got \(4, 1, 8, 2, 64\)"),
    (_arr((4, 8, 64)), (1, 2), r"got ArrayImpl with ndim=3"),
    (_arr((1, 4, 2, 8, 2, 64)), (1, 2), r"ndim=6"),
    (None, (1, 2), r"got NoneType with ndim=None"),
    (_arr(POOL), (1, 2), r"a single 4-D kv_cache pool needs a split table, "
     r"expected \(batch_size, 2, max_pages\), got \(1, 2\)"),
    (_arr(POOL), (1, 3), r"needs a split table.*got \(1, 3\)"),
    (_arr(POOL), (1, 3, 2), r"needs a split table.*got \(1, 3, 2\)"),
    (_arr(POOL), (1, 1, 2), r"needs a split table.*got \(1, 1, 2\)"),
    ((_arr(POOL),) * 2, (1, 2, 2), r"kv_cache format 'pair' needs a shared "
     r"table, expected \(batch_size, max_pages\), got \(1, 2, 2\)"),
    (_arr((4, 2, 8, 2, 64)), (1, 2, 2), r"format 'flashinfer' needs a shared"),
    ((_arr(POOL),) * 2, (2,), r"Invalid rank of page_table"),
    (_arr(POOL), (1, 2, 2, 2), r"Invalid rank of page_table"),
    ((_arr(POOL), _arr((4, 8, 1, 64))), (1, 2), r"Invalid shape of v_pages"),
    ((_arr(POOL), _arr(POOL, jnp.bfloat16)), (1, 2),
     r"Invalid dtype of v_pages: expected float32"),
    ((_arr(POOL, jnp.int8),) * 2, (1, 2), r"Invalid dtype of k_pages"),
    ((_arr((8, 2, 64)),) * 2, (1, 2), r"Invalid rank of k_pages"),
]


@pytest.mark.parametrize("cache, table_shape, msg", BAD_CACHES)
def test_make_view_refuses_what_fits_no_format(cache, table_shape, msg):
  """Each misfit the docstrings name raises ValueError with its message:
  a sequence not a pair, a 5-D cache without the 2, another rank, a pool
  without a split table, a pair or 5-D cache with one, a table of another
  rank, mismatched K/V pages."""
  with pytest.raises(ValueError, match=msg):
    _kv.make_view(cache, jnp.zeros(table_shape, jnp.int32))


def test_make_view_refuses_a_float_table():
  """A float table is refused (not truncated to page ids)."""
  with pytest.raises(ValueError, match="Invalid dtype of page_table"):
    _kv.make_view((_arr(POOL),) * 2, jnp.zeros((1, 2), jnp.float32))


def _as(fmt, shape, dtype=jnp.float32):
  """A zero cache of `fmt` whose pool pages have `shape`, with a table."""
  n, rest = shape[0], shape[1:]
  if fmt == "pair":
    return (_arr(shape, dtype),) * 2, jnp.zeros((1, 2), jnp.int32)
  if fmt == "pool":
    return _arr(shape, dtype), jnp.zeros((1, 2, 2), jnp.int32)
  return _arr((n, 2) + rest, dtype), jnp.zeros((1, 2), jnp.int32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_supported_sizes_and_dtypes_exactly(fmt):
  """Every supported page size, head dim and KV dtype makes a view (with
  that page size / head dim); the neighbours of each size are refused,
  naming the pool (`k_pages` for the pair, else `kv_cache`)."""
  name = "k_pages" if fmt == "pair" else "kv_cache"
  for ps in (8, 16, 32, 64, 128):
    assert _kv.make_view(*_as(fmt, (2, ps, 1, 64))).page_size == ps
    for bad in (ps - 1, ps + 1):
      with pytest.raises(ValueError, match=rf"Invalid page_size of {name}: "
                         rf"expected one of \(8, 16, 32, 64, 128\), got {bad}"):
        _kv.make_view(*_as(fmt, (2, bad, 1, 64)))
  for d in (64, 128, 256):
    assert _kv.make_view(*_as(fmt, (2, 8, 1, d))).head_dim == d
    for bad in (d - 1, d + 1):
      with pytest.raises(ValueError, match=rf"Invalid head_dim of {name}: "
                         rf"expected one of \(64, 128, 256\), got {bad}"):
        _kv.make_view(*_as(fmt, (2, 8, 1, bad)))
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32, FP8):
    assert _kv.make_view(*_as(fmt, (2, 8, 1, 64), dtype)).k_pool.dtype == dtype


def _fp8_pool():
  return jnp.zeros(POOL, FP8)


@pytest.mark.parametrize("scale", [
    lambda s: s, lambda s: np.float32(s), lambda s: np.array(s),
    lambda s: np.array([s], np.float32), lambda s: [s], lambda s: (s,),
    lambda s: jnp.float32(s), lambda s: jnp.array([s], jnp.float32)])
def test_check_scales_gives_one_f32_per_tensor(scale, rng):
  """A scale given as a number, a 0-d or 1-element array (host or jax) or a
  one-item list becomes `f32[]` holding its value, also with one KV head
  (a `(1,)` scale is then per tensor, not per head); a pool that is not
  FP8 takes no scales and gives `(None, None)`."""
  ks, vs = (float(np.float32(x)) for x in rng.uniform(0.01, 4.0, 2))
  for heads in (None, 1):
    got = _kv.check_scales(_fp8_pool(), scale(ks), scale(vs),
                           num_kv_heads=heads)
    assert [(g.shape, g.dtype) for g in got] == [((), jnp.float32)] * 2
    assert [float(g) for g in got] == [ks, vs]
    assert not _kv.is_per_head(got)
  assert _kv.check_scales(_arr(POOL), None, None) == (None, None)


def test_check_scales_per_head(rng):
  """With `num_kv_heads` > 1, a `(num_kv_heads,)` scale stays per head
  (`is_per_head`), next to a per-tensor one; `unit_head_scales` divides
  each head by its own scale."""
  heads = int(rng.integers(2, 5))
  per_head = rng.uniform(0.01, 4.0, heads).astype(np.float32)
  for ks, vs in ((per_head, 2.0), (1.5, jnp.asarray(per_head)),
                 (list(per_head), per_head)):
    got = _kv.check_scales(_fp8_pool(), ks, vs, num_kv_heads=heads)
    assert _kv.is_per_head(got)
    for g, s in zip(got, (ks, vs)):
      np.testing.assert_array_equal(g, np.asarray(s, np.float32))
  x = rng.standard_normal((5, heads, 64)).astype(np.float32)
  np.testing.assert_allclose(_kv.unit_head_scales(jnp.asarray(x), per_head),
                             x / per_head[:, None], rtol=1e-6)


@pytest.mark.parametrize("scale, heads, msg", [
    (np.ones((1, 1), np.float32), None,
     r"Invalid shape of k_scale: expected \(\) \(one scale per tensor\), "
     r"got \(1, 1\)$"),
    (np.ones(3, np.float32), 2, r"Invalid shape of k_scale: expected \(\) "
     r"\(one scale per tensor\) or \(2,\) \(one per KV head\), got \(3,\)$"),
    (np.ones(2, np.float32), 1, r"expected \(\) \(one scale per tensor\) or "
     r"\(1,\) \(one per KV head\), got \(2,\)$"),
    (np.array([0.5, 0.0], np.float32), 2, r"got \[0\.5, 0\.0\]$"),
    (-1.5, None, r"Invalid k_scale: expected a finite scale >= 1\.175e-38 "
     r"\(the smallest normal f32; stored value = x / scale\), got -1\.5$"),
    (-10**30, None, r"got -1000000000000000000000000000000$"),  # 32 chars
    (-10**31, None,  # 33 chars: shown as its f32 value
     rf"got {re.escape(str(float(np.float32(-1e31))))} \(as f32\)$"),
    (10**400, None, r"got inf \(as f32\)$"),
    (-10**400, None, r"got -inf \(as f32\)$"),
])
def test_check_scales_refusals_show_the_scale(scale, heads, msg):
  """A scale of another shape, or a bad host value, raises ValueError
  naming it; the value shows as the caller gave it (a numpy array as a
  list), or as its f32 value when its repr is over 32 characters."""
  with pytest.raises(ValueError, match=msg):
    _kv.check_scales(_fp8_pool(), scale, 1.0, num_kv_heads=heads)


def test_scale_contract_gets_only_jax_array_scales(rng):
  """`run_scale_contract` stages a check (`bool[]`) for scales given as
  jax arrays, and nothing (None) when both were host numbers (already
  checked by `check_scales`)."""
  seen = []

  def step(ks_array, vs_array):
    for ks, vs in ((2.0, 3), (np.float32(2.0), [3.0]), (ks_array, 3.0),
                   (2.0, vs_array)):
      scales = _kv.check_scales(_fp8_pool(), ks, vs)
      seen.append(_kv.run_scale_contract(scales, ks, vs))
    return ks_array

  checkify.checkify(jax.jit(step))(*jnp.asarray(rng.uniform(1, 2, 2),
                                                jnp.float32))
  assert seen[:2] == [None, None]
  assert [s.shape for s in seen[2:]] == [(), ()]
  assert all(s.dtype == jnp.bool_ for s in seen[2:])
