"""Fused RoPE + paged K/V append for Hopper: Pallas on Mosaic GPU.

The same pass as the Pallas-Triton kernel (`rope_append.py`; TensorRT-LLM's
`qkv_preprocessing`): read q, k and v once, rotate q and k in f32, write
the rotated q and scatter the k and v rows into the pool at
`page * page_size + position % page_size`. It is a gather / scatter of
small chunks with a little f32 math per element, which Pallas's
array-level Mosaic GPU lowering cannot express (its register layouts have
no per-row gather, and its copies are TMA boxes with a fixed cost each),
so the kernel body is per-thread code written through `plgpu.inline_mgpu`
in MLIR's `arith` / `math` / `llvm` dialects, as a CUDA kernel would be:

* The grid is `(token tiles, head programs)`, one warpgroup (128 threads)
  per CTA. Each token's head is cut into `units` (one per thread) of
  `chunk_bytes`-byte chunks (4, 8 or 16): with GPT-NeoX pairs `(i, i +
  half)` a unit is the chunk at column `c` and its partner at `c + half`;
  with GPT-J pairs `(2i, 2i + 1)` one chunk holds its pairs; columns past
  `rotary_dim` (partial rotary) are plain chunks. A tile has `128 // units`
  tokens, one thread per (token, unit).
* A thread computes the cos / sin of its unit's frequencies once
  (`positions * inv_freq` in f32, libdevice `cos` / `sin`) and applies
  them to every head of its program: a `1 / num_splits` share of the q
  heads (to `q_out`) and of the kv heads (k rotated, v copied, to their
  pool rows), or with `one_head` a single head. It issues its first
  `max_loads` chunk loads before the cos / sin and the pool rows, so
  their latencies overlap, and every later batch's loads before that
  batch's stores (the compiler cannot move a load above a store to a pool
  it cannot prove distinct).
* A token's pool rows come from `k_rows` / `v_rows` or, with `paged`, from
  the page table as `reference.append_rows` computes them, in the kernel;
  a row outside the pool (`>= num_rows`, or negative) is not written.
  Tokens past `num_tokens` in the last tile do nothing.

The pools go in as `jax.Ref` arguments of `pl.kernel`, which aliases them
in and out: under a donated jit they are updated in place. float8_e4m3fn
pools (per-tensor `k_scale` / `v_scale`) store `pkvattn._kv.quantize` of
the f32 values (`cvt.rn.satfinite.e4m3x2.f32`, two per instruction).
`dispatch.rope_append` sends Hopper calls here; f32 and head dims that do
not split into the chunks stay on the Triton kernel (`supports`). The
per-thread MLIR / PTX helpers are `_mlir`'s.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pkvattn.pallas_kernels import _compat
from pkvattn.pallas_kernels import _mlir
from pkvattn.pallas_kernels._compat import pl
from pkvattn.pallas_kernels._mlir import arith, ir
from pkvattn.pallas_kernels._mlir import const, elements, parse_type, vector
from pkvattn.pallas_kernels._mlir import load_global, store_global
from pkvattn.pallas_kernels._mlir import math as mmath

WARPGROUP = 128      # threads per CTA
CHUNK = 16           # bytes per load / store
MAX_LOADS = 32       # chunk loads a thread issues before their stores
SMALL_CHUNK_MAX_TOKENS = 4096  # the default's 4-byte chunks up to here
TABLE_KINDS = ("shared", "split", "flashinfer")
DTYPES = (jnp.bfloat16, jnp.float16)
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (pkvattn._kv.FP8_MAX)


def units_per_token(head_dim: int, half: int, interleaved: bool,
                    itemsize: int, chunk_bytes: int = CHUNK) -> int:
  """Threads per (token, head): one per `chunk_bytes` chunk of the head,
  except that a GPT-NeoX rotated pair of chunks (`c`, `c + half`) is one
  thread."""
  vec = chunk_bytes // itemsize
  rot = 2 * half
  rotated = (half if not interleaved else rot) // vec
  return rotated + (head_dim - rot) // vec


def supports(*, dtype, pool_dtype, head_dim: int, half: int,
             interleaved: bool, num_qo_heads: int, num_kv_heads: int,
             num_splits: int, has_scales: bool,
             chunk_bytes: int = CHUNK) -> str | None:
  """Why the kernel does not take a case (a sentence), or None when it
  does: bf16 / f16 q, k, v and pools of that dtype, or float8_e4m3fn pools
  with their scales (`has_scales`), the rotated half and the pass-through columns in whole `chunk_bytes` chunks,
  at most 128 threads per token, and `num_splits` dividing both head
  counts."""
  vec = chunk_bytes // 2
  fp8 = jnp.dtype(pool_dtype) == jnp.dtype(FP8)
  if fp8 != has_scales:
    return "FP8 pools need k_scale / v_scale, and only FP8 pools take them"
  if not fp8 and jnp.dtype(pool_dtype) != jnp.dtype(dtype):
    return (f"pools of {jnp.dtype(pool_dtype).name} for "
            f"{jnp.dtype(dtype).name} rows")
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
    return f"dtype {jnp.dtype(dtype).name} is not bf16 / f16"
  rot = 2 * half
  if half % vec or (head_dim - rot) % vec or (interleaved and rot % vec):
    return (f"head_dim {head_dim} / rotary_dim {rot} do not split into "
            f"{vec}-element chunks")
  if units_per_token(head_dim, half, interleaved, 2,
                     chunk_bytes) > WARPGROUP:
    return f"head_dim {head_dim} needs more than {WARPGROUP} threads a token"
  if num_kv_heads % num_splits or num_qo_heads % num_splits:
    return (f"num_splits {num_splits} does not divide num_qo_heads "
            f"{num_qo_heads} and num_kv_heads {num_kv_heads}")
  return None


@dataclasses.dataclass(frozen=True)
class Config:
  """Launch config of the Mosaic-GPU kernel.

  Attributes:
    num_splits: programs per token tile over the heads, dividing both head
      counts (each program: `1 / num_splits` of the q heads and of the kv
      heads, its loads batched across them).
    one_head: overrides `num_splits`: `num_qo_heads + num_kv_heads` programs
      per tile, each rotating one q head or appending one kv head (the most
      programs, for few tokens and head counts that do not split evenly).
    max_loads: chunk loads a thread issues before their stores.
    chunk_bytes: bytes per load / store (16, 8 or 4): smaller chunks spread
      a token over more threads, each with fewer cos / sin to compute.
  """
  backend = "mosaic"  # the kernel's name in `dispatch` (not a field)
  num_splits: int = 1
  one_head: bool = False
  max_loads: int = MAX_LOADS
  chunk_bytes: int = CHUNK

  def __post_init__(self):
    if self.chunk_bytes not in (4, 8, 16):
      raise ValueError(f"Invalid chunk_bytes: expected 4, 8 or 16, got "
                       f"{self.chunk_bytes}")
    if self.num_splits < 1 or self.max_loads < 1:
      raise ValueError(f"Invalid num_splits / max_loads: expected >= 1, "
                       f"got {self.num_splits} / {self.max_loads}")

  @staticmethod
  def default_for(num_tokens: int, num_qo_heads: int,
                  num_kv_heads: int) -> "Config":
    """The launch `dispatch.rope_append` gives this kernel: the heads split
    over the largest power of two <= 8 programs dividing both head counts;
    4-byte chunks up to `SMALL_CHUNK_MAX_TOKENS` tokens, 8-byte chunks
    beyond. A thread's cos / sin chain is what small batches wait on, so
    more threads with shorter chains win; large batches keep 8-byte chunks
    (measured: docs/performance.md). The case must fit the chunks
    (`supports`)."""
    splits = 1
    while (2 * splits <= 8 and num_kv_heads % (2 * splits) == 0
           and num_qo_heads % (2 * splits) == 0):
      splits *= 2
    chunk = 4 if num_tokens <= SMALL_CHUNK_MAX_TOKENS else 8
    return Config(num_splits=splits, chunk_bytes=chunk)

  def programs(self, num_qo_heads: int, num_kv_heads: int) -> int:
    """Programs per token tile."""
    return num_qo_heads + num_kv_heads if self.one_head else self.num_splits


# ---------------------------------------------------------------- the kernel

def _body(ctx, *args, num_tokens, num_rows, num_qo_heads, num_kv_heads,
          head_dim, half, interleaved, rotate, has_q, fused, same_pool,
          table_kind, page_size, num_splits, one_head, max_loads, units,
          chunk_bytes, dtype_name, itemsize, fp8):
  """Per-thread body (inside `inline_mgpu`); see the module docstring.
  `args`: tile id, split id, then the refs in `rope_append_mgpu`'s order
  (inputs, q_out, pools). `fp8`: the pools hold float8_e4m3fn (scales in
  an f32[2] input after `inv_freq`)."""
  del ctx
  from jax.experimental.mosaic.gpu import utils  # noqa: PLC0415
  i32, i64, f32 = parse_type("i32"), parse_type("i64"), parse_type("f32")
  el = parse_type(dtype_name)
  vec = chunk_bytes // itemsize
  vty = ir.VectorType.get((vec,), el)
  args = list(args)
  tile, split = _mlir.scalar(args.pop(0)), _mlir.scalar(args.pop(0))
  pos_ref = args.pop(0)
  if table_kind is None:
    k_rows_ref, v_rows_ref = args.pop(0), args.pop(0)
  else:
    bi_ref, table_ref = args.pop(0), args.pop(0)
    tshape = ir.MemRefType(table_ref.type).shape
    batch_size, max_pages = tshape[0], tshape[-1]
  inv_ref = args.pop(0) if rotate else None
  scales_ref = args.pop(0) if fp8 else None
  if fused:
    q_ref = k_ref = v_ref = args.pop(0)
    src_heads = num_qo_heads + 2 * num_kv_heads
    k_off, v_off = num_qo_heads, num_qo_heads + num_kv_heads
  else:
    q_ref = args.pop(0) if has_q else None
    k_ref, v_ref = args.pop(0), args.pop(0)
    k_off = v_off = 0
  q_out_ref = args.pop(0) if has_q else None
  k_pool_ref = args.pop(0)
  v_pool_ref = k_pool_ref if same_pool else args.pop(0)

  ci, wide = _mlir.const_i32, _mlir.wide

  tid = utils.thread_idx()
  lane = arith.remui(tid, ci(WARPGROUP))
  per_tile = WARPGROUP // units
  t = arith.addi(arith.muli(tile, ci(per_tile)), arith.divui(lane, ci(units)))
  u = arith.remui(lane, ci(units))
  active = arith.andi(
      arith.cmpi(arith.CmpIPredicate.ult, lane, ci(per_tile * units)),
      arith.cmpi(arith.CmpIPredicate.ult, t, ci(num_tokens)))

  at = _mlir.element_address   # (ref, i32 element, its bytes)

  def head_addr(ref, heads, row, h, col, size=itemsize):
    """Byte address of chunk `col` (element column, i32) of head `h` of row
    `row` of a `[rows, heads, head_dim]` ref of `size`-byte elements."""
    elem = arith.addi(arith.muli(arith.addi(
        arith.muli(wide(row), const(heads, i64)), wide(h)),
        const(head_dim, i64)), wide(col))
    return arith.addi(_mlir.address(ref, 64),
                      arith.muli(elem, const(size, i64)))

  nrot = (half if not interleaved else 2 * half) // vec if rotate else 0
  src_q = num_qo_heads if not fused else src_heads
  src_kv = num_kv_heads if not fused else src_heads

  with utils.when(active):
    pos = load_global(at(pos_ref, t, 4), i32, 4)
    bi = (load_global(at(bi_ref, t, 4), i32, 4) if table_kind is not None
          else None)

    def rows():
      """(k_row, v_row, k_ok, v_ok) of the thread's token."""
      if table_kind is None:
        k_row = load_global(at(k_rows_ref, t, 4), i32, 4)
        v_row = load_global(at(v_rows_ref, t, 4), i32, 4)
      else:
        k_row, v_row = _table_rows(table_ref, bi, pos, table_kind,
                                   page_size, num_rows, batch_size,
                                   max_pages)
      # Unsigned: a negative row is outside the pool too.
      return (k_row, v_row,
              arith.cmpi(arith.CmpIPredicate.ult, k_row, ci(num_rows)),
              arith.cmpi(arith.CmpIPredicate.ult, v_row, ci(num_rows)))

    def trig_for(u_rot):
      """cos, sin (f32 lists) of rotated unit `u_rot`'s frequencies."""
      npairs = vec if not interleaved else vec // 2
      f0 = arith.muli(u_rot, ci(npairs))
      inv = elements(load_global(at(inv_ref, f0, 4),
                                 ir.VectorType.get((npairs,), f32),
                                 4 * min(npairs, 4)), npairs)
      p = arith.sitofp(f32, pos)
      ang = [arith.mulf(p, f) for f in inv]
      return [mmath.cos(x) for x in ang], [mmath.sin(x) for x in ang]

    def inv_scales():
      """f32 reciprocals of (k_scale, v_scale), as the Triton kernel's."""
      one = const(1.0, f32)
      return [arith.divf(one, load_global(at(scales_ref, ci(i), 4), f32, 4))
              for i in (0, 1)]

    # A job: (kind "q" / "k" / "v", head index). Sources and destinations:
    # q -> q_out rows of the token, k / v -> their pool rows.
    def src_of(kind, h):
      if kind == "q":
        return q_ref, src_q, h
      off = k_off if kind == "k" else v_off
      return ((k_ref if kind == "k" else v_ref), src_kv,
              arith.addi(h, ci(off)) if off else h)

    def run_jobs(jobs, cols, trig_fn):
      """`jobs` on chunk columns `cols` (i32 element columns; one, or a
      NeoX pair): q and k rotated with `trig_fn()`'s cos / sin, or copied
      (trig_fn None), v copied. The first `max_loads` chunk loads are
      issued before the cos / sin and the pool rows are computed (so
      their latencies overlap), and each later batch's before its
      stores."""
      per_batch = max(1, max_loads // len(cols))
      state = {}
      for b0 in range(0, len(jobs), per_batch):
        batch = jobs[b0:b0 + per_batch]
        loaded = []
        for kind, h in batch:
          ref, heads, hs = src_of(kind, h)
          loaded.append([load_global(head_addr(ref, heads, t, hs, c), vty,
                                     chunk_bytes) for c in cols])
        if not state:
          state["trig"] = trig_fn() if trig_fn is not None else None
          state["rows"] = rows() if any(k != "q" for k, _ in jobs) else None
          if fp8 and state["rows"] is not None:
            state["inv"] = inv_scales()
        for (kind, h), xs in zip(batch, loaded):
          trig = state["trig"] if kind != "v" else None
          if kind == "q":
            outs = xs if trig is None else [
                _pack(c, el, vty)
                for c in _f32_chunks(xs, trig, interleaved, vec)]
            for o, c in zip(outs, cols):
              store_global(o, head_addr(q_out_ref, num_qo_heads, t, h, c),
                           chunk_bytes)
            continue
          k_row, v_row, k_ok, v_ok = state["rows"]
          dst, row, ok = ((k_pool_ref, k_row, k_ok) if kind == "k"
                          else (v_pool_ref, v_row, v_ok))
          if fp8:  # from f32, rounded once (to FP8)
            inv = state["inv"][0 if kind == "k" else 1]
            outs = [_pack_fp8(c, inv)
                    for c in _f32_chunks(xs, trig, interleaved, vec)]
          elif trig is not None:
            outs = [_pack(c, el, vty)
                    for c in _f32_chunks(xs, trig, interleaved, vec)]
          else:
            outs = xs
          size = 1 if fp8 else itemsize
          with utils.when(ok):
            for o, c in zip(outs, cols):
              store_global(o, head_addr(dst, num_kv_heads, row, h, c,
                                        size), vec * size)

    def run(cols, trig_fn):
      """This program's jobs: a `1 / num_splits` share of the q heads and
      of the kv heads, or with `one_head` program `split`'s one head (q
      head `split`, else kv head `split - num_qo_heads`)."""
      if one_head:
        nq = num_qo_heads if has_q else 0
        if nq:
          with utils.when(arith.cmpi(arith.CmpIPredicate.ult, split,
                                     ci(nq))):
            run_jobs([("q", split)], cols, trig_fn)
        with utils.when(arith.cmpi(arith.CmpIPredicate.uge, split, ci(nq))):
          h = arith.subi(split, ci(nq))
          run_jobs([("k", h), ("v", h)], cols, trig_fn)
        return
      jobs = []
      if has_q:
        hq = num_qo_heads // num_splits
        jobs += [("q", arith.addi(arith.muli(split, ci(hq)), ci(i)))
                 for i in range(hq)]
      hk = num_kv_heads // num_splits
      for i in range(hk):
        h = arith.addi(arith.muli(split, ci(hk)), ci(i))
        jobs += [("k", h), ("v", h)]
      run_jobs(jobs, cols, trig_fn)

    if nrot:
      with utils.when(arith.cmpi(arith.CmpIPredicate.ult, u, ci(nrot))):
        c0 = arith.muli(u, ci(vec))
        cols = [c0, arith.addi(c0, ci(half))] if not interleaved else [c0]
        run(cols, lambda: trig_for(u))
    if units > nrot:
      with utils.when(arith.cmpi(arith.CmpIPredicate.uge, u, ci(nrot))):
        col = arith.addi(ci(2 * half if rotate else 0),
                         arith.muli(arith.subi(u, ci(nrot)), ci(vec)))
        run([col], None)


def _f32_chunks(xs, trig, interleaved, vec):
  """The f32 values of chunks `xs` (vectors of `vec` 2-byte floats), one
  list per chunk, rotated with `trig` = (cos, sin) lists, or only widened
  (trig None). Rotated: `xs` = [x1, x2] (NeoX, a chunk and its partner)
  or [x] (GPT-J, pairs within the chunk)."""
  f32 = parse_type("f32")
  vals = [[arith.extf(f32, e) for e in elements(x, vec)] for x in xs]
  if trig is None:
    return vals
  cos, sin = trig
  if not interleaved:
    a, b = vals
    return [[arith.subf(arith.mulf(a[i], cos[i]), arith.mulf(b[i], sin[i]))
             for i in range(vec)],
            [arith.addf(arith.mulf(b[i], cos[i]), arith.mulf(a[i], sin[i]))
             for i in range(vec)]]
  x, out = vals[0], []
  for i in range(vec // 2):
    a, b = x[2 * i], x[2 * i + 1]
    out.append(arith.subf(arith.mulf(a, cos[i]), arith.mulf(b, sin[i])))
    out.append(arith.addf(arith.mulf(b, cos[i]), arith.mulf(a, sin[i])))
  return [out]


def _pack(vals, el, vty):
  """f32 values rounded to `el`, as a vector of type `vty`."""
  return vector([arith.truncf(el, x) for x in vals], vty)


def _pack_fp8(vals, inv_scale):
  """f32 values as float8_e4m3fn bytes, `pkvattn._kv.quantize`'s math:
  times the f32 reciprocal of the scale, clipped to +-FP8_MAX (NaN kept),
  rounded to nearest even (`cvt.rn.satfinite.e4m3x2.f32`, two per
  instruction); a vector of `len(vals) // 2` i16, little-endian pairs."""
  f32 = parse_type("f32")
  hi, lo = const(FP8_MAX, f32), const(-FP8_MAX, f32)
  ys = [arith.maximumf(arith.minimumf(arith.mulf(x, inv_scale), hi), lo)
        for x in vals]
  # cvt's first source lands in the upper byte: (odd, even) for memory
  # order (even, odd).
  pairs = [_mlir.asm("cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;",
                     [ys[2 * i + 1], ys[2 * i]], "=h,f,f", parse_type("i16"))
           for i in range(len(ys) // 2)]
  return vector(pairs, ir.VectorType.get((len(pairs),), parse_type("i16")))


def _table_rows(table_ref, b, pos, table_kind, page_size, num_rows,
                batch_size, max_pages):
  """K and V pool rows of a token of sequence `b` at position `pos` (i32)
  from the page table (`reference.append_rows`' rule): `num_rows` where
  the sequence, position or page is out of range."""
  i32, ci = parse_type("i32"), _mlir.const_i32
  lt, ge = arith.CmpIPredicate.slt, arith.CmpIPredicate.sge

  block = arith.divsi(pos, ci(page_size))
  ok = arith.andi(
      arith.andi(arith.cmpi(ge, b, ci(0)), arith.cmpi(lt, b, ci(batch_size))),
      arith.andi(arith.cmpi(ge, pos, ci(0)),
                 arith.cmpi(lt, block, ci(max_pages))))
  bc = arith.select(ok, b, ci(0))
  kc = arith.select(ok, block, ci(0))
  per_seq = 2 * max_pages if table_kind == "split" else max_pages

  def entry(which):
    idx = arith.addi(arith.muli(bc, ci(per_seq)),
                     arith.addi(ci(which * max_pages), kc))
    return load_global(_mlir.element_address(table_ref, idx, 4), i32, 4)

  if table_kind == "split":
    k_page, v_page = entry(0), entry(1)
  else:
    page = entry(0)
    if table_kind == "flashinfer":
      neg = arith.cmpi(lt, page, ci(0))
      k_page = arith.select(neg, ci(-1), arith.muli(page, ci(2)))
      v_page = arith.select(neg, ci(-1), arith.addi(arith.muli(page, ci(2)),
                                                    ci(1)))
    else:
      k_page = v_page = page
  offset = arith.remsi(pos, ci(page_size))
  num_pages = num_rows // page_size

  def rows(page):
    good = arith.andi(ok, arith.andi(arith.cmpi(ge, page, ci(0)),
                                     arith.cmpi(lt, page, ci(num_pages))))
    return arith.select(good, arith.addi(arith.muli(page, ci(page_size)),
                                         offset), ci(num_rows))
  return rows(k_page), rows(v_page)


def index_inputs(positions, k_rows, v_rows, paged, inv_freq, scales):
  """The leading kernel inputs both RoPE + append kernels take, in order:
  positions, then `k_rows, v_rows` or (with `paged`) `batch_indices,
  page_table` (all i32), then `inv_freq` (f32) if given and the FP8
  `scales` (f32[2]) if given. Returns `(table_kind or None, inputs)`.

  Raises:
    ValueError: an unknown `table_kind` in `paged`.
  """
  if paged is None:
    table_kind = None
    inputs = [positions.astype(jnp.int32), k_rows.astype(jnp.int32),
              v_rows.astype(jnp.int32)]
  else:
    batch_indices, page_table, table_kind = paged
    if table_kind not in TABLE_KINDS:
      raise ValueError(f"Invalid table_kind: expected one of {TABLE_KINDS}, "
                       f"got {table_kind!r}")
    inputs = [positions.astype(jnp.int32), batch_indices.astype(jnp.int32),
              page_table.astype(jnp.int32)]
  if inv_freq is not None:
    inputs.append(inv_freq.astype(jnp.float32))
  if scales is not None:
    inputs.append(jnp.asarray(scales, jnp.float32).reshape(2))
  return table_kind, inputs


def rope_append_mgpu(
    q,          # [num_tokens, num_qo_heads, head_dim] | None | shape only
    k,          # [num_tokens, num_kv_heads, head_dim] | None (with qkv)
    v,          # [num_tokens, num_kv_heads, head_dim] | None (with qkv)
    positions,  # i32[num_tokens]
    k_rows,     # i32[num_tokens] | None (with paged)
    v_rows,     # i32[num_tokens] | None (with paged)
    inv_freq,   # f32[rotary_dim // 2] | None (no rotation)
    k_pool,     # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool,     # [num_pages, page_size, num_kv_heads, head_dim] | None
    *,
    interleaved: bool,
    config: Config | None = None,
    qkv=None,   # [num_tokens, num_qo_heads + 2 * num_kv_heads, head_dim]
    paged=None,
    scales=None,  # f32[2]: (k_scale, v_scale) of float8_e4m3fn pools
):
  """`rope_append.rope_append` (or, with `qkv`, `rope_append_qkv`) on the
  Mosaic-GPU kernel, with the same semantics (`reference.rope_reference`
  on q and k, `reference.append_rows`' rows, TensorRT-LLM's
  `qkv_preprocessing`).

  Args:
    q, k, v: bf16 or f16, one dtype. With `qkv` (the fused rows, heads q,
      then k, then v), `q` stands for the rotated q's shape only and `k`,
      `v` are None.
    positions: token positions (the RoPE angle is `positions * inv_freq`
      in f32).
    k_rows, v_rows: flat pool rows per token (`page * page_size +
      position % page_size`); a row `>= num_pages * page_size` or negative
      is not written. None with `paged`.
    inv_freq: per-pair inverse frequencies (scaling applied); the first
      `2 * len(inv_freq)` features of each head rotate (GPT-NeoX pairs, or
      GPT-J pairs with `interleaved`), the rest pass through. None: no
      rotation (a plain append; q is copied).
    k_pool, v_pool: the cache pools, dtype of k, or float8_e4m3fn with
      `scales`; `v_pool` None when V shares `k_pool` (split or
      FlashInfer-layout tables).
    config: launch config; None = `Config.default_for`.
    paged: `(batch_indices i32[num_tokens], page_table, table_kind)`:
      the rows looked up in the kernel, as `rope_append.rope_append`.
    scales: `f32[2]` (k_scale, v_scale), may be traced, exactly with
      float8_e4m3fn pools: rows store `clip(x * (1 / scale), -448, 448)`
      rounded to nearest, x the rotated K (f32) or V (`pkvattn._kv.quantize`).

  Returns:
    `(q_rotated [num_tokens, num_qo_heads, head_dim] or None, k_pool,
    v_pool or None)`, the pools aliased to the inputs (in place under a
    donated jit).

  Raises:
    ValueError: a case `supports` rejects, q / k / v of different dtypes,
      or an unknown `table_kind`.
  """
  plgpu = _compat.mosaic_gpu()
  fused = qkv is not None
  num_pages, page_size, num_kv_heads, head_dim = k_pool.shape
  if fused:
    num_tokens = qkv.shape[0]
    num_qo_heads = qkv.shape[1] - 2 * num_kv_heads
    dtype = qkv.dtype
  else:
    num_tokens = k.shape[0]
    num_qo_heads = 0 if q is None else q.shape[1]
    dtype = k.dtype
  has_q = fused or q is not None
  got = [x.dtype for x in ((q, k, v) if not fused else ()) if x is not None]
  if any(jnp.dtype(x) != jnp.dtype(dtype) for x in got):
    raise ValueError(f"Invalid dtypes of q, k, v: expected one dtype, got "
                     f"{[jnp.dtype(x).name for x in got]}")
  rotate = inv_freq is not None
  half = inv_freq.shape[0] if rotate else 0
  same_pool = v_pool is None
  itemsize = jnp.dtype(dtype).itemsize
  if config is None:
    config = Config.default_for(num_tokens, num_qo_heads, num_kv_heads)
  why = supports(dtype=dtype, pool_dtype=k_pool.dtype, head_dim=head_dim,
                 half=half, interleaved=interleaved,
                 num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                 num_splits=1 if config.one_head else config.num_splits,
                 has_scales=scales is not None,
                 chunk_bytes=config.chunk_bytes)
  if why is not None:
    raise ValueError(f"Invalid case for the Mosaic-GPU rope_append: {why}")
  units = units_per_token(head_dim, half, interleaved, itemsize,
                          config.chunk_bytes)
  per_tile = WARPGROUP // units
  num_rows = num_pages * page_size
  flat_k = k_pool.reshape(num_rows, num_kv_heads, head_dim)
  table_kind, inputs = index_inputs(positions, k_rows, v_rows, paged,
                                    inv_freq, scales)
  if fused:
    inputs.append(qkv)
  else:
    if has_q:
      inputs.append(q)
    inputs += [k, v]
  # The pools go in as `jax.Ref`s: the kernel writes them, and Pallas
  # aliases a Ref argument in and out of the kernel (under a donated jit
  # the pool is updated in place).
  k_ref = jax.new_ref(flat_k)
  refs = [k_ref]
  if not same_pool:
    refs.append(jax.new_ref(v_pool.reshape(num_rows, num_kv_heads,
                                           head_dim)))
  out_type = ([jax.ShapeDtypeStruct((num_tokens, num_qo_heads, head_dim),
                                    dtype)] if has_q else [])
  body = functools.partial(
      _body, num_tokens=num_tokens, num_rows=num_rows,
      num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
      head_dim=head_dim, half=half, interleaved=interleaved, rotate=rotate,
      has_q=has_q, fused=fused, same_pool=same_pool, table_kind=table_kind,
      page_size=page_size, num_splits=config.num_splits,
      one_head=config.one_head, max_loads=config.max_loads, units=units,
      chunk_bytes=config.chunk_bytes,
      dtype_name="bf16" if jnp.dtype(dtype) == jnp.bfloat16 else "f16",
      itemsize=itemsize, fp8=scales is not None)
  n_refs = len(inputs) + len(refs) + len(out_type)
  splat = plgpu.Layout.WG_SPLAT(shape=())
  n_in = len(inputs)
  # The inputs are read only; q_out and the pools written.
  inline = plgpu.inline_mgpu(
      arg_types=(splat, splat) + (_compat.ref_type(write=False),) * n_in
      + (plgpu.RefType(),) * (n_refs - n_in))(body)

  def kernel(*all_refs):
    # Inputs, the pool Refs, then q_out: `_body` takes q_out before the
    # pools.
    ins, pools, outs = (all_refs[:n_in], all_refs[n_in:n_in + len(refs)],
                        all_refs[n_in + len(refs):])
    inline(lax.axis_index("tiles"), lax.axis_index("splits"), *ins, *outs,
           *pools)

  programs = config.programs(num_qo_heads if has_q else 0, num_kv_heads)
  name = (f"rope_append_mgpu{'_qkv' if fused else ''}_s{programs}"
          f"_{'gptj' if interleaved else 'neox'}{'' if rotate else '_norope'}")
  # `pl.kernel` (not `plgpu.kernel`, whose batching wrapper has no rule to
  # discharge Ref arguments) on a Mosaic-GPU mesh.
  res = pl.kernel(
      kernel,
      out_type=out_type,
      mesh=plgpu.Mesh(grid=(-(-num_tokens // per_tile), programs),
                      grid_names=("tiles", "splits")),
      compiler_params=plgpu.CompilerParams(),
      name=name,
  )(*inputs, *refs)
  q_out = res[0] if has_q else None
  k_pool = k_ref[...].reshape(num_pages, page_size, num_kv_heads, head_dim)
  if not same_pool:
    v_pool = refs[1][...].reshape(num_pages, page_size, num_kv_heads,
                                  head_dim)
  return q_out, k_pool, v_pool
