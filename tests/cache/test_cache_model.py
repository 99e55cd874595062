"""Random operation sequences: the jitted cache vs the pure-Python model.

Three configs, all with `enable_swa_scratch_reuse` on: one mixed (a windowed
and a full layer: scratch inactive, the plain path), two all-windowed (scratch
active; one with three windows and `max_rewind_len`). After every step: the
device state equals the model slot for slot (`cache_asserts.assert_same`:
tables, lengths, refcounts, publication, LRU clocks, generations, scratch),
`cache.validate` passes, per-request results agree, every reused block
really holds the request's prefix, and a visibility oracle built from the
attention semantics alone holds (`_check_visibility`): every block a current
or future query can see is mapped to a slot holding that sequence's tokens;
scratch blocks are mapped only while their step runs, to pages no one else
holds.

Arguments of each operation come from a numpy generator seeded by a drawn
integer (two hypothesis draws per operation keep an example cheap); the
operation kinds and seeds still shrink.
"""

from __future__ import annotations

import collections
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pkvattn import cache
from pkvattn.cache import alloc
from pkvattn.cache import claim
from pkvattn.cache import forking
from pkvattn.cache import publish
from pkvattn.cache import reference
from pkvattn.cache.validate import CacheInvariantError
from pkvattn.cache.validate import validate as validate_flat
from cache_asserts import assert_same

CONFIGS = {
    # One windowed and one full layer: scratch stays inactive.
    "mixed": cache.CacheConfig(
        num_slots=16, page_size=4, num_layers=2, max_seqs=6, max_pages=6,
        hash_ways=16, layer_windows=(5, -1), enable_swa_scratch_reuse=True),
    "swa": cache.CacheConfig(
        num_slots=12, page_size=4, num_layers=2, max_seqs=5, max_pages=6,
        hash_ways=12, layer_windows=(5, 3), enable_swa_scratch_reuse=True),
    "swa_rewind": cache.CacheConfig(
        num_slots=12, page_size=4, num_layers=3, max_seqs=5, max_pages=6,
        hash_ways=12, layer_windows=(6, 2, 9), enable_swa_scratch_reuse=True,
        max_rewind_len=2),
}
# Admission policy of each config's claim / extend / fork (static arguments;
# every combination is also covered by tests/test_cache_reliability.py).
POLICY = {"mixed": True, "swa": False, "swa_rewind": True}  # head_of_line
BATCH = 3
# Examples per config (CI: 3 x 120 = 360 operation sequences, all with
# scratch reuse enabled, 240 of them with scratch active; more with
# PKV_CACHE_EXAMPLES).
NUM_EXAMPLES = int(os.environ.get("PKV_CACHE_EXAMPLES", "120"))

assert not CONFIGS["mixed"].swa_scratch_active
assert CONFIGS["swa"].swa_scratch_active
assert CONFIGS["swa_rewind"].swa_scratch_active

# Traces per (op, config, static arguments): every jitted op must be traced
# once for the whole run, whatever the batch values.
_TRACES: collections.Counter = collections.Counter()


def _counted(name, fn):
  def traced(state, *args, **statics):
    _TRACES[(name, state.config, tuple(sorted(statics.items())))] += 1
    return fn(state, *args, **statics)
  return traced


_claim = jax.jit(_counted("claim", claim.claim_batch.__wrapped__),
                 static_argnames=("head_of_line", "evict"))
_extend = jax.jit(_counted("extend", alloc.extend.__wrapped__),
                  static_argnames=("head_of_line", "evict"))
_commit = jax.jit(_counted("commit", publish.commit.__wrapped__))
_release = jax.jit(_counted("release", alloc.release.__wrapped__))
_finish = jax.jit(_counted("finish", alloc.finish_step.__wrapped__))
_fork = jax.jit(_counted("fork", forking.fork.__wrapped__),
                static_argnames=("head_of_line",))


@jax.jit
def _tables(state):
  """K pages of every layer: `i32[num_layers, max_seqs, max_pages]`."""
  cfg = state.config
  ids = jnp.arange(cfg.max_seqs, dtype=jnp.int32)
  return jax.vmap(lambda layer: cache.page_table(state, ids, layer)[:, 0])(
      jnp.arange(cfg.num_layers, dtype=jnp.int32))


_KINDS = ("claim", "claim", "extend", "extend", "commit", "commit", "release",
          "finish", "fork")


def _i32(x):
  return jnp.asarray(np.asarray(x, np.int32))


def _cdiv(a, b):
  return -(-a // b)


class _Run:
  """Drives both implementations and tracks, independently of either, what
  every slot holds (`truth`) and which step each sequence runs (`step`)."""

  def __init__(self, name: str):
    self.cfg = CONFIGS[name]
    self.head_of_line = POLICY[name]
    self.state = cache.init_cache(self.cfg)
    self.ref = reference.ReferenceCache(self.cfg)
    self.bases = np.random.default_rng(0).integers(
        0, 3, size=(3, self.cfg.max_seq_len))  # shared stems: prefixes collide
    self.future: dict[int, np.ndarray] = {}  # sid -> all tokens it will hold
    self.truth: dict[int, tuple] = {}        # slot -> (scope, token prefix)
    self.step: dict[int, tuple[int, int]] = {}  # sid -> (history, capacity)

  # --- argument drawing ------------------------------------------------------
  def _ids(self, rng, pool):
    """BATCH distinct ids from `pool`, padded with -1; sometimes one entry is
    replaced by an arbitrary (possibly invalid or duplicate) id."""
    ids = [int(x) for x in rng.permutation(pool)[:BATCH]] if pool else []
    ids += [-1] * (BATCH - len(ids))
    if rng.integers(4) == 0:
      ids[rng.integers(BATCH)] = int(rng.integers(-1, self.cfg.max_seqs + 1))
    return ids

  def apply(self, kind: str, seed: int):
    rng = np.random.default_rng(seed)
    live = sorted(self.ref.seqs)
    dead = [i for i in range(self.cfg.max_seqs) if i not in self.ref.seqs]
    getattr(self, kind)(rng, live, dead)

  def _valid_once(self, ids, want_live, dedupe=False):
    """Ids an op acts on: in range, right liveness, listed once (dedupe: the
    first occurrence)."""
    out = []
    for r, sid in enumerate(ids):
      ok = 0 <= sid < self.cfg.max_seqs and (sid in self.ref.seqs) == want_live
      once = sid not in ids[:r] if dedupe else ids.count(sid) == 1
      out.append(ok and once)
    return out

  def _note_new_blocks(self, sid, first_block):
    row = self.ref.seq_row(sid)
    scope = self.ref.seqs[sid].scope
    ps = self.cfg.page_size
    for i in range(first_block, len(self.ref.seqs[sid].slots)):
      if row[i] >= 0:  # scratch blocks (-1) hold nothing past their step
        self.truth[row[i]] = (scope, tuple(self.future[sid][:(i + 1) * ps]))

  # --- operations ------------------------------------------------------------
  def claim(self, rng, live, dead):
    cfg, ps = self.cfg, self.cfg.page_size
    max_len = cfg.max_seq_len
    ids = self._ids(rng, dead)
    lengths = rng.choice([max_len, 13, 9, 16, 5, 4, 1, 0, max_len + 2], BATCH)
    stems = rng.choice([0, 0, 0, 1, 2], BATCH)
    cuts = rng.choice([max_len, max_len, 16, 9, 4, 0], BATCH)
    scopes = rng.choice([0, 0, 0, 1], BATCH)
    tokens = self.bases[stems].copy()
    for r, cut in enumerate(cuts):
      tokens[r, cut:] = rng.integers(0, 3, max_len - cut)
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
      row = self.ref.seq_row(sid)
      for i in range(reused):  # reuse only of the exact prefix and scope
        assert self.truth[row[i]] == (scopes[r],
                                      tuple(tokens[r][:(i + 1) * ps]))
      self.future[sid] = tokens[r].copy()
      self._note_new_blocks(sid, reused)
      self.step[sid] = (reused * ps, int(lengths[r]))

  def extend(self, rng, live, dead):
    ids = self._ids(rng, live)
    adds = rng.integers(0, 11, BATCH)
    # The eviction sort under a cond, on every call, or none (free only).
    evict = (True, "branchless", False)[rng.integers(3)]
    before = {sid: (len(s.slots), s.length) for sid, s in self.ref.seqs.items()}
    valid = self._valid_once(ids, want_live=True)
    self.state, res = _extend(self.state, _i32(ids), _i32(adds),
                              head_of_line=self.head_of_line, evict=evict)
    want = self.ref.extend(ids, adds, head_of_line=self.head_of_line,
                           evict=bool(evict))
    assert np.asarray(res.ok).tolist() == want["ok"]
    assert np.asarray(res.num_new_blocks).tolist() == want["num_new_blocks"]
    for r, sid in enumerate(ids):
      if valid[r]:  # the previous step is over, granted or not
        self.step.pop(sid, None)
      if want["ok"][r]:
        self._note_new_blocks(sid, before[sid][0])
        self.step[sid] = (before[sid][1], before[sid][1] + int(adds[r]))

  def commit(self, rng, live, dead):
    ids = self._ids(rng, live)
    lengths = rng.choice([28, 28, 24, 13, 8, 4, 0], BATCH)
    tokens = np.zeros((BATCH, self.cfg.max_seq_len), np.int32)
    for r, sid in enumerate(ids):
      if sid in self.future:
        tokens[r] = self.future[sid]
    self.state = _commit(self.state, _i32(ids), _i32(tokens), _i32(lengths))
    self.ref.commit(ids, tokens, lengths)

  def release(self, rng, live, dead):
    ids = self._ids(rng, live)
    if rng.integers(4) == 0:  # a duplicate: released once, never leaked
      ids[-1] = ids[0]
    self.state = _release(self.state, _i32(ids))
    self.ref.release(ids)
    for sid in ids:
      self.step.pop(sid, None)
      if sid >= 0:
        assert sid not in self.ref.seqs

  def finish(self, rng, live, dead):
    ids = self._ids(rng, live)
    valid = self._valid_once(ids, want_live=True, dedupe=True)
    self.state = _finish(self.state, _i32(ids))
    self.ref.finish_step(ids)
    for r, sid in enumerate(ids):
      if valid[r]:
        self.step.pop(sid, None)

  def fork(self, rng, live, dead):
    cfg, ps = self.cfg, self.cfg.page_size
    parents, children = self._ids(rng, live), self._ids(rng, dead)
    self.state, res = _fork(self.state, _i32(parents), _i32(children),
                            head_of_line=self.head_of_line)
    want = self.ref.fork(parents, children, head_of_line=self.head_of_line)
    assert np.asarray(res.ok).tolist() == want["ok"]
    src = np.asarray(res.src_pages).reshape(BATCH, -1)
    dst = np.asarray(res.dst_pages).reshape(BATCH, -1)
    sub = np.arange(2 * cfg.num_layers)
    for r, copy in enumerate(want["copies"]):
      if copy is None:
        assert (src[r] == -1).all() and (dst[r] == -1).all()
      else:
        np.testing.assert_array_equal(src[r], copy[0] * 2 * cfg.num_layers + sub)
        np.testing.assert_array_equal(dst[r], copy[1] * 2 * cfg.num_layers + sub)
      if want["ok"][r]:
        child, parent = children[r], parents[r]
        length = self.ref.seqs[child].length
        fut = self.future[parent].copy()
        fut[length:] = rng.integers(0, 3, cfg.max_seq_len - length)
        self.future[child] = fut
        self._note_new_blocks(child, length // ps)

  # --- the visibility oracle -------------------------------------------------
  def check_visibility(self):
    """What each live sequence must be able to read, from the definitions.

    For layer `l` with window `w` (key `j` visible to the query at `p` iff
    `p - w <= j <= p`; `w = -1`: all `j <= p`):
      * future queries (positions `>= length - max_rewind_len`) see blocks
        from `(length - max_rewind_len - w) // page_size` on: each is mapped
        to this layer's page of a slot holding the sequence's tokens;
      * the running step (queries at `history .. capacity - 1`) sees blocks
        from `(history - w) // page_size` to `cdiv(capacity, page_size)`: all
        mapped; normal ones as above (a block the step writes may be shared,
        by `fork`, only with sequences that expect the same tokens there:
        one `truth` per slot); scratch ones (no slot) to a page that no other
        block of any live sequence maps to in this layer, of a slot that
        holds no sequence's block;
      * with no running step, every mapped page is the block's own slot (no
        scratch page outlives its step).
    """
    cfg, ps, nl = self.cfg, self.cfg.page_size, self.cfg.num_layers
    tables = np.asarray(_tables(self.state))  # [nl, max_seqs, max_pages]
    seqs = self.ref.seqs
    normal = {s for seq in seqs.values() for s in seq.slots if s >= 0}
    for layer, w in enumerate(cfg.layer_windows):
      holders = collections.Counter(
          int(p) for sid in seqs for p in tables[layer, sid] if p >= 0)

      def own(sid, b, page):
        slot, sub = divmod(page // 2, nl)
        assert page % 2 == 0 and sub == layer, (sid, b, page)
        assert self.truth.get(slot) == (
            seqs[sid].scope, tuple(self.future[sid][:(b + 1) * ps])), (
                sid, b, slot)

      for sid, seq in seqs.items():
        row = tables[layer, sid]
        nb = _cdiv(seq.length, ps)
        assert (row[nb:] == -1).all(), (sid, row)
        first_query = max(seq.length - cfg.max_rewind_len, 0)
        lo = 0 if w < 0 else max(first_query - w, 0) // ps
        for b in range(lo, nb):
          assert row[b] >= 0, (sid, b, row)
          own(sid, b, int(row[b]))
        if sid not in self.step:
          for b in range(nb):
            if row[b] >= 0:
              assert row[b] == (seq.slots[b] * nl + layer) * 2, (sid, b, row)
          continue
        history, capacity = self.step[sid]
        lo = 0 if w < 0 else max(history - w, 0) // ps
        for b in range(lo, _cdiv(capacity, ps)):
          page = int(row[b])
          assert page >= 0, (sid, b, row, self.step[sid])
          if seq.slots[b] >= 0:
            own(sid, b, page)
          else:
            assert holders[page] == 1, (sid, b, page)
            assert page // (2 * nl) not in normal, (sid, b, page)


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


def test_validate_catches_corruption():
  run = _Run("mixed")
  run.state, _ = _claim(run.state, _i32([0, 1, -1]),
                        _i32(run.bases[[0, 1, 0]]), _i32([9, 5, 0]),
                        _i32([0, 0, 0]), head_of_line=True)
  cache.validate(run.state)
  bad = dataclasses.replace(run.state, slot_refcount=run.state.slot_refcount.at[
      int(run.state.seq_slots[0, 0])].add(1))
  with pytest.raises(ValueError, match="refcount"):
    cache.validate(bad)
  stolen = dataclasses.replace(run.state, seq_slots=run.state.seq_slots.at[
      1, 0].set(run.state.seq_slots[0, 2]))
  with pytest.raises(ValueError):
    cache.validate(stolen)


def _published_state(rng):
  """No windows: seq 0 (14 tokens, 3 full blocks published, a partial one),
  seq 2 reusing its first 2 blocks (9 tokens), seq 1 released after
  publishing its own tail (cached slots); seqs 1 and 3 dead."""
  cfg = cache.CacheConfig(num_slots=10, page_size=4, num_layers=2, max_seqs=4,
                          max_pages=5, hash_ways=4)
  a = rng.integers(1, 100, 20)
  b = np.concatenate([a[:8], rng.integers(100, 200, 12)])
  toks = _i32(np.stack([a, b, a]))
  st = cache.init_cache(cfg)
  st, _ = cache.claim_batch(st, _i32([0]), toks[:1], _i32([14]))
  st = cache.commit(st, _i32([0]), toks[:1], _i32([14]))
  st, res = cache.claim_batch(st, _i32([1, 2]), toks[1:], _i32([20, 9]))
  assert res.num_reused_tokens.tolist() == [8, 8]
  st = cache.commit(st, _i32([1]), toks[1:2], _i32([20]))
  return cache.release(st, _i32([1]))


def _scratch_state(rng, windows=(3, 3), grow=13):
  """Scratch active: seq 0 grown 6 -> 6 + grow tokens (with window 3 and
  `grow=13`, scratch blocks [2, 4) in one slot), seq 1 live with 0 tokens, seq 2 at capacity (24 tokens,
  scratch blocks [0, 5) in 3 slots); seq 3 dead."""
  cfg = cache.CacheConfig(num_slots=12, page_size=4, num_layers=2, max_seqs=4,
                          max_pages=6, hash_ways=4, layer_windows=windows,
                          enable_swa_scratch_reuse=True)
  st = cache.init_cache(cfg)
  toks = _i32(rng.integers(1, 100, (3, 24)))
  st, res = cache.claim_batch(st, _i32([0, 1, 2]), toks, _i32([6, 0, 24]))
  assert res.ok.tolist() == [True] * 3
  st, res = cache.extend(st, _i32([0]), _i32([grow]))
  assert res.ok.tolist() == [True]
  return st


def test_validate_names_each_broken_invariant(rng):
  """`validate` passes on valid states (edge lengths 0 and capacity, scratch
  ranges, shared and cached blocks) and, on a state broken one invariant at a
  time, raises naming that invariant."""
  pub, scr = _published_state(rng), _scratch_state(rng)
  for state in (pub, scr, cache.init_cache(pub.config)):
    cache.validate(state)
  assert scr.seq_scratch_first.tolist() == [2, 0, 0, 0]
  assert scr.seq_scratch_count.tolist() == [2, 0, 5, 0]
  assert scr.seq_lens.tolist() == [19, 0, 24, 0]
  # Window 0: the step's last blocks are scratch ([2, 4) of 4 blocks).
  w0 = _scratch_state(rng, windows=(0, 0), grow=10)
  cache.validate(w0)
  assert (int(w0.seq_scratch_first[0]), int(w0.seq_scratch_count[0]),
          int(w0.seq_lens[0])) == (2, 2, 16)

  row0, row2 = pub.seq_slots[0].tolist(), pub.seq_slots[2].tolist()
  shared, partial0, partial2 = row0[1], row0[3], row2[2]
  cached = [s for s in range(10) if bool(pub.slot_published[s])
            and int(pub.slot_refcount[s]) == 0]
  free = [s for s in range(10) if not bool(pub.slot_published[s])
          and int(pub.slot_refcount[s]) == 0]
  c0, c1 = cached[:2]
  assert pub.config.num_buckets == 16
  table = pub.hash_table.reshape(-1)
  empty = int(np.flatnonzero(np.asarray(table) < 0)[0])
  p1 = int(pub.slot_hash_pos[c1])
  u32 = jnp.uint32

  def at(st, name, index, value, add=False):
    a = getattr(st, name).at[index]
    return (st, {name: a.add(value) if add else a.set(value)})

  def flat(value, pos=empty):
    return (pub, {"hash_table": table.at[pos].set(value).reshape(
        pub.hash_table.shape)})

  cases = [
      ((pub, {"slot_refcount": pub.slot_refcount.astype(jnp.float32)}),
       r"slot_refcount: expected int32\[10\], got float32\[10\]"),
      ((pub, {"seq_lens": pub.seq_lens[:3]}),
       r"seq_lens: expected int32\[4\], got int32\[3\]"),
      (at(pub, "seq_slots", (1, 4), free[0]),
       "seq 1: dead but holds blocks or length 0"),
      (at(pub, "seq_lens", 1, 4), "seq 1: dead but holds blocks or length 4"),
      (at(pub, "seq_scratch_slots", (3, 2), free[0]),
       "seq 3: dead but holds scratch"),
      (at(pub, "seq_scratch_count", 3, 1), "seq 3: dead but holds scratch"),
      (at(pub, "seq_scratch_first", 3, 1), "seq 3: dead but holds scratch"),
      (at(pub, "seq_lens", 2, 21), r"seq 2: length 21 out of \[0, 20\]"),
      (at(pub, "seq_lens", 2, -1), r"seq 2: length -1 out of \[0, 20\]"),
      (at(pub, "seq_slots", (2, 1), -1),
       "seq 2: invalid slot in its first 3 blocks"),
      (at(pub, "seq_slots", (2, 2), 10),
       "seq 2: invalid slot in its first 3 blocks"),
      (at(pub, "seq_scratch_count", 0, 1),
       r"seq 0: scratch count 1 \(scratch active: False\)"),
      (at(pub, "seq_scratch_count", 0, -1), "seq 0: scratch count -1"),
      (at(pub, "seq_scratch_slots", (0, 2), free[0]),
       "seq 0: no scratch blocks but scratch"),
      (at(pub, "seq_scratch_first", 0, 1),
       "seq 0: no scratch blocks but scratch"),
      (at(pub, "seq_slots", (2, 3), free[0]),
       r"seq 2: blocks past cdiv\(len, page_size\)=3"),
      (at(pub, "seq_slots", (2, 1), row2[0]), "seq 2: a slot appears twice"),
      (at(pub, "slot_refcount", shared, 1, add=True),
       f"slot {shared}: refcount 3 but 2 holders"),
      ((pub, {"seq_slots": pub.seq_slots.at[2, 2].set(partial0),
              "slot_refcount": pub.slot_refcount.at[partial0].add(1)
                               .at[partial2].add(-1)}),
       f"slot {partial0}: shared or published but the partial block 3 of "
       "seq 0"),
      (at(pub, "slot_published", partial2, True),
       f"slot {partial2}: shared or published but the partial block 2 of "
       "seq 2"),
      (flat(10), rf"hash_table\[{empty}\] = 10 is not a slot id"),
      (flat(free[0]),
       rf"hash_table\[{empty}\] = slot {free[0]}, which is not published"),
      (at(pub, "slot_hash_pos", c1, empty),
       rf"slot {c1}: slot_hash_pos {empty} but in hash_table\[{p1}\]"),
      # Bucket = key word 0 & (num_buckets - 1); hash_ways 4 per bucket.
      (at(pub, "slot_key", (c1, 0), pub.slot_key[c1, 0] ^ u32(1)),
       f"slot {c1}: key bucket {(int(pub.slot_key[c1, 0]) ^ 1) % 16} but "
       f"stored in bucket {p1 // 4}"),
      (flat(-1, p1), f"slot {c1}: published but in the hash table 0 times"),
      (flat(c1), f"slot {c1}: published but in the hash table 2 times"),
      (at(pub, "slot_hash_pos", free[0], 3),
       f"slot {free[0]}: unpublished with slot_hash_pos 3"),
      (at(pub, "slot_key", c0, pub.slot_key[c1]),
       "two published slots share a key"),
      (at(pub, "slot_parent", c1, -2), "published slot with an invalid parent"),
      (at(pub, "slot_parent", c1, 10), "published slot with an invalid parent"),
      (at(pub, "slot_depth", c1, 5), "published slot with an invalid depth"),
      (at(pub, "slot_depth", c1, -1), "published slot with an invalid depth"),
      (at(pub, "slot_depth", row0[0], 1), "published slot with an invalid depth"),
      (at(pub, "slot_depth", shared, 0), "published slot with an invalid depth"),
      ((pub, {"num_hits": pub.num_lookups + 1}), "counters"),
      ((pub, {"num_hits": jnp.int32(-1)}), "counters"),
      ((pub, {"num_lookups": jnp.int32(-1), "num_hits": jnp.int32(-2)}),
       "counters"),
      (at(pub, "slot_refcount", free[0], -1), "negative refcount"),
      # Scratch: seq 0 holds blocks [0, 5) of 19 tokens, window 3: blocks
      # 0-3 are out of every later query's window, block 4 is not.
      (at(scr, "seq_slots", (0, 4), -1),
       "seq 0: invalid slot in its first 5 blocks"),
      (at(scr, "seq_scratch_first", 0, 1),
       r"seq 0: scratch blocks \[1, 3\) not -1 blocks of its 5"),
      (at(scr, "seq_scratch_first", 0, -1),
       r"seq 0: scratch blocks \[-1, 1\) not -1 blocks of its 5"),
      (at(w0, "seq_scratch_first", 0, 3),
       r"seq 0: scratch blocks \[3, 5\) not -1 blocks of its 4"),
      (at(scr, "seq_lens", 0, 17),
       r"seq 0: scratch blocks \[2, 4\) visible to a query at or after 17"),
      (at(scr, "seq_scratch_slots", (0, 1), 8),
       "seq 0: expected 1 distinct scratch slots"),
      (at(scr, "seq_scratch_slots", (0, 0), -1),
       "seq 0: expected 1 distinct scratch slots"),
      (at(scr, "seq_scratch_slots", (0, 0), 12),
       "seq 0: expected 1 distinct scratch slots"),
      (at(scr, "seq_scratch_slots", (2, 1), -1),
       "seq 2: expected 3 distinct scratch slots"),
      (at(scr, "seq_scratch_slots", (2, 1), 12),
       "seq 2: expected 3 distinct scratch slots"),
      (at(scr, "seq_scratch_slots", (2, 1), int(scr.seq_scratch_slots[2, 0])),
       "seq 2: expected 3 distinct scratch slots"),
      ((scr, {"seq_scratch_slots": scr.seq_scratch_slots.at[2, 0].set(
          int(scr.seq_scratch_slots[0, 0])),
              "slot_refcount": scr.slot_refcount.at[
                  scr.seq_scratch_slots[0, 0]].add(1).at[
                      scr.seq_scratch_slots[2, 0]].add(-1)}),
       f"slot {int(scr.seq_scratch_slots[0, 0])}: a scratch slot shared"),
      # A scratch slot that is also another sequence's normal block.
      ((scr, {"seq_scratch_slots": scr.seq_scratch_slots.at[2, 0].set(
          int(scr.seq_slots[0, 0])),
              "slot_refcount": scr.slot_refcount.at[scr.seq_slots[0, 0]].add(
                  1).at[scr.seq_scratch_slots[2, 0]].add(-1)}),
       f"slot {int(scr.seq_slots[0, 0])}: a scratch slot shared"),
      (at(scr, "slot_published", int(scr.seq_scratch_slots[0, 0]), True),
       f"slot {int(scr.seq_scratch_slots[0, 0])}: a scratch slot shared or "
       "published"),
  ]
  for (state, change), message in cases:
    with pytest.raises(CacheInvariantError, match=message):
      cache.validate(dataclasses.replace(state, **change))


def test_validate_lists_only_the_broken_invariant(rng):
  """One line per broken invariant: a single corruption, with the refcounts
  following it, raises exactly that line; an invalid (-1) slot id is never
  counted as a holder of some slot, and a scratch range starting before
  block 0 is refused even when the blocks it covers are -1 and out of every
  window."""
  pub, scr = _published_state(rng), _scratch_state(rng)

  def drop(st, name, index):
    s = int(getattr(st, name)[index])
    return dataclasses.replace(
        st, **{name: getattr(st, name).at[index].set(-1),
               "slot_refcount": st.slot_refcount.at[s].add(-1)})

  assert scr.seq_scratch_count[2] == 5 and scr.seq_lens[2] == 24
  cases = [
      (drop(pub, "seq_slots", (2, 1)),
       "seq 2: invalid slot in its first 3 blocks"),
      (drop(scr, "seq_scratch_slots", (0, 0)),
       "seq 0: expected 1 distinct scratch slots"),
      # Seq 2's scratch blocks [0, 5) are all -1 and out of the window, so
      # only the range's own bound catches a first of -1.
      (dataclasses.replace(scr, seq_scratch_first=scr.seq_scratch_first
                           .at[2].set(-1)),
       "seq 2: scratch blocks [-1, 4) not -1 blocks of its 6"),
  ]
  for state, line in cases:
    with pytest.raises(CacheInvariantError) as e:
      validate_flat(state)
    lines = str(e.value).splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), lines


def test_validate_window_holes_and_anchors(rng):
  """A sliding group's state (`allow_window_holes`) may hold -1 exactly at
  the blocks no later query sees: `(b + 1) * page_size <= length -
  max_rewind_len - max(layer_windows)`, only when every layer is windowed;
  with `anchor_num_slots`, a published slot's parent is an anchor slot id in
  `[0, anchor_num_slots)`."""
  for windows, holes in (((0, 6), {0, 1}), ((6, -1), set())):
    # 16 tokens, rewind 2, widest window 6: blocks 0, 1 end at or before 8.
    cfg = cache.CacheConfig(num_slots=8, page_size=4, num_layers=2,
                            max_seqs=2, max_pages=5, layer_windows=windows,
                            max_rewind_len=2)
    st, _ = cache.claim_batch(cache.init_cache(cfg), _i32([0]),
                              _i32(rng.integers(1, 100, (1, 20))), _i32([16]))
    for b in range(4):
      s = int(st.seq_slots[0, b])
      hole = dataclasses.replace(
          st, seq_slots=st.seq_slots.at[0, b].set(-1),
          slot_refcount=st.slot_refcount.at[s].add(-1))
      with pytest.raises(CacheInvariantError, match="invalid slot"):
        cache.validate(hole)
      if b in holes:
        validate_flat(hole, allow_window_holes=True)
      else:
        with pytest.raises(CacheInvariantError, match="invalid slot"):
          validate_flat(hole, allow_window_holes=True)

  pub = _published_state(rng)
  published = np.flatnonzero(np.asarray(pub.slot_published))
  parents = pub.slot_parent.at[published].set(5).at[published[0]].set(0)
  anchored = dataclasses.replace(pub, slot_parent=parents)
  validate_flat(anchored, anchor_num_slots=6)
  for parent in (-1, 6):
    bad = dataclasses.replace(
        anchored, slot_parent=parents.at[published[1]].set(parent))
    with pytest.raises(CacheInvariantError,
                       match="published slot with an invalid anchor"):
      validate_flat(bad, anchor_num_slots=6)
