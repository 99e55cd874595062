"""FP8 pages in the Triton kernels: configs side by side, Nsight-ready children.

Run on a GPU:  `python -m bench.fp8_decode_diag [--out DIR] [--sweep NAME] [--fast]`

Decode: for Llama-3-8B shapes (32 / 8 / 128 heads), the Llama-3.2-1B shape
(32 / 8 / 64) and SmolLM2's (9 / 3 / 64), times `paged_decode`'s Triton
kernel on bf16 pages (default config) and on FP8 pages: the FP8 default
config (`default`), then the bf16 default's tiling with V converted in its
loaded layout (`loaded`), where Triton puts it (`operand`), both tiles by
inline PTX (`asm`) and both read as 16-bit column pairs (`pairs`), after
checking every FP8 variant against the f32 reference on the same pages
(`--sweep tiles` adds tiling variants around the bf16 tiling with `loaded`,
`--sweep asm` around it with `asm`, `--sweep stages` the FP8 default's
pipeline depth, `--sweep splits` its split count, `--sweep pack` tilings
around the FP8 default where it packs two head_dim-64 kv heads per program,
`paged_decode.Config.pack_heads`, `--sweep grid` conversion x stages x
splits x page-id prefetch around the FP8 default, `grid_variants` (run when
the default was the inline-PTX rule), `--sweep half` that default with
half-size steps and more splits, `--sweep pairs` the column-pair default
beside the inline-PTX rule it replaced, `pairs_variants`; `--fast` skips the
per-call timing). A sweep writes
`fp8_decode_diag_<sweep>_sweep_<device>.json`.
Times are per call (`_timing.time_fn`) and GPU kernel time from a profiler
trace (`_timing.device_kernel_ms`); `tbps` counts the K/V bytes read.

Prefill (B=4 S=4096 page 16, causal, Llama-3-8B heads): the default path on
bf16 pages (Mosaic GPU on Hopper), the Triton kernel on bf16 and on FP8
pages, and the Mosaic-GPU kernel on FP8 pages (128-key steps with one FP8
staging stage, 64-key steps with two); TFLOP/s by kernel time. (The H100 file of 2026-11-25 also has the
prefill kernel with V converted in its loaded layout, `fp8_loaded`: slower
there, so prefill keeps Triton's placement.)

RoPE + append (65,536 tokens, default config) into bf16 and FP8 pools by
kernel time, against the copy roofs, with the bytes each moves (q, k, v read
in bf16; q written in bf16, K/V in the pool's dtype).

`--child fp8|bf16|fp8op` runs one decode call (the spec from $DIAG_SPEC),
for `ncu -k regex:paged_decode`. (Its first version, with module-level
switches instead of `fp8_convert`, measured the f16 / bf16 dot choice too:
`results/fp8_decode_diag_*.json`; `results/fp8_decode_ab.json` is an older
A/B whose switch was read from a jit cache and may not have taken effect.)
"""


from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from bench import _timing
from bench import bench_fp8
import pkvattn
from pkvattn import _kv
from pkvattn.pallas_kernels import paged_decode as kernel
from pkvattn.pallas_kernels import paged_prefill as prefill_kernel
from pkvattn.pallas_kernels import paged_prefill_mgpu as mgpu
from pkvattn.pallas_kernels import reference

SPECS = {
    # name: (num_qo_heads, num_kv_heads, head_dim, batch, seq_len, page_size)
    "llama3_8b_b64_s4096_p16": (32, 8, 128, 64, 4096, 16),
    "llama3_8b_b64_s4096_p64": (32, 8, 128, 64, 4096, 64),
    "llama3_8b_b8_s16384_p16": (32, 8, 128, 8, 16384, 16),
    "llama3_8b_b256_s1024_p16": (32, 8, 128, 256, 1024, 16),
    "llama1b_b256_s1024_p16": (32, 8, 64, 256, 1024, 16),
    "llama1b_b64_s4096_p16": (32, 8, 64, 64, 4096, 16),
    "llama1b_b8_s16384_p16": (32, 8, 64, 8, 16384, 16),
    "smollm2_b256_s1024_p16": (9, 3, 64, 256, 1024, 16),
    "smollm2_b64_s4096_p16": (9, 3, 64, 64, 4096, 16),
    "gemma3_270m_b64_s4096_p16": (4, 1, 256, 64, 4096, 16),
    "gemma3_270m_b256_s1024_p16": (4, 1, 256, 256, 1024, 16),
}
K_SCALE, V_SCALE = 4 / 448, 3 / 448


def _inputs(spec, seed=0):
  hq, hkv, d, b, s, ps = spec
  pages = b * s // ps
  keys = jax.random.split(jax.random.key(seed), 4)
  k = jax.random.normal(keys[0], (pages, ps, hkv, d), jnp.bfloat16)
  v = jax.random.normal(keys[1], (pages, ps, hkv, d), jnp.bfloat16)
  table = jax.random.permutation(keys[2], pages).astype(jnp.int32).reshape(
      b, s // ps)
  q = jax.random.normal(keys[3], (b, hq, d), jnp.bfloat16)
  lens = jnp.full((b,), s, jnp.int32)
  return q, k, v, table, lens


def variants(base: kernel.Config, fp8_default: kernel.Config, page_size: int,
             sweep: str, shape: dict | None = None):
  """name -> Config of the FP8 variants tried on one spec: the FP8 default,
  then the bf16 default's tiling with each conversion, then a sweep's."""
  out = {"default": fp8_default, "loaded": base,
         "operand": dataclasses.replace(base, fp8_convert="operand"),
         "asm": dataclasses.replace(base, fp8_convert="asm"),
         "pairs": dataclasses.replace(base, fp8_convert="pairs")}
  if sweep == "splits":
    # More programs per SM for the 2-warp FP8 default (its registers allow
    # 6 per SM; at k_splits=1 the Llama-3-8B shapes give about 4).
    d = fp8_default
    return {"default": d, "loaded": base,
            **{f"default_ks_x{n}": dataclasses.replace(
                d, k_splits=min(64, n * d.k_splits)) for n in (2, 4, 8)},
            "default_s2_ks_x4": dataclasses.replace(
                d, num_stages=2, k_splits=min(64, 4 * d.k_splits)),
            "default_s4_ks_x4": dataclasses.replace(
                d, num_stages=4, k_splits=min(64, 4 * d.k_splits))}
  if sweep == "pairs":
    return {"default": fp8_default, "loaded": base,
            **pairs_variants(fp8_default, page_size, shape["batch_size"],
                             shape["num_kv_heads"], shape["max_pages"])}
  if sweep == "grid":
    return {"default": fp8_default, **grid_variants(fp8_default, page_size)}
  if sweep == "half":
    # Half-size steps with more splits around the FP8 default.
    d = fp8_default
    out = {"default": fp8_default, "loaded": base,
           "ks_x4": dataclasses.replace(d, k_splits=min(64, 4 * d.k_splits))}
    if d.pages_per_block > 1:
      for mult in (2, 4):
        out[f"half_ks_x{mult}"] = dataclasses.replace(
            d, pages_per_block=d.pages_per_block // 2,
            k_splits=min(64, mult * d.k_splits), prefetch_ids=False)
        out[f"half_ks_x{mult}_pf"] = dataclasses.replace(
            out[f"half_ks_x{mult}"], prefetch_ids=True)
    return out
  if sweep == "stages":
    return {"default": fp8_default, "loaded": base,
            **{f"default_s{n}": dataclasses.replace(fp8_default, num_stages=n)
               for n in (2, 4, 5)}}
  if sweep == "pack" and fp8_default.pack_heads > 1:
    d = fp8_default
    half = d.pages_per_block // 2
    out.update({
        "p_loaded": dataclasses.replace(d, fp8_convert="loaded"),
        "p_w4": dataclasses.replace(d, num_warps=4),
        "p_loaded_w4": dataclasses.replace(d, fp8_convert="loaded",
                                           num_warps=4),
        "p_s4": dataclasses.replace(d, num_stages=4),
        "p_ks_x2": dataclasses.replace(d, k_splits=2 * d.k_splits),
        "p_loaded_w4_ks_x2": dataclasses.replace(
            d, fp8_convert="loaded", num_warps=4, k_splits=2 * d.k_splits)})
    if d.pages_per_block * page_size * 2 <= 128:
      x2 = dataclasses.replace(d, pages_per_block=2 * d.pages_per_block,
                               k_splits=max(1, d.k_splits // 2))
      out["p_ppb_x2"] = x2
      out["p_ppb_x2_w4"] = dataclasses.replace(x2, num_warps=4)
      out["p_ppb_x2_loaded_w4"] = dataclasses.replace(
          x2, fp8_convert="loaded", num_warps=4)
    if half:
      out["p_ppb_half"] = dataclasses.replace(d, pages_per_block=half,
                                              k_splits=2 * d.k_splits)
  if sweep == "asm":
    a = dataclasses.replace(base, fp8_convert="asm")
    out = {"default": fp8_default, "loaded": base, "asm": a,
           "asm_s2": dataclasses.replace(a, num_stages=2),
           "asm_s4": dataclasses.replace(a, num_stages=4),
           "asm_w8": dataclasses.replace(a, num_warps=8),
           "asm_w2": dataclasses.replace(a, num_warps=2),
           "asm_w2_s2": dataclasses.replace(a, num_warps=2, num_stages=2),
           "asm_ks_x2": dataclasses.replace(a, k_splits=2 * base.k_splits),
           "asm_w2_ks_x2": dataclasses.replace(a, num_warps=2,
                                               k_splits=2 * base.k_splits)}
    if base.pages_per_block * page_size * 2 <= 256:
      out["asm_ppb_x2"] = dataclasses.replace(
          a, pages_per_block=2 * base.pages_per_block,
          k_splits=max(1, base.k_splits // 2))
      out["asm_ppb_x2_w8"] = dataclasses.replace(
          out["asm_ppb_x2"], num_warps=8)
    if base.pages_per_block > 1:
      out["asm_ppb_half"] = dataclasses.replace(
          a, pages_per_block=base.pages_per_block // 2,
          k_splits=2 * base.k_splits)
      out["asm_w2_ppb_half"] = dataclasses.replace(
          out["asm_ppb_half"], num_warps=2)
      out["asm_w2_ppb_half_ks1"] = dataclasses.replace(
          out["asm_ppb_half"], num_warps=2, k_splits=base.k_splits)
  if sweep == "tiles":
    out["s2"] = dataclasses.replace(base, num_stages=2)
    out["s4"] = dataclasses.replace(base, num_stages=4)
    out["w2"] = dataclasses.replace(base, num_warps=2)
    out["w8"] = dataclasses.replace(base, num_warps=8)
    out["w8_s2"] = dataclasses.replace(base, num_warps=8, num_stages=2)
    out["w8_s4"] = dataclasses.replace(base, num_warps=8, num_stages=4)
    if base.pages_per_block * page_size * 2 <= 256:
      out["w8_ppb_x2"] = dataclasses.replace(
          base, num_warps=8, pages_per_block=2 * base.pages_per_block,
          k_splits=max(1, base.k_splits // 2))
    if base.pages_per_block > 1:
      out["w2_ppb_half"] = dataclasses.replace(
          base, num_warps=2, pages_per_block=base.pages_per_block // 2,
          k_splits=2 * base.k_splits)
    out["ks_x2"] = dataclasses.replace(base, k_splits=2 * base.k_splits)
    if base.pages_per_block * page_size * 2 <= 256:
      out["ppb_x2"] = dataclasses.replace(
          base, pages_per_block=2 * base.pages_per_block,
          k_splits=max(1, base.k_splits // 2))
    if base.pages_per_block > 1:
      out["ppb_half"] = dataclasses.replace(
          base, pages_per_block=base.pages_per_block // 2,
          k_splits=2 * base.k_splits)
  return out


def pairs_variants(d: kernel.Config, page_size: int, batch_size: int,
                   num_kv_heads: int, max_pages: int):
  """name -> Config around `d`, an FP8 default that reads column pairs
  (`fp8_convert="pairs"`; its kv heads per program kept): the earlier
  inline-PTX rule (`asm_rule`: both tiles converted after Triton's layout
  change, 64-token steps, splits for 2 programs per SM, page ids a step
  ahead with <= 4 programs per SM) and its `mul` twin, then `d` with half /
  twice the step (splits scaled to match), page ids at each step or ahead,
  4 warps, 4 stages, twice the splits."""
  programs = batch_size * num_kv_heads // d.pack_heads
  ppb = max(1, 64 // page_size)
  ks = kernel._default_splits(programs, max_pages, ppb, kernel._NUM_SMS)
  rule = dataclasses.replace(
      d, fp8_convert="asm", pages_per_block=ppb, k_splits=ks,
      prefetch_ids=programs * ks <= 4 * kernel._NUM_SMS)
  out = {"asm_rule": rule,
         "mul_rule": dataclasses.replace(rule, fp8_convert="mul")}
  if d.pages_per_block > 1:
    out["half_step"] = dataclasses.replace(
        d, pages_per_block=d.pages_per_block // 2,
        k_splits=min(64, 2 * d.k_splits))
  if d.pages_per_block * page_size < 128:
    out["twice_step"] = dataclasses.replace(
        d, pages_per_block=2 * d.pages_per_block,
        k_splits=max(1, d.k_splits // 2))
  out["ids_flip"] = dataclasses.replace(d, prefetch_ids=not d.prefetch_ids)
  out["w4"] = dataclasses.replace(d, num_warps=4)
  out["s4"] = dataclasses.replace(d, num_stages=4)
  out["ks_x2"] = dataclasses.replace(d, k_splits=min(64, 2 * d.k_splits))
  return out


def grid_variants(d: kernel.Config, page_size: int):
  """name -> Config: a grid around `d`, an FP8 default (its kv heads per
  program kept): both tiles converted by inline PTX (`asm`), or V converted
  in its loaded layout and multiplied by its row mask (`mul`),
  on 2 warps with 3 or 4 stages, 1 / 2 / 4 times its splits, page ids at
  each step or a step ahead; then 4 warps, 2 stages with more splits, and
  half-size steps."""
  out = {}
  for conv in ("asm", "mul"):
    for stages in (3, 4):
      for mult in (1, 2, 4):
        for pf in (False, True):
          out[f"{conv}_w2_s{stages}_ks_x{mult}{'_pf' if pf else ''}"] = (
              dataclasses.replace(d, fp8_convert=conv, num_warps=2,
                                  num_stages=stages,
                                  k_splits=min(64, mult * d.k_splits),
                                  prefetch_ids=pf))
  for conv in ("asm", "mul"):
    for mult in (1, 2):
      out[f"{conv}_w4_s3_ks_x{mult}_pf"] = dataclasses.replace(
          d, fp8_convert=conv, num_warps=4, num_stages=3,
          k_splits=min(64, mult * d.k_splits), prefetch_ids=True)
  for mult in (2, 4):
    out[f"asm_w2_s2_ks_x{mult}_pf"] = dataclasses.replace(
        d, fp8_convert="asm", num_warps=2, num_stages=2,
        k_splits=min(64, mult * d.k_splits), prefetch_ids=True)
  if d.pages_per_block > 1:
    for conv in ("asm", "mul"):
      for mult in (2, 4):
        out[f"{conv}_w2_s3_half_ks_x{mult}_pf"] = dataclasses.replace(
            d, fp8_convert=conv, num_warps=2, num_stages=3,
            pages_per_block=d.pages_per_block // 2,
            k_splits=min(64, mult * d.k_splits), prefetch_ids=True)
  return out


def decode_rows(names=None, sweep="", fast=False):
  rows = []
  for name, spec in SPECS.items():
    if names and name not in names:
      continue
    hq, hkv, d, b, s, ps = spec
    q, k, v, table, lens = _inputs(spec)
    k8, v8 = _kv.quantize(k, K_SCALE), _kv.quantize(v, V_SCALE)
    sm_scale = d ** -0.5
    shape = dict(batch_size=b, num_kv_heads=hkv, page_size=ps,
                 max_pages=s // ps, head_dim=d, group_size=hq // hkv,
                 dtype=q.dtype)
    base = kernel.Config.default_for(**shape)
    fp8_default = kernel.Config.default_for(**shape,
                                            kv_dtype=jnp.float8_e4m3fn)
    # Reference on a slice of the batch (the whole one is GBs in f32).
    nb = min(b, 8)
    expected, _ = reference.paged_decode_reference(
        q[:nb].astype(jnp.float32), k8, v8, table[:nb], table[:nb],
        lens[:nb], None, jnp.float32(K_SCALE), jnp.float32(V_SCALE),
        sm_scale=sm_scale)
    kv_bytes = lambda itemsize: 2 * b * s * hkv * d * itemsize  # noqa: E731

    def timed(pk, pv, cfg, scaled):
      kw = dict(k_scale=jnp.float32(K_SCALE),
                v_scale=jnp.float32(V_SCALE)) if scaled else {}
      f = jax.jit(lambda q, a, c: kernel.paged_decode(
          q, a, c, table, table, lens, sm_scale=sm_scale, config=cfg, **kw))
      out, _ = f(q, pk, pv)
      err = _timing.rel_err(out[:nb], expected) if scaled else None
      t = None if fast else _timing.time_fn(f, q, pk, pv)["median_ms"]
      kt = _timing.device_kernel_ms(f, lambda: (q, pk, pv))
      return dict(ms=t, kernel_ms=kt, rel_err=err)

    row = dict(spec=name, base=dataclasses.asdict(base),
               fp8_default=dataclasses.asdict(fp8_default))
    r = timed(k, v, base, False)
    row["bf16_default"] = dict(r, tbps=kv_bytes(2) / r["kernel_ms"] / 1e9)
    for vname, cfg in variants(base, fp8_default, ps, sweep,
                               shape).items():
      try:
        r = timed(k8, v8, cfg, True)
      except Exception as e:  # noqa: BLE001  (a config that does not lower)
        row[f"fp8_{vname}"] = dict(error=f"{type(e).__name__}: {e}"[:300])
        continue
      row[f"fp8_{vname}"] = dict(
          r, tbps=kv_bytes(1) / r["kernel_ms"] / 1e9,
          over_bf16=r["kernel_ms"] / row["bf16_default"]["kernel_ms"],
          config=dataclasses.asdict(cfg))
      if fast:
        print(f"  {name} {vname}: {r['kernel_ms'] * 1e3:.1f} us "
              f"{row[f'fp8_{vname}']['over_bf16']:.3f}x bf16 "
              f"err {r['rel_err']:.1e}", flush=True)
    rows.append(row)
    print(json.dumps(row), flush=True)
    del k, v, k8, v8
  return rows


def prefill_inputs(hq, hkv, d, b, s, ps, qlen, seed=7):
  """A prefill case: `b` sequences of `s` keys on shuffled pages, the last
  `qlen` of each new: (q, k, v, k8, v8, table, q_indptr, kv_lens)."""
  pages = b * s // ps
  keys = jax.random.split(jax.random.key(seed), 4)
  k = jax.random.normal(keys[0], (pages, ps, hkv, d), jnp.bfloat16)
  v = jax.random.normal(keys[1], (pages, ps, hkv, d), jnp.bfloat16)
  k8, v8 = _kv.quantize(k, K_SCALE), _kv.quantize(v, V_SCALE)
  table = jax.random.permutation(keys[2], pages).astype(jnp.int32).reshape(
      b, s // ps)
  q = jax.random.normal(keys[3], (b * qlen, hq, d), jnp.bfloat16)
  indptr = jnp.arange(0, b * qlen + 1, qlen, dtype=jnp.int32)
  lens = jnp.full((b,), s, jnp.int32)
  return q, k, v, k8, v8, table, indptr, lens


def prefill_rows():
  hq, hkv, d, b, s, ps = 32, 8, 128, 4, 4096, 16
  q, k, v, k8, v8, table, indptr, lens = prefill_inputs(hq, hkv, d, b, s, ps,
                                                        s)
  flops = 4 * b * hq * d * (s * (s + 1) / 2)
  triton = prefill_kernel.Config.default_for(
      group_size=hq // hkv, head_dim=d, page_size=ps, dtype=q.dtype,
      backend="triton")
  scales = dict(k_scale=jnp.float32(K_SCALE), v_scale=jnp.float32(V_SCALE))
  cases = {
      # name: (k pages, v pages, config (None = the public op's default), kw)
      "bf16_default": (k, v, None, {}),
      "bf16_triton": (k, v, triton, {}),
      "fp8_triton": (k8, v8, triton, scales),
      # The Mosaic-GPU kernel on FP8 pages: (block_kv, fp8 staging stages).
      "fp8_mosaic_bkv128_st1": (k8, v8, (128, 1), scales),
      "fp8_mosaic_bkv64_st2": (k8, v8, (64, 2), scales),
  }
  mosaic = prefill_kernel.Config.default_for(
      group_size=hq // hkv, head_dim=d, page_size=ps, dtype=q.dtype,
      backend="mosaic")
  plan = mosaic.plan(indptr, lens, num_tokens=b * s, causal=True,
                     window_left=-1)
  row = dict(spec="prefill_b4_s4096_p16_causal",
             triton=dataclasses.asdict(triton))
  outs = {}
  for name, (kp, vp, cfg, kw) in cases.items():
    if cfg is None:
      f = jax.jit(lambda q, kp, vp: pkvattn.paged_prefill(
          q, (kp, vp), table, indptr, lens, impl="pallas"))
    elif isinstance(cfg, tuple):
      f = jax.jit(lambda q, kp, vp, cfg=cfg, kw=kw: mgpu.paged_prefill_mgpu(
          q, kp, vp, table, table, plan.tiles, causal=True,
          sm_scale=d ** -0.5, block_kv=cfg[0], fp8_stages=cfg[1], **kw)[0])
    else:
      f = jax.jit(lambda q, kp, vp, cfg=cfg, kw=kw: prefill_kernel.paged_prefill(
          q, kp, vp, table, table, indptr, lens, sm_scale=d ** -0.5,
          config=cfg, **kw)[0])
    try:
      outs[name] = f(q, kp, vp)
      kt = _timing.device_kernel_ms(f, lambda kp=kp, vp=vp: (q, kp, vp))
    except Exception as e:  # noqa: BLE001  (a variant that does not lower)
      row[name] = dict(error=f"{type(e).__name__}: {e}"[:400])
      continue
    row[name] = dict(kernel_ms=kt, tflops=flops / kt / 1e9)
  # Sequence 0's first 256 tokens see keys 0..255 only: the f32 reference
  # over those (the whole batch is GBs in f32).
  expected, _ = reference.paged_prefill_reference(
      q[:256].astype(jnp.float32), k8, v8, table[:1], table[:1],
      jnp.array([0, 256], jnp.int32), jnp.array([256], jnp.int32), None,
      jnp.float32(K_SCALE), jnp.float32(V_SCALE), sm_scale=d ** -0.5)
  for name in cases:
    if name.startswith("fp8") and name in outs:
      row[name]["rel_err"] = _timing.rel_err(outs[name][:256], expected)
      row[name]["over_bf16_default_tflops"] = (
          row[name]["tflops"] / row["bf16_default"]["tflops"])
  print(json.dumps(row), flush=True)
  return [row]


def _child(tag: str):
  """One decode call for Nsight Compute (`ncu -k regex:paged_decode`)."""
  spec = SPECS[os.environ.get("DIAG_SPEC", "llama3_8b_b64_s4096_p16")]
  hq, hkv, d, b, s, ps = spec
  q, k, v, table, lens = _inputs(spec)
  kw, cfg = {}, None
  if tag.startswith("fp8"):
    k, v = _kv.quantize(k, K_SCALE), _kv.quantize(v, V_SCALE)
    kw = dict(k_scale=jnp.float32(K_SCALE), v_scale=jnp.float32(V_SCALE))
    cfg = kernel.Config.default_for(
        batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
        head_dim=d)
    if tag == "fp8op":
      cfg = dataclasses.replace(cfg, fp8_convert="operand")
  out = jax.jit(lambda q, a, c: kernel.paged_decode(
      q, a, c, table, table, lens, sm_scale=0.1, config=cfg, **kw))(q, k, v)
  jax.block_until_ready(out)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="bench/results")
  ap.add_argument("--child", default=None, choices=("fp8", "fp8op", "bf16"))
  ap.add_argument("--skip", default="", help="comma list: append,prefill,"
                  "decode")
  ap.add_argument("--specs", default="", help="comma list of SPECS names")
  ap.add_argument("--sweep", default="",
                  choices=("", "tiles", "asm", "stages", "pack", "splits",
                           "grid", "half", "pairs"))
  ap.add_argument("--fast", action="store_true",
                  help="decode: kernel time only (no per-call timing)")
  args = ap.parse_args()
  if args.child:
    _child(args.child)
    return
  skip = set(filter(None, args.skip.split(",")))
  res = dict(environment=_timing.environment())
  res["copy_roof_gbps"] = _timing.copy_roof_gbps()
  res["torch_copy_roof_gbps"] = _timing.torch_copy_roof_gbps()
  roof = max(res["copy_roof_gbps"], res["torch_copy_roof_gbps"] or 0.0)
  if "append" not in skip:
    res["append"] = bench_fp8.append_speed(roof)
  if "prefill" not in skip:
    res["prefill"] = prefill_rows()
  if "decode" not in skip:
    res["decode"] = decode_rows(set(filter(None, args.specs.split(","))),
                                args.sweep, args.fast)
  os.makedirs(args.out, exist_ok=True)
  dev = res["environment"]["device"].replace(" ", "_")
  tag = f"_{args.sweep}_sweep" if args.sweep else ""
  path = os.path.join(args.out, f"fp8_decode_diag{tag}_{dev}.json")
  with open(path, "w") as f:
    json.dump(res, f, indent=1)
  print(f"\ncopy roof {roof:.0f} GB/s")
  for r in res.get("append", []):
    print(f"rope+append {r['pool_dtype']:14s} {r['kernel_ms']:.3f} ms "
          f"{r['gbps']:.0f} GB/s = {r['of_copy_roof']:.2f}x roof")
  for r in res.get("prefill", []):
    print(r["spec"], " ".join(
        f"{k} {v['tflops']:.0f}" for k, v in r.items()
        if isinstance(v, dict) and "tflops" in v), "TFLOP/s")
  for row in res.get("decode", []):
    cells = [f"bf16 {row['bf16_default']['kernel_ms']*1e3:.0f}us"]
    for key, r in row.items():
      if key.startswith("fp8_"):
        cells.append(f"{key[4:]} " + (f"{r['kernel_ms']*1e3:.0f}us"
                                      f"({r['over_bf16']:.2f},e{r['rel_err']:.0e})"
                                      if "kernel_ms" in r else "ERR"))
    print(row["spec"], " ".join(cells))
  print("->", path)


if __name__ == "__main__":
  main()
