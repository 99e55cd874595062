"""`commit` (`cache/publish.py`) on scripted batches, against the
pure-Python model and the prefix-caching semantics it implements.

As in vLLM's prefix caching only full blocks are published: block `i` of
sequence `r` when `i < min(lengths[r], seq_lens, max_len) // page_size`,
each the child of the block before (`slot_parent`, at that parent's
generation `slot_parent_gen`) at depth `i`. Checked here: each of the three
bounds on the published blocks (a token row one block wide included); rows
wider than `max_pages * page_size`; a second commit going on from the chain
published by the first; two sequences with one prefix in one call (the
first in row-major order wins, the other is a twin at its next commit); a
full hash bucket (the blocks without a way, and every later block of their
sequence, stay unpublished; free ways go to earlier requests first);
two keys equal in one u32 lane only (distinct keys, both published); SWA
scratch blocks stopping a chain even where another sequence published
their tokens;
refused ids leaving the state unchanged; a later claim of a committed
prompt reusing its blocks (the hash table was written); an orphan (its
parent evicted) in slot 0 (a slot like any other: -1 is the no-block id)
published again in place, taking no free way, then its chain committed
again and served whole, or replaced by another sequence's blocks (in a
hybrid cache's sliding group too); and a sliding group leaving its own
published slots as they are. Each step is also compared with `cache/reference.py`
(`reference_hybrid.py`) slot for slot (`cache_asserts.assert_same`), or,
where a bucket can overflow, checked by `cache.validate`.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np

from pkvattn import cache
from pkvattn.cache import hashing
from cache_asserts import Lockstep

PS = 4
CFG = cache.CacheConfig(num_slots=16, page_size=PS, num_layers=2, max_seqs=4,
                        max_pages=4)
WIDTH = PS * CFG.max_pages


def _prompt(seed):
  return np.random.default_rng(seed).integers(1, 1000, WIDTH).astype(np.int32)


def _published(st, sid):
  """Published flags of sequence `sid`'s blocks (its row up to the first
  -1)."""
  row = [int(s) for s in st.seq_slots[sid] if s >= 0]
  return [bool(st.slot_published[s]) for s in row]


def _assert_chain(st, sid, num_blocks):
  """Blocks `0..num_blocks-1` of `sid` form a published chain: depth `i`,
  parent the slot of block `i - 1` (-1 for the first) at its generation."""
  row = [int(s) for s in st.seq_slots[sid]]
  for i in range(num_blocks):
    s = row[i]
    assert bool(st.slot_published[s]), (sid, i)
    assert int(st.slot_depth[s]) == i, (sid, i)
    want_parent = row[i - 1] if i else -1
    assert int(st.slot_parent[s]) == want_parent, (sid, i)
    if i:
      assert int(st.slot_parent_gen[s]) == int(st.slot_gen[want_parent])


def test_commit_publishes_full_blocks_only():
  """Three bounds on the published blocks: `lengths`, the sequence's
  length and the token row's width; a partial block is never published.
  A later commit with more tokens goes on from the published chain."""
  pair = Lockstep(CFG)
  p = _prompt(0)
  pair.claim([0], p[None], [14])        # blocks 0..2 full, block 3 partial
  pair.commit([0], p[None], [PS - 1])   # lengths: a partial block only
  assert _published(pair.host(), 0) == [False] * 4
  pair.commit([0], p[None, :PS + 2], [14])       # width: one full block
  assert _published(pair.host(), 0) == [True, False, False, False]
  pair.commit([0], p[None], [2 * PS + 1])        # lengths: two full blocks
  assert _published(pair.host(), 0) == [True, True, False, False]
  pair.commit([0], p[None], [40])       # capped at seq_lens = 14: three
  st = pair.host()
  assert _published(st, 0) == [True, True, True, False]
  _assert_chain(st, 0, 3)


def test_commit_token_rows_wider_than_a_sequence():
  """Token rows wider than `max_pages * page_size` (a caller's padded
  batch) publish the same blocks as rows of the exact width: every full
  block of the sequence, none past its length."""
  pair = Lockstep(CFG)
  p = _prompt(6)
  wide = np.concatenate([p, np.full(2 * PS + 1, 7, np.int32)])
  pair.claim([0], p[None], [WIDTH])
  pair.commit([0], wide[None], [WIDTH + PS])
  st = pair.host()
  assert _published(st, 0) == [True] * CFG.max_pages
  _assert_chain(st, 0, CFG.max_pages)


def test_commit_one_prefix_twice_in_one_call():
  """Two sequences with the same two full blocks in one call: the first in
  row-major order publishes them, the other's own slots stay unpublished
  (one key, one slot). At its next commit they are twins (its block 0 is
  slot 0, a slot like any other): nothing is published. Claimed again with
  one more block, its third block goes on from the twin chain."""
  pair = Lockstep(CFG)
  p = _prompt(1)
  q = p.copy()
  q[2 * PS:] += 1                       # same first two blocks only
  pair.claim([0, 1], np.stack([p, q]), [8, 8])
  pair.commit([1, 0], np.stack([q, p]), [8, 8])
  st = pair.host()
  assert _published(st, 1) == [True, True]
  assert _published(st, 0) == [False, False]
  assert int(st.seq_slots[0, 0]) == 0
  before = pair.state
  pair.commit([0], p[None], [8])
  chex.assert_trees_all_equal(pair.state, before)
  pair.release([0])
  pair.claim([0], q[None], [12])        # reuses 1's two blocks, one new
  pair.commit([0], q[None], [12])
  st = pair.host()
  assert _published(st, 0) == [True, True, True]
  _assert_chain(st, 0, 3)


def test_commit_full_bucket():
  """One bucket of three ways. Free ways go to the considered blocks only,
  in row-major order: the first request's two full blocks (its blocks past
  `lengths` take none), then the second request's first block; its later
  blocks find no way and stay unpublished (its chain stops there)."""
  cfg = cache.CacheConfig(num_slots=16, page_size=PS, num_layers=2,
                          max_seqs=4, max_pages=4, hash_ways=3,
                          hash_buckets=1)
  pair = Lockstep(cfg, model=False)
  p, q = _prompt(2), _prompt(3)
  pair.claim([0, 1], np.stack([p, q]), [16, 16])
  pair.commit([1, 0], np.stack([q, p]), [2 * PS, 16])
  st = pair.host()
  assert _published(st, 1) == [True, True, False, False]
  assert _published(st, 0) == [True, False, False, False]
  _assert_chain(st, 1, 2)
  _assert_chain(st, 0, 1)
  assert sorted(st.hash_table[0].tolist()) == sorted(
      st.seq_slots[1, :2].tolist() + [int(st.seq_slots[0, 0])])


def test_commit_keys_equal_in_one_lane_only():
  """A key is both u32 lanes: two blocks whose keys share lane 0 only (a
  pair found by a birthday search over `hashing.block_keys`, checked here
  first) are different keys, both published in one call."""
  rows = np.array([[837, 403, 708, 237], [866, 819, 443, 851]], np.int32)
  keys = np.asarray(hashing.block_keys(jnp.asarray(rows[:, None]),
                                       jnp.zeros((2,), jnp.int32)))[:, 0]
  assert keys[0, 0] == keys[1, 0] and keys[0, 1] != keys[1, 1]
  pair = Lockstep(CFG)
  pair.claim([0, 1], rows, [PS, PS])
  assert pair.host().seq_scope[:2].tolist() == [0, 0]
  pair.commit([0, 1], rows, [PS, PS])
  st = pair.host()
  assert _published(st, 0) == [True] and _published(st, 1) == [True]


def test_commit_refused_ids_leave_state_unchanged():
  """Dead, out of range, duplicated and padding ids, and a negative length,
  publish nothing."""
  pair = Lockstep(CFG)
  p = _prompt(4)
  pair.claim([0, 1], np.stack([p, p + 1]), [8, 8])
  before = pair.state
  rows = np.stack([p] * 5)
  pair.commit([2, CFG.max_seqs, 0, 0, 1], rows, [8, 8, 8, 8, -1])
  chex.assert_trees_all_equal(pair.state, before)
  pair.commit([-1], p[None], [8])
  chex.assert_trees_all_equal(pair.state, before)


def test_committed_prompt_is_reused():
  """After commit and release, claiming the same prompt reuses its
  committed full blocks (found through the hash table written by commit),
  but not its partial block."""
  pair = Lockstep(CFG)
  p = _prompt(5)
  pair.claim([0], p[None], [11])
  pair.commit([0], p[None], [11])
  pair.release([0])
  res = pair.claim([1], p[None], [11])
  assert res["num_reused_tokens"][0] == 2 * PS


# Eight slots, one bucket of four ways (can overflow: no model).
ONE_BUCKET = cache.CacheConfig(num_slots=8, page_size=PS, num_layers=2,
                               max_seqs=4, max_pages=4, hash_ways=4,
                               hash_buckets=1)

# A global group and a sliding one whose window (15) never drops a block.
HYBRID = cache.HybridCacheConfig(layer_windows=(-1, 15),
                                 group_num_slots=(8, 8), page_size=PS,
                                 max_seqs=4, max_pages=4, hash_ways=8)


def _orphan_in_slot_0(pair, p, q, num_blocks=3):
  """Sequence 0 (prompt `q`, 16 tokens) with its block 2 in slot 0,
  published (with its blocks up to `num_blocks`) as the child of the twin
  it found for block 1 (sequence 1's, prompt `p`: the same first two
  blocks), then that twin evicted: slot 0 is an orphan still held by
  sequence 0, whose blocks 0, 1 are unpublished and block 0's twin
  (sequence 1's block 0) stays cached. Free slots go lowest index first, a
  cached chain loses its deepest block first."""
  pair.claim([3], _prompt(20)[None], [PS])           # slot 0, to free later
  pair.claim([1, 0], np.stack([p, q]), [2 * PS, 2 * PS])
  pair.commit([1, 0], np.stack([p, q]), [2 * PS, 2 * PS])
  pair.release([3])
  pair.extend([0], [2 * PS])                         # blocks 2, 3
  pair.commit([0], q[None], [num_blocks * PS])       # block 2: child of a twin
  st = pair.host()
  twin = (st.groups[0] if pair.hybrid else st).seq_slots[1, :2].tolist()
  pair.release([1])
  # One block more than the free slots: evicts the twin's block 1.
  st = pair.host()
  st = st.groups[0] if pair.hybrid else st
  need = int(np.sum((st.slot_refcount == 0) & ~st.slot_published)) + 1
  ids = [2, 3][:-(-need // 4)]
  lens = [min(need - 4 * i, 4) * PS for i in range(len(ids))]
  pair.claim(ids, np.stack([_prompt(40 + i) for i in ids]), lens)
  st = pair.host()
  st = st.groups[0] if pair.hybrid else st
  row = st.seq_slots[0].tolist()
  assert row[2] == 0 and int(st.slot_parent[0]) == twin[1]
  assert bool(st.slot_published[0]) and bool(st.slot_published[twin[0]])
  assert not bool(st.slot_published[twin[1]])
  return twin, row


def test_commit_replaces_an_orphan_in_slot_0():
  """Slot 0 is a slot like any other (-1 is the no-block id). An own
  published block after the served run whose parent left the cache is
  published again under the chain's current parent, in place: it takes no
  free way, which go to the new keys only (blocks 1 and 3 here, the
  bucket's last two free ways; a padding row before it holds none), and
  every published slot stays where the table says. Committed again, the
  chain is served whole."""
  pair = Lockstep(ONE_BUCKET, model=False)
  p = _prompt(22)
  q = p.copy()
  q[2 * PS:] += 1
  twin, row = _orphan_in_slot_0(pair, p, q)
  assert (pair.host().hash_table[0] >= 0).sum() == 2      # twin[0], slot 0
  gen0 = int(pair.host().slot_gen[0])
  pair.commit([-1, 0], np.stack([p, q]), [4 * PS, 4 * PS])   # padding first
  st = pair.host()
  assert _published(st, 0) == [False, True, True, True]
  assert int(st.slot_parent[row[1]]) == twin[0]
  for i in (2, 3):
    assert int(st.slot_parent[row[i]]) == row[i - 1], i
    assert int(st.slot_parent_gen[row[i]]) == int(st.slot_gen[row[i - 1]])
    assert int(st.slot_depth[row[i]]) == i
  assert int(st.slot_gen[0]) == gen0 + 1
  assert sorted(st.hash_table[0].tolist()) == sorted([twin[0]] + row[1:])
  for s in row[1:] + [twin[0]]:
    assert int(st.hash_table.reshape(-1)[st.slot_hash_pos[s]]) == s, s
  # The same commit again: every block is served (block 0 by its twin, the
  # others by their own slots, block 3 the child of slot 0), none published.
  before = pair.state
  pair.commit([0], q[None], [4 * PS])
  chex.assert_trees_all_equal(pair.state, before)


def test_hybrid_commit_keeps_own_published_sliding_slots():
  """A sliding group publishes a held block on its own, anchored to group
  0's slot of that block at its generation, and leaves its own published
  slots as they are. Here group 0 publishes block 2 (slot 0 of both groups)
  again under its new parent (the orphan of
  `test_commit_replaces_an_orphan_in_slot_0`, generation + 1) while the
  sliding group's slot 0 keeps its anchor at the old generation; every step
  against `reference_hybrid`."""
  pair = Lockstep(HYBRID)
  p = _prompt(23)
  q = p.copy()
  q[2 * PS:] += 1
  _, row = _orphan_in_slot_0(pair, p, q)
  g1 = pair.host().groups[1]
  assert g1.seq_slots[0, 2] == 0 and bool(g1.slot_published[0])
  assert int(g1.slot_parent[0]) == row[2]
  kept = (int(g1.slot_gen[0]), int(g1.slot_parent_gen[0]))
  pair.commit([0], q[None], [4 * PS])
  g0, g1 = pair.host().groups
  assert int(g0.slot_gen[0]) == kept[1] + 1      # group 0 published it again
  assert (int(g1.slot_gen[0]), int(g1.slot_parent_gen[0])) == kept
  assert _published(g1, 0) == [False, True, True, True]


def _orphans_replaced(pair):
  """The orphan scenario with blocks 2 and 3 published, then sequence 1
  claiming and committing the same prompt."""
  p = _prompt(24)
  q = p.copy()
  q[2 * PS:] += 1
  twin, row = _orphan_in_slot_0(pair, p, q, num_blocks=4)
  pair.release([2])
  res = pair.claim([1], q[None], [4 * PS])
  assert res["num_reused_tokens"] == [PS]
  pair.commit([1], q[None], [4 * PS])
  return twin, row


def test_commit_replaces_orphans_of_another_sequence():
  """A published slot with the block's key that is not a twin is replaced
  and leaves the cache. Sequence 0's blocks 2 and 3 (slot 0 and the next)
  are published as the children of a twin that is then evicted; sequence 1
  claims the same prompt (block 0 reused), and its commit publishes blocks
  1..3 as its own chain in place of sequence 0's (still held, no longer
  published): the replaced slots keep their ways, the bucket's last free
  way goes to block 1."""
  pair = Lockstep(ONE_BUCKET, model=False)
  twin, row = _orphans_replaced(pair)
  st = pair.host()
  assert _published(st, 1) == [True] * 4
  _assert_chain(st, 1, 4)
  assert int(st.seq_slots[1, 0]) == twin[0]
  assert st.seq_slots[0].tolist() == row
  assert _published(st, 0) == [False] * 4
  assert sorted(st.hash_table[0].tolist()) == sorted(
      st.seq_slots[1].tolist())


def test_hybrid_commit_replaces_orphans_of_another_sequence():
  """The same in a hybrid cache: the sliding group's slots of sequence 0's
  blocks 2 and 3 hold the same tokens but are anchored to group 0's old
  slots, so sequence 1's blocks replace them there too."""
  pair = Lockstep(HYBRID)
  _orphans_replaced(pair)
  for g in pair.host().groups:
    assert _published(g, 1) == [True] * 4
    assert _published(g, 0) == [False] * 4


def test_commit_stops_at_scratch_blocks_with_a_twin():
  """An SWA scratch block is never published nor serves a chain, even where
  another sequence published the same tokens: sequence 0's prompt has
  blocks 0..2 scratch (window 3: out of reach of every later query), and
  sequence 1 publishes those three blocks one step at a time; committing
  sequence 0 then publishes nothing (its block 3 included)."""
  cfg = cache.CacheConfig(num_slots=16, page_size=PS, num_layers=2,
                          max_seqs=4, max_pages=4, layer_windows=(3, 3),
                          enable_swa_scratch_reuse=True)
  pair = Lockstep(cfg)
  p = _prompt(9)
  pair.claim([0, 1], np.stack([p, p]), [WIDTH, PS])
  assert pair.host().seq_slots[0].tolist()[:3] == [-1] * 3
  pair.commit([1], p[None], [PS])
  for n in (2, 3):
    pair.extend([1], [PS])
    pair.commit([1], p[None], [n * PS])
  assert _published(pair.host(), 1) == [True] * 3
  before = pair.state
  pair.commit([0], p[None], [WIDTH])
  chex.assert_trees_all_equal(pair.state, before)
