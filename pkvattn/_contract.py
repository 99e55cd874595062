"""Checked mode of the attention and append ops: their runtime contract as checks.

The machinery (the `checked()` context, eager vs staged errors) is
`pkvattn.cache._contract`, whose module docstring says how to enable it inside
a jitted function. Here are the clauses, one function per op family, written
with `require` (a `checkify.check`). They read only the small integer inputs
(tables, lengths, indptr, indices), never the pools.
"""

from __future__ import annotations

import jax.numpy as jnp

from pkvattn.cache._contract import checked as checked
from pkvattn.cache._contract import enabled as enabled
from pkvattn.cache._contract import first_true
from pkvattn.cache._contract import guard as guard
from pkvattn.cache._contract import require
from pkvattn.cache._contract import run as run
from pkvattn.cache._contract import unchecked as unchecked

__all__ = ["append_contract", "attention_contract", "both", "checked",
           "enabled", "guard", "run", "scale_contract", "unchecked"]

# `pkvattn._kv.MIN_SCALE` (the smallest normal f32), repeated so that this
# module needs jax only.
_MIN_SCALE = 2.0 ** -126


def scale_contract(k_scale, v_scale):
  """The FP8 scales given as jax arrays (`f32[]` or `f32[num_kv_heads]`, or
  None where the scale was a host number, already checked at trace time by
  `_kv.check_scales`).

  Clause: every value is finite and `>= 2**-126` (the smallest normal f32,
  so that the quantizers' `1 / scale` is finite).
  """
  for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
    if s is None:
      continue
    good = jnp.isfinite(s) & (s >= _MIN_SCALE)
    require(jnp.all(good),
            f"Invalid {name}: {name} = {{}}, expected a finite scale >= "
            f"{_MIN_SCALE:.4g} (the smallest normal f32; stored value = x / "
            f"scale)", s.reshape(-1)[first_true(~good)])


def both(ok_a, ok_b):
  """Conjunction of two `run` results (None: nothing staged)."""
  if ok_a is None:
    return ok_b
  if ok_b is None:
    return ok_a
  return ok_a & ok_b


def _tables(table):
  """The caller's table as `i32[batch_size, rows, max_pages]` (rows: 1 shared,
  2 split)."""
  table = table.astype(jnp.int32)
  return table[:, None, :] if table.ndim == 2 else table


def _require_pages(table, need, num_pages: int, kv_lens, what: str):
  """Entries of `table` (`[B, R, P]`) where `need` (`bool[B, P]`) are pages."""
  bad = need[:, None, :] & ((table < 0) | (table >= num_pages))
  rows, width = table.shape[1], table.shape[2]
  f = first_true(bad)
  b, r, i = f // (rows * width), (f // width) % rows, f % width
  where = "page_table[{}, {}]" if rows == 1 else "page_table[{}, {}, {}]"
  args = (b, i) if rows == 1 else (b, r, i)
  require(~jnp.any(bad),
          f"Invalid page_table: {where} = {{}} for {what} (kv_lens[{{}}] = "
          f"{{}}), expected a page id in [0, num_pages={num_pages})",
          *args, table[b, r, i], b, kv_lens[b])


def attention_contract(table, kv_lens, q_indptr=None, *, num_pages: int,
                       page_size: int, num_tokens: int, window_left: int):
  """`paged_decode` (`q_indptr=None`: one query per row) / `paged_prefill`.

  Clauses: `0 <= kv_lens <= max_pages * page_size`; for prefill `q_indptr[0]
  == 0`, non-decreasing, `q_indptr[-1] <= num_tokens`, `kv_lens >= q_len`;
  every block a query can see (from the first query's window start, or 0, up
  to `cdiv(kv_lens[b], page_size)`; none for a row without queries) has a page
  id in `[0, num_pages)`.
  """
  table = _tables(table)
  max_pages = table.shape[2]
  cap = max_pages * page_size
  if kv_lens.shape[0] == 0:
    if q_indptr is not None:
      require(q_indptr[0] == 0,
              "Invalid q_indptr: q_indptr[0] = {}, expected 0", q_indptr[0])
    return
  kv_lens = kv_lens.astype(jnp.int32)
  bad = (kv_lens < 0) | (kv_lens > cap)
  b = first_true(bad)
  require(~jnp.any(bad),
          f"Invalid kv_lens: kv_lens[{{}}] = {{}}, expected in [0, max_pages * "
          f"page_size = {cap}]", b, kv_lens[b])
  if q_indptr is None:
    q_len = (kv_lens > 0).astype(jnp.int32)
  else:
    q_indptr = q_indptr.astype(jnp.int32)
    require(q_indptr[0] == 0,
            "Invalid q_indptr: q_indptr[0] = {}, expected 0", q_indptr[0])
    q_len = q_indptr[1:] - q_indptr[:-1]
    b = first_true(q_len < 0)
    require(jnp.all(q_len >= 0),
            "Invalid q_indptr: decreasing at q_indptr[{}] = {} > "
            "q_indptr[{}] = {}", b, q_indptr[b], b + 1, q_indptr[b + 1])
    require(q_indptr[-1] <= num_tokens,
            f"Invalid q_indptr: q_indptr[-1] = {{}} > num_tokens = "
            f"{num_tokens}", q_indptr[-1])
    short = kv_lens < q_len
    b = first_true(short)
    require(~jnp.any(short),
            "Invalid kv_lens: kv_lens[{}] = {} < q_len = {} (kv_lens counts "
            "the new tokens too)", b, kv_lens[b], q_len[b])
  first_query = kv_lens - q_len
  lo = jnp.zeros_like(kv_lens)
  if window_left >= 0:
    lo = jnp.maximum(first_query - window_left, 0)
  block = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
  end = (jnp.clip(kv_lens, 0, cap) + page_size - 1) // page_size
  need = ((q_len > 0)[:, None] & (block >= (lo // page_size)[:, None])
          & (block < end[:, None]))
  _require_pages(table, need, num_pages, kv_lens, "a visible block")


def append_contract(table, batch_indices, positions, *, num_pages: int,
                    page_size: int):
  """`append_paged_kv` / `apply_rope_and_append*`.

  Clauses: `batch_indices` in `[-1, batch_size)`; a token with
  `batch_indices[t] >= 0` has `positions[t] >= 0`, its block
  `positions[t] // page_size < max_pages`, and a page id in `[0, num_pages)`
  there (unchecked, such a token is silently not written).
  """
  table = _tables(table)
  batch_size, _, max_pages = table.shape
  if batch_indices.shape[0] == 0:
    return
  bidx = batch_indices.astype(jnp.int32)
  pos = positions.astype(jnp.int32)
  bad = (bidx < -1) | (bidx >= batch_size)
  t = first_true(bad)
  require(~jnp.any(bad),
          f"Invalid batch_indices: batch_indices[{{}}] = {{}}, expected -1 "
          f"(padding) or in [0, batch_size={batch_size})", t, bidx[t])
  real = bidx >= 0
  block = pos // page_size
  bad = real & ((pos < 0) | (block >= max_pages))
  t = first_true(bad)
  require(~jnp.any(bad),
          f"Invalid positions: positions[{{}}] = {{}}, expected in [0, "
          f"max_pages * page_size = {max_pages * page_size})", t, pos[t])
  if batch_size == 0:
    return
  pages = table[jnp.clip(bidx, 0), :, jnp.clip(block, 0, max_pages - 1)]
  bad = real[:, None] & ((pages < 0) | (pages >= num_pages))
  f = first_true(bad)
  t = f // pages.shape[1]
  require(~jnp.any(bad),
          f"Invalid page_table: token {{}} (batch_indices = {{}}, positions = "
          f"{{}}) is written to page {{}}, expected a page id in [0, "
          f"num_pages={num_pages})", t, bidx[t], pos[t],
          pages.reshape(-1)[f])
