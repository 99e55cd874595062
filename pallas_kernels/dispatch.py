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


def decode(*, gpu: Gpu, dtype, kv_dtype, head_dim: int, group_size: int,
           page_size: int, batch_size: int, num_kv_heads: int,
           max_pages: int, window_left: int = -1, q_tokens_per_seq: int = 1,
           backend: str | None = None,
           num_sms: int = DECODE_NUM_SMS) -> Choice:
  """The decode kernel and its config for one call (static facts only).

  Rules, first match wins:

  1. Hopper, a bf16 / f16 q over pages of that dtype or FP8 ones, and a
     case `paged_decode_mma.supports` (head_dim 64 / 128 / 256, groups
     1..8, pages of 8..128 tokens): the per-warp Mosaic-GPU kernel
     (`"mosaic_mma"`, `paged_decode.MmaConfig`). Steps of 16 keys, 32 for
     FP8 pages at head_dim <= 128 (half the bytes per key, half the
     registers in flight); splits for about `MMA_CTAS_PER_SM` CTAs per SM
     (half that at head_dim 256 with 16-bit pages), the power of two
     nearest it, each split keeping >= 2 rounds of the four warps' steps,
     at most 64.
  2. FP8 pages on a GPU that converts e4m3 pairs in one instruction
     (compute capability >= 8.9): the Triton kernel reading both tiles as
     column pairs (`fp8_convert="pairs"`) on 2 warps, 3 stages. Head_dim 64
     packs two kv heads per program where their number is even
     (`pack_heads=2`: 128-byte rows); an odd number keeps one, with 64-token
     steps and splits for 4 programs per SM. Otherwise steps of 64 tokens,
     32 at head_dim 256 or with > 4 programs per SM, and splits for 2
     programs per SM; page ids a step ahead where a step covers <= 64
     tokens.
  3. Everything else (f32, other GPUs, interpret mode; FP8 pages there
     convert in the loaded layout, `fp8_convert="loaded"`): the Triton
     kernel, 3 stages. Steps of 64 tokens (32 at head_dim 256, to bound
     registers) on 4 warps; with many programs (>= 8 per SM) 128-token
     steps at head_dim <= 128; otherwise 2 warps at head_dim 64. Splits for
     2 programs per SM, 4 for 2-warp programs.

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

  # 1. Hopper: the per-warp Mosaic-GPU kernel.
  if backend == "mosaic_mma" or backend is None and gpu.is_hopper and (
      paged_decode_mma.supports(
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
  num_warps = 4
  if head_dim <= 128 and programs >= 8 * num_sms:
    block_tokens = 128
  elif head_dim <= 64:
    num_warps = 2
  pages_per_block = max(1, block_tokens // page_size)
  return Choice("triton", paged_decode.TritonConfig(
      pages_per_block=pages_per_block,
      k_splits=_decode_splits(programs, max_pages, pages_per_block,
                              per_sm=4 if num_warps == 2 else 2,
                              num_sms=num_sms),
      num_warps=num_warps, num_stages=3))


def _pow2_at_least(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def _decode_splits(programs: int, max_pages: int, pages_per_block: int, *,
                   per_sm: int, num_sms: int) -> int:
  """Splits for about `per_sm` programs per SM (rounded up to a power of
  two), each keeping >= 2 steps of the longest sequence, at most 64."""
  want = _pow2_at_least(max(1, -(-per_sm * num_sms // max(1, programs))))
  max_steps = max(1, -(-max_pages // pages_per_block))
  cap = _pow2_at_least(max(1, max_steps // 2))
  if cap > max_steps // 2 and cap > 1:
    cap //= 2
  return max(1, min(want, cap, 64))


def _mma_splits(items: int, max_pages: int, *, pages_per_round: int,
                ctas_per_sm: float, num_sms: int) -> int:
  """Splits for about `ctas_per_sm` CTAs per SM over `items` (kv head,
  sequence) pairs: the nearest power of two, halved until each split keeps
  >= 2 rounds of `pages_per_round` pages, at most 64."""
  import math  # noqa: PLC0415
  want = ctas_per_sm * num_sms / max(1, items)
  splits = 1 << max(0, round(math.log2(want))) if want > 1 else 1
  max_rounds = max(1, -(-max_pages // pages_per_round))
  while splits > 1 and 2 * splits > max_rounds:
    splits //= 2
  return min(splits, 64)
