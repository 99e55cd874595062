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
`TritonConfig.pack_heads`, a program serves adjacent kv heads as one wider
head: FP8 pages at head_dim 64). Each split writes a normalised partial
output and its log-sum-exp; a small jnp step combines the splits by LSE and
adds the sinks to the denominator (FlashInfer `merge_state`).

FP8 pages: scales per tensor or per KV head. Each program reads the scales
of the kv heads it serves (one, or `pack_heads`): K's multiplies its query
rows' logits (a scalar folded into the logits scale where every row has the
same one, a per-row vector for packed heads with per-head scales) and V's
its output rows before they are stored (before the split combine: a split's
output is linear in V, its LSE depends on the logits only). The query
keeps its dtype.

Memory: K/V pages are read through masked gathers, so rows past `kv_lens[b]`,
outside the window, or in pages past the split's end are never loaded (they may
be NaN or belong to another sequence), and table entries outside the visible
page range `[first_visible_page, cdiv(kv_len, page_size))` are never read.
Decode is memory-bound: the kernel's job is to stream the touched K/V bytes at
close to the copy bandwidth.

Layouts (see `pkvattn/_kv.py`): K block `i` of sequence `b` is
`k_pool[k_table[b, i]]`, V block `i` is `v_pool[v_table[b, i]]`; pools are NHD
`[num_pages, page_size, num_kv_heads, head_dim]`; the pools may be one array.
With `interleaved_kv` one table names page pairs: K block `i` is
`pool[2 t]`, V block `i` `pool[2 t + 1]` for `t = k_table[b, i]`
(FlashInfer's `[num_pages, 2, page_size, num_kv_heads, head_dim]` cache
viewed as `2 num_pages` pages), so a call on that cache needs no table of
its own computed first (one XLA kernel less per call).

Backends: `paged_decode` runs this module's Pallas-Triton kernel
(`TritonConfig`) or the per-warp Mosaic-GPU kernel (`MmaConfig`,
`paged_decode_mma`: `mma.sync` on fragments loaded straight from the pages).
`pallas_kernels.dispatch.decode` picks one per call: the per-warp kernel on
Hopper for bf16 / f16 q over pages of that dtype or FP8 ones (scales per
tensor or per KV head), Triton for f32, other GPUs, interpret mode and
Hopper's many one-token rows over 16-token pages of 16 bits (an engine's
decode step). Both read a prefill call's decode rows in place
(`paged_decode_rows`).
The per-warp kernel, not a TMA / wgmma pipeline, serves Hopper because a
page of a decode cache is a few KiB: a descriptor-driven copy and a
producer / consumer hand-over per page cost more than they save there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from pkvattn.pallas_kernels import _fp8
from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import paged_decode_mma
from pkvattn.pallas_kernels._compat import pl
from pkvattn.pallas_kernels._compat import pltriton
from pkvattn.pallas_kernels._compat import suppress_triton_deprecation
from pkvattn.pallas_kernels._compat import triton_params

# Finite stand-in for -inf inside the kernel: with -inf, a block whose rows are
# all masked gives `exp(-inf - (-inf)) = NaN` in the online-softmax rescale.
DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

_LOG2E = math.log2(math.e)
_SUPPORTED_HEAD_DIMS = (64, 128, 256)
KV_EVICTIONS = (None, "evict_first", "evict_last")


def _next_pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def supports(*, dtype, kv_dtype, head_dim: int, page_size: int) -> str | None:
  """Why the Triton decode kernel does not take a case (a short reason), or
  None when it does: a bf16 / f16 / f32 q over pages of its dtype or of
  float8_e4m3fn, head_dim 64 / 128 / 256, a power-of-two page size in
  [8, 128]. (Which GPU runs it is `dispatch.decode`'s question.)"""
  dt = jnp.dtype(dtype)
  if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                jnp.dtype(jnp.float32)):
    return f"q dtype {dt.name} is not bf16 / f16 / f32"
  if jnp.dtype(kv_dtype) not in (dt, jnp.dtype(jnp.float8_e4m3fn)):
    return f"pages of {jnp.dtype(kv_dtype).name} for a {dt.name} q"
  if head_dim not in _SUPPORTED_HEAD_DIMS:
    return f"head_dim={head_dim} is not one of {_SUPPORTED_HEAD_DIMS}"
  if page_size < 8 or page_size > 128 or page_size & (page_size - 1):
    return f"page_size={page_size} is not a power of two in [8, 128]"
  return None


def _check_pow2(name: str, value, upper: int | None = None) -> None:
  ok = isinstance(value, int) and value >= 1 and not value & (value - 1)
  if not ok or (upper is not None and value > upper):
    bound = "" if upper is None else f" <= {upper}"
    raise ValueError(f"Invalid {name}: expected a power of two >= 1{bound}, "
                     f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Static tiling of this module's Pallas-Triton decode kernel.

  Attributes:
    pages_per_block: pages gathered per loop step (a power of two); one step
      covers `pages_per_block * page_size` tokens.
    k_splits: flash-decoding splits of each sequence's visible pages (a
      power of two). With one split the kernel writes the final output
      itself (no combine).
    num_warps: Triton warps per program (a power of two <= 8).
    num_stages: Triton software-pipelining stages of the page loop (>= 1).
    kv_eviction: L2 eviction hint for the streamed K/V loads (None,
      "evict_first" or "evict_last"); K/V are read once, so they need not
      linger.
    fp8_convert: FP8 pages: how tiles convert to the dot dtype (one of
      `_fp8.CONVERT_MODES`): "loaded" (V converted in the layout it was
      loaded in, behind a select on the token mask) or "pairs" (the pools
      read as 16-bit words of two adjacent columns, split into even and odd
      columns by inline PTX on a GPU of compute capability >= 8.9; see
      `pallas_kernels/_fp8.py`). Unused for 16-bit / f32 pages.
    pack_heads: kv heads per program (a power of two dividing
      `num_kv_heads`, `pack_heads * head_dim <= 256`). Adjacent kv heads
      are contiguous in every pool layout (NHD), so the pools are viewed as
      `[num_pages, page_size, num_kv_heads / pack_heads, pack_heads *
      head_dim]` (a free reshape) and each query row is placed
      block-diagonally: the kernel loads q head `h` of kv head `k` into
      columns `(k % pack_heads) * head_dim` onward with zeros elsewhere, so
      its logits are its own head's, and keeps its own head's columns of
      the output. The program then reads `pack_heads * head_dim`-wide rows
      for `pack_heads * group_size` query rows (the dots do `pack_heads`
      times the FLOPs, which decode does not run short of). Per-KV-head
      FP8 scales then differ between a program's rows: each row's logits
      and output take its own head's. One difference from unpacked heads:
      a non-finite K value in an owned row of one head reaches the logits
      of the heads packed with it (0 * inf).
    prefetch_ids: load each step's page ids one step ahead (carried through
      the loop) instead of at the step's start.
  """
  backend: ClassVar[str] = "triton"
  pages_per_block: int
  k_splits: int
  num_warps: int = 4
  num_stages: int = 3
  kv_eviction: str | None = None
  fp8_convert: str = "loaded"
  pack_heads: int = 1
  prefetch_ids: bool = False

  def __post_init__(self):
    for name in ("pages_per_block", "k_splits", "pack_heads"):
      _check_pow2(name, getattr(self, name))
    _check_pow2("num_warps", self.num_warps, upper=8)
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"Invalid num_stages: expected an int >= 1, got "
                       f"{self.num_stages!r}")
    if self.kv_eviction not in KV_EVICTIONS:
      raise ValueError(f"Invalid kv_eviction: expected one of "
                       f"{KV_EVICTIONS}, got {self.kv_eviction!r}")
    if self.fp8_convert not in _fp8.CONVERT_MODES:
      raise ValueError(f"Invalid fp8_convert: expected one of "
                       f"{_fp8.CONVERT_MODES}, got {self.fp8_convert!r}")
    if not isinstance(self.prefetch_ids, bool):
      raise ValueError(f"Invalid prefetch_ids: expected a bool, got "
                       f"{self.prefetch_ids!r}")


@dataclasses.dataclass(frozen=True)
class MmaConfig:
  """Static config of the per-warp Mosaic-GPU decode kernel
  (`paged_decode_mma`: four warps per `(kv head, sequence, split)` item,
  each taking every fourth step of `16 * tiles` keys).

  Attributes:
    k_splits: flash-decoding splits of each sequence's visible pages (a
      power of two <= 64). With one split the kernel stores the output
      rows itself, sinks added; with several a jnp combine follows.
    tiles: 16-key m-tiles per warp step (1, 2 or 4).
  """
  backend: ClassVar[str] = "mosaic_mma"
  k_splits: int
  tiles: int = 1

  def __post_init__(self):
    _check_pow2("k_splits", self.k_splits, upper=64)
    if self.tiles not in (1, 2, 4):
      raise ValueError(f"Invalid tiles: expected 1, 2 or 4, got "
                       f"{self.tiles!r}")


def _paged_decode_kernel(
    kv_lens_ref,   # i32[batch_size] (whole array)
    tok_ref,       # i32[batch_size] (whole array): q's row of sequence b,
                   # with `q_rows` | None (q's row b)
    k_table_ref,   # i32[max_pages] (row b, or b // R with `q_rows`)
    v_table_ref,   # i32[max_pages] (row b, or b // R with `q_rows`)
    q_ref,         # [num_qo_heads, head_dim] (row b); with `q_rows` the
                   # whole [num_tokens, num_qo_heads, head_dim]
    sinks_ref,     # f32[num_qo_heads] | None
    k_scale_ref,   # f32[1] | f32[pack] of FP8 pages (kv head k's) | None
    v_scale_ref,   # f32[1] | f32[pack] of FP8 pages (kv head k's) | None
    k_pool_ref,    # [num_pages, page_size, <kv head k>, pack * head_dim]
    v_pool_ref,    # [num_pages', page_size, <kv head k>, pack * head_dim]
    *refs,         # o_ref, lse_ref; before them, with `q_rows` and one
                   # split, `into`'s two inputs (aliased to them, unread).
                   # o_ref: final: [num_qo_heads, head_dim] q.dtype (row
                   # b; with `q_rows` the whole [num_tokens, ...], written
                   # in place); else f32[group_padded, head_dim] (split s
                   # of head k). lse_ref: final: f32[num_qo_heads] (row b;
                   # whole with `q_rows`); else f32[group_padded].
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
    interleaved_kv: bool = False,
    interpret: bool = False,
):
  o_ref, lse_ref = refs[-2:]
  b = pl.program_id(0)
  kv_head = pl.program_id(1)
  split = pl.program_id(2)
  page_size = k_pool_ref.shape[1]
  kv_len = kv_lens_ref[b]
  # `q_rows`: sequence b's query is q's row `tok`; a sequence without one
  # (a row outside `[0, num_tokens)`) reads no key and stores nothing.
  by_row = tok_ref is not None
  has_row = True
  if by_row:
    tok = tok_ref[b]
    has_row = (tok >= 0) & (tok < q_ref.shape[0])
    tok = jnp.where(has_row, tok, 0)
    kv_len = jnp.where(has_row, kv_len, 0)

  def at_row(ref, *index):
    """`ref.at[index]`, behind q's row `tok` with `q_rows` (every index of
    one shape, the form the Triton lowering and interpret mode accept)."""
    if by_row:
      index = (jnp.full(index[0].shape, tok, jnp.int32),) + index
    return ref.at[index]
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
      # Packed kv heads (`TritonConfig.pack_heads`): row r belongs to the
      # (r // (group_size / pack))-th head of the pack and owns that head's
      # q_dim columns; q is 0 elsewhere, and the output keeps owned columns.
      block = group_row // (group_size // pack)
      mask = mask & (cols // q_dim == jnp.broadcast_to(block[:, None], shape))
      cols = cols % q_dim
    return pltriton.load(at_row(q_ref, rows, cols), mask=mask & has_row,
                         other=0.0)

  # Output columns (per word with `pairs`: the even ones, `+ 1` the odd).
  o_shape = (group_padded, q_dim // step_cols)
  q_rows = jnp.broadcast_to(head_rows[:, None], o_shape)
  q_cols = lax.broadcasted_iota(jnp.int32, o_shape, 1) * step_cols
  q_mask = jnp.broadcast_to(row_ok[:, None], o_shape)
  qs = tuple(load_q(first) for first in range(step_cols))

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
    # FP8 pages: a kv head's K scale multiplies its rows' logits and its V
    # scale their output (the partial outputs are linear in V; the LSE
    # depends on the logits only); the tiles and q convert to f16 for the
    # dots (f32 for an f32 q): `_fp8`'s notes.
    if k_scale_ref.shape[0] == 1:
      # One scale for all rows (per-tensor scales, or an unpacked program's
      # kv head): folded into the logits scale.
      qk_scale = qk_scale * k_scale_ref[0]
      v_scale = v_scale_ref[0]
    else:
      # Packed heads with per-KV-head scales: row r's head is the pack's
      # (r // (group_size / pack))-th (as in `load_q`; padding rows, never
      # stored, take the last head's), so the scales are per-row vectors.
      row_head = jnp.minimum(group_row // (group_size // pack), pack - 1)
      qk_scale = qk_scale * pltriton.load(k_scale_ref.at[row_head])[:, None]
      v_scale = pltriton.load(v_scale_ref.at[row_head])[:, None]
    dot_dtype = _fp8.dot_dtype(qs[0].dtype)
    qs = tuple(_fp8.query_for_dots(q) for q in qs)
  page_iota = lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size), 0)
  row_iota = lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size), 1)

  def page_ids(step):
    """The K and V page ids of `step` (0 past the split's pages)."""
    page0 = split_start + step * pages_per_block
    page_ok = page0 + lax.iota(jnp.int32, pages_per_block) < split_end
    if interleaved_kv:
      ids = pltriton.load(k_table_ref.at[pl.ds(page0, pages_per_block)],
                          mask=page_ok, other=0)
      return 2 * ids, 2 * ids + 1
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
      # placement reads it in wide words. V is contracted over tokens, so
      # it converts in its loaded layout (`_fp8.convert_loaded`).
      ks = (k.astype(dot_dtype),)
      vs = (_fp8.convert_loaded(v, dot_dtype, tok_ok.reshape(block_k)),)
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

  def store_out(ref, rows, out, in_row: bool = False):
    """`out` (a tuple: even, then odd columns with `pairs`) into `ref`'s
    `rows`; `in_row`: the final output, behind q's row with `q_rows`."""
    for first, part in enumerate(out):
      index = (rows, q_cols + first)
      pltriton.store(at_row(ref, *index) if in_row else ref.at[index],
                     part.astype(ref.dtype),
                     mask=q_mask & has_row if in_row else q_mask)

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
  store_out(o_ref, q_rows, tuple(acc / den[:, None] for acc in accs),
            in_row=True)
  pltriton.store(at_row(lse_ref, head_rows), lse, mask=row_ok & has_row)


def _paged_decode_call(
    q,         # [batch_size, num_qo_heads, head_dim]
    sinks,     # f32[num_qo_heads] | None
    k_pool,    # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool,    # [num_pages', page_size, num_kv_heads, head_dim]
    k_table,   # i32[batch_size, max_pages]
    v_table,   # i32[batch_size, max_pages]
    kv_lens,   # i32[batch_size]
    scales=None,  # (k_scale, v_scale) of FP8 pages, each f32[1] (per
    #               tensor) or f32[num_kv_heads * pack] (per head) | None
    *,
    sm_scale: float,
    window_left: int,
    logits_soft_cap: float | None,
    config: TritonConfig,
    interpret: bool,
    q_rows=None,  # i32[batch_size] | None
    into=None,    # (out, lse) of q's rows | None
    interleaved_kv: bool = False,
):
  """Runs the kernel (`interleaved_kv`: `k_table` names page pairs, the
  module docstring's layouts; `v_table` is then not read).

  With `config.k_splits == 1` returns the final `(out [batch_size,
  num_qo_heads, head_dim] q.dtype, lse f32[batch_size, num_qo_heads])` (sinks
  applied). With `q_rows` (`paged_decode_rows`), q is `[num_tokens,
  num_qo_heads, head_dim]`, sequence b's query its row `q_rows[b]` (none
  outside `[0, num_tokens)`), its pages those of table row `b // R` (R =
  `batch_size / table rows`); with one split the kernel writes those rows
  of `into` in place (aliased) and returns `into`. Otherwise returns
  per-split partials `(o f32[batch_size, num_kv_heads, k_splits,
  group_padded, head_dim], lse f32[batch_size, num_kv_heads, k_splits,
  group_padded])`, normalised per split, of which
  only the first `group_size` rows are written; empty splits give `o = 0,
  lse = -inf`; sinks are left to `_combine`. Per-head scales go to each
  program as the `pack_heads` scales of the kv heads it serves (a block
  of `f32[num_kv_heads * pack]`); a per-tensor scale as its one value.
  """
  num_tokens, num_qo_heads, head_dim = q.shape
  batch_size = kv_lens.shape[0]
  rows_per_seq = batch_size // max(k_table.shape[0], 1)
  _, page_size, num_kv_heads, width = k_pool.shape  # width: packed heads
  group_size = num_qo_heads // num_kv_heads
  group_padded = max(16, _next_pow2(group_size))
  max_pages = k_table.shape[1]
  ks = config.k_splits
  final = ks == 1
  in_place = q_rows is not None and final
  if not final:
    sinks = None
  head_scales = scales is not None and scales[0].shape[0] > 1
  if head_scales:
    scale_spec = pl.BlockSpec((config.pack_heads,), lambda b, k, s: (k,))
  else:
    scale_spec = pl.BlockSpec((1,), lambda b, k, s: (0,))
  kernel = functools.partial(
      _paged_decode_kernel, sm_scale=sm_scale, window_left=window_left,
      logits_soft_cap=logits_soft_cap, pages_per_block=config.pages_per_block,
      k_splits=ks, group_size=group_size, group_padded=group_padded,
      kv_eviction=config.kv_eviction, fp8_convert=config.fp8_convert,
      prefetch_ids=config.prefetch_ids, interleaved_kv=interleaved_kv,
      interpret=interpret)
  pool_spec = lambda n: pl.BlockSpec(  # noqa: E731
      (n, page_size, None, width), lambda b, k, s: (0, 0, k, 0))
  whole = lambda *shape: pl.BlockSpec(  # noqa: E731
      shape, lambda b, k, s: (0,) * len(shape))
  if in_place:
    out_specs = [whole(num_tokens, num_qo_heads, head_dim),
                 whole(num_tokens, num_qo_heads)]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in into]
  elif final:
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
          f"{'_hs' if head_scales else ''}"
          f"{'_' + config.kv_eviction if config.kv_eviction else ''}"
          f"{'_rows' if q_rows is not None else ''}"
          f"{'_il' if interleaved_kv else ''}")
  table_spec = pl.BlockSpec((None, max_pages),
                            lambda b, k, s: (b // rows_per_seq, 0))
  args = [kv_lens, q_rows, k_table, v_table, q, sinks,
          *(scales or (None, None)), k_pool, v_pool,
          *(into if in_place else ())]
  in_specs = [
      whole(batch_size),
      None if q_rows is None else whole(batch_size),
      table_spec,
      table_spec,
      (whole(*q.shape) if q_rows is not None else
       pl.BlockSpec((None, num_qo_heads, head_dim), lambda b, k, s: (b, 0, 0))),
      None if sinks is None else whole(num_qo_heads),
      *([None, None] if scales is None else [scale_spec] * 2),
      pool_spec(k_pool.shape[0]),
      pool_spec(v_pool.shape[0]),
      *out_specs[:2 if in_place else 0],
  ]
  # `into` is written in place: its two inputs (the last ones) alias the
  # outputs.
  n_in = sum(x is not None for x in args)
  aliases = {n_in - 2: 0, n_in - 1: 1} if in_place else {}
  return pl.pallas_call(
      kernel,
      grid=(batch_size, num_kv_heads, ks),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=triton_params(config.num_warps, config.num_stages),
      interpret=interpret,
      name=name,
  )(*args)


def _combine(o, lse, sinks, group_size):
  """LSE-combine of the splits; sinks join the denominator only.

  o f32[B, Hkv, S, Gp, D], lse f32[B, Hkv, S, Gp], sinks f32[Hkv, G] | None.
  Returns (out f32[B, Hkv, G, D], lse f32[B, Hkv, G]).
  """
  o = o[..., :group_size, :]
  lse = lse[..., :group_size]
  m = jnp.max(lse, axis=2)  # [B, Hkv, G]; the keys' own: see below
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - m_safe[:, :, None]), 0.0)
  den = jnp.sum(w, axis=2)
  out = jnp.sum(w[..., None] * jnp.where(w[..., None] > 0, o, 0.0), axis=2)
  lse_total = jnp.where(den > 0, jnp.log(jnp.where(den > 0, den, 1.0)) + m_safe,
                        -jnp.inf)
  if sinks is not None:
    # Rescaled to the larger of the two only here: a sink far above every
    # logit must not underflow the keys' weights before the LSE is taken.
    top = jnp.maximum(m_safe, sinks[None])
    keep = jnp.exp(m_safe - top)
    out = out * keep[..., None]
    den = den * keep + jnp.exp(sinks[None] - top)
  out = out / jnp.where(den > 0, den, 1.0)[..., None]
  return out, lse_total


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "window_left", "logits_soft_cap", "interpret",
                     "config", "interleaved_kv"))
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
    config: TritonConfig | MmaConfig | None = None,
    k_scale=None,  # f32[] | f32[num_kv_heads]: FP8 pages
    v_scale=None,  # f32[] | f32[num_kv_heads]: FP8 pages
    interleaved_kv: bool = False,
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
    config: static; a `TritonConfig` (this module's kernel) or an
      `MmaConfig` (the per-warp Mosaic-GPU kernel); None =
      `dispatch.decode`'s choice for this call on
      `dispatch.current_gpu(interpret)`.
    k_scale, v_scale: of FP8 pages, each an f32 scalar (a 0-d or
      1-element array) or one per KV head (`f32[num_kv_heads]`); may be
      traced: a stored value `x` of kv head `h` means `x * scale[h]`. Read
      in the kernel: the Triton kernel multiplies each query row's logits
      by its kv head's K scale and its output by the V scale (per-tensor
      scales fold into the logits scale); the per-warp kernel's CTA, of
      one kv head, folds that head's into its logits scale and output
      normalisation.
    interleaved_kv: static; `k_table` names page pairs of one pool (`k_pool
      is v_pool`'s pages): K block `i` is `k_pool[2 t]`, V block `i`
      `k_pool[2 t + 1]` for `t = k_table[b, i]` (FlashInfer's `[num_pages,
      2, ...]` cache reshaped to `[2 num_pages, ...]`); `v_pool` and
      `v_table` are not read (pass `k_pool` and `k_table`).

  Returns:
    `(out [batch_size, num_qo_heads, head_dim] q.dtype,
    lse f32[batch_size, num_qo_heads])`, natural-log LSE over visible keys,
    sink excluded; `kv_lens[b] == 0` gives zeros and `-inf`.

  Raises:
    NotImplementedError: a case `supports` rejects (head_dim not in {64,
      128, 256}, a page_size that is not a power of two in [8, 128], other
      dtypes).
    ValueError: `config` of neither class; an `MmaConfig` in interpret mode,
      or on a case `paged_decode_mma` does not serve (its errors); a scale
      neither of one value nor of shape `(num_kv_heads,)`; an `MmaConfig`
      or `fp8_convert="pairs"` with FP8 pages where
      `dispatch.current_gpu` is a GPU below compute capability 8.9 (no e4m3
      pair conversion; without a GPU, e.g. lowering for CUDA on a CPU host,
      it lowers); `pack_heads` that does not divide num_kv_heads or makes
      rows wider than 256.
  """
  if interleaved_kv:
    # One pool and one table inside this jit too (the kernels' `same_table`:
    # each page id is read once).
    v_pool, v_table = k_pool, k_table
  return _decode(q, k_pool, v_pool, k_table, v_table, kv_lens, sinks,
                 k_scale, v_scale, sm_scale=sm_scale, window_left=window_left,
                 logits_soft_cap=logits_soft_cap, config=config,
                 interpret=interpret, interleaved_kv=interleaved_kv)


def _decode(q, k_pool, v_pool, k_table, v_table, kv_lens, sinks, k_scale,
            v_scale, *, sm_scale, window_left, logits_soft_cap, config,
            interpret: bool, q_rows=None, into=None,
            interleaved_kv: bool = False):
  """`paged_decode` (or, with `q_rows` and `into`, `paged_decode_rows`) on
  `config`'s kernel; None = `dispatch.decode`'s config, its splits counting
  every one of `kv_lens`'s rows."""
  reason = supports(dtype=q.dtype, kv_dtype=k_pool.dtype, head_dim=q.shape[2],
                    page_size=k_pool.shape[1])
  if reason is not None:
    raise NotImplementedError(f"paged_decode kernel: {reason}")
  if config is None:
    config = _default_config(q, k_pool, k_table, interpret,
                             num_rows=kv_lens.shape[0])
  _check_config(config, k_scale, interpret)
  if sinks is not None:
    sinks = sinks.astype(jnp.float32)
  run = _mma_decode if isinstance(config, MmaConfig) else _triton_decode
  return run(q, k_pool, v_pool, k_table, v_table, kv_lens, sinks, k_scale,
             v_scale, sm_scale=sm_scale, window_left=window_left,
             logits_soft_cap=logits_soft_cap, config=config,
             interpret=interpret, q_rows=q_rows, into=into,
             interleaved_kv=interleaved_kv)


def _triton_decode(q, k_pool, v_pool, k_table, v_table, kv_lens, sinks,
                   k_scale, v_scale, *, sm_scale, window_left,
                   logits_soft_cap, config: TritonConfig, interpret: bool,
                   q_rows=None, into=None, interleaved_kv: bool = False):
  """`paged_decode` on this module's kernel (a `TritonConfig`); with
  `q_rows` and `into`, `paged_decode_rows` (in place with one split)."""
  batch_size = kv_lens.shape[0]
  _, num_qo_heads, head_dim = q.shape
  num_kv_heads = k_pool.shape[2]
  group_size = num_qo_heads // num_kv_heads
  head_scales = _fp8.is_per_head(k_scale, v_scale, num_kv_heads)
  pack = config.pack_heads
  num_scales = num_kv_heads  # per-head scales: one per kv head, unpacked
  if pack > 1:
    if num_kv_heads % pack or pack * head_dim > 256:
      raise ValueError(
          f"Invalid config.pack_heads: expected a divisor of num_kv_heads="
          f"{num_kv_heads} with pack_heads * head_dim <= 256, got {pack} "
          f"(head_dim={head_dim})")
    k_pool = _pack_pool(k_pool, pack)
    v_pool = _pack_pool(v_pool, pack)
    num_kv_heads //= pack
    group_size *= pack
  if config.fp8_convert == "pairs" and k_scale is not None:
    k_pool, v_pool = _fp8.pair_view(k_pool), _fp8.pair_view(v_pool)
  scales = None
  if k_scale is not None:
    # Two inputs, not one stacked pair (a stack is one more small XLA
    # kernel per call): f32[1] each for per-tensor scales (free reshapes),
    # else f32[num_kv_heads] each (a per-tensor scale beside a per-head one
    # broadcast), read per program (`_paged_decode_call`).
    shape = (num_scales,) if head_scales else (1,)
    scales = tuple(jnp.broadcast_to(jnp.asarray(x, jnp.float32).reshape(-1),
                                    shape) for x in (k_scale, v_scale))
  with suppress_triton_deprecation():
    o, lse = _paged_decode_call(
        q, sinks, k_pool, v_pool, k_table.astype(jnp.int32),
        v_table.astype(jnp.int32), kv_lens.astype(jnp.int32), scales,
        sm_scale=float(sm_scale), window_left=int(window_left),
        logits_soft_cap=logits_soft_cap, config=config, interpret=interpret,
        q_rows=q_rows, into=into, interleaved_kv=interleaved_kv)
  if config.k_splits == 1:
    return o, lse
  sk = None if sinks is None else sinks.reshape(num_kv_heads, group_size)
  out, lse = _combine(o, lse, sk, group_size)
  out = out.reshape(batch_size, num_qo_heads, head_dim).astype(q.dtype)
  lse = lse.reshape(batch_size, num_qo_heads)
  if into is None:
    return out, lse
  return _scatter_rows(into, q_rows, out, lse)


def _default_config(q, k_pool, k_table, interpret: bool,
                    num_rows: int | None = None
                    ) -> TritonConfig | MmaConfig:
  """`dispatch.decode`'s config for a call with these q heads, pages and
  tables on `dispatch.current_gpu(interpret)`: `k_table`'s rows are the
  sequences, each with `num_rows / rows` query rows (None: one)."""
  batch_size, max_pages = k_table.shape
  q_tokens_per_seq = 1
  if num_rows is not None and batch_size:
    q_tokens_per_seq = num_rows // batch_size
  _, page_size, num_kv_heads, _ = k_pool.shape
  _, num_qo_heads, head_dim = q.shape
  return dispatch.decode(
      gpu=dispatch.current_gpu(interpret), dtype=q.dtype,
      kv_dtype=k_pool.dtype, head_dim=head_dim,
      group_size=num_qo_heads // num_kv_heads, page_size=page_size,
      batch_size=batch_size, num_kv_heads=num_kv_heads, max_pages=max_pages,
      q_tokens_per_seq=q_tokens_per_seq).config


def _has_row(q_rows, num_tokens: int):
  """Which sequences have a query row: `0 <= q_rows[b] < num_tokens`."""
  return (q_rows >= 0) & (q_rows < num_tokens)


def _check_config(config, k_scale, interpret: bool) -> None:
  """Raises ValueError for a config of neither class, and where FP8 pages
  would take a conversion the GPU lacks:
  the per-warp kernel and `fp8_convert="pairs"` convert e4m3 pairs with
  `cvt.rn.f16x2.e4m3x2` (compute capability >= 8.9). Without a GPU
  (interpret mode, or lowering for CUDA on a CPU host) no conversion is
  refused."""
  if not isinstance(config, (TritonConfig, MmaConfig)):
    raise ValueError(f"Invalid config: expected a TritonConfig or an "
                     f"MmaConfig, got {config!r}")
  mma = isinstance(config, MmaConfig)
  if k_scale is None or not (mma or config.fp8_convert == "pairs"):
    return
  gpu = dispatch.current_gpu(interpret)
  if gpu.compute_capability is not None and not gpu.has_fp8_cvt:
    what = ("config: MmaConfig (backend 'mosaic_mma') on FP8 pages" if mma
            else f"config.fp8_convert: {config.fp8_convert!r}")
    raise ValueError(f"Invalid {what} needs a GPU of compute capability "
                     f">= 8.9, got {gpu.compute_capability}")


def _pack_pool(pool, pack: int):
  """`[N, page_size, H, D]` -> `[N, page_size, H / pack, pack * D]` (free:
  adjacent heads are contiguous; `TritonConfig.pack_heads`)."""
  n, page_size, num_kv_heads, head_dim = pool.shape
  return pool.reshape(n, page_size, num_kv_heads // pack, pack * head_dim)


def _mma_decode(q, k_pool, v_pool, k_table, v_table, kv_lens, sinks, k_scale,
                v_scale, *, sm_scale, window_left, logits_soft_cap,
                config: MmaConfig, interpret: bool, q_rows=None, into=None,
                interleaved_kv: bool = False):
  """`paged_decode` on the per-warp Mosaic-GPU kernel (an `MmaConfig`);
  with `q_rows` and `into`, `paged_decode_rows`."""
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
        tiles=config.tiles, q_rows=q_rows, into=into,
        interleaved_kv=interleaved_kv)
  o, lse = paged_decode_mma.paged_decode_mma(
      q, k_pool, v_pool, k_table, v_table, kv_lens,
      sm_scale=float(sm_scale), window_left=int(window_left),
      logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
      k_splits=config.k_splits, tiles=config.tiles, final=False,
      q_rows=q_rows, interleaved_kv=interleaved_kv)
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
    config: TritonConfig | MmaConfig | None = None,
    k_scale=None,  # f32[] | f32[num_kv_heads]: FP8 pages
    v_scale=None,  # f32[] | f32[num_kv_heads]: FP8 pages
):
  """Token rows of a prefill call decoded into its output, one query each.

  Row i belongs to sequence `b = i // R` (`R = num_rows / batch_size`, an
  integer: R token rows per sequence). For every i with `0 <= q_rows[i] <
  num_tokens`, row `t = q_rows[i]` of `out` / `lse` becomes `paged_decode`
  of query `q[t]` over sequence b's pages with `kv_lens[i]` keys (the
  query at position `kv_lens[i] - 1`: a multi-token sequence's tokens
  keep their causal order by their key counts); every other row keeps its
  value. Semantics per row are `paged_decode`'s
  (`reference.paged_decode_reference`). Both kernels read the rows of `q`
  in place and, with one split, write those of `out` / `lse` in place (no
  gather, no scatter); with several, the combined rows are scattered
  back.

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
      v_scale: as `paged_decode`; the default config is `dispatch.decode`'s
      with `q_tokens_per_seq = R` (its splits count all `num_rows` rows).

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
  # The default config's splits count all `num_rows` rows, though a CTA of
  # the per-warp kernel may serve several (`paged_decode_mma.row_packing`):
  # most rows of a call with prompts are empty, and splitting them would
  # add a combine and a scatter to the call (measured: docs/performance.md).
  return _decode(q, k_pool, v_pool, k_table, v_table, kv_lens, sinks,
                 k_scale, v_scale, sm_scale=sm_scale, window_left=window_left,
                 logits_soft_cap=logits_soft_cap, config=config,
                 interpret=interpret, q_rows=q_rows.astype(jnp.int32),
                 into=(out, lse))
