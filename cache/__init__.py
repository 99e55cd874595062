"""Functional KV-cache state: a pytree plus pure, jit-compiled functions.

Users write `pkvattn.cache.init_cache(cfg)`, `pkvattn.cache.claim_batch(...)`,
and so on; see `cache/state.py` for the pool layout and `cache/alloc.py` for
the semantics shared by all operations (`claim_batch` itself is in
`cache/claim.py`). `checked()` (also `pkvattn.checked`) turns the ops'
runtime contract into errors (`cache/_contract.py`).

A host-memory tier for evicted prefix blocks (`HostTierConfig`,
`host_offload_plan`, `host_lookup`) lives in `cache/host_tier.py`.

Hybrid sliding-window models get one slot space per window group
(`HybridCacheConfig`, `cache/hybrid.py`): `init_cache`, `claim_batch`,
`extend`, `commit`, `release`, `finish_step`, `fork`, `page_table`,
`stats` and `validate` accept either kind of state and dispatch on it.
"""

import functools as _functools

import jax
import jax.numpy as jnp

from . import alloc as _alloc
from . import claim as _claim
from . import forking as _forking
from . import hybrid as _hybrid
from . import publish as _publish
from . import state as _state
from . import tables as _tables
from . import validate as _validate
from ._contract import checked as checked
from .alloc import ExtendResult as ExtendResult
from .claim import ClaimResult as ClaimResult
from .forking import ForkResult as ForkResult
from .host_tier import HostTierConfig as HostTierConfig
from .host_tier import HostTierInvariantError as HostTierInvariantError
from .host_tier import HostTierState as HostTierState
from .host_tier import host_invalidate as host_invalidate
from .host_tier import host_lookup as host_lookup
from .host_tier import host_offload_plan as host_offload_plan
from .host_tier import host_tier_stats as host_tier_stats
from .host_tier import init_host_tier as init_host_tier
from .host_tier import validate_host_tier as validate_host_tier
from .hybrid import HybridCacheConfig as HybridCacheConfig
from .hybrid import HybridCacheState as HybridCacheState
from .hybrid import layer_page_tables as _hybrid_layer_tables
from .state import MAX_POOL_PAGES as MAX_POOL_PAGES
from .state import NULL_PAGE as NULL_PAGE
from .state import NULL_SEQ as NULL_SEQ
from .state import CacheConfig as CacheConfig
from .state import CacheState as CacheState
from .window import PageIndexMode as PageIndexMode
from .window import SwaScratchPlan as SwaScratchPlan
from .window import swa_scratch_plan as swa_scratch_plan



def _dispatch(flat, hybrid):
  """`flat` for a `CacheState` (or config), `hybrid` for the per-group kind."""
  @_functools.wraps(flat)
  def op(state, *args, **kwargs):
    if isinstance(state, (HybridCacheState, HybridCacheConfig)):
      return hybrid(state, *args, **kwargs)
    kwargs.pop("num_computed", None)  # a flat cache releases nothing early
    return flat(state, *args, **kwargs)
  op.__doc__ = (flat.__doc__ or "") + (
      "\n\n  A `HybridCacheState` (per-window-group slot spaces) dispatches to "
      f"`cache.hybrid.{hybrid.__name__}`.\n")
  return op


init_cache = _dispatch(_state.init_cache, _hybrid.init_hybrid_cache)
claim_batch = _dispatch(_claim.claim_batch, _hybrid.claim_batch)
extend = _dispatch(_alloc.extend, _hybrid.extend)
commit = _dispatch(_publish.commit, _hybrid.commit)
release = _dispatch(_alloc.release, _hybrid.release)
finish_step = _dispatch(_alloc.finish_step, _hybrid.finish_step)
fork = _dispatch(_forking.fork, _hybrid.fork)
page_table = _dispatch(_tables.page_table, _hybrid.page_table)
stats = _dispatch(_state.stats, _hybrid.stats)
validate = _dispatch(_validate.validate, _hybrid.validate)


def layer_page_tables(state, seq_ids):
  """`i32[num_layers, n, 2, max_pages]`: every layer's split page table.

  Args:
    state: a `CacheState` (its config's `num_layers`) or `HybridCacheState`.
    seq_ids: `i32[n]`; rows of -1, out-of-range or dead ids are all -1.

  Returns:
    The tables of `page_table(state, seq_ids, layer)` stacked over the model
    layers (vectorised, one computation per slot space).
  """
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  if isinstance(state, HybridCacheState):
    return _hybrid_layer_tables(state, seq_ids)
  return jax.vmap(lambda layer: _tables.page_table(state, seq_ids, layer,
                                                   check=False))(
      jnp.arange(state.config.num_layers, dtype=jnp.int32))


__all__ = [
    "CacheConfig",
    "CacheState",
    "ClaimResult",
    "ExtendResult",
    "ForkResult",
    "HostTierConfig",
    "HostTierInvariantError",
    "HostTierState",
  "HybridCacheConfig",
  "HybridCacheState",
    "MAX_POOL_PAGES",
    "NULL_PAGE",
    "NULL_SEQ",
    "PageIndexMode",
    "SwaScratchPlan",
    "checked",
    "claim_batch",
    "commit",
    "extend",
    "finish_step",
    "fork",
    "host_invalidate",
    "host_lookup",
    "host_offload_plan",
    "host_tier_stats",
    "init_cache",
    "init_host_tier",
  "layer_page_tables",
    "page_table",
    "release",
    "stats",
    "swa_scratch_plan",
    "validate",
    "validate_host_tier",
]
