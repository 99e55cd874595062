"""The engine on hybrid sliding-window models: per-window-group slot spaces.

Greedy tokens must not depend on the KV layout (one slot space vs one per
window group), on prefix reuse, on SWA scratch in the sliding groups, or on
how tight the sliding group's budget is (refusals and preemptions
recompute, outputs unchanged); the per-group
layout must hold fewer KV bytes than the flat one once prompts outgrow the
window. CPU, xla path, f32.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pkvattn import cache
from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.models import load_model

BASE = EngineConfig(page_size=8, num_slots=64, max_seqs=3, max_num_tokens=48,
                    max_model_len=128, decode_steps=4, token_buckets=(48,),
                    impl="xla")


@pytest.fixture(scope="module", params=["tiny-gemma2", "tiny-gemma3"])
def model(request):
  return load_model(request.param)


def _prompts(seed, vocab):
  # A shared 44-token prefix (longer than both windows) and random tails:
  # reuse must serve the global layers' whole prefix and the sliding
  # layers' last window of it.
  rng = np.random.default_rng(seed)
  shared = rng.integers(1, vocab - 64, 44).tolist()
  return [shared + rng.integers(1, vocab - 64, int(k)).tolist()
          for k in rng.integers(2, 30, 5)]


def _run(model, cfg, prompts, new_tokens=24, warmup=False):
  engine = Engine(model, cfg)
  if warmup:
    engine.warmup()
  compiled = engine.stats.num_compiles
  out = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens,
                                                ignore_eos=True))
  if warmup:  # the per-group state changes no program's count
    assert engine.stats.num_compiles == compiled == len(engine.programs())
  cache.validate(engine.state)
  return out, engine


def test_layouts_reuse_and_budget_give_the_same_tokens(model):
  prompts = _prompts(0, model.cfg.vocab_size)
  flat, flat_engine = _run(model, dataclasses.replace(
      BASE, kv_groups=False, enable_prefix_reuse=False), prompts)
  grouped, engine = _run(model, BASE, prompts, warmup=True)
  assert isinstance(engine.cache_config, cache.HybridCacheConfig)
  assert isinstance(flat_engine.cache_config, cache.CacheConfig)
  assert grouped == flat
  st = engine.stats
  # Prompts reuse the shared prefix in every group (only whole blocks
  # before the last prompt token count).
  assert st.reused_tokens >= 2 * 40
  assert len(st.peak_group_slots) == 2 == len(engine.cache_config.groups)
  # The sliding group keeps only its window: fewer slots at peak than the
  # global group, and fewer KV bytes than the flat layout of the same run.
  assert st.peak_group_slots[1] < st.peak_group_slots[0]
  assert st.flat_peak_kv_bytes > st.peak_kv_bytes > 0
  assert st.kv_bytes_saved == st.flat_peak_kv_bytes - st.peak_kv_bytes
  # Tight sliding budget: admissions wait and decodes are preempted and
  # recomputed (both with prefix reuse on), tokens unchanged.
  # The sliding group holds just the longest request (prompt + output).
  longest = max(-(-(len(p) + 24) // BASE.page_size) for p in prompts)
  slots = engine.cache_config.group_num_slots
  tight, tight_engine = _run(model, dataclasses.replace(
      BASE, group_num_slots=(slots[0], longest)), prompts)
  assert tight == flat
  assert (tight_engine.stats.num_refused_claims
          + tight_engine.stats.num_preemptions) > 0


def test_scratch_in_the_sliding_groups_gives_the_same_tokens(model):
  # SWA scratch blocks live for one step, so with scratch in the sliding
  # groups the engine prefills each prompt in one step (a budget that holds
  # each prompt and its output); chunked, the sliding layers would lose
  # the blocks of a prompt's earlier chunks.
  prompts = _prompts(0, model.cfg.vocab_size)
  flat, _ = _run(model, dataclasses.replace(
      BASE, kv_groups=False, enable_prefix_reuse=False), prompts)
  cfg = dataclasses.replace(BASE, enable_swa_scratch_reuse=True,
                            max_num_tokens=128, token_buckets=(128,))
  scratch, engine = _run(model, cfg, prompts)
  assert isinstance(engine.cache_config, cache.HybridCacheConfig)
  assert engine.cache_config.enable_swa_scratch_reuse
  assert scratch == flat


def test_group_budget_and_flags_are_validated():
  model = load_model("tiny-gemma2")
  with pytest.raises(ValueError, match="group_num_slots"):
    EngineConfig(group_num_slots=[8, 8])
  with pytest.raises(ValueError, match="group_num_slots"):
    Engine(model, dataclasses.replace(BASE, kv_groups=False,
                                      group_num_slots=(16, 16)))
  with pytest.raises(ValueError, match="group_num_slots"):
    Engine(model, dataclasses.replace(BASE, group_num_slots=(16,)))
  # A request longer than the smallest group can ever hold is refused.
  engine = Engine(model, dataclasses.replace(BASE, group_num_slots=(32, 4)))
  with pytest.raises(ValueError, match="group_num_slots"):
    engine.add_request(list(range(1, 40)), SamplingParams(max_new_tokens=4))
