"""Mosaic-GPU against Pallas-Triton decode by page size (Hopper).

Run on an H100 / H200:  `python -m bench.decode_mosaic_pages`

The Mosaic kernel copies each page of a step with one TMA box of
`page_size x head_dim` elements, or at 8-token pages by `cp.async`
(`paged_decode.CP_ASYNC_MAX_PAGE_SIZE`); small boxes (1 KiB at 8-token
pages and head_dim 64) cost TMA issue time, while the Triton kernel's
one-page steps slow down at 128-token pages. This bench times both
backends' defaults
(`Config.default_for(backend=...)`) on the same shuffled pages (the
"flashinfer" kv_cache format, every sequence at full length, B=64 S=4096)
for three head shapes and page sizes 8..128, by GPU kernel time from a
profiler trace (`_timing.device_kernel_ms`), after checking that both give
the same output, and the Mosaic kernel with the other load path
(`mosaic_other_ms`: TMA where the default is cp.async, and the reverse).
It also reports which backend `default_for` picks there.
`--p16-shapes` times head_dim-64 shapes at 16-token pages over batch sizes
and lengths instead (`P16_SHAPES`).

Writes `bench/results/decode_mosaic_pages_<device>.json` (or
`decode_mosaic_d64_shapes_<device>.json`; and under `$OUT`) and prints a
table last.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp

from bench import _timing
from bench.bench_decode_mosaic import _inputs, decode_fn
from pkvattn.pallas_kernels import paged_decode as kernel

HEADS = [(9, 3, 64), (32, 8, 64), (32, 8, 128)]  # SmolLM2, Llama-3.2-1B, -8B
PAGE_SIZES = (8, 16, 32, 64, 128)
# (qo heads, kv heads, head_dim, batch, tokens per sequence) at page 16.
P16_SHAPES = [(32, 8, 64, 256, 1024), (32, 8, 64, 64, 4096),
              (32, 8, 64, 8, 16384), (32, 8, 64, 32, 2048),
              (9, 3, 64, 256, 1024), (16, 8, 64, 128, 2048)]


def _case(hq, hkv, d, b, s, ps) -> dict:
  """Both backends' defaults on one shape: kernel times, agreement, and the
  backend `default_for` picks."""
  q, kv, table, lens = _inputs(hq, hkv, d, b, s, ps)
  jt, jl = jnp.asarray(table), jnp.asarray(lens)
  row = dict(heads=f"{hq}/{hkv}/{d}", batch_size=b, kv_len=s,
             page_size=ps)
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
  other = dataclasses.replace(cfg, cp_async=not cfg.cp_async)  # mosaic's
  f = decode_fn(other, head_dim=d)
  row["rel_err_other"] = _timing.rel_err(f(q, kv, jt, jl), outs["triton"])
  row["mosaic_other_ms"] = _timing.device_kernel_ms(
      f, lambda: (q, kv, jt, jl), calls=5)
  row["mosaic_cp_async"] = cfg.cp_async
  row["rel_err"] = _timing.rel_err(outs["mosaic"], outs["triton"])
  row["mosaic_over_triton"] = row["mosaic_ms"] / row["triton_ms"]
  row["default"] = kernel.Config.default_for(
      batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
      head_dim=d, group_size=hq // hkv, dtype=q.dtype,
      kv_dtype=kv.dtype).backend
  print(row, flush=True)
  return row


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--p16-shapes", action="store_true")
  args = ap.parse_args()
  env = _timing.environment()
  print(env, flush=True)
  rows = []
  if args.p16_shapes:
    cases = [(hq, hkv, d, b, s, 16) for hq, hkv, d, b, s in P16_SHAPES]
  else:
    cases = [(hq, hkv, d, 64, 4096, ps) for hq, hkv, d in HEADS
             for ps in PAGE_SIZES]
  for case in cases:
    rows.append(_case(*case))
  device = env["device"].replace(" ", "_")
  name = "decode_mosaic_d64_shapes" if args.p16_shapes else (
      "decode_mosaic_pages")
  _timing.write_results(f"{name}_{device}", rows)
  print()
  _timing.print_table(rows, ["heads", "batch_size", "kv_len", "page_size",
                             "triton_ms", "mosaic_ms", "mosaic_cp_async",
                             "mosaic_other_ms", "mosaic_over_triton",
                             "rel_err", "rel_err_other", "default"])


if __name__ == "__main__":
  main()
