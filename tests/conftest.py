import os
import shutil
import sys
import tempfile

import pytest

# Make tests/ importable as a plain directory (attention_utils etc.).
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _fast_cpu_compile_flags():
  """On jaxlib 0.10, XLA:CPU's older runtime, which compiled and ran these
  programs faster than the thunk runtime (about 1.15x compile, 1.25x run on
  a 262k-vocab LM head, 2-core CI machine). Appended to the user's
  XLA_FLAGS; left out on a GPU machine. (LLVM -O0 compiled small programs
  faster but ran the real-model tests 1.4x slower: not used.)"""
  from importlib import metadata
  have = os.environ.get("XLA_FLAGS", "")
  if shutil.which("nvidia-smi") or "xla_cpu_use_thunk_runtime" in have:
    return have
  try:
    major, minor = (int(x) for x in metadata.version("jaxlib").split(".")[:2])
  except (metadata.PackageNotFoundError, ValueError):
    return have
  if (major, minor) != (0, 10):  # a flag this XLA is known to take
    return have
  return f"{have} --xla_cpu_use_thunk_runtime=false"


os.environ["XLA_FLAGS"] = _fast_cpu_compile_flags().strip()
# The CLI's persistent compilation cache defaults to $XDG_CACHE_HOME: keep
# test runs out of the user's cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="pkvattn-test-cache-")


@pytest.fixture(autouse=True)
def _no_persistent_cache_leak():
  """A test that turns JAX's persistent compilation cache on (the CLI does
  by default) leaves it off for the next test."""
  import jax
  before = jax.config.jax_compilation_cache_dir
  yield
  if jax.config.jax_compilation_cache_dir != before:
    from pkvattn.serving import compile_cache
    jax.config.update("jax_compilation_cache_dir", before)
    compile_cache.reset()
