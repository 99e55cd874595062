"""Paged decode: `pkvattn.paged_decode` against FlashInfer 0.7.2's decode on
the very same pages, with the copy and read roofs.

Run on a GPU:  `python -m bench.decode [--specs 0,4] [--fp8] [--layers 16]
[--backend triton,mma] [--call-overhead]`

Specs: `bench.common.specs.DECODE` (Llama-3-8B heads at four batch /
length / page shapes, SmolLM2, group 6 at head_dim 128, Gemma 3 270M;
`DECODE_EXTRA` by name or group, e.g. `--specs short`: the engine's short
contexts in a table sized for 1,024 tokens), every sequence at full length
on shuffled pages in FlashInfer's layout (pkvattn's "flashinfer" kv_cache
format), NaN in the spare pages and in table entries past a sequence's
pages, bf16.

Arms, each checked against the f32 reference (`impl="xla"` on f32 copies of
the same pages; rel err < 2e-2, 5e-2 on FP8 pages) before it is timed:

* `pkvattn`: `pkvattn.paged_decode(..., impl="pallas")`, the public call
  and its default kernel;
* `--backend A,B`: kernel arms of `bench.common.kernels.DECODE_ARMS`
  (forced backends, config grids);
* `flashinfer cuda cores` / `flashinfer tensor cores`:
  `BatchDecodeWithPagedKVCacheWrapper` (planned once, `run()` timed);
* `--xla`: `impl="xla"`, the jnp reference path.

Timing, per arm: `per_call_us`, the wall time a call adds to a stream of
back-to-back calls (`timing.pipelined_ms`); `kernel_us`, the summed GPU
kernel time of one call from a profiler trace (launch gaps and host time
out). `tbps` / `kernel_tbps`: bytes moved (q + touched K/V pages + out) per
time (with `--layers`, `kernel_tbps` per layer: every layer reads the same
pages, so where a layer's pages fit in L2 it can pass the HBM roof);
`x_flashinfer[_kernel]`: FlashInfer's faster mode's time / the arm's
(> 1: faster than FlashInfer).

Modes:

* `--fp8`: the pages quantized to float8_e4m3fn with per-tensor scales
  (amax / 448), every arm on the same FP8 bytes (FlashInfer with its
  `k_scale` / `v_scale`), plus `pkvattn per-head scales` (the same scales
  passed to the call as `[num_kv_heads]` vectors, as a model's parameters
  are: the cost of the per-head path) and
  `pkvattn bf16 pages` for `x_bf16_pages` (the FP8 arm's time / bf16
  pages' time).
* `--layers L`: decode as a model runs it: L layers in one program, each
  layer's q depending on the last layer's output (`q_l + 1e-3 *
  out_{l-1}`), one `jax.jit` for pkvattn and one CUDA graph for FlashInfer
  (`graph-L`; a Python loop, `loop-L`, beside it). Times per layer; also
  `span_us` (GPU time from the program's first kernel start to its last
  kernel end: launch gaps between kernels in, host time out).
* `--call-overhead`: what a lone call costs the host: `jax floor` (a
  trivial jitted program on the same arguments) and `pkvattn eager` (the
  bare op called outside any `jax.jit`, as in a user's Python loop)
  beside the arms, and
  `host_us`, the host's time per call of a loop of launches before its
  closing sync. A call is host-bound where host_us >= kernel_us.

Writes `<out>/decode[_fp8][_short][_layers|_call_overhead]_<device>.json`
(`_short`: every spec a short-context one); prints a table last.
"""

from __future__ import annotations

import os

# torch and jax share the GPU: no preallocation (set before jax loads).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import flashinfer as fi  # noqa: E402
from bench.common import results  # noqa: E402
from bench.common import specs as specs_lib  # noqa: E402
from bench.common import timing  # noqa: E402

DEP = 1e-3  # q_l' = q_l + DEP * out_{l-1} in a multi-layer program


def pkvattn_fn(fp8: bool):
  """The public call: `f(q, kv_cache, page_table, kv_lens[, k_scale,
  v_scale])`, the scales scalars or `[num_kv_heads]` vectors."""
  import pkvattn  # pylint: disable=import-outside-toplevel
  if fp8:
    return lambda q, c, t, n, ks, vs: pkvattn.paged_decode(
        q, c, t, n, impl="pallas", k_scale=ks, v_scale=vs)
  return lambda q, c, t, n: pkvattn.paged_decode(q, c, t, n, impl="pallas")


def kernel_arms(names, spec, fp8: bool):
  """`[(label, f)]` of the `--backend` arms in the public call's form."""
  if not names:
    return []
  from bench.common import kernels  # pylint: disable=import-outside-toplevel
  hq, hkv, d = spec.shape
  out = []
  for name in names:
    for label, f in kernels.decode_arms(
        name, batch_size=spec.batch_size, num_qo_heads=hq, num_kv_heads=hkv,
        head_dim=d, page_size=spec.page_size,
        max_pages=spec.max_pages,
        kv_dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16):
      if fp8:
        out.append((label, lambda q, c, t, n, ks, vs, f=f: f(
            q, c, t, n, k_scale=ks, v_scale=vs)))
      else:
        out.append((label, lambda q, c, t, n, f=f: f(q, c, t, n)))
  return out


def host_us(launch, sync, calls: int = 16) -> float:
  """Host time per `launch()` over `calls` back-to-back launches before
  their closing `sync`, us."""
  sync(launch())
  t0 = time.perf_counter()
  out = None
  for _ in range(calls):
    out = launch()
  dt = time.perf_counter() - t0
  sync(out)
  return dt / calls * 1e6


def layers_fn(call, num_layers: int, fp8: bool):
  """`f(q_stack, kv_cache, page_table, kv_lens, *scales) -> (out_0,
  out_{L-1})`: `num_layers` chained decode calls in one jit (returning the
  last output keeps every layer live)."""
  def f(qs, c, t, n, *scales):
    outs = []
    for layer in range(num_layers):
      q = qs[layer]
      if outs:
        q = (q.astype(jnp.float32)
             + DEP * outs[-1].astype(jnp.float32)).astype(qs.dtype)
      outs.append(call(q, c, t, n, *scales))
    return outs[0], outs[-1]
  del fp8
  return jax.jit(f)


def flashinfer_arms(q, kv, table, lens, spec, scales, num_layers: int):
  """`[(label, run, out)]`: FlashInfer's CUDA-core and tensor-core decode
  (`run()` one launch, `out` its first result as jax f32), or with
  `num_layers` the chained layers in a CUDA graph and a Python loop (`out`
  the first and last layer's outputs)."""
  import torch  # pylint: disable=import-outside-toplevel
  hq, hkv, _ = spec.shape
  ks, vs = scales or (None, None)
  arms = []
  for tc in (False, True):
    tag = "flashinfer " + ("tensor cores" if tc else "cuda cores")
    try:
      if not num_layers:
        run, out = fi.decode_fn(q, kv, table, lens, num_qo_heads=hq,
                                num_kv_heads=hkv, k_scale=ks, v_scale=vs,
                                use_tensor_cores=tc)
        arms.append((tag, run, out))
        continue
      qt, ct = fi.to_torch(q), fi.to_torch(kv)
      w = fi.decode_wrapper(kv, table, lens, num_qo_heads=hq,
                            num_kv_heads=hkv, q_dtype=qt.dtype,
                            use_tensor_cores=tc)
      kw = {} if ks is None else dict(k_scale=ks, v_scale=vs)

      def layers(w=w, qt=qt, ct=ct, kw=kw):
        outs = [w.run(qt[0], ct, **kw)]
        for layer in range(1, num_layers):
          outs.append(w.run(torch.add(qt[layer], outs[-1], alpha=DEP), ct,
                            **kw))
        return outs[0], outs[-1]

      side = torch.cuda.Stream()  # warm up off the capture stream
      side.wait_stream(torch.cuda.current_stream())
      with torch.cuda.stream(side):
        for _ in range(3):
          layers()
      torch.cuda.current_stream().wait_stream(side)
      torch.cuda.synchronize()
      graph = torch.cuda.CUDAGraph()
      with torch.cuda.graph(graph):
        static = layers()
      graph.replay()
      torch.cuda.synchronize()
      to_jax = lambda x: jnp.asarray(x.float().cpu().numpy())  # noqa: E731
      arms.append((f"{tag} graph-L", graph.replay,
                   tuple(to_jax(x) for x in static)))
      loop_out = layers()
      arms.append((f"{tag} loop-L", layers,
                   tuple(to_jax(x) for x in loop_out)))
    except Exception as e:  # noqa: BLE001  (no wheel, no JIT, no GPU)
      if not isinstance(e, ImportError):
        traceback.print_exc()
      print(f"  {tag}: skipped ({repr(e)[:200]})", flush=True)
  return arms


def run_spec(spec, args) -> list[dict]:
  hq, hkv, d = spec.shape
  layers = args.layers or 0
  fp8 = args.fp8
  q, kv, table, lens = specs_lib.decode_inputs(spec, num_layers=layers)
  jt, jl = jnp.asarray(table), jnp.asarray(lens)
  scales = None
  kv_timed = kv
  if fp8:
    kv_timed, ks, vs = specs_lib.fp8_pages(kv, table)
    scales = (ks, vs)
  scale_args = () if scales is None else tuple(jnp.float32(s) for s in scales)
  # Per-head scales are inputs, as a model's parameters are: each head the
  # per-tensor scale.
  head_args = () if scales is None else tuple(
      jnp.full((hkv,), s, jnp.float32) for s in scales)
  nbytes = specs_lib.decode_bytes(spec, 1 if fp8 else 2)
  q0 = q[0] if layers else q
  # The f32 reference on the pages the arms read (dequantized for FP8).
  import pkvattn  # pylint: disable=import-outside-toplevel
  ref_kv = kv_timed.astype(jnp.float32)
  if fp8:
    ref_kv = ref_kv * jnp.asarray([scales[0], scales[1]], jnp.float32)[
        None, :, None, None, None]
  ref = jax.jit(lambda q, c, t, n: pkvattn.paged_decode(
      q, c, t, n, impl="xla"))(q0.astype(jnp.float32), ref_kv, jt, jl)
  ref = jax.block_until_ready(ref)
  tol = 5e-2 if fp8 else 2e-2
  del ref_kv

  arms = [("pkvattn", pkvattn_fn(fp8))]
  arms += kernel_arms(args.backend, spec, fp8)
  if fp8:
    arms.append(("pkvattn per-head scales", pkvattn_fn(True)))
    arms.append(("pkvattn bf16 pages", pkvattn_fn(False)))
  if args.call_overhead:
    # The bare op as a user calls it in a Python loop (not under the
    # benchmark's jax.jit): the op's own one-program path.
    arms.append(("pkvattn eager", pkvattn_fn(fp8)))
  if args.xla:
    arms.append(("xla", lambda q, c, t, n, *s: pkvattn.paged_decode(
        q, c, t, n, impl="xla", **(dict(k_scale=s[0], v_scale=s[1])
                                   if s else {}))))
  rows = []
  iters, min_time_s = 20, 0.2

  def jax_row(label, call):
    bf16 = label == "pkvattn bf16 pages"
    a = ((q, kv, jt, jl) if bf16 else (q, kv_timed, jt, jl) + (
        head_args if label == "pkvattn per-head scales" else scale_args))
    f = (layers_fn(call if not bf16 else (lambda q, c, t, n, *s: call(
        q, c, t, n)), layers, fp8) if layers
         else call if label == "pkvattn eager" else jax.jit(call))
    out = f(*a)
    first = out[0] if layers else out
    t = timing.time_fn(f, *a, iters=iters, min_time_s=min_time_s)
    row = dict(spec=spec.name, impl=label,
               err=timing.rel_err(first, ref),
               per_call_us=t["median_ms"] * 1e3,
               kernel_us=timing.device_kernel_ms(f, lambda: a, calls=5) * 1e3)
    if layers:
      spans = timing.gpu_span_ms([lambda: f(*a)] * 5)
      row["span_us"] = float(np.median(spans)) * 1e3 if spans else None
      row["custom_calls"] = sum(" custom-call(" in ln for ln in f.lower(
          *a).compile().as_text().splitlines())
    if args.call_overhead:
      row["host_us"] = host_us(lambda: f(*a), jax.block_until_ready)
    return row

  for label, call in arms:
    try:
      rows.append(jax_row(label, call))
    except Exception:  # noqa: BLE001  (an arm that rejects the shape)
      traceback.print_exc()
      rows.append(dict(spec=spec.name, impl=label,
                       error=traceback.format_exc()[-600:]))
    print(rows[-1], flush=True)
  if args.call_overhead:
    floor = jax.jit(lambda q, c, t, n: q * 2)
    a = (q, kv_timed, jt, jl)
    t = timing.time_fn(floor, *a, iters=iters, min_time_s=min_time_s)
    rows.append(dict(spec=spec.name, impl="jax floor",
                     per_call_us=t["median_ms"] * 1e3,
                     kernel_us=timing.device_kernel_ms(
                         floor, lambda: a, calls=5) * 1e3,
                     host_us=host_us(lambda: floor(*a),
                                     jax.block_until_ready)))
  if not args.no_flashinfer:
    for label, run, out in flashinfer_arms(q, kv_timed, table, lens, spec,
                                           scales, layers):
      import torch  # pylint: disable=import-outside-toplevel
      first = out[0] if layers else out
      row = dict(spec=spec.name, impl=label,
                 err=timing.rel_err(first, ref),
                 per_call_us=fi.torch_time(run, iters=iters,
                                           min_time_s=min_time_s) * 1e3,
                 kernel_us=fi.kernel_ms(run, calls=5) * 1e3)
      if layers:
        spans = timing.gpu_span_ms(
            [lambda run=run: (run(), torch.cuda.synchronize())] * 5)
        row["span_us"] = float(np.median(spans)) * 1e3 if spans else None
      if args.call_overhead:
        row["host_us"] = host_us(run, lambda _: torch.cuda.synchronize())
      rows.append(row)
      print(row, flush=True)
  finish_rows(rows, spec, nbytes, layers, tol)
  return rows


def finish_rows(rows, spec, nbytes, layers, tol):
  """Correctness flags, bandwidths, per-layer times and ratios."""
  for r in rows:
    if "per_call_us" not in r:
      continue
    if r.get("err") is not None:
      r["correct"] = bool(r["err"] < tol) or r["impl"] == "pkvattn bf16 pages"
    if layers:
      r["layers"] = layers
      for k in ("per_call_us", "kernel_us", "span_us"):
        if r.get(k):
          r[k.replace("_us", "_us_per_layer")] = r[k] / layers
      if r.get("kernel_us") and r.get("correct"):
        r["kernel_tbps"] = nbytes / (r["kernel_us_per_layer"] * 1e-6) / 1e12
    elif r["impl"] != "jax floor" and r.get("correct"):
      r["tbps"] = nbytes / (r["per_call_us"] * 1e-6) / 1e12
      if r.get("kernel_us"):
        r["kernel_tbps"] = nbytes / (r["kernel_us"] * 1e-6) / 1e12
  peers = [r for r in rows if r["impl"].startswith("flashinfer")
           and r.get("correct") and (not layers or "graph" in r["impl"])]
  bf16 = next((r for r in rows if r["impl"] == "pkvattn bf16 pages"
               and r.get("kernel_us")), None)
  for r in rows:
    if "per_call_us" not in r or r["impl"] == "jax floor":
      continue
    if peers:
      r["x_flashinfer"] = min(p["per_call_us"] for p in peers) \
          / r["per_call_us"]
      if r.get("kernel_us") and all(p.get("kernel_us") for p in peers):
        r["x_flashinfer_kernel"] = min(p["kernel_us"] for p in peers) \
            / r["kernel_us"]
      if layers and r.get("span_us") and all(p.get("span_us")
                                             for p in peers):
        r["x_flashinfer_span"] = min(p["span_us"] for p in peers) \
            / r["span_us"]
    if bf16 and r.get("kernel_us") and r is not bf16:
      r["x_bf16_pages"] = r["kernel_us"] / bf16["kernel_us"]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--specs", default="",
                  help="comma-separated names or indices of "
                  "bench.common.specs.DECODE (+ DECODE_EXTRA by name or "
                  "group, e.g. short); default: all of DECODE")
  ap.add_argument("--fp8", action="store_true",
                  help="FP8 pages (per-tensor scales) for every arm")
  ap.add_argument("--layers", type=int, default=0,
                  help="L chained layers in one program (0: single calls)")
  ap.add_argument("--backend", default="",
                  help="comma-separated kernel arms: "
                  "triton, mma, triton-grid, mma-grid "
                  "(bench.common.kernels.DECODE_ARMS)")
  ap.add_argument("--call-overhead", action="store_true",
                  help="add a trivial jitted program and the host's "
                  "launch time per call")
  ap.add_argument("--xla", action="store_true",
                  help="also time impl='xla'")
  ap.add_argument("--no-flashinfer", action="store_true")
  ap.add_argument("--roof", action="store_true",
                  help="measure the copy roof (torch copy_, else XLA) and "
                  "the read-only roof (a reduction)")
  results.add_out_arg(ap)
  args = ap.parse_args(argv)
  args.backend = [b for b in args.backend.split(",") if b]
  if args.layers and args.call_overhead:
    ap.error("--layers and --call-overhead are separate modes")
  try:
    chosen = (specs_lib.select(specs_lib.DECODE, args.specs)
              if not args.specs or all(
                  p.isdigit() or p in {s.name for s in specs_lib.DECODE}
                  for p in args.specs.split(","))
              else specs_lib.select(specs_lib.DECODE
                                    + specs_lib.DECODE_EXTRA, args.specs))
  except ValueError as e:
    ap.error(str(e))
  env = results.environment()
  print(env, flush=True)
  # Short-context specs (tables wider than the sequences) get files of
  # their own beside the long-context ones.
  mode = ("_fp8" if args.fp8 else "") + (
      "_short" if all(s.table_pages for s in chosen) else "") + (
          "_layers" if args.layers else "") + (
              "_call_overhead" if args.call_overhead else "")
  name = f"decode{mode}_{results.device_tag()}"
  extra = dict(fi_versions=fi.versions(), layers=args.layers,
               backend_arms=args.backend)
  if args.roof:
    roof = timing.torch_copy_roof_gbps() or timing.copy_roof_gbps()
    extra["copy_roof_tbps"] = roof / 1e3
    read = timing.read_roof_gbps()
    extra["read_roof_tbps"] = {k: v and v / 1e3 for k, v in read.items()}
  rows = []
  for spec in chosen:
    print(spec.name, flush=True)
    rows += run_spec(spec, args)
    results.write(name, rows, out=args.out, extra=extra, env=env)
  cols = ["spec", "impl", "per_call_us", "kernel_us", "tbps", "kernel_tbps",
          "x_flashinfer", "x_flashinfer_kernel", "err"]
  if args.layers:
    cols = ["spec", "impl", "per_call_us_per_layer", "span_us_per_layer",
            "kernel_us_per_layer", "kernel_tbps", "x_flashinfer",
            "x_flashinfer_span",
            "x_flashinfer_kernel", "err"]
  if args.fp8:
    cols.insert(-1, "x_bf16_pages")
  if args.call_overhead:
    cols.insert(4, "host_us")
  print()
  timing.print_table(rows, cols)
  if args.roof:
    print(f"copy roof {extra['copy_roof_tbps']:.3f} TB/s, read roof "
          f"{extra['read_roof_tbps']['best']:.3f} TB/s")


if __name__ == "__main__":
  main()
