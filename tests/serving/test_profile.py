"""`pkvattn.serving.profile`: which programs `Engine.profile` times, on
which state, and how it combines the times.

The times come from a scripted clock (each timed call lasts what the test
says), so the arithmetic of the split is checked exactly; that profiling
runs on a real engine and leaves its state alone is
`test_engine.test_profile_reports_split`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.serving import profile as prof_lib

CFG = EngineConfig(page_size=8, num_slots=40, max_seqs=4, max_num_tokens=32,
                   max_model_len=64, impl="xla")
PROMPT = [256, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def step_engine(model):
  engine = Engine(model, CFG)
  engine.add_request(PROMPT, SamplingParams(max_new_tokens=3))
  engine.step()
  engine.step()
  return engine


@pytest.fixture(scope="module")
def burst_engine(model):
  engine = Engine(model, dataclasses.replace(CFG, decode_steps=2))
  engine.add_request(PROMPT, SamplingParams(max_new_tokens=6))
  for _ in range(3):  # admit, prefill, first decode step
    engine.step()
  assert engine._burst_eligible()
  return engine


def _lens(state):
  return np.asarray(state.seq_lens)


def test_a_burst_model_runs_on_the_state_its_reservation_leaves(
    burst_engine):
  prog = prof_lib.profile_programs(burst_engine)
  assert prog["per"] == 2
  cache_out = prog["cache_ops"](*prog["cache_ops_args"]())
  reserved = _lens(cache_out[1])
  current = _lens(burst_engine.state)
  assert (reserved >= current).all() and (reserved > current).any()
  np.testing.assert_array_equal(_lens(prog["model_args"]()[2]), reserved)
  np.testing.assert_array_equal(_lens(prog["step_args"]()[2]), current)


def test_a_step_model_runs_on_the_engine_state(step_engine):
  prog = prof_lib.profile_programs(step_engine)
  assert prog["per"] == 1
  for make in (prog["model_args"], prog["step_args"]):
    jax.tree.map(np.testing.assert_array_equal,
                 jax.tree.map(np.asarray, make()[2]),
                 jax.tree.map(np.asarray, step_engine.state))


class _Clock:
  """`time` for the profile module: each timed call lasts the next of
  `durations_ms` (two readings per call: its start and its end)."""

  def __init__(self, durations_ms):
    self.durations = list(durations_ms)
    self.now, self.started = 0.0, False

  def perf_counter(self):
    if self.started:
      self.now += self.durations.pop(0) / 1e3
    self.started = not self.started
    return self.now


@pytest.mark.parametrize("which", ["step", "burst"])
@pytest.mark.parametrize("step,bare,floor,ops,attention", [
    (5.0, 3.0, 1.0, 2.5, 4.0),
    # The model program alone slower than the step, the cache program
    # faster than a trivial call: both differences count as 0.
    (3.0, 5.0, 2.0, 1.0, 1.0),
])
def test_the_split(monkeypatch, step_engine, burst_engine, which, step, bare,
                   floor, ops, attention):
  engine = step_engine if which == "step" else burst_engine
  per = 2 if which == "burst" else 1
  # Timed in this order, one call each: the step, the model program, the
  # trivial call, the cache program, the attention.
  clock = _Clock([step, bare, floor, ops, attention])
  monkeypatch.setattr(prof_lib, "time", clock)
  got = prof_lib.profile(engine, iters=1)
  assert not clock.durations
  want = dict(step_ms=step / per,
              bookkeeping_ms=max(step - bare, 0.0) / per,
              bookkeeping_in_jit_ms=max(ops - floor, 0.0) / per,
              attention_ms=attention)
  want["rest_ms"] = want["step_ms"] - attention - want["bookkeeping_ms"]
  assert got == pytest.approx(want)
