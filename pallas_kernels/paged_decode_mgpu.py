"""Paged decode attention for Hopper: Pallas on Mosaic GPU (TMA + wgmma).

The same flash-decoding algorithm as the Pallas-Triton kernel
(`paged_decode.py`: split-K over the visible pages, online softmax, LSE
combine of the splits), laid out for Hopper's asynchronous units:

* Work items are `(kv head, sequence, split)`, kv heads fastest. The grid
  is persistent: one CTA per SM (`num_ctas`), each taking every
  `num_ctas`-th item, so the K/V ring runs on from one item into the next
  (the next item's pages and q arrive while this one's softmax and stores
  finish, instead of every CTA filling its pipeline afresh). The GQA group
  of the kv head (1..8 query heads) is packed into the M dimension of both
  wgmma matmuls: `S = Q K^T` is `[64, block_kv]` with the group in rows
  `0..group_size-1`. The other rows are computed on zeros and never stored
  (a wgmma has 64 rows; decode is bound by the K/V bytes, not the MMA).
* Two warpgroups: a producer issues one TMA copy per page (`pool[page, rows,
  kv_head, :]` -> `[page_size, head_dim]` of a shared-memory stage) into a
  ring of `num_stages` stages, reading the page ids from the page table (or,
  with `cp_async`, its 128 threads copy the pages 16 bytes at a time,
  `_mgpu_async`); the
  consumer runs QK^T, the base-2 softmax (scale folded into the exponent, as
  FlashAttention-3) and PV per step of `block_kv` keys, with q double
  buffered across items.
* Only the visible pages `[first visible page, cdiv(kv_len, page_size))` of
  the split are read; page ids outside that range (released window pages,
  pages past the end) are never read (the page index is clamped into it).
  Keys outside `[kv_len - 1 - window_left, kv_len)` get -inf logits, and
  their V rows are zeroed in shared memory before PV (stale rows may be NaN;
  `0 * NaN` would reach the output).
* With one split the CTA stores the normalised output rows of its group
  straight into `out [batch, num_qo_heads, head_dim]` (a ladder of
  power-of-two TMA boxes covers exactly `group_size` rows); with several it
  stores f32 partials and their LSE for `paged_decode`'s combine.

Keys in M (`keys_m`): the wgmmas compute `S^T = K q^T` ([block_kv, 16],
the 16 loaded q rows as N) and `O^T = V^T P^T` ([head_dim, 16], P^T through
shared memory, V and P^T sharing a 32-byte swizzle), a quarter of the MMA
work and softmax elements per key; the softmax reduces over keys across
the warpgroup's warps, and the wrapper picks the group's columns of O^T.

FP8 pages (float8_e4m3fn, per-tensor `k_scale` / `v_scale`): TMA fills an
FP8 staging ring and a third warpgroup converts each staged tile to f16
(one `cvt` per pair) into the consumer's stage; q is converted to f16 (in
place, or before the launch with `keys_m`), K's scale joins the logits'
scale and V's the output's. Correct, but not much faster than bf16 pages:
the one consumer warpgroup is ~90% busy at about 1 us per 64 keys with the
q rows in M (0.9 with the keys there) whatever the page bytes (Nsight
Compute, H200). Shortening its chain did not help, though: issuing each
step's QK^T together with the previous step's PV, the softmax running
under that wgmma (FA3's intra-warpgroup overlap, P^T double buffered), was
6-12% slower on FP8 pages, 10% slower at head_dim 64 and 2% faster on bf16
Llama-3-8B heads, and 64-key steps through 4 stages were slower too (H200,
2026-11-26, `bench/results/decode_mosaic_overlap_NVIDIA_H200.json`), as
were 2 CTAs per SM (2026-11-25). Nor is the consumer alone the limit:
with its work and the converter's removed (a probe build whose warpgroups
only wait on and arrive at the barriers), the TMA ring by itself takes 138 /
134 / 79 / 152 us on the four Llama-3-8B decode specs, 0.56-0.60x of bf16
pages' time, and a second converter warpgroup changes nothing (H200,
2026-11-26): this layout cannot go much below 0.6x of bf16 pages. The
Triton kernel reading the pages as column pairs takes 0.55-0.59x there
(`paged_decode.Config.default_for`), so FP8 pages stay on Triton.

At head_dim 256 one q buffer (the next item's q loads during the
epilogue) and 64-key steps fit shared memory next to the output tile. The
keys-in-M build would leave room for a third stage there, but is slower
with two or three (0.85-0.90x of FlashInfer's kernel time on Gemma 3 270M
heads against 0.92-0.97x, H200, 2026-11-26,
`bench/results/decode_mosaic_d256_keys_m_NVIDIA_H200.json`).

Page loads by `cp.async` (`cp_async`, the default at 8-token pages): in
Pallas's per-thread lowering each TMA copy also takes a warpgroup barrier
and 128 barrier arrivals, a fixed cost per page. With 8-token pages (1 KiB
boxes at head_dim 64) that cost sets the pace: 90.7 us with TMA against
67.1 with cp.async on SmolLM2 heads, B=64 S=4096 (H200, 2026-11-26); at
16-token pages the two are within 3% either way. Neither load path
is what keeps this kernel behind the Triton one on small heads: its ring
alone (the consumer only waiting on and releasing the stages) takes 55.8
us there with 16-token pages, the Triton kernel's whole time, and the
Llama-3-8B heads' ring 246 us against Triton's 245 (same run).

`paged_decode` routes here when a config asks for it
(`Config(backend="mosaic")`: pages of 8..128 tokens, head_dim 64 / 128 /
256, group sizes 1..8, bf16 / f16 or FP8 pages, `supports`). Until
2026-11-26 it was the Hopper default at 128-token pages; the per-warp
kernel (`paged_decode_mma`) took that over at 0.99-1.06x of this kernel's
time (H200, five head_dim 64 / 128 specs,
`bench/results/decode_mma_NVIDIA_H200_p128_tma.json`). Interpret mode has
no Mosaic GPU for warp-specialised kernels. Sinks go through the split
path, whose combine adds them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pkvattn.pallas_kernels import _compat
from pkvattn.pallas_kernels import _fp8
from pkvattn.pallas_kernels import _mgpu_async

BLOCK_M = 64      # wgmma rows
GROUP_ROWS = 8    # query rows of a group (at most), partial rows per split
Q_ROWS = 16       # query rows each CTA loads: two 8-row swizzle tiles
MAX_GROUP = GROUP_ROWS
LSE_ROWS = BLOCK_M  # lse rows stored per CTA (a TMA box needs >= 16 bytes)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
SMEM_LIMIT = 232448  # per CTA on sm_90 (227 KiB)


def q_buffers(head_dim: int) -> int:
  """q buffers of the kernel: two (the next item's q loads during this
  item) up to head_dim 128, one at 256 (two would not fit next to the K/V
  stages and the output tile; the next q then loads during the epilogue)."""
  return 2 if head_dim <= 128 else 1


def smem_bytes(*, head_dim: int, block_kv: int, num_stages: int,
               itemsize: int, final: bool, fp8_stages: int = 0,
               keys_m: bool = False) -> int:
  """Shared memory one CTA needs (q buffers, K/V stages, output tile, lse,
  with FP8 pages the FP8 staging rings, and 1 KiB for the barriers), bytes;
  the row reductions stay within warps (no reduction scratch), except with
  `keys_m` (1 KiB more, and P^T's tile)."""
  out_item = itemsize if final else 4
  rows = Q_ROWS if keys_m else BLOCK_M  # of the q buffers and output tile
  p_tile = block_kv * Q_ROWS * itemsize + 1024 if keys_m else 0
  return (q_buffers(head_dim) * rows * head_dim * itemsize
          + 2 * num_stages * block_kv * head_dim * itemsize
          + 2 * fp8_stages * block_kv * head_dim
          + rows * head_dim * out_item + LSE_ROWS * 4 + 1024 + p_tile)


def num_sms() -> int:
  """Streaming multiprocessors of JAX's first device (132 where it does not
  say: H100 / H200 SXM)."""
  try:
    n = int(getattr(jax.devices()[0], "core_count", 0) or 0)
  except (RuntimeError, TypeError, ValueError):  # pragma: no cover
    n = 0
  return n if n > 0 else 132


def supports(*, dtype, kv_dtype, head_dim: int, page_size: int,
             group_size: int) -> bool:
  """Whether this kernel serves the case on this machine's GPU.

  Needs a Hopper GPU (wgmma is sm_90a only), bf16 / f16 q with pages of the
  same dtype (head_dim 64, 128 or 256) or float8_e4m3fn pages (head_dim 64
  or 128), a GQA group of 1..8 and a power-of-two page size in [8, 128].
  """
  dt = jnp.dtype(dtype)
  if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return False
  f8 = jnp.dtype(kv_dtype) == jnp.dtype(jnp.float8_e4m3fn)
  if jnp.dtype(kv_dtype) != dt and not f8:
    return False
  if head_dim not in ((64, 128) if f8 else (64, 128, 256)):
    return False
  if not 1 <= group_size <= MAX_GROUP:
    return False
  if page_size < 8 or page_size > 128 or page_size & (page_size - 1):
    return False
  return _compat.is_hopper()


_mgpu = _compat.mosaic_gpu


def _kernel(kv_lens_ref, q_ref, k_pool_ref, v_pool_ref, k_table_ref,
            v_table_ref, *rest, sm_scale: float, window_left: int,
            stage_transforms=(), logits_soft_cap: float | None,
            group_size: int, block_kv: int,
            num_stages: int, k_splits: int, final: bool, num_ctas: int,
            fp8_stages: int = 0, q_from_bf16: bool = False,
            keys_m: bool = False, cp_async: bool = False):
  plgpu = _mgpu()
  from jax.experimental import pallas as pl  # noqa: PLC0415
  rest = list(rest)
  # FP8 pages: f32[2] = (k_scale, v_scale), read as scalars.
  scales_ref = rest.pop(0) if fp8_stages else None
  out_ref, lse_ref, scoped = rest
  smem, bars, free, *more = scoped
  # cp.async pages: the stages' own barriers, K's then V's (i32 pairs).
  page_bars = more.pop() if cp_async else None
  p_smem = smem[-1] if keys_m else None  # P^T [block_kv, 16]
  q_smem, k_smem, v_smem, o_smem, lse_smem = smem[:5]
  if fp8_stages:
    k8_smem, v8_smem = smem[5:7]
    (k8_bar, v8_bar), (k8_free, v8_free) = more
  k_bar, v_bar, q_bar = bars
  k_free, v_free = free
  page_size = k_pool_ref.shape[1]
  num_kv_heads = k_pool_ref.shape[2]
  batch_size = kv_lens_ref.shape[0]
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype  # the dots' dtype (f16 with FP8 pages)
  f32, i32 = jnp.float32, jnp.int32
  bkv = jnp.array(block_kv, i32)

  cta = lax.axis_index("ctas")
  wg = lax.axis_index("wg")
  if cp_async:
    _mgpu_async.init_barriers(page_bars, 2 * num_stages)
  num_items = num_kv_heads * batch_size * k_splits
  # Items cta, cta + num_ctas, ...: kv heads fastest, then sequences, then
  # splits.
  my_items = lax.div(num_items - cta + (num_ctas - 1),
                     jnp.array(num_ctas, i32))

  def coords(t):
    """(kv_head, b, split) of this CTA's item t."""
    w = cta + t * num_ctas
    rest = lax.div(w, jnp.array(num_kv_heads, i32))
    return (lax.rem(w, jnp.array(num_kv_heads, i32)),
            lax.rem(rest, jnp.array(batch_size, i32)),
            lax.div(rest, jnp.array(batch_size, i32)))

  def item(t):
    """(kv_head, b, split, kv_len, lo, s0, s1, n) of this CTA's item t."""
    kv_head, b, split = coords(t)
    kv_len = kv_lens_ref[b]
    lo = jnp.array(0, i32)
    if window_left >= 0:
      lo = jnp.maximum(kv_len - 1 - window_left, 0)
    first_step = lax.div(lo, bkv)
    end_step = lax.div(kv_len + bkv - 1, bkv)
    steps = jnp.maximum(end_step - first_step, 0)
    per_split = lax.div(steps + (k_splits - 1), jnp.array(k_splits, i32))
    s0 = first_step + split * per_split
    s1 = jnp.minimum(s0 + per_split, end_step)
    return kv_head, b, split, kv_len, lo, s0, s1, jnp.maximum(s1 - s0, 0)

  def q_rows(kv_head, b):
    """First q row of the 16 loaded (a multiple of 8) and the group's offset
    in them: the group's rows of q [batch * num_qo_heads, head_dim] start at
    row0; a TMA into 8-row swizzle tiles starts at a multiple of 8."""
    row0 = b * (group_size * num_kv_heads) + kv_head * group_size
    first = pl.multiple_of(lax.div(row0, jnp.array(8, i32)) * 8, 8)
    return first, row0 - first

  @pl.when(wg == 0)
  def _consumer():
    # With `keys_m` the keys are the wgmmas' M dimension: S^T = K q^T is
    # [block_kv, 16] (the 16 loaded q rows, the group among them, as N) and
    # O^T = V^T P^T is [head_dim, 16], a quarter of the MMA work and softmax
    # elements of S = q K^T [64, block_kv] and O = P V [64, head_dim] per
    # key. Its softmax reduces over keys (axis 0, across the warpgroup's
    # warps), and the sum of p stays elementwise until the item's end.
    kax, qax = (0, 1) if keys_m else (1, 0)  # key / query axes of S
    s_shape = (block_kv, Q_ROWS) if keys_m else (BLOCK_M, block_kv)
    n_q = q_smem.shape[0]  # q buffers: 2, or 1 at head_dim 256
    if not keys_m:
      # Rows past the group compute on zeros (never stored).
      zeros = plgpu.layout_cast(jnp.zeros((BLOCK_M, head_dim), dtype),
                                plgpu.Layout.WGMMA)
      for i in range(n_q):
        q_smem.at[i][...] = zeros
      plgpu.commit_smem()

    def load_q(t):
      kv_head, b, _ = coords(t)
      first, _ = q_rows(kv_head, b)
      buf = lax.rem(t, jnp.array(n_q, i32))
      plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(first, Q_ROWS)],
                              q_smem.at[buf, pl.ds(0, Q_ROWS)], q_bar.at[buf])

    @pl.when(my_items > 0)
    def _():
      load_q(0)

    # FP8 pages: K's scale joins the logits' scale, V's the output's.
    k_scale = scales_ref[0] if scales_ref is not None else 1.0
    if logits_soft_cap is not None:
      scale = 1.0
      cap_scale = sm_scale / logits_soft_cap * k_scale
    else:
      scale = sm_scale * _LOG2E * k_scale

    def run_item(t, g):
      kv_head, b, split, kv_len, lo, s0, s1, n = item(t)
      buf = lax.rem(t, jnp.array(n_q, i32))
      if n_q == 2:
        # The next item's q goes into the other buffer (its last reader,
        # the item before this one, is done).
        @pl.when(t + 1 < my_items)
        def _():
          load_q(t + 1)
      plgpu.barrier_wait(q_bar.at[buf])
      q_buf = q_smem.at[buf]
      if q_from_bf16:
        # FP8 pages: the dots run in f16 (e4m3 converts to f16 in one cvt
        # per pair). q arrived as bf16 bits in an f16 buffer: convert it in
        # place, clamped to f16's range.
        x = _compat.mgpu_load(q_buf, plgpu.Layout.WGMMA)
        q_buf[...] = _fp8.query_for_dots(
            lax.bitcast_convert_type(x, jnp.bfloat16))
        plgpu.commit_smem()

      def step(i, carry, masked: bool):
        acc, m, l = carry
        slot = lax.rem(g + i - s0, jnp.array(num_stages, i32))
        if cp_async:
          parity = lax.rem(lax.div(g + i - s0, jnp.array(num_stages, i32)),
                           jnp.array(2, i32))
          _mgpu_async.wait(page_bars, slot, parity)
        else:
          plgpu.barrier_wait(k_bar.at[slot])

        def qk(acc_ref):
          if keys_m:
            plgpu.wgmma(acc_ref, k_smem.at[slot], q_buf.transpose((1, 0)))
          else:
            plgpu.wgmma(acc_ref, q_buf, k_smem.at[slot].transpose((1, 0)))
          return acc_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC(s_shape, f32))
        plgpu.barrier_arrive(k_free.at[slot])
        if logits_soft_cap is not None:
          s = jnp.tanh(s * cap_scale) * (logits_soft_cap * _LOG2E)
        if masked:
          key = plgpu.broadcasted_iota(i32, s_shape, kax,
                                       layout=plgpu.Layout.WGMMA)
          key = key + i * block_kv
          s = jnp.where((key < kv_len) & (key >= lo), s, -jnp.inf)
        # Every split's first step holds a visible key, so m is finite
        # from then on and exp2(-inf - m) = 0 for the masked keys.
        m_next = jnp.maximum(m, s.max(axis=kax) * scale)
        alpha = jnp.exp2(m - m_next)
        p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_next, s_shape, [qax]))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [qax])
        if keys_m:
          l = l * lax.broadcast_in_dim(alpha, s_shape, [1]) + p
          # P^T is PV's B operand: through shared memory (the last step's
          # PV, whose wgmma was waited for, has read it).
          p_smem[...] = p.astype(dtype)
          plgpu.commit_smem()
        else:
          l = l * alpha + p.sum(axis=1)
          p16 = p.astype(dtype)
        if cp_async:
          _mgpu_async.wait(page_bars, slot + num_stages, parity)
        else:
          plgpu.barrier_wait(v_bar.at[slot])
        if masked:
          # V rows of keys outside [lo, kv_len) meet p = 0 but may be NaN:
          # stale rows past kv_len, and before the window the rows of the
          # first visible page loaded in place of released ones (with its
          # own stale tail). Zero them.
          @pl.when(((i + 1) * block_kv > kv_len) | (i * block_kv < lo))
          def _():
            v_slot = v_smem.at[slot]
            key = plgpu.broadcasted_iota(i32, (block_kv, head_dim), 0,
                                         layout=plgpu.Layout.WGMMA)
            key = key + i * block_kv
            v_slot[...] = jnp.where((key < kv_len) & (key >= lo),
                                    v_slot[...],
                                    jnp.zeros((block_kv, head_dim), dtype))
            plgpu.commit_smem()

        def pv(acc_ref):
          if keys_m:
            plgpu.wgmma(acc_ref, v_smem.at[slot].transpose((1, 0)), p_smem)
          else:
            plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_next, l

      # Steps [s0, s1): the first may hold keys before the window, the last
      # keys past kv_len; the ones between are fully visible.
      full_lo = jnp.clip(lax.div(lo + bkv - 1, bkv), s0, jnp.maximum(s1, s0))
      full_hi = jnp.clip(lax.div(kv_len, bkv), full_lo, jnp.maximum(s1, s0))

      def run(lo_i, hi_i, carry, masked):
        return lax.fori_loop(lo_i, hi_i,
                             lambda i, c: step(i, c, masked), carry)

      wgmma_layout = plgpu.Layout.WGMMA
      q_layout = wgmma_layout.reduce(kax)
      acc_shape = (head_dim, Q_ROWS) if keys_m else (BLOCK_M, head_dim)
      m = plgpu.layout_cast(jnp.full((s_shape[qax],), -jnp.inf, f32),
                            q_layout)
      l = plgpu.layout_cast(jnp.full(s_shape if keys_m else (BLOCK_M,), 0.0,
                                     f32), wgmma_layout if keys_m else q_layout)
      acc = plgpu.layout_cast(jnp.full(acc_shape, 0.0, f32), wgmma_layout)
      carry = (acc, m, l)
      carry = run(s0, full_lo, carry, True)
      carry = run(full_lo, full_hi, carry, False)
      carry = run(full_hi, jnp.maximum(s1, s0), carry, True)
      acc, m, l = carry
      if n_q == 1:
        # One q buffer: this item's matmuls are done, so the next item's q
        # loads during this epilogue.
        @pl.when(t + 1 < my_items)
        def _():
          load_q(t + 1)
      if keys_m:
        l = l.sum(axis=0)

      ok = l > 0.0
      inv = jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)
      if scales_ref is not None:
        inv = inv * scales_ref[1]  # V's scale
      out = acc * lax.broadcast_in_dim(inv, acc.shape, [qax])
      lse = jnp.where(
          ok, (m + jnp.log(jnp.where(ok, l, 1.0)) * _LOG2E) * _LN2, -jnp.inf)
      # The last item's stores must have read o_smem / lse_smem.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      o_smem[...] = out.astype(o_smem.dtype)
      lse_smem[...] = lse
      plgpu.commit_smem()
      if keys_m:
        # O^T of all 16 rows; the wrapper picks the group's.
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[b, kv_head, split])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, kv_head, split])
        return g + n
      # The group's rows only, as a ladder of power-of-two TMA boxes.
      _, r = q_rows(kv_head, b)
      q_row = kv_head * group_size
      off = 0
      size = GROUP_ROWS
      while size >= 1:
        if group_size & size:
          src = o_smem.at[pl.ds(r + off, size)]
          if final:
            dst = out_ref.at[b, pl.ds(q_row + off, size)]
          else:
            dst = out_ref.at[b, kv_head, split, pl.ds(off, size)]
          plgpu.copy_smem_to_gmem(src, dst)
          off += size
        size //= 2
      if final:
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, kv_head])
      else:
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, kv_head, split])
      return g + n

    lax.fori_loop(0, my_items, run_item, jnp.array(0, i32))
    plgpu.wait_smem_to_gmem(0)

  # The TMA ring: the consumers' stages, or with FP8 pages the FP8
  # staging ring that the converter (warpgroup 2) empties into them.
  if fp8_stages:
    ring = (k8_smem, v8_smem, k8_bar, v8_bar, k8_free, v8_free, fp8_stages)
  else:
    ring = (k_smem, v_smem, k_bar, v_bar, k_free, v_free, num_stages)

  @pl.when(wg == 1)
  def _producer():
    # No register hand-over: one CTA per SM (the K/V ring fills shared
    # memory) leaves every thread its registers; a producer cut to 40
    # spilled the page ids it carries.
    rows = min(page_size, block_kv)
    copies = block_kv // rows
    k_dst, v_dst, k_full, v_full, k_empty, v_empty, depth = ring

    def produce_item(t, g):
      kv_head, b, _, kv_len, lo, s0, _, n = item(t)
      first_page = lax.div(lo, jnp.array(page_size, i32))
      last_page = jnp.maximum(
          lax.div(kv_len + page_size - 1, jnp.array(page_size, i32)) - 1, 0)

      def page_ids(i):
        """The page ids of step i, K's then V's: `copies` each."""
        ids = []
        for table_ref in (k_table_ref, v_table_ref):
          for c in range(copies):
            if page_size >= block_kv:
              page_idx = lax.div(i, jnp.array(page_size // block_kv, i32))
            else:
              page_idx = i * copies + c
            ids.append(table_ref[b, jnp.clip(page_idx, first_page, last_page)])
        return tuple(ids)

      def issue(i, slot, pages, pool_ref, smem, bar):
        r0 = 0
        if page_size >= block_kv:
          per_page = page_size // block_kv
          r0 = pl.multiple_of(
              lax.rem(i, jnp.array(per_page, i32)) * block_kv, block_kv)
        if cp_async:
          # The whole warpgroup copies the tile, one 16-byte chunk per
          # thread at a time, and arrives at the stage's own barrier.
          _mgpu_async.copy_page_rows(
              pool_ref, smem, page_bars, slot=slot,
              bar_index=slot + (0 if bar is k_full else num_stages),
              kv_head=kv_head, row0=jnp.asarray(r0, i32), pages=pages,
              rows_per_page=rows, transforms=stage_transforms)
          return
        for c in range(copies):
          plgpu.copy_gmem_to_smem(
              pool_ref.at[pages[c], pl.ds(r0, rows), kv_head],
              smem.at[slot, pl.ds(c * rows, rows)], bar.at[slot])

      # The ring runs on across items: global step g + j uses slot
      # (g + j) % depth, free from the start for the first lap. The
      # page ids of step j + 1 are loaded while step j waits for its slot
      # (one table round trip per step, not one per page; the index is
      # clamped into the visible pages, so a step past the end reads a
      # valid entry and is never issued). Loading them 2 or 3 steps ahead
      # changed no kernel time by more than run-to-run noise (H200,
      # 2026-11-26: SmolLM2 / Gemma 3 / Llama-3-8B heads, 16-token pages).
      def body(j, pages):
        gj = g + j
        slot = lax.rem(gj, jnp.array(depth, i32))
        i = s0 + j
        nxt = page_ids(i + 1)

        @pl.when(gj >= depth)
        def _():
          plgpu.barrier_wait(k_empty.at[slot])
        issue(i, slot, pages[:copies], k_pool_ref, k_dst, k_full)

        @pl.when(gj >= depth)
        def _():
          plgpu.barrier_wait(v_empty.at[slot])
        issue(i, slot, pages[copies:], v_pool_ref, v_dst, v_full)
        return nxt
      lax.fori_loop(0, n, body, page_ids(s0))
      return g + n

    lax.fori_loop(0, my_items, produce_item, jnp.array(0, i32))

  if fp8_stages:
    @pl.when(wg == 2)
    def _converter():
      """FP8 pages: each staged K and V tile converts to f16 (one cvt per
      pair; e4m3 is exact in f16), 64 rows at a time, into the stage the
      consumer reads. `commit_smem` orders the stores before the consumer's
      wgmma and this warpgroup's staging reads before the TMA that refills
      the slot."""
      tiles = ((k8_smem, k8_bar, k8_free, k_smem, k_bar, k_free),
               (v8_smem, v8_bar, v8_free, v_smem, v_bar, v_free))

      def convert_item(t, g):
        n = item(t)[-1]

        def body(j, _):
          gj = g + j
          s8 = lax.rem(gj, jnp.array(fp8_stages, i32))
          slot = lax.rem(gj, jnp.array(num_stages, i32))
          for src, full8, empty8, dst, full, empty in tiles:
            plgpu.barrier_wait(full8.at[s8])

            @pl.when(gj >= num_stages)
            def _(empty=empty):
              plgpu.barrier_wait(empty.at[slot])
            for r in range(0, block_kv, 64):
              x = _compat.mgpu_load(src.at[s8, pl.ds(r, 64)],
                                    plgpu.Layout.WGMMA)
              dst[slot, pl.ds(r, 64)] = x.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_arrive(full.at[slot])
            plgpu.barrier_arrive(empty8.at[s8])
          return None
        lax.fori_loop(0, n, body, None)
        return g + n

      lax.fori_loop(0, my_items, convert_item, jnp.array(0, i32))


def _group_index(batch_size: int, num_kv_heads: int, num_qo_heads: int):
  """i32[batch_size, num_kv_heads, group_size]: the rows of group (b, k)
  among the 16 q rows its CTA loaded. The group starts at q row
  `b * num_qo_heads + k * group_size`, loaded from that row rounded down
  to 8."""
  group_size = num_qo_heads // num_kv_heads
  row0 = (jnp.arange(batch_size)[:, None] * num_qo_heads
          + jnp.arange(num_kv_heads)[None, :] * group_size)
  return (row0 % 8)[..., None] + jnp.arange(group_size)


def group_lse(lse, *, num_qo_heads: int):
  """The group rows of the kernel's lse rows.

  Args:
    lse: f32[batch_size, num_kv_heads, ..., 64] as `paged_decode_mgpu`
      returns it.
    num_qo_heads: static.

  Returns:
    f32[batch_size, num_kv_heads, ..., group_size]: head `h` of group `k`.
  """
  idx = _group_index(*lse.shape[:2], num_qo_heads)
  group_size = idx.shape[-1]
  idx = idx.reshape(idx.shape[:2] + (1,) * (lse.ndim - 3) + (group_size,))
  idx = jnp.broadcast_to(idx, lse.shape[:-1] + (group_size,))
  return jnp.take_along_axis(lse, idx, axis=-1)


def _group_cols(o_t, *, num_qo_heads: int):
  """`o_t [batch_size, num_kv_heads, k_splits, head_dim, 16]` (the keys_m
  kernel's O^T over the 16 loaded q rows) -> the group's rows
  `[batch_size, num_kv_heads, k_splits, group_size, head_dim]`, picked as
  `group_lse` picks lse rows."""
  idx = _group_index(*o_t.shape[:2], num_qo_heads)
  idx = jnp.broadcast_to(idx[:, :, None, None, :],
                         o_t.shape[:-1] + (idx.shape[-1],))
  return jnp.swapaxes(jnp.take_along_axis(o_t, idx, axis=-1), -1, -2)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "window_left", "logits_soft_cap", "block_kv",
                     "num_stages", "k_splits", "final", "num_ctas",
                     "fp8_stages", "keys_m", "cp_async"))
def paged_decode_mgpu(
    q: jax.Array,         # [batch_size, num_qo_heads, head_dim]
    k_pool: jax.Array,    # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool: jax.Array,    # [num_pages', page_size, num_kv_heads, head_dim]
    k_table: jax.Array,   # i32[batch_size, max_pages]
    v_table: jax.Array,   # i32[batch_size, max_pages]
    kv_lens: jax.Array,   # i32[batch_size]
    *,
    sm_scale: float,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    block_kv: int = 128,
    num_stages: int = 2,
    k_splits: int = 1,
    final: bool | None = None,
    num_ctas: int | None = None,
    k_scale=None,         # f32[]: FP8 pages
    v_scale=None,         # f32[]: FP8 pages
    fp8_stages: int = 2,
    keys_m: bool = False,
    cp_async: bool = False,
):
  """One persistent Mosaic-GPU launch of split-K paged decode (see the module
  docstring).

  Semantics are `reference.paged_decode_reference` without sinks: query `b`
  sits at position `kv_lens[b] - 1` and sees keys `j` with
  `max(0, kv_lens[b] - 1 - window_left) <= j < kv_lens[b]`.

  Args:
    q: `[batch_size, num_qo_heads, head_dim]`, bf16 or f16, head_dim 64, 128
      or 256 (64 or 128 with FP8 pages), `num_qo_heads = group_size *
      num_kv_heads` with group_size 1..8.
    k_pool, v_pool: `[num_pages, page_size, num_kv_heads, head_dim]`, dtype
      of `q` or float8_e4m3fn with `k_scale` / `v_scale` (may be one array
      with split tables); page_size a power of two in [8, 128].
    k_table, v_table: `i32[batch_size, max_pages]`; only entries of visible
      pages are read.
    kv_lens: `i32[batch_size]`, tokens including the current one.
    sm_scale, window_left, logits_soft_cap: static, as `paged_decode`.
    block_kv: static, keys per step: 64 or 128, a multiple of page_size or
      a divisor of it.
    num_stages: static, shared-memory stages of the K/V ring (>= 2).
    k_splits: static, splits of each sequence's visible steps.
    final: static; store the output itself (needs `k_splits == 1`) or
      per-split partials; None = `k_splits == 1` (False with one split: a
      partial, for a combine that adds sinks).
    num_ctas: static, CTAs of the persistent grid (each takes every
      `num_ctas`-th (kv head, sequence, split) item, with the K/V ring
      running on from one item to the next); None = the device's SM count,
      at most the number of items.
    k_scale, v_scale: f32 scalars (may be traced), exactly with FP8 pages:
      a stored value `x` means `x * scale` (FlashInfer / vLLM's per-tensor
      scales). TMA brings the FP8 pages into a staging ring of
      `fp8_stages` stages, a third warpgroup converts each tile to f16 into
      the consumer's stage, and the dots run in f16 (q rounded to f16 after
      clamping to its range, as `_fp8.query_for_dots`); K's scale joins the
      logits' scale, V's the output's.
    fp8_stages: static, stages of the FP8 staging ring (>= 1).
    keys_m: static; put the keys in the wgmmas' M dimension (`S^T = K
      q^T`, `O^T = V^T P^T` with the 16 loaded q rows as N) instead of the
      q rows (padded to 64); same results.
    cp_async: static; the producer warpgroup loads the pages with
      `cp.async` (every thread 16 bytes at a time, `_mgpu_async`) instead
      of one TMA copy per page; same results. bf16 / f16 pages without
      `keys_m` only.

  Returns:
    With `final`: `(out [batch_size, num_qo_heads, head_dim] q.dtype,
    lse f32[batch_size, num_kv_heads, 64])`, where the natural-log LSE of
    head `h` of group `k` is at the row `group_lse` picks. Otherwise per-split
    partials `(o f32[batch_size, num_kv_heads, k_splits, 8, head_dim],
    lse f32[batch_size, num_kv_heads, k_splits, 64])`, normalised per split,
    o rows `0..group_size-1` written, lse rows as above (empty splits:
    `o = 0`, `lse = -inf`). With `keys_m` the lse has 16 rows (the loaded
    q rows; `group_lse` picks the same way) and the partials
    `group_size` rows.

  Raises:
    ValueError: an unsupported dtype, head_dim, group size, page_size,
      block_kv / num_stages, more shared memory than a CTA has,
      `num_ctas < 1`, scales given without FP8 pages or missing with them,
      `fp8_stages < 1`, or `cp_async` with FP8 pages or `keys_m`.
  """
  plgpu = _mgpu()
  from jax.experimental import pallas as pl  # noqa: PLC0415
  batch_size, num_qo_heads, head_dim = q.shape
  _, page_size, num_kv_heads, _ = k_pool.shape
  dtype = q.dtype
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"Invalid q dtype: expected bf16 or f16, got {dtype}")
  f8 = jnp.dtype(jnp.float8_e4m3fn)
  fp8 = jnp.dtype(k_pool.dtype) == f8
  if k_pool.dtype != v_pool.dtype or k_pool.dtype not in (dtype, f8):
    raise ValueError(f"Invalid k_pool/v_pool dtype: expected {dtype} or "
                     f"float8_e4m3fn for both, got "
                     f"{k_pool.dtype}/{v_pool.dtype}")
  if fp8 != (k_scale is not None) or (k_scale is None) != (v_scale is None):
    raise ValueError(
        f"Invalid scales: expected k_scale and v_scale exactly with "
        f"float8_e4m3fn pages, got pages {k_pool.dtype}, "
        f"k_scale={k_scale is not None}, v_scale={v_scale is not None}")
  if fp8 and head_dim > 128:
    raise ValueError(f"Invalid head_dim with float8_e4m3fn pages: expected "
                     f"64 or 128, got {head_dim}")
  if fp8 and fp8_stages < 1:
    raise ValueError(f"Invalid fp8_stages: expected >= 1, got {fp8_stages}")
  if cp_async and (fp8 or keys_m):
    raise ValueError(f"Invalid cp_async=True: expected bf16 / f16 pages "
                     f"without keys_m, got pages {k_pool.dtype}, "
                     f"keys_m={keys_m}")

  if head_dim not in (64, 128, 256):
    raise ValueError(f"Invalid head_dim: expected 64, 128 or 256, got "
                     f"{head_dim}")
  group_size = num_qo_heads // num_kv_heads
  if group_size * num_kv_heads != num_qo_heads or not (
      1 <= group_size <= MAX_GROUP):
    raise ValueError(f"Invalid num_qo_heads / num_kv_heads: expected a group "
                     f"of 1..{MAX_GROUP}, got {num_qo_heads}/{num_kv_heads}")
  if page_size < 8 or page_size > 128 or page_size & (page_size - 1):
    raise ValueError(f"Invalid page_size: expected a power of two in "
                     f"[8, 128], got {page_size}")
  if block_kv not in (64, 128) or num_stages < 2 or k_splits < 1:
    raise ValueError(f"Invalid (block_kv, num_stages, k_splits): expected "
                     f"64/128, >= 2, >= 1, got "
                     f"{(block_kv, num_stages, k_splits)}")
  if final is None:
    final = k_splits == 1
  if final and k_splits != 1:
    raise ValueError(f"Invalid final=True: expected k_splits == 1, got "
                     f"{k_splits}")
  itemsize = jnp.dtype(dtype).itemsize
  need = smem_bytes(head_dim=head_dim, block_kv=block_kv,
                    num_stages=num_stages, itemsize=itemsize, final=final,
                    fp8_stages=fp8_stages if fp8 else 0, keys_m=keys_m)
  if need > SMEM_LIMIT:
    raise ValueError(f"Invalid num_stages={num_stages}: expected at most "
                     f"{SMEM_LIMIT} bytes of shared memory, got {need}")
  copies = block_kv // min(page_size, block_kv)
  num_items = num_kv_heads * batch_size * k_splits
  if num_ctas is None:
    num_ctas = num_sms()
  if num_ctas < 1:
    raise ValueError(f"Invalid num_ctas: expected >= 1, got {num_ctas}")
  num_ctas = min(num_ctas, num_items)
  # FP8 pages: the dots run in f16; a bf16 q travels as its bits in an f16
  # view (a free bitcast) and is converted in the kernel.
  out_dtype = dtype
  if fp8:
    dtype = jnp.dtype(jnp.float16)
  # (keys_m: a 16-row q tile has no WGMMA layout to convert it in, so q
  # converts before the launch.)
  q_from_bf16 = fp8 and out_dtype != dtype and not keys_m
  kernel = functools.partial(
      _kernel, sm_scale=sm_scale, window_left=window_left,
      logits_soft_cap=logits_soft_cap, group_size=group_size,
      block_kv=block_kv, num_stages=num_stages, k_splits=k_splits,
      final=final, num_ctas=num_ctas, fp8_stages=fp8_stages if fp8 else 0,
      q_from_bf16=q_from_bf16, keys_m=keys_m, cp_async=cp_async)

  def entry(*refs):
    swizzle = 128 if head_dim * itemsize >= 128 else 64
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)),
                  plgpu.SwizzleTransform(swizzle))
    o_dtype = out_dtype if final else jnp.float32
    # keys_m: V^T is the A operand and P^T [block_kv, 16] the B operand of
    # PV: their swizzles must match, and P^T's 16-element rows take 32
    # bytes. q holds its 16 loaded rows, the output tile is O^T.
    narrow = (plgpu.TilingTransform((8, 32 // itemsize)),
              plgpu.SwizzleTransform(32))
    q_rows_smem, o_shape, lse_rows = (
        (Q_ROWS, (head_dim, Q_ROWS), Q_ROWS) if keys_m
        else (BLOCK_M, (BLOCK_M, head_dim), LSE_ROWS))
    smem = [
        plgpu.SMEM((q_buffers(head_dim), q_rows_smem, head_dim), dtype,
                   transforms=transforms),
        plgpu.SMEM((num_stages, block_kv, head_dim), dtype,
                   transforms=transforms),
        plgpu.SMEM((num_stages, block_kv, head_dim), dtype,
                   transforms=narrow if keys_m else transforms),
        plgpu.SMEM(o_shape, o_dtype),
        plgpu.SMEM((lse_rows,), jnp.float32),
    ]
    # The consumer's stages fill by TMA (`copies` arrivals) or, with FP8
    # pages, by the converter (one arrival).
    arrivals = 1 if fp8 else copies
    extra = []
    if fp8:
      swizzle8 = 128 if head_dim >= 128 else 64
      transforms8 = (plgpu.TilingTransform((8, swizzle8)),
                     plgpu.SwizzleTransform(swizzle8))
      smem += [plgpu.SMEM((fp8_stages, block_kv, head_dim), f8,
                          transforms=transforms8)] * 2
      extra = [
          (plgpu.Barrier(num_arrivals=copies, num_barriers=fp8_stages),) * 2,
          (plgpu.Barrier(num_barriers=fp8_stages),) * 2]
    if keys_m:
      smem.append(plgpu.SMEM((block_kv, Q_ROWS), dtype, transforms=narrow))
    if cp_async:
      # One mbarrier (two i32 words) per K and per V stage.
      extra.append(plgpu.SMEM((4 * num_stages,), jnp.int32))
    pl.run_scoped(
        lambda *scoped: kernel(*refs, scoped,
                               stage_transforms=transforms),
        smem,
        (plgpu.Barrier(num_arrivals=arrivals, num_barriers=num_stages),
         plgpu.Barrier(num_arrivals=arrivals, num_barriers=num_stages),
         plgpu.Barrier(num_barriers=2)),
        (plgpu.Barrier(num_barriers=num_stages),) * 2,
        *extra,
        collective_axes="wg",
    )

  # q as rows [batch_size * num_qo_heads, head_dim] (a free reshape); a
  # TMA into 8-row swizzle tiles needs a multiple of 8 rows. The last CTA's
  # 16-row box may run past the end (TMA fills zeros).
  rows = batch_size * num_qo_heads
  q_in = q.reshape(rows, head_dim)
  if rows % 8:
    q_in = jnp.pad(q_in, ((0, -rows % 8), (0, 0)))
  if q_from_bf16:
    q_in = lax.bitcast_convert_type(q_in, dtype)
  elif fp8:
    q_in = _fp8.query_for_dots(q_in)
  args = [kv_lens.astype(jnp.int32), q_in, k_pool, v_pool,
          k_table.astype(jnp.int32), v_table.astype(jnp.int32)]
  if fp8:
    args.append(jnp.stack([jnp.asarray(k_scale, jnp.float32).reshape(()),
                           jnp.asarray(v_scale, jnp.float32).reshape(())]))
  if keys_m:
    out_type = [
        jax.ShapeDtypeStruct(
            (batch_size, num_kv_heads, k_splits, head_dim, Q_ROWS),
            out_dtype if final else jnp.float32),
        jax.ShapeDtypeStruct((batch_size, num_kv_heads, k_splits, Q_ROWS),
                             jnp.float32)]
  elif final:
    out_type = [
        jax.ShapeDtypeStruct((batch_size, num_qo_heads, head_dim), out_dtype),
        jax.ShapeDtypeStruct((batch_size, num_kv_heads, LSE_ROWS),
                             jnp.float32)]
  else:
    out_type = [
        jax.ShapeDtypeStruct(
            (batch_size, num_kv_heads, k_splits, GROUP_ROWS, head_dim),
            jnp.float32),
        jax.ShapeDtypeStruct((batch_size, num_kv_heads, k_splits, LSE_ROWS),
                             jnp.float32)]
  res = plgpu.kernel(
      entry,
      out_type=out_type,
      grid=(num_ctas,),
      grid_names=("ctas",),
      num_threads=3 if fp8 else 2,
      thread_name="wg",
      # The row reductions (WGMMA layout) stay within warps: no scratch
      # (at head_dim 256 its default 2 KiB would not fit); keys_m reduces
      # across warps.
      compiler_params=plgpu.CompilerParams(
          approx_math=True, reduction_scratch_bytes=1024 if keys_m else 0),
  )(*args)
  if not keys_m:
    return res
  o_t, lse = res
  o = _group_cols(o_t, num_qo_heads=num_qo_heads)
  if final:
    o = o.reshape(batch_size, num_qo_heads, head_dim)
    lse = lse[:, :, 0]
  return o, lse
