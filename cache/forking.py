"""Sequences that share their parent's blocks: `fork` (beam search, n > 1).

Full blocks are shared by reference count; a partial last block is copied
into a new slot (copy-on-write), admitted all or nothing in batch order like
`extend` ("Admission" in `cache/alloc.py`, whose helpers this module shares;
`alloc` does not import it).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _checks
from . import _contract
from .alloc import _admit
from .alloc import _check_ids
from .alloc import _open_seqs
from .alloc import _require_live
from .alloc import _select
from .alloc import _take_slots
from .state import CacheState


class ForkResult(NamedTuple):
  ok: jax.Array         # bool[n], child created
  src_pages: jax.Array  # i32[n * num_layers * 2], pool pages to copy, -1 = none
  dst_pages: jax.Array  # i32[n * num_layers * 2], destinations, -1 = none


def fork(
    state: CacheState,
    parent_ids: jax.Array,  # i32[n]
    child_ids: jax.Array,   # i32[n]
    *,
    head_of_line: bool = True,
    check: bool | None = None,
) -> tuple[CacheState, ForkResult]:
  """Creates child sequences sharing their parent's blocks (beam search, n > 1).

  The child gets the parent's length and scope. Full blocks are shared by
  reference count (read-only: nobody writes into a full block). The partial
  last block, if any, is copied into a new slot (copy-on-write); apply the
  returned copies to the KV pool with `pkvattn.copy_pages(kv_cache,
  res.src_pages, res.dst_pages)` before the child's next write.

  Args:
    state: the cache state.
    parent_ids: `i32[n]` (array or list), live ids (may repeat: several
      children per parent).
    child_ids: `i32[n]`, new ids, not live, unique, not among `parent_ids`;
      -1 = padding.
    head_of_line: static, as in `extend` (each request needs one slot if the
      parent's last block is partial, else none).
    check: checked mode for this call (`pkvattn.checked`): ids in range,
      parents live, children dead, unique and not among the parents. `None`
      follows `checked()`; unchecked, such requests are refused.

  Returns:
    `(state, ForkResult(ok, src_pages, dst_pages))`. The copies cover every
    layer, K and V: entry `(r * num_layers + layer) * 2 + kv` is pool page
    `(slot * num_layers + layer) * 2 + kv` of the parent's partial block
    (src) and of the child's new slot (dst); -1 where request `r` copies
    nothing. Admission is all-or-nothing, in batch order (module docstring).

  Raises:
    ValueError: shapes or dtypes of the arguments (trace time).
    checkify.JaxRuntimeError: (a ValueError) checked mode, a violated
      contract.
  """
  parent_ids, child_ids = map(_checks.as_index_array, (parent_ids, child_ids))
  _check_fork_args(parent_ids, child_ids)
  if _contract.enabled(check):
    _contract.run(_fork_contract, state, parent_ids, child_ids)
  with _contract.unchecked():
    return _fork(state, parent_ids, child_ids, head_of_line=head_of_line)


def _check_fork_args(parent_ids, child_ids) -> None:
  _check_ids(parent_ids, "parent_ids")
  _check_ids(child_ids, "child_ids")
  _checks.check_shape(child_ids, parent_ids.shape, "child_ids")


def _fork_contract(state: CacheState, parent_ids, child_ids):
  if parent_ids.shape[0] == 0:
    return
  cfg = state.config
  _contract.require_ids(parent_ids, cfg.max_seqs, "parent_ids", unique=False)
  _contract.require_ids(child_ids, cfg.max_seqs, "child_ids")
  pids = parent_ids.astype(jnp.int32)
  cids = child_ids.astype(jnp.int32)
  pad = (pids < 0) != (cids < 0)
  i = _contract.first_true(pad)
  _contract.require(~jnp.any(pad), "Invalid child_ids: child_ids[{}] = {} "
                    "with parent_ids[{}] = {} (-1 pads both or neither)",
                    i, cids[i], i, pids[i])
  _require_live(state, parent_ids, "parent_ids", "fork")
  live = (cids >= 0) & state.seq_live[jnp.clip(cids, 0, cfg.max_seqs - 1)]
  i = _contract.first_true(live)
  _contract.require(~jnp.any(live), "Invalid child_ids: child_ids[{}] = {} "
                    "is live; a child must be a new id", i, cids[i])


@functools.partial(jax.jit, static_argnames=("head_of_line",))
def _fork(state, parent_ids, child_ids, *, head_of_line=True):
  """`fork` on arrays, unchecked."""
  inp, need = _fork_prepare(state, parent_ids, child_ids)
  ok, need, _ = _admit(state, inp.valid, need, head_of_line=head_of_line)
  return _fork_apply(state, inp, ok, need)


class _ForkInputs(NamedTuple):
  pidx: jax.Array      # i32[n], parent rows (clipped)
  cidx: jax.Array      # i32[n], child rows (clipped)
  valid: jax.Array     # bool[n]
  length: jax.Array    # i32[n], the parent's length
  num_full: jax.Array  # i32[n], its full blocks


def _fork_prepare(state, parent_ids, child_ids):
  """Validates a fork; returns `(_ForkInputs, need i32[n])` (one slot for a
  partial last block)."""
  cfg = state.config
  ps = cfg.page_size
  _check_ids(parent_ids, "parent_ids")
  n = parent_ids.shape[0]
  _check_ids(child_ids, "child_ids")
  _checks.check_shape(child_ids, (n,), "child_ids")
  parent_ids = parent_ids.astype(jnp.int32)
  child_ids = child_ids.astype(jnp.int32)
  pidx = jnp.clip(parent_ids, 0, cfg.max_seqs - 1)
  p_ok = ((parent_ids >= 0) & (parent_ids < cfg.max_seqs)
          & state.seq_live[pidx])
  # A child must be a new id, so never a (live) parent of the batch.
  cidx, c_ok = _select(state, child_ids, want_live=False)
  valid = p_ok & c_ok
  length = state.seq_lens[pidx]
  num_full = length // ps
  partial = (length % ps) != 0
  need = (valid & partial).astype(jnp.int32)
  return _ForkInputs(pidx, cidx, valid, length, num_full), need


def _fork_apply(state, inp: _ForkInputs, ok, need):
  """Creates the admitted children (`ok`); returns `(state, ForkResult)`
  with the copies' pages in this slot space's pool layout."""
  cfg = state.config
  nl = cfg.num_layers
  pidx, num_full = inp.pidx, inp.num_full
  ranks = jnp.where(need > 0, jnp.cumsum(need) - 1, -1)
  state, new_slot = _take_slots(
      state, ranks, jnp.sum(need), jnp.zeros((state.num_slots,), bool))
  parent_rows = state.seq_slots[pidx]
  pos = jnp.arange(cfg.max_pages)[None, :]
  shared = (pos < num_full[:, None]) & ok[:, None]
  row = jnp.where(shared, parent_rows, -1)
  row = jnp.where((pos == num_full[:, None]) & (need[:, None] > 0),
                  new_slot[:, None], row)
  state, _ = _open_seqs(state, ok, inp.cidx, row, inp.length,
                        state.seq_scope[pidx])
  src_slot = jnp.take_along_axis(
      parent_rows, jnp.clip(num_full, 0, cfg.max_pages - 1)[:, None],
      axis=1)[:, 0]
  sub = jnp.arange(nl * 2, dtype=jnp.int32)[None, :]   # layer * 2 + kv
  copy = need[:, None] > 0
  src = jnp.where(copy, src_slot[:, None] * (nl * 2) + sub, -1)
  dst = jnp.where(copy, new_slot[:, None] * (nl * 2) + sub, -1)
  return state, ForkResult(ok=ok, src_pages=src.reshape(-1),
                           dst_pages=dst.reshape(-1))


fork.__wrapped__ = _fork.__wrapped__
