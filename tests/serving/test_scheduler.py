"""The host scheduler alone, driven by a NumPy model of the device programs.

No model and no compile: a request's "model" is a random stream of tokens
(its i-th generated token is `stream[i]`), and the device's answers are
written here from the program inputs (a burst emits tokens until a stop
token or the request's length, as `programs.device_decode_burst` does).
This checks what the engine tests can only see through whole generations:
that a single step and a burst book stop tokens, lengths and preemptions
identically, that every stop / length rule holds for random requests, and
what a refused claim does to the queue.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pkvattn.sampling import SamplingParams
from pkvattn.serving.config import EngineConfig
from pkvattn.serving.programs import BurstOutputs
from pkvattn.serving.programs import MAX_STOP_IDS
from pkvattn.serving.programs import StepOutputs
from pkvattn.serving.request import RequestLimits
from pkvattn.serving.request import RequestStatus
from pkvattn.serving.request import make_request
from pkvattn.serving.scheduler import Scheduler
from pkvattn.serving.stats import EngineStats

EOS = 7
VOCAB = 64
CFG = EngineConfig(page_size=4, num_slots=64, max_seqs=3, max_num_tokens=16,
                   max_model_len=64, token_buckets=(3,))


def _limits(cfg):
  return RequestLimits(
      max_model_len=cfg.max_model_len, page_size=cfg.page_size,
      max_slots=cfg.num_slots, pool_text=f"num_slots={cfg.num_slots}",
      vocab_size=VOCAB, max_prefill_tokens=None,
      default_stop_ids=frozenset({EOS}))


def _random_requests(rng, n):
  """`(prompts, params, streams, preempt_at)`: random prompts, lengths and
  stop rules; each request's token stream (a stop token within a few tokens is likely); and the
  `(request, token index)` pairs after which the pool cannot grow it."""
  prompts, params, streams = [], [], []
  for _ in range(n):
    prompts.append(rng.integers(0, VOCAB, int(rng.integers(1, 24))).tolist())
    stops = None
    if rng.random() < 0.6:
      stops = tuple(int(t) for t in rng.choice(VOCAB, int(rng.integers(1, 4)),
                                               replace=False))
    params.append(SamplingParams(
        max_new_tokens=int(rng.integers(1, 20)), stop_token_ids=stops,
        ignore_eos=bool(rng.random() < 0.25)))
    streams.append(rng.integers(0, VOCAB, 20).tolist())
  preempt_at = {(int(r), int(i)) for r, i in zip(rng.integers(0, n, n),
                                                  rng.integers(0, 20, n))}
  return prompts, params, streams, preempt_at


def _expected_output(params, stream, stop_ids):
  """The generated tokens and finish reason by the rules of `SamplingParams`
  (the first stop token ends it, kept; else `max_new_tokens`)."""
  for i, t in enumerate(stream[:params.max_new_tokens]):
    if t in stop_ids and not params.ignore_eos:
      return stream[:i + 1], "stop"
  return stream[:params.max_new_tokens], "length"


def _step_outputs(cfg, scheduled, streams, preempt_at):
  """A step's outputs: each sampling row's next stream token; `extend`
  refused at the `preempt_at` positions; every claim granted, none reused."""
  S, A = cfg.max_seqs, cfg.num_admit
  sampled = np.full(S, -1, np.int32)
  extend_ok = np.ones(S, bool)
  for req, _, samples in scheduled.rows:
    if samples:
      i = len(req.output)
      sampled[req.seq_id] = streams[req.request_id][i]
      extend_ok[req.seq_id] = (req.request_id, i) not in preempt_at
  zeros = np.zeros(A, np.int32)
  return StepOutputs(sampled=sampled, extend_ok=extend_ok,
                     claim_ok=np.ones(A, bool), claim_reused=zeros,
                     claim_new_blocks=zeros, used_slots=np.int32(0),
                     num_free=np.int32(0))


def _burst_outputs(cfg, sched, scheduled, streams, preempt_at):
  """A burst's outputs from its inputs: per active row, tokens from the
  stream at `gen_index` on, until a stop id of the inputs, `remaining`
  tokens or `decode_steps`; a `preempt_at` position stops the row there
  (its next token has no slot) with `preempted` set."""
  inp = scheduled.inputs
  S, k = cfg.max_seqs, cfg.decode_steps
  by_row = {r.seq_id: r for r in sched.running}
  tokens = np.full((k, S), -1, np.int32)
  preempted = np.zeros(S, bool)
  for r in np.flatnonzero(inp.active):
    rid = by_row[r].request_id
    stops = set(inp.stop_ids[r][inp.stop_ids[r] >= 0].tolist())
    for step in range(min(k, int(inp.remaining[r]))):
      i = int(inp.gen_index[r]) + step
      tokens[step, r] = streams[rid][i]
      if streams[rid][i] in stops or step + 1 == inp.remaining[r]:
        break
      if (rid, i) in preempt_at:
        preempted[r] = True
        break
  return BurstOutputs(tokens=tokens, preempted=preempted,
                      used_slots=np.int32(0), num_free=np.int32(0))


def _serve(cfg, prompts, params, streams, preempt_at):
  """Runs the requests to the end; returns `(requests, stats, kinds,
  sampled)`, `sampled` the sum of what `update_from_output` returned."""
  stats = EngineStats()
  sched = _queue(cfg, prompts, params, stats)
  reqs = list(sched.waiting)
  kinds, sampled = [], 0
  while sched.waiting or sched.running:
    assert len(kinds) < 1000, "the scheduler does not make progress"
    if sched.burst_eligible():
      scheduled = sched.schedule_burst()
      out = _burst_outputs(cfg, sched, scheduled, streams, preempt_at)
    else:
      scheduled = sched.schedule()
      sched.take_released_rows()
      out = _step_outputs(cfg, scheduled, streams, preempt_at)
    kinds.append(scheduled.kind)
    sampled += sched.update_from_output(scheduled, out)
  return reqs, stats, kinds, sampled


@pytest.mark.parametrize("seed", range(6))
def test_steps_and_bursts_book_stops_lengths_and_preemptions_alike(seed):
  rng = np.random.default_rng(1000 + seed)
  prompts, params, streams, preempt_at = _random_requests(rng, 7)
  steps, step_stats, step_kinds, step_sampled = _serve(
      CFG, prompts, params, streams, preempt_at)
  burst_cfg = dataclasses.replace(CFG, decode_steps=4)
  bursts, burst_stats, burst_kinds, burst_sampled = _serve(
      burst_cfg, prompts, params, streams, preempt_at)
  assert set(step_kinds) == {"step"} and "burst" in burst_kinds
  for a, b, p, sp, stream in zip(steps, bursts, prompts, params, streams):
    stop_ids = {EOS} if sp.stop_token_ids is None else set(sp.stop_token_ids)
    output, reason = _expected_output(sp, stream, stop_ids)
    for req in (a, b):
      assert req.output == output
      assert req.finish_reason == reason
      assert req.status is RequestStatus.FINISHED and req.done
      assert req.num_computed == len(p) + len(output) - 1
    assert a.num_preemptions == b.num_preemptions
  for st, reqs, sampled in ((step_stats, steps, step_sampled),
                             (burst_stats, bursts, burst_sampled)):
    assert st.generated_tokens == sampled == sum(len(r.output) for r in reqs)
    assert st.num_preemptions == sum(r.num_preemptions for r in reqs)
    assert st.prompt_tokens >= sum(len(p) for p in prompts)
  assert step_stats.num_preemptions == burst_stats.num_preemptions
  assert step_stats.decode_tokens == burst_stats.decode_tokens
  assert step_stats.prefill_tokens == burst_stats.prefill_tokens


def _decoding(cfg, rng, **params):
  """A scheduler with one request decoding in row 0 (one token out)."""
  stats = EngineStats()
  sched = Scheduler(cfg, stats, pool_text="num_slots=64")
  prompt = rng.integers(0, VOCAB, int(rng.integers(1, 10))).tolist()
  req = make_request(prompt, SamplingParams(**params), _limits(cfg))
  sched.add(req)
  scheduled = sched.schedule()
  sched.update_from_output(scheduled, _claims(cfg, ok=[True]))
  scheduled = sched.schedule()
  first = int(rng.integers(0, VOCAB))
  while first in req.stop_ids:
    first = int(rng.integers(0, VOCAB))
  sched.update_from_output(scheduled, _sampled(cfg, {0: first}))
  assert req.status == "decode" and req.output == [first]
  return sched, req


def _claims(cfg, ok):
  A = cfg.num_admit
  claim_ok = np.zeros(A, bool)
  claim_ok[:len(ok)] = ok
  zeros = np.zeros(A, np.int32)
  return StepOutputs(sampled=np.full(cfg.max_seqs, -1, np.int32),
                     extend_ok=np.ones(cfg.max_seqs, bool), claim_ok=claim_ok,
                     claim_reused=zeros, claim_new_blocks=zeros,
                     used_slots=np.int32(0), num_free=np.int32(0))


def _sampled(cfg, tokens, extend_ok=True):
  out = _claims(cfg, ok=[])
  sampled = out.sampled.copy()
  for r, t in tokens.items():
    sampled[r] = t
  return out.replace(sampled=sampled,
                     extend_ok=np.full(cfg.max_seqs, extend_ok, bool))


@pytest.mark.parametrize("seed", range(4))
def test_one_token_step_equals_one_token_burst(seed):
  # The same token booked by a step (extend refused) and by a burst that
  # emits it and stops preempted: identical requests and queues, whether the
  # token stops the request, ends its length, or neither (then preempted).
  rng = np.random.default_rng(2000 + seed)
  max_new = int(rng.integers(3, 7))  # room to preempt before the length
  stop = int(rng.integers(0, VOCAB))
  for case in ("stop", "length", "preempted"):
    results = []
    for kind in ("step", "burst"):
      cfg = dataclasses.replace(CFG, decode_steps=4)
      sched, req = _decoding(cfg, np.random.default_rng(seed),
                             max_new_tokens=max_new, stop_token_ids=(stop,))
      while case == "length" and len(req.output) < max_new - 1:
        req.output.append((stop + 1) % VOCAB)  # as if decoded before
        req.num_computed += 1
      token = stop if case == "stop" else (stop + 1) % VOCAB
      computed = req.num_computed
      if kind == "step":
        scheduled = sched.schedule()
        assert [row.num_tokens for row in scheduled.rows] == [1]
        sched.update_from_output(scheduled, _sampled(cfg, {0: token},
                                                     extend_ok=False))
      else:
        assert sched.burst_eligible()
        scheduled = sched.schedule_burst()
        tokens = np.full((4, cfg.max_seqs), -1, np.int32)
        tokens[0, 0] = token
        preempted = np.zeros(cfg.max_seqs, bool)
        preempted[0] = True
        sched.update_from_output(scheduled, BurstOutputs(
            tokens=tokens, preempted=preempted, used_slots=np.int32(0),
            num_free=np.int32(0)))
      assert req.output[-1] == token and req.num_computed in (computed + 1, 0)
      assert sched.to_release == [(0, computed + 1)]
      if case == "preempted":
        assert req.status == "waiting" and req.num_preemptions == 1
        assert sched.stats.num_preemptions == 1
        assert list(sched.waiting) == [req] and req.seq_id == -1
        assert req.num_computed == 0 and req.finish_reason is None
      else:
        assert req.status == "finished" and req.finish_reason == case
        assert not sched.waiting and not sched.running
      results.append((list(req.output), req.status, req.finish_reason,
                      req.num_computed, req.num_preemptions,
                      sched.stats.generated_tokens, sched.stats.decode_tokens))
    assert results[0] == results[1], case


def test_refused_claims_requeue_in_order_and_unfittable_raises():
  rng = np.random.default_rng(3000)
  stats = EngineStats()
  sched = Scheduler(CFG, stats, pool_text="num_slots=64")
  reqs = []
  for i in range(5):
    req = make_request(rng.integers(0, VOCAB, 5).tolist(),
                       SamplingParams(max_new_tokens=3), _limits(CFG))
    req.request_id = i
    sched.add(req)
    reqs.append(req)
  scheduled = sched.schedule()
  assert list(scheduled.admitted) == reqs[:3]
  assert [r.seq_id for r in reqs[:3]] == [0, 1, 2] and not sched.free_rows
  # The middle claim holds; the others go back to the front, in order.
  sched.update_from_output(scheduled, _claims(CFG, ok=[False, True, False]))
  assert list(sched.waiting) == [reqs[0], reqs[2], reqs[3], reqs[4]]
  assert sched.running == [reqs[1]] and reqs[1].status == "prefill"
  assert sched.free_rows == [0, 2] and reqs[0].seq_id == reqs[2].seq_id == -1
  assert stats.num_refused_claims == 2
  # Nothing running, nothing to release: a refused claim can never fit.
  lone = Scheduler(CFG, EngineStats(), pool_text="num_slots=64")
  req = make_request([1, 2, 3], SamplingParams(max_new_tokens=2),
                     _limits(CFG))
  lone.add(req)
  scheduled = lone.schedule()
  with pytest.raises(RuntimeError, match="needs 1 slots.*num_slots=64"):
    lone.update_from_output(scheduled, _claims(CFG, ok=[False]))


def test_status_is_a_str_enum_and_bursts_cap_stop_ids():
  assert RequestStatus.FINISHED == "finished"
  assert str(RequestStatus.DECODE) == "decode"
  cfg = dataclasses.replace(CFG, decode_steps=4)
  rng = np.random.default_rng(4000)
  too_many = tuple(range(MAX_STOP_IDS + 1))
  sched, _ = _decoding(cfg, rng, max_new_tokens=8, stop_token_ids=too_many)
  assert not sched.burst_eligible()  # stop ids beyond the device's table
  sched, _ = _decoding(cfg, rng, max_new_tokens=8,
                       stop_token_ids=too_many[:MAX_STOP_IDS])
  assert sched.burst_eligible()


def _queue(cfg, prompts, params=None, stats=None):
  """A scheduler with one queued request per prompt, request ids 0, 1, ...
  (`params[i]`; None: 8 new tokens each)."""
  sched = Scheduler(cfg, stats or EngineStats(), pool_text="num_slots=64")
  for i, p in enumerate(prompts):
    sp = SamplingParams(max_new_tokens=8) if params is None else params[i]
    req = make_request(p, sp, _limits(cfg))
    req.request_id = i
    sched.add(req)
  return sched


def test_admissions_stop_at_max_admit_rows_and_backlog(rng):
  """A step admits while a row is free, fewer than `max_admit` requests
  were admitted, and the prompt tokens admitted but not computed stay under
  two steps' token budget; the rest stay queued in order."""
  prompts = [rng.integers(0, VOCAB, 5).tolist() for _ in range(4)]
  cfg = dataclasses.replace(CFG, max_admit=2)
  sched = _queue(cfg, prompts)
  assert [r.request_id for r in sched.schedule().admitted] == [0, 1]
  assert [r.request_id for r in sched.waiting] == [2, 3]
  sched = _queue(CFG, prompts)  # 3 rows for 4 requests
  assert [r.request_id for r in sched.schedule().admitted] == [0, 1, 2]
  # Two steps' budget is 32 tokens: 20 + 11 admitted, then 31 < 32 lets a
  # third in; with 20 + 12 the backlog is full.
  for second, admitted in ((11, [0, 1, 2]), (12, [0, 1])):
    lens = (20, second, 3)
    sched = _queue(CFG, [rng.integers(0, VOCAB, n).tolist() for n in lens])
    scheduled = sched.schedule()
    assert [r.request_id for r in scheduled.admitted] == admitted
    # Unused admission slots are padding: id -1, no tokens.
    pad = CFG.num_admit - len(admitted)
    np.testing.assert_array_equal(scheduled.inputs.admit_ids,
                                  admitted + [-1] * pad)
    np.testing.assert_array_equal(scheduled.inputs.admit_lens,
                                  list(lens[:len(admitted)]) + [0] * pad)


def test_no_burst_while_a_waiting_request_could_take_a_row(rng):
  """Bursts start only when nothing but decoding can happen: once a
  request waits with a row free, the next program is a step (it admits)."""
  for k in (1, 2):  # bursts of two steps are bursts; "one step" is a step
    cfg = dataclasses.replace(CFG, max_seqs=2, decode_steps=k)
    sched, _ = _decoding(cfg, rng, max_new_tokens=8)
    assert sched.burst_eligible() is (k > 1), k
  cfg = dataclasses.replace(CFG, max_seqs=2, decode_steps=4)
  sched, _ = _decoding(cfg, rng, max_new_tokens=8)
  assert sched.burst_eligible()  # one decoding request, nothing waiting
  req = make_request([1, 2], SamplingParams(max_new_tokens=2), _limits(cfg))
  req.request_id = 1
  sched.add(req)
  assert sched.free_rows and not sched.burst_eligible()


@pytest.mark.parametrize("waiting", [False, True])
def test_a_burst_stays_in_flight_only_if_a_request_outlives_it(waiting, rng):
  """A dispatched burst of k steps chains into the next one when some
  request has more than k tokens left (all of them have, when a request
  waits for a row); one that may end in it is read first."""
  cfg = dataclasses.replace(CFG, max_seqs=1, decode_steps=4)
  for left, chains in ((4, False), (5, True)):
    sched, _ = _decoding(cfg, rng, max_new_tokens=1 + left)
    if waiting:
      sched.add(make_request([1], SamplingParams(max_new_tokens=1),
                             _limits(cfg)))
    assert sched.can_chain() is chains, left
    # Checked mode reads every burst's errors before the next one.
    sched.config = dataclasses.replace(cfg, check=True)
    assert not sched.can_chain(), left


def test_a_request_failing_beside_a_pending_release_frees_its_row(
    exploding_params):
  """A request that fails while another row waits to be released (its
  request ended in the step before) queues its own row for release too."""
  cfg = dataclasses.replace(CFG, max_seqs=2)
  sched = Scheduler(cfg, EngineStats(), pool_text="num_slots=64")
  reqs = []
  for i, n in enumerate((1, 8)):  # A ends with its first token
    req = make_request([1, 2, 3], SamplingParams(max_new_tokens=n),
                       _limits(cfg))
    req.request_id = i
    sched.add(req)
    reqs.append(req)
  streams = [[EOS + 1] * 20] * 2

  def step():
    scheduled = sched.schedule()
    sched.take_released_rows()
    sched.update_from_output(scheduled, _step_outputs(cfg, scheduled, streams,
                                                      set()))

  step()  # admission
  step()  # both prompts: A samples its one token and ends
  assert reqs[0].finish_reason == "length" and sched.to_release

  reqs[1].params = exploding_params(8)  # B's next sampling step raises
  step()
  assert reqs[1].finish_reason == "error"
  step()  # the rows queued for release are released
  assert sched.free_rows == [0, 1] and not sched.to_release


@pytest.mark.parametrize("one_step", [False, True])
def test_prefill_chunks_fill_the_budget_and_start_after_reused_tokens(
    one_step, rng):
  """A prefill feeds from its reused tokens on: chunks under the step's
  token budget (one whole chunk where SWA scratch prefills prompts in one
  step); a prefill the budget has no room for left is not in the step."""
  sched = Scheduler(CFG, EngineStats(), prefill_in_one_step=one_step,
                    pool_text="num_slots=64")
  reqs = []
  for i, n in enumerate((12, 16, 3)):
    req = make_request(rng.integers(0, VOCAB, n).tolist(),
                       SamplingParams(max_new_tokens=4), _limits(CFG))
    req.request_id = i
    sched.add(req)
    reqs.append(req)
  scheduled = sched.schedule()
  assert list(scheduled.admitted) == reqs and not scheduled.rows
  sched.take_released_rows()
  # The first prompt reuses 8 cached tokens, the others none.
  out = _claims(CFG, ok=[True, True, True])
  reused = out.claim_reused.copy()
  reused[0] = 8
  sched.update_from_output(scheduled, out.replace(claim_reused=reused))
  assert [r.num_computed for r in reqs] == [8, 0, 0]
  # Budget 16: the first prompt's last 4 tokens, then 12 of the second's 16
  # (or none of it, in one step only); no room for the third.
  scheduled = sched.schedule()
  fed = [(row.request.request_id, row.num_tokens, row.samples)
         for row in scheduled.rows]
  inp = scheduled.inputs
  if one_step:
    assert fed == [(0, 4, True), (2, 3, True)]
  else:
    assert fed == [(0, 4, True), (1, 12, False)]
  assert [r.seq_id for r in reqs] == [0, 1, 2]
  # The rows whose fed tokens end their prompt sample.
  np.testing.assert_array_equal(inp.sample_rows, [True, False, one_step])
  assert inp.q_indptr[-1] == sum(n for _, n, _ in fed)
  assert inp.kv_lens[0] == 12 and inp.q_indptr[1] == 4
  np.testing.assert_array_equal(inp.tokens[:4], reqs[0].tokens[8:12])
  # Booked: the fed tokens as prefill, a first token where a prompt ends
  # (the step it came in: stats.num_steps, which the engine counts).
  sched.stats.num_steps = 5
  sched.take_released_rows()
  sched.update_from_output(scheduled, _sampled(CFG, {0: 9, 2: 9}))
  assert sched.stats.prefill_tokens == 4 + (3 if one_step else 12)
  assert sched.stats.decode_tokens == 0
  assert reqs[0].first_token_step == 5 and reqs[1].first_token_step is None
  sched.stats.num_steps = 6
  scheduled = sched.schedule()  # the prompts that ended decode
  sched.take_released_rows()
  sched.update_from_output(scheduled, _sampled(CFG, {0: 9, 2: 9}))
  assert sched.stats.decode_tokens == (2 if one_step else 1)
  assert reqs[0].first_token_step == 5 and reqs[0].output == [9, 9]


def test_claims_count_the_slots_scratch_saved():
  """With SWA scratch a claim takes fewer new blocks than its prompt's
  unreused ones; the difference is added to `slots_saved_by_scratch`."""
  stats = EngineStats(slots_saved_by_scratch=0)
  sched = Scheduler(CFG, stats, pool_text="num_slots=64")
  req = make_request(list(range(10)), SamplingParams(max_new_tokens=2),
                     _limits(CFG))
  sched.add(req)
  scheduled = sched.schedule()
  out = _claims(CFG, ok=[True])
  reused, new_blocks = out.claim_reused.copy(), out.claim_new_blocks.copy()
  reused[0], new_blocks[0] = 4, 1  # 3 blocks, 1 reused, 1 new: 1 saved
  sched.update_from_output(scheduled, out.replace(
      claim_reused=reused, claim_new_blocks=new_blocks))
  assert req.num_computed == 4 and stats.reused_tokens == 4
  assert stats.prompt_tokens == 10
  assert stats.slots_saved_by_scratch == 1


def _admitted(cfg, prompts, params, reused=None):
  """A scheduler whose requests (one per prompt) were admitted in one step,
  their claims granted (`reused[i]` tokens reused); returns `(sched,
  requests)`."""
  sched = _queue(cfg, prompts, params)
  reqs = list(sched.waiting)
  scheduled = sched.schedule()
  assert list(scheduled.admitted) == reqs
  sched.take_released_rows()
  out = _claims(cfg, ok=[True] * len(reqs))
  claim_reused = out.claim_reused.copy()
  claim_reused[:len(reqs)] = reused or 0
  sched.update_from_output(scheduled, out.replace(claim_reused=claim_reused))
  return sched, reqs


def test_sampling_fields_reach_step_and_burst_inputs(rng):
  """Each sampling row carries its request's temperature, top-k, top-p and
  seed, the seed taken modulo 2**32 (`SamplingParams`), in a step's inputs
  and in a burst's."""
  seeds = [int(rng.integers(1, 2**31)), -int(rng.integers(1, 2**31)),
           2**32 + int(rng.integers(1, 2**31))]
  params = [SamplingParams(max_new_tokens=8, temperature=float(t), top_k=k,
                           top_p=float(p), seed=sd)
            for t, k, p, sd in zip(rng.uniform(0.1, 2, 3),
                                   rng.integers(1, VOCAB, 3),
                                   rng.uniform(0.1, 1, 3), seeds)]
  cfg = dataclasses.replace(CFG, decode_steps=4)
  prompts = [rng.integers(0, VOCAB, 4).tolist() for _ in params]
  sched, reqs = _admitted(cfg, prompts, params)
  want = np.array([sd % 2**32 for sd in seeds], np.uint32)
  scheduled = sched.schedule()  # the three prompts, each sampling
  rows = [r.seq_id for r in reqs]
  sched.take_released_rows()
  sched.update_from_output(scheduled, _sampled(cfg, {r: EOS + 1 for r in rows}))
  assert sched.burst_eligible()
  burst = sched.schedule_burst()
  for inp in (scheduled.inputs, burst.inputs):
    np.testing.assert_array_equal(inp.seeds[rows], want)
    np.testing.assert_allclose(inp.temperature[rows],
                               [p.temperature for p in params], rtol=1e-6)
    np.testing.assert_array_equal(inp.top_k[rows], [p.top_k for p in params])
    np.testing.assert_allclose(inp.top_p[rows], [p.top_p for p in params],
                               rtol=1e-6)


def test_fail_leaves_the_queues_and_releases_a_held_row_once(rng):
  """`fail` takes the request out of its queue and finishes it with the
  error; a row it holds is released once, with nothing committed: not
  again if it already waits for release, not at all if it is free."""
  cases = ("row 0", "pending", "free", "waiting")
  for case in cases:
    sched, req = _decoding(CFG, rng, max_new_tokens=8)
    assert req.seq_id == 0 and sched.running == [req]
    if case == "pending":
      sched.to_release.append((0, 5))
    elif case == "free":  # its row already given back
      sched.free_rows = sorted(sched.free_rows + [0])
    elif case == "waiting":  # preempted: no row, at the queue's front
      sched.running.remove(req)
      req.seq_id = -1
      sched.waiting.appendleft(req)
      sched.free_rows = sorted(sched.free_rows + [0])
    sched.fail(req, RuntimeError("boom"))
    assert req not in sched.running and req not in sched.waiting, case
    assert req.finish_reason == "error" and "boom" in req.error, case
    assert req.seq_id == -1 and sched.take_finished() == [req], case
    assert sched.to_release == {"row 0": [(0, 0)], "pending": [(0, 5)],
                                "free": [], "waiting": []}[case], case
    # Work left: only the release a program still has to run.
    assert sched.has_work() == (case in ("row 0", "pending")), case


@pytest.mark.parametrize("prefix_reuse", [True, False])
def test_step_inputs_reserve_publish_and_pick_the_variant(prefix_reuse, rng):
  """A sampling row reserves the slot of the token it samples only if
  another one follows it; a prompt's last chunk publishes the prompt (with
  prefix reuse), a decode row does not; the step is greedy-only when no
  sampling row has a temperature above 0."""
  cfg = dataclasses.replace(CFG, enable_prefix_reuse=prefix_reuse)
  params = [SamplingParams(max_new_tokens=1), SamplingParams(max_new_tokens=2),
            SamplingParams(max_new_tokens=3, temperature=0.0)]
  prompts = [rng.integers(0, VOCAB, 4).tolist() for _ in params]
  sched, reqs = _admitted(cfg, prompts, params)
  scheduled = sched.schedule()  # the three prompts, each sampling
  inp = scheduled.inputs
  np.testing.assert_array_equal(inp.sample_rows, [True] * 3)
  np.testing.assert_array_equal(inp.extend_ids, [-1, 1, 2])
  np.testing.assert_array_equal(inp.prompt_commit_ids,
                                [0, 1, 2] if prefix_reuse else [-1] * 3)
  assert scheduled.greedy_only
  sched.take_released_rows()
  sched.update_from_output(scheduled, _sampled(cfg, {0: 9, 1: 9, 2: 9}))
  assert reqs[0].done and [r.status for r in reqs[1:]] == ["decode"] * 2
  scheduled = sched.schedule()  # decode rows: the second samples its last
  inp = scheduled.inputs
  np.testing.assert_array_equal(inp.extend_ids, [-1, -1, 2])
  np.testing.assert_array_equal(inp.prompt_commit_ids, [-1] * 3)
  # A row at temperature > 0 among greedy ones: the sampled variant.
  reqs[2].params = SamplingParams(max_new_tokens=3, temperature=0.5)
  assert not sched.schedule().greedy_only


def test_admission_backlog_counts_prompt_tokens_not_computed(rng):
  """The prefill backlog that stops admissions (two steps' budget: 32
  tokens) is the running prompts' tokens not computed yet, reused ones
  excluded."""
  sched, _ = _admitted(CFG, [rng.integers(0, VOCAB, 24).tolist()],
                       [SamplingParams(max_new_tokens=4)], reused=[8])
  for i, n in ((1, 16), (2, 5)):
    req = make_request(rng.integers(0, VOCAB, n).tolist(),
                       SamplingParams(max_new_tokens=4), _limits(CFG))
    req.request_id = i
    sched.add(req)
  # 16 left + 16 admitted = 32: the 5-token prompt waits.
  assert [r.request_id for r in sched.schedule().admitted] == [1]
  assert [r.request_id for r in sched.waiting] == [2]


def test_release_inputs_commit_each_row_once_at_its_longest():
  """A row queued twice for release is committed once, with the longer
  length (a duplicated commit id would void it); every entry is
  released."""
  sched = Scheduler(CFG, EngineStats(), pool_text="num_slots=64")
  sched.to_release = [(2, 5), (0, 3), (2, 9)]
  commit_ids, commit_lens, release_ids = sched.release_inputs()
  np.testing.assert_array_equal(commit_ids, [0, 2, -1])
  np.testing.assert_array_equal(commit_lens, [3, 9, 0])
  np.testing.assert_array_equal(release_ids, [2, 0, 2])
  # A failed request's row (`fail`: nothing committed) alone: padding after.
  sched.to_release = [(1, 0)]
  commit_ids, commit_lens, release_ids = sched.release_inputs()
  np.testing.assert_array_equal(commit_lens, [0, 0, 0])
  np.testing.assert_array_equal(commit_ids[1:], [-1, -1])
  np.testing.assert_array_equal(release_ids, [1, -1, -1])


def test_unschedule_gives_back_admissions_and_released_rows(rng):
  """A step whose program did not run is undone: its admissions return to
  the queue front in order without rows, and the rows it was to release
  wait for the next program again."""
  cfg = dataclasses.replace(CFG, max_seqs=3)
  params = [SamplingParams(max_new_tokens=1), SamplingParams(max_new_tokens=8)]
  sched, reqs = _admitted(cfg, [[1, 2], [3, 4]], params)
  scheduled = sched.schedule()
  sched.take_released_rows()
  sched.update_from_output(scheduled, _sampled(cfg, {0: 9, 1: 9}))
  assert reqs[0].done and sched.to_release == [(0, 2)]
  for i in (2, 3):
    req = make_request([5, 6, 7], SamplingParams(max_new_tokens=2),
                       _limits(cfg))
    req.request_id = i
    sched.add(req)
  waiting = list(sched.waiting)
  scheduled = sched.schedule()
  # Row 2 is free; row 0 frees only in the program that releases it.
  assert list(scheduled.admitted) == waiting[:1] and waiting[0].seq_id == 2
  taken = sched.take_released_rows()
  assert taken == [(0, 2)] and 0 in sched.free_rows
  sched.unschedule(scheduled, taken)
  assert list(sched.waiting) == waiting
  assert all(r.seq_id == -1 for r in waiting)
  assert sched.free_rows == [2] and sched.to_release == [(0, 2)]


def test_burst_variant_rows_and_chaining_read_every_running_request(rng):
  """A burst is greedy-only when every running request is (temperature 0
  included); its row bucket holds the highest running row; with a request
  waiting it chains only if no running request may end in it."""
  cfg = dataclasses.replace(CFG, max_seqs=8, decode_steps=4,
                            burst_rows=(1, 2, 4))
  params = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=9),
            SamplingParams(max_new_tokens=9, temperature=0.0)]
  sched, reqs = _admitted(cfg, [[1, 2], [3, 4], [5, 6]], params)
  scheduled = sched.schedule()
  sched.take_released_rows()
  sched.update_from_output(scheduled, _sampled(cfg, {0: 9, 1: 9, 2: 9}))
  assert sched.burst_greedy()
  reqs[1].params = SamplingParams(max_new_tokens=9, temperature=0.7)
  assert not sched.burst_greedy()
  assert sched.burst_rows() == 4  # rows 0-2 run
  # No row above any running one to hold: the smallest bucket.
  assert Scheduler(cfg, EngineStats()).burst_rows() == 1
  sched.running.remove(reqs[2])
  assert sched.burst_rows() == 2
  sched.running.remove(reqs[0])  # row 1 alone still needs 2 rows
  assert sched.burst_rows() == 2
  sched.running[:0] = [reqs[0]]
  # Over a 4-step burst, 4 and 8 tokens left: chains (the second outlives
  # it); with a request waiting, only when none may end in it.
  reqs[0].params = SamplingParams(max_new_tokens=5)
  assert sched.can_chain()
  sched.add(make_request([1], SamplingParams(max_new_tokens=1),
                         _limits(cfg)))
  assert not sched.can_chain()
  reqs[0].params = SamplingParams(max_new_tokens=6)  # 5 and 8 left
  assert sched.can_chain()


def test_step_and_burst_kinds_and_their_padded_sizes():
  """A step's size is its token bucket (0 when it feeds no token: the
  program of its cache ops alone), its tokens laid out in row order; a
  burst's is its row bucket. A scheduled step is a frozen value."""
  cfg = dataclasses.replace(CFG, max_seqs=8, decode_steps=4,
                            burst_rows=(1, 2, 4))
  sched = _queue(cfg, [[5, 6]])
  req = sched.waiting[0]
  scheduled = sched.schedule()  # the admission alone
  assert scheduled.kind == "step" and scheduled.num_tokens == 0
  assert scheduled.inputs.tokens.shape == (0,)
  with pytest.raises(dataclasses.FrozenInstanceError):
    scheduled.rows = ()
  sched.take_released_rows()
  sched.update_from_output(scheduled, _claims(cfg, ok=[True]))
  scheduled = sched.schedule()  # 2 prompt tokens: the bucket of 3
  assert scheduled.kind == "step" and scheduled.num_tokens == 3
  np.testing.assert_array_equal(scheduled.inputs.tokens, [5, 6, 0])
  sched.take_released_rows()
  sched.update_from_output(scheduled, _sampled(cfg, {0: EOS + 1}))
  assert req.status == "decode" and sched.burst_eligible()
  burst = sched.schedule_burst()
  assert burst.kind == "burst" and burst.num_tokens == burst.burst_rows == 1


def test_burst_inputs_carry_each_decoding_request(rng):
  """A burst's row of a request: its last sampled token, the tokens in the
  cache, the tokens it may still emit, its output length, and its stop ids
  (sorted, -1 padded; none with `ignore_eos`); rows without a request are
  inactive with no stop id."""
  stops = sorted(int(t) for t in rng.choice(VOCAB, 2, replace=False))
  params = [SamplingParams(max_new_tokens=10, stop_token_ids=tuple(stops)),
            SamplingParams(max_new_tokens=9, ignore_eos=True)]
  cfg = dataclasses.replace(CFG, decode_steps=4)
  prompts = [rng.integers(0, VOCAB, int(n)).tolist()
             for n in rng.integers(1, 8, 2)]
  sched, reqs = _admitted(cfg, prompts, params)
  not_stop = [t for t in range(VOCAB) if t not in stops and t != EOS]
  for _ in range(3):  # the prompts, then two decode steps
    scheduled = sched.schedule()
    sched.take_released_rows()
    toks = {r.seq_id: int(rng.choice(not_stop)) for r in reqs}
    sched.update_from_output(scheduled, _sampled(cfg, toks))
  assert all(len(r.output) == 3 for r in reqs) and sched.burst_eligible()
  inp = sched.burst_inputs()
  for req, p, sp in zip(reqs, prompts, params):
    r = req.seq_id
    assert inp.active[r] and inp.last[r] == req.output[-1]
    assert inp.computed[r] == len(p) + 2 == req.num_computed
    assert inp.remaining[r] == sp.max_new_tokens - 3
    assert inp.gen_index[r] == 3
  pad = [-1] * (MAX_STOP_IDS - 2)
  np.testing.assert_array_equal(inp.stop_ids[reqs[0].seq_id], stops + pad)
  np.testing.assert_array_equal(inp.stop_ids[reqs[1].seq_id], [-1] * (
      MAX_STOP_IDS))
  assert not inp.active[2] and (inp.stop_ids[2] == -1).all()


def _assert_cleared(inp, row, fields):
  """Row `row` of `inp` holds the values of a row without a request."""
  for name, v in fields.items():
    assert getattr(inp, name)[row] == v, name


def test_a_row_failing_in_a_step_or_burst_is_cleared_from_its_inputs(
    exploding_params):
  """A request whose inputs raise while a step or a burst is prepared is
  failed alone and its row cleared (module docstring): the program sees a
  row without a request, the other request's row is unchanged."""
  cleared = dict(kv_lens=0, sample_rows=False, temperature=0, top_k=0,
                 top_p=1, seeds=0, gen_index=0, extend_ids=-1,
                 prompt_commit_ids=-1)
  cleared_burst = dict(active=False, last=0, computed=0, remaining=0,
                       temperature=0, top_k=0, top_p=1, seeds=0, gen_index=0)
  for kind in ("step", "burst"):
    cfg = dataclasses.replace(CFG, decode_steps=4)
    params = [SamplingParams(max_new_tokens=8)] * 2
    sched, reqs = _admitted(cfg, [[1, 2, 3], [4, 5]], params)
    scheduled = sched.schedule()
    sched.take_released_rows()
    sched.update_from_output(scheduled, _sampled(cfg, {0: 9, 1: 9}))
    reqs[1].params = exploding_params(8)
    if kind == "step":
      scheduled = sched.schedule()
      inp = scheduled.inputs
      assert [row.request for row in scheduled.rows] == [reqs[0]]
      np.testing.assert_array_equal(np.diff(inp.q_indptr), [1, 0, 0])
      _assert_cleared(inp, 1, cleared)
      assert inp.sample_rows[0] and inp.kv_lens[0] == 4
      assert scheduled.greedy_only
    else:
      inp = sched.burst_inputs()
      _assert_cleared(inp, 1, cleared_burst)
      assert (inp.stop_ids[1] == -1).all()
      assert inp.active[0] and inp.computed[0] == 3 and inp.remaining[0] == 7
    assert reqs[1].finish_reason == "error" and sched.running == [reqs[0]]
    assert sched.to_release == [(1, 0)], kind


def test_a_failing_admission_leaves_its_slot_as_padding(rng):
  """An admission whose inputs raise fails that request alone; the step's
  admission inputs are those of a queue without it (padding: id -1, no
  tokens), and it takes no row."""
  prompts = [rng.integers(1, VOCAB, n).tolist() for n in (10, 3, 5)]
  sched = _queue(CFG, prompts)
  bad = [sched.waiting[0], sched.waiting[2]]
  for req in bad:
    req.reuse_scope = "not an int"  # raises when written to the inputs
  scheduled = sched.schedule()
  inp = scheduled.inputs
  assert [r.request_id for r in scheduled.admitted] == [1]
  assert all(r.finish_reason == "error" for r in bad)
  want_tokens = np.zeros((CFG.num_admit, CFG.max_model_len), np.int32)
  want_tokens[0, :3] = prompts[1]
  np.testing.assert_array_equal(inp.admit_tokens, want_tokens)
  np.testing.assert_array_equal(inp.admit_ids, [0, -1, -1])
  np.testing.assert_array_equal(inp.admit_lens, [3, 0, 0])
  np.testing.assert_array_equal(inp.admit_scope, [0, 0, 0])
  assert sched.free_rows == [1, 2] and not sched.to_release
