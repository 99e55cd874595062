"""The engine's host KV tier (`EngineConfig.host_kv_cache_bytes`) on the tiny
model (CPU, f32): a multi-turn workload whose histories exceed the device
pool. With the tier, returning turns reload their evicted prefixes instead of
recomputing them; greedy tokens are the same as without it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from pkvattn import cache
from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.models import load_model
from test_engine_compile_once import count_compiles

# 16 slots x 8 tokens; 4 conversations of up to ~90 tokens: every turn evicts
# the others' histories from the device.
CFG = EngineConfig(page_size=8, num_slots=16, max_seqs=2, max_num_tokens=32,
                   max_model_len=128, token_buckets=(32,))
HOST_BYTES = 1 << 20


@pytest.fixture(scope="module")
def model():
  return load_model("tiny-llama")


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
  with pytest.raises(ValueError, match="host_kv_cache_bytes.*kv_groups=False"):
    Engine(load_model("tiny-gemma3"), dataclasses.replace(
        CFG, host_kv_cache_bytes=HOST_BYTES))


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
  _check_batches(tier)
  cache.validate_host_tier(tier.state)


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
    before = len(tier._pending)  # noqa: SLF001
    left = flush(stats, seconds)
    assert seconds is not None and left <= max(before - 1, 0)
    waiting.append(left)
    return left
  tier.flush = one_at_a_time
  assert _multi_turn(engine) == a_off
  assert max(waiting) > 0 and engine.stats.host_hits > 0
  _check_batches(tier)
  cache.validate_host_tier(tier.state)
  flush()  # all of them
  assert not tier._pending  # noqa: SLF001


def test_chain_order_keeps_chains_together(rng):
  """Interleaved chains come out grouped (in order of first appearance),
  each root to leaf; a block whose parent is not among them roots a group."""
  from pkvattn.serving.host_tier import _chain_order
  chains, nxt = [], 1
  for _ in range(4):
    n = int(rng.integers(1, 6))
    chains.append(list(range(nxt, nxt + n)))
    nxt += n
  blocks = [(c, d) for c, ch in enumerate(chains) for d in range(len(ch))]
  perm = rng.permutation(len(blocks))
  blocks = [blocks[i] for i in perm]
  # Drop chain 0's root: its next block becomes an orphan root.
  blocks = [b for b in blocks if b != (0, 0)] if len(chains[0]) > 1 else blocks
  key = np.array([[chains[c][d], 0] for c, d in blocks], np.uint32)
  parent = np.array([[chains[c][d - 1] if d else 0, 0] for c, d in blocks],
                    np.uint32)
  first = np.array([d == 0 for _, d in blocks])
  order = _chain_order(key, parent, first)
  assert sorted(order.tolist()) == list(range(len(blocks)))
  seq = [blocks[i] for i in order]
  groups = [c for i, (c, _) in enumerate(seq) if i == 0 or seq[i - 1][0] != c]
  assert len(groups) == len(set(groups))                 # contiguous chains
  assert groups == list(dict.fromkeys(c for c, _ in blocks))  # first seen
  for c in groups:
    depths = [d for cc, d in seq if cc == c]
    assert depths == sorted(depths)                      # root to leaf


def test_a_plan_covers_the_next_steps(model, rng):
  """One plan mirrors PLAN_HORIZON steps' worth of evictions; the calls
  whose bounds fit in what is left plan nothing."""
  from pkvattn.serving.host_tier import PLAN_HORIZON
  engine = Engine(model, dataclasses.replace(CFG,
                                             host_kv_cache_bytes=HOST_BYTES))
  tier, stats = engine.host_tier, engine.stats
  need = int(rng.integers(1, 4))
  for _ in range(PLAN_HORIZON):
    tier.offload(engine.pool, engine.state, need, 0, stats)
  assert tier.num_plans == 1
  tier.offload(engine.pool, engine.state, need, 0, stats)
  assert tier.num_plans == 2
  tier.offload(engine.pool, engine.state, 5, 5, stats)  # free slots suffice
  assert tier.num_plans == 2
