"""FP8 (e4m3) K/V tiles in the attention kernels: dot dtype and placement.

* Dot dtype: the dots run in f16 (f32 for an f32 query). Every e4m3 value
  is exact in f16, so a pair converts in one `cvt.rn.f16x2.e4m3x2`
  (compute capability >= 8.9) and no f16 -> bf16 step follows; q is
  clamped to f16's range and rounded to f16 once (finer than bf16: 11 bits
  of mantissa against 8), and the probabilities (in [0, 1]) keep more bits
  than in bf16 (`dot_dtype`, `query_for_dots`).
* Where V converts (the Triton decode kernel, `paged_decode.TritonConfig.
  fp8_convert`). V is the B operand of `P @ V`, contracted over tokens, its
  strided dimension. Left to itself, Triton keeps an FP8 tile in shared
  memory and converts it after reading it in the dot-operand layout: one
  byte per shared-memory load and a conversion per value. Two placements
  avoid that:
  - `"loaded"` (`convert_loaded`): V converted in the layout it was loaded
    in (16 contiguous bytes per thread), behind a select on the token mask
    so that Triton cannot move the conversion after the layout change. It
    then stores f16 to shared memory and reads it back with transposed
    `ldmatrix`, as for bf16 pages. Used on GPUs without the e4m3 pair
    conversion and in interpret mode.
  - `"pairs"` (`pair_view`, `split_pairs`): the pools are viewed as 16-bit
    words of two adjacent columns (a bitcast) and each tile is split in
    registers into its even and odd columns (a byte permute and one
    `cvt.rn.f16x2.e4m3x2` per two words). The logits sum two half-width
    dots (q's even columns against K's even ones, odd against odd) and V's
    halves feed two accumulators, whose columns interleave only when the
    output is stored. Triton then sees 16-bit tiles: it reads them from
    shared memory with `ldmatrix` (transposed for V) in the layout of f16
    operands, as for bf16 pages, and the 8-bit operand layout with its
    register moves is gone; nothing is joined back inside the loop. The
    decode default on GPUs with the e4m3 pair conversion (measured:
    docs/performance.md). The Triton prefill kernel (many query rows,
    compute-bound) keeps Triton's placement: column pairs lost there.
* Head_dim 64: two kv heads packed per program read as one 128-wide head
  (`paged_decode.TritonConfig.pack_heads`), so a row is 128 bytes.
* Prefill with many query rows per sequence dequantizes the named pages
  before the launch instead (`dequantize_pages`,
  `paged_prefill.Config.fp8_pages`): a fixed cost per key, where in-kernel
  conversion costs per query tile. Per-KV-head scales always take that
  path in prefill (the prefill kernels read one scale per tensor).
* Scales: one per tensor (`f32[]`), or one per KV head (`f32[num_kv_heads]`,
  `is_per_head`). The Triton decode kernel reads one per kv head it serves;
  the Mosaic-GPU kernels read one per tensor.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

F16_MAX = 65504.0
# How the Triton decode kernel's FP8 tiles convert to the dot dtype (module
# docstring): "loaded" (V in the layout it was loaded in, behind a select) or
# "pairs" (tiles read as 16-bit words of two adjacent columns, split into
# even and odd columns: `pair_view`, `split_pairs`).
CONVERT_MODES = ("loaded", "pairs")


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


def convert_loaded(x, dtype, rows_ok):
  """An FP8 tile `x [rows, cols]` as `dtype`, rows where `rows_ok
  bool[rows]` is False set to 0 (callers pass the load's mask, whose masked
  rows loaded as 0 already): the select keeps the conversion in the loaded
  layout (`"loaded"`, see the module docstring)."""
  y = x.astype(dtype)
  keep = jnp.broadcast_to(rows_ok.reshape(-1, 1), y.shape)
  return jnp.where(keep, y, jnp.zeros_like(y))


def is_per_head(k_scale, v_scale, num_kv_heads: int) -> bool:
  """Whether either scale is one per KV head (`f32[num_kv_heads]`); None,
  scalars and 1-element arrays are per tensor. Static: reads shapes only.

  Raises:
    ValueError: a scale neither of one value nor of shape `(num_kv_heads,)`.
  """
  for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
    if x is not None and jnp.size(x) != 1 and (
        jnp.shape(x) != (num_kv_heads,)):
      raise ValueError(
          f"Invalid shape of {name}: expected () (one scale per tensor) or "
          f"({num_kv_heads},) (one per KV head), got {jnp.shape(x)}")
  return any(x is not None and jnp.size(x) > 1 for x in (k_scale, v_scale))


def dequantize_pages(pool, table, scale, dtype):
  """The pages a table names, dequantized into a compact pool of their own.

  Args:
    pool: `float8_e4m3fn[num_pages, page_size, num_kv_heads, head_dim]`.
    table: `i32[batch_size, max_pages]` page ids into `pool`. Entries
      outside `[0, num_pages)` (e.g. -1 past a sequence's pages) are clipped
      into range: their copies land in compact pages the kernels never read,
      as they never read those entries.
    scale: f32 scalar, or `f32[num_kv_heads]` (one per KV head, broadcast
      over `[..., num_kv_heads, head_dim]`); may be traced: a stored value
      `x` of head `h` means `x * scale[h]`.
    dtype: the pool's new dtype (the query's: bf16, f16 or f32).

  Returns:
    `(pages [batch_size * max_pages, page_size, num_kv_heads, head_dim]
    dtype, table i32[batch_size, max_pages])` with `pages[table[b, i]] ==
    pool[table_in[b, i]] * scale` (per head) rounded once to `dtype` (e4m3
    is exact in bf16 and f16: the product's rounding is the only one). One
    fused XLA gather: it reads the named pages' FP8 bytes once and writes
    them in `dtype` (1 + 2 bytes per value for bf16), which a compute-bound
    prefill then reads as 16-bit pages (`paged_prefill.Config.fp8_pages`).
  """
  ids = jnp.clip(table, 0, pool.shape[0] - 1).reshape(-1)
  scale = jnp.asarray(scale, jnp.float32)
  if scale.ndim:  # [num_kv_heads] (or [1]) -> [num_kv_heads, 1]
    scale = scale.reshape(-1, 1)
  pages = (pool[ids].astype(jnp.float32) * scale).astype(dtype)
  new_table = jnp.arange(ids.shape[0], dtype=jnp.int32).reshape(table.shape)
  return pages, new_table
