"""Which kernel runs each op, and with which config: one rule per op.

Each op has one function here that maps the static facts of a call (GPU
generation, dtypes, head_dim, group size, page size, window, query tokens per
sequence, batch shape) to a `Choice` of backend and config. The functions read
top to bottom: the first rule that matches wins. `docs/kernels.md` mirrors each
rule as a table and `tests/test_dispatch.py` asserts every row of it, so a
change of default shows up in both.

Only this module asks which GPU is present (`current_gpu`); kernels'
`supports()` functions check shapes and dtypes, never the device. Tests fake
the GPU one way: they pass `gpu=` (e.g. `HOPPER`) to these functions, or
patch `current_gpu` through the `fake_gpu` fixture of `tests/conftest.py`.
"""

from __future__ import annotations

import dataclasses
import functools

from pkvattn.pallas_kernels import _compat


@dataclasses.dataclass(frozen=True)
class Gpu:
  """The device a kernel is chosen for.

  Attributes:
    compute_capability: `(major, minor)` of an NVIDIA GPU, or None where no
      GPU runs the kernel (Pallas interpret mode on the CPU).
    num_sms: streaming multiprocessors; steers split and grid sizes only.
  """
  compute_capability: tuple[int, int] | None
  num_sms: int = 132

  @property
  def interpret(self) -> bool:
    """No GPU: kernels run in Pallas interpret mode."""
    return self.compute_capability is None

  @property
  def is_hopper(self) -> bool:
    """Compute capability 9.0: wgmma and TMA as the Mosaic-GPU kernels use
    them are sm_90a only."""
    return self.compute_capability == (9, 0)

  @property
  def has_fp8_cvt(self) -> bool:
    """e4m3 pairs convert to f16 in one instruction
    (`cvt.rn.f16x2.e4m3x2`: compute capability >= 8.9)."""
    return (self.compute_capability is not None
            and self.compute_capability >= (8, 9))


# The generations the dispatch tables name.
INTERPRET = Gpu(None)
AMPERE = Gpu((8, 0), 108)    # A100
ADA = Gpu((8, 9), 128)       # L40S / RTX 4090 class
HOPPER = Gpu((9, 0), 132)    # H100 / H200 SXM
GPUS = {"interpret": INTERPRET, "ampere": AMPERE, "ada": ADA,
        "hopper": HOPPER}


@functools.cache
def _detected_gpu() -> Gpu:
  cc = _compat.compute_capability()
  return Gpu(cc, _compat.num_sms()) if cc is not None else INTERPRET


def current_gpu(interpret: bool = False) -> Gpu:
  """The GPU of JAX's first device (`INTERPRET` where there is none, or
  where `interpret` asks for Pallas interpret mode)."""
  return INTERPRET if interpret else _detected_gpu()


@dataclasses.dataclass(frozen=True)
class Choice:
  """A dispatch decision: the backend's name and its config (the config
  class belongs to the backend's kernel module)."""
  backend: str
  config: object
