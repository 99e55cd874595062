"""Edges of the cache API: a fork of an empty batch, `page_table`'s `layer`,
a per-window-group `extend`'s `num_computed`, per-window-group claims at
the edge of their pool with cached blocks reused (alone, and admitted in
order within one batch), a reusing prompt's rewound first query in the
sliding layers, and `validate` naming a group out of step with group 0.

`fork(state, [], [])` returns an empty `ForkResult` and the state unchanged,
on a flat and on a per-window-group cache alike. `page_table`'s `layer`: a
Python int out of range raises ValueError at trace time; an array layer is
checked in checked mode (eager: `checkify.JaxRuntimeError` naming `layer`;
staged in a checkified jit: the error, and an all -1 table). The oracle for
an in-range array layer is the Python-int path of the same layer. States are
built from random claims.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import pkvattn
from pkvattn import cache
from pkvattn.cache.validate import CacheInvariantError

FLAT = cache.CacheConfig(num_slots=16, page_size=4, num_layers=3, max_seqs=4,
                         max_pages=6)
HYBRID = cache.HybridCacheConfig((-1, 7, -1, 7, 7), (24, 16), page_size=4,
                                 max_seqs=4, max_pages=6)
CONFIGS = {"flat": FLAT, "hybrid": HYBRID}


def _state(cfg, rng):
  """A state with random sequences claimed (ids 0..k-1, random lengths of
  at most 5 blocks each, so 3 sequences fit the smallest pool's 16 slots)."""
  st = cache.init_cache(cfg)
  k = int(rng.integers(1, 4))
  lengths = rng.integers(1, 4 * 5 + 1, k)
  tokens = rng.integers(0, 50, (k, 24))
  st, res = cache.claim_batch(st, jnp.arange(k, dtype=jnp.int32),
                              jnp.asarray(tokens, jnp.int32),
                              jnp.asarray(lengths, jnp.int32))
  assert bool(jnp.all(res.ok))
  return st, k


def _cached(cfg, length):
  """A fresh cache where sequence 0 claimed tokens 1, 2, ... (`length` of
  them), published its whole blocks and was released: they are cached and
  evictable. Returns the state and the token row (24 tokens)."""
  tokens = np.arange(24, dtype=np.int32)[None] + 1
  st, res = cache.claim_batch(cache.init_cache(cfg), jnp.array([0]), tokens,
                              jnp.array([length]))
  assert bool(res.ok[0])
  st = cache.commit(st, jnp.array([0]), tokens, jnp.array([length]))
  return cache.release(st, jnp.array([0])), tokens


def _same_state(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fork_of_an_empty_batch_is_empty(name, rng):
  st, _ = _state(CONFIGS[name], rng)
  for empty in ([], jnp.zeros((0,), jnp.int32)):
    new, res = cache.fork(st, empty, empty)
    for field, dtype in (("ok", jnp.bool_), ("src_pages", jnp.int32),
                         ("dst_pages", jnp.int32)):
      x = getattr(res, field)
      assert x.shape == (0,) and x.dtype == dtype, (field, x)
    _same_state(new, st)
  with pkvattn.checked():
    new, res = cache.fork(st, [], [])
  assert res.ok.shape == (0,)
  _same_state(new, st)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_page_table_python_layer_out_of_range(name, rng):
  cfg = CONFIGS[name]
  st, k = _state(cfg, rng)
  n = cfg.num_layers
  for layer in (-1, n, n + 7, np.int64(-3)):
    with pytest.raises(ValueError, match=rf"Invalid layer: expected 0 <= "
                       rf"layer < {n}, got {int(layer)}"):
      cache.page_table(st, jnp.arange(k), layer)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("split", [True, False])
def test_page_table_array_layer_checked(name, split, rng):
  cfg = CONFIGS[name]
  st, k = _state(cfg, rng)
  n = cfg.num_layers
  ids = jnp.asarray(rng.permutation(k), jnp.int32)
  staged = jax.jit(checkify.checkify(
      lambda s, layer: cache.page_table(s, ids, layer, split=split)))
  with pkvattn.checked():
    for layer in rng.permutation(n):
      want = cache.page_table(st, ids, int(layer), split=split)
      got = cache.page_table(st, ids, jnp.int32(layer), split=split)
      np.testing.assert_array_equal(got, want)
      err, got = staged(st, jnp.int32(layer))
      assert err.get() is None
      np.testing.assert_array_equal(got, want)
    for bad in (-1, n, n + int(rng.integers(1, 100)), -int(rng.integers(2, 9))):
      msg = rf"Invalid layer: layer = {bad}, expected in \[0, num_layers={n}\)"
      with pytest.raises(checkify.JaxRuntimeError, match=msg):
        cache.page_table(st, ids, jnp.int32(bad), split=split)
      err, got = staged(st, jnp.int32(bad))
      assert err.get() is not None and f"layer = {bad}" in err.get()
      assert (np.asarray(got) == -1).all()
    # Every layer at once (in range by construction): no check staged.
    tables = cache.layer_page_tables(st, ids)
  for layer in range(n):
    np.testing.assert_array_equal(tables[layer],
                                  cache.page_table(st, ids, layer))


def test_page_table_unchecked_traced_layer_is_not_checked(rng):
  """Unchecked, an array layer is not verified (documented): no error."""
  st, k = _state(FLAT, rng)
  out = jax.jit(lambda layer: cache.page_table(st, jnp.arange(k), layer))(
      jnp.int32(FLAT.num_layers))
  assert out.shape == (k, 2, FLAT.max_pages)


def test_hybrid_extend_num_computed_as_list_and_refused(rng):
  """`num_computed` given as a list is taken as the array it names (the same
  state and result); one of the wrong length or dtype raises ValueError
  naming it, at trace time."""
  st, k = _state(HYBRID, rng)
  ids, one = jnp.arange(k, dtype=jnp.int32), jnp.ones((k,), jnp.int32)
  done = [int(n) for n in np.asarray(st.groups[0].seq_lens)[:k]]
  a = cache.extend(st, ids, one, num_computed=jnp.asarray(done, jnp.int32))
  b = cache.extend(st, ids, one, num_computed=done)
  _same_state(a, b)
  with pytest.raises(ValueError, match="num_computed"):
    cache.extend(st, ids, one, num_computed=jnp.zeros((k + 1,), jnp.int32))
  with pytest.raises(ValueError, match="num_computed"):
    cache.extend(st, ids, one, num_computed=jnp.zeros((k,), jnp.float32))


@pytest.mark.parametrize("evict,head_of_line", [(True, True), (False, False),
                                                (False, True), (True, False)])
@pytest.mark.parametrize("windows,slots", [((-1,), (5,)), ((-1, 3), (5, 9))])
def test_hybrid_claim_counts_the_cached_blocks_it_takes(windows, slots, evict,
                                                        head_of_line):
  """A claim that reuses evictable cached blocks takes them out of the
  supply its new blocks come from: with a 5-slot global group and 2 cached
  blocks reused, 3 new blocks fit and 4 do not (2 + 4 > 5), and the
  refused claim leaves the state as it was. Without eviction the supply is
  the 3 free slots, which the reused blocks do not take from: 3 new blocks
  fit there too, in either admission order."""
  cfg = cache.HybridCacheConfig(windows, slots, page_size=4, max_seqs=4,
                                max_pages=6)
  st, tokens = _cached(cfg, 9)   # 2 published blocks, now evictable
  kw = dict(evict=evict, head_of_line=head_of_line)
  new, res = cache.claim_batch(st, jnp.array([1]), tokens, jnp.array([24]),
                               **kw)
  assert not bool(res.ok[0])
  _same_state(new, st)
  new, res = cache.claim_batch(st, jnp.array([1]), tokens, jnp.array([20]),
                               **kw)
  assert bool(res.ok[0])
  assert int(res.num_reused_tokens[0]) == 8


@pytest.mark.parametrize("windows,slots", [((-1,), (5,)), ((-1, 3), (5, 9))])
def test_hybrid_claims_in_order_share_the_cached_blocks_they_take(windows,
                                                                 slots):
  """Admitting in order (`head_of_line=False`, evicting): a request's cached
  blocks count once against the supply, by the first admitted request that
  takes them. Global group of 5 slots, 2 cached evictable blocks of tokens
  1-8 and 3 free slots. Request A (tokens 1-8) reuses block 0 (its last
  token is computed) and takes 1 new block: 2 of the 5. Request B (tokens
  1-8 and on) reuses blocks 0 and 1; block 1 is B's to count: 16 tokens (2
  new blocks) fit, 2 + 2 + 1 = 5, and 20 tokens (3 new) do not."""
  cfg = cache.HybridCacheConfig(windows, slots, page_size=4, max_seqs=4,
                                max_pages=6)
  st, row = _cached(cfg, 8)
  base = row[0]
  tokens = np.stack([base, base])
  for b_len, b_ok in ((16, True), (20, False)):
    new, res = cache.claim_batch(st, jnp.array([1, 2]), tokens,
                                 jnp.array([8, b_len]), evict=True,
                                 head_of_line=False)
    assert [bool(x) for x in res.ok] == [True, b_ok], b_len
    assert [int(x) for x in res.num_reused_tokens[:1]] == [4]
    cache.validate(new)
  # A request reusing nothing after A: A's 2 blocks leave 3 (the cached
  # block 1 is evictable), so 3 new blocks fit and 4 do not.
  other = np.stack([base, base + 100])
  for b_len, b_ok in ((12, True), (16, False)):
    new, res = cache.claim_batch(st, jnp.array([1, 2]), other,
                                 jnp.array([8, b_len]), evict=True,
                                 head_of_line=False)
    assert [bool(x) for x in res.ok] == [True, b_ok], b_len
    cache.validate(new)


@pytest.mark.parametrize("rewind,computed,reused", [
    (2, 9, 8), (2, 11, 0), (0, 11, 8)])
def test_hybrid_reuse_keeps_the_window_of_a_rewound_first_query(
    rewind, computed, reused):
  """A prompt reusing cached blocks may be rewound `max_rewind_len` tokens
  before its first computed one: its sliding group must still hold what
  that query sees. Window 4, page 4: a 9-token prompt reusing 2 blocks
  queries first at 8, or with a 2-token rewind at 7, which sees position 3
  (block 0). A cached request that had computed 11 tokens when its blocks
  were published had dropped block 0 from its sliding layers (no query of
  its own at 11 - 2 or later sees it), so with the rewind nothing is
  reused, and without it both blocks are; at 9 computed it still held
  block 0."""
  cfg = cache.HybridCacheConfig((4, -1), (16, 16), page_size=4, max_seqs=4,
                                max_pages=6, max_rewind_len=rewind)
  tokens = np.arange(24, dtype=np.int32)[None] + 1
  st = cache.init_cache(cfg)
  st, res = cache.claim_batch(st, jnp.array([0]), tokens, jnp.array([9]))
  assert bool(res.ok[0])
  # `num_computed` counts tokens already in the cache (at most its length).
  for done in (9, computed):
    st, res = cache.extend(st, jnp.array([0]), jnp.array([2]),
                           num_computed=jnp.array([done]))
    assert bool(res.ok[0])
  st = cache.commit(st, jnp.array([0]), tokens, jnp.array([13]))
  st, res = cache.claim_batch(st, jnp.array([1]), tokens, jnp.array([9]))
  assert bool(res.ok[0])
  assert int(res.num_reused_tokens[0]) == reused
  cache.validate(st)


@pytest.mark.parametrize("name", ["seq_live", "seq_lens", "seq_scope"])
def test_hybrid_validate_names_a_group_out_of_step(name, rng):
  """Every group tracks the same sequences: their liveness, lengths and
  reuse scopes equal group 0's. A state that breaks it in one group is
  named; the intact state validates."""
  st, k = _state(HYBRID, rng)
  cache.validate(st)
  g1 = st.groups[1]
  field = getattr(g1, name)
  changed = field.at[k - 1].set(~field[k - 1] if field.dtype == jnp.bool_
                                else field[k - 1] + 1)
  bad = dataclasses.replace(st, groups=(
      st.groups[0], dataclasses.replace(g1, **{name: changed})))
  with pytest.raises(CacheInvariantError,
                     match=f"group 1: {name} differs from group 0"):
    cache.validate(bad)
