"""Multi-process start-up: `jax.distributed.initialize` from flags or the
environment.

One program runs in every process (one per GPU or group of GPUs, on one host
or several); after `initialize`, `jax.devices()` lists every process's
devices, a mesh over them (`pkvattn.parallel.make_mesh`) spans the
processes, and the same `Engine(model, config, mesh=mesh)` code runs SPMD in
each of them, given the same requests in the same order: the host
bookkeeping is replicated, and XLA's collectives (NCCL on GPUs, gloo on
CPUs) are the only transport.

The launch is read from, in order: the arguments, `PKVATTN_COORDINATOR`
(`host:port` of process 0), `PKVATTN_NUM_PROCESSES`, `PKVATTN_PROCESS_ID`,
else nothing: a single process (for jax's own cluster detection, SLURM or
Open MPI, call `jax.distributed.initialize()` instead). The same program
thus runs alone or as one of several processes.

Example (two processes on one host, one device each):
  $ PKVATTN_COORDINATOR=127.0.0.1:12345 PKVATTN_NUM_PROCESSES=2 \\
      PKVATTN_PROCESS_ID=0 python serve.py &
  $ PKVATTN_COORDINATOR=127.0.0.1:12345 PKVATTN_NUM_PROCESSES=2 \\
      PKVATTN_PROCESS_ID=1 python serve.py
"""

from __future__ import annotations

import os
from typing import Sequence

import jax

COORDINATOR_ENV = "PKVATTN_COORDINATOR"
NUM_PROCESSES_ENV = "PKVATTN_NUM_PROCESSES"
PROCESS_ID_ENV = "PKVATTN_PROCESS_ID"

__all__ = ["COORDINATOR_ENV", "NUM_PROCESSES_ENV", "PROCESS_ID_ENV",
           "initialize"]


def _env_int(name: str) -> int | None:
  value = os.environ.get(name, "").strip()
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(
        f"Invalid {name}: expected an integer, got {value!r}") from None


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None, *,
               local_device_ids: Sequence[int] | None = None) -> bool:
  """Joins this process to the others (`jax.distributed.initialize`);
  returns whether it did (False: none of the three given or set, a single
  process).

  Call it before anything else touches jax's devices. On CPUs the
  cross-process collectives go through gloo
  (`jax_cpu_collectives_implementation`; without it a CPU computation
  spanning processes fails to run); GPUs use NCCL.

  Args:
    coordinator_address: `host:port` of process 0's coordinator; default
      `$PKVATTN_COORDINATOR`.
    num_processes: processes in all; default `$PKVATTN_NUM_PROCESSES`.
    process_id: this process's index in `[0, num_processes)`; default
      `$PKVATTN_PROCESS_ID`.
    local_device_ids: the local devices this process uses (default all).

  Raises:
    ValueError: some of the three given and others not, a non-integer
      environment value, or `process_id` outside `[0, num_processes)`.
  """
  address = coordinator_address or os.environ.get(COORDINATOR_ENV) or None
  n = num_processes if num_processes is not None else _env_int(
      NUM_PROCESSES_ENV)
  pid = process_id if process_id is not None else _env_int(PROCESS_ID_ENV)
  given = [v is not None for v in (address, n, pid)]
  if any(given) and not all(given):
    raise ValueError(
        f"Invalid launch: expected coordinator_address, num_processes and "
        f"process_id together (or {COORDINATOR_ENV}, {NUM_PROCESSES_ENV}, "
        f"{PROCESS_ID_ENV}), got {address=}, num_processes={n}, "
        f"process_id={pid}")
  if not any(given):
    return False
  if not (n >= 1 and 0 <= pid < n):
    raise ValueError(
        f"Invalid process_id: expected in [0, {n}), got {pid}")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = {}
  if local_device_ids is not None:
    kwargs["local_device_ids"] = list(local_device_ids)
  jax.distributed.initialize(address, num_processes=n, process_id=pid,
                             **kwargs)
  return True
