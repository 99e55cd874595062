"""The prefill kernel's tile schedule as one Mosaic-GPU launch (Hopper).

`plan.plan_prefill` (the pure-jnp reference beside this kernel) builds a
step's schedule from `q_indptr` / `kv_lens` with a few small XLA ops: a
prefix sum, a compare-and-count search, the longest-first order's rank
count and scatter, and the gathers and selects around them. On the GPU
each is an XLA kernel of its own, and their launches cost more than the
work (measured: docs/performance.md). Here the same schedule is one launch
of `cdiv(num_tiles, 128)` CTAs of 128 threads, written as per-thread code
through `plgpu.inline_mgpu` (MLIR `arith` / `scf` / `memref` and PTX, with
`_mlir`'s helpers, as `paged_decode_mma` is). Every CTA:

1. reads the `batch_size + 1` sequences (the last is the padding
   pseudo-sequence) in contiguous chunks per thread, keeps each one's
   first and end token, kv length and tile count in shared memory, and
   prefix-sums the tile counts (per thread, then across the warp by
   `shfl.sync.up` and across the four warps through shared memory);
2. with `longest_first`, computes every tile's work estimate (its
   sequence by a binary search of the prefix sums) into shared memory;
3. takes the tiles `128 * cta + thread`: each one's row, and its rank in
   descending work (ties in tile order: a stable sort) by counting the
   tiles before it, and stores the row at that rank. The same thread
   also stores the sequence's decode rows (one per token of a sequence
   the decode kernel runs, with its key count) and short tile (ranked
   the same way among the short tiles), where the plan has them.

So the output equals `plan.plan_prefill`'s bit for bit (a test checks it on
the GPU). Phases 1-2 are repeated by every CTA: the plan is small (up to
`MAX_ROWS` tiles and sequences; beyond, `supports` says no and the
caller takes the jnp plan).

The rank count (every tile against every tile, from shared memory) is
quadratic in the tiles and sets the kernel's pace at a few hundred of
them; `MAX_ROWS` bounds it.

The CTA's barriers are `barrier.sync`, not `bar.sync`
(`_mlir.cta_barrier`): the latter requires every thread of a warp to
reach the same barrier instruction, and the compiler may copy a barrier
into both branches of the conditional store before it, and the threads of
a warp that split there would then wait at two barriers (a hang).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pkvattn.pallas_kernels import _compat
from pkvattn.pallas_kernels import _mlir
from pkvattn.pallas_kernels import plan as plan_lib
from pkvattn.pallas_kernels._compat import pl
from pkvattn.pallas_kernels._mlir import arith, ir, memref

THREADS = 128  # one warpgroup per CTA
WARPS = THREADS // 32
# Most tiles, and most sequences + 1, a plan may have here: every CTA ranks
# its tiles against all of them (one shared-memory word each).
MAX_ROWS = 2048
_PAD_WORK = -2  # below any tile's work (unused tiles have -1)


def supports(*, num_tokens: int, batch_size: int, block_q: int,
             align: int, min_tokens: int = 1) -> str | None:
  """Why the kernel does not take a plan (a sentence), or None when it
  does: at least one sequence, at most `MAX_ROWS` tiles (`plan.max_tiles`
  with `min_tokens`, `plan.tile_min_tokens` of the plan's arguments) and
  `MAX_ROWS - 1` sequences, a power-of-two `align`. (Whether the GPU is a
  Hopper one is the caller's check: the kernel also lowers elsewhere.)"""
  tiles = plan_lib.max_tiles(num_tokens, batch_size, block_q, min_tokens)
  if batch_size < 1:
    return "no sequences"
  if tiles > MAX_ROWS or batch_size + 1 > MAX_ROWS:
    return (f"{tiles} tiles / {batch_size} sequences exceed {MAX_ROWS}")
  if align < 1 or align & (align - 1):
    return f"align {align} is not a power of two"
  return None


def _body(ctx, cta_v, q_indptr_ref, kv_lens_ref, *refs, batch_size: int,
          num_tokens: int, num_tiles: int, block_q: int, align: int,
          causal: bool, window_left: int, longest_first: bool,
          short_block_q: int, split_decode_rows: bool,
          decode_rows_per_seq: int = 1):
  """Per-thread body (inside `inline_mgpu`); see the module docstring.
  `refs`: tiles, [short_tiles], [decode_rows, [decode_kv_lens]], smem."""
  del ctx
  from jax.experimental.mosaic.gpu import utils  # noqa: PLC0415
  refs = list(refs)
  tiles_ref = refs.pop(0)
  short_ref = refs.pop(0) if short_block_q > 0 else None
  decode_ref = refs.pop(0) if split_decode_rows else None
  R = decode_rows_per_seq
  dkv_ref = refs.pop(0) if split_decode_rows and R > 1 else None
  [smem_ref] = refs
  i32 = ir.IntegerType.get_signless(32)
  index_t = ir.IndexType.get()
  P = arith.CmpIPredicate
  B, T, N = batch_size, num_tokens, num_tiles
  S = B + 1                       # sequences, the padding one included
  n_pad = -(-N // 4) * 4          # work words, padded for 4-word steps
  b_pad = -(-B // 4) * 4
  # Shared memory (i32 words): per sequence START, END, KV, NT (tiles),
  # CUM (inclusive prefix sum of NT); then WORK[n_pad] (per tile), SW
  # [b_pad] (short tiles' work) and the warps' totals.
  START, END, KV, NT, CUM = (k * S for k in range(5))
  WORK = 5 * S
  SW = WORK + n_pad
  WT = SW + b_pad

  ci = _mlir.const_i32

  def add(a, b):
    return arith.addi(a, b if not isinstance(b, int) else ci(b))

  def sub(a, b):
    return arith.subi(a, b if not isinstance(b, int) else ci(b))

  def cmp(pred, a, b):
    return arith.cmpi(pred, a, b if not isinstance(b, int) else ci(b))

  def sel(p, a, b):
    return arith.select(p, a if not isinstance(a, int) else ci(a),
                        b if not isinstance(b, int) else ci(b))

  def mn(a, b):
    return arith.minsi(a, b if not isinstance(b, int) else ci(b))

  def mx(a, b):
    return arith.maxsi(a, b if not isinstance(b, int) else ci(b))

  def band(*ps):
    out = ps[0]
    for p in ps[1:]:
      out = arith.andi(out, p)
    return out

  def bnot(p):
    return arith.xori(p, _mlir.const(1, _mlir.int_type(1)))

  def idx(x):
    return arith.index_cast(index_t, x if not isinstance(x, int) else ci(x))

  def gload(ref, *ix):
    return memref.load(ref, [idx(x) for x in ix])

  def gstore(ref, x, *ix):
    memref.store(x, ref, [idx(i) for i in ix])

  def sload(base, i):
    return memref.load(smem_ref, [idx(add(i, base))])

  def sstore(base, i, x):
    memref.store(x if not isinstance(x, int) else ci(x), smem_ref,
                 [idx(add(i, base))])

  def classes(ln, real):
    """(one, short) of a sequence of `ln` new tokens: it goes to the decode
    rows / the short tiles (i1; None where the plan has no such class);
    `real` (i1 or None): not the padding sequence."""
    one = short = None
    if split_decode_rows:
      one = cmp(P.eq, ln, 1) if R == 1 else band(cmp(P.sge, ln, 1),
                                                 cmp(P.sle, ln, R))
    if short_block_q > 0:
      short = band(cmp(P.sge, ln, 1), cmp(P.sle, ln, short_block_q))
      if one is not None:
        short = band(short, bnot(one))
    if real is not None:
      one, short = (None if x is None else band(x, real)
                    for x in (one, short))
    return one, short

  tid = _mlir.thread_index()
  cta = _mlir.scalar(cta_v)
  lane = arith.andi(tid, ci(31))
  warp = arith.shrui(tid, ci(5))
  total = mn(gload(q_indptr_ref, ci(B)), T)

  # 1. The sequences, `chunk` per thread, and the prefix sum of their
  # tile counts.
  chunk = -(-S // THREADS)
  run = ci(0)
  seqs = []
  for k in range(chunk):
    s = add(arith.muli(tid, ci(chunk)), k)
    ok = cmp(P.slt, s, S)
    s_c = mn(s, B)                   # a row of q_indptr (B + 1 rows)
    pad = cmp(P.eq, s_c, B)
    b_c = mn(s_c, B - 1)
    start = sel(pad, total, gload(q_indptr_ref, s_c))
    end = sel(pad, ci(T), mn(gload(q_indptr_ref, add(b_c, 1)), T))
    kv = sel(pad, 0, gload(kv_lens_ref, b_c))
    ln = mx(sub(end, start), 0)
    skip = cmp(P.eq, ln, 0)
    one, short = classes(ln, bnot(pad))
    for x in (one, short):
      if x is not None:
        skip = arith.ori(skip, x)
    lead = arith.andi(start, ci(align - 1))
    nt = sel(skip, 0, arith.divsi(add(add(ln, lead), block_q - 1),
                                  ci(block_q)))
    nt = sel(ok, nt, 0)
    with utils.when(ok):
      for base, x in ((START, start), (END, end), (KV, kv), (NT, nt)):
        sstore(base, s, x)
    if short_block_q > 0 and longest_first:
      # Short tiles' work (their kv length; -1 for none), pads below all.
      with utils.when(cmp(P.slt, s, b_pad)):
        sstore(SW, s, sel(cmp(P.slt, s, B), sel(short, kv, -1), _PAD_WORK))
    run = add(run, nt)
    seqs.append((s, ok, run))
  # Inclusive scan of the threads' totals: within the warp, then across.
  x = run
  for d in (1, 2, 4, 8, 16):
    y = _mlir.asm(f"shfl.sync.up.b32 $0, $1, {d}, 0, 0xffffffff;", [x],
                  "=r,r", i32, side_effects=True)
    x = sel(cmp(P.uge, lane, d), add(x, y), x)
  with utils.when(cmp(P.eq, lane, 31)):
    sstore(WT, warp, x)
  _mlir.cta_barrier()
  before = sub(x, run)
  for w in range(WARPS - 1):
    before = add(before, sel(cmp(P.ugt, warp, w), sload(WT, ci(w)), 0))
  for s, ok, upto in seqs:
    with utils.when(ok):
      sstore(CUM, s, add(before, upto))
  _mlir.cta_barrier()

  last = sload(CUM, ci(S - 1))
  steps = S.bit_length()

  def tile(i):
    """Tile `i`'s row (the five fields) and work estimate."""
    lo, hi = ci(0), ci(S)
    for _ in range(steps):   # upper bound: #{s : CUM[s] <= i}
      active = cmp(P.slt, lo, hi)
      mid = arith.shrui(add(lo, hi), ci(1))
      right = band(active, cmp(P.sle, sload(CUM, mn(mid, S - 1)), i))
      lo = sel(right, add(mid, 1), lo)
      hi = sel(band(active, bnot(right)), mid, hi)
    used = cmp(P.slt, i, last)
    seq = mn(lo, B)
    start, end, kv, nt = (sload(base, seq) for base in (START, END, KV, NT))
    ln = mx(sub(end, start), 0)
    lead = arith.andi(start, ci(align - 1))
    local = sub(i, sub(sload(CUM, seq), nt))
    q_start = mx(add(sub(start, lead), arith.muli(local, ci(block_q))),
                 start)
    q_end = sel(used, end, q_start)
    kv_len = sel(used, kv, 0)
    pos_offset = sub(sub(kv, ln), start)
    row = [sel(cmp(P.slt, seq, B), seq, 0), q_start, q_end, kv_len,
           pos_offset]
    origin = sub(q_start, arith.andi(q_start, ci(align - 1)))
    pos_max = add(sub(mn(add(origin, block_q), q_end), 1), pos_offset)
    hi_key = mn(kv_len, add(pos_max, 1)) if causal else kv_len
    lo_key = ci(0)
    if window_left >= 0:
      lo_key = mx(sub(add(q_start, pos_offset), window_left), 0)
    work = sel(used, mx(sub(hi_key, lo_key), 0), -1)
    return row, work

  def rank(base, count, i, w):
    """#{j < count: WORK'[j] > w, or == w with j < i} of the words at
    `base` (count a multiple of 4): i's place in a stable descending
    order."""
    @utils.fori(ci(count // 4), ci(0))
    def loop(j4, n):
      for u in range(4):
        j = add(arith.muli(j4, ci(4)), u)
        wj = sload(base, j)
        first = arith.ori(cmp(P.sgt, wj, w),
                          band(cmp(P.eq, wj, w), cmp(P.slt, j, i)))
        n = add(n, arith.extui(i32, first))
      return n
    return loop.results[0]

  # 2. Every tile's work.
  if longest_first:
    for k in range(-(-N // THREADS)):
      i = add(tid, THREADS * k)
      _, w = tile(mn(i, N - 1))
      with utils.when(cmp(P.slt, i, n_pad)):
        sstore(WORK, i, sel(cmp(P.slt, i, N), w, _PAD_WORK))
    _mlir.cta_barrier()

  # 3. This CTA's tiles, and its sequences' decode rows and short tiles.
  i = add(arith.muli(cta, ci(THREADS)), tid)
  row, w = tile(mn(i, N - 1))
  dest = rank(WORK, n_pad, i, w) if longest_first else i
  with utils.when(cmp(P.slt, i, N)):
    for f, x in enumerate(row):
      gstore(tiles_ref, x, dest, ci(f))
  if decode_ref is None and short_ref is None:
    return
  b = mn(i, B - 1)
  start, end, kv = (sload(base, b) for base in (START, END, KV))
  ln = mx(sub(end, start), 0)
  one, short = classes(ln, None)
  in_batch = cmp(P.slt, i, B)
  if decode_ref is not None:
    with utils.when(in_batch):
      if R == 1:
        gstore(decode_ref, sel(one, start, T), b)
      else:
        for r in range(R):
          # Token r of a decode sequence, and the keys it sees.
          row = band(one, cmp(P.slt, ci(r), ln))
          at = add(arith.muli(b, ci(R)), r)
          gstore(decode_ref, sel(row, add(start, r), T), at)
          gstore(dkv_ref, sel(row, sub(kv, sub(sub(ln, 1), r)), 0), at)
  if short_ref is not None:
    srow = [b, start, sel(short, end, start), sel(short, kv, 0),
            sub(sub(kv, ln), start)]
    sdest = (rank(SW, b_pad, b, sel(short, kv, -1)) if longest_first
             else b)
    with utils.when(in_batch):
      for f, x in enumerate(srow):
        gstore(short_ref, x, sdest, ci(f))


def plan_prefill_mgpu(
    q_indptr: jax.Array,  # i32[batch_size + 1]
    kv_lens: jax.Array,   # i32[batch_size]
    *,
    num_tokens: int,
    block_q: int,
    causal: bool = True,
    window_left: int = -1,
    longest_first: bool = True,
    short_block_q: int = 0,
    align: int = 1,
    split_decode_rows: bool = False,
    decode_rows_per_seq: int = 1,
) -> plan_lib.PrefillPlan:
  """`plan.plan_prefill` in one Mosaic-GPU launch (see the module
  docstring); same arguments, same result bit for bit.

  Args:
    q_indptr: `i32[batch_size + 1]`, cu_seqlens of the new tokens,
      `q_indptr[-1] <= num_tokens`.
    kv_lens: `i32[batch_size]`, tokens including the new ones.
    num_tokens, block_q, causal, window_left, longest_first,
      short_block_q, align, split_decode_rows, decode_rows_per_seq:
      static, as `plan.plan_prefill`.

  Returns:
    A `plan.PrefillPlan`: `tiles i32[plan.max_tiles(...), 5]` (as
    `plan.plan_prefill`), `short_tiles i32[batch_size, 5]` with
    `short_block_q > 0`, `decode_rows i32[batch_size *
    decode_rows_per_seq]` with `split_decode_rows`, and then
    `decode_kv_lens` of that shape with `decode_rows_per_seq > 1`.

  Raises:
    ValueError: a case `supports` rejects, `q_indptr` not of shape
      `(batch_size + 1,)`, or `decode_rows_per_seq < 1`.
  """
  if decode_rows_per_seq < 1:
    raise ValueError(f"Invalid decode_rows_per_seq: expected >= 1, got "
                     f"{decode_rows_per_seq}")
  rows_per_seq = decode_rows_per_seq if split_decode_rows else 1
  plgpu = _compat.mosaic_gpu()
  batch_size = kv_lens.shape[0]
  if q_indptr.shape != (batch_size + 1,):
    raise ValueError(f"Invalid q_indptr shape: expected ({batch_size + 1},), "
                     f"got {q_indptr.shape}")
  min_tokens = plan_lib.tile_min_tokens(short_block_q, split_decode_rows,
                                        rows_per_seq)
  why = supports(num_tokens=num_tokens, batch_size=batch_size,
                 block_q=block_q, align=align, min_tokens=min_tokens)
  if why is not None:
    raise ValueError(f"Invalid case for the Mosaic-GPU plan: {why}")
  num_tiles = plan_lib.max_tiles(num_tokens, batch_size, block_q, min_tokens)
  out_type = [jax.ShapeDtypeStruct((num_tiles, plan_lib.NUM_FIELDS),
                                   jnp.int32)]
  if short_block_q > 0:
    out_type.append(jax.ShapeDtypeStruct((batch_size, plan_lib.NUM_FIELDS),
                                         jnp.int32))
  if split_decode_rows:
    out_type += [jax.ShapeDtypeStruct((batch_size * rows_per_seq,),
                                      jnp.int32)] * (1 + (rows_per_seq > 1))
  body = functools.partial(
      _body, batch_size=batch_size, num_tokens=num_tokens,
      num_tiles=num_tiles, block_q=block_q, align=align, causal=causal,
      window_left=window_left, longest_first=longest_first,
      short_block_q=short_block_q, split_decode_rows=split_decode_rows,
      decode_rows_per_seq=rows_per_seq)
  n_refs = 2 + len(out_type) + 1
  # q_indptr and kv_lens are read only; the outputs and the scratch written.
  inline = plgpu.inline_mgpu(
      arg_types=(_mlir.splat(),) + (_compat.ref_type(write=False),) * 2
      + (plgpu.RefType(),) * (n_refs - 2))(body)
  s = batch_size + 1
  smem_words = (5 * s + -(-num_tiles // 4) * 4 + -(-batch_size // 4) * 4
                + WARPS)

  def kernel(*refs):
    pl.run_scoped(lambda smem: inline(lax.axis_index("ctas"), *refs, smem),
                  plgpu.SMEM((smem_words,), jnp.int32))

  res = pl.kernel(
      kernel,
      out_type=out_type,
      mesh=plgpu.Mesh(grid=(math.ceil(num_tiles / THREADS),),
                      grid_names=("ctas",)),
      compiler_params=plgpu.CompilerParams(),
      name=f"plan_prefill_mgpu_bq{block_q}",
  )(q_indptr.astype(jnp.int32), kv_lens.astype(jnp.int32))
  res = list(res)
  tiles = res.pop(0)
  short_tiles = res.pop(0) if short_block_q > 0 else None
  decode_rows = res.pop(0) if split_decode_rows else None
  decode_kv_lens = res.pop(0) if rows_per_seq > 1 else None
  return plan_lib.PrefillPlan(tiles, short_tiles, decode_rows, block_q,
                              short_block_q, num_tokens, batch_size, align,
                              decode_kv_lens, rows_per_seq)
