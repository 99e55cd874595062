"""Mosaic-GPU decode kernel (Hopper): correctness, then speed beside the
Triton kernel and FlashInfer 0.7.2 in one process.

Run on an H100 / H200:  `python -m bench.bench_decode_mosaic`

1. Correctness: `paged_decode` with `Config(backend="mosaic")` against the
   f64 dense oracle (`tests/attention_utils.dense_attention`) on
   NaN-poisoned caches (NaN in every page a sequence does not own and past
   `kv_len`): GQA groups 1..8, head_dim 64 / 128, pages 8..128, the three
   kv_cache formats, window / soft cap / sinks, one and several splits, kv
   lengths 0, 1, 7, 129, 4095. `--cp-async` checks every case again with
   the pages loaded by `cp.async` (`Config.cp_async`), whatever the page
   size.
2. Speed: the four Llama-3-8B decode specs (32/8/128) and the small-head
   shapes (SmolLM2 9/3/64; group 6 at head_dim 128; Gemma 3 270M 4/1/256),
   every sequence at full length, shuffled pages in the "flashinfer"
   format, so FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` reads the
   very same buffers. All
   three are timed the same way, per call (wall time per call of
   back-to-back calls, median: `_timing.time_fn` / `_flashinfer.torch_time`,
   `_timing.pipelined_ms`'s method) and by GPU kernel time from one profiler
   trace (`_timing.device_kernel_ms` / `_flashinfer.kernel_ms`). A lone
   jitted JAX call costs the host about 60-130 us to launch (H200,
   2026-11-26), so a call of less GPU time than that is host-bound per call;
   inside a model's jitted step that cost is paid once per step
   (`bench/decode_layers.py`). Outputs are compared first. FlashInfer runs
   both its CUDA-core and its tensor-core decode; `x_flashinfer` is against
   the faster of the two.

Bytes moved per call: q + touched K/V pages + out (bench_decode's count).
Prints a table last; writes `bench/results/decode_mosaic_<device>.json`
(and under `$OUT`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench import _flashinfer
from bench import _timing
from pkvattn import _kv
from pkvattn.pallas_kernels import paged_decode as kernel
from pkvattn.pallas_kernels import paged_decode_mgpu as mgpu

SHAPES = {"llama3_8b": (32, 8, 128), "smollm2": (9, 3, 64),
          "g6_d128": (48, 8, 128), "gemma3_270m": (4, 1, 256)}
SPECS = [
    ("llama3_8b", 64, 4096, 16), ("llama3_8b", 64, 4096, 64),
    ("llama3_8b", 8, 16384, 16), ("llama3_8b", 256, 1024, 16),
    ("smollm2", 64, 4096, 16), ("smollm2", 256, 1024, 16),
    ("g6_d128", 64, 4096, 16),
    ("gemma3_270m", 64, 4096, 16), ("gemma3_270m", 256, 1024, 16),
]


def _mosaic_config(b, hkv, ps, max_pages, d, **over):
  cfg = kernel.Config.default_for(batch_size=b, num_kv_heads=hkv,
                                  page_size=ps, max_pages=max_pages,
                                  head_dim=d, backend="mosaic")
  return dataclasses.replace(cfg, **over)


def correctness(over=None):
  """Oracle checks of the Mosaic kernel's default config, with `over`
  (e.g. `dict(cp_async=True)`) replaced in it."""
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
  import attention_utils as au  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(int(time.time()))
  cases = [  # (group, d, page_size, fmt, kw, k_splits[, num_ctas])
      (4, 128, 16, "pair", {}, 1, 3),   # several items per CTA
      (3, 64, 16, "pool", dict(window_left=300, sinks=True), 2, 1),
      (8, 64, 8, "flashinfer", dict(logits_soft_cap=30.0), None, 5),
      (1, 128, 16, "pair", {}, None),
      (2, 64, 8, "pool", {}, 2),
      (3, 64, 16, "flashinfer", {}, None),
      (3, 64, 16, "pair", dict(window_left=100), 4),
      (4, 128, 64, "flashinfer", dict(logits_soft_cap=30.0), None),
      (5, 128, 32, "pool", dict(sinks=True), None),
      (6, 128, 16, "pair", dict(window_left=37, sinks=True), 2),
      (7, 64, 128, "pair", {}, 4),
      (8, 128, 8, "pool", dict(window_left=1000, logits_soft_cap=20.0), 1),
      (8, 64, 64, "flashinfer", {}, 8),
  ]
  rows = []
  for dtype in (jnp.bfloat16, jnp.float16):
    for g, d, ps, fmt, kw, splits, *ctas in cases:
      if dtype == jnp.float16 and g not in (3, 8):
        continue
      hkv = 2
      kv_lens = [0, 1, 7, 129, 4095, ps, 3 * ps + 5]
      p = au.make_paged(rng, kv_lens, page_size=ps, num_kv_heads=hkv,
                        head_dim=d, dtype=dtype, fmt=fmt)
      hq = g * hkv
      qf = rng.standard_normal((len(kv_lens), hq, d)).astype(np.float32)
      qd = np.asarray(jnp.asarray(qf, dtype).astype(jnp.float32))
      kw = dict(kw)
      sinks = None
      if kw.pop("sinks", False):
        sinks = (rng.standard_normal(hq) * 2).astype(np.float32)
      view = _kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
      cfg = _mosaic_config(len(kv_lens), hkv, ps, view.k_table.shape[1], d)
      if splits:
        cfg = dataclasses.replace(cfg, k_splits=splits)
      if ctas:
        cfg = dataclasses.replace(cfg, num_ctas=ctas[0])
      if over:
        cfg = dataclasses.replace(cfg, **over)
      name = f"g{g} d{d} p{ps} {fmt} {kw} sinks={sinks is not None} {cfg}"
      try:
        out, lse = kernel.paged_decode(
            jnp.asarray(qd, dtype), view.k_pool, view.v_pool, view.k_table,
            view.v_table, jnp.asarray(p.kv_lens),
            None if sinks is None else jnp.asarray(sinks),
            sm_scale=d ** -0.5, config=cfg, **kw)
        ok, worst = True, 0.0
        for b, n in enumerate(kv_lens):
          exp, exp_lse = au.dense_attention(
              qd[b:b + 1], p.k[b], p.v[b], [n - 1], n, sm_scale=d ** -0.5,
              window_left=kw.get("window_left", -1),
              logits_soft_cap=kw.get("logits_soft_cap"), sinks=sinks)
          try:
            au.assert_close(out[b:b + 1], exp, dtype, f"b={b}")
            au.assert_lse_close(lse[b], exp_lse[0], dtype)
          except AssertionError as e:
            ok = False
            print("MISMATCH", name, b, n, str(e)[:300], flush=True)
          if n:
            worst = max(worst, _timing.rel_err(out[b:b + 1], exp))
        rows.append(dict(case=name, dtype=jnp.dtype(dtype).name, ok=ok,
                         worst_rel_err=worst))
      except Exception:  # noqa: BLE001
        traceback.print_exc()
        rows.append(dict(case=name, dtype=jnp.dtype(dtype).name, ok=False,
                         error=traceback.format_exc()[-600:]))
  return rows


def _inputs(hq, hkv, d, b, s, ps, seed=0):
  pages_per_seq = s // ps
  n_pages = b * pages_per_seq + 8
  kk, kq, kp = jax.random.split(jax.random.key(seed), 3)
  kv = jax.random.normal(kk, (n_pages, 2, ps, hkv, d), jnp.bfloat16)
  perm = np.asarray(jax.random.permutation(kp, n_pages)).astype(np.int32)
  table = perm[:b * pages_per_seq].reshape(b, pages_per_seq)
  kv = kv.at[perm[b * pages_per_seq:]].set(jnp.nan)  # spare pages: unread
  q = jax.random.normal(kq, (b, hq, d), jnp.bfloat16)
  return q, kv, table, np.full((b,), s, np.int32)


def decode_fn(cfg, *, head_dim):
  """Jitted `paged_decode` with `cfg` on a cache in any kv_cache format:
  `f(q, kv_cache, page_table, kv_lens) -> out`."""
  def f(q, kv, t, n):
    v = _kv.make_view(kv, t)
    return kernel.paged_decode(q, v.k_pool, v.v_pool, v.k_table, v.v_table,
                               n, sm_scale=head_dim ** -0.5, config=cfg)[0]
  return jax.jit(f)


def speed(spec, configs):
  shape, b, s, ps = spec
  hq, hkv, d = SHAPES[shape]
  q, kv, table, lens = _inputs(hq, hkv, d, b, s, ps)
  jt, jl = jnp.asarray(table), jnp.asarray(lens)
  nbytes = 2 * b * hq * d * 2 + 2 * b * s * hkv * d * 2
  name = f"{shape}_b{b}_s{s}_p{ps}"
  rows = []

  fn_for = functools.partial(decode_fn, head_dim=d)

  triton = kernel.Config.default_for(batch_size=b, num_kv_heads=hkv,
                                     page_size=ps, max_pages=s // ps,
                                     head_dim=d, backend="triton")
  ref = fn_for(triton)(q, kv, jt, jl)
  runs = [("triton default", triton)] + [
      (label, _mosaic_config(b, hkv, ps, s // ps, d, **over))
      for label, over in configs(d)]
  for label, cfg in runs:
    row, _ = timed_row(dict(spec=name, impl=label, config=str(cfg)),
                       lambda cfg=cfg: fn_for(cfg), (q, kv, jt, jl), nbytes,
                       ref)
    rows.append(row)
  rows += flashinfer_rows(name, q, kv, table, lens, hq, hkv, nbytes, ref)
  # > 1: faster than FlashInfer's faster mode on this spec, per call and
  # by kernel time (per call, a ~0.1 ms JAX call is host-bound).
  fi = [r for r in rows if r["impl"].startswith("flashinfer")
        and "ms" in r and r["err_vs_triton"] < 2e-2]
  for r in rows:
    if fi and "ms" in r:
      r["x_flashinfer"] = min(x["ms"] for x in fi) / r["ms"]
      if r.get("kernel_ms") and all(x.get("kernel_ms") for x in fi):
        r["x_flashinfer_kernel"] = (min(x["kernel_ms"] for x in fi)
                                    / r["kernel_ms"])
  return rows


def timed_row(row, make_fn, args, nbytes, ref):
  """`row` plus the per-call time (`ms`, `_timing.time_fn`) and GPU kernel
  time (`kernel_ms`, `_timing.device_kernel_ms`) of the jitted function
  `make_fn()` on `args`, GB/s of both (`tbps`, `tbps_kernel`) for `nbytes`
  moved, and its output's error against `ref` (`err_vs_triton`; None: its
  own). Returns `(row, output)`, or an `error` row and None where it
  fails."""
  try:
    f = make_fn()
    out = f(*args)
    err = _timing.rel_err(out, out if ref is None else ref)
    t = _timing.time_fn(f, *args, iters=30, min_time_s=0.3)
    kt = _timing.device_kernel_ms(f, lambda: args, calls=5)
    row = dict(row, ms=t["median_ms"], kernel_ms=kt,
               tbps=nbytes / t["median_ms"] / 1e9,
               tbps_kernel=nbytes / kt / 1e9, err_vs_triton=err)
  except Exception:  # noqa: BLE001
    traceback.print_exc()
    row, out = dict(row, error=traceback.format_exc()[-600:]), None
  print(row, flush=True)
  return row, out


def flashinfer_rows(name, q, kv, table, lens, hq, hkv, nbytes, ref,
                    **scales):
  """FlashInfer 0.7.2's CUDA-core and tensor-core decode on the same pages
  (FP8 ones with `k_scale=` / `v_scale=` floats): per-call and kernel time,
  GB/s (`tbps`, `tbps_kernel`), error against `ref` (one row each; an
  `error` row where it fails)."""
  rows = []
  for tc in (False, True):
    label = "flashinfer 0.7.2" + (" tc" if tc else "")
    try:
      run, out = _flashinfer.decode_fn(q, kv, table, lens, num_qo_heads=hq,
                                       num_kv_heads=hkv, use_tensor_cores=tc,
                                       **scales)
      ms = _flashinfer.torch_time(run, iters=30, min_time_s=0.3)
      km = _flashinfer.kernel_ms(run, calls=5)
      rows.append(dict(spec=name, impl=label, ms=ms, tbps=nbytes / ms / 1e9,
                       kernel_ms=km, tbps_kernel=nbytes / km / 1e9,
                       err_vs_triton=_timing.rel_err(out, ref)))
    except Exception:  # noqa: BLE001
      traceback.print_exc()
      rows.append(dict(spec=name, impl=label,
                       error=traceback.format_exc()[-600:]))
    print(rows[-1], flush=True)
  return rows


def _configs(d):
  """Mosaic variants timed besides its default."""
  out = [("mosaic default", {}),
         # Pages by one TMA copy each / by cp.async (the default decides
         # by page size).
         ("mosaic tma", dict(cp_async=False)),
         ("mosaic cp_async", dict(cp_async=True)),
         # Keys in the wgmmas' M dimension.
         ("mosaic keys_m", dict(keys_m=True)),
         # 64-key steps leave room for 2 (3) CTAs per SM.
         ("mosaic keys_m bkv64 2cta", dict(keys_m=True, pages_per_block=-64,
                                           ctas_per_sm=2)),
         ("mosaic keys_m bkv64 2cta splits x2",
          dict(keys_m=True, pages_per_block=-64, ctas_per_sm=2, k_splits=2))]
  if d == 64:
    out += [("mosaic keys_m bkv64 3cta",
             dict(keys_m=True, pages_per_block=-64, ctas_per_sm=3))]
  # More or fewer splits (items per persistent CTA), other rings.
  out += [("mosaic splits x2", dict(k_splits=2)),
          ("mosaic splits x4", dict(k_splits=4)),
          ("mosaic splits /2", dict(k_splits=0))]
  # Other rings (at head_dim 256 only 64-key steps in 2 stages fit with the
  # q rows in M).
  if d == 128:
    out += [("mosaic bkv64 s3", dict(pages_per_block=-64, num_stages=3))]
  elif d == 256:
    # keys_m's 16-row q and output tiles leave room for a third stage.
    out += [("mosaic keys_m s3", dict(keys_m=True, num_stages=3)),
            ("mosaic keys_m s3 splits /2",
             dict(keys_m=True, num_stages=3, k_splits=0))]
  elif d == 64:
    out += [("mosaic s2", dict(num_stages=2)),
            ("mosaic s5", dict(num_stages=5)),
            ("mosaic bkv64 s6", dict(pages_per_block=-64, num_stages=6))]
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--skip-correctness", action="store_true")
  ap.add_argument("--skip-speed", action="store_true")
  ap.add_argument("--cp-async", action="store_true",
                  help="check the cp.async page loads against the oracle "
                       "too")
  ap.add_argument("--specs", default=None,
                  help="comma-separated indices into SPECS (default: all)")
  ap.add_argument("--default-only", action="store_true",
                  help="time the Mosaic default only, not its variants")
  ap.add_argument("--only", default=None,
                  help="comma-separated variant labels to time besides the "
                       "Mosaic default (default: all)")
  args = ap.parse_args()
  env = _timing.environment()
  print(env, flush=True)
  corr = [] if args.skip_correctness else correctness()
  if args.cp_async:
    corr += [dict(r, case="cp_async " + r["case"])
             for r in correctness(dict(cp_async=True))]
  device = env["device"].replace(" ", "_")
  rows = []
  specs = [] if args.skip_speed else SPECS
  if args.specs and not args.skip_speed:
    specs = [SPECS[int(i)] for i in args.specs.split(",")]
  for spec in specs:
    shape, b, s, ps = spec
    hq, hkv, d = SHAPES[shape]

    def configs(d, b=b, hkv=hkv, ps=ps, s=s):
      base = _mosaic_config(b, hkv, ps, s // ps, d)
      res = []
      only = set(args.only.split(",")) if args.only else None
      for label, over in _configs(d)[:1 if args.default_only else None]:
        if only and label != "mosaic default" and label not in only:
          continue
        over = dict(over)
        if "ctas_per_sm" in over:
          over["num_ctas"] = over.pop("ctas_per_sm") * mgpu.num_sms()
        if over.get("pages_per_block") == -64:
          over["pages_per_block"] = max(1, 64 // ps)
        if over.get("k_splits") in (2, 4):
          over["k_splits"] = min(64, base.k_splits * over["k_splits"])
        elif over.get("k_splits") == 0:
          if base.k_splits == 1:
            continue
          over["k_splits"] = base.k_splits // 2
        res.append((label, over))
      return res
    rows += speed(spec, configs)
    _timing.write_results(f"decode_mosaic_{device}", rows,  # so far
                          extra=dict(correctness=corr))
  _timing.write_results(f"decode_mosaic_{device}", rows,
                        extra=dict(correctness=corr))
  print()
  if corr:
    _timing.print_table(corr, ["case", "dtype", "ok", "worst_rel_err"])
  if rows:
    _timing.print_table(rows, ["spec", "impl", "ms", "kernel_ms", "tbps",
                               "x_flashinfer", "x_flashinfer_kernel",
                               "err_vs_triton"])


if __name__ == "__main__":
  main()
