"""The Triton decode kernel's page-id prefetch (`Config.prefetch_ids`) A/B.

Run on a GPU:  `python -m bench.decode_prefetch_ids [--out DIR]`

For Llama-3-8B heads (B=64 S=4096 at 16 / 32 / 64-token pages, B=8
S=16384, B=256 S=1024), SmolLM2 heads (B=64 S=4096, B=256 S=1024), Gemma 3
270M heads (B=64 S=4096) and Llama-3.2-1B heads (B=256 S=1024, B=64
S=4096), times the Triton default config on bf16 pages and on FP8 pages
(`bench.fp8_decode_diag`'s inputs and scales) with the page ids loaded at
each step and a step ahead, alternately twice in one process (the faster
of each pair of runs kept), by GPU kernel time (`_timing.device_kernel_ms`,
5 calls). Checks that both give bit-identical outputs. Writes
`decode_prefetch_ids_<device>.json` under `--out`; prints one line per
spec.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

from bench import _timing
from bench.fp8_decode_diag import K_SCALE
from bench.fp8_decode_diag import V_SCALE
from bench.fp8_decode_diag import _inputs
from pkvattn import _kv
from pkvattn.pallas_kernels import paged_decode as kernel

# (num_qo_heads, num_kv_heads, head_dim, batch, seq_len, page_size)
SPECS = [(32, 8, 128, 64, 4096, 16), (32, 8, 128, 64, 4096, 32),
         (32, 8, 128, 64, 4096, 64), (32, 8, 128, 8, 16384, 16),
         (32, 8, 128, 256, 1024, 16), (9, 3, 64, 64, 4096, 16),
         (9, 3, 64, 256, 1024, 16), (4, 1, 256, 64, 4096, 16),
         (32, 8, 64, 256, 1024, 16), (32, 8, 64, 64, 4096, 16)]


def spec_row(spec) -> dict:
  hq, hkv, d, b, s, ps = spec
  q, k, v, table, lens = _inputs(spec)
  k8, v8 = _kv.quantize(k, K_SCALE), _kv.quantize(v, V_SCALE)
  scales = dict(k_scale=jnp.float32(K_SCALE), v_scale=jnp.float32(V_SCALE))
  row = dict(spec=f"{hq}/{hkv}/{d} B{b} S{s} p{ps}")
  for dt, pk, pv, kw, kv_dtype in (("bf16", k, v, {}, None),
                                   ("fp8", k8, v8, scales,
                                    jnp.float8_e4m3fn)):
    base = kernel.Config.default_for(
        batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
        head_dim=d, kv_dtype=kv_dtype, backend="triton")
    row[f"{dt}_config"] = str(base)
    outs = {}
    for prefetch in (False, True, False, True):
      cfg = dataclasses.replace(base, prefetch_ids=prefetch)
      f = jax.jit(lambda q, a, c, kw=kw, cfg=cfg: kernel.paged_decode(
          q, a, c, table, table, lens, sm_scale=d ** -0.5, config=cfg,
          **kw)[0])
      outs.setdefault(prefetch, f(q, pk, pv))
      us = _timing.device_kernel_ms(f, lambda: (q, pk, pv), calls=5) * 1e3
      key = f"{dt}_{'prefetch' if prefetch else 'base'}_us"
      row[key] = min(row.get(key, float("inf")), us)
    row[f"{dt}_identical"] = bool(jnp.array_equal(outs[False], outs[True]))
    row[f"{dt}_prefetch_over_base"] = (row[f"{dt}_prefetch_us"]
                                       / row[f"{dt}_base_us"])
  return row


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="bench/results")
  args = ap.parse_args()
  env = _timing.environment()
  rows = []
  for spec in SPECS:
    rows.append(spec_row(spec))
    r = rows[-1]
    print(f"{r['spec']:24s} bf16 {r['bf16_base_us']:6.1f} -> "
          f"{r['bf16_prefetch_us']:6.1f} ({r['bf16_prefetch_over_base']:.3f})"
          f"  fp8 {r['fp8_base_us']:6.1f} -> {r['fp8_prefetch_us']:6.1f} "
          f"({r['fp8_prefetch_over_base']:.3f})", flush=True)
  _timing.write_results(f"decode_prefetch_ids_{env['device'].replace(' ', '_')}",
                        rows, out_dirs=(args.out,))
  print(json.dumps(dict(device=env["device"])))


if __name__ == "__main__":
  main()
