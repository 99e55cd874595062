"""Copy-on-write page copies inside a KV cache, for any of the three formats."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pkvattn import _checks
from pkvattn import _kv


def copy_pages(
    kv_cache,               # (k_pages, v_pages) | pool | flashinfer cache
    src_pages: jax.Array,   # i32[num_copies]
    dst_pages: jax.Array,   # i32[num_copies]
):
  """Copies pool pages `src_pages[i] -> dst_pages[i]` (fork's copy-on-write).

  Indices use the **split** numbering of `pkvattn.cache.page_table(...,
  split=True)` and of `cache.fork`: page `p` is K when `p` is even and V when
  odd, of shared page `p // 2`. Per format:
    pool `[num_pages, page_size, num_kv_heads, head_dim]`: page `p` itself.
    pair `(k_pages, v_pages)`, each `[num_pages, ...]`: `k_pages[p // 2]` for
      even `p`, `v_pages[p // 2]` for odd `p`.
    flashinfer `[num_pages, 2, page_size, num_kv_heads, head_dim]`: entry
      `[p // 2, p % 2]` (the pool view after a free reshape).
  Entries with `src_pages[i] < 0` or `dst_pages[i] < 0` are skipped (padding).
  All reads happen before all writes; destinations must be distinct.

  The update is an `.at[].set` scatter: under `jax.jit(..., donate_argnums=0)`
  XLA performs it in place, with no copy of the pool.

  Args:
    kv_cache: one of the three formats above (see `pkvattn.paged_decode`).
    src_pages: `i32[num_copies]` (array or list), split-numbered source
      pages, -1 = skip.
    dst_pages: `i32[num_copies]` (array or list), split-numbered destination
      pages, -1 = skip.

  Returns:
    The updated cache, in the format and dtype of `kv_cache`.

  Raises:
    ValueError: an unknown kv_cache format, non-integer or mismatched index
      vectors.

  Example:
    >>> pool = jnp.zeros((8, 16, 1, 64)).at[2].set(1.0)
    >>> out = copy_pages(pool, jnp.array([2, -1]), jnp.array([5, 7]))
    >>> float(out[5].mean()), float(out[7].mean())
    (1.0, 0.0)
  """
  fmt = _kv.detect_format(kv_cache)
  src_pages = _checks.as_index_array(src_pages)
  dst_pages = _checks.as_index_array(dst_pages)
  _checks.check_int(src_pages, "src_pages")
  _checks.check_ndim(src_pages, (1,), "src_pages")
  _checks.check_int(dst_pages, "dst_pages")
  _checks.check_shape(dst_pages, src_pages.shape, "dst_pages")
  src = src_pages.astype(jnp.int32)
  dst = dst_pages.astype(jnp.int32)
  ok = (src >= 0) & (dst >= 0)
  if fmt == "pair":
    k_pages, v_pages = kv_cache
    _checks.check_ndim(k_pages, (4,), "k_pages")
    _checks.check_shape(v_pages, k_pages.shape, "v_pages")
    n = k_pages.shape[0]
    out = []
    for kv, pages in ((0, k_pages), (1, v_pages)):
      sel = ok & (dst % 2 == kv) & (src % 2 == kv)
      # A K->V (or V->K) copy crosses arrays; split numbering allows it.
      other = v_pages if kv == 0 else k_pages
      cross = ok & (dst % 2 == kv) & (src % 2 != kv)
      s = jnp.clip(src // 2, 0, n - 1)
      value = jnp.where((cross)[:, None, None, None], other[s], pages[s])
      idx = jnp.where(sel | cross, dst // 2, n)
      out.append(pages.at[idx].set(value, mode="drop"))
    return tuple(out) if isinstance(kv_cache, tuple) else list(out)
  if fmt == "pool":
    pool = kv_cache
    n = pool.shape[0]
    value = pool[jnp.clip(src, 0, n - 1)]
    return pool.at[jnp.where(ok, dst, n)].set(value, mode="drop")
  n, two, ps, h, d = kv_cache.shape
  pool = kv_cache.reshape(n * two, ps, h, d)
  value = pool[jnp.clip(src, 0, 2 * n - 1)]
  pool = pool.at[jnp.where(ok, dst, 2 * n)].set(value, mode="drop")
  return pool.reshape(n, two, ps, h, d)
