"""The engine loop's bookkeeping at its edges (CPU, xla path, f32): a step
with nothing to do, the step counter, profiling while a burst is in flight
and the host tier's release-first program only where a plan needs it."""

from __future__ import annotations

import dataclasses

import pytest

from pkvattn import cache
from pkvattn.engine import Engine, EngineConfig, SamplingParams

CFG = EngineConfig(page_size=8, num_slots=40, max_seqs=4, max_num_tokens=32,
                   max_model_len=64)


def _prompts(rng, n):
  return [[256] + rng.integers(0, 256, int(rng.integers(3, 20))).tolist()
          for _ in range(n)]


def test_a_step_with_nothing_to_do_books_nothing(model):
  # A fresh engine: no step has run (no inputs or program to profile), and
  # stepping it runs no program and counts no step.
  engine = Engine(model, CFG)
  assert engine.last_inputs is None and engine.last_program is None
  with pytest.raises(ValueError, match="needs at least one step"):
    engine.profile(iters=1)
  assert not engine.has_unfinished()
  assert engine.step() == 0
  assert engine.stats.num_steps == 0 and engine.last_program is None
  assert engine.generate([]) == []


def test_generate_drops_the_requests_it_returns(model, rng):
  # Requests returned by `generate` leave the engine; one queued by
  # `add_request` beside them stays until it is dropped from the history.
  engine = Engine(model, CFG)
  sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
  kept = engine.add_request(_prompts(rng, 1)[0], sp)
  outs = engine.generate(_prompts(rng, 2), sp)
  assert [len(o) for o in outs] == [3, 3]
  assert len(engine.get_request(kept).output) == 3
  for rid in (1, 2):
    with pytest.raises(KeyError, match=f"Request {rid} finished and was "
                       "dropped"):
      engine.get_request(rid)


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_num_steps_counts_each_step_and_each_burst_iteration(model, rng,
                                                             decode_steps):
  # `stats.num_steps` grows by one per step program and by `decode_steps`
  # per burst, whatever else the call does (drain a burst, admit).
  engine = Engine(model, dataclasses.replace(CFG, decode_steps=decode_steps))
  for p in _prompts(rng, 3):
    engine.add_request(p, SamplingParams(
        max_new_tokens=int(rng.integers(2, 12)), ignore_eos=True))
  run, kinds = engine._run, []  # noqa: SLF001

  def spy(scheduled):
    kinds.append(scheduled.kind)
    return run(scheduled)
  engine._run = spy  # noqa: SLF001
  while engine.has_unfinished():
    before, kinds[:] = engine.stats.num_steps, []
    engine.step()
    assert engine.stats.num_steps - before == sum(
        decode_steps if k == "burst" else 1 for k in kinds), kinds
  assert engine.stats.num_steps > 0


def test_profile_reads_the_burst_in_flight_first(model, rng):
  # Profiling between chained bursts books the burst in flight and leaves
  # the requests to finish with the tokens of an engine never profiled.
  cfg = dataclasses.replace(CFG, decode_steps=2)
  prompts = _prompts(rng, 2)
  sp = SamplingParams(max_new_tokens=9, ignore_eos=True)
  expected = Engine(model, cfg).generate(prompts, sp)
  engine = Engine(model, cfg)
  ids = [engine.add_request(p, sp) for p in prompts]
  while engine._inflight is None:  # noqa: SLF001
    engine.step()
  booked = sum(len(engine.get_request(i).output) for i in ids)
  prof = engine.profile(iters=1)
  assert prof["step_ms"] > 0
  assert engine._inflight is None  # noqa: SLF001
  assert sum(len(engine.get_request(i).output) for i in ids) > booked
  while engine.has_unfinished():
    engine.step()
  assert [engine.get_request(i).output for i in ids] == expected
  cache.validate(engine.state)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_rows_are_released_first_only_for_a_plan(model, rng, decode_steps):
  # With a host tier but a pool that never fills, no step or burst plans a
  # copy to the host, so finished rows are released by the program that
  # runs next, never by a program of their own.
  cfg = dataclasses.replace(CFG, decode_steps=decode_steps,
                            host_kv_cache_bytes=1 << 20)
  engine = Engine(model, cfg)
  released_first = []
  release_first = engine._release_first  # noqa: SLF001

  def spy(scheduled, released):
    released_first.append(scheduled.kind)
    return release_first(scheduled, released)
  engine._release_first = spy  # noqa: SLF001
  take, taken = engine.scheduler.take_released_rows, []

  def take_spy():
    rows = take()
    taken.append(len(rows))
    return rows
  engine.scheduler.take_released_rows = take_spy
  # Prefilled in one step, then finishing one after the other: steps or
  # unchained bursts take the rows finished before them.
  prompts = [[256] + rng.integers(0, 256, 6).tolist() for _ in range(4)]
  params = [SamplingParams(max_new_tokens=n, ignore_eos=True)
            for n in (2, 5, 9, 13)]
  outs = engine.generate(prompts, params)
  assert [len(o) for o in outs] == [2, 5, 9, 13]
  assert sum(taken) > 0 and released_first == []
  assert engine.stats.num_steps > 0


def test_pool_dtype_overrides_the_config(model):
  # `pool_dtype` wins over the page dtype the config and model imply.
  import jax.numpy as jnp  # noqa: PLC0415
  assert Engine(model, CFG).pool.dtype == jnp.float32
  engine = Engine(model, CFG, pool_dtype=jnp.bfloat16)
  assert engine.pool.dtype == jnp.bfloat16


def test_checked_burst_reports_a_violation_of_its_model_program(model):
  # A burst runs `reserve` then its model program: a slot id out of the pool
  # in a running row's table (which `reserve` does not read) is a violation
  # of the second program, and the burst raises it after booking.
  from jax.experimental import checkify  # noqa: PLC0415
  cfg = dataclasses.replace(CFG, decode_steps=2, check=True)
  engine = Engine(model, cfg)
  engine.add_request([256] + list(range(1, 10)), SamplingParams(
      max_new_tokens=8, ignore_eos=True))
  while not engine._burst_eligible():  # noqa: SLF001
    engine.step()
  (req,) = engine.scheduler.running
  engine.state = dataclasses.replace(
      engine.state, seq_slots=engine.state.seq_slots.at[req.seq_id, 0].set(
          cfg.num_slots + 3))
  with pytest.raises(checkify.JaxRuntimeError, match="page_table"):
    engine.step()


def test_a_burst_that_does_not_run_keeps_its_rows_to_release(model, rng):
  # The first burst that would release a finished row raises before it runs
  # (as a launch error would): the row stays to be released, not free, and
  # the other request still completes as without the failure, every row and
  # slot free at the end.
  cfg = dataclasses.replace(CFG, decode_steps=2, max_seqs=2)
  prompts = _prompts(rng, 2)
  params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 12)]
  expected = Engine(model, cfg).generate(prompts, params)
  engine = Engine(model, cfg)
  ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
  sched, run, failed = engine.scheduler, engine._run, []  # noqa: SLF001

  def flaky(scheduled):
    if scheduled.kind == "burst" and sched.burst_taken and not failed:
      failed.append(list(sched.burst_taken))
      raise RuntimeError("launch failed")
    return run(scheduled)
  engine._run = flaky  # noqa: SLF001
  for _ in range(100):  # bounded: a lost row would stall the loop
    if not engine.has_unfinished():
      break
    try:
      engine.step()
    except RuntimeError:
      (taken,) = failed
      assert sched.to_release[:len(taken)] == taken
      assert not {row for row, _ in taken} & set(sched.free_rows)
  assert failed
  assert [engine.get_request(i).output for i in ids] == expected
  engine.step()  # releases the last finished row
  assert sched.free_rows == list(range(cfg.max_seqs))
  cache.validate(engine.state)
  assert int(cache.stats(engine.state)["num_used"]) == 0


def test_add_request_shares_generates_default_scope(model, rng):
  # Without a `reuse_scope`, a request reuses the blocks of `generate`'s
  # (which take none): both are in the default scope 0.
  engine = Engine(model, CFG)
  prompt = [256] + rng.integers(0, 256, 20).tolist()  # 2 full pages of 8
  sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
  (out,) = engine.generate([prompt], sp)
  for scope in ({}, {"reuse_scope": 0}):
    req = engine.get_request(engine.add_request(prompt, sp, **scope))
    while engine.has_unfinished():
      engine.step()
    assert req.num_reused == 16 and req.output == out


def test_peak_used_slots_counts_what_bursts_grow_into(model, rng):
  # Decoding in bursts, a row grows past the slots its prefill used: the
  # peak counts the slots of every token fed.
  cfg = dataclasses.replace(CFG, decode_steps=4)
  engine = Engine(model, cfg)
  prompt = [256] + rng.integers(0, 256, int(rng.integers(4, 9))).tolist()
  new = 30
  engine.generate([prompt], SamplingParams(max_new_tokens=new,
                                           ignore_eos=True))
  fed = len(prompt) + new - 1  # the last token is sampled, never fed
  assert -(-fed // 8) <= engine.stats.peak_used_slots <= cfg.num_slots
