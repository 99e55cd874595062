"""Which kernel runs each op, and with which config: one rule per op.

Each op has one function here that maps the static facts of a call (GPU
generation, dtypes, head_dim, group size, page size, window, query tokens per
sequence, batch shape) to a `Choice` of backend and config. The functions read
top to bottom: the first rule that matches wins. `docs/kernels.md` mirrors each
rule as a table and `tests/test_dispatch.py` asserts every row of it, so a
change of default shows up in both.

Only this module asks which GPU is present (`current_gpu`); kernels'
`supports()` functions check shapes and dtypes, never the device. Tests fake
the GPU one way: they pass `gpu=` (e.g. `HOPPER`) to these functions, or
patch `current_gpu` through the `fake_gpu` fixture of `tests/conftest.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from pkvattn.pallas_kernels import _compat


@dataclasses.dataclass(frozen=True)
class Gpu:
  """The device a kernel is chosen for.

  Attributes:
    compute_capability: `(major, minor)` of an NVIDIA GPU, or None where no
      GPU runs the kernel (Pallas interpret mode on the CPU).
    num_sms: streaming multiprocessors; steers split and grid sizes only.
  """
  compute_capability: tuple[int, int] | None
  num_sms: int = 132

  @property
  def interpret(self) -> bool:
    """No GPU: kernels run in Pallas interpret mode."""
    return self.compute_capability is None

  @property
  def is_hopper(self) -> bool:
    """Compute capability 9.0: wgmma and TMA as the Mosaic-GPU kernels use
    them are sm_90a only."""
    return self.compute_capability == (9, 0)

  @property
  def has_fp8_cvt(self) -> bool:
    """e4m3 pairs convert to f16 in one instruction
    (`cvt.rn.f16x2.e4m3x2`: compute capability >= 8.9)."""
    return (self.compute_capability is not None
            and self.compute_capability >= (8, 9))


# The generations the dispatch tables name.
INTERPRET = Gpu(None)
AMPERE = Gpu((8, 0), 108)    # A100
ADA = Gpu((8, 9), 128)       # L40S / RTX 4090 class
HOPPER = Gpu((9, 0), 132)    # H100 / H200 SXM
GPUS = {"interpret": INTERPRET, "ampere": AMPERE, "ada": ADA,
        "hopper": HOPPER}


@functools.cache
def _detected_gpu() -> Gpu:
  cc = _compat.compute_capability()
  return Gpu(cc, _compat.num_sms()) if cc is not None else INTERPRET


def current_gpu(interpret: bool = False) -> Gpu:
  """The GPU of JAX's first device (`INTERPRET` where there is none, or
  where `interpret` asks for Pallas interpret mode)."""
  return INTERPRET if interpret else _detected_gpu()


@dataclasses.dataclass(frozen=True)
class Choice:
  """A dispatch decision: the backend's name and its config (the config
  class belongs to the backend's kernel module)."""
  backend: str
  config: object


# ---------------------------------------------------------------- decode

# SMs the decode split rules aim at: H100 / H200 SXM's count on every GPU.
# The splits only steer how many programs fill the machine, and a constant
# keeps one default per shape whatever the device reports.
DECODE_NUM_SMS = 132
# CTAs per SM the per-warp Mosaic kernel's splits aim at (halved at head_dim
# 256 for 16-bit pages, whose CTAs hold about twice the registers).
MMA_CTAS_PER_SM = 2.5
# From this many (query row, kv head) items per SM, 16-token pages of 16 bits
# at head_dim <= 128 with one query row per sequence take the Triton kernel
# on Hopper too: an engine's decode step (hundreds of rows, short contexts),
# where the per-warp kernel's four-warp CTAs and their merge cost more than
# the Triton programs' pipelined 32- or 64-token steps. (128-token pages stay
# faster on the per-warp kernel; measured: docs/performance.md.)
TRITON_ITEMS_PER_SM = 3


def decode(*, gpu: Gpu, dtype, kv_dtype, head_dim: int, group_size: int,
           page_size: int, batch_size: int, num_kv_heads: int,
           max_pages: int, window_left: int = -1, q_tokens_per_seq: int = 1,
           backend: str | None = None,
           num_sms: int = DECODE_NUM_SMS) -> Choice:
  """The decode kernel and its config for one call (static facts only).

  Rules, first match wins:

  1. Hopper, a bf16 / f16 q over pages of that dtype or FP8 ones (scales
     per tensor or per KV head), and a case `paged_decode_mma.supports`
     (head_dim 64 / 128 / 256, groups 1..8, pages of 8..128 tokens),
     except 16-token pages of 16 bits at head_dim
     <= 128 with one query row per sequence and at least
     `TRITON_ITEMS_PER_SM` (row, kv head) items per SM (those take rule
     3): the per-warp Mosaic-GPU kernel
     (`"mosaic_mma"`, `paged_decode.MmaConfig`). Steps of 16 keys, 32 for
     FP8 pages at head_dim <= 128 (half the bytes per key, half the
     registers in flight); splits for about `MMA_CTAS_PER_SM` CTAs per SM
     (half that at head_dim 256 with 16-bit pages), the power of two
     nearest it, each split keeping >= 2 rounds of the four warps' steps,
     at most 64.
  2. FP8 pages on a GPU that converts e4m3 pairs in one instruction
     (compute capability >= 8.9; on Hopper, cases the per-warp kernel does
     not take): the Triton kernel
     reading both tiles as column pairs (`fp8_convert="pairs"`) on 2
     warps, 3 stages. Head_dim 64 packs two kv heads per program where
     their number is even (`pack_heads=2`: 128-byte rows); an odd number
     keeps one, with 64-token steps and splits for 4 programs per SM.
     Otherwise steps of 64 tokens, 32 at head_dim 256 or with > 4 programs
     per SM, and splits for 2 programs per SM; page ids a step ahead where
     a step covers <= 64 tokens.
  3. Everything else (f32, other GPUs, interpret mode, Hopper's many
     one-token rows over 16-bit pages; FP8 pages there convert in the
     loaded layout, `fp8_convert="loaded"`): the Triton kernel, 3 stages.
     Steps of 64 tokens (32 at head_dim 256, to bound registers) on 4
     warps; with many programs (>= 8 per SM) at head_dim <= 128, 128-token
     steps, except for Hopper's many one-token rows (a 128-token step is
     mostly masked at tens of keys): with an even number of kv heads two
     per program (`pack_heads=2`, one dot for both heads' query rows) in
     32-token steps on 2 warps, 2 stages (smaller tiles, more programs
     resident per SM), otherwise 64-token steps on 2 warps; otherwise 2
     warps at head_dim 64. Splits for 2 programs per SM, 4 for 2-warp
     programs, counted in packed programs; none for Hopper's many
     one-token rows, whose `TRITON_ITEMS_PER_SM` items per SM fill the
     machine (a second split is empty at tens of keys, and costs the
     combine).

  Triton splits are a power of two <= 64, each keeping >= 2 steps of the
  longest sequence, so short contexts are not split into empty programs;
  with one split the kernel writes the output itself (no combine). Small
  pages are gathered several per step (`pages_per_block`). Each constant
  was chosen by measurement (measured: docs/performance.md).

  Args:
    gpu: the device (`current_gpu()`; `INTERPRET` for interpret mode).
    dtype: q's dtype (bf16, f16, f32).
    kv_dtype: the pages' dtype (q's, or float8_e4m3fn); None = `dtype`.
    head_dim, group_size, page_size, num_kv_heads: the call's heads and
      pages (`group_size = num_qo_heads // num_kv_heads`).
    batch_size: sequences (page-table rows).
    max_pages: page-table width.
    window_left: the sliding window (-1 = none). No rule reads it: the
      kernels skip pages outside the window at run time.
    q_tokens_per_seq: decode rows per sequence (`paged_decode_rows`);
      the splits count `batch_size * q_tokens_per_seq` rows.
    backend: None (the rules above), or "triton" / "mosaic_mma" to take
      that backend's config for the shape whatever the GPU (benchmarks,
      tests).
    num_sms: SMs the splits aim at; `DECODE_NUM_SMS` unless a test asks.

  Returns:
    `Choice(backend, config)`: `("mosaic_mma", paged_decode.MmaConfig)` or
    `("triton", paged_decode.TritonConfig)`.

  Raises:
    ValueError: `backend` not None, "triton" or "mosaic_mma".
  """
  # Kernel modules import this one (for `current_gpu`); importing them here
  # keeps that one-way at import time.
  import jax.numpy as jnp  # noqa: PLC0415
  from pkvattn.pallas_kernels import paged_decode  # noqa: PLC0415
  from pkvattn.pallas_kernels import paged_decode_mma  # noqa: PLC0415
  del window_left
  if backend not in (None, "triton", "mosaic_mma"):
    raise ValueError(f"Invalid backend: expected None, 'triton' or "
                     f"'mosaic_mma', got {backend!r}")
  kv_dtype = dtype if kv_dtype is None else kv_dtype
  fp8 = jnp.dtype(kv_dtype) == jnp.float8_e4m3fn
  rows = batch_size * q_tokens_per_seq

  # 1. Hopper: the per-warp Mosaic-GPU kernel, not for many one-token rows
  # over 16-bit pages.
  many_rows = (not fp8 and head_dim <= 128 and page_size == 16 and
               q_tokens_per_seq == 1 and
               rows * num_kv_heads >= TRITON_ITEMS_PER_SM * num_sms)
  if backend == "mosaic_mma" or backend is None and gpu.is_hopper and (
      not many_rows) and (paged_decode_mma.supports(
          dtype=dtype, kv_dtype=kv_dtype, head_dim=head_dim,
          page_size=page_size, group_size=group_size) is None):
    tiles = (2 if fp8 and head_dim <= 128
             else paged_decode_mma.default_tiles(head_dim))
    ctas_per_sm = MMA_CTAS_PER_SM / (2 if head_dim > 128 and not fp8 else 1)
    round_keys = paged_decode_mma.WARPS * paged_decode_mma.KEYS * tiles
    splits = _mma_splits(
        rows * num_kv_heads, max_pages,
        pages_per_round=max(1, round_keys // page_size),
        ctas_per_sm=ctas_per_sm, num_sms=num_sms)
    return Choice("mosaic_mma", paged_decode.MmaConfig(k_splits=splits,
                                                       tiles=tiles))

  # 2. FP8 pages where e4m3 pairs convert in one instruction: column pairs.
  programs = rows * num_kv_heads
  if fp8 and gpu.has_fp8_cvt:
    odd_d64 = head_dim == 64 and num_kv_heads % 2 == 1
    pack = 2 if head_dim == 64 and not odd_d64 else 1
    programs //= pack
    block_tokens = 64 if odd_d64 or (head_dim <= 128
                                     and programs <= 4 * num_sms) else 32
    pages_per_block = max(1, block_tokens // page_size)
    return Choice("triton", paged_decode.TritonConfig(
        pages_per_block=pages_per_block,
        k_splits=_decode_splits(programs, max_pages, pages_per_block,
                                per_sm=4 if odd_d64 else 2, num_sms=num_sms),
        num_warps=2, num_stages=3, fp8_convert="pairs", pack_heads=pack,
        prefetch_ids=pages_per_block * page_size <= 64))

  # 3. The Triton kernel.
  block_tokens = 32 if head_dim > 128 else 64
  num_warps, num_stages, pack = 4, 3, 1
  if head_dim <= 128 and programs >= 8 * num_sms:
    if gpu.is_hopper and many_rows:
      num_warps = 2
      if num_kv_heads % 2 == 0:
        block_tokens, num_stages, pack = 32, 2, 2
        programs //= pack
    else:
      block_tokens = 128
  elif head_dim <= 64:
    num_warps = 2
  pages_per_block = max(1, block_tokens // page_size)
  # Hopper's many rows fill the machine unsplit; a second split would be
  # empty at tens of keys and add the combine.
  splits = 1 if gpu.is_hopper and many_rows else _decode_splits(
      programs, max_pages, pages_per_block,
      per_sm=4 if num_warps == 2 else 2, num_sms=num_sms)
  return Choice("triton", paged_decode.TritonConfig(
      pages_per_block=pages_per_block, k_splits=splits,
      num_warps=num_warps, num_stages=num_stages, pack_heads=pack))


def _pow2_at_least(x: int) -> int:
  """The smallest power of two >= `x` (1 for `x <= 1`)."""
  return 1 << max(0, int(x) - 1).bit_length()


def _pow2_at_most(x: int) -> int:
  """The largest power of two <= `x` (>= 1)."""
  return 1 << (int(x).bit_length() - 1)


def _decode_splits(programs: int, max_pages: int, pages_per_block: int, *,
                   per_sm: int, num_sms: int) -> int:
  """Splits for about `per_sm` programs per SM (rounded up to a power of
  two), each keeping >= 2 steps of the longest sequence, at most 64."""
  want = _pow2_at_least(max(1, -(-per_sm * num_sms // max(1, programs))))
  max_steps = max(1, -(-max_pages // pages_per_block))
  cap = _pow2_at_most(max(1, max_steps // 2))
  return min(want, cap, 64)


def _mma_splits(items: int, max_pages: int, *, pages_per_round: int,
                ctas_per_sm: float, num_sms: int) -> int:
  """Splits for about `ctas_per_sm` CTAs per SM over `items` (kv head,
  sequence) pairs: the nearest power of two, halved until each split keeps
  >= 2 rounds of `pages_per_round` pages, at most 64."""
  want = ctas_per_sm * num_sms / max(1, items)
  splits = 1 << max(0, round(math.log2(want)))
  max_rounds = max(1, -(-max_pages // pages_per_round))
  while splits > 1 and 2 * splits > max_rounds:
    splits //= 2
  return min(splits, 64)


# ---------------------------------------------------------------- prefill

# Head_dim 64 on Hopper: the GQA group packed into two consumers' rows, one
# CTA per SM, below this many new tokens per sequence; three consumers on
# 192-token tiles from it (measured: docs/performance.md).
PREFILL_D64_MIN_TOKENS = 2048
# Head_dim 128 on Hopper without a window: one CTA per SM where the plan's
# static tile bound (`plan.max_tiles`) is at least this many times the tiles
# the step's tokens could fill (`num_tokens // block_q + 1`): steps of many
# sequences and few prompts, whose spare tiles would each launch a CTA
# (measured: docs/performance.md).
PREFILL_PERSISTENT_SPARE_RATIO = 2


def prefill(*, gpu: Gpu, dtype, kv_dtype, head_dim: int, group_size: int,
            page_size: int | None, num_tokens: int, batch_size: int,
            window_left: int = -1, head_scales: bool = False,
            backend: str | None = None) -> Choice:
  """The prefill kernel and its config for one call (static facts only).

  FP8 pages, under every rule: dequantized into a 16-bit pool first
  (`fp8_pages="dequantize"`) from `paged_prefill.DEQUANTIZE_MIN_ROWS` query
  rows (tokens x group) per sequence, twice that with a window, where the
  gather's fixed cost per key is repaid; read in the kernel (`"kernel"`) below
  (`paged_prefill.dequantize_pays`). With per-KV-head scales the
  Pallas-Triton kernel's pages are always dequantized (the gather scales
  each head; its tiles read one scale per tensor); the Mosaic-GPU kernel
  reads them in the kernel, each item its kv head's.

  Rules, first match wins:

  1. Hopper, a bf16 / f16 q and a case `paged_prefill_mgpu.supports`
     (head_dim 64 / 128 / 256, pages of >= 8 tokens dividing the key step
     or divisible by it): the Mosaic-GPU kernel (`"mosaic"`,
     `paged_prefill.MosaicConfig`, two stages, no Pallas-Triton short
     launch; one-token sequences are split-K decode rows).
     a. Head_dim 64 below `PREFILL_D64_MIN_TOKENS` new tokens per sequence
        (groups up to 64): the GQA group packed into the rows of two
        consumers (`pack_gqa`: `block_q = 2 * (64 // group_size)` tokens of
        every head of the group), one CTA per SM (`persistent`, each CTA
        loading its next tile while one runs), 128-key steps. Sequences of
        2-8 tokens are tiles of this launch: a packed tile holds the whole
        group, and a call saves the short launch and its plan.
     b. Otherwise one query head per CTA. At head_dim 64 with 16-bit pages,
        192-token tiles of three consumers passing a token
        (`schedule="ring"`, FlashAttention-3's form there: half the matmul
        per softmax element needs more warpgroups to hide it); else
        128-token tiles of two consumers in lock step (`"pingpong"`; FP8
        pages read in the kernel are converted by the producer warpgroup,
        which three consumers leave too few registers). 128-key steps, 64
        at head_dim 256 (whose output tiles share the q tiles' shared
        memory). Sequences of up to `max(8, 16 // next_pow2(group_size))`
        new tokens run in the decode kernel, a token a row, several rows
        of a sequence per CTA (`decode_rows_per_seq`). At head_dim 128
        without a window, one CTA per SM (`persistent`) where the plan's
        static tile bound is at least `PREFILL_PERSISTENT_SPARE_RATIO`
        times the tiles the tokens can fill (an engine's mixed and verify
        steps); prompts keep one CTA per tile.
  2. Everything else (f32, other GPUs, interpret mode, head_dims or pages
     the Mosaic-GPU kernel lacks): the Pallas-Triton kernel (`"triton"`,
     `paged_prefill.TritonConfig`). Tiles of 128 query rows (64 for f32),
     the group's heads packed densely (`block_q = rows // group_size`).
     Head_dim <= 128: 64-key tiles on 4 warps (one warpgroup), 3 stages
     (2 for f32, whose tiles would not fit in shared memory). Head_dim 256:
     32-key tiles on 8 warps, 2 stages (one warpgroup's accumulator would
     not fit in registers). Sequences of up to `max(8, 16 //
     next_pow2(group_size))` tokens (multi-token decode), where that is
     fewer than a main tile's, run in a short launch with 128-key tiles
     (64 at head_dim 256, halved for f32); one-token sequences are split-K
     decode rows.

  The constants were chosen by measurement (measured: docs/performance.md).

  Args:
    gpu: the device (`current_gpu()`; `INTERPRET` for interpret mode).
    dtype: q's dtype (bf16, f16, f32).
    kv_dtype: the pages' dtype (q's, or float8_e4m3fn); None = `dtype`.
    head_dim, group_size: the call's heads (`group_size = num_qo_heads //
      num_kv_heads`).
    page_size: tokens per page; None where unknown (a plan made before the
      pages are known): taken as 16.
    num_tokens: rows of q (the step's new tokens, padded).
    batch_size: sequences in the step.
    window_left: the sliding window (-1 = none).
    head_scales: FP8 pages with per-KV-head scales (`f32[num_kv_heads]`):
      `fp8_pages="dequantize"` whatever the rows under rule 2.
    backend: None (the rules above), or "triton" / "mosaic" to take that
      backend's config for the shape whatever the GPU (benchmarks, tests).

  Returns:
    `Choice(backend, config)`: `("mosaic", paged_prefill.MosaicConfig)` or
    `("triton", paged_prefill.TritonConfig)`.

  Raises:
    ValueError: `backend` not None, "triton" or "mosaic".
  """
  import jax.numpy as jnp  # noqa: PLC0415
  from pkvattn.pallas_kernels import paged_prefill  # noqa: PLC0415
  from pkvattn.pallas_kernels import paged_prefill_mgpu  # noqa: PLC0415
  from pkvattn.pallas_kernels import plan  # noqa: PLC0415
  if backend not in (None, "triton", "mosaic"):
    raise ValueError(f"Invalid backend: expected None, 'triton' or "
                     f"'mosaic', got {backend!r}")
  kv_dtype = dtype if kv_dtype is None else kv_dtype
  fp8_pages = "auto"  # 16-bit pages: no FP8 to read
  fp8 = jnp.dtype(kv_dtype) == jnp.float8_e4m3fn
  if fp8:
    fp8_pages = "dequantize" if paged_prefill.dequantize_pays(
        num_tokens=num_tokens, batch_size=batch_size,
        group_size=group_size, window_left=window_left) else "kernel"
  # Multi-token decode: sequences of up to this many new tokens run apart
  # from the main tiles (a short launch, or the decode kernel).
  short_tokens = max(8, 16 // _pow2_at_least(group_size))

  # 1. Hopper: the Mosaic-GPU kernel.
  mosaic_block_k = 64 if head_dim > 128 else 128
  if backend == "mosaic" or backend is None and gpu.is_hopper and (
      paged_prefill_mgpu.supports(
          dtype=dtype, head_dim=head_dim,
          page_size=16 if page_size is None else page_size,
          block_kv=mosaic_block_k) is None):
    # 1a. Head_dim 64, shorter prompts: the group packed, one CTA per SM.
    if (head_dim == 64 and group_size <= paged_prefill_mgpu.BLOCK_Q and
        num_tokens < PREFILL_D64_MIN_TOKENS * max(batch_size, 1)):
      return Choice("mosaic", paged_prefill.MosaicConfig(
          block_q=paged_prefill_mgpu.tile_q(2, group_size), block_k=128,
          num_stages=2, short_block_q=0, short_block_k=128, pack_gqa=True,
          persistent=True, fp8_pages=fp8_pages))
    # 1b. One query head per CTA: three consumers at head_dim 64 (16-bit
    # pages), else two; multi-token decode in the decode kernel.
    three = head_dim == 64 and fp8_pages != "kernel"
    block_q = paged_prefill_mgpu.tile_q(3 if three else 2)
    config = paged_prefill.MosaicConfig(
        block_q=block_q, block_k=mosaic_block_k, num_stages=2,
        short_block_q=0, short_block_k=mosaic_block_k,
        decode_rows_per_seq=short_tokens,
        schedule="ring" if three else "pingpong", fp8_pages=fp8_pages)
    if head_dim == 128 and window_left < 0:
      spare = plan.max_tiles(num_tokens, batch_size, block_q,
                             config.tile_min_tokens) >= (
                                 PREFILL_PERSISTENT_SPARE_RATIO *
                                 (num_tokens // block_q + 1))
      config = dataclasses.replace(config, persistent=spare)
    return Choice("mosaic", config)

  # 2. The Pallas-Triton kernel (one scale per tensor in its tiles).
  if fp8 and head_scales:
    fp8_pages = "dequantize"
  wide = jnp.dtype(dtype).itemsize >= 4
  rows = 64 if wide else 128
  if head_dim <= 128:
    block_k, num_warps, num_stages, short_block_k = 64, 4, 2 if wide else 3, 128
  else:
    block_k, num_warps, num_stages, short_block_k = 32, 8, 2, 64
  block_q = max(1, rows // group_size)
  return Choice("triton", paged_prefill.TritonConfig(
      block_q=block_q, block_k=block_k, num_warps=num_warps,
      num_stages=num_stages,
      short_block_q=short_tokens if short_tokens < block_q else 0,
      short_block_k=short_block_k // 2 if wide else short_block_k,
      fp8_pages=fp8_pages))


# ------------------------------------------------------------- rope_append

# The Triton kernel's big-batch rule from this many tokens.
ROPE_BIG_BATCH_TOKENS = 8192
# Programs the Triton kernel's small-batch rule splits the heads for: about
# what fills the GPU.
ROPE_PROGRAMS = 512


def rope_append(*, gpu: Gpu, dtype, kv_dtype, pool_dtype, head_dim: int,
                num_qo_heads: int, num_kv_heads: int, num_tokens: int,
                rotary_dim: int | None = None, interleaved: bool = False,
                has_scales: bool | None = None) -> Choice:
  """The RoPE + append kernel and its config for one call.

  Rules, first match wins:

  1. Hopper, q, k and v of one dtype, and a case
     `rope_append_mgpu.supports` takes (bf16 / f16 rows, pools of that
     dtype or float8_e4m3fn with scales, the rotated and pass-through
     columns in whole chunks): the Mosaic-GPU kernel (`"mosaic"`, the
     launch `rope_append_mgpu.Config.default_for` gives: the heads split
     over the largest power of two <= 8 programs dividing both counts,
     4-byte chunks up to `rope_append_mgpu.SMALL_CHUNK_MAX_TOKENS` tokens,
     8-byte beyond).
  2. Otherwise the Pallas-Triton kernel (`"triton"`,
     `rope_append.TritonConfig`, 4 warps), the head loop unrolled where a
     program has <= 16 heads (several heads' loads in flight):
     a. From `ROPE_BIG_BATCH_TOKENS` tokens: 8-token tiles, the heads
        split over up to 8 programs per tile (the largest power of two
        dividing both head counts).
     b. Fewer: 4-token tiles up to 512 tokens, 8 beyond, the heads split
        until about `ROPE_PROGRAMS` programs fill the GPU. Where the head
        counts do not split that far (e.g. 9 q / 3 kv heads, or very few
        tokens), so the programs stay fewer, one head per program
        (`one_head`: the most programs, one short chain each).

  The constants were chosen by measurement (measured:
  docs/performance.md).

  Args:
    gpu: the device (`current_gpu()`; `INTERPRET` for interpret mode).
    dtype: q's dtype (k's where there is no q).
    kv_dtype: k's and v's dtype (v's where they differ).
    pool_dtype: the pools' dtype (kv_dtype's, or float8_e4m3fn).
    head_dim, num_qo_heads, num_kv_heads: the heads (`num_qo_heads` 0:
      append only).
    num_tokens: tokens to rotate and append.
    rotary_dim: features rotated per head (None = head_dim; 0 = none).
    interleaved: GPT-J pairs instead of GPT-NeoX halves.
    has_scales: whether k_scale / v_scale come with the call; None = the
      pools are float8_e4m3fn.

  Returns:
    `Choice(backend, config)`: `("mosaic", rope_append_mgpu.Config)` or
    `("triton", rope_append.TritonConfig)`.
  """
  import jax.numpy as jnp  # noqa: PLC0415
  from pkvattn.pallas_kernels import rope_append as kernel  # noqa: PLC0415
  from pkvattn.pallas_kernels import rope_append_mgpu  # noqa: PLC0415
  half = (head_dim if rotary_dim is None else rotary_dim) // 2
  if has_scales is None:
    has_scales = jnp.dtype(pool_dtype) == jnp.float8_e4m3fn

  # 1. Hopper: the Mosaic-GPU kernel.
  if gpu.is_hopper and jnp.dtype(dtype) == jnp.dtype(kv_dtype):
    config = rope_append_mgpu.Config.default_for(num_tokens, num_qo_heads,
                                                 num_kv_heads)
    if rope_append_mgpu.supports(
        dtype=kv_dtype, pool_dtype=pool_dtype, head_dim=head_dim, half=half,
        interleaved=interleaved, num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads, num_splits=config.num_splits,
        has_scales=has_scales, chunk_bytes=config.chunk_bytes) is None:
      return Choice("mosaic", config)

  # 2a. The Pallas-Triton kernel, big batches.
  def split(block_tokens: int, max_splits: int):
    splits = 1
    while (2 * splits <= max_splits and num_kv_heads % (2 * splits) == 0
           and num_qo_heads % (2 * splits) == 0):
      splits *= 2
    return kernel.TritonConfig(
        block_tokens=block_tokens, num_splits=splits, num_warps=4,
        unroll=(num_qo_heads + num_kv_heads) // splits <= 16)
  if num_tokens >= ROPE_BIG_BATCH_TOKENS:
    return Choice("triton", split(8, 8))
  # 2b. Smaller: split the heads until about ROPE_PROGRAMS programs.
  block_tokens = 4 if num_tokens <= 512 else 8
  tiles = max(1, -(-num_tokens // block_tokens))
  want = _pow2_at_least(-(-ROPE_PROGRAMS // tiles))
  config = split(block_tokens, want)
  # Splits below `want` (a power of two) leave < ROPE_PROGRAMS programs.
  if config.num_splits < want:
    config = kernel.TritonConfig(block_tokens=block_tokens, num_warps=4,
                                 one_head=True)
  return Choice("triton", config)


# -------------------------------------------------------------- sampling

def sample_floor(*, gpu: Gpu, dtype, vocab_size: int,
                 backend: str | None = None) -> Choice:
  """The sampler's kept-set floor (`pkvattn.sampling.kept_floor`).

  Rules, first match wins:

  1. A GPU and a case `sample_floor.supports` takes (f32 probabilities):
     the Pallas-Triton search kernel (`"triton"`, `sample_floor.Config`:
     one program a row on 32 warps, 4,096 probabilities a loop step, the
     vocabulary's power of two where it is smaller, 4-ary: three probes a
     pass over the row). It replaces a `[rows, vocab]` radix sort, the
     costliest kernel of a sampled decode step (measured:
     docs/performance.md).
  2. Otherwise (interpret mode: the CPU) the floor read off the sorted
     rows (`"xla"`, no config): the kernel's 15-odd passes over each row
     are for a GPU.

  Args:
    gpu: the device (`current_gpu()`).
    dtype: the probabilities' dtype.
    vocab_size: their row length.
    backend: None (the rules above), or "triton" / "xla" to take that
      backend whatever the GPU (interpret mode on a CPU; tests).

  Returns:
    `Choice("triton", sample_floor.Config)` or `Choice("xla", None)`.

  Raises:
    ValueError: `backend` not None, "triton" or "xla".
  """
  from pkvattn.pallas_kernels import sample_floor as kernel  # noqa: PLC0415
  if backend not in (None, "triton", "xla"):
    raise ValueError(f"Invalid backend: expected None, 'triton' or 'xla', "
                     f"got {backend!r}")
  if backend == "triton" or backend is None and not gpu.interpret and (
      kernel.supports(dtype, vocab_size) is None):
    return Choice("triton", kernel.Config(
        block=min(kernel.Config.block, _pow2_at_least(vocab_size))))
  return Choice("xla", None)
