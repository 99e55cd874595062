"""The inline PTX / MLIR helpers (`pallas_kernels/_mlir.py`), on the CPU.

Each helper is run inside a small MLIR module of its own (an `ir.Context`
with JAX's dialects) and the ops it emits are checked in the printed IR:
constants, types, the inline-asm op's text, constraints and side effects,
address arithmetic (folded to numbers by MLIR's canonicalizer and compared
with the 128-byte swizzle rule of the PTX ISA). The kernels built on these
helpers are cross-lowered by their own tests (`test_paged_decode_mma`,
`test_rope_append_mgpu`, `test_plan_mgpu`, `test_paged_prefill_mgpu`).
"""

import pathlib
import re
import struct

import numpy as np
import pytest
from jax.interpreters import mlir as jax_mlir
from jaxlib.mlir import ir
from jaxlib.mlir import passmanager
from jaxlib.mlir.dialects import func

from pkvattn.pallas_kernels import _mlir

KERNELS = pathlib.Path(_mlir.__file__).parent


def _build(arg_types, body, num_results=None):
  """The printed module of one function `f(*arg_types)` whose body is
  `body(*args)`; the values it returns become the function's results."""
  ctx = jax_mlir.make_ir_context()
  with ctx, ir.Location.unknown():
    module = ir.Module.create()
    with ir.InsertionPoint(module.body):
      arg_types = [t() if callable(t) else t for t in arg_types]
      results = []

      def emit(*args):
        out = body(*args)
        results.extend(out or [])
      fn = func.FuncOp("f", ir.FunctionType.get(arg_types, []))
      block = fn.add_entry_block()
      with ir.InsertionPoint(block):
        emit(*block.arguments)
        func.ReturnOp(results)
      fn.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
          arg_types, [r.type for r in results]))
    assert module.operation.verify()
    return module, ctx


def _text(arg_types, body):
  module, _ = _build(arg_types, body)
  return str(module)


def _folded(arg_types, body):
  """`body`'s returned values after canonicalization, as Python ints (each
  must fold to a constant)."""
  module, ctx = _build(arg_types, body)
  with ctx:
    passmanager.PassManager.parse(
        "builtin.module(func.func(canonicalize))").run(module.operation)
  text = str(module)
  consts = dict(re.findall(r"(%\S+) = arith.constant (-?\d+) : i\d+", text))
  ret = re.search(r"return (.*?) :", text).group(1).split(", ")
  return [int(consts[name]) for name in ret]


def _i32():
  return _mlir.int_type(32)


def _i64():
  return _mlir.int_type(64)


def _memref():
  return ir.MemRefType.get([4, 8], ir.F32Type.get())


def test_bindings_are_the_ones_mosaic_gpu_builds_with():
  from jax._src.lib.mlir import ir as private_ir  # noqa: PLC0415
  from jax._src.lib.mlir.dialects import arith as private_arith  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import utils  # noqa: PLC0415
  assert _mlir.ir is ir is private_ir is utils.ir
  assert _mlir.arith is private_arith is utils.arith
  assert _mlir.llvm is utils.llvm


@pytest.mark.parametrize("x,want", [
    (1.0, "0f3F800000"), (-2.0, "0fC0000000"), (0.0, "0f00000000"),
    (-0.0, "0f80000000"), (65504.0, "0f477FE000"), (-65504.0, "0fC77FE000"),
    (448.0, "0f43E00000"), (0.1, "0f3DCCCCCD"), (float("inf"), "0f7F800000"),
    (float("-inf"), "0fFF800000"), (2.0 ** -149, "0f00000001"),
])
def test_f32_immediates(x, want):
  assert _mlir.f32(x) == want
  # The same bits as numpy's float32 (little-endian packing, read back).
  bits = struct.unpack("<I", np.float32(x).tobytes())[0]
  assert _mlir.f32(x) == f"0f{bits:08X}"


def test_f32_rounds_to_float32():
  # 1 + 2**-30 is not a float32: it rounds to 1.0.
  assert _mlir.f32(1.0 + 2.0 ** -30) == "0f3F800000"
  assert re.fullmatch(r"0f7FC[0-9A-F]{5}", _mlir.f32(float("nan")))


def test_types_and_constants():
  def body(a):
    assert str(_mlir.int_type(16)) == "i16"
    assert str(_mlir.parse_type("!llvm.ptr<1>")) == "!llvm.ptr<1>"
    assert _mlir.parse_type("i32") == _mlir.int_type(32)
    return [_mlir.const_i32(-7), _mlir.const_i64(1 << 40),
            _mlir.const_f32(0.5), _mlir.const(1, _mlir.int_type(1)),
            _mlir.wide(a)]
  text = _text([_i32], body)
  assert "arith.constant -7 : i32" in text
  assert f"arith.constant {1 << 40} : i64" in text
  assert "arith.constant 5.000000e-01 : f32" in text
  assert "arith.constant true" in text
  assert "arith.extui %arg0 : i32 to i64" in text


def test_const_rejects_what_it_cannot_make():
  def body():
    with pytest.raises(TypeError, match="expected an int"):
      _mlir.const(1.5, _mlir.int_type(32))
    with pytest.raises(TypeError, match="expected an int"):
      _mlir.const(True, _mlir.int_type(32))
    with pytest.raises(NotImplementedError):
      _mlir.const(1, ir.VectorType.get([2], _mlir.int_type(32)))
  _text([], body)


def test_asm_void_single_and_struct_results():
  def body(a, x):
    _mlir.asm("barrier.sync 0;", [], "")
    one = _mlir.asm("ex2.approx.ftz.f32 $0, $1;", [x], "=f,f",
                    ir.F32Type.get())
    kept = _mlir.asm("ld.global.nc.u32 $0, [$1];", [a], "=r,l", _i32(),
                     side_effects=True)
    words = _mlir.asm("ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", [kept],
                      "=r,=r,=r,=r,r", [_i32()] * 4, side_effects=True)
    assert len(words) == 4
    return [one, *words]
  text = _text([_i64, lambda: ir.F32Type.get()], body)
  lines = [ln.strip() for ln in text.splitlines() if "inline_asm" in ln]
  assert len(lines) == 4
  # No result: kept (side effects), typed !llvm.void.
  assert lines[0].startswith('%0 = llvm.inline_asm has_side_effects '
                             '"barrier.sync 0;", ""')
  assert lines[0].endswith("() -> !llvm.void")
  # A result: pure unless told otherwise.
  assert "has_side_effects" not in lines[1]
  assert '"ex2.approx.ftz.f32 $0, $1;", "=f,f"' in lines[1]
  assert lines[1].endswith("(f32) -> f32")
  assert '"ld.global.nc.u32 $0, [$1];", "=r,l"' in lines[2]
  assert "has_side_effects" in lines[2] and lines[2].endswith("(i64) -> i32")
  # A list of results: one struct, unpacked field by field.
  assert lines[3].endswith("(i32) -> !llvm.struct<(i32, i32, i32, i32)>")
  assert '"=r,=r,=r,=r,r"' in lines[3]
  extracts = re.findall(r"llvm.extractvalue %\S+\[(\d)\]", text)
  assert extracts == ["0", "1", "2", "3"]


def test_threads_and_barrier():
  def body():
    return [_mlir.thread_index(), _mlir.lane_index()]
  text = _text([], body)
  assert text.count('llvm.inline_asm has_side_effects "mov.u32 $0, '
                    '%tid.x;", "=r"') == 2
  assert "arith.constant 128 : i32" in text and "arith.remui" in text

  def barrier():
    _mlir.cta_barrier()
  text = _text([], barrier)
  # `barrier.sync`, not the warp-aligned `bar.sync`.
  assert '"barrier.sync 0;", ""' in text and "bar.sync" not in text


def test_scalar_takes_the_splat_register():
  class Splat:
    registers = np.array(["value"], dtype=object)
  assert _mlir.scalar(Splat()) == "value"
  plain = object()
  assert _mlir.scalar(plain) is plain


@pytest.mark.parametrize("index_type,extui", [(_i32, True), (_i64, False)])
def test_element_address(index_type, extui):
  def body(ref, index):
    return [_mlir.element_address(ref, index, 6)]
  text = _text([_memref, index_type], body)
  ops = re.findall(r"= (\S+)", text.split("llvm.inttoptr", 1)[1])
  # After the ref's base pointer: its integer address, then index * 6 added.
  want = ["llvm.ptrtoint", "arith.extui", "arith.constant", "arith.muli",
          "arith.addi"]
  assert ops == (want if extui else [w for w in want if w != "arith.extui"])
  assert "arith.constant 6 : i64" in text
  assert "llvm.ptrtoint %" in text and "!llvm.ptr to i64" in text


def test_global_load_store_and_vectors():
  def body(addr, x):
    v = _mlir.load_global(addr, _i32(), 4)
    _mlir.store_global(v, addr, 16)
    vec = _mlir.vector([x, v], ir.VectorType.get([2], _i32()))
    return _mlir.elements(vec, 2)
  text = _text([_i64, _i32], body)
  assert text.count("llvm.inttoptr %arg0 : i64 to !llvm.ptr<1>") == 2
  # The alignment attribute prints as `{alignment = 4 : i64}` (jaxlib < 0.12)
  # or `<alignment = 4>` (the newer LLVM of jaxlib 0.12).
  assert re.search(r"llvm.load %\S+ (\{alignment = 4 : i64\}|<alignment = 4>)"
                   r" : !llvm.ptr<1> -> i32", text)
  assert re.search(r"llvm.store %\S+, %\S+ (\{alignment = 16 : i64\}|"
                   r"<alignment = 16>) : i32, !llvm.ptr<1>", text)
  assert "llvm.mlir.undef : vector<2xi32>" in text
  assert text.count("llvm.insertelement") == 2
  assert text.count("llvm.extractelement") == 2


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_swizzled_address_is_the_128_byte_swizzle(head_dim):
  """Chunk c of row r of a `[16, head_dim]` bf16 operand: 8-row x 128-byte
  tiles (row tiles outer), chunk `c % 8` of the tile row stored at chunk
  `(c % 8) ^ (r % 8)`."""
  row_chunks = head_dim * 2 // _mlir.CHUNK
  col_tiles = row_chunks // 8
  rows = 16
  cases = [(r, c) for r in range(rows) for c in range(row_chunks)]

  def body():
    c = _mlir.const_i32
    return [_mlir.swizzled_address(c(4096), c(r), c(k // 8), c(k % 8),
                                   col_tiles) for r, k in cases]
  got = _folded([], body)
  want = []
  for r, k in cases:
    tile = (r // 8) * col_tiles + k // 8
    want.append(4096 + tile * 8 * 128 + (r % 8) * 128
                + ((k % 8) ^ (r % 8)) * 16)
  assert got == want
  # A bijection onto the operand's 16-byte chunks.
  assert sorted(got) == list(range(4096, 4096 + rows * head_dim * 2, 16))


def test_one_place_defines_the_helpers():
  """No other kernel module builds inline asm ops or imports the private
  MLIR bindings: they go through `_mlir`."""
  for path in KERNELS.glob("*.py"):
    if path.name == "_mlir.py":
      continue
    src = path.read_text()
    assert "llvm.inline_asm(" not in src, path.name
    assert "jax._src.lib.mlir" not in src, path.name
    assert not re.search(r"^def _(asm|mlir|ty|c)\(", src, re.M), path.name
