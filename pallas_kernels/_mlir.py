"""Inline PTX and MLIR helpers for the Mosaic-GPU kernels' per-thread code.

Four kernels are written per thread, as a CUDA kernel would be, inside
`plgpu.inline_mgpu`: the `mma.sync` decode kernel (`paged_decode_mma`), the
RoPE + append kernel (`rope_append_mgpu`), the plan kernel (`plan_mgpu`)
and the packed-GQA row loads / stores of the prefill kernel (`_mgpu_rows`).
Their bodies build MLIR ops of the `arith` / `scf` / `memref` / `math` /
`llvm` dialects and PTX through `llvm.inline_asm`. This module is the one
definition of what they share: the bindings, integer types, constants, the
inline-asm op, address arithmetic, thread indices, a CTA barrier, typed
global loads and stores, and the layout of a 128-byte-swizzled wgmma
operand. Helpers only one kernel uses (the decode kernel's `mma` fragment
ops, the plan's scans) stay in that kernel's module.

Every helper emits its ops at the current MLIR insertion point (inside
`inline_mgpu`, or any `ir.InsertionPoint` with a `Location`), in the order
its docstring reads; none of them caches a value across calls.

MLIR bindings: the public `jaxlib.mlir` package. Mosaic GPU builds its IR
with it, and jax's private `jax._src.lib.mlir` re-exports the same module
objects (values made with one are accepted by the other); the private path
is only a fallback for a jaxlib without the public one.
"""

from __future__ import annotations

import struct

try:
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm, math, memref, scf
except ImportError:  # pragma: no cover
  from jax._src.lib.mlir import ir  # type: ignore[no-redef]
  from jax._src.lib.mlir.dialects import (  # type: ignore[no-redef]
      arith, llvm, math, memref, scf)

WARPGROUP = 128   # threads of a warpgroup
CHUNK = 16        # bytes a vector load / store / cp.async moves
SWIZZLE = 128     # bytes per swizzled row of an operand tile
TILE_ROWS = 8     # rows per operand tile

__all__ = ["ir", "arith", "llvm", "math", "memref", "scf", "WARPGROUP",
           "CHUNK", "SWIZZLE", "TILE_ROWS", "f32", "parse_type", "int_type",
           "const", "const_i32", "const_i64", "const_f32", "wide", "asm",
           "scalar", "splat", "address", "element_address",
           "swizzled_address", "thread_index", "lane_index", "cta_barrier",
           "load_global", "store_global", "elements", "vector"]


# ---------------------------------------------------------------- PTX text

def f32(x: float) -> str:
  """A float32 immediate in PTX's hex form (`0fXXXXXXXX`, the big-endian
  bits), exact for any value a Python float rounds to in float32; NaN and
  +-inf included."""
  return "0f%08X" % struct.unpack(">I", struct.pack(">f", x))[0]


# ------------------------------------------------------ types and constants

def parse_type(name: str) -> ir.Type:
  """The MLIR type spelled `name` ("i32", "f32", "bf16", "!llvm.ptr<1>",
  ...) in the current context."""
  return ir.Type.parse(name)


def int_type(bits: int) -> ir.IntegerType:
  """The signless integer type of `bits` bits."""
  return ir.IntegerType.get_signless(bits)


def const(x, ty):
  """An `arith.constant` of `x` in integer, index or float type `ty`.

  Raises:
    TypeError: a non-integer `x` for an integer or index type.
    NotImplementedError: another type.
  """
  if isinstance(ty, (ir.IntegerType, ir.IndexType)):
    if isinstance(x, bool) or not isinstance(x, int):
      raise TypeError(f"Invalid constant: expected an int for {ty}, got "
                      f"{type(x).__name__}")
    attr = ir.IntegerAttr.get(ty, x)
  elif isinstance(ty, ir.FloatType):
    attr = ir.FloatAttr.get(ty, x)
  else:
    raise NotImplementedError(f"constants of type {ty}")
  return arith.constant(ty, attr)


def const_i32(x: int):
  """An i32 constant."""
  return const(x, int_type(32))


def const_i64(x: int):
  """An i64 constant."""
  return const(x, int_type(64))


def const_f32(x: float):
  """An f32 constant (`x` rounded to float32)."""
  return const(float(x), ir.F32Type.get())


def wide(x):
  """An integer value zero-extended to i64 (`arith.extui`)."""
  return arith.extui(int_type(64), x)


# ---------------------------------------------------------------- inline PTX

def asm(text: str, operands, constraints: str, results=None, *,
        side_effects: bool | None = None):
  """One `llvm.inline_asm` op: PTX `text` on `operands` (`$i` numbers the
  results first, then the operands), LLVM `constraints` ("=r" an i32
  result, "=f" f32, "=h" i16, "l" an i64 operand, "r" i32, "f" f32).

  Args:
    results: None (no result: the op returns nothing), one type (returns
      the value) or a list of types (returns a list of values, unpacked from
      an `!llvm.struct` result by `llvm.extractvalue`).
    side_effects: `has_side_effects` of the op; None = True without results
      (so it is never removed), False with them (a pure computation the
      compiler may move, merge or drop if unused). Loads, thread-index
      reads and warp shuffles that must stay in place pass True.
  """
  if side_effects is None:
    side_effects = results is None
  if results is None:
    llvm.inline_asm(parse_type("!llvm.void"), list(operands), text,
                    constraints, has_side_effects=side_effects)
    return None
  if not isinstance(results, (list, tuple)):
    return llvm.inline_asm(results, list(operands), text, constraints,
                           has_side_effects=side_effects)
  packed = llvm.StructType.get_literal(list(results))
  out = llvm.inline_asm(packed, list(operands), text, constraints,
                        has_side_effects=side_effects)
  return [llvm.extractvalue(t, out, [i]) for i, t in enumerate(results)]


# ---------------------------------------------------- inline_mgpu arguments

def scalar(x):
  """The i32 value of a scalar argument of `inline_mgpu` (a splat array in
  the per-thread lowering, a plain value in the warpgroup one)."""
  regs = getattr(x, "registers", None)
  return x if regs is None else regs.flat[0]


def splat():
  """The layout of an i32 scalar argument of `inline_mgpu`."""
  from pkvattn.pallas_kernels import _compat  # noqa: PLC0415
  return _compat.mosaic_gpu().Layout.WG_SPLAT(shape=())


# ---------------------------------------------------------------- addresses

def address(ref, bits: int):
  """Byte address of a memref's first element as an integer of `bits`:
  32 for the shared-window address of a shared-memory ref, 64 for the
  generic address of a global-memory one (`llvm.ptrtoint` of Mosaic GPU's
  `memref_ptr`)."""
  from jax.experimental.mosaic.gpu import utils  # noqa: PLC0415
  return llvm.ptrtoint(int_type(bits), utils.memref_ptr(ref))


def element_address(ref, index, size: int):
  """Generic address (i64) of element `index` of `size` bytes of a
  global-memory ref: `address(ref, 64) + index * size`. `index`: i64, or
  i32 (zero-extended after the base is taken)."""
  base = address(ref, 64)
  if ir.IntegerType(index.type).width != 64:
    index = wide(index)
  return arith.addi(base, arith.muli(index, const_i64(size)))


def swizzled_address(base, row, c_tile, c_in, col_tiles: int):
  """Shared-window address (i32) of 16-byte chunk `c_in` of column tile
  `c_tile` of row `row` of a wgmma operand at `base` (i32 values;
  `col_tiles` static).

  The layout `plgpu.TilingTransform((8, 64))` + `plgpu.SwizzleTransform(128)`
  make of `[rows, head_dim]` 2-byte elements: tiles of 8 rows x 128 bytes,
  row tiles outer and column tiles inner; within a tile, chunk `c` of row
  `r` sits at chunk `c ^ r` (the PTX ISA's 128-byte swizzle mode), so the
  8 rows' chunks of one column land in 8 different banks."""
  c = const_i32
  r = arith.remui(row, c(TILE_ROWS))
  tile = arith.addi(
      arith.muli(arith.divui(row, c(TILE_ROWS)), c(col_tiles)), c_tile)
  return arith.addi(base, arith.addi(
      arith.muli(arith.addi(arith.muli(tile, c(TILE_ROWS)), r), c(SWIZZLE)),
      arith.muli(arith.xori(c_in, r), c(CHUNK))))


# ---------------------------------------------------------------- threads

def thread_index():
  """This thread's index in the CTA (i32, `%tid.x`)."""
  return asm("mov.u32 $0, %tid.x;", [], "=r", int_type(32),
             side_effects=True)


def lane_index():
  """This thread's index in its warpgroup (i32)."""
  return arith.remui(thread_index(), const_i32(WARPGROUP))


def cta_barrier():
  """Per thread: waits for every thread of the CTA (`barrier.sync 0`).

  Not `bar.sync` (= `barrier.sync.aligned`: every thread of a warp at the
  same instruction): the compiler may duplicate a barrier into the
  branches of a lane-divergent `when` just before it, and the threads of a
  warp that split there would then wait at two barriers and hang."""
  asm("barrier.sync 0;", [], "")


# ------------------------------------------------------ typed global memory

def load_global(addr, ty, align: int):
  """A value of type `ty` loaded from global-memory address `addr` (i64),
  `align` bytes aligned (`llvm.load` through an `!llvm.ptr<1>`)."""
  ptr = llvm.inttoptr(parse_type("!llvm.ptr<1>"), addr)
  return llvm.load(ty, ptr, alignment=align)


def store_global(value, addr, align: int):
  """Stores `value` at global-memory address `addr` (i64), `align` bytes
  aligned."""
  ptr = llvm.inttoptr(parse_type("!llvm.ptr<1>"), addr)
  llvm.store(value, ptr, alignment=align)


def elements(vec, n: int) -> list:
  """The `n` elements of an LLVM-compatible vector value."""
  i32 = parse_type("i32")
  return [llvm.extractelement(vec, const(i, i32)) for i in range(n)]


def vector(values, ty):
  """A vector of type `ty` holding `values` (from an `llvm.mlir.undef`)."""
  i32 = parse_type("i32")
  out = llvm.mlir_undef(ty)
  for i, x in enumerate(values):
    out = llvm.insertelement(out, x, const(i, i32))
  return out
