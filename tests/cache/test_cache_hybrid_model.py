"""Random operation sequences: the per-window-group cache vs its Python model.

Four configs mixing window groups: Gemma-3-like (a global group and two
sliding ones, scratch reuse on), Gemma-2-like with `max_rewind_len`, an
all-sliding model with two windows (group 0 slides too; scratch on), and a
global-heavy one; both admission policies. A prompt whose sliding blocks were
scratch is reused only as far as its held tail allows, so the configs without
scratch are the ones that exercise reuse past the window most. After every
operation every group's state equals `reference_hybrid.ReferenceHybridCache`'s
slot for slot
(tables, lengths, refcounts, publication, LRU clocks, generations, parents,
scratch), per-request results agree, and a visibility oracle built from the
attention semantics alone holds (`_Run.check_visibility`): every block a
current or future query can see is mapped, in each layer, to a page of a slot
holding that sequence's tokens, and a sliding layer maps no block that no
query can see any more (the memory the per-group spaces exist to save).
At the end: `cache.validate`, per-group stats, every layer's table in
absolute pool pages, and one trace per jitted op.

`extend` gets `num_computed` (None, the length, less, or more: clipped). Per
sequence the harness keeps `promise`, the first query position the cache was
told of (a claim's `min(reused tokens, length - max_rewind_len)`, raised by
each `extend` to `num_computed - max_rewind_len`), and `reach`, the first
position a query may still come at: the promise, raised at the end of a step
that had scratch blocks to its `capacity - max_rewind_len` (scratch blocks
are stale for every later query, `cache/window.py`).
"""

from __future__ import annotations

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pkvattn import cache
from pkvattn.cache import hybrid
from pkvattn.cache import reference_hybrid
from cache_asserts import assert_same as assert_same_group

_COMMON = dict(page_size=4, max_seqs=5, max_pages=6, hash_ways=20)
CONFIGS = {
    # Global + windows 6 and 3 (three groups), scratch in the sliding ones.
    "gemma3": cache.HybridCacheConfig(
        layer_windows=(6, 3, -1, 6), group_num_slots=(20, 12, 9),
        enable_swa_scratch_reuse=True, **_COMMON),
    # 1:1 local/global, rewinds of up to 2 tokens, no scratch (so prompts
    # keep their sliding blocks until `extend`: reuse past the window).
    "gemma2": cache.HybridCacheConfig(
        layer_windows=(5, -1), group_num_slots=(18, 10), max_rewind_len=2,
        **_COMMON),
    # No global layer: group 0 (window 9) slides and releases too.
    "sliding": cache.HybridCacheConfig(
        layer_windows=(9, 2, 9), group_num_slots=(16, 9),
        enable_swa_scratch_reuse=True, max_rewind_len=1, **_COMMON),
    # No scratch, two global layers: every new block takes a slot; old ones
    # go at `extend`.
    "noscratch": cache.HybridCacheConfig(
        layer_windows=(-1, 4, -1), group_num_slots=(18, 10), **_COMMON),
}
POLICY = {"gemma3": True, "gemma2": False, "sliding": False,
          "noscratch": True}  # head_of_line of claim / extend / fork
BATCH = 3
# Examples per config (CI: 4 x 80 = 320 operation sequences; more with
# PKV_HYBRID_EXAMPLES).
NUM_EXAMPLES = int(os.environ.get("PKV_HYBRID_EXAMPLES", "80"))

_TRACES: collections.Counter = collections.Counter()


def _counted(name, fn):
  def traced(state, *args, **statics):
    key = (name, state.config, tuple(sorted(statics.items())),
           tuple(a is None for a in args))
    _TRACES[key] += 1
    return fn(state, *args, **statics)
  return traced


_claim = jax.jit(_counted("claim", hybrid._claim_batch.__wrapped__),
                 static_argnames=("head_of_line", "evict"))
_extend = jax.jit(_counted("extend", hybrid._extend.__wrapped__),
                  static_argnames=("head_of_line", "evict"))
_commit = jax.jit(_counted("commit", hybrid._commit.__wrapped__))
_fork = jax.jit(_counted("fork", hybrid._fork.__wrapped__),
                static_argnames=("head_of_line",))
_tables = jax.jit(lambda state: cache.layer_page_tables(
    state, jnp.arange(state.config.max_seqs, dtype=jnp.int32))[:, :, 0])

_KINDS = ("claim", "claim", "served", "extend", "extend", "extend", "commit",
          "commit", "release", "finish", "fork")


def _i32(x):
  return jnp.asarray(np.asarray(x, np.int32))


def _cdiv(a, b):
  return -(-a // b)


def assert_same(state: cache.HybridCacheState,
                ref: reference_hybrid.ReferenceHybridCache,
                with_stats: bool = False):
  """Slot for slot; with `with_stats` (end of a run) also the per-group
  stats and `cache.validate` (a third of a run's time if done per op; the
  slot-for-slot comparison runs after every op)."""
  if with_stats:
    cache.validate(state)
  for st_g, ref_g in zip(state.groups, ref.groups):
    assert_same_group(st_g, ref_g, invariants=False)
  if with_stats:
    got = jax.device_get(cache.stats(state))
    want = ref.stats()
    for k, v in want.items():
      assert np.asarray(got[k]).tolist() == v, (k, got, want)


class _Run:
  """Drives both implementations and tracks, independently of either, what
  every group slot holds (`truth`), the running step of each sequence
  (`step`), and its `promise` and `reach` (module docstring)."""

  def __init__(self, name: str):
    self.cfg = CONFIGS[name]
    self.head_of_line = POLICY[name]
    self.state = cache.init_cache(self.cfg)
    self.ref = reference_hybrid.ReferenceHybridCache(self.cfg)
    self.bases = np.random.default_rng(0).integers(
        0, 3, size=(3, self.cfg.max_seq_len))  # shared stems: prefixes collide
    self.future: dict[int, np.ndarray] = {}
    self.truth: dict[tuple[int, int], tuple] = {}  # (group, slot) -> content
    self.step: dict[int, tuple[int, int]] = {}     # sid -> (history, capacity)
    self.promise: dict[int, int] = {}
    self.reach: dict[int, int] = {}

  def _ids(self, rng, pool):
    ids = [int(x) for x in rng.permutation(pool)[:BATCH]] if pool else []
    ids += [-1] * (BATCH - len(ids))
    if rng.integers(4) == 0:
      ids[rng.integers(BATCH)] = int(rng.integers(-1, self.cfg.max_seqs + 1))
    return ids

  def _valid_once(self, ids, want_live, dedupe=False):
    out = []
    for r, sid in enumerate(ids):
      ok = 0 <= sid < self.cfg.max_seqs and (sid in self.ref.seqs) == want_live
      once = sid not in ids[:r] if dedupe else ids.count(sid) == 1
      out.append(ok and once)
    return out

  def apply(self, kind: str, seed: int):
    rng = np.random.default_rng(seed)
    live = sorted(self.ref.seqs)
    dead = [i for i in range(self.cfg.max_seqs) if i not in self.ref.seqs]
    getattr(self, kind)(rng, live, dead)

  def _note_new_blocks(self, sid, first_block):
    ps = self.cfg.page_size
    for gid, g in enumerate(self.ref.groups):
      seq = g.seqs[sid]
      for i in range(first_block, len(seq.slots)):
        if seq.slots[i] >= 0:
          self.truth[(gid, seq.slots[i])] = (
              seq.scope, tuple(self.future[sid][:(i + 1) * ps]))

  def _end(self, sid):
    """The running step of `sid` (if any) is over."""
    step = self.step.pop(sid, None)
    if step is not None and any(
        g.seqs[sid].scratch_count for g in self.ref.groups if sid in g.seqs):
      self.reach[sid] = max(self.reach[sid],
                            step[1] - self.cfg.max_rewind_len)

  # --- operations ------------------------------------------------------------
  def claim(self, rng, live, dead):
    cfg = self.cfg
    max_len = cfg.max_seq_len
    ids = self._ids(rng, dead)
    lengths = rng.choice([max_len, 13, 9, 16, 5, 4, 1, 0, max_len + 2], BATCH)
    stems = rng.choice([0, 0, 0, 1, 2], BATCH)
    cuts = rng.choice([max_len, max_len, 16, 9, 4, 0], BATCH)
    scopes = rng.choice([0, 0, 0, 1], BATCH)
    tokens = self.bases[stems].copy()
    for r, cut in enumerate(cuts):
      tokens[r, cut:] = rng.integers(0, 3, max_len - cut)
    self._claim(ids, tokens, lengths, scopes)

  def _claim(self, ids, tokens, lengths, scopes):
    cfg, ps = self.cfg, self.cfg.page_size
    self.state, res = _claim(self.state, _i32(ids), _i32(tokens),
                             _i32(lengths), _i32(scopes),
                             head_of_line=self.head_of_line)
    want = self.ref.claim_batch(ids, tokens, lengths, scopes,
                                head_of_line=self.head_of_line)
    for k, v in want.items():
      assert np.asarray(getattr(res, k)).tolist() == v, (k, res, want)
    for r, sid in enumerate(ids):
      if not want["ok"][r]:
        continue
      reused = want["num_reused_tokens"][r] // ps
      self.future[sid] = tokens[r].copy()
      self._note_new_blocks(sid, reused)
      self.step[sid] = (reused * ps, int(lengths[r]))
      self.promise[sid] = self.reach[sid] = min(
          reused * ps, int(lengths[r]) - cfg.max_rewind_len)

  def extend(self, rng, live, dead):
    cfg = self.cfg
    ids = self._ids(rng, live)
    adds = rng.integers(0, 11, BATCH)
    # The eviction sort under a cond, on every call, or none (free only).
    evict = (True, "branchless", False)[rng.integers(3)]
    valid = self._valid_once(ids, want_live=True)
    lens = [self.ref.seqs[s].length if v else 0 for s, v in zip(ids, valid)]
    computed = None
    if rng.integers(3):
      computed = [L - int(rng.choice([0, 0, 1, 3, 6, -2])) for L in lens]
    before = {sid: len(s.slots) for sid, s in self.ref.seqs.items()}
    for sid, v in zip(ids, valid):
      if v:  # the previous step is over, granted or not
        self._end(sid)
    self.state, res = _extend(
        self.state, _i32(ids), _i32(adds),
        None if computed is None else _i32(computed),
        head_of_line=self.head_of_line, evict=evict)
    want = self.ref.extend(ids, adds, computed,
                           head_of_line=self.head_of_line, evict=bool(evict))
    assert np.asarray(res.ok).tolist() == want["ok"]
    assert np.asarray(res.num_new_blocks).tolist() == want["num_new_blocks"]
    for r, sid in enumerate(ids):
      if not valid[r]:
        continue
      done = lens[r] if computed is None else min(max(computed[r], 0), lens[r])
      first = done - cfg.max_rewind_len
      self.promise[sid] = max(self.promise[sid], first)
      self.reach[sid] = max(self.reach[sid], first)
      if want["ok"][r]:
        self._note_new_blocks(sid, before[sid])
        self.step[sid] = (self.reach[sid], lens[r] + int(adds[r]))

  def commit(self, rng, live, dead):
    m = self.cfg.max_seq_len
    self._commit(self._ids(rng, live), rng.choice([m, m, m - 4, 13, 8, 4, 0],
                                                  BATCH))

  def _commit(self, ids, lengths):
    tokens = np.zeros((BATCH, self.cfg.max_seq_len), np.int32)
    for r, sid in enumerate(ids):
      if sid in self.future:
        tokens[r] = self.future[sid]
    self.state = _commit(self.state, _i32(ids), _i32(tokens), _i32(lengths))
    self.ref.commit(ids, tokens, lengths)

  def served(self, rng, live, dead):
    """A whole request: a prompt from a shared stem is claimed, committed and
    released (its blocks stay cached: later prompts reuse them)."""
    if not dead:
      return
    m = self.cfg.max_seq_len
    ids = [int(rng.choice(dead))] + [-1] * (BATCH - 1)
    tokens = self.bases[rng.integers(len(self.bases), size=BATCH)].copy()
    cut = int(rng.choice([m, 16, 12]))
    tokens[0, cut:] = rng.integers(0, 3, m - cut)
    lengths = [int(rng.choice([m, m - 1, 17, 13])), 0, 0]
    self._claim(ids, tokens, lengths, [0] * BATCH)
    self._commit(ids, lengths)
    self._release(ids)

  def release(self, rng, live, dead):
    ids = self._ids(rng, live)
    if rng.integers(4) == 0:  # a duplicate: released once, never leaked
      ids[-1] = ids[0]
    self._release(ids)

  def _release(self, ids):
    self.state = cache.release(self.state, _i32(ids))
    self.ref.release(ids)
    for sid in ids:
      self.step.pop(sid, None)
      self.promise.pop(sid, None)
      self.reach.pop(sid, None)
      if sid >= 0:
        assert sid not in self.ref.seqs

  def finish(self, rng, live, dead):
    ids = self._ids(rng, live)
    valid = self._valid_once(ids, want_live=True, dedupe=True)
    for r, sid in enumerate(ids):
      if valid[r]:
        self._end(sid)
    self.state = cache.finish_step(self.state, _i32(ids))
    self.ref.finish_step(ids)

  def fork(self, rng, live, dead):
    cfg, ps = self.cfg, self.cfg.page_size
    parents, children = self._ids(rng, live), self._ids(rng, dead)
    self.state, res = _fork(self.state, _i32(parents), _i32(children),
                            head_of_line=self.head_of_line)
    want = self.ref.fork(parents, children, head_of_line=self.head_of_line)
    assert np.asarray(res.ok).tolist() == want["ok"]
    src = np.asarray(res.src_pages).reshape(BATCH, -1)
    dst = np.asarray(res.dst_pages).reshape(BATCH, -1)
    for r, copies in enumerate(want["copies"]):
      if copies is None:
        assert (src[r] == -1).all() and (dst[r] == -1).all()
        continue
      exp_src, exp_dst = [], []
      for gid, s, d in copies:
        width = 2 * cfg.groups[gid].num_layers
        base = cfg.group_page_base[gid]
        exp_src.extend(base + s * width + np.arange(width))
        exp_dst.extend(base + d * width + np.arange(width))
      np.testing.assert_array_equal(src[r], exp_src)
      np.testing.assert_array_equal(dst[r], exp_dst)
    for r, ok in enumerate(want["ok"]):
      if ok:
        child, parent = children[r], parents[r]
        length = self.ref.seqs[child].length
        fut = self.future[parent].copy()
        fut[length:] = rng.integers(0, 3, cfg.max_seq_len - length)
        self.future[child] = fut
        self.promise[child] = self.promise[parent]
        # The child runs no step: it never sees the parent's scratch blocks.
        step = self.step.get(parent)
        scratch = step is not None and any(
            g.seqs[parent].scratch_count for g in self.ref.groups)
        self.reach[child] = max(self.reach[parent], step[1] - (
            cfg.max_rewind_len) if scratch else self.reach[parent])
        self._note_new_blocks(child, length // ps)

  # --- the visibility oracle -------------------------------------------------
  def check_visibility(self):
    """What each live sequence must (and may) map, from the definitions.

    For model layer `l` of group `g` (window `w`; key `j` visible to the
    query at `p` iff `p - w <= j <= p`, `w = -1`: all `j <= p`):
      * blocks from `max(reach - w, 0) // page_size` to the last are mapped
        to this layer's page of a group-`g` slot holding the sequence's
        tokens;
      * a sliding layer maps no block before `max(promise - w, 0) //
        page_size` (released), except the running step's scratch blocks;
      * the running step (queries `history .. capacity - 1`) sees blocks from
        `max(history - w, 0) // page_size` on: mapped; a scratch block (no
        slot) to a page no other live block maps in this layer, of a slot
        that holds no sequence's block.
    """
    cfg, ps = self.cfg, self.cfg.page_size
    tables = np.asarray(_tables(self.state))  # [num_layers, max_seqs, pages]
    for layer, w in enumerate(cfg.layer_windows):
      gid, j = cfg.layer_group[layer], cfg.layer_index[layer]
      g, nl = self.ref.groups[gid], cfg.groups[gid].num_layers
      base = cfg.group_page_base[gid]
      normal = {s for seq in g.seqs.values() for s in seq.slots if s >= 0}
      holders = collections.Counter(
          int(p) for sid in g.seqs for p in tables[layer, sid] if p >= 0)

      def decode(page, own_layer=True):
        """The group slot of a K page (of this layer's sub-page unless a
        scratch page: those rotate over the group's layers)."""
        assert page >= base and (page - base) % 2 == 0, page
        slot, sub = divmod((page - base) // 2, nl)
        assert slot < cfg.group_num_slots[gid], (page, slot)
        assert sub == j or not own_layer, (page, slot, sub)
        return slot

      for sid, seq in g.seqs.items():
        row = tables[layer, sid]
        nb = _cdiv(seq.length, ps)
        assert (row[nb:] == -1).all(), (sid, row)
        step = self.step.get(sid)
        scratch = (set(range(seq.scratch_first,
                             seq.scratch_first + seq.scratch_count))
                   if step else set())
        lo = 0 if w < 0 else max(self.reach[sid] - w, 0) // ps
        gone = 0 if w < 0 else max(self.promise[sid] - w, 0) // ps
        for b in range(nb):
          if b < gone:
            assert row[b] == -1 or b in scratch, (sid, b, row, gone)
          if b < lo:
            continue
          assert row[b] >= 0, (sid, layer, b, row, lo)
          if seq.slots[b] >= 0:
            assert decode(int(row[b])) == seq.slots[b], (sid, b, row)
            assert self.truth.get((gid, seq.slots[b])) == (
                seq.scope, tuple(self.future[sid][:(b + 1) * ps])), (sid, b)
        if step is None:
          assert not scratch
          continue
        history, capacity = step
        for b in range(0 if w < 0 else max(history - w, 0) // ps,
                       _cdiv(capacity, ps)):
          page = int(row[b])
          assert page >= 0, (sid, b, row, step)
          if seq.slots[b] < 0:
            assert b in scratch, (sid, b)
            assert holders[page] == 1, (sid, b, page)
            assert decode(page, False) not in normal, (sid, b, page)


@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=NUM_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_random_ops_match_reference(name, data):
  run = _Run(name)
  for _ in range(data.draw(st.integers(5, 10), label="num_ops")):
    kind = data.draw(st.sampled_from(_KINDS))
    run.apply(kind, data.draw(st.integers(0, 2**16)))
    assert_same(run.state, run.ref)
    run.check_visibility()
  assert_same(run.state, run.ref, with_stats=True)
  ids = np.arange(-1, run.cfg.max_seqs + 1)
  for layer in range(run.cfg.num_layers):
    for split in (True, False):
      actual = cache.page_table(run.state, _i32(ids), layer, split=split)
      expected = run.ref.page_table(ids, layer, split=split)
      np.testing.assert_array_equal(actual, expected)
  traces = {k: v for k, v in _TRACES.items() if k[1] == run.cfg}
  assert max(traces.values()) == 1, traces
