"""JAX's persistent compilation cache, as the engine and the CLI use it.

With a cache directory set, every XLA executable JAX compiles is written
there (keyed by the program, the jax / XLA versions and the device), and a
later process with the same model and engine config loads the engine's
programs instead of compiling them: `Engine.warmup()` then takes seconds.
"""

from __future__ import annotations

import os

import jax


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
