"""The engine never refuses work that fits, loses nothing, and rejects bad
input before queuing anything."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pkvattn import cache
from pkvattn.engine import Engine, EngineConfig, SamplingParams

# One config for every example (its programs compile once per process): a
# pool of 6 slots of 8 tokens for 3 rows of up to 40 tokens, so claims are
# refused, decodes preempted and cached blocks evicted.
CFG = EngineConfig(page_size=8, num_slots=6, max_seqs=3, max_num_tokens=16,
                   max_model_len=40, decode_steps=2, check=True)


def test_two_cached_requests_that_each_fit_both_complete(model):
  # Both requests are preempted, their blocks committed (4 cached, 0 free)
  # and both re-claimed in one batch: each must still complete, as alone.
  p = np.random.default_rng(0).integers(0, 256, 30).tolist()
  cfg = EngineConfig(page_size=8, num_slots=4, max_seqs=2, max_num_tokens=64,
                     max_model_len=64)
  sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
  prompts = [p[:16], p[14:30]]
  outs = Engine(model, cfg).generate(prompts, sp)
  alone = [Engine(model, cfg).generate([q], sp)[0] for q in prompts]
  assert outs == alone and [len(o) for o in outs] == [16, 16]


@st.composite
def workloads(draw):
  base = draw(st.lists(st.integers(1, 255), min_size=24, max_size=24))
  n = draw(st.integers(1, 5))
  reqs = []
  for _ in range(n):
    start = draw(st.sampled_from([0, 0, 4, 8]))  # shared prefixes
    length = draw(st.integers(1, 20))
    prompt = base[start:start + length]
    tail = draw(st.lists(st.integers(1, 255), max_size=4))
    prompt = (prompt + tail)[:24] or [1]
    room = CFG.num_slots * CFG.page_size - len(prompt)  # fits alone
    new = draw(st.integers(1, min(12, room, CFG.max_model_len - len(prompt))))
    reqs.append((prompt, new))
  return reqs


# Each example runs the engine twice (batched, then each request alone);
# PKV_ENGINE_EXAMPLES raises the count for a deeper run.
@settings(max_examples=int(os.environ.get("PKV_ENGINE_EXAMPLES", "8")),
          deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(reqs=workloads(), check=st.booleans(), data=st.data())
def test_every_request_that_fits_alone_completes_as_alone(model, reqs, check,
                                                          data):
  # Greedy and seeded sampled requests, some ending at a stop token of their
  # own output: batched (unchecked, bursts are chained: one in flight while
  # the next runs), each must give what it gives alone.
  cfg = dataclasses.replace(CFG, check=check)
  alone = Engine(model, cfg)
  sps, expected = [], []
  for prompt, new in reqs:
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True,
                        temperature=data.draw(st.sampled_from([0.0, 0.0, 0.9])),
                        seed=data.draw(st.integers(0, 9)))
    out = alone.generate([prompt], sp)[0]
    assert len(out) == new
    if data.draw(st.booleans()):
      stop = out[data.draw(st.integers(0, new - 1))]
      sp = dataclasses.replace(sp, ignore_eos=False, stop_token_ids=(stop,))
      out = out[:out.index(stop) + 1]
    sps.append(sp)
    expected.append(out)
  engine = Engine(model, cfg)
  outs = engine.generate([p for p, _ in reqs], sps)
  assert outs == expected
  assert not engine.has_unfinished()
  cache.validate(engine.state)


def test_bad_input_queues_nothing(model):
  engine = Engine(model, CFG)
  sp = SamplingParams(max_new_tokens=2)
  with pytest.raises(ValueError, match="params: expected one SamplingParams "
                     r"per prompt \(2\), got 1"):
    engine.generate([[1, 2], [3, 4]], [sp])
  with pytest.raises(ValueError, match=r"prompts\[1\]: Invalid prompt: "
                     "token ids must be in"):
    engine.generate([[1, 2], [1, 10**6]], sp)
  with pytest.raises(ValueError, match="expected a sequence of token ids, "
                     "got str"):
    engine.generate(["hello"], sp)
  with pytest.raises(ValueError, match="expected a list of token-id"):
    engine.generate("hello", sp)
  with pytest.raises(ValueError, match="1-D sequence of int"):
    engine.add_request([1.5, 2.0], sp)
  assert not engine.has_unfinished()
  # The engine still serves afterwards, and only what it was given.
  assert [len(o) for o in engine.generate([[1, 2, 3]], sp)] == [2]
  assert not engine.has_unfinished()


def test_engine_config_is_checked_when_built():
  with pytest.raises(ValueError, match="page_size: expected a power of two, "
                     "got 12"):
    EngineConfig(page_size=12)
  with pytest.raises(ValueError, match="max_seqs: expected a positive int"):
    EngineConfig(max_seqs=2.5)
  with pytest.raises(ValueError, match="max_admit"):
    EngineConfig(max_admit=0)


def test_ignore_eos_finishes_on_length_even_at_a_stop_id(model):
  engine = Engine(model, CFG)
  prompt = [256, 5, 6, 7]
  first = engine.generate([prompt], SamplingParams(max_new_tokens=1))[0][0]
  rid = engine.add_request(prompt, SamplingParams(
      max_new_tokens=1, ignore_eos=True, stop_token_ids=(first,)))
  while engine.has_unfinished():
    engine.step()
  req = engine.get_request(rid)
  assert req.output == [first] and req.finish_reason == "length"
  rid = engine.add_request(prompt, SamplingParams(
      max_new_tokens=3, stop_token_ids=(first,)))
  while engine.has_unfinished():
    engine.step()
  assert engine.get_request(rid).finish_reason == "stop"


def test_checked_engine_reports_a_corrupted_page_table(model):
  # A slot id out of the pool in a running sequence's table: unchecked, the
  # attention would read another page; checked, the step raises and names it.
  from jax.experimental import checkify
  engine = Engine(model, CFG)
  engine.add_request([256, 1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(
      max_new_tokens=4, ignore_eos=True))
  engine.step()  # admitted: its blocks are claimed
  engine.state = dataclasses.replace(
      engine.state,
      seq_slots=engine.state.seq_slots.at[0, 0].set(CFG.num_slots + 3))
  with pytest.raises(checkify.JaxRuntimeError, match="page_table"):
    engine.step()


@pytest.mark.parametrize("decode_steps", [1, 2])
def test_a_program_that_raises_loses_no_request(model, monkeypatch,
                                                decode_steps, rng):
  """Every other program call raises before it runs (as a launch or compile
  error would): each such step or burst is undone (`Scheduler.unschedule`:
  its admissions back at the queue's front, the rows it took to release
  released by a later program), so every request still completes with the
  tokens it gets alone, and every row and slot is free at the end."""
  cfg = EngineConfig(page_size=8, num_slots=12, max_seqs=2, max_num_tokens=16,
                     max_model_len=40, decode_steps=decode_steps)
  prompts = [rng.integers(1, 256, int(n)).tolist() for n in (5, 11, 3, 7)]
  sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
  alone = [Engine(model, cfg).generate([p], sp)[0] for p in prompts]
  engine = Engine(model, cfg)
  ids = [engine.add_request(p, sp) for p in prompts]
  run, calls = engine._run, [0]

  def flaky(*args, **kwargs):
    calls[0] += 1
    if calls[0] % 2:
      raise RuntimeError("launch failed")
    return run(*args, **kwargs)
  monkeypatch.setattr(engine, "_run", flaky)
  with pytest.raises(RuntimeError, match="launch failed"):
    engine.step()  # admits the first two, then fails: queued as before
  assert [r.request_id for r in engine.scheduler.waiting] == ids
  assert engine.scheduler.free_rows == list(range(cfg.max_seqs))
  failed = 1
  for _ in range(200):  # bounded: a lost row would stall the queue
    if not engine.has_unfinished():
      break
    try:
      engine.step()
    except RuntimeError:
      failed += 1
  assert not engine.has_unfinished()
  assert failed == (calls[0] + 1) // 2 > 4
  assert [engine.get_request(i).output for i in ids] == alone
  monkeypatch.undo()
  for _ in range(10):
    if engine.scheduler.has_work():
      engine.step()
  assert engine.scheduler.free_rows == list(range(cfg.max_seqs))
  assert not engine.scheduler.to_release
  assert int(cache.stats(engine.state)["num_used"]) == 0


def test_generate_warns_of_each_request_that_failed(model, exploding_params):
  """A request finished with "error" (here: its sampling fields raise while
  a step's inputs are prepared, as a bug would) comes back from `generate`
  with the tokens it had, named in a RuntimeWarning; the others complete."""
  engine = Engine(model, EngineConfig(page_size=8, num_slots=40, max_seqs=4,
                                      max_num_tokens=32, max_model_len=64))

  def progress(_):
    for req in engine.scheduler.running:
      if req.request_id == 1:
        req.params = exploding_params(8)

  sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
  with pytest.warns(RuntimeWarning) as caught:
    out = engine.generate([[256, 1, 2], [256, 3, 4, 5], [256, 6]], sp,
                          progress=progress)
  # (On a GPU jax 0.11 also warns of the Pallas-Triton deprecation.)
  assert [str(w.message) for w in caught
          if w.category is RuntimeWarning] == [
      "prompts[1] (request 1) failed: RuntimeError: boom"]
  assert [len(o) for o in out[::2]] == [8, 8] and len(out[1]) < 8
