"""Paged prefill attention: ragged new tokens over a paged KV cache.

This module holds the Pallas-Triton kernel and the `paged_prefill` wrapper
that runs a step: the plan, the main launch (this kernel with a
`TritonConfig`, the Mosaic-GPU kernel of `paged_prefill_mgpu` with a
`MosaicConfig`; `dispatch.prefill` chooses), the short launch and the
decode rows. The Triton kernel:

Algorithm: FlashAttention-2 forward (Dao 2023, arXiv:2307.08691, Algorithm 1
and Section 3.1: online softmax, un-normalised accumulator rescaled once at the
end, causal tiles skipped and masks applied only where a tile crosses the
diagonal) with FlashInfer's paged, ragged addressing:

* A query tile is `block_q` consecutive new tokens of ONE sequence times the
  GQA group of one kv head, packed densely into the M dimension of the dot
  (row `r` is token `r // group_size`, head `r % group_size`; `M =
  next_pow2(block_q * group_size)`, `tile_rows`). So a KV tile loaded once
  serves the whole group, a decode row (q_len 1) still fills `group_size`
  rows of the MMA, and a group that is not a power of two wastes at most
  `group_size - 1` rows of a tile (42 tokens of group 3 in 128 rows).
* The grid is static, `(num_kv_heads, plan.max_tiles(...))`, at most
  `num_tokens // block_q + batch_size + 1` tiles (no dynamic grid on
  Pallas-Triton); the tile -> (sequence, first token) map
  is the plan (`pallas_kernels.plan`, FlashInfer's plan/run split), computed
  once per step from `q_indptr` / `kv_lens`, heaviest tiles first. Padding
  tokens past `q_indptr[-1]` are a pseudo-sequence with no keys, so their rows
  are written as zeros; unused tiles do nothing.
* Sequences with `q_len <= short_block_q` (multi-token decode) run in a
  second launch with `short_block_q`-token tiles that updates the first
  launch's outputs in place (`input_output_aliases`), so a short sequence
  costs its tokens x `group_size` MMA rows, not a main tile's
  `tile_rows(block_q, group_size)`. Sequences of one token (decode rows of
  a mixed batch), or of up to `decode_rows_per_seq` (the unpacked
  Mosaic-GPU defaults: no short launch), go to the split-K decode kernel
  instead, one decode query per token, several of a sequence's per CTA
  (`paged_decode.paged_decode_rows`).
* Each program walks KV tiles of `block_k` tokens from the first block any of
  its rows can see (window) to the last (causality, `kv_len`). With
  `block_k <= page_size` a tile lies in one page: one scalar table read and
  strided loads `pool[page, rows, kv_head, :]`; otherwise the tile's
  `block_k // page_size` page ids are read as scalars and spread to its keys
  with a select chain, and K/V rows are loaded by index (a per-key vector
  load of the table holds more registers per thread through the softmax
  and spills). The walk is `fori_loop`s over masked edge tiles (window start; only with a
  window), unmasked interior tiles, and masked edge tiles (diagonal /
  `kv_len`). Edge loads are masked to the tile's visible key range, so a
  table entry outside it (maybe -1) and a stale row past `kv_len` (maybe NaN)
  are never read.
* Softmax runs in base 2. Without a soft cap the scale is folded into the
  exponent (FlashAttention-3): the row max is taken on the raw logits and
  each logit costs one FMA + one `ex2.approx.ftz` (inline PTX; see
  `PrefillConfig.fast_exp2`). The optional soft cap is applied to the
  natural-scale logits first; sinks join the denominator at the end only; `lse` is
  returned in natural log.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pkvattn.pallas_kernels import _compat
from pkvattn.pallas_kernels import _fp8
from pkvattn.pallas_kernels import _mlir
from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import paged_prefill_mgpu
from pkvattn.pallas_kernels import plan as plan_lib
from pkvattn.pallas_kernels import plan_mgpu
from pkvattn.pallas_kernels._compat import pl
from pkvattn.pallas_kernels._compat import pltriton as plgpu

# Finite, not -inf: a row whose keys in a tile are all masked would otherwise
# compute exp2(-inf - (-inf)) = NaN in the running max / rescale.
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# `dequantize_pays`: FP8 pages are dequantized before the launch from this
# many query rows (tokens x group) per sequence, twice as many with a sliding
# window (measured: docs/performance.md).
DEQUANTIZE_MIN_ROWS = 512
FP8_PAGES = ("auto", "kernel", "dequantize")
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def tile_rows(block_q: int, group_size: int) -> int:
  """Rows (M of the dots) of a Triton query tile: `block_q` tokens times the
  group, rounded up to a power of two."""
  return pl.next_power_of_2(block_q * group_size)


def _exp2(x, fast: bool):
  """2**x (f32); `fast`: one `ex2.approx.ftz.f32` (results < 2**-126 -> 0)."""
  if not fast:
    return jnp.exp2(x)
  [y] = plgpu.elementwise_inline_asm(
      "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return y


def _exp2_fma(x, scale: float, shift, fast: bool):
  """2**(x * scale + shift) (f32), `scale` static: one FMA + one `ex2`."""
  if not fast:
    return jnp.exp2(x * scale + shift)
  [y] = plgpu.elementwise_inline_asm(
      "{ .reg .f32 t; fma.rn.ftz.f32 t, $1, " + _mlir.f32(scale)
      + ", $2; ex2.approx.ftz.f32 $0, t; }",
      args=[x, shift], constraints="=f,f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return y


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
  """What both backends' configs share: the step's plan, the Pallas-Triton
  launches beside the main one (short tiles) and the split-K decode rows,
  and how FP8 pages are read. Use `TritonConfig` or `MosaicConfig`; their
  class attribute `backend` names the kernel of the main launch.

  Attributes:
    block_q: new tokens per main-launch query tile (the plan's `block_q`).
    block_k: keys per KV tile (a power of two).
    num_stages: pipeline stages of the main launch.
    longest_first: plan order of the query tiles (see `plan.plan_prefill`).
    short_block_q: > 0 runs sequences with q_len <= short_block_q (decode
      rows of a mixed batch, multi-token decode) in a second, Pallas-Triton
      launch with tiles of `short_block_q` tokens (`tile_rows(short_block_q,
      group_size) >= 16` rows) instead of `block_q`, so a short sequence
      does not pay for a main tile's rows; 0 = no short launch.
    short_block_k, short_num_warps, short_num_stages: the short launch's
      keys per KV tile (a power of two >= 16) and Triton launch parameters.
      It runs the kv heads of one tile side by side (decode rows of a mixed
      batch read their pages together; measured: docs/performance.md).
    single_loop: the Pallas-Triton launches walk keys in one loop that
      masks every tile (as JAX's `mha`) instead of masked edge loops around
      an unmasked interior loop.
    fast_exp2: on the GPU, the Pallas-Triton launches' softmax
      exponentials are one `fma.rn.ftz` + `ex2.approx.ftz` each (inline
      PTX, as FlashAttention-3) instead of libdevice's `exp2f`, whose
      denormal handling costs a compare and two multiplies per logit and
      serialises the softmax. Ignored in interpret mode.
    split_decode_rows: sequences with q_len <= decode_rows_per_seq (the
      decode rows of a mixed batch) run through the split-K decode kernel
      (`paged_decode.paged_decode_rows`) instead of a tile: a memory-bound
      row streams its KV across several programs at the decode kernel's
      bandwidth, where a tile walks it in one.
    decode_rows_per_seq: with `split_decode_rows`, the longest sequences
      (new tokens) the decode kernel runs, one decode query per token with
      its own key count (the tokens' causal order); 1 = decode rows only.
      Above 1, a decode CTA serves several of a sequence's token rows in
      its MMA columns and reads the pages once for them
      (`paged_decode_mma.row_packing`).
    fp8_pages: FP8 pages only: "kernel" reads them in the kernels (tiles
      converted to f16 there, scales folded into the logits and the
      output; per-KV-head scales only where `reads_head_scales`);
      "dequantize" first gathers the pages the tables name into a compact
      pool in q's dtype, scaled per tensor or per KV head
      (`_fp8.dequantize_pages`, one fused XLA gather), and runs the 16-bit
      kernels on it; "auto" dequantizes where `dequantize_pays`, and with
      per-KV-head scales where the kernels read one scale per tensor (the
      rule `dispatch.prefill` applies).
  """
  backend: ClassVar[str]
  block_q: int = 16
  block_k: int = 64
  num_stages: int = 2
  longest_first: bool = True
  short_block_q: int = 0
  short_block_k: int = 128
  short_num_warps: int = 8
  short_num_stages: int = 2
  single_loop: bool = False
  fast_exp2: bool = True
  split_decode_rows: bool = True
  decode_rows_per_seq: int = 1
  fp8_pages: str = "auto"

  def __post_init__(self):
    if type(self) is PrefillConfig:
      raise TypeError("PrefillConfig is abstract: use TritonConfig or "
                      "MosaicConfig")
    if self.fp8_pages not in FP8_PAGES:
      raise ValueError(f"Invalid fp8_pages: expected one of {FP8_PAGES}, "
                       f"got {self.fp8_pages!r}")
    if self.block_q < 1:
      raise ValueError(f"Invalid block_q: expected >= 1, got {self.block_q}")
    if self.block_k < 1 or self.block_k & (self.block_k - 1):
      raise ValueError(f"Invalid block_k: expected a power of two, got "
                       f"{self.block_k}")
    if self.short_block_q < 0:
      raise ValueError(f"Invalid short_block_q: expected >= 0, got "
                       f"{self.short_block_q}")
    if self.short_block_q and (self.short_block_k < 16 or
                               self.short_block_k & (self.short_block_k - 1)):
      raise ValueError(
          f"Invalid short_block_k: expected a power of two >= 16, got "
          f"{self.short_block_k}")
    if self.decode_rows_per_seq < 1:
      raise ValueError(f"Invalid decode_rows_per_seq: expected >= 1, got "
                       f"{self.decode_rows_per_seq}")

  def dequantizes_fp8(self, *, num_tokens: int, batch_size: int,
                      group_size: int, head_scales: bool = False,
                      window_left: int = -1) -> bool:
    """Whether a call on FP8 pages runs on dequantized pages (`fp8_pages`;
    "auto": with per-KV-head scales, `head_scales`, the kernels do not
    read (`reads_head_scales`), or where `dequantize_pays`)."""
    if self.fp8_pages != "auto":
      return self.fp8_pages == "dequantize"
    return head_scales and not self.reads_head_scales or dequantize_pays(
        num_tokens=num_tokens, batch_size=batch_size, group_size=group_size,
        window_left=window_left)

  @property
  def plan_align(self) -> int:
    """`plan.plan_prefill(align=...)`: where tiles may start (1: at any
    token)."""
    return 1

  @property
  def reads_head_scales(self) -> bool:
    """Whether every launch of the call reads per-KV-head FP8 scales in its
    kernel: the Mosaic-GPU kernel and the decode kernels do, the
    Pallas-Triton tiles (a `TritonConfig`'s main launch, any short
    launch) read one scale per tensor."""
    return self.backend == "mosaic" and self.short_block_q == 0

  @property
  def tile_min_tokens(self) -> int:
    """New tokens a sequence needs for main tiles in this config's plans
    (`plan.tile_min_tokens`; `plan.max_tiles`'s `min_tokens`)."""
    return plan_lib.tile_min_tokens(self.short_block_q,
                                    self.split_decode_rows,
                                    self.decode_rows_per_seq)

  def _plan_kwargs(self, num_tokens: int, causal: bool,
                   window_left: int) -> dict:
    return dict(num_tokens=num_tokens, block_q=self.block_q, causal=causal,
                window_left=window_left, longest_first=self.longest_first,
                short_block_q=self.short_block_q, align=self.plan_align,
                split_decode_rows=self.split_decode_rows,
                decode_rows_per_seq=self.decode_rows_per_seq)

  def plan(self, q_indptr, kv_lens, *, num_tokens: int, causal: bool,
           window_left: int) -> plan_lib.PrefillPlan:
    """This config's tile schedule for one step (`plan.plan_prefill`)."""
    return plan_lib.plan_prefill(
        q_indptr, kv_lens, **self._plan_kwargs(num_tokens, causal,
                                               window_left))

  def validate(self, group_size: int) -> None:
    """Checks what depends on the group size (the fields alone are checked
    on construction).

    Raises:
      NotImplementedError: a short tile of fewer than 16 rows.
    """
    short = self.short_block_q
    if short and tile_rows(short, group_size) < 16:
      raise NotImplementedError(
          f"Invalid short_block_q={short}: expected tile_rows(short_block_q, "
          f"group_size={group_size}) >= 16, got "
          f"{tile_rows(short, group_size)}")


@dataclasses.dataclass(frozen=True)
class TritonConfig(PrefillConfig):
  """The Pallas-Triton kernel of this module in the main launch.

  Attributes (beside `PrefillConfig`'s):
    block_q: new tokens per query tile; `tile_rows(block_q, group_size)` =
      `next_pow2(block_q * group_size)` rows (>= 16) go into the M
      dimension of the dots (any `block_q` >= 1; the defaults fill them:
      `rows // group_size` tokens).
    block_k: keys per KV tile (power of two, >= 16); need not align to
      pages.
    num_warps, num_stages: Triton launch parameters.
    heads_outer: launch order of the main launch. True: the tile index
      varies fastest, so the programs running together share one kv head's
      K/V in L2. False: the kv heads of one tile run side by side and read
      the rows of a page (all heads interleaved, NHD) together.
  """
  backend: ClassVar[str] = "triton"
  num_warps: int = 4
  heads_outer: bool = True

  def validate(self, group_size: int) -> None:
    """`PrefillConfig.validate`, plus the dots' 16-row minimum.

    Raises:
      NotImplementedError: tiles Triton cannot run (dot operands < 16).
    """
    super().validate(group_size)
    rows = tile_rows(self.block_q, group_size)
    if rows < 16 or self.block_k < 16:
      raise NotImplementedError(
          f"Triton dots need >= 16 rows per operand: tile_rows(block_q, "
          f"group_size) = {rows}, block_k = {self.block_k}")


@dataclasses.dataclass(frozen=True)
class MosaicConfig(PrefillConfig):
  """The Mosaic-GPU kernel (`paged_prefill_mgpu`: TMA, warp-specialised
  wgmma, Hopper only) in the main launch.

  Its tiles are `block_q` tokens: `tile_q(n, group_size)` for `n`
  consumer warpgroups of 64 rows (`paged_prefill_mgpu.tile_q`), so
  `block_q` names the consumer count. `block_k` keys per step (64 or 128),
  `num_stages` shared-memory stages of the K/V ring. The short launch,
  where a config has one (`short_block_q`), is Pallas-Triton.

  Attributes (beside `PrefillConfig`'s):
    schedule: the consumers' schedule (`paged_prefill_mgpu`): "pingpong"
      (two consumers in lock step) or "ring" (a token passed around the
      consumers; required with three).
    pack_gqa: pack the GQA group into the tile rows
      (`paged_prefill_mgpu(pack_gqa=True)`): a consumer's 64 rows are
      `64 // group_size` tokens of every head of the group, so `block_q`
      is `tile_q(n, group_size)` (42 tokens at group 3 with two consumers)
      and tiles start at any token (`plan_align` 1).
    persistent: one CTA per SM, each taking every num_sms-th (head, tile)
      item with its K/V ring running on across items
      (`paged_prefill_mgpu(persistent=True)`).
    plan_kernel: on a Hopper GPU, `plan` builds the step's schedule in one
      Mosaic-GPU launch (`plan_mgpu`, up to its `MAX_ROWS` tiles) instead
      of the several small XLA kernels of `plan.plan_prefill` (the same
      plan).
  """
  backend: ClassVar[str] = "mosaic"
  block_q: int = paged_prefill_mgpu.TILE_Q
  block_k: int = 128
  schedule: str = "pingpong"
  pack_gqa: bool = False
  persistent: bool = False
  plan_kernel: bool = True

  def __post_init__(self):
    super().__post_init__()
    if self.schedule not in paged_prefill_mgpu.SCHEDULES:
      raise ValueError(f"Invalid schedule: expected one of "
                       f"{paged_prefill_mgpu.SCHEDULES}, got "
                       f"{self.schedule!r}")

  @property
  def plan_align(self) -> int:
    """`plan.plan_prefill(align=...)`: TMA query loads need 8-row origins,
    packed tiles none (`paged_prefill_mgpu.plan_align`)."""
    return paged_prefill_mgpu.plan_align(self.pack_gqa)

  def tile_q(self, num_consumers: int, group_size: int) -> int:
    """Tokens per tile with `num_consumers` consumers under this config's
    packing (`paged_prefill_mgpu.tile_q`)."""
    return paged_prefill_mgpu.tile_q(
        num_consumers, group_size if self.pack_gqa else 1)

  def num_consumers(self, group_size: int) -> int:
    """Consumer warpgroups that `block_q` gives (`tile_q`).

    Raises:
      ValueError: a `block_q` no consumer count gives.
    """
    tiles = {self.tile_q(n, group_size): n
             for n in paged_prefill_mgpu.CONSUMERS}
    if self.block_q not in tiles:
      raise ValueError(f"Invalid block_q for the mosaic backend: expected "
                       f"one of {sorted(tiles)}, got {self.block_q}")
    return tiles[self.block_q]

  def plan(self, q_indptr, kv_lens, *, num_tokens: int, causal: bool,
           window_left: int) -> plan_lib.PrefillPlan:
    """This config's tile schedule for one step: one Mosaic-GPU launch
    (`plan_mgpu`) with `plan_kernel` on a Hopper GPU
    (`dispatch.current_gpu`) where it serves, else the jnp ops of
    `plan.plan_prefill` (the same plan)."""
    kw = self._plan_kwargs(num_tokens, causal, window_left)
    if self.plan_kernel and dispatch.current_gpu().is_hopper and (
        plan_mgpu.supports(num_tokens=num_tokens, batch_size=kv_lens.shape[0],
                           block_q=self.block_q, align=self.plan_align,
                           min_tokens=self.tile_min_tokens) is None):
      return plan_mgpu.plan_prefill_mgpu(q_indptr, kv_lens, **kw)
    return plan_lib.plan_prefill(q_indptr, kv_lens, **kw)

  def validate(self, group_size: int) -> None:
    """`PrefillConfig.validate`, plus the tile's consumers and packing.

    Raises:
      ValueError: `pack_gqa` with a group outside 1..64, a `block_q` no
        consumer count gives, three consumers without the ring schedule.
    """
    super().validate(group_size)
    if self.pack_gqa and not 1 <= group_size <= paged_prefill_mgpu.BLOCK_Q:
      raise ValueError(f"Invalid group_size for pack_gqa: expected "
                       f"1..{paged_prefill_mgpu.BLOCK_Q}, got {group_size}")
    if self.num_consumers(group_size) != 2 and self.schedule != "ring":
      raise ValueError(
          f"Invalid schedule: expected 'ring' with block_q="
          f"{self.tile_q(3, group_size)} (three consumers), got "
          f"{self.schedule!r}")


def dequantize_pays(*, num_tokens: int, batch_size: int, group_size: int,
                    window_left: int = -1) -> bool:
  """Whether a call on FP8 pages runs faster on pages dequantized first
  (`PrefillConfig.fp8_pages`): when its query rows (`num_tokens *
  group_size`) reach `DEQUANTIZE_MIN_ROWS` per sequence of the batch, twice
  that with a sliding window (`window_left >= 0`).

  Prefill is compute-bound: converting tiles in the kernel costs every
  query tile that reads a key (the Mosaic-GPU kernel's producer warpgroup
  converts each tile its CTA reads, one query head's rows a CTA), while the
  gather costs a fixed amount per key the table names, which enough query
  rows per sequence repay. With a window the kernel reads only the window's
  keys but the gather still takes every page the table names (measured:
  docs/performance.md).
  """
  rows = DEQUANTIZE_MIN_ROWS * (2 if window_left >= 0 else 1)
  return num_tokens * group_size >= rows * max(batch_size, 1)


def _paged_prefill_kernel(
    tiles_ref,     # i32[num_tiles, NUM_FIELDS]
    q_ref,         # [num_tokens, num_qo_heads, head_dim]
    k_pool_ref,    # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool_ref,    # [num_pages, page_size, num_kv_heads, head_dim]
    k_table_ref,   # i32[batch_size, max_pages]
    v_table_ref,   # i32[batch_size, max_pages]
    *rest,         # [sinks_ref f32[num_qo_heads]], [scales_ref f32[2]],
                   # o_ref, lse_ref
    block_q: int,
    block_k: int,
    group_size: int,
    causal: bool,
    sm_scale: float,
    window_left: int,
    logits_soft_cap: float | None,
    has_sinks: bool,
    single_loop: bool,
    heads_outer: bool,
    fast_exp2: bool,
    has_scales: bool = False,
):
  rest = list(rest)
  sinks_ref = rest.pop(0) if has_sinks else None
  # FP8 pages: (k_scale, v_scale); tiles and q are converted to f16 (f32 for
  # an f32 q; `_fp8`), K's scale multiplies the raw logits and V's the
  # output (exact).
  scales_ref = rest.pop(0) if has_scales else None
  o_ref, lse_ref = rest
  page_size = k_pool_ref.shape[1]
  head_dim = q_ref.shape[2]
  rows = tile_rows(block_q, group_size)

  if heads_outer:
    tile, kv_head = pl.program_id(0), pl.program_id(1)
  else:
    kv_head, tile = pl.program_id(0), pl.program_id(1)
  seq = tiles_ref[tile, plan_lib.SEQ]
  q_start = tiles_ref[tile, plan_lib.Q_START]
  q_end = tiles_ref[tile, plan_lib.Q_END]
  kv_len = tiles_ref[tile, plan_lib.KV_LEN]
  pos_offset = tiles_ref[tile, plan_lib.POS_OFFSET]

  # Row r of the tile is token q_start + r // group_size, head g = r %
  # group_size: the group's heads packed densely, so group 3 wastes 2 of 128
  # rows (42 tokens a tile) where padding each token to 4 rows wasted 32.
  r = jnp.arange(rows, dtype=jnp.int32)
  token = q_start + r // group_size
  g = r % group_size
  row_ok = (token < q_end) & (r < block_q * group_size)
  # Masked rows point one past the end: never touched on the GPU, and dropped
  # (not written back) by interpret mode's scatter, where an in-bounds
  # duplicate of a valid row could overwrite it with the stale value.
  token = jnp.where(row_ok, token, q_ref.shape[0])
  head = kv_head * group_size + g
  # Every index is an int array (no slices): one addressing form that both the
  # Triton lowering and interpret mode accept for masked gathers.
  d = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
  q = plgpu.load(q_ref.at[token[:, None], head[:, None], d],
                 mask=row_ok[:, None], other=0.0)
  q_pos = token + pos_offset  # [rows]; rows past q_end are never stored
  if has_scales:
    q = _fp8.query_for_dots(q)
  # f32 dots in full f32 (Triton's IEEE input precision), as the decode
  # kernel's: the default would round both operands to TF32 on the GPU
  # (about 1e-3 off the float64 oracle at head_dim 64; interpret mode is
  # exact either way).
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

  # Key ranges in tokens: [kv_lo, kv_hi) is what any row of the tile can see;
  # [full_lo, full_hi) is what every row sees (tiles inside need no mask).
  pos_min = q_start + pos_offset
  pos_max = jnp.minimum(q_start + block_q, q_end) - 1 + pos_offset
  if causal:
    kv_hi = jnp.minimum(kv_len, pos_max + 1)
    full_hi = jnp.minimum(kv_len, pos_min + 1)
  else:
    kv_hi = kv_len
    full_hi = kv_len
  if window_left >= 0:
    kv_lo = jnp.maximum(pos_min - window_left, 0)
    full_lo = jnp.maximum(pos_max - window_left, 0)
  else:
    kv_lo = jnp.int32(0)
    full_lo = jnp.int32(0)
  lo_blk = kv_lo // block_k
  hi_blk = jnp.where(kv_hi > kv_lo, (kv_hi + block_k - 1) // block_k, lo_blk)
  u_lo = (full_lo + block_k - 1) // block_k
  u_hi = full_hi // block_k
  has_full = u_lo < u_hi
  mid_lo = jnp.where(has_full, u_lo, hi_blk)
  mid_hi = jnp.where(has_full, u_hi, hi_blk)

  qk_scale = sm_scale * _LOG2E

  within_page = block_k <= page_size

  def load_kv(blk, masked: bool):
    """K [block_k, head_dim] of block `blk` and a thunk loading its V.

    With `masked`, keys outside [kv_lo, kv_hi) load as zeros (never read).
    """
    j = blk * block_k + jnp.arange(block_k, dtype=jnp.int32)
    ld = ((j >= kv_lo) & (j < kv_hi))[:, None] if masked else None
    if within_page:
      # One page per block: a scalar table read and strided [block_k, D] loads.
      first = blk * block_k
      page_idx = first // page_size
      rows_idx = pl.ds(first % page_size, block_k)
      k_page = k_table_ref[seq, page_idx]
      v_page = v_table_ref[seq, page_idx]
      k_at = k_pool_ref.at[k_page, rows_idx, kv_head, :]
      v_at = v_pool_ref.at[v_page, rows_idx, kv_head, :]
    else:
      # Several pages per block: one scalar table read per page, spread to
      # the keys with a select chain (no per-key table loads).
      npg = block_k // page_size
      first_page = blk * npg
      pg = (j // page_size) - first_page  # [block_k], 0 .. npg - 1
      # Table entries past the last visible page may be -1: never read.
      last_page = jnp.maximum((kv_hi - 1) // page_size, 0)

      def pages(table_ref):
        page = None
        for i in range(npg):
          pid = jnp.maximum(
              table_ref[seq, jnp.minimum(first_page + i, last_page)], 0)
          page = pid if page is None else jnp.where(pg == i, pid, page)
        return page
      slot = (j % page_size)[:, None]
      k_at = k_pool_ref.at[pages(k_table_ref)[:, None], slot, kv_head, d]
      v_at = v_pool_ref.at[pages(v_table_ref)[:, None], slot, kv_head, d]
    # FP8 tiles convert to q's (dot) dtype where Triton places it: unlike
    # decode's, converting V in its loaded layout is slower here (measured:
    # docs/performance.md).
    cast = (lambda x: x.astype(q.dtype)) if has_scales else (lambda x: x)
    if masked:
      return (cast(plgpu.load(k_at, mask=ld, other=0.0)),
              lambda: cast(plgpu.load(v_at, mask=ld, other=0.0)))
    return cast(plgpu.load(k_at)), lambda: cast(plgpu.load(v_at))

  # Without a soft cap the scale is folded into the exponent: the row max is
  # taken on the raw logits (the scale is positive) and each logit costs one
  # FMA + one exp2 (FlashAttention-3's softmax). Masked logits are set on the
  # raw scale, to a value that stays finite once scaled.
  fold_scale = logits_soft_cap is None and qk_scale > 0
  mask_value = DEFAULT_MASK_VALUE / max(1.0, qk_scale)

  def body(blk, carry, masked: bool):
    acc, m_prev, l_prev = carry
    k, load_v = load_kv(blk, masked)
    j = blk * block_k + jnp.arange(block_k, dtype=jnp.int32)
    s = plgpu.dot(q, k, trans_b=True,
                  precision=precision)  # f32[rows, block_k]
    if has_scales:
      s = s * scales_ref[0]
    if logits_soft_cap is not None:
      s = jnp.tanh(s * (sm_scale / logits_soft_cap)) * (
          logits_soft_cap * _LOG2E)
    elif not fold_scale:
      s = s * qk_scale
    if masked:
      vis = (j[None, :] >= kv_lo) & (j[None, :] < kv_len)
      if causal:
        vis &= j[None, :] <= q_pos[:, None]
      if window_left >= 0:
        vis &= j[None, :] >= q_pos[:, None] - window_left
      s = jnp.where(vis, s, mask_value)
    if fold_scale:  # m is kept in scaled (base-2) units
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1) * qk_scale)
      p = _exp2_fma(s, qk_scale, jnp.broadcast_to(-m_next[:, None], s.shape),
                    fast_exp2)
    else:
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
      p = _exp2(s - m_next[:, None], fast_exp2)
    alpha = _exp2(m_prev - m_next, fast_exp2)
    if masked:
      p = jnp.where(vis, p, 0.0)
    l_next = l_prev * alpha + jnp.sum(p, axis=1)
    v = load_v()
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v,
                                           precision=precision)
    return acc, m_next, l_next

  carry = (jnp.zeros((rows, head_dim), jnp.float32),
           jnp.full((rows,), -jnp.inf, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  masked_body = functools.partial(body, masked=True)
  if single_loop:
    carry = lax.fori_loop(lo_blk, hi_blk, masked_body, carry)
  else:
    if window_left >= 0:  # window edge: masked tiles before the interior
      carry = lax.fori_loop(lo_blk, mid_lo, masked_body, carry)
    else:  # lo_blk == 0 == mid_lo whenever an interior exists
      mid_hi = jnp.where(has_full, u_hi, lo_blk)
      mid_lo = lo_blk
    carry = lax.fori_loop(mid_lo, mid_hi,
                          functools.partial(body, masked=False), carry)
    carry = lax.fori_loop(mid_hi, hi_blk, masked_body, carry)
  acc, m, l = carry
  if has_scales:
    acc = acc * scales_ref[1]

  if has_sinks:
    sink = sinks_ref[head] * _LOG2E  # f32[rows], base 2
    m_all = jnp.maximum(m, sink)
    keep = jnp.exp2(m - m_all)
    denom = l * keep + jnp.exp2(sink - m_all)
    out = acc * (keep / denom)[:, None]
  else:
    out = acc / jnp.where(l > 0.0, l, 1.0)[:, None]
  lse = jnp.where(l > 0.0, (m + jnp.log2(jnp.where(l > 0.0, l, 1.0))) * _LN2,
                  -jnp.inf)
  plgpu.store(o_ref.at[token[:, None], head[:, None], d],
              out.astype(o_ref.dtype), mask=row_ok[:, None])
  plgpu.store(lse_ref.at[token, head], lse, mask=row_ok)


def _paged_prefill_call(q, k_pool, v_pool, k_table, v_table, sinks, scales,
                        tiles, prev=None, *, block_q: int, block_k: int,
                        num_warps: int, num_stages: int, heads_outer: bool,
                        config: PrefillConfig, causal,
                        sm_scale, window_left, logits_soft_cap, interpret):
  """One launch over `tiles`; `prev=(out, lse)` is updated in place (aliased)."""
  num_tokens, num_qo_heads, head_dim = q.shape
  num_kv_heads = k_pool.shape[2]
  group_size = num_qo_heads // num_kv_heads
  num_tiles = tiles.shape[0]
  kernel = functools.partial(
      _paged_prefill_kernel, block_q=block_q, block_k=block_k,
      group_size=group_size, causal=causal, sm_scale=sm_scale,
      window_left=window_left, logits_soft_cap=logits_soft_cap,
      has_sinks=sinks is not None, single_loop=config.single_loop,
      heads_outer=heads_outer, fast_exp2=config.fast_exp2 and not interpret,
      has_scales=scales is not None)
  args = [tiles, q, k_pool, v_pool, k_table, v_table]
  if sinks is not None:
    args.append(sinks.astype(jnp.float32))
  if scales is not None:
    args.append(scales)
  aliases = {}
  if prev is not None:
    aliases = {len(args): 0, len(args) + 1: 1}
    args.extend(prev)
    kernel = functools.partial(_drop_aliased_inputs, kernel,
                               num_inputs=len(args) - 2)
  name = (f"paged_prefill_bq{block_q}_bk{block_k}"
          f"_g{group_size}_w{num_warps}_s{num_stages}")
  with _compat.suppress_triton_deprecation():
    out, lse = pl.pallas_call(
        kernel,
        grid=((num_tiles, num_kv_heads) if heads_outer else
              (num_kv_heads, num_tiles)),
        out_shape=[
            jax.ShapeDtypeStruct((num_tokens, num_qo_heads, head_dim), q.dtype),
            jax.ShapeDtypeStruct((num_tokens, num_qo_heads), jnp.float32),
        ],
        compiler_params=_compat.triton_params(num_warps, num_stages),
        input_output_aliases=aliases,
        interpret=interpret,
        name=name,
    )(*args)
  return out, lse


def _drop_aliased_inputs(kernel, *refs, num_inputs):
  """Calls `kernel` without the two aliased (out, lse) input refs."""
  return kernel(*refs[:num_inputs], *refs[num_inputs + 2:])


@functools.partial(
    jax.jit,
    static_argnames=("causal", "sm_scale", "window_left", "logits_soft_cap",
                     "interpret", "config"))
def paged_prefill(
    q: jax.Array,         # [num_tokens, num_qo_heads, head_dim]
    k_pool: jax.Array,    # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool: jax.Array,    # [num_pages, page_size, num_kv_heads, head_dim]
    k_table: jax.Array,   # i32[batch_size, max_pages]
    v_table: jax.Array,   # i32[batch_size, max_pages]
    q_indptr: jax.Array,  # i32[batch_size + 1]
    kv_lens: jax.Array,   # i32[batch_size]
    sinks: jax.Array | None = None,  # f32[num_qo_heads]
    *,
    causal: bool = True,
    sm_scale: float,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    interpret: bool = False,
    config: TritonConfig | MosaicConfig | None = None,
    plan: plan_lib.PrefillPlan | None = None,
    k_scale=None,  # f32[] | f32[num_kv_heads]: FP8 pages
    v_scale=None,  # f32[] | f32[num_kv_heads]: FP8 pages
):
  """Ragged prefill attention over a paged KV cache (the `impl="pallas"` path).

  Semantics are `reference.paged_prefill_reference`: token `t` of sequence `b`
  (`q_indptr[b] <= t < q_indptr[b+1]`) sits at position
  `kv_lens[b] - q_len_b + (t - q_indptr[b])` and sees key `j` iff
  `j < kv_lens[b]`, `j <= pos` (causal) and `j >= pos - window_left`
  (window_left >= 0). K block `i` of sequence `b` is `k_pool[k_table[b, i]]`,
  V block `i` is `v_pool[v_table[b, i]]` (k_pool and v_pool may be one array).

  Args:
    q: `[num_tokens, num_qo_heads, head_dim]`; bf16, f16 or f32.
    k_pool, v_pool: `[num_pages, page_size, num_kv_heads, head_dim]`, dtype of
      `q`, or float8_e4m3fn with `k_scale` / `v_scale` (each an f32 scalar
      or one per KV head, `f32[num_kv_heads]`; may be traced; a stored
      value `x` of kv head `h` means `x * scale[h]`); page_size a power of
      two. FP8 pages with per-tensor scales run in the backend the config
      names, as 16-bit pages do (Mosaic GPU: TMA-staged FP8 tiles
      converted to f16 by the producer warpgroup; Triton: tiles converted
      in registers; both run f16 dots), or, where `config.dequantizes_fp8`
      (by default from `DEQUANTIZE_MIN_ROWS` query rows per sequence,
      `dequantize_pays`), are first gathered and dequantized into a
      compact pool of q's dtype (`_fp8.dequantize_pages`: the named pages
      only, `batch_size * max_pages` of them, held for the call) that the
      16-bit kernels read. Per-KV-head scales are always dequantized that
      way, each head by its own scale (the kernels read one scale per
      tensor), so the query keeps its dtype on every backend.
    k_table, v_table: `i32[batch_size, max_pages]`; entries outside a
      sequence's visible key range are never read (may be -1).
    q_indptr: `i32[batch_size + 1]`, cu_seqlens; tokens past `q_indptr[-1]`
      are padding and give zeros / `lse = -inf`.
    kv_lens: `i32[batch_size]`, tokens including the new ones.
    sinks: optional `f32[num_qo_heads]` logits joining the denominator only.
    causal, sm_scale, window_left, logits_soft_cap: static, as in the public
      `pkvattn.paged_prefill`.
    interpret: static; run in Pallas interpret mode (CPU tests).
    config: static `TritonConfig` or `MosaicConfig`; None = the one
      `dispatch.prefill` chooses for this call on `dispatch.current_gpu`
      (`interpret` asks for the Triton kernel).
    plan: optional `PrefillPlan` from `plan.plan_prefill` with the same
      `block_q` and `num_tokens` (computed here when None); pass one plan to
      every layer of a step to compute the schedule once. With `config`
      None, a plan made for the other backend's tile size is replaced by
      one computed here.

  Returns:
    `(out [num_tokens, num_qo_heads, head_dim] q.dtype,
      lse f32[num_tokens, num_qo_heads])`, natural-log lse, sink excluded.

  Raises:
    ValueError: a plan built for a different block_q / num_tokens / batch;
      a `MosaicConfig` in interpret mode or one whose tiles do not fit the
      group (`MosaicConfig.validate`); a scale neither of one value nor of
      shape `(num_kv_heads,)`; per-KV-head scales with
      `config.fp8_pages="kernel"` where the config's launches read one
      scale per tensor (`reads_head_scales`).
    NotImplementedError: tile sizes Triton cannot run (dot operands < 16).
  """
  num_tokens, num_qo_heads, head_dim = q.shape
  num_kv_heads = k_pool.shape[2]
  group_size = num_qo_heads // num_kv_heads
  defaulted = config is None
  fp8 = k_scale is not None
  head_scales = _fp8.is_per_head(k_scale, v_scale, num_kv_heads)
  if config is None:
    config = dispatch.prefill(
        gpu=dispatch.current_gpu(interpret), dtype=q.dtype,
        kv_dtype=k_pool.dtype, head_dim=head_dim, group_size=group_size,
        page_size=k_pool.shape[1], window_left=window_left,
        num_tokens=num_tokens, batch_size=kv_lens.shape[0],
        head_scales=head_scales).config
  config.validate(group_size)
  if head_scales and config.fp8_pages == "kernel" and (
      not config.reads_head_scales):
    raise ValueError(
        f"Invalid config.fp8_pages: 'kernel' reads one k_scale / v_scale per "
        f"tensor in a {type(config).__name__} with short_block_q="
        f"{config.short_block_q}, got per-KV-head scales (expected "
        f"'dequantize' or 'auto', or a MosaicConfig without a short "
        f"launch)")
  if fp8 and config.dequantizes_fp8(num_tokens=num_tokens,
                                    batch_size=kv_lens.shape[0],
                                    group_size=group_size,
                                    head_scales=head_scales,
                                    window_left=window_left):
    k_pool, k_table = _fp8.dequantize_pages(k_pool, k_table, k_scale, q.dtype)
    v_pool, v_table = _fp8.dequantize_pages(v_pool, v_table, v_scale, q.dtype)
    fp8, k_scale, v_scale = False, None, None
  if fp8 and config.backend == "mosaic" and (
      config.num_consumers(group_size) != 2):
    # FP8 tiles read in the kernel are converted by the producer warpgroup,
    # which three consumers leave too few registers: two consumers (the
    # defaults have two there already: `dispatch.prefill`).
    config = dataclasses.replace(
        config, block_q=config.tile_q(2, group_size), schedule="pingpong")
  scales = None  # the Pallas-Triton tiles': per tensor only
  if fp8 and not head_scales:
    scales = jnp.stack([jnp.asarray(k_scale, jnp.float32).reshape(()),
                        jnp.asarray(v_scale, jnp.float32).reshape(())])
  if config.backend == "mosaic" and interpret:
    raise ValueError(
        f"Invalid config: the mosaic backend needs a GPU, got "
        f"interpret={interpret}")
  if plan is not None:
    got = (plan.block_q, plan.short_block_q, plan.align,
           plan.decode_rows is not None, plan.decode_rows_per_seq,
           plan.num_tokens, plan.batch_size)
    want = (config.block_q, config.short_block_q, config.plan_align,
            config.split_decode_rows,
            config.decode_rows_per_seq if config.split_decode_rows else 1,
            num_tokens, kv_lens.shape[0])
    if got != want:
      if not (defaulted and got[5:] == want[5:]):
        raise ValueError(
            f"Invalid plan: built for (block_q, short_block_q, align, "
            f"split_decode_rows, decode_rows_per_seq, num_tokens, "
            f"batch_size) = {got}, expected {want}")
      # A step's one plan serves layers of both backends (f32 layers run
      # the Triton kernel where others run the mosaic one): the layers the
      # plan was not made for plan for themselves.
      plan = None
  if plan is None:
    plan = config.plan(q_indptr, kv_lens, num_tokens=num_tokens,
                       causal=causal, window_left=window_left)
  k_table = k_table.astype(jnp.int32)
  v_table = v_table.astype(jnp.int32)
  call = functools.partial(
      _paged_prefill_call, q, k_pool, v_pool, k_table, v_table, sinks, scales,
      config=config, causal=causal,
      sm_scale=sm_scale, window_left=window_left,
      logits_soft_cap=logits_soft_cap, interpret=interpret)
  if config.backend == "mosaic":
    out = paged_prefill_mgpu.paged_prefill_mgpu(
        q, k_pool, v_pool, k_table, v_table, plan.tiles, sinks,
        causal=causal, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
        block_kv=config.block_k, num_stages=config.num_stages,
        k_scale=k_scale, v_scale=v_scale,
        num_consumers=config.num_consumers(group_size),
        schedule=config.schedule, pack_gqa=config.pack_gqa,
        persistent=config.persistent, window_left=window_left)
  else:
    out = call(plan.tiles, block_q=config.block_q, block_k=config.block_k,
               num_warps=config.num_warps, num_stages=config.num_stages,
               heads_outer=config.heads_outer)
  if plan.short_tiles is not None:
    out = call(plan.short_tiles, out, block_q=config.short_block_q,
               block_k=config.short_block_k,
               num_warps=config.short_num_warps,
               num_stages=config.short_num_stages, heads_outer=False)
  if plan.decode_rows is not None:
    # Sequences of up to `decode_rows_per_seq` tokens: one decode query
    # per token, written into the output rows (`num_tokens` = none).
    from pkvattn.pallas_kernels import paged_decode  # noqa: PLC0415
    out = paged_decode.paged_decode_rows(
        *out, q, plan.decode_rows, k_pool, v_pool, k_table, v_table,
        kv_lens if plan.decode_kv_lens is None else plan.decode_kv_lens,
        sinks, sm_scale=sm_scale, window_left=window_left,
        logits_soft_cap=logits_soft_cap, interpret=interpret,
        k_scale=k_scale, v_scale=v_scale)
  return tuple(out)
