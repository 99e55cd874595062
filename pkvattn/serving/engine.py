"""The continuous-batching engine: host scheduling over the device programs.

Each `step()`:

1. **Host scheduling** (plain Python over a few dozen requests): every running
   request gets a row of the step's ragged batch: decode rows feed their last
   sampled token (1 token), prefill rows feed the next chunk of their prompt
   under a static token budget (`max_num_tokens`, chunked prefill), all in ONE
   mixed batch. Waiting requests are admitted while rows are free.
2. **One compiled device program** (`serving.programs`; the pool, the cache
   state and the token buffer are donated and carried through):
   `commit` (publish the full blocks of prompts finished last step, and of
   sequences ending) → `release` (finished / preempted) → per-layer page tables
   → model forward (every layer runs `paged_prefill` on the mixed batch) →
   sampling (greedy / temperature / top-k / top-p, seeded per request) →
   `extend` by one token for rows that keep decoding (reserving the slot the
   next token needs) → `claim_batch` for the admitted requests (prefix reuse,
   two-phase). Admitted requests start their prefill in the next step, from
   `num_reused_tokens`.
3. **Host bookkeeping** of the results (one device→host transfer per step):
   append sampled tokens, stop on EOS / `max_new_tokens`, and when the pool is
   full (an `extend` or a claim refused) the request waits, or is preempted
   and later recomputed from its prompt + generated tokens (vLLM's recompute
   preemption), never failed.

Multi-step decode (`EngineConfig.decode_steps > 1`): when every running request
is decoding and nothing waits for a free row, `decode_steps` decode iterations
run in one device call (`lax.scan`, sampled tokens fed back on device, stop
tokens / max lengths checked on device; one `extend` up front reserves the
burst's tokens and one set of page tables serves it), amortising the host work.

**Compile once.** Shapes are static and the programs an engine may run are a
small known set (`Engine.programs()`, `serving.programs.program_keys`: token
buckets × greedy / sampled, plus the burst's two variants; 6 for the default
buckets with bursts). `Engine.warmup()` compiles all of them ahead
of time (in parallel threads), after which no workload compiles anything: the
engine calls the compiled executables directly. Without `warmup()` a program
is compiled on its first use (its compile time is kept out of the
tokens/s figures). `EngineConfig.compile_cache_dir` turns on JAX's persistent
compilation cache, so a second process with the same model and config loads
its programs instead of compiling them.

Row `r` of the batch is always sequence id `r` of the cache, so the page tables
are the cache's tables for `seq_ids = arange(max_seqs)`, rows without tokens
this step simply have `q_len = 0`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import sys
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pkvattn import _checks
from pkvattn import _contract
from pkvattn import cache as _cache
from pkvattn.models import Model
from pkvattn.models import calibrate as _calibrate
from pkvattn.models import decoder as _decoder
from pkvattn.sampling import SamplingParams
from pkvattn.serving import compile_cache as _compile_cache
from pkvattn.serving import programs as _programs
from pkvattn.serving.config import EngineConfig
from pkvattn.serving.config import cache_config as _cache_config
from pkvattn.serving.config import group_slots as _group_slots
from pkvattn.serving.config import kv_dtype as _kv_dtype
from pkvattn.serving.config import slots_for_memory as _slots_for_memory
from pkvattn.serving.config import num_pool_pages as _num_pool_pages
from pkvattn.serving.config import Request
from pkvattn.serving.programs import MAX_STOP_IDS
from pkvattn.serving.programs import ProgramKey
from pkvattn.serving.stats import EngineStats


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
  """

  def __init__(self, model: Model, config: EngineConfig = EngineConfig(),
               *, pool_dtype=None, mesh: jax.sharding.Mesh | None = None):
    """Raises ValueError: the model's heads do not split over `mesh` ("tp")."""
    self.mesh = mesh
    if mesh is not None:
      from pkvattn import parallel as _parallel  # parallel imports models
      model = _parallel.shard_model(model, mesh)
    if not config.scan_layers:
      params = _decoder.unstack_layers(model.params)
      if mesh is not None:
        params = jax.device_put(params, jax.tree.map(
            lambda s: jax.sharding.NamedSharding(mesh, s),
            _parallel.param_specs(params)))
      model = dataclasses.replace(model, params=params)
    if mesh is None:
      # One matmul for q/k/v and one for gate/up: XLA's own dot merger fuses
      # them too, but by concatenating the weights inside a Triton gemm
      # fusion every step (0.41 ms more per decode step at Llama-3.2-1B's
      # shape, H200).
      model = dataclasses.replace(
          model, params=_decoder.fuse_projections(model.params))
    mcfg = model.cfg
    dtype = pool_dtype or _kv_dtype(config, model.params["embed"].dtype)
    if config.kv_cache_memory is not None:
      config = dataclasses.replace(
          config, num_slots=_slots_for_memory(config, mcfg, dtype))
    # FP8 pages: per-layer scales live in the layer parameters (inputs of the
    # programs, so calibrating later compiles nothing).
    self._fp8 = jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)
    self._needs_calibration = self._fp8 and config.k_scale is None
    if self._fp8:
      model = dataclasses.replace(model, params=_calibrate.set_kv_scales(
          model.params, config.k_scale or 1.0, config.v_scale or 1.0))
    self.model = model
    self.config = config
    self.cache_config = _cache_config(config, mcfg)
    pool_shape = (_num_pool_pages(self.cache_config), config.page_size,
                  mcfg.num_kv_heads, mcfg.head_dim)
    self.state = _cache.init_cache(self.cache_config)
    self.seq_tokens = jnp.zeros((config.max_seqs, config.max_model_len),
                                jnp.int32)
    self._inputs_sharding = None
    if mesh is None:
      self.pool = jnp.zeros(pool_shape, dtype)
    else:
      # Allocated sharded: no device ever holds the whole pool.
      self.pool = jax.jit(lambda: jnp.zeros(pool_shape, dtype),
                          out_shardings=_parallel.pool_sharding(mesh))()
      self._inputs_sharding = _parallel.replicated(mesh)
      self.state, self.seq_tokens = jax.device_put(
          (self.state, self.seq_tokens), self._inputs_sharding)
    # Scratch blocks live for one step: with scratch active (all-SWA models,
    # or a sliding group of per-group spaces) a prompt is prefilled in one
    # step.
    self._hybrid = isinstance(self.cache_config, _cache.HybridCacheConfig)
    self._group_configs = (self.cache_config.group_configs if self._hybrid
                           else (self.cache_config,))
    self._scratch = any(c.swa_scratch_active for c in self._group_configs)
    self._min_slots = min(_group_slots(self.cache_config))
    itemsize = jnp.dtype(dtype).itemsize
    self._block_bytes = (2 * config.page_size * mcfg.num_kv_heads
                         * mcfg.head_dim * itemsize)  # one layer, K and V
    # greedy / sampled as separate programs only where a lax.cond syncs the
    # host (GPU); elsewhere one program serves both.
    self._split_variants = _checks.is_gpu()
    if config.compile_cache_dir is not None:
      _compile_cache.enable(config.compile_cache_dir)
    # Compiled executables by ProgramKey (filled by warmup or on first use).
    self._compiled: dict[ProgramKey, Any] = {}
    self._compile_lock = threading.Lock()
    self.compile_times: dict[ProgramKey, float] = {}  # seconds per program
    self.lower_times: dict[ProgramKey, float] = {}    # of which tracing + lowering

    self._requests: dict[int, Request] = {}
    self._waiting: collections.deque[Request] = collections.deque()
    self._running: list[Request] = []       # admitted, in admission order
    self._free_rows = list(range(config.max_seqs))
    self._to_release: list[tuple[int, int]] = []   # (row, committed len)
    # A dispatched burst whose outputs the host has not read yet, with its
    # inputs: `(BurstOutputs of device arrays, BurstInputs)` (see `_burst`).
    self._inflight: tuple[Any, Any] | None = None
    self._next_id = 0
    self._default_stop = frozenset(mcfg.eos_token_ids)
    self.stats = EngineStats()
    if self._scratch and not self._hybrid:
      self.stats.slots_saved_by_scratch = 0
    self.stats.peak_group_slots = (0,) * len(self._group_configs)
    if self._hybrid and self.cache_config.groups[0].window_left < 0:
      self.stats.flat_peak_kv_bytes = 0
    self.stats.kv_cache_dtype = str(jnp.dtype(dtype))
    self.stats.kv_cache_bytes = int(np.prod(pool_shape)) * itemsize
    self.stats.kv_scales_calibrated = self._fp8 and not self._needs_calibration
    self.last_inputs: _programs.StepInputs | None = None
    self.last_program: ProgramKey | None = None

  # ------------------------------------------------------------- programs
  def programs(self) -> tuple[ProgramKey, ...]:
    """Every program this engine may run (`serving.programs.program_keys`)."""
    return _programs.program_keys(self.config, self._split_variants)

  def _variant(self, kind: str, num_tokens: int,
               greedy_only: bool) -> ProgramKey:
    """The program for a call (greedy-only calls may take the sampled one)."""
    return ProgramKey(kind, num_tokens,
                      bool(greedy_only) and self._split_variants)

  def _lower(self, key: ProgramKey):
    fn = _programs.jitted_program(self.model.cfg, self.config, self.mesh,
                                  key.kind, key.greedy_only)
    if key.kind == "step":
      inputs = _programs.step_input_shapes(self.config, key.num_tokens)
    else:
      inputs = _programs.burst_input_shapes(self.config)
    if self._inputs_sharding is not None:
      inputs = jax.tree.map(
          lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                         sharding=self._inputs_sharding),
          inputs)
    with _contract.checked(self.config.check):
      return fn.lower(self.model.params, self.pool, self.state,
                      self.seq_tokens, inputs)

  def _run(self, program, inputs):
    """Calls a compiled program on the engine's buffers (donated) and keeps
    its new buffers; returns its outputs. Checked mode: raises the first
    contract violation (`checkify.JaxRuntimeError`) after the call."""
    if self._inputs_sharding is not None:
      inputs = jax.device_put(inputs, self._inputs_sharding)
    # Else host arrays go to the executable as they are: its C++ call path
    # copies them (0.1 against 0.3 ms per call for a burst's 13 arrays by
    # jax.device_put, CPU; more on a GPU, one transfer each).
    result = program(self.model.params, self.pool, self.state,
                     self.seq_tokens, inputs)
    err = None
    if self.config.check:
      err, result = result
    self.pool, self.state, self.seq_tokens, out = result
    if err is not None:
      err.throw()
    return out

  def _memo_key(self, key: ProgramKey):
    return (self.model.cfg, self.config, self.mesh, key,
            _programs.signature(self.model.params, self.pool, self.state,
                                self.seq_tokens))

  def _compile(self, key: ProgramKey, memo_key, lowered, t0: float):
    """Compiles `lowered` (once per process and `memo_key`) and records it."""
    compiled = _programs.compiled_program(
        memo_key, None if lowered is None else lowered.compile)
    dt = time.perf_counter() - t0
    with self._compile_lock:
      self._compiled[key] = compiled
      self.compile_times[key] = dt
      self.stats.compile_time_s += dt
      self.stats.num_compiles += 1
    return compiled

  def _program(self, key: ProgramKey):
    """The compiled executable of `key`, compiled now if `warmup` did not."""
    compiled = self._compiled.get(key)
    if compiled is not None:
      return compiled
    t0 = time.perf_counter()
    memo_key = self._memo_key(key)
    compiled = _programs.lookup_compiled(memo_key)
    if compiled is None:
      lowered = self._lower(key)
      self.lower_times[key] = time.perf_counter() - t0
      return self._compile(key, memo_key, lowered, t0)
    return self._compile(key, memo_key, None, t0)

  def warmup(self, progress: bool | Callable[[ProgramKey, float], Any] = False,
             max_workers: int | None = None) -> dict[ProgramKey, float]:
    """Compiles every program of `programs()` ahead of time.

    After it, no step, burst or request of any kind compiles anything.
    Programs are traced and lowered one after the other in this thread
    (Python, under the GIL) while XLA compiles the ones already lowered in
    worker threads (outside the GIL); with `EngineConfig.compile_cache_dir`
    set, programs found in the persistent cache are loaded instead of
    compiled.

    Args:
      progress: True = a tqdm bar on stderr; a callable is called as
        `progress(key, seconds)` after each program.
      max_workers: compile threads; None = min(#programs, os.cpu_count()).

    Returns:
      `{ProgramKey: seconds}` for each program, from the start of its
      lowering to the end of its compilation (programs overlap); the total
      wall time is added to `stats.warmup_time_s`.
    """
    keys = [k for k in self.programs() if k not in self._compiled]
    t_start = time.perf_counter()
    if self._needs_calibration:  # compiles the calibration prefill
      self._calibrate([[0]], record=False)
    bar = None
    if progress is True:
      from tqdm import tqdm
      bar = tqdm(total=len(keys), unit="program", desc="compiling",
                 file=sys.stderr)

    def done(key):
      if bar is not None:
        bar.set_postfix_str(f"{key}: {self.compile_times[key]:.1f} s")
        bar.update(1)
      elif callable(progress):
        progress(key, self.compile_times[key])

    workers = max_workers or min(len(keys), os.cpu_count() or 1) or 1
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      futures = {}
      for key in keys:
        t0 = time.perf_counter()
        memo_key = self._memo_key(key)
        if _programs.lookup_compiled(memo_key) is not None:
          self._compile(key, memo_key, None, t0)
          done(key)
          continue
        lowered = self._lower(key)
        self.lower_times[key] = time.perf_counter() - t0
        futures[pool.submit(self._compile, key, memo_key, lowered, t0)] = key
      for fut in concurrent.futures.as_completed(futures):
        fut.result()
        done(futures[fut])
    if bar is not None:
      bar.close()
    self.stats.warmup_time_s += time.perf_counter() - t_start
    return {k: self.compile_times[k] for k in self.programs()
            if k in self.compile_times}

  # ------------------------------------------------------------------ API
  def _make_request(self, prompt, params: SamplingParams,
                    reuse_scope: int) -> Request:
    """A validated request (not queued)."""
    if isinstance(prompt, (str, bytes)):
      raise ValueError(
          f"Invalid prompt: expected a sequence of token ids, got "
          f"{type(prompt).__name__} (encode it with the model's tokenizer)")
    if not isinstance(params, SamplingParams):
      raise ValueError(
          f"Invalid params: expected a SamplingParams, got "
          f"{type(params).__name__}")
    try:
      arr = np.asarray(prompt)
    except (TypeError, ValueError) as e:
      raise ValueError(f"Invalid prompt: expected token ids, got {prompt!r}") from e
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
      raise ValueError(
          f"Invalid prompt: expected a 1-D sequence of int token ids, got "
          f"shape {arr.shape} of {arr.dtype}")
    prompt = arr.tolist()  # Python ints (10x faster than a per-token int())
    if not prompt:
      raise ValueError("Invalid prompt: expected at least one token, got none")
    total = len(prompt) + params.max_new_tokens
    if total > self.config.max_model_len:
      raise ValueError(
          f"Invalid request: len(prompt) + max_new_tokens = {total} exceeds "
          f"max_model_len={self.config.max_model_len}")
    blocks = -(-total // self.config.page_size)
    if blocks > self._min_slots:
      raise ValueError(
          f"Invalid request: len(prompt) + max_new_tokens = {total} tokens need "
          f"{blocks} slots of {self.config.page_size} tokens, but the pool has "
          f"{self._slots_text()}")
    if (self._scratch
        and total > self.config.max_num_tokens):
      # Scratch blocks live for one step only, so a prompt (or a recompute of
      # prompt + output) must be prefilled in a single step.
      raise ValueError(
          f"Invalid request: with SWA scratch reuse, len(prompt) + "
          f"max_new_tokens = {total} must fit max_num_tokens="
          f"{self.config.max_num_tokens}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= self.model.cfg.vocab_size:
      raise ValueError(
          f"Invalid prompt: token ids must be in [0, {self.model.cfg.vocab_size}),"
          f" got range [{lo}, {hi}]")
    if params.stop_token_ids is not None:
      stop = frozenset(params.stop_token_ids)
    else:
      stop = frozenset() if params.ignore_eos else self._default_stop
    return Request(-1, prompt, params, stop, reuse_scope=int(reuse_scope))

  def _enqueue(self, req: Request) -> int:
    req.request_id = self._next_id
    self._next_id += 1
    self._requests[req.request_id] = req
    self._waiting.append(req)
    return req.request_id

  def add_request(self, prompt: Sequence[int],
                  params: SamplingParams = SamplingParams(),
                  reuse_scope: int = 0) -> int:
    """Queues a request; returns its id.

    Args:
      prompt: token ids (a sequence of ints or a 1-D integer array).
      params: how the request samples and stops.
      reuse_scope: salts the prefix cache (tenant / adapter): blocks are
        reused only between requests of the same scope.

    Raises:
      ValueError: a prompt that is not a sequence of token ids (e.g. a str),
        an empty prompt, prompt + max_new_tokens over max_model_len or over
        the pool (`num_slots * page_size`), token ids outside the vocabulary.
    """
    return self._enqueue(self._make_request(prompt, params, reuse_scope))

  def get_request(self, request_id: int) -> Request:
    return self._requests[request_id]

  def has_unfinished(self) -> bool:
    """Whether a request waits or runs, or a dispatched burst is unread."""
    return bool(self._waiting or self._running or self._inflight)

  def generate(self, prompts: Sequence[Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
               progress: Callable[[int], Any] | None = None) -> list[list[int]]:
    """Runs all prompts to completion; returns generated ids per prompt.

    Every request is validated before any is queued: on a ValueError nothing
    was queued. `progress(n)` is called after each step with the tokens
    generated in it.

    Raises:
      ValueError: `params` is a sequence whose length differs from
        `prompts`', or a request is invalid (see `add_request`).
    """
    if isinstance(prompts, (str, bytes)):
      raise ValueError(
          "Invalid prompts: expected a list of token-id sequences, got a str")
    prompts = list(prompts)
    if isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    else:
      params = list(params)
      if len(params) != len(prompts):
        raise ValueError(
            f"Invalid params: expected one SamplingParams per prompt "
            f"({len(prompts)}), got {len(params)}")
    reqs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
      try:
        reqs.append(self._make_request(p, sp, 0))
      except ValueError as e:
        raise ValueError(f"Invalid prompts[{i}]: {e}") from e
    ids = [self._enqueue(r) for r in reqs]
    while self.has_unfinished():
      n = self.step()
      if progress is not None:
        progress(n)
    return [self._requests[i].output for i in ids]

  # ----------------------------------------------------------------- step
  def _schedule(self):
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
    rows = []   # (request, q_len, samples)
    feeds = {}  # row -> tokens fed this step
    budget = T
    # Decode rows first (one token each), then prefill chunks in arrival order.
    order = ([r for r in self._running if r.status == "decode"]
             + [r for r in self._running if r.status == "prefill"])
    for req in order:
      if req.status == "decode":
        # All but the last sampled token are in the cache: feed that one.
        feed, total = req.output[-1:], req.num_computed + 1
      else:
        todo = req.tokens
        total = len(todo)
        remaining = total - req.num_computed
        # With SWA scratch reuse a prompt is prefilled in one step (scratch
        # blocks live for one step); otherwise chunked under the budget.
        chunk = remaining if self._scratch else min(
            remaining, budget)
        if chunk > budget or chunk <= 0:
          continue
        feed = todo[req.num_computed:req.num_computed + chunk]
      n = len(feed)
      if n > budget:
        continue
      budget -= n
      r = req.seq_id
      feeds[r] = feed
      q_lens[r] = n
      kv_lens[r] = req.num_computed + n
      samples = req.num_computed + n == total
      rows.append((req, n, samples))
      if samples:
        sample_rows[r] = True
        sp = req.params
        temperature[r], top_k[r], top_p[r] = sp.temperature, sp.top_k, sp.top_p
        seeds[r] = np.uint32(sp.seed & 0xFFFFFFFF)
        gen_index[r] = len(req.output)
        if len(req.output) + 1 < sp.max_new_tokens:
          extend_ids[r] = r
        if req.status == "prefill" and cfg.enable_prefix_reuse:
          prompt_commit_ids[r] = r  # published up to kv_lens in the step
    # Tokens are laid out in row order (q_indptr is cu_seqlens over rows).
    q_indptr = np.zeros(S + 1, np.int32)
    q_indptr[1:] = np.cumsum(q_lens)
    bucket = next(b for b in cfg.buckets if b >= q_indptr[-1])
    tokens = tokens[:bucket]
    for r, feed in feeds.items():
      tokens[q_indptr[r]:q_indptr[r] + len(feed)] = feed

    # Admissions: while rows are free and the prefill backlog is short.
    admit_ids = np.full(A, -1, np.int32)
    admit_tokens = np.zeros((A, cfg.max_model_len), np.int32)
    admit_lens = np.zeros(A, np.int32)
    admit_scope = np.zeros(A, np.int32)
    admitted = []
    backlog = sum(len(r.tokens) - r.num_computed for r in self._running
                  if r.status == "prefill")
    while (self._waiting and self._free_rows and len(admitted) < A
           and backlog < 2 * T):
      req = self._waiting.popleft()
      row = self._free_rows.pop(0)
      req.seq_id = row
      toks = req.tokens
      i = len(admitted)
      admit_ids[i] = row
      admit_tokens[i, :len(toks)] = toks
      admit_lens[i] = len(toks)
      admit_scope[i] = req.reuse_scope
      admitted.append(req)
      backlog += len(toks)

    commit_ids, commit_lens, release_ids = self._release_inputs()
    inputs = _programs.StepInputs(
        tokens=tokens, q_indptr=q_indptr, kv_lens=kv_lens,
        sample_rows=sample_rows, temperature=temperature, top_k=top_k,
        top_p=top_p, seeds=seeds, gen_index=gen_index, commit_ids=commit_ids,
        commit_lens=commit_lens, prompt_commit_ids=prompt_commit_ids,
        release_ids=release_ids,
        extend_ids=extend_ids, admit_ids=admit_ids, admit_tokens=admit_tokens,
        admit_lens=admit_lens, admit_scope=admit_scope)
    return inputs, rows, admitted

  def _release_inputs(self):
    """`(commit_ids, commit_lens, release_ids)`, i32[max_seqs] each, of the
    rows in `_to_release` (finished: published, then released; -1 = none)."""
    S = self.config.max_seqs
    commit_ids = np.full(S, -1, np.int32)
    commit_lens = np.zeros(S, np.int32)
    release_ids = np.full(S, -1, np.int32)
    commits = {}  # one entry per row: a duplicated id would void the commit
    for row, n in self._to_release:
      commits[row] = max(n, commits.get(row, 0))
    for i, (row, n) in enumerate(sorted(commits.items())):
      commit_ids[i], commit_lens[i] = row, n
    for i, (row, _) in enumerate(self._to_release):
      release_ids[i] = row
    return commit_ids, commit_lens, release_ids

  def _take_released_rows(self):
    """Marks the rows of `_to_release` free: the next program releases them
    (its inputs were built from `_release_inputs`)."""
    for row, _ in self._to_release:
      self._free_rows.append(row)
    self._to_release = []
    self._free_rows.sort()

  def step(self) -> int:
    """Runs one engine step (or burst); returns the number of tokens it
    booked into requests' outputs.

    While decoding in chained bursts (`EngineConfig.decode_steps`), a call
    dispatches the next burst and books the one before it: outputs lag the
    device by one burst, and `has_unfinished()` stays true until the last
    burst is read.

    Raises:
      RuntimeError: a waiting request can never be admitted (its prompt needs
        more slots than the whole pool has).
    """
    if self._needs_calibration and self._waiting:
      self._calibrate([r.tokens for r in self._waiting])
    if self._burst_eligible():
      return self._burst()
    drained = self._drain()
    if not (self._waiting or self._running or self._to_release):
      return drained
    t0 = time.perf_counter()
    inputs, rows, admitted = self._schedule()
    self._take_released_rows()
    self.last_inputs = inputs
    t1 = time.perf_counter()
    key = self._variant("step", int(inputs.tokens.shape[0]),
                        greedy_only=not np.any(inputs.temperature > 0))
    self.last_program = key
    compile_s = self.stats.compile_time_s
    program = self._program(key)
    compile_s = self.stats.compile_time_s - compile_s
    out = self._run(program, inputs)
    out = jax.device_get(out)  # the one device -> host sync
    t2 = time.perf_counter()

    num_sampled = 0
    has_prefill = False
    for req, n, samples in rows:
      if req.status == "prefill":
        has_prefill = True
        self.stats.prefill_tokens += n
      else:
        self.stats.decode_tokens += n
      req.num_computed += n
      if not samples:
        continue
      r = req.seq_id
      if req.status == "prefill":
        req.status = "decode"  # its prompt was committed in the step
      token = int(out.sampled[r])
      req.output.append(token)
      num_sampled += 1
      self.stats.generated_tokens += 1
      if req.first_token_step is None:
        req.first_token_step = self.stats.num_steps
      stopped = token in req.stop_ids and not req.params.ignore_eos
      if stopped or len(req.output) >= req.params.max_new_tokens:
        req.status = "finished"
        req.finish_reason = "stop" if stopped else "length"
        self._finish(req)
      elif not out.extend_ok[r]:
        self._preempt(req)
    refused = []
    for i, req in enumerate(admitted):
      if out.claim_ok[i]:
        req.status = "prefill"
        self.stats.prompt_tokens += len(req.tokens)
        req.num_reused = int(out.claim_reused[i])
        req.num_computed = req.num_reused
        self.stats.reused_tokens += req.num_reused
        if self.stats.slots_saved_by_scratch is not None:
          ps = self.config.page_size
          wanted = -(-len(req.tokens) // ps) - req.num_reused // ps
          self.stats.slots_saved_by_scratch += wanted - int(
              out.claim_new_blocks[i])
        self._running.append(req)
      else:  # out of slots: back to the queue front, in arrival order
        self.stats.num_refused_claims += 1
        self._free_rows.append(req.seq_id)
        req.seq_id = -1
        refused.append(req)
    self._waiting.extendleft(reversed(refused))
    self._free_rows.sort()
    if refused and not rows and not self._running and not self._to_release:
      raise RuntimeError(
          f"Request {refused[0].request_id} needs "
          f"{-(-len(refused[0].tokens) // self.config.page_size)} slots but the "
          f"pool has only {self._slots_text()}")
    self._record_usage(out.used_slots)
    self.stats.num_steps += 1
    t3 = time.perf_counter()
    self.stats.host_time_s += (t1 - t0) + (t3 - t2)
    if has_prefill:
      self.stats.prefill_time_s += t3 - t0 - compile_s
    elif rows:
      self.stats.decode_time_s += t3 - t0 - compile_s
    return drained + num_sampled

  def _calibrate(self, prompts, record: bool = True):
    """FP8 scales of every layer from a prefill of the first prompts."""
    k_scale, v_scale = _calibrate.calibrate_kv_scales(
        self.model.params, self.model.cfg, prompts,
        num_tokens=self.config.calibration_tokens,
        max_prompts=self.config.max_seqs, impl=self.config.impl)
    if record:
      self.model = dataclasses.replace(
          self.model, params=_calibrate.set_kv_scales(
              self.model.params, k_scale, v_scale))
      self._needs_calibration = False
      self.stats.kv_scales_calibrated = True
    return k_scale, v_scale

  def _burst_eligible(self) -> bool:
    """Multi-step decode applies when nothing but decoding can happen."""
    if self.config.decode_steps <= 1 or not self._running:
      return False
    if self._waiting and (self._free_rows or self._to_release):
      return False  # a step admits them (released rows free up in it)
    return all(r.status == "decode" and len(r.stop_ids) <= MAX_STOP_IDS
               for r in self._running)

  def _burst_greedy(self) -> bool:
    """Whether every running request is greedy: the next burst's variant
    then has no `lax.cond`, i.e. no device-to-host sync per iteration."""
    return all(r.params.temperature <= 0 for r in self._running)

  def _burst_inputs(self) -> _programs.BurstInputs:
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
    for req in self._running:
      r, sp = req.seq_id, req.params
      active[r] = True
      last[r] = req.output[-1]
      computed[r] = req.num_computed
      remaining[r] = sp.max_new_tokens - len(req.output)
      stops = [] if sp.ignore_eos else sorted(req.stop_ids)
      stop_ids[r, :len(stops)] = stops
      temperature[r], top_k[r], top_p[r] = sp.temperature, sp.top_k, sp.top_p
      seeds[r] = np.uint32(sp.seed & 0xFFFFFFFF)
      gen_index[r] = len(req.output)
    return _programs.BurstInputs(active, last, computed, remaining, stop_ids,
                                 temperature, top_k, top_p, seeds, gen_index,
                                 *self._release_inputs())

  def _burst(self) -> int:
    """`decode_steps` decode iterations in one device call (see EngineConfig).

    Bursts are chained (see `_can_chain`): the next burst is dispatched
    before this one's tokens are read, with its per-row inputs
    taken from this one's end state on the device (`programs.chain_inputs`),
    so the host reads and books one burst while the device runs the next
    (vLLM's async scheduling). Returns the tokens read in this call: those
    of the burst dispatched before it, if one was in flight, and this one's
    unless it stays in flight.
    """
    t0 = time.perf_counter()
    prev = self._inflight
    self._inflight = None
    if prev is None:
      inputs = self._burst_inputs()
    else:
      inputs = _programs.chain_inputs(prev[1], prev[0].carry,
                                      *self._release_inputs())
    self._take_released_rows()
    t1 = time.perf_counter()
    key = self._variant("burst", self.config.max_seqs, self._burst_greedy())
    self.last_program = key
    compile_s = self.stats.compile_time_s
    program = self._program(key)
    compile_s = self.stats.compile_time_s - compile_s
    out = self._run(program, inputs)
    host_s = t1 - t0
    num_sampled = 0
    if prev is not None:  # read while `out` runs
      num_sampled, dt = self._read_burst(prev[0])
      host_s += dt
    if self._can_chain():
      self._inflight = (out, inputs)
    else:
      n, dt = self._read_burst(out)
      num_sampled += n
      host_s += dt
    self.stats.num_steps += self.config.decode_steps
    self.stats.host_time_s += host_s
    self.stats.decode_time_s += time.perf_counter() - t0 - compile_s
    return num_sampled

  def _can_chain(self) -> bool:
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
    left = [r.params.max_new_tokens - len(r.output) for r in self._running]
    if self._waiting:
      return bool(left) and min(left) > k
    return any(n > k for n in left)

  def _drain(self) -> int:
    """Reads the burst in flight, if any; returns its tokens."""
    if self._inflight is None:
      return 0
    out, _ = self._inflight
    self._inflight = None
    t0 = time.perf_counter()
    n, dt = self._read_burst(out)
    self.stats.host_time_s += dt
    self.stats.decode_time_s += time.perf_counter() - t0
    return n

  def _read_burst(self, out) -> tuple[int, float]:
    """Books a burst's tokens into its requests (finished ones are released
    by the next program, preempted ones requeued). Returns the tokens and
    the host seconds spent after the device's results arrived."""
    out = jax.device_get(out.replace(carry=None))
    t0 = time.perf_counter()
    num_sampled = 0
    for req in list(self._running):
      r = req.seq_id
      toks = [int(t) for t in out.tokens[:, r] if t >= 0]
      req.output.extend(toks)
      req.num_computed += len(toks)
      num_sampled += len(toks)
      token = req.output[-1]
      stopped = token in req.stop_ids and not req.params.ignore_eos
      if stopped or len(req.output) >= req.params.max_new_tokens:
        req.status = "finished"
        req.finish_reason = "stop" if stopped else "length"
        self._finish(req)
      elif out.preempted[r]:
        self._preempt(req)
    self.stats.decode_tokens += num_sampled
    self.stats.generated_tokens += num_sampled
    self._record_usage(out.used_slots)
    return num_sampled, time.perf_counter() - t0

  def _slots_text(self) -> str:
    if not self._hybrid:
      return f"num_slots={self.config.num_slots}"
    return (f"group_num_slots={self.cache_config.group_num_slots} (per window "
            f"group; the smallest bounds one request)")

  def _record_usage(self, used_slots):
    """Peak slots per slot space and peak KV bytes (`EngineStats`)."""
    used = np.atleast_1d(np.asarray(used_slots)).astype(int)
    st = self.stats
    st.peak_group_slots = tuple(
        max(a, int(b)) for a, b in zip(st.peak_group_slots, used))
    st.peak_used_slots = st.peak_group_slots[0]
    held = sum(int(u) * c.num_layers for u, c in zip(used, self._group_configs))
    st.peak_kv_bytes = max(st.peak_kv_bytes, held * self._block_bytes)
    if st.flat_peak_kv_bytes is not None:
      flat = int(used[0]) * self.model.cfg.num_layers * self._block_bytes
      st.flat_peak_kv_bytes = max(st.flat_peak_kv_bytes, flat)

  def _finish(self, req: Request):
    self._running.remove(req)
    self._to_release.append((req.seq_id, req.num_computed))

  def _preempt(self, req: Request):
    """Out of slots for the next token: free the sequence, recompute later."""
    self._running.remove(req)
    self._to_release.append((req.seq_id, req.num_computed))
    req.status = "waiting"
    req.seq_id = -1
    req.num_computed = 0
    req.num_preemptions += 1
    self.stats.num_preemptions += 1
    self._waiting.appendleft(req)

  # -------------------------------------------------------------- profile
  def profile(self, iters: int = 10) -> dict:
    """Times the pieces of the next step (`pkvattn.serving.profile.profile`)."""
    self._drain()
    from pkvattn.serving import profile as _profile
    return _profile.profile(self, iters)
