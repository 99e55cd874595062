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
Both are PER_LAYER page-index modes (TensorRT-LLM `PageIndexMode`): the layer is
already in the index. `PageIndexMode.SHARED` gives the slot index `s` only, for
callers that offset per layer themselves (e.g. a per-layer strided view
`pool.reshape(num_slots, num_layers, 2, ...)[:, layer]`).

SWA scratch (`cache/alloc.py`). While a sequence's step has scratch
blocks (`seq_scratch_count > 0`), its blocks `b` in `[seq_scratch_first,
seq_scratch_first + seq_scratch_count)` map, for layer `l`, to sub-page `(i % L
+ l) % L` of scratch slot `seq_scratch_slots[i // L]` (`i = b -
seq_scratch_first`, `L = num_layers`; `window.scratch_page_indices`), i.e. to
the page of model layer `(i % L + l) % L` in that slot. Layers must run one
after the other within the step (layer `l + 1` overwrites sub-pages that
layer `l` used; `window.scratch_subpage` explains why that is safe). A SHARED
slot index cannot express sub-pages, so SHARED is refused for a config whose
scratch is active (`config.swa_scratch_active`): statically, because whether a
given sequence has scratch is data-dependent and a SHARED caller could not
handle it anyway.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks
from . import _contract

from .state import NULL_PAGE, CacheState
from .window import PageIndexMode, check_page_index_mode, scratch_page_indices


def page_table(
    state: CacheState,
    seq_ids: jax.Array,  # i32[n]
    layer,               # int or i32[] (may be traced, e.g. inside lax.scan)
    split: bool = True,
    mode: PageIndexMode | str = PageIndexMode.PER_LAYER,
    *,
    check: bool | None = None,
) -> jax.Array:          # i32[n, 2, max_pages] | i32[n, max_pages]
  """The page table of `seq_ids` for one layer, as the kernels read it.

  Args:
    state: the cache state.
    seq_ids: `i32[n]` (array or list); rows for -1, out-of-range or dead ids
      are all -1.
    layer: layer index in `[0, num_layers)`; a Python int is range-checked at
      trace time, an array (e.g. traced) in checked mode only (unchecked, an
      out-of-range layer gives other layers' pages).
    split: static. True: `i32[n, 2, max_pages]`, row 0 the K pages, row 1 the V
      pages of the single multi-layer pool. False: shared `i32[n, max_pages]`
      indices `slot * num_layers + layer` (module docstring). Ignored by SHARED.
    mode: static `PageIndexMode` (or `"per_layer"` / `"shared"`). PER_LAYER
      (default): the indices above; blocks of a running step's scratch range
      point at scratch sub-pages (module docstring). SHARED: `i32[n,
      max_pages]` slot ids (`layer` unused, still range-checked).
    check: checked mode for this call (`pkvattn.checked`; None follows it):
      an array `layer` in `[0, num_layers)`. Staged in a checkified jit, a
      call whose `layer` is out of range returns an all -1 table.

  Returns:
    The table, `NULL_PAGE = -1` wherever the sequence has no block (past
    `cdiv(seq_lens, page_size)`, and scratch blocks of finished steps).

  Raises:
    ValueError: `seq_ids` not an integer vector, a Python int `layer` out of
      range, an unknown `mode`, or SHARED while the config's scratch reuse is
      active (`config.swa_scratch_active`: scratch needs PER_LAYER).
    checkify.JaxRuntimeError: (a ValueError) checked mode, an array `layer`
      out of range.

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
  seq_ids = _checks.as_index_array(seq_ids)
  _checks.check_int(seq_ids, "seq_ids")
  _checks.check_ndim(seq_ids, (1,), "seq_ids")
  if isinstance(layer, (int, np.integer)) and not 0 <= layer < cfg.num_layers:
    raise ValueError(
        f"Invalid layer: expected 0 <= layer < {cfg.num_layers}, got {layer}")
  mode = check_page_index_mode(mode, cfg.swa_scratch_active)
  ok = run_layer_contract(layer, cfg.num_layers, check)
  with _contract.unchecked():
    return guard_table(ok, lambda: _page_table(
        state, seq_ids, jnp.asarray(layer, jnp.int32), split=bool(split),
        shared_mode=mode is PageIndexMode.SHARED))


def _layer_contract(layer, *, num_layers: int):
  """`page_table`'s clause: `0 <= layer < num_layers`."""
  layer = jnp.asarray(layer).astype(jnp.int32)
  _contract.require((layer >= 0) & (layer < num_layers),
                    f"Invalid layer: layer = {{}}, expected in [0, "
                    f"num_layers={num_layers})", layer)


def run_layer_contract(layer, num_layers: int, check: bool | None):
  """Checked mode's clause on an array `layer` (a Python int is checked at
  trace time): `_contract.run`'s result, None when nothing is staged."""
  if isinstance(layer, (int, np.integer)) or not _contract.enabled(check):
    return None
  return _contract.run(_layer_contract, layer, num_layers=int(num_layers))


def guard_table(ok, body):
  """`body()` (a page table) where the staged layer clause holds, else an
  all `NULL_PAGE` table of its shape (`_contract.guard`)."""
  if ok is None:
    return body()
  return _contract.guard(ok, body, lambda: jnp.full(
      jax.eval_shape(body).shape, NULL_PAGE, jnp.int32))


@functools.partial(jax.jit, static_argnames=("split", "shared_mode"))
def _page_table(state: CacheState, seq_ids, layer, split, shared_mode):
  cfg = state.config
  seq_ids = seq_ids.astype(jnp.int32)
  ok = (seq_ids >= 0) & (seq_ids < cfg.max_seqs)
  idx = jnp.where(ok, seq_ids, 0)
  ok &= state.seq_live[idx]
  slots = jnp.where(ok[:, None], state.seq_slots[idx], NULL_PAGE)
  has = slots >= 0
  if shared_mode:
    return slots
  shared = slots * cfg.num_layers + layer
  k = jnp.where(has, 2 * shared, NULL_PAGE)
  if cfg.swa_scratch_active:
    # Scratch range of the running step: sub-pages of the scratch slots.
    first = state.seq_scratch_first[idx]
    count = jnp.where(ok, state.seq_scratch_count[idx], 0)
    scratch_k = scratch_page_indices(
        state.seq_scratch_slots[idx], count, layer,
        num_layers=cfg.num_layers, max_scratch_blocks=cfg.max_pages)[:, 0]
    i = jnp.arange(cfg.max_pages, dtype=jnp.int32)[None, :] - first[:, None]
    in_scratch = (i >= 0) & (i < count[:, None])
    k = jnp.where(in_scratch, jnp.take_along_axis(
        scratch_k, jnp.clip(i, 0, cfg.max_pages - 1), axis=1), k)
  if not split:
    return jnp.where(k >= 0, k // 2, NULL_PAGE)
  v = jnp.where(k >= 0, k + 1, NULL_PAGE)
  return jnp.stack([k, v], axis=1)
