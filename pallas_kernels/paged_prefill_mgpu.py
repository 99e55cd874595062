"""Paged prefill attention for Hopper: Pallas on Mosaic GPU (TMA + wgmma).

The Pallas-Triton prefill kernel (`paged_prefill.py`) stays well short of
cuDNN on Hopper (measured: docs/performance.md): Triton, as bundled with jax,
neither warp-specialises nor keeps a wgmma in flight across the softmax.
This kernel is the FlashAttention-3 forward (Shah et al. 2024,
arXiv:2407.08608: producer / consumer warpgroups, TMA loads into a ring of
shared-memory stages, two consumer warpgroups whose matmuls alternate with
each other's softmax) over FlashInfer's paged, ragged layout:

* An item is one query head and one plan tile of `tile_q(n)` = 64 n
  consecutive new tokens of one sequence (`plan.plan_prefill(block_q=...)`;
  with `align=8`, heaviest tiles first: a tile's rows start at its first
  token rounded down to 8, so TMA lands them on whole 8-row swizzle tiles;
  rows of other sequences are computed and never stored). n = 2 or 3
  consumer warpgroups take 64 rows each; one more (the producer) issues
  TMA, from one of its warps (FA3's producer; with FP8 pages the whole
  warpgroup, which converts the tiles). Items run heads fastest, so the
  heads of one GQA group run together and share the K/V they read through
  L2.
* `pack_gqa` (FlashAttention-3's PackGQA): an item is one kv head and a
  tile of `tile_q(n, G)` tokens, and a consumer's 64 rows are 64 // G
  tokens x the group's G query heads (row r: token r // G, head r % G). A
  K/V stage then serves the whole group, and a causal tile's diagonal
  spans 64 // G tokens instead of 64. Those rows are no TMA box: the
  consumers load q and store the output and lse row by row, per thread
  (`_mgpu_rows`), which also writes lse in place; tiles start at their
  first token (`plan_align`).
* One CTA per item, or with `persistent` one per SM, each taking every
  num_sms-th item: the K/V ring runs on from one item into the next (step
  i of an item whose first step is the CTA's global step g uses stage
  (g + i) % num_stages), so the producer loads the next item's pages while
  the consumers finish the last one, and a short tile's pipeline fill and
  epilogue overlap other work. Every warpgroup loads an item's plan row an
  item ahead, and packed consumers copy the next item's q rows (and sinks)
  with `cp.async` into a second q buffer while one runs, so items of one
  or two steps (prompts of a few hundred tokens) do not wait on those
  loads. Unpacked items of tiles the plan left unused (the static grid's
  spare tiles: all of them in a speculative decoding verify step, whose
  sequences run in the decode kernel) skip the q load and epilogue, and
  the plan bounds the grid tightly (`plan.max_tiles`).
* A KV step is `block_kv` keys. The producer's warp reads the step's page
  ids from the page table (scalars; with two consumers before it waits for
  the step's stage, so their latency hides behind that wait) and issues one
  TMA copy per page
  (`pool[page, rows, kv_head, :]` -> `[page_size, head_dim]` of the stage),
  all arriving on the stage's barrier. Pages past the last one a sequence
  owns are never read (the page index is clamped to that page).
* Two schedules share the tensor cores between the consumers. "pingpong"
  (two consumers): a two-party barrier keeps them in lock step, each one's
  QK^T and PV alternating with the other's softmax. "ring" (any number; FA3
  runs three at head_dim 64, where a step's matmuls are half as long per
  softmax element): a token passes from consumer to consumer, and the
  holder issues QK^T of its step i together with PV of step i - 1, then
  passes it on and runs step i's softmax while the others' matmuls run.
* Consumers walk the unmasked steps first, then the steps that cross the
  diagonal or `kv_len`, masked with -inf. Keys past `kv_len` of the last
  page are stale (possibly NaN, left by a previous owner): their logits are
  masked, and their V rows are zeroed in shared memory before the PV matmul,
  since 0 * NaN would otherwise reach the output.
* Softmax in base 2 with the scale folded into the exponent (FA3); the
  optional soft cap is applied first; sinks join the denominator at the end.
* Unpacked output rows are stored with TMA in a ladder of power-of-two row
  counts (a tile's rows past its sequence's end belong to another sequence
  and must not be written); `lse` rows are stored in place per thread
  (`_mgpu_rows.store_lse`: a TMA box needs >= 16 bytes in its minor
  dimension), so no XLA scatter follows the launch.

FP8 pages (float8_e4m3fn, `k_scale` / `v_scale` per tensor or per KV
head): TMA fills an FP8 staging ring and the producer warpgroup converts
each staged tile to f16 into the stage the consumers read
(`_fp8_producer`); q is converted to f16 once per item; the item's kv
head's K scale multiplies its logits and V's scale its output. 128-key
steps (64 at head_dim 256) with one staging stage is what fits in 227 KiB
of shared memory (the reduction scratch, unused by the row reductions of
the WGMMA layout, is given up for it). FP8 pages run two consumers: the
converting producer needs the registers a third consumer would take.

Sliding window (`window_left`): an item's steps start at the block of the
first key its first token sees, for the producer and every consumer alike
(the consumers' barrier phases stay in step; a later consumer's first
steps may be wholly masked for its rows, which the softmax allows for).
Steps before the keys every row of a consumer sees are masked like the
diagonal's. Pages before the one of that first key may be released: they
are never read (the page index is clamped up to it), and the V rows the
clamped copies bring are zeroed.

Head_dim 256 (Gemma 2 / Gemma 3 layers): two consumers' q tiles, their
output tiles and two 64-key K/V stages would take 256 KiB. A consumer's q
tile is dead once its last QK^T has run, so there its output tile takes
the same shared memory (`RefUnion`): 196 KiB with 64-key steps; with FP8
pages one 64-key staging stage more (32 KiB) and no reduction scratch,
224.5 KiB. Unpacked tiles only. The FP8 conversions (q's from bf16, the
producer's of staged tiles) go 128 columns at a time, so their registers
are those of head_dim 128. `dispatch.prefill` keeps the Triton kernel for
f32, other GPUs and the cases `supports` turns down.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pkvattn.pallas_kernels import _compat
from pkvattn.pallas_kernels import _fp8
from pkvattn.pallas_kernels import plan as plan_lib

BLOCK_Q = 64          # tokens per consumer warpgroup
TILE_Q = 2 * BLOCK_Q  # tokens per CTA (the plan's block_q), two consumers
CONSUMERS = (2, 3)    # consumer warpgroups per CTA
HEAD_DIMS = (64, 128, 256)
SCHEDULES = ("pingpong", "ring")
ALIGN = 8             # tile origins: TMA lands rows on 8-row swizzle tiles
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
SMEM_BYTES = 227 * 1024  # per CTA on Hopper
_SLACK = 2048            # barriers, alignment
_REDUCTION_SCRATCH = 2048  # Mosaic GPU's default; none with FP8 pages
_CONVERT_COLS = 128      # columns an FP8 / bf16-q conversion pass holds


def supports(*, dtype, head_dim: int, page_size: int,
             block_kv: int = 128) -> str | None:
  """Why this kernel does not take a case (a sentence), or None when it
  does: bf16/f16 q, head_dim 64, 128 or 256, and page_size >= 8 (TMA rows
  land on 8-row swizzle tiles) dividing `block_kv` or divisible by it; any
  window; bf16/f16 or FP8 pages. It runs on Hopper GPUs only (wgmma is
  sm_90a only): that is `dispatch.prefill`'s check, not this one's."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype).name} is not bf16 / f16"
  if head_dim not in HEAD_DIMS:
    return f"head_dim {head_dim} is not one of {HEAD_DIMS}"
  if page_size < 8 or (page_size < block_kv and block_kv % page_size):
    return (f"page_size {page_size} is not >= 8 and dividing block_kv "
            f"{block_kv} or divisible by it")
  return None


_mgpu = _compat.mosaic_gpu

# Registers per thread by (consumers, FP8 pages). Consumers + producer stay
# within 64,512 registers (2 x 128 x 232 + 128 x 40, 3 x 128 x 160 + 128 x
# 24): `setmaxnreg.inc` blocks until its registers are free, and a full
# 65,536 never are (the kernel hangs). With FP8 pages the producer converts
# tiles, so it keeps more.
_CONSUMER_REGS = {(2, False): 232, (2, True): 224, (3, False): 160}
_PRODUCER_REGS = {(2, False): 40, (2, True): 56, (3, False): 24}


def _smem_bytes(num_consumers: int, q_buffers: int, head_dim: int,
                block_kv: int, num_stages: int, fp8_stages: int,
                packed_sinks: bool, out_in_q: bool = False) -> int:
  """Shared memory the kernel allocates (2-byte q and pages in the dots;
  FP8 staging; packed tiles' sink logits; the barriers in `_SLACK`; the
  reduction scratch, which builds on FP8 pages give up). `out_in_q`: the
  output tiles share the q tiles' memory."""
  n = num_consumers
  rows = BLOCK_Q * head_dim * 2
  q_and_out = (max(q_buffers, 1) if out_in_q else q_buffers + 1) * n * rows
  total = q_and_out + n * BLOCK_Q * 4  # q, out, lse
  total += 2 * num_stages * block_kv * head_dim * 2
  total += 2 * fp8_stages * block_kv * head_dim
  total += q_buffers * n * BLOCK_Q * 4 if packed_sinks else 0
  return total + _SLACK + (0 if fp8_stages else _REDUCTION_SCRATCH)


def tile_q(num_consumers: int, pack_group: int = 1) -> int:
  """Tokens per CTA (the plan's `block_q`) with `num_consumers` consumer
  warpgroups of `BLOCK_Q` rows each: `BLOCK_Q` tokens of one query head
  (`pack_group` 1), or with a GQA group of `pack_group` heads packed into
  the rows (`pack_gqa`), `BLOCK_Q // pack_group` tokens of all of them."""
  return num_consumers * (BLOCK_Q // pack_group)


def plan_align(pack_gqa: bool) -> int:
  """`plan.plan_prefill(align=...)`: TMA query loads need 8-row origins;
  the per-thread loads of packed tiles (`pack_gqa`) need none."""
  return 1 if pack_gqa else ALIGN


def _tile_transforms(head_dim: int, dtype):
  """Tiling + swizzle of a `[rows, head_dim]` wgmma operand in shared
  memory (rows of 128 bytes or more: the 128-byte swizzle)."""
  plgpu = _mgpu()
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = 128 if head_dim * itemsize >= 128 else 64
  return (plgpu.TilingTransform((8, swizzle // itemsize)),
          plgpu.SwizzleTransform(swizzle))


def _kernel(tiles_ref, q_ref, k_pool_ref, v_pool_ref, k_table_ref,
            v_table_ref, *rest, causal: bool, sm_scale: float,
            logits_soft_cap: float | None, has_sinks: bool, group_size: int,
            block_kv: int, num_stages: int, fp8_stages: int = 0,
            q_from_bf16: bool = False, num_consumers: int = 2,
            schedule: str = "pingpong", pack_gqa: bool = False,
            num_ctas: int, q_buffers: int = 1, window_left: int = -1,
            out_in_q: bool = False):
  plgpu = _mgpu()
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from pkvattn.pallas_kernels import _mgpu_rows  # noqa: PLC0415
  packed = pack_gqa
  pack_group = group_size if packed else 1
  # Rows per consumer: BLOCK_Q tokens of one head, or tq tokens x G heads.
  tq = BLOCK_Q // pack_group
  rest = list(rest)
  sinks_ref = rest.pop(0) if has_sinks else None
  # FP8 pages: f32[2 H] = (k_scale, v_scale) of H = 1 (per tensor) or
  # num_kv_heads (per KV head) values each, read as scalars per item.
  scales_ref = rest.pop(0) if fp8_stages else None
  n_scales = scales_ref.shape[0] // 2 if fp8_stages else 0
  # Per-tensor scales are read once per CTA; per-head ones per item.
  tensor_scales = ((scales_ref[0], scales_ref[1]) if n_scales == 1
                   else None)
  out_ref, lse_ref, scoped = rest
  bufs, bars, free, sched, *fp8_bars = scoped
  if out_in_q:
    # A consumer's output tile shares its q tile's memory (`RefUnion`):
    # written after its last QK^T, read by its TMA stores before the next
    # item's q arrives.
    (q_smem2, o_smem2), k_smem, v_smem, lse_smem2, *bufs = bufs
  else:
    q_smem2, k_smem, v_smem, o_smem2, lse_smem2, *bufs = bufs
  if fp8_stages:
    k8_smem, v8_smem, *bufs = bufs
    (k8_bar, v8_bar), = fp8_bars
  # Packed tiles with sinks: each row's sink logit, `f32[n, BLOCK_Q]`.
  sink_smem2 = bufs.pop(0) if packed and has_sinks else None
  k_bar, v_bar, q_bar = bars
  k_free, v_free = free
  page_size = k_pool_ref.shape[1]
  head_dim = q_ref.shape[2]
  dtype = q_ref.dtype
  f32 = jnp.float32
  i32 = jnp.int32
  num_tiles = tiles_ref.shape[0]
  # CTAs serve (head, tile) items: a query head, or a kv head when packed.
  grid_heads = (q_ref.shape[1] // group_size) if packed else q_ref.shape[1]
  num_items = grid_heads * num_tiles

  cta = lax.axis_index("ctas")
  wg = lax.axis_index("wg")
  # Items cta, cta + num_ctas, ... (one each when num_ctas == num_items):
  # heads fastest, so the heads of one tile run side by side and share its
  # K/V through L2, tiles in the plan's order (heaviest first).
  my_items = lax.div(num_items - cta + (num_ctas - 1),
                     jnp.array(num_ctas, i32))
  bkv = jnp.array(block_kv, i32)
  n_cons = num_consumers
  window = window_left >= 0

  def fetch(t):
    """The plan row (`plan.NUM_FIELDS` i32 scalars) of this CTA's item t,
    loaded an item or two ahead of its use so that the loads' latency
    hides behind the work before it (past the CTA's last item: the last
    tile's row, unused)."""
    tile = jnp.minimum(lax.div(cta + t * num_ctas, jnp.array(grid_heads, i32)),
                       num_tiles - 1)
    return tuple(tiles_ref[tile, f] for f in range(plan_lib.NUM_FIELDS))

  class Item:
    """This CTA's item t: its head, tile and the tile's plan row (`fetch`).
    `hinted`: alignment hints on its offsets (`pl.multiple_of`), which
    single-warp code (the producer's) does not lower. `scales`: read the
    item's FP8 scales (per-head ones are two loads; the producer and the
    next item's q load never use them)."""

    def __init__(self, t, row, hinted: bool = True, scales: bool = True):
      w = cta + t * num_ctas
      self.head = lax.rem(w, jnp.array(grid_heads, i32))
      self.tile = lax.div(w, jnp.array(grid_heads, i32))
      (self.seq, self.q_start, self.q_end, self.kv_len,
       self.pos_offset) = row
      self.hinted = hinted
      # The plan (align=8) puts the tile's origin at q_start rounded down
      # to 8 rows (TMA into 8-row swizzle tiles); rows before q_start or at
      # / past q_end belong to other sequences: computed, never stored.
      # Packed tiles load their rows per thread and start at q_start.
      if packed:
        self.origin = self.q_start
      else:
        self.origin = self.q_start - lax.rem(self.q_start,
                                             jnp.array(ALIGN, i32))
        if hinted:
          self.origin = pl.multiple_of(self.origin, ALIGN)
      # FP8 pages: the scales of the item's kv head (K's on the raw
      # logits, V's on the output).
      self.logit_scale = self.v_scale = None
      if tensor_scales is not None:
        self.logit_scale, self.v_scale = tensor_scales
      elif n_scales > 1 and scales:
        kvh = self.head if packed else lax.div(
            self.head, jnp.array(group_size, i32))
        self.logit_scale = scales_ref[kvh]
        self.v_scale = scales_ref[n_scales + kvh]
      # With a window, the item's steps start at the block of the first
      # key its first token sees (`kv_first`; every consumer walks from
      # there, and steps count from that block); else at key 0.
      self.kv_first = self.lo_blk = jnp.array(0, i32)
      if window:
        self.kv_first = jnp.maximum(
            self.q_start + self.pos_offset - window_left, 0)
        self.lo_blk = lax.div(self.kv_first, bkv)
      # The producer loads every step some consumer needs; with causal
      # masking a later warpgroup (later rows) needs at least as many.
      total = self.wg_steps(0)[3]
      for w in range(1, n_cons):
        total = jnp.maximum(total, self.wg_steps(w)[3])
      self.total_steps = total

    def wg_steps(self, w):
      """(first row token, first / end valid token, KV steps, first and
      end unmasked step) of consumer w; steps count from block `lo_blk`.
      Steps before the unmasked ones are the window's edge, those after
      cross the diagonal or kv_len."""
      t0 = self.origin + w * tq
      lo = jnp.clip(self.q_start - t0, 0, tq)
      hi_row = jnp.clip(self.q_end - t0, lo, tq)
      first_pos = t0 + lo + self.pos_offset
      last_pos = t0 + hi_row - 1 + self.pos_offset
      if causal:
        hi = jnp.minimum(self.kv_len, last_pos + 1)
        full = jnp.minimum(self.kv_len, first_pos + 1)
      else:
        hi = full = self.kv_len
      # The padding pseudo-sequence (kv_len 0) has negative positions:
      # clamp, or a negative "unmasked" step count would run a step at -1.
      some = hi_row > lo
      hi = jnp.where(some, jnp.maximum(hi, 0), 0)
      full = jnp.where(some, jnp.maximum(full, 0), 0)
      steps = jnp.maximum(lax.div(hi + bkv - 1, bkv) - self.lo_blk, 0)
      if not window:
        return t0, lo, hi_row, steps, jnp.array(0, i32), lax.div(full, bkv)
      # Keys every row sees start at the last row's window start.
      full_lo = jnp.maximum(last_pos - window_left, 0)
      u_lo = jnp.clip(lax.div(full_lo + bkv - 1, bkv) - self.lo_blk, 0,
                      steps)
      u_hi = jnp.clip(lax.div(full, bkv) - self.lo_blk, u_lo, steps)
      return t0, lo, hi_row, steps, u_lo, u_hi

  def rendezvous():
    plgpu.barrier_arrive(sched)
    plgpu.barrier_wait(sched)

  # The ring schedule passes one token around the consumers: a warpgroup
  # issues its matmuls only while it holds the token (`take` ... `give`).
  def take():
    plgpu.barrier_wait(sched.at[wg])

  def give():
    plgpu.barrier_arrive(sched.at[lax.rem(wg + 1, n_cons)])

  qk_scale = sm_scale * _LOG2E

  # The K/V ring runs on across a CTA's items: step i of an item whose
  # first step is global step g uses stage (g + i) % num_stages.
  def stage(g, i):
    return lax.rem(g + i, jnp.array(num_stages, i32))

  def softmax(s, i, it, t0, m, l, masked: bool):
    """Online softmax of step i's logits (i counts from block `it.lo_blk`):
    (m, l, P in the dot dtype, the factor alpha that rescales the
    accumulator)."""
    if logits_soft_cap is not None:
      cap_scale = sm_scale / logits_soft_cap
      if it.logit_scale is not None:
        cap_scale = cap_scale * it.logit_scale
      s = jnp.tanh(s * cap_scale) * (logits_soft_cap * _LOG2E)
      scale = 1.0
    else:
      scale = qk_scale
      if it.logit_scale is not None:
        scale = scale * it.logit_scale
    if masked:
      shape = (BLOCK_Q, block_kv)
      row = plgpu.broadcasted_iota(i32, shape, 0, layout=plgpu.Layout.WGMMA)
      key = plgpu.broadcasted_iota(i32, shape, 1, layout=plgpu.Layout.WGMMA)
      key = key + (it.lo_blk + i) * block_kv
      vis = key < it.kv_len
      pos = t0 + it.pos_offset  # position of token t0
      if causal and packed:
        # Row r is token t0 + r // G: key <= pos + r // G <=> (key - pos)
        # * G <= r (integers).
        vis = vis & ((key - pos) * pack_group <= row)
      elif causal:
        vis = vis & (key <= row + pos)
      if window and packed:
        # key >= pos + r // G - W <=> (key - pos + W + 1) * G > r.
        vis = vis & ((key - pos + window_left + 1) * pack_group > row)
      elif window:
        vis = vis & (key >= row + pos - window_left)
      s = jnp.where(vis, s, -jnp.inf)
    # Without a window every valid row sees key 0 in step 0 (causal or
    # not), so its m is finite from the first step on and exp2(-inf - m)
    # = 0 for masked keys. With one, a row may see no key of a step at the
    # window's edge: its m stays -inf, so the exponents take 0 for it
    # (alpha = p = 0). (Rows of other sequences may go NaN; rows do not
    # mix.)
    m_next = jnp.maximum(m, s.max(axis=1) * scale)
    m_ref = m_next
    if masked and window:
      m_ref = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp2(m - m_ref)
    p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_ref, s.shape, [0]))
    l = l * alpha + p.sum(axis=1)
    return m_next, l, p.astype(dtype), alpha

  def pass_stage(slot):
    """A stage this consumer does not read: wait for it all the same (each
    thread keeps a barrier's phase by counting its own waits, and the ring
    runs on into the next item), then release it."""
    plgpu.barrier_wait(k_bar.at[slot])
    plgpu.barrier_wait(v_bar.at[slot])
    plgpu.barrier_arrive(k_free.at[slot])
    plgpu.barrier_arrive(v_free.at[slot])

  def rescale(acc, alpha):
    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

  def zero_stale_v(i, slot, it):
    # Stale V rows past kv_len (NaN in tests) would turn 0 * NaN into NaN:
    # zero them in shared memory, and with a window the rows before the
    # item's first key (their pages, read in place of released ones, may
    # hold anything). Several consumers may do this for the same stage;
    # they write identical values.
    first = (it.lo_blk + i) * block_kv
    stale = first + block_kv > it.kv_len
    if window:
      stale = stale | (first < it.kv_first)

    @pl.when(stale)
    def _():
      v_slot = v_smem.at[slot]
      vrow = plgpu.broadcasted_iota(i32, (block_kv, head_dim), 0,
                                    layout=plgpu.Layout.WGMMA) + first
      keep = vrow < it.kv_len
      if window:
        keep = keep & (vrow >= it.kv_first)
      v_slot[...] = jnp.where(keep, v_slot[...],
                              jnp.zeros((block_kv, head_dim), dtype))
      plgpu.commit_smem()

  def pingpong(q_smem, it, g, t0, steps, u_lo, u_hi, carry):
    """Two consumers in lock step (FA3's ping-pong): a step's QK^T, softmax
    and PV in turn, one warpgroup's matmuls alternating with the other's
    softmax."""
    @pl.when(steps > 0)
    def _():
      plgpu.barrier_wait(k_bar.at[stage(g, 0)])

    # Offset the two consumers by one matmul: from here on their QK^T / PV
    # matmuls alternate with each other's softmax.
    pl.when(wg == 1)(rendezvous)

    def step(i, carry, masked: bool):
      slot = stage(g, i)

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem,
                    k_smem.at[slot].transpose((1, 0)))
        rendezvous()
        return acc_ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, block_kv), f32))
      plgpu.barrier_arrive(k_free.at[slot])
      acc, m, l = carry
      m_next, l, p16, alpha = softmax(s, i, it, t0, m, l, masked)
      acc = rescale(acc, alpha)
      acc, l, m_next, p16 = lax.optimization_barrier((acc, l, m_next, p16))
      plgpu.barrier_arrive(sched)  # softmax done
      plgpu.barrier_wait(v_bar.at[slot])
      if masked:
        zero_stale_v(i, slot, it)
      plgpu.barrier_wait(sched)  # the other consumer's matmul is issued

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
        nxt = i + 1

        @pl.when(nxt < steps)
        def _():
          plgpu.barrier_wait(k_bar.at[stage(g, nxt)])
      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_next, l

    def skip(i, _):
      # Steps the other consumer needs and this one does not (causal: the
      # first warpgroup's rows end earlier): release the stage and keep the
      # ping-pong barrier in step.
      pass_stage(stage(g, i))
      rendezvous()
      rendezvous()

    if window:  # the window's edge
      carry = lax.fori_loop(0, u_lo, functools.partial(step, masked=True),
                            carry)
    carry = lax.fori_loop(u_lo, u_hi, functools.partial(step, masked=False),
                          carry)
    carry = lax.fori_loop(u_hi, steps, functools.partial(step, masked=True),
                          carry)
    lax.fori_loop(steps, it.total_steps, skip, None)
    pl.when(wg == 0)(rendezvous)  # matches the second consumer's first one
    return carry

  def ring(q_smem, it, g, t0, steps, u_lo, u_hi, carry):
    """Any number of consumers passing a token (FA3's warp-scheduler
    barrier): a warpgroup issues QK^T of step i with PV of step i - 1 while
    it holds the token, passes it on, and runs step i's softmax while the
    others' matmuls run. Every warpgroup takes the token `total_steps + 1`
    times, in order: a first QK^T, `steps - 1` pairs, a last PV, then one
    empty turn per step it does not need."""
    total_steps = it.total_steps
    # A warpgroup with no rows of its own still runs the first step (its
    # rows are never stored) so that every consumer's turns line up.
    steps = jnp.where(total_steps > 0, jnp.maximum(steps, 1), 0)
    first = jnp.minimum(steps, 1)
    zeros_s = plgpu.layout_cast(jnp.full((BLOCK_Q, block_kv), 0.0, f32),
                                plgpu.Layout.WGMMA)

    def after_softmax(i, slot, masked):
      # V of step i must be in place (and clean) before the next turn's PV;
      # K of step i + 1 before its QK^T.
      plgpu.barrier_wait(v_bar.at[slot])
      if masked:
        zero_stale_v(i, slot, it)
      nxt = i + 1

      @pl.when(nxt < steps)
      def _():
        plgpu.barrier_wait(k_bar.at[stage(g, nxt)])

    def first_step(i, carry, masked: bool):
      # Step 0, without a PV.
      acc, m, l, _ = carry
      slot = stage(g, 0)

      def qk(s_ref):
        take()
        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
        give()
        return s_ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, block_kv), f32))
      plgpu.barrier_arrive(k_free.at[slot])
      m, l, p16, _ = softmax(s, i, it, t0, m, l, masked)  # acc is 0
      after_softmax(i, slot, masked)
      return acc, m, l, p16

    def step(i, carry, masked: bool):
      acc, m, l, p16 = carry
      slot = stage(g, i)
      prev = stage(g, i - 1)

      def matmuls(refs):
        s_ref, acc_ref = refs
        take()
        plgpu.wgmma(s_ref, q_smem,
                    k_smem.at[slot].transpose((1, 0)))
        plgpu.wgmma(acc_ref, p16, v_smem.at[prev])
        give()
      s, acc = pl.run_state(matmuls)((plgpu.ACC.init(zeros_s),
                                      plgpu.ACC.init(acc)))
      plgpu.barrier_arrive(k_free.at[slot])
      plgpu.barrier_arrive(v_free.at[prev])
      m, l, p16, alpha = softmax(s, i, it, t0, m, l, masked)
      acc = rescale(acc, alpha)
      after_softmax(i, slot, masked)
      return acc, m, l, p16

    def last_step(i, carry):
      acc, m, l, p16 = carry
      slot = stage(g, steps - 1)

      def pv(acc_ref):
        take()
        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
        give()
      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m, l, p16

    def skip(i, _):
      # A step another consumer needs and this one does not (causal: earlier
      # rows end earlier): release the stage, pass the token on.
      pass_stage(stage(g, i))
      take()
      give()

    @pl.when(first > 0)
    def _():
      plgpu.barrier_wait(k_bar.at[stage(g, 0)])

    acc, m, l = carry
    p16 = plgpu.layout_cast(jnp.zeros((BLOCK_Q, block_kv), dtype),
                            plgpu.Layout.WGMMA)
    carry = (acc, m, l, p16)
    # Runs of masked / unmasked steps; step 0 (first_step) runs once, in
    # the run that holds it.
    runs = [(0, u_lo, True)] if window else []
    runs += [(u_lo, u_hi, False), (u_hi, steps, True)]
    for a, b, masked in runs:
      carry = lax.fori_loop(a, jnp.minimum(b, first),
                            functools.partial(first_step, masked=masked),
                            carry)
    for a, b, masked in runs:
      carry = lax.fori_loop(jnp.maximum(a, first), jnp.maximum(b, first),
                            functools.partial(step, masked=masked), carry)
    carry = lax.fori_loop(0, first, last_step, carry)
    lax.fori_loop(steps, total_steps, skip, None)
    return carry[:3]

  @pl.when(wg < n_cons)
  def _consumer():
    # With FP8 pages the producer converts tiles, so it keeps more registers.
    plgpu.set_max_registers(_CONSUMER_REGS[(n_cons, bool(fp8_stages))],
                            action="increase")
    o_smem = o_smem2.at[wg]
    lse_smem = lse_smem2.at[wg]
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def load_q(it, buf, asynchronous):
      # Packed rows of this consumer for item `it` into q buffer `buf`.
      _mgpu_rows.load_q_rows(
          q_ref, q_smem2, sinks_ref, sink_smem2, index=buf * n_cons + wg,
          t0=it.wg_steps(wg)[0], kv_head=it.head, group_size=pack_group,
          transforms=_tile_transforms(head_dim, q_smem2.dtype),
          asynchronous=asynchronous)

    def run_item(t, carry):
      g, row, row_next = carry
      it = Item(t, row)
      row_after = fetch(t + 2)
      if packed:
        item_work(t, it, g, row_next)
      else:
        # A tile the plan left unused (`Q_END <= Q_START`: the plan's tiles
        # are a static bound, and a call whose sequences all went to the
        # decode kernel, a verify step, uses none) has no step and no row
        # to store: skip its q load and epilogue. Its CTA still launches.
        pl.when(it.q_end > it.q_start)(
            lambda: item_work(t, it, g, row_next))
      return g + it.total_steps, row_next, row_after

    def item_work(t, it, g, row_next):
      head = it.head
      t0, row_lo, row_hi, steps, u_lo, u_hi = it.wg_steps(wg)
      buf = lax.rem(t, jnp.array(q_buffers, i32))
      q_smem = q_smem2.at[buf * n_cons + wg]
      # A q buffer's last reader, the QK^T of the last item that used it,
      # is done (its result was read before that item's last softmax).
      if packed and q_buffers == 2:
        # This item's rows were copied while the previous item ran; the
        # next item's rows go into the other buffer while this one runs.
        _mgpu_rows.wait_rows()
        plgpu.commit_smem()

        @pl.when(t + 1 < my_items)
        def _():
          load_q(Item(t + 1, row_next, scales=False), 1 - buf, True)
      elif packed:
        load_q(it, buf, False)
        plgpu.commit_smem()
      else:
        t0 = pl.multiple_of(t0, ALIGN)
        if out_in_q:
          # The previous item's output stores read this memory.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(t0, BLOCK_Q), head], q_smem,
                                q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
      if q_from_bf16:
        # FP8 pages: the dots run in f16 (e4m3 converts to f16 in one cvt
        # per pair). q arrived as bf16 bits in an f16 buffer: convert it in
        # place, clamped to f16's range, 128 columns at a time.
        for c in range(0, head_dim, _CONVERT_COLS):
          cols = pl.ds(c, min(_CONVERT_COLS, head_dim))
          x = _compat.mgpu_load(q_smem.at[:, cols], plgpu.Layout.WGMMA)
          q_smem[:, cols] = _fp8.query_for_dots(
              lax.bitcast_convert_type(x, jnp.bfloat16))
        plgpu.commit_smem()
      m = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, f32), row_layout)
      l = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0.0, f32), row_layout)
      acc = plgpu.layout_cast(jnp.full((BLOCK_Q, head_dim), 0.0, f32),
                              plgpu.Layout.WGMMA)
      run = ring if schedule == "ring" else pingpong
      acc, m, l = run(q_smem, it, g, t0, steps, u_lo, u_hi, (acc, m, l))

      ok = l > 0.0
      if has_sinks:
        if packed:
          sink = _compat.mgpu_load(sink_smem2.at[buf * n_cons + wg],
                                   row_layout) * _LOG2E
        else:
          sink = sinks_ref[head] * _LOG2E
        m_all = jnp.maximum(m, sink)
        keep = jnp.exp2(m - m_all)
        denom = l * keep + jnp.exp2(sink - m_all)
        scale_out = keep / denom
      else:
        scale_out = jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)
      if scales_ref is not None:
        scale_out = scale_out * it.v_scale
      out = acc * lax.broadcast_in_dim(scale_out, acc.shape, [0])
      lse = jnp.where(ok, (m + jnp.log(jnp.where(ok, l, 1.0)) * _LOG2E)
                      * _LN2, -jnp.inf)
      if not packed:
        # The previous item's TMA stores must have read o_smem, and its
        # threads lse_smem (a warpgroup barrier).
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.commit_smem()
      if packed or out_in_q:
        # A plain row-major tile (for the per-thread row stores, or the
        # q tile's union member): an unoptimized store, which jax 0.12's
        # layout inference needs here (asked for an optimized one into the
        # union, it does not finish).
        _compat.mgpu_store_any_layout(o_smem, out.astype(out_ref.dtype))
      else:
        o_smem[...] = out.astype(out_ref.dtype)
      lse_smem[...] = lse
      plgpu.commit_smem()
      if packed:
        _mgpu_rows.store_rows(o_smem2, lse_smem2, out_ref, lse_ref, index=wg,
                              t0=t0, kv_head=head, row_lo=row_lo,
                              row_hi=row_hi, group_size=pack_group)
        return
      # Rows outside [row_lo, row_hi) belong to other sequences: store the
      # valid ones as a ladder of power-of-two TMA boxes.
      n = row_hi - row_lo
      off = row_lo
      size = BLOCK_Q
      while size >= 1:
        @pl.when((n & size) != 0)
        def _(off=off, size=size):
          plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(off, size)],
                                  out_ref.at[pl.ds(t0 + off, size), head])
        off = off + (n & size)
        size //= 2
      _mgpu_rows.store_lse(lse_smem2, lse_ref, index=wg, t0=t0, head=head,
                           row_lo=row_lo, row_hi=row_hi)

    if schedule == "ring":
      # The last consumer hands the first token to the first one. Every
      # consumer takes it equally often in an item, so it ends each item
      # where it started; the first consumer takes back the last one. (A
      # hand-over per item would let the last consumer arrive twice at the
      # first one's barrier before it waits: a phase it would never see.)
      pl.when(wg == n_cons - 1)(give)
    first_rows = (fetch(0), fetch(1))
    if packed and q_buffers == 2:
      load_q(Item(0, first_rows[0], scales=False), 0, True)
    lax.fori_loop(0, my_items, run_item, (jnp.array(0, i32), *first_rows))
    if schedule == "ring":
      pl.when(wg == 0)(take)
    if not packed:
      plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == n_cons)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGS[(n_cons, bool(fp8_stages))],
                            action="decrease")
    rows = min(page_size, block_kv)
    copies = block_kv // rows

    def item_loads(it):
      kv_head = it.head if packed else lax.div(it.head,
                                               jnp.array(group_size, i32))
      last_page = jnp.maximum(lax.div(it.kv_len + page_size - 1,
                                      jnp.array(page_size, i32)) - 1, 0)
      # With a window, pages before the one of the item's first key may be
      # released (-1 in the table): never read (`zero_stale_v` clears what
      # the clamped copies bring).
      first_page = lax.div(it.kv_first, jnp.array(page_size, i32))

      def pages(j, table_ref):
        """Step j's (page, first row) per copy (block lo_blk + j): the page
        ids are loaded here, so a caller can start their loads before it
        waits for the stage they go to."""
        i = it.lo_blk + j
        first = i * block_kv
        out = []
        for c in range(copies):
          if page_size >= block_kv:
            per_page = page_size // block_kv
            page_idx = lax.div(i, jnp.array(per_page, i32))
            r0 = lax.rem(i, jnp.array(per_page, i32)) * block_kv
            if it.hinted:
              r0 = pl.multiple_of(r0, block_kv)
          else:
            page_idx = lax.div(first, jnp.array(page_size, i32)) + c
            r0 = 0
          if window:
            page_idx = jnp.maximum(page_idx, first_page)
          out.append((table_ref[it.seq, jnp.minimum(page_idx, last_page)],
                      r0))
        return out

      def copy(step_pages, slot, pool_ref, smem, bar):
        for c, (page, r0) in enumerate(step_pages):
          plgpu.copy_gmem_to_smem(
              pool_ref.at[page, pl.ds(r0, rows), kv_head],
              smem.at[slot, pl.ds(c * rows, rows)], bar.at[slot])

      return pages, copy

    if fp8_stages:
      def produce_fp8(t, carry):
        g, row = carry
        it = Item(t, row, scales=False)
        row_next = fetch(t + 1)
        pages, copy = item_loads(it)

        def issue(j, slot, pool_ref, table_ref, smem, bar):
          copy(pages(j, table_ref), slot, pool_ref, smem, bar)
        return _fp8_producer(
            lambda i, s8: issue(i, s8, k_pool_ref, k_table_ref, k8_smem,
                                k8_bar),
            lambda i, s8: issue(i, s8, v_pool_ref, v_table_ref, v8_smem,
                                v8_bar),
            it.total_steps, g, k_smem, v_smem, k8_smem, v8_smem, k_bar,
            v_bar, k8_bar, v8_bar, k_free, v_free, num_stages=num_stages,
            fp8_stages=fp8_stages), row_next
      lax.fori_loop(0, my_items, produce_fp8, (jnp.array(0, i32), fetch(0)))
      return

    def produce(t, carry):
      g, row = carry
      it = Item(t, row, hinted=False, scales=False)
      row_next = fetch(t + 1)
      pages, copy = item_loads(it)

      def body(i, _):
        slot = stage(g, i)
        # With two consumers the step's page ids load while the producer
        # waits for its stage: a full ring then waits on the consumers
        # only, not on the ids' latency after them. With three (head_dim
        # 64's ring) loading them early measured slower
        # (docs/performance.md).
        early = n_cons == 2
        k_pages = pages(i, k_table_ref) if early else None
        v_pages = pages(i, v_table_ref) if early else None

        @pl.when(g + i >= num_stages)
        def _():
          plgpu.barrier_wait(k_free.at[slot])
        copy(k_pages if early else pages(i, k_table_ref), slot, k_pool_ref,
             k_smem, k_bar)

        @pl.when(g + i >= num_stages)
        def _():
          plgpu.barrier_wait(v_free.at[slot])
        copy(v_pages if early else pages(i, v_table_ref), slot, v_pool_ref,
             v_smem, v_bar)
      lax.fori_loop(0, it.total_steps, body, None)
      return g + it.total_steps, row_next

    def one_warp(warp):
      # One warp issues the loads (FA3's producer): the warpgroup's other
      # three wait at the join, so the scalar work of each step (page ids,
      # TMA descriptors) takes no issue slots from the consumer warps that
      # share their schedulers, and no warpgroup barrier precedes a copy.
      @pl.when(warp == 0)
      def _():
        lax.fori_loop(0, my_items, produce, (jnp.array(0, i32), fetch(0)))
    plgpu.warp_map(one_warp)


def _fp8_producer(load_k, load_v, total_steps, g, k_smem, v_smem, k8_smem,
                  v8_smem, k_bar, v_bar, k8_bar, v8_bar, k_free, v_free, *,
                  num_stages: int, fp8_stages: int):
  """The producer warpgroup's work for one item with FP8 pages: TMA brings
  each step's pages into FP8 staging rings (`fp8_stages` deep, one for K,
  one for V); the warpgroup converts a staged tile to the dot dtype (f16),
  64 rows x 128 columns at a time (a 56-register budget), into the stage
  the consumers read, then arrives on that stage's barrier, so the
  consumers run unchanged. A staging slot is refilled right after its conversion
  (`commit_smem`: the warpgroup's reads are done and ordered before the
  next TMA write), so the next K load flies while V converts, and the next
  V load while K does. `g`: the item's first global step (both rings run
  on across items); returns the next item's."""
  plgpu = _mgpu()
  from jax.experimental import pallas as pl  # noqa: PLC0415
  dtype = k_smem.dtype
  block_kv, head_dim = k_smem.shape[1:]
  i32 = jnp.int32

  def convert(src8, bar8, dst, bar, free, i):
    gi = g + i
    s8 = lax.rem(gi, jnp.array(fp8_stages, i32))
    slot = lax.rem(gi, jnp.array(num_stages, i32))
    plgpu.barrier_wait(bar8.at[s8])

    @pl.when(gi >= num_stages)
    def _():
      plgpu.barrier_wait(free.at[slot])
    for r in range(0, block_kv, 64):
      for c in range(0, head_dim, _CONVERT_COLS):
        cols = pl.ds(c, min(_CONVERT_COLS, head_dim))
        # WGMMA_8BIT: 4-byte shared-memory loads (WGMMA's layout makes
        # them 2-byte ones) and 8-byte f16 stores.
        x = _compat.mgpu_load(src8.at[s8, pl.ds(r, 64), cols],
                              plgpu.Layout.WGMMA_8BIT)
        dst[slot, pl.ds(r, 64), cols] = x.astype(dtype)
    plgpu.commit_smem()
    plgpu.barrier_arrive(bar.at[slot])

  # A staging slot is free once its previous tile is converted, which this
  # warpgroup did itself (in program order) before loading the next one.
  for j in range(fp8_stages):
    @pl.when(j < total_steps)
    def _(j=j):
      s8 = lax.rem(g + j, jnp.array(fp8_stages, i32))
      load_k(j, s8)
      load_v(j, s8)

  def step(i, _):
    later = i + fp8_stages
    for src8, bar8, dst, bar, free, load in (
        (k8_smem, k8_bar, k_smem, k_bar, k_free, load_k),
        (v8_smem, v8_bar, v_smem, v_bar, v_free, load_v)):
      convert(src8, bar8, dst, bar, free, i)

      @pl.when(later < total_steps)
      def _(load=load):
        load(later, lax.rem(g + later, jnp.array(fp8_stages, i32)))
  lax.fori_loop(0, total_steps, step, None)
  return g + total_steps


@functools.partial(
    jax.jit,
    static_argnames=("causal", "sm_scale", "logits_soft_cap", "block_kv",
                     "num_stages", "fp8_stages", "num_consumers",
                     "schedule", "pack_gqa", "persistent", "window_left"))
def paged_prefill_mgpu(
    q: jax.Array,         # [num_tokens, num_qo_heads, head_dim]
    k_pool: jax.Array,    # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool: jax.Array,    # [num_pages, page_size, num_kv_heads, head_dim]
    k_table: jax.Array,   # i32[batch_size, max_pages]
    v_table: jax.Array,   # i32[batch_size, max_pages]
    tiles: jax.Array,     # i32[num_tiles, plan.NUM_FIELDS], block_q = tile_q(.)
    sinks: jax.Array | None = None,  # f32[num_qo_heads]
    *,
    causal: bool,
    sm_scale: float,
    logits_soft_cap: float | None = None,
    block_kv: int = 128,
    num_stages: int = 2,
    k_scale=None,  # f32[] | f32[num_kv_heads]: FP8 pages
    v_scale=None,  # f32[] | f32[num_kv_heads]: FP8 pages
    fp8_stages: int = 1,
    num_consumers: int = 2,
    schedule: str = "pingpong",
    pack_gqa: bool = False,
    persistent: bool = False,
    window_left: int = -1,
):
  """One Mosaic-GPU launch over the plan's main tiles (see module docstring).

  Semantics are `reference.paged_prefill_reference`, for the tokens the
  `tiles` cover (`plan.plan_prefill(...,
  block_q=tile_q(num_consumers, G), align=plan_align(pack_gqa))`, G the
  group size with `pack_gqa`, else 1); rows of other tokens (the plan's short
  tiles) are left unwritten.

  Args:
    q: `[num_tokens, num_qo_heads, head_dim]`, bf16 or f16, head_dim 64,
      128 or 256.
    k_pool, v_pool: `[num_pages, page_size, num_kv_heads, head_dim]`, dtype
      of `q` (may be one array with split tables).
    k_table, v_table: `i32[batch_size, max_pages]`.
    tiles: `i32[num_tiles, 5]`, a plan's `tiles` built with block_q =
      `tile_q(num_consumers, G)` and align = `plan_align(pack_gqa)` (G as
      above).
    sinks: optional `f32[num_qo_heads]`, joins the denominator only.
    causal, sm_scale, logits_soft_cap, window_left: static, as
      `paged_prefill` (window_left -1: no window; else token t sees keys
      from position - window_left on).
    block_kv: static, keys per step (64 or 128; 64 at head_dim 256, where
      the output tiles take the q tiles' shared memory).
    num_stages: static, shared-memory stages of the K/V ring (>= 2).
    k_scale, v_scale: f32 scales (may be traced) of float8_e4m3fn pages
      (stored value = x / scale), each a scalar (per tensor) or
      `f32[num_kv_heads]` (per KV head; a scalar beside it is broadcast):
      the item's kv head's K scale multiplies its logits and V's its
      output.
    fp8_stages: static, FP8 pages: stages of the FP8 staging ring that TMA
      fills and the producer warpgroup converts from (`_fp8_producer`).
    num_consumers: static, consumer warpgroups per CTA: 2, or 3 at head_dim
      64 with 16-bit pages (192-token tiles, as FlashAttention-3 there; at
      head_dim 128 three would not fit in registers or shared memory).
    schedule: static, how the consumers share the tensor cores: "pingpong"
      (two consumers in lock step, a step's matmuls at a time) or "ring"
      (a token passed around any number of consumers; each issues QK^T of
      one step with PV of the step before).
    pack_gqa: static; pack the GQA group into the rows of a consumer's
      tile (FlashAttention-3's PackGQA): 64 // G tokens x G query heads
      per consumer, one CTA per kv head and tile, so a K/V stage serves
      the whole group (`_mgpu_rows`). False: one query head per CTA, 64
      tokens per consumer.
    persistent: static; one CTA per SM (`_compat.num_sms`), each
      taking every num_sms-th (head, tile) item, its K/V ring running on
      from one item into the next, so the producer loads the next item's
      pages while the consumers finish the last one. False: one CTA per
      item.

  Returns:
    `(out [num_tokens, num_qo_heads, head_dim] q.dtype,
      lse f32[num_tokens, num_qo_heads])`; natural-log lse; rows of tokens no
    tile covers are unspecified.

  Raises:
    ValueError: an unsupported dtype, head_dim or page_size (see `supports`;
      the GPU model is not checked here), a scale neither of one value nor
      of shape `(num_kv_heads,)`, an unsupported
      (num_consumers, schedule, pages dtype), or a head_dim-256 build past
      the shared memory (packed tiles, 128-key steps, two FP8 staging
      stages).
  """
  plgpu = _mgpu()
  from jax.experimental import pallas as pl  # noqa: PLC0415
  num_tokens, num_qo_heads, head_dim = q.shape
  _, page_size, num_kv_heads, _ = k_pool.shape
  num_tiles = tiles.shape[0]
  if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16),
                                jnp.dtype(jnp.float16)):
    raise ValueError(f"Invalid q dtype: expected bf16 or f16, got {q.dtype}")
  fp8 = jnp.dtype(k_pool.dtype) == jnp.dtype(jnp.float8_e4m3fn)
  if fp8 != (k_scale is not None) or (k_scale is None) != (v_scale is None):
    raise ValueError(
        f"Invalid scales: expected k_scale and v_scale exactly with "
        f"float8_e4m3fn pages, got pages {k_pool.dtype}, "
        f"k_scale={k_scale is not None}, v_scale={v_scale is not None}")
  if fp8 and fp8_stages < 1:
    raise ValueError(f"Invalid fp8_stages: expected >= 1, got {fp8_stages}")
  head_scales = _fp8.is_per_head(k_scale, v_scale, num_kv_heads)
  if head_dim not in HEAD_DIMS:
    raise ValueError(
        f"Invalid head_dim: expected one of {HEAD_DIMS}, got {head_dim}")
  if page_size < 8 or (page_size < block_kv and block_kv % page_size):
    raise ValueError(
        f"Invalid page_size: expected >= 8 and dividing or divisible by "
        f"block_kv={block_kv}, got {page_size}")
  if (schedule not in SCHEDULES or num_consumers not in CONSUMERS or
      (num_consumers != 2 and (schedule == "pingpong" or fp8 or
                               head_dim != 64))):
    raise ValueError(
        f"Invalid (num_consumers, schedule): expected 2 with 'pingpong' or "
        f"'ring', or 3 with 'ring', head_dim 64 and 16-bit pages, got "
        f"{(num_consumers, schedule)} with head_dim {head_dim} and "
        f"{k_pool.dtype} pages")
  if block_kv not in (64, 128) or num_stages < 2:
    raise ValueError(f"Invalid (block_kv, num_stages): expected 64/128 and "
                     f">= 2, got {(block_kv, num_stages)}")
  group_size = num_qo_heads // num_kv_heads
  if pack_gqa and not 1 <= group_size <= BLOCK_Q:
    raise ValueError(f"Invalid group size for pack_gqa: expected 1..{BLOCK_Q}"
                     f", got {group_size}")
  copies = block_kv // min(page_size, block_kv)
  out_dtype = q.dtype
  # FP8 pages: the dots run in f16; a bf16 q travels as its bits in an f16
  # view (a free bitcast) and is converted in the kernel.
  dtype = jnp.dtype(jnp.float16) if fp8 else q.dtype
  q_from_bf16 = fp8 and q.dtype != dtype
  grid_heads = num_kv_heads if pack_gqa else num_qo_heads
  num_items = grid_heads * num_tiles
  num_ctas = num_items
  if persistent:
    num_ctas = max(1, min(_compat.num_sms(), num_items))
  n = num_consumers
  # Persistent packed tiles copy the next item's q rows while one runs, into
  # a second q buffer where shared memory has room for it.
  smem_args = (head_dim, block_kv, num_stages, fp8_stages if fp8 else 0,
               pack_gqa and sinks is not None)
  q_buffers = 1
  if pack_gqa and persistent and _smem_bytes(n, 2, *smem_args) <= SMEM_BYTES:
    q_buffers = 2
  # At head_dim 256, q and output tiles do not fit side by side: a
  # consumer's output tile takes its q tile's memory (the per-row stores of
  # packed tiles would race with the next item's q rows: unpacked only).
  out_in_q = head_dim > 128
  if out_in_q and (pack_gqa or _smem_bytes(
      n, q_buffers, *smem_args, out_in_q=True) > SMEM_BYTES):
    raise ValueError(
        f"Invalid (head_dim, block_kv, num_stages, num_consumers, pack_gqa):"
        f" expected a build within {SMEM_BYTES} bytes of shared memory, got "
        f"{(head_dim, block_kv, num_stages, n, pack_gqa)} needing "
        f"{_smem_bytes(n, q_buffers, *smem_args, out_in_q=not pack_gqa)}")
  kernel = functools.partial(
      _kernel, causal=causal, sm_scale=sm_scale,
      logits_soft_cap=logits_soft_cap, has_sinks=sinks is not None,
      group_size=group_size, block_kv=block_kv, num_stages=num_stages,
      fp8_stages=fp8_stages if fp8 else 0, q_from_bf16=q_from_bf16,
      num_consumers=num_consumers, schedule=schedule, pack_gqa=pack_gqa,
      num_ctas=num_ctas, q_buffers=q_buffers, window_left=window_left,
      out_in_q=out_in_q)

  def entry(*refs):
    transforms = _tile_transforms(head_dim, dtype)
    q_smem = plgpu.SMEM((q_buffers * n, BLOCK_Q, head_dim), dtype,
                        transforms=transforms)
    o_smem = plgpu.SMEM((n, BLOCK_Q, head_dim), out_dtype)
    smem = [
        plgpu.RefUnion(q_smem, o_smem) if out_in_q else q_smem,
        plgpu.SMEM((num_stages, block_kv, head_dim), dtype,
                   transforms=transforms),
        plgpu.SMEM((num_stages, block_kv, head_dim), dtype,
                   transforms=transforms),
        *(() if out_in_q else (o_smem,)),
        plgpu.SMEM((n, BLOCK_Q), jnp.float32),
    ]
    # The consumers' stages fill by TMA (`copies` arrivals), or, with FP8
    # pages, by the producer's conversion (one arrival).
    stage_arrivals = 1 if fp8 else copies
    extra = []
    if fp8:
      f8 = jnp.float8_e4m3fn
      swizzle8 = 128 if head_dim >= 128 else 64
      transforms8 = (plgpu.TilingTransform((8, swizzle8)),
                     plgpu.SwizzleTransform(swizzle8))
      smem += [plgpu.SMEM((fp8_stages, block_kv, head_dim), f8,
                          transforms=transforms8)] * 2
      extra = [(plgpu.Barrier(num_arrivals=copies,
                              num_barriers=fp8_stages),) * 2]
    if pack_gqa and sinks is not None:
      smem.append(plgpu.SMEM((q_buffers * n, BLOCK_Q), jnp.float32))
    pl.run_scoped(
        lambda *scoped: kernel(*refs, scoped),
        smem,
        (plgpu.Barrier(num_arrivals=stage_arrivals, num_barriers=num_stages),
         plgpu.Barrier(num_arrivals=stage_arrivals, num_barriers=num_stages),
         plgpu.Barrier(num_barriers=n)),
        (plgpu.Barrier(num_arrivals=n, num_barriers=num_stages),) * 2,
        # pingpong: a two-party rendezvous; ring: one token slot each.
        (plgpu.Barrier(num_arrivals=2) if schedule == "pingpong" else
         plgpu.Barrier(num_barriers=n)),
        *extra,
        collective_axes="wg",
    )

  # TMA into 8-row swizzle tiles views q's token axis in tiles of 8 rows
  # (packed tiles load rows per thread).
  q_in = q if pack_gqa or num_tokens % ALIGN == 0 else jnp.pad(
      q, ((0, -num_tokens % ALIGN), (0, 0), (0, 0)))
  if q_from_bf16:
    q_in = lax.bitcast_convert_type(q_in, dtype)
  args = [tiles.astype(jnp.int32), q_in, k_pool, v_pool,
          k_table.astype(jnp.int32), v_table.astype(jnp.int32)]
  if sinks is not None:
    args.append(sinks.astype(jnp.float32))
  if fp8:
    n_scales = num_kv_heads if head_scales else 1
    args.append(jnp.concatenate([
        jnp.broadcast_to(jnp.asarray(x, jnp.float32).reshape(-1),
                         (n_scales,)) for x in (k_scale, v_scale)]))
  out, lse = plgpu.kernel(
      entry,
      out_type=[
          jax.ShapeDtypeStruct((num_tokens, num_qo_heads, head_dim),
                               out_dtype),
          jax.ShapeDtypeStruct((num_tokens, num_qo_heads), jnp.float32),
      ],
      grid=(num_ctas,),
      grid_names=("ctas",),
      num_threads=n + 1,
      thread_name="wg",
      # The row reductions (WGMMA layout) stay within warps: the default
      # 2 KiB reduction scratch would push the FP8 staging past 227 KiB.
      compiler_params=plgpu.CompilerParams(
          approx_math=True, **(dict(reduction_scratch_bytes=0) if fp8
                               else {})),
  )(*args)
  return out, lse
