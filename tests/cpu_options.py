"""XLA:CPU compile settings of the test run, importable by tests.

Most of the suite's time is compiling. LLVM -O0 without the expensive passes
compiles small programs much faster (the suite took about 20% less CPU
time); it runs large ones slower, so the real-model engine test sets
`OPTIMIZED_CPU_OPTIONS` on its programs. XLA:CPU's older loop emitters
instead of its MLIR fusion emitters, and copy insertion without region
analysis, compile the engine's programs about a third faster again (jaxlib
0.10.2, 2-core machine) and run the real-model tests no slower; jaxlib 0.11
has no loop-emitter flag (an unknown flag in XLA_FLAGS aborts the process),
so it is set for older jaxlibs only. `conftest.py` puts `FAST_CPU_FLAGS` in
XLA_FLAGS.

A module of its own, not `conftest.py`: pytest imports every folder's
`conftest.py` under the one module name `conftest`, so `import conftest`
in a test would find whichever it loaded last.
"""

import os
from importlib import metadata


def _jaxlib_version() -> tuple[int, int]:
  """(major, minor) of the installed jaxlib, read without importing jax."""
  try:
    return tuple(int(x) for x in metadata.version("jaxlib").split(".")[:2])
  except (metadata.PackageNotFoundError, ValueError):
    return (0, 0)


FAST_CPU_FLAGS = ("--xla_backend_optimization_level=0",
                  "--xla_llvm_disable_expensive_passes=true",
                  "--xla_cpu_copy_insertion_use_region_analysis=false",
                  *(("--xla_cpu_use_fusion_emitters=false",)
                    if _jaxlib_version() < (0, 11) else ()))
OPTIMIZED_CPU_OPTIONS = {"xla_backend_optimization_level": 2,
                         "xla_llvm_disable_expensive_passes": False}
# XLA's defaults for the codegen flags above.
_CODEGEN_DEFAULTS = {"xla_cpu_use_fusion_emitters": True,
                     "xla_cpu_copy_insertion_use_region_analysis": True}


def default_codegen_options() -> dict[str, bool]:
  """XLA's defaults for the codegen flags this run's XLA_FLAGS change, as
  compile options: tests that read a compiled program's structure (an
  in-place scatter, no pool-sized copy) compile with them, so they check
  what a user's XLA:CPU builds. Empty where conftest left XLA_FLAGS alone
  (a GPU machine): XLA's defaults hold there, and passing an option the
  jaxlib lacks is an error."""
  flags = os.environ.get("XLA_FLAGS", "")
  return {k: v for k, v in _CODEGEN_DEFAULTS.items() if f"--{k}=" in flags}


def to_cpu(tree):
  """`tree`'s arrays committed to the CPU, so that a jit of them compiles
  for XLA:CPU whatever the default backend: tests that read XLA:CPU's
  compiled programs run on any machine (a GPU backend knows neither the
  options above nor XLA:CPU's codegen)."""
  import jax  # noqa: PLC0415  (conftest imports this before it sets XLA_FLAGS)
  return jax.device_put(tree, jax.devices("cpu")[0])
