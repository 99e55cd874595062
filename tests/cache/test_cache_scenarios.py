"""Hand-built cache scenarios: two-phase claims, all-or-nothing, scopes, collisions."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pkvattn import cache
from pkvattn.cache import hashing
from cache_asserts import token_rows

PS = 4


_cfg = functools.partial(cache.CacheConfig, num_slots=8, page_size=PS,
                         num_layers=2, max_seqs=8, max_pages=6, hash_ways=8)


def _tok(rows, width=24):
  return jnp.asarray(token_rows(rows, width))


def _claim(state, ids, prompts, lengths=None, scopes=None):
  lengths = [len(p) for p in prompts] if lengths is None else lengths
  return cache.claim_batch(
      state, jnp.asarray(ids, jnp.int32), _tok(prompts), jnp.asarray(
          lengths, jnp.int32),
      None if scopes is None else jnp.asarray(scopes, jnp.int32))


def _commit(state, ids, prompts):
  return cache.commit(state, jnp.asarray(ids, jnp.int32), _tok(prompts),
                      jnp.asarray([len(p) for p in prompts], jnp.int32))


def _release(state, ids):
  return cache.release(state, jnp.asarray(ids, jnp.int32))


def _rand(seed, n):
  return np.random.default_rng(seed).integers(1, 1000, n).tolist()


def _setup_cached(cfg):
  """A (9 tokens, 2 blocks published) and C (8 tokens, 2 published) released:
  slots 0, 1 (A, released first) and 3, 4 (C) cached, 2 free; then H holds 2
  fresh slots. Returns (state, prompt_a)."""
  a, c, h = _rand(1, 9), _rand(2, 8), _rand(3, 8)
  st = cache.init_cache(cfg)
  st, res = _claim(st, [0], [a])
  st = _commit(st, [0], [a])
  st, _ = _claim(st, [1], [c])
  st = _commit(st, [1], [c])
  st = _release(st, [0])
  st = _release(st, [1])
  st, _ = _claim(st, [2], [h])
  cache.validate(st)
  s = cache.stats(st)
  assert (int(s["num_free"]), int(s["num_cached"]), int(s["num_used"])) == (
      2, 4, 2)
  return st, a


def test_batched_claim_protects_matched_blocks():
  cfg = _cfg()
  st0, a = _setup_cached(cfg)
  x = _rand(4, 12)  # needs 3 blocks: 2 free + 1 eviction

  # One at a time: X evicts the tail of A (released first, deepest block
  # first); B keeps A's first block and reuses only that.
  st, rx = _claim(st0, [3], [x])
  st, rb = _claim(st, [4], [a])
  assert bool(rx.ok[0]) and bool(rb.ok[0])
  assert int(rb.num_reused_tokens[0]) == 4
  cache.validate(st)

  # Batched: phase 1 protects A's blocks for B, X evicts C's instead.
  st, res = _claim(st0, [3, 4], [x, a])
  cache.validate(st)
  np.testing.assert_array_equal(res.ok, [True, True])
  np.testing.assert_array_equal(res.num_reused_tokens, [0, 8])
  np.testing.assert_array_equal(res.num_new_blocks, [3, 1])
  np.testing.assert_array_equal(res.num_missed_blocks, [2, 0])
  row_b = np.asarray(st.seq_slots[4])
  np.testing.assert_array_equal(row_b[:2], [0, 1])
  assert not set(np.asarray(st.seq_slots[3])[:3].tolist()) & {0, 1}


def test_lru_evicts_least_recently_released_first():
  cfg = _cfg()
  st0, a = _setup_cached(cfg)
  # 2 free, then A's blocks (released at clock 0) before C's (clock 1), A's
  # tail (slot 1, depth 1) before its head (slot 0).
  st, res = _claim(st0, [3], [_rand(5, 12)])
  assert bool(res.ok[0])
  np.testing.assert_array_equal(np.asarray(st.seq_slots[3])[:3], [6, 7, 1])
  assert bool(st.slot_published[0]) and not bool(st.slot_published[1])


def test_released_chain_is_evicted_tail_first():
  # A's 3 full blocks (slots 0, 1, 2 at depths 0, 1, 2) share one release
  # clock. One eviction must take the tail (slot 2), not the head: evicting
  # slot 0 would orphan slots 1 and 2 and A's return would reuse nothing.
  cfg = _cfg(num_slots=4)
  a, x = _rand(6, 12), _rand(7, 8)
  st = cache.init_cache(cfg)
  st, _ = _claim(st, [0], [a])
  st = _commit(st, [0], [a])
  st = _release(st, [0])
  np.testing.assert_array_equal(st.slot_depth[:3], [0, 1, 2])
  st, rx = _claim(st, [1], [x])  # 2 blocks: free slot 3, then one eviction
  assert bool(rx.ok[0])
  np.testing.assert_array_equal(np.asarray(st.seq_slots[1])[:2], [3, 2])
  np.testing.assert_array_equal(st.slot_published, [True, True, False, False])
  cache.validate(st)
  st = _release(st, [1])
  st, ra = _claim(st, [0], [a])
  assert bool(ra.ok[0])
  assert int(ra.num_reused_tokens[0]) == 8
  np.testing.assert_array_equal(np.asarray(st.seq_slots[0])[:2], [0, 1])
  cache.validate(st)


def test_out_of_pages_is_all_or_nothing_first_come_first_served():
  cfg = _cfg()
  st0 = cache.init_cache(cfg)
  prompts = [_rand(1, 16), _rand(2, 20), _rand(3, 4)]  # 4 + 5 + 1 blocks > 8
  st, res = _claim(st0, [0, 1, 2], prompts)
  cache.validate(st)
  np.testing.assert_array_equal(res.ok, [True, False, False])
  np.testing.assert_array_equal(res.num_new_blocks, [4, 0, 0])
  assert not bool(st.seq_live[1]) and not bool(st.seq_live[2])
  np.testing.assert_array_equal(st.seq_slots[1], -1)
  assert int(cache.stats(st)["num_free"]) == 4
  # extend: the first request fits, the second would need 5 more blocks.
  st, ext = cache.extend(st, jnp.array([0, -1], jnp.int32),
                         jnp.array([24, 0], jnp.int32))
  np.testing.assert_array_equal(ext.ok, [False, False])
  st, ext = cache.extend(st, jnp.array([0], jnp.int32), jnp.array([8], jnp.int32))
  np.testing.assert_array_equal(ext.num_new_blocks, [2])
  cache.validate(st)


def test_invalid_requests_leave_state_unchanged():
  cfg = _cfg()
  st0, _ = _claim(cache.init_cache(cfg), [0], [_rand(1, 5)])
  p = _rand(2, 6)
  cases = [
      ([0], [p], None),                 # id already live
      ([8], [p], None),                 # id out of range
      ([-1], [p], None),                # padding
      ([3, 3], [p, p], None),           # duplicate ids
      ([3], [p], [25]),                 # over max_pages * page_size = 24
      ([3], [p], [-1]),                 # negative length
  ]
  for ids, prompts, lengths in cases:
    st, res = _claim(st0, ids, prompts, lengths)
    assert not np.asarray(res.ok).any(), (ids, lengths)
    assert int(np.asarray(res.num_new_blocks).sum()) == 0
    chex.assert_trees_all_equal(st, st0)
  # Over max_pages * page_size with a token row wider than that.
  st, res = cache.claim_batch(st0, jnp.array([3], jnp.int32),
                              _tok([p], width=32), jnp.array([25], jnp.int32))
  assert not bool(res.ok[0])
  chex.assert_trees_all_equal(st, st0)
  st, res = cache.extend(st0, jnp.array([1, 9, 0, 0], jnp.int32),
                         jnp.array([1, 1, 1, 1], jnp.int32))
  assert not np.asarray(res.ok).any()  # dead, out of range, duplicated
  chex.assert_trees_all_equal(st, st0)
  st, fr = cache.fork(st0, jnp.array([0, 1], jnp.int32),
                      jnp.array([0, 2], jnp.int32))  # live child, dead parent
  assert not np.asarray(fr.ok).any()
  assert (np.asarray(fr.src_pages) == -1).all()
  chex.assert_trees_all_equal(st, st0)
  # A parent id one past the last row, with the last row (7) live.
  st7, _ = _claim(st0, [7], [p])
  st, fr = cache.fork(st7, jnp.array([8], jnp.int32), jnp.array([2], jnp.int32))
  assert not bool(fr.ok[0])
  chex.assert_trees_all_equal(st, st7)


def test_reuse_scope_isolation_and_last_token_rule():
  cfg = _cfg(num_slots=16, hash_ways=16)
  p = _rand(7, 12)  # exactly 3 blocks
  st = cache.init_cache(cfg)
  st, _ = _claim(st, [0], [p], scopes=[1])
  st = _commit(st, [0], [p])
  st, res = _claim(st, [1, 2, 3], [p, p, p + [5]], scopes=[2, 1, 1])
  cache.validate(st)
  # Other scope: nothing. Same scope, fully cached prompt: the last block is
  # recomputed so the last token gets logits. One more token: all 3 reused.
  np.testing.assert_array_equal(res.num_reused_tokens, [0, 8, 12])
  np.testing.assert_array_equal(res.num_missed_blocks, [2, 0, 0])
  row0 = np.asarray(st.seq_slots[0])
  np.testing.assert_array_equal(np.asarray(st.seq_slots[3])[:3], row0[:3])
  np.testing.assert_array_equal(np.asarray(st.seq_slots[2])[:2], row0[:2])
  assert np.asarray(st.seq_slots[2])[2] != row0[2]
  s = cache.stats(st)
  assert int(s["num_hits"]) == 5 and int(s["num_lookups"]) == 2 + 2 + 2 + 3
  assert float(s["hit_rate"]) == pytest.approx(5 / 9)
  # No lookup yet: a hit rate of 0, not 0 / 0.
  assert float(cache.stats(cache.init_cache(cfg))["hit_rate"]) == 0.0
  # A shared published block has refcount = number of holders.
  assert int(st.slot_refcount[row0[0]]) == 3


def test_forced_key_collision_is_never_reused(monkeypatch):
  def constant_keys(block_tokens, scope):
    n, nb, _ = block_tokens.shape
    return jnp.zeros((n, nb, 2), jnp.uint32)

  monkeypatch.setattr(hashing, "block_keys", constant_keys)
  # A config used by no other test, so the jitted ops trace the patched hash
  # (and nothing else ever reuses those traces).
  cfg = _cfg(num_slots=16, hash_ways=16, max_seqs=9)
  blk = _rand(9, 4)
  a = blk + blk + _rand(10, 2)  # two identical blocks: same key, same tokens
  st = cache.init_cache(cfg)
  st, _ = _claim(st, [0], [a])
  st = _commit(st, [0], [a])
  cache.validate(st)
  assert int(jnp.sum(st.slot_published)) == 1  # block 1 collides in-batch
  # Block 1 of `a` finds block 0's slot by key with equal tokens, but its
  # parent differs: only block 0 is reused.
  st, res = _claim(st, [1], [a])
  assert int(res.num_reused_tokens[0]) == 4
  # Different tokens under the same key: no reuse at all.
  st, res = _claim(st, [2], [_rand(11, 9)])
  assert int(res.num_reused_tokens[0]) == 0
  # Different scope, same tokens: no reuse.
  st, res = _claim(st, [3], [a], scopes=[5])
  assert int(res.num_reused_tokens[0]) == 0
  cache.validate(st)
  st = _release(st, [2, 3])
  # Same key, one token of the block differs (its first or its last): every
  # token is compared, so no reuse either.
  for seq, pos in ((7, 0), (8, 3)):
    near = list(a)
    near[pos] += 1
    st, res = _claim(st, [seq], [near])
    assert int(res.num_reused_tokens[0]) == 0, pos
  st = _release(st, [7, 8])
  # A colliding publication replaces the old entry instead of aliasing it.
  other = _rand(12, 9)
  st, _ = _claim(st, [4], [other])
  st = _commit(st, [4], [other])
  cache.validate(st)
  st, res = _claim(st, [5], [a])
  assert int(res.num_reused_tokens[0]) == 0
  st, res = _claim(st, [6], [other])
  assert int(res.num_reused_tokens[0]) == 4
  cache.validate(st)


def test_block_under_another_parent_is_not_reused(monkeypatch):
  """With keys of each block's own tokens (not of the chain), a block cached
  under one parent is found by key and tokens under another parent whose
  publication generation is the same: the parent slot must match too, so
  only the leading block is reused. Publishing the block under the new
  parent replaces the key's entry: it is found under that parent, and the
  old chain keeps only its leading block."""
  keys = hashing.block_keys

  def own_block_keys(block_tokens, scope):
    n, nb, ps = block_tokens.shape
    return keys(block_tokens.reshape(n * nb, 1, ps),
                jnp.repeat(scope, nb)).reshape(n, nb, 2)

  monkeypatch.setattr(hashing, "block_keys", own_block_keys)
  # A config used by no other test (the jitted ops trace the patched hash).
  cfg = _cfg(num_slots=12, hash_ways=8, max_seqs=5)
  w, v, x, z = (_rand(30 + i, PS) for i in range(4))
  st = cache.init_cache(cfg)
  st, _ = _claim(st, [0, 1], [w + v + [7], x + z + [7]])
  st = _commit(st, [0, 1], [w + v + [7], x + z + [7]])
  st = _release(st, [0, 1])
  gen = np.asarray(st.slot_gen)
  assert gen[np.asarray(st.slot_published)].tolist() == [1] * 4
  # Z's slot holds Z's key and tokens, its parent X's slot at generation 1,
  # the same generation as W's slot: only W is reused.
  st, res = _claim(st, [2], [w + z + [7]])
  assert int(res.num_reused_tokens[0]) == PS
  st = _commit(st, [2], [w + z + [7]])
  st = _release(st, [2])
  cache.validate(st)
  for seq, prompt, reused in ((3, w + z + [7], 2 * PS), (4, x + z + [7], PS)):
    st, res = _claim(st, [seq], [prompt])
    assert int(res.num_reused_tokens[0]) == reused, seq
  cache.validate(st)


@pytest.mark.parametrize("shared_word", [0, 1])
def test_lookup_matches_the_whole_key_within_a_bucket(monkeypatch,
                                                      shared_word):
  """Keys in one bucket that share one word and differ in the other (the
  first word's low bits are the bucket index: shared, or its high bits
  differ): a lookup must take the entry whose whole key matches, so each
  prompt finds its own cached blocks."""
  keys = hashing.block_keys

  def one_bucket(block_tokens, scope):
    k = keys(block_tokens, scope)
    if shared_word == 0:
      return k.at[..., 0].set(jnp.uint32(0))
    return k.at[..., 0].set(k[..., 0] & jnp.uint32(0xFFFFFF00)).at[
        ..., 1].set(jnp.uint32(0))

  monkeypatch.setattr(hashing, "block_keys", one_bucket)
  # A config used by no other test (the jitted ops trace the patched hash).
  cfg = _cfg(num_slots=20, hash_ways=8, max_seqs=7 - shared_word)
  assert cfg.num_buckets <= 256
  prompts = [_rand(20 + i, 9) for i in range(3)]  # two full blocks each
  st = cache.init_cache(cfg)
  st, _ = _claim(st, [0, 1, 2], prompts)
  st = _commit(st, [0, 1, 2], prompts)
  st = _release(st, [0, 1, 2])
  assert int(jnp.sum(st.slot_published)) == 6
  for seq, prompt in zip((3, 4, 5), prompts):
    st, res = _claim(st, [seq], [prompt])
    assert int(res.num_reused_tokens[0]) == 8, seq
  cache.validate(st)


def test_page_table_traced_layer_in_scan():
  cfg = _cfg(num_layers=3)
  st, _ = _claim(cache.init_cache(cfg), [0, 1, 7],
                 [_rand(1, 9), _rand(2, 3), _rand(3, 5)])
  # Padding and ids past the last row (8, 12: max_seqs is 8, row 7 live)
  # get NULL rows.
  ids = jnp.array([1, -1, 0, 7, 8, 12], jnp.int32)

  def body(carry, layer):
    return carry, (cache.page_table(st, ids, layer),
                   cache.page_table(st, ids, layer, split=False))

  _, (split, shared) = jax.lax.scan(body, 0, jnp.arange(3))
  chex.assert_shape(split, (3, 6, 2, cfg.max_pages))
  chex.assert_shape(shared, (3, 6, cfg.max_pages))
  chex.assert_type(split, jnp.int32)
  rows = np.asarray(st.seq_slots)[[1, 0, 0, 7, 0, 0]]
  rows[1] = rows[4] = rows[5] = -1
  assert (rows[3] >= 0).any()
  for layer in range(3):
    q = np.where(rows >= 0, rows * 3 + layer, -1)
    np.testing.assert_array_equal(shared[layer], q)
    np.testing.assert_array_equal(split[layer, :, 0], np.where(q >= 0, 2 * q, -1))
    np.testing.assert_array_equal(split[layer, :, 1],
                                  np.where(q >= 0, 2 * q + 1, -1))
    np.testing.assert_array_equal(cache.page_table(st, ids, layer), split[layer])
  with pytest.raises(ValueError, match="layer"):
    cache.page_table(st, ids, 3)


def test_config_errors():
  for bad in (0, -2, 4.0, True, None):
    with pytest.raises(ValueError, match="Invalid num_slots: expected a "
                       "positive int"):
      _cfg(num_slots=bad)
  with pytest.raises(ValueError, match="layer_windows"):
    _cfg(layer_windows=(-1,))
  for bad in ((3, -2), (-2, -1)):  # one window below -1 is enough
    with pytest.raises(ValueError, match="expected window_left >= -1"):
      _cfg(layer_windows=bad)
  with pytest.raises(ValueError, match="Invalid max_rewind_len"):
    _cfg(max_rewind_len=-1)
  # Pool pages are int32: num_slots * num_layers * 2 must stay below 2**31.
  with pytest.raises(ValueError, match=(
      r"Invalid num_slots: expected num_slots \* num_layers \* 2 < 2\*\*31 "
      r"pool pages \(int32 page ids\), got 536870912 \* 2 \* 2 = 2147483648")):
    _cfg(num_slots=2**29, num_layers=2)
  assert _cfg(num_slots=2**29 - 1, num_layers=2).num_pool_pages == 2**31 - 4
  with pytest.raises(ValueError, match="Invalid config: expected a CacheConfig"):
    cache.init_cache(dataclasses.asdict(_cfg()))
  # Scratch is active iff enabled and every layer slides (window 0 too).
  for windows, active in (((0, 3), True), ((0, 0), True), ((3, -1), False),
                          (None, False)):
    cfg = _cfg(layer_windows=windows, enable_swa_scratch_reuse=True)
    assert cfg.swa_scratch_active == active, windows
    assert not _cfg(layer_windows=windows).swa_scratch_active
  # One scratch slot serves num_layers scratch blocks: a sequence's scratch
  # row holds cdiv(max_pages, num_layers) slots.
  for max_pages, num_layers, width in ((6, 2, 3), (7, 2, 4), (5, 3, 2),
                                       (2, 4, 1)):
    cfg = _cfg(max_pages=max_pages, num_layers=num_layers)
    assert cache.init_cache(cfg).seq_scratch_slots.shape == (8, width)
  for bad in (3, 12, 0, -8, 8.0, "8", True):
    with pytest.raises(ValueError, match="Invalid hash_buckets: expected a "
                       "power of two or None"):
      _cfg(hash_buckets=bad)
  for good in (None, 1, 2, 1024):
    assert _cfg(hash_buckets=good).hash_buckets == good
  st = cache.init_cache(_cfg())
  with pytest.raises(ValueError, match="tokens"):
    cache.claim_batch(st, jnp.zeros((2,), jnp.int32), jnp.zeros((3, 8), jnp.int32),
                      jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="lengths"):
    cache.claim_batch(st, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 8), jnp.int32),
                      jnp.zeros((2,), jnp.float32))
  for evict in ("always", None, 1):
    with pytest.raises(ValueError, match="Invalid evict: .* got"):
      cache.extend(st, jnp.zeros((2,), jnp.int32), jnp.ones((2,), jnp.int32),
                   evict=evict)


def test_block_keys_chain_and_scope():
  rng = np.random.default_rng(0)
  toks = jnp.asarray(rng.integers(0, 50, (3, 5, PS)), jnp.int32)
  toks = toks.at[1].set(toks[0]).at[2].set(toks[0]).at[2, 1, 0].add(1)
  keys = np.asarray(hashing.block_keys(toks, jnp.array([0, 0, 0], jnp.int32)))
  np.testing.assert_array_equal(keys[0], keys[1])
  # Changing block 1 changes the keys of blocks 1.. (chained), not block 0.
  np.testing.assert_array_equal(keys[2, 0], keys[0, 0])
  assert (keys[2, 1:] != keys[0, 1:]).any(axis=-1).all()
  other = np.asarray(hashing.block_keys(toks, jnp.array([1, 1, 1], jnp.int32)))
  assert (other[0] != keys[0]).any(axis=-1).all()
  # The parallel prefix composition equals a serial fold of the blocks'
  # affine maps from the scope's seed, x <- a * x + b (mod 2**32), mixed.
  a, b = (np.asarray(m, np.uint64) for m in hashing.block_maps(toks))
  salt = np.asarray(hashing._LANE_SALTS, np.uint32)
  x = np.asarray(hashing.fmix32(jnp.zeros((3, 1), jnp.uint32) ^ salt),
                 np.uint64)
  for i in range(5):
    x = (a[:, i] * x + b[:, i]) % 2**32
    np.testing.assert_array_equal(
        np.asarray(hashing.fmix32(jnp.asarray(x, jnp.uint32))), keys[:, i])


def test_default_bucket_count_keeps_the_load_factor_at_most_a_quarter():
  """`hash_buckets=None`: the smallest power of two `p` with `p * hash_ways
  >= 4 * num_slots`; a given `hash_buckets` is kept."""
  for num_slots in (1, 3, 8, 12, 17, 64, 100, 1000):
    for ways in (1, 2, 3, 8, 16, 64, 4096):
      p = 1
      while p * ways < 4 * num_slots:
        p *= 2
      assert hashing.num_buckets(num_slots, ways, None) == p, (num_slots, ways)
      assert hashing.num_buckets(num_slots, ways, 32) == 32
  assert _cfg(num_slots=20, hash_ways=8).num_buckets == 16


def test_in_batch_duplicates_publish_once_past_a_shorter_commit():
  """Three sequences hold the same prompt: block 0 reused from the cache,
  block 1 in a fresh slot each. Committing them in one batch with the
  middle one's length short of block 1 publishes block 1 once (the first
  row's); the third row's copy is a duplicate of the first even with the
  middle row's same-key block, not committed, between them."""
  cfg = _cfg(num_slots=12)
  p = _rand(50, 9)
  st = cache.init_cache(cfg)
  st, _ = _claim(st, [0], [p[:5]])
  st = _commit(st, [0], [p[:5]])
  st = _release(st, [0])
  st, res = _claim(st, [1, 2, 3], [p, p, p])
  np.testing.assert_array_equal(res.num_reused_tokens, [4, 4, 4])
  st = cache.commit(st, jnp.asarray([1, 2, 3], jnp.int32), _tok([p, p, p]),
                    jnp.asarray([8, 4, 8], jnp.int32))
  cache.validate(st)
  np.testing.assert_array_equal(
      st.slot_published[st.seq_slots[1:4, 1]], [True, False, False])
  assert int(jnp.sum(st.slot_published)) == 2


def test_twin_blocks_continue_the_chain():
  """A and B hold the same 8-token prefix in their own slots (claimed
  together, neither reused). Committed together, B's copies are in-batch
  duplicates of A's, so B stops there. B's next commit finds them
  published by A (twins): B's third block is published as the child of
  A's second, and after B grows, its fourth as the child of its third (a
  commit going on past its own published blocks after twins). C, asking
  for B's 16 tokens + 1, reuses A's two blocks and B's two."""
  cfg = _cfg(num_slots=16)
  shared = _rand(60, 8)
  a = shared + _rand(61, 5)
  b = shared + _rand(62, 13)
  st = cache.init_cache(cfg)
  # B claims first: its copies of the shared blocks are slots 0 and 1.
  st, res = _claim(st, [1, 0], [b[:13], a])
  np.testing.assert_array_equal(res.num_reused_tokens, [0, 0])
  np.testing.assert_array_equal(np.asarray(st.seq_slots[1])[:2], [0, 1])
  st = cache.commit(st, jnp.asarray([0, 1], jnp.int32), _tok([a, b]),
                    jnp.asarray([13, 13], jnp.int32))
  np.testing.assert_array_equal(st.slot_published[st.seq_slots[0, :3]],
                                [True, True, True])
  assert not bool(jnp.any(st.slot_published[st.seq_slots[1, :3]]))
  st = cache.commit(st, jnp.asarray([1], jnp.int32), _tok([b]),
                    jnp.asarray([13], jnp.int32))
  a_slots, b_slots = np.asarray(st.seq_slots[0]), np.asarray(st.seq_slots[1])
  np.testing.assert_array_equal(st.slot_published[b_slots[:3]],
                                [False, False, True])
  assert int(st.slot_parent[b_slots[2]]) == a_slots[1]
  assert int(st.slot_parent_gen[b_slots[2]]) == int(st.slot_gen[a_slots[1]])
  st, _ = cache.extend(st, jnp.asarray([1], jnp.int32),
                       jnp.asarray([8], jnp.int32))
  st = cache.commit(st, jnp.asarray([1], jnp.int32), _tok([b]),
                    jnp.asarray([21], jnp.int32))
  b_slots = np.asarray(st.seq_slots[1])
  assert bool(st.slot_published[b_slots[3]])
  assert int(st.slot_parent[b_slots[3]]) == b_slots[2]
  cache.validate(st)
  st, rc = _claim(st, [2], [b[:17]])
  assert int(rc.num_reused_tokens[0]) == 16
  np.testing.assert_array_equal(np.asarray(st.seq_slots[2])[:4],
                                [a_slots[0], a_slots[1], b_slots[2],
                                 b_slots[3]])
  cache.validate(st)


def test_blocks_after_an_evicted_twin_are_published_again():
  """B published its third block as the child of A's second (its twin).
  A's blocks are then evicted. B's next commit publishes its own first
  blocks, then its third again under its own second (the old parent left
  the cache) and its new blocks after it: C, asking for B's tokens,
  reuses all five blocks."""
  cfg = _cfg(num_slots=10)
  shared = _rand(80, 8)
  a = shared + _rand(81, 5)
  b = shared + _rand(82, 13)
  st = cache.init_cache(cfg)
  st, _ = _claim(st, [0, 1], [a, b[:13]])
  st = cache.commit(st, jnp.asarray([0, 1], jnp.int32), _tok([a, b]),
                    jnp.asarray([13, 13], jnp.int32))
  st = _commit(st, [1], [b[:13]])
  a_row, b2 = st.seq_slots[0, :3], int(st.seq_slots[1, 2])
  assert bool(st.slot_published[b2]) and int(st.slot_parent[b2]) == a_row[1]
  st = _release(st, [0])
  st, rx = _claim(st, [2], [_rand(83, 24)])  # evicts A's three blocks
  assert bool(rx.ok[0])
  assert not bool(jnp.any(st.slot_published[a_row]))
  st = _release(st, [2])
  st, ext = cache.extend(st, jnp.asarray([1], jnp.int32),
                         jnp.asarray([8], jnp.int32))
  assert bool(ext.ok[0])
  gen_b2 = int(st.slot_gen[b2])
  st = _commit(st, [1], [b])
  row = np.asarray(st.seq_slots[1])[:5]
  np.testing.assert_array_equal(st.slot_published[row], [True] * 5)
  np.testing.assert_array_equal(st.slot_parent[row], [-1, *row[:4]])
  assert int(st.slot_gen[b2]) == gen_b2 + 1
  cache.validate(st)
  st, rc = _claim(st, [3], [b])
  assert int(rc.num_reused_tokens[0]) == 20
  np.testing.assert_array_equal(np.asarray(st.seq_slots[3])[:5], row)


def test_orphan_is_not_a_twin():
  """A publishes two blocks, then its head's slot moves to a new
  generation (as a republish after an eviction does): A's second block
  names it as parent at the old one, an orphan that claims skip. B reuses
  the head and holds the second block in its own slot; committing it, B
  does not take the orphan for a twin (a chain from it is unreachable) but
  replaces it, so E, asking for the same tokens, reuses both blocks."""
  cfg = _cfg(num_slots=8)
  p = _rand(70, 9)
  st = cache.init_cache(cfg)
  st, _ = _claim(st, [0], [p])
  st = _commit(st, [0], [p[:8]])
  a0, a1 = (int(x) for x in st.seq_slots[0, :2])
  st = _release(st, [0])
  st = dataclasses.replace(st, slot_gen=st.slot_gen.at[a0].add(1))
  st, rb = _claim(st, [1], [p])
  assert int(rb.num_reused_tokens[0]) == 4
  b1 = int(st.seq_slots[1, 1])
  assert b1 != a1
  st = _commit(st, [1], [p[:8]])
  assert bool(st.slot_published[b1]) and not bool(st.slot_published[a1])
  assert int(st.slot_parent[b1]) == a0
  assert int(st.slot_parent_gen[b1]) == int(st.slot_gen[a0])
  cache.validate(st)
  st, re_ = _claim(st, [2], [p])
  assert int(re_.num_reused_tokens[0]) == 8
  np.testing.assert_array_equal(np.asarray(st.seq_slots[2])[:2], [a0, b1])


def test_full_hash_bucket_only_skips_publication():
  cfg = _cfg(num_slots=16, hash_ways=2, hash_buckets=1)
  p, q = _rand(20, 12), _rand(21, 12)
  st = cache.init_cache(cfg)
  st, _ = _claim(st, [0, 1], [p, q])
  st = _commit(st, [0, 1], [p, q])  # 6 full blocks, room for 2 entries
  cache.validate(st)
  assert int(jnp.sum(st.slot_published)) == 2
  # Seq 0's first two blocks won the two ways; its chain stops there and seq
  # 1 publishes nothing.
  np.testing.assert_array_equal(st.slot_published[st.seq_slots[0, :3]],
                                [True, True, False])
  st, res = _claim(st, [2, 3], [p + [1], q + [1]])
  np.testing.assert_array_equal(res.num_reused_tokens, [8, 0])
  cache.validate(st)


def test_full_sliding_bucket_only_skips_publication():
  """A sliding group's bucket holds blocks whose global anchors were evicted
  (its own pool had room to keep them): a later prompt's global blocks take
  the freed ways, its anchored sliding blocks find none and stay unpublished,
  the entries in their way untouched."""
  cfg = cache.HybridCacheConfig(
      layer_windows=(-1, PS, -1), group_num_slots=(3, 8), page_size=PS,
      max_seqs=3, max_pages=4, hash_ways=2, hash_buckets=1)
  a, c = _rand(22, 9), _rand(23, 9)  # 2 full blocks each
  st = cache.init_cache(cfg)
  st, _ = _claim(st, [0], [a])
  st = _commit(st, [0], [a])
  st = _release(st, [0])
  st, res = _claim(st, [1], [c])  # group 0 evicts both of A's blocks
  assert bool(res.ok[0])
  g0, g1 = st.groups
  assert not bool(jnp.any(g0.slot_published))
  assert int(jnp.sum(g1.slot_published)) == 2  # A's, anchors gone
  st = _commit(st, [1], [c])
  cache.validate(st)
  n0, n1 = st.groups
  np.testing.assert_array_equal(n0.slot_published[n0.seq_slots[1, :2]],
                                [True, True])
  np.testing.assert_array_equal(n1.slot_published[n1.seq_slots[1, :2]],
                                [False, False])
  np.testing.assert_array_equal(n1.hash_table, g1.hash_table)


def test_sliding_block_under_another_anchor_is_not_reused(monkeypatch):
  """Keys made by a block's own tokens (every equal block collides): a
  sliding group's entry whose anchor is another prompt's global block is
  not reused, though its key and tokens match and the global group serves
  the prompt's own chain. A publishes both groups; its global blocks are
  evicted, its sliding entries stay; D (another first block, A's second
  block) publishes its global blocks only (its sliding ones fell out of the
  window first); B, D's prefix, then reuses nothing: D's sliding blocks are
  gone and A's answers only under A's anchor."""
  def own_tokens_keys(block_tokens, scope):
    t = block_tokens.astype(jnp.uint32)
    w = jnp.arange(1, t.shape[-1] + 1, dtype=jnp.uint32)
    return jnp.stack([jnp.sum(t * w, axis=-1) + scope.astype(jnp.uint32)[
        :, None], t[..., 0] ^ (t[..., -1] << 8)], axis=-1)

  monkeypatch.setattr(hashing, "block_keys", own_tokens_keys)
  # A config used by no other test (the jitted ops trace the patched keys).
  cfg = cache.HybridCacheConfig(
      layer_windows=(-1, PS, -1), group_num_slots=(5, 8), page_size=PS,
      max_seqs=4, max_pages=5, hash_ways=2, hash_buckets=1)
  y = _rand(31, PS)
  a, d = _rand(30, PS) + y + [7], _rand(32, PS) + y + [7]
  st = cache.init_cache(cfg)
  st, _ = _claim(st, [0], [a])
  st = _commit(st, [0], [a])
  st = _release(st, [0])
  st, res = _claim(st, [1], [_rand(33, 17)])  # evicts A's global blocks
  assert bool(res.ok[0])
  st = _release(st, [1])
  g0, g1 = st.groups
  assert not bool(jnp.any(g0.slot_published))
  assert int(jnp.sum(g1.slot_published)) == 2  # A's, anchors gone
  st, res = _claim(st, [2], [d])
  assert bool(res.ok[0]) and int(res.num_reused_tokens[0]) == 0
  for _ in range(2):  # to 17 tokens: blocks 0 and 1 leave the window
    st, res = cache.extend(st, jnp.array([2], jnp.int32),
                           jnp.array([4], jnp.int32))
    assert bool(res.ok[0])
  d17 = d + _rand(34, 8)
  st = _commit(st, [2], [d17])
  cache.validate(st)
  n0, n1 = st.groups
  np.testing.assert_array_equal(n0.slot_published[n0.seq_slots[2, :2]],
                                [True, True])
  np.testing.assert_array_equal(n1.hash_table, g1.hash_table)  # A's entries
  st = _release(st, [2])
  st, res = _claim(st, [3], [d[:2 * PS] + [9]])
  assert bool(res.ok[0])
  assert int(res.num_reused_tokens[0]) == 0
  cache.validate(st)


def test_bucket_ways_go_to_that_buckets_blocks(monkeypatch):
  """A commit's fresh blocks rank per bucket (row-major): blocks of other
  buckets do not use up a bucket's ways. Keys are set by hand: block `i` of
  row `r` goes to bucket `buckets[r, i]` (two ways each), so row 0 publishes
  all 4 blocks and row 1 stops at its block 1, the third of bucket 5."""
  buckets = np.asarray([[5, 6, 5, 7], [6, 5, 8, 9]], np.uint32)

  def set_buckets(block_tokens, scope):
    n, nb, _ = block_tokens.shape
    ids = np.arange(n * nb, dtype=np.uint32).reshape(n, nb) + 1
    bkt = np.pad(buckets, ((0, 0), (0, nb - 4)), constant_values=15)
    return jnp.stack([jnp.asarray(bkt[:n]), jnp.asarray(ids)], axis=-1)

  monkeypatch.setattr(hashing, "block_keys", set_buckets)
  # A config used by no other test (the jitted ops trace the patched keys).
  cfg = _cfg(num_slots=16, hash_ways=2, hash_buckets=16, max_seqs=3)
  p, q = _rand(40, 17), _rand(41, 17)  # 4 full blocks each
  st = cache.init_cache(cfg)
  st, _ = _claim(st, [0, 1], [p, q])
  st = _commit(st, [0, 1], [p, q])
  cache.validate(st)
  np.testing.assert_array_equal(st.slot_published[st.seq_slots[0, :4]],
                                [True] * 4)
  np.testing.assert_array_equal(st.slot_published[st.seq_slots[1, :4]],
                                [True, False, False, False])


def test_extend_without_eviction_uses_free_slots_only():
  cfg = _cfg()
  st0, _ = _setup_cached(cfg)  # 2 free, 4 cached, H (id 2, 8 tokens) live
  ids = jnp.array([2], jnp.int32)
  # 4 more tokens: one block, a free one; both variants agree.
  a, ra = cache.extend(st0, ids, jnp.array([4], jnp.int32))
  b, rb = cache.extend(st0, ids, jnp.array([4], jnp.int32), evict=False)
  chex.assert_trees_all_equal((a, ra), (b, rb))
  # 12 more tokens: three blocks, one past the free ones. With eviction it is
  # granted; without, refused, and no cached block is touched.
  a, ra = cache.extend(st0, ids, jnp.array([12], jnp.int32))
  b, rb = cache.extend(st0, ids, jnp.array([12], jnp.int32), evict=False)
  assert bool(ra.ok[0]) and not bool(rb.ok[0])
  assert int(rb.num_new_blocks[0]) == 0
  chex.assert_trees_all_equal(b, st0)
  cache.validate(a)
  cache.validate(b)


@pytest.mark.parametrize("n", [1, 7, 512, 513, 1000, 4096])
def test_prefix_count_equals_cumsum(n):
  from pkvattn.cache import alloc
  rng = np.random.default_rng(n)
  for p in (0.0, 0.3, 1.0):
    mask = rng.random(n) < p
    got = jax.jit(alloc._prefix_count)(jnp.asarray(mask))
    chex.assert_type(got, jnp.int32)
    np.testing.assert_array_equal(got, np.cumsum(mask))


def test_claim_without_eviction_uses_free_slots_only():
  cfg = _cfg()
  st0, a = _setup_cached(cfg)  # 2 free, 4 cached (A's two blocks among them)
  # A again (reuses its 2 cached blocks) + 4 tokens: 1 new block, free: both
  # variants agree, reuse included.
  prompt = a[:8] + _rand(9, 4)
  ra_st, ra = _claim(st0, [3], [prompt])
  rb_st, rb = cache.claim_batch(st0, jnp.asarray([3], jnp.int32), _tok([prompt]),
                                jnp.asarray([12], jnp.int32), evict=False)
  chex.assert_trees_all_equal((ra_st, ra), (rb_st, rb))
  assert int(rb.num_reused_tokens[0]) == 8
  # 12 fresh tokens: 3 blocks, one past the free ones.
  x = _rand(4, 12)
  st_e, re_ = _claim(st0, [3], [x])
  st_n, rn = cache.claim_batch(st0, jnp.asarray([3], jnp.int32), _tok([x]),
                               jnp.asarray([12], jnp.int32), evict=False)
  assert bool(re_.ok[0]) and not bool(rn.ok[0])
  chex.assert_trees_all_equal(st_n, st0)
  cache.validate(st_e)
