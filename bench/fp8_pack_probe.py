"""Probes behind two FP8 defaults: packed kv heads in decode, dequantized
pages in prefill (GPU).

Run:  `python -m bench.fp8_pack_probe [decode|prefill|inkernel|all] [--out DIR]`

* `decode`: head_dim-64 kv heads packed in pairs or fours into one wider head
  (Llama-3.2-1B heads; Llama-3-8B heads into head_dim 256), done in XLA around
  the kernel: the pools reshaped to `[N, page_size, H / P, P * D]`, q made
  block-diagonal `[B, Hq, P * D]` (`pack_query`), the output's own columns
  taken back (`unpack_output`), the kernel run with its default for the
  packed shape. bf16 and FP8 pages, each tiling checked against the f32
  reference on the first 8 sequences.
* `prefill`: FP8 pages dequantized first (gathered into a compact bf16 pool,
  then the bf16 default), against the FP8 pages read in the kernel, at 4 x
  4,096 / 4 x 512 / 16 x 128 new tokens per sequence over 4,096 keys. This
  probe scales q by `k_scale` and the output by `v_scale` in separate XLA
  passes; `paged_prefill` folds the scales into the gather instead
  (`_fp8.dequantize_pages`), so its cost is the gather alone.
* `inkernel`: `paged_decode`'s default on FP8 pages (`Config.pack_heads=2`:
  q placed and the output selected inside the kernel) against the `decode`
  probe's XLA packing around the head_dim-128 default, and unpacked.

Times are GPU kernel time (`_timing.device_kernel_ms`: every kernel of the
call, packing and gathers included) and per call. Writes
`fp8_pack_probe_<device>.json` under `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

import pkvattn
from bench import _timing
from bench import fp8_decode_diag
from pkvattn import _kv
from pkvattn.pallas_kernels import paged_decode as kernel
from pkvattn.pallas_kernels import paged_prefill as pk
from pkvattn.pallas_kernels import reference

K_SCALE, V_SCALE = fp8_decode_diag.K_SCALE, fp8_decode_diag.V_SCALE
DECODE_SPECS = {  # name: (num_qo_heads, num_kv_heads, head_dim, B, S, page)
    "llama1b_b256_s1024_p16": (32, 8, 64, 256, 1024, 16),
    "llama1b_b64_s4096_p16": (32, 8, 64, 64, 4096, 16),
    "llama3_8b_b64_s4096_p16": (32, 8, 128, 64, 4096, 16),
}
PREFILL_SPECS = {  # name: (Hq, Hkv, D, B, kv len, page, new tokens per row)
    "l8b_b4_s4096_full": (32, 8, 128, 4, 4096, 16, 4096),
    "l8b_b4_s4096_q512": (32, 8, 128, 4, 4096, 16, 512),
    "l8b_b16_s4096_q128": (32, 8, 128, 16, 4096, 16, 128),
    "l1b_b4_s4096_full": (32, 8, 64, 4, 4096, 16, 4096),
}
INKERNEL_SPECS = {
    "l1b_b256_s1024": (32, 8, 64, 256, 1024, 16),
    "l1b_b256_s1152": (32, 8, 64, 256, 1152, 16),
    "l1b_b64_s4096": (32, 8, 64, 64, 4096, 16),
}


def pack_query(q, num_kv_heads: int, pack: int):
  """`q [B, Hq, D]` -> `[B, Hq, pack * D]`: q head `h` of kv head `k` in
  columns `(k % pack) * D` onward, zeros elsewhere."""
  b, hq, d = q.shape
  g = hq // num_kv_heads
  q5 = q.reshape(b, num_kv_heads // pack, pack, g, d)
  eye = jnp.eye(pack, dtype=q.dtype)
  return jnp.einsum("bkjgd,jl->bkjgld", q5, eye).reshape(b, hq, pack * d)


def unpack_output(o, num_kv_heads: int, pack: int, head_dim: int):
  """`[B, Hq, pack * D]` -> each q head's own columns `[B, Hq, D]`."""
  b, hq, _ = o.shape
  g = hq // num_kv_heads
  o6 = o.reshape(b, num_kv_heads // pack, pack, g, pack, head_dim)
  return jnp.moveaxis(jnp.diagonal(o6, axis1=2, axis2=4), -1, 2).reshape(
      b, hq, head_dim)


def _decode_inputs(spec, seed=0):
  hq, hkv, d, b, s, ps = spec
  keys = jax.random.split(jax.random.key(seed), 4)
  pages = b * s // ps
  k = jax.random.normal(keys[0], (pages, ps, hkv, d), jnp.bfloat16)
  v = jax.random.normal(keys[1], (pages, ps, hkv, d), jnp.bfloat16)
  table = jax.random.permutation(keys[2], pages).astype(jnp.int32).reshape(
      b, s // ps)
  q = jax.random.normal(keys[3], (b, hq, d), jnp.bfloat16)
  lens = jnp.full((b,), s, jnp.int32) - jnp.arange(b, dtype=jnp.int32) % 7
  return q, k, v, table, lens


def _decode_case(spec):
  """Inputs of one decode spec and the FP8 pages: (q, k, v, k8, v8, table,
  lens)."""
  q, k, v, table, lens = _decode_inputs(spec)
  return (q, k, v, _kv.quantize(k, K_SCALE), _kv.quantize(v, V_SCALE),
          table, lens)


def _time(f, *args):
  return dict(kernel_ms=_timing.device_kernel_ms(f, lambda: args),
              ms=_timing.time_fn(f, *args)["median_ms"])


def decode_rows():
  rows = []
  for name, spec in DECODE_SPECS.items():
    hq, hkv, d, b, s, ps = spec
    q, k, v, k8, v8, table, lens = _decode_case(spec)
    pages = k.shape[0]
    nb = 8
    want8, _ = reference.paged_decode_reference(
        q[:nb].astype(jnp.float32), k8, v8, table[:nb], table[:nb], lens[:nb],
        None, jnp.float32(K_SCALE), jnp.float32(V_SCALE), sm_scale=d ** -0.5)
    want16, _ = reference.paged_decode_reference(
        q[:nb].astype(jnp.float32), k, v, table[:nb], table[:nb], lens[:nb],
        None, sm_scale=d ** -0.5)
    row = dict(spec=name)

    def run(vname, pack, fp8, edit=None):
      kp, vp = (k8, v8) if fp8 else (k, v)
      h2, d2 = hkv // pack, d * pack
      kw = dict(k_scale=jnp.float32(K_SCALE),
                v_scale=jnp.float32(V_SCALE)) if fp8 else {}
      cfg = kernel.Config.default_for(
          batch_size=b, num_kv_heads=h2, page_size=ps, max_pages=s // ps,
          head_dim=d2, group_size=hq // h2, dtype=q.dtype, kv_dtype=kp.dtype)
      cfg = dataclasses.replace(cfg, pack_heads=1)
      if edit:
        cfg = edit(cfg)

      @jax.jit
      def f(q, kp, vp):
        if pack > 1:
          q = pack_query(q, hkv, pack)
          kp = kp.reshape(pages, ps, h2, d2)
          vp = vp.reshape(pages, ps, h2, d2)
        o, _ = kernel.paged_decode(q, kp, vp, table, table, lens,
                                   sm_scale=d ** -0.5, config=cfg, **kw)
        return unpack_output(o, hkv, pack, d) if pack > 1 else o

      try:
        err = _timing.rel_err(f(q, kp, vp)[:nb], want8 if fp8 else want16)
        row[vname] = dict(_time(f, q, kp, vp), rel_err=err,
                          cfg=dataclasses.asdict(cfg))
      except Exception as e:  # noqa: BLE001  (a config that does not lower)
        row[vname] = dict(error=f"{type(e).__name__}: {e}"[:300])
      print(name, vname, row[vname], flush=True)

    run("bf16", 1, False)
    run("fp8", 1, True)
    run("fp8_p2", 2, True)
    run("fp8_p2_loaded_w4", 2, True,
        lambda c: dataclasses.replace(c, fp8_convert="loaded", num_warps=4))
    run("fp8_p2_w4", 2, True, lambda c: dataclasses.replace(c, num_warps=4))
    if d == 64:
      run("fp8_p4", 4, True)
      run("fp8_p4_asm", 4, True,
          lambda c: dataclasses.replace(c, fp8_convert="asm", num_warps=4))
    run("bf16_p2", 2, False)
    for r in row.values():
      if isinstance(r, dict) and "kernel_ms" in r:
        r["over_bf16"] = r["kernel_ms"] / row["bf16"]["kernel_ms"]
    rows.append(row)
  return rows


def prefill_rows():
  rows = []
  for name, (hq, hkv, d, b, s, ps, qlen) in PREFILL_SPECS.items():
    pages = b * s // ps
    q, k, v, k8, v8, table, indptr, lens = fp8_decode_diag.prefill_inputs(
        hq, hkv, d, b, s, ps, qlen)
    flops = 4 * b * hq * d * (qlen * s - qlen * (qlen - 1) / 2)
    scales = dict(k_scale=jnp.float32(K_SCALE), v_scale=jnp.float32(V_SCALE))
    f16 = jax.jit(lambda q, kp, vp: pkvattn.paged_prefill(
        q, (kp, vp), table, indptr, lens, impl="pallas"))

    @jax.jit
    def gather(kp, vp):
      idx = jnp.clip(table, 0, pages - 1).reshape(-1)
      return kp[idx].astype(jnp.bfloat16), vp[idx].astype(jnp.bfloat16)

    @jax.jit
    def dequantized(q, kp, vp):
      kg, vg = gather(kp, vp)
      compact = jnp.arange(b * (s // ps), dtype=jnp.int32).reshape(table.shape)
      qs = (q.astype(jnp.float32) * K_SCALE).astype(q.dtype)
      o = pkvattn.paged_prefill(qs, (kg, vg), compact, indptr, lens,
                                impl="pallas")
      return (o.astype(jnp.float32) * V_SCALE).astype(q.dtype)

    # FP8 pages read in the kernel at every size (`fp8_pages="kernel"`),
    # whatever the public op's rule would choose.
    in_kernel = dataclasses.replace(pk.Config.default_for(
        group_size=hq // hkv, head_dim=d, page_size=ps, dtype=q.dtype),
        fp8_pages="kernel")
    f8 = jax.jit(lambda q, kp, vp: pk.paged_prefill(
        q, kp, vp, table, table, indptr, lens, sm_scale=d ** -0.5,
        config=in_kernel, **scales)[0])
    nq = min(qlen, 256)
    want, _ = reference.paged_prefill_reference(
        q[:nq].astype(jnp.float32), k8, v8, table[:1], table[:1],
        jnp.array([0, nq], jnp.int32), jnp.array([s - qlen + nq], jnp.int32),
        None, jnp.float32(K_SCALE), jnp.float32(V_SCALE), sm_scale=d ** -0.5)
    row = dict(spec=name)
    for vname, f, kp, vp in (("bf16", f16, k, v), ("fp8_kernel", f8, k8, v8),
                             ("fp8_gather", dequantized, k8, v8)):
      out = f(q, kp, vp)
      r = _time(f, q, kp, vp)
      row[vname] = dict(r, tflops=flops / r["kernel_ms"] / 1e9, rel_err=(
          _timing.rel_err(out[:nq], want) if "fp8" in vname else None))
    row["gather_only_kernel_ms"] = _timing.device_kernel_ms(
        gather, lambda: (k8, v8))
    for vname in ("fp8_kernel", "fp8_gather"):
      row[vname]["over_bf16"] = (row["bf16"]["kernel_ms"]
                                 / row[vname]["kernel_ms"])
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def inkernel_rows():
  rows = []
  for name, spec in INKERNEL_SPECS.items():
    hq, hkv, d, b, s, ps = spec
    q, k, v, k8, v8, table, lens = _decode_case(spec)
    pages = k.shape[0]
    sc = dict(k_scale=jnp.float32(K_SCALE), v_scale=jnp.float32(V_SCALE))
    d128 = kernel.Config.default_for(
        batch_size=b, num_kv_heads=hkv // 2, page_size=ps, max_pages=s // ps,
        head_dim=2 * d, kv_dtype=k8.dtype)
    unpacked = kernel.Config.default_for(
        batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
        head_dim=d)
    call = lambda q, a, c, **kw: kernel.paged_decode(  # noqa: E731
        q, a, c, table, table, lens, sm_scale=d ** -0.5, **kw)[0]
    fs = {
        "bf16": (jax.jit(lambda q, a, c: call(q, a, c)), k, v),
        "fp8_default": (jax.jit(lambda q, a, c: call(q, a, c, **sc)), k8, v8),
        "fp8_xla_pack": (jax.jit(lambda q, a, c: unpack_output(call(
            pack_query(q, hkv, 2), a.reshape(pages, ps, hkv // 2, 2 * d),
            c.reshape(pages, ps, hkv // 2, 2 * d), config=d128, **sc),
            hkv, 2, d)), k8, v8),
        "fp8_unpacked": (jax.jit(lambda q, a, c: call(
            q, a, c, config=unpacked, **sc)), k8, v8),
    }
    ref = fs["fp8_xla_pack"][0](q, k8, v8).astype(jnp.float32)
    row = dict(spec=name)
    for vname, (f, a, c) in fs.items():
      out = f(q, a, c).astype(jnp.float32)
      row[vname] = dict(_time(f, q, a, c),
                        max_diff_vs_xla_pack=float(jnp.abs(out - ref).max()))
    for r in row.values():
      if isinstance(r, dict):
        r["over_bf16"] = r["kernel_ms"] / row["bf16"]["kernel_ms"]
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("what", nargs="?", default="all",
                  choices=("all", "decode", "prefill", "inkernel"))
  ap.add_argument("--out", default="bench/results")
  args = ap.parse_args()
  res = dict(environment=_timing.environment())
  for part, fn in (("decode", decode_rows), ("prefill", prefill_rows),
                   ("inkernel", inkernel_rows)):
    if args.what in ("all", part):
      res[part] = fn()
  os.makedirs(args.out, exist_ok=True)
  dev = res["environment"]["device"].replace(" ", "_")
  path = os.path.join(args.out, f"fp8_pack_probe_{dev}.json")
  with open(path, "w") as f:
    json.dump(res, f, indent=1)
  for part in ("decode", "inkernel"):
    for r in res.get(part, []):
      print(r["spec"], " ".join(
          f"{k} {v['kernel_ms'] * 1e3:.0f}us({v['over_bf16']:.2f})"
          for k, v in r.items() if isinstance(v, dict) and "kernel_ms" in v))
  for r in res.get("prefill", []):
    print(r["spec"], " ".join(
        f"{k} {v['tflops']:.0f}TF({v.get('over_bf16', 1.0):.2f})"
        for k, v in r.items() if isinstance(v, dict)),
        f"gather {r['gather_only_kernel_ms']:.3f}ms")
  print("->", path)


if __name__ == "__main__":
  main()
