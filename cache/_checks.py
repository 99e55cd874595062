"""Trace-time argument checks in the project's one error format (re-exported by `pkvattn/_checks.py`).

Kept local so that `cache` depends on jax/numpy only, never on `pkvattn`.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np


def as_index_array(x):
  """`jnp.asarray(x)` for integer arguments given as arrays or Python lists.

  An empty list has no dtype to infer (numpy says float): it becomes int32.
  Tracers and arrays pass unchanged.
  """
  if isinstance(x, (list, tuple)):
    a = np.asarray(x)
    if a.size == 0:
      return jnp.zeros(a.shape, jnp.int32)
  return jnp.asarray(x)


def check_shape(x, expected: Sequence[int | None], name: str) -> None:
  """Raises ValueError unless `x.shape` matches `expected` (`None` = any)."""
  shape = tuple(np.shape(x))
  ok = len(shape) == len(expected) and all(
      e is None or e == s for e, s in zip(expected, shape))
  if not ok:
    shown = tuple("*" if e is None else e for e in expected)
    raise ValueError(f"Invalid shape of {name}: expected {shown}, got {shape}")


def check_ndim(x, ndims: Sequence[int], name: str) -> None:
  """Raises ValueError unless `x.ndim` is one of `ndims`."""
  if np.ndim(x) not in ndims:
    raise ValueError(
        f"Invalid rank of {name}: expected ndim in {tuple(ndims)}, got "
        f"{np.ndim(x)} (shape {tuple(np.shape(x))})")


def check_int(x, name: str) -> None:
  """Raises ValueError unless `x` has an integer dtype."""
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(
        f"Invalid dtype of {name}: expected an integer dtype, got {dtype}")


def _is_size(value) -> bool:
  """A Python int >= 1 (`bool` is not a size)."""
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_positive_int(value, name: str) -> None:
  """Raises ValueError unless `value` is a Python int >= 1 (a config size)."""
  if not _is_size(value):
    raise ValueError(f"Invalid {name}: expected a positive int, got {value!r}")


def check_power_of_two(value, name: str) -> None:
  """Raises ValueError unless `value` is None or a Python int that is a
  power of two (a hash table's bucket count)."""
  if value is not None and (not _is_size(value) or value & (value - 1)):
    raise ValueError(
        f"Invalid {name}: expected a power of two or None, got {value!r}")
