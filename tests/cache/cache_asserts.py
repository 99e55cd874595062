"""The jitted cache's state checked against the pure-Python model, slot for
slot.

`assert_same` compares a `cache.CacheState` with a
`cache/reference.ReferenceCache` (tables, lengths, refcounts, publication,
LRU clocks, generations, parents, scratch). The random-operation tests of
one cache (`test_cache_model.py`), of its admission
(`test_cache_reliability.py`) and of every window group of a hybrid cache
(`test_cache_hybrid_model.py`) run it after their operations.
"""

from __future__ import annotations

import jax
import numpy as np

from pkvattn import cache
from pkvattn.cache import reference


def assert_same(state: cache.CacheState, ref: reference.ReferenceCache,
                with_stats: bool = False, invariants: bool = True):
  """Device state == model, slot for slot (`invariants`: `cache.validate`
  first; a caller checking a per-window-group cache validates it whole)."""
  cfg = state.config
  if invariants:
    cache.validate(state)
  h = jax.device_get(state)  # one transfer, then numpy comparisons
  for sid in range(cfg.max_seqs):
    live = sid in ref.seqs
    assert h.seq_slots[sid].tolist() == ref.seq_row(sid), (sid, h.seq_slots)
    assert bool(h.seq_live[sid]) == live
    assert int(h.seq_lens[sid]) == (ref.seqs[sid].length if live else 0)
    if live:
      assert int(h.seq_scope[sid]) == ref.seqs[sid].scope
    slots, first, count = ref.scratch_row(sid)
    assert h.seq_scratch_slots[sid].tolist() == slots, sid
    assert (int(h.seq_scratch_first[sid]),
            int(h.seq_scratch_count[sid])) == (first, count), sid
  assert h.slot_refcount.tolist() == ref.refcount
  assert h.slot_published.tolist() == ref.published
  assert h.slot_last_use.tolist() == ref.last_use
  assert h.slot_gen.tolist() == ref.gen
  for s in np.nonzero(ref.published)[0]:
    assert int(h.slot_parent[s]) == ref.parent[s]
    assert int(h.slot_parent_gen[s]) == ref.parent_gen[s]
    assert int(h.slot_depth[s]) == ref.depth[s]
    assert tuple(h.slot_tokens[s].tolist()) == ref.tokens[s]
    assert int(h.slot_scope[s]) == ref.scope[s]
  if with_stats:
    got = {k: int(v) for k, v in jax.device_get(cache.stats(state)).items()
           if k != "hit_rate"}
    want = ref.stats()
    for k, v in want.items():
      assert got[k] == v, (k, got, want)
    assert (got["num_free"] + got["num_used"] + got["num_cached"]
            == cfg.num_slots)
  assert int(h.clock) == ref.clock
