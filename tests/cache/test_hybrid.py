"""`cache/hybrid.py`: joint admission across window groups, scenario by
scenario.

Each scenario runs the jitted per-window-group cache and
`reference_hybrid.ReferenceHybridCache` side by side (`Lockstep`: results
and every group slot for slot) and checks the outcome the docstrings promise
directly: `head_of_line=False` admits request `r` iff it fits every group
together with the requests admitted before it, a reused cached block is
taken out of the evictable supply of the requests after it (`evict=True`),
and with `evict=False` the budget is the free slots alone, which reusing a
cached block does not spend.
"""

from __future__ import annotations

import functools

import numpy as np

from pkvattn import cache
from cache_asserts import Lockstep, token_rows

PS = 4


# Group 0 (global) is the tight one: 4 slots; the sliding group (window 4)
# has room for every scenario.
_cfg = functools.partial(
    cache.HybridCacheConfig, layer_windows=(-1, 4), group_num_slots=(4, 12),
    page_size=PS, max_seqs=4, max_pages=3, hash_ways=12)


def _rows(prompts, width=3 * PS):
  return token_rows(prompts, width)


def _published(rng):
  """A Lockstep whose group 0 holds prompt `a`'s 2 whole blocks cached (its
  partial third block freed): 2 free and 2 cached slots there."""
  both = Lockstep(_cfg())
  a = rng.integers(1, 1000, 2 * PS + 1).tolist()
  both.publish([0], _rows([a]), [len(a)])
  st = cache.stats(both.state)
  assert np.asarray(st["num_free"])[0] == 2
  assert np.asarray(st["num_cached"])[0] == 2
  return both, a


def test_reused_cached_blocks_leave_the_supply_of_later_requests():
  """`head_of_line=False`, `evict=True`: `a` again reuses its 2 cached blocks
  and takes 1 new slot, so of group 0's 4-slot supply (2 free + 2 evictable)
  1 is left: a 5-token prompt (2 slots) after it is refused, a 1-token one
  (1 slot) after that is admitted. Counting the reused blocks as still
  evictable would admit the 5-token prompt into slots `a` holds."""
  rng = np.random.default_rng(11)
  both, a = _published(rng)
  b = rng.integers(1000, 2000, PS + 1).tolist()
  c = rng.integers(2000, 3000, 1).tolist()
  res = both.claim([1, 2, 3], _rows([a, b, c]), [len(a), len(b), len(c)],
                   head_of_line=False)
  assert res["ok"] == [True, False, True], res
  assert res["num_reused_tokens"] == [2 * PS, 0, 0], res
  assert [n[0] for n in res["num_new_blocks"]] == [1, 0, 1], res


def test_without_eviction_a_reused_cached_block_costs_no_free_slot():
  """`evict=False`, either policy: the budget is group 0's 2 free slots;
  reusing `a`'s 2 cached blocks spends none of them, so `a` (1 new slot)
  and a 1-token prompt (1 slot) are both admitted."""
  rng = np.random.default_rng(12)
  for head_of_line in (True, False):
    both, a = _published(rng)
    c = rng.integers(2000, 3000, 1).tolist()
    res = both.claim([1, 2], _rows([a, c]), [len(a), len(c)], evict=False,
                     head_of_line=head_of_line)
    assert res["ok"] == [True, True], (head_of_line, res)
    assert res["num_reused_tokens"] == [2 * PS, 0], res


def test_a_refused_request_protects_none_of_its_reused_blocks():
  """`head_of_line=False`: a new 9-token prompt first takes 3 of group 0's 4
  supply slots (its 2 free ones and one cached block of `a`, evicted).
  `a` again (2 reused, 1 new) is then refused, and so is `a`'s first 5
  tokens (1 reused, 1 new: 3 + 1 + 1 > 4): the refused request before it
  reserved nothing, so its cached blocks are neither free to reuse for
  nothing nor kept from eviction."""
  rng = np.random.default_rng(13)
  both, a = _published(rng)
  d = rng.integers(3000, 4000, 2 * PS + 1).tolist()
  res = both.claim([1, 2, 3], _rows([d, a, a[:PS + 1]]),
                   [len(d), len(a), PS + 1], head_of_line=False)
  assert res["ok"] == [True, False, False], res
  assert [n[0] for n in res["num_new_blocks"]] == [3, 0, 0], res


def test_reuse_floor_counts_the_rewind_before_the_prompt_end():
  """`max_rewind_len=2`, window 4: a 9-token prompt reusing `n=2` blocks has
  its first recomputed query at `min(2 * 4, 9 - 2) = 7`, which sees token 3,
  so the sliding group must serve block 0 as well (`lo_g(2) = (7 - 4) // 4 =
  0`). `a`'s sliding block 0 was released by `extend` before `a` was
  committed (so never published), its blocks 1 and 2 are cached: no `n`
  has every block it needs, and nothing is reused."""
  both = Lockstep(_cfg(group_num_slots=(8, 12), max_pages=4,
                       max_rewind_len=2))
  rng = np.random.default_rng(14)
  a = rng.integers(1, 1000, 3 * PS + 1).tolist()
  assert both.claim([0], _rows([a[:10]], 4 * PS), [10])["ok"] == [True]
  assert both.extend([0], [3], num_computed=[10])["ok"] == [True]
  assert int(both.state.groups[1].seq_slots[0, 0]) == -1  # (8 - 4) // 4 = 1
  both.commit([0], _rows([a], 4 * PS), [len(a)])
  both.release([0])
  res = both.claim([1], _rows([a[:9]], 4 * PS), [9])
  assert res["ok"] == [True], res
  assert res["num_reused_tokens"] == [0], res


def test_sliding_anchor_group_matches_its_own_chain():
  """No global layer: group 0 (window 9, the widest) is the anchor and is
  matched by its own token chain, not against itself as an anchor. `a`
  again (9 tokens, no rewind) reuses `n = 2` blocks: group 0 serves `[0,
  2)` and the window-2 group block 1 (`lo_1(2) = (8 - 2) // 4 = 1`)."""
  both = Lockstep(_cfg(layer_windows=(9, 2, 9), group_num_slots=(8, 8)))
  rng = np.random.default_rng(15)
  a = rng.integers(1, 1000, 2 * PS + 1).tolist()
  both.publish([0], _rows([a]), [len(a)])
  res = both.claim([1], _rows([a]), [len(a)])
  assert res["ok"] == [True], res
  assert res["num_reused_tokens"] == [2 * PS], res


def test_fork_copies_name_pool_page_zero():
  """A fork's copy pages are absolute pool pages (`group_page_base[g] +
  (slot * L_g + j) * 2 (+ 1 for V)`), and page 0 (group 0's slot 0, layer
  0, K) is a page like any other: a 3-token parent whose partial block sits
  in group 0's slot 0 copies pages `[0, 2)` there, and its sliding group's
  partial block at that group's base."""
  both = Lockstep(_cfg())
  cfg = both.state.config
  assert both.claim([0], _rows([[5, 6, 7]]), [3])["ok"] == [True]
  got, want = both.fork([0], [1])
  assert got["ok"] == [True]
  src, dst = [], []
  for gid, s, d in sorted(want["copies"][0]):
    width = 2 * cfg.groups[gid].num_layers
    src += [cfg.group_page_base[gid] + s * width + k for k in range(width)]
    dst += [cfg.group_page_base[gid] + d * width + k for k in range(width)]
  assert int(both.state.groups[0].seq_slots[0, 0]) == 0
  assert src[0] == 0, (src, want)
  assert got["src_pages"] == src, (got, src)
  assert got["dst_pages"] == dst, (got, dst)


def test_requests_reusing_the_same_cached_blocks_take_them_once():
  """`head_of_line=False`: two prompts `a` both reuse `a`'s 2 cached blocks
  of group 0; the first takes them out of the 4-slot supply (3 with its new
  slot), the second needs only its own new slot (4 <= 4): both admitted."""
  rng = np.random.default_rng(16)
  both, a = _published(rng)
  res = both.claim([1, 2], _rows([a, a]), [len(a)] * 2, head_of_line=False)
  assert res["ok"] == [True, True], res
  assert res["num_reused_tokens"] == [2 * PS] * 2, res


def test_fork_evicts_a_cached_block_for_its_copy():
  """`fork` admits by free plus evictable slots, as a claim does: group 0
  has no free slot left (a 5-token prompt holds 2, `a`'s 2 blocks are
  cached), and the child's copy of the partial block evicts one."""
  rng = np.random.default_rng(17)
  both, _ = _published(rng)
  b = rng.integers(1000, 2000, PS + 1).tolist()
  assert both.claim([1], _rows([b]), [len(b)])["ok"] == [True]
  assert np.asarray(cache.stats(both.state)["num_free"])[0] == 0
  got, _ = both.fork([1], [2])
  assert got["ok"] == [True], got
  assert np.asarray(cache.stats(both.state)["num_cached"])[0] == 1
