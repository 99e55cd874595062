"""Unit tests of `pkvattn.serving.host_tier`, mostly on a tier built without
an engine (CPU, f32, one layer): its sizes, the copy pacing of `flush`, the
plan accounting of `offload`, the gather and scatter programs and the chain
order of a plan's blocks. (Engine-level tests: `test_engine_host_tier.py`.)"""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest

from pkvattn.engine import EngineConfig
from pkvattn.serving import host_tier as ht

PAGE = (8, 1, 2)  # page_size, num_kv_heads, head_dim
DEVICE_SLOTS = 16
# One layer: a slot holds its K and V pages (f32).
SLOT_BYTES = 2 * int(np.prod(PAGE)) * 4


def _tier(host_slots, **kwargs):
  """A tier of `host_slots` slots' bytes over a 16-slot device pool."""
  cfg = EngineConfig(page_size=PAGE[0], num_slots=DEVICE_SLOTS, max_seqs=2,
                     max_num_tokens=32, max_model_len=128,
                     token_buckets=(32,),
                     host_kv_cache_bytes=host_slots * SLOT_BYTES, **kwargs)
  return ht.HostTier(cfg, types.SimpleNamespace(num_slots=DEVICE_SLOTS),
                     (DEVICE_SLOTS * 2,) + PAGE, jnp.float32, 1, SLOT_BYTES,
                     hybrid=False, scratch=False)


def test_pow2_at_least_is_the_smallest_power_of_two_not_below(rng):
  for x in [1, 2, 3, 4, 5, 7, 8, 9] + rng.integers(1, 1 << 20, 20).tolist():
    want = next(1 << k for k in range(64) if (1 << k) >= x)
    assert ht._pow2_at_least(x) == want, x  # noqa: SLF001


@pytest.mark.parametrize("host_slots", [1, 7, 8, 50, 300, 1000])
def test_sizes_round_down_to_whole_batches(host_slots):
  """`batch_blocks`: `BATCH_BLOCKS`, or fewer so there are at least 8
  batches (at least 1 slot each); `num_slots`: whole batches only;
  `max_plan`: within both pools."""
  tier = _tier(host_slots)
  S = max(1, min(ht.BATCH_BLOCKS, host_slots // 8))
  assert tier.batch_blocks == S <= ht.BATCH_BLOCKS
  assert tier.max_batches >= min(8, host_slots)
  assert tier.max_batches == host_slots // S
  assert tier.num_slots == (host_slots // S) * S <= host_slots
  assert tier.slot_bytes == SLOT_BYTES
  # A plan mirrors at least a block, never more than either pool holds.
  assert 1 <= tier.max_plan <= min(tier.num_slots, DEVICE_SLOTS)
  assert tier.slot_shape == (2,) + PAGE
  stats = types.SimpleNamespace()
  tier.stats_into(stats)
  assert stats.host_num_slots == tier.num_slots
  assert stats.host_kv_cache_bytes == tier.num_slots * SLOT_BYTES


def _pending_batches(tier, n):
  """`n` gathered batches waiting for their copies (ids 0..n-1)."""
  shape = (tier.batch_blocks,) + tier.slot_shape
  for b in range(n):
    tier._batches[b] = [jnp.full(shape, b, jnp.float32),  # noqa: SLF001
                        tier.batch_blocks]
    tier._pending.append(b)  # noqa: SLF001
  tier._next_batch = n  # noqa: SLF001


def test_flush_queues_what_the_copy_speed_moves_in_the_time_given(rng):
  """`flush(seconds=...)` queues the batches `copy_bytes_per_s` moves in
  `seconds` (at least one), oldest first; `batches=k` queues k; no
  argument, all; batches freed before their copies are passed over
  without counting. It returns the batches still waiting."""
  tier = _tier(64)
  batch_bytes = tier.batch_blocks * tier.slot_bytes
  n, k = 9, int(rng.integers(2, 5))
  _pending_batches(tier, n)
  assert tier.flush(seconds=1.0) == 0  # an infinite speed (a CPU): all
  _pending_batches(tier, n)
  tier.copy_bytes_per_s = (k + 0.5) * batch_bytes
  seconds = float(rng.uniform(0.9, 1.05))  # k of them fit, not k + 1
  assert tier.flush(seconds=seconds) == n - k
  assert list(tier._pending) == list(range(k, n))  # noqa: SLF001
  assert tier.flush(seconds=1e-9) == n - k - 1  # at least one
  del tier._batches[k + 1]  # noqa: SLF001  freed before its copy
  assert tier.flush(batches=2) == n - k - 4
  assert list(tier._pending) == list(range(k + 4, n))  # noqa: SLF001
  assert tier.flush() == 0 and tier.flush() == 0
  for b, (array, rows) in tier._batches.items():  # noqa: SLF001
    assert rows == tier.batch_blocks
    np.testing.assert_array_equal(np.asarray(array), b)


def test_gather_pads_to_whole_batches(rng):
  """`_gather` returns `len(src) / batch_blocks` batches whose row j is
  the pages of device slot `src[j]` (each slot: `num_layers * 2` pages)."""
  L2, S, nb = 4, 3, 2
  pool = rng.standard_normal((DEVICE_SLOTS * L2,) + PAGE).astype(np.float32)
  src = rng.choice(DEVICE_SLOTS, S * nb, replace=False).astype(np.int32)
  src[-1] = -1
  src[int(rng.integers(0, S * nb - 1))] = DEVICE_SLOTS - 1
  src[int(np.flatnonzero(src != DEVICE_SLOTS - 1)[0])] = 0
  out = ht._gather(jnp.asarray(pool), src, num_slots=DEVICE_SLOTS,  # noqa: SLF001
                   batch_blocks=S)
  assert len(out) == nb
  slots = pool.reshape((DEVICE_SLOTS, L2) + PAGE)
  for i, batch in enumerate(out):
    assert batch.shape == (S, L2) + PAGE
    for j in range(S):
      if src[i * S + j] >= 0:
        np.testing.assert_array_equal(np.asarray(batch[j]),
                                      slots[src[i * S + j]])


def test_scatter_writes_the_rows_into_the_sequences_slots(rng):
  """`_scatter` writes row `batch_rows[j]` of the batch into the slot of
  block `blocks[j]` of sequence `rows[j]`; rows -1 and blocks without a
  slot (-1) write nothing; every other slot keeps its pages. The pool is
  donated."""
  L2, S, seqs, pages = 2, 6, 5, 3  # more sequences than blocks a sequence
  pool = rng.standard_normal((DEVICE_SLOTS * L2,) + PAGE).astype(np.float32)
  table = rng.permutation(DEVICE_SLOTS)[:seqs * pages].reshape(seqs, pages)
  rows = np.array([0, seqs - 1, 1, -1, 3, 2], np.int32)
  blocks = np.array([0, pages - 1, 2, 1, 1, 0], np.int32)
  table[table == 0] = table[3, 1]  # device slot 0 (a permutation still)
  table[3, 1] = 0
  table[2, 0] = -1  # no slot
  table = table.astype(np.int32)
  # Batch rows 0 and S - 1 are written (by the first two).
  batch_rows = np.concatenate([[0, S - 1], rng.permutation(np.arange(1, S - 1))
                               ]).astype(np.int32)
  batch = rng.standard_normal((S, L2) + PAGE).astype(np.float32)
  donated = jnp.asarray(pool)
  out = ht._scatter(donated, jnp.asarray(table), rows, blocks,  # noqa: SLF001
                    batch_rows, jnp.asarray(batch), num_slots=DEVICE_SLOTS)
  assert donated.is_deleted()  # the pool is donated (updated in place)
  want = pool.reshape((DEVICE_SLOTS, L2) + PAGE).copy()
  written = 0
  for j in range(S):
    if rows[j] >= 0 and table[rows[j], blocks[j]] >= 0:
      want[table[rows[j], blocks[j]]] = batch[batch_rows[j]]
      written += 1
  assert written == 4
  np.testing.assert_array_equal(np.asarray(out), want.reshape(pool.shape))


def test_chain_order_of_no_blocks_is_empty():
  order = ht._chain_order(np.zeros((0, 2), np.uint32),  # noqa: SLF001
                          np.zeros((0, 2), np.uint32), np.zeros(0, bool))
  assert order.shape == (0,)


def test_offload_plans_horizon_times_the_need_then_uses_it_up(rng):
  """A plan is due when the allocations may evict more (`num_new_slots -
  num_free`) than the earlier plans mirrored ahead and later calls have
  not used; it asks for `PLAN_HORIZON` times that (at most `max_plan`)
  past the free slots, and what it mirrors past this call's need covers
  the next calls. (The plan is scripted: it mirrors nothing.)"""
  tier = _tier(256)
  asked = []

  def plan(state, host, num_new_slots):
    asked.append(num_new_slots)
    none = jnp.full(tier.max_plan, -1, jnp.int32)
    return host, none, none
  tier._plan = plan  # noqa: SLF001
  stats = types.SimpleNamespace(host_transfer_s=0.0)
  covered, want = 0, []  # blocks mirrored ahead, not used yet
  assert ht.PLAN_HORIZON * 3 <= tier.max_plan
  # First: a plan of 1 covers the next 0 and 3 (as its horizon allows); a
  # plan of `max_plan` covers nothing past itself.
  script = [1, 0, 3, tier.max_plan, 1]
  for call in range(40):
    free = int(rng.integers(0, 6))
    need = script[call] if call < len(script) else int(rng.choice(
        [-2, 0, 1, 1, 2, 3, tier.max_plan]))
    due = need > covered
    assert tier.would_plan(free + need, free) == due
    tier.offload(None, None, free + need, free, stats)
    if due:
      ahead = min(ht.PLAN_HORIZON * need, tier.max_plan)
      want.append(free + ahead)
      covered = ahead - need
    else:
      covered -= max(need, 0)
    assert asked == want
  assert tier.num_plans == len(want) > 3


def test_chain_order_reads_both_key_words(rng):
  """Keys are 64-bit (`u32[n, 2]`: high, low word): two chains whose keys
  differ only in the high word's top bit stay apart, each root to leaf, in
  the order their first block appears."""
  n = int(rng.integers(2, 5))
  low = rng.choice(1 << 32, n, replace=False).astype(np.uint32)
  high = np.uint32(rng.integers(1, 1 << 31))
  highs = (high, high | np.uint32(1 << 31))
  # Listed interleaved, chain 0's block of each depth first: a key read by
  # its low word alone would find chain 0's block as chain 1's parent.
  blocks = [(c, d) for d in range(n) for c in (0, 1)]
  key = np.array([(highs[c], low[d]) for c, d in blocks], np.uint32)
  parent = np.array([(highs[c], low[d - 1]) if d else (0, 0)
                     for c, d in blocks], np.uint32)
  first = np.array([d == 0 for _, d in blocks])
  order = ht._chain_order(key, parent, first)  # noqa: SLF001
  assert [blocks[i] for i in order] == (
      [(0, d) for d in range(n)] + [(1, d) for d in range(n)])


def test_chain_fields_read_the_host_slots(rng):
  """`_chain_fields` gives the key, parent key and `is_first` of each host
  slot asked for (-1: host slot 0's)."""
  from pkvattn import cache
  H = 8
  host = cache.init_host_tier(cache.HostTierConfig(num_slots=H, page_size=8))
  key = rng.integers(0, 1 << 32, (H, 2), dtype=np.uint64).astype(np.uint32)
  parent = rng.integers(0, 1 << 32, (H, 2), dtype=np.uint64).astype(np.uint32)
  first = rng.integers(0, 2, H).astype(bool)
  host = dataclasses.replace(host, key=jnp.asarray(key),
                             parent_key=jnp.asarray(parent),
                             is_first=jnp.asarray(first))
  slots = np.array([0, H - 1, -1] + rng.integers(0, H, 5).tolist(), np.int32)
  got = ht._chain_fields(host, slots)  # noqa: SLF001
  at = np.maximum(slots, 0)
  for g, want in zip(got, (key[at], parent[at], first[at])):
    np.testing.assert_array_equal(np.asarray(g), want)


def test_offload_gathers_the_planned_pages_and_bounds_the_waiting(rng):
  """The blocks a plan names are gathered into new batches (host slot
  `dst[j]` then holds the pages of device slot `src[j]`), and before that
  the oldest waiting batches are queued to the host until at most one
  plan's batches (`cdiv(max_plan, batch_blocks)`) wait besides the new
  ones. (The plan is scripted.)"""
  tier = _tier(256)
  S, per_plan = tier.batch_blocks, -(-tier.max_plan // tier.batch_blocks)
  old = per_plan + 1
  _pending_batches(tier, old)
  m = int(rng.integers(1, tier.max_plan + 1))
  src = rng.choice(DEVICE_SLOTS, m, replace=False).astype(np.int32)
  dst = rng.choice(np.arange(old * S, tier.num_slots), m,
                   replace=False).astype(np.int32)

  def plan(state, host, num_new_slots):
    pad = np.full(tier.max_plan - m, -1, np.int32)
    return (host, jnp.asarray(np.concatenate([src, pad])),
            jnp.asarray(np.concatenate([dst, pad])))
  tier._plan = plan  # noqa: SLF001
  pool = rng.standard_normal((DEVICE_SLOTS * 2,) + PAGE).astype(np.float32)
  stats = types.SimpleNamespace(host_transfer_s=0.0, host_blocks_offloaded=0,
                                host_bytes_offloaded=0)
  tier.offload(jnp.asarray(pool), None, m, 0, stats)
  new = -(-m // S)
  assert list(tier._pending) == list(range(1, old + new))  # noqa: SLF001
  assert stats.host_blocks_offloaded == m
  assert stats.host_bytes_offloaded == m * SLOT_BYTES
  slots = pool.reshape((DEVICE_SLOTS, 2) + PAGE)
  for s, d in zip(src, dst):
    np.testing.assert_array_equal(tier.host_pages(int(d)), slots[s])
