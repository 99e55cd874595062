"""Per-warp Mosaic-GPU decode (`paged_decode_mma`) beside the Triton
default, the TMA Mosaic kernel and FlashInfer 0.7.2, in one process.

Run on an H100 / H200:  `python -m bench.decode_mma [--specs 0,4]`

The nine decode specs of `bench_decode_mosaic` (four Llama-3-8B, two
SmolLM2, group 6 at head_dim 128, two Gemma 3 270M; every sequence at full
length, shuffled pages in the "flashinfer" format, so FlashInfer reads the
very same buffers). Each implementation's output is compared with the
Triton default's first; then per-call time (`_timing.time_fn`, back to
back) and GPU kernel time from one profiler trace
(`_timing.device_kernel_ms`, `_flashinfer.kernel_ms`). Variants of the mma
kernel: its default, twice / half the splits, 32-key steps at head_dim 64,
q in registers at head_dim 256, L1 no-allocate loads (`_variants`).
`x_flashinfer_kernel` is against FlashInfer's faster mode (CUDA-core or
tensor-core decode) by kernel time.

Prints a table last; writes `bench/results/decode_mma_<device>[_tag].json`
(and under `$OUT`).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from bench import _timing
from bench.bench_decode_mosaic import SHAPES, SPECS, _inputs, decode_fn
from bench.bench_decode_mosaic import flashinfer_rows, timed_row
from pkvattn import _kv
from pkvattn.pallas_kernels import paged_decode as kernel
from pkvattn.pallas_kernels import paged_decode_mgpu as mgpu
from pkvattn.pallas_kernels import paged_decode_mma as mma


def _variants(base, d: int, full: bool):
  """(label, config, kernel options) of the mma kernel runs: its default,
  then (with `full`) twice / half the splits, 32-key steps at head_dim
  64, q in registers at head_dim 256, L1 no-allocate loads."""
  out = [("mma default", base, {})]
  if not full:
    return out
  out.append(("mma splits x2",
              dataclasses.replace(base, k_splits=min(64, 2 * base.k_splits)),
              {}))
  if base.k_splits > 1:
    out.append(("mma splits /2",
                dataclasses.replace(base, k_splits=base.k_splits // 2), {}))
  if d == 64:
    out.append(("mma tiles 2", dataclasses.replace(base, mma_tiles=2), {}))
  if d == 256:
    out.append(("mma q in registers", base, dict(q_in_smem=False)))
  out.append(("mma .L1::no_allocate", base,
              dict(load_hint=".L1::no_allocate")))
  return out


def mma_fn(cfg, opts, *, head_dim):
  """Jitted decode on the mma kernel with kernel options `opts` (as
  `paged_decode`'s mosaic_mma path: the jnp combine after several
  splits)."""
  if not opts:
    return decode_fn(cfg, head_dim=head_dim)

  def f(q, kv, t, n):
    v = _kv.make_view(kv, t)
    final = cfg.k_splits == 1
    o, lse = mma.paged_decode_mma(
        q, v.k_pool, v.v_pool, v.k_table, v.v_table, n,
        sm_scale=head_dim ** -0.5, k_splits=cfg.k_splits,
        tiles=cfg.mma_tiles, final=final, **opts)
    if final:
      return o
    b, hq, d = q.shape
    hkv = v.k_pool.shape[2]
    out, _ = kernel._combine(o, lse, None, hq // hkv)  # noqa: SLF001
    return out.reshape(b, hq, d).astype(q.dtype)
  return jax.jit(f)


def speed(spec, *, full: bool, with_tma: bool):
  shape, b, s, ps = spec
  hq, hkv, d = SHAPES[shape]
  q, kv, table, lens = _inputs(hq, hkv, d, b, s, ps)
  jt, jl = jnp.asarray(table), jnp.asarray(lens)
  nbytes = 2 * b * hq * d * 2 + 2 * b * s * hkv * d * 2
  name = f"{shape}_b{b}_s{s}_p{ps}"
  kw = dict(batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
            head_dim=d)
  triton = kernel.Config.default_for(**kw, backend="triton")
  runs = [("triton default", triton, {})]
  if with_tma and mgpu.supports(dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
                                head_dim=d, page_size=ps, group_size=hq // hkv):
    runs.append(("mosaic tma", kernel.Config.default_for(**kw,
                                                         backend="mosaic"),
                 {}))
  runs += _variants(kernel.Config.default_for(**kw, backend="mosaic_mma"), d,
                    full)
  rows = []
  ref = None
  for label, cfg, opts in runs:
    row, out = timed_row(
        dict(spec=name, impl=label, config=str(cfg), opts=opts),
        lambda cfg=cfg, opts=opts: mma_fn(cfg, opts, head_dim=d),
        (q, kv, jt, jl), nbytes, ref)
    rows.append(row)
    if ref is None:
      ref = out
  rows += flashinfer_rows(name, q, kv, table, lens, hq, hkv, nbytes, ref)
  add_ratios(rows, "triton default", max_err=2e-2)
  return rows


def add_ratios(rows, triton_impl: str, *, max_err: float):
  """On every row with a kernel time: `x_flashinfer_kernel` / `x_flashinfer`
  (FlashInfer's faster mode, among its rows within `max_err` of the
  reference, over this row's kernel / per-call time) and `x_triton_kernel`
  (the `triton_impl` row's kernel time over this row's)."""
  fi = [r for r in rows if r["impl"].startswith("flashinfer")
        and r.get("kernel_ms") and r["err_vs_triton"] < max_err]
  tri = [r["kernel_ms"] for r in rows
         if r["impl"] == triton_impl and r.get("kernel_ms")]
  for r in rows:
    if not r.get("kernel_ms"):
      continue
    if fi:
      r["x_flashinfer_kernel"] = min(x["kernel_ms"] for x in fi) / r[
          "kernel_ms"]
      r["x_flashinfer"] = min(x["ms"] for x in fi) / r["ms"]
    if tri:
      r["x_triton_kernel"] = tri[0] / r["kernel_ms"]


def run_main(prefix, speed_fn, columns, extra_args=None):
  """The decode benches' command line: `--specs` (indices into SPECS),
  `--default-only`, `--page-size` (instead of the specs'), `--tag` (a
  suffix of the results file), and what `extra_args(parser)` adds; rows of
  `speed_fn(spec, args)` for each spec go to `bench/results/
  <prefix>_<device>[_tag].json` as they come, and a table of `columns`
  is printed last."""
  ap = argparse.ArgumentParser()
  ap.add_argument("--specs", default=None,
                  help="comma-separated indices into SPECS (default: all)")
  ap.add_argument("--default-only", action="store_true",
                  help="time the mma kernel's default only, not variants")
  ap.add_argument("--page-size", type=int, default=None,
                  help="pages of this many tokens instead of the specs'")
  ap.add_argument("--tag", default="", help="suffix of the results file")
  if extra_args is not None:
    extra_args(ap)
  args = ap.parse_args()
  env = _timing.environment()
  print(env, flush=True)
  specs = SPECS
  if args.specs:
    specs = [SPECS[int(i)] for i in args.specs.split(",")]
  if args.page_size:
    specs = [(*spec[:3], args.page_size) for spec in specs]
  device = env["device"].replace(" ", "_")
  name = f"{prefix}_{device}" + (f"_{args.tag}" if args.tag else "")
  rows = []
  for spec in specs:
    rows += speed_fn(spec, args)
    _timing.write_results(name, rows)
  print()
  _timing.print_table(rows, columns)


def main():
  run_main(
      "decode_mma",
      lambda spec, a: speed(spec, full=not a.default_only, with_tma=a.tma),
      ["spec", "impl", "kernel_ms", "tbps_kernel", "x_triton_kernel",
       "x_flashinfer_kernel", "x_flashinfer", "err_vs_triton"],
      lambda ap: ap.add_argument("--tma", action="store_true",
                                 help="time the TMA Mosaic kernel too"))


if __name__ == "__main__":
  main()
