"""FP8 pages on the per-warp Mosaic-GPU decode kernel (`paged_decode_mma`)
beside the Triton FP8 default and FlashInfer 0.7.2's FP8 decode, in one
process (Hopper).

Run on an H100 / H200:  `python -m bench.decode_mma_fp8 [--specs 0,4]`

The nine decode specs of `bench_decode_mosaic` (four Llama-3-8B, two
SmolLM2, group 6 at head_dim 128, two Gemma 3 270M; every sequence at full
length, shuffled pages in the "flashinfer" format), their pages quantized
to float8_e4m3fn with per-tensor scales (amax / 448, `_kv.quantize`), so
that every implementation reads the very same FP8 bytes:

* `triton fp8 default`: the Triton kernel's FP8 default (column pairs);
* `mma fp8 ...`: the per-warp kernel on the FP8 pages, its default config
  and twice / half the splits and 32-key steps;
* `mma bf16 default`: the per-warp kernel on the unquantized bf16 pages
  (`fp8_over_bf16` is kernel time over this row's);
* FlashInfer's CUDA-core and tensor-core decode on the FP8 pages with the
  same scales.

Outputs are compared with the Triton FP8 kernel's (`err_vs_triton`,
relative L2). Times: GPU kernel time from one profiler trace
(`kernel_ms`, what the ratios use) and per call (`ms`). Prints a table
last; writes `bench/results/decode_mma_fp8_<device>[_tag].json` (and under
`$OUT`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_decode_mosaic import SHAPES, _inputs, decode_fn
from bench.bench_decode_mosaic import flashinfer_rows, timed_row
from bench.decode_mma import add_ratios, run_main
from pkvattn import _kv
from pkvattn.pallas_kernels import paged_decode as kernel

FP8 = jnp.float8_e4m3fn


def fp8_fn(cfg, *, head_dim):
  """Jitted `paged_decode` with `cfg` on FP8 pages in any kv_cache format:
  `f(q, kv_cache, page_table, kv_lens, k_scale, v_scale) -> out`."""
  def f(q, kv, t, n, ks, vs):
    v = _kv.make_view(kv, t)
    return kernel.paged_decode(q, v.k_pool, v.v_pool, v.k_table, v.v_table,
                               n, sm_scale=head_dim ** -0.5, config=cfg,
                               k_scale=ks, v_scale=vs)[0]
  return jax.jit(f)


def quantized(kv, table):
  """`kv [N, 2, page_size, H, D]` bf16 -> (FP8 pages, k_scale, v_scale):
  per-tensor scales from the amax of the pages `table` names."""
  used = jnp.asarray(np.unique(table))
  amax = [float(jnp.max(jnp.abs(kv[used, i].astype(jnp.float32))))
          for i in (0, 1)]
  ks, vs = (a / _kv.FP8_MAX for a in amax)
  kv8 = jnp.stack([_kv.quantize(kv[:, 0], ks), _kv.quantize(kv[:, 1], vs)],
                  axis=1)
  return kv8, ks, vs


def variants(base, d: int, full: bool):
  """(label, config) of the mma kernel runs: its FP8 default, then (with
  `full`) twice / half the splits, 16-key steps, 64-key steps (head_dim
  <= 128)."""
  out = [("mma fp8 default", base)]
  if not full:
    return out
  out.append(("mma fp8 splits x2",
              dataclasses.replace(base, k_splits=min(64, 2 * base.k_splits))))
  if base.k_splits > 1:
    out.append(("mma fp8 splits /2",
                dataclasses.replace(base, k_splits=base.k_splits // 2)))
  out.append(("mma fp8 tiles 1", dataclasses.replace(base, mma_tiles=1)))
  if d <= 128:
    out.append(("mma fp8 tiles 4", dataclasses.replace(base, mma_tiles=4)))
  return out


def speed(spec, *, full: bool):
  shape, b, s, ps = spec
  hq, hkv, d = SHAPES[shape]
  q, kv, table, lens = _inputs(hq, hkv, d, b, s, ps)
  kv8, ks, vs = quantized(kv, table)
  jt, jl = jnp.asarray(table), jnp.asarray(lens)
  jks, jvs = jnp.float32(ks), jnp.float32(vs)
  nbytes = 2 * b * hq * d * 2 + 2 * b * s * hkv * d
  name = f"{shape}_b{b}_s{s}_p{ps}"
  kw = dict(batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
            head_dim=d, group_size=hq // hkv, dtype=q.dtype)
  args8 = (q, kv8, jt, jl, jks, jvs)
  rows, ref = [], None
  triton = kernel.Config.default_for(**kw, kv_dtype=FP8, backend="triton")
  mma = kernel.Config.default_for(**kw, kv_dtype=FP8, backend="mosaic_mma")
  for label, cfg in [("triton fp8 default", triton)] + variants(mma, d, full):
    row, out = timed_row(dict(spec=name, impl=label, config=str(cfg)),
                         lambda cfg=cfg: fp8_fn(cfg, head_dim=d), args8,
                         nbytes, ref)
    rows.append(row)
    if ref is None:
      ref = out
  bf16 = kernel.Config.default_for(**kw, kv_dtype=q.dtype,
                                   backend="mosaic_mma")
  row, _ = timed_row(dict(spec=name, impl="mma bf16 default",
                          config=str(bf16)),
                     lambda: decode_fn(bf16, head_dim=d), (q, kv, jt, jl),
                     nbytes, ref)
  rows.append(row)
  rows += flashinfer_rows(name, q, kv8, table, lens, hq, hkv, nbytes, ref,
                          k_scale=ks, v_scale=vs)
  add_ratios(rows, "triton fp8 default", max_err=5e-2)
  bf16_ms = next((r.get("kernel_ms") for r in rows
                  if r["impl"] == "mma bf16 default"), None)
  for r in rows:
    if r.get("kernel_ms") and bf16_ms:
      r["fp8_over_bf16"] = r["kernel_ms"] / bf16_ms
  return rows


def main():
  run_main("decode_mma_fp8",
           lambda spec, a: speed(spec, full=not a.default_only),
           ["spec", "impl", "kernel_ms", "tbps_kernel", "x_triton_kernel",
            "x_flashinfer_kernel", "fp8_over_bf16", "err_vs_triton"])


if __name__ == "__main__":
  main()
