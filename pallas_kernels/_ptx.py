"""PTX text helpers: `f32` lives in `_mlir` with the other inline-PTX
helpers; this module keeps its old import path (`_ptx.f32`)."""

from __future__ import annotations

from pkvattn.pallas_kernels._mlir import f32

__all__ = ["f32"]
