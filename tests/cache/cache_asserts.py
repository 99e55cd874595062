"""The jitted cache's state checked against the pure-Python model, slot for
slot.

`assert_same` compares a `cache.CacheState` with a
`cache/reference.ReferenceCache` (tables, lengths, refcounts, publication,
LRU clocks, generations, parents, scratch). The random-operation tests of
one cache (`test_cache_model.py`), of its admission
(`test_cache_reliability.py`) and of every window group of a hybrid cache
(`test_cache_hybrid_model.py`) run it after their operations; `Lockstep`
drives the two through scripted operations for the tests of one op
(`test_claim.py`, `test_forking.py`, `test_publish.py`), a per-window-group
cache against `reference_hybrid` too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pkvattn import cache
from pkvattn.cache import reference
from pkvattn.cache import reference_hybrid


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


def i32(x):
  """`x` as an int32 jax array."""
  return jnp.asarray(np.asarray(x, np.int32))


def token_rows(prompts, width: int) -> np.ndarray:
  """Token lists as an `i32[len(prompts), width]` token row each, zero past
  its end (a list longer than `width` raises)."""
  out = np.zeros((len(prompts), width), np.int32)
  for r, p in enumerate(prompts):
    out[r, :len(p)] = p
  return out


class Lockstep:
  """The jitted cache and the model driven in step: each op runs on both, its
  results are compared field by field with the model's and the states slot
  for slot (`assert_same`; the stats counters too under `with_stats`).

  `model=False` is for a config the model does not cover (hash buckets that
  can overflow): the jitted cache alone, `cache.validate` after each op.
  A `cache.HybridCacheConfig` runs against
  `reference_hybrid.ReferenceHybridCache`: `cache.validate` on the whole
  state, then each window group slot for slot (no `with_stats`).
  """

  def __init__(self, cfg, *, model: bool = True, with_stats: bool = False):
    self.hybrid = isinstance(cfg, cache.HybridCacheConfig)
    assert not (self.hybrid and with_stats)
    self.state = cache.init_cache(cfg)
    model_cls = (reference_hybrid.ReferenceHybridCache if self.hybrid
                 else reference.ReferenceCache)
    self.ref = model_cls(cfg) if model else None
    self.with_stats = with_stats

  def _check(self):
    if self.ref is None:
      cache.validate(self.state)
    elif self.hybrid:
      cache.validate(self.state)
      for st_g, ref_g in zip(self.state.groups, self.ref.groups):
        assert_same(st_g, ref_g, invariants=False)
    else:
      assert_same(self.state, self.ref, with_stats=self.with_stats)

  def host(self) -> cache.CacheState:
    return jax.device_get(self.state)

  def claim(self, ids, tokens, lengths, **kw) -> dict[str, list]:
    """`claim_batch` on both (`kw`: `evict`, `head_of_line`); the jitted
    result's fields as lists."""
    tokens = np.asarray(tokens, np.int32)
    self.state, res = cache.claim_batch(self.state, i32(ids), i32(tokens),
                                        i32(lengths), **kw)
    got = {k: np.asarray(v).tolist() for k, v in res._asdict().items()}
    if self.ref is not None:
      want = self.ref.claim_batch(ids, tokens, lengths, **kw)
      assert got == want, (got, want)
    self._check()
    return got

  def extend(self, ids, num_new_tokens, **kw) -> dict[str, list]:
    """`extend` on both (`kw`: `evict`, `head_of_line`, and `num_computed`
    for a hybrid cache); the jitted result's fields as lists."""
    self.state, res = cache.extend(self.state, i32(ids), i32(num_new_tokens),
                                   **kw)
    got = {k: np.asarray(v).tolist() for k, v in res._asdict().items()}
    if self.ref is not None:
      want = self.ref.extend(ids, num_new_tokens, **kw)
      assert got == want, (got, want)
    self._check()
    return got

  def commit(self, ids, tokens, lengths):
    tokens = np.asarray(tokens, np.int32)
    self.state = cache.commit(self.state, i32(ids), i32(tokens), i32(lengths))
    if self.ref is not None:
      self.ref.commit(ids, tokens, lengths)
    self._check()

  def release(self, ids):
    self.state = cache.release(self.state, i32(ids))
    if self.ref is not None:
      self.ref.release(ids)
    self._check()

  def publish(self, ids, tokens, lengths):
    """Claims, commits and releases the prompts: their blocks end cached."""
    res = self.claim(ids, tokens, lengths)
    assert all(res["ok"]), res
    self.commit(ids, tokens, lengths)
    self.release(ids)

  def fork(self, parents, children, head_of_line: bool = True):
    """`fork` on both (needs the model); returns the jitted result's fields
    as lists and the model's result (its `copies`: `(src, dst)` slots or
    None per request)."""
    self.state, res = cache.fork(self.state, i32(parents), i32(children),
                                 head_of_line=head_of_line)
    want = self.ref.fork(parents, children, head_of_line=head_of_line)
    got = {k: np.asarray(v).tolist() for k, v in res._asdict().items()}
    assert got["ok"] == want["ok"], (got["ok"], want["ok"])
    self._check()
    return got, want
