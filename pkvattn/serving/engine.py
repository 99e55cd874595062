"""The continuous-batching engine: the loop that ties the serving modules.

Each `Engine.step()` is host scheduling (`serving.scheduler`: a mixed batch
of decode rows and chunked prefills, plus admissions), ONE compiled device
program (`serving.programs`: cache ops, model forward, sampling; the pool,
cache state and token buffer donated and carried through), and host
bookkeeping of its outputs after one device-to-host transfer. When every
running request decodes, `EngineConfig.decode_steps` iterations run in one
device call (a burst), chained so the host books one burst while the device
runs the next. Programs come from a small set known ahead of time
(`serving.compiler`), compiled by `warmup()` or on first use.

The jobs live in `serving.request`, `serving.scheduler`,
`serving.kv_manager`, `serving.compiler`, `serving.runner` and
`serving.programs` (`pkvattn.serving` lists them); docs/engine.md
describes the design and its reasons.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pkvattn.models import Model
from pkvattn.sampling import SamplingParams
from pkvattn.serving import programs as _programs
from pkvattn.serving import runner as _runner
from pkvattn.serving.compiler import Compiler
from pkvattn.serving.compiler import ProgramKey
from pkvattn.serving.compiler import model_position
from pkvattn.serving.compiler import program_inputs
from pkvattn.serving.config import EngineConfig
from pkvattn.serving.config import kv_dtype as _kv_dtype
from pkvattn.serving.config import slots_for_memory as _slots_for_memory
from pkvattn.serving.host_tier import HostTier
from pkvattn.serving.kv_manager import KVCacheManager
from pkvattn.serving.request import Request
from pkvattn.serving.request import RequestLimits
from pkvattn.serving.request import RequestStatus
from pkvattn.serving.request import make_request
from pkvattn.serving.request import make_requests
from pkvattn.serving.scheduler import ScheduledStep
from pkvattn.serving.scheduler import Scheduler
from pkvattn.serving.stats import EngineStats

# The host tier's copies to the host queued after a program's outputs are
# read: those taking about this share of that program's time (they run
# beside the next program; see `HostTier.flush`).
FLUSH_SHARE = 0.5


class Engine:
  """Continuous-batching generation with paged attention and prefix reuse.

  Example:
    >>> from pkvattn.models import load_model
    >>> engine = Engine(load_model("tiny-llama"), EngineConfig(page_size=8))
    >>> outs = engine.generate([[256, 72, 105]], SamplingParams(max_new_tokens=4))
    >>> len(outs[0])
    4

  Tensor parallel (`pkvattn.parallel`): pass `mesh=pkvattn.parallel.make_mesh(2)`
  (a mesh with a "tp" axis). The model is laid out by
  `pkvattn.parallel.shard_model` (heads / MLP columns sliced, kv heads
  replicated when tp > num_kv_heads; `engine.model` is the sharded model),
  the pool is sharded on its kv-head axis, and the cache state, token buffer
  and step inputs are replicated; each step's forward runs under one
  `shard_map`.

  Attributes:
    model, config, cache_config, mesh: what the engine runs (`config` with
      `num_slots` derived from `kv_cache_memory` where set).
    pool: the KV pages, `[num_pages, page_size, num_kv_heads, head_dim]`;
      FP8 pages on the XLA path as their `uint8` bytes
      (`serving.kv_manager`; `pkvattn._kv.from_bytes` reads them), the
      page dtype in `stats.kv_cache_dtype`.
    state: the cache state (`pkvattn.cache`); `seq_tokens`: i32[max_seqs,
      max_model_len], each row's tokens.
    stats: an `EngineStats`; compile_times / lower_times: seconds per
      `ProgramKey` (`serving.compiler.Compiler`).
    scheduler, compiler, kv: the `Scheduler`, `Compiler` and
      `KVCacheManager` the loop ties together.
    last_inputs, last_program: the last step's `StepInputs` and program.
  """

  def __init__(self, model: Model, config: EngineConfig = EngineConfig(),
               *, pool_dtype=None, mesh: jax.sharding.Mesh | None = None):
    """Raises ValueError: the model's heads do not split over `mesh` ("tp")."""
    self.mesh = mesh
    dtype = pool_dtype or _kv_dtype(config, model.params["embed"].dtype)
    model = _runner.prepare_model(model, config, mesh, dtype)
    mcfg = model.cfg
    if config.kv_cache_memory is not None:
      config = dataclasses.replace(
          config, num_slots=_slots_for_memory(config, mcfg, dtype))
    self._fp8 = jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)
    self._needs_calibration = self._fp8 and config.k_scale is None
    # FP8 scales, calibrated or given, are checked once against the first
    # requests' prompts (`_calibrate`).
    self._needs_scale_check = self._fp8
    self.model = model
    self.config = config
    self.kv = KVCacheManager(config, mcfg, dtype)
    self.cache_config = self.kv.cache_config
    self.pool, self.state, self.seq_tokens = self.kv.allocate(mesh)
    self._inputs_sharding = None
    if mesh is not None:
      from pkvattn import parallel as _parallel  # parallel imports models
      self._inputs_sharding = _parallel.replicated(mesh)
    self.stats = EngineStats()
    self.kv.start_stats(self.stats)
    # The host KV tier (`serving.host_tier`), None when off. `_num_free`:
    # the pool's free slots after the last program read, which tells when
    # blocks must be mirrored to the host before a program.
    self.host_tier: HostTier | None = None
    if config.host_kv_cache_bytes:
      self.host_tier = HostTier(
          config, self.cache_config, self.kv.pool_shape, dtype,
          mcfg.num_layers, self.kv.block_bytes, hybrid=self.kv.hybrid,
          scratch=self.kv.scratch, mesh=mesh)
      self.host_tier.stats_into(self.stats)
    self._num_free = self.kv.max_slots
    self.stats.kv_scales_calibrated = self._fp8 and not self._needs_calibration
    self.compiler = Compiler(mcfg, config, mesh, self.stats,
                             self._inputs_sharding)
    self.compile_times, self.lower_times = (self.compiler.compile_times,
                                            self.compiler.lower_times)
    self.scheduler = Scheduler(config, self.stats,
                               prefill_in_one_step=self.kv.scratch,
                               pool_text=self.kv.pool_text)
    self._limits = RequestLimits(
        max_model_len=config.max_model_len, page_size=config.page_size,
        max_slots=self.kv.max_slots, pool_text=self.kv.pool_text,
        vocab_size=mcfg.vocab_size,
        max_prefill_tokens=config.max_num_tokens if self.kv.scratch else None,
        default_stop_ids=frozenset(mcfg.eos_token_ids))
    # Unfinished requests, and finished ones not yet dropped: `_history`
    # holds the ids of the latest `config.finished_history` finished ones.
    self._requests: dict[int, Request] = {}
    self._history: collections.deque[int] = collections.deque()
    self._next_id = 0
    # A dispatched burst the host has not read yet: `(BurstOutputs of device
    # arrays, its ScheduledStep)` (see `_burst`).
    self._inflight: tuple[Any, ScheduledStep] | None = None
    self.last_inputs: _programs.StepInputs | None = None
    self.last_program: ProgramKey | None = None

  # ------------------------------------------------------------- programs
  def programs(self) -> tuple[ProgramKey, ...]:
    """Every program this engine may run (`serving.compiler.program_keys`)."""
    return self.compiler.keys()

  def warmup(self, progress: bool | Callable[[ProgramKey, float], Any] = False,
             max_workers: int | None = None) -> dict[ProgramKey, float]:
    """Compiles every program of `programs()` ahead of time.

    After it, no step, burst or request of any kind compiles anything.
    Programs are lowered one after the other in this thread while XLA
    compiles the ones already lowered in worker threads; with
    `EngineConfig.compile_cache_dir` set, programs saved there are loaded
    instead, in the worker threads (no tracing, lowering or compiling). FP8
    pages without given scales also compile their calibration prefill here.

    Args:
      progress: True = a tqdm bar on stderr; a callable is called as
        `progress(key, seconds)` after each program.
      max_workers: compile threads; None = min(#programs, os.cpu_count()).

    Returns:
      `{ProgramKey: seconds}` for each program, from the start of its
      lowering to the end of its compilation (programs overlap); the total
      wall time is added to `stats.warmup_time_s`.
    """
    t_start = time.perf_counter()
    if self._needs_scale_check:  # compiles the calibration prefills
      self._calibrate([[0]], record=False)
    times = self.compiler.warmup(self._buffers(), progress, max_workers)
    if self.host_tier is not None:  # its copy programs, at every size
      self.pool = self.host_tier.warmup(
          self.pool, self.state, (self.config.num_admit,
                                  self.config.max_model_len))
    self.stats.warmup_time_s += time.perf_counter() - t_start
    return times

  def _buffers(self):
    return self.model.params, self.pool, self.state, self.seq_tokens

  def _lower(self, key: ProgramKey):
    """`jax.stages.Lowered` of program `key` (HLO checks in tests, bench)."""
    return self.compiler.lower(key, self._buffers())

  def _run(self, scheduled: ScheduledStep):
    """Runs the programs of `scheduled` (`Compiler.sequence`: a model program
    and a cache program) on the engine's buffers (donated) and keeps their
    new buffers; returns `(outputs, seconds spent compiling them, checkify
    error or None)`. A step's outputs are its cache program's with the
    model program's `sampled`; a burst's are its model program's. Both
    programs are compiled before either runs. Checked mode: the error is
    the first contract violation of the calls, which the caller raises
    (`err.throw()`: a `checkify.JaxRuntimeError`) once it has kept the new
    buffers and booked or undone the step."""
    key = self.compiler.key(scheduled.kind, scheduled.num_tokens,
                            scheduled.greedy_only)
    self.last_program = key
    compile_s = self.stats.compile_time_s
    keys = self.compiler.sequence(key)
    programs = [self.compiler.program(k, self._buffers()) for k in keys]
    compile_s = self.stats.compile_time_s - compile_s
    outs, errs = [], []
    for k, program in zip(keys, programs):
      result, err = _runner.run_program(
          program, self._buffers(), program_inputs(k, scheduled.inputs),
          check=self.config.check, inputs_sharding=self._inputs_sharding)
      self.pool, self.state, self.seq_tokens, out = result
      outs.append(out)
      errs.append(err)
    # Checked mode: the first program's violation, if any (`get()` reads
    # the error back from the device).
    err = next((e for e in errs if e is not None and e.get() is not None),
               errs[-1])
    out = outs[-1]
    at = model_position(key)
    if at is not None and at != len(outs) - 1:  # a step: its cache program last
      out = out.replace(sampled=outs[at])
    return out, compile_s, err

  # ------------------------------------------------------------------ API
  def _enqueue(self, req: Request) -> int:
    req.request_id = self._next_id
    self._next_id += 1
    self._requests[req.request_id] = req
    self.scheduler.add(req)
    return req.request_id

  def add_request(self, prompt: Sequence[int],
                  params: SamplingParams = SamplingParams(),
                  reuse_scope: int = 0) -> int:
    """Queues a request; returns its id.

    Args:
      prompt: token ids (a sequence of ints or a 1-D integer array).
      params: how the request samples and stops.
      reuse_scope: salts the prefix cache (tenant / adapter): blocks are
        reused only between requests of the same scope; an int32.

    Raises:
      ValueError: a prompt that is not a sequence of token ids (e.g. a str),
        an empty prompt, prompt + max_new_tokens over max_model_len or over
        the pool (`num_slots * page_size`), token ids (prompt or stop ids)
        outside the vocabulary, `reuse_scope` outside int32. Nothing is
        queued then.
    """
    return self._enqueue(make_request(prompt, params, self._limits,
                                      reuse_scope))

  def get_request(self, request_id: int) -> Request:
    """The request `request_id` (`add_request`'s id): unfinished, or among
    the latest `config.finished_history` finished ones not yet returned by
    `generate`.

    Raises:
      KeyError: an id this engine never gave, or of a finished request it
        dropped (returned by `generate`, or older than the history).
    """
    try:
      return self._requests[request_id]
    except KeyError:
      if isinstance(request_id, int) and 0 <= request_id < self._next_id:
        raise KeyError(
            f"Request {request_id} finished and was dropped (returned by "
            f"generate, or older than the last finished_history="
            f"{self.config.finished_history} finished requests)") from None
      raise KeyError(f"Unknown request_id: expected an id in [0, "
                     f"{self._next_id}), got {request_id!r}") from None

  def _retire(self) -> None:
    """Moves newly finished requests into the bounded history, dropping the
    oldest beyond `config.finished_history`."""
    for req in self.scheduler.take_finished():
      self._history.append(req.request_id)
    while len(self._history) > self.config.finished_history:
      self._requests.pop(self._history.popleft(), None)

  def has_unfinished(self) -> bool:
    """Whether a request waits or runs, or a dispatched burst is unread."""
    return bool(self.scheduler.waiting or self.scheduler.running
                or self._inflight)

  def generate(self, prompts: Sequence[Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
               progress: Callable[[int], Any] | None = None) -> list[list[int]]:
    """Runs all prompts to completion; returns generated ids per prompt.

    Every request is validated before any is queued: on a ValueError nothing
    was queued. `progress(n)` is called after each step with the tokens
    generated in it. The requests are dropped from the engine when returned
    (`get_request` no longer finds them). A request that failed alone in a
    step (`finish_reason == "error"`) returns the tokens it had, and a
    `RuntimeWarning` names it and its error.

    Raises:
      ValueError: `params` is a sequence whose length differs from
        `prompts`', or a request is invalid (see `add_request`).
    """
    reqs = make_requests(prompts, params, self._limits)
    for r in reqs:
      self._enqueue(r)
    while self.has_unfinished():
      n = self.step()
      if progress is not None:
        progress(n)
    for i, r in enumerate(reqs):
      self._requests.pop(r.request_id, None)
      if r.finish_reason == "error":
        warnings.warn(f"prompts[{i}] (request {r.request_id}) failed: "
                      f"{r.error}", RuntimeWarning, stacklevel=2)
    return [r.output for r in reqs]

  # ----------------------------------------------------------------- step
  def step(self) -> int:
    """Runs one engine step (or burst); returns the number of tokens it
    booked into requests' outputs.

    While decoding in chained bursts (`EngineConfig.decode_steps`), a call
    dispatches the next burst and books the one before it: outputs lag the
    device by one burst, and `has_unfinished()` stays true until the last
    burst is read.

    An exception while one request's inputs are prepared or its outputs
    booked finishes that request alone (`finish_reason="error"`,
    `Request.error`); the others go on. An exception that belongs to no
    request (a program fails to compile or run, a checked-mode violation)
    is raised after the queues are left consistent: if the step's programs
    did not run, its admissions go back to the queue front and its released
    rows stay to be released; if they ran, its outputs are booked first.

    Raises:
      RuntimeError: a waiting request can never be admitted (its prompt needs
        more slots than the whole pool has).
    """
    try:
      return self._step()
    finally:
      self._retire()

  def _step(self) -> int:
    if self._needs_scale_check and self.scheduler.waiting:
      self._calibrate([r.tokens for r in self.scheduler.waiting])
    if self._burst_eligible():
      return self._burst()
    drained = self._drain()
    if not self.scheduler.has_work():
      return drained
    t0 = time.perf_counter()
    scheduled = self.scheduler.schedule()
    released = self.scheduler.take_released_rows()
    self.last_inputs = scheduled.inputs
    has_prefill = any(row.request.status is RequestStatus.PREFILL
                      for row in scheduled.rows)
    if self.host_tier is not None:  # mirror what the step may evict
      bound = self.host_tier.step_bound(scheduled.inputs)
      if released and self.host_tier.would_plan(bound, self._num_free):
        scheduled = self._release_first(scheduled, released)
        released = []
      self.host_tier.offload(self.pool, self.state, bound, self._num_free,
                             self.stats)
    t1 = time.perf_counter()
    try:
      out, compile_s, err = self._run(scheduled)
    except Exception:
      self.scheduler.unschedule(scheduled, released)
      raise
    out = jax.device_get(out)  # the one device -> host sync
    t2 = time.perf_counter()
    num_sampled = self.scheduler.update_from_output(scheduled, out)
    self.kv.record_usage(self.stats, out.used_slots)
    self._note_free(out.num_free)
    if self.host_tier is not None:
      self._host_reload(scheduled, out)
      self._flush_host_tier(t2 - t1)
    if err is not None:  # checked mode: raises a violation after booking
      err.throw()
    self.stats.num_steps += 1
    t3 = time.perf_counter()
    self.stats.host_time_s += (t1 - t0) + (t3 - t2)
    if has_prefill:
      self.stats.prefill_time_s += t3 - t0 - compile_s
    elif scheduled.rows:
      self.stats.decode_time_s += t3 - t0 - compile_s
    return drained + num_sampled

  def _calibrate(self, prompts, record: bool = True):
    """FP8 scales of every layer from a prefill of the first prompts
    (`runner.calibrate`) unless given, then checked against a prefill of
    the same prompts (`runner.check_scales`): the saturated K and V values
    go to `stats.kv_saturated_values`, and a `RuntimeWarning` names each
    layer and K / V whose scale saturates more than
    `calibrate.FP8_SATURATION_WARN` (0.1%) of its values or maps its largest
    value below 1 of e4m3's 448 (`ScaleCheck.problems`). The engine warns
    rather than refuses: the scales still give finite, if inaccurate,
    attention. `record=False` only compiles the two prefills."""
    model = self.model
    if self._needs_calibration:
      model = _runner.calibrate(model, self.config, prompts)
    check = _runner.check_scales(model, self.config, prompts)
    if not record:
      return
    self.model = model
    self._needs_calibration = False
    self._needs_scale_check = False
    self.stats.kv_scales_calibrated = True
    self.stats.kv_saturated_values = check.num_saturated
    problems = check.problems()
    if problems:
      warnings.warn(
          "FP8 KV scales fit the first prompts badly (the pool stores x / "
          "scale clipped to +-448):\n  " + "\n  ".join(problems),
          RuntimeWarning, stacklevel=3)

  # --------------------------------------------------------------- bursts
  def _burst_eligible(self) -> bool:
    """Multi-step decode applies (`Scheduler.burst_eligible`)."""
    return self.scheduler.burst_eligible()

  def _burst(self) -> int:
    """`decode_steps` decode iterations in one device call (see EngineConfig).

    Bursts are chained (`Scheduler.can_chain`): the next burst is dispatched
    before this one's tokens are read, with its per-row inputs taken from
    this one's end state on the device (`programs.chain_inputs`), so the
    host reads and books one burst while the device runs the next (vLLM's
    async scheduling). Returns the tokens read in this call: those of the
    burst dispatched before it, if one was in flight, and this one's unless
    it stays in flight.
    """
    t0 = time.perf_counter()
    prev = self._inflight
    self._inflight = None
    if prev is None:
      scheduled = self.scheduler.schedule_burst()
    else:
      scheduled = self.scheduler.schedule_burst(prev[1], prev[0].carry)
    if prev is None and self.host_tier is not None:
      # Nothing in flight: mirror what this burst and the next may evict
      # (a chained burst plans nothing: its plan would wait for this one).
      bound = self.host_tier.burst_bound()
      taken = self.scheduler.burst_taken
      if taken and self.host_tier.would_plan(bound, self._num_free):
        scheduled = self._release_first(scheduled, taken)
        self.scheduler.burst_taken = []
      self.host_tier.offload(self.pool, self.state, bound, self._num_free,
                             self.stats)
    t1 = time.perf_counter()
    try:
      out, compile_s, err = self._run(scheduled)
    except Exception:  # it did not run: the burst before it stays to read
      self.scheduler.unschedule(scheduled, self.scheduler.burst_taken)
      self._inflight = prev
      raise
    host_s = t1 - t0
    num_sampled = 0
    if prev is not None:  # read while `out` runs
      num_sampled, dt = self._read_burst(*prev)
      host_s += dt
    if self.scheduler.can_chain():  # never in checked mode (`err` not None)
      self._inflight = (out, scheduled)
    else:
      n, dt = self._read_burst(out, scheduled)
      num_sampled += n
      host_s += dt
      if err is not None:  # checked mode: raises a violation after booking
        err.throw()
    if self.host_tier is not None:  # this call lasted about one burst
      self._flush_host_tier(time.perf_counter() - t0)
    self.stats.num_steps += self.config.decode_steps
    self.stats.host_time_s += host_s
    self.stats.decode_time_s += time.perf_counter() - t0 - compile_s
    return num_sampled

  def _release_first(self, scheduled: ScheduledStep,
                     released: list[tuple[int, int]]) -> ScheduledStep:
    """Publishes and releases the finished rows of `scheduled` in a
    program of their own (`step[no tokens]`, `programs.release_only`);
    returns `scheduled` without them. With a host tier: a step's claims or
    a burst's extends may evict the blocks of rows released in the same
    program, which a plan made before it cannot see (they are not
    evictable yet); released first, they are in the plan. If the program
    does not run, `scheduled` is undone (`Scheduler.unschedule` with the
    `released` rows); a checked-mode violation is raised after it ran."""
    only = ScheduledStep(_programs.release_only(self.config,
                                                scheduled.inputs),
                         greedy_only=True)
    try:
      out, _, err = self._run(only)
    except Exception:
      self.scheduler.unschedule(scheduled, released)
      raise
    self._note_free(jax.device_get(out.num_free))  # the plan syncs anyway
    if err is not None:
      try:
        err.throw()
      except Exception:
        self.scheduler.unschedule(scheduled, [])  # its rows are free now
        raise
    return dataclasses.replace(
        scheduled, inputs=_programs.without_release(scheduled.inputs))

  def _drain(self) -> int:
    """Reads the burst in flight, if any; returns its tokens."""
    if self._inflight is None:
      return 0
    prev = self._inflight
    self._inflight = None
    t0 = time.perf_counter()
    n, dt = self._read_burst(*prev)
    self.stats.host_time_s += dt
    self.stats.decode_time_s += time.perf_counter() - t0
    return n

  def _read_burst(self, out, scheduled: ScheduledStep) -> tuple[int, float]:
    """Books a burst's tokens into its requests (finished ones are released
    by the next program, preempted ones requeued). Returns the tokens and
    the host seconds spent after the device's results arrived."""
    out = jax.device_get(out.replace(carry=None))
    t0 = time.perf_counter()
    num_sampled = self.scheduler.update_from_output(scheduled, out)
    self.kv.record_usage(self.stats, out.used_slots)
    self._note_free(out.num_free)
    return num_sampled, time.perf_counter() - t0

  def _note_free(self, num_free) -> None:
    """Keeps a program's free-slot count (host array; `[groups]` when
    hybrid: the smallest group's) for the host tier's plans."""
    self._num_free = int(np.min(num_free))

  def _flush_host_tier(self, program_s: float) -> None:
    """Queues the host tier's copies to the host (`HostTier.flush`) that
    take about `FLUSH_SHARE` of `program_s`, the time of the program whose
    outputs were just read: they run beside the next one, and its outputs'
    read does not wait for them."""
    self.host_tier.flush(self.stats, FLUSH_SHARE * program_s)

  def _host_reload(self, scheduled: ScheduledStep, out) -> None:
    """After a step: reloads the blocks of its newly admitted requests
    found on the host (`HostTier.reload`); each then prefills from after
    them."""
    tier = self.host_tier
    reqs = [(i, req) for i, req in enumerate(scheduled.admitted)
            if out.claim_ok[i] and req.status is RequestStatus.PREFILL]
    self.pool, _ = tier.reload(self.pool, self.state, scheduled.inputs, reqs,
                               self.stats)

  # -------------------------------------------------------------- profile
  def profile(self, iters: int = 10) -> dict:
    """Times the pieces of the next step (`pkvattn.serving.profile.profile`)."""
    self._drain()
    from pkvattn.serving import profile as _profile
    return _profile.profile(self, iters)
