"""Version shims for Pallas (Triton and Mosaic GPU) across jax 0.10.2 .. 0.12.

Pallas-Triton is deprecated since jax 0.11.0 but still shipped; a GPU
`pallas_call` without explicit Triton compiler params goes to Mosaic GPU, so
every kernel passes `triton_params(...)`. The deprecation warning is filtered
here, around our own calls only (`suppress_triton_deprecation`). jax 0.11.2
warns when a Triton kernel is lowered: under a caller's jit that is at its
compile, outside the filter (the test run ignores it: pyproject.toml).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

from jax.experimental import pallas as pl

try:  # jax >= 0.10: jax.experimental.pallas.triton
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
  pltriton = None


def triton_params(num_warps: int = 4, num_stages: int = 2):
  """Triton compiler params for `pl.pallas_call(compiler_params=...)`."""
  if pltriton is not None and hasattr(pltriton, "CompilerParams"):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  from jax.experimental.pallas import gpu as plgpu  # pragma: no cover
  return plgpu.TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)


@contextlib.contextmanager
def suppress_triton_deprecation():
  """Silences only the Pallas-Triton deprecation warning."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=FutureWarning)
    yield


def mosaic_gpu():
  """Imports Mosaic GPU Pallas lazily (only the Hopper kernels need it)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415
  return plgpu


def ref_type(*, write: bool = True):
  """`plgpu.RefType` of an `inline_mgpu` argument, saying whether the
  inline code writes the ref. jax 0.12's `pl.kernel` refuses a kernel whose
  inline code may write an input passed as an array, and learns from
  `write=False` that it does not; before 0.12 a RefType has no such field
  (every ref counts as read and written, and nothing checks inputs)."""
  plgpu = mosaic_gpu()
  fields = {f.name for f in dataclasses.fields(plgpu.RefType)}
  if not write and "write" in fields:
    return plgpu.RefType(write=False)
  return plgpu.RefType()


def mgpu_store_any_layout(ref, value):
  """`ref[...] = value` from registers of any layout into shared memory
  whatever its transforms: jax 0.12 refuses such a store where it has no
  conflict-free ("optimized") form unless asked with
  `plgpu.store(optimized=False)`; jax 0.10 / 0.11 store it either way
  (`plgpu.store` is new in 0.12)."""
  plgpu = mosaic_gpu()
  if hasattr(plgpu, "store"):
    plgpu.store(ref, value, optimized=False)
  else:
    ref[...] = value


def mgpu_load(ref, layout):
  """`plgpu.load` of a whole (already indexed) shared-memory ref into
  registers of `layout`: jax 0.10 takes the index as a second argument,
  jax 0.11 deprecates it (index the ref with `.at[...]` instead)."""
  import inspect  # noqa: PLC0415
  plgpu = mosaic_gpu()
  param = inspect.signature(plgpu.load).parameters.get("idx")
  if param is not None and param.default is inspect.Parameter.empty:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def compute_capability() -> tuple[int, int] | None:
  """(major, minor) of JAX's first device where it is an NVIDIA GPU, else
  None."""
  import jax  # noqa: PLC0415
  try:
    dev = jax.devices()[0]
  except RuntimeError:  # pragma: no cover
    return None
  cc = str(getattr(dev, "compute_capability", ""))
  if dev.platform != "gpu" or "." not in cc:
    return None
  major, minor = cc.split(".")[:2]
  return int(major), int(minor)


def num_sms() -> int:
  """Streaming multiprocessors of JAX's first device (132 where it does not
  say: H100 / H200 SXM)."""
  import jax  # noqa: PLC0415
  try:
    n = int(getattr(jax.devices()[0], "core_count", 0) or 0)
  except (RuntimeError, TypeError, ValueError):  # pragma: no cover
    n = 0
  return n if n > 0 else 132


def has_fp8_cvt() -> bool:
  """Whether the GPU converts e4m3 pairs to f16 in one instruction
  (`cvt.rn.f16x2.e4m3x2`: compute capability >= 8.9)."""
  cc = compute_capability()
  return cc is not None and cc >= (8, 9)


def is_hopper() -> bool:
  """Whether JAX's first device is a compute capability 9.0 GPU (wgmma and
  TMA as the Mosaic-GPU kernels use them are sm_90a only)."""
  return compute_capability() == (9, 0)


__all__ = ["pl", "pltriton", "triton_params", "suppress_triton_deprecation",
           "mosaic_gpu", "mgpu_load", "is_hopper", "compute_capability",
           "has_fp8_cvt", "num_sms"]

