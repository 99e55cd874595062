"""`cache/state.py`: the documented defaults and derived sizes of
`CacheConfig`, the empty state `init_cache` returns, the padding id, and
`stats` against its docstring's definitions (numpy, on random states)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from pkvattn import cache


_cfg = functools.partial(cache.CacheConfig, num_slots=64, page_size=4,
                         num_layers=2, max_seqs=3, max_pages=5)


def test_config_defaults_and_derived_sizes():
  cfg = _cfg()
  # 16 ways; buckets: the smallest power of two >= 4 * num_slots / hash_ways.
  assert (cfg.hash_ways, cfg.num_buckets) == (16, 16)
  assert _cfg(num_slots=65).num_buckets == 32
  assert _cfg(hash_buckets=4).num_buckets == 4
  assert (cfg.layer_windows, cfg.max_rewind_len) == (None, 0)
  assert cfg.max_seq_len == 5 * 4 and cfg.num_pool_pages == 64 * 2 * 2
  assert cfg.max_scratch_slots == 3  # cdiv(5, 2)
  assert _cfg(max_pages=4).max_scratch_slots == 2
  # Scratch reuse is off unless asked for, even with every layer sliding.
  assert not _cfg(layer_windows=(3, 5)).swa_scratch_active
  assert _cfg(layer_windows=(3, 5)).scratch_window_left == -1
  on = _cfg(layer_windows=(3, 5), enable_swa_scratch_reuse=True)
  assert on.swa_scratch_active is True and on.scratch_window_left == 5
  # Hashable and immutable: a jit static argument.
  assert hash(on) == hash(dataclasses.replace(on)) and on == _cfg(
      layer_windows=(3, 5), enable_swa_scratch_reuse=True)
  with pytest.raises(dataclasses.FrozenInstanceError):
    on.num_slots = 8


def test_init_cache_is_empty():
  cfg = _cfg(hash_ways=4)
  st = cache.init_cache(cfg)
  assert st.config is cfg and (st.num_slots, st.page_size) == (64, 4)
  n, s = cfg.num_slots, cfg.max_seqs
  expected = dict(
      slot_refcount=(0, (n,)), slot_last_use=(0, (n,)),
      slot_published=(False, (n,)), slot_key=(0, (n, 2)),
      slot_tokens=(0, (n, 4)), slot_scope=(0, (n,)), slot_parent=(-1, (n,)),
      slot_parent_gen=(0, (n,)), slot_gen=(0, (n,)), slot_depth=(0, (n,)),
      slot_hash_pos=(-1, (n,)), hash_table=(-1, (cfg.num_buckets, 4)),
      seq_slots=(cache.NULL_PAGE, (s, 5)), seq_lens=(0, (s,)),
      seq_live=(False, (s,)), seq_scope=(0, (s,)),
      seq_scratch_slots=(cache.NULL_PAGE, (s, 3)),
      seq_scratch_first=(0, (s,)), seq_scratch_count=(0, (s,)),
      clock=(0, ()), num_lookups=(0, ()), num_hits=(0, ()))
  for name, (value, shape) in expected.items():
    arr = np.asarray(getattr(st, name))
    assert arr.shape == shape, name
    assert (arr == value).all(), name
  assert np.asarray(st.slot_key).dtype == np.uint32
  with pytest.raises(dataclasses.FrozenInstanceError):
    st.seq_lens = st.seq_lens + 1


def test_null_ids_are_minus_one_and_null_seq_pads():
  """`NULL_SEQ = -1` entries of `seq_ids` are padding: refused, no effect
  (the common rules of `cache/alloc.py`)."""
  assert cache.NULL_PAGE == cache.NULL_SEQ == -1
  st = cache.init_cache(_cfg(max_seqs=2))
  tokens = np.arange(1, 11, dtype=np.int32).reshape(2, 5)
  st, res = cache.claim_batch(st, [0, cache.NULL_SEQ], tokens, [5, 5])
  assert np.asarray(res.ok).tolist() == [True, False]
  assert np.asarray(st.seq_live).tolist() == [True, False]
  assert int(cache.stats(st)["num_used"]) == 2  # two blocks of seq 0 only


def test_stats_follow_their_definitions():
  rng = np.random.default_rng()
  cfg = _cfg(num_slots=16)
  for _ in range(3):
    refcount = rng.integers(0, 3, 16)
    published = rng.random(16) < 0.5
    scratch = rng.integers(-1, 16, (3, 3))  # slot 0 included
    live = rng.random(3) < 0.5
    lookups = int(rng.integers(1, 50))
    hits = int(rng.integers(0, lookups + 1))
    st = dataclasses.replace(
        cache.init_cache(cfg), slot_refcount=np.int32(refcount),
        slot_published=published, seq_scratch_slots=np.int32(scratch),
        seq_live=live, num_lookups=np.int32(lookups), num_hits=np.int32(hits))
    got = {k: v.item() for k, v in cache.stats(st).items()}
    unref = refcount == 0
    want = dict(
        num_slots=16, num_free=int((unref & ~published).sum()),
        num_used=int((~unref).sum()), num_cached=int((unref & published).sum()),
        num_published=int(published.sum()), num_scratch=int((scratch >= 0).sum()),
        num_live_seqs=int(live.sum()), num_lookups=lookups, num_hits=hits)
    assert {k: got[k] for k in want} == want
    assert got["hit_rate"] == pytest.approx(hits / lookups)
    assert got["num_free"] + got["num_used"] + got["num_cached"] == 16
  # No lookups yet: hit rate 0, not 0 / 0; one lookup, one hit: 1.
  st = cache.init_cache(cfg)
  assert cache.stats(st)["hit_rate"].item() == 0.0
  one = dataclasses.replace(st, num_lookups=np.int32(1), num_hits=np.int32(1))
  assert cache.stats(one)["hit_rate"].item() == 1.0
