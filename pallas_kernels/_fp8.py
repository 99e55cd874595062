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
"""

from __future__ import annotations

import jax.numpy as jnp

F16_MAX = 65504.0
# Where an FP8 tile is converted to the dot dtype: "loaded" (in the layout it
# was loaded in, behind a select) or "operand" (Triton's choice: after the
# dot-operand layout change).
CONVERT_MODES = ("loaded", "operand")


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


def convert(x, dtype, rows_ok, mode: str):
  """An FP8 tile `x [rows, cols]` as `dtype`.

  With `mode == "loaded"`, the converted rows are selected by `rows_ok
  bool[rows]` (rows that are False become 0: callers pass the load's mask,
  whose masked rows loaded as 0 already), which keeps the conversion in the
  loaded layout (see the module docstring).
  """
  y = x.astype(dtype)
  if mode == "operand":
    return y
  keep = jnp.broadcast_to(rows_ok.reshape(-1, 1), y.shape)
  return jnp.where(keep, y, jnp.zeros_like(y))
