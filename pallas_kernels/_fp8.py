"""FP8 (e4m3) K/V tiles in the attention kernels: dot dtype and placement.

Measured on an H100 (2026-11-25, `bench/fp8_decode_diag.py`, Nsight Compute
on the Llama-3-8B decode shape B=64 S=4096 page 16):

* Left to itself, Triton keeps an FP8 tile in shared memory and converts it
  after reading it in the dot-operand layout. For V, the B operand of `P @ V`
  contracted over tokens (its strided dimension), that read is one byte per
  `LDS.U8`, and each value then takes an `F2FP` (e4m3x2 -> f16x2) and an
  `F2F` (f16 -> bf16): 168 registers, 2.1x the instructions of the bf16
  kernel, 1.7 TB/s of FP8 bytes against 3.0 TB/s for bf16 pages.
* Converting V in the layout it was loaded in (16 contiguous bytes per
  thread), behind a select on the token mask so that Triton cannot move the
  conversion after the layout change, stores f16 to shared memory and reads
  it back with transposed `ldmatrix`, as for bf16 pages.
* f16 dots: e4m3 values are exact in f16, so the conversion is one `F2FP`
  per pair and no `F2F`; q is rounded to f16 (finer than bf16: 11 bits of
  mantissa against 8) after clamping to f16's range, and the probabilities
  (in [0, 1]) keep more bits than in bf16.
Together: FP8-page decode time 0.59-0.67x of bf16 pages on the Llama-3-8B
shapes, against 0.68-0.90x before.

* Inline PTX (`"asm"`): both tiles convert through
  `elementwise_inline_asm`, four values per instance (`cvt.rn.f16x2.e4m3x2`
  on each 16-bit half of the register; sm_89+), with no select (meant to
  keep V's conversion in its loaded layout; Triton places it after the
  layout change all the same, see below). With 64-key steps on 2
  warps it was the default at head_dim 128 until `"pairs"`: decode kernel
  time 0.56-0.60x
  of bf16 pages on the four Llama-3-8B shapes against 0.60-0.66x with
  `"loaded"` and its own best tiling (H100, 2026-11-25,
  `bench/fp8_decode_diag.py --sweep asm`). At head_dim 64 it ties
  `"loaded"` (0.73x, Llama-3.2-1B heads) or loses (0.66 against 0.64x,
  SmolLM2 heads), and on 4 warps with 64-key steps it loses at head_dim
  128 too (0.80x), so the default keeps `"loaded"` there.
* What the inline-PTX default executes (H200, Nsight Compute SASS counts,
  B=64 S=4096 p16, 2026-11-26): 1,276 instructions per warp per 64-key
  step. Triton places V's conversion after the layout change: V's 128
  bytes per thread come from shared memory one `LDS.U8` at a time (10% of
  the instructions) and are packed by `PRMT`s (8%) for the PTX; `IMAD.MOV`s
  assembling q's MMA fragments are another 14%. `"mul"` (V converted by
  Triton in its loaded layout and multiplied by the 0 / 1 row mask: packed
  `HMUL2`s, where `"loaded"`'s select unpacks and repacks every f16 pair)
  reads V in 16-byte words and runs 11% fewer instructions, but takes 192
  registers against 168 and is no faster at head_dim 128 (`fp8_decode_diag
  --sweep grid`); at head_dim 64 without packing (SmolLM2's odd kv heads)
  it beats `"loaded"` by 4-13% (the default there until `"pairs"`).
  The `IMAD.MOV`s come from Triton laying both dots' operands out for 8-bit
  values (4 per thread along K) because the K and V tiles were loaded as
  bytes. Two probe builds (H200, 2026-11-26, five decode specs) removed
  them: the PTX lowered as impure (Triton's slice stops there) ran 25%
  fewer instructions on 124 registers, V staged as f16 for `ldmatrix`, but
  was 31-57% slower, its loads no longer software-pipelined; and tiles
  loaded as 16-bit e4m3 pairs, converted into even and odd columns and
  joined back, were 25-34% slower (the join costs a `PRMT` per value and V
  is still read from shared memory one pair at a time).
* Column pairs (`"pairs"`, the decode default on GPUs with the e4m3
  conversion, 2026-11-26): the pools are viewed as 16-bit words of two
  adjacent columns (`pair_view`, a bitcast) and each tile is split in
  registers into its even and odd columns (`split_pairs`: a byte permute
  and one `cvt.rn.f16x2.e4m3x2` per two words). The logits sum two
  half-width dots (q's even columns against K's even ones, odd against
  odd) and V's halves feed two accumulators, whose columns interleave only
  when the output is stored. Triton then sees 16-bit tiles: it reads them
  from shared memory with `ldmatrix` (transposed for V) in the layout of
  f16 operands, as for bf16 pages, and the 8-bit operand layout with its
  register moves is gone. Decode kernel time 0.53-0.58x of bf16 pages on
  the four Llama-3-8B shapes on an H200 and 0.55-0.57x on an H100,
  against 0.62-0.74x / 0.55-0.59x for the inline-PTX rule
  (`paged_decode.Config.default_for` has the figures). Unlike the
  even / odd probe above, nothing is joined back inside the loop. The
  Triton prefill kernel (many query rows, compute-bound) loses with it:
  1.02-1.27x the time of its byte tiles on Llama-3-8B, SmolLM2 and Gemma 3
  heads, whole prompts and 128-token chunks over 4,096 keys (H200, a
  scratch build, 2026-11-26), so prefill keeps Triton's placement.
* Head_dim 64: two kv heads packed per program read as one 128-wide head
  (`paged_decode.Config.pack_heads`), 0.54-0.55x of bf16 pages on
  Llama-3.2-1B heads on an H200 (`paged_decode.Config.default_for`).
* Prefill with many query rows per sequence dequantizes the named pages
  before the launch instead (`dequantize_pages`,
  `paged_prefill.Config.fp8_pages`): a fixed cost per key, where in-kernel
  conversion costs per query tile.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

F16_MAX = 65504.0
# Where and how FP8 tiles convert to the dot dtype: "loaded" (V in the layout
# it was loaded in, behind a select), "operand" (Triton's choice: after the
# dot-operand layout change), "asm" (K and V in their loaded layout, by
# inline PTX; a GPU of compute capability >= 8.9), "mul" (as "loaded", with
# V's rows multiplied by their 0 / 1 mask instead of selected) or "pairs"
# (tiles read as 16-bit words of two adjacent columns, split into even and
# odd columns: `pair_view`, `split_pairs`).
CONVERT_MODES = ("loaded", "operand", "asm", "mul", "pairs")

# e4m3x4 (one 32-bit register) -> f16x4 (two): one `cvt.rn.f16x2.e4m3x2`
# per pair, on the register's 16-bit halves (sm_89+).
_E4M3X4_TO_F16X4 = """{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}"""


# e4m3 pairs (the even or odd bytes of two 16-bit words in one register) ->
# f16x2: a byte permute, then one `cvt.rn.f16x2.e4m3x2` (sm_89+).
_PAIRS_TO_F16X2 = """{
.reg .b32 t;
.reg .b16 lo, hi;
prmt.b32 t, $1, 0, %s;
mov.b32 {lo, hi}, t;
cvt.rn.f16x2.e4m3x2 $0, lo;
}"""


def pair_view(pool):
  """An FP8 pool `[..., head_dim]` as `uint16[..., head_dim // 2]`: word `i`
  holds columns `2i` (low byte) and `2i + 1` (high byte). A bitcast, no
  copy."""
  *lead, head_dim = pool.shape
  return lax.bitcast_convert_type(
      lax.bitcast_convert_type(pool, jnp.uint8).reshape(
          *lead, head_dim // 2, 2), jnp.uint16)


def split_pairs(words, dtype, interpret: bool):
  """`uint16[rows, cols]` words of `pair_view` -> `(even, odd)`, each
  `[rows, cols]` in `dtype`: the e4m3 values of columns `2i` and `2i + 1`.

  On a GPU with an f16 dot dtype, each is inline PTX on the words in the
  layout they were loaded in: a byte permute and one e4m3x2 -> f16x2
  conversion per two words. Both keep 16-bit tiles, so Triton reads them
  from shared memory with `ldmatrix` in the MMA operand layout (transposed
  for V), as it does bf16 pages, not byte by byte."""
  if interpret or jnp.dtype(dtype) != jnp.float16:
    def half(shift):
      b = ((words >> shift) & 0xFF).astype(jnp.uint8)
      return lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(dtype)
    return half(0), half(8)
  from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415
  out = jax.ShapeDtypeStruct(words.shape, jnp.float16)
  return tuple(
      pltriton.elementwise_inline_asm(
          _PAIRS_TO_F16X2 % sel, args=[words], constraints="=r,r", pack=2,
          result_shape_dtypes=[out])[0]
      for sel in ("0x0020", "0x0031"))


def dot_dtype(q_dtype):
  """The dtype FP8 tiles convert to for the dots with a `q_dtype` query:
  f16 for 16-bit queries, f32 for f32."""
  return jnp.float32 if jnp.dtype(q_dtype) == jnp.float32 else jnp.float16


def query_for_dots(q):
  """`q` in `dot_dtype(q.dtype)`: a 16-bit query clamped to +-65504 first
  (a larger bf16 value would become inf in f16)."""
  dtype = dot_dtype(q.dtype)
  if q.dtype == dtype or dtype == jnp.float32:
    return q.astype(dtype)
  return jnp.clip(q.astype(jnp.float32), -F16_MAX, F16_MAX).astype(dtype)


def convert_asm(x, dtype, interpret: bool):
  """An FP8 tile `x` as `dtype` through inline PTX where the dot dtype is
  f16 on a GPU (Pallas-Triton lowering only: `astype` in interpret mode and
  for an f32 dot, the same values)."""
  if interpret or jnp.dtype(dtype) != jnp.float16:
    return x.astype(dtype)
  from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415
  bits = lax.bitcast_convert_type(x, jnp.uint8)
  [y] = pltriton.elementwise_inline_asm(
      _E4M3X4_TO_F16X4, args=[bits], constraints="=r,=r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float16)])
  return y


def convert(x, dtype, rows_ok, mode: str, interpret: bool = False):
  """An FP8 tile `x [rows, cols]` as `dtype`.

  With `mode == "loaded"`, the converted rows are selected by `rows_ok
  bool[rows]` (rows that are False become 0: callers pass the load's mask,
  whose masked rows loaded as 0 already), which keeps the conversion in the
  loaded layout (see the module docstring). `mode == "asm"`:
  `convert_asm`.
  """
  if mode == "asm":
    return convert_asm(x, dtype, interpret)
  y = x.astype(dtype)
  if mode == "operand":
    return y
  if mode == "mul":
    return y * rows_ok.astype(y.dtype).reshape(-1, 1)
  keep = jnp.broadcast_to(rows_ok.reshape(-1, 1), y.shape)
  return jnp.where(keep, y, jnp.zeros_like(y))


def dequantize_pages(pool, table, scale, dtype):
  """The pages a table names, dequantized into a compact pool of their own.

  Args:
    pool: `float8_e4m3fn[num_pages, page_size, num_kv_heads, head_dim]`.
    table: `i32[batch_size, max_pages]` page ids into `pool`. Entries
      outside `[0, num_pages)` (e.g. -1 past a sequence's pages) are clipped
      into range: their copies land in compact pages the kernels never read,
      as they never read those entries.
    scale: f32 scalar (may be traced): a stored value `x` means `x * scale`.
    dtype: the pool's new dtype (the query's: bf16, f16 or f32).

  Returns:
    `(pages [batch_size * max_pages, page_size, num_kv_heads, head_dim]
    dtype, table i32[batch_size, max_pages])` with `pages[table[b, i]] ==
    pool[table_in[b, i]] * scale` rounded once to `dtype` (e4m3 is exact in
    bf16 and f16: the product's rounding is the only one). One fused XLA
    gather: it reads the named pages' FP8 bytes once and writes them in
    `dtype` (1 + 2 bytes per value for bf16), which a compute-bound prefill
    then reads as 16-bit pages (`paged_prefill.Config.fp8_pages`).
  """
  ids = jnp.clip(table, 0, pool.shape[0] - 1).reshape(-1)
  scale = jnp.asarray(scale, jnp.float32)
  pages = (pool[ids].astype(jnp.float32) * scale).astype(dtype)
  new_table = jnp.arange(ids.shape[0], dtype=jnp.int32).reshape(table.shape)
  return pages, new_table
