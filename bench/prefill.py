"""Paged prefill: `pkvattn.paged_prefill` against FlashInfer 0.7.2's FA3
prefill on the very same pages and cuDNN on contiguous K/V.

Run on a GPU:  `python -m bench.prefill [--specs main|window|d64|d256|fp8|
mixed|engine|NAME,...] [--window W] [--fp8] [--mixed] [--backend A,B]`

Specs: `bench.common.specs.PREFILL` (default: the "main" group: Llama-3-8B
prompts at pages 16 / 64, one 16,384-token prompt, a mixed engine step,
head_dim-64 prompts), causal, bf16, shuffled pages in FlashInfer's layout
with NaN spare pages. `--window W` runs every selected spec with
`window_left = W` (default: each spec's own).

Arms, each checked before it is timed (the last query tokens of sequence 0
against the f32 reference, `impl="xla"` on f32 copies of the pages, rel err
< 1e-2; peers against pkvattn's output):

* `pkvattn`: `pkvattn.paged_prefill(..., impl="pallas")`, the public call
  with its plan made inside (plan counted);
* `pkvattn plan reused`: the same with `plan=pkvattn.plan_prefill(...)`
  made once outside, as a model's layers share one plan per step;
* `--backend A,B`: kernel arms of `bench.common.kernels.PREFILL_ARMS`;
* `flashinfer fa3`: `BatchPrefillWithPagedKVCacheWrapper(backend="fa3")`,
  planned once, `run()` timed;
* `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` on
  contiguous K/V (prompts; a mixed step as two calls: the prompts, then
  the decode rows; no window).

Timing: `ROUNDS` interleaved rounds (the GPU's clocks drift), the best
round kept: `per_call_us` (wall time a call adds to a stream of
back-to-back calls, `timing.pipelined_ms`) and `gpu_us` (summed kernel
time from a profiler trace). `tflops[_kernel]`: `specs.prefill_flops` over
those times; `x_fa3[_kernel]`, `x_cudnn[_kernel]`: the peer's time / the
arm's (> 1: faster than the peer).

Modes:

* `--fp8`: pages quantized to float8_e4m3fn (per-tensor scales, amax /
  448), the pkvattn and kernel arms on FP8 bytes, `pkvattn bf16 pages`
  and FA3 on the bf16 pages beside them (default specs: the "fp8" group).
* `--mixed`: a mixed step (prompts and decode rows) by part: pkvattn on
  the prompts alone and on the decode rows alone (same pages), cuDNN's
  two calls apart, and each arm's GPU time per kernel name (default
  specs: the "mixed" group).

Writes `<out>/prefill[_fp8|_mixed][_<group>]_<device>.json` (the group
when `--specs` names one group: `prefill_window_<device>.json`); prints a
table last.
"""

from __future__ import annotations

import os

# torch and jax share the GPU: no preallocation (set before jax loads).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import flashinfer as fi  # noqa: E402
from bench.common import results  # noqa: E402
from bench.common import specs as specs_lib  # noqa: E402
from bench.common import timing  # noqa: E402

ROUNDS = 2
CHECK_TOKENS = 128


def public_fn(window_left: int, fp8: bool, plan: bool = False):
  """The public call `f(q, kv_cache, page_table, q_indptr, kv_lens[,
  k_scale, v_scale][, plan])`."""
  import pkvattn  # pylint: disable=import-outside-toplevel

  def f(q, c, t, qi, kl, *rest):
    kw = {}
    if fp8:
      kw.update(k_scale=rest[0], v_scale=rest[1])
      rest = rest[2:]
    if plan:
      kw["plan"] = rest[0]
    return pkvattn.paged_prefill(q, c, t, qi, kl, impl="pallas",
                                 causal=True, window_left=window_left, **kw)
  return f


def make_plan(spec, window_left, q_indptr, kv_lens, kv_dtype):
  import pkvattn  # pylint: disable=import-outside-toplevel
  hq, hkv, d = spec.shape
  kw = {} if kv_dtype == jnp.bfloat16 else dict(kv_dtype=kv_dtype)
  return jax.block_until_ready(jax.jit(lambda qi, kl: pkvattn.plan_prefill(
      qi, kl, num_tokens=spec.num_tokens, num_qo_heads=hq,
      num_kv_heads=hkv, head_dim=d, dtype=jnp.bfloat16, causal=True,
      window_left=window_left, **kw))(q_indptr, kv_lens))


def kernel_arms(names, spec, window_left, fp8):
  if not names:
    return []
  from bench.common import kernels  # pylint: disable=import-outside-toplevel
  hq, hkv, d = spec.shape
  out = []
  for name in names:
    for label, f in kernels.prefill_arms(
        name, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
        page_size=spec.page_size, num_tokens=spec.num_tokens,
        batch_size=len(spec.q_lens), window_left=window_left):
      if fp8:
        out.append((label, lambda q, c, t, qi, kl, ks, vs, f=f: f(
            q, c, t, qi, kl, k_scale=ks, v_scale=vs)))
      else:
        out.append((label, lambda q, c, t, qi, kl, f=f: f(q, c, t, qi, kl)))
  return out


def cudnn_fns(spec, inp, window_left, by_part: bool = False):
  """`[(label, f, args)]`: cuDNN on contiguous K/V, the prompts in one
  call and the one-token rows in another; a mixed step runs both in one
  program ("cudnn"), and with `by_part` each alone too."""
  if window_left >= 0:
    return []
  hq, _, d = spec.shape
  scale = d ** -0.5
  qi = inp["q_indptr"]
  prompts = [b for b, (ql, kl) in enumerate(zip(spec.q_lens, spec.kv_lens))
             if ql == kl]
  decodes = [b for b, ql in enumerate(spec.q_lens) if ql == 1]
  if len(prompts) + len(decodes) != len(spec.q_lens):
    return []
  out = []
  if prompts and len({spec.q_lens[b] for b in prompts}) == 1:
    s = spec.q_lens[prompts[0]]
    qp = jnp.concatenate([inp["q"][qi[b]:qi[b + 1]] for b in prompts]
                         ).reshape(len(prompts), s, hq, d)
    idx = jnp.asarray(prompts)
    out.append(("cudnn prompts", (qp, inp["k"][idx, :s], inp["v"][idx, :s]),
                True))
  if decodes and len({spec.kv_lens[b] for b in decodes}) == 1:
    n = spec.kv_lens[decodes[0]]
    qd = jnp.stack([inp["q"][qi[b]] for b in decodes])[:, None]
    idx = jnp.asarray(decodes)
    out.append(("cudnn decode rows", (qd, inp["k"][idx, :n],
                                      inp["v"][idx, :n]), False))
  fns = []
  for label, a, causal in out:
    fns.append((label, jax.jit(lambda q, k, v, causal=causal:
                               jax.nn.dot_product_attention(
                                   q, k, v, is_causal=causal, scale=scale,
                                   implementation="cudnn")), a))
  if len(fns) == 2:  # one step: both calls in one program
    (_, f1, a1), (_, f2, a2) = fns
    fns = [("cudnn", jax.jit(lambda *a: (f1(*a[:3]), f2(*a[3:]))),
            a1 + a2)] + (fns if by_part else [])
  elif fns and fns[0][0] == "cudnn prompts" and len(prompts) == len(
      spec.q_lens):
    fns = [("cudnn",) + fns[0][1:]]
  return fns


def sub_spec(spec, inp, rows_of):
  """The spec restricted to the sequences `rows_of` (same pages): `(spec',
  q, table, q_indptr, kv_lens)`."""
  idx = np.asarray(rows_of)
  qi = inp["q_indptr"]
  q = jnp.concatenate([inp["q"][qi[b]:qi[b + 1]] for b in idx])
  ql = tuple(spec.q_lens[b] for b in idx)
  kl = tuple(spec.kv_lens[b] for b in idx)
  sub = dataclasses.replace(spec, name=spec.name, q_lens=ql, kv_lens=kl)
  new_qi = np.concatenate([[0], np.cumsum(ql)]).astype(np.int32)
  return sub, q, inp["page_table"][idx], new_qi, np.asarray(kl, np.int32)


def run_spec(spec, args) -> tuple[list[dict], list[dict]]:
  hq, hkv, d = spec.shape
  w = spec.window_left if args.window is None else args.window
  fp8 = args.fp8
  inp = specs_lib.prefill_inputs(spec)
  kv = inp["kv_cache"]
  scales, kv_timed = (), kv
  if fp8:
    kv_timed, ks, vs = specs_lib.fp8_pages(kv, inp["page_table"])
    scales = (jnp.float32(ks), jnp.float32(vs))
  t, qi, kl = (jnp.asarray(inp["page_table"]), jnp.asarray(inp["q_indptr"]),
               jnp.asarray(inp["kv_lens"]))
  base = (inp["q"], kv_timed, t, qi, kl) + scales
  checks = []

  # Reference: sequence 0's last query tokens, f32, the pages the arms read.
  import pkvattn  # pylint: disable=import-outside-toplevel
  ql0 = spec.q_lens[0]
  n = min(CHECK_TOKENS, ql0)
  ref_kv = kv_timed.astype(jnp.float32)
  if fp8:
    ref_kv = ref_kv * jnp.asarray(scales, jnp.float32)[
        None, :, None, None, None]
  ref = jax.jit(lambda q, c, tt, qq, kk: pkvattn.paged_prefill(
      q, c, tt, qq, kk, impl="xla", causal=True, window_left=w))(
          inp["q"][ql0 - n:ql0].astype(jnp.float32), ref_kv, t[:1],
          jnp.asarray([0, n], jnp.int32), kl[:1])
  ref = jax.block_until_ready(ref)
  del ref_kv

  entries = []  # (label, jitted f or torch run, args, runtime)
  arms = [("pkvattn", public_fn(w, fp8))]
  arms += kernel_arms(args.backend, spec, w, fp8)
  outs = {}
  for label, call in arms:
    f = jax.jit(call)
    try:
      out = jax.block_until_ready(f(*base))
    except Exception as e:  # noqa: BLE001  (an arm that rejects the shape)
      traceback.print_exc()
      checks.append(dict(spec=spec.name, check=f"{label} runs", ok=False,
                         error=repr(e)[:300]))
      continue
    outs[label] = out
    err = timing.rel_err(out[ql0 - n:ql0], ref)
    checks.append(dict(spec=spec.name, check=f"{label} vs f32 reference",
                       rel_err=err, ok=err < 1e-2))
    entries.append((label, f, base, "jax"))
  want = outs.get("pkvattn")
  plan = make_plan(spec, w, qi, kl, kv_timed.dtype)
  entries.append(("pkvattn plan reused", jax.jit(public_fn(w, fp8, True)),
                  base + (plan,), "jax"))
  if fp8:
    entries.append(("pkvattn bf16 pages", jax.jit(public_fn(w, False)),
                    (inp["q"], kv, t, qi, kl), "jax"))
  for label, f, a in cudnn_fns(spec, inp, w, by_part=args.mixed):
    entries.append((label, f, a, "jax"))
  if args.mixed:
    prompts = [b for b, (q_, k_) in enumerate(zip(spec.q_lens, spec.kv_lens))
               if q_ > 1]
    rows1 = [b for b, q_ in enumerate(spec.q_lens) if q_ == 1]
    for label, part in (("pkvattn prompts alone", prompts),
                        ("pkvattn decode rows alone", rows1)):
      if part and len(part) < len(spec.q_lens):
        _, q, tt, pqi, pkl = sub_spec(spec, inp, part)
        entries.append((label, jax.jit(public_fn(w, fp8)),
                        (q, kv_timed, jnp.asarray(tt), jnp.asarray(pqi),
                         jnp.asarray(pkl)) + scales, "jax"))
  if not args.no_flashinfer:
    try:
      run, fa3_out = fi.prefill_fn(
          inp["q"], kv, inp["page_table"], inp["q_indptr"], inp["kv_lens"],
          num_qo_heads=hq, num_kv_heads=hkv, causal=True, sm_scale=d ** -0.5,
          backend="fa3", window_left=w)
      if want is not None:
        err = timing.rel_err(fa3_out, want)
        checks.append(dict(spec=spec.name, check="flashinfer fa3 vs pkvattn",
                           rel_err=err, ok=err < (1e-1 if fp8 else 1e-2)))
      entries.append(("flashinfer fa3" + (" bf16 pages" if fp8 else ""),
                      run, (), "torch"))
    except Exception as e:  # noqa: BLE001  (no wheel, no JIT, no GPU)
      if not isinstance(e, ImportError):
        traceback.print_exc()
      print(f"  flashinfer fa3: skipped ({repr(e)[:200]})", flush=True)

  timed = {}
  for _ in range(ROUNDS):
    for label, f, a, runtime in entries:
      try:
        if runtime == "torch":
          per_call = fi.torch_time(f, iters=10, min_time_s=0.1)
          gpu = fi.kernel_ms(f, calls=3)
        else:
          per_call = timing.time_fn(f, *a, iters=10,
                                    min_time_s=0.1)["median_ms"]
          gpu = timing.device_kernel_ms(f, lambda a=a: a, calls=3)
      except Exception:  # noqa: BLE001
        traceback.print_exc()
        continue
      timed.setdefault(label, []).append((per_call, gpu))
  flops = specs_lib.prefill_flops(spec, w)
  rows = []
  for label, f, a, runtime in entries:
    if label not in timed:
      continue
    per_call = min(x for x, _ in timed[label])
    gpu = min(x for _, x in timed[label])
    row = dict(spec=spec.name, heads="/".join(map(str, spec.shape)),
               window_left=w, impl=label, per_call_us=per_call * 1e3,
               gpu_us=gpu * 1e3 or None,
               round_per_call_us=[x * 1e3 for x, _ in timed[label]])
    if "alone" not in label and not label.startswith("cudnn "):
      # A whole call (not one part of a mixed step): its FLOPs.
      row["tflops"] = flops / (per_call * 1e-3) / 1e12
      if gpu:
        row["tflops_kernel"] = flops / (gpu * 1e-3) / 1e12
    if args.mixed and runtime == "jax":
      row["kernels_us"] = timing.kernel_breakdown_us(f, a, calls=5)
    rows.append(row)
    print(f"  {spec.name} {label:28s} {row['per_call_us']:9.1f} us per call"
          f" {row['gpu_us'] or 0:9.1f} us GPU", flush=True)
  for peer, tag in (("flashinfer fa3", "fa3"), ("cudnn", "cudnn")):
    p = next((r for r in rows if r["impl"] == peer), None)
    if fp8 and tag == "fa3":
      p = next((r for r in rows if r["impl"].startswith("flashinfer")), None)
    if p is None:
      continue
    for r in rows:
      if r is p or "tflops" not in r:
        continue
      r[f"x_{tag}"] = p["per_call_us"] / r["per_call_us"]
      if p.get("gpu_us") and r.get("gpu_us"):
        r[f"x_{tag}_kernel"] = p["gpu_us"] / r["gpu_us"]
  bf16 = next((r for r in rows if r["impl"] == "pkvattn bf16 pages"), None)
  if bf16 and bf16.get("gpu_us"):
    for r in rows:
      if r.get("gpu_us") and r is not bf16 and "tflops" in r:
        r["x_bf16_pages"] = r["gpu_us"] / bf16["gpu_us"]
  return rows, checks


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--specs", default="",
                  help="comma-separated spec names, indices or groups of "
                  "bench.common.specs.PREFILL (main, mixed, engine, window, "
                  "d64, d256, fp8; 'all'); default: main (fp8 with --fp8, "
                  "mixed with --mixed)")
  ap.add_argument("--window", type=int, default=None,
                  help="window_left for every spec (default: the spec's)")
  ap.add_argument("--fp8", action="store_true",
                  help="FP8 pages (per-tensor scales)")
  ap.add_argument("--mixed", action="store_true",
                  help="mixed steps by part, GPU time per kernel")
  ap.add_argument("--backend", default="",
                  help="comma-separated kernel arms: triton, mosaic, "
                  "per-sm, per-item, short-launch, fp8-in-kernel, "
                  "fp8-dequantize, triton-fp8-in-kernel "
                  "(bench.common.kernels.PREFILL_ARMS)")
  ap.add_argument("--no-flashinfer", action="store_true")
  results.add_out_arg(ap)
  args = ap.parse_args(argv)
  args.backend = [b for b in args.backend.split(",") if b]
  group = "fp8" if args.fp8 else "mixed" if args.mixed else "main"
  try:
    chosen = specs_lib.select(specs_lib.PREFILL, args.specs, group)
  except ValueError as e:
    ap.error(str(e))
  env = results.environment()
  print(env, flush=True)
  # One named group other than the mode's own names the file after it
  # (prefill_window_<device>.json); a list of specs does not.
  groups = {"main", "fp8", "mixed", "engine", "window", "d64", "d256"}
  tag = "" if args.specs in ("", "main") or args.specs not in groups \
      else f"_{args.specs}"
  mode = ("_fp8" if args.fp8 else "") + ("_mixed" if args.mixed else "")
  if tag in (mode, "_main"):
    tag = ""
  name = f"prefill{mode}{tag}_{results.device_tag()}"
  extra = dict(fi_versions=fi.versions(), backend_arms=args.backend,
               window_override=args.window,
               flops_convention="4 * head_dim * num_qo_heads * visible "
               "(query, key) pairs; 2 * S^2 * head_dim * num_qo_heads for a "
               "whole causal prompt")
  rows, checks = [], []
  for spec in chosen:
    print(spec.name, flush=True)
    try:
      r, c = run_spec(spec, args)
    except Exception as e:  # noqa: BLE001  (keep the other specs going)
      traceback.print_exc()
      r, c = [], [dict(spec=spec.name, check="spec runs", ok=False,
                       error=repr(e)[:400])]
    rows += r
    checks += c
    results.write(name, rows, out=args.out, extra=dict(extra, checks=checks),
                  env=env)
  for c in checks:
    if not c.get("ok"):
      print("CHECK FAILED", c)
  print()
  cols = ["spec", "impl", "per_call_us", "gpu_us", "tflops_kernel",
          "x_fa3", "x_fa3_kernel", "x_cudnn", "x_cudnn_kernel"]
  if args.fp8:
    cols.append("x_bf16_pages")
  timing.print_table(rows, cols)


if __name__ == "__main__":
  main()
