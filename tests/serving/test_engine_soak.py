"""A long run of one engine: thousands of requests, valid and invalid mixed,
over many `generate` / `add_request` + `step` calls.

Every valid greedy request must produce the tokens its prompt gets alone (an
oracle run of each prompt alone, cut at its length / stop ids), every invalid
one is refused at submission with a ValueError and changes nothing, a request
that fails inside a step fails alone, the request table stays bounded, and at
the end every row and slot is free again.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pkvattn import cache
from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.models import load_model

HISTORY = 8
CFG = EngineConfig(page_size=8, num_slots=24, max_seqs=3, max_num_tokens=16,
                   max_model_len=40, decode_steps=2, impl="xla",
                   finished_history=HISTORY)
MAX_NEW = 6
NUM_PROMPTS = 10
NUM_REQUESTS = 2000  # per example
I32 = 2**31


@pytest.fixture(scope="module")
def engine():
  return Engine(load_model("tiny-llama"), CFG)


@pytest.fixture(scope="module")
def prompts(engine):
  rng = np.random.default_rng(0)
  vocab = engine.model.cfg.vocab_size
  base = rng.integers(0, vocab, size=12).tolist()
  # Shared prefixes (prefix-cache hits) and distinct prompts, 3 to 20 tokens.
  out = [base[:3 + i] for i in range(4)]
  out += [rng.integers(0, vocab, size=int(n)).tolist()
          for n in rng.integers(3, 21, size=NUM_PROMPTS - 4)]
  return out


@pytest.fixture(scope="module")
def oracle(engine, prompts):
  """Greedy tokens of each prompt run alone on the idle engine."""
  sp = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
  return [engine.generate([p], sp)[0] for p in prompts]


def _expected(full, max_new, stop):
  """`full` (greedy, alone) cut at `max_new` tokens and after the first stop
  id of `stop` (None: no stop)."""
  out = []
  for t in full[:max_new]:
    out.append(t)
    if stop is not None and t in stop:
      break
  return out


# Each field: (valid values, invalid values). The test knows which is which.
FIELDS = {
    "max_new_tokens": ([1, 3, MAX_NEW], [0, -1, I32, 2**40, 2.0, True]),
    "top_k": ([0, 1, 5, I32 - 1], [-1, I32, 2**63, 1.5]),
    "seed": ([0, 7, 2**32 - 1, -I32, 2**40, -2**40], ["1", 1.5, True]),
    "temperature": ([0.0], [math.nan, math.inf, -1.0, 1e39]),
    "top_p": ([1.0, 0.5], [0.0, 1.5, math.nan]),
    "stop_token_ids": ([None, ()], [(I32,), (-1,), (2**40,), (10**6,), "ab"]),
    "reuse_scope": ([0, 3, I32 - 1, -I32], [I32, -I32 - 1, 1.5]),
}


def request_spec(rng, bad_rate):
  """(prompt index or an invalid prompt's name, SamplingParams kwargs,
  reuse_scope, valid), drawn with `rng`; each field is invalid with
  probability `bad_rate`."""
  kwargs, valid = {}, True
  for name, (good, bad) in FIELDS.items():
    if rng.random() < bad_rate:
      kwargs[name] = bad[rng.integers(len(bad))]
      valid = False
    else:
      kwargs[name] = good[rng.integers(len(good))]
  kwargs["ignore_eos"] = bool(rng.integers(2))
  prompt = int(rng.integers(NUM_PROMPTS))
  if rng.random() < bad_rate:
    prompt = ["empty", "negative", "vocab", "int64"][rng.integers(4)]
    valid = False
  if kwargs["stop_token_ids"] == () and rng.integers(2):
    kwargs["stop_token_ids"] = "stop-in-oracle"  # filled from the oracle
  scope = kwargs.pop("reuse_scope")
  return prompt, kwargs, scope, valid


def _build(spec, prompts, oracle, vocab):
  """(prompt, SamplingParams or the ValueError building it raised, scope,
  expected tokens or None, whether the spec is valid)."""
  idx, kwargs, scope, _ = spec
  kwargs = dict(kwargs)
  if isinstance(idx, str):
    prompt = {"empty": [], "negative": [1, -1, 2], "vocab": [1, vocab],
              "int64": [1, 2**40]}[idx]
  else:
    prompt = prompts[idx]
  if kwargs["stop_token_ids"] == "stop-in-oracle":
    kwargs["stop_token_ids"] = (oracle[idx if isinstance(idx, int) else 0][1],)
  try:
    params = SamplingParams(**kwargs)
  except ValueError as e:
    params = e
  expected = None
  if isinstance(idx, int) and not isinstance(params, ValueError):
    stop = (None if kwargs["ignore_eos"] else
            set(kwargs["stop_token_ids"]) if kwargs["stop_token_ids"]
            is not None else set(CFG_EOS))
    expected = _expected(oracle[idx], kwargs["max_new_tokens"], stop)
  return prompt, params, scope, expected, spec[3]


CFG_EOS: tuple[int, ...] = ()


def _check_bounded(engine):
  unfinished = len(engine.scheduler.waiting) + len(engine.scheduler.running)
  assert len(engine._requests) <= unfinished + HISTORY


@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), bad_rate=st.sampled_from([0.01, 0.05]))
def test_soak(engine, prompts, oracle, seed, bad_rate):
  # Hypothesis picks the workload's seed and how often a field is invalid;
  # the requests (thousands per test) are drawn from them with numpy, which
  # keeps each example's data small for hypothesis.
  rng = np.random.default_rng(seed)
  specs = [request_spec(rng, bad_rate) for _ in range(NUM_REQUESTS)]
  global CFG_EOS
  CFG_EOS = tuple(engine.model.cfg.eos_token_ids)
  vocab = engine.model.cfg.vocab_size
  S = CFG.max_seqs
  built = [_build(s, prompts, oracle, vocab) for s in specs]
  i = checked = 0
  while i < len(built):
    n = int(rng.integers(1, 9))
    batch, i = built[i:i + n], i + n
    mode = ["generate", "add_request"][rng.integers(2)]
    before = len(engine._requests)
    good = []
    for prompt, params, scope, expected, valid in batch:
      if valid:
        assert not isinstance(params, ValueError), params
        good.append((prompt, params, scope, expected))
        continue
      with pytest.raises(ValueError, match="Invalid"):  # refused alone
        if isinstance(params, ValueError):
          raise params
        engine.add_request(prompt, params, reuse_scope=scope)
      assert len(engine._requests) == before
      if (good and isinstance(params, SamplingParams)
          and scope in FIELDS["reuse_scope"][0]):
        # A bad prompt in a batch refuses the whole batch, queuing nothing.
        with pytest.raises(ValueError, match=r"prompts\[1\]"):
          engine.generate([good[0][0], prompt], [good[0][1], params])
        assert len(engine._requests) == before
    if mode == "generate" and good:
      outs = engine.generate([g[0] for g in good], [g[1] for g in good])
      assert outs == [g[3] for g in good]
      checked += len(good)
    elif good:
      ids = [(engine.add_request(p, sp, reuse_scope=scope), expected)
             for p, sp, scope, expected in good]
      got = {}
      while engine.has_unfinished():
        engine.step()
        for rid, _ in ids:  # read each as it finishes (history is bounded)
          if rid not in got and engine.get_request(rid).done:
            req = engine.get_request(rid)
            assert req.finish_reason in ("stop", "length"), req.error
            got[rid] = list(req.output)
      assert got == dict(ids)
      checked += len(ids)
    _check_bounded(engine)
  assert checked >= NUM_REQUESTS // 2  # most requests ran and were compared
  # Rows released by the last step are released by the next program.
  while engine.scheduler.has_work():
    engine.step()
  assert engine.scheduler.free_rows == list(range(S))
  assert not engine.scheduler.waiting and not engine.scheduler.running
  assert int(cache.stats(engine.state)["num_used"]) == 0
  _check_bounded(engine)


@pytest.mark.parametrize("bad", [0, 1])  # the failing request's row
def test_a_request_failing_in_a_step_fails_alone(engine, prompts, oracle,
                                                 bad, exploding_params):
  sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
  ids = [engine.add_request(p, sp) for p in prompts[:4]]
  engine.get_request(ids[bad]).params = exploding_params(4)
  engine.get_request(ids[2]).prompt = [1, 2**40]  # fails its admission
  reqs = [engine.get_request(i) for i in ids]
  while engine.has_unfinished():
    engine.step()
  for k in (bad, 2):
    assert reqs[k].finish_reason == "error"
    assert reqs[k].error
  assert "boom" in reqs[bad].error
  for k in {0, 1, 3} - {bad}:
    assert reqs[k].output == oracle[k][:4], k
  while engine.scheduler.has_work():
    engine.step()
  assert engine.scheduler.free_rows == list(range(CFG.max_seqs))
  assert int(cache.stats(engine.state)["num_used"]) == 0
  # The engine serves the next requests as before.
  assert engine.generate([prompts[5]], sp) == [oracle[5][:4]]


def test_dropped_requests_raise_a_clear_key_error(engine, prompts):
  sp = SamplingParams(max_new_tokens=1)
  engine.generate([prompts[0]], sp)
  last = engine._next_id - 1
  with pytest.raises(KeyError, match="dropped"):
    engine.get_request(last)
  with pytest.raises(KeyError, match="Unknown request_id"):
    engine.get_request(10**9)
