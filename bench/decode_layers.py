"""Paged decode as a model runs it: L layers back to back in one program,
pkvattn against FlashInfer 0.7.2, so per-call host launch cost is out.

Run on an H100 / H200:
  `python -m bench.decode_layers [--specs 0,llama3_8b_b8_s16384_p16]
  [--layers 16] [--out bench/results]`
CPU check of the pkvattn path only (Pallas interpret mode, a tiny spec,
batch 2, 2 layers):  `python -m bench.decode_layers --cpu-smoke`

Per spec of `bench_decode_mosaic.SPECS` (same pages, "flashinfer" kv_cache
format, so both libraries read the same buffers), with one q stack
`[L, batch_size, num_qo_heads, head_dim]` and the same dependency chain in
both libraries, `q_l' = q_l + 1e-3 * out_{l-1}` (one rounding to bf16), so
no layer can be dropped, merged or reordered:

* pkvattn jit-L: one `jax.jit` of L unrolled `paged_decode` calls (pkvattn's
  default routing, and the Triton kernel's default and `backend="mosaic"`
  as `bench_decode_mosaic`'s "mosaic default" where the default is not
  already that), timed by
  `_timing.time_fn` (one launch of the executable per call); kernel time by
  `_timing.device_kernel_ms` (every kernel of the program: attention,
  combine, the q add).
* flashinfer graph-L: the same L `run()` calls and adds captured once in a
  `torch.cuda.CUDAGraph` (planned once, outside the graph), timed by
  `graph.replay()` (`_flashinfer.torch_time`), kernel time by
  `_flashinfer.kernel_ms`; CUDA-core and tensor-core decode.
* flashinfer loop-L: the same L calls from a Python loop (reference).

Times are per layer: `per_layer_us` = the median time per program call / L (wall
time a call adds to a stream of back-to-back calls, `_timing.pipelined_ms`;
host launch included where it exceeds the GPU time);
`span_us_per_layer` = the GPU time from the program's first kernel start
to its last kernel end / L (`_timing.gpu_span_ms`: gaps between kernels
included, host time before the first kernel not); `kernel_us_per_layer` =
the summed kernel time / L. `x_flashinfer_graph[_span|_kernel]` = the
faster FlashInfer graph's per-layer time / the row's (> 1: faster than
FlashInfer). Layer 0 of every row is
checked against pkvattn's default (`err_vs_pkvattn`, rel err < 2e-2 for a
FlashInfer row to count), the last layer too (`err_last`); `custom_calls`
counts the custom calls in pkvattn's compiled HLO (>= L on a GPU: every
layer's kernel is there). Prints a table
last; writes `decode_layers_<device>.json` under `--out` (and `$OUT`).
"""

from __future__ import annotations

import os

# torch and jax share the GPU: no preallocation (set before jax loads).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import _flashinfer  # noqa: E402
from bench import _timing  # noqa: E402
from bench.bench_decode_mosaic import SHAPES  # noqa: E402
from bench.bench_decode_mosaic import SPECS  # noqa: E402
from bench.bench_decode_mosaic import _inputs  # noqa: E402
from bench.bench_decode_mosaic import _mosaic_config  # noqa: E402
from pkvattn import _kv  # noqa: E402
from pkvattn.pallas_kernels import paged_decode as kernel  # noqa: E402

DEP = 1e-3  # q_l' = q_l + DEP * out_{l-1}
SMOKE_SPEC = ("smollm2", 2, 64, 16)
NOTE = ("L decode layers in one program: pkvattn = one jax.jit of L unrolled "
        "paged_decode calls (time_fn per program call); FlashInfer = L "
        "BatchDecodeWithPagedKVCacheWrapper.run() calls in one CUDA graph "
        "(replay) or a Python loop; each layer's q = q_l + 1e-3 * out_{l-1}. "
        "per_layer_us = median program time / L; span_us_per_layer = GPU "
        "time from the program's first kernel start to its last kernel end "
        "/ L; kernel_us_per_layer = summed GPU kernel time of the program "
        "(profiler trace) / L.")


def spec_name(spec) -> str:
  shape, b, s, ps = spec
  return f"{shape}_b{b}_s{s}_p{ps}"


def layers_fn(cfg, *, head_dim, num_layers, interpret=False):
  """`f(q_stack, kv_cache, page_table, kv_lens) -> (out_0, out_{L-1})`: L
  chained `paged_decode` calls in one jit (returning the last output keeps
  every layer live; out_0 is the unchained layer, for the checks)."""
  def f(qs, kv, t, n):
    v = _kv.make_view(kv, t)  # one table for all layers, as a model has
    outs = []
    for l in range(num_layers):
      q = qs[l]
      if outs:
        q = (q.astype(jnp.float32)
             + DEP * outs[-1].astype(jnp.float32)).astype(qs.dtype)
      outs.append(kernel.paged_decode(
          q, v.k_pool, v.v_pool, v.k_table, v.v_table, n,
          sm_scale=head_dim ** -0.5, config=cfg, interpret=interpret)[0])
    return outs[0], outs[-1]
  return jax.jit(f)


def _custom_calls(f, *args) -> int | None:
  """Custom calls in `f`'s compiled HLO (>= L on a GPU: no layer dropped)."""
  try:
    return sum(" custom-call(" in line
               for line in f.lower(*args).compile().as_text().splitlines())
  except Exception:  # noqa: BLE001  (a check only)
    return None


def _span_ms(thunk, calls: int = 5):
  """Median GPU span of one program (`_timing.gpu_span_ms`), ms; None where
  the trace has no GPU lines."""
  spans = _timing.gpu_span_ms([thunk] * calls)
  return float(np.median(spans)) if spans else None


def pkvattn_rows(name, label, cfg, f, args, num_layers, ref, kernel_time=True):
  try:
    first, last = f(*args)
    t = _timing.time_fn(f, *args, iters=30, min_time_s=0.3)
    kt = (_timing.device_kernel_ms(f, lambda: args, calls=3)
          if kernel_time else 0.0)
    span = (_span_ms(lambda: f(*args)) if kernel_time else None)
    row = dict(spec=name, impl=label, config=str(cfg),
               per_layer_us=t["median_ms"] * 1e3 / num_layers,
               kernel_us_per_layer=kt * 1e3 / num_layers or None,
               span_us_per_layer=span and span * 1e3 / num_layers,
               program_ms=t["median_ms"], custom_calls=_custom_calls(f, *args))
    if ref is not None:
      row.update(err_vs_pkvattn=_timing.rel_err(first, ref[0]),
                 err_last=_timing.rel_err(last, ref[1]))
    return row, (first, last)
  except Exception:  # noqa: BLE001
    traceback.print_exc()
    return dict(spec=name, impl=label, config=str(cfg),
                error=traceback.format_exc()[-600:]), None


def flashinfer_rows(name, qs, kv, table, lens, hq, hkv, num_layers, ref):
  """FlashInfer graph-L and loop-L rows, CUDA-core and tensor-core decode."""
  import torch  # pylint: disable=import-outside-toplevel
  jax.block_until_ready((qs, kv))
  qt, ct = _flashinfer.to_torch(qs), _flashinfer.to_torch(kv)
  to_jax = lambda x: jnp.asarray(x.float().cpu().numpy())  # noqa: E731
  rows = []
  for tc in (False, True):
    tag = "flashinfer" + (" tc" if tc else "")
    try:
      w = _flashinfer.decode_wrapper(kv, table, lens, num_qo_heads=hq,
                                     num_kv_heads=hkv, q_dtype=qt.dtype,
                                     use_tensor_cores=tc)

      def layers(w=w):
        outs = [w.run(qt[0], ct)]
        for l in range(1, num_layers):
          outs.append(w.run(torch.add(qt[l], outs[-1], alpha=DEP), ct))
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
      for label, run in ((f"{tag} graph-L", graph.replay),
                         (f"{tag} loop-L", layers)):
        ms = _flashinfer.torch_time(run, iters=30, min_time_s=0.3)
        kt = _flashinfer.kernel_ms(run, calls=3)
        span = _span_ms(lambda run=run: (run(), torch.cuda.synchronize()))
        outs = static if "graph" in label else layers()
        torch.cuda.synchronize()
        rows.append(dict(
            spec=name, impl=label, per_layer_us=ms * 1e3 / num_layers,
            kernel_us_per_layer=kt * 1e3 / num_layers or None,
            span_us_per_layer=span and span * 1e3 / num_layers, program_ms=ms,
            err_vs_pkvattn=_timing.rel_err(to_jax(outs[0]), ref[0]),
            err_last=_timing.rel_err(to_jax(outs[1]), ref[1])))
        print(rows[-1], flush=True)
      del graph, static
    except Exception:  # noqa: BLE001
      traceback.print_exc()
      rows.append(dict(spec=name, impl=tag,
                       error=traceback.format_exc()[-600:]))
      print(rows[-1], flush=True)
  return rows


def run_spec(spec, num_layers, *, flashinfer=True, interpret=False):
  shape, b, s, ps = spec
  hq, hkv, d = SHAPES[shape]
  _, kv, table, lens = _inputs(hq, hkv, d, b, s, ps)
  qs = jax.random.normal(jax.random.key(1), (num_layers, b, hq, d),
                         jnp.bfloat16)
  args = (qs, kv, jnp.asarray(table), jnp.asarray(lens))
  name = spec_name(spec)
  # pkvattn's default routing (what paged_decode's config=None picks).
  default = kernel.Config.default_for(
      batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
      head_dim=d, group_size=hq // hkv, dtype=qs.dtype, kv_dtype=kv.dtype,
      interpret=interpret)
  runs = [("pkvattn default jit-L", default)]
  if not interpret:
    triton = kernel.Config.default_for(
        batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
        head_dim=d, backend="triton")
    mosaic = _mosaic_config(b, hkv, ps, s // ps, d)
    for label, cfg in (("pkvattn triton jit-L", triton),
                       ("pkvattn mosaic jit-L", mosaic)):
      if cfg != default:
        runs.append((label, cfg))
  rows, ref = [], None
  for label, cfg in runs:
    f = layers_fn(cfg, head_dim=d, num_layers=num_layers, interpret=interpret)
    row, outs = pkvattn_rows(name, label, cfg, f, args, num_layers, ref,
                             kernel_time=not interpret)
    if ref is None and outs is not None:
      ref = outs
      row.update(err_vs_pkvattn=0.0, err_last=0.0)
    rows.append(row)
    print(row, flush=True)
  if interpret and ref is not None:  # the chain, one jitted call per layer
    one = layers_fn(default, head_dim=d, num_layers=1, interpret=True)
    out = None
    for l in range(num_layers):
      q = qs[l:l + 1]
      if out is not None:
        q = (q.astype(jnp.float32)
             + DEP * out.astype(jnp.float32)).astype(q.dtype)
      out = one(q, *args[1:])[1]
    rows[0]["err_last_vs_per_call"] = _timing.rel_err(ref[1], out)
    print("jit-L last layer vs per-call chain, rel err:",
          rows[0]["err_last_vs_per_call"], flush=True)
  if flashinfer and ref is not None:
    rows += flashinfer_rows(name, qs, kv, table, lens, hq, hkv, num_layers, ref)
  fi = [r for r in rows if "graph-L" in r["impl"] and "per_layer_us" in r
        and r["err_vs_pkvattn"] < 2e-2]
  for r in rows:
    if fi and "per_layer_us" in r:
      r["x_flashinfer_graph"] = (min(x["per_layer_us"] for x in fi)
                                 / r["per_layer_us"])
      if r.get("span_us_per_layer") and all(
          x.get("span_us_per_layer") for x in fi):
        r["x_flashinfer_graph_span"] = (
            min(x["span_us_per_layer"] for x in fi) / r["span_us_per_layer"])
      if r.get("kernel_us_per_layer") and all(
          x.get("kernel_us_per_layer") for x in fi):
        r["x_flashinfer_graph_kernel"] = (
            min(x["kernel_us_per_layer"] for x in fi)
            / r["kernel_us_per_layer"])
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--specs", default=None,
                  help="comma-separated indices into bench_decode_mosaic.SPECS "
                  "or names like llama3_8b_b64_s4096_p16 (default: all)")
  ap.add_argument("--layers", type=int, default=None,
                  help="layers per program (default 16; 2 with --cpu-smoke)")
  ap.add_argument("--out", default="bench/results", help="results folder")
  ap.add_argument("--no-flashinfer", action="store_true")
  ap.add_argument("--cpu-smoke", action="store_true",
                  help=f"pkvattn only, interpret mode, spec {SMOKE_SPEC}; "
                  "writes no results")
  args = ap.parse_args()
  env = _timing.environment()
  print(env, flush=True)
  by_name = {spec_name(s): s for s in SPECS}
  layers = args.layers or (2 if args.cpu_smoke else 16)
  if args.cpu_smoke:
    rows = run_spec(SMOKE_SPEC, layers, flashinfer=False, interpret=True)
  else:
    specs = SPECS if not args.specs else [
        SPECS[int(x)] if x.isdigit() else by_name[x]
        for x in args.specs.split(",")]
    rows = []
    for spec in specs:
      rows += run_spec(spec, layers, flashinfer=not args.no_flashinfer)
      _timing.write_results(  # after every spec: so far
          f"decode_layers_{env['device'].replace(' ', '_')}", rows,
          extra=dict(note=NOTE, layers=layers), out_dirs=(args.out,))
  print()
  _timing.print_table(rows, ["spec", "impl", "per_layer_us",
                             "span_us_per_layer", "kernel_us_per_layer",
                             "x_flashinfer_graph", "x_flashinfer_graph_span",
                             "x_flashinfer_graph_kernel", "err_vs_pkvattn"])


if __name__ == "__main__":
  main()
