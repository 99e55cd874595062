"""Per-layer page tables into the multi-layer KV pool.

Index conventions (see `cache/state.py`), for block `i` of a sequence held in
slot `s`, in layer `layer` of a `num_layers`-layer model:
  split (TensorRT-LLM, one pool `[num_slots * num_layers * 2, page_size,
  num_kv_heads, head_dim]`): K at page `(s * num_layers + layer) * 2`, V at
  that `+ 1`.
  shared (vLLM / FlashInfer): one index `s * num_layers + layer` into a pair
  `(k_pages, v_pages)`, each `[num_slots * num_layers, page_size,
  num_kv_heads, head_dim]`, or into FlashInfer's
  `[num_slots * num_layers, 2, page_size, num_kv_heads, head_dim]` (which is
  the split pool after a free reshape: shared index `q` is split pages `2q`,
  `2q + 1`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks

from .state import NULL_PAGE, CacheState


def page_table(
    state: CacheState,
    seq_ids: jax.Array,  # i32[n]
    layer,               # int or i32[] (may be traced, e.g. inside lax.scan)
    split: bool = True,
) -> jax.Array:          # i32[n, 2, max_pages] | i32[n, max_pages]
  """The page table of `seq_ids` for one layer, as the kernels read it.

  Args:
    state: the cache state.
    seq_ids: `i32[n]`; rows for -1, out-of-range or dead ids are all -1.
    layer: layer index in `[0, num_layers)`; a Python int is range-checked, a
      traced one is not (an out-of-range layer gives wrong pages).
    split: static. True: `i32[n, 2, max_pages]`, row 0 the K pages, row 1 the V
      pages of the single multi-layer pool. False: shared `i32[n, max_pages]`
      indices `slot * num_layers + layer` (module docstring).

  Returns:
    The table, `NULL_PAGE = -1` wherever the sequence has no block (past
    `cdiv(seq_lens, page_size)`).

  Raises:
    ValueError: `seq_ids` not an integer vector, or a concrete `layer` out of
      range.

  Example:
    >>> from pkvattn import cache
    >>> cfg = cache.CacheConfig(num_slots=8, page_size=4, num_layers=2,
    ...                         max_seqs=2, max_pages=4)
    >>> st = cache.init_cache(cfg)
    >>> st, res = cache.claim_batch(st, jnp.array([0]), jnp.zeros((1, 6), int),
    ...                             jnp.array([6]))
    >>> cache.page_table(st, jnp.array([0]), 1).tolist()
    [[[2, 6, -1, -1], [3, 7, -1, -1]]]
  """
  cfg = state.config
  _checks.check_int(seq_ids, "seq_ids")
  _checks.check_ndim(seq_ids, (1,), "seq_ids")
  if isinstance(layer, (int, np.integer)) and not 0 <= layer < cfg.num_layers:
    raise ValueError(
        f"Invalid layer: expected 0 <= layer < {cfg.num_layers}, got {layer}")
  return _page_table(state, seq_ids, jnp.asarray(layer, jnp.int32), split)


@functools.partial(jax.jit, static_argnames=("split",))
def _page_table(state: CacheState, seq_ids, layer, split):
  cfg = state.config
  seq_ids = seq_ids.astype(jnp.int32)
  ok = (seq_ids >= 0) & (seq_ids < cfg.max_seqs)
  idx = jnp.where(ok, seq_ids, 0)
  ok &= state.seq_live[idx]
  slots = jnp.where(ok[:, None], state.seq_slots[idx], NULL_PAGE)
  has = slots >= 0
  shared = slots * cfg.num_layers + layer
  if not split:
    return jnp.where(has, shared, NULL_PAGE)
  k = jnp.where(has, 2 * shared, NULL_PAGE)
  v = jnp.where(has, 2 * shared + 1, NULL_PAGE)
  return jnp.stack([k, v], axis=1)
