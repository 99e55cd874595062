"""`HybridCacheConfig`: what it refuses, and `from_budget`'s split of a flat
pool between window groups (expected slots worked out by hand from the rule
its docstring states)."""

from __future__ import annotations

import pytest

from pkvattn import cache

_KW = dict(page_size=4, max_seqs=3, max_pages=6)


@pytest.mark.parametrize("windows", [(), (-2, -1), (7.0, -1), ("3",)])
def test_layer_windows_refused(windows):
  with pytest.raises(ValueError, match="Invalid layer_windows"):
    cache.HybridCacheConfig(windows, (8,) * max(1, len(set(windows))), **_KW)


@pytest.mark.parametrize("slots", [(0, 8), (8, -1), (8.5, 8), ("8", 8)])
def test_group_num_slots_refused(slots):
  with pytest.raises(ValueError, match="Invalid group_num_slots"):
    cache.HybridCacheConfig((-1, 7), slots, **_KW)


def test_edges_accepted():
  """Window -1 (full attention) and 0 (the current token alone), one slot
  per group, and a pool of 2**31 - 2 pages (the largest below int32's
  limit: pages come in K / V pairs) are fine; 2**31 pages over two groups
  that each fit alone are not."""
  cfg = cache.HybridCacheConfig((-1, 0, -1), (1, 1), **_KW)
  assert cfg.layer_windows == (-1, 0, -1)
  assert [g.window_left for g in cfg.groups] == [-1, 0]
  big = 2**29
  cfg = cache.HybridCacheConfig((-1, 7), (big, big - 1), **_KW)
  assert cfg.num_pool_pages == 2**31 - 2
  with pytest.raises(ValueError, match="overflow int32"):
    cache.HybridCacheConfig((-1, 7), (big, big), **_KW)


# Layers: global 0, 3 (2 layers); window 7: 1, 2, 5 (3); window 3: 4 (1).
WINDOWS = (-1, 7, 7, -1, 3, 7)


@pytest.mark.parametrize("kw,expected", [
    # Sliding group w: min(num_slots, max_seqs * (cdiv(w + 1 + rewind, ps)
    # + 1) + cdiv(step_tokens, ps) + max_pages), step_tokens defaulting to
    # max_pages * ps = 24. w=7: 3 * 3 + 6 + 6 = 21; w=3: 3 * 2 + 6 + 6 = 18.
    # The global group: (64 * 6 - 21 * 3 - 18 * 1) // 2 = 151.
    (dict(num_slots=64), (151, 21, 18)),
    # 8 tokens a step, rewinds of 2: w=7: 3 * 4 + 2 + 6 = 20; w=3: 3 * 3 +
    # 2 + 6 = 17; global (384 - 60 - 17) // 2 = 153.
    (dict(num_slots=64, max_num_tokens=8, max_rewind_len=2), (153, 20, 17)),
    # A small pool caps each sliding group at num_slots: 16 each, and the
    # global layers keep (16 * 6 - 16 * 4) // 2 = 16.
    (dict(num_slots=16), (16, 16, 16)),
    # The smallest pool that leaves every group max_pages slots.
    (dict(num_slots=6), (6, 6, 6)),
])
def test_from_budget_split(kw, expected):
  cfg = cache.HybridCacheConfig.from_budget(layer_windows=WINDOWS, **_KW,
                                            **kw)
  assert [g.window_left for g in cfg.groups] == [-1, 7, 3]
  assert cfg.group_num_slots == expected
  assert cfg.max_rewind_len == kw.get("max_rewind_len", 0)
  # The split never holds more bytes than the flat pool it replaces.
  assert cfg.num_pool_pages <= cfg.flat_pool_pages(kw["num_slots"])


def test_from_budget_all_sliding_and_too_small():
  # No global layer: each group keeps its need (w=5: 3 * 3 + 6 + 6 = 21).
  cfg = cache.HybridCacheConfig.from_budget(64, (5, 5), **_KW)
  assert cfg.group_num_slots == (21,)
  with pytest.raises(ValueError, match="Invalid num_slots: 5 flat slots"):
    cache.HybridCacheConfig.from_budget(5, WINDOWS, **_KW)
