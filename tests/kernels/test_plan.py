"""The prefill schedule (`pallas_kernels/plan.py`) against its documented rules.

On random mixed batches (prompts, multi-token and one-token decode, empty
sequences, padding) and every option: the static tile count
(`max_tiles`), every token in exactly one main tile, short tile or decode
row with its sequence's metadata, tiles on their sequence's `block_q` grid
from the `align`-rounded first token, the longest-first order (a stable
sort by descending visible keys, ties in token order; token order without
it), the short tiles' rows and order, and the decode rows' tokens and key
counts. The expected values come from the docstrings' rules and a
key-by-key count of each tile's visible keys, not from the code.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_utils import assert_tile_rows
from pkvattn.pallas_kernels import plan as plan_lib

NUM_TOKENS = 150
BATCH = 10
BLOCK_Q = 16

# (causal, window_left, longest_first, short_block_q, align,
#  split_decode_rows, decode_rows_per_seq); the first: the defaults.
OPTIONS = [
    (True, -1, True, 0, 1, False, 1),
    (True, 7, True, 4, 8, True, 1),
    (False, 20, True, 0, 4, True, 3),
    (False, -1, True, 8, 1, True, 2),
    (True, -1, False, 4, 8, True, 3),
    (True, 0, True, 1, 16, False, 5),
]


def _mixed_batch(rng):
  """q_lens of prompts (9-40 tokens), 1-8-token rows and empty sequences
  fitting `NUM_TOKENS` (the rest is padding); kv_lens of 0-60 cached keys
  more."""
  q_lens = rng.choice([0, 1, 2, 3, 5, 8], BATCH)
  prompts = rng.random(BATCH) < 0.5
  q_lens[prompts] = rng.integers(9, 41, prompts.sum())
  while q_lens.sum() > NUM_TOKENS:
    q_lens[rng.integers(BATCH)] //= 2
  kv_lens = q_lens + rng.integers(0, 61, BATCH) * rng.integers(0, 2, BATCH)
  q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return q_lens, kv_lens.astype(np.int32), q_indptr


def _visible_keys(rows, off, kv, causal, window_left):
  """Keys any of the token `rows` sees (token t at position t + off),
  counted key by key."""
  seen = np.zeros(max(kv, 0), bool)
  keys = np.arange(max(kv, 0))
  for t in rows:
    mask = np.ones_like(seen)
    if causal:
      mask &= keys <= t + off
    if window_left >= 0:
      mask &= keys >= t + off - window_left
    seen |= mask
  return int(seen.sum())


def _check_order(keys, longest_first, what):
  """`keys` (work, token) in launch order: descending work, ties (and all
  without `longest_first`) in token order."""
  want = sorted(keys, key=(lambda k: (-k[0], k[1])) if longest_first
                else (lambda k: k[1]))
  assert keys == want, what


def _plan_fn(opts):
  """The jitted `plan_prefill` of `opts` (`OPTIONS[0]`: no keywords)."""
  causal, window_left, longest_first, short, align, split, rows_per_seq = opts
  kw = dict(causal=causal, window_left=window_left,
            longest_first=longest_first, short_block_q=short, align=align,
            split_decode_rows=split, decode_rows_per_seq=rows_per_seq)
  if opts == OPTIONS[0]:  # the documented defaults
    kw = {}
  return jax.jit(lambda qi, kl: plan_lib.plan_prefill(
      qi, kl, num_tokens=NUM_TOKENS, block_q=BLOCK_Q, **kw))


def _check_plan(plan, opts, q_lens, kv_lens, q_indptr):
  """`plan` of the batch follows the documented rules of `opts`."""
  causal, window_left, longest_first, short, align, split, rows_per_seq = opts
  r = rows_per_seq if split else 0
  min_tokens = max(short, r) + 1
  assert plan_lib.tile_min_tokens(short, split, rows_per_seq) == min_tokens
  assert (plan.block_q, plan.short_block_q, plan.num_tokens,
          plan.batch_size, plan.align) == (BLOCK_Q, short, NUM_TOKENS,
                                           BATCH, align)
  assert plan.decode_rows_per_seq == (rows_per_seq if split else 1)
  assert plan.num_tiles == (NUM_TOKENS // BLOCK_Q + min(
      BATCH, NUM_TOKENS // min_tokens) + 1)
  decode = (q_lens >= 1) & (q_lens <= r)
  is_short = (q_lens >= 1) & (q_lens <= short) & ~decode
  seen = np.zeros(NUM_TOKENS, int)
  keys, unused = [], 0
  for seq, start, end, kv, off in np.asarray(plan.tiles):
    assert 0 <= seq < BATCH  # a row of the page table
    if end <= start:
      assert kv == 0
      unused += 1
      continue
    assert unused == 0, "a used tile after an unused one"
    origin = start - start % align
    rows = np.arange(start, min(end, origin + BLOCK_Q))
    seen[rows] += 1
    assert_tile_rows(seq, kv, off, rows, q_indptr, q_lens, kv_lens)
    # On its sequence's grid of block_q tokens from the first token
    # rounded down to align (the padding's first token: q_indptr[-1]).
    b = np.searchsorted(q_indptr[1:], start, side="right")
    first = q_indptr[min(b, BATCH)]
    assert b < BATCH or seq == 0  # the padding's row: 0
    assert b == BATCH or not (decode[b] or is_short[b])
    assert start >= first and (origin - first + first % align) % BLOCK_Q == 0
    keys.append((_visible_keys(rows, off, kv, causal, window_left), start))
  _check_order(keys, longest_first, "tiles")
  if short:
    tiles = np.asarray(plan.short_tiles)
    assert tiles.shape == (BATCH, plan_lib.NUM_FIELDS)
    used = [t for t in tiles if t[2] > t[1]]
    assert all(t[3] == 0 for t in tiles if t[2] <= t[1])  # unused: no keys
    if longest_first:  # the unused ones (no work) last
      assert [tuple(t) for t in tiles[:len(used)]] == [
          tuple(t) for t in used]
    assert sorted(t[0] for t in used) == list(np.flatnonzero(is_short))
    for seq, start, end, kv, off in used:
      assert (start, end) == (q_indptr[seq], q_indptr[seq + 1])
      rows = np.arange(start, end)
      seen[rows] += 1
      assert_tile_rows(seq, kv, off, rows, q_indptr, q_lens, kv_lens)
    if window_left < 0:  # the last row sees every key
      _check_order([(t[3], t[0]) for t in used], longest_first, "short")
    if not longest_first:
      assert all(t[0] == b for b, t in enumerate(tiles) if t[2] > t[1])
  else:
    assert plan.short_tiles is None
  if split:
    rows = np.asarray(plan.decode_rows).reshape(BATCH, rows_per_seq)
    for b in range(BATCH):
      for j in range(rows_per_seq):
        want = q_indptr[b] + j if decode[b] and j < q_lens[b] else NUM_TOKENS
        assert rows[b, j] == want
        if want < NUM_TOKENS:
          seen[want] += 1
    if rows_per_seq > 1:
      counts = np.asarray(plan.decode_kv_lens).reshape(BATCH, rows_per_seq)
      for b in range(BATCH):
        for j in range(rows_per_seq):
          # The token's position + 1; 0 for none.
          want = (kv_lens[b] - q_lens[b] + j + 1
                  if decode[b] and j < q_lens[b] else 0)
          assert counts[b, j] == want
    else:
      assert plan.decode_kv_lens is None
  else:
    assert plan.decode_rows is None and plan.decode_kv_lens is None
  np.testing.assert_array_equal(seen, 1)


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_plan_follows_its_documented_rules(opts, rng):
  plan_fn = _plan_fn(opts)
  for _ in range(3):
    q_lens, kv_lens, q_indptr = _mixed_batch(rng)
    plan = plan_fn(jnp.asarray(q_indptr), jnp.asarray(kv_lens))
    _check_plan(plan, opts, q_lens, kv_lens, q_indptr)


@pytest.mark.parametrize("window_left,short", [(-1, 0), (0, 0), (4, 0),
                                               (-1, 1)])
def test_plan_orders_small_works_and_ties(window_left, short):
  """Tiles of one and two visible keys, and of equal work, in order:
  one-token sequences of 1 and 2 keys, a 16-token prompt over no cache
  (16 keys) and a 12-token chunk over 38 cached keys (16 keys with a
  4-key window); with one-token short tiles, those of 1 key among the
  unused rows."""
  opts = (True, window_left, True, short) + OPTIONS[0][4:]  # or defaults
  q_lens = np.array([1, 1, 16, 12, 1, 1, 0, 0, 0, 0])
  kv_lens = np.array([1, 2, 16, 50, 2, 1, 0, 0, 0, 0], np.int32)
  q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  plan = _plan_fn(opts)(jnp.asarray(q_indptr), jnp.asarray(kv_lens))
  _check_plan(plan, opts, q_lens, kv_lens, q_indptr)


def test_static_bounds_and_errors():
  """`max_tiles`'s docstring example (64 four-token sequences verified in
  a step, 256 tokens in 128-token tiles) and `tile_min_tokens`'s rule;
  `decode_rows_per_seq < 1` is rejected; a plan is immutable."""
  assert plan_lib.max_tiles(256, 64, 128, 9) == 31
  assert plan_lib.max_tiles(256, 64, 128) == 67
  assert plan_lib.max_tiles(256, 64, 128, 0) == 67  # as min_tokens 1
  assert plan_lib.max_tiles(10, 64, 4, 3) == 2 + 3 + 1
  assert plan_lib.max_tiles(10, 64, 4) == 2 + 10 + 1
  assert plan_lib.max_tiles(10, 6, 4, 1) == 2 + 6 + 1
  assert plan_lib.tile_min_tokens(0, False, 8) == 1
  assert plan_lib.tile_min_tokens(4, False, 8) == 5
  assert plan_lib.tile_min_tokens(2, True, 5) == 6
  assert plan_lib.tile_min_tokens(8, True, 3) == 9
  lens = jnp.ones((2,), jnp.int32)
  plan = plan_lib.plan_prefill(jnp.arange(3, dtype=jnp.int32), lens,
                               num_tokens=4, block_q=4)
  with pytest.raises(dataclasses.FrozenInstanceError):  # reused per layer
    plan.block_q = 8
  for bad in (0, -1):
    with pytest.raises(ValueError, match="decode_rows_per_seq"):
      plan_lib.plan_prefill(jnp.arange(3, dtype=jnp.int32), lens,
                            num_tokens=4, block_q=4, split_decode_rows=True,
                            decode_rows_per_seq=bad)
