"""Mosaic-GPU against Pallas-Triton decode by page size (Hopper).

Run on an H100 / H200:  `python -m bench.decode_mosaic_pages`

The Mosaic kernel copies each page of a step with one TMA box of
`page_size x head_dim` elements; small boxes (2 KiB at 16-token pages and
head_dim 64) cost it issue time, while the Triton kernel's one-page steps
slow down at 128-token pages. This bench times both backends' defaults
(`Config.default_for(backend=...)`) on the same shuffled pages (the
"flashinfer" kv_cache format, every sequence at full length, B=64 S=4096)
for three head shapes and page sizes 16..128, by GPU kernel time from a
profiler trace (`_timing.device_kernel_ms`), after checking that both give
the same output. It also reports which backend `default_for` picks there.

Writes `bench/results/decode_mosaic_pages_<device>.json` (and under `$OUT`)
and prints a table last.
"""

from __future__ import annotations

import jax.numpy as jnp

from bench import _timing
from bench.bench_decode_mosaic import _inputs, decode_fn
from pkvattn.pallas_kernels import paged_decode as kernel

HEADS = [(9, 3, 64), (32, 8, 64), (32, 8, 128)]  # SmolLM2, Llama-3.2-1B, -8B
PAGE_SIZES = (16, 32, 64, 128)


def main():
  env = _timing.environment()
  print(env, flush=True)
  rows = []
  b, s = 64, 4096
  for hq, hkv, d in HEADS:
    for ps in PAGE_SIZES:
      q, kv, table, lens = _inputs(hq, hkv, d, b, s, ps)
      jt, jl = jnp.asarray(table), jnp.asarray(lens)
      row = dict(heads=f"{hq}/{hkv}/{d}", page_size=ps)
      outs = {}
      for be in ("triton", "mosaic"):
        cfg = kernel.Config.default_for(
            batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
            head_dim=d, backend=be)
        f = decode_fn(cfg, head_dim=d)
        outs[be] = f(q, kv, jt, jl)
        row[f"{be}_ms"] = _timing.device_kernel_ms(
            f, lambda: (q, kv, jt, jl), calls=5)
        row[f"{be}_config"] = str(cfg)
      row["rel_err"] = _timing.rel_err(outs["mosaic"], outs["triton"])
      row["mosaic_over_triton"] = row["mosaic_ms"] / row["triton_ms"]
      row["default"] = kernel.Config.default_for(
          batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
          head_dim=d, group_size=hq // hkv, dtype=q.dtype,
          kv_dtype=kv.dtype).backend
      print(row, flush=True)
      rows.append(row)
  device = env["device"].replace(" ", "_")
  _timing.write_results(f"decode_mosaic_pages_{device}", rows)
  print()
  _timing.print_table(rows, ["heads", "page_size", "triton_ms", "mosaic_ms",
                             "mosaic_over_triton", "rel_err", "default"])


if __name__ == "__main__":
  main()
