"""`bench.tools.gpu_compile`: programs a pytest run jits, compiled for an H100
with no GPU (where jax's CUDA plugin is installed; skipped otherwise), and
its command line."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))



def _cuda_plugin() -> bool:
  try:
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}")
               for v in (12, 13))
  except ModuleNotFoundError:
    return False


needs_cuda_plugin = pytest.mark.skipif(
    not _cuda_plugin(), reason="needs jax's CUDA plugin (jax[cuda13])")

# One program XLA:GPU compiles, one it must refuse (a custom call that no GPU
# library registers), one shape repeated (compiled once).
PROGRAMS = textwrap.dedent("""
    import jax, jax.numpy as jnp

    def test_programs():
      f = jax.jit(lambda x: jnp.cumsum(x * 2.0, axis=1))
      for _ in range(2):
        assert float(f(jnp.ones((4, 8)))[0, -1]) == 16.0

      def g(x):
        return jax.ffi.ffi_call(
            "pkvattn_no_such_target", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
      jax.jit(g).lower(jnp.ones((3,)))
    """)


def _run_tool(*args):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep
             + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", "bench.tools.gpu_compile",
                         *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)


def test_pytest_usage_error_is_an_argparse_error(tmp_path):
  proc = _run_tool("--out", str(tmp_path), "tests/cache/test_state.py", "--",
                   "--no-such-pytest-flag")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "error: pytest refused its arguments" in proc.stderr
  assert "Traceback" not in proc.stderr
  assert not list(tmp_path.iterdir())


@needs_cuda_plugin
def test_counts_programs_and_reports_a_refused_one(tmp_path):
  (tmp_path / "test_programs.py").write_text(PROGRAMS)
  proc = _run_tool("--out", str(tmp_path / "out"),
                   str(tmp_path / "test_programs.py"), "--", "--rootdir",
                   str(tmp_path))
  assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
  res = json.loads((tmp_path / "out"
                    / "gpu_compile_NVIDIA_H100_80GB_HBM3.json").read_text())
  assert "1 passed" in proc.stdout and res["failed"] == 1
  assert res["programs"] >= 2
  (row,) = res["rows"]
  assert row["program"] == "g" and row["stage"] == "compile"
  assert row["test"].endswith("test_programs.py::test_programs")
  assert "pkvattn_no_such_target" in row["error"]
