"""The host scheduler: which request runs where, and what its outputs mean.

Each engine step asks the `Scheduler` for a `ScheduledStep` (the inputs of
one device program and the requests they serve), runs that program, and
hands its outputs back to `Scheduler.update_from_output`, which books the
sampled tokens into the requests, finishes those that stop, preempts those
the pool could not grow, and settles the step's admissions. A single step and
a multi-step decode burst are booked by the same code (`_book`, `check_stop`),
so a stop token or a length ends a request the same way in both.

Rows: row `r` of the step batch is always sequence id `r` of the cache, so a
request keeps its row (`Request.seq_id`) from admission to release, and rows
without tokens in a step simply have `q_len = 0`.

Scheduling a step (vLLM's continuous batching with chunked prefill): decode
rows first (one token each: the last sampled token), then prefill chunks of
the admitted prompts in admission order under the step's token budget
(`max_num_tokens`), all in one mixed batch; then waiting requests are
admitted while rows are free and the prefill backlog is under two steps'
budget. An admission is a claim the device settles in the same program
(`claim_batch`: prefix reuse, all-or-nothing); the request starts its prefill
in the next step from its reused tokens. A refused claim puts the request
back at the front of the queue; a decode whose `extend` is refused is
preempted and later recomputed from prompt + output (vLLM's recompute
preemption): requests wait, they never fail for a full pool.

Rows freed by finished or preempted requests are released by the next
program (`commit` of what they computed, then `release`), so their rows are
free for admissions from that program on.

Error isolation: an exception while one request's inputs are prepared
(`schedule`, `burst_inputs`, an admission) or its outputs booked
(`update_from_output`) finishes that request alone with
`finish_reason="error"` (`fail`): its row is cleared from the step's inputs
and released by the program (nothing of it is published to the prefix
cache), and every other request goes on. An admission writes its inputs
before it takes the request and the row off their queues, so a failing one
loses neither.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import numpy as np

from pkvattn.serving import programs as _programs
from pkvattn.serving.config import EngineConfig
from pkvattn.serving.programs import MAX_STOP_IDS
from pkvattn.serving.request import Request
from pkvattn.serving.request import RequestStatus
from pkvattn.serving.request import check_stop
from pkvattn.serving.stats import EngineStats

WAITING = RequestStatus.WAITING
PREFILL = RequestStatus.PREFILL
DECODE = RequestStatus.DECODE
FINISHED = RequestStatus.FINISHED


class ScheduledRow(NamedTuple):
  """One request fed in a step."""
  request: Request
  num_tokens: int   # tokens fed in this step
  samples: bool     # the fed tokens end its sequence: it samples a token


@dataclasses.dataclass(frozen=True)
class ScheduledStep:
  """What one device program runs, as the host scheduled it.

  Attributes:
    inputs: a `programs.StepInputs` (host arrays) for a step, or a
      `programs.BurstInputs` for a burst (host arrays, or device arrays
      taken from the previous burst's end state when chained).
    greedy_only: every row that samples is greedy (selects a burst's
      variant without the sampler's `lax.cond`; a step's one program reads
      the same from its inputs).
    rows: a step's requests, in feed order (decode rows first); empty for a
      burst, whose rows are the running requests when it is read.
    admitted: a step's claims, in `inputs.admit_ids` order.
    burst_rows: a burst's row bucket (`EngineConfig.burst_buckets`): its
      program runs the model over rows `[0, burst_rows)`.
  """
  inputs: _programs.StepInputs | _programs.BurstInputs
  greedy_only: bool
  rows: tuple[ScheduledRow, ...] = ()
  admitted: tuple[Request, ...] = ()
  burst_rows: int = 0

  @property
  def kind(self) -> str:
    """"step" or "burst" (`compiler.ProgramKey.kind`)."""
    return ("burst" if isinstance(self.inputs, _programs.BurstInputs)
            else "step")

  @property
  def num_tokens(self) -> int:
    """Padded tokens of a step (its bucket); a burst's row bucket."""
    if self.kind == "burst":
      return self.burst_rows
    return int(self.inputs.tokens.shape[0])


class Scheduler:
  """The queues and rows of one engine, and the booking of its outputs.

  Attributes:
    waiting: requests without a row, served first in, first out (refused
      claims and preempted requests go back to the front).
    running: admitted requests (prefill or decode), in admission order.
    free_rows: rows no request holds, sorted.
    to_release: `(row, committed tokens)` of finished / preempted requests,
      released by the next program.
    finished: requests finished since the engine last took them
      (`take_finished`), in finishing order.
  """

  def __init__(self, config: EngineConfig, stats: EngineStats, *,
               prefill_in_one_step: bool = False, pool_text: str = ""):
    """`prefill_in_one_step`: SWA scratch is active, whose blocks live for one
    step, so a prompt is prefilled whole (`make_request` checks it fits).
    `pool_text`: the pool's size in words, for the error of a request that
    can never be admitted."""
    self.config = config
    self.stats = stats
    self.prefill_in_one_step = prefill_in_one_step
    self.pool_text = pool_text
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.free_rows = list(range(config.max_seqs))
    self.to_release: list[tuple[int, int]] = []
    self.finished: list[Request] = []
    self.burst_taken: list[tuple[int, int]] = []  # for `unschedule`

  def take_finished(self) -> list[Request]:
    """The requests finished since the last call (the engine's history)."""
    out, self.finished = self.finished, []
    return out

  def fail(self, req: Request, error: BaseException) -> None:
    """Finishes `req` alone with `finish_reason="error"` and the message of
    `error`: it leaves its queue, and its row (if it holds one) is released
    by the next program with nothing committed (what it computed is not
    published to the prefix cache). Safe to call whatever state the failure
    left `req` in."""
    if req in self.running:
      self.running.remove(req)
    if req in self.waiting:
      self.waiting.remove(req)
    row = req.seq_id
    if row >= 0 and row not in self.free_rows and all(
        r != row for r, _ in self.to_release):
      self.to_release.append((row, 0))
    req.seq_id = -1
    req.status = FINISHED
    req.finish_reason = "error"
    req.error = f"{type(error).__name__}: {error}"
    self.finished.append(req)

  def add(self, req: Request) -> None:
    """Queues `req` (status WAITING) behind the waiting requests."""
    self.waiting.append(req)

  def has_work(self) -> bool:
    """Whether a program has something to do: a request waits or runs, or
    a row waits to be released."""
    return bool(self.waiting or self.running or self.to_release)

  # ------------------------------------------------------------ one step
  def schedule(self) -> ScheduledStep:
    """The next step: running requests' tokens under the budget, then
    admissions. Takes rows for the admitted requests (given back if their
    claims are refused); leaves `to_release` for `take_released_rows`."""
    cfg = self.config
    S, T, A = cfg.max_seqs, cfg.max_num_tokens, cfg.num_admit
    tokens = np.zeros(T, np.int32)
    q_lens = np.zeros(S, np.int32)
    kv_lens = np.zeros(S, np.int32)
    sample_rows = np.zeros(S, bool)
    temperature = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    seeds = np.zeros(S, np.uint32)
    gen_index = np.zeros(S, np.int32)
    extend_ids = np.full(S, -1, np.int32)
    prompt_commit_ids = np.full(S, -1, np.int32)
    rows = []
    feeds = {}  # row -> tokens fed this step
    budget = T
    order = ([r for r in self.running if r.status is DECODE]
             + [r for r in self.running if r.status is PREFILL])
    for req in order:
      r = req.seq_id
      try:
        if req.status is DECODE:
          # All but the last sampled token are in the cache: feed that one.
          feed, total = req.output[-1:], req.num_computed + 1
        else:
          todo = req.tokens
          total = len(todo)
          remaining = total - req.num_computed
          chunk = (remaining if self.prefill_in_one_step
                   else min(remaining, budget))
          if chunk > budget or chunk <= 0:
            continue
          feed = todo[req.num_computed:req.num_computed + chunk]
        n = len(feed)
        if n > budget:
          continue
        q_lens[r] = n
        kv_lens[r] = req.num_computed + n
        samples = req.num_computed + n == total
        if samples:
          sample_rows[r] = True
          sp = req.params
          temperature[r], top_k[r], top_p[r] = (sp.temperature, sp.top_k,
                                                sp.top_p)
          seeds[r] = np.uint32(sp.seed & 0xFFFFFFFF)
          gen_index[r] = len(req.output)
          if len(req.output) + 1 < sp.max_new_tokens:
            extend_ids[r] = r  # reserve the slot of the token it samples
          if req.status is PREFILL and cfg.enable_prefix_reuse:
            prompt_commit_ids[r] = r  # published up to kv_lens in the step
      except Exception as e:  # this request alone: clear its row, fail it
        for arr, v in ((q_lens, 0), (kv_lens, 0), (sample_rows, False),
                       (temperature, 0), (top_k, 0), (top_p, 1), (seeds, 0),
                       (gen_index, 0), (extend_ids, -1),
                       (prompt_commit_ids, -1)):
          arr[r] = v
        self.fail(req, e)
        continue
      budget -= n
      feeds[r] = feed
      rows.append(ScheduledRow(req, n, samples))
    # Tokens are laid out in row order (q_indptr is cu_seqlens over rows),
    # padded to the smallest bucket that holds them; a step that feeds none
    # runs the program of no tokens (its cache ops alone).
    q_indptr = np.zeros(S + 1, np.int32)
    q_indptr[1:] = np.cumsum(q_lens)
    bucket = next(b for b in cfg.buckets if b >= q_indptr[-1]) \
        if q_indptr[-1] else 0
    tokens = tokens[:bucket]
    for r, feed in feeds.items():
      tokens[q_indptr[r]:q_indptr[r] + len(feed)] = feed

    # Admissions: while rows are free and the prefill backlog is short.
    admit_ids = np.full(A, -1, np.int32)
    admit_tokens = np.zeros((A, cfg.max_model_len), np.int32)
    admit_lens = np.zeros(A, np.int32)
    admit_scope = np.zeros(A, np.int32)
    admitted = []
    backlog = sum(len(r.tokens) - r.num_computed for r in self.running
                  if r.status is PREFILL)
    while (self.waiting and self.free_rows and len(admitted) < A
           and backlog < 2 * T):
      # Inputs first, then the queues: a failing request loses no row.
      req, row, i = self.waiting[0], self.free_rows[0], len(admitted)
      try:
        toks = req.tokens
        admit_tokens[i, :len(toks)] = toks
        admit_lens[i] = len(toks)
        admit_scope[i] = req.reuse_scope
      except Exception as e:
        admit_tokens[i], admit_lens[i], admit_scope[i] = 0, 0, 0
        self.fail(req, e)  # it holds no row yet
        continue
      admit_ids[i] = row
      self.waiting.popleft()
      self.free_rows.pop(0)
      req.seq_id = row
      admitted.append(req)
      backlog += len(toks)

    commit_ids, commit_lens, release_ids = self.release_inputs()
    inputs = _programs.StepInputs(
        tokens=tokens, q_indptr=q_indptr, kv_lens=kv_lens,
        sample_rows=sample_rows, temperature=temperature, top_k=top_k,
        top_p=top_p, seeds=seeds, gen_index=gen_index, commit_ids=commit_ids,
        commit_lens=commit_lens, prompt_commit_ids=prompt_commit_ids,
        release_ids=release_ids,
        extend_ids=extend_ids, admit_ids=admit_ids, admit_tokens=admit_tokens,
        admit_lens=admit_lens, admit_scope=admit_scope)
    return ScheduledStep(inputs, greedy_only=not np.any(temperature > 0),
                         rows=tuple(rows), admitted=tuple(admitted))

  def release_inputs(self):
    """`(commit_ids, commit_lens, release_ids)`, i32[max_seqs] each, of the
    rows in `to_release` (published, then released; -1 = none)."""
    S = self.config.max_seqs
    commit_ids = np.full(S, -1, np.int32)
    commit_lens = np.zeros(S, np.int32)
    release_ids = np.full(S, -1, np.int32)
    commits = {}  # one entry per row: a duplicated id would void the commit
    for row, n in self.to_release:
      commits[row] = max(n, commits.get(row, 0))
    for i, (row, n) in enumerate(sorted(commits.items())):
      commit_ids[i], commit_lens[i] = row, n
    for i, (row, _) in enumerate(self.to_release):
      release_ids[i] = row
    return commit_ids, commit_lens, release_ids

  def take_released_rows(self) -> list[tuple[int, int]]:
    """Marks the rows of `to_release` free: the program about to run
    releases them (its inputs were built by `release_inputs`). Returns
    them, for `unschedule`."""
    taken = self.to_release
    for row, _ in taken:
      self.free_rows.append(row)
    self.to_release = []
    self.free_rows.sort()
    return taken

  def unschedule(self, scheduled: ScheduledStep,
                 taken: list[tuple[int, int]]) -> None:
    """Undoes `scheduled` and `take_released_rows` (which returned `taken`)
    when its program did not run: its admissions go back to the queue front
    in order, their rows and the `taken` rows are no longer free (the rows
    wait to be released by the next program)."""
    for req in reversed(scheduled.admitted):
      self.free_rows.append(req.seq_id)
      req.seq_id = -1
      self.waiting.appendleft(req)
    for row, _ in taken:
      self.free_rows.remove(row)
    self.to_release = list(taken) + self.to_release
    self.free_rows.sort()

  # -------------------------------------------------------------- bursts
  def burst_eligible(self) -> bool:
    """Multi-step decode applies when nothing but decoding can happen: every
    running request decodes (with at most `MAX_STOP_IDS` stop ids) and no
    waiting request could get a row."""
    if self.config.decode_steps <= 1 or not self.running:
      return False
    if self.waiting and (self.free_rows or self.to_release):
      return False  # a step admits them (released rows free up in it)
    return all(r.status is DECODE and len(r.stop_ids) <= MAX_STOP_IDS
               for r in self.running)

  def burst_greedy(self) -> bool:
    """Whether every running request is greedy: the burst's variant then has
    no `lax.cond`, i.e. no device-to-host sync per iteration."""
    return all(r.params.temperature <= 0 for r in self.running)

  def burst_inputs(self) -> _programs.BurstInputs:
    """Host inputs of a burst over the running (decoding) requests."""
    S = self.config.max_seqs
    active = np.zeros(S, bool)
    last = np.zeros(S, np.int32)
    computed = np.zeros(S, np.int32)
    remaining = np.zeros(S, np.int32)
    stop_ids = np.full((S, MAX_STOP_IDS), -1, np.int32)
    temperature = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    seeds = np.zeros(S, np.uint32)
    gen_index = np.zeros(S, np.int32)
    for req in list(self.running):
      r, sp = req.seq_id, req.params
      try:
        stops = [] if sp.ignore_eos else sorted(req.stop_ids)
        last[r] = req.output[-1]
        computed[r] = req.num_computed
        remaining[r] = sp.max_new_tokens - len(req.output)
        stop_ids[r, :len(stops)] = stops
        temperature[r], top_k[r], top_p[r] = sp.temperature, sp.top_k, sp.top_p
        seeds[r] = np.uint32(sp.seed & 0xFFFFFFFF)
        gen_index[r] = len(req.output)
      except Exception as e:  # this request alone: clear its row, fail it
        for arr, v in ((last, 0), (computed, 0), (remaining, 0),
                       (stop_ids, -1), (temperature, 0), (top_k, 0),
                       (top_p, 1), (seeds, 0), (gen_index, 0)):
          arr[r] = v
        self.fail(req, e)
        continue
      active[r] = True
    return _programs.BurstInputs(active, last, computed, remaining, stop_ids,
                                 temperature, top_k, top_p, seeds, gen_index,
                                 *self.release_inputs())

  def schedule_burst(self, prev: ScheduledStep | None = None,
                     carry: _programs.BurstCarry | None = None
                     ) -> ScheduledStep:
    """The next burst: from the running requests, or chained after the burst
    `prev` (not read yet) from its end state `carry` on the device
    (`programs.chain_inputs`). Takes the released rows either way."""
    if prev is None:
      inputs = self.burst_inputs()
    else:
      inputs = _programs.chain_inputs(prev.inputs, carry,
                                      *self.release_inputs())
    self.burst_taken = self.take_released_rows()
    return ScheduledStep(inputs, greedy_only=self.burst_greedy(),
                         burst_rows=self.burst_rows())

  def burst_rows(self) -> int:
    """The smallest row bucket (`EngineConfig.burst_buckets`) above every
    running request's row. Rows hand out lowest first, so a few requests
    sit in the first rows; a chained burst's active rows are among them."""
    top = max((r.seq_id for r in self.running), default=0) + 1
    return next(b for b in self.config.burst_buckets if b >= top)

  def can_chain(self) -> bool:
    """Whether the burst just dispatched (not read yet) can stay in flight
    while the next one runs (no check reads its errors).

    Nothing waiting: if some running request still has tokens to emit after
    it (by its length). Requests waiting for a row: only if no running
    request reaches its length in it, so a row that frees by length is
    given to a waiting request right after the burst that frees it; a row
    that frees by a stop token is seen one burst later (it idles for that
    burst: vLLM's async scheduling has the same lag)."""
    if self.config.check:
      return False
    k = self.config.decode_steps
    left = [r.params.max_new_tokens - len(r.output) for r in self.running]
    if self.waiting:
      return bool(left) and min(left) > k
    return any(n > k for n in left)

  # ------------------------------------------------------------- booking
  def update_from_output(self, scheduled: ScheduledStep, out) -> int:
    """Books a program's outputs (host arrays) into its requests; returns
    the tokens sampled.

    A step (`out`: `programs.StepOutputs`): each row's fed tokens count as
    computed, a sampling row gets `out.sampled[row]` (a prefill turns
    decode), and an `extend` refused (`out.extend_ok`) preempts it; then the
    admissions settle (`out.claim_ok`). A burst (`programs.BurstOutputs`):
    each running request gets the tokens of its row (`-1` = idle), one
    computed per token, and `out.preempted` preempts it. Either way a stop
    token or the length finishes the request (`check_stop`) first.

    Raises:
      RuntimeError: a refused claim that no running or finishing request can
        ever make room for (its prompt needs more slots than the pool has).
    """
    if scheduled.kind == "burst":
      num_sampled = 0
      for req in list(self.running):
        try:
          r = req.seq_id
          toks = [int(t) for t in out.tokens[:, r] if t >= 0]
          self._book(req, len(toks), toks, bool(out.preempted[r]))
          num_sampled += len(toks)
        except Exception as e:
          self.fail(req, e)
      return num_sampled
    num_sampled = 0
    for req, n, samples in scheduled.rows:
      if req.done:  # failed while its inputs were prepared
        continue
      try:
        r = req.seq_id
        sampled = [int(out.sampled[r])] if samples else []
        self._book(req, n, sampled, samples and not out.extend_ok[r])
        num_sampled += len(sampled)
      except Exception as e:
        self.fail(req, e)
    self._settle_claims(scheduled, out)
    return num_sampled

  def _book(self, req: Request, num_fed: int, sampled: list[int],
            preempted: bool) -> None:
    """Books `num_fed` computed tokens and the `sampled` ones of `req`, then
    finishes it (stop token / length) or else, if `preempted`, preempts it."""
    if req.status is PREFILL:
      self.stats.prefill_tokens += num_fed
    else:
      self.stats.decode_tokens += num_fed
    req.num_computed += num_fed
    if sampled:
      if req.status is PREFILL:
        req.status = DECODE  # its prompt was committed in the step
      req.output.extend(sampled)
      self.stats.generated_tokens += len(sampled)
      if req.first_token_step is None:
        req.first_token_step = self.stats.num_steps
      reason = check_stop(req)
      if reason is not None:
        req.status = FINISHED
        req.finish_reason = reason
        self.running.remove(req)
        self.to_release.append((req.seq_id, req.num_computed))
        self.finished.append(req)
        return
    if preempted:
      self._preempt(req)

  def _preempt(self, req: Request) -> None:
    """Out of slots for the next token: free its row, recompute it later
    from prompt + output (first in the queue)."""
    self.running.remove(req)
    self.to_release.append((req.seq_id, req.num_computed))
    req.status = WAITING
    req.seq_id = -1
    req.num_computed = 0
    req.num_preemptions += 1
    self.stats.num_preemptions += 1
    self.waiting.appendleft(req)

  def _settle_claim(self, i: int, req: Request, out) -> bool:
    """Settles admission `i` (`req`); returns whether its claim was refused
    (its row is then free again and it must go back to the queue)."""
    if out.claim_ok[i]:
      req.status = PREFILL
      self.stats.prompt_tokens += len(req.tokens)
      req.num_reused = int(out.claim_reused[i])
      req.num_computed = req.num_reused
      self.stats.reused_tokens += req.num_reused
      if self.stats.slots_saved_by_scratch is not None:
        ps = self.config.page_size
        wanted = -(-len(req.tokens) // ps) - req.num_reused // ps
        self.stats.slots_saved_by_scratch += wanted - int(
            out.claim_new_blocks[i])
      self.running.append(req)
      return False
    # Out of slots: back to the queue front, in arrival order.
    self.stats.num_refused_claims += 1
    self.free_rows.append(req.seq_id)
    req.seq_id = -1
    return True

  def _settle_claims(self, scheduled: ScheduledStep, out) -> None:
    """Admitted requests whose claims held start their prefill (from their
    reused tokens); refused ones go back to the queue front, in order."""
    refused = []
    for i, req in enumerate(scheduled.admitted):
      try:
        if self._settle_claim(i, req, out):
          refused.append(req)
      except Exception as e:
        self.fail(req, e)
    self.waiting.extendleft(reversed(refused))
    self.free_rows.sort()
    if (refused and not scheduled.rows and not self.running
        and not self.to_release):
      raise RuntimeError(
          f"Request {refused[0].request_id} needs "
          f"{-(-len(refused[0].tokens) // self.config.page_size)} slots but the "
          f"pool has only {self.pool_text}")
