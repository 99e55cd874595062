"""Text helpers for the kernels' inline PTX."""

from __future__ import annotations

import struct


def f32(x: float) -> str:
  """A float32 immediate in PTX's hex form (`0fXXXXXXXX`), exact for any
  value a Python float rounds to in float32."""
  return "0f%08X" % struct.unpack(">I", struct.pack(">f", x))[0]
