"""Scheduling metadata for the paged prefill kernel (FlashInfer's plan/run split).

The prefill kernel's grid is static (no dynamic grid on Pallas-Triton), bounded
by `num_tokens // block_q + batch_size + 1` query tiles per kv head, fewer
where sequences of a few tokens run elsewhere (`max_tiles`). A query
tile is `block_q` consecutive new tokens of ONE sequence; the padding tokens
past `q_indptr[-1]` form one extra pseudo-sequence with `kv_len = 0`, so their
tiles write zeros (and `lse = -inf`) and no output row is left unwritten.

Which tile belongs to which sequence depends only on `q_indptr`, `kv_lens`
and the static `num_tokens` / `block_q`, so it is computed once per step with
a few small jnp ops (a prefix sum, a compare-and-count search, the order's
rank count and scatter) and reused by every layer.

Tiles are ordered longest-first (by the number of visible keys, an LPT
schedule as in FlashInfer / FA3): under causal masking the last query tile of
a prompt does `S / block_q` times the work of the first, and launching the
heavy tiles first keeps the tail of the launch short. Decode rows of a mixed
batch (one token, long KV) sort by their KV length beside the prompt tiles.
The order is a stable sort by descending work (`order_by_work`).

This module is the pure-jnp reference of the schedule; on Hopper the
Mosaic-GPU configs of the prefill kernel build the same plan in one launch
(`plan_mgpu`, `paged_prefill.MosaicConfig.plan_kernel`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

# Columns of `PrefillPlan.tiles`.
SEQ, Q_START, Q_END, KV_LEN, POS_OFFSET = range(5)
NUM_FIELDS = 5


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tiles", "short_tiles", "decode_rows", "decode_kv_lens"],
    meta_fields=["block_q", "short_block_q", "num_tokens", "batch_size",
                 "align", "decode_rows_per_seq"])
@dataclasses.dataclass(frozen=True)
class PrefillPlan:
  """Per-step schedule of the prefill kernel; a pytree (block_q etc. static).

  With `short_block_q > 0`, sequences with `1 <= q_len <= short_block_q`
  (decode rows, multi-token decode) are left out of `tiles` and get one tile
  each in `short_tiles` (row b: sequence b, or an unused tile), run by a
  second launch with `short_block_q` tokens per tile, so a decode row does
  not pay for a main tile's MMA rows. With `decode_rows`, sequences
  with `1 <= q_len <= decode_rows_per_seq` (R) go to the split-K decode
  kernel instead, one decode query per token (memory-bound rows at the
  decode kernel's bandwidth; a short tile walks a long KV in one program).
  With R > 1 (multi-token decode in the decode kernel, its tokens' causal
  order kept by giving each its own key count) `decode_rows[b * R + r]`
  is sequence b's token r and `decode_kv_lens[b * R + r]` the keys that
  token sees (its position + 1); the token rows of one sequence run side
  by side and share its pages through L2.

  `tiles[i]` describes grid tile `i` (already in launch order):
    SEQ:        row of the page table (0 for the padding pseudo-sequence);
    Q_START:    first token of the tile in `q` (global index);
    Q_END:      one past the sequence's last token (rows at or past it are
                masked; `Q_END <= Q_START` marks an unused tile);
    KV_LEN:     tokens in the sequence's cache (0 for padding / unused);
    POS_OFFSET: position of token `t` is `t + POS_OFFSET`.
  """
  tiles: jax.Array  # i32[max_tiles(...), NUM_FIELDS]
  short_tiles: jax.Array | None  # i32[batch_size, NUM_FIELDS] | None
  # i32[batch_size * decode_rows_per_seq] | None: the tokens of each
  # sequence run by the split-K decode kernel (`num_tokens` for none);
  # None = every sequence stays in the tiles.
  decode_rows: jax.Array | None
  block_q: int
  short_block_q: int  # 0 = no short class
  num_tokens: int
  batch_size: int
  align: int = 1  # tiles' grid origin: first token rounded down to `align`
  # i32[batch_size * decode_rows_per_seq] with decode_rows_per_seq > 1:
  # each decode row's keys (0 for none); None: the sequences' kv_lens.
  decode_kv_lens: jax.Array | None = None
  decode_rows_per_seq: int = 1

  @property
  def num_tiles(self) -> int:
    return self.tiles.shape[0]


# Up to this many rows, `order_by_work` ranks every row by counting
# the rows that go before it (one compare of all pairs, one kernel) and
# scatters the rows to their ranks, and `prefix_sum` sums by comparing all
# pairs too; above it, they sort (`jnp.argsort`) and scan (`jnp.cumsum`).
# On the GPU each small XLA op is a kernel launch of its own, and a sort
# costs several of them: one fused compare is cheaper for the plan's
# usual sizes (measured: docs/performance.md).
RANK_MAX_ROWS = 2048


def prefix_sum(x: jax.Array) -> jax.Array:
  """`jnp.cumsum(x)` of `i32[n]`: one fused reduce up to `RANK_MAX_ROWS`."""
  n = x.shape[0]
  if n > RANK_MAX_ROWS:
    return jnp.cumsum(x)
  i = jnp.arange(n, dtype=jnp.int32)
  return jnp.sum(jnp.where(i[None, :] <= i[:, None], x[None, :], 0), axis=1,
                 dtype=x.dtype)


def order_by_work(rows: jax.Array, work: jax.Array) -> jax.Array:
  """`rows` in descending `work`, ties in row order (a stable sort).

  Args:
    rows: `i32[n, k]`.
    work: `i32[n]`, the sort key.

  Returns:
    `i32[n, k]`: `rows[numpy.argsort(-work, kind="stable")]`.
  """
  n = work.shape[0]
  if n > RANK_MAX_ROWS:
    return rows[jnp.argsort(-work, stable=True)]
  i = jnp.arange(n, dtype=jnp.int32)
  # before[r, c]: row c goes before row r.
  wr, wc = work[:, None], work[None, :]
  before = (wc > wr) | ((wc == wr) & (i[None, :] < i[:, None]))
  # The barrier keeps the count its own kernel: fused into the scatter,
  # XLA counts each row's rank serially.
  rank = jax.lax.optimization_barrier(
      jnp.sum(before, axis=1, dtype=jnp.int32))
  return jnp.zeros_like(rows).at[rank].set(rows, unique_indices=True)


def max_tiles(num_tokens: int, batch_size: int, block_q: int,
              min_tokens: int = 1) -> int:
  """Static bound on the tiles of a plan: those of the sequences with at
  least `min_tokens` new tokens (the shorter ones run elsewhere:
  `tile_min_tokens`), and of the padding pseudo-sequence.

  A sequence's tiles lie on a grid of `block_q` tokens from its first token
  rounded down to `align` (a divisor of `block_q`): with `x` that origin
  and `y` its last token rounded down to `align`, it has
  `(y - x) // block_q + 1` tiles. Consecutive sequences' `[x, y]` do not
  overlap and lie in `[0, num_tokens)`, so their first terms sum to at
  most `num_tokens // block_q`, and a plan has at most that many tiles
  plus one per sequence with tiles: at most `min(batch_size, num_tokens
  // min_tokens)` sequences and the padding one. (With `min_tokens` 9, a
  speculative decoding verify step of 64 sequences of 4 tokens has 31
  tiles where `num_tokens // block_q + batch_size + 1` has 67.)"""
  return num_tokens // block_q + min(batch_size,
                                     num_tokens // max(min_tokens, 1)) + 1


def tile_min_tokens(short_block_q: int, split_decode_rows: bool,
                    decode_rows_per_seq: int) -> int:
  """New tokens a sequence needs for main tiles of `plan_prefill`: those
  with `1 <= q_len <= short_block_q` run as short tiles, with
  `split_decode_rows` those of up to `decode_rows_per_seq` tokens as
  decode rows (`max_tiles`'s `min_tokens`)."""
  return max(short_block_q,
             decode_rows_per_seq if split_decode_rows else 0) + 1


def plan_prefill(
    q_indptr: jax.Array,  # i32[batch_size + 1]
    kv_lens: jax.Array,   # i32[batch_size]
    *,
    num_tokens: int,
    block_q: int,
    causal: bool = True,
    window_left: int = -1,
    longest_first: bool = True,
    short_block_q: int = 0,
    align: int = 1,
    split_decode_rows: bool = False,
    decode_rows_per_seq: int = 1,
) -> PrefillPlan:
  """Builds the tile schedule of one step (jit-compatible, no host sync).

  Args:
    q_indptr: `i32[batch_size + 1]`, cu_seqlens of the new tokens,
      `q_indptr[-1] <= num_tokens`.
    kv_lens: `i32[batch_size]`, tokens including the new ones.
    num_tokens: static, rows of `q`.
    block_q: static, tokens per query tile (must match the kernel config).
    causal, window_left: static; only used to estimate each tile's work for
      the longest-first order (correctness does not depend on them).
    longest_first: static; False keeps tiles in token order.
    short_block_q: static; > 0 moves sequences with q_len <= short_block_q
      into `short_tiles` (see `PrefillPlan`).
    align: static; tiles lie on a grid of `block_q` tokens that starts at
      the sequence's first token rounded down to a multiple of `align`, so
      every tile's `Q_START` rounded down to `align` is `block_q`-aligned to
      that grid (the Mosaic kernel loads a tile's queries with TMA from an
      `align`-aligned row, `align - 1` rows of the previous sequence
      included and masked). 1 = tiles start at the sequence's first token.
    split_decode_rows: static; True leaves sequences with `1 <= q_len <=
      decode_rows_per_seq` out of both tile lists and lists their tokens
      in `decode_rows` (see `PrefillPlan`).
    decode_rows_per_seq: static, >= 1; the longest sequence (new tokens)
      run by the decode kernel with `split_decode_rows`.

  Returns:
    A `PrefillPlan` with `tiles i32[max_tiles(num_tokens, batch_size,
    block_q, tile_min_tokens(short_block_q, split_decode_rows,
    decode_rows_per_seq)), 5]`.

  Raises:
    ValueError: `decode_rows_per_seq < 1`.
  """
  if decode_rows_per_seq < 1:
    raise ValueError(f"Invalid decode_rows_per_seq: expected >= 1, got "
                     f"{decode_rows_per_seq}")
  batch_size = kv_lens.shape[0]
  q_indptr = q_indptr.astype(jnp.int32)
  kv_lens = kv_lens.astype(jnp.int32)
  total = jnp.minimum(q_indptr[-1], num_tokens)
  # Sequence `batch_size` is the padding pseudo-sequence [total, num_tokens).
  starts = jnp.concatenate([q_indptr[:-1], total[None]])
  ends = jnp.concatenate([jnp.minimum(q_indptr[1:], num_tokens),
                          jnp.full((1,), num_tokens, jnp.int32)])
  lens = jnp.maximum(ends - starts, 0)
  kvs = jnp.concatenate([kv_lens, jnp.zeros((1,), jnp.int32)])
  short_tiles = decode_rows = decode_kv_lens = None
  one = jnp.zeros((batch_size,), bool)
  rows_per_seq = decode_rows_per_seq
  if split_decode_rows:
    one = (lens[:-1] >= 1) & (lens[:-1] <= rows_per_seq)
    if rows_per_seq == 1:
      decode_rows = jnp.where(one, starts[:-1], num_tokens).astype(jnp.int32)
    else:
      r = jnp.arange(rows_per_seq, dtype=jnp.int32)[None, :]
      ln = lens[:-1, None]
      row = one[:, None] & (r < ln)
      decode_rows = jnp.where(row, starts[:-1, None] + r,
                              num_tokens).reshape(-1).astype(jnp.int32)
      decode_kv_lens = jnp.where(row, kv_lens[:, None] - (ln - 1 - r),
                                 0).reshape(-1).astype(jnp.int32)
  is_short = jnp.concatenate([one, jnp.zeros((1,), bool)])
  if short_block_q > 0:
    b = jnp.arange(batch_size, dtype=jnp.int32)
    short = (lens[:-1] >= 1) & (lens[:-1] <= short_block_q) & ~one
    s_start = starts[:-1]
    short_tiles = jnp.stack([
        b, s_start, jnp.where(short, ends[:-1], s_start),
        jnp.where(short, kv_lens, 0), kv_lens - lens[:-1] - s_start],
                            axis=1).astype(jnp.int32)
    if longest_first:
      short_tiles = order_by_work(short_tiles, jnp.where(short, kv_lens, -1))
    is_short |= jnp.concatenate([short, jnp.zeros((1,), bool)])
  lead = starts % align  # rows before the sequence on its first tile
  n_tiles = jnp.where(is_short | (lens == 0), 0,
                      (lens + lead + block_q - 1) // block_q)
  cum = prefix_sum(n_tiles)
  num = max_tiles(num_tokens, batch_size, block_q, tile_min_tokens(
      short_block_q, split_decode_rows, rows_per_seq))
  i = jnp.arange(num, dtype=jnp.int32)
  # One fused compare-and-count (the default binary search is a loop of
  # small kernels on the GPU).
  seq = jnp.searchsorted(cum, i, side="right",
                         method="compare_all").astype(jnp.int32)
  used = i < cum[-1]
  seq = jnp.minimum(seq, batch_size)
  local = i - (cum[seq] - n_tiles[seq])
  q_start = jnp.maximum(starts[seq] - lead[seq] + local * block_q,
                        starts[seq])
  q_end = jnp.where(used, ends[seq], q_start)
  kv_len = jnp.where(used, kvs[seq], 0)
  pos_offset = kvs[seq] - lens[seq] - starts[seq]
  table_row = jnp.where(seq < batch_size, seq, 0)
  # Work estimate: visible keys of the tile's widest row range.
  pos_min = q_start + pos_offset
  pos_max = jnp.minimum(q_start - q_start % align + block_q,
                        q_end) - 1 + pos_offset
  hi = jnp.minimum(kv_len, pos_max + 1) if causal else kv_len
  lo = jnp.maximum(pos_min - window_left, 0) if window_left >= 0 else 0
  work = jnp.where(used, jnp.maximum(hi - lo, 0), -1)
  tiles = jnp.stack([table_row, q_start, q_end, kv_len, pos_offset],
                    axis=1).astype(jnp.int32)
  if longest_first:
    tiles = order_by_work(tiles, work)
  return PrefillPlan(tiles, short_tiles, decode_rows, block_q,
                     short_block_q, num_tokens, batch_size, align,
                     decode_kv_lens,
                     decode_rows_per_seq if split_decode_rows else 1)
