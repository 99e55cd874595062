"""Counting XLA compilations in a test, through `jax.monitoring`.

`count_compiles` registers a listener on XLA's backend compile event
(`BACKEND_COMPILE`) for the length of a `with` block; the engine tests use
it to prove a workload compiles nothing after `Engine.warmup()`
(`test_engine_compile_once.py`, `test_engine_fp8.py`,
`test_engine_host_tier.py`).
"""

from __future__ import annotations

import contextlib

import jax
import jax.monitoring

# The duration event JAX records once per backend (XLA) compilation.
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles():
  """Context manager yielding a list that gets one `BACKEND_COMPILE` entry
  per XLA backend compilation made inside the `with` block (a
  `jax.monitoring` listener, removed on exit)."""
  events = []

  def listener(name, secs, **kwargs):
    del secs, kwargs
    if name == BACKEND_COMPILE:
      events.append(name)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
