"""Decode tiling sweep on the small-head shapes, FlashInfer 0.7.2 beside it.

Run on an H100 / H200:  `python -m bench.decode_heads_sweep [--specs a,b]`

For each spec (every sequence at full length, shuffled pages in the
"flashinfer" kv_cache format, NaN in the spare pages) the Triton decode
kernel runs over a grid of `Config`s (tokens per step, splits, warps); every
output is compared with the default config's first, then timed with
`_timing.time_fn` (back-to-back calls, median ms per call), the way
`_flashinfer.torch_time` times FlashInfer's CUDA-core and tensor-core decode
on the same buffers. The default and the three fastest configs are timed
again by kernel time (`_timing.device_kernel_ms`).

Writes `decode_heads_sweep_<device>.json` under `--out` (default
bench/results) after every spec; prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import traceback

import jax
import jax.numpy as jnp

from bench import _flashinfer
from bench import _timing
from bench.bench_decode_mosaic import _inputs
from bench.bench_decode_mosaic import decode_fn
from pkvattn.pallas_kernels import paged_decode as kernel

# name -> (num_qo_heads, num_kv_heads, head_dim, batch_size, seq_len, page_size)
SPECS = {
    "smollm2_b64_s4096": (9, 3, 64, 64, 4096, 16),
    "smollm2_b256_s1024": (9, 3, 64, 256, 1024, 16),
    "llama1b_b256_s1024": (32, 8, 64, 256, 1024, 16),
    "g6_d128_b64_s4096": (48, 8, 128, 64, 4096, 16),
    "gemma3_270m_b64_s4096": (4, 1, 256, 64, 4096, 16),
}


def grid(spec):
  hq, hkv, d, b, s, ps = spec
  out = []
  tokens_set = (32, 64) if d > 128 else (64, 128)
  for tokens in tokens_set:
    ppb = max(1, tokens // ps)
    for ks in (1, 2, 4, 8, 16):
      if ks * ppb * 2 > s // ps:
        continue
      for warps in (2, 4):
        out.append(kernel.Config(ppb, ks, warps, 3))
  return out


def sweep_spec(name, spec):
  hq, hkv, d, b, s, ps = spec
  q, kv, table, lens = _inputs(hq, hkv, d, b, s, ps)
  jt, jl = jnp.asarray(table), jnp.asarray(lens)
  nbytes = 2 * b * hq * d * 2 + 2 * b * s * hkv * d * 2

  fn_for = functools.partial(decode_fn, head_dim=d)

  default = kernel.Config.default_for(
      batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
      head_dim=d, group_size=hq // hkv, dtype=q.dtype, backend="triton")
  ref = jax.block_until_ready(fn_for(default)(q, kv, jt, jl))
  rows = []
  for label, tc in (("flashinfer", False), ("flashinfer tc", True)):
    try:
      run, out = _flashinfer.decode_fn(q, kv, table, lens, num_qo_heads=hq,
                                       num_kv_heads=hkv, use_tensor_cores=tc)
      ms = _flashinfer.torch_time(run, iters=20, min_time_s=0.2)
      rows.append(dict(spec=name, impl=label, ms=ms,
                       err=_timing.rel_err(out, ref)))
    except Exception:  # noqa: BLE001
      rows.append(dict(spec=name, impl=label,
                       error=traceback.format_exc()[-400:]))
    print(rows[-1], flush=True)
  configs = [("default", default)] + [(str(c), c) for c in grid(spec)
                                      if c != default]
  fns = {}
  for label, cfg in configs:
    try:
      f = fn_for(cfg)
      err = _timing.rel_err(f(q, kv, jt, jl), ref)
      ms = _timing.time_fn(f, q, kv, jt, jl, iters=10,
                           min_time_s=0.1)["median_ms"]
      fns[label] = f
      rows.append(dict(spec=name, impl="triton", config=label, ms=ms, err=err,
                       ppb=cfg.pages_per_block, ks=cfg.k_splits,
                       warps=cfg.num_warps))
    except Exception:  # noqa: BLE001
      rows.append(dict(spec=name, impl="triton", config=label,
                       error=traceback.format_exc()[-400:]))
    print(rows[-1], flush=True)
  ok = [r for r in rows if r["impl"] == "triton" and "ms" in r
        and r["err"] < 2e-2]
  best = sorted(ok, key=lambda r: r["ms"])[:3]
  for r in best + [r for r in ok if r["config"] == "default"]:
    if "kernel_ms" not in r:
      r["kernel_ms"] = _timing.device_kernel_ms(
          fns[r["config"]], lambda: (q, kv, jt, jl), calls=5)
  fi = [r["ms"] for r in rows if r["impl"].startswith("flashinfer")
        and "ms" in r and r["err"] < 2e-2]
  for r in rows:
    if "ms" in r:
      r["tbps"] = nbytes / r["ms"] / 1e9
      if fi:
        r["x_flashinfer"] = min(fi) / r["ms"]
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--specs", default=",".join(SPECS))
  ap.add_argument("--out", default="bench/results")
  args = ap.parse_args()
  env = _timing.environment()
  print(env, flush=True)
  rows = []
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(
      args.out, f"decode_heads_sweep_{env['device'].replace(' ', '_')}.json")
  for name in args.specs.split(","):
    rows += sweep_spec(name, SPECS[name])
    with open(path, "w") as f:
      json.dump(dict(environment=env, rows=rows), f, indent=1)
  summary = []
  for name in args.specs.split(","):
    rs = [r for r in rows if r["spec"] == name and "ms" in r]
    fi = min((r for r in rs if r["impl"].startswith("flashinfer")),
             key=lambda r: r["ms"], default=None)
    dflt = next((r for r in rs if r.get("config") == "default"), None)
    best = min((r for r in rs if r["impl"] == "triton" and r["err"] < 2e-2),
               key=lambda r: r["ms"], default=None)
    summary.append(dict(
        spec=name, fi=fi and f"{fi['impl']} {fi['ms'] * 1e3:.1f}",
        default_us=dflt and dflt["ms"] * 1e3,
        default_x_fi=dflt and dflt.get("x_flashinfer"),
        best=best and best["config"], best_us=best and best["ms"] * 1e3,
        best_x_fi=best and best.get("x_flashinfer")))
  _timing.print_table(summary, ["spec", "fi", "default_us", "default_x_fi",
                                "best", "best_us", "best_x_fi"])
  print("->", path)


if __name__ == "__main__":
  main()
