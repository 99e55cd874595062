"""Fused RoPE + paged K/V append: one Pallas (Triton) pass over the tokens.

`rope_append` / `rope_append_qkv` run this kernel, or on Hopper the
Mosaic-GPU one of `rope_append_mgpu.py`, as `dispatch.rope_append` chooses;
that kernel takes the same arguments and does the same f32 math, so both
give the same rows.

TensorRT-LLM's `qkv_preprocessing` (PR #11667) as a Pallas kernel. The grid is
`(token tiles, head splits)`; program `(i, j)` owns `block_tokens` tokens and
`1 / num_splits` of the q and kv heads. It computes the tile's cos/sin once
(f32, from `positions * inv_freq`), then for each of its heads reads q / k / v
once, rotates q and k in f32, stores the rotated q, and scatters the k and v
rows into the pool at per-token rows `page * page_size + position % page_size`
(precomputed by the wrapper, `reference.append_rows`; one past the end = skip).

Writes are masked stores through int-array indices, so a skipped token touches
no memory on the GPU. In interpret mode the masked lanes write back what they
read, which is why a skipped token's row is out of range (dropped) rather than
clamped (it could race a real write to the clamped row). The pool(s) are
aliased to the outputs (`input_output_aliases`), so under a donated jit the
pool is updated in place. `rope_append_qkv` takes TensorRT-LLM's fused
`[num_tokens, (num_qo_heads + 2 * num_kv_heads) * head_dim]` rows instead and
reads the q, k and v heads of each row in place (one ref, head offsets).

Every index is an int array (never a strided `pl.ds`): that form lowers to
Triton and also discharges in interpret mode, which rejects mixed slice/array
and strided indexers. Column ranges that are not powers of two (partial
rotary, say rotary_dim 16 of 64 leaves 48) are split into power-of-two chunks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from pkvattn.pallas_kernels import _compat
from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import rope_append_mgpu
from pkvattn.pallas_kernels._compat import pl

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (pkvattn._kv.FP8_MAX)


def _is_pow2(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def _pow2_chunks(start: int, size: int) -> list[tuple[int, int]]:
  """[start, start + size) as power-of-two (offset, length) pieces, largest first."""
  out = []
  while size > 0:
    n = 1 << (size.bit_length() - 1)
    out.append((start, n))
    start, size = start + n, size - n
  return out


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Launch config of this module's Pallas-Triton kernel (`backend`
  "triton"; `dispatch.rope_append` chooses between it and
  `rope_append_mgpu.Config`).

  Attributes:
    block_tokens: tokens per program, a power of two.
    num_splits: programs per token tile over the heads; divides both head
      counts (each program: `1 / num_splits` of the q heads and kv heads).
    num_warps, num_stages: Triton launch parameters.
    one_head: overrides `num_splits`: `num_qo_heads + num_kv_heads` programs
      per tile, each rotating one q head or appending one kv head.
    unroll: unroll the loop over a program's heads, so the loads of several
      heads can be in flight at once (a rolled loop waits for each head's
      loads before the next head's start).
  """
  backend: ClassVar[str] = "triton"
  block_tokens: int = 32
  num_splits: int = 1
  num_warps: int = 4
  num_stages: int = 2
  one_head: bool = False
  unroll: bool = False

  def __post_init__(self):
    if not _is_pow2(self.block_tokens):
      raise ValueError(f"Invalid block_tokens: expected a power of two, got "
                       f"{self.block_tokens}")
    for name in ("num_splits", "num_warps", "num_stages"):
      if getattr(self, name) < 1:
        raise ValueError(f"Invalid {name}: expected >= 1, got "
                         f"{getattr(self, name)}")


def _rope_append_kernel(*refs, num_tokens, num_rows, num_qo_heads,
                        num_kv_heads, head_dim, half, block_tokens, num_splits,
                        one_head, interleaved, rotate, has_q, same_pool,
                        fused, unroll, table_kind, page_size,
                        has_scales=False):
  # Unpack: inputs, then outputs (the aliased pool inputs are unused: the
  # outputs are the same buffers).
  refs = list(refs)
  pos_ref = refs.pop(0)      # i32[num_tokens]
  if table_kind is None:
    k_rows_ref = refs.pop(0)   # i32[num_tokens]
    v_rows_ref = refs.pop(0)   # i32[num_tokens]
  else:
    bi_ref = refs.pop(0)       # i32[num_tokens]
    table_ref = refs.pop(0)    # i32[batch_size, max_pages] | [batch_size, 2, max_pages]
  inv_ref = refs.pop(0) if rotate else None  # f32[half]
  # f32[2] (k_scale, v_scale): FP8 pools store clip(x / scale, +-448).
  scales_ref = refs.pop(0) if has_scales else None
  if fused:
    # [num_tokens, num_qo_heads + 2 * num_kv_heads, head_dim]: q, k, v heads.
    q_ref = k_ref = v_ref = refs.pop(0)
    k_off, v_off = num_qo_heads, num_qo_heads + num_kv_heads
  else:
    q_ref = refs.pop(0) if has_q else None     # [num_tokens, num_qo_heads, head_dim]
    k_ref = refs.pop(0)        # [num_tokens, num_kv_heads, head_dim]
    v_ref = refs.pop(0)        # [num_tokens, num_kv_heads, head_dim]
    k_off = v_off = 0
  refs.pop(0)                # k pool (aliased input)
  if not same_pool:
    refs.pop(0)              # v pool (aliased input)
  q_out_ref = refs.pop(0) if has_q else None  # [num_tokens, num_qo_heads, head_dim]
  k_pool_ref = refs.pop(0)   # [num_rows, num_kv_heads, head_dim]
  v_pool_ref = k_pool_ref if same_pool else refs.pop(0)

  i = pl.program_id(0)
  j = pl.program_id(1)
  tok = i * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
  valid = tok < num_tokens
  tok_ld = jnp.minimum(tok, num_tokens - 1)
  tok_st = jnp.where(valid, tok, num_tokens)  # out of range = dropped
  rot = 2 * half
  # Triton tensors need power-of-two dims: split the rotated half and the
  # pass-through tail into power-of-two column chunks (static).
  half_chunks = _pow2_chunks(0, half)
  pass_chunks = _pow2_chunks(rot, head_dim - rot)
  if rotate:
    pos = pos_ref[tok_ld].astype(jnp.float32)
    trig = []
    for start, size in half_chunks:
      ar = start + jnp.arange(size, dtype=jnp.int32)
      angles = pos[:, None] * inv_ref[ar][None, :]
      if interleaved:
        c1, c2 = 2 * ar, 2 * ar + 1
      else:
        c1, c2 = ar, half + ar
      trig.append((c1[None, :], c2[None, :], jnp.cos(angles), jnp.sin(angles),
                   size))
  call = [((start + jnp.arange(size, dtype=jnp.int32))[None, :], size)
          for start, size in _pow2_chunks(0, head_dim)]

  def full_mask(m, width):
    return jnp.broadcast_to(m[:, None], (block_tokens, width))

  # What a row stores: the value in the destination dtype, or, with a scale
  # (FP8 pools), `pkvattn._kv.quantize`'s math: times the f32 reciprocal,
  # saturation to +-FP8_MAX, then the cast.
  k_scale = 1.0 / scales_ref[0] if has_scales else None  # reciprocals
  v_scale = 1.0 / scales_ref[1] if has_scales else None

  def stored(x, dst_ref, inv_scale):
    if inv_scale is None:
      return x.astype(dst_ref.dtype)
    y = x.astype(jnp.float32) * inv_scale
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(dst_ref.dtype)

  def copy_cols(src_ref, dst_ref, h, src_off, r_ld, r_st, mask, chunks,
                scale):
    for cols, size in chunks:
      x = src_ref[r_ld, h + src_off, cols]
      _compat.pltriton.store(dst_ref.at[r_st, h, cols],
                             stored(x, dst_ref, scale),
                             mask=full_mask(mask, size))

  def rotate_head(src_ref, dst_ref, h, src_off, rows_ld, rows_st, mask,
                  scale=None):
    """Reads head h (+ src_off) of the tile's tokens from src, writes it
    rotated to head h of the dst rows."""
    r_ld, r_st = rows_ld[:, None], rows_st[:, None]
    for c1, c2, cos, sin, size in trig:
      x1 = src_ref[r_ld, h + src_off, c1].astype(jnp.float32)
      x2 = src_ref[r_ld, h + src_off, c2].astype(jnp.float32)
      m = full_mask(mask, size)
      _compat.pltriton.store(dst_ref.at[r_st, h, c1],
                             stored(x1 * cos - x2 * sin, dst_ref, scale),
                             mask=m)
      _compat.pltriton.store(dst_ref.at[r_st, h, c2],
                             stored(x2 * cos + x1 * sin, dst_ref, scale),
                             mask=m)
    copy_cols(src_ref, dst_ref, h, src_off, r_ld, r_st, mask,
              [((s + jnp.arange(n, dtype=jnp.int32))[None, :], n)
               for s, n in pass_chunks], scale)

  def copy_head(src_ref, dst_ref, h, src_off, rows_ld, rows_st, mask, scale):
    copy_cols(src_ref, dst_ref, h, src_off, rows_ld[:, None], rows_st[:, None],
              mask, call, scale)

  if table_kind is None:
    k_rows = k_rows_ref[tok_ld]
    v_rows = v_rows_ref[tok_ld]
  else:
    k_rows, v_rows = _table_rows(table_ref, pos_ref[tok_ld], bi_ref[tok_ld],
                                 table_kind, page_size, num_rows)

  def kv_head(h):
    k_ok = valid & (k_rows < num_rows)
    v_ok = valid & (v_rows < num_rows)
    k_st = jnp.where(k_ok, k_rows, num_rows)
    v_st = jnp.where(v_ok, v_rows, num_rows)
    if rotate:
      rotate_head(k_ref, k_pool_ref, h, k_off, tok_ld, k_st, k_ok, k_scale)
    else:
      copy_head(k_ref, k_pool_ref, h, k_off, tok_ld, k_st, k_ok, k_scale)
    copy_head(v_ref, v_pool_ref, h, v_off, tok_ld, v_st, v_ok, v_scale)

  if one_head:
    # Program j owns q head j (j < num_qo_heads) or kv head j - num_qo_heads:
    # the most programs, one short dependency chain each (small batches).
    if has_q:
      @pl.when(j < num_qo_heads)
      def _():
        rotate_head(q_ref, q_out_ref, j, 0, tok_ld, tok_st, valid)

    @pl.when(j >= num_qo_heads)
    def _():
      kv_head(j - num_qo_heads)
    return

  if has_q:
    hq_per = num_qo_heads // num_splits

    def q_body(hh, carry):
      rotate_head(q_ref, q_out_ref, j * hq_per + hh, 0, tok_ld, tok_st, valid)
      return carry

    _loop(hq_per, q_body, unroll)

  hkv_per = num_kv_heads // num_splits

  def kv_body(hh, carry):
    kv_head(j * hkv_per + hh)
    return carry

  _loop(hkv_per, kv_body, unroll)


def _table_rows(table_ref, p, b, table_kind, page_size, num_rows):
  """Flat K and V pool rows of the tile's tokens, from the page table
  (`reference.append_rows`'s rule, computed in the kernel: no separate XLA
  gather before the launch). Out-of-table tokens get `num_rows` (skipped)."""
  batch_size, max_pages = table_ref.shape[0], table_ref.shape[-1]
  num_pages = num_rows // page_size
  block = p // page_size
  ok = (b >= 0) & (b < batch_size) & (p >= 0) & (block < max_pages)
  bc = jnp.clip(b, 0, batch_size - 1)
  kc = jnp.clip(block, 0, max_pages - 1)
  if table_kind == "split":
    k_page = table_ref[bc, jnp.zeros_like(bc), kc]
    v_page = table_ref[bc, jnp.ones_like(bc), kc]
  else:
    page = table_ref[bc, kc]
    if table_kind == "flashinfer":  # [n, 2, ...] cache seen as 2n pages
      k_page = jnp.where(page >= 0, 2 * page, -1)
      v_page = jnp.where(page >= 0, 2 * page + 1, -1)
    else:  # shared
      k_page = v_page = page
  offset = p % page_size

  def rows(page):
    good = ok & (page >= 0) & (page < num_pages)
    return jnp.where(good, page * page_size + offset, num_rows)
  return rows(k_page), rows(v_page)


TABLE_KINDS = rope_append_mgpu.TABLE_KINDS


def _loop(n: int, body, unroll: bool):
  """`body(i, None)` for i < n: a Python loop when unrolled (the Triton
  lowering rejects `fori_loop(unroll=...)`), else a `fori_loop`."""
  if unroll:
    for i in range(n):
      body(i, None)
  else:
    lax.fori_loop(0, n, body, None)


def check_supported(num_qo_heads: int, num_kv_heads: int,
                    config: TritonConfig) -> None:
  """Raises NotImplementedError for head splits this kernel cannot run
  (the config's own fields are checked on construction)."""
  if not config.one_head and (num_kv_heads % config.num_splits
                              or num_qo_heads % config.num_splits):
    raise NotImplementedError(
        f"num_splits={config.num_splits} must divide {num_qo_heads=} and "
        f"{num_kv_heads=}")


def _rope_append_call(q, k, v, positions, k_rows, v_rows, inv_freq, k_pool,
                      v_pool, *, interleaved, config, interpret, qkv=None,
                      paged=None, scales=None):
  """`qkv` given (q, k, v None): one [num_tokens, num_qo_heads + 2 *
  num_kv_heads, head_dim] input, `q` then stands for its shape only.
  `paged=(batch_indices, page_table, table_kind)` given (k_rows, v_rows None):
  the kernel computes the rows from the table itself."""
  fused = qkv is not None
  if fused:
    q, num_qo_heads_fused = None, qkv.shape[1] - 2 * k_pool.shape[2]
    k = jax.ShapeDtypeStruct((qkv.shape[0], k_pool.shape[2], qkv.shape[2]),
                             qkv.dtype)
  num_tokens, num_kv_heads, head_dim = k.shape
  num_pages, page_size = k_pool.shape[:2]
  num_rows = num_pages * page_size
  has_q = q is not None or fused
  rotate = inv_freq is not None
  same_pool = v_pool is None
  num_qo_heads = (num_qo_heads_fused if fused else q.shape[1]) if has_q else 0
  half = inv_freq.shape[0] if rotate else 0
  check_supported(num_qo_heads, num_kv_heads, config)

  flat_k = k_pool.reshape(num_rows, num_kv_heads, head_dim)
  table_kind, inputs = rope_append_mgpu.index_inputs(
      positions, k_rows, v_rows, paged, inv_freq, scales)
  if fused:
    inputs += [qkv, flat_k]
  else:
    if has_q:
      inputs.append(q)
    inputs += [k, v, flat_k]
  out_shape = []
  if has_q:
    out_shape.append(jax.ShapeDtypeStruct(
        (num_tokens, num_qo_heads, head_dim),
        qkv.dtype if fused else q.dtype))
  out_shape.append(jax.ShapeDtypeStruct(flat_k.shape, flat_k.dtype))
  aliases = {len(inputs) - 1: len(out_shape) - 1}
  if not same_pool:
    flat_v = v_pool.reshape(num_rows, num_kv_heads, head_dim)
    inputs.append(flat_v)
    out_shape.append(jax.ShapeDtypeStruct(flat_v.shape, flat_v.dtype))
    aliases[len(inputs) - 1] = len(out_shape) - 1

  num_tiles = -(-num_tokens // config.block_tokens)
  kernel = functools.partial(
      _rope_append_kernel, num_tokens=num_tokens, num_rows=num_rows,
      num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
      head_dim=head_dim, half=half, block_tokens=config.block_tokens,
      num_splits=config.num_splits, one_head=config.one_head,
      interleaved=interleaved, rotate=rotate,
      has_q=has_q, same_pool=same_pool, fused=fused, unroll=config.unroll,
      table_kind=table_kind, page_size=page_size,
      has_scales=scales is not None)
  head_programs = (num_qo_heads + num_kv_heads if config.one_head
                   else config.num_splits)
  name = (f"rope_append{'_qkv' if fused else ''}_bt{config.block_tokens}"
          f"_s{head_programs}{'_u' if config.unroll else ''}"
          f"_{'gptj' if interleaved else 'neox'}{'' if rotate else '_norope'}")
  with _compat.suppress_triton_deprecation():
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(num_tiles, head_programs),
        input_output_aliases=aliases,
        compiler_params=_compat.triton_params(
            num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=name,
    )(*inputs)
  outs = list(outs)
  q_out = outs.pop(0) if has_q else None
  k_pool = outs.pop(0).reshape(num_pages, page_size, num_kv_heads, head_dim)
  if not same_pool:
    v_pool = outs.pop(0).reshape(num_pages, page_size, num_kv_heads, head_dim)
  return q_out, k_pool, v_pool


def rope_append(
    q,          # [num_tokens, num_qo_heads, head_dim] | None (append only)
    k,          # [num_tokens, num_kv_heads, head_dim]
    v,          # [num_tokens, num_kv_heads, head_dim]
    positions,  # i32[num_tokens]
    k_rows,     # i32[num_tokens], flat K row per token; >= num_rows = skip
    v_rows,     # i32[num_tokens], flat V row per token; >= num_rows = skip
    inv_freq,   # f32[rotary_dim // 2] | None (no rotation)
    k_pool,     # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool,     # [num_pages, page_size, num_kv_heads, head_dim] | None (= k_pool)
    *,
    interleaved: bool = False,
    config: "TritonConfig | rope_append_mgpu.Config | None" = None,
    interpret: bool = False,
    paged=None,
    k_scale=None,  # f32[]: FP8 pools
    v_scale=None,  # f32[]: FP8 pools
):
  """Rotates q and k (if `inv_freq`), writes k and v rows into the pool(s).

  Returns `(q_rotated or None, k_pool, v_pool or None)`. The pools are aliased
  to the outputs; call inside a jit that donates them to update in place.
  Not jitted here, so the aliasing composes with the caller's donation.

  Args:
    paged: `(batch_indices i32[num_tokens], page_table, table_kind)` instead
      of `k_rows` / `v_rows` (pass None for those): the kernel looks the rows
      up itself (no XLA gather before the launch). `table_kind` "shared"
      (`i32[batch, max_pages]`, K and V pools alike), "split" (`i32[batch,
      2, max_pages]`, TensorRT-LLM), "flashinfer" (shared table into a
      `[n, 2, ...]` cache passed as the `[2n, ...]` pool: K page `2t`, V
      page `2t + 1`).
    k_scale, v_scale: f32 scalars (may be traced) for float8_e4m3fn pools:
      rows store `clip(x * (1 / scale), -448, 448)` with x the rotated K (f32) or
      V, as `pkvattn._kv.quantize`.
    config: a `TritonConfig` (this module's Pallas-Triton kernel) or a
      `rope_append_mgpu.Config` (the Mosaic-GPU kernel, Hopper); the
      config's `backend` names the kernel. None = the one
      `dispatch.rope_append` chooses on `dispatch.current_gpu`
      (`interpret` asks for the Triton kernel).

  Raises:
    ValueError: an unknown `table_kind`; a `rope_append_mgpu.Config` in
      interpret mode or for a case its kernel lacks
      (`rope_append_mgpu.supports`).
    NotImplementedError: a config whose `num_splits` does not divide the head
      counts.
  """
  scales = _scales(k_scale, v_scale)
  if config is None:
    config = _choose(
        k.shape[0], 0 if q is None else q.shape[1], k.shape[1],
        head_dim=k.shape[2], inv_freq=inv_freq, interleaved=interleaved,
        dtype=k.dtype if q is None else q.dtype,
        # v of another dtype than k: not one dtype, the Triton kernel.
        kv_dtype=k.dtype if v.dtype == k.dtype else v.dtype,
        pool_dtype=k_pool.dtype, scales=scales, interpret=interpret)
  if k.shape[0] == 0:
    return q, k_pool, v_pool
  return _launch(q, k, v, positions, k_rows, v_rows, inv_freq, k_pool,
                 v_pool, interleaved=interleaved, config=config,
                 interpret=interpret, paged=paged, scales=scales)


def _choose(num_tokens: int, num_qo_heads: int, num_kv_heads: int, *,
            head_dim: int, inv_freq, interleaved: bool, dtype, kv_dtype,
            pool_dtype, scales, interpret: bool):
  """The config `dispatch.rope_append` chooses for a call."""
  return dispatch.rope_append(
      gpu=dispatch.current_gpu(interpret), dtype=dtype, kv_dtype=kv_dtype,
      pool_dtype=pool_dtype, head_dim=head_dim, num_qo_heads=num_qo_heads,
      num_kv_heads=num_kv_heads, num_tokens=num_tokens,
      rotary_dim=0 if inv_freq is None else 2 * inv_freq.shape[0],
      interleaved=interleaved, has_scales=scales is not None).config


def _launch(q, k, v, positions, k_rows, v_rows, inv_freq, k_pool, v_pool, *,
            interleaved, config, interpret, paged=None, scales=None,
            qkv=None):
  """The kernel `config.backend` names (see `rope_append`)."""
  if config.backend == "mosaic":
    if interpret:
      raise ValueError(
          "Invalid config for interpret mode: the mosaic backend "
          "(rope_append_mgpu.Config) needs a Hopper GPU (Mosaic GPU has no "
          "interpret mode), got interpret=True")
    return rope_append_mgpu.rope_append_mgpu(
        q, k, v, positions, k_rows, v_rows, inv_freq, k_pool, v_pool,
        interleaved=interleaved, config=config, qkv=qkv, paged=paged,
        scales=scales)
  return _rope_append_call(q, k, v, positions, k_rows, v_rows, inv_freq,
                           k_pool, v_pool, interleaved=interleaved,
                           config=config, interpret=interpret, paged=paged,
                           scales=scales, qkv=qkv)


def _scales(k_scale, v_scale):
  """`f32[2]` of the FP8 scales, or None."""
  if k_scale is None:
    return None
  return jnp.stack([jnp.asarray(k_scale, jnp.float32).reshape(()),
                    jnp.asarray(v_scale, jnp.float32).reshape(())])


def rope_append_qkv(
    qkv,        # [num_tokens, (num_qo_heads + 2 * num_kv_heads) * head_dim]
    positions,  # i32[num_tokens]
    k_rows,     # i32[num_tokens]
    v_rows,     # i32[num_tokens]
    inv_freq,   # f32[rotary_dim // 2]
    k_pool,     # [num_pages, page_size, num_kv_heads, head_dim]
    v_pool,     # [num_pages, page_size, num_kv_heads, head_dim] | None (= k_pool)
    *,
    interleaved: bool = False,
    config: "TritonConfig | rope_append_mgpu.Config | None" = None,
    interpret: bool = False,
    paged=None,
    k_scale=None,  # f32[]: FP8 pools
    v_scale=None,  # f32[]: FP8 pools
):
  """`rope_append` on TensorRT-LLM's fused qkv layout (q heads, k heads, v heads).

  The [num_tokens, heads * head_dim] -> [num_tokens, heads, head_dim] reshape is
  free, and the kernel reads the three parts of each row in place (slicing q,
  k, v out first would copy them). Returns `(q_rotated [num_tokens,
  num_qo_heads, head_dim], k_pool, v_pool or None)`. `paged`, `k_scale` and
  `v_scale` as in `rope_append`.
  """
  num_tokens = qkv.shape[0]
  num_kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
  heads = qkv.shape[1] // head_dim
  num_qo_heads = heads - 2 * num_kv_heads
  qkv = qkv.reshape(num_tokens, heads, head_dim)
  scales = _scales(k_scale, v_scale)
  if config is None:
    config = _choose(
        num_tokens, num_qo_heads, num_kv_heads, head_dim=head_dim,
        inv_freq=inv_freq, interleaved=interleaved, dtype=qkv.dtype,
        kv_dtype=qkv.dtype, pool_dtype=k_pool.dtype, scales=scales,
        interpret=interpret)
  if num_tokens == 0:
    return qkv[:, :num_qo_heads], k_pool, v_pool
  q_shape = jax.ShapeDtypeStruct((num_tokens, num_qo_heads, head_dim),
                                 qkv.dtype)
  return _launch(q_shape, None, None, positions, k_rows, v_rows, inv_freq,
                 k_pool, v_pool, interleaved=interleaved, config=config,
                 interpret=interpret, paged=paged, scales=scales, qkv=qkv)
