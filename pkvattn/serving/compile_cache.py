"""The persistent compilation cache, as the engine and the CLI use it.

With a cache directory set, two things are kept there:

* JAX's persistent compilation cache: every XLA executable JAX compiles
  (keyed by the lowered program, the jax / XLA versions and the device). A
  hit skips XLA's compile, but JAX must still trace and lower the program to
  compute its key, and for an engine's programs that is most of the time.
* The engine's own programs (`programs/`, `load_program` / `save_program`):
  each compiled program serialized (`jax.experimental.serialize_executable`)
  under a digest of everything its trace depends on (`program_digest`: the
  model and engine configs, the program, the buffers' shapes, dtypes and
  shardings, the jax / jaxlib versions, the devices, XLA_FLAGS, the JAX
  options that change a trace and pkvattn's own source). A later process
  loads it without tracing, lowering or compiling anything.

Either way `Engine.warmup()` of a later process with the same model and
engine config takes seconds. Like JAX's cache, a cached program is code the
process loads and runs: the directory must be as trusted as the Python
environment itself.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import pickle
import sys
import tempfile
import threading

import jax

from pkvattn import _checks


def default_dir() -> str:
  """`$XDG_CACHE_HOME/pkvattn/xla` (`~/.cache/pkvattn/xla` by default)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return os.path.join(base, "pkvattn", "xla")


def enable(path: str) -> str:
  """Turns on JAX's persistent compilation cache in `path` (created).

  Every program is cached whatever its compile time or size
  (`jax_persistent_cache_min_compile_time_secs = 0`,
  `jax_persistent_cache_min_entry_size_bytes = 0`). Process-wide: it sets JAX
  config options. Returns the absolute path.

  Raises:
    ValueError: `path` exists and is not a writable directory.
  """
  path = os.path.abspath(os.path.expanduser(path))
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"Invalid compile_cache_dir: cannot create {path!r}: {e}") from e
  if not os.access(path, os.W_OK):
    raise ValueError(f"Invalid compile_cache_dir: {path!r} is not writable")
  if jax.config.jax_compilation_cache_dir != path:
    jax.config.update("jax_compilation_cache_dir", path)
    reset()  # a cache already opened in another directory is re-opened
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


def reset():
  """Closes the cache JAX has open, so the next compile reads
  `jax_compilation_cache_dir` again (None = no persistent cache)."""
  try:
    from jax.experimental.compilation_cache import compilation_cache as cc
    cc.reset_cache()
  except (ImportError, AttributeError):
    pass


PROGRAMS_SUBDIR = "programs"
# Saved programs kept per directory, the least recently used removed first:
# a code or config change digests to new files, which would otherwise pile
# up (an engine has up to about ten programs).
MAX_SAVED_PROGRAMS = 64

# JAX options whose value changes what a program traces to.
_TRACE_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision",
                  "jax_default_prng_impl", "jax_threefry_partitionable")


@functools.cache
def source_digest() -> str:
  """sha256 of pkvattn's Python sources (`pkvattn`, `pkvattn.cache`,
  `pkvattn.pallas_kernels`, file names and contents): any edit to the code
  a program traces invalidates its cached executable."""
  import pkvattn.cache  # noqa: PLC0415
  import pkvattn.pallas_kernels  # noqa: PLC0415
  h = hashlib.sha256()
  for pkg in (sys.modules["pkvattn"], pkvattn.cache, pkvattn.pallas_kernels):
    for root in pkg.__path__:
      for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
          path = os.path.join(dirpath, name)
          h.update(os.path.relpath(path, root).encode())
          with open(path, "rb") as f:
            h.update(f.read())
  return h.hexdigest()


def program_digest(*parts) -> str:
  """Hex digest of a program's identity: `repr` of `parts` (the caller's:
  model config, engine config, program, argument signature) and of this
  process's jax / jaxlib versions, devices, XLA_FLAGS, trace options and
  `source_digest()`."""
  import jaxlib  # noqa: PLC0415
  devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
  context = (jax.__version__, jaxlib.__version__, devices,
             os.environ.get("XLA_FLAGS", ""),
             [(o, getattr(jax.config, o, None)) for o in _TRACE_OPTIONS],
             source_digest())
  return hashlib.sha256(repr((parts, context)).encode()).hexdigest()


def program_path(cache_dir: str, digest: str) -> str:
  """Where the program of `digest` is kept under `cache_dir`."""
  return os.path.join(cache_dir, PROGRAMS_SUBDIR, digest + ".pkl")


@functools.cache
def _load_kernel_runtime() -> None:
  """Loads Mosaic GPU's runtime library into the process (GPU backends).

  A saved program's Mosaic GPU kernels are compiled again when it loads,
  and their host code calls `mosaic_gpu_launch_kernel`, a symbol of the
  runtime that importing `jax.experimental.mosaic.gpu` loads. A process
  that loads programs before it traces any kernel has not imported it yet;
  without it the load fails ("Symbols not found") and the program is
  compiled again."""
  if not _checks.is_gpu():
    return
  try:
    importlib.import_module("jax.experimental.mosaic.gpu")
  except ImportError:  # a jaxlib without Mosaic GPU: no kernels to load
    pass


def load_program(path: str, devices):
  """The `jax.stages.Compiled` saved at `path`, loaded onto `devices` (those
  it was compiled for), or None: no file, or one that does not load
  (another jax, a truncated write); the caller then compiles and saves it
  again."""
  if not os.path.isfile(path):
    return None
  from jax.experimental import serialize_executable  # noqa: PLC0415
  _load_kernel_runtime()
  try:
    with open(path, "rb") as f:
      payload, in_tree, out_tree = pickle.load(f)
    compiled = serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, execution_devices=list(devices))
    os.utime(path)  # recently used: `prune_programs` keeps it
    return compiled
  except Exception:  # noqa: BLE001: any failure means "not cached"
    return None


def save_program(path: str, compiled) -> bool:
  """Writes `compiled` to `path` (atomically: a temporary file renamed);
  False where the executable cannot be serialized (the backend's, or one
  holding constants) or the directory cannot be written."""
  from jax.experimental import serialize_executable  # noqa: PLC0415
  tmp = None
  try:
    data = pickle.dumps(serialize_executable.serialize(compiled))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
    prune_programs(os.path.dirname(path))
    return True
  except Exception:  # noqa: BLE001: the program runs uncached
    if tmp is not None and os.path.exists(tmp):
      os.remove(tmp)
    return False


_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_thread = threading.local()


def _count_jax_cache_hit(event: str, **kwargs) -> None:
  del kwargs
  if event == _JAX_CACHE_HIT:  # recorded in the thread that compiles
    _thread.jax_cache_hits = getattr(_thread, "jax_cache_hits", 0) + 1


@functools.cache
def _watch_jax_cache_hits() -> None:
  jax.monitoring.register_event_listener(_count_jax_cache_hit)


def compile_and_save(lowered, path: str | None):
  """`lowered.compile()`, saved at `path` (None: not saved) unless JAX's
  persistent cache served the executable.

  An executable JAX deserialized from its cache does not serialize whole on
  XLA:CPU: the copy saved from it loads, then fails when run ("Function ...
  not found"). Such a program is left unsaved; a later process lowers it
  again and JAX's cache serves it again (seconds, not a compile)."""
  _watch_jax_cache_hits()
  before = getattr(_thread, "jax_cache_hits", 0)
  compiled = lowered.compile()
  if path is not None and getattr(_thread, "jax_cache_hits", 0) == before:
    save_program(path, compiled)
  return compiled


def prune_programs(programs_dir: str, keep: int = MAX_SAVED_PROGRAMS) -> None:
  """Removes all but the `keep` most recently used saved programs of
  `programs_dir` (by modification time: saving or loading one touches it)."""
  try:
    entries = [e for e in os.scandir(programs_dir) if e.name.endswith(".pkl")]
    entries.sort(key=lambda e: e.stat().st_mtime_ns, reverse=True)
    for e in entries[keep:]:
      os.remove(e.path)
  except OSError:  # another process pruned it first: nothing to do
    pass
