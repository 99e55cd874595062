"""The engine's host KV tier (`EngineConfig.host_kv_cache_bytes`) on the tiny
model (CPU, f32): a multi-turn workload whose histories exceed the device
pool. With the tier, returning turns reload their evicted prefixes instead of
recomputing them; greedy tokens are the same as without it.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np
import pytest

from pkvattn import cache
from pkvattn.serving import host_tier
from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.models import load_model
from compile_events import count_compiles

# 16 slots x 8 tokens; 4 conversations of up to ~90 tokens: every turn evicts
# the others' histories from the device.
CFG = EngineConfig(page_size=8, num_slots=16, max_seqs=2, max_num_tokens=32,
                   max_model_len=128, token_buckets=(32,))
HOST_BYTES = 1 << 20


def _multi_turn(engine, turns=3, convs=4, seed=0):
  """Runs `turns` rounds; each turn appends a user message to each
  conversation's history (prompt + previous answer). Returns the answers."""
  rng = np.random.default_rng(seed)
  hist = [[256] + rng.integers(0, 256, 24).tolist() for _ in range(convs)]
  sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
  answers = []
  for _ in range(turns):
    prompts = [h + rng.integers(0, 256, 6).tolist() for h in hist]
    outs = engine.generate(prompts, sp)
    answers.append(outs)
    hist = [p + o for p, o in zip(prompts, outs)]
  return answers


@pytest.fixture(scope="module")
def runs(model):
  off = Engine(model, CFG)
  on = Engine(model, dataclasses.replace(CFG, host_kv_cache_bytes=HOST_BYTES))
  return (off, _multi_turn(off)), (on, _multi_turn(on))


def test_same_tokens_fewer_prefill_tokens(runs):
  (off, a_off), (on, a_on) = runs
  assert a_on == a_off
  st = on.stats
  assert st.host_blocks_offloaded > 0
  assert st.host_hits > 0 and st.host_blocks_reloaded == st.host_hits
  assert 0 < sum(on.host_tier.phase_s.values()) <= st.host_transfer_s
  assert 0 < st.host_hit_rate <= 1
  assert st.host_bytes_reloaded == st.host_blocks_reloaded * (
      on.host_tier.slot_bytes)
  assert st.prefill_tokens < off.stats.prefill_tokens
  # Every prompt token is computed, reused on the device or reloaded.
  ps = CFG.page_size
  assert (st.prefill_tokens + st.reused_tokens + st.host_blocks_reloaded * ps
          == off.stats.prefill_tokens + off.stats.reused_tokens)
  assert off.stats.host_blocks_offloaded == 0 and off.host_tier is None
  cache.validate(on.state)
  cache.validate_host_tier(on.host_tier.state)


def test_reloaded_pages_equal_the_device_ones(runs):
  """Each valid host entry holds the pages its block had on the device: a
  block still (or again) published on the device with the same key has the
  same pages, bit for bit."""
  _, _ = runs[0]
  on = runs[1][0]
  tier = on.host_tier
  hs = tier.state
  valid = np.asarray(hs.valid)
  keys = np.asarray(hs.key)
  st = on.state
  pub = np.asarray(st.slot_published)
  dkeys = {tuple(k): s for s, k in enumerate(np.asarray(st.slot_key).tolist())
           if pub[s]}
  pool = np.asarray(on.pool).reshape((st.num_slots,) + tier.slot_shape)
  compared = 0
  for h in np.flatnonzero(valid):
    s = dkeys.get(tuple(keys[h].tolist()))
    if s is not None:
      np.testing.assert_array_equal(tier.host_pages(h), pool[s])
      compared += 1
  assert compared > 0
  assert all(tier.host_pages(h) is not None for h in np.flatnonzero(valid))


def test_fp8_pool(model):
  cfg = dataclasses.replace(CFG, kv_cache_dtype="fp8", k_scale=0.05,
                            v_scale=0.05)
  off = _multi_turn(Engine(model, cfg), turns=2)
  engine = Engine(model, dataclasses.replace(cfg,
                                             host_kv_cache_bytes=HOST_BYTES))
  assert engine.host_tier.dtype == np.dtype(jax.numpy.float8_e4m3fn)
  assert _multi_turn(engine, turns=2) == off
  assert engine.stats.host_hits > 0
  # With and without the tier, the engines share their step programs (the
  # step of no tokens and the 32-token step).
  assert engine.stats.num_compiles == 2


def test_no_compile_after_warmup(model):
  jax.clear_caches()  # the tier's programs compile again, in warmup
  engine = Engine(model, dataclasses.replace(CFG,
                                             host_kv_cache_bytes=HOST_BYTES))
  with count_compiles() as events:
    engine.warmup()
  assert events                       # the proof that compiles are counted
  # On a CPU the batches stay in its own memory: no copies to time or pace;
  # on a GPU warmup times the copies to the host.
  speed = engine.host_tier.copy_bytes_per_s
  if jax.default_backend() == "cpu":
    assert speed == float("inf")
  else:
    assert 0 < speed < float("inf")
  with count_compiles() as events:
    _multi_turn(engine, turns=2, seed=1)
  assert engine.stats.host_hits > 0
  assert events == []


def test_config_errors(model):
  with pytest.raises(ValueError, match="host_kv_cache_bytes"):
    EngineConfig(host_kv_cache_bytes=-1)
  with pytest.raises(ValueError, match="host_kv_cache_bytes"):
    EngineConfig(host_kv_cache_bytes=1.5)
  with pytest.raises(ValueError, match="host_kv_cache_bytes.*enable_prefix"):
    EngineConfig(host_kv_cache_bytes=1 << 20, enable_prefix_reuse=False)
  with pytest.raises(ValueError, match="host_kv_cache_bytes.*one slot"):
    Engine(model, dataclasses.replace(CFG, host_kv_cache_bytes=10))
  # Exactly one slot's bytes: a tier of one batch of one slot.
  slot_bytes = Engine(model, dataclasses.replace(
      CFG, host_kv_cache_bytes=HOST_BYTES)).host_tier.slot_bytes
  tier = Engine(model, dataclasses.replace(
      CFG, host_kv_cache_bytes=slot_bytes)).host_tier
  assert (tier.num_slots, tier.batch_blocks, tier.max_batches) == (1, 1, 1)
  with pytest.raises(ValueError, match=f"one slot of {slot_bytes} bytes"):
    Engine(model, dataclasses.replace(CFG, host_kv_cache_bytes=slot_bytes - 1))
  with pytest.raises(ValueError, match="host_kv_cache_bytes.*kv_groups=False"):
    Engine(load_model("tiny-gemma3"), dataclasses.replace(
        CFG, host_kv_cache_bytes=HOST_BYTES))


def test_tier_larger_than_the_machine_is_refused(model, monkeypatch):
  """A tier the machine's memory cannot hold is refused when the engine is
  built (its batches are allocated as blocks are offloaded, so it would
  fail mid-run), as is one of more slots than int32 slot ids name; a tier
  of exactly the machine's memory is not."""
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  with pytest.raises(ValueError, match=(
      rf"Invalid host_kv_cache_bytes: expected at most the host's memory "
      rf"\({memory} bytes\), got {memory + 1}")):
    Engine(model, dataclasses.replace(CFG, host_kv_cache_bytes=memory + 1))
  slot_bytes = Engine(model, dataclasses.replace(
      CFG, host_kv_cache_bytes=HOST_BYTES)).host_tier.slot_bytes
  monkeypatch.setattr(host_tier, "host_memory_bytes", lambda: 1 << 62)
  with pytest.raises(ValueError, match=rf"at most 2\*\*31 - 1 slots of "
                     rf"{slot_bytes} bytes, got {2**31}"):
    Engine(model, dataclasses.replace(
        CFG, host_kv_cache_bytes=2**31 * slot_bytes))
  # At the limit: built (the tier's batches are not allocated yet).
  monkeypatch.setattr(host_tier, "host_memory_bytes", lambda: 4 * slot_bytes)
  tier = Engine(model, dataclasses.replace(
      CFG, host_kv_cache_bytes=4 * slot_bytes)).host_tier
  assert tier.num_slots == 4


def _check_batches(tier):
  """Every valid host slot names a live batch; batches hold at most
  `batch_blocks` live rows and fit the byte budget."""
  valid = np.asarray(tier.state.valid)
  assert np.all(tier._batch_of[valid] >= 0)  # noqa: SLF001
  assert len(tier._batches) <= tier.max_batches  # noqa: SLF001
  live = np.bincount(tier._batch_of[tier._batch_of >= 0],  # noqa: SLF001
                     minlength=tier._next_batch)  # noqa: SLF001
  for b, (_, rows) in tier._batches.items():  # noqa: SLF001
    assert 0 < rows == live[b] <= tier.batch_blocks


def test_small_tier_frees_whole_batches(model, runs):
  """A tier of 16 slots (8 batches of 2) fills up: batches are freed whole,
  the bookkeeping follows, and the tokens stay those without the tier."""
  (off, a_off), _ = runs
  engine = Engine(model, dataclasses.replace(
      CFG, host_kv_cache_bytes=16 * off.kv.block_bytes * 2))  # 2 layers
  tier = engine.host_tier
  assert (tier.num_slots, tier.batch_blocks, tier.max_batches) == (16, 2, 8)
  assert _multi_turn(engine) == a_off
  assert engine.stats.host_blocks_offloaded > tier.num_slots  # it cycled
  assert engine.stats.host_hits > 0
  assert len(tier._batches) == tier.max_batches  # noqa: SLF001  full
  _check_batches(tier)
  cache.validate_host_tier(tier.state)


@pytest.mark.parametrize("batches", ["many", "few"])
def test_copy_speed_timed_after_the_reservation(model, runs, monkeypatch,
                                                batches):
  """`warmup` reserves the tier's pinned memory, whose first use of each
  buffer page-locks it (slow), then times the copies' speed (`flush` sizes
  its copies by it) on at most `COPY_PROBE_BATCHES` buffers already
  reserved: with each first use made to take 20 ms and each later copy
  1 ms, the speed is that of the later copies, and no copy goes past the
  reserved buffers (a tier of fewer batches than the probe's)."""
  from pkvattn.serving import host_tier as ht
  (off, _), _ = runs
  nbytes = HOST_BYTES
  if batches == "few":  # 4 batches of one slot
    nbytes = 4 * off.kv.block_bytes * 2  # 2 layers
  engine = Engine(model, dataclasses.replace(CFG, host_kv_cache_bytes=nbytes))
  tier = engine.host_tier
  assert (tier.max_batches >= ht.COPY_PROBE_BATCHES) == (batches == "many")
  monkeypatch.setattr(ht, "_host_memory_kind", lambda pool: "pinned_host")
  real_put, puts = jax.device_put, []

  def put(x, device=None, *args, **kwargs):
    if getattr(device, "memory_kind", None) == "pinned_host":
      # The batch made before the reservation is a first use, too.
      time.sleep(0.02 if len(puts) <= tier.max_batches else 0.001)
      puts.append(x.shape)
    return real_put(x, device, *args, **kwargs)
  monkeypatch.setattr(jax, "device_put", put)
  tier.warmup(engine.pool, engine.state,
              (engine.config.num_admit, engine.config.max_model_len))
  probe = min(ht.COPY_PROBE_BATCHES, tier.max_batches)
  assert len(puts) == tier.max_batches + 1 + probe
  batch_bytes = tier.batch_blocks * tier.slot_bytes
  # Timed over the reservation it would be below one batch per 20 ms.
  assert 2 * batch_bytes / 0.02 < tier.copy_bytes_per_s <= batch_bytes / 1e-3


def test_copies_queued_a_batch_at_a_time(model, runs):
  """With copies slower than any program, each `flush` after a read queues
  one batch: the others wait in device memory, reloads read them there, and
  the tokens are those without the tier."""
  (off, a_off), _ = runs
  engine = Engine(model, dataclasses.replace(
      CFG, host_kv_cache_bytes=12 * off.kv.block_bytes * 2))  # 2 layers
  tier = engine.host_tier
  assert tier.batch_blocks == 1
  tier.copy_bytes_per_s = 1.0  # one batch per flush (at least one)
  flush, waiting = tier.flush, []

  def one_at_a_time(stats=None, seconds=None):
    # The oldest batch still live is queued; freed ones before it leave.
    pending = list(tier._pending)  # noqa: SLF001
    live = [b in tier._batches for b in pending]  # noqa: SLF001
    expected = len(pending) - (live.index(True) + 1 if any(live)
                               else len(pending))
    left = flush(stats, seconds)
    assert seconds is not None and left == expected
    waiting.append(left)
    return left
  tier.flush = one_at_a_time
  t0 = time.perf_counter()
  assert _multi_turn(engine) == a_off
  wall = time.perf_counter() - t0
  assert max(waiting) > 0 and engine.stats.host_hits > 0
  assert 0 < sum(tier.phase_s.values()) <= engine.stats.host_transfer_s <= wall
  _check_batches(tier)
  cache.validate_host_tier(tier.state)
  flush()  # all of them
  assert not tier._pending  # noqa: SLF001


def test_chain_order_keeps_chains_together(rng):
  """Interleaved chains come out grouped (in order of first appearance),
  each root to leaf; a block whose parent is not among them roots a group
  of its own, also where the key it names sorts next to another chain's
  root."""
  from pkvattn.serving.host_tier import _chain_order
  lens = [3] + [int(n) for n in rng.integers(1, 6, 3)]
  keys = rng.choice(2**40, sum(lens), replace=False).astype(np.uint64) + 2
  chains = np.split(keys, np.cumsum(lens)[:-1])
  # Chain 0 loses its middle block, whose key sorts just below chain 1's
  # root: chain 0's leaf is an orphan (listed first), a group of its own.
  chains[0][1] = chains[1][0] - 1
  assert chains[0][1] not in keys[lens[0]:]
  blocks = [(c, d) for c, n in enumerate(lens) for d in range(n)
            if (c, d) not in ((0, 1), (0, 2))]
  blocks = [(0, 2)] + [blocks[i] for i in rng.permutation(len(blocks))]

  def pairs(values):  # u64 -> u32[n, 2] (high, low)
    v = np.asarray(values, np.uint64)
    return np.stack([v >> np.uint64(32), v & np.uint64(0xFFFFFFFF)],
                    1).astype(np.uint32)
  key = pairs([chains[c][d] for c, d in blocks])
  parent = pairs([chains[c][d - 1] if d else 0 for c, d in blocks])
  first = np.array([d == 0 for _, d in blocks])
  order = _chain_order(key, parent, first)
  # Expected: groups by first appearance, each by depth (ties: listed order).
  group = [(c, c == 0 and d == 2) for c, d in blocks]
  seen = {g: i for i, g in reversed(list(enumerate(group)))}
  expected = sorted(range(len(blocks)),
                    key=lambda i: (seen[group[i]], blocks[i][1], i))
  assert order.tolist() == expected
  # One chain of 40, leaf first, then shuffled: ancestors 39 links up (6
  # rounds of pointer jumping).
  chain = rng.choice(2**40, 40, replace=False).astype(np.uint64) + 2
  for depth in (np.arange(40)[::-1], rng.permutation(40)):
    order = _chain_order(pairs(chain[depth]),
                         pairs([chain[d - 1] if d else 0 for d in depth]),
                         depth == 0)
    assert depth[order].tolist() == list(range(40))


def test_a_plan_covers_the_next_steps(model, rng):
  """One plan mirrors PLAN_HORIZON steps' worth of evictions; the calls
  whose bounds fit in what is left plan nothing."""
  from pkvattn.serving.host_tier import PLAN_HORIZON
  engine = Engine(model, dataclasses.replace(CFG,
                                             host_kv_cache_bytes=HOST_BYTES))
  tier, stats = engine.host_tier, engine.stats
  need, free = int(rng.integers(1, 4)), int(rng.integers(1, 4))
  assert PLAN_HORIZON * need <= tier.max_plan
  for _ in range(PLAN_HORIZON):  # `need` past the free slots, each call
    tier.offload(engine.pool, engine.state, need + free, free, stats)
  assert tier.num_plans == 1
  tier.offload(engine.pool, engine.state, need + free, free, stats)
  assert tier.num_plans == 2
  tier.offload(engine.pool, engine.state, 5, 5, stats)  # free slots suffice
  assert tier.num_plans == 2


def test_batches_lose_reassigned_rows_and_the_oldest_is_freed_whole(
    model, runs):
  """A batch loses a row when its host slot is planned again; past the
  budget of batches, the least recently used one is freed whole and its
  live slots leave the bookkeeping. The plans are scripted (host slots
  chosen here; the plan itself is tested in the cache's tests)."""
  (off, _), _ = runs
  engine = Engine(model, dataclasses.replace(
      CFG, host_kv_cache_bytes=16 * off.kv.block_bytes * 2))  # 2 layers
  tier = engine.host_tier
  assert (tier.num_slots, tier.batch_blocks, tier.max_batches) == (16, 2, 8)
  planned = []

  def plan(state, host, num_new_slots):
    dst = planned.pop(0)
    src = np.full(tier.max_plan, -1, np.int32)
    d = np.full(tier.max_plan, -1, np.int32)
    src[:len(dst)], d[:len(dst)] = np.arange(len(dst)), dst
    return host, jax.numpy.asarray(src), jax.numpy.asarray(d)
  tier._plan = plan  # noqa: SLF001

  def mirror(*dst):
    planned.append(list(dst))
    tier._covered = 0  # noqa: SLF001  a plan is due
    tier.offload(engine.pool, engine.state, len(dst), 0, engine.stats)
    assert not planned

  def rows():
    return {b: n for b, (_, n) in tier._batches.items()}  # noqa: SLF001
  mirror(0, 1)
  mirror(2, 3)
  mirror(0)  # batch 0 keeps slot 1
  assert rows() == {0: 1, 1: 2, 2: 1}
  assert tier._batch_of[:4].tolist() == [2, 0, 1, 1]  # noqa: SLF001
  mirror(2, 3)  # batch 1 loses both: freed
  assert rows() == {0: 1, 2: 1, 3: 2}
  for slot in range(4, 14, 2):
    mirror(slot, slot + 1)
  assert len(tier._batches) == tier.max_batches  # noqa: SLF001
  mirror(14, 15)  # one batch too many: batch 0, the oldest, goes
  assert list(rows()) == [2, 3, 4, 5, 6, 7, 8, 9]
  assert tier._batch_of[1] == -1 and tier.host_pages(1) is None  # noqa: SLF001
  assert tier._batch_of[0] == 2 and tier.host_pages(0) is not None  # noqa: SLF001
  _check_batches(tier)


def test_host_memory_kind_prefers_pinned_memory():
  """Batches live in `pinned_host` memory where the device has it, else in
  `unpinned_host`; on a CPU in its own memory; a device with neither is an
  error naming `host_kv_cache_bytes`."""
  import types
  from pkvattn.serving.host_tier import _host_memory_kind

  class Device:
    def __init__(self, platform, *kinds):
      self.platform, self.kinds = platform, kinds

    def addressable_memories(self):
      return [types.SimpleNamespace(kind=k) for k in self.kinds]

  def kind(*devices):
    return _host_memory_kind(types.SimpleNamespace(
        sharding=types.SimpleNamespace(device_set=set(devices))))
  assert kind(Device("cpu", "device", "pinned_host")) == "device"
  both = ("device", "pinned_host", "unpinned_host")
  assert kind(Device("gpu", *both), Device("gpu", *both)) == "pinned_host"
  assert kind(Device("gpu", "device", "unpinned_host")) == "unpinned_host"
  with pytest.raises(ValueError, match="host_kv_cache_bytes.*got.*device"):
    kind(Device("gpu", "device"))


def test_batches_in_device_memory_stay_bounded(model, runs):
  """With no copy to the host queued after reads (copies slower than
  anything), a plan queues the oldest gathered batches itself, so at most
  one plan's batches wait in device memory besides its own; after every
  plan the bookkeeping holds (each live batch's row count is its live
  slots), and the tokens are those without the tier."""
  (off, a_off), _ = runs
  engine = Engine(model, dataclasses.replace(
      CFG, host_kv_cache_bytes=16 * off.kv.block_bytes * 2))  # 2 layers
  tier = engine.host_tier
  flush, offload, waiting = tier.flush, tier.offload, []

  def only_when_asked(stats=None, seconds=None, batches=None):
    return len(tier._pending) if batches is None else flush(  # noqa: SLF001
        stats, batches=batches)

  def checked(*args):
    offload(*args)
    waiting.append(len(tier._pending))  # noqa: SLF001
    assert waiting[-1] <= 2 * -(-tier.max_plan // tier.batch_blocks)
    _check_batches(tier)
  tier.flush, tier.offload = only_when_asked, checked
  t0 = time.perf_counter()
  assert _multi_turn(engine) == a_off
  wall = time.perf_counter() - t0
  assert max(waiting) > -(-tier.max_plan // tier.batch_blocks)
  st = engine.stats
  assert st.host_blocks_offloaded > tier.num_slots  # it cycled
  assert st.host_hits > 0
  # The phases' seconds are parts of the tier's host time, once each.
  assert set(tier.phase_s) == {"plan", "gather", "put", "free", "lookup",
                               "load"}
  assert min(tier.phase_s.values()) >= 0
  assert sum(tier.phase_s.values()) <= st.host_transfer_s <= wall


def test_plan_bounds_count_claims_extends_and_a_burst(model):
  """A step's bound: its claims' whole prompts, one block per extended row,
  and one burst's (`cdiv(decode_steps, page_size) + 1` blocks a row); a
  burst's: two bursts'. A plan mirrors up to PLAN_HORIZON steps' and
  bursts' worth, within both pools."""
  from types import SimpleNamespace
  from pkvattn.serving.host_tier import PLAN_HORIZON
  cfg = dataclasses.replace(CFG, num_slots=4096, decode_steps=12,
                            max_admit=2, host_kv_cache_bytes=1 << 30)
  tier = Engine(model, cfg).host_tier
  # page_size 8, 2 rows: a burst of 12 tokens takes 2 + 1 blocks a row.
  assert tier.burst_blocks == 6 and tier.burst_bound() == 12
  inputs = SimpleNamespace(admit_ids=np.array([-1, 1]),
                           admit_lens=np.array([40, 17]),
                           extend_ids=np.array([0, -1]))
  assert tier.step_bound(inputs) == 3 + 1 + 6  # 17 tokens: 3 blocks
  # A step: 2 claims of 16 pages (max_model_len 128) and 2 extends.
  assert tier.max_plan == PLAN_HORIZON * (2 * 16 + 2 + 6)
  small = Engine(model, dataclasses.replace(cfg, num_slots=64)).host_tier
  assert small.max_plan == 64


def test_a_prompt_partly_on_the_device_reloads_the_rest(model, rng):
  """A returning prompt whose first blocks are still on the device reuses
  those and looks up only the blocks after them (up to the one before its
  last token's) on the host, and finds them all: the blocks the step that
  admitted the other prompt evicted were released in that step, and
  mirrored all the same."""
  engine = Engine(model, dataclasses.replace(CFG,
                                             host_kv_cache_bytes=HOST_BYTES))
  st, sp = engine.stats, SamplingParams(max_new_tokens=1, ignore_eos=True)
  prompt = [256] + rng.integers(0, 256, 47).tolist()  # 6 blocks of 8
  engine.generate([prompt], sp)
  # 13 blocks of another prompt in the 16-slot pool evict 3 of its 6.
  engine.generate([[256] + rng.integers(0, 256, 103).tolist()], sp)
  before = dataclasses.replace(st)
  engine.generate([prompt], sp)
  reused = st.reused_tokens - before.reused_tokens
  hits = st.host_hits - before.host_hits
  assert reused == 24
  assert st.host_lookups - before.host_lookups == (48 - 1) // 8 - 3
  assert hits == 2
  assert st.prefill_tokens - before.prefill_tokens == 48 - reused - 8 * hits
  # A load from the first batch (rows -1: copied, then dropped); one that
  # also names a host slot holding nothing raises (a bug, never skipped).
  tier = engine.host_tier
  rows, blocks = np.full(2, -1, np.int32), np.zeros(2, np.int32)
  first = int(np.flatnonzero(tier._batch_of == 0)[0])  # noqa: SLF001
  empty = int(np.flatnonzero(tier._batch_of < 0)[0])  # noqa: SLF001
  engine.pool = tier.load(engine.pool, engine.state, rows, blocks,
                          np.array([first, first]))
  with pytest.raises(RuntimeError, match=rf"host slots \[{empty}\] hold"):
    tier.load(engine.pool, engine.state, rows, blocks,
              np.array([first, empty]))


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_rows_released_before_a_plan_are_mirrored(model, decode_steps, rng):
  """A step or an unchained burst that may evict releases its finished rows
  in a program of their own first, so the plan mirrors their blocks (a plan
  made before the releasing program cannot see them); the tokens are those
  without the tier."""
  cfg = dataclasses.replace(CFG, decode_steps=decode_steps)
  # After the turns, two prompts prefilled in one step: one ends with its
  # first token while the other decodes (with bursts, the next program is
  # a burst that releases it).
  prompts = [[256] + rng.integers(0, 256, 14).tolist() for _ in range(2)]
  params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (1, 12)]
  off = Engine(model, cfg)
  expected = _multi_turn(off), off.generate(prompts, params)
  engine = Engine(model, dataclasses.replace(cfg,
                                             host_kv_cache_bytes=HOST_BYTES))
  kinds, release_first = [], engine._release_first  # noqa: SLF001

  def spy(scheduled, released):
    kinds.append(scheduled.kind)
    out = release_first(scheduled, released)
    assert np.all(np.asarray(out.inputs.release_ids) == -1)
    return out
  engine._release_first = spy  # noqa: SLF001
  assert (_multi_turn(engine), engine.generate(prompts, params)) == expected
  assert "step" in kinds and (decode_steps == 1 or "burst" in kinds)
  assert engine.stats.host_hits > 0
  cache.validate(engine.state)


@pytest.mark.parametrize("failing_call", [1, 2])
def test_a_failed_release_first_loses_no_request(model, monkeypatch,
                                                 failing_call, rng):
  """The step that releases a finished row first and then admits: if the
  release program raises before it runs, the step is undone with the row
  still to be released; if the step's own program raises after the
  release ran, the row is free and nothing is released twice. Either way
  the request then completes as without the tier."""
  cfg = dataclasses.replace(CFG, host_kv_cache_bytes=HOST_BYTES)
  sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
  first = [256] + rng.integers(0, 256, 47).tolist()
  second = [256] + rng.integers(0, 256, 103).tolist()  # evicts the first
  off = Engine(model, CFG)
  expected = off.generate([first], sp), off.generate([second], sp)
  engine = Engine(model, cfg)
  assert engine.generate([first], sp) == expected[0]
  rid = engine.add_request(second, sp)
  row_to_release = list(engine.scheduler.to_release)
  assert row_to_release
  run, calls, released_first = engine._run, [], []  # noqa: SLF001
  release_first = engine._release_first  # noqa: SLF001

  def flaky(scheduled):
    calls.append(scheduled.kind)
    if len(calls) == failing_call:
      raise RuntimeError("launch failed")
    return run(scheduled)

  def spy(scheduled, released):
    released_first.append(list(released))
    return release_first(scheduled, released)
  monkeypatch.setattr(engine, "_run", flaky)
  monkeypatch.setattr(engine, "_release_first", spy)
  with pytest.raises(RuntimeError, match="launch failed"):
    engine.step()
  assert released_first == [row_to_release]
  assert [r.request_id for r in engine.scheduler.waiting] == [rid]
  assert engine.scheduler.to_release == (row_to_release if failing_call == 1
                                         else [])
  monkeypatch.undo()
  while engine.has_unfinished():
    engine.step()
  assert engine.get_request(rid).output == expected[1][0]
  engine.step()  # releases the last row
  assert engine.scheduler.free_rows == list(range(cfg.max_seqs))
  cache.validate(engine.state)
  assert int(cache.stats(engine.state)["num_used"]) == 0


def test_one_block_reloads_and_an_empty_tier_looks_nothing_up(model, rng):
  """Before any block was mirrored, admissions look nothing up on the host;
  a returning prompt of two blocks, evicted whole, looks up and reloads its
  first (the second holds its last token, always computed), and `reload`
  reports that block's tokens for it. A new prompt of 9 tokens looks up
  its first block alone."""
  engine = Engine(model, dataclasses.replace(CFG,
                                             host_kv_cache_bytes=HOST_BYTES))
  st, sp = engine.stats, SamplingParams(max_new_tokens=1, ignore_eos=True)
  tier, reported = engine.host_tier, []
  reload = tier.reload

  def spy(*args):
    pool, done = reload(*args)
    reported.append(done)
    return pool, done
  tier.reload = spy
  prompt = [256] + rng.integers(0, 256, 15).tolist()  # 2 blocks of 8
  engine.generate([prompt], sp)
  assert st.host_blocks_offloaded == 0 and st.host_lookups == 0
  assert all(done == {} for done in reported)
  # 128 tokens: the whole 16-slot pool, every block of the first evicted.
  engine.generate([[256] + rng.integers(0, 256, 126).tolist()], sp)
  assert st.host_blocks_offloaded > 0
  before, reported[:] = dataclasses.replace(st), []
  engine.generate([prompt], sp)
  assert st.reused_tokens == before.reused_tokens
  assert st.host_lookups - before.host_lookups == 1
  assert st.host_hits - before.host_hits == 1
  assert st.prefill_tokens - before.prefill_tokens == 16 - 8
  assert [list(done.values()) for done in reported if done] == [[8]]
  engine.generate([[256] + rng.integers(0, 256, 8).tolist()], sp)
  assert st.host_lookups - before.host_lookups == 2
