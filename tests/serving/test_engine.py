"""Engine behaviour on the built-in tiny model (CPU, xla path, f32).

Parity with transformers lives in test_models_hf.py; here: a full pool
(requests wait / are preempted and recomputed, outputs unchanged), stop tokens,
seeded sampling independent of batch composition, one compile for all steps,
donation of the pool, the split of step time into prefill, decode and host
time (a scripted clock) (the sampler itself: tests/test_sampling.py).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pkvattn import cache
from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.models import load_model

# One engine config shared by most tests, so the step compiles once per module.
CFG = EngineConfig(page_size=8, num_slots=40, max_seqs=4, max_num_tokens=32,
                   max_model_len=64)
# 8 slots x 8 tokens: the requests of `_prompts()` (up to 20 + 16 tokens = 5
# slots each) cannot all run at once.
SMALL_POOL = EngineConfig(page_size=8, num_slots=8, max_seqs=4,
                          max_num_tokens=32, max_model_len=128,
                          token_buckets=(32,))


def _prompts(n=6, seed=0):
  rng = np.random.default_rng(seed)
  shared = rng.integers(0, 256, 12).tolist()
  return [([256] + shared if i % 2 else [256]) + rng.integers(
      0, 256, int(rng.integers(1, 20))).tolist() for i in range(n)]


def test_greedy_batching_full_pool_and_stop_tokens(model):
  # (One test, so the reference run is made once under pytest -n 2.)
  prompts = _prompts()
  sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
  engine = Engine(model, CFG)
  expected = engine.generate(prompts, sp)
  # Programs come from the engine's bounded list only (decode-only steps at
  # the 4-token bucket, the others at 32, the first admissions at 0), each
  # compiled once.
  assert CFG.buckets == (4, 32)
  compiled = set(engine.compile_times)
  assert compiled <= set(engine.programs())
  assert {k.num_tokens for k in compiled if k.kind == "step"} == {0, 4, 32}
  assert engine.stats.num_compiles == len(compiled)
  # Compiled on first use: the compile time is its own, not the steps'.
  st = engine.stats
  assert min(st.compile_time_s, st.prefill_time_s, st.decode_time_s,
             st.host_time_s) > 0
  assert sum(engine.compile_times.values()) == pytest.approx(
      st.compile_time_s)
  assert not st.kv_scales_calibrated   # no FP8 scales on f32 pages
  cache.validate(engine.state)
  assert [len(o) for o in expected] == [16] * len(prompts)
  st = engine.stats
  assert st.generated_tokens == 16 * len(prompts)
  assert st.prefill_tokens + st.reused_tokens == sum(map(len, prompts))
  assert st.reused_tokens > 0  # later odd prompts reuse the shared 12+1 tokens
  assert 0 < st.peak_used_slots <= CFG.num_slots
  assert not engine.has_unfinished()

  # A full pool: claims are refused and decodes preempted (recomputed later
  # from prompt + output, partly from the prefix cache); outputs must not
  # change, and no slot may be shared by mistake.
  small = Engine(model, SMALL_POOL)
  assert small.generate(prompts, sp) == expected
  assert small.stats.num_preemptions > 0 and small.stats.num_refused_claims > 0
  assert small.stats.peak_used_slots <= SMALL_POOL.num_slots
  cache.validate(small.state)

  # Multi-step decode (bursts of 4 on device) under the same full pool.
  burst = Engine(model, dataclasses.replace(SMALL_POOL, decode_steps=4))
  assert burst.generate(prompts, sp) == expected
  assert burst.stats.num_preemptions > 0
  cache.validate(burst.state)

  # A stop token ends the request at its first occurrence (kept in output),
  # in single steps and in bursts.
  stop = expected[0][3]
  first = expected[0].index(stop)
  rid = small.add_request(prompts[0], SamplingParams(max_new_tokens=16,
                                                     stop_token_ids=(stop,)))
  while small.has_unfinished():
    small.step()
  rid2 = burst.add_request(prompts[0], SamplingParams(max_new_tokens=16,
                                                      stop_token_ids=(stop,)))
  while burst.has_unfinished():
    burst.step()
  for req in (small.get_request(rid), burst.get_request(rid2)):
    assert req.output == expected[0][:first + 1]
    assert req.finish_reason == "stop"


def _queued_in_bursts(model, cfg, prompts, lengths):
  """`(outputs of one-step decoding with cfg, an engine decoding in bursts
  of 4 with the same requests queued, their SamplingParams)`."""
  params = [SamplingParams(max_new_tokens=n, ignore_eos=True)
            for n in lengths]
  single = Engine(model, cfg).generate(prompts, params)
  engine = Engine(model, dataclasses.replace(cfg, decode_steps=4))
  for p, sp in zip(prompts, params):
    engine.add_request(p, sp)
  return single, engine, params


def test_bursts_release_finished_rows(model):
  # Requests finishing one after the other: each burst releases the rows
  # that finished in the one before it, so decoding stays in bursts (no
  # single step per finish; bursts chained on the device's end state) and
  # every slot is free at the end, with the tokens of one-step decoding and
  # finished prompts still published.
  prompts = _prompts(4, seed=3)
  single, engine, params = _queued_in_bursts(model, CFG, prompts,
                                             (3, 6, 9, 13))
  kinds, chained = [], 0
  while engine.has_unfinished():
    engine.step()
    kinds.append(engine.last_program.kind)
    chained += engine._inflight is not None  # read in the next call
  outs = [engine.get_request(i).output for i in range(len(prompts))]
  assert outs == single and chained > 0
  first = kinds.index("burst")
  assert kinds[first:] == ["burst"] * (len(kinds) - first), kinds
  engine.step()  # releases the last finished row
  cache.validate(engine.state)
  assert int(cache.stats(engine.state)["num_used"]) == 0
  # Their blocks were published: the same prompt again reuses them, and
  # a next turn after an answer fed in bursts reuses every full block of
  # prompt and answer (the third prompt's: 14 + 9 tokens, its second block
  # ends with two answer tokens; it shares no block with another prompt).
  rid = engine.add_request(prompts[0], params[0])
  turn = engine.add_request(prompts[2] + outs[2] + [7], params[0])
  while engine.has_unfinished():
    engine.step()
  assert engine.get_request(rid).num_reused > 0
  fed = len(prompts[2]) + len(outs[2]) - 1  # the last token is not fed
  assert fed // 8 == 2 and len(prompts[2]) < 16
  assert engine.get_request(turn).num_reused == 16


@pytest.mark.parametrize("max_new_tokens", [3, 12])
def test_a_burst_reserves_the_tokens_it_feeds(model, max_new_tokens):
  """A burst's reservation grows a row by the tokens it will feed after
  the one the step before reserved: `min(decode_steps, remaining - 1)` (the
  last token a request emits is sampled, never fed)."""
  from pkvattn.serving import programs
  cfg = dataclasses.replace(CFG, decode_steps=4)
  engine = Engine(model, cfg)
  prompt = [256] + list(range(40, 46))
  engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens,
                                            ignore_eos=True))
  engine.step()  # admission
  engine.step()  # prefill: one token out, the slot of the next reserved
  (req,) = engine.scheduler.running
  row = req.seq_id
  assert int(engine.state.seq_lens[row]) == len(prompt) + 1
  state = programs.reserve_burst(engine.state, engine.seq_tokens,
                                 engine.scheduler.burst_inputs(),
                                 decode_steps=4, commit=True)
  grow = min(4, max_new_tokens - 1 - 1)
  assert int(state.seq_lens[row]) == len(prompt) + 1 + grow


def test_bursts_shrink_to_row_buckets(model):
  # Rows 3, 2, 1 finish first: each burst runs the model over the smallest
  # row bucket above the running rows (4, then 2, then 1; chained bursts of
  # different buckets hand their end state on), with the tokens of one-step
  # decoding; rows outside a bucket come out untouched.
  prompts = _prompts(4, seed=7)
  cfg = dataclasses.replace(CFG, burst_rows=(1, 2))
  assert cfg.burst_buckets == (1, 2, 4)
  single, engine, _ = _queued_in_bursts(model, cfg, prompts, (24, 12, 7, 3))
  rows = []
  while engine.has_unfinished():
    engine.step()
    if engine.last_program.kind == "burst":
      rows.append(engine.last_program.num_tokens)
  assert [engine.get_request(i).output for i in range(4)] == single
  assert rows == sorted(rows, reverse=True) and {1, 2, 4} <= set(rows), rows
  engine.step()  # releases the last finished row
  cache.validate(engine.state)
  assert int(cache.stats(engine.state)["num_used"]) == 0


def test_bursts_chain_while_requests_wait(model):
  # Two rows, four requests: bursts chain while the other two wait, and a
  # row that frees by length goes to a waiting request right after the
  # burst that frees it (outputs as one-step decoding).
  prompts = _prompts(4, seed=5)
  single, engine, _ = _queued_in_bursts(
      model, dataclasses.replace(CFG, max_seqs=2), prompts, (14, 11, 9, 6))
  chained_waiting = 0
  while engine.has_unfinished():
    engine.step()
    if engine._inflight is not None and engine.scheduler.waiting:
      chained_waiting += 1
      # Nothing in flight reaches its length: no freed row idles.
      assert all(r.params.max_new_tokens - len(r.output) > 4
                 for r in engine.scheduler.running)
  outs = [engine.get_request(i).output for i in range(len(prompts))]
  assert outs == single and chained_waiting > 0


def test_prefix_reuse_respects_scope(model):
  engine = Engine(model, CFG)
  prompt = [256] + list(range(40, 60))  # 21 tokens: 2 full pages of 8
  sp = SamplingParams(max_new_tokens=2, ignore_eos=True)

  def run(scope):
    rid = engine.add_request(prompt, sp, reuse_scope=scope)
    while engine.has_unfinished():
      engine.step()
    return engine.get_request(rid)

  first = run(scope=1)
  assert first.num_reused == 0
  assert run(scope=2).num_reused == 0   # another tenant: no reuse
  again = run(scope=1)
  assert again.num_reused == 16 and again.output == first.output


def test_finished_row_is_published_with_its_own_tokens(model):
  # One row: B waits for A and runs in A's row after it. A's full blocks
  # are published by the commit of the step that releases A (one commit
  # with the prompts completed in that step), under A's tokens: B, with an
  # unrelated prompt, reuses nothing and decodes as alone, and A's prompt,
  # asked again, reuses A's blocks and decodes as A did.
  cfg = dataclasses.replace(CFG, max_seqs=1)
  sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
  prompt_a = [256] + list(range(40, 60))    # 21 tokens: 2 full pages of 8
  prompt_b = [256] + list(range(100, 120))
  expected_b = Engine(model, cfg).generate([prompt_b], sp)[0]
  engine = Engine(model, cfg)
  ids = [engine.add_request(p, sp) for p in (prompt_a, prompt_b)]
  while engine.has_unfinished():
    engine.step()
  a, b = (engine.get_request(i) for i in ids)
  assert b.num_reused == 0 and b.output == expected_b
  again = engine.get_request(engine.add_request(prompt_a, sp))
  while engine.has_unfinished():
    engine.step()
  assert again.num_reused == 16 and again.output == a.output
  # Its row's token buffer holds the reused prompt (written at admission,
  # not fed) and the decoded tokens (fed): the 25 tokens' third block,
  # prompt and output, is published under them, so the conversation's next
  # turn reuses 24 tokens.
  turn = engine.get_request(engine.add_request(
      prompt_a + again.output + [7], sp))
  while engine.has_unfinished():
    engine.step()
  assert turn.num_reused == 24
  cache.validate(engine.state)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_requests_computing_one_prefix_together_publish_both_chains(
    model, decode_steps):
  # Two requests share 16 tokens (two pages of 8) and are admitted in the
  # same step, so neither reuses the other's prefix: both compute it and
  # commit it in the same step, where the first publishes the shared
  # blocks. At the second's next commit its copies of them are twins, and
  # its own blocks after them are published as their children. Both
  # prompts asked again reuse every full block, and so does each
  # conversation's next turn (prompt and answer, answers fed in steps or in
  # bursts).
  cfg = dataclasses.replace(CFG, decode_steps=decode_steps)
  sp = SamplingParams(max_new_tokens=9, ignore_eos=True)
  shared = [256] + list(range(40, 55))
  prompts = [shared + list(range(60, 69)), shared + list(range(80, 91))]
  engine = Engine(model, cfg)
  ids = [engine.add_request(p, sp) for p in prompts]
  while engine.has_unfinished():
    engine.step()
  firsts = [engine.get_request(i) for i in ids]
  assert [r.num_reused for r in firsts] == [0, 0]
  again = [engine.add_request(p, sp) for p in prompts]
  turns = [engine.add_request(p + r.output + [7], sp)
           for p, r in zip(prompts, firsts)]
  while engine.has_unfinished():
    engine.step()
  for rid, p in zip(again, prompts):
    req = engine.get_request(rid)
    assert req.num_reused == (len(p) - 1) // 8 * 8, (len(p), req.num_reused)
    assert req.output == firsts[ids.index(rid - 2)].output
  for rid, p, r in zip(turns, prompts, firsts):
    fed = len(p) + len(r.output) - 1  # the last token is not fed
    assert engine.get_request(rid).num_reused == fed // 8 * 8
  cache.validate(engine.state)


def test_prompt_larger_than_pool_raises(model):
  # A request that can never fit the pool is refused when it is added
  # (nothing queued), not after steps.
  engine = Engine(model, SMALL_POOL)
  need = -(-74 // SMALL_POOL.page_size)
  with pytest.raises(ValueError, match=f"need {need} slots.*num_slots="
                     f"{SMALL_POOL.num_slots}"):
    engine.add_request(list(range(70)), SamplingParams(max_new_tokens=4))
  assert not engine.has_unfinished()


def test_finished_history_keeps_the_latest_and_names_what_it_dropped(model):
  engine = Engine(model, dataclasses.replace(CFG, finished_history=1))
  ids = []
  for prompt in _prompts(2, seed=4):
    ids.append(engine.add_request(prompt, SamplingParams(
        max_new_tokens=2, ignore_eos=True)))
    while engine.has_unfinished():
      engine.step()
  assert ids == [0, 1]
  assert len(engine.get_request(1).output) == 2   # the latest is kept
  with pytest.raises(KeyError, match="Request 0 finished and was dropped"):
    engine.get_request(0)
  for unknown in (2, -1, "0"):
    with pytest.raises(KeyError, match=r"Unknown request_id: expected an id "
                       r"in \[0, 2\)"):
      engine.get_request(unknown)


def test_sampling_is_seeded_per_request(model):
  prompts = _prompts(4, seed=3)
  sp = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=50, top_p=0.95,
                      seed=7, ignore_eos=True)
  alone = Engine(model, CFG).generate([prompts[0]], sp)[0]
  crowd = Engine(model, CFG).generate(prompts, [sp] + [
      SamplingParams(max_new_tokens=8, temperature=0.7, seed=i) for i in range(3)])
  assert crowd[0] == alone
  other_seed = Engine(model, CFG).generate(
      [prompts[0]], SamplingParams(max_new_tokens=8, temperature=1.0, seed=8,
                                   ignore_eos=True))[0]
  assert other_seed != alone


def test_split_sampled_variant_samples_as_the_one_program(model):
  # On a GPU a burst's greedy-only and sampled programs are split, and the
  # sampled one has no lax.cond (the host runs it only when a row samples).
  # Forced here on the CPU: a batch of sampling and greedy rows gets the
  # tokens of the one program with the cond, and greedy-only bursts run
  # their own variant.
  prompts = _prompts(4, seed=5)
  sps = [SamplingParams(max_new_tokens=6, temperature=0.9, top_k=20,
                        top_p=0.9, seed=3, ignore_eos=True),
         SamplingParams(max_new_tokens=6, ignore_eos=True)] * 2
  cfg = dataclasses.replace(CFG, decode_steps=2)
  want = Engine(model, cfg).generate(prompts, sps)
  split = Engine(model, dataclasses.replace(cfg, max_seqs=3))
  split.compiler.split_variants = True
  got = split.generate(prompts, sps)
  assert got == want
  ran = {k.greedy_only for k in split.compiler.compiled if k.kind == "burst"}
  assert ran == {True, False}
  assert got != Engine(model, cfg).generate(prompts, [sps[1]] * 4)


def test_pool_is_donated(model):
  engine = Engine(model, CFG)
  engine.add_request([256, 1, 2, 3], SamplingParams(max_new_tokens=2))
  old_pool, old_state = engine.pool, engine.state
  engine.step()
  assert old_pool.is_deleted()
  assert old_state.slot_refcount.is_deleted()
  # The compiled step aliases the pool and never copies it.
  hlo = engine._lower(engine.last_program).compile().as_text()
  assert "input_output_alias" in hlo
  pool_type = "f32[%s]" % ",".join(map(str, engine.pool.shape))
  assert not re.search(re.escape(pool_type) + r"[^\n]*\bcopy\(", hlo)


def test_invalid_requests(model):
  engine = Engine(model, CFG)
  with pytest.raises(ValueError, match="max_model_len"):
    engine.add_request(list(range(60)), SamplingParams(max_new_tokens=8))
  with pytest.raises(ValueError, match="prompt"):
    engine.add_request([], SamplingParams())
  with pytest.raises(ValueError, match="token ids"):
    engine.add_request([100000], SamplingParams())
  with pytest.raises(ValueError, match="max_num_tokens"):
    EngineConfig(max_seqs=8, max_num_tokens=4)
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-1.0)


def test_profile_reports_split(model):
  engine = Engine(model, CFG)
  engine.add_request([256, 5, 6, 7, 8], SamplingParams(max_new_tokens=3))
  engine.step()
  engine.step()
  keys = {"step_ms", "attention_ms", "bookkeeping_ms", "bookkeeping_in_jit_ms",
          "rest_ms"}
  prof = engine.profile(iters=2)
  assert set(prof) == keys
  assert prof["step_ms"] > 0 and prof["attention_ms"] > 0
  assert prof["bookkeeping_ms"] >= 0 and prof["bookkeeping_in_jit_ms"] >= 0
  # Decoding in bursts: the profiled step is one burst iteration, and
  # profiling leaves the engine's state alone.
  burst = Engine(model, dataclasses.replace(CFG, decode_steps=2))
  burst.add_request([256, 5, 6, 7, 8], SamplingParams(max_new_tokens=6))
  for _ in range(3):  # admit, prefill, first decode step (commits the prompt)
    burst.step()
  assert burst._burst_eligible()
  before = jax.tree.map(np.asarray, burst.state)
  prof = burst.profile(iters=2)
  assert set(prof) == keys and prof["step_ms"] > 0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray,
                                                           burst.state), before)
  assert burst.generate([], SamplingParams()) == []
  while burst.has_unfinished():
    burst.step()
  assert len(burst.get_request(0).output) == 6


# Scripted durations, s (binary fractions: sums are exact): scheduling a
# step or burst, running its programs, compiling one, booking its outputs.
SCHED, RUN, COMPILE, BOOK = 2.0**-4, 1.0, 8.0, 2.0**-6


class _ScriptedClock:
  """The engine module's `time`: it advances only where the test's hooks
  say the work took time."""

  def __init__(self):
    self.now = 0.0
    self.compiled = 0.0  # scripted compile seconds handed to the engine
    self.host = 0.0      # scripted scheduling and booking seconds
    self.unfed = 0.0     # steps that fed no tokens (admissions only)

  def perf_counter(self):
    return self.now


def _script(engine, monkeypatch):
  """Patches `engine` so host work, programs and compiles take the scripted
  durations on a `_ScriptedClock`; returns the clock."""
  import pkvattn.serving.engine as engine_mod  # pylint: disable=import-outside-toplevel
  clock = _ScriptedClock()
  monkeypatch.setattr(engine_mod, "time", clock)
  sched = engine.scheduler

  def advancing(fn, dt):
    def wrapped(*a, **kw):
      clock.now += dt
      clock.host += dt
      return fn(*a, **kw)
    return wrapped

  for name, dt in (("schedule", SCHED), ("schedule_burst", SCHED),
                   ("update_from_output", BOOK)):
    monkeypatch.setattr(sched, name, advancing(getattr(sched, name), dt))
  run = engine._run

  def scripted_run(scheduled):
    out, compile_s, err = run(scheduled)
    compile_s = COMPILE if compile_s > 0 else 0.0  # compiled on first use
    clock.now += RUN + compile_s
    clock.compiled += compile_s
    if scheduled.kind == "step" and not scheduled.rows:
      clock.unfed += SCHED + RUN + BOOK  # its scheduling, run and booking
    return out, compile_s, err

  monkeypatch.setattr(engine, "_run", scripted_run)
  return clock


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_step_time_goes_to_prefill_decode_and_host(model, monkeypatch,
                                                    decode_steps):
  # Every step's wall time, less its compiles, is prefill time if the step
  # carried prompt tokens and decode time otherwise (bursts, drains), unless
  # it fed no tokens (admissions only: neither); the host's share is its
  # scheduling and booking. Six prompts on four rows: later prompts are
  # admitted beside decoding rows (mixed steps); one more arrives while a
  # burst is in flight (the next call reads it before its step).
  engine = Engine(model, dataclasses.replace(CFG, decode_steps=decode_steps))
  clock = _script(engine, monkeypatch)
  prompts = _prompts(7)
  ids = [engine.add_request(p, SamplingParams(max_new_tokens=5 + 3 * i,
                                              ignore_eos=True))
         for i, p in enumerate(prompts[:-1])]
  st = engine.stats
  calls = prefill_calls = mixed_calls = 0
  while engine.has_unfinished():
    if engine._inflight is not None and len(ids) < len(prompts):
      ids.append(engine.add_request(prompts[-1], SamplingParams(
          max_new_tokens=4, ignore_eos=True)))
    before = _counters(engine, clock, ids)
    n = engine.step()
    d = {k: v - before[k] for k, v in _counters(engine, clock, ids).items()}
    calls += 1
    assert n == d["booked"]
    # The whole call is booked once, compiles excluded; its host time is
    # its scheduling and booking, not its programs.
    assert d["prefill_s"] + d["decode_s"] == (
        d["clock"] - d["compiled"] - d["unfed"])
    assert d["host_s"] == d["host_work"]
    if d["prefill_tokens"]:  # a step that carried prompt tokens
      prefill_calls += 1
      mixed_calls += d["decode_tokens"] > 0
      assert d["prefill_s"] == SCHED + RUN + BOOK
    else:
      assert d["prefill_s"] == 0
  assert 0 < mixed_calls <= prefill_calls < calls
  assert len(ids) == len(prompts) or decode_steps == 1
  assert st.decode_time_s > 0 and clock.compiled > 0 and clock.unfed > 0


def _counters(engine, clock, ids) -> dict:
  """The scripted clock's sums and `engine.stats`' times and token counts,
  with the tokens booked into the outputs of requests `ids`."""
  st = engine.stats
  return dict(clock=clock.now, compiled=clock.compiled, host_work=clock.host,
              unfed=clock.unfed, prefill_tokens=st.prefill_tokens,
              decode_tokens=st.decode_tokens, prefill_s=st.prefill_time_s,
              decode_s=st.decode_time_s, host_s=st.host_time_s,
              booked=sum(len(engine.get_request(i).output) for i in ids))


def test_builtin_gemma2_model_runs():
  model = load_model("tiny-gemma2")
  assert model.cfg.windows == (31, -1) and model.cfg.sandwich_norms
  engine = Engine(model, EngineConfig(page_size=8, num_slots=16, max_seqs=2,
                                      max_num_tokens=48, max_model_len=64,
                                      token_buckets=(48,)))
  prompt = model.tokenizer.encode("A prompt longer than the 32-token window.")
  out = engine.generate([prompt], SamplingParams(max_new_tokens=4,
                                                 ignore_eos=True))
  assert len(out[0]) == 4 and all(0 <= t < model.cfg.vocab_size for t in out[0])


def test_unstacked_layers_match_scanned():
  # Gemma 2 (period 2, windows differ per layer): the unrolled loop over
  # per-layer weights must give the scanned forward's logits and tokens.
  from pkvattn.models import forward, stack_layers, unstack_layers
  from pkvattn.flax import AttentionPlan, layer_page_tables
  model = load_model("tiny-gemma2")
  mcfg = model.cfg
  flat = unstack_layers(model.params)
  assert len(flat["layers"]) == mcfg.num_layers
  assert unstack_layers(flat) is flat
  jax.tree.map(np.testing.assert_array_equal, stack_layers(flat), model.params)
  rng = np.random.default_rng(1)
  lens = [37, 5]
  ps, max_pages = 8, 6
  slots = rng.permutation(len(lens) * max_pages).astype(np.int32).reshape(
      len(lens), max_pages)
  q_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  plan = AttentionPlan.create(layer_page_tables(jnp.asarray(slots),
                                                mcfg.num_layers),
                              q_indptr, np.asarray(lens, np.int32),
                              int(q_indptr[-1]))
  tokens = jnp.asarray(rng.integers(0, mcfg.vocab_size, int(q_indptr[-1])),
                       jnp.int32)
  pool = jnp.zeros(mcfg.pool_shape(slots.size, ps), jnp.float32)
  outs = [forward(p, mcfg, tokens, pool, plan, impl="xla")
          for p in (model.params, flat)]
  np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="params\\['layers'\\]"):
    forward(dict(flat, layers=flat["layers"][:1]), mcfg, tokens, pool, plan)
  ecfg = EngineConfig(page_size=8, num_slots=16, max_seqs=2, max_num_tokens=48,
                      max_model_len=64, token_buckets=(48,))
  prompts = [rng.integers(0, 256, n).tolist() for n in (40, 9)]
  sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
  gen = [Engine(model, dataclasses.replace(ecfg, scan_layers=s)).generate(
      prompts, sp) for s in (True, False)]
  assert gen[0] == gen[1]


def test_fused_projections_match_separate():
  # One q/k/v matmul and one gate/up matmul (what the engine runs) compute
  # the same forward as the separate projections, biases included.
  from pkvattn.flax import AttentionPlan, layer_page_tables
  from pkvattn.models import TINY_CONFIGS, forward, fuse_projections, init_params
  cfg = dataclasses.replace(TINY_CONFIGS["tiny-llama"], qkv_bias=True,
                            mlp_bias=True)
  params = init_params(cfg, jax.random.key(1), jnp.float32, scale=0.1)
  fused = fuse_projections(params)
  assert "qkv_proj" in fused["layers"]["attn"]
  assert "gate_up_proj" in fused["layers"]["mlp"]
  assert (jax.tree.structure(fuse_projections(fused))
          == jax.tree.structure(fused))  # idempotent
  n, ps = 11, 8
  tables = layer_page_tables(jnp.arange(2, dtype=jnp.int32)[None], cfg.num_layers)
  plan = AttentionPlan.create(tables, jnp.array([0, n]), jnp.array([n]), 16)
  tokens = jax.random.randint(jax.random.key(2), (16,), 0, cfg.vocab_size)
  pool = jnp.zeros(cfg.pool_shape(2, ps), jnp.float32)
  expected, _ = forward(params, cfg, tokens, pool, plan, impl="xla")
  actual, _ = forward(fused, cfg, tokens, pool, plan, impl="xla")
  np.testing.assert_allclose(actual[:n], expected[:n], rtol=1e-5, atol=1e-5)
