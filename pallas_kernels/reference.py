"""Pure-jnp references for every op in this package (no Pallas / Triton imports).

These are both the `impl="xla"` path of the public API and the cross-check for
the kernels. They follow FlashInfer's semantics:

* `kv_lens[b]` counts the tokens in the cache *including* the new ones; the
  queries of sequence `b` are its last `q_len` positions.
* Key `j` is visible to the query at position `i` iff `j < kv_len`, and, when
  causal, `j <= i`, and, when `window_left >= 0`, `j >= i - window_left`.
* Logits are `s = sm_scale * q.k`; with `logits_soft_cap = c`, `s = c * tanh(s / c)`.
* `sinks[h]` (gpt-oss) is one extra logit per query head that joins the softmax
  denominator only. `lse` is the natural-log sum-exp over visible keys (the
  sink excluded), so rows with no visible key give zeros and `lse = -inf`.

Arithmetic is done in f32; outputs are cast to `q.dtype`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

NEG_INF = float("-inf")


def _gather_kv(pool, table, scale=None):
  """[num_pages, page_size, H, D] x i32[B, P] -> [B, P * page_size, H, D].

  Entries < 0 are clipped to page 0; the caller masks those rows out before
  they can reach an output (NaNs are removed with `where`, never multiplied).
  With `scale` (FP8 pages: `f32[]`, or `f32[H]` one per KV head), the pages
  are dequantized: f32 `value * scale[h]`.
  """
  b, p = table.shape
  _, ps, h, d = pool.shape
  pages = pool[jnp.clip(table, 0, pool.shape[0] - 1)]
  if scale is not None:
    scale = jnp.asarray(scale, jnp.float32)
    if scale.ndim:  # [H] -> [H, 1], over [..., H, D]
      scale = scale.reshape(-1, 1)
    pages = pages.astype(jnp.float32) * scale
  return pages.reshape(b, p * ps, h, d)


def _logits(q, k, sm_scale, logits_soft_cap):
  """q [..., Hkv, G, D] x k [..., S, Hkv, D] -> f32 [..., Hkv, G, S]."""
  s = jnp.einsum("...kgd,...skd->...kgs", q.astype(jnp.float32),
                 k.astype(jnp.float32), precision=lax.Precision.HIGHEST)
  s = s * sm_scale
  if logits_soft_cap is not None and logits_soft_cap > 0:
    s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
  return s


def _masked_softmax_av(s, mask, v, sinks):
  """s f32[..., Hkv, G, S], mask bool broadcastable, v [..., S, Hkv, D].

  Returns (out f32[..., Hkv, G, D], lse f32[..., Hkv, G]). The LSE is taken
  against the visible keys' own maximum: a sink far above every logit
  would otherwise underflow `exp(s - m)` to zero and turn a finite LSE
  into -inf. The sink joins the output's denominator only.
  """
  s = jnp.where(mask, s, NEG_INF)
  m = jnp.max(s, axis=-1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
  denom = jnp.sum(p, axis=-1)
  lse = jnp.where(denom > 0, jnp.log(jnp.where(denom > 0, denom, 1.0)) + m_safe,
                  NEG_INF)
  v = jnp.where(jnp.isnan(v), 0.0, v.astype(jnp.float32))  # masked rows may be NaN
  out = jnp.einsum("...kgs,...skd->...kgd", p, v,
                   precision=lax.Precision.HIGHEST)
  if sinks is None:
    return out / jnp.where(denom > 0, denom, 1.0)[..., None], lse
  top = jnp.maximum(m_safe, sinks)  # both finite: exp() below is at most 1
  keep = jnp.exp(m_safe - top)
  return out * (keep / (denom * keep + jnp.exp(sinks - top)))[..., None], lse


def _visible(q_pos, kv_pos, kv_len, causal, window_left):
  mask = kv_pos < kv_len
  if causal:
    mask &= kv_pos <= q_pos
  if window_left is not None and window_left >= 0:
    mask &= kv_pos >= q_pos - window_left
  return mask


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "window_left", "logits_soft_cap"))
def paged_decode_reference(
    q,          # [batch_size, num_qo_heads, head_dim]
    k_pool,     # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool,     # [num_pages, page_size, num_kv_heads, head_dim]
    k_table,    # i32[batch_size, max_pages]
    v_table,    # i32[batch_size, max_pages]
    kv_lens,    # i32[batch_size]
    sinks=None,  # f32[num_qo_heads] | None
    k_scale=None,  # f32[] | f32[num_kv_heads] | None: FP8 (value * k_scale)
    v_scale=None,  # f32[] | f32[num_kv_heads] | None
    *,
    sm_scale: float,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
):
  """One query token per sequence at position `kv_lens[b] - 1`.

  Query `b` sees keys `j` with `max(0, kv_lens[b] - 1 - window_left) <= j <
  kv_lens[b]` (all of `j < kv_lens[b]` with `window_left = -1`); the GQA
  group of kv head `h` is query heads `h * group_size ..`. FP8 pages are
  read as `value * k_scale` / `value * v_scale` in f32 (per-KV-head scales:
  each head's own). The oracle of `paged_decode` and `paged_decode_mma`
  (vLLM / FlashInfer paged decode; sinks as gpt-oss's).

  Returns `(out [batch_size, num_qo_heads, head_dim] q.dtype,
  lse f32[batch_size, num_qo_heads])`; an empty sequence gives zeros and
  -inf.
  """
  b, hq, d = q.shape
  hkv = k_pool.shape[2]
  g = hq // hkv
  k = _gather_kv(k_pool, k_table, k_scale)  # [B, S, Hkv, D]
  v = _gather_kv(v_pool, v_table, v_scale)
  s_len = k.shape[1]
  qg = q.reshape(b, hkv, g, d)
  s = _logits(qg, k, sm_scale, logits_soft_cap)  # [B, Hkv, G, S]
  kv_pos = jnp.arange(s_len)[None, :]
  q_pos = (kv_lens - 1)[:, None]
  mask = _visible(q_pos, kv_pos, kv_lens[:, None], True, window_left)
  mask = mask[:, None, None, :]
  sk = None if sinks is None else sinks.astype(jnp.float32).reshape(hkv, g)
  out, lse = _masked_softmax_av(s, mask, v, sk)
  return out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)


def owner(ends, idx, n: int):
  """Per entry of `idx`, the first position `b` of the sorted `ends` with
  `ends[b] > idx` (the sequence or tile that `idx` falls in), clipped to
  `[0, n)`, i32. One fused compare-and-count: the default binary search is
  a while loop of small kernels on the GPU (three per step of the search)."""
  return jnp.clip(jnp.searchsorted(ends, idx, side="right",
                                   method="compare_all"),
                  0, n - 1).astype(jnp.int32)


def token_metadata(q_indptr, kv_lens, num_tokens):
  """Per-token sequence index and position for a ragged batch.

  Returns `(batch_indices i32[num_tokens], positions i32[num_tokens])`;
  tokens at or past `q_indptr[-1]` are padding and get batch index -1 and
  position 0. Follows FlashInfer's `get_batch_indices_positions`.
  """
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  b = owner(q_indptr[1:], t, kv_lens.shape[0])
  valid = t < q_indptr[-1]
  q_len = q_indptr[b + 1] - q_indptr[b]
  pos = kv_lens[b] - q_len + (t - q_indptr[b])
  return jnp.where(valid, b, -1), jnp.where(valid, pos, 0).astype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=("causal", "sm_scale", "window_left", "logits_soft_cap",
                     "chunk"))
def paged_prefill_reference(
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
    chunk: int = 64,
):
  """Ragged-batch attention of new tokens over their sequences' paged KV.

  Sequence `b`'s new tokens are rows `q_indptr[b] .. q_indptr[b + 1]` of
  `q`, its last `q_len` positions; visibility is the module docstring's rule
  (FlashInfer's `BatchPrefillWithPagedKVCache`). FP8 pages are read as
  `value * scale` in f32 (per-KV-head scales: each head's own). The
  pure-jnp statement of `paged_prefill`'s semantics, which the kernels and
  the XLA prefill (`pkvattn.xla_attention`) follow; tested, like them,
  against a float64 oracle.

  Tokens are processed `chunk` at a time (`lax.map`); each token gathers its
  own sequence's pages, so memory is `chunk * max_pages * page_size * H * D`.

  Returns `(out [num_tokens, num_qo_heads, head_dim] q.dtype,
  lse f32[num_tokens, num_qo_heads])`; padding tokens give zeros / -inf.
  """
  t_total, hq, d = q.shape
  hkv = k_pool.shape[2]
  g = hq // hkv
  ps = k_pool.shape[1]
  max_pages = k_table.shape[1]
  s_len = max_pages * ps
  bidx, pos = token_metadata(q_indptr, kv_lens, t_total)
  chunk = max(1, min(chunk, t_total))
  pad = (-t_total) % chunk
  qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
  bp = jnp.pad(bidx, (0, pad), constant_values=-1)
  pp = jnp.pad(pos, (0, pad))
  sk = None if sinks is None else sinks.astype(jnp.float32).reshape(hkv, g)

  def one_chunk(args):
    qc, bc, pc = args  # [C, Hq, D], [C], [C]
    valid = bc >= 0
    bs = jnp.clip(bc, 0)
    k = _gather_kv(k_pool, k_table[bs], k_scale)  # [C, S, Hkv, D]
    v = _gather_kv(v_pool, v_table[bs], v_scale)
    s = _logits(qc.reshape(-1, hkv, g, d), k, sm_scale, logits_soft_cap)
    kv_pos = jnp.arange(s_len)[None, :]
    kv_len = jnp.where(valid, kv_lens[bs], 0)
    mask = _visible(pc[:, None], kv_pos, kv_len[:, None], causal, window_left)
    out, lse = _masked_softmax_av(s, mask[:, None, None, :], v, sk)
    return out.reshape(-1, hq, d), lse.reshape(-1, hq)

  n = qp.shape[0] // chunk
  out, lse = lax.map(
      one_chunk,
      (qp.reshape(n, chunk, hq, d), bp.reshape(n, chunk), pp.reshape(n, chunk)))
  out = out.reshape(-1, hq, d)[:t_total]
  lse = lse.reshape(-1, hq)[:t_total]
  return out.astype(q.dtype), lse


def merge_state_reference(out_a, lse_a, out_b, lse_b):
  """Combines two partial attentions over disjoint key sets (FlashInfer `merge_state`).

  `out_*: [..., num_qo_heads, head_dim]`, `lse_*: f32[..., num_qo_heads]`.
  Returns `(out, lse)` with `lse = logaddexp(lse_a, lse_b)`; where both are
  -inf the output is zeros.
  """
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  wa = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)[..., None]
  wb = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)[..., None]
  out = wa * out_a.astype(jnp.float32) + wb * out_b.astype(jnp.float32)
  return out.astype(out_a.dtype), lse


# ----------------------------------------------------------------------------
# RoPE and paged K/V append. `inv_freq f32[rotary_dim // 2]` is the per-pair
# inverse frequency (scaling already applied, see pkvattn.rope); the first
# `rotary_dim = 2 * len(inv_freq)` features of each head are rotated, the rest
# pass through.
# ----------------------------------------------------------------------------


def rope_cos_sin(positions, inv_freq):
  """`i32[num_tokens]` x `f32[rotary_dim // 2]` -> (cos, sin) f32[num_tokens, rotary_dim // 2].

  The angle `positions * inv_freq` is formed in f32 (as transformers does).
  """
  angles = positions.astype(jnp.float32)[:, None] * inv_freq.astype(
      jnp.float32)[None, :]
  return jnp.cos(angles), jnp.sin(angles)


def rope_reference(
    x,          # [num_tokens, num_heads, head_dim]
    positions,  # i32[num_tokens]
    inv_freq,   # f32[rotary_dim // 2]
    *,
    interleaved: bool,
):
  """Rotates the first `rotary_dim` features of every head; f32 math, x.dtype out.

  `interleaved=False` is GPT-NeoX / Llama (`rotate_half`: pair `(i, i + half)`),
  `interleaved=True` is GPT-J (pair `(2i, 2i + 1)`).
  """
  half = inv_freq.shape[0]
  rot = 2 * half
  cos, sin = rope_cos_sin(positions, inv_freq)
  cos, sin = cos[:, None, :], sin[:, None, :]
  xf = x.astype(jnp.float32)
  xr, xp = xf[..., :rot], xf[..., rot:]
  if interleaved:
    x1, x2 = xr[..., 0::2], xr[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = jnp.stack([o1, o2], axis=-1).reshape(xr.shape)
  else:
    x1, x2 = xr[..., :half], xr[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return jnp.concatenate([out, xp], axis=-1).astype(x.dtype)


def append_rows(
    batch_indices,  # i32[num_tokens]
    positions,      # i32[num_tokens]
    table,          # i32[batch_size, max_pages]
    page_size: int,
    num_pages: int,
):
  """Flat pool row `page * page_size + position % page_size` of every token.

  Tokens with `batch_indices < 0`, a position outside the table, or a table
  entry `< 0` get row `num_pages * page_size`: one past the end, so a
  `mode="drop"` scatter (or a masked kernel store) skips them. Never a negative
  row: jnp indexing would wrap it.
  """
  batch_size, max_pages = table.shape
  num_rows = num_pages * page_size
  b = batch_indices.astype(jnp.int32)
  p = positions.astype(jnp.int32)
  block = p // page_size
  valid = (b >= 0) & (b < batch_size) & (p >= 0) & (block < max_pages)
  page = table[jnp.clip(b, 0, batch_size - 1), jnp.clip(block, 0, max_pages - 1)]
  valid &= (page >= 0) & (page < num_pages)
  return jnp.where(valid, page * page_size + p % page_size, num_rows).astype(
      jnp.int32)


def append_paged_kv_reference(
    k,              # [num_tokens, num_kv_heads, head_dim]
    v,              # [num_tokens, num_kv_heads, head_dim]
    batch_indices,  # i32[num_tokens]
    positions,      # i32[num_tokens]
    k_pool,         # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool,         # [num_pages, page_size, num_kv_heads, head_dim] | None
    k_table,        # i32[batch_size, max_pages]
    v_table,        # i32[batch_size, max_pages]
):
  """Scatters token rows into the pool(s); `v_pool=None` = V shares `k_pool`.

  Returns `(k_pool, v_pool)` (`v_pool` is None when shared). The reshape to
  flat rows is free and the scatter is `mode="drop"`, so under donation XLA
  updates the pool in place.
  """
  n, ps, h, d = k_pool.shape
  k_rows = append_rows(batch_indices, positions, k_table, ps, n)
  v_rows = append_rows(batch_indices, positions, v_table, ps, n)
  flat = k_pool.reshape(n * ps, h, d)
  if v_pool is None:
    rows = jnp.concatenate([k_rows, v_rows])
    vals = jnp.concatenate([k, v]).astype(k_pool.dtype)
    return flat.at[rows].set(vals, mode="drop").reshape(k_pool.shape), None
  k_pool = flat.at[k_rows].set(k.astype(k_pool.dtype), mode="drop")
  v_pool = v_pool.reshape(n * ps, h, d).at[v_rows].set(
      v.astype(v_pool.dtype), mode="drop")
  return k_pool.reshape(n, ps, h, d), v_pool.reshape(n, ps, h, d)
