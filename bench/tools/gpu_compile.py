"""Compiles every program a pytest run jits for an NVIDIA H100, with no GPU.

XLA:GPU compiles ahead of time from a description of its target (a
`GpuTargetConfigProto` plus a topology) instead of an attached device. As a
pytest plugin, this module lowers each single-device program that the tests
jit a second time, for CUDA, and compiles it with the CUDA plugin's
compile-only client; the tests themselves run on the CPU as usual. It checks
that the installed jax's GPU compiler accepts every program (fusion, tiling,
code generation, ptxas), on a CPU machine: a jax release is checked this way
before the scarce GPU time. It does not check what the programs compute, nor
the Pallas kernels' GPU lowering (on the CPU the tests take the XLA path or
interpret the kernels).

Needs the CUDA plugin of the installed jax beside it
(`pip install "jax[cuda13]==<jax version>"`; no GPU or driver). Usage:

    python -m bench.tools.gpu_compile [--out DIR] [TESTS ...] [-- PYTEST ARGS]

runs pytest on TESTS (default: the cache, serving and ops tests) with the
plugin, writes `<out>/gpu_compile_<target>.json` (one row per program that
failed, the counts beside them) and prints the failures last; exit status 1
if any failed. Or as a plugin of one's own pytest run (one process, no `-n`):
`JAX_PLATFORMS=cpu python -m pytest -p bench.tools.gpu_compile tests/cache`.
Built on jax internals (`pxla.lower_sharding_computation`, compile-only
devices from `jax.experimental.topologies`), checked with jax 0.12.1.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import numpy as np

from bench.common import results as results_lib

# NVIDIA H100 SXM (sm_90a): the facts XLA:GPU's cost models and emitters read.
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  device_address_bits: 64
  name: "NVIDIA H100 80GB HBM3"
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


TARGET = "NVIDIA H100 80GB HBM3"
DEFAULT_TESTS = ("tests/cache", "tests/serving", "tests/ops")


class GpuCompileCheck:
  """Wraps jax's lowering: each new single-device program is compiled for the GPU.

  `programs` counts the distinct programs compiled (by their StableHLO
  text); `failures` holds `{test, program, stage, error}` per failure, stage
  "lower" (the CUDA lowering) or "compile" (XLA:GPU).
  """

  def __init__(self):
    from jax.experimental import topologies
    from jax._src.interpreters import pxla
    from jax._src.lib import _jax
    topo = topologies.get_topology_desc(
        "", platform="cuda", target_config=H100_TARGET_CONFIG,
        topology="1x1x1")
    self.device = topo.devices[0]
    self.device_list = _jax.DeviceList((self.device,))
    self.failures: list[dict] = []
    self.test = "?"
    self._seen: set[str] = set()
    self._busy = False
    self._pxla = pxla
    self._lower = pxla.lower_sharding_computation
    pxla.lower_sharding_computation = self._lower_and_check

  @property
  def programs(self) -> int:
    return len(self._seen)

  def close(self):
    self._pxla.lower_sharding_computation = self._lower

  def _lower_and_check(self, closed_jaxpr, api_name, fun_name, in_shardings,
                       out_shardings, *args, **kwargs):
    out = self._lower(closed_jaxpr, api_name, fun_name, in_shardings,
                      out_shardings, *args, **kwargs)
    devices = {d for s in (*in_shardings, *out_shardings)
               if hasattr(s, "device_set") for d in s.device_set}
    if (self._busy or kwargs.get("lowering_platforms") is not None
        or len(devices) > 1):
      return out
    self._busy = True
    try:
      self._check(closed_jaxpr, api_name, fun_name, in_shardings,
                  out_shardings, args, kwargs)
    finally:
      self._busy = False
    return out

  def _check(self, closed_jaxpr, api_name, fun_name, in_shardings,
             out_shardings, args, kwargs):
    from jax._src import compiler
    failure = dict(test=self.test, program=fun_name)
    try:
      lowered = self._lower(closed_jaxpr, api_name, fun_name, in_shardings,
                            out_shardings, *args,
                            **dict(kwargs, lowering_platforms=("cuda",)))
      module = lowered.stablehlo()
    except Exception as e:  # the CUDA lowering itself
      self.failures.append(dict(failure, stage="lower", error=_first_line(e)))
      return
    key = hashlib.sha1(str(module).encode()).hexdigest()
    if key in self._seen:
      return
    self._seen.add(key)
    options = compiler.get_compile_options(
        1, 1, device_assignment=np.array([[0]]))
    try:
      self.device.client.compile(module, executable_devices=self.device_list,
                                 compile_options=options)
    except Exception as e:
      self.failures.append(dict(failure, stage="compile", error=_first_line(e)))


def _first_line(e: Exception) -> str:
  return str(e).strip().split("\n")[0][:500]


_checks: list[GpuCompileCheck] = []


def pytest_configure(config):
  config._gpu_compile = GpuCompileCheck()
  _checks.append(config._gpu_compile)


def pytest_runtest_setup(item):
  item.config._gpu_compile.test = item.nodeid


def pytest_unconfigure(config):
  config._gpu_compile.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  check = config._gpu_compile
  terminalreporter.section("GPU compile (bench.tools.gpu_compile)")
  terminalreporter.write_line(
      f"{check.programs} programs compiled for an H100, "
      f"{len(check.failures)} failed")
  for r in check.failures:
    terminalreporter.write_line(
        f"FAILED {r['test']} {r['program']} ({r['stage']}): {r['error']}")


def pytest_sessionfinish(session, exitstatus):
  if session.config._gpu_compile.failures and exitstatus == 0:
    session.exitstatus = 1


def main(argv=None):
  ap = argparse.ArgumentParser(
      description=__doc__.split("\n\n", maxsplit=1)[0])
  ap.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS),
                  help="test paths (default: %(default)s); pytest's own "
                  "arguments after --")
  results_lib.add_out_arg(ap)
  argv = list(sys.argv[1:] if argv is None else argv)
  extra = argv[argv.index("--") + 1:] if "--" in argv else []
  args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
  os.environ["JAX_PLATFORMS"] = "cpu"
  import pytest  # pylint: disable=import-outside-toplevel
  env = results_lib.environment()
  code = pytest.main(["-q", "-p", "no:cacheprovider", *args.tests, *extra],
                     plugins=[sys.modules[__name__]])
  if not _checks:  # pytest stopped before configuring (its usage error)
    ap.error(f"pytest refused its arguments (exit {int(code)}): "
             f"{' '.join([*args.tests, *extra])}")
  check = _checks[-1]
  env.update(device=TARGET, platform="cuda (compile only, on the CPU)")
  name = f"gpu_compile_{TARGET.replace(' ', '_')}"
  results_lib.write(name, check.failures, out=args.out, env=env,
                    extra=dict(tests=args.tests, programs=check.programs,
                               failed=len(check.failures),
                               pytest_exit=int(code)))
  print(f"{check.programs} programs compiled for an H100 "
        f"(jax {env['versions'].get('jaxlib')}), {len(check.failures)} failed")
  for r in check.failures:
    print(f"  {r['test']} {r['program']} ({r['stage']}): {r['error'][:200]}")
  return 1 if check.failures else int(code)


if __name__ == "__main__":
  sys.exit(main())
