"""Admission of claim_batch / extend / fork: no starvation by protection, and
the `head_of_line` policy; `release` of duplicated ids; list arguments.

Random pools (built by random claims, commits and releases) meet random
batches under every static policy (`head_of_line` x `evict`); the jitted ops
must agree with `cache/reference.py`, whose admission follows the rule's
definition (a loop over the requests with sets of protected slots), and the
properties the rule promises must hold on the device results themselves.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pkvattn import cache
from pkvattn.cache import reference
from cache_asserts import assert_same

CFG = cache.CacheConfig(num_slots=8, page_size=4, num_layers=1, max_seqs=6,
                        max_pages=4, hash_ways=8)
PS = CFG.page_size
MAX_LEN = CFG.max_seq_len  # 16
BATCH = 4
# The public ops throughout: their jitted bodies compile once per config and
# static arguments, shared by every test of the module.
_claim, _extend, _fork = cache.claim_batch, cache.extend, cache.fork
_commit, _release = cache.commit, cache.release


def _i32(x):
  return jnp.asarray(np.asarray(x, np.int32))


# ---------------------------------------------------------------------------
# Regressions.


def _two_cached_prompts():
  """Sequences A and B (16 tokens, page_size 8) published and released.

  Returns `(state, a, b, a_slots, b_slots)`: prompts A+[1] and B+[1] (17
  tokens) and the slots of their 2 cached blocks. Every slot (4) is cached,
  none free.
  """
  cfg = cache.CacheConfig(num_slots=4, page_size=8, num_layers=1,
                          max_seqs=4, max_pages=4)
  a = np.r_[np.full(16, 5), 1]
  b = np.r_[np.full(16, 6), 1]
  st_ = cache.init_cache(cfg)
  st_, res = cache.claim_batch(st_, _i32([0, 1]), _i32([a[:16], b[:16]]),
                               _i32([16, 16]))
  assert np.asarray(res.ok).all()
  a_slots, b_slots = np.asarray(st_.seq_slots[:2, :2]).tolist()
  st_ = cache.commit(st_, _i32([0, 1]), _i32([a[:16], b[:16]]), _i32([16, 16]))
  st_ = cache.release(st_, _i32([0, 1]))
  stats = cache.stats(st_)
  assert int(stats["num_cached"]) == 4 and int(stats["num_free"]) == 0
  return st_, a, b, a_slots, b_slots


@pytest.mark.parametrize("head_of_line", [True, False])
def test_refused_request_protects_nothing(head_of_line):
  st_, a, b, a_slots, b_slots = _two_cached_prompts()
  # Alone, A+[1] reuses its 2 cached blocks and takes 1 new slot.
  _, res = cache.claim_batch(st_, _i32([2]), _i32([a]), _i32([17]),
                             head_of_line=head_of_line)
  assert np.asarray(res.ok).tolist() == [True]
  # With B+[1] behind it, both used to be refused: each one's matches were
  # protected, so neither could evict a block to get its new one. Together
  # they need 2 new + 4 kept > 4 slots; A comes first and fits alone.
  new, res = cache.claim_batch(st_, _i32([2, 3]), _i32([a, b]), _i32([17, 17]),
                               head_of_line=head_of_line)
  assert np.asarray(res.ok).tolist() == [True, False]
  assert np.asarray(res.num_reused_tokens).tolist() == [16, 0]
  assert np.asarray(res.num_new_blocks).tolist() == [1, 0]
  cache.validate(new)
  # A keeps its blocks; its new slot is B's least recently released block
  # (both released together: the deepest one, B's tail), which leaves the
  # cache.
  row = np.asarray(new.seq_slots[2]).tolist()
  assert row[:3] == a_slots + [b_slots[1]]
  assert not bool(new.seq_live[3])
  published = np.asarray(new.slot_published)
  assert published[a_slots].all() and published.sum() == 3
  # B's chain lost its tail: alone it reuses its head and needs 2 new slots,
  # while the only cached slot left is that head.
  _, res = cache.claim_batch(new, _i32([3]), _i32([b]), _i32([17]))
  assert not bool(res.ok[0])


def test_release_duplicate_ids_releases_once():
  st_, a, _, _, _ = _two_cached_prompts()
  st_, res = cache.claim_batch(st_, _i32([0]), _i32([a]), _i32([17]))
  assert bool(res.ok[0])
  assert int(cache.stats(st_)["num_used"]) == 3
  for ids in ([0, 0], [0, -1, 0, 9]):
    out = cache.release(st_, _i32(ids))
    cache.validate(out)
    assert not bool(out.seq_live[0])
    assert int(cache.stats(out)["num_used"]) == 0, ids
    assert int(out.clock) == int(st_.clock) + 1
  # finish_step with a duplicate acts once too (scratch inactive: a no-op).
  cache.validate(cache.finish_step(st_, _i32([0, 0])))


def test_cache_ops_accept_lists():
  st_ = cache.init_cache(CFG)
  st_, res = cache.claim_batch(st_, [0, 1], [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]],
                               [5, 5], [0, 0])
  assert np.asarray(res.ok).tolist() == [True, True]
  st_, res = cache.extend(st_, [0, 1], [3, 0])
  assert np.asarray(res.ok).tolist() == [True, True]
  st_ = cache.commit(st_, [0], [[1, 2, 3, 4, 5, 0, 0, 0]], [8])
  st_, res = cache.fork(st_, [1], [2])
  assert bool(res.ok[0])
  st_ = cache.finish_step(st_, [0])
  table = cache.page_table(st_, [0, 2, -1], 0)
  assert table.shape == (3, 2, CFG.max_pages)
  st_ = cache.release(st_, [0, 1, 2])
  cache.validate(st_)
  assert int(cache.stats(st_)["num_live_seqs"]) == 0


def test_head_of_line_worked_example():
  # 2 free slots; three requests needing 1, 2 and 1 new slots (the example
  # of the `extend` docstring), for claim_batch and for extend.
  st_ = cache.init_cache(CFG)
  st_, res = cache.claim_batch(st_, [0, 1, 2], np.arange(48).reshape(3, 16),
                               [4, 4, 16])
  assert np.asarray(res.ok).all() and int(cache.stats(st_)["num_free"]) == 2
  for hol, expected in ((True, [True, False, False]),
                        (False, [True, False, True])):
    _, res = cache.claim_batch(st_, [3, 4, 5], np.arange(48).reshape(3, 16),
                               [4, 8, 4], head_of_line=hol)
    assert np.asarray(res.ok).tolist() == expected, hol
  st_, _ = cache.claim_batch(st_, [3], np.zeros((1, 16), int), [0])
  for hol, expected in ((True, [True, False, False]),
                        (False, [True, False, True])):
    _, res = cache.extend(st_, [0, 1, 3], [4, 8, 4], head_of_line=hol)
    assert np.asarray(res.ok).tolist() == expected, hol
    assert np.asarray(res.num_new_blocks).tolist() == [
        n if e else 0 for n, e in zip([1, 2, 1], expected)]


# ---------------------------------------------------------------------------
# Properties over random pools and batches.


class _Pool:
  """The device state and the model in lockstep."""

  def __init__(self, rng):
    self.state = cache.init_cache(CFG)
    self.ref = reference.ReferenceCache(CFG)
    self.bases = rng.integers(0, 2, (3, MAX_LEN))  # shared prompt stems

  def prompts(self, rng, n):
    """Stems, cut at a random block boundary, then random tokens."""
    tokens = self.bases[rng.integers(0, 3, n)].copy()
    for r in range(n):
      cut = int(rng.choice([MAX_LEN, MAX_LEN, 12, 8, 4, 0]))
      tokens[r, cut:] = rng.integers(0, 2, MAX_LEN - cut)
    return tokens

  def ids(self, rng, live: bool, n=BATCH):
    pool = [i for i in range(CFG.max_seqs) if (i in self.ref.seqs) == live]
    ids = [int(x) for x in rng.permutation(pool)[:n]]
    return ids + [-1] * (n - len(ids))

  def build(self, rng, num_ops):
    """Random rounds of claim + commit, releasing all, some or none of the
    round: a pool with cached, used and free slots in random proportions."""
    for _ in range(num_ops):
      n = int(rng.integers(1, 3))
      ids = self.ids(rng, live=False, n=n)
      tokens = self.prompts(rng, n)
      lengths = rng.choice([16, 12, 9, 5, 4], n)
      self.state, _ = _claim(self.state, _i32(ids), _i32(tokens),
                             _i32(lengths), head_of_line=False)
      self.ref.claim_batch(ids, tokens, lengths, head_of_line=False)
      self.state = _commit(self.state, _i32(ids), _i32(tokens), _i32(lengths))
      self.ref.commit(ids, tokens, lengths)
      keep = int(rng.choice([0, 0, 0, 1, n]))
      ids = ids[keep:] + [-1] * keep
      self.state = _release(self.state, _i32(ids))
      self.ref.release(ids)
    assert_same(self.state, self.ref)


_SETTINGS = settings(
    max_examples=int(os.environ.get("PKV_ADMIT_EXAMPLES", "60")),
    deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _first_valid(ids, valid):
  return next((r for r in range(len(ids)) if valid[r]), None)


@_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), num_ops=st.integers(0, 8),
       head_of_line=st.booleans(), evict=st.booleans())
def test_claim_admission_matches_model_and_never_starves(seed, num_ops,
                                                         head_of_line, evict):
  rng = np.random.default_rng(seed)
  pool = _Pool(rng)
  pool.build(rng, num_ops)
  ids = pool.ids(rng, live=False)
  tokens = pool.prompts(rng, BATCH)
  lengths = rng.choice([16, 13, 9, 5, 1], BATCH)
  kw = dict(head_of_line=head_of_line, evict=evict)
  new, res = _claim(pool.state, _i32(ids), _i32(tokens), _i32(lengths), **kw)
  want = pool.ref.claim_batch(ids, tokens, lengths, **kw)
  for k, v in want.items():
    assert np.asarray(getattr(res, k)).tolist() == v, (k, res, want)
  assert_same(new, pool.ref)
  ok = np.asarray(res.ok).tolist()
  valid = [i >= 0 for i in ids]  # only dead ids are drawn: all valid
  # The first request is admitted whenever it fits alone.
  r0 = _first_valid(ids, valid)
  if r0 is not None:
    alone = [sid if r == r0 else -1 for r, sid in enumerate(ids)]
    _, res0 = _claim(pool.state, _i32(alone), _i32(tokens), _i32(lengths),
                     **kw)
    assert ok[r0] == bool(res0.ok[r0])
  if head_of_line:  # the admitted requests are a prefix of the valid ones
    refused = [r for r in range(BATCH) if valid[r] and not ok[r]]
    if refused:
      assert not any(ok[refused[0]:])
    # ... and the other policy admits at least them.
    _, res2 = _claim(pool.state, _i32(ids), _i32(tokens), _i32(lengths),
                     head_of_line=False, evict=evict)
    assert all(b for a, b in zip(ok, np.asarray(res2.ok).tolist()) if a)


@_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), num_ops=st.integers(1, 8),
       head_of_line=st.booleans(), evict=st.booleans())
def test_extend_and_fork_admission_match_model(seed, num_ops, head_of_line,
                                               evict):
  rng = np.random.default_rng(seed)
  pool = _Pool(rng)
  pool.build(rng, num_ops)
  ids = pool.ids(rng, live=True)
  adds = rng.integers(0, 9, BATCH)
  kw = dict(head_of_line=head_of_line, evict=evict)
  new, res = _extend(pool.state, _i32(ids), _i32(adds), **kw)
  ref = pool.ref.copy()
  want = ref.extend(ids, adds, **kw)
  assert np.asarray(res.ok).tolist() == want["ok"]
  assert np.asarray(res.num_new_blocks).tolist() == want["num_new_blocks"]
  assert_same(new, ref)
  if head_of_line:  # the admitted requests are a prefix of the valid ones
    ok = want["ok"]
    fits_capacity = [sid >= 0 and pool.ref.seqs[sid].length + a <= MAX_LEN
                     for sid, a in zip(ids, adds)]
    refused = [r for r in range(BATCH) if fits_capacity[r] and not ok[r]]
    if refused:
      assert not any(ok[refused[0]:])
  parents = pool.ids(rng, live=True)
  children = pool.ids(rng, live=False)
  children = [c if p >= 0 else -1 for p, c in zip(parents, children)]
  new, res = _fork(pool.state, _i32(parents), _i32(children),
                   head_of_line=head_of_line)
  want = pool.ref.fork(parents, children, head_of_line=head_of_line)
  assert np.asarray(res.ok).tolist() == want["ok"]
  assert_same(new, pool.ref)
