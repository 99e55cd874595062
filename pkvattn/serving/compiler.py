"""Compile once: the bounded set of an engine's programs and their executables.

An engine's shapes are static, so the programs it may run are a small set
known before the first request (`program_keys`): one `step` program per
token bucket and, with `decode_steps > 1`, one `burst` program per row
bucket, in a greedy-only and a sampled variant where the split pays (GPU
backends; see `serving.programs`), and the cache programs: the step of no
tokens (every step's cache ops) and, with bursts, `reserve` (every
burst's).
`Compiler` lowers and compiles them:

* **ahead of time** (`warmup`): programs are traced and lowered one after
  the other in the calling thread (Python, under the GIL) while XLA compiles
  the ones already lowered in worker threads (outside the GIL), so the
  compiles overlap; saved programs load in the worker threads;
* **or on first use** (`program`), its time counted in
  `EngineStats.compile_time_s` and kept out of the tokens/s figures.

After that the engine calls the compiled executables directly: no workload
traces or compiles anything. Executables are also kept per process
(`compiled_program`), keyed by model config, engine config, mesh, program and
argument signature, so a second engine of the same shapes compiles nothing;
and with `EngineConfig.compile_cache_dir` each compiled program is also
saved there (`serving.compile_cache`): a later process loads it without
tracing, lowering or compiling (and JAX's persistent compilation cache, on
in the same directory, serves the rest of its jitted functions).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import sys
import threading
import time
from typing import Any, Callable

import jax

from pkvattn import _checks
from pkvattn import _contract
from pkvattn.serving import compile_cache as _compile_cache
from pkvattn.serving import programs as _programs
from pkvattn.serving.config import EngineConfig
from pkvattn.serving.stats import EngineStats


@dataclasses.dataclass(frozen=True)
class ProgramKey:
  """One compiled program of an engine.

  Attributes:
    kind: "step" (one mixed prefill / decode step), "burst"
      (`decode_steps` decode iterations) or "reserve" (a burst's cache ops).
    num_tokens: padded tokens of a step (its bucket; 0: the step's cache
      ops); a burst's rows (its row bucket, `EngineConfig.burst_buckets`);
      0 for "reserve".
    greedy_only: every row samples greedily (argmax only; no `lax.cond`):
      a burst's greedy variant, and the cache programs (they sample
      nothing). False for a step's model program (its one program samples
      under a `lax.cond`) and a burst's sampled variant.
  """
  kind: str
  num_tokens: int
  greedy_only: bool

  def __str__(self):
    if self.kind == "step" and self.num_tokens == 0:
      return "step[no tokens]"
    if self.kind == "reserve":
      return "reserve"
    if self.kind == "step":
      return f"step[{self.num_tokens} tokens]"
    mode = "greedy" if self.greedy_only else "sampled"
    return f"{self.kind}[{self.num_tokens} tokens, {mode}]"


def program_keys(cfg: EngineConfig, split_variants: bool = True
                 ) -> tuple[ProgramKey, ...]:
  """Every program an engine with `cfg` may run (what `Engine.warmup` compiles).

  A step has one model program per token bucket, its sampler under a
  `lax.cond` (`programs.device_step`). A burst has a greedy-only and a
  sampled variant per row bucket where `split_variants` (GPU backends, where
  a `lax.cond` reads its predicate back on the host: the host dispatches a
  burst while the previous one runs, which a read would serialize); one
  program per row bucket, the `lax.cond` built in, otherwise.
  """
  variants = (True, False) if split_variants else (False,)
  # The cache programs sample nothing: their greedy-only keys alone.
  keys = [ProgramKey("step", 0, True)]
  keys += [ProgramKey("step", b, False) for b in cfg.buckets]
  if cfg.decode_steps > 1:
    keys += [ProgramKey("reserve", 0, True)]
    keys += [ProgramKey("burst", r, g) for r in cfg.burst_buckets
             for g in variants]
  return tuple(keys)


def is_cache_program(key: ProgramKey) -> bool:
  """`key` is a cache program: the step of no tokens, or `reserve`."""
  return key.kind == "reserve" or (key.kind == "step" and key.num_tokens == 0)


def program_sequence(key: ProgramKey) -> tuple[ProgramKey, ...]:
  """The programs a call of `key` runs, in order: a step that feeds tokens
  runs its model program then the step's cache program, a burst the
  `reserve` cache program then its model program."""
  if key.kind == "step" and key.num_tokens:
    return (key, ProgramKey("step", 0, True))
  if key.kind == "burst":
    return (ProgramKey("reserve", 0, True), key)
  return (key,)


def model_position(key: ProgramKey) -> int | None:
  """Where the model program runs in `program_sequence(key)`: 0 in a step
  that feeds tokens, 1 in a burst (after `reserve`); None where the call
  runs only a cache program. The model program's outputs carry the call's
  sampled tokens."""
  seq = program_sequence(key)
  return next((i for i, k in enumerate(seq) if not is_cache_program(k)), None)


def program_inputs(key: ProgramKey, inputs):
  """`inputs` of a call as program `key` of its sequence takes them: the
  step's cache program without the fed tokens (`programs.step_cache_inputs`:
  one program serves every bucket), every other program as they are."""
  if key.kind == "step" and not key.num_tokens:
    return _programs.step_cache_inputs(inputs)
  return inputs


def lowering_order(keys) -> list[ProgramKey]:
  """`keys` in the order `Compiler.warmup` lowers them: the longest compiles
  first. Lowering is serial and each compile starts when its lowering ends,
  so a long compile lowered last would bound the warmup; the largest step
  (its token bucket's forward and prefill kernels) compiles longest, then
  the bursts (a decode step and a sampler per iteration), then the smaller
  steps, the cache programs last. Within a row bucket the sampled burst
  comes before the greedy one: its sampler compiles longer (measured:
  docs/performance.md)."""
  def rank(k):  # larger buckets first, then sampled before greedy
    return (-k.num_tokens, k.greedy_only)
  model = [k for k in keys if not is_cache_program(k)]
  steps = sorted((k for k in model if k.kind == "step"), key=rank)
  bursts = sorted((k for k in model if k.kind == "burst"), key=rank)
  cache = sorted((k for k in keys if is_cache_program(k)),
                 key=lambda k: k.kind == "reserve")
  return steps[:1] + bursts + steps[1:] + cache


def signature(*trees) -> tuple:
  """A hashable (structure, shapes, dtypes, shardings) key of array trees."""
  leaves, treedef = jax.tree.flatten(trees)
  return treedef, tuple((tuple(a.shape), str(a.dtype),
                         getattr(a, "sharding", None)) for a in leaves)


_COMPILED: dict = {}
_COMPILED_LOCK = threading.Lock()


def lookup_compiled(key):
  """The executable `compiled_program` kept for `key`, or None."""
  with _COMPILED_LOCK:
    return _COMPILED.get(key)


def compiled_program(key, compile_fn):
  """The executable kept for `key`, else `compile_fn()` (kept): engines with
  the same model config, engine config, program and argument signature share
  one executable per process (`compile_fn` compiles, or loads a saved
  program: `Compiler`)."""
  compiled = lookup_compiled(key)
  if compiled is None:
    compiled = compile_fn()
    with _COMPILED_LOCK:
      compiled = _COMPILED.setdefault(key, compiled)
  return compiled


def clear_compiled():
  """Forgets every executable `compiled_program` kept.

  Each one holds its code in memory: on XLA:CPU one to three memory maps per
  compiled kernel (hundreds a program), and Linux caps a process at
  `vm.max_map_count` maps (65,530 by default; past it XLA's next compile
  fails inside LLVM and crashes the process). A process that builds many
  engines of different shapes calls this, with `jax.clear_caches()`, to
  release them (the tests do, per worker)."""
  with _COMPILED_LOCK:
    _COMPILED.clear()


class Compiler:
  """Lowers, compiles and keeps one engine's programs.

  `buffers` arguments are the engine's `(params, pool, state, seq_tokens)`:
  their shapes, dtypes and shardings are the programs' (the pool, state and
  token buffer are donated when the program runs, never here).

  Attributes:
    compiled: `{ProgramKey: executable}` of this engine, filled by `warmup`
      or on first use.
    compile_times: `{ProgramKey: seconds}` from the start of lowering to the
      end of compiling (or loading) each program.
    lower_times: `{ProgramKey: seconds}` of those spent tracing + lowering
      (none for a program loaded from `compile_cache_dir`).
    split_variants: a burst's greedy-only and sampled variants are separate
      programs (GPU backends, where the sampler's `lax.cond` syncs the
      host); the sampled one runs only when some row samples, so it has no
      `lax.cond` either (`programs.jitted_program(sample_cond=False)`).
  """

  def __init__(self, model_cfg, config: EngineConfig,
               mesh: jax.sharding.Mesh | None, stats: EngineStats,
               inputs_sharding=None):
    """Turns on the persistent compilation cache where
    `config.compile_cache_dir` is set (process-wide).

    Raises:
      ValueError: `compile_cache_dir` cannot be created or written.
    """
    # The host KV tier runs programs of its own (`serving.host_tier`); the
    # step and burst programs do not depend on it, so engines with and
    # without it share their executables.
    config = dataclasses.replace(config, host_kv_cache_bytes=0)
    self.model_cfg, self.config, self.mesh = model_cfg, config, mesh
    self.stats = stats
    self.inputs_sharding = inputs_sharding
    self.split_variants = _checks.is_gpu()
    if config.compile_cache_dir is not None:
      _compile_cache.enable(config.compile_cache_dir)
    self.compiled: dict[ProgramKey, Any] = {}
    self.compile_times: dict[ProgramKey, float] = {}
    self.lower_times: dict[ProgramKey, float] = {}
    self._lock = threading.Lock()

  def keys(self) -> tuple[ProgramKey, ...]:
    """Every program this engine may run (`program_keys`)."""
    return program_keys(self.config, self.split_variants)

  def key(self, kind: str, num_tokens: int, greedy_only: bool) -> ProgramKey:
    """The program for a call: a burst's greedy-only calls take its greedy
    variant where the variants are split, a step always takes its bucket's
    one program (`program_keys`)."""
    if is_cache_program(ProgramKey(kind, num_tokens, True)):
      return ProgramKey(kind, num_tokens, True)
    if kind == "step":
      return ProgramKey(kind, num_tokens, False)
    return ProgramKey(kind, num_tokens,
                      bool(greedy_only) and self.split_variants)

  def sequence(self, key: ProgramKey) -> tuple[ProgramKey, ...]:
    """The programs a call of `key` runs, in order (`program_sequence`)."""
    return program_sequence(key)

  def jitted(self, key: ProgramKey):
    """The `jax.jit` of `key` (`programs.jitted_program`): a burst's rows are
    its bucket; a step samples under a `lax.cond`, a burst's sampled
    variant only where the variants are not split."""
    kind = ("step_cache" if key.kind == "step" and is_cache_program(key)
            else key.kind)
    return _programs.jitted_program(
        self.model_cfg, self.config, self.mesh, kind, key.greedy_only,
        rows=key.num_tokens if key.kind == "burst" else None,
        sample_cond=key.kind == "step" or not self.split_variants)

  def lower(self, key: ProgramKey, buffers):
    """`jax.stages.Lowered` of `key` on `buffers` and the program's input
    shapes (replicated on the mesh, if any)."""
    fn = self.jitted(key)
    if key.kind == "step":
      inputs = _programs.step_input_shapes(self.config, key.num_tokens)
    else:
      inputs = _programs.burst_input_shapes(self.config)
    if self.inputs_sharding is not None:
      inputs = jax.tree.map(
          lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                         sharding=self.inputs_sharding),
          inputs)
    with _contract.checked(self.config.check):
      return fn.lower(*buffers, inputs)

  def _memo_key(self, key: ProgramKey, buffers):
    return (self.model_cfg, self.config, self.mesh, key, signature(*buffers))

  def _saved_path(self, memo_key) -> str | None:
    """Where `compile_cache_dir` keeps the program of `memo_key` (None: no
    directory, or an engine on a mesh or of several processes: only
    one-device engines save their programs; JAX's persistent cache serves
    the others)."""
    cache_dir = self.config.compile_cache_dir
    if cache_dir is None or self.mesh is not None or jax.process_count() > 1:
      return None
    model_cfg, config, mesh, key, sig = memo_key
    config = dataclasses.replace(config, compile_cache_dir=None)
    return _compile_cache.program_path(cache_dir, _compile_cache.program_digest(
        model_cfg, config, mesh, key, sig, self.inputs_sharding,
        _programs.compiler_options()))

  def _ready(self, memo_key, path, buffers):
    """`compile_fn` of a program this process keeps or `compile_cache_dir`
    holds at `path` (loaded onto the device of `buffers`); None: it must be
    lowered and compiled."""
    kept = lookup_compiled(memo_key)
    if kept is not None:
      return lambda: kept
    sharding = getattr(jax.tree.leaves(buffers)[0], "sharding", None)
    if path is None or sharding is None:
      return None
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    loaded = _compile_cache.load_program(path, devices)
    return None if loaded is None else (lambda: loaded)

  @staticmethod
  def _compile_fn(lowered, path):
    """`compile_fn` that compiles `lowered` and saves it at `path` (None:
    not saved; `compile_cache.compile_and_save`)."""
    return lambda: _compile_cache.compile_and_save(lowered, path)

  def _compile(self, key: ProgramKey, memo_key, compile_fn, t0: float):
    """The program of `memo_key` (once per process: `compiled_program`),
    recorded as `key`'s."""
    compiled = compiled_program(memo_key, compile_fn)
    dt = time.perf_counter() - t0
    with self._lock:
      self.compiled[key] = compiled
      self.compile_times[key] = dt
      self.stats.compile_time_s += dt
      self.stats.num_compiles += 1
    return compiled

  def program(self, key: ProgramKey, buffers):
    """The executable of `key`, compiled now if `warmup` did not."""
    compiled = self.compiled.get(key)
    if compiled is not None:
      return compiled
    t0 = time.perf_counter()
    memo_key = self._memo_key(key, buffers)
    path = self._saved_path(memo_key)
    ready = self._ready(memo_key, path, buffers)
    if ready is not None:
      return self._compile(key, memo_key, ready, t0)
    lowered = self.lower(key, buffers)
    self.lower_times[key] = time.perf_counter() - t0
    return self._compile(key, memo_key, self._compile_fn(lowered, path), t0)

  def warmup(self, buffers,
             progress: bool | Callable[[ProgramKey, float], Any] = False,
             max_workers: int | None = None) -> dict[ProgramKey, float]:
    """Compiles every program of `keys()` not compiled yet (see
    `Engine.warmup`); returns `{ProgramKey: seconds}` of all compiled."""
    keys = lowering_order([k for k in self.keys() if k not in self.compiled])
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
      # Saved programs load in the worker threads, all at once: a load
      # compiles the program's Mosaic GPU kernels again, which one after
      # the other would add up to most of a warm start.
      loads = {}
      for key in keys:
        memo_key = self._memo_key(key, buffers)
        path = self._saved_path(memo_key)
        loads[key] = (memo_key, path, time.perf_counter(),
                      pool.submit(self._ready, memo_key, path, buffers))
      futures = {}
      for key in keys:
        memo_key, path, t0, load = loads[key]
        ready = load.result()
        if ready is not None:
          self._compile(key, memo_key, ready, t0)
          done(key)
          continue
        t0 = time.perf_counter()
        lowered = self.lower(key, buffers)
        self.lower_times[key] = time.perf_counter() - t0
        futures[pool.submit(self._compile, key, memo_key,
                            self._compile_fn(lowered, path), t0)] = key
      for fut in concurrent.futures.as_completed(futures):
        fut.result()
        done(futures[fut])
    if bar is not None:
      bar.close()
    return {k: self.compile_times[k] for k in self.keys()
            if k in self.compile_times}
