"""FP8 pages on the Mosaic-GPU decode kernel against the Triton FP8 default
and bf16 pages, in one process (Hopper).

Run on an H100 / H200:  `python -m bench.decode_mosaic_fp8 [--specs a,b]`

For each decode spec of `bench_decode.SPECS` (Llama-3-8B 32/8/128 at four
shapes, SmolLM2 9/3/64, group 6 at head_dim 128, Gemma 3 270M 4/1/256) and
the Llama-3.2-1B heads (32/8/64) of the engine benchmark, every sequence at
full length on shuffled pages in FlashInfer's layout, with per-tensor scales
(amax / 448):

* `bf16 default`: `pkvattn.paged_decode` on the bf16 pages;
* `fp8 default`: the same call on the FP8 pages (whatever the default route
  is);
* `fp8 mosaic ...`: `paged_decode` with `Config(backend="mosaic")` on the
  FP8 pages, its default (`Config.default_for(backend="mosaic")`, the
  keys in the wgmmas' M dimension: `Config.keys_m`) and variants: FP8
  staging depth, f16 stages, splits, the q rows in M instead, two CTAs
  per SM.

Each output is compared with the Triton FP8 kernel's (`err_vs_triton_fp8`,
relative L2; both read the same FP8 bytes). Times: GPU kernel time from a
profiler trace (`_timing.device_kernel_ms`, the number the comparisons
use) and per call (`_timing.time_fn`; a ~0.1 ms JAX call is host-bound).
`fp8_over_bf16` is kernel time over the bf16 default's. Prints a table
last; writes `bench/results/decode_mosaic_fp8_<device>.json` (and under
`$OUT`).
"""

from __future__ import annotations

import argparse
import dataclasses
import traceback
from unittest import mock

import jax
import jax.numpy as jnp

import pkvattn
from bench import _timing
from bench.bench_decode import SPECS
from bench.bench_fp8 import decode_inputs
from pkvattn import _kv
from pkvattn.pallas_kernels import paged_decode as kernel
from pkvattn.pallas_kernels import paged_decode_mgpu as mgpu

FP8 = jnp.float8_e4m3fn
LLAMA32_1B = (32, 8, 64)
EXTRA_SPECS = {
    "llama32_1b_decode_b256_s1024_p16": dict(batch_size=256, seq_len=1024,
                                             page_size=16, heads=LLAMA32_1B),
    "llama32_1b_decode_b64_s4096_p16": dict(batch_size=64, seq_len=4096,
                                            page_size=16, heads=LLAMA32_1B),
}


def _inputs(spec):
  """`bench_fp8.decode_inputs` with the scales as f32 scalars."""
  q, kv, kv8, table, lens, ks, vs = decode_inputs(spec)
  return q, kv, kv8, table, lens, jnp.float32(ks), jnp.float32(vs)


def _kernel_fn(cfg, d, fp8_stages=None, example=()):
  """`f(q, kv_cache, table, lens, k_scale, v_scale) -> out` on `cfg`; with
  `fp8_stages`, traced (on `example`) with that FP8 staging depth."""
  def f(q, kv, t, n, ks, vs):
    v = _kv.make_view(kv, t)
    return kernel.paged_decode(q, v.k_pool, v.v_pool, v.k_table, v.v_table,
                               n, sm_scale=d ** -0.5, config=cfg,
                               k_scale=ks, v_scale=vs)[0]
  jf = jax.jit(f)
  if fp8_stages is None:
    return jf
  # The depth is read at trace time only: trace once under the patch.
  with mock.patch.object(kernel, "_mosaic_fp8_stages", lambda *a: fp8_stages):
    jax.block_until_ready(jf(*example))
  return jf


def variants(d):
  """(label, Config overrides, FP8 staging depth or None for the default)
  of the Mosaic runs."""
  out = [("fp8 mosaic", {}, None),
         ("fp8 mosaic fp8st1", {}, 1),
         ("fp8 mosaic splits x2", dict(k_splits=2), None),
         # 64-key steps through deeper rings, one CTA per SM.
         ("fp8 mosaic keys_m bkv64 s4", dict(block=64, num_stages=4), None),
         # The q rows in the wgmmas' M dimension (the default puts the
         # keys there): 64-key steps at head_dim 128.
         ("fp8 mosaic rows in M", dict(keys_m=False), None),
         # 64-key steps and one FP8 stage leave room for 2 CTAs per SM.
         ("fp8 mosaic keys_m bkv64 2cta",
          dict(keys_m=True, block=64, ctas_per_sm=2), 1),
         ("fp8 mosaic keys_m bkv64 2cta splits x2",
          dict(keys_m=True, block=64, ctas_per_sm=2, k_splits=2), 1)]
  if d == 64:
    out += [("fp8 mosaic s3", dict(num_stages=3), None),
            ("fp8 mosaic fp8st2", {}, 2)]
  return out


def run_spec(name, spec, only=None):
  q, kv, kv8, table, lens, ks, vs = _inputs(spec)
  b, hq, d = q.shape
  hkv = kv.shape[3]
  ps, s = spec["page_size"], spec["seq_len"]
  rows = []
  f16 = jax.jit(lambda q, c, t, n: pkvattn.paged_decode(q, c, t, n,
                                                        impl="pallas"))
  f8 = jax.jit(lambda q, c, t, n, a, z: pkvattn.paged_decode(
      q, c, t, n, impl="pallas", k_scale=a, v_scale=z))
  triton8 = kernel.Config.default_for(
      batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
      head_dim=d, group_size=hq // hkv, dtype=q.dtype, kv_dtype=FP8,
      backend="triton")
  ref8 = _kernel_fn(triton8, d)(q, kv8, table, lens, ks, vs)
  k16 = _timing.device_kernel_ms(f16, lambda: (q, kv, table, lens), calls=5)
  t16 = _timing.time_fn(f16, q, kv, table, lens)["median_ms"]
  rows.append(dict(spec=name, impl="bf16 default", kernel_ms=k16, ms=t16,
                   fp8_over_bf16=None))
  runs = [("fp8 default", f8)]
  base = kernel.Config.default_for(
      batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
      head_dim=d, kv_dtype=FP8, backend="mosaic")
  if d <= 128:
    for label, over, st in variants(d):
      if only and label not in only:
        continue
      over = dict(over)
      if "k_splits" in over:
        over["k_splits"] = base.k_splits * over["k_splits"]
      if "ctas_per_sm" in over:
        over["num_ctas"] = over.pop("ctas_per_sm") * mgpu.num_sms()
      if "block" in over:
        over["pages_per_block"] = max(1, over.pop("block") // ps)
      cfg = dataclasses.replace(base, **over)
      runs.append((label, (cfg, st)))
  for label, fn in runs:
    try:
      if isinstance(fn, tuple):
        cfg, st = fn
        fn = _kernel_fn(cfg, d, st, (q, kv8, table, lens, ks, vs))
        config = f"{cfg} fp8_stages={st or 'auto'}"
      else:
        config = "default route"
      args = (q, kv8, table, lens, ks, vs)
      out = fn(*args)
      err = _timing.rel_err(out, ref8)
      k8 = _timing.device_kernel_ms(fn, lambda: args, calls=5)
      t8 = _timing.time_fn(fn, *args)["median_ms"]
      rows.append(dict(spec=name, impl=label, config=config, kernel_ms=k8,
                       ms=t8, fp8_over_bf16=k8 / k16,
                       err_vs_triton_fp8=err))
    except Exception:  # noqa: BLE001
      traceback.print_exc()
      rows.append(dict(spec=name, impl=label,
                       error=traceback.format_exc()[-800:]))
    print(rows[-1], flush=True)
  return rows


def main():
  ap = argparse.ArgumentParser()
  specs = {**SPECS, **EXTRA_SPECS}
  ap.add_argument("--specs", default=",".join(specs))
  ap.add_argument("--only", default=None,
                  help="comma-separated Mosaic variant labels (default: all)")
  args = ap.parse_args()
  env = _timing.environment()
  print(env, flush=True)
  rows = []
  dev = env["device"].replace(" ", "_")
  for name in args.specs.split(","):
    rows += run_spec(name, specs[name],
                     set(args.only.split(",")) if args.only else None)
    _timing.write_results(f"decode_mosaic_fp8_{dev}", rows)  # so far
  _timing.print_table(rows, ["spec", "impl", "kernel_ms", "ms",
                             "fp8_over_bf16", "err_vs_triton_fp8"])


if __name__ == "__main__":
  main()
