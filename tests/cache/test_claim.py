"""`cache/claim.py`: `claim_batch` at the edges of its inputs.

Every scenario runs the jitted op and `cache/reference.py` (the loop-based
model of the same rules) side by side and compares results and state slot
for slot, and checks the values the docstrings promise directly: lengths at
the limits (0, the token row's width, the sequence capacity), token rows too
narrow for one or two whole blocks, refused requests (all-zero results, no
lookups counted), and chain verification through the parent's publication
generation.
"""

from __future__ import annotations

import functools

import chex
import numpy as np

from pkvattn import cache
from cache_asserts import Lockstep, token_rows

PS = 4


_cfg = functools.partial(cache.CacheConfig, num_slots=8, page_size=PS,
                         num_layers=1, max_seqs=4, max_pages=4, hash_ways=8)


def test_empty_prompt_is_admitted_and_looks_nothing_up():
  """A 0-token prompt is a valid claim (`0 <= lengths[r]`): admitted with no
  slot, nothing reused or missed (`(lengths - 1) // page_size` reusable
  blocks is read as 0, not -1), and no lookup is counted; a cached prefix
  that its (ignored) token row happens to hold is not reused."""
  both = Lockstep(_cfg(), with_stats=True)
  a = list(range(1, 13))
  both.publish([0], token_rows([a], 12), [12])
  lookups = int(cache.stats(both.state)["num_lookups"])
  res = both.claim([1, 2], token_rows([a, []], 12), [0, 0])
  assert res == dict(ok=[True, True], num_reused_tokens=[0, 0],
                     num_new_blocks=[0, 0], num_missed_blocks=[0, 0])
  assert int(cache.stats(both.state)["num_lookups"]) == lookups
  assert np.asarray(both.state.seq_live)[[1, 2]].tolist() == [True, True]
  assert np.asarray(both.state.seq_lens)[[1, 2]].tolist() == [0, 0]


def test_prompt_as_long_as_it_may_be_is_admitted():
  """`lengths[r] <= min(max_len, max_pages * page_size)` is inclusive: a
  prompt filling the token row, or the sequence capacity, fits and is
  admitted (no request that fits is refused); one token more is refused and
  leaves the state unchanged, whichever of the two bounds is the smaller."""
  cfg = _cfg()  # capacity 16 tokens
  cap = cfg.max_seq_len
  rng = np.random.default_rng(0)
  for width in (cap - 3, cap, cap + 5):
    limit = min(width, cap)
    both = Lockstep(cfg, with_stats=True)
    tokens = rng.integers(1, 50, (2, width))
    res = both.claim([0, -1], tokens, [limit, 0])
    assert res["ok"] == [True, False]
    assert res["num_new_blocks"] == [-(-limit // PS), 0]
    st0 = both.state
    res = both.claim([1], tokens[:1], [limit + 1])
    assert res["ok"] == [False], width
    chex.assert_trees_all_equal(both.state, st0)


def test_one_whole_block_in_the_token_row_is_reused():
  """A token row of `page_size + 1` tokens holds one whole block, and a
  prompt of that length reuses it (`(5 - 1) // 4 = 1` reusable block): the
  sequence's first slot is the cached one."""
  both = Lockstep(_cfg(), with_stats=True)
  p = [7, 8, 9, 10, 11]
  both.publish([0], token_rows([p], 5), [5])
  cached = int(both.ref.index[both.ref._block_keys(p, 0, 1)[0]])
  res = both.claim([1], token_rows([p], 5), [5])
  assert res == dict(ok=[True], num_reused_tokens=[PS], num_new_blocks=[1],
                     num_missed_blocks=[0])
  assert int(both.state.seq_slots[1, 0]) == cached


def test_token_row_narrower_than_a_page():
  """A token row shorter than one page holds no whole block: prompts are
  admitted with one new block each and nothing reusable."""
  both = Lockstep(_cfg(), with_stats=True)
  p = [[1, 2, 3], [1, 2, 3]]
  both.publish([0], token_rows(p[:1], 3), [3])
  res = both.claim([1, 2], token_rows(p, 3), [3, 2])
  assert res == dict(ok=[True, True], num_reused_tokens=[0, 0],
                     num_new_blocks=[1, 1], num_missed_blocks=[0, 0])


def test_refused_requests_report_zeros_and_count_no_lookups():
  """A request refused for lack of room (all or nothing) reports zeros in
  every field and its reusable blocks count as neither lookups nor hits,
  though its prefix is cached; the admitted request before it counts its
  own."""
  both = Lockstep(_cfg(num_slots=4), with_stats=True)
  a, b = list(range(1, 10)), list(range(20, 29))
  both.publish([0], token_rows([a], 9), [9])  # 2 blocks of a cached, 2 free
  st = cache.stats(both.state)
  lookups, hits = int(st["num_lookups"]), int(st["num_hits"])
  # b (3 new slots) then a (reuses 2, 1 new): b fits, a does not after it.
  res = both.claim([1, 2], token_rows([b, a], 9), [9, 9])
  assert res == dict(ok=[True, False], num_reused_tokens=[0, 0],
                     num_new_blocks=[3, 0], num_missed_blocks=[2, 0])
  st = cache.stats(both.state)
  assert int(st["num_lookups"]) == lookups + 2
  assert int(st["num_hits"]) == hits


def test_chain_check_uses_the_parent_slots_generation():
  """Block 1 matches only if its recorded parent generation equals the
  generation of the slot serving block 0, here slot 0. Built so that slot
  1's generation differs from slot 0's: reading another slot's generation
  would break the chain and reuse one block instead of two."""
  both = Lockstep(_cfg(num_slots=4), with_stats=True)
  a = list(range(1, 10))    # 2 whole blocks + 1 token
  b = list(range(30, 42))   # 3 whole blocks
  both.publish([0], token_rows([a], 12), [9])   # a0 -> slot 0, a1 -> slot 1
  both.publish([1], token_rows([b], 12), [12])  # evicts a's tail (slot 1)
  both.publish([2], token_rows([a], 12), [9])   # a1 again, into another slot
  assert int(both.state.slot_gen[0]) != int(both.state.slot_gen[1])
  res = both.claim([3], token_rows([a], 12), [9])
  assert res["ok"] == [True]
  assert res["num_reused_tokens"] == [2 * PS]
  assert int(both.state.seq_slots[3, 0]) == 0


def test_checked_claim_accepts_every_valid_request():
  """Checked mode raises only for a violated contract: with sequences 0 and 2
  live, claiming the free ids 1 and the last one, 3, with lengths 0 and the
  full capacity, next to a padding row (id -1, whose length is ignored),
  passes and admits both; so does claiming id 0 while only id 1 is live.
  Each check must read the liveness of the very id it names, and the length
  bounds are inclusive."""
  cfg = _cfg()
  cap = cfg.max_seq_len
  st = cache.init_cache(cfg)
  st, res = cache.claim_batch(st, [0, 2], np.ones((2, PS), np.int32), [2, 3])
  assert np.asarray(res.ok).all()
  tokens = np.arange(3 * cap, dtype=np.int32).reshape(3, cap)
  _, res = cache.claim_batch(st, [1, 3, -1], tokens, [0, cap, cap + 7],
                             check=True)
  assert np.asarray(res.ok).tolist() == [True, True, False]
  _, res = cache.claim_batch(st, [-1], tokens[:1], [-5], check=True)
  assert np.asarray(res.ok).tolist() == [False]
  st = cache.release(st, [0, 2])
  st, res = cache.claim_batch(st, [1], np.ones((1, PS), np.int32), [4])
  _, res = cache.claim_batch(st, [0], tokens[:1], [cap], check=True)
  assert np.asarray(res.ok).tolist() == [True]
