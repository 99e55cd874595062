import atexit
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

# Make tests/ importable as a plain directory (attention_utils etc.).
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from cpu_options import FAST_CPU_FLAGS  # noqa: E402  (after the path insert)


def _fast_cpu_compile_flags():
  """`FAST_CPU_FLAGS` appended to the user's XLA_FLAGS (those the user set
  win); left out on a GPU machine, where the optimization level would
  reach the GPU backend too."""
  have = os.environ.get("XLA_FLAGS", "")
  if shutil.which("nvidia-smi"):
    return have
  flags = [f for f in FAST_CPU_FLAGS if f.split("=")[0] not in have]
  return " ".join([have] + flags)


os.environ["XLA_FLAGS"] = _fast_cpu_compile_flags().strip()
# f32 tolerances assume f32 dots. XLA:GPU's default precision rounds f32
# operands to TF32 (10-bit mantissa: ~1e-3 off a float64 oracle), so on a GPU
# machine the suite asks for full f32 as XLA:CPU computes it. The kernels'
# f32 dots ask for it themselves.
if shutil.which("nvidia-smi"):
  os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# The CLI's persistent compilation cache defaults to $XDG_CACHE_HOME: keep
# test runs out of the user's cache.
# Removed when the run ends (by the process that made it, not its children).
_TEST_CACHE_HOME = tempfile.mkdtemp(prefix="pkvattn-test-cache-")
os.environ["XDG_CACHE_HOME"] = _TEST_CACHE_HOME
_OWNER_PID = os.getpid()
atexit.register(lambda: os.getpid() == _OWNER_PID and shutil.rmtree(
    _TEST_CACHE_HOME, ignore_errors=True))

SEED_ENV = "PKVATTN_TEST_SEED"


@pytest.fixture
def cuda_lowering():
  """The test's lowerings for CUDA run on a machine without a GPU under
  every supported jax (`attention_utils.cuda_target`)."""
  import attention_utils  # noqa: PLC0415  (imports jax: after XLA_FLAGS)
  with attention_utils.cuda_target():
    yield


@pytest.fixture
def rng(request):
  """A `np.random.Generator` with a fresh seed each run, so the inputs vary
  from run to run; a failing test's report names its seed, and
  `PKVATTN_TEST_SEED=<seed>` replays those inputs."""
  seed = os.environ.get(SEED_ENV)
  seed = int(seed) if seed else np.random.SeedSequence().entropy
  request.node.user_properties.append((SEED_ENV, seed))
  return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ARG001
  """Adds the `rng` fixture's seed to a failed test's report."""
  outcome = yield
  report = outcome.get_result()
  if report.failed:
    for name, seed in item.user_properties:
      if name == SEED_ENV:
        report.sections.append(
            ("random inputs", f"replay them with {SEED_ENV}={seed}"))


@pytest.fixture(scope="module")
def shared_gguf_readers():
  """One `gguf.GGUFReader` per GGUF file for the module's tests.

  transformers parses a GGUF file's metadata for its config, its weights
  and its tokenizer (`from_pretrained(..., gguf_file=...)`), and pkvattn's
  loader parses it once more: four parses of one file, about 20 s each for
  Gemma 3's 262k-token vocabulary on a 2-core CI machine. A reader is a
  read-only memory map, so one per file (keyed by path, modification time
  and size) returns what four would.
  """
  gguf = pytest.importorskip("gguf")
  original = gguf.GGUFReader
  readers = {}

  def shared(path, mode="r"):
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_mtime_ns, st.st_size, mode)
    if key not in readers:
      readers[key] = original(path, mode)
    return readers[key]

  gguf.GGUFReader = shared
  yield
  gguf.GGUFReader = original


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


@pytest.fixture(autouse=True)
def _memory_maps_under_the_cap():
  """Before a test, a worker near Linux's cap on memory maps releases the
  executables it keeps (`memory_maps`: past the cap XLA:CPU segfaults in
  its next compile)."""
  import memory_maps
  n = memory_maps.count()
  if n is not None and n > memory_maps.budget():
    memory_maps.release_executables()
  yield


@pytest.fixture
def fake_gpu(monkeypatch):
  """`fake_gpu(dispatch.HOPPER)` makes `dispatch.current_gpu()` answer that
  GPU for the rest of the test: the one way tests fake a GPU generation
  (kernels ask `dispatch.current_gpu`, never the device)."""
  from pkvattn.pallas_kernels import dispatch  # noqa: PLC0415

  def fake(gpu):
    monkeypatch.setattr(
        dispatch, "current_gpu",
        lambda interpret=False: dispatch.INTERPRET if interpret else gpu)
  return fake
