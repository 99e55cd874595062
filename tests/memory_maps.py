"""The process's memory maps against Linux's cap on them.

XLA:CPU maps each compiled kernel's code and data into memory regions of
their own: an engine program of the tiny test model holds about 700. Linux
caps a process at `vm.max_map_count` regions (65,530 by default); past the
cap XLA's next compile fails to allocate ("LLVM compilation error: Cannot
allocate memory") and the process segfaults inside the compile. A test
worker compiles hundreds of programs and keeps them (jax's caches, the
engine's per-process executables), so it can reach the cap; `tests/conftest`
releases them before a test once a worker passes `budget()`.
"""

from __future__ import annotations

import gc

# The most one test has added, with room to spare (the largest seen on the
# CPU suite: about 6,500, a hybrid-layout engine test).
HEADROOM = 25_000


def count() -> int | None:
  """Memory maps of this process (None where /proc is missing)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return f.read().count(b"\n")
  except OSError:
    return None


def cap() -> int:
  """`vm.max_map_count` (Linux's default where it cannot be read)."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return 65_530


def budget() -> int:
  """Maps past which a worker releases its executables before a test."""
  return max(cap() - HEADROOM, cap() // 2)


def release_executables() -> None:
  """Drops every executable this process keeps (jax's caches and
  `pkvattn.serving.compiler`'s), so their maps are unmapped once nothing
  else holds them; later calls compile again."""
  import jax
  from pkvattn.serving import compiler
  compiler.clear_compiled()
  jax.clear_caches()
  gc.collect()
