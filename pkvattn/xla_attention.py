"""Flash-style paged prefill in plain XLA: the `impl="xla"` prefill path.

`pallas_kernels/reference.py` is the semantics' oracle: each query token there
gathers its sequence's whole page list, which is simple but moves
`num_tokens * max_pages * page_size` keys per call. This module computes the
same result (FlashInfer's `BatchPrefillWithPagedKVCache` semantics, as
`reference.paged_prefill_reference`) the way the GPU kernels do, in ops XLA
runs well on a CPU or on GPUs without the Pallas kernels:

* Query tiles: each sequence's new tokens are cut into tiles of `block_q`
  tokens (a tile never spans two sequences). The tiles run one after another
  (`lax.map`); a tile's rows are its tokens times the GQA group, so one
  `[block_q * group_size, head_dim] x [head_dim, block_k]` matmul per kv head
  serves every query head of the group.
* Key blocks: a tile walks `block_k`-token blocks of its sequence's keys
  (`block_k / page_size` pages gathered from the table row once per tile and
  block) with an online softmax in f32 (running max, denominator and output,
  rescaled per block). The walk covers only blocks a query of the tile can
  see: from the window start of its first query (or 0) to its last query's
  position (causal) or `kv_lens[b]`; blocks wholly before the window or after
  the diagonal are never gathered, and the loop's trip count is that range.
* Masking inside a block: keys past `kv_lens[b]`, after a query (causal) or
  before its window, and rows past the tile's tokens give `-inf` logits;
  V rows past `kv_lens[b]` and before the tile's window start (a block may
  begin on pages a window released) are zeroed before the `P @ V` matmul,
  so the NaN or garbage that unowned pages and tail rows hold never reaches
  an output.
* FP8 pages: the loops read the pool as its `uint8` bytes and a gathered
  block is converted to f32 (only gathered values convert, never the pool:
  with a float8_e4m3fn loop operand XLA's CPU backend, which has no FP8
  gather, converted the whole pool before the loop); `k_scale` is folded
  into the query's logit scale and `v_scale` into the output (per-KV-head
  scales: each kv head's into its group's query rows and output rows).
* Sinks (gpt-oss) join the final denominator only; `lse` is over the visible
  keys (sink excluded); a row with no visible key gives zeros and `-inf`.

Tile and block sizes come from `block_sizes` (a static rule on the shapes).
Memory per tile: the `[num_kv_heads, block_q * group_size, block_k]` logits
and probabilities, plus one key and one value block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pkvattn import _kv
from pkvattn.pallas_kernels import reference

NEG_INF = float("-inf")

# Largest query tile and key block (tokens) of the XLA prefill: large enough
# that the per-block matmuls amortise the loop's per-iteration cost, small
# enough that the `[rows, block_k]` logits stay in a CPU's L2-sized working
# set (measured: docs/performance.md). Smaller steps get smaller ones
# (`block_sizes`).
BLOCK_Q = 256
BLOCK_K = 512
MIN_BLOCK_Q = 16


def block_sizes(num_tokens: int, page_size: int, *, batch_size: int = 1,
                max_keys: int | None = None, block_q: int | None = None,
                block_k: int | None = None) -> tuple[int, int]:
  """`(block_q, block_k)` of a call, from its static shapes.

  `block_q`: the tokens per sequence if they were spread evenly
  (`num_tokens / batch_size`, to a power of two), within `[MIN_BLOCK_Q,
  BLOCK_Q]` and at most `num_tokens`: a tile's rows past its sequence's
  tokens are computed and discarded, so a batch of short prompts (or decode
  rows beside a chunk) takes short tiles. `block_k`: `BLOCK_K`, or the
  table's keys (`max_keys`) where fewer, a multiple of `page_size` (whole
  pages per block). Either may be given instead.
  """
  if block_q is None:
    even = max(1, num_tokens // max(1, batch_size))
    block_q = min(BLOCK_Q, max(MIN_BLOCK_Q, 1 << (even - 1).bit_length()))
  bq = max(1, min(block_q, num_tokens))
  if block_k is None:
    block_k = BLOCK_K if max_keys is None else min(BLOCK_K, max_keys)
  bk = max(block_k, page_size)
  return bq, bk - bk % page_size


def _head_scale(scale, trailing: int):
  """An FP8 scale as f32: a scalar unchanged, one per KV head
  (`[num_kv_heads]`) with `trailing` unit dimensions appended, to broadcast
  over its head's axis."""
  scale = jnp.asarray(scale, jnp.float32)
  return scale.reshape(scale.shape + (1,) * trailing) if scale.ndim else scale


def _tiles(q_indptr, kv_lens, block_q: int, num_tiles: int):
  """Per-tile `(seq, first token, rows, first position)`, each `i32[num_tiles]`
  (tiles past the last real one get `rows = 0`), then each sequence's first
  tile `i32[batch_size]`."""
  batch_size = kv_lens.shape[0]
  q_len = q_indptr[1:] - q_indptr[:-1]
  per_seq = (q_len + block_q - 1) // block_q
  ends = jnp.cumsum(per_seq)
  starts = ends - per_seq
  i = jnp.arange(num_tiles, dtype=jnp.int32)
  seq = reference.owner(ends, i, batch_size)
  j = i - starts[seq]
  first = q_indptr[seq] + j * block_q
  rows = jnp.where(i < ends[-1], jnp.minimum(block_q, q_len[seq] - j * block_q),
                   0)
  pos0 = kv_lens[seq] - q_len[seq] + j * block_q
  return seq, first, rows.astype(jnp.int32), pos0, starts


@functools.partial(
    jax.jit,
    static_argnames=("causal", "sm_scale", "window_left", "logits_soft_cap",
                     "block_q", "block_k"))
def paged_prefill(
    q,          # [num_tokens, num_qo_heads, head_dim]
    k_pool,     # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool,     # [num_pages, page_size, num_kv_heads, head_dim]
    k_table,    # i32[batch_size, max_pages]
    v_table,    # i32[batch_size, max_pages]
    q_indptr,   # i32[batch_size + 1]
    kv_lens,    # i32[batch_size]
    sinks=None,  # f32[num_qo_heads] | None
    k_scale=None,  # f32[] | f32[num_kv_heads] | None: FP8 (value * k_scale)
    v_scale=None,  # f32[] | f32[num_kv_heads] | None
    *,
    causal: bool = True,
    sm_scale: float,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
):
  """Ragged-batch attention of new tokens over their sequences' paged KV.

  Same arguments and semantics as `reference.paged_prefill_reference`
  (module docstring for the method); `block_q` / `block_k` override
  `block_sizes`. Arguments are validated by `pkvattn.paged_prefill`.

  Returns `(out [num_tokens, num_qo_heads, head_dim] q.dtype,
  lse f32[num_tokens, num_qo_heads])`; padding tokens (at or past
  `q_indptr[-1]`) give zeros and `-inf`.
  """
  t_total, hq, d = q.shape
  _, ps, hkv, _ = k_pool.shape
  g = hq // hkv
  batch_size, max_pages = k_table.shape
  bq, bk = block_sizes(t_total, ps, batch_size=batch_size,
                       max_keys=max_pages * ps, block_q=block_q,
                       block_k=block_k)
  ppb = bk // ps
  num_tiles = max(1, min(t_total, (t_total + batch_size * (bq - 1)) // bq))
  seq, first, rows, pos0, starts = _tiles(q_indptr, kv_lens, bq, num_tiles)

  # Tables padded to whole key blocks (-1: never visible, clipped on read).
  pad_pages = -max_pages % ppb
  k_table = jnp.pad(k_table, ((0, 0), (0, pad_pages)), constant_values=-1)
  v_table = jnp.pad(v_table, ((0, 0), (0, pad_pages)), constant_values=-1)
  q_pad = jnp.pad(q, ((0, bq), (0, 0), (0, 0)))
  logit_scale = jnp.float32(sm_scale)
  if k_scale is not None:  # [hkv, 1, 1] per head: over [bq, hkv, g, d]
    logit_scale = logit_scale * _head_scale(k_scale, 2)
  r = bq * g
  row_token = jnp.arange(r, dtype=jnp.int32) // g  # row = token * g + head

  # FP8 pools enter the loops as their bytes (`_kv.as_bytes`, free; it
  # cancels a caller's `from_bytes`) and each gathered block converts:
  # given a float8_e4m3fn loop operand, XLA's CPU backend (no FP8 gather)
  # converts the whole pool to a wider float before the loop.
  fp8 = _kv.is_fp8(k_pool)
  if fp8:
    same = v_pool is k_pool
    k_pool = _kv.as_bytes(k_pool)
    v_pool = k_pool if same else _kv.as_bytes(v_pool)

  def gather(pool, table_row, kb):
    pages = lax.dynamic_slice(table_row, (kb * ppb,), (ppb,))
    blk = pool[jnp.clip(pages, 0, pool.shape[0] - 1)]
    if fp8:
      blk = _kv.from_bytes(blk)
    return blk.reshape(bk, hkv, d).astype(jnp.float32)

  def one_tile(args):
    b, t0, n_rows, p0 = args
    qt = lax.dynamic_slice(q_pad, (t0, 0, 0), (bq, hq, d)).astype(jnp.float32)
    qt = (qt.reshape(bq, hkv, g, d) * logit_scale).transpose(1, 0, 2, 3)
    qt = qt.reshape(hkv, r, d)
    q_pos = p0 + row_token                       # [R]
    row_ok = row_token < n_rows
    kv_len = kv_lens[b]
    hi = jnp.minimum(kv_len, p0 + n_rows) if causal else kv_len
    lo = jnp.maximum(p0 - window_left, 0) if window_left >= 0 else 0
    kb_lo = lo // bk
    kb_hi = jnp.where(n_rows > 0, (hi + bk - 1) // bk, kb_lo)
    k_row, v_row = k_table[b], v_table[b]

    def block(kb, carry):
      m, l, acc = carry
      k = gather(k_pool, k_row, kb)              # [bk, Hkv, D]
      v = gather(v_pool, v_row, kb)
      k_pos = kb * bk + jnp.arange(bk, dtype=jnp.int32)
      key_ok = k_pos < kv_len
      v_ok = key_ok & (k_pos >= lo)
      s = jnp.einsum("krd,skd->krs", qt, k,
                     precision=lax.Precision.HIGHEST)  # [Hkv, R, bk]
      if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
      mask = key_ok[None, :] & row_ok[:, None]
      if causal:
        mask &= k_pos[None, :] <= q_pos[:, None]
      if window_left >= 0:
        mask &= k_pos[None, :] >= q_pos[:, None] - window_left
      s = jnp.where(mask[None], s, NEG_INF)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      alpha = jnp.exp(m - m_safe)                # 0 while m is -inf
      p = jnp.exp(s - m_safe[..., None])         # 0 where masked
      # A masked key's weight is 0, but 0 * NaN is NaN: zero V past the
      # sequence and before the tile's window (those pages need not be valid:
      # a window's released pages), where no row of the tile looks.
      v = jnp.where(v_ok[:, None, None], v, 0.0)
      l = alpha * l + jnp.sum(p, axis=-1)
      acc = alpha[..., None] * acc + jnp.einsum(
          "krs,skd->krd", p, v, precision=lax.Precision.HIGHEST)
      return m_new, l, acc

    init = (jnp.full((hkv, r), NEG_INF, jnp.float32),
            jnp.zeros((hkv, r), jnp.float32),
            jnp.zeros((hkv, r, d), jnp.float32))
    m, l, acc = lax.fori_loop(kb_lo, kb_hi, block, init)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), NEG_INF)
    if sinks is None:
      out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    else:
      sink = jnp.repeat(sinks.astype(jnp.float32).reshape(hkv, 1, g), bq,
                        axis=1).reshape(hkv, r)
      top = jnp.maximum(m_safe, sink)
      keep = jnp.exp(m_safe - top)
      denom = l * keep + jnp.exp(sink - top)
      out = acc * (keep / denom)[..., None]
    out = out.reshape(hkv, bq, g, d).transpose(1, 0, 2, 3).reshape(bq, hq, d)
    lse = lse.reshape(hkv, bq, g).transpose(1, 0, 2).reshape(bq, hq)
    return out, lse

  out_t, lse_t = lax.map(one_tile, (seq, first, rows, pos0))
  if v_scale is not None:
    v_scale = _head_scale(v_scale, 1)
    if v_scale.ndim:  # [hq, 1] per head: over [tiles, bq, hq, d]
      v_scale = jnp.repeat(v_scale, g, axis=0)
    out_t = out_t * v_scale

  # Token t of sequence b sits in tile starts[b] + (t - q_indptr[b]) // bq.
  t = jnp.arange(t_total, dtype=jnp.int32)
  tb = reference.owner(q_indptr[1:], t, batch_size)
  off = t - q_indptr[tb]
  valid = t < q_indptr[-1]
  tile = jnp.clip(starts[tb] + off // bq, 0, num_tiles - 1)
  row = off % bq
  out = jnp.where(valid[:, None, None], out_t[tile, row], 0.0)
  lse = jnp.where(valid[:, None], lse_t[tile, row], NEG_INF)
  return out.astype(q.dtype), lse
