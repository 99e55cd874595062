"""Forced backends and kernel configs: the one place a benchmark reaches
past the public API.

Every benchmark's default arm ("pkvattn") calls only `pkvattn.*`, so the
same script times any build of the package. The arms here (`--backend` of
`decode.py`, `prefill.py`, `rope_append.py`) build a kernel config
explicitly and call the kernel entry points; they follow the kernels'
config classes, and only this module has to change when those do.

Each `*_arms(name, ...)` returns `[(label, fn)]` (a name may stand for a
grid of several configs), with `fn` unjitted and in the public call's form:

* decode: `fn(q, kv_cache, page_table, kv_lens, k_scale=None,
  v_scale=None) -> out [batch_size, num_qo_heads, head_dim]`;
* prefill: `fn(q, kv_cache, page_table, q_indptr, kv_lens, k_scale=None,
  v_scale=None) -> out [num_tokens, num_qo_heads, head_dim]`, causal;
* rope + append: `fn(q, k, v, batch_indices, positions, kv_cache,
  page_table, k_scale=None, v_scale=None) -> (q_rot, kv_cache)`, kv_cache
  a `(k_pages, v_pages)` pair with one shared page table, NeoX halves, the
  caller's `inv_freq` (`pkvattn.RopeConfig.inv_freq(head_dim)`).

kv_cache is any of pkvattn's formats (`pkvattn._kv.make_view`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

DECODE_ARMS = {
    "triton": "the Pallas-Triton decode kernel's default config",
    "mma": "the per-warp Mosaic-GPU decode kernel's default config (Hopper)",
    "triton-grid": "the Triton kernel over a tiling grid (32 / 64 / 128 "
                   "tokens per step, warps and stages, one or two kv heads "
                   "per program; half and twice the splits; page ids "
                   "loaded a step ahead or not)",
    "mma-grid": "the per-warp kernel with twice / half the splits and "
                "1 / 2 / 4 MMA tiles per step",
}
PREFILL_ARMS = {
    "triton": "the Pallas-Triton prefill kernel's default config",
    "mosaic": "the Mosaic-GPU prefill kernel, unpacked (Hopper)",
    "per-sm": "the default with one CTA per SM (persistent=True)",
    "per-item": "the default with one CTA per (head, tile) item",
    "short-launch": "sequences of 2-8 new tokens in a Pallas-Triton short "
                    "launch instead of the decode kernel",
    "fp8-in-kernel": "FP8 pages read in the kernel (fp8_pages='kernel')",
    "fp8-dequantize": "FP8 pages gathered into a bf16 pool first "
                      "(fp8_pages='dequantize')",
    "triton-fp8-in-kernel": "the Triton kernel reading FP8 pages",
}
ROPE_ARMS = {
    "triton": "the Pallas-Triton RoPE + append kernel's default config",
    "mosaic": "the Mosaic-GPU RoPE + append kernel's default config "
              "(Hopper)",
    "mosaic-chunks": "the Mosaic-GPU kernel with 4 / 8 / 16-byte chunks "
                     "and with one head per program",
}


def _check(name, arms):
  if name not in arms:
    raise ValueError(f"--backend: expected one of {sorted(arms)}, got "
                     f"{name!r}")


# --------------------------------------------------------------------------
# Decode.
# --------------------------------------------------------------------------

def _decode_call(cfg, head_dim):
  from pkvattn import _kv  # pylint: disable=import-outside-toplevel
  from pkvattn.pallas_kernels import paged_decode as pd  # pylint: disable=import-outside-toplevel

  def f(q, kv_cache, page_table, kv_lens, k_scale=None, v_scale=None):
    v = _kv.make_view(kv_cache, page_table)
    return pd.paged_decode(q, v.k_pool, v.v_pool, v.k_table, v.v_table,
                           kv_lens, sm_scale=head_dim ** -0.5, config=cfg,
                           k_scale=k_scale, v_scale=v_scale)[0]
  return f


def decode_arms(name: str, *, batch_size: int, num_qo_heads: int,
                num_kv_heads: int, head_dim: int, page_size: int,
                max_pages: int, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16):
  """`[(label, fn)]` of decode arm `name` (`DECODE_ARMS`) for one shape."""
  _check(name, DECODE_ARMS)
  from pkvattn.pallas_kernels import dispatch  # pylint: disable=import-outside-toplevel
  backend = "mosaic_mma" if name.startswith("mma") else "triton"
  base = dispatch.decode(
      gpu=dispatch.current_gpu(), batch_size=batch_size,
      num_kv_heads=num_kv_heads, page_size=page_size, max_pages=max_pages,
      head_dim=head_dim, group_size=num_qo_heads // num_kv_heads,
      dtype=dtype, kv_dtype=kv_dtype, backend=backend).config
  configs = [(name, base)]
  R = dataclasses.replace
  if name == "triton-grid":
    seen = {base}
    packs = [1] + ([2] if num_kv_heads % 2 == 0 and 2 * head_dim <= 256
                   else [])
    for tokens in (32, 64, 128):
      if tokens < page_size or (head_dim > 128 and tokens > 64):
        continue
      ppb = tokens // page_size
      for pack in packs:
        for warps, stages in ((2, 1), (2, 2), (2, 3), (4, 1), (4, 2),
                              (4, 3), (4, 4)):
          c = R(base, pages_per_block=ppb, num_warps=warps,
                num_stages=stages, pack_heads=pack)
          if c not in seen:
            seen.add(c)
            configs.append((f"triton ppb{ppb} ks{base.k_splits} w{warps} "
                            f"s{stages} pk{pack}", c))
    for ks in sorted({max(1, base.k_splits // 2), base.k_splits * 2}):
      c = R(base, k_splits=ks)
      if c not in seen:
        seen.add(c)
        configs.append((f"triton ks{ks}", c))
    c = R(base, prefetch_ids=not base.prefetch_ids)
    configs.append((f"triton prefetch_ids={c.prefetch_ids}", c))
  elif name == "mma-grid":
    configs.append(("mma splits x2", R(base,
                                       k_splits=min(64, 2 * base.k_splits))))
    if base.k_splits > 1:
      configs.append(("mma splits /2", R(base, k_splits=base.k_splits // 2)))
    for tiles in (1, 2, 4):
      if tiles != base.tiles and (tiles < 4 or head_dim <= 128):
        configs.append((f"mma tiles {tiles}", R(base, tiles=tiles)))
  return [(label, _decode_call(c, head_dim)) for label, c in configs]


# --------------------------------------------------------------------------
# Prefill.
# --------------------------------------------------------------------------

def _prefill_call(cfg, head_dim, window_left):
  from pkvattn import _kv  # pylint: disable=import-outside-toplevel
  from pkvattn.pallas_kernels import paged_prefill as pp  # pylint: disable=import-outside-toplevel

  def f(q, kv_cache, page_table, q_indptr, kv_lens, k_scale=None,
        v_scale=None):
    v = _kv.make_view(kv_cache, page_table)
    return pp.paged_prefill(q, v.k_pool, v.v_pool, v.k_table, v.v_table,
                            q_indptr, kv_lens, None, causal=True,
                            sm_scale=head_dim ** -0.5,
                            window_left=window_left, config=cfg,
                            k_scale=k_scale, v_scale=v_scale)[0]
  return f


def prefill_arms(name: str, *, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, num_tokens: int,
                 batch_size: int, window_left: int = -1,
                 dtype=jnp.bfloat16):
  """`[(label, fn)]` of prefill arm `name` (`PREFILL_ARMS`) for one call
  shape; empty where the arm does not differ from the default there."""
  _check(name, PREFILL_ARMS)
  from pkvattn.pallas_kernels import dispatch  # pylint: disable=import-outside-toplevel

  def choose(backend=None):
    return dispatch.prefill(
        gpu=dispatch.current_gpu(), dtype=dtype, kv_dtype=dtype,
        head_dim=head_dim, group_size=num_qo_heads // num_kv_heads,
        page_size=page_size, num_tokens=num_tokens, batch_size=batch_size,
        window_left=window_left, backend=backend).config

  default = choose()
  R = dataclasses.replace
  if name.startswith("triton"):
    cfg = choose("triton")
    if name == "triton-fp8-in-kernel":
      cfg = R(cfg, fp8_pages="kernel")
  elif name == "mosaic":
    cfg = choose("mosaic")
  elif name in ("per-sm", "per-item"):
    if default.backend != "mosaic":
      return []
    cfg = R(default, persistent=name == "per-sm")
  elif name == "short-launch":
    longest = max(default.short_block_q, default.decode_rows_per_seq)
    if longest <= 1:
      return []
    cfg = R(default, short_block_q=longest, decode_rows_per_seq=1)
  else:  # fp8-in-kernel, fp8-dequantize
    cfg = R(default, fp8_pages=name.split("-", 1)[1].replace(
        "in-kernel", "kernel"))
  return [(name, _prefill_call(cfg, head_dim, window_left))]


# --------------------------------------------------------------------------
# RoPE + append.
# --------------------------------------------------------------------------

def _rope_call(cfg, inv_freq):
  from pkvattn.pallas_kernels import rope_append as ra  # pylint: disable=import-outside-toplevel
  inv = jnp.asarray(inv_freq, jnp.float32)

  def f(q, k, v, batch_indices, positions, kv_cache, page_table,
        k_scale=None, v_scale=None):
    k_pool, v_pool = kv_cache
    scales = ({} if k_scale is None
              else dict(k_scale=k_scale, v_scale=v_scale))
    q, kp, vp = ra.rope_append(
        q, k, v, positions, None, None, inv, k_pool, v_pool,
        interleaved=False, paged=(batch_indices, page_table, "shared"),
        config=cfg, **scales)
    return q, (kp, vp)
  return f


def rope_append_arms(name: str, *, num_tokens: int, num_qo_heads: int,
                     num_kv_heads: int, inv_freq):
  """`[(label, fn)]` of RoPE + append arm `name` (`ROPE_ARMS`);
  `inv_freq`: `f32[rotary_dim / 2]` RoPE frequencies."""
  _check(name, ROPE_ARMS)
  from pkvattn.pallas_kernels import rope_append_mgpu as rm  # pylint: disable=import-outside-toplevel
  if name == "triton":
    # The Triton rule is the one every GPU but Hopper takes (Ampere here).
    from pkvattn.pallas_kernels import dispatch  # pylint: disable=import-outside-toplevel
    choice = dispatch.rope_append(
        gpu=dispatch.AMPERE, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
        pool_dtype=jnp.bfloat16, head_dim=2 * len(inv_freq),
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        num_tokens=num_tokens)
    cfgs = [("triton", choice.config)]
  else:
    base = rm.Config.default_for(num_tokens, num_qo_heads, num_kv_heads)
    cfgs = [("mosaic", base)]
    if name == "mosaic-chunks":
      cfgs = [(f"mosaic chunk{c}", dataclasses.replace(base, chunk_bytes=c))
              for c in (4, 8, 16)]
      cfgs.append(("mosaic one head", rm.Config(one_head=True,
                                                chunk_bytes=4)))
  return [(label, _rope_call(c, inv_freq)) for label, c in cfgs]
