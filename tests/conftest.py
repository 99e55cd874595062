import os
import sys
import tempfile

import pytest

# Make tests/ importable as a plain directory (attention_utils etc.).
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
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
