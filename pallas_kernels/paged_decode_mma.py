"""Paged decode attention for Hopper, one warp per key stream: Pallas on
Mosaic GPU, `mma.sync` from registers.

The same flash-decoding algorithm as the Pallas-Triton decode kernel
(`paged_decode.py`): split-K over the visible pages, online softmax in base
2 (the scale folded into the exponent), an LSE combine of the splits. It is
laid out as a CUDA decode kernel for small pages would be, not as a
warp-specialised pipeline: a page of 16 tokens of one kv head at head_dim 64
is 2 KiB, and a descriptor-driven (TMA) copy per page plus a producer /
consumer hand-over per stage cost more than they save on pages that small.
So the body is per-thread code written through `plgpu.inline_mgpu` (MLIR
`arith` / `scf` / `llvm` and PTX, built with `_mlir`), as
`rope_append_mgpu` is:

* A CTA (4 warps) serves one work item `(kv head, sequence, split)`, kv
  heads fastest. Its warps take turns over the split's steps of
  `16 * tiles` keys (warp `w` takes steps `w, w + 4, ...`), each with its
  own online-softmax state; at the end the four states merge through
  shared memory and the CTA stores its output rows (or a partial and its
  LSE for `paged_decode`'s combine).
* Keys are the M dimension of `mma.sync.m16n8k16` (bf16 / f16 in, f32
  accumulators) and the GQA group (<= 8 query heads, zero rows past it) is
  N: `S^T = K q^T` per 16 keys, `O^T += V^T P^T`. P^T's operand comes
  from S^T's accumulators by `movmatrix` (an 8x8 transpose in registers).
* No shared memory in the loop: every thread loads its own fragments'
  bytes straight from the pool into registers, 16 bytes per load. The dots
  sum over head_dim (and keys), so each thread may own any columns, as
  long as q and K agree (and V and the output): a thread of lane `l` owns
  16-byte chunks `l % 4, l % 4 + 4, ...` of a K row (a warp's load covers
  whole 64-byte runs of 8 rows) and chunks `l // 4, l // 4 + 8, ...` of a V
  row (whole 128-byte runs of 4 rows); V's key pairs are interleaved with
  `prmt`. The next step's K and V loads are issued before this step's
  matmuls (at head_dim 256, K's after QK^T and V's after PV, to bound the
  registers), and the page ids two steps ahead.
* Keys outside `[max(0, kv_len - 1 - window_left), kv_len)` and steps past
  the warp's last are not loaded (their registers are zero) and their
  logits are -inf; a column whose keys are all masked subtracts a max of
  0, so its weights are exp2(-inf) = 0, never NaN. The page index is
  clamped into the visible pages, so table entries outside them are never
  read, and stale rows past `kv_len` (possibly NaN) never reach a register.
* At head_dim 256 q's fragments are read from shared memory at each step
  (`q_in_smem`): registers are short there, and holding q in them costs
  more than the reads (measured: docs/performance.md).
* With one split the CTA stores the output rows and the LSE itself, sinks
  added to the denominator; with several it stores f32 partials and their
  LSE for `paged_decode`'s jnp combine. (A combine in the kernel, by the
  last CTA of each (sequence, kv head) to finish, would cost every CTA an
  atomic's round trip and the kernel's tail the last CTA's reads: slower
  than the jnp combine on the shapes that split, measured:
  docs/performance.md.)
* With `q_rows` (`paged_decode.paged_decode_rows`: the one-token
  sequences of a prefill call), q is the call's token-major q and
  sequence b's query its row `q_rows[b]`; with one split the CTA writes
  that row of the call's output and LSE in place (`jax.Ref`s, aliased),
  and the CTAs of a sequence without a row do nothing past reading it.
  So a prefill call's decode rows need no q gather and no output scatter.
  The tables may have a row per R sequences: R token rows of one
  multi-token sequence, each with its own `kv_lens` (its causal prefix),
  read table row `b // R` (`paged_prefill.PrefillConfig.decode_rows_per_seq`).
  A CTA then serves T = `tokens_per_item` of those rows at once where the
  group leaves room in the MMA's columns, 8 a tile, two tiles at head_dim
  <= 128 (`row_packing`: T a power of two dividing R with T * G <= 16; 4
  at group 3 or 4, 2 at groups 5-8; at head_dim 256 half that): column n
  is token n // G's head n % G, each column masked to its own keys, so the
  T rows read the sequence's pages once rather than T times.

FP8 pages (float8_e4m3fn, `k_scale` / `v_scale` per tensor or per KV
head, a CTA reading its head's): the same loads carry twice the keys'
columns. The matmuls run in f16 (every e4m3 value is an f16 one; q is
clamped to +-65504 and rounded to f16 once, as the Triton kernel's FP8
path does), each 32-bit word of K converting to
two f16 pairs by `cvt.rn.f16x2.e4m3x2` just before its `mma`; V's words of
two keys are byte-interleaved by one `prmt` per pair of columns, then
converted the same way. K's scale joins the logits' scale and V's the
output's normalisation. At head_dim 64 a V row is 64 bytes, so its loads
are 8 bytes a lane. `dispatch.decode` takes steps of 32 keys there at
head_dim <= 128 (measured: docs/performance.md).

`dispatch.decode` sends a Hopper call with bf16 / f16 q over pages of that
dtype or FP8 pages here (`paged_decode.MmaConfig`); f32, other GPUs,
interpret mode and many one-token rows over 16-token pages of 16 bits
(`dispatch.TRITON_ITEMS_PER_SM`) take the Triton kernel (`supports` says
why a case is not taken here).
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pkvattn.pallas_kernels import _compat
from pkvattn.pallas_kernels import _fp8
from pkvattn.pallas_kernels import _mlir
from pkvattn.pallas_kernels._compat import pl
from pkvattn.pallas_kernels._mlir import arith, asm

WARPS = 4          # warps per CTA (one warpgroup)
KEYS = 16          # keys per m-tile (mma.sync M)
COLS = 8           # query rows per kv head (mma.sync N), the group padded
MAX_GROUP = COLS
HEAD_DIMS = (64, 128, 256)
LOAD_HINTS = ("", ".L1::no_allocate", ".L2::256B", ".L1::no_allocate.L2::256B",
              ".L2::128B")
FP8 = jnp.float8_e4m3fn
F16_MAX = 65504.0
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def supports(*, dtype, kv_dtype, head_dim: int, page_size: int,
             group_size: int) -> str | None:
  """Why the kernel does not take a case (a sentence), or None when it does:
  bf16 / f16 q with pages of the same dtype or of float8_e4m3fn (FP8, which
  needs compute capability >= 8.9), head_dim 64 / 128 / 256, a GQA
  group of 1..8 and a power-of-two page size in [8, 128]. (Whether the GPU
  is a Hopper one is the caller's check: the kernel also lowers elsewhere.)
  """
  dt = jnp.dtype(dtype)
  if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"q dtype {dt.name} is not bf16 / f16"
  if jnp.dtype(kv_dtype) not in (dt, jnp.dtype(FP8)):
    return f"pages of {jnp.dtype(kv_dtype).name} for a {dt.name} q"
  if head_dim not in HEAD_DIMS:
    return f"head_dim {head_dim} is not one of {HEAD_DIMS}"
  if not 1 <= group_size <= MAX_GROUP:
    return f"a GQA group of {group_size} is not in [1, {MAX_GROUP}]"
  if page_size < 8 or page_size > 128 or page_size & (page_size - 1):
    return f"page_size {page_size} is not a power of two in [8, 128]"
  return None


def tokens_per_item_default(group_size: int, rows_per_seq: int,
                           n_tiles: int = 1) -> int:
  """Token rows of one sequence a work item serves side by side in the
  MMA's `8 * n_tiles` columns (`paged_decode_mma` with `q_rows`): the
  largest power of two T dividing `rows_per_seq` with `T * group_size <= 8
  * n_tiles`; 1 for one row per sequence. The T rows then read the
  sequence's pages once."""
  t = 1
  while (2 * t * group_size <= COLS * n_tiles
         and rows_per_seq % (2 * t) == 0):
    t *= 2
  return t


def row_packing(group_size: int, rows_per_seq: int,
                head_dim: int) -> tuple[int, int]:
  """`(tokens_per_item, n_tiles)`, `paged_decode_mma`'s default with
  `q_rows`: a second n-tile (16 columns) where it fits more token rows in
  a CTA at head_dim <= 128 (at 256 its accumulators would not fit in
  registers), then `tokens_per_item_default`."""
  n_tiles = 1
  if head_dim <= 128 and (tokens_per_item_default(group_size, rows_per_seq, 2)
                          > tokens_per_item_default(group_size, rows_per_seq)):
    n_tiles = 2
  return tokens_per_item_default(group_size, rows_per_seq, n_tiles), n_tiles


def default_tiles(head_dim: int) -> int:
  """m-tiles (16 keys) per warp step: 1 (16-key steps). Longer steps were
  no faster with 16-bit pages, and at head_dim >= 128 64-key steps spill
  two steps' K and V fragments (the one in flight and the one in use)
  (measured: docs/performance.md)."""
  del head_dim
  return 1


# ---------------------------------------------------------------- fragment ops

class _Ops:
  """The per-thread instructions the kernel is made of."""

  def __init__(self, dtype_name: str, load_hint: str = "",
               out_name: str | None = None):
    """`dtype_name`: the matmuls' inputs ("bf16" / "f16"); `out_name`: the
    output's (None: the same)."""
    self.load_hint = load_hint
    self.i32, self.i64, self.f32 = (_mlir.parse_type("i32"),
                                    _mlir.parse_type("i64"),
                                    _mlir.parse_type("f32"))
    self.pair = "bf16x2" if dtype_name == "bf16" else "f16x2"
    self.out_pair = ("bf16x2" if (out_name or dtype_name) == "bf16"
                     else "f16x2")
    self.mma_in = "bf16" if dtype_name == "bf16" else "f16"

  def ci(self, x):
    return _mlir.const(x, self.i32)

  def cf(self, x):
    return _mlir.const(float(x), self.f32)

  def wide(self, x):
    return arith.extui(self.i64, x)

  def load16(self, addr, pred, words: int = 4):
    """`words` (4 or 2) x i32 from global `addr` (aligned to their size)
    where `pred` (i1), else zeros."""
    i32 = self.i32
    outs = ", ".join(f"${i}" for i in range(words))
    zeros = "".join(f"mov.b32 ${i}, 0;\n" for i in range(words))
    return asm(
        f"{{\n.reg .pred p;\nsetp.ne.b32 p, ${words + 1}, 0;\n{zeros}"
        f"@p ld.global.nc{self.load_hint}.v{words}.u32 {{{outs}}}, "
        f"[${words}];\n}}",
        [addr, arith.extui(i32, pred)],
        ",".join(["=r"] * words + ["l", "r"]), [i32] * words,
        side_effects=True)

  def e4m3_f16(self, x):
    """One i32 of four e4m3 bytes -> two f16x2 words (bytes 0, 1 and 2,
    3; exact: every e4m3 value is an f16 one)."""
    return asm(
        "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\n"
        "cvt.rn.f16x2.e4m3x2 $0, lo;\ncvt.rn.f16x2.e4m3x2 $1, hi;\n}",
        [x], "=r,=r,r", [self.i32] * 2)

  def bf16_f16(self, x):
    """A bf16x2 word -> f16x2, each value clamped to +-65504 first (NaN
    stays NaN), as `_fp8.query_for_dots`."""
    m, n = _mlir.f32(F16_MAX), _mlir.f32(-F16_MAX)
    return asm(
        "{\n.reg .b32 lo, hi;\nshl.b32 lo, $1, 16;\n"
        "and.b32 hi, $1, 0xffff0000;\n"
        f"min.NaN.f32 lo, lo, {m};\nmax.NaN.f32 lo, lo, {n};\n"
        f"min.NaN.f32 hi, hi, {m};\nmax.NaN.f32 hi, hi, {n};\n"
        "cvt.rn.f16x2.f32 $0, hi, lo;\n}", [x], "=r,r", self.i32)

  def load_i32(self, addr):
    return asm("ld.global.nc.u32 $0, [$1];", [addr], "=r,l", self.i32,
               side_effects=True)

  def mma(self, a, b, acc):
    """acc (4 f32) += A (4 x i32 pairs) @ B (2 x i32 pairs), m16n8k16."""
    f32 = self.f32
    return asm(
        f"mma.sync.aligned.m16n8k16.row.col.f32.{self.mma_in}.{self.mma_in}"
        ".f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $11, $12, $13};",
        [*a, *b, *acc], "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [f32] * 4)

  def pack(self, lo, hi):
    """(lo, hi) f32 -> one i32 of two 16-bit values (lo in the low half)."""
    return asm(f"cvt.rn.{self.pair}.f32 $0, $1, $2;", [hi, lo], "=r,f,f",
               self.i32)

  def pack_out(self, lo, hi):
    """`pack` in the output's dtype."""
    return asm(f"cvt.rn.{self.out_pair}.f32 $0, $1, $2;", [hi, lo],
               "=r,f,f", self.i32)

  def movt(self, x):
    """8x8 16-bit transpose across the warp (`movmatrix`)."""
    return asm("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", [x],
               "=r,r", self.i32)

  def prmt(self, a, b, sel: int):
    return asm(f"prmt.b32 $0, $1, $2, {sel:#x};", [a, b], "=r,r,r",
               self.i32)

  def shfl_xor(self, x, mask: int):
    return asm(f"shfl.sync.bfly.b32 $0, $1, {mask}, 31, 0xffffffff;", [x],
               "=f,f", self.f32)

  def ex2(self, x):
    return asm("ex2.approx.ftz.f32 $0, $1;", [x], "=f,f", self.f32)

  def lg2(self, x):
    return asm("lg2.approx.ftz.f32 $0, $1;", [x], "=f,f", self.f32)

  def tanh(self, x):
    return asm("tanh.approx.f32 $0, $1;", [x], "=f,f", self.f32)

  def rcp(self, x):
    return asm("rcp.approx.ftz.f32 $0, $1;", [x], "=f,f", self.f32)

  def fmax(self, a, b):
    return arith.maximumf(a, b)

  def sel(self, pred, a, b):
    return arith.select(pred, a, b)

  def st_shared(self, addr, x):
    asm("st.shared.f32 [$0], $1;", [addr, x], "r,f")

  def ld_shared(self, addr):
    return asm("ld.shared.f32 $0, [$1];", [addr], "=f,r", self.f32,
               side_effects=True)

  def st_global_b32(self, addr, x):
    asm("st.global.b32 [$0], $1;", [addr, x], "l,r")

  def st_global_f32x2(self, addr, a, b):
    asm("st.global.v2.f32 [$0], {$1, $2};", [addr, a, b], "l,f,f")

  def st_global_f32(self, addr, a):
    asm("st.global.f32 [$0], $1;", [addr, a], "l,f")


# ---------------------------------------------------------------- the kernel

def _body(ctx, item_v, *refs, batch_size, num_kv_heads, group_size,
          head_dim, page_size, max_pages, k_splits, tiles, mode, has_sinks,
          sm_scale, window_left, logits_soft_cap, same_table, dtype_name,
          late_loads, load_hint, q_in_smem, fp8, num_tokens,
          rows_per_seq: int = 1, tokens_per_item: int = 1,
          n_tiles: int = 1, interleaved_kv: bool = False,
          head_scales: bool = False):
  """Per-thread body (inside `inline_mgpu`); see the module docstring.
  `refs`: kv_lens, [q_rows with `num_tokens`], q, k_pool, v_pool, k_table,
  v_table, [k_scale, v_scale with `fp8`: f32[1], or f32[num_kv_heads]
  with `head_scales`], [sinks], out, lse, smem; `mode`:
  "final" (the output) or "partial" (per-split partials). `num_tokens`
  (None: q has one row per sequence): q's rows, of which sequence b's
  query is `q_rows[b]` (none outside `[0, num_tokens)`); its pages are
  those of table row `b // rows_per_seq`. `tokens_per_item` (T, with
  `num_tokens`): a work item serves sequences `T b' .. T b' + T - 1`
  (token rows of one table row), MMA column `n` being token `n // G`'s
  head `n % G`; `batch_size` then counts items (`b'`). `n_tiles`: MMA
  n-tiles of 8 columns (1 or 2). `interleaved_kv` (with `same_table`): the
  table names page pairs, K's page `2 t` and V's `2 t + 1`."""
  del ctx
  refs = list(refs)
  kv_lens_ref = refs.pop(0)
  q_rows_ref = refs.pop(0) if num_tokens is not None else None
  (q_ref, k_pool_ref, v_pool_ref, k_table_ref, v_table_ref) = refs[:5]
  refs = refs[5:]
  k_scale_ref, v_scale_ref = (refs.pop(0), refs.pop(0)) if fp8 else (None,
                                                                     None)
  sinks_ref = refs.pop(0) if has_sinks else None
  o_ref, lse_ref, smem_ref = refs
  from jax.experimental.mosaic.gpu import utils  # noqa: PLC0415
  # FP8 pages: the matmuls run in f16 (e4m3 converts exactly; q is
  # rounded to f16), the output is stored in q's dtype.
  o = _Ops("f16" if fp8 else dtype_name, load_hint, out_name=dtype_name)
  i32 = o.i32
  o.true = _mlir.const(1, _mlir.parse_type("i1"))
  ci, cf, wide = o.ci, o.cf, o.wide
  ult, lt, ge = (arith.CmpIPredicate.ult, arith.CmpIPredicate.slt,
                 arith.CmpIPredicate.sge)
  D, P, G = head_dim, page_size, group_size
  num_qo_heads = G * num_kv_heads
  step_keys = KEYS * tiles
  E = 1 if fp8 else 2    # bytes per page element
  k_loads = D * E // 64  # 16-byte K loads per key (4 lanes share a row)
  # V: D * E / 8 bytes per key and lane (8 lanes share a row), in loads of
  # `v_bytes` (8 for FP8 at head_dim 64, else 16).
  v_bytes = min(16, D * E // 8)
  v_loads = D * E // 8 // v_bytes
  v_cols = v_bytes // E  # head columns per V load
  m_tiles = D // KEYS    # m-tiles of head_dim in O^T
  row_bytes = num_kv_heads * D * E
  # Pages a step touches: keys [s * step_keys, (s + 1) * step_keys).
  ids_per_step = max(1, step_keys // P)

  item = _mlir.scalar(item_v)
  tid = utils.thread_idx()
  warp = arith.divui(tid, ci(32))
  lane = arith.remui(tid, ci(32))
  r = arith.divui(lane, ci(4))   # mma groupID
  c = arith.remui(lane, ci(4))   # mma threadID_in_group
  kv_head = arith.remui(item, ci(num_kv_heads))
  rest = arith.divui(item, ci(num_kv_heads))
  b = arith.remui(rest, ci(batch_size))
  split = arith.divui(rest, ci(batch_size))

  gaddr = _mlir.element_address   # (ref, i64 element, its bytes)

  T = tokens_per_item
  NT = n_tiles
  cols_n = COLS * NT   # MMA columns
  zero = ci(0)

  def window_lo(kv):
    if window_left >= 0:
      return arith.maxsi(arith.subi(kv, ci(1 + window_left)), zero)
    return zero

  # The row of q (and of the final output) of sequence b's query. A CTA of
  # a sequence without a row does nothing more (its partials, if any, go
  # to no row): the rest of the body is one region, closed at its end.
  no_row_exit = contextlib.ExitStack()
  if T == 1:
    kv_len = o.load_i32(gaddr(kv_lens_ref, wide(b), 4))
    b_table = b if rows_per_seq == 1 else arith.divui(b, ci(rows_per_seq))
    tok = b
    if q_rows_ref is not None:
      tok = o.load_i32(gaddr(q_rows_ref, wide(b), 4))
      no_row_exit.enter_context(
          utils.when(arith.cmpi(ult, tok, ci(num_tokens))))
    lo = window_lo(kv_len)
  else:
    # T token rows: each its own key count (0 without a row), the item's
    # keys the union of theirs.
    b_table = arith.divui(b, ci(rows_per_seq // T))
    toks, kvs, oks = [], [], []
    for t in range(T):
      row = wide(arith.addi(arith.muli(b, ci(T)), ci(t)))
      toks.append(o.load_i32(gaddr(q_rows_ref, row, 4)))
      oks.append(arith.cmpi(ult, toks[-1], ci(num_tokens)))
      kvs.append(o.sel(oks[-1], o.load_i32(gaddr(kv_lens_ref, row, 4)),
                       zero))
    any_row, kv_len = oks[0], kvs[0]
    lo = o.sel(oks[0], window_lo(kvs[0]), ci(2 ** 31 - 1))
    for t in range(1, T):
      any_row = arith.ori(any_row, oks[t])
      kv_len = arith.maxsi(kv_len, kvs[t])
      lo = arith.minsi(lo, o.sel(oks[t], window_lo(kvs[t]),
                                 ci(2 ** 31 - 1)))
    no_row_exit.enter_context(utils.when(any_row))

    def of_token(n, vals):
      """`vals[n // G]` for a (traced) column n < T * G."""
      t_n = arith.divui(n, ci(G))
      out = vals[0]
      for t in range(1, T):
        out = o.sel(arith.cmpi(arith.CmpIPredicate.eq, t_n, ci(t)), vals[t],
                    out)
      return out
  first_step = arith.divsi(lo, ci(step_keys))
  end_step = arith.divsi(arith.addi(kv_len, ci(step_keys - 1)),
                         ci(step_keys))
  steps = arith.maxsi(arith.subi(end_step, first_step), zero)
  per_split = arith.divsi(arith.addi(steps, ci(k_splits - 1)), ci(k_splits))
  s0 = arith.addi(first_step, arith.muli(split, per_split))
  s1 = arith.minsi(arith.addi(s0, per_split), end_step)
  n = arith.maxsi(arith.subi(s1, s0), zero)
  # This warp's steps: s0 + warp + 4 j, j < n_w.
  n_w = arith.divsi(arith.addi(arith.subi(n, warp), ci(WARPS - 1)),
                    ci(WARPS))
  n_w = arith.maxsi(n_w, zero)
  first_page = arith.divsi(lo, ci(P))
  last_page = arith.maxsi(
      arith.subi(arith.divsi(arith.addi(kv_len, ci(P - 1)), ci(P)), ci(1)),
      zero)

  def step_of(j):
    return arith.addi(arith.addi(s0, warp), arith.muli(j, ci(WARPS)))

  # q^T fragments (B operand of QK^T): column n = r + 8 nt of n-tile nt,
  # the 16-byte chunks c, c + 4, ... of its row; zero columns past the
  # group (or the T tokens' heads).
  q_words = []   # [n-tile][word]
  for nt in range(NT):
    n_col = arith.addi(r, ci(8 * nt)) if nt else r
    if T == 1:
      g_ok = arith.cmpi(ult, n_col, ci(G))
      q_row = arith.addi(arith.muli(tok, ci(num_qo_heads)),
                         arith.addi(arith.muli(kv_head, ci(G)), n_col))
    else:
      # Column n: token n // G's head n % G (zero past T * G columns or for
      # a token without a row).
      g_ok = arith.andi(arith.cmpi(ult, n_col, ci(T * G)),
                        of_token(n_col, oks))
      q_row = arith.addi(arith.muli(of_token(n_col, toks), ci(num_qo_heads)),
                         arith.addi(arith.muli(kv_head, ci(G)),
                                    arith.remui(n_col, ci(G))))
    for x in range(k_loads):
      # The q columns of K chunk c + 4x: 8 (16-bit pages) or 16 (FP8).
      col = arith.muli(arith.addi(c, ci(4 * x)), ci(16 // E))
      for half in range(3 - E):
        elem = arith.addi(wide(arith.muli(q_row, ci(D))), wide(
            arith.addi(col, ci(8 * half)) if half else col))
        q_words += o.load16(gaddr(q_ref, elem, 2), g_ok)
  nq = len(q_words) // NT   # words per n-tile
  if fp8 and dtype_name == "bf16":
    q_words = [o.bf16_f16(wd) for wd in q_words]
  # Shared memory: [q words [word][lane] with `q_in_smem`], then the
  # merge's region (`saddr`).
  q_region = len(q_words) * 32 if q_in_smem else 0
  sbase = arith.addi(_mlir.address(smem_ref, 32), ci(4 * q_region))
  if q_in_smem:
    # Registers are short at head_dim 256: every warp reads its q
    # fragments from shared memory at each step instead (all warps hold
    # the same q; warp 0 writes them).
    qbase = _mlir.address(smem_ref, 32)
    with utils.when(arith.cmpi(arith.CmpIPredicate.eq, warp, zero)):
      for idx, wd in enumerate(q_words):
        asm("st.shared.b32 [$0], $1;", [arith.addi(
            qbase, arith.muli(arith.addi(ci(32 * idx), lane), ci(4))), wd],
            "r,r")
    asm("bar.sync 0;", [], "")

    def q_word(idx):
      return asm("ld.shared.b32 $0, [$1];", [arith.addi(
          qbase, arith.muli(arith.addi(ci(32 * idx), lane), ci(4)))],
                 "=r,r", i32)
    q_words = [functools.partial(q_word, idx)
               for idx in range(len(q_words))]
  else:
    q_words = [lambda wd=wd: wd for wd in q_words]

  def kw(words, i, h, nt=0):
    """The 16-bit pair `h` (0, 1) of q's (n-tile `nt`) or K's columns for
    m-tile `i` of QK^T (16 columns of the permuted head) among one key's `D
    / 8` pairs."""
    return words[nq * nt + 2 * i + h]

  def k_pairs(words, i):
    """K's two pairs of m-tile `i` from one key's loaded words."""
    if fp8:
      return o.e4m3_f16(words[i])
    return words[2 * i], words[2 * i + 1]

  def page_ids(s):
    """Page ids of step s (K's, V's): `ids_per_step` each, the page index
    clamped into the visible pages."""
    base = arith.divsi(arith.muli(s, ci(step_keys)), ci(P))
    out = []
    tables = (k_table_ref,) if same_table else (k_table_ref, v_table_ref)
    for table_ref in tables:
      ids = []
      for q_ in range(ids_per_step):
        idx = arith.maxsi(arith.minsi(arith.addi(base, ci(q_)), last_page),
                          first_page)
        elem = arith.addi(wide(arith.muli(b_table, ci(max_pages))),
                          wide(idx))
        ids.append(o.load_i32(gaddr(table_ref, elem, 4)))
      out.append(ids)
    if interleaved_kv:
      two = ci(2)
      return [[arith.muli(x, two) for x in out[0]],
              [arith.addi(arith.muli(x, two), ci(1)) for x in out[0]]]
    if same_table:
      out.append(out[0])
    return out

  def key_ok(key, step_ok):
    return arith.andi(step_ok, arith.andi(arith.cmpi(ge, key, lo),
                                          arith.cmpi(lt, key, kv_len)))

  def row_addr(pool_ref, page, key, chunk_bytes):
    """Address of `chunk_bytes` into the kv head's row of `key` in `page`."""
    row = arith.addi(arith.muli(page, ci(P)), arith.andi(key, ci(P - 1)))
    off = arith.addi(
        arith.muli(wide(row), _mlir.const(row_bytes, o.i64)),
        wide(arith.addi(arith.muli(kv_head, ci(D * E)), chunk_bytes)))
    return arith.addi(_mlir.address(pool_ref, 64), off)

  def slot_of(offset: int) -> int:
    """Which of a step's page ids holds key `offset` of the step."""
    return 0 if P >= step_keys else offset // P

  def load_keys(pool_ref, s, ids, step_ok, key_offs, key_lane, chunk_lane,
                chunk_stride, n_loads, chunk_size=16):
    """Words of step s: [tile][key key_lane() + off for off in key_offs] ->
    `n_loads` chunks `chunk_lane + chunk_stride * x` of `chunk_size` bytes
    (16 or 8) of its row, 4 bytes a word (zeros for a key outside the
    visible range or the warp's steps)."""
    out = []
    base = arith.muli(s, ci(step_keys))
    key_lane = key_lane()
    for t in range(tiles):
      per_key = []
      for off in key_offs:
        key = arith.addi(base, arith.addi(key_lane, ci(KEYS * t + off)))
        ok = key_ok(key, step_ok)
        page = ids[slot_of(KEYS * t + (8 if off >= 8 else 0))]
        words = []
        for x in range(n_loads):
          chunk = arith.muli(arith.addi(chunk_lane, ci(chunk_stride * x)),
                             ci(chunk_size))
          words += o.load16(row_addr(pool_ref, page, key, chunk), ok,
                            chunk_size // 4)
        per_key.append(words)
      out.append(per_key)
    return out

  def load_k(s, ids, step_ok):
    """K (A operand of S^T = K q^T): keys r, r + 8 of each tile, chunks c,
    c + 4, ..."""
    return load_keys(k_pool_ref, s, ids, step_ok, (0, 8), lambda: r, c, 4,
                     k_loads)

  def load_v(s, ids, step_ok):
    """V (A operand of O^T = V^T P^T): keys 2c, 2c + 1, 2c + 8, 2c + 9 of
    each tile, chunks r, r + 8, ..."""
    return load_keys(v_pool_ref, s, ids, step_ok, (0, 1, 8, 9),
                     lambda: arith.muli(c, ci(2)), r, 8, v_loads, v_bytes)

  neg_inf = cf(-math.inf)
  # S^T's columns of this thread: 8 nt + 2c + col, indexed k = 2 nt + col.
  cols = [arith.addi(arith.muli(c, ci(2)), ci(8 * (k // 2) + k % 2))
          for k in range(2 * NT)]
  if T > 1:
    # Each token's own keys.
    col_kv = [o.sel(arith.cmpi(ult, n, ci(T * G)), of_token(n, kvs), zero)
              for n in cols]
    col_lo = [window_lo(kv) for kv in col_kv]

    def col_key_ok(key, col):
      return arith.andi(arith.cmpi(ge, key, col_lo[col]),
                        arith.cmpi(lt, key, col_kv[col]))

  def scalar_f32(ref):
    """The CTA's scale: the tensor's, or its kv head's."""
    at = wide(kv_head) if head_scales else _mlir.const_i64(0)
    return arith.bitcast(o.f32, o.load_i32(gaddr(ref, at, 4)))

  # FP8 pages: K's scale joins the logits' scale, V's the output's. Both
  # are loaded here, before the key loop: a load in the merge would put its
  # latency on the kernel's tail.
  k_scale = scalar_f32(k_scale_ref) if fp8 else None
  v_scale = scalar_f32(v_scale_ref) if fp8 else None
  if logits_soft_cap is not None:
    cap_in = cf(sm_scale / logits_soft_cap)
    if fp8:
      cap_in = arith.mulf(cap_in, k_scale)
    cap_out = cf(logits_soft_cap * _LOG2E)
  else:
    scale = cf(sm_scale * _LOG2E)
    if fp8:
      scale = arith.mulf(scale, k_scale)

  def qk_softmax(s, kregs, m, l):
    """Logits of step s (base 2, masked) -> (P^T fragments [tile][n-tile],
    m, l, alpha per column k = 2 nt + col)."""
    base = arith.muli(s, ci(step_keys))
    logits = []   # [tile][n-tile][4]
    for t in range(tiles):
      accs = [[cf(0.0)] * 4 for _ in range(NT)]
      for i in range(D // 16):
        (a0, a2), (a1, a3) = (k_pairs(kregs[t][0], i),
                              k_pairs(kregs[t][1], i))
        a = [a0, a1, a2, a3]
        for nt in range(NT):
          bq = [kw(q_words, i, 0, nt)(), kw(q_words, i, 1, nt)()]
          accs[nt] = o.mma(a, bq, accs[nt])
      per_nt = []
      for nt in range(NT):
        vals = []
        for e in range(4):
          x = accs[nt][e]
          if logits_soft_cap is not None:
            x = arith.mulf(o.tanh(arith.mulf(x, cap_in)), cap_out)
          else:
            x = arith.mulf(x, scale)
          key = arith.addi(base, arith.addi(r, ci(KEYS * t + 8 * (e // 2))))
          x = o.sel(key_ok(key, o.true) if T == 1 else
                    col_key_ok(key, 2 * nt + e % 2), x, neg_inf)
          vals.append(x)
        per_nt.append(vals)
      logits.append(per_nt)
    m_new, alpha, m_use = [], [], []
    for k in range(2 * NT):
      nt, col = divmod(k, 2)
      mx = m[k]
      for t in range(tiles):
        mx = o.fmax(mx, o.fmax(logits[t][nt][col], logits[t][nt][col + 2]))
      for mask in (4, 8, 16):
        mx = o.fmax(mx, o.shfl_xor(mx, mask))
      # All keys masked so far: subtract 0, so exp2(-inf) = 0, never NaN.
      use = o.sel(arith.cmpf(arith.CmpFPredicate.OEQ, mx, neg_inf), cf(0.0),
                  mx)
      m_new.append(mx)
      m_use.append(use)
      alpha.append(o.ex2(arith.subf(m[k], use)))
    l_new = [arith.mulf(l[k], alpha[k]) for k in range(2 * NT)]
    p_frags = []
    for t in range(tiles):
      per_nt = []
      for nt in range(NT):
        p = [o.ex2(arith.subf(logits[t][nt][e], m_use[2 * nt + e % 2]))
             for e in range(4)]
        for col in range(2):
          l_new[2 * nt + col] = arith.addf(l_new[2 * nt + col],
                                           arith.addf(p[col], p[col + 2]))
        # S^T rows r (keys 0..7) and r + 8 (keys 8..15): two 8x8 blocks,
        # transposed into P^T's B fragments.
        per_nt.append([o.movt(o.pack(p[0], p[1])),
                       o.movt(o.pack(p[2], p[3]))])
      p_frags.append(per_nt)
    return p_frags, m_new, l_new, alpha

  def pv(acc, alpha, p_frags, vregs):
    """acc [m-tile][n-tile][4] scaled by alpha, plus this step's V^T P^T."""
    acc = [[[arith.mulf(a[e], alpha[2 * nt + e % 2]) for e in range(4)]
            for nt, a in enumerate(row)] for row in acc]
    for t in range(tiles):
      ka, ka1, kb, kb1 = vregs[t]
      for j in range(m_tiles):
        # Rows r / r + 8 of m-tile j: this lane's V columns 2j / 2j + 1
        # (`d_of`), for keys (2c, 2c + 1) and (2c + 8, 2c + 9).
        if fp8:
          # Bytes 2(j % 2), + 1 of word j // 2: the two keys' bytes
          # interleaved, then converted to the f16 pairs.
          idx, sel = j // 2, (0x5140, 0x7362)[j % 2]
          frag = [*o.e4m3_f16(o.prmt(ka[idx], ka1[idx], sel)),
                  *o.e4m3_f16(o.prmt(kb[idx], kb1[idx], sel))]
        else:
          frag = [o.prmt(ka[j], ka1[j], 0x5410),
                  o.prmt(ka[j], ka1[j], 0x7632),
                  o.prmt(kb[j], kb1[j], 0x5410),
                  o.prmt(kb[j], kb1[j], 0x7632)]
        for nt in range(NT):
          acc[j][nt] = o.mma(frag, p_frags[t][nt], acc[j][nt])
    return acc

  # The loop carries acc (m_tiles x n_tiles x 4), m and l (2 n_tiles each),
  # the next step's K and V words and the page ids of the step after it.
  j0 = zero
  ids0 = page_ids(step_of(j0))
  ok0 = arith.cmpi(lt, j0, n_w)
  k0 = load_k(step_of(j0), ids0[0], ok0)
  v0 = load_v(step_of(j0), ids0[1], ok0)
  ids1 = page_ids(step_of(ci(1)))
  init = dict(acc=[[[cf(0.0)] * 4 for _ in range(NT)]
                   for _ in range(m_tiles)],
              m=[neg_inf] * (2 * NT), l=[cf(0.0)] * (2 * NT), k=k0, v=v0,
              ids=ids1)

  @utils.fori(n_w, init)
  def loop(j, carry):
    s = step_of(j)
    nxt = arith.addi(j, ci(1))
    ok_next = arith.cmpi(lt, nxt, n_w)
    ids2 = page_ids(step_of(arith.addi(j, ci(2))))
    if not late_loads:
      k_next = load_k(step_of(nxt), carry["ids"][0], ok_next)
      v_next = load_v(step_of(nxt), carry["ids"][1], ok_next)
    p_frags, m, l, alpha = qk_softmax(s, carry["k"], carry["m"],
                                      carry["l"])
    if late_loads:
      k_next = load_k(step_of(nxt), carry["ids"][0], ok_next)
    acc = pv(carry["acc"], alpha, p_frags, carry["v"])
    if late_loads:
      v_next = load_v(step_of(nxt), carry["ids"][1], ok_next)
    return dict(acc=acc, m=m, l=l, k=k_next, v=v_next, ids=ids2)

  res = loop.results[0]
  acc, m, l = res["acc"], res["m"], res["l"]
  for k in range(2 * NT):
    for mask in (4, 8, 16):
      l[k] = arith.addf(l[k], o.shfl_xor(l[k], mask))

  # Merge the four warps' states through shared memory: acc as
  # [warp][reg][lane] (reg = 4 (NT j + nt) + e), then (m, l) as
  # [warp][2][columns].
  regs = 4 * m_tiles * NT
  ml0 = WARPS * regs * 32

  def saddr(idx):
    return arith.addi(sbase, arith.muli(idx, ci(4)))

  for j in range(m_tiles):
    for nt in range(NT):
      for e in range(4):
        idx = arith.addi(arith.muli(arith.addi(
            arith.muli(warp, ci(regs)), ci(4 * (NT * j + nt) + e)), ci(32)),
                         lane)
        o.st_shared(saddr(idx), acc[j][nt][e])
  with utils.when(arith.cmpi(ult, lane, ci(4))):
    for which, vals in ((0, m), (1, l)):
      for k in range(2 * NT):
        idx = arith.addi(
            ci(ml0), arith.addi(arith.muli(arith.addi(
                arith.muli(warp, ci(2)), ci(which)), ci(cols_n)), cols[k]))
        o.st_shared(saddr(idx), vals[k])
  # After the lane-divergent stores: not the aligned `bar.sync`.
  _mlir.cta_barrier()

  def ml(w, which, k):
    idx = ci(ml0 + (w * 2 + which) * cols_n)
    return o.ld_shared(saddr(arith.addi(idx, cols[k])))

  # Per column (g = 8 nt + 2c + col, index k = 2 nt + col): the merged max,
  # weights, 1 / sum and LSE; with sinks (final output only) the sink joins
  # the sum, not the LSE.
  g = cols
  if T == 1:
    g_in = [arith.cmpi(ult, x, ci(G)) for x in g]
    head_of = [arith.minui(x, ci(G - 1)) for x in g]
    qo_row = [arith.addi(arith.muli(tok, ci(num_qo_heads)),
                         arith.addi(arith.muli(kv_head, ci(G)), x))
              for x in g]
  else:
    # Column n: token n // G's head n % G, written where that token has a
    # row.
    g_in = [arith.andi(arith.cmpi(ult, x, ci(T * G)), of_token(x, oks))
            for x in g]
    head_of = [arith.remui(x, ci(G)) for x in g]
    qo_row = [arith.addi(arith.muli(of_token(x, toks), ci(num_qo_heads)),
                         arith.addi(arith.muli(kv_head, ci(G)), h))
              for x, h in zip(g, head_of)]

  def sink2(k):
    """Column k's sink in base-2 logits (-inf past the group)."""
    head = arith.addi(arith.muli(kv_head, ci(G)), head_of[k])
    x = o.load_i32(gaddr(sinks_ref, wide(head), 4))
    x = arith.bitcast(o.f32, x)
    return o.sel(g_in[k], arith.mulf(x, cf(_LOG2E)), neg_inf)

  final = mode == "final"
  weights, inv, lse = [], [], []
  for k in range(2 * NT):
    ms = [ml(w, 0, k) for w in range(WARPS)]
    ls = [ml(w, 1, k) for w in range(WARPS)]
    mx = ms[0]
    for x in ms[1:]:
      mx = o.fmax(mx, x)
    use = o.sel(arith.cmpf(arith.CmpFPredicate.OEQ, mx, neg_inf), cf(0.0),
                mx)
    wts = [o.ex2(arith.subf(x, use)) for x in ms]
    tot = cf(0.0)
    for wt, x in zip(wts, ls):
      tot = arith.addf(tot, arith.mulf(wt, x))
    pos = arith.cmpf(arith.CmpFPredicate.OGT, tot, cf(0.0))
    safe = o.sel(pos, tot, cf(1.0))
    den = tot
    if final and has_sinks:
      den = arith.addf(tot, o.ex2(arith.subf(sink2(k), use)))
    den_pos = arith.cmpf(arith.CmpFPredicate.OGT, den, cf(0.0))
    weights.append(wts)
    inv.append(o.sel(den_pos, o.rcp(o.sel(den_pos, den, cf(1.0))), cf(0.0)))
    if fp8:
      inv[-1] = arith.mulf(inv[-1], v_scale)
    lse.append(o.sel(pos, arith.mulf(arith.addf(use, o.lg2(safe)),
                                     cf(_LN2)), neg_inf))

  # Warp w merges and stores the head_dim m-tiles j = w, w + 4, ...: the
  # output rows, or this split's partial rows.
  part = arith.addi(arith.muli(arith.addi(
      arith.muli(b, ci(num_kv_heads)), kv_head), ci(k_splits)), split)
  part_row = [arith.addi(arith.muli(part, ci(cols_n)), x) for x in g]
  out_row = qo_row if final else part_row

  def d_of(j):
    """First of the two head_dim columns of m-tile j this thread holds:
    its V column 2j, in load x (chunk r + 8x) of `v_cols` columns."""
    x, within = divmod(2 * j, v_cols)
    return arith.addi(arith.muli(arith.addi(r, ci(8 * x)), ci(v_cols)),
                      ci(within))

  def store_out(row, j, k, lo_v, hi_v):
    """Columns (d, d + 1) of m-tile j of row `row` (column k): of the
    output (dtype, rows of the group only), or of the partials (f32)."""
    elem = arith.addi(wide(arith.muli(row, ci(D))), wide(d_of(j)))
    if final:
      with utils.when(g_in[k]):
        o.st_global_b32(gaddr(o_ref, elem, 2), o.pack_out(lo_v, hi_v))
    else:
      o.st_global_f32x2(gaddr(o_ref, elem, 4), lo_v, hi_v)

  def warps_tiles(fn):
    for w in range(WARPS):
      with utils.when(arith.cmpi(arith.CmpIPredicate.eq, warp, ci(w))):
        for j in range(w, m_tiles, WARPS):
          fn(j)

  def merge_tile(j):
    for nt in range(NT):
      vals = []
      for e in range(4):
        k = 2 * nt + e % 2
        tot = cf(0.0)
        for w2 in range(WARPS):
          idx = ci(((w2 * regs) + 4 * (NT * j + nt) + e) * 32)
          y = o.ld_shared(saddr(arith.addi(idx, lane)))
          tot = arith.addf(tot, arith.mulf(weights[k][w2], y))
        vals.append(arith.mulf(tot, inv[k]))
      for col in range(2):
        # Columns d, d + 1.
        k = 2 * nt + col
        store_out(out_row[k], j, k, vals[col], vals[col + 2])

  warps_tiles(merge_tile)
  lane0 = arith.andi(arith.cmpi(arith.CmpIPredicate.eq, warp, zero),
                     arith.cmpi(ult, lane, ci(4)))
  with utils.when(lane0):
    for k in range(2 * NT):
      ok = g_in[k] if final else o.true
      with utils.when(ok):
        o.st_global_f32(gaddr(lse_ref, wide(out_row[k]), 4), lse[k])
  no_row_exit.close()


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "window_left", "logits_soft_cap", "k_splits",
                     "tiles", "final", "late_loads", "load_hint",
                     "q_in_smem", "tokens_per_item", "n_tiles",
                     "interleaved_kv"))
def paged_decode_mma(
    q: jax.Array,         # [batch_size, num_qo_heads, head_dim]
    k_pool: jax.Array,    # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool: jax.Array,    # [num_pages', page_size, num_kv_heads, head_dim]
    k_table: jax.Array,   # i32[batch_size, max_pages]
    v_table: jax.Array,   # i32[batch_size, max_pages]
    kv_lens: jax.Array,   # i32[batch_size]
    sinks: jax.Array | None = None,  # f32[num_qo_heads]
    *,
    sm_scale: float,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    k_scale: jax.Array | float | None = None,  # f32[] | f32[Hkv]: FP8
    v_scale: jax.Array | float | None = None,  # f32[] | f32[Hkv]: FP8
    k_splits: int = 1,
    tiles: int | None = None,
    final: bool = True,
    late_loads: bool | None = None,
    load_hint: str = "",
    q_in_smem: bool | None = None,
    q_rows: jax.Array | None = None,  # i32[batch_size]
    into: tuple[jax.Array, jax.Array] | None = None,
    tokens_per_item: int | None = None,
    n_tiles: int | None = None,
    interleaved_kv: bool = False,
):
  """One Mosaic-GPU launch of split-K paged decode on `mma.sync` (see the
  module docstring).

  Semantics are `reference.paged_decode_reference` (vLLM / FlashInfer
  paged decode; sinks as gpt-oss's, in the denominator only): query `b`
  sits at position `kv_lens[b] - 1` and sees keys `j` with `max(0,
  kv_lens[b] - 1 - window_left) <= j < kv_lens[b]`.

  Args:
    q: `[batch_size, num_qo_heads, head_dim]`, bf16 or f16, head_dim 64, 128
      or 256, `num_qo_heads = group_size * num_kv_heads`, group_size 1..8.
    k_pool, v_pool: `[num_pages, page_size, num_kv_heads, head_dim]`, dtype
      of `q`, or float8_e4m3fn with `k_scale` / `v_scale` (compute
      capability >= 8.9); may be one array; page_size a power of two in
      [8, 128].
    k_table, v_table: `i32[batch_size, max_pages]` (may be one array); only
      entries of visible pages are read.
    kv_lens: `i32[batch_size]`, tokens including the current one.
    sinks: optional `f32[num_qo_heads]` logits (natural-log units) joining
      the softmax denominator only (not the LSE); only with `final`.
    sm_scale, window_left, logits_soft_cap: static, as `paged_decode`.
    k_scale, v_scale: traced f32 scales of FP8 pages, as `paged_decode`:
      a stored value `x` of kv head `h` means `x * scale[h]`, each one
      scalar (per tensor) or `f32[num_kv_heads]` (per KV head; a scalar
      beside a per-head one is broadcast). The matmuls then run in f16 (q
      clamped to +-65504 and rounded to f16, as `_fp8.query_for_dots`).
    k_splits: static, splits of each sequence's visible steps (one CTA
      each).
    tiles: static, 16-key m-tiles per warp step (1, 2 or 4); None =
      `default_tiles(head_dim)`.
    final: static; return the output (True, needs `k_splits == 1`) or
      per-split partials for the caller's combine (False).
    late_loads: static; issue the next step's K loads after this step's
      QK^T and its V loads after PV (fewer live registers) instead of both
      before the matmuls; None = at head_dim 256 only.
    load_hint: static; cache qualifiers of the K / V loads after
      `ld.global.nc` (PTX), one of `LOAD_HINTS`.
    q_in_smem: static; read q's fragments from shared memory at each step
      instead of holding them in registers; None = at head_dim 256 only.
    q_rows: optional `i32[batch_size]`: q is then `[num_tokens,
      num_qo_heads, head_dim]` (the token rows of a prefill call) and
      sequence b's query is row `q_rows[b]`; a row outside `[0,
      num_tokens)` means no query (as `kv_lens[b] == 0`, and with `final`
      nothing is written). The decode rows of a mixed prefill call are
      read in place, with no gather (`paged_decode.paged_decode_rows`).
      The tables may then have `batch_size / R` rows (R an integer):
      sequence b reads the pages of table row `b // R` (R token rows of
      one sequence, each with its own `kv_lens[b]`).
    into: with `q_rows` and `final` (and only then): `(out [num_tokens,
      num_qo_heads, head_dim] q.dtype, lse f32[num_tokens, num_qo_heads])`,
      whose rows `q_rows[b]` the kernel overwrites in place (aliased
      `jax.Ref`s; the other rows are kept).
    tokens_per_item: static, with `q_rows`: T token rows of one table row
      per CTA, side by side in the MMA's columns (column n: row `T b' + n
      // group_size`, head `n % group_size`), so their pages are read once;
      `T * group_size <= 8 * n_tiles`, T dividing R. None = `row_packing`;
      1 without `q_rows`.
    n_tiles: static, MMA n-tiles of 8 query columns per CTA (1 or 2); None
      = `row_packing` with `q_rows`, else 1.
    interleaved_kv: static; `k_table` names page pairs of `k_pool`: K
      block `i` is `k_pool[2 t]`, V block `i` `k_pool[2 t + 1]` for `t =
      k_table[b, i]` (FlashInfer's `[num_pages, 2, ...]` cache reshaped to
      `[2 num_pages, ...]`); `v_pool` and `v_table` are not read (pass
      `k_pool` and `k_table`).

  Returns:
    With `final`: `(out [batch_size, num_qo_heads, head_dim] q.dtype, lse
    f32[batch_size, num_qo_heads])` (natural log; an empty sequence gives
    zeros and -inf); with `into`, `into` with rows `q_rows[b]` replaced.
    Otherwise per-split partials `(o f32[batch_size / T, num_kv_heads,
    k_splits, 8 n_tiles, head_dim], lse f32[batch_size / T, num_kv_heads,
    k_splits, 8 n_tiles])`, normalised per split, rows `0..T * group_size
    - 1` meaningful (row n: sequence `T b' + n // group_size`, head `n %
    group_size`; empty splits: `o = 0`, `lse = -inf`).

  Raises:
    ValueError: a case `supports` rejects, `k_splits < 1`, `tiles` not in
      (1, 2, 4), `final=True` with `k_splits > 1`, sinks with `final=False`
      or of another shape, an unknown `load_hint`, FP8 pages without both
      scales (or scales with 16-bit pages), a scale of neither one nor
      `num_kv_heads` values, `q_rows` not of `(batch_size,)` or tables
      whose rows do not divide it (or, without `q_rows`, tables of other
      than `batch_size` rows), or `into` without
      `q_rows` and `final` (or of shapes or dtypes other than q's rows),
      `tokens_per_item` other than 1 without `q_rows`, or not dividing R,
      or over `8 * n_tiles / group_size`; `n_tiles` not 1 or 2.
  """
  plgpu = _compat.mosaic_gpu()
  num_tokens = None
  if q_rows is not None:
    num_tokens = q.shape[0]
    if q_rows.shape != kv_lens.shape:
      raise ValueError(f"Invalid q_rows shape: expected {kv_lens.shape} (one "
                       f"per sequence), got {q_rows.shape}")
  if (into is not None) != (q_rows is not None and final):
    raise ValueError(
        f"Invalid into: expected (out, lse) exactly with q_rows and "
        f"final=True, got into={'set' if into is not None else 'None'}, "
        f"q_rows={'set' if q_rows is not None else 'None'}, final={final}")
  if into is not None:
    want = ((q.shape, q.dtype), (q.shape[:2], jnp.dtype(jnp.float32)))
    got = tuple((x.shape, x.dtype) for x in into)
    if got != want:
      raise ValueError(f"Invalid into: expected (shape, dtype) {want}, got "
                       f"{got}")
  batch_size = kv_lens.shape[0]
  table_rows = k_table.shape[0]
  if v_table.shape != k_table.shape or not (
      table_rows == batch_size or q_rows is not None and table_rows and
      batch_size % table_rows == 0):
    raise ValueError(
        f"Invalid k_table / v_table shapes: expected equal ones with "
        f"{batch_size} rows{' (or a divisor)' if q_rows is not None else ''}"
        f", got {k_table.shape} / {v_table.shape}")
  _, num_qo_heads, head_dim = q.shape
  _, page_size, num_kv_heads, _ = k_pool.shape
  group_size = num_qo_heads // num_kv_heads
  if group_size * num_kv_heads != num_qo_heads:
    raise ValueError(f"Invalid num_qo_heads: expected a multiple of "
                     f"num_kv_heads={num_kv_heads}, got {num_qo_heads}")
  why = supports(dtype=q.dtype, kv_dtype=k_pool.dtype, head_dim=head_dim,
                 page_size=page_size, group_size=group_size)
  if why is None and v_pool.dtype != k_pool.dtype:
    why = f"v_pool of {v_pool.dtype} next to k_pool of {k_pool.dtype}"
  if why is not None:
    raise ValueError(f"Invalid case for the mma.sync decode kernel: {why}")
  fp8 = jnp.dtype(k_pool.dtype) == jnp.dtype(FP8)
  if fp8 != (k_scale is not None) or fp8 != (v_scale is not None):
    raise ValueError(
        f"Invalid k_scale / v_scale: expected both with FP8 pages and neither "
        f"with {jnp.dtype(q.dtype).name} pages, got pages of "
        f"{jnp.dtype(k_pool.dtype).name}, k_scale "
        f"{'set' if k_scale is not None else 'None'}, v_scale "
        f"{'set' if v_scale is not None else 'None'}")
  head_scales = _fp8.is_per_head(k_scale, v_scale, num_kv_heads)
  if k_splits < 1:
    raise ValueError(f"Invalid k_splits: expected >= 1, got {k_splits}")
  if tiles is None:
    tiles = default_tiles(head_dim)
  if tiles not in (1, 2, 4):
    raise ValueError(f"Invalid tiles: expected 1, 2 or 4, got {tiles}")
  if not final and sinks is not None:
    raise ValueError("Invalid sinks with final=False: expected None (the "
                     "caller's combine adds them)")
  if sinks is not None and sinks.shape != (num_qo_heads,):
    raise ValueError(f"Invalid sinks shape: expected ({num_qo_heads},), got "
                     f"{sinks.shape}")
  if final and k_splits != 1:
    raise ValueError(f"Invalid final=True: expected k_splits == 1, got "
                     f"{k_splits}")
  mode = "final" if final else "partial"
  rows_per_seq = batch_size // table_rows if table_rows else 1
  packing = (row_packing(group_size, rows_per_seq, head_dim)
             if q_rows is not None else (1, 1))
  if n_tiles is None:
    n_tiles = packing[1] if tokens_per_item is None else (
        1 if tokens_per_item * group_size <= COLS else 2)
  if tokens_per_item is None:
    tokens_per_item = (tokens_per_item_default(group_size, rows_per_seq,
                                               n_tiles)
                       if q_rows is not None else 1)
  T, NT = tokens_per_item, n_tiles
  if NT not in (1, 2):
    raise ValueError(f"Invalid n_tiles: expected 1 or 2, got {NT}")
  if T != 1 and (q_rows is None or rows_per_seq % T or
                 T * group_size > COLS * NT or T < 1):
    raise ValueError(
        f"Invalid tokens_per_item: expected 1, or with q_rows a divisor of "
        f"the {rows_per_seq} rows per table row with tokens_per_item * "
        f"group_size <= {COLS * NT} (group_size {group_size}, n_tiles {NT}),"
        f" got {T}{'' if q_rows is not None else ' without q_rows'}")
  # Registers: two n-tiles at head_dim 128 hold as many accumulators as
  # one at 256, so they take its loads' order and q in shared memory.
  heavy = head_dim > 128 or NT == 2 and head_dim == 128
  if late_loads is None:
    late_loads = heavy
  if q_in_smem is None:
    q_in_smem = heavy
  if load_hint not in LOAD_HINTS:
    raise ValueError(f"Invalid load_hint: expected one of {LOAD_HINTS}, got "
                     f"{load_hint!r}")
  if interleaved_kv:
    v_pool, v_table = k_pool, k_table
  same_table = k_table is v_table
  max_pages = k_table.shape[1]
  dtype = q.dtype
  has_sinks = sinks is not None
  body = functools.partial(
      _body, batch_size=batch_size // T, num_kv_heads=num_kv_heads,
      group_size=group_size, head_dim=head_dim, page_size=page_size,
      max_pages=max_pages, k_splits=k_splits, tiles=tiles, mode=mode,
      has_sinks=has_sinks, sm_scale=float(sm_scale),
      window_left=int(window_left), logits_soft_cap=logits_soft_cap,
      same_table=same_table,
      dtype_name="bf16" if jnp.dtype(dtype) == jnp.bfloat16 else "f16",
      late_loads=late_loads, load_hint=load_hint, q_in_smem=q_in_smem,
      fp8=fp8, num_tokens=num_tokens, rows_per_seq=rows_per_seq,
      tokens_per_item=T, n_tiles=NT, interleaved_kv=interleaved_kv,
      head_scales=head_scales)
  tables = [k_table.astype(jnp.int32)]
  tables.append(tables[0] if same_table else v_table.astype(jnp.int32))
  inputs = [kv_lens.astype(jnp.int32)]
  if q_rows is not None:
    inputs.append(q_rows.astype(jnp.int32))
  inputs += [q, k_pool, v_pool, *tables]
  if fp8:
    # Two inputs (free reshapes), not one stacked pair (one more small XLA
    # kernel per call): f32[1] each, or f32[num_kv_heads] each with
    # per-head scales (a scalar beside them broadcast).
    shape = (num_kv_heads,) if head_scales else (1,)
    inputs += [jnp.broadcast_to(jnp.asarray(x, jnp.float32).reshape(-1),
                                shape) for x in (k_scale, v_scale)]
  if has_sinks:
    inputs.append(sinks.astype(jnp.float32))
  refs = []
  if into is not None:
    # Written in place: Pallas aliases a `jax.Ref` argument in and out of
    # the kernel.
    refs = [jax.new_ref(x) for x in into]
    out_type = []
  elif final:
    out_type = [
        jax.ShapeDtypeStruct((batch_size, num_qo_heads, head_dim), dtype),
        jax.ShapeDtypeStruct((batch_size, num_qo_heads), jnp.float32)]
  else:
    out_type = [
        jax.ShapeDtypeStruct((batch_size // T, num_kv_heads, k_splits,
                              COLS * NT, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch_size // T, num_kv_heads, k_splits,
                              COLS * NT), jnp.float32)]
  splat = plgpu.Layout.WG_SPLAT(shape=())
  n_refs = len(inputs) + len(refs) + len(out_type) + 1
  # The inputs are read only; the in-place Refs, outputs and scratch written.
  inline = plgpu.inline_mgpu(
      arg_types=(splat,) + (_compat.ref_type(write=False),) * len(inputs)
      + (plgpu.RefType(),) * (n_refs - len(inputs)))(body)
  # Per warp: acc [regs][lane]; then (m, l) [warp][2][8].
  smem_words = (WARPS * (head_dim // 4) * 32 + WARPS * 2 * COLS) * NT
  if q_in_smem:
    smem_words += head_dim // 8 * 32 * NT   # q's words [word][lane]

  def kernel(*refs):
    pl.run_scoped(lambda smem: inline(lax.axis_index("items"), *refs, smem),
                  plgpu.SMEM((smem_words,), jnp.float32))

  res = pl.kernel(
      kernel,
      out_type=out_type,
      mesh=plgpu.Mesh(grid=(batch_size // T * num_kv_heads * k_splits,),
                      grid_names=("items",)),
      compiler_params=plgpu.CompilerParams(),
      name=(f"paged_decode_mma_t{tiles}_{mode}{'_fp8' if fp8 else ''}"
            f"{'_rows' if q_rows is not None else ''}"
            f"{f'_x{T}' if T > 1 else ''}{f'_n{NT}' if NT > 1 else ''}"
            f"{'_il' if interleaved_kv else ''}"),
  )(*inputs, *refs)
  if refs:
    return tuple(x[...] for x in refs)
  return res
