"""One error format for trace-time argument checks.

Every check raises `ValueError` naming the argument, with expected vs got, so the
message reads the same whichever op raised it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Shape / rank / integer checks are shared with `cache` (which must not import
# `pkvattn`), so they live there and are re-exported here.
from pkvattn.cache._checks import as_index_array as as_index_array
from pkvattn.cache._checks import check_int as check_int
from pkvattn.cache._checks import check_ndim as check_ndim
from pkvattn.cache._checks import check_shape as check_shape


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


def resolve_impl(impl) -> str:
  """An op's `impl` as named ("pallas" / "xla"); None is "pallas" on a GPU,
  else "xla". Raises ValueError for another value."""
  if impl is None:
    return "pallas" if is_gpu() else "xla"
  check_choice(impl, ("pallas", "xla"), "impl")
  return impl
