"""Every benchmark and tool imports and parses its command line (`--help`),
and offers `--out`."""

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
SCRIPTS = sorted(
    os.path.relpath(p, ROOT)[:-3].replace(os.sep, ".")
    for p in glob.glob(os.path.join(ROOT, "bench", "*.py"))
    + glob.glob(os.path.join(ROOT, "bench", "tools", "*.py"))
    if not p.endswith("__init__.py"))


def test_at_most_sixteen_benchmarks():
  top = [s for s in SCRIPTS if s.count(".") == 1]
  assert 0 < len(top) <= 16, top


@pytest.mark.parametrize("module", SCRIPTS)
def test_help_runs(module):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "--out" in proc.stdout, proc.stdout
