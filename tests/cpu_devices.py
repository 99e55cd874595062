"""A test script run in a subprocess on several forced CPU devices.

XLA fixes the host platform's device count when jax starts, and the test
process has one device: multi-device tests (meshes, shardings, tensor
parallelism) run their script in a fresh interpreter with
`--xla_force_host_platform_device_count` and read back the JSON it prints
on a line starting with `RESULT` (`run_script`; `test_multiprocess`, whose
processes run side by side, takes the flags and the result line alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def xla_flags(num_devices: int) -> str:
  """The test run's `XLA_FLAGS` plus `num_devices` forced host devices."""
  return (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform"
          f"_device_count={num_devices}").strip()


def result_of(stdout: str) -> dict:
  """The JSON of the last line of `stdout` that starts with `RESULT`."""
  line = [l for l in stdout.splitlines() if l.startswith("RESULT")][-1]
  return json.loads(line[len("RESULT"):])


def run_script(script: str, *args: str, num_devices: int = 4,
               timeout: float = 600) -> dict:
  """Runs `python -c script args...` on `num_devices` CPU devices and
  returns the JSON of its last `RESULT` line (the process must exit 0;
  its stderr tail is the failure message otherwise)."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(num_devices), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", script, *args], env=env,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return result_of(proc.stdout)
