"""Paged decode attention (one query token per sequence), Pallas GPU / Triton.

Algorithm: flash-decoding (Dao et al., "Flash-Decoding for long-context
inference", 2023; FlashAttention-2, Dao 2023, section 3.1 for the online
softmax). The visible pages of each sequence are split into `k_splits`
contiguous ranges; program `(b, k, s)` of the grid walks split `s` of sequence
`b` for kv head `k`, `pages_per_block` pages per step (`lax.fori_loop` with a
dynamic trip count), gathering the page ids from the page table in the kernel.
The whole GQA group of kv head `k` is packed into the M dimension of both dots
(`q [group_padded, head_dim] @ K^T`, `P @ V`), padded to 16 rows, so every K/V
byte is read once per kv head, not once per query head (with
`Config.pack_heads`, a program serves adjacent kv heads as one wider head:
FP8 pages at head_dim 64). Each split writes a
normalised partial output and its log-sum-exp; a small jnp step combines the
splits by LSE and adds the sinks to the denominator (FlashInfer `merge_state`).

Memory: K/V pages are read through masked gathers, so rows past `kv_lens[b]`,
outside the window, or in pages past the split's end are never loaded (they may
be NaN or belong to another sequence), and table entries outside the visible
page range `[first_visible_page, cdiv(kv_len, page_size))` are never read.
Decode is memory-bound: the kernel's job is to stream the touched K/V bytes at
close to the copy bandwidth.

Layouts (see `pkvattn/_kv.py`): K block `i` of sequence `b` is
`k_pool[k_table[b, i]]`, V block `i` is `v_pool[v_table[b, i]]`; pools are NHD
`[num_pages, page_size, num_kv_heads, head_dim]`; the pools may be one array.

`paged_decode` runs this module's Pallas-Triton kernel on other GPUs, in
interpret mode and for f32; on Hopper it routes bf16 / f16 q over pages of
that dtype or FP8 pages to the per-warp Mosaic-GPU kernel
(`paged_decode_mma`; `Config.default_for`). The TMA Mosaic-GPU kernel
(`paged_decode_mgpu`) runs when a config asks for it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pkvattn.pallas_kernels import _compat
from pkvattn.pallas_kernels import _fp8
from pkvattn.pallas_kernels import paged_decode_mgpu
from pkvattn.pallas_kernels import paged_decode_mma
from pkvattn.pallas_kernels._compat import pl
from pkvattn.pallas_kernels._compat import pltriton
from pkvattn.pallas_kernels._compat import suppress_triton_deprecation
from pkvattn.pallas_kernels._compat import triton_params

# Finite stand-in for -inf inside the kernel: with -inf, a block whose rows are
# all masked gives `exp(-inf - (-inf)) = NaN` in the online-softmax rescale.
DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

_LOG2E = math.log2(math.e)
_NUM_SMS = 132  # H100 / H200; only steers the split heuristic.
_SUPPORTED_HEAD_DIMS = (64, 128, 256)
BACKENDS = ("triton", "mosaic", "mosaic_mma")


def _next_pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Config:
  """Static tiling of the decode kernel.

  Attributes:
    pages_per_block: pages gathered per loop step (power of two); one step
      covers `pages_per_block * page_size` tokens.
    k_splits: flash-decoding splits of each sequence's visible pages.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages of the page loop.
    kv_eviction: L2 eviction hint for the streamed K/V loads
      (`"evict_first"` or None); K/V are read once, so they need not linger.
    backend: "triton" (this module's kernel), "mosaic_mma" (the per-warp
      Mosaic-GPU kernel, `paged_decode_mma`, see below) or "mosaic" (the
      TMA Mosaic-GPU kernel, `paged_decode_mgpu`: TMA or cp.async page loads, wgmma,
      Hopper only), whose
      steps are `pages_per_block * page_size` keys (64 or 128) through
      `num_stages` shared-memory stages, one consumer warpgroup
      (`num_warps` must be 4; kv_eviction unused), on a persistent grid of
      one CTA per SM.
    fp8_convert: Triton kernel, FP8 pages: where and how tiles convert to
      the dot dtype, "loaded", "operand", "asm" (inline PTX, compute
      capability >= 8.9), "mul" or "pairs" (the pools read as 16-bit words
      of two adjacent columns, split by inline PTX into even and odd
      columns on a GPU of compute capability >= 8.9; `pallas_kernels/
      _fp8.py`).
    pack_heads: Triton kernel: kv heads per program (a power of two
      dividing `num_kv_heads`, `pack_heads * head_dim <= 256`). Adjacent kv
      heads are contiguous in every pool layout (NHD), so the pools are
      viewed as `[num_pages, page_size, num_kv_heads / pack_heads,
      pack_heads * head_dim]` (a free reshape) and each query row is placed
      block-diagonally: the kernel loads q head `h` of kv head `k` into
      columns `(k % pack_heads) * head_dim` onward with zeros elsewhere, so
      its logits are its own head's, and keeps its own head's columns of the
      output. The
      program then reads `pack_heads * head_dim`-wide rows for
      `pack_heads * group_size` query rows (the dots do `pack_heads` times
      the FLOPs, which decode does not run short of). One difference from
      unpacked heads: a non-finite K value in an owned row of one head
      reaches the logits of the heads packed with it (0 * inf).
    num_ctas: mosaic backend: CTAs of its persistent grid (None = one per
      SM of the device, at most one per work item); fewer make each CTA
      serve more items (tests use this).
    keys_m: mosaic backend: the keys in the wgmmas' M dimension (`S^T = K
      q^T`, `O^T = V^T P^T`, the 16 loaded q rows as N) instead of the
      query rows padded to 64 (`paged_decode_mgpu`).
    prefetch_ids: Triton kernel: load each step's page ids one step ahead
      (carried through the loop) instead of at the step's start.
    cp_async: mosaic backend: load bf16 / f16 pages with `cp.async` (the
      producer warpgroup's threads, 16 bytes each at a time) instead of one
      TMA copy per page, where the q rows are in M (with `keys_m`, and for
      FP8 pages, which stage through their own ring, pages load by TMA).
    mma_tiles: mosaic_mma backend: 16-key tiles per warp step (1, 2 or 4;
      None = `paged_decode_mma.default_tiles`).

  Backend "mosaic_mma" is the per-warp Mosaic-GPU kernel
  (`paged_decode_mma`: `mma.sync` on fragments loaded straight from the
  pages, four warps per (kv head, sequence, split)); it uses `k_splits`
  and `mma_tiles` only.
  """
  pages_per_block: int
  k_splits: int
  num_warps: int = 4
  num_stages: int = 3
  kv_eviction: str | None = None
  backend: str = "triton"
  fp8_convert: str = "loaded"
  pack_heads: int = 1
  num_ctas: int | None = None
  keys_m: bool = False
  prefetch_ids: bool = False
  cp_async: bool = False
  mma_tiles: int | None = None

  def __post_init__(self):
    for name in ("pages_per_block", "k_splits", "pack_heads"):
      v = getattr(self, name)
      if v < 1 or v & (v - 1):
        raise ValueError(f"Invalid {name}: expected a power of two >= 1, got {v}")
    if self.fp8_convert not in _fp8.CONVERT_MODES:
      raise ValueError(f"Invalid fp8_convert: expected one of "
                       f"{_fp8.CONVERT_MODES}, got {self.fp8_convert!r}")
    if self.backend not in BACKENDS:
      raise ValueError(f"Invalid backend: expected one of {BACKENDS}, got "
                       f"{self.backend!r}")
    if self.mma_tiles is not None and (self.backend != "mosaic_mma"
                                       or self.mma_tiles not in (1, 2, 4)):
      raise ValueError(f"Invalid mma_tiles: expected None, or 1, 2 or 4 with "
                       f"the mosaic_mma backend, got {self.mma_tiles} "
                       f"(backend={self.backend!r})")
    if self.backend != "triton" and self.pack_heads != 1:
      raise ValueError(f"Invalid pack_heads for the mosaic backend: expected "
                       f"1, got {self.pack_heads}")
    if self.num_ctas is not None and (self.backend != "mosaic"
                                      or self.num_ctas < 1):
      raise ValueError(f"Invalid num_ctas: expected None, or >= 1 with the "
                       f"mosaic backend, got {self.num_ctas} "
                       f"(backend={self.backend!r})")
    if self.prefetch_ids and self.backend != "triton":
      raise ValueError(f"Invalid prefetch_ids: expected the triton backend, "
                       f"got {self.backend!r}")
    if self.cp_async and self.backend != "mosaic":
      raise ValueError(f"Invalid cp_async: expected the mosaic backend, got "
                       f"{self.backend!r}")
    if self.keys_m and self.backend != "mosaic":
      raise ValueError(f"Invalid keys_m: expected the mosaic backend, got "
                       f"{self.backend!r}")
    if self.backend == "mosaic" and self.num_warps != 4:
      raise ValueError(f"Invalid num_warps for the mosaic backend: expected "
                       f"4 (one consumer warpgroup), got {self.num_warps}")

  @classmethod
  def default_for(cls, *, batch_size: int, num_kv_heads: int, page_size: int,
                  max_pages: int, head_dim: int,
                  num_sms: int = _NUM_SMS, group_size: int | None = None,
                  dtype=None, kv_dtype=None, interpret: bool = False,
                  backend: str | None = None) -> "Config":
    """Heuristic config for one decode call (static shapes only).

    Backend: "mosaic_mma" where `_mma_default` says so (Hopper, bf16 / f16
    q with pages of that dtype or FP8 ones; its config is `_mma_config`'s;
    `group_size`, `dtype` and `kv_dtype` must be given), else "triton"
    (f32, other GPUs, interpret mode). `backend` forces one ("mosaic", the
    TMA Mosaic-GPU kernel, only so: `_mosaic_config`). The rest of this
    docstring is the Triton kernel's config.

    * A step covers >= 64 tokens (>= 32 at head_dim 256, to bound registers):
      small pages are gathered several at a time. 32-token steps lose up to
      30% when few programs are resident (too few bytes in flight). With
      many programs (>= 8 per SM, e.g. 256 sequences x 8 kv heads) 128-token
      steps at head_dim <= 128: 4% less kernel time there, 11% more at 512
      programs (H200 interleaved A/B, 2026-11-22, bench/decode_ab.py).
    * 4 warps, 3 pipeline stages: 8 warps lose 5-25%, and 3 stages were
      the most consistent choice across the four Llama-3-8B decode shapes.
      At head_dim 64 with fewer programs (SmolLM2-135M: 256 sequences x 3
      kv heads), 2 warps: 6.8 / 18.4 / 48.4 us against 7.4 / 18.6 / 49.2
      us with 4 at kv_lens ~80 / ~300 / ~960 (H200, 2026-11-23,
      bench/decode_step_ab.py). 32-token steps won at ~80 (6.0-6.1 us) but
      lost 10-18% at ~300 and ~960.
    * FP8 pages on a GPU with e4m3 -> f16 conversion (compute capability >=
      8.9): both tiles read as 16-bit words of two adjacent columns
      (`fp8_convert="pairs"`, `pallas_kernels/_fp8.py`) on 2 warps, 3 stages,
      splits for 2 programs per SM (4 at head_dim 64 without packing), page
      ids a step ahead where a step covers <= 64 tokens. Head_dim 64 with an
      even number of kv heads packs two per program (`pack_heads=2`: 128-byte
      rows, 8 of the MMA's 16 rows). Steps of 64 tokens, 32 at head_dim 256 or
      with > 4 programs per SM. Kernel time against bf16 pages' default
      (2026-11-26, `bench/fp8_decode_diag.py --sweep pairs`,
      `fp8_decode_diag_pairs_sweep_*.json`; the rules it replaced in
      brackets): Llama-3-8B heads B=64 S=4096 p16 / p64, B=8 S=16384, B=256
      S=1024: H200 0.55 / 0.55 / 0.59 / 0.56x (0.71 / 0.63 / 0.75 / 0.67x),
      H100 0.56 / 0.55 / 0.57 / 0.55x (0.58 / 0.55 / 0.61 / 0.58x);
      Llama-3.2-1B heads packed, B=256 S=1024 / B=64 S=4096: H200 0.53 / 0.54x
      (0.67-0.72 / 0.66x), H100 0.53 / 0.54x; SmolLM2 heads B=256 S=1024 /
      B=64 S=4096: H200 0.70 / 0.73x (0.82 / 0.81x), H100 0.62 / 0.64x (0.62 /
      0.65x); Gemma 3 270M heads B=64 / B=256: H200 0.59 / 0.59x (0.83-0.85x),
      H100 0.58 / 0.58x. Around the default (half or twice the step, the ids
      at each step, 4 warps, 4 stages, twice the splits) nothing wins on the
      H200 but 64-token steps for Gemma 3 heads at B=256 (0.57x). On the H100
      the ids at each step win by 1-3% and 64-token steps at head_dim 256 by
      up to 12% (B=256); not adopted, as they lose or tie on the H200.
      128-token steps with the ids a step ahead lose (H200, scratch grid:
      0.59-0.70x against 0.54-0.58x), so they load them at each step.
    * Splits: enough programs (`batch_size * num_kv_heads * k_splits`) for
      about 2 per SM (H200 sweep, 2026-11-21: more splits only add combine
      traffic once the SMs are busy), 4 per SM for 2-warp programs (SmolLM2
      heads, 64 sequences at 4,096: 77.7 against 80.6 us kernel time with 2,
      H100, 2026-11-25, bench/decode_heads_sweep.py), but each split keeps
      >= 2 steps of the longest sequence, so short contexts are not split
      into empty programs. With one split the kernel writes the final output
      itself (no combine).
    """
    if backend is not None and backend not in BACKENDS:
      raise ValueError(f"Invalid backend: expected None or one of "
                       f"{BACKENDS}, got {backend!r}")
    kw = dict(batch_size=batch_size, num_kv_heads=num_kv_heads,
              page_size=page_size, max_pages=max_pages, head_dim=head_dim,
              num_sms=num_sms, kv_dtype=kv_dtype)
    if backend == "mosaic":
      return _mosaic_config(**kw)
    if backend == "mosaic_mma" or backend is None and not interpret and (
        group_size is not None and _mma_default(
            group_size=group_size, head_dim=head_dim, page_size=page_size,
            dtype=dtype, kv_dtype=kv_dtype)):
      return _mma_config(**kw)
    programs = batch_size * num_kv_heads
    fp8_cvt = (not interpret and kv_dtype is not None
               and jnp.dtype(kv_dtype) == jnp.float8_e4m3fn
               and _compat.has_fp8_cvt())
    if fp8_cvt:
      # head_dim 64: two kv heads per program where their number is even;
      # an odd number keeps one, 64-token steps and 4 programs per SM.
      odd_d64 = head_dim == 64 and num_kv_heads % 2 == 1
      pack = 2 if head_dim == 64 and not odd_d64 else 1
      programs //= pack
      block_tokens = (64 if odd_d64 or (head_dim <= 128
                                        and programs <= 4 * num_sms) else 32)
      pages_per_block = max(1, block_tokens // page_size)
      return cls(pages_per_block=pages_per_block,
                 k_splits=_default_splits(programs, max_pages,
                                          pages_per_block, num_sms,
                                          per_sm=4 if odd_d64 else 2),
                 num_warps=2, num_stages=3, fp8_convert="pairs",
                 pack_heads=pack,
                 prefetch_ids=pages_per_block * page_size <= 64)
    block_tokens = 32 if head_dim > 128 else 64
    num_warps, num_stages = 4, 3
    if head_dim <= 128 and programs >= 8 * num_sms:
      block_tokens = 128
    elif head_dim <= 64:
      num_warps = 2
    pages_per_block = max(1, block_tokens // page_size)
    k_splits = _default_splits(programs, max_pages, pages_per_block, num_sms,
                               per_sm=4 if num_warps == 2 else 2)
    return cls(pages_per_block=pages_per_block, k_splits=k_splits,
               num_warps=num_warps, num_stages=num_stages)


def _mma_default(*, group_size, head_dim, page_size, dtype,
                 kv_dtype) -> bool:
  """The per-warp Mosaic-GPU kernel (`paged_decode_mma`) is the default on
  compute capability 9.0 for bf16 / f16 q with pages of that dtype or FP8
  ones, head_dim 64 / 128 / 256, groups 1..8, pages of 8..128 tokens. It
  takes the Hopper decode off the deprecated Pallas-Triton backend.

  Kernel time, same process as FlashInfer 0.7.2 (`bench/decode_mma.py`,
  `bench/decode_mma_fp8.py`, `bench/results/decode_mma*.json`):

  * bf16 pages of 16 tokens, the nine decode specs (H100 and H200,
    2026-11-26): 0.99-1.03x the Triton kernel's time in the 16-layer
    program (`bench/decode_layers.py`), 1.00-1.18x FlashInfer's faster
    decode; the engine (SmolLM2 shape, 256 x 256 tokens) gave the same
    tokens (`bench/engine_rope_ab.py --op decode`).
  * 128-token pages (2026-11-26, `decode_mma_*_p128_tma.json`): 0.99-1.06x
    (H200) / 0.99-1.02x (H100) the speed of the TMA Mosaic kernel
    (`paged_decode_mgpu`, the default there before) on five head_dim 64 /
    128 specs, 1.01-1.11x FlashInfer's faster decode; at head_dim 256
    (Gemma 3 270M heads B=64 / B=256, on Triton before) 1.16 / 1.25x
    (H200) and 1.09 / 1.10x (H100) the Triton kernel's speed, 1.02-1.04x
    FlashInfer's.
  * FP8 pages of 16 tokens, the nine specs (`decode_mma_fp8_*.json`):
    1.03-1.12x the speed of the Triton kernel's FP8 default (column pairs)
    on the H100 and 0.96-1.20x on the H200 (0.96x: Llama-3-8B heads B=256
    S=1024), 1.21-1.93x / 1.47-2.27x that of FlashInfer's FP8 decode; at
    128-token pages (H200) 1.05 / 1.26 / 2.68x Triton's on Llama-3-8B /
    SmolLM2 / Gemma 3 heads.
  """
  if dtype is None:
    return False
  if paged_decode_mma.supports(
      dtype=dtype, kv_dtype=dtype if kv_dtype is None else kv_dtype,
      head_dim=head_dim, page_size=page_size,
      group_size=group_size) is not None:
    return False
  return _compat.is_hopper()


# Pages up to which the Mosaic-GPU kernel loads pages by `cp.async` rather
# than one TMA copy per page. Kernel time TMA / cp.async (H200, 2026-11-26,
# B=64 S=4096, bench/results/decode_mosaic_pages_NVIDIA_H200.json): 1.35x
# at 8-token pages on SmolLM2 heads (90.7 / 67.1 us), 1.40x on 32/8/64,
# 1.00x on Llama-3-8B heads; at 16-token pages 0.97-1.03x over eleven
# specs (there and decode_mosaic_cp_async_NVIDIA_H200.json), no clear
# winner, so TMA stays there; from 32 tokens TMA is 1.00-1.09x faster.
# H100, 8-token pages: 1.11 / 1.17 / 1.00x on the same three head shapes
# (decode_mosaic_pages_p8_NVIDIA_H100_80GB_HBM3.json).
CP_ASYNC_MAX_PAGE_SIZE = 8


def _mosaic_config(*, batch_size, num_kv_heads, page_size, max_pages,
                   head_dim, num_sms, kv_dtype=None) -> Config:
  """The Mosaic-GPU kernel's config: 128-key steps through 2 stages (at
  head_dim 64, 4 or 5 stages took 2-4% more kernel time in two H100 runs,
  2026-11-25; 3 do not fit at head_dim 128 next to the two q buffers and
  the output tile); splits for about two items per persistent CTA, each
  keeping >= 2 steps (twice the splits lost 1.5-9% on the seven
  bench_decode_mosaic specs). Head_dim 256 takes 64-key steps: 128-key
  stages do not fit. FP8 pages take the keys-in-M build (`keys_m`), 0.86-
  0.94x of the rows-in-M build's kernel time at 128-key steps (H200,
  2026-11-25, decode_mosaic_fp8_keys_m_NVIDIA_H200.json). Pages of 8
  tokens load by `cp.async` (`CP_ASYNC_MAX_PAGE_SIZE`)."""
  fp8 = kv_dtype is not None and jnp.dtype(kv_dtype) == jnp.float8_e4m3fn
  block_kv = 64 if head_dim > 128 else 128
  pages_per_block = max(1, block_kv // page_size)
  k_splits = _default_splits(batch_size * num_kv_heads, max_pages,
                             pages_per_block, num_sms)
  return Config(pages_per_block=pages_per_block, k_splits=k_splits,
                num_stages=2, backend="mosaic", keys_m=fp8,
                cp_async=not fp8 and page_size <= CP_ASYNC_MAX_PAGE_SIZE)


# CTAs per SM the per-warp Mosaic-GPU kernel's splits aim at (rounded to
# the nearest power of two of splits).
MMA_CTAS_PER_SM = 2.5


def _mma_config(*, batch_size, num_kv_heads, page_size, max_pages, head_dim,
                num_sms, kv_dtype=None,
                ctas_per_sm: float | None = None) -> Config:
  """The per-warp Mosaic-GPU kernel's config: 16-key steps, and splits for
  about `ctas_per_sm` CTAs per SM (None: `MMA_CTAS_PER_SM`, half at
  head_dim 256, whose CTAs hold about twice the registers), the nearest
  power of two, each split keeping >= 2 rounds of its four warps' steps.
  Kernel time on the nine `bench/decode_mma.py` specs (H100, 2026-11-26):
  about 4 CTAs per SM took 1.6-7% more than about 2; rounding the splits up
  rather than to the nearest power of two took 2-8% more on Llama-3-8B
  heads B=8 S=16384 and on Gemma 3 270M heads (twice the splits), rounding
  down 4% more on SmolLM2 heads B=64 (192 CTAs on 132 SMs); Gemma 3 heads
  B=64 at 4 splits 1.03x the time of 2.

  FP8 pages (half the bytes per key, half the registers in flight) take
  32-key steps at head_dim <= 128 (`mma_tiles=2`; 16-key steps took
  1.01-1.24x the time on the seven such specs on the H200 and 0.98-1.11x
  on the H100, 64-key steps 0.96-1.22x and 1.02-1.08x; at head_dim 256,
  32-key steps took 1.03-1.04x on the H200) and `MMA_CTAS_PER_SM` at every
  head_dim (at head_dim 256 half as many CTAs, the 16-bit rule, took 1.17x
  / 1.06x the time on Gemma 3 270M heads B=64, H200 / H100; 2026-11-26,
  `bench/decode_mma_fp8.py`)."""
  fp8 = kv_dtype is not None and jnp.dtype(kv_dtype) == jnp.float8_e4m3fn
  if ctas_per_sm is None:
    ctas_per_sm = MMA_CTAS_PER_SM / (2 if head_dim > 128 and not fp8 else 1)
  tiles = (2 if fp8 and head_dim <= 128
           else paged_decode_mma.default_tiles(head_dim))
  round_keys = paged_decode_mma.WARPS * paged_decode_mma.KEYS * tiles
  pages_per_round = max(1, round_keys // page_size)
  want = ctas_per_sm * num_sms / max(1, batch_size * num_kv_heads)
  splits = 1 << max(0, round(math.log2(want))) if want > 1 else 1
  max_rounds = max(1, -(-max_pages // pages_per_round))
  while splits > 1 and 2 * splits > max_rounds:
    splits //= 2
  return Config(pages_per_block=1, k_splits=min(splits, 64),
                backend="mosaic_mma", mma_tiles=2 if tiles == 2 else None)


def _default_splits(programs: int, max_pages: int, pages_per_block: int,
                    num_sms: int, per_sm: int = 2) -> int:
  """Splits for about `per_sm` programs per SM, each keeping >= 2 steps of
  the longest sequence (a power of two, at most 64)."""
  want = _next_pow2(max(1, -(-per_sm * num_sms // programs)))
  max_steps = max(1, -(-max_pages // pages_per_block))
  cap = _next_pow2(max(1, max_steps // 2))
  if cap > max_steps // 2 and cap > 1:
    cap //= 2
  return max(1, min(want, cap, 64))


def _paged_decode_kernel(
    kv_lens_ref,   # i32[batch_size] (whole array)
    k_table_ref,   # i32[max_pages] (row b)
    v_table_ref,   # i32[max_pages] (row b)
    q_ref,         # [num_qo_heads, head_dim] (row b)
    sinks_ref,     # f32[num_qo_heads] | None
    k_scale_ref,   # f32[1] of FP8 pages | None
    v_scale_ref,   # f32[1] of FP8 pages | None
    k_pool_ref,    # [num_pages, page_size, <kv head k>, pack * head_dim]
    v_pool_ref,    # [num_pages', page_size, <kv head k>, pack * head_dim]
    o_ref,         # final: [num_qo_heads, head_dim] q.dtype (row b);
                   # else f32[group_padded, head_dim] (split s of head k)
    lse_ref,       # final: f32[num_qo_heads]; else f32[group_padded]
    *,
    sm_scale: float,
    window_left: int,
    logits_soft_cap: float | None,
    pages_per_block: int,
    k_splits: int,
    group_size: int,
    group_padded: int,
    kv_eviction: str | None,
    fp8_convert: str = "loaded",
    prefetch_ids: bool = False,
    interpret: bool = False,
):
  b = pl.program_id(0)
  kv_head = pl.program_id(1)
  split = pl.program_id(2)
  page_size = k_pool_ref.shape[1]
  # FP8 pages read as 16-bit words of column pairs (`fp8_convert="pairs"`):
  # the pools' last dimension holds head_dim / 2 words.
  pairs = k_scale_ref is not None and fp8_convert == "pairs"
  width = k_pool_ref.shape[-1]  # words per row with `pairs`
  head_dim = width * 2 if pairs else width  # pack_heads * q's head_dim
  q_dim = q_ref.shape[-1]
  pack = head_dim // q_dim
  block_k = pages_per_block * page_size
  final = k_splits == 1

  # Rows of this kv head's query group inside q[b]; rows >= group_size are
  # padding (masked: never loaded or stored).
  group_row = lax.iota(jnp.int32, group_padded)
  row_ok = group_row < group_size
  head_rows = kv_head * group_size + group_row
  step_cols = 2 if pairs else 1  # q and output columns per word

  def load_q(first):
    """q's columns `first, first + step_cols, ...` of the (packed) width."""
    shape = (group_padded, head_dim // step_cols)
    rows = jnp.broadcast_to(head_rows[:, None], shape)
    cols = lax.broadcasted_iota(jnp.int32, shape, 1) * step_cols + first
    mask = jnp.broadcast_to(row_ok[:, None], shape)
    if pack > 1:
      # Packed kv heads (`Config.pack_heads`): row r belongs to the
      # (r // (group_size / pack))-th head of the pack and owns that head's
      # q_dim columns; q is 0 elsewhere, and the output keeps owned columns.
      block = group_row // (group_size // pack)
      mask = mask & (cols // q_dim == jnp.broadcast_to(block[:, None], shape))
      cols = cols % q_dim
    return pltriton.load(q_ref.at[rows, cols], mask=mask, other=0.0)

  # Output columns (per word with `pairs`: the even ones, `+ 1` the odd).
  o_shape = (group_padded, q_dim // step_cols)
  q_rows = jnp.broadcast_to(head_rows[:, None], o_shape)
  q_cols = lax.broadcasted_iota(jnp.int32, o_shape, 1) * step_cols
  q_mask = jnp.broadcast_to(row_ok[:, None], o_shape)
  qs = tuple(load_q(first) for first in range(step_cols))

  kv_len = kv_lens_ref[b]
  lo = jnp.int32(0)
  if window_left >= 0:
    lo = jnp.maximum(kv_len - 1 - window_left, 0)
  first_page = lo // page_size
  end_page = (kv_len + page_size - 1) // page_size
  num_pages = jnp.maximum(end_page - first_page, 0)
  # Pages per split, rounded up to whole steps so splits start on step edges.
  steps = (num_pages + pages_per_block - 1) // pages_per_block
  steps_per_split = (steps + k_splits - 1) // k_splits
  split_start = first_page + split * steps_per_split * pages_per_block
  split_end = jnp.minimum(split_start + steps_per_split * pages_per_block,
                          end_page)
  num_steps = jnp.maximum(
      (split_end - split_start + pages_per_block - 1) // pages_per_block, 0)

  precision = (lax.Precision.HIGHEST if qs[0].dtype == jnp.float32
               else None)
  # exp2 with log2(e) folded into the scale; with a soft cap the cap applies to
  # the sm_scale'd logits first (FlashInfer), then log2(e).
  qk_scale = sm_scale if logits_soft_cap is not None else sm_scale * _LOG2E
  v_scale = None
  if k_scale_ref is not None:
    # FP8 pages: K's scale folds into the logits scale and V's into the
    # output, both exact (per-tensor scales); the tiles and q convert to f16
    # for the dots (f32 for an f32 q): `_fp8`'s notes.
    qk_scale = qk_scale * k_scale_ref[0]
    v_scale = v_scale_ref[0]
    dot_dtype = _fp8.dot_dtype(qs[0].dtype)
    qs = tuple(_fp8.query_for_dots(q) for q in qs)
  page_iota = lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size), 0)
  row_iota = lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size), 1)

  def page_ids(step):
    """The K and V page ids of `step` (0 past the split's pages)."""
    page0 = split_start + step * pages_per_block
    page_ok = page0 + lax.iota(jnp.int32, pages_per_block) < split_end
    return tuple(
        pltriton.load(table_ref.at[pl.ds(page0, pages_per_block)],
                      mask=page_ok, other=0)
        for table_ref in (k_table_ref, v_table_ref))

  def body(step, carry):
    if prefetch_ids:
      # The next step's page ids load while this step's tiles do (carried),
      # so the tile loads do not wait on a table load first.
      acc, m_prev, l_prev, k_ids, v_ids = carry
      next_ids = page_ids(step + 1)
    else:
      acc, m_prev, l_prev = carry
      k_ids, v_ids = page_ids(step)
      next_ids = ()
    page0 = split_start + step * pages_per_block
    tok = (page0 + page_iota) * page_size + row_iota  # [ppb, page_size]
    tok_ok = (tok < kv_len) & (tok >= lo) & (page0 + page_iota < split_end)
    # Gather with one int index per dim, all of shape [block_k, head_dim] (the
    # form both the Triton lowering and interpret mode accept).
    shape = (block_k, width)
    rows = jnp.broadcast_to(row_iota.reshape(block_k, 1), shape)
    cols = lax.broadcasted_iota(jnp.int32, shape, 1)
    load_mask = jnp.broadcast_to(tok_ok.reshape(block_k, 1), shape)

    def gather(pool_ref, ids):
      ids = jnp.broadcast_to(ids[:, None], (pages_per_block, page_size))
      ids = jnp.broadcast_to(ids.reshape(block_k, 1), shape)
      return pltriton.load(pool_ref.at[ids, rows, cols], mask=load_mask,
                           other=0 if pairs else 0.0,
                           eviction_policy=kv_eviction)

    k = gather(k_pool_ref, k_ids)  # [block_k, width]
    v = gather(v_pool_ref, v_ids)
    if pairs:
      # Even and odd columns as two half-width tiles each: the logits sum
      # two dots, and each half of V feeds its own accumulator.
      ks = _fp8.split_pairs(k, dot_dtype, interpret)
      vs = _fp8.split_pairs(v, dot_dtype, interpret)
    elif k_scale_ref is not None:
      # K is contracted over head_dim, its contiguous dimension: Triton's
      # placement reads it in wide words. V is contracted over tokens.
      ks = ((_fp8.convert_asm(k, dot_dtype, interpret)
             if fp8_convert == "asm" else k.astype(dot_dtype)),)
      vs = (_fp8.convert(v, dot_dtype, tok_ok.reshape(block_k), fp8_convert,
                         interpret),)
    else:
      ks, vs = (k,), (v,)
    s = None  # [G, block_k]
    for q, k in zip(qs, ks):
      part = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                             precision=precision,
                             preferred_element_type=jnp.float32)
      s = part if s is None else s + part
    s = s * qk_scale
    if logits_soft_cap is not None:
      s = (logits_soft_cap * _LOG2E) * jnp.tanh(s * (1.0 / logits_soft_cap))
    s = jnp.where(tok_ok.reshape(1, block_k), s, DEFAULT_MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=-1))
    alpha = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = l_prev * alpha + p.sum(axis=-1)
    p = p.astype(vs[0].dtype)
    acc = tuple(
        a * alpha[:, None] + lax.dot_general(
            p, v, (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)
        for a, v in zip(acc, vs))
    return (acc, m_next, l_next) + next_ids

  acc = tuple(jnp.zeros((group_padded, head_dim // step_cols), jnp.float32)
              for _ in range(step_cols))
  m = jnp.full((group_padded,), DEFAULT_MASK_VALUE, jnp.float32)
  l = jnp.zeros((group_padded,), jnp.float32)
  carry = (acc, m, l) + (page_ids(0) if prefetch_ids else ())
  accs, m, l = lax.fori_loop(0, num_steps, body, carry)[:3]
  if v_scale is not None:
    accs = tuple(acc * v_scale for acc in accs)

  has = l > 0.0
  l_safe = jnp.where(has, l, 1.0)
  # m is in log2 units (log2(e) folded into the logits).
  lse = jnp.where(has, (m + jnp.log2(l_safe)) * (1.0 / _LOG2E), -jnp.inf)
  if pack > 1:  # each row's own head's columns: [group_padded, q_dim]
    # (a 3-D mask, not the q load's: that one would stay live in registers
    # through the loop)
    def own_columns(acc):
      acc3 = acc.reshape(group_padded, pack, acc.shape[1] // pack)
      shape3 = acc3.shape
      block3 = lax.broadcasted_iota(jnp.int32, shape3, 0) // (
          group_size // pack)
      own3 = lax.broadcasted_iota(jnp.int32, shape3, 1) == block3
      return jnp.where(own3, acc3, 0.0).sum(1)
    accs = tuple(own_columns(acc) for acc in accs)

  def store_out(ref, rows, out):
    for first, part in enumerate(out):  # with `pairs`: even, then odd
      pltriton.store(ref.at[rows, q_cols + first], part.astype(ref.dtype),
                     mask=q_mask)

  if not final:
    if pairs:
      store_out(o_ref, jnp.broadcast_to(group_row[:, None], q_mask.shape),
                tuple(acc / l_safe[:, None] for acc in accs))
    else:
      pltriton.store(o_ref, (accs[0] / l_safe[:, None]).astype(o_ref.dtype),
                     mask=q_mask)
    pltriton.store(lse_ref, lse, mask=row_ok)
    return
  den = l
  if sinks_ref is not None:
    # The sink joins the denominator only (gpt-oss): rescale to a common max.
    sink = pltriton.load(sinks_ref.at[head_rows], mask=row_ok, other=0.0)
    sink = sink.astype(jnp.float32) * _LOG2E
    m_all = jnp.maximum(m, sink)
    alpha = jnp.exp2(m - m_all)
    accs = tuple(acc * alpha[:, None] for acc in accs)
    den = l * alpha + jnp.exp2(sink - m_all)
  den = jnp.where(den > 0.0, den, 1.0)
  store_out(o_ref, q_rows, tuple(acc / den[:, None] for acc in accs))
  pltriton.store(lse_ref.at[head_rows], lse, mask=row_ok)


def _paged_decode_call(
    q,         # [batch_size, num_qo_heads, head_dim]
    sinks,     # f32[num_qo_heads] | None
    k_pool,    # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool,    # [num_pages', page_size, num_kv_heads, head_dim]
    k_table,   # i32[batch_size, max_pages]
    v_table,   # i32[batch_size, max_pages]
    kv_lens,   # i32[batch_size]
    scales=None,  # (k_scale f32[1], v_scale f32[1]) of FP8 pages | None
    *,
    sm_scale: float,
    window_left: int,
    logits_soft_cap: float | None,
    config: Config,
    interpret: bool,
):
  """Runs the kernel.

  With `config.k_splits == 1` returns the final `(out [batch_size,
  num_qo_heads, head_dim] q.dtype, lse f32[batch_size, num_qo_heads])` (sinks
  applied). Otherwise returns per-split partials `(o f32[batch_size,
  num_kv_heads, k_splits, group_padded, head_dim], lse f32[batch_size,
  num_kv_heads, k_splits, group_padded])`, normalised per split, of which
  only the first `group_size` rows are written; empty splits give `o = 0,
  lse = -inf`; sinks are left to `_combine`.
  """
  batch_size, num_qo_heads, head_dim = q.shape
  _, page_size, num_kv_heads, width = k_pool.shape  # width: packed heads
  group_size = num_qo_heads // num_kv_heads
  group_padded = max(16, _next_pow2(group_size))
  max_pages = k_table.shape[1]
  ks = config.k_splits
  final = ks == 1
  if not final:
    sinks = None
  kernel = functools.partial(
      _paged_decode_kernel, sm_scale=sm_scale, window_left=window_left,
      logits_soft_cap=logits_soft_cap, pages_per_block=config.pages_per_block,
      k_splits=ks, group_size=group_size, group_padded=group_padded,
      kv_eviction=config.kv_eviction, fp8_convert=config.fp8_convert,
      prefetch_ids=config.prefetch_ids, interpret=interpret)
  pool_spec = lambda n: pl.BlockSpec(  # noqa: E731
      (n, page_size, None, width), lambda b, k, s: (0, 0, k, 0))
  if final:
    out_specs = [
        pl.BlockSpec((None, num_qo_heads, head_dim), lambda b, k, s: (b, 0, 0)),
        pl.BlockSpec((None, num_qo_heads), lambda b, k, s: (b, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch_size, num_qo_heads, head_dim), q.dtype),
        jax.ShapeDtypeStruct((batch_size, num_qo_heads), jnp.float32),
    ]
  else:
    out_specs = [
        pl.BlockSpec((None, None, None, group_padded, head_dim),
                     lambda b, k, s: (b, k, s, 0, 0)),
        pl.BlockSpec((None, None, None, group_padded),
                     lambda b, k, s: (b, k, s, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct(
            (batch_size, num_kv_heads, ks, group_padded, head_dim),
            jnp.float32),
        jax.ShapeDtypeStruct((batch_size, num_kv_heads, ks, group_padded),
                             jnp.float32),
    ]
  name = (f"paged_decode_g{group_size}_d{width}_ps{page_size}"
          f"_ppb{config.pages_per_block}_ks{ks}_w{config.num_warps}"
          f"_s{config.num_stages}"
          f"{'' if config.fp8_convert == 'loaded' else '_fp8' + config.fp8_convert}"
          f"{'' if config.pack_heads == 1 else f'_pk{config.pack_heads}'}"
          f"{'_pf' if config.prefetch_ids else ''}"
          f"{'_' + config.kv_eviction if config.kv_eviction else ''}")
  return pl.pallas_call(
      kernel,
      grid=(batch_size, num_kv_heads, ks),
      in_specs=[
          pl.BlockSpec((batch_size,), lambda b, k, s: (0,)),
          pl.BlockSpec((None, max_pages), lambda b, k, s: (b, 0)),
          pl.BlockSpec((None, max_pages), lambda b, k, s: (b, 0)),
          pl.BlockSpec((None, num_qo_heads, head_dim), lambda b, k, s: (b, 0, 0)),
          None if sinks is None else pl.BlockSpec((num_qo_heads,),
                                                  lambda b, k, s: (0,)),
          *([None, None] if scales is None else
            [pl.BlockSpec((1,), lambda b, k, s: (0,))] * 2),
          pool_spec(k_pool.shape[0]),
          pool_spec(v_pool.shape[0]),
      ],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=triton_params(config.num_warps, config.num_stages),
      interpret=interpret,
      name=name,
  )(kv_lens, k_table, v_table, q, sinks, *(scales or (None, None)), k_pool,
    v_pool)


def _combine(o, lse, sinks, group_size):
  """LSE-combine of the splits; sinks join the denominator only.

  o f32[B, Hkv, S, Gp, D], lse f32[B, Hkv, S, Gp], sinks f32[Hkv, G] | None.
  Returns (out f32[B, Hkv, G, D], lse f32[B, Hkv, G]).
  """
  o = o[..., :group_size, :]
  lse = lse[..., :group_size]
  m = jnp.max(lse, axis=2)  # [B, Hkv, G]
  if sinks is not None:
    m = jnp.maximum(m, sinks[None])
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - m_safe[:, :, None]), 0.0)
  den = jnp.sum(w, axis=2)
  out = jnp.sum(w[..., None] * jnp.where(w[..., None] > 0, o, 0.0), axis=2)
  lse_total = jnp.where(den > 0, jnp.log(jnp.where(den > 0, den, 1.0)) + m_safe,
                        -jnp.inf)
  if sinks is not None:
    den = den + jnp.exp(sinks[None] - m_safe)
  out = out / jnp.where(den > 0, den, 1.0)[..., None]
  return out, lse_total


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "window_left", "logits_soft_cap", "interpret",
                     "config"))
def paged_decode(
    q,          # [batch_size, num_qo_heads, head_dim]
    k_pool,     # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool,     # [num_pages', page_size, num_kv_heads, head_dim]
    k_table,    # i32[batch_size, max_pages]
    v_table,    # i32[batch_size, max_pages]
    kv_lens,    # i32[batch_size]
    sinks=None,  # f32[num_qo_heads] | None
    *,
    sm_scale: float,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    interpret: bool = False,
    config: Config | None = None,
    k_scale=None,  # f32[]: FP8 pages
    v_scale=None,  # f32[]: FP8 pages
):
  """Flash-decoding over a paged KV cache (see the module docstring).

  Args:
    q: `[batch_size, num_qo_heads, head_dim]`, bf16 / f16 / f32.
    k_pool, v_pool: `[num_pages, page_size, num_kv_heads, head_dim]`, dtype of
      `q` (may be the same array; their `num_pages` may differ), or
      float8_e4m3fn with `k_scale` / `v_scale`.
    k_table, v_table: `i32[batch_size, max_pages]`; block `i` of sequence `b`
      is `k_pool[k_table[b, i]]` / `v_pool[v_table[b, i]]`. Only entries in
      `[first visible page, cdiv(kv_lens[b], page_size))` are read.
    kv_lens: `i32[batch_size]`, tokens including the current one; the query
      sits at position `kv_lens[b] - 1`.
    sinks: optional `f32[num_qo_heads]` logits joining the denominator only.
    sm_scale: static softmax scale applied to `q . k`.
    window_left: static; keys `j >= kv_lens[b] - 1 - window_left` only; -1 = all.
    logits_soft_cap: static; `c * tanh(s / c)` on the scaled logits; None = off.
    interpret: static; Pallas interpret mode (CPU tests).
    config: static `Config`; None = `Config.default_for(...)`.
    k_scale, v_scale: f32 scalars (traced) of FP8 pages: a stored value `x`
      means `x * scale` (read in the kernel: K's scale folded into the
      logits scale, V's into the output).

  Returns:
    `(out [batch_size, num_qo_heads, head_dim] q.dtype,
    lse f32[batch_size, num_qo_heads])`, natural-log LSE over visible keys,
    sink excluded; `kv_lens[b] == 0` gives zeros and `-inf`.

  Raises:
    NotImplementedError: head_dim not in {64, 128, 256} or a page_size that is
      not a power of two in [8, 128].
    ValueError: a `config` with `backend="mosaic"` in interpret mode or on
      a case `paged_decode_mgpu` does not serve (its errors); one with
      `backend="mosaic_mma"` in interpret mode, with FP8 pages where JAX's
      first device is a GPU below compute capability 8.9, or on a case
      `paged_decode_mma` does not serve (its errors);
      `fp8_convert` "asm" or "pairs" with FP8 pages where JAX's first
      device is a GPU below compute capability 8.9 (elsewhere, e.g.
      lowering for CUDA on a CPU host, it lowers); `config.pack_heads` that
      does not divide
      num_kv_heads or makes rows wider than 256.
  """
  batch_size, num_qo_heads, head_dim = q.shape
  _, page_size, num_kv_heads, _ = k_pool.shape
  if head_dim not in _SUPPORTED_HEAD_DIMS:
    raise NotImplementedError(f"paged_decode kernel: unsupported {head_dim=}")
  if page_size < 8 or page_size > 128 or page_size & (page_size - 1):
    raise NotImplementedError(f"paged_decode kernel: unsupported {page_size=}")
  group_size = num_qo_heads // num_kv_heads
  if config is None:
    config = _default_config(q, k_pool, k_table, interpret)
  _check_fp8_convert(config, k_scale, interpret)
  if sinks is not None:
    sinks = sinks.astype(jnp.float32)
  pack = config.pack_heads
  if pack > 1:
    if (num_kv_heads % pack or pack * head_dim > 256
        or config.backend != "triton"):
      raise ValueError(
          f"Invalid config.pack_heads: expected a divisor of num_kv_heads="
          f"{num_kv_heads} with pack_heads * head_dim <= 256 on the triton "
          f"backend, got {pack} (head_dim={head_dim}, "
          f"backend={config.backend!r})")
    k_pool = _pack_pool(k_pool, pack)
    v_pool = _pack_pool(v_pool, pack)
    num_kv_heads //= pack
    group_size *= pack
  if (config.fp8_convert == "pairs" and k_scale is not None
      and config.backend == "triton"):
    k_pool, v_pool = _fp8.pair_view(k_pool), _fp8.pair_view(v_pool)
  if config.backend == "mosaic_mma":
    return _mma_decode(q, k_pool, v_pool, k_table, v_table, kv_lens, sinks,
                       k_scale, v_scale, sm_scale=sm_scale,
                       window_left=window_left,
                       logits_soft_cap=logits_soft_cap, config=config,
                       interpret=interpret)
  if config.backend == "mosaic":
    return _mosaic_decode(q, k_pool, v_pool, k_table, v_table, kv_lens, sinks,
                          k_scale, v_scale, sm_scale=sm_scale,
                          window_left=window_left,
                          logits_soft_cap=logits_soft_cap, config=config,
                          interpret=interpret)
  scales = None
  if k_scale is not None:
    # Two f32[1] inputs (free reshapes), not one stacked pair: a stack is
    # one more small XLA kernel per call.
    scales = tuple(jnp.asarray(x, jnp.float32).reshape(1)
                   for x in (k_scale, v_scale))
  with suppress_triton_deprecation():
    o, lse = _paged_decode_call(
        q, sinks, k_pool, v_pool, k_table.astype(jnp.int32),
        v_table.astype(jnp.int32), kv_lens.astype(jnp.int32), scales,
        sm_scale=float(sm_scale), window_left=int(window_left),
        logits_soft_cap=logits_soft_cap, config=config, interpret=interpret)
  if config.k_splits == 1:
    return o, lse
  sk = None if sinks is None else sinks.reshape(num_kv_heads, group_size)
  out, lse = _combine(o, lse, sk, group_size)
  return (out.reshape(batch_size, num_qo_heads, head_dim).astype(q.dtype),
          lse.reshape(batch_size, num_qo_heads))


def _default_config(q, k_pool, k_table, interpret: bool,
                    batch_size: int | None = None) -> Config:
  """`Config.default_for` a call with these q heads, pages and tables
  (`batch_size` sequences; None: `k_table`'s rows)."""
  rows, max_pages = k_table.shape
  batch_size = rows if batch_size is None else batch_size
  _, page_size, num_kv_heads, _ = k_pool.shape
  _, num_qo_heads, head_dim = q.shape
  return Config.default_for(
      batch_size=batch_size, num_kv_heads=num_kv_heads, page_size=page_size,
      max_pages=max_pages, head_dim=head_dim,
      group_size=num_qo_heads // num_kv_heads, dtype=q.dtype,
      kv_dtype=k_pool.dtype, interpret=interpret)


def _has_row(q_rows, num_tokens: int):
  """Which sequences have a query row: `0 <= q_rows[b] < num_tokens`."""
  return (q_rows >= 0) & (q_rows < num_tokens)


def _check_fp8_convert(config: Config, k_scale, interpret: bool) -> None:
  """Raises ValueError where FP8 pages would take a conversion the GPU
  lacks: the mosaic_mma backend and `fp8_convert` "asm" / "pairs" convert
  e4m3 pairs with `cvt.rn.f16x2.e4m3x2` (compute capability >= 8.9)."""
  if k_scale is None or interpret or not (
      config.backend == "mosaic_mma" or config.fp8_convert in ("asm", "pairs")):
    return
  cc = _compat.compute_capability()
  if cc is not None and cc < (8, 9):
    what = ("config.backend: 'mosaic_mma' on FP8 pages"
            if config.backend == "mosaic_mma" else
            f"config.fp8_convert: {config.fp8_convert!r}")
    raise ValueError(f"Invalid {what} needs a GPU of compute capability "
                     f">= 8.9, got {cc}")


def _pack_pool(pool, pack: int):
  """`[N, page_size, H, D]` -> `[N, page_size, H / pack, pack * D]` (free:
  adjacent heads are contiguous; `Config.pack_heads`)."""
  n, page_size, num_kv_heads, head_dim = pool.shape
  return pool.reshape(n, page_size, num_kv_heads // pack, pack * head_dim)


def _mosaic_decode(q, k_pool, v_pool, k_table, v_table, kv_lens, sinks,
                   k_scale, v_scale, *, sm_scale, window_left, logits_soft_cap,
                   config: Config, interpret: bool):
  """`paged_decode` on the Mosaic-GPU kernel (`config.backend == "mosaic"`)."""
  batch_size, num_qo_heads, head_dim = q.shape
  _, page_size, num_kv_heads, _ = k_pool.shape
  group_size = num_qo_heads // num_kv_heads
  if interpret:
    raise ValueError(
        "Invalid config for the mosaic backend: expected a GPU, got "
        "interpret=True")
  block_kv = config.pages_per_block * page_size
  if head_dim > 128 or (k_scale is not None and head_dim > 64
                        and not config.keys_m):
    # 64-key steps (a 128-token page in two): at head_dim 256 128-key
    # stages do not fit, nor, with FP8 pages at 128, the FP8 staging ring
    # next to them.
    block_kv = min(block_kv, 64)
  final = config.k_splits == 1 and sinks is None
  o, lse = paged_decode_mgpu.paged_decode_mgpu(
      q, k_pool, v_pool, k_table, v_table, kv_lens, sm_scale=float(sm_scale),
      window_left=int(window_left), logits_soft_cap=logits_soft_cap,
      block_kv=block_kv, num_stages=config.num_stages,
      k_splits=config.k_splits, final=final, num_ctas=config.num_ctas,
      k_scale=k_scale, v_scale=v_scale,
      fp8_stages=_mosaic_fp8_stages(head_dim, block_kv, config.num_stages,
                                    final, config.keys_m),
      keys_m=config.keys_m,
      cp_async=config.cp_async and k_scale is None and not config.keys_m)
  lse = paged_decode_mgpu.group_lse(lse, num_qo_heads=num_qo_heads)
  if final:
    return o, lse.reshape(batch_size, num_qo_heads)
  sk = None if sinks is None else sinks.reshape(num_kv_heads, group_size)
  out, lse = _combine(o, lse, sk, group_size)
  return (out.reshape(batch_size, num_qo_heads, head_dim).astype(q.dtype),
          lse.reshape(batch_size, num_qo_heads))


def _mma_decode(q, k_pool, v_pool, k_table, v_table, kv_lens, sinks, k_scale,
                v_scale, *, sm_scale, window_left, logits_soft_cap,
                config: Config, interpret: bool, q_rows=None, into=None):
  """`paged_decode` on the per-warp Mosaic-GPU kernel (`config.backend ==
  "mosaic_mma"`); with `q_rows` and `into`, `paged_decode_rows`."""
  if interpret:
    raise ValueError(
        "Invalid config for the mosaic_mma backend: expected a GPU, got "
        "interpret=True")
  batch_size = kv_lens.shape[0]
  _, num_qo_heads, head_dim = q.shape
  num_kv_heads = k_pool.shape[2]
  group_size = num_qo_heads // num_kv_heads
  if config.k_splits == 1:
    # The kernel stores the output, sinks added (in place with `into`).
    return paged_decode_mma.paged_decode_mma(
        q, k_pool, v_pool, k_table, v_table, kv_lens, sinks,
        sm_scale=float(sm_scale), window_left=int(window_left),
        logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
        tiles=config.mma_tiles, q_rows=q_rows, into=into)
  o, lse = paged_decode_mma.paged_decode_mma(
      q, k_pool, v_pool, k_table, v_table, kv_lens,
      sm_scale=float(sm_scale), window_left=int(window_left),
      logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
      k_splits=config.k_splits, tiles=config.mma_tiles, final=False,
      q_rows=q_rows)
  # With q_rows a CTA may serve T sequences (`paged_decode_mma.row_packing`):
  # row n of item b' is sequence `T b' + n // G`'s head `n % G`.
  tokens = batch_size // o.shape[0] if o.shape[0] else 1
  if tokens > 1:
    n = tokens * group_size
    o = o[..., :n, :].reshape(batch_size // tokens, num_kv_heads,
                              config.k_splits, tokens, group_size, head_dim)
    o = o.transpose(0, 3, 1, 2, 4, 5).reshape(
        batch_size, num_kv_heads, config.k_splits, group_size, head_dim)
    lse = lse[..., :n].reshape(batch_size // tokens, num_kv_heads,
                               config.k_splits, tokens, group_size)
    lse = lse.transpose(0, 3, 1, 2, 4).reshape(
        batch_size, num_kv_heads, config.k_splits, group_size)
  sk = None if sinks is None else sinks.reshape(num_kv_heads, group_size)
  out, lse = _combine(o, lse, sk, group_size)
  out = out.reshape(batch_size, num_qo_heads, head_dim).astype(q.dtype)
  lse = lse.reshape(batch_size, num_qo_heads)
  if into is None:
    return out, lse
  return _scatter_rows(into, q_rows, out, lse)


def _scatter_rows(into, q_rows, out, lse):
  """`into` with rows `q_rows[b]` set to `out[b]` / `lse[b]`; rows outside
  `[0, num_tokens)` are dropped (negative ones too, not wrapped)."""
  num_tokens = into[0].shape[0]
  rows = jnp.where(_has_row(q_rows, num_tokens), q_rows, num_tokens)
  return (into[0].at[rows].set(out.astype(into[0].dtype), mode="drop"),
          into[1].at[rows].set(lse, mode="drop"))


def paged_decode_rows(
    out,        # [num_tokens, num_qo_heads, head_dim]
    lse,        # f32[num_tokens, num_qo_heads]
    q,          # [num_tokens, num_qo_heads, head_dim]
    q_rows,     # i32[num_rows]
    k_pool,     # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool,     # [num_pages', page_size, num_kv_heads, head_dim]
    k_table,    # i32[batch_size, max_pages]
    v_table,    # i32[batch_size, max_pages]
    kv_lens,    # i32[num_rows]
    sinks=None,  # f32[num_qo_heads] | None
    *,
    sm_scale: float,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    interpret: bool = False,
    config: Config | None = None,
    k_scale=None,  # f32[]: FP8 pages
    v_scale=None,  # f32[]: FP8 pages
):
  """Token rows of a prefill call decoded into its output, one query each.

  Row i belongs to sequence `b = i // R` (`R = num_rows / batch_size`, an
  integer: R token rows per sequence). For every i with `0 <= q_rows[i] <
  num_tokens`, row `t = q_rows[i]` of `out` / `lse` becomes `paged_decode`
  of query `q[t]` over sequence b's pages with `kv_lens[i]` keys (the
  query at position `kv_lens[i] - 1`: a multi-token sequence's tokens
  keep their causal order by their key counts); every other row keeps its
  value. Semantics per row are `paged_decode`'s
  (`reference.paged_decode_reference`). On the per-warp Mosaic-GPU backend
  (`paged_decode_mma`, the Hopper default) the kernel reads the rows of
  `q` and, with one split, writes those of `out` / `lse` in place (no
  gather, no scatter); otherwise the rows are gathered, decoded and
  scattered back.

  Args:
    out, lse: `[num_tokens, num_qo_heads, head_dim]` of q's dtype and
      `f32[num_tokens, num_qo_heads]`: the call's output so far.
    q: `[num_tokens, num_qo_heads, head_dim]`, bf16 / f16 / f32.
    q_rows: `i32[num_rows]`: row i's query token, or a token outside `[0,
      num_tokens)` (e.g. `num_tokens`) for none.
    k_pool, v_pool, k_table, v_table, sinks: as `paged_decode`
      (`batch_size` table rows).
    kv_lens: `i32[num_rows]`, each row's keys (not read for rows without
      a query).
    sm_scale, window_left, logits_soft_cap, interpret, config, k_scale,
      v_scale: as `paged_decode` (config for `num_rows` sequences).

  Returns:
    `(out, lse)` with the decode rows written.

  Raises:
    ValueError: `q_rows` / `kv_lens` not of one shape `(R * batch_size,)`,
      or `out` / `lse` not of q's rows' shape and dtype; and
      `paged_decode`'s errors.
  """
  num_rows = kv_lens.shape[0]
  batch_size = k_table.shape[0]
  if q_rows.shape != (num_rows,) or (
      num_rows % batch_size if batch_size else num_rows):
    raise ValueError(f"Invalid q_rows / kv_lens shapes: expected one shape "
                     f"(R * {batch_size},), got {q_rows.shape} / "
                     f"{kv_lens.shape}")
  want = ((q.shape, jnp.dtype(q.dtype)), (q.shape[:2], jnp.dtype(jnp.float32)))
  got = ((out.shape, jnp.dtype(out.dtype)), (lse.shape, jnp.dtype(lse.dtype)))
  if got != want:
    raise ValueError(f"Invalid out / lse: expected (shape, dtype) {want}, "
                     f"got {got}")
  num_tokens = q.shape[0]
  q_rows = q_rows.astype(jnp.int32)
  if config is None:
    # Splits for all `num_rows` rows, though a CTA of the per-warp kernel
    # may serve several (`paged_decode_mma.row_packing`): most rows of a
    # call with prompts are empty, and splitting them would add a combine
    # and a scatter to the call (3-5 us, Llama-3-8B and Gemma 3 270M heads,
    # 8-16 prompts, H100, 2026-11-27).
    config = _default_config(q, k_pool, k_table, interpret,
                             batch_size=num_rows)
  if config.backend == "mosaic_mma" and not interpret:
    _check_fp8_convert(config, k_scale, interpret)
    if sinks is not None:
      sinks = sinks.astype(jnp.float32)
    return _mma_decode(q, k_pool, v_pool, k_table, v_table, kv_lens, sinks,
                       k_scale, v_scale, sm_scale=sm_scale,
                       window_left=window_left,
                       logits_soft_cap=logits_soft_cap, config=config,
                       interpret=interpret, q_rows=q_rows, into=(out, lse))
  ok = _has_row(q_rows, num_tokens)
  rows_per_seq = num_rows // max(batch_size, 1)
  if rows_per_seq > 1:
    k_table, v_table = (jnp.repeat(t, rows_per_seq, axis=0)
                        for t in (k_table, v_table))
  d_out, d_lse = paged_decode(
      q[jnp.where(ok, q_rows, 0)], k_pool, v_pool, k_table, v_table,
      jnp.where(ok, kv_lens, 0), sinks, sm_scale=sm_scale,
      window_left=window_left, logits_soft_cap=logits_soft_cap,
      interpret=interpret, config=config, k_scale=k_scale, v_scale=v_scale)
  return _scatter_rows((out, lse), q_rows, d_out, d_lse)


def _mosaic_fp8_stages(head_dim: int, block_kv: int, num_stages: int,
                       final: bool, keys_m: bool = False) -> int:
  """FP8 staging stages of the Mosaic-GPU kernel: the most, up to 3, that
  fit in shared memory next to its other buffers (at least 1)."""
  for n in (3, 2):
    if paged_decode_mgpu.smem_bytes(
        head_dim=head_dim, block_kv=block_kv, num_stages=num_stages,
        itemsize=2, final=final, fp8_stages=n,
        keys_m=keys_m) <= paged_decode_mgpu.SMEM_LIMIT:
      return n
  return 1
