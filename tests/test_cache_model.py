"""Random operation sequences: the jitted cache vs the pure-Python model.

After every step: the device state equals the model slot for slot (tables,
lengths, refcounts, publication, LRU clocks, generations), `cache.validate`
passes, per-request results agree, and every reused block really holds the
request's prefix (tracked independently as ground truth per slot).
"""

from __future__ import annotations

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pkvattn import cache
from pkvattn.cache import alloc
from pkvattn.cache import reference

CFG = cache.CacheConfig(num_slots=16, page_size=4, num_layers=2, max_seqs=6,
                        max_pages=6, hash_ways=16)
PS = CFG.page_size
MAX_LEN = CFG.max_seq_len  # 24
BATCH = 3
NUM_EXAMPLES = int(os.environ.get("PKV_CACHE_EXAMPLES", "1000"))

# Every jitted op traced once for the whole run, whatever the batch values.
_claim = jax.jit(chex.assert_max_traces(alloc.claim_batch.__wrapped__, n=1))
_extend = jax.jit(chex.assert_max_traces(alloc.extend.__wrapped__, n=1))
_commit = jax.jit(chex.assert_max_traces(alloc.commit.__wrapped__, n=1))
_release = jax.jit(chex.assert_max_traces(alloc.release.__wrapped__, n=1))
_fork = jax.jit(chex.assert_max_traces(alloc.fork.__wrapped__, n=1))

# A few shared prompt stems so that prefixes collide often.
_BASES = np.random.default_rng(0).integers(0, 3, size=(3, MAX_LEN))

_KINDS = ("claim", "claim", "extend", "commit", "commit", "release", "fork")


def _pick_ids(data, pool):
  """BATCH distinct ids from `pool` (live or dead ids), padded with -1; one
  entry may be replaced by an arbitrary (possibly invalid or duplicate) id."""
  ids = list(data.draw(st.permutations(pool)))[:BATCH] if pool else []
  ids += [-1] * (BATCH - len(ids))
  if data.draw(st.integers(0, 3)) == 0:
    ids[data.draw(st.integers(0, BATCH - 1))] = data.draw(
        st.integers(-1, CFG.max_seqs))
  return ids


def _draw_op(data, run):
  kind = data.draw(st.sampled_from(_KINDS))
  live = sorted(run.ref.seqs)
  dead = [i for i in range(CFG.max_seqs) if i not in run.ref.seqs]
  batch = lambda e: data.draw(st.lists(e, min_size=BATCH, max_size=BATCH))
  seed = data.draw(st.integers(0, 2**31 - 1))
  if kind == "claim":
    return kind, (_pick_ids(data, dead),
                  batch(st.sampled_from([13, 9, 16, 24, 5, 4, 1, 0, 26])),
                  batch(st.sampled_from([0, 0, 0, 1, 2])),   # prompt stem
                  batch(st.sampled_from([24, 24, 16, 9, 4, 0])),  # stem cut
                  batch(st.sampled_from([0, 0, 0, 1])),      # reuse_scope
                  seed)
  if kind == "extend":
    return kind, (_pick_ids(data, live), batch(st.integers(0, 9)))
  if kind == "commit":
    return kind, (_pick_ids(data, live),
                  batch(st.sampled_from([28, 28, 24, 13, 8, 4, 0])))
  if kind == "release":
    return kind, (_pick_ids(data, live),)
  return kind, (_pick_ids(data, live), _pick_ids(data, dead), seed)


def _i32(x):
  return jnp.asarray(np.asarray(x, np.int32))


def assert_same(state: cache.CacheState, ref: reference.ReferenceCache,
                with_stats: bool = False):
  cache.validate(state)
  h = jax.device_get(state)  # one transfer, then numpy comparisons
  for sid in range(CFG.max_seqs):
    live = sid in ref.seqs
    assert h.seq_slots[sid].tolist() == ref.seq_row(sid), (sid, h.seq_slots)
    assert bool(h.seq_live[sid]) == live
    assert int(h.seq_lens[sid]) == (ref.seqs[sid].length if live else 0)
    if live:
      assert int(h.seq_scope[sid]) == ref.seqs[sid].scope
  assert h.slot_refcount.tolist() == ref.refcount
  assert h.slot_published.tolist() == ref.published
  assert h.slot_last_use.tolist() == ref.last_use
  assert h.slot_gen.tolist() == ref.gen
  for s in np.nonzero(ref.published)[0]:
    assert int(h.slot_parent[s]) == ref.parent[s]
    assert int(h.slot_parent_gen[s]) == ref.parent_gen[s]
    assert tuple(h.slot_tokens[s].tolist()) == ref.tokens[s]
    assert int(h.slot_scope[s]) == ref.scope[s]
  if with_stats:
    got = {k: int(v) for k, v in jax.device_get(cache.stats(state)).items()
           if k != "hit_rate"}
    want = ref.stats()
    for k, v in want.items():
      assert got[k] == v, (k, got, want)
    assert (got["num_free"] + got["num_used"] + got["num_cached"]
            == CFG.num_slots)
  assert int(h.clock) == ref.clock


class _Run:
  """Drives both implementations and tracks ground truth per slot."""

  def __init__(self):
    self.state = cache.init_cache(CFG)
    self.ref = reference.ReferenceCache(CFG)
    self.future: dict[int, np.ndarray] = {}  # sid -> all tokens it will hold
    self.truth: dict[int, tuple] = {}        # slot -> (scope, token prefix)

  def _note_new_blocks(self, sid, first_block):
    row = self.ref.seq_row(sid)
    scope = self.ref.seqs[sid].scope
    for i in range(first_block, len(self.ref.seqs[sid].slots)):
      self.truth[row[i]] = (scope, tuple(self.future[sid][:(i + 1) * PS]))

  def claim(self, ids, lengths, stems, cuts, scopes, seed):
    rng = np.random.default_rng(seed)
    tokens = _BASES[stems].copy()
    for r, cut in enumerate(cuts):
      tokens[r, cut:] = rng.integers(0, 3, MAX_LEN - cut)
    self.state, res = _claim(self.state, _i32(ids), _i32(tokens),
                             _i32(lengths), _i32(scopes))
    want = self.ref.claim_batch(ids, tokens, lengths, scopes)
    for k, v in want.items():
      assert np.asarray(getattr(res, k)).tolist() == v, (k, res, want)
    for r, sid in enumerate(ids):
      if not want["ok"][r]:
        continue
      reused = want["num_reused_tokens"][r] // PS
      row = self.ref.seq_row(sid)
      for i in range(reused):  # reuse only of the exact prefix and scope
        assert self.truth[row[i]] == (scopes[r], tuple(tokens[r][:(i + 1) * PS]))
      self.future[sid] = tokens[r].copy()
      self._note_new_blocks(sid, reused)

  def extend(self, ids, adds):
    before = {sid: len(s.slots) for sid, s in self.ref.seqs.items()}
    self.state, res = _extend(self.state, _i32(ids), _i32(adds))
    want = self.ref.extend(ids, adds)
    assert np.asarray(res.ok).tolist() == want["ok"]
    assert np.asarray(res.num_new_blocks).tolist() == want["num_new_blocks"]
    for r, sid in enumerate(ids):
      if want["ok"][r]:
        self._note_new_blocks(sid, before[sid])

  def commit(self, ids, lengths):
    tokens = np.zeros((BATCH, MAX_LEN), np.int32)
    for r, sid in enumerate(ids):
      if sid in self.future:
        tokens[r] = self.future[sid]
    self.state = _commit(self.state, _i32(ids), _i32(tokens), _i32(lengths))
    self.ref.commit(ids, tokens, lengths)

  def release(self, ids):
    self.state = _release(self.state, _i32(ids))
    self.ref.release(ids)

  def fork(self, parents, children, seed):
    self.state, res = _fork(self.state, _i32(parents), _i32(children))
    want = self.ref.fork(parents, children)
    assert np.asarray(res.ok).tolist() == want["ok"]
    src = np.asarray(res.src_pages).reshape(BATCH, -1)
    dst = np.asarray(res.dst_pages).reshape(BATCH, -1)
    sub = np.arange(2 * CFG.num_layers)
    rng = np.random.default_rng(seed)
    for r, copy in enumerate(want["copies"]):
      if copy is None:
        assert (src[r] == -1).all() and (dst[r] == -1).all()
      else:
        np.testing.assert_array_equal(src[r], copy[0] * 2 * CFG.num_layers + sub)
        np.testing.assert_array_equal(dst[r], copy[1] * 2 * CFG.num_layers + sub)
      if want["ok"][r]:
        child, parent = children[r], parents[r]
        length = self.ref.seqs[child].length
        fut = self.future[parent].copy()
        fut[length:] = rng.integers(0, 3, MAX_LEN - length)
        self.future[child] = fut
        self._note_new_blocks(child, length // PS)


@settings(max_examples=NUM_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_random_ops_match_reference(data):
  run = _Run()
  for _ in range(data.draw(st.integers(6, 16), label="num_ops")):
    kind, args = _draw_op(data, run)
    getattr(run, kind)(*args)
    assert_same(run.state, run.ref)
  assert_same(run.state, run.ref, with_stats=True)
  layer = data.draw(st.integers(0, CFG.num_layers - 1), label="layer")
  ids = np.arange(-1, CFG.max_seqs + 1)
  for split in (True, False):
    actual = cache.page_table(run.state, _i32(ids), layer, split=split)
    expected = run.ref.page_table(ids, layer, split=split)
    chex.assert_shape(actual, expected.shape)
    np.testing.assert_array_equal(actual, expected)


def test_validate_catches_corruption():
  run = _Run()
  run.claim([0, 1, -1], [9, 5, 0], [0, 1, 0], [24, 24, 0], [0, 0, 0], 1)
  cache.validate(run.state)
  bad = dataclass_replace(run.state, slot_refcount=run.state.slot_refcount.at[
      int(run.state.seq_slots[0, 0])].add(1))
  with pytest.raises(ValueError, match="refcount"):
    cache.validate(bad)
  stolen = dataclass_replace(run.state, seq_slots=run.state.seq_slots.at[1, 0].set(
      run.state.seq_slots[0, 2]))
  with pytest.raises(ValueError):
    cache.validate(stolen)


def dataclass_replace(state, **kw):
  import dataclasses
  return dataclasses.replace(state, **kw)
