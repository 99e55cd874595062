"""One error format for trace-time argument checks.

Every check raises `ValueError` naming the argument, with expected vs got, so the
message reads the same whichever op raised it.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


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


def check_dtype(x, allowed, name: str) -> None:
  """Raises ValueError unless `x.dtype` is one of `allowed`."""
  allowed = tuple(jnp.dtype(a) for a in allowed)
  if jnp.dtype(x.dtype) not in allowed:
    raise ValueError(
        f"Invalid dtype of {name}: expected one of "
        f"{[str(a) for a in allowed]}, got {jnp.dtype(x.dtype)}")


def check_same_dtype(x, ref, name: str, ref_name: str) -> None:
  """Raises ValueError unless `x.dtype == ref.dtype`."""
  if jnp.dtype(x.dtype) != jnp.dtype(ref.dtype):
    raise ValueError(
        f"Invalid dtype of {name}: expected {jnp.dtype(ref.dtype)} (the dtype "
        f"of {ref_name}), got {jnp.dtype(x.dtype)}")


def check_int(x, name: str) -> None:
  """Raises ValueError unless `x` has an integer dtype."""
  if not jnp.issubdtype(jnp.dtype(x.dtype), jnp.integer):
    raise ValueError(
        f"Invalid dtype of {name}: expected an integer dtype, got "
        f"{jnp.dtype(x.dtype)}")


def check_heads(num_qo_heads: int, num_kv_heads: int) -> None:
  if num_kv_heads <= 0 or num_qo_heads % num_kv_heads:
    raise ValueError(
        f"{num_qo_heads=} must be a positive multiple of {num_kv_heads=}")


def check_choice(value, choices, name: str) -> None:
  if value not in choices:
    raise ValueError(
        f"Invalid {name}: expected one of {tuple(choices)}, got {value!r}")


def is_gpu() -> bool:
  """True when the default backend is a CUDA/ROCm GPU."""
  return jax.default_backend() == "gpu"
