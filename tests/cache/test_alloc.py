"""`cache/alloc.py`'s allocation and admission at their edges, against the
model (`cache/reference.py`, whose allocation and admission are the rules
themselves, written as loops over requests and slots).

The random-operation tests rarely hit these: one call taking every free
slot, then every cached one (the last in `eviction_order` too); a request
that needs the whole supply behind refused ones (padding, dead, duplicated,
negative growth); a lookup one block wide; `head_of_line=False` with two
requests reusing the same cached blocks or with a refusal between two that
fit; `finish_step` of a duplicated id while scratch is active. Each test
drives the jitted ops and the model in lockstep (`cache_asserts.Lockstep`:
results and state slot for slot) and checks the docstring's numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

from pkvattn import cache
from cache_asserts import Lockstep
from cache_asserts import assert_same
from cache_asserts import i32

# 4 slots, 4 blocks of 4 tokens per sequence: one 16-token prompt takes all.
CFG = cache.CacheConfig(num_slots=4, page_size=4, num_layers=1, max_seqs=3,
                        max_pages=4, hash_ways=4)
LEN = CFG.max_seq_len


def _prompt(rng, lo):
  return rng.integers(lo, lo + 50, (1, LEN))


@pytest.mark.parametrize("evict", [True, "branchless"])
def test_one_claim_takes_every_free_then_every_cached_slot(evict, rng):
  run = Lockstep(CFG, with_stats=True)
  a = _prompt(rng, 1)
  # Every slot free: the 4 blocks take slots 0..3 in index order.
  res = run.claim([0], a, [LEN], evict=evict)
  assert res["ok"] == [True] and res["num_new_blocks"] == [4]
  assert run.host().seq_slots[0].tolist() == [0, 1, 2, 3]
  run.commit([0], a, [LEN])
  run.release([0])  # every slot cached, none free
  # An unrelated prompt reuses nothing: all 4 cached slots are evicted, the
  # tail of the released chain first (its blocks share one release clock).
  b = _prompt(rng, 100)
  res = run.claim([1], b, [LEN], evict=evict)
  assert res["ok"] == [True] and res["num_reused_tokens"] == [0]
  assert run.host().seq_slots[1].tolist() == [3, 2, 1, 0]
  assert not run.host().slot_published.any()
  assert (run.host().hash_table == -1).all()  # every way empty again
  # B ends unpublished: its slots are free and A's blocks are gone, though
  # the evicted slots still hold A's tokens. A again reuses nothing.
  run.release([1])
  res = run.claim([2], a, [LEN], evict=evict)
  assert res["ok"] == [True] and res["num_reused_tokens"] == [0]


@pytest.mark.parametrize("evict", [True, "branchless", False])
def test_one_extend_takes_every_free_slot(evict, rng):
  run = Lockstep(CFG, with_stats=True)
  run.claim([0, 1], np.zeros((2, LEN), np.int32), [0, 0])
  res = run.extend([1, 0], [LEN, 0], evict=evict)
  assert res["ok"] == [True, True] and res["num_new_blocks"] == [4, 0]
  assert run.host().seq_slots[1].tolist() == [0, 1, 2, 3]
  # Nothing is left: a further block is refused, and the state is unchanged.
  res = run.extend([0], [1], evict=evict)
  assert res["ok"] == [False]


@pytest.mark.parametrize("head_of_line", [True, False])
def test_refused_requests_take_no_supply(head_of_line, rng):
  """Padding, dead and duplicated ids are refused and cost nothing: a valid
  request after them that needs every free slot is admitted (it fits alone,
  module docstring "Admission")."""
  run = Lockstep(CFG, with_stats=True)
  run.claim([0, 1], np.zeros((2, LEN), np.int32), [0, 0])
  kw = dict(head_of_line=head_of_line)
  res = run.extend([-1, 2, 1, 1, 0], [4, 4, 4, 4, LEN], **kw)
  assert res["ok"] == [False, False, False, False, True]
  assert res["num_new_blocks"] == [0, 0, 0, 0, 4]
  run.release([0])
  res = run.claim([-1, 0, 0, 2], _prompt(rng, 1).repeat(4, 0),
                  [LEN, 4, 4, LEN], **kw)
  assert res["ok"] == [False, False, False, True]


def test_a_negative_extend_is_refused(rng):
  """Unchecked, `num_new_tokens < 0` is refused (`extend`'s contract)."""
  run = Lockstep(CFG, with_stats=True)
  run.claim([0], _prompt(rng, 1), [6])
  for add in (-1, -4, -6):
    res = run.extend([0], [add])
    assert res == {"ok": [False], "num_new_blocks": [0]}
    assert int(run.host().seq_lens[0]) == 6


def test_finish_step_acts_once_on_a_duplicated_id():
  """`finish_step` ends the step of an id listed twice (its docstring's
  config: 16 tokens, blocks 0-2 stale, 2 scratch slots + 1 slot)."""
  cfg = cache.CacheConfig(num_slots=8, page_size=4, num_layers=2, max_seqs=2,
                          max_pages=4, hash_ways=8, layer_windows=(3, 3),
                          enable_swa_scratch_reuse=True)
  run = Lockstep(cfg, with_stats=True)
  res = run.claim([0, 1], np.zeros((2, 16), np.int32), [16, 16])
  assert res["num_new_blocks"] == [3, 3]
  run.state = cache.finish_step(run.state, i32([1, -1, 1]))
  run.ref.finish_step([1, -1, 1])
  assert_same(run.state, run.ref, with_stats=True)
  h = run.host()
  assert h.seq_slots[1].tolist()[:3] == [-1, -1, -1]
  assert (h.seq_scratch_slots[1] == -1).all() and h.seq_scratch_count[1] == 0
  assert (h.seq_scratch_slots[0] >= 0).sum() == 2


@pytest.mark.parametrize("head_of_line", [True, False])
def test_one_block_lookup_protects_its_reused_block(head_of_line, rng):
  """Token rows one block wide for the lookup (6 tokens, page_size 4): the
  reused cached block counts against the supply and is protected, so the
  claim's new block evicts the other cached slot, never the reused one, and
  a request behind it finds no supply left."""
  cfg = cache.CacheConfig(num_slots=2, page_size=4, num_layers=1, max_seqs=2,
                          max_pages=2, hash_ways=2)
  run = Lockstep(cfg, with_stats=True)
  a, b = rng.integers(1, 50, (1, 6)), rng.integers(50, 99, (1, 6))
  run.publish([0], a, [6])  # block 0 cached in slot 0, slot 1 free
  run.publish([0], b, [4])  # B's block cached in slot 1, released later
  # A again (1 new + its cached block: the whole supply), then C (1 new).
  c = rng.integers(100, 150, (1, 6))
  res = run.claim([1, 0], np.r_[a, c], [6, 4], head_of_line=head_of_line)
  assert res["ok"] == [True, False] and res["num_reused_tokens"] == [4, 0]
  assert run.host().seq_slots[1].tolist() == [0, 1]


def test_greedy_claim_counts_shared_reuse_once_and_refusals_not_at_all(rng):
  """`head_of_line=False`: each request is admitted iff it fits with those
  admitted before it; the cached blocks that two requests reuse count once,
  a refused request costs nothing (module docstring, "Admission")."""
  cfg = cache.CacheConfig(num_slots=4, page_size=4, num_layers=1, max_seqs=5,
                          max_pages=4, hash_ways=4)
  run = Lockstep(cfg, with_stats=True)
  a = rng.integers(1, 50, 8)
  run.publish([0], [a], [8])  # 2 blocks cached, 2 slots free
  x, y, z = (np.r_[a, rng.integers(1, 50, 4)] for _ in range(3))
  far = rng.integers(50, 99, 12)
  # Supply 4: x takes 1 new slot + the 2 cached blocks (3), `far` (3 new) is
  # refused, y shares x's blocks (1 new: 4), z (1 new) would exceed it.
  res = run.claim([1, 2, 3, 4], [x, far, y, z], [9, 12, 9, 9],
                  head_of_line=False)
  assert res["ok"] == [True, False, True, False]
  assert res["num_reused_tokens"] == [8, 0, 8, 0]
  # Same pool: p takes 1 free slot; w then needs 2 new + its 2 cached
  # blocks, 5 > 4 with p's slot: refused, its reuse counted against it.
  run = Lockstep(cfg, with_stats=True)
  run.publish([0], [a], [8])
  p, w = rng.integers(50, 99, 16), np.r_[a, rng.integers(1, 50, 8)]
  res = run.claim([1, 2], [p, w], [4, 16], head_of_line=False)
  assert res["ok"] == [True, False]
  # Same pool: u and v share only block 0 (slot 0) of the cached chain, each
  # with 1 new slot (2 + 1), then p's 1 new slot evicts block 1: all fit.
  run = Lockstep(cfg, with_stats=True)
  run.publish([0], [a], [8])
  u, v = (np.r_[a[:4], rng.integers(50, 99, 4)] for _ in range(2))
  res = run.claim([1, 2, 3], [u, v, p[:8]], [8, 8, 4], head_of_line=False)
  assert res["ok"] == [True, True, True]
  assert res["num_reused_tokens"] == [4, 4, 0]


def test_greedy_extend_skips_a_refusal_without_cost():
  """The `extend` docstring's example with one more request: 2 free slots,
  requests needing `[1, 2, 1, 1]` slots: `head_of_line=False` admits
  `[True, False, True, False]`."""
  cfg = cache.CacheConfig(num_slots=4, page_size=4, num_layers=1, max_seqs=4,
                          max_pages=4, hash_ways=4)
  run = Lockstep(cfg, with_stats=True)
  run.claim([0, 1, 2, 3], np.zeros((4, LEN), np.int32), [4, 4, 0, 0])
  res = run.extend([0, 1, 2, 3], [4, 8, 4, 4], head_of_line=False)
  assert res["ok"] == [True, False, True, False]
  assert res["num_new_blocks"] == [1, 0, 1, 0]


def test_a_child_of_a_republished_slot_0_is_never_matched(rng):
  """A block whose parent slot was evicted is never matched again, even
  when the parent's tokens come back in the same slot (`eviction_order`:
  `slot_parent_gen`). The parent here is slot 0, the bound of the check."""
  cfg = cache.CacheConfig(num_slots=4, page_size=4, num_layers=1, max_seqs=3,
                          max_pages=3, hash_ways=4)
  run = Lockstep(cfg, with_stats=True)
  x = rng.integers(1, 50, (1, 9))
  # P holds x0 in slot 0, Q x0 x1 and a partial block in slots 1-3 (nothing
  # cached yet). P publishes x0 first; Q's x0 is then a twin of slot 0, so
  # Q publishes only x1: slot 2, a child of slot 0.
  run.claim([0], x[:, :4], [4])
  run.claim([1], x, [9])
  assert run.host().seq_slots[1].tolist() == [1, 2, 3]
  run.commit([0], x[:, :4], [4])
  run.commit([1], x, [9])
  run.release([0])
  run.release([1])  # slot 0 released before slot 2; slots 1, 3 free
  # Three unrelated blocks take free slots 1 and 3, then evict slot 0 (least
  # recently released): slot 2 stays cached with its parent gone.
  res = run.claim([2], rng.integers(50, 99, (1, 12)), [12])
  assert res["ok"] == [True] and run.host().seq_slots[2].tolist() == [1, 3, 0]
  run.release([2])
  # x0 again, published in slot 0 (the lowest free slot): a new generation.
  run.claim([0], x[:, :4], [4])
  assert run.host().seq_slots[0].tolist()[:1] == [0]
  run.commit([0], x[:, :4], [4])
  run.release([0])
  # x's lookup reaches 2 blocks: only x0 is reused, x1's slot is stale.
  res = run.claim([1], x, [9])
  assert res["ok"] == [True] and res["num_reused_tokens"] == [4]


def test_checked_extend_reads_the_row_of_the_id_it_names():
  """Checked mode (`extend`'s `check`) with only the last id, 2, live at 6
  tokens (ids 0 and 1 dead, 0 tokens): growing id 2 to exactly the capacity
  (beside a padding row, whose count is ignored) passes and is granted; one
  token more raises and names its 6 tokens. Both checks must read id 2's
  own liveness and length."""
  st = cache.init_cache(CFG)
  st, res = cache.claim_batch(st, [2], np.ones((1, LEN), np.int32), [6])
  assert np.asarray(res.ok).tolist() == [True]
  _, res = cache.extend(st, [-1, 2], [LEN + 5, LEN - 6], check=True)
  assert np.asarray(res.ok).tolist() == [False, True]
  with pytest.raises(ValueError, match=r"num_new_tokens\[0\] = 11 for a "
                     r"sequence of 6 tokens"):
    cache.extend(st, [2], [LEN - 5], check=True)
