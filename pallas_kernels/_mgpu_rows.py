"""Per-thread query loads and output stores of a GQA-packed query tile.

The Mosaic-GPU prefill kernel (`paged_prefill_mgpu`, `pack_gqa=True`) can
pack a GQA group into the M dimension of its matmuls, as FlashAttention-3's
PackGQA does: row `r` of a consumer's 64-row tile is token `t0 + r // G`,
query head `kv_head * G + r % G` (G = `group_size`). One K/V stage then
serves all G heads, where one query head per CTA reads each page G times
and spends a causal tile's diagonal on 64 tokens instead of 64 / G.

Those rows are not a TMA box: consecutive rows of one token sit `head_dim`
apart in `q [num_tokens, num_qo_heads, head_dim]`, those of the next token a
whole token row further. So the 128 threads of the consumer warpgroup move
them 16 bytes at a time through `plgpu.inline_mgpu` and PTX:

* `load_q_rows` copies the tile's rows from `q` into the 128-byte-swizzled
  8-row tiles a wgmma reads (`_mlir.swizzled_address`), and
  optionally each row's sink logit into a row vector;
* `store_rows` copies the rows of a finished tile (output in a plain
  row-major shared-memory buffer, lse in a row vector) to
  `out [num_tokens, num_qo_heads, head_dim]` and `lse [num_tokens,
  num_qo_heads]`, only rows whose token is in `[row_lo, row_hi)` of the
  tile (rows of other sequences or past the group's last full token are
  computed and dropped);
* `store_lse` stores the lse rows of an unpacked tile (one query head, 64
  tokens) to `lse [num_tokens, num_qo_heads]` in place: 4 bytes a row is
  narrower than a TMA box.

All are called by every thread of one warpgroup; the caller orders them
against Pallas's own shared-memory accesses with `plgpu.commit_smem()` (a
proxy fence and a warpgroup barrier): after `load_q_rows`, before the
wgmma reads q; before `store_rows`, after storing the output and lse.
"""

from __future__ import annotations

from pkvattn.pallas_kernels import _compat
from pkvattn.pallas_kernels import _mlir
from pkvattn.pallas_kernels._mlir import SWIZZLE, WARPGROUP, arith

ROWS = 64      # rows of a consumer's tile
CHUNK = _mlir.CHUNK  # bytes per copy


def _geometry(head_dim: int, itemsize: int):
  """(16-byte chunks per row, rows per pass of 128 threads, passes)."""
  row_chunks = head_dim * itemsize // CHUNK
  rows_per_pass = WARPGROUP // row_chunks
  return row_chunks, rows_per_pass, ROWS // rows_per_pass


def _load_v4(addr, space: str):
  """Four i32 words from `addr` in state space `space` ("global.nc": an
  i64 generic address, "shared": an i32 shared-window one)."""
  ptr = "l" if space.startswith("global") else "r"
  return _mlir.asm(f"ld.{space}.v4.u32 {{$0, $1, $2, $3}}, [$4];", [addr],
                   f"=r,=r,=r,=r,{ptr}", [_mlir.int_type(32)] * 4,
                   side_effects=True)


def _row_token_head(row, t0, kv_head, group_size: int):
  """(token, query head) of tile row `row` (i32 values)."""
  c = _mlir.const_i32
  token = arith.addi(t0, arith.divui(row, c(group_size)))
  head = arith.addi(arith.muli(kv_head, c(group_size)),
                    arith.remui(row, c(group_size)))
  return token, head


def load_q_rows(q_ref, q_smem, sinks_ref, sink_smem, *, index, t0, kv_head,
                group_size: int, transforms, asynchronous: bool = False):
  """Loads one consumer's packed query tile (all 128 threads of it).

  Row `r` of stage `index` of `q_smem` (`[n, 64, head_dim]`, 2-byte
  elements, tiled and 128-byte swizzled by `transforms`) becomes
  `q_ref[min(t0 + r // G, num_tokens - 1), kv_head * G + r % G, :]`
  (`q_ref`: `[num_tokens, num_qo_heads, head_dim]` in global memory; rows
  past the last token repeat it and are never stored). With `sinks_ref`
  (`f32[num_qo_heads]`), row `r` of `sink_smem` (`f32[n, 64]`, plain) gets
  `sinks_ref[kv_head * G + r % G]`.

  `index`, `t0` and `kv_head` are i32 scalars; `group_size` is static.
  `asynchronous`: the bytes travel by `cp.async` (global to shared, no
  registers) and have landed only after this thread's `wait_rows()`;
  otherwise by loads and stores, landed on return.
  """
  plgpu = _compat.mosaic_gpu()
  num_tokens, num_qo_heads, head_dim = q_ref.shape
  itemsize = q_ref.dtype.itemsize
  if itemsize != 2 or head_dim * itemsize % SWIZZLE:
    raise ValueError(f"Invalid q: expected 2-byte elements in rows of a "
                     f"multiple of {SWIZZLE} bytes, got {q_ref.dtype} x "
                     f"{head_dim}")
  row_chunks, rows_per_pass, passes = _geometry(head_dim, itemsize)
  tile_chunks = SWIZZLE // CHUNK
  col_tiles = row_chunks // tile_chunks
  stage_bytes = ROWS * head_dim * itemsize
  has_sinks = sinks_ref is not None
  read = _compat.ref_type(write=False)
  refs = (read, plgpu.RefType(transforms=transforms))
  if has_sinks:
    refs += (read, plgpu.RefType())

  @plgpu.inline_mgpu(arg_types=(*refs, *[_mlir.splat()] * 3))
  def _load(ctx, q, stage, *rest):
    del ctx
    c, i64 = _mlir.const_i32, _mlir.int_type(64)
    *srefs, index_v, t0_v, head_v = rest
    t0, kv_head = _mlir.scalar(t0_v), _mlir.scalar(head_v)
    lane = _mlir.lane_index()
    t_row = arith.divui(lane, c(row_chunks))
    cc = arith.remui(lane, c(row_chunks))
    c_tile = arith.divui(cc, c(tile_chunks))
    c_in = arith.remui(cc, c(tile_chunks))
    dst0 = arith.addi(_mlir.address(stage, 32),
                      arith.muli(_mlir.scalar(index_v), c(stage_bytes)))
    q0 = _mlir.address(q, 64)
    words, dsts = [], []
    for p in range(passes):
      row = arith.addi(t_row, c(p * rows_per_pass))
      token, head = _row_token_head(row, t0, kv_head, group_size)
      token = arith.minsi(token, c(num_tokens - 1))
      elem = arith.addi(arith.muli(token, c(num_qo_heads)), head)
      src = arith.addi(q0, arith.extui(i64, arith.addi(
          arith.muli(elem, c(head_dim * itemsize)),
          arith.muli(cc, c(CHUNK)))))
      dst = _mlir.swizzled_address(dst0, row, c_tile, c_in, col_tiles)
      if asynchronous:
        _mlir.asm("cp.async.cg.shared.global [$0], [$1], 16;", [dst, src],
                "r,l")
        continue
      words.append(_load_v4(src, "global.nc"))
      dsts.append(dst)
    for dst, w in zip(dsts, words):
      _mlir.asm("st.shared.v4.u32 [$0], {$1, $2, $3, $4};",
              [dst, *w], "r,r,r,r,r")
    if has_sinks:
      sinks, sink_stage = srefs
      _, head = _row_token_head(lane, t0, kv_head, group_size)
      src = arith.addi(_mlir.address(sinks, 64),
                       arith.extui(i64, arith.muli(head, c(4))))
      dst = arith.addi(
          _mlir.address(sink_stage, 32),
          arith.addi(arith.muli(_mlir.scalar(index_v), c(ROWS * 4)),
                     arith.muli(lane, c(4))))
      # Threads 0..63 carry one row each.
      move = ("@p cp.async.ca.shared.global [$1], [$0], 4;" if asynchronous
              else "@p ld.global.nc.f32 s, [$0];\n@p st.shared.f32 [$1], s;")
      _mlir.asm(
          "{\n.reg .pred p;\n.reg .f32 s;\nsetp.lt.u32 p, $2, 64;\n"
          + move + "\n}", [src, dst, lane], "l,r,r")

  args = (q_ref, q_smem) + ((sinks_ref, sink_smem) if has_sinks else ())
  _load(*args, index, t0, kv_head)


def wait_rows():
  """Waits (each calling thread) until its `load_q_rows(asynchronous=True)`
  copies have landed; a `plgpu.commit_smem()` after it orders them, for the
  whole warpgroup, before a wgmma reads them."""
  plgpu = _compat.mosaic_gpu()

  @plgpu.inline_mgpu()
  def _wait(ctx):
    del ctx
    _mlir.asm("cp.async.wait_all;", [], "")

  _wait()


def store_rows(o_smem, lse_smem, out_ref, lse_ref, *, index, t0, kv_head,
               row_lo, row_hi, group_size: int):
  """Stores one consumer's packed tile (all 128 threads of it).

  Row `r` of stage `index` of `o_smem` (`[n, 64, head_dim]`, plain
  row-major) goes to `out_ref[t0 + r // G, kv_head * G + r % G, :]` and row
  `r` of `lse_smem` (`f32[n, 64]`) to `lse_ref[t0 + r // G, kv_head * G +
  r % G]` (`out_ref`: `[num_tokens, num_qo_heads, head_dim]`, `lse_ref`:
  `f32[num_tokens, num_qo_heads]`, global memory), for the rows whose token
  offset `r // G` lies in `[row_lo, row_hi)`.

  `index`, `t0`, `kv_head`, `row_lo` and `row_hi` are i32 scalars.
  """
  plgpu = _compat.mosaic_gpu()
  _, num_qo_heads, head_dim = out_ref.shape
  itemsize = out_ref.dtype.itemsize
  row_chunks, rows_per_pass, passes = _geometry(head_dim, itemsize)
  stage_bytes = ROWS * head_dim * itemsize

  @plgpu.inline_mgpu(arg_types=(_compat.ref_type(write=False),) * 2
                     + (plgpu.RefType(),) * 2 + (_mlir.splat(),) * 5)
  def _store(ctx, o_s, lse_s, out, lse, index_v, t0_v, head_v, lo_v, hi_v):
    del ctx
    c, i64 = _mlir.const_i32, _mlir.int_type(64)
    t0, kv_head = _mlir.scalar(t0_v), _mlir.scalar(head_v)
    # Rows [lo, hi) of the tile are stored.
    lo = arith.muli(_mlir.scalar(lo_v), c(group_size))
    hi = arith.muli(_mlir.scalar(hi_v), c(group_size))
    index = _mlir.scalar(index_v)
    lane = _mlir.lane_index()
    t_row = arith.divui(lane, c(row_chunks))
    cc = arith.remui(lane, c(row_chunks))
    src0 = arith.addi(
        arith.addi(_mlir.address(o_s, 32), arith.muli(index, c(stage_bytes))),
        arith.muli(cc, c(CHUNK)))
    out0 = _mlir.address(out, 64)

    def valid(row):
      ok_lo = arith.cmpi(arith.CmpIPredicate.sge, row, lo)
      ok_hi = arith.cmpi(arith.CmpIPredicate.slt, row, hi)
      return arith.extui(_mlir.int_type(32), arith.andi(ok_lo, ok_hi))

    def elem_of(row):
      token, head = _row_token_head(row, t0, kv_head, group_size)
      return arith.extui(i64, arith.addi(arith.muli(token, c(num_qo_heads)),
                                         head))

    for p in range(passes):
      row = arith.addi(t_row, c(p * rows_per_pass))
      w = _load_v4(arith.addi(
          src0, arith.muli(row, c(head_dim * itemsize))), "shared")
      dst = arith.addi(out0, arith.addi(
          arith.muli(elem_of(row), _mlir.const_i64(head_dim * itemsize)),
          arith.extui(i64, arith.muli(cc, c(CHUNK)))))
      _mlir.asm(
          "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\n"
          "@p st.global.v4.u32 [$0], {$1, $2, $3, $4};\n}",
          [dst, *w, valid(row)], "l,r,r,r,r,r")
    # lse: threads 0..63, one row each.
    _store_lse_row(lse_s, lse, index, elem_of, valid)

  _store(o_smem, lse_smem, out_ref, lse_ref, index, t0, kv_head, row_lo,
         row_hi)


def _store_lse_row(lse_s, lse, index, elem_of, valid):
  """Per thread (inside `inline_mgpu`): threads 0..63 store row `lane` of
  stage `index` of `lse_s` (`f32[n, 64]`) at element `elem_of(lane)` of
  `lse`, where `valid(lane)` (i32, nonzero: store)."""
  c = _mlir.const_i32
  lane = _mlir.lane_index()
  in_tile = arith.extui(_mlir.int_type(32), arith.cmpi(
      arith.CmpIPredicate.ult, lane, c(ROWS)))
  row = arith.remui(lane, c(ROWS))
  src = arith.addi(_mlir.address(lse_s, 32),
                   arith.muli(arith.addi(arith.muli(index, c(ROWS)), row),
                              c(4)))
  dst = arith.addi(_mlir.address(lse, 64),
                   arith.muli(elem_of(row), _mlir.const_i64(4)))
  _mlir.asm(
      "{\n.reg .pred p;\n.reg .f32 s;\nsetp.ne.b32 p, $2, 0;\n"
      "@p ld.shared.f32 s, [$1];\n@p st.global.f32 [$0], s;\n}",
      [dst, src, arith.andi(in_tile, valid(row))], "l,r,r")


def store_lse(lse_smem, lse_ref, *, index, t0, head, row_lo, row_hi):
  """Stores one consumer's lse rows of an unpacked tile (all 128 threads
  of it; threads 0..63 carry one row each).

  Row `r` of stage `index` of `lse_smem` (`f32[n, 64]`) goes to
  `lse_ref[t0 + r, head]` (`lse_ref`: `f32[num_tokens, num_qo_heads]`,
  global memory) for `r` in `[row_lo, row_hi)`: one query head's rows,
  where a TMA box could not take them (4 bytes wide). The caller orders
  the loads after the writes of `lse_smem` (`plgpu.commit_smem()`), and
  later writes of it after them (a warpgroup barrier).

  `index`, `t0`, `head`, `row_lo` and `row_hi` are i32 scalars.
  """
  plgpu = _compat.mosaic_gpu()
  num_qo_heads = lse_ref.shape[1]

  @plgpu.inline_mgpu(arg_types=(_compat.ref_type(write=False),
                                plgpu.RefType()) + (_mlir.splat(),) * 5)
  def _store(ctx, lse_s, lse, index_v, t0_v, head_v, lo_v, hi_v):
    del ctx
    c, i64 = _mlir.const_i32, _mlir.int_type(64)
    t0, head = _mlir.scalar(t0_v), _mlir.scalar(head_v)
    lo, hi = _mlir.scalar(lo_v), _mlir.scalar(hi_v)

    def valid(row):
      ok_lo = arith.cmpi(arith.CmpIPredicate.sge, row, lo)
      ok_hi = arith.cmpi(arith.CmpIPredicate.slt, row, hi)
      return arith.extui(_mlir.int_type(32), arith.andi(ok_lo, ok_hi))

    def elem_of(row):
      return arith.extui(i64, arith.addi(
          arith.muli(arith.addi(t0, row), c(num_qo_heads)), head))

    _store_lse_row(lse_s, lse, _mlir.scalar(index_v), elem_of, valid)

  _store(lse_smem, lse_ref, index, t0, head, row_lo, row_hi)
