"""The host tier of the prefix cache (`cache/host_tier.py`).

A fuzzer drives a small device cache through random claims, commits,
releases and extends, with the host tier mirroring ahead before every
allocating op (`host_offload_plan`, pages copied device -> host) and reloading
on claims (`host_lookup` from the device's reused blocks on, pages copied
host -> the claimed slots). A KV-content oracle writes each block's pages as
a function of its scope and every token up to the block's end at "prefill";
a reloaded block must equal what was written for that very prefix, bit for
bit, so a wrong hit (other tokens, other scope, a stale chain) fails. The
invariants of both tiers hold after every op, and the device state is the
one the same ops give without the tier.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pkvattn import cache

CFG = cache.CacheConfig(num_slots=6, page_size=2, num_layers=2, max_seqs=3,
                        max_pages=5, hash_ways=4)
PS, L2, MAX_LEN = CFG.page_size, CFG.num_layers * 2, CFG.max_seq_len
HOST = cache.HostTierConfig(num_slots=5, page_size=PS, hash_ways=4)
MAX_BLOCKS = CFG.max_pages + 1


def _content(scope, prefix):
  """The pages of a block: `i32[L2, PS]`, from its scope and every token up
  to its end (a partial block's too)."""
  seed = zlib.crc32(np.asarray([scope, *prefix], np.int64).tobytes())
  return (np.arange(L2 * PS, dtype=np.int64).reshape(L2, PS) * 7919
          + seed).astype(np.int32)


class World:
  """A device cache + host tier with page buffers and the oracle."""

  def __init__(self, tier: bool):
    self.tier = tier
    self.state = cache.init_cache(CFG)
    self.host = cache.init_host_tier(HOST)
    self.pool = np.zeros((CFG.num_slots, L2, PS), np.int32)
    self.host_buf = np.zeros((HOST.num_slots, L2, PS), np.int32)
    self.seqs = {}            # seq id -> (scope, tokens)
    self.by_key = {}          # published key -> pages written
    self.reloaded = 0

  def mirror(self, num_new):
    if not self.tier:
      return
    self.host, src, dst = cache.host_offload_plan(
        self.state, self.host, num_new, max_blocks=MAX_BLOCKS)
    src, dst = np.asarray(src), np.asarray(dst)
    n = int(np.sum(src >= 0))
    assert (src[n:] < 0).all() and (dst[n:] < 0).all() and (dst[:n] >= 0).all()
    assert len(set(dst[:n].tolist())) == n
    self.host_buf[dst[:n]] = self.pool[src[:n]]

  def write(self, seq, first_block):
    """Prefill: the pages of blocks `first_block..` of `seq`."""
    scope, toks = self.seqs[seq]
    row = np.asarray(self.state.seq_slots[seq])
    for b in range(first_block, -(-len(toks) // PS)):
      self.pool[row[b]] = _content(scope, toks[:(b + 1) * PS])

  def check_blocks(self, seq, blocks):
    scope, toks = self.seqs[seq]
    row = np.asarray(self.state.seq_slots[seq])
    for b in blocks:
      np.testing.assert_array_equal(
          self.pool[row[b]], _content(scope, toks[:(b + 1) * PS]),
          err_msg=f"seq {seq} block {b}")

  def claim(self, seq, scope, toks):
    if self.tier:
      self.mirror(-(-len(toks) // PS))
    padded = np.zeros(MAX_LEN, np.int32)
    padded[:len(toks)] = toks
    self.state, res = cache.claim_batch(self.state, [seq], padded[None],
                                        [len(toks)], [scope])
    ok = bool(res.ok[0])
    if not ok:
      return res
    self.seqs[seq] = (scope, list(toks))
    reused = int(res.num_reused_tokens[0]) // PS
    self.check_blocks(seq, range(reused))   # device reuse is exact too
    hits = 0
    if self.tier:
      self.host, n, slots = cache.host_lookup(
          self.host, padded[None], [len(toks)], [reused], [scope])
      hits, slots = int(n[0]), np.asarray(slots[0])
      assert hits <= (len(toks) - 1) // PS - reused
      row = np.asarray(self.state.seq_slots[seq])
      for b in range(reused, reused + hits):
        self.pool[row[b]] = self.host_buf[slots[b]]
      self.check_blocks(seq, range(reused, reused + hits))  # bit for bit
      self.reloaded += hits
    self.write(seq, reused + hits)
    return res

  def commit(self, seq):
    scope, toks = self.seqs[seq]
    padded = np.zeros(MAX_LEN, np.int32)
    padded[:len(toks)] = toks
    self.state = cache.commit(self.state, [seq], padded[None], [len(toks)])
    row = np.asarray(self.state.seq_slots[seq])
    pub = np.asarray(self.state.slot_published)
    keys = np.asarray(self.state.slot_key)
    for b in range(len(toks) // PS):
      if row[b] >= 0 and pub[row[b]]:
        self.by_key[tuple(keys[row[b]].tolist())] = self.pool[row[b]].copy()

  def release(self, seq):
    self.state = cache.release(self.state, [seq])
    del self.seqs[seq]

  def extend(self, seq, new):
    scope, toks = self.seqs[seq]
    if self.tier:
      self.mirror(-(-len(new) // PS) + 1)
    self.state, res = cache.extend(self.state, [seq], [len(new)])
    if bool(res.ok[0]):
      first = len(toks) // PS
      self.seqs[seq] = (scope, toks + list(new))
      self.write(seq, first)
    return res

  def check(self):
    cache.validate(self.state)
    cache.validate_host_tier(self.host)
    hs = cache.host_tier_stats(self.host)
    assert int(hs["num_valid"]) + int(hs["num_free"]) == HOST.num_slots
    valid = np.asarray(self.host.valid)
    keys = np.asarray(self.host.key)
    for h in np.flatnonzero(valid):
      # Every host entry holds what was written for its block.
      np.testing.assert_array_equal(self.host_buf[h],
                                    self.by_key[tuple(keys[h].tolist())])


def _assert_same_state(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


OPS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, CFG.max_seqs - 1),
                         st.integers(0, 2**30)), min_size=5, max_size=30)


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_fuzz_offload_reload_oracle(ops):
  on, off = World(tier=True), World(tier=False)
  # Few distinct prefixes, so prompts share and return to them.
  bases = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9],
           [5, 5, 6, 6, 7, 7, 8, 8]]
  for kind, seq, r in ops:
    rng = np.random.default_rng(r)
    live = seq in on.seqs
    if not live:
      base = bases[r % 3]
      n = int(rng.integers(3, MAX_LEN + 1))
      toks = (base + rng.integers(1, 3, MAX_LEN).tolist())[:n]
      scope = int(r % 7 == 0)
      a, b = on.claim(seq, scope, toks), off.claim(seq, scope, toks)
      assert a.ok.tolist() == b.ok.tolist()
      assert a.num_reused_tokens.tolist() == b.num_reused_tokens.tolist()
    elif kind == 0:
      on.release(seq), off.release(seq)
    elif kind == 1:
      on.commit(seq), off.commit(seq)
    elif kind == 2:
      on.commit(seq), off.commit(seq)
      on.release(seq), off.release(seq)
    elif kind == 3:
      room = MAX_LEN - len(on.seqs[seq][1])
      new = rng.integers(1, 4, int(rng.integers(0, room + 1))).tolist()
      a, b = on.extend(seq, new), off.extend(seq, new)
      assert a.ok.tolist() == b.ok.tolist()
    on.check()
    # The tier never changes the device cache.
    _assert_same_state(on.state, off.state)


def _published_and_released(world, seq, scope, toks):
  world.claim(seq, scope, toks)
  world.commit(seq)
  world.release(seq)


def test_reload_after_eviction_and_scopes():
  w = World(tier=True)
  a = [1, 2, 3, 4, 5, 6, 7]            # 3 full blocks + 1 token
  _published_and_released(w, 0, 0, a)
  # Fill the device with another prompt: A's blocks are mirrored, then
  # evicted.
  b = [9, 8, 7, 6, 5, 4, 3, 2, 1, 9]   # 5 slots of 6: 2 of A's evicted
  w.claim(1, 0, b)
  assert int(cache.host_tier_stats(w.host)["num_valid"]) == 2
  w.commit(1), w.release(1)
  w.check()
  # Another tenant never hits A's blocks.
  res = w.claim(2, 1, a + [1])
  assert int(res.num_reused_tokens[0]) == 0 and w.reloaded == 0
  w.release(2)
  res = w.claim(0, 0, a + [1])
  reused = int(res.num_reused_tokens[0]) // PS
  # Blocks 0 and 1 come back from the host (bit-exact: `claim` checks).
  assert reused == 0 and w.reloaded >= 2
  w.check()


def test_plan_follows_device_eviction_order():
  """Cached slots are picked least recently released first, the blocks of one
  release deepest first (a chain's tail before its head), only as many as the
  allocation would evict past the free ones."""
  w = World(tier=True)
  w.claim(0, 0, [1, 2, 3, 4])                 # slots 0, 1
  w.claim(1, 0, [5, 6, 7, 8, 9])              # slots 2, 3, 4
  w.commit(0), w.commit(1)
  w.release(1)                                # 3, 2 cached first; 4 free
  w.release(0)                                # then 1, 0
  state = w.state
  free = int(cache.stats(state)["num_free"])
  assert free == 2
  host = cache.init_host_tier(HOST)
  host, src, dst = cache.host_offload_plan(state, host, free + 3,
                                           max_blocks=4)
  assert np.asarray(src).tolist() == [3, 2, 1, -1]
  assert np.asarray(dst).tolist() == [0, 1, 2, -1]
  # Nothing to evict: nothing planned.
  _, src, _ = cache.host_offload_plan(state, cache.init_host_tier(HOST), free,
                                      max_blocks=4)
  assert (np.asarray(src) < 0).all()
  # Already on the host: not copied again.
  host, src, _ = cache.host_offload_plan(state, host, free + 4, max_blocks=4)
  assert np.asarray(src).tolist() == [0, -1, -1, -1]


def test_host_lru_eviction():
  """A full host tier evicts its least recently used entry; a lookup
  refreshes the entries it finds."""
  host_cfg = cache.HostTierConfig(num_slots=2, page_size=PS, hash_ways=4)
  pad = lambda t: [t + [0] * (MAX_LEN - len(t))]   # noqa: E731
  state = cache.init_cache(CFG)
  p0, p1 = [1, 1], [2, 2]                           # one block each
  for s, t in ((0, p0), (1, p1)):
    state, _ = cache.claim_batch(state, [s], pad(t), [2])
    state = cache.commit(state, [s], pad(t), [2])
  state = cache.release(state, [0])
  state = cache.release(state, [1])
  host = cache.init_host_tier(host_cfg)
  host, src, dst = cache.host_offload_plan(state, host, 99, max_blocks=4)
  assert np.asarray(dst).tolist() == [0, 1, -1, -1]
  host, n, _ = cache.host_lookup(host, pad(p0 + [0]), [3], [0])
  assert int(n[0]) == 1                             # p0's entry refreshed
  # A long prompt takes every device slot (p0, p1 evicted there), then is
  # published and released; its first block goes to the host, evicting the
  # least recently used entry: p1's.
  big = [3] * MAX_LEN
  state, res = cache.claim_batch(state, [2], pad(big), [MAX_LEN])
  state, res1 = cache.claim_batch(state, [1], pad([4, 4]), [2])
  assert bool(res.ok[0]) and bool(res1.ok[0])
  assert int(cache.stats(state)["num_published"]) == 0
  state = cache.commit(state, [2], pad(big), [MAX_LEN])
  state = cache.release(state, [2])
  free = int(cache.stats(state)["num_free"])
  host, src, dst = cache.host_offload_plan(state, host, free + 1,
                                           max_blocks=4)
  # Big's blocks were released together: its deepest block goes first, slot
  # 0 (its last block, which took p0's evicted slot).
  assert np.asarray(src).tolist() == [0, -1, -1, -1]
  assert np.asarray(dst).tolist() == [1, -1, -1, -1]
  assert np.asarray(host.key[1]).tolist() == np.asarray(
      state.slot_key[0]).tolist()
  cache.validate_host_tier(host)
  _, n0, _ = cache.host_lookup(host, pad(p0 + [0]), [3], [0])
  _, n1, _ = cache.host_lookup(host, pad(p1 + [0]), [3], [0])
  assert (int(n0[0]), int(n1[0])) == (1, 0)


def test_lookup_never_counts_the_last_block_and_respects_start():
  w = World(tier=True)
  a = [1, 2, 3, 4, 5, 6]                # 3 full blocks
  _published_and_released(w, 0, 0, a)
  w.host, _, _ = cache.host_offload_plan(w.state, w.host, 99, max_blocks=8)
  padded = jnp.asarray([a + [0] * (MAX_LEN - 6)], jnp.int32)
  _, n, slots = cache.host_lookup(w.host, padded, [6], [0])
  assert int(n[0]) == 2 and (np.asarray(slots[0, 2:]) < 0).all()
  _, n, slots = cache.host_lookup(w.host, padded, [6], [1])
  assert int(n[0]) == 1 and int(slots[0, 0]) == -1
  # A different first block breaks the chain: later blocks never match.
  other = jnp.asarray([[9, 9] + a[2:] + [0] * (MAX_LEN - 6)], jnp.int32)
  _, n, _ = cache.host_lookup(w.host, other, [6], [0])
  assert int(n[0]) == 0
  _, n, _ = cache.host_lookup(w.host, other, [6], [1])
  assert int(n[0]) == 0                  # block 1's parent key differs


def test_config_validation():
  with pytest.raises(ValueError, match="num_slots"):
    cache.HostTierConfig(num_slots=0, page_size=4)
  for bad in (3, 6, 0, -4, 8.0, "8", True):
    with pytest.raises(ValueError, match="hash_buckets"):
      cache.HostTierConfig(num_slots=4, page_size=4, hash_buckets=bad)
  for good in (1, 2, 64):
    assert cache.HostTierConfig(num_slots=4, page_size=4,
                                hash_buckets=good).num_buckets == good
  # 16 ways by default: the smallest power of two >= 4 * num_slots / 16.
  assert [cache.HostTierConfig(num_slots=n, page_size=4).num_buckets
          for n in (64, 68)] == [16, 32]
  # Hashable and immutable: a jit static argument.
  cfg = cache.HostTierConfig(num_slots=4, page_size=4)
  assert hash(cfg) == hash(dataclasses.replace(cfg))
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.num_slots = 8
  with pytest.raises(ValueError, match="page_size"):
    cache.host_offload_plan(cache.init_cache(CFG), cache.init_host_tier(
        cache.HostTierConfig(num_slots=4, page_size=8)), 1, max_blocks=2)


def test_invalidate_frees_slots_and_stops_hits(rng):
  """Host slots dropped by `host_invalidate` are free, out of the table, no
  longer found by a lookup, and taken again by the next plan."""
  cfg = cache.CacheConfig(num_slots=4, page_size=2, num_layers=1, max_seqs=2,
                          max_pages=4)
  state = cache.init_cache(cfg)
  host = cache.init_host_tier(cache.HostTierConfig(num_slots=4, page_size=2))
  a = rng.integers(1, 1000, 7).tolist()       # 3 full blocks + 1 token
  state, _ = cache.claim_batch(state, [0], [a], [7])
  state = cache.commit(state, [0], [a], [7])
  state = cache.release(state, [0])
  host, src, dst = cache.host_offload_plan(state, host, 4, max_blocks=4)
  dst = np.asarray(dst)
  assert int((dst >= 0).sum()) == 3
  padded = np.asarray(a + [0], np.int32)[None]
  _, hits, _ = cache.host_lookup(host, padded, [7], [0])
  assert hits.tolist() == [3]
  # Drop the middle block's slot (and a padding entry, and a free slot).
  free = int(np.setdiff1d(np.arange(4), dst[:3])[0])
  host = cache.host_invalidate(host, np.array([dst[1], -1, free], np.int32))
  cache.validate_host_tier(host)
  st = cache.host_tier_stats(host)
  assert int(st["num_valid"]) == 2 and int(st["num_free"]) == 2
  _, hits, _ = cache.host_lookup(host, padded, [7], [0])
  assert hits.tolist() == [1]                 # the chain stops at the hole
  # The next plan mirrors the block again into a free slot.
  host, src2, dst2 = cache.host_offload_plan(state, host, 4, max_blocks=4)
  got = np.asarray(dst2)[np.asarray(src2) == np.asarray(src)[1]]
  assert len(got) == 1 and not np.isin(got[0], [dst[0], dst[2]])
  cache.validate_host_tier(host)
  _, hits, _ = cache.host_lookup(host, padded, [7], [0])
  assert hits.tolist() == [3]


def _offloaded(rng, host_cfg, num_tokens):
  """A device cache holding one published, released prompt of `num_tokens`
  random tokens (page size 2) and a host tier that mirrored its blocks:
  `(state, host, src, dst, tokens)`, src and dst those of the plan."""
  cfg = cache.CacheConfig(num_slots=8, page_size=2, num_layers=1, max_seqs=1,
                          max_pages=8)
  state = cache.init_cache(cfg)
  toks = rng.integers(1, 10**6, num_tokens).tolist()
  state = _published(state, 0, toks)
  host = cache.init_host_tier(host_cfg)
  host, src, dst = cache.host_offload_plan(state, host, 8, max_blocks=8)
  return state, host, np.asarray(src), np.asarray(dst), toks


def test_plan_gives_each_bucket_its_own_ways(rng):
  """With one way per bucket, a plan keeps exactly one block per distinct
  bucket of its blocks' keys: ways are counted per bucket, not across the
  plan."""
  host_cfg = cache.HostTierConfig(num_slots=8, page_size=2, hash_ways=1,
                                  hash_buckets=1024)
  state, host, src, dst, _ = _offloaded(rng, host_cfg, 9)   # 4 full blocks
  keys = np.asarray(state.slot_key)[:, 0]
  published = np.flatnonzero(np.asarray(state.slot_published))
  assert len(published) == 4
  buckets = {int(k) & 1023 for k in keys[published]}
  assert int((src >= 0).sum()) == len(buckets)
  cache.validate_host_tier(host)
  # One bucket of two ways: two of the four blocks are kept, the others
  # dropped (never written over a taken way).
  host_cfg = cache.HostTierConfig(num_slots=8, page_size=2, hash_ways=2,
                                  hash_buckets=1)
  _, host, src, _, _ = _offloaded(rng, host_cfg, 9)
  assert int((src >= 0).sum()) == 2
  assert int(cache.host_tier_stats(host)["num_valid"]) == 2
  cache.validate_host_tier(host)


def test_invalidate_clears_the_first_table_position(rng):
  """One bucket: the blocks take its ways in plan order from position 0;
  freeing the entry at position 0 takes it out of the table too."""
  host_cfg = cache.HostTierConfig(num_slots=4, page_size=2, hash_ways=4,
                                  hash_buckets=1)
  _, host, src, dst, _ = _offloaded(rng, host_cfg, 7)       # 3 full blocks
  assert int((src >= 0).sum()) == 3
  pos = np.asarray(host.hash_pos)
  first = int(np.flatnonzero(pos == 0)[0])
  host = cache.host_invalidate(host, np.array([first], np.int32))
  cache.validate_host_tier(host)
  assert int(host.hash_table[0, 0]) == -1
  assert not bool(host.valid[first])


def test_find_matches_both_key_words():
  """A host entry is found only by its whole 64-bit key: equal first words
  (the bucket's) or equal second words alone are not a match."""
  from pkvattn.cache.host_tier import _find
  host = cache.init_host_tier(cache.HostTierConfig(num_slots=2, page_size=2,
                                                   hash_ways=2,
                                                   hash_buckets=1))
  key = np.array([[5, 7], [9, 11]], np.uint32)
  host = dataclasses.replace(
      host, key=jnp.asarray(key), valid=jnp.ones((2,), bool),
      hash_pos=jnp.arange(2, dtype=jnp.int32),
      hash_table=jnp.arange(2, dtype=jnp.int32)[None])
  cache.validate_host_tier(host)
  queries = np.array([[5, 7], [9, 11], [6, 7], [5, 8], [9, 7], [6, 11]],
                     np.uint32)
  found, bucket = _find(host, jnp.asarray(queries))
  assert np.asarray(found).tolist() == [0, 1, -1, -1, -1, -1]
  assert np.asarray(bucket).tolist() == [0] * 6


def test_a_colliding_key_is_never_a_hit(rng):
  """A lookup verifies the entry its key finds: an entry with the block's
  64-bit key but another token, scope, first-block flag or parent key (a
  hash collision, made here by editing the entry) is a miss, and the chain
  of hits stops before it."""
  host_cfg = cache.HostTierConfig(num_slots=4, page_size=2)
  _, host, _, _, toks = _offloaded(rng, host_cfg, 7)      # 3 full blocks
  padded = np.asarray(toks + [0], np.int32)[None]
  _, n, slots = cache.host_lookup(host, padded, [7], [0])
  assert n.tolist() == [3]
  h0, h1 = int(slots[0, 0]), int(slots[0, 1])

  def edited(h, name, value):
    return dataclasses.replace(
        host, **{name: getattr(host, name).at[h].set(value)})

  one = jnp.uint32(1)
  for h, name, value, hits in (
      (h0, "tokens", host.tokens[h0].at[1].add(1), 0),
      (h0, "tokens", host.tokens[h0].at[0].add(1), 0),
      (h0, "scope", 1, 0),
      (h0, "is_first", False, 0),
      (h1, "is_first", True, 1),
      (h1, "parent_key", host.parent_key[h1].at[0].add(one), 1),
      (h1, "parent_key", host.parent_key[h1].at[1].add(one), 1)):
    _, n, _ = cache.host_lookup(edited(h, name, value), padded, [7], [0])
    assert n.tolist() == [hits], (name, h)


def test_plan_refuses_max_blocks_below_one():
  state = cache.init_cache(CFG)
  host = cache.init_host_tier(HOST)
  for bad in (0, -1, 2.0, True):
    with pytest.raises(ValueError, match="Invalid max_blocks: expected a "
                       "positive int"):
      cache.host_offload_plan(state, host, 1, max_blocks=bad)
  _, src, dst = cache.host_offload_plan(state, host, 1, max_blocks=1)
  assert src.shape == dst.shape == (1,)


def _published(state, seq, toks):
  """`state` after `toks` were claimed, committed and released by `seq`."""
  n = len(toks)
  state, res = cache.claim_batch(state, [seq], [toks], [n])
  assert bool(res.ok[0])
  state = cache.commit(state, [seq], [toks], [n])
  return cache.release(state, [seq])


def test_plan_never_overwrites_an_entry_it_refreshed(rng):
  """Host {A, free}; the plan picks A (already there: refreshed), B and C.
  Only the free slot may take a new block, so B gets it and C is dropped;
  A's entry is kept and still found."""
  cfg = cache.CacheConfig(num_slots=8, page_size=2, num_layers=1, max_seqs=1,
                          max_pages=4)
  a, b, c = (rng.integers(1, 10**6, 2).tolist() for _ in range(3))
  state = _published(cache.init_cache(cfg), 0, a)
  host = cache.init_host_tier(cache.HostTierConfig(num_slots=2, page_size=2))
  host, src, dst = cache.host_offload_plan(state, host, 8, max_blocks=4)
  assert np.asarray(dst).tolist() == [0, -1, -1, -1]       # A -> host slot 0
  state = _published(_published(state, 0, b), 0, c)
  host, src, dst = cache.host_offload_plan(state, host, 8, max_blocks=4)
  cache.validate_host_tier(host)
  src, dst = np.asarray(src), np.asarray(dst)
  assert dst.tolist() == [1, -1, -1, -1]
  assert np.asarray(state.slot_tokens)[src[0]].tolist() == b
  for toks, hits in ((a, 1), (b, 1), (c, 0)):
    _, n, _ = cache.host_lookup(host, [toks + [0]], [3], [0])
    assert n.tolist() == [hits]


@pytest.mark.parametrize("edit", [0, 1])
def test_plan_replaces_an_entry_whose_key_collides(rng, edit):
  """Host {Z, A, free}. An entry with a picked block's key but other tokens
  (a collision, made by editing host slot `edit`) leaves the table before
  the block gets a slot: one entry per key, and the block is found
  afterwards."""
  cfg = cache.CacheConfig(num_slots=8, page_size=2, num_layers=1, max_seqs=1,
                          max_pages=4)
  blocks = [rng.integers(1, 10**6, 2).tolist() for _ in range(2)]
  state = _published(_published(cache.init_cache(cfg), 0, blocks[0]), 0,
                     blocks[1])
  host = cache.init_host_tier(cache.HostTierConfig(num_slots=3, page_size=2))
  host, _, dst = cache.host_offload_plan(state, host, 8, max_blocks=4)
  assert np.asarray(dst).tolist() == [0, 1, -1, -1]        # Z, A
  host = dataclasses.replace(host, tokens=host.tokens.at[edit, 0].add(1))
  _, n, _ = cache.host_lookup(host, [blocks[edit] + [0]], [3], [0])
  assert n.tolist() == [0]                                 # not a hit
  host, src, dst = cache.host_offload_plan(state, host, 8, max_blocks=4)
  cache.validate_host_tier(host)                           # one entry a key
  assert int(cache.host_tier_stats(host)["num_valid"]) == 2
  assert int((np.asarray(src) >= 0).sum()) == 1
  for toks in blocks:
    _, n, _ = cache.host_lookup(host, [toks + [0]], [3], [0])
    assert n.tolist() == [1]


@pytest.mark.parametrize("num_slots", [2, 3])
def test_plan_takes_a_free_slot_then_the_lru_never_a_refreshed_entry(
    rng, num_slots):
  """Host {A, B} (and a free slot when `num_slots` is 3), stored by one
  plan; B is then held on the device, so the next plan picks A (on the host:
  refreshed) and a new block C. C takes the free slot if there is one, else
  the least recently used entry, B's, never A's. Every plan and lookup bumps
  the clock; the entries a plan stores or refreshes take it as `last_use`."""
  cfg = cache.CacheConfig(num_slots=8, page_size=2, num_layers=1, max_seqs=2,
                          max_pages=4)
  a, b, c = (rng.integers(1, 10**6, 2).tolist() for _ in range(3))
  state = _published(_published(cache.init_cache(cfg), 0, a), 0, b)
  host = cache.init_host_tier(cache.HostTierConfig(num_slots=num_slots,
                                                   page_size=2))
  clock = int(host.clock)
  host, _, dst = cache.host_offload_plan(state, host, 8, max_blocks=4)
  assert np.asarray(dst).tolist() == [0, 1, -1, -1]        # A, B
  assert int(host.clock) > clock
  clock = int(host.clock)
  assert np.asarray(host.last_use[:2]).tolist() == [clock, clock]
  state, res = cache.claim_batch(state, [0], [b + [7]], [3])   # holds B
  assert int(res.num_reused_tokens[0]) == 2
  state = _published(state, 1, c)
  host, src, dst = cache.host_offload_plan(state, host, 8, max_blocks=4)
  cache.validate_host_tier(host)
  assert int(host.clock) > clock
  clock = int(host.clock)
  src, dst = np.asarray(src), np.asarray(dst)
  assert dst.tolist() == [num_slots - 1, -1, -1, -1]
  assert np.asarray(state.slot_tokens)[src[0]].tolist() == c
  assert int(host.last_use[0]) == int(host.last_use[dst[0]]) == clock
  for toks, hits in ((a, 1), (b, int(num_slots == 3)), (c, 1)):
    host, n, _ = cache.host_lookup(host, [toks + [0]], [3], [0])
    assert n.tolist() == [hits]
    assert int(host.clock) > clock
    clock = int(host.clock)


def test_plan_takes_the_free_slot_then_evicts_the_lru_entry(rng):
  """Host {A, free}; a plan of two new blocks gives the free slot to the
  first and A's slot to the second: A leaves the table, both are found."""
  host_cfg = cache.HostTierConfig(num_slots=2, page_size=2)
  state, host, _, dst, a = _offloaded(rng, host_cfg, 3)    # 1 full block
  assert dst[:2].tolist() == [0, -1]
  toks = rng.integers(1, 10**6, 5).tolist()                # 2 full blocks
  state = _published(cache.init_cache(state.config), 0, toks)
  host, _, dst = cache.host_offload_plan(state, host, 8, max_blocks=4)
  cache.validate_host_tier(host)
  assert np.asarray(dst).tolist() == [1, 0, -1, -1]
  for prompt, hits in ((a, 0), (toks, 2)):
    _, n, _ = cache.host_lookup(host, [prompt], [len(prompt)], [0])
    assert n.tolist() == [hits]


def test_plan_pads_its_result_to_max_blocks(rng):
  """`max_blocks` past the device's slot count: the result is still
  `max_blocks` wide, the plan's copies first, then -1."""
  host_cfg = cache.HostTierConfig(num_slots=8, page_size=2)
  state, _, src8, dst8, _ = _offloaded(rng, host_cfg, 9)  # 8 device slots
  _, src, dst = cache.host_offload_plan(
      state, cache.init_host_tier(host_cfg), 8, max_blocks=11)
  for x, x8 in ((src, src8), (dst, dst8)):
    x = np.asarray(x)
    assert x.shape == (11,) and (x[4:] == -1).all()
    np.testing.assert_array_equal(x[:8], x8)


def test_lookup_of_prompts_narrower_than_a_block(rng):
  """Prompts narrower than one block have no block to look up: no hits,
  and `slots` is `max_len // page_size = 0` wide."""
  host_cfg = cache.HostTierConfig(num_slots=4, page_size=2)
  _, host, _, _, toks = _offloaded(rng, host_cfg, 7)
  _, n, slots = cache.host_lookup(host, [toks[:1], toks[1:2]], [1, 1],
                                  [0, 0])
  assert n.tolist() == [0, 0] and slots.shape == (2, 0)


def test_lookup_skips_padding_rows_and_a_lone_last_block(rng):
  """A row of length 0 (padding) looks nothing up, and a prompt whose first
  block holds its last token counts no block, both with the very tokens of
  blocks on the host."""
  host_cfg = cache.HostTierConfig(num_slots=4, page_size=2)
  _, host, _, _, toks = _offloaded(rng, host_cfg, 7)      # 3 full blocks
  rows = np.asarray([toks + [0]] * 3, np.int32)
  before = cache.host_tier_stats(host)
  host, n, slots = cache.host_lookup(host, rows, [0, 2, 7], [0, 0, 0])
  after = cache.host_tier_stats(host)
  assert n.tolist() == [0, 0, 3] and (np.asarray(slots[:2]) < 0).all()
  assert int(after["num_lookups"] - before["num_lookups"]) == 3
  assert int(after["num_hits"] - before["num_hits"]) == 3


def test_init_host_tier_is_empty():
  """Every host slot free and out of the table (-1 throughout), counters 0."""
  host = cache.init_host_tier(HOST)
  assert not np.asarray(host.valid).any()
  assert (np.asarray(host.hash_pos) == -1).all()
  assert (np.asarray(host.hash_table) == -1).all()
  stats = {k: int(v) for k, v in cache.host_tier_stats(host).items()}
  assert stats == dict(num_slots=HOST.num_slots, num_valid=0,
                       num_free=HOST.num_slots, num_offloaded=0,
                       num_lookups=0, num_hits=0)
  with pytest.raises(dataclasses.FrozenInstanceError):
    host.clock = host.clock + 1


def test_plan_stores_each_block_as_the_device_holds_it(rng):
  """A copied block's entry holds its device slot's key, tokens and scope,
  `is_first` iff it heads its chain, and its parent's key (0 if first)."""
  host_cfg = cache.HostTierConfig(num_slots=8, page_size=2)
  state, host, src, dst, _ = _offloaded(rng, host_cfg, 9)  # 4 full blocks
  n = int((src >= 0).sum())
  assert n == 4
  dev = {k: np.asarray(getattr(state, k))
         for k in ("slot_key", "slot_tokens", "slot_scope", "slot_parent")}
  for s, h in zip(src[:n], dst[:n]):
    first = dev["slot_parent"][s] < 0
    parent_key = [0, 0] if first else dev["slot_key"][dev["slot_parent"][s]]
    assert bool(host.is_first[h]) == first
    np.testing.assert_array_equal(host.parent_key[h], parent_key)
    np.testing.assert_array_equal(host.key[h], dev["slot_key"][s])
    np.testing.assert_array_equal(host.tokens[h], dev["slot_tokens"][s])
    assert int(host.scope[h]) == dev["slot_scope"][s]


def test_lookup_counts_and_refusals(rng):
  """`num_lookups` counts the blocks a lookup may match (from its start
  block, never the last prompt token's block), `num_hits` those found; bad
  array shapes are refused."""
  host_cfg = cache.HostTierConfig(num_slots=4, page_size=2)
  _, host, _, _, toks = _offloaded(rng, host_cfg, 7)      # 3 full blocks
  padded = [toks + [0]]
  for start, hits in ((0, 3), (1, 2), (3, 0), (5, 0)):
    before = cache.host_tier_stats(host)
    host, n, _ = cache.host_lookup(host, padded, [7], [start])
    after = cache.host_tier_stats(host)
    assert n.tolist() == [hits]
    assert int(after["num_lookups"] - before["num_lookups"]) == max(3 - start,
                                                                    0)
    assert int(after["num_hits"] - before["num_hits"]) == hits
  for lengths, start in (([7, 7], [0]), ([7], [0, 0]), ([[7]], [[0]])):
    with pytest.raises(ValueError, match="Invalid tokens / lengths / "
                       "start_blocks"):
      cache.host_lookup(host, padded, lengths, start)
  with pytest.raises(ValueError, match="Invalid tokens / lengths"):
    cache.host_lookup(host, toks + [0], [7], [0])


def test_invalidate_skips_slot_ids_out_of_range(rng):
  """Ids past the last host slot (and -1) change nothing, with every slot,
  the last one too, holding an entry."""
  host_cfg = cache.HostTierConfig(num_slots=4, page_size=2, hash_ways=4,
                                  hash_buckets=1)
  _, host, _, _, _ = _offloaded(rng, host_cfg, 9)         # 4 full blocks
  assert bool(host.valid.all())
  after = cache.host_invalidate(host, np.array([4, 5, -1, 2**30], np.int32))
  cache.validate_host_tier(after)
  for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(after)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_invalidating_a_free_slot_changes_nothing(rng):
  """Freeing a free host slot is a no-op, the table's last position (taken)
  included: one bucket of 3 ways, 3 entries, one host slot free."""
  host_cfg = cache.HostTierConfig(num_slots=4, page_size=2, hash_ways=3,
                                  hash_buckets=1)
  _, host, _, _, _ = _offloaded(rng, host_cfg, 7)         # 3 full blocks
  valid = np.asarray(host.valid)
  assert int(valid.sum()) == 3 and int(host.hash_table[0, -1]) >= 0
  free = int(np.flatnonzero(~valid)[0])
  _assert_same_state(host, cache.host_invalidate(
      host, np.array([free], np.int32)))


def test_validate_names_each_broken_invariant(rng):
  """`validate_host_tier` on a valid tier passes, and on the tier broken
  one invariant at a time raises naming that invariant."""
  host_cfg = cache.HostTierConfig(num_slots=4, page_size=2, hash_ways=4,
                                  hash_buckets=2)
  _, host, _, _, _ = _offloaded(rng, host_cfg, 7)         # 3 entries
  cache.validate_host_tier(host)
  valid = np.asarray(host.valid)
  h, free = int(np.flatnonzero(valid)[0]), int(np.flatnonzero(~valid)[0])
  other = int(np.flatnonzero(valid)[1])
  p = int(host.hash_pos[h])
  table = host.hash_table.reshape(-1)

  def at(name, index, value):
    return {name: getattr(host, name).at[index].set(value)}

  def flat_table(value):
    return {"hash_table": table.at[p].set(value).reshape(
        host.hash_table.shape)}

  u32 = jnp.uint32
  for change, message in (
      ({"valid": jnp.ones((5,), bool)}, "shapes do not match"),
      ({"hash_table": host.hash_table[:1]}, "shapes do not match"),
      ({"tokens": host.tokens[:, :1]}, "shapes do not match"),
      (flat_table(4), f"hash_table entry {p} -> 4: not a valid host slot"),
      (flat_table(free), f"hash_table entry {p} -> {free}: not a valid"),
      (at("hash_pos", h, p + 1), f"slot {h}: hash_pos {p + 1} != {p}"),
      (at("key", (h, 0), host.key[h, 0] ^ u32(1)),
       f"slot {h}: key in bucket {p // 4}, hashes elsewhere"),
      (flat_table(-1), f"valid slot {h} is in the table 0 times"),
      (at("hash_pos", free, 0), f"free slot {free} has hash_pos 0"),
      (at("key", other, host.key[h]), "two valid host slots share a key"),
      ({"num_hits": host.num_lookups + 1}, "hits > lookups"),
      ({"num_offloaded": jnp.int32(-1)}, "counters negative")):
    broken = dataclasses.replace(host, **change)
    with pytest.raises(cache.HostTierInvariantError, match=message):
      cache.validate_host_tier(broken)
