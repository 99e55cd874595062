"""FP8 KV cache on the GPU: correctness, then decode / prefill / append speed.

Run on a GPU:  `python -m bench.bench_fp8 [--out DIR] [--quick]`

1. Correctness (pkvattn pallas vs the xla reference on the same FP8 pages,
   NaN in spare pages; GQA groups 1/3/4/8; the three kv_cache formats):
   decode, prefill (mixed batch), and RoPE + append (written pages bitwise
   equal, as uint8).
2. Decode, the specs of bench_decode (Llama-3-8B heads 32/8/128 unless the
   spec names others): pkvattn bf16 pages, pkvattn FP8 pages, FlashInfer
   0.7.2 FP8 and bf16 (`BatchDecodeWithPagedKVCacheWrapper.plan(...,
   kv_data_type=...)`), on the same pages (FlashInfer's NHD layout is our
   "flashinfer" format), each timed per call by `_timing.time_fn`'s method
   (`_timing.pipelined_ms`: wall time per call of back-to-back calls) and by GPU kernel time
   (`_timing.device_kernel_ms` / `_flashinfer.kernel_ms`); FlashInfer's
   outputs are checked against ours first.
3. Prefill with FP8 pages vs bf16 pages (causal, B=4 S=4096 p16): TFLOP/s
   per call and by kernel time, for the default (FP8 pages dequantized
   first at this size) and for FP8 pages read in the kernel.
4. RoPE + append into bf16 and FP8 pages, 65,536 tokens, by kernel time:
   bytes (read q/k/v, write q and the K/V rows) vs the copy roof (the
   better of an XLA u32 op and torch's `copy_`).

Prints a table last; writes `fp8_<device>.json` under `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import pkvattn
from bench import _flashinfer
from bench import _timing
from bench.bench_decode import NUM_KV_HEADS, NUM_QO_HEADS, HEAD_DIM, SPECS
from pkvattn import _kv

FP8 = jnp.float8_e4m3fn


def _quantized_pool(rng, num_pages, page_size, hkv, d, nan_pages=()):
  """bf16 pages, their FP8 copy and the per-tensor scale (amax / 448)."""
  x = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
  x[list(nan_pages)] = np.nan
  scale = float(np.nanmax(np.abs(x))) / _kv.FP8_MAX
  bf16 = jnp.asarray(x, jnp.bfloat16)
  return bf16, _kv.quantize(jnp.asarray(x), scale), scale


def correctness(quick: bool):
  rows = []
  rng = np.random.default_rng(int(time.time()))
  d = 128
  for g in ((1, 4) if quick else (1, 3, 4, 8)):
    for fmt in ("pair", "pool", "flashinfer"):
      hkv, ps = 2, 16
      lens = np.array([1, 7, 129, 700, 4095 if not quick else 300])
      pages = [-(-int(n) // ps) for n in lens]
      n_pages = sum(pages) + 3
      perm = rng.permutation(n_pages)
      spare = perm[sum(pages):]
      table = np.full((len(lens), max(pages)), -1, np.int32)
      off = 0
      for b, p in enumerate(pages):
        table[b, :p] = perm[off:off + p]
        off += p
      _, k8, ks = _quantized_pool(rng, n_pages, ps, hkv, d, spare)
      _, v8, vs = _quantized_pool(rng, n_pages, ps, hkv, d, spare)
      if fmt == "pair":
        cache, tbl = (k8, v8), jnp.asarray(table)
      elif fmt == "pool":
        cache = jnp.concatenate([k8, v8])
        tbl = jnp.asarray(np.stack([table, np.where(table >= 0,
                                                    table + n_pages, -1)], 1))
      else:
        cache, tbl = jnp.stack([k8, v8], axis=1), jnp.asarray(table)
      q = jnp.asarray(rng.standard_normal((len(lens), g * hkv, d)),
                      jnp.bfloat16)
      kw = dict(k_scale=ks, v_scale=vs, return_lse=True)
      out = {}
      for impl in ("pallas", "xla"):
        out[impl] = pkvattn.paged_decode(q, cache, tbl, jnp.asarray(lens),
                                         impl=impl, **kw)
      err = _timing.rel_err(out["pallas"][0], out["xla"][0])
      lse_err = float(jnp.max(jnp.abs(out["pallas"][1] - out["xla"][1])))
      # Prefill: a mixed batch (decode rows and chunks over a cached prefix).
      q_lens = np.minimum(lens, [1, 7, 64, 1, 33])
      indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
      qp = jnp.asarray(rng.standard_normal((int(indptr[-1]), g * hkv, d)),
                       jnp.bfloat16)
      pout = {}
      for impl in ("pallas", "xla"):
        pout[impl] = pkvattn.paged_prefill(
            qp, cache, tbl, jnp.asarray(indptr), jnp.asarray(lens),
            impl=impl, k_scale=ks, v_scale=vs)
      perr = _timing.rel_err(pout["pallas"], pout["xla"])
      ok = err < 2e-2 and lse_err < 2e-2 and perr < 2e-2
      rows.append(dict(group=g, fmt=fmt, decode_rel_err=err,
                       decode_lse_abs_err=lse_err, prefill_rel_err=perr,
                       ok=bool(ok)))
  # RoPE + append into FP8 pages: pallas == xla, bitwise.
  n_tok, hq, hkv, ps = 300, 8, 2, 16
  q = jnp.asarray(rng.standard_normal((n_tok, hq, d)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((n_tok, hkv, d)) * 3, jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((n_tok, hkv, d)), jnp.bfloat16)
  table = jnp.asarray(rng.permutation(40)[:4 * 10].reshape(4, 10), jnp.int32)
  bidx = jnp.asarray(np.repeat(np.arange(4), n_tok // 4), jnp.int32)
  pos = jnp.asarray(np.tile(np.arange(n_tok // 4), 4), jnp.int32)
  pool = jnp.zeros((40, ps, hkv, d), FP8)
  res = {}
  for impl in ("pallas", "xla"):
    res[impl] = pkvattn.apply_rope_and_append(
        q, k, v, bidx, pos, (pool, pool), table, pkvattn.RopeConfig(),
        impl=impl, k_scale=0.02, v_scale=0.01)
  a = np.concatenate([np.asarray(x).astype(np.float64).ravel()
                      for x in res["pallas"][1]])
  b = np.concatenate([np.asarray(x).astype(np.float64).ravel()
                      for x in res["xla"][1]])
  off = a != b
  rel = float(np.max(np.abs(a[off] - b[off]) / np.abs(b[off]))) if off.any() \
      else 0.0
  rows.append(dict(rope_append_fraction_differing=float(off.mean()),
                   rope_append_max_rel_diff=rel,
                   ok=bool(off.mean() < 1e-3 and rel <= 2**-3)))
  return rows


def decode_inputs(spec):
  """A decode spec's inputs (`bench_decode.SPECS` entry): every sequence at
  full length on shuffled pages in FlashInfer's layout, bf16 and FP8 with
  per-tensor scales (amax / 448).

  Returns:
    `(q bf16[b, hq, d], kv bf16[pages, 2, page_size, hkv, d], kv8 (same,
    float8_e4m3fn), table i32[b, pages / b], kv_lens i32[b], k_scale,
    v_scale)`, the scales as Python floats.
  """
  b, s, ps = spec["batch_size"], spec["seq_len"], spec["page_size"]
  hq, hkv, d = spec.get("heads", (NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM))
  rng = np.random.default_rng(0)
  pages_per_seq = s // ps
  n_pages = b * pages_per_seq
  kv = jax.random.normal(jax.random.key(1), (n_pages, 2, ps, hkv, d),
                         jnp.bfloat16)
  ks = float(jnp.max(jnp.abs(kv[:, 0]).astype(jnp.float32))) / 448
  vs = float(jnp.max(jnp.abs(kv[:, 1]).astype(jnp.float32))) / 448
  kv8 = jnp.stack([_kv.quantize(kv[:, 0], ks), _kv.quantize(kv[:, 1], vs)],
                  axis=1)
  table = jnp.asarray(rng.permutation(n_pages).reshape(b, pages_per_seq),
                      jnp.int32)
  lens = jnp.full((b,), s, jnp.int32)
  q = jax.random.normal(jax.random.key(2), (b, hq, d), jnp.bfloat16)
  return q, kv, kv8, table, lens, ks, vs


def decode_speed(quick: bool):
  import flashinfer  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  rows = []
  workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
  specs = list(SPECS.items())[:2] if quick else list(SPECS.items())
  for name, spec in specs:
    b, ps = spec["batch_size"], spec["page_size"]
    q, kv, kv8, table, lens, ks, vs = decode_inputs(spec)
    hq, hkv, d = q.shape[1], kv.shape[3], q.shape[2]
    n_pages, pages_per_seq = kv.shape[0], table.shape[1]
    f16 = jax.jit(lambda q, c, t, n: pkvattn.paged_decode(q, c, t, n,
                                                          impl="pallas"))
    f8 = jax.jit(lambda q, c, t, n, a, z: pkvattn.paged_decode(
        q, c, t, n, impl="pallas", k_scale=a, v_scale=z))
    a, z = jnp.float32(ks), jnp.float32(vs)
    ours16 = f16(q, kv, table, lens)
    ours8 = f8(q, kv8, table, lens, a, z)
    t16 = _timing.time_fn(f16, q, kv, table, lens)["median_ms"]
    t8 = _timing.time_fn(f8, q, kv8, table, lens, a, z)["median_ms"]
    k16 = _timing.device_kernel_ms(f16, lambda: (q, kv, table, lens))
    k8 = _timing.device_kernel_ms(f8, lambda: (q, kv8, table, lens, a, z))
    # FlashInfer on the same pages.
    indptr = torch.arange(0, n_pages + 1, pages_per_seq, dtype=torch.int32,
                          device="cuda")
    indices = _flashinfer.to_torch(table.reshape(-1))
    last = torch.full((b,), ps, dtype=torch.int32, device="cuda")
    qt = _flashinfer.to_torch(q)
    fi = {}
    for label, cache, dt in (("bf16", kv, torch.bfloat16),
                             ("fp8", kv8, torch.float8_e4m3fn)):
      w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
      w.plan(indptr, indices, last, hq, hkv, d, ps,
             q_data_type=torch.bfloat16, kv_data_type=dt)
      ct = _flashinfer.to_torch(cache)
      scales = dict(k_scale=ks, v_scale=vs) if label == "fp8" else {}
      out = w.run(qt, ct, **scales)
      ref = ours8 if label == "fp8" else ours16
      err = _timing.rel_err(jnp.asarray(out.float().cpu().numpy()), ref)
      run = lambda w=w, ct=ct, s=scales: w.run(qt, ct, **s)  # noqa: E731
      fi[label] = (_flashinfer.torch_time(run), err,
                   _flashinfer.kernel_ms(run))
    by = lambda itemsize: 2 * n_pages * ps * hkv * d * itemsize  # noqa: E731
    rows.append(dict(
        spec=name, heads=f"{hq}/{hkv}/{d}", pkv_bf16_ms=t16, pkv_fp8_ms=t8,
        pkv_bf16_kernel_ms=k16, pkv_fp8_kernel_ms=k8,
        fp8_over_bf16_kernel=k8 / k16,
        fi_bf16_kernel_ms=fi["bf16"][2], fi_fp8_kernel_ms=fi["fp8"][2],
        pkv_fp8_vs_fi_fp8_kernel=fi["fp8"][2] / k8,
        fi_bf16_ms=fi["bf16"][0],
        fi_fp8_ms=fi["fp8"][0], fi_bf16_rel_err=fi["bf16"][1],
        fi_fp8_rel_err=fi["fp8"][1],
        fp8_over_bf16=t8 / t16, pkv_fp8_vs_fi_fp8=fi["fp8"][0] / t8,
        pkv_fp8_tbps=by(1) / (t8 * 1e-3) / 1e12,
        pkv_bf16_tbps=by(2) / (t16 * 1e-3) / 1e12))
    del kv, kv8
  return rows


def prefill_speed():
  """Causal prefill, B=4 S=4096 p16: the public op on bf16 and FP8 pages
  (its default: FP8 pages dequantized first at this many tokens per row,
  `paged_prefill.Config.fp8_pages`), and the FP8 pages read in the kernel
  (`fp8_pages="kernel"`, the default config otherwise), per call and by
  GPU kernel time (the dequantizing gather included)."""
  from pkvattn.pallas_kernels import paged_prefill as kernel  # noqa: PLC0415
  b, s, ps = 4, 4096, 16
  n_pages = b * s // ps
  kv = jax.random.normal(jax.random.key(3), (n_pages, 2, ps, NUM_KV_HEADS,
                                             HEAD_DIM), jnp.bfloat16)
  kv8 = jnp.stack([_kv.quantize(kv[:, 0], 0.01), _kv.quantize(kv[:, 1], 0.01)],
                  axis=1)
  table = jnp.arange(n_pages, dtype=jnp.int32).reshape(b, s // ps)
  q = jax.random.normal(jax.random.key(4), (b * s, NUM_QO_HEADS, HEAD_DIM),
                        jnp.bfloat16)
  indptr = jnp.arange(0, b * s + 1, s, dtype=jnp.int32)
  lens = jnp.full((b,), s, jnp.int32)
  f16 = jax.jit(lambda q, c: pkvattn.paged_prefill(q, c, table, indptr, lens,
                                                   impl="pallas"))
  f8 = jax.jit(lambda q, c: pkvattn.paged_prefill(
      q, c, table, indptr, lens, impl="pallas", k_scale=0.01, v_scale=0.01))
  group = NUM_QO_HEADS // NUM_KV_HEADS
  in_kernel = dataclasses.replace(
      kernel.Config.default_for(group_size=group, head_dim=HEAD_DIM,
                                page_size=ps, dtype=q.dtype),
      fp8_pages="kernel")

  @jax.jit
  def f8k(q, cache):
    view = _kv.make_view(cache, table)
    return kernel.paged_prefill(
        q, view.k_pool, view.v_pool, view.k_table, view.v_table, indptr,
        lens, sm_scale=HEAD_DIM ** -0.5, config=in_kernel,
        k_scale=jnp.float32(0.01), v_scale=jnp.float32(0.01))[0]

  want = f8k(q, kv8)
  err = _timing.rel_err(f8(q, kv8), want)
  flops = 4 * b * NUM_QO_HEADS * HEAD_DIM * (s * (s + 1) / 2)
  out = dict(spec="prefill_b4_s4096_p16_causal",
             fp8_default_vs_in_kernel_rel_err=err)
  for name, f, c in (("bf16", f16, kv), ("fp8", f8, kv8),
                     ("fp8_in_kernel", f8k, kv8)):
    t = _timing.time_fn(f, q, c)["median_ms"]
    kt = _timing.device_kernel_ms(f, lambda c=c: (q, c))
    out.update({f"{name}_ms": t, f"{name}_kernel_ms": kt,
                f"{name}_tflops": flops / t / 1e9,
                f"{name}_kernel_tflops": flops / kt / 1e9})
  out["fp8_over_bf16_tflops"] = out["bf16_ms"] / out["fp8_ms"]
  out["fp8_over_bf16_kernel_tflops"] = (out["bf16_kernel_ms"]
                                        / out["fp8_kernel_ms"])
  out["fp8_in_kernel_over_bf16_kernel_tflops"] = (
      out["bf16_kernel_ms"] / out["fp8_in_kernel_kernel_ms"])
  return out


def append_speed(roof_gbps):
  """RoPE + append (65,536 tokens, Llama-3-8B heads, default config) into a
  bf16 and an FP8 pool: kernel time from a profiler trace (the pool's
  zero-fill before each call is a separate kernel, left out), bytes moved
  (q, k, v read in bf16; q written in bf16, K/V in the pool's dtype) against
  the copy roof."""
  n, hq, hkv, d, ps, b = 65536, 32, 8, 128, 16, 16
  keys = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(keys[0], (n, hq, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (n, hkv, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (n, hkv, d), jnp.bfloat16)
  pages = n // ps
  table = jnp.arange(pages, dtype=jnp.int32).reshape(b, pages // b)
  bidx = jnp.repeat(jnp.arange(b, dtype=jnp.int32), n // b)
  pos = jnp.tile(jnp.arange(n // b, dtype=jnp.int32), b)
  rows = []
  for dtype in (jnp.bfloat16, FP8):
    kw = dict(k_scale=0.02, v_scale=0.02) if dtype == FP8 else {}
    f = jax.jit(lambda q, k, v, c, kw=kw: pkvattn.apply_rope_and_append(
        q, k, v, bidx, pos, c, table, pkvattn.RopeConfig(), impl="pallas",
        **kw), donate_argnums=(3,))
    make = lambda dtype=dtype: (q, k, v, jnp.zeros(  # noqa: E731
        (pages, 2, ps, hkv, d), dtype))
    jax.block_until_ready(f(*make()))
    calls = [make() for _ in range(3)]
    events = _timing.gpu_stream_events([lambda a=a: f(*a) for a in calls])
    rope = [ns for name, ns in events if "rope" in name.lower()]
    if not rope:
      raise RuntimeError(f"no rope_append kernel in the trace: {events}")
    kernel_ms = sum(rope) / len(rope) / 1e6
    itemsize = jnp.dtype(dtype).itemsize
    moved = (2 * q.size + k.size + v.size) * 2 + (k.size + v.size) * itemsize
    gbps = moved / (kernel_ms * 1e-3) / 1e9
    rows.append(dict(spec="rope_append_65536", pool_dtype=jnp.dtype(
        dtype).name, kernel_ms=kernel_ms, bytes=moved, gbps=gbps,
        of_copy_roof=gbps / roof_gbps))
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="bench/results")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--skip", default="", help="comma list: decode,prefill,append")
  args = ap.parse_args()
  skip = set(filter(None, args.skip.split(",")))
  res = dict(environment=_timing.environment())
  res["correctness"] = correctness(args.quick)
  print(json.dumps(res["correctness"], indent=1))
  res["copy_roof_gbps"] = _timing.copy_roof_gbps()
  res["torch_copy_roof_gbps"] = _timing.torch_copy_roof_gbps()
  roof = max(res["copy_roof_gbps"], res["torch_copy_roof_gbps"] or 0.0)
  if "decode" not in skip:
    res["decode"] = decode_speed(args.quick)
  if "prefill" not in skip:
    res["prefill"] = prefill_speed()
  if "append" not in skip:
    res["append"] = append_speed(roof)
  os.makedirs(args.out, exist_ok=True)
  dev = jax.devices()[0].device_kind.replace(" ", "_")
  path = os.path.join(args.out, f"fp8_{dev}.json")
  with open(path, "w") as f:
    json.dump(res, f, indent=1)
  print("\nper call (kernel) ms        heads      pkv bf16        pkv fp8"
        "         FI fp8          FI bf16        fp8/bf16     FI/pkv(fp8)")
  for r in res.get("decode", []):
    print(f"{r['spec'][:34]:34s} {r['heads']:9s}"
          + "".join(f" {r[k + '_ms']:6.3f}({r[k + '_kernel_ms']:.3f})"
                    for k in ("pkv_bf16", "pkv_fp8", "fi_fp8", "fi_bf16"))
          + f"  {r['fp8_over_bf16']:5.3f}({r['fp8_over_bf16_kernel']:.3f})"
          f"  {r['pkv_fp8_vs_fi_fp8']:5.2f}"
          f"({r['pkv_fp8_vs_fi_fp8_kernel']:.2f})")
  if "prefill" in res:
    p = res["prefill"]
    print(f"prefill TFLOP/s per call (kernel): bf16 {p['bf16_tflops']:.0f}"
          f"({p['bf16_kernel_tflops']:.0f}), fp8 {p['fp8_tflops']:.0f}"
          f"({p['fp8_kernel_tflops']:.0f}) = "
          f"{p['fp8_over_bf16_tflops']:.2f}x"
          f"({p['fp8_over_bf16_kernel_tflops']:.2f}x); read in the kernel "
          f"{p['fp8_in_kernel_kernel_tflops']:.0f} = "
          f"{p['fp8_in_kernel_over_bf16_kernel_tflops']:.2f}x")
  for a in res.get("append", []):
    print(f"rope+append into {a['pool_dtype']}: {a['kernel_ms']:.3f} ms, "
          f"{a['gbps']:.0f} GB/s = {a['of_copy_roof']:.2f}x copy roof "
          f"({roof:.0f} GB/s)")
  print("correct:", all(r["ok"] for r in res["correctness"]), "->", path)


if __name__ == "__main__":
  main()
