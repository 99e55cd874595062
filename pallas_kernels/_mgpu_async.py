"""Per-thread `cp.async` page loads for the Mosaic-GPU kernels on Hopper.

Pallas's `plgpu.copy_gmem_to_smem` copies by TMA on compute capability 9.0:
one descriptor-driven box per call, and in Pallas's per-thread (lane)
lowering each call also takes a warpgroup barrier and 128 `mbarrier`
arrivals (one per thread, each expecting 1/128 of the bytes): a fixed
cost per page. A page of 8 tokens of one kv head at head_dim 64 is a 1 KiB
box, and there that cost sets the decode kernel's pace (1.35x its time
with the loads below, `paged_decode.CP_ASYNC_MAX_PAGE_SIZE`). Here every
thread of the loading warpgroup copies 16-byte chunks with `cp.async`
(as GPUs before Hopper, and paged kernels that gather small pages, load
them), and one barrier arrival per thread and tile
(`cp.async.mbarrier.arrive.noinc`) tells the consumer when the tile has
landed.

This module gives the Mosaic-GPU decode kernel that path through
`plgpu.inline_mgpu` and PTX, with barriers of its own (a shared-memory
`i32` array, two words per `mbarrier`), since Pallas barriers cannot be
handed to inline Mosaic GPU code:

* `init_barriers` sets them up (expected arrivals: the 128 threads of the
  loading warpgroup), run by every thread of the CTA before the warpgroups
  part;
* `copy_page_rows` is one tile's copies by the loading warpgroup: rows of
  pages `pool[page, rows, kv_head, :]` into a `[rows, head_dim]` stage in
  the 128-byte-swizzled 8-row tiles a wgmma reads, then the arrival;
* `wait` is the consumer's wait for a phase of one barrier, followed by
  the proxy fence that orders the copied bytes (generic proxy) before the
  wgmma that reads them (async proxy).

Layout of a stage (what `plgpu.TilingTransform((8, 64))` +
`plgpu.SwizzleTransform(128)` make of `[rows, head_dim]` 2-byte elements):
8-row x 128-byte tiles, row tiles outer, column tiles inner; within a tile,
16-byte chunk `c` of row `r` sits at chunk `c ^ r` (the PTX ISA's 128-byte
swizzle mode).
"""

from __future__ import annotations

from pkvattn.pallas_kernels import _compat

WARPGROUP = 128   # threads of the loading warpgroup
CHUNK = 16        # bytes per cp.async
SWIZZLE = 128     # bytes per swizzled row of a tile
TILE_ROWS = 8


def mlir():
  """(ir, arith, llvm) of the MLIR bindings jax ships."""
  from jax._src.lib.mlir import ir  # noqa: PLC0415
  from jax._src.lib.mlir.dialects import arith, llvm  # noqa: PLC0415
  return ir, arith, llvm


def asm(text: str, operands, constraints: str, result=None):
  ir, _, llvm = mlir()
  ty = result if result is not None else ir.Type.parse("!llvm.void")
  return llvm.inline_asm(ty, list(operands), text, constraints,
                         has_side_effects=True)


def cta_barrier():
  """Per thread: waits for every thread of the CTA (`barrier.sync 0`).

  Not `bar.sync` (= `barrier.sync.aligned`: every thread of a warp at the
  same instruction): the compiler may duplicate a barrier into the
  branches of a lane-divergent `when` just before it, and the threads of a
  warp that split there then wait at two barriers (a hang, seen on H200 in
  the plan kernel)."""
  asm("barrier.sync 0;", [], "")


def int_type(bits: int):
  ir, _, _ = mlir()
  return ir.IntegerType.get_signless(bits)


def const_i32(x: int):
  from jax.experimental.mosaic.gpu import utils  # noqa: PLC0415
  return utils.c(x, int_type(32))


def const_i64(x: int):
  from jax.experimental.mosaic.gpu import utils  # noqa: PLC0415
  return utils.c(x, int_type(64))


def scalar(x):
  """The i32 value of a scalar argument of `inline_mgpu` (a splat array in
  the per-thread lowering, a plain value in the warpgroup one)."""
  regs = getattr(x, "registers", None)
  return x if regs is None else regs.flat[0]


def address(ref, bits: int):
  """Byte address of a memref as an integer of `bits`: 32 for the
  shared-window address of a shared-memory ref, 64 for the generic address
  of a global-memory one. (With `scalar`, shared with the per-thread RoPE +
  append kernel, `rope_append_mgpu`.)"""
  _, _, llvm = mlir()
  from jax.experimental.mosaic.gpu import utils  # noqa: PLC0415
  return llvm.ptrtoint(int_type(bits), utils.memref_ptr(ref))


def thread_index():
  """This thread's index in the CTA (i32)."""
  return asm("mov.u32 $0, %tid.x;", [], "=r", result=int_type(32))


def lane_index():
  """This thread's index in its warpgroup (i32)."""
  _, arith, _ = mlir()
  return arith.remui(thread_index(), const_i32(WARPGROUP))


def splat():
  """The layout of an i32 scalar argument of `inline_mgpu`."""
  plgpu = _compat.mosaic_gpu()
  return plgpu.Layout.WG_SPLAT(shape=())


def init_barriers(bars_ref, num_barriers: int):
  """Initialises `num_barriers` mbarriers in `bars_ref` (`i32[2 *
  num_barriers]`, 8-byte aligned) to expect one arrival from each thread
  of a warpgroup, then synchronises the CTA. Every thread of the CTA must
  call it, before any thread waits on or arrives at one of them."""
  plgpu = _compat.mosaic_gpu()

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def _init(ctx, bars):
    del ctx
    _, arith, _ = mlir()
    base = address(bars, 32)
    tid = thread_index()
    for i in range(num_barriers):
      addr = arith.addi(base, const_i32(8 * i))
      asm("{\n.reg .pred p;\nsetp.eq.u32 p, $1, 0;\n"
          f"@p mbarrier.init.shared::cta.b64 [$0], {WARPGROUP};\n}}",
          [addr, tid], "r,r")
    asm("fence.mbarrier_init.release.cluster;", [], "")
    asm("bar.sync 0;", [], "")

  _init(bars_ref)


def wait(bars_ref, index, parity):
  """Waits (every thread of the calling warpgroup) for the phase of parity
  `parity` (i32 0 / 1) of barrier `index` (i32) in `bars_ref` to complete,
  then fences the copied bytes for the async proxy (wgmma)."""
  plgpu = _compat.mosaic_gpu()

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), splat(), splat()))
  def _wait(ctx, bars, idx, par):
    del ctx
    _, arith, _ = mlir()
    addr = arith.addi(address(bars, 32),
                      arith.muli(scalar(idx), const_i32(8)))
    # PTX labels are local to their { } block (as CUTLASS's waits use).
    asm("{\n.reg .pred done;\nLAB_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1;\n"
        "@!done bra LAB_WAIT;\n}", [addr, scalar(par)], "r,r")
    asm("fence.proxy.async.shared::cta;", [], "")

  _wait(bars_ref, index, parity)


def copy_page_rows(pool_ref, stage_ref, bars_ref, *, slot, bar_index,
                   kv_head, row0, pages, rows_per_page: int,
                   transforms):
  """One tile's page loads by the calling warpgroup (all 128 threads).

  Copies rows `[0, len(pages) * rows_per_page)` of stage `slot` of
  `stage_ref` (`[num_stages, block_kv, head_dim]`, 2-byte elements, tiled
  and 128-byte swizzled by `transforms`): row `c * rows_per_page + r` is
  `pool_ref[pages[c], row0 + r, kv_head, :]` (`pool_ref`: `[num_pages,
  page_size, num_kv_heads, head_dim]` in global memory). Then each thread
  arrives, once its copies have landed, at barrier `bar_index` of
  `bars_ref` (`cp.async.mbarrier.arrive.noinc`).

  `slot`, `bar_index`, `kv_head`, `row0` and `pages` are i32 scalars;
  `rows_per_page` is static.
  """
  plgpu = _compat.mosaic_gpu()
  _, block_kv, head_dim = stage_ref.shape
  _, page_size, num_kv_heads, _ = pool_ref.shape
  itemsize = stage_ref.dtype.itemsize
  if itemsize != 2 or head_dim * itemsize % SWIZZLE:
    raise ValueError(f"Invalid stage: expected 2-byte elements in rows of a "
                     f"multiple of {SWIZZLE} bytes, got {stage_ref.dtype} x "
                     f"{head_dim}")
  n_pages = len(pages)
  if n_pages * rows_per_page != block_kv:
    raise ValueError(f"Invalid pages: expected {block_kv // rows_per_page} "
                     f"of {rows_per_page} rows, got {n_pages}")
  row_chunks = head_dim * itemsize // CHUNK     # 16-byte chunks per row
  tile_chunks = SWIZZLE // CHUNK                # chunks per tile row
  col_tiles = row_chunks // tile_chunks
  rows_per_pass = WARPGROUP // row_chunks       # rows one pass covers
  passes = block_kv // rows_per_pass
  stage_bytes = block_kv * head_dim * itemsize
  row_bytes = num_kv_heads * head_dim * itemsize  # a token row of the pool
  page_bytes = page_size * row_bytes

  @plgpu.inline_mgpu(arg_types=(
      plgpu.RefType(), plgpu.RefType(transforms=transforms), plgpu.RefType(),
      splat(), splat(), splat(), splat(), *([splat()] * n_pages)))
  def _copy(ctx, pool, stage, bars, slot_v, bar_v, head_v, row0_v, *page_v):
    del ctx
    _, arith, _ = mlir()
    i64 = int_type(64)
    lane = lane_index()
    t_row = arith.divui(lane, const_i32(row_chunks))      # row within a pass
    cc = arith.remui(lane, const_i32(row_chunks))         # chunk within a row
    c_tile = arith.divui(cc, const_i32(tile_chunks))      # column tile
    c_in = arith.remui(cc, const_i32(tile_chunks))        # chunk in tile row
    dst0 = arith.addi(address(stage, 32),
                      arith.muli(scalar(slot_v), const_i32(stage_bytes)))
    # Global address of (page 0, row 0, kv_head, chunk cc).
    src0 = arith.addi(
        address(pool, 64),
        arith.extui(i64, arith.addi(
            arith.muli(scalar(head_v), const_i32(head_dim * itemsize)),
            arith.muli(cc, const_i32(CHUNK)))))
    pages64 = [arith.muli(arith.extui(i64, scalar(p)), const_i64(page_bytes))
               for p in page_v]
    row0 = scalar(row0_v)
    for p in range(passes):
      row = arith.addi(t_row, const_i32(p * rows_per_pass))  # row of the tile
      r = arith.remui(row, const_i32(TILE_ROWS))
      tile = arith.addi(
          arith.muli(arith.divui(row, const_i32(TILE_ROWS)),
                     const_i32(col_tiles)),
          c_tile)
      dst = arith.addi(dst0, arith.addi(
          arith.muli(arith.addi(arith.muli(tile, const_i32(TILE_ROWS)), r),
                     const_i32(SWIZZLE)),
          arith.muli(arith.xori(c_in, r), const_i32(CHUNK))))
      first = p * rows_per_pass // rows_per_page
      last = ((p + 1) * rows_per_pass - 1) // rows_per_page
      page = pages64[first]
      for c in range(first + 1, last + 1):   # a pass over several pages
        later = arith.cmpi(arith.CmpIPredicate.uge, row,
                           const_i32(c * rows_per_page))
        page = arith.select(later, pages64[c], page)
      in_page = arith.addi(row0, arith.remui(row, const_i32(rows_per_page)))
      src = arith.addi(arith.addi(src0, page), arith.extui(
          i64, arith.muli(in_page, const_i32(row_bytes))))
      asm("cp.async.cg.shared.global [$0], [$1], 16;", [dst, src], "r,l")
    bar = arith.addi(address(bars, 32), arith.muli(scalar(bar_v), const_i32(8)))
    # Arrives once this thread's copies so far have landed; `.noinc`: the
    # arrival is one of the barrier's 128 expected ones.
    asm("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", [bar], "r")

  _copy(pool_ref, stage_ref, bars_ref, slot, bar_index, kv_head, row0,
        *pages)
