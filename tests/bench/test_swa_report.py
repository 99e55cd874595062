"""The KV report's planner (`bench/common/swa_planner.py`) against a token-level
brute force and against the real per-window-group cache ops.

Scenario: Gemma-3-270M's layer windows (18 layers, layer i global iff
(i + 1) % 6 == 0, window 512 -> `window_left = 511`), page_size 16, a
4,096-token prompt in 1,024-token chunks (and in one chunk), then 64 decode
tokens.
"""

from __future__ import annotations

import os
import sys

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.common import swa_planner  # noqa: E402  (repo root, for the bench package)
from pkvattn import cache  # noqa: E402

PAGE_SIZE = 16
PROMPT_LEN = 4096
NUM_DECODE = 64
WINDOWS = tuple(-1 if (i + 1) % 6 == 0 else 511 for i in range(18))
MODES = {"chunks_1k": 1024, "one_chunk": None}


def _steps(prompt_len, chunk_len, num_decode):
  """`(history_len, capacity)` of each step, written out here (not the
  planner's): chunks, then one token at a time."""
  chunk_len = chunk_len or prompt_len
  out, h = [], 0
  while h < prompt_len:
    out.append((h, min(h + chunk_len, prompt_len)))
    h = out[-1][1]
  return out + [(prompt_len + i, prompt_len + i + 1) for i in range(num_decode)]


def _seen(queries, window_left, num_tokens):
  """`bool[num_tokens]`: token t is seen by some query q (t <= q, and
  t >= q - window_left unless window_left == -1). A coverage count: +1 over
  each query's interval of visible tokens."""
  cover = np.zeros(num_tokens + 1, np.int64)
  q = np.asarray(queries, np.int64)
  lo = np.zeros_like(q) if window_left < 0 else np.maximum(q - window_left, 0)
  hi = np.minimum(q, num_tokens - 1) + 1
  keep = lo < hi
  np.add.at(cover, lo[keep], 1)
  np.add.at(cover, hi[keep], -1)
  return np.cumsum(cover)[:num_tokens] > 0


def brute_force_slots(window_left, num_layers, steps, page_size, scratch):
  """Slots of one group right after each step, from token visibility alone.

  At a step growing the sequence from `h` to `cap` tokens, a block is needed
  now if a query of the step (`h .. cap - 1`) sees one of its positions, and
  later if a future query (`cap ..`, far enough that nothing older can be
  seen) does; a future query sees its own position, so a partial last block,
  which future tokens fill, is always needed later. Held: old blocks (with a
  token `< h`) needed now or later, and new blocks needed later; new blocks
  needed only now are scratch: `num_layers` of them per slot, or one slot
  each without scratch reuse.
  """
  out = []
  for h, cap in steps:
    num_blocks = -(-cap // page_size)
    end = num_blocks * page_size
    now = _seen(np.arange(h, cap), window_left, end)
    horizon = end + max(window_left, 0) + 2 * page_size
    later = _seen(np.arange(cap, horizon), window_left, end)
    held = scratch_blocks = 0
    for b in range(num_blocks):
      pos = slice(b * page_size, (b + 1) * page_size)
      old = b * page_size < h
      if old:
        held += bool(now[pos].any() or later[pos].any())
      elif later[pos].any():
        held += 1
      elif scratch and window_left >= 0:
        scratch_blocks += 1
      else:
        held += 1
    out.append(held + -(-scratch_blocks // num_layers))
  return out


def _groups():
  return swa_planner.window_groups(WINDOWS)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scratch", [True, False])
def test_planner_matches_brute_force(mode, scratch):
  scenario = swa_planner.Scenario(PROMPT_LEN, MODES[mode], NUM_DECODE,
                                  PAGE_SIZE)
  steps = _steps(PROMPT_LEN, MODES[mode], NUM_DECODE)
  assert [s[:2] for s in swa_planner.run_steps(scenario)] == steps
  actual = swa_planner.plan_run(WINDOWS, scenario, scratch=scratch)
  for w, n in _groups().items():
    expected = brute_force_slots(w, n, steps, PAGE_SIZE, scratch)
    assert actual["group_steps"][w] == expected, (w, n)
  if scratch:
    # By hand. 1k chunks: 32 history blocks in the window of a chunk's first
    # query, 32 stale new blocks in 3 scratch slots of 15 layers, 32 new
    # blocks kept for later queries. One chunk: 224 stale blocks in 15
    # scratch slots + 32 kept.
    want = 32 + 3 + 32 if mode == "chunks_1k" else 15 + 32
    assert actual["group_peak_slots"][511] == want
    assert actual["group_peak_slots"][-1] == (PROMPT_LEN + NUM_DECODE) // 16


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    prompt_len=st.integers(1, 160), chunk_len=st.one_of(st.none(),
                                                        st.integers(1, 64)),
    num_decode=st.integers(0, 12), page_size=st.integers(1, 8),
    window_left=st.integers(-1, 40), num_layers=st.integers(1, 5),
    scratch=st.booleans())
def test_planner_matches_brute_force_random(prompt_len, chunk_len, num_decode,
                                            page_size, window_left,
                                            num_layers, scratch):
  scenario = swa_planner.Scenario(prompt_len, chunk_len, num_decode, page_size)
  steps = _steps(prompt_len, chunk_len, num_decode)
  actual = swa_planner.group_step_slots(window_left, num_layers, scenario,
                                        scratch=scratch)
  assert actual == brute_force_slots(window_left, num_layers, steps, page_size,
                                     scratch)


def _measure(config, chunk_len):
  """Runs the scenario through the public cache ops; `num_used` per group
  right after each step, `{window_left: [slots]}`."""
  steps = _steps(PROMPT_LEN, chunk_len, NUM_DECODE)
  seq = jnp.zeros((1,), jnp.int32)
  tokens = jax.random.randint(jax.random.key(np.random.randint(1 << 30)),
                              (1, PROMPT_LEN), 0, 32000, jnp.int32)
  state = cache.init_cache(config)
  used = []
  for i, (h, cap) in enumerate(steps):
    if i == 0:
      state, res = cache.claim_batch(state, seq, tokens, jnp.array([cap]))
    else:
      state, res = cache.extend(state, seq, jnp.array([cap - h]),
                                num_computed=jnp.array([h]))
    assert bool(res.ok[0]), (h, cap)
    used.append(np.asarray(cache.stats(state)["num_used"]).tolist())
  cache.validate(state)
  return {g.window_left: [u[gid] for u in used]
          for gid, g in enumerate(config.groups)}


@pytest.fixture(scope="module")
def config():
  max_pages = -(-(PROMPT_LEN + NUM_DECODE) // PAGE_SIZE)
  return cache.HybridCacheConfig(WINDOWS, (max_pages + 16,) * 2,
                                 page_size=PAGE_SIZE, max_seqs=1,
                                 max_pages=max_pages,
                                 enable_swa_scratch_reuse=True)


@pytest.mark.parametrize("mode", MODES)
def test_planner_matches_cache(config, mode):
  actual = _measure(config, MODES[mode])
  scenario = swa_planner.Scenario(PROMPT_LEN, MODES[mode], NUM_DECODE,
                                  PAGE_SIZE)
  steps = _steps(PROMPT_LEN, MODES[mode], NUM_DECODE)
  planned = swa_planner.plan_run(WINDOWS, scenario, scratch=True)
  for w, n in _groups().items():
    expected = brute_force_slots(w, n, steps, PAGE_SIZE, scratch=True)
    assert actual[w] == expected, w
    assert planned["group_steps"][w] == expected, w
