"""The prefill plan's longest-first order: a sort against a rank count.

`plan.order_by_work` puts the plan's tiles in descending work. Up to
`plan.RANK_MAX_ROWS` rows it counts, for every row, the rows that go before
it and scatters each row to its rank (and `plan.prefix_sum` sums by
comparing all pairs); above, it sorts (`jnp.argsort`, `jnp.cumsum`). This
bench runs both in one process (the sort arm by tracing with
`RANK_MAX_ROWS = 0`), on head_dim-64 prompts of 256 / 512 / 1,024 tokens
(64 / 32 / 16 sequences, SmolLM2's 9/3/64 heads, page 16, bf16), and on
a mixed step of 4 prompts of 512 tokens and 124 decode rows at 2,048 keys:

* the plan alone, and a call with it: GPU time per kernel
  (`jax.profiler` trace, launch gaps excluded); the two plans, and the
  two calls' outputs, checked equal;
* `paged_prefill` with its default config, the plan computed in the call
  (plan counted) and passed in (plan reused): per-call time
  (`_timing.time_fn`) and GPU time, in `ROUNDS` interleaved rounds;
* FlashInfer 0.7.2's FA3 prefill on the same pages (`run` only; its plan is
  host work), timed the same way, when the wheel is installed; its output
  checked against ours.

Writes `bench/results/prefill_plan_<device>.json` and prints a table last.

  python -m bench.prefill_plan [--specs causal_b64_s256,...]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from bench import _flashinfer  # noqa: E402
from bench import _timing  # noqa: E402
from bench import bench_prefill as bp  # noqa: E402
from pkvattn.pallas_kernels import paged_prefill as pp  # noqa: E402
from pkvattn.pallas_kernels import plan as plan_lib  # noqa: E402

# (name, q_lens, kv_lens)
SPECS = [(f"causal_b{b}_s{s}", [s] * b, [s] * b)
         for b, s in ((64, 256), (32, 512), (16, 1024))]
SPECS.append(("mixed_4x512_124x2048", [512] * 4 + [1] * 124,
              [512] * 4 + [2048] * 124))
ROUNDS = 3
CALLS = 5


@contextlib.contextmanager
def ordered_by(order: str):
  """Traces inside use `order` ("sort" or "rank") for the plan's order."""
  before = plan_lib.RANK_MAX_ROWS
  plan_lib.RANK_MAX_ROWS = 0 if order == "sort" else before
  try:
    yield
  finally:
    plan_lib.RANK_MAX_ROWS = before


def spec_args(q_lens, kv_lens, heads):
  """A causal page-16 spec (`bench_prefill.build_spec`) and the arguments
  `(q, pool, k_table, v_table, q_indptr, kv_lens)` of a call on it."""
  sp = bp.build_spec(jax.random.key(0), q_lens, kv_lens, 16, heads)
  return sp, (sp["q"], sp["pool"], sp["k_table"], sp["v_table"],
              sp["q_indptr"], sp["kv_lens"])


def default_setup(q_lens, kv_lens, heads, window_left: int = -1):
  """`spec_args` and the default config of a call on it: `(sp, args, cfg,
  num_tokens)`."""
  hq, hkv, d = heads
  num_tokens = int(sum(q_lens))
  sp, args = spec_args(q_lens, kv_lens, heads)
  cfg = pp.Config.default_for(group_size=hq // hkv, head_dim=d,
                              page_size=16, dtype=jnp.bfloat16,
                              window_left=window_left,
                              num_tokens=num_tokens, batch_size=len(q_lens))
  return sp, args, cfg, num_tokens


def run_spec(name, q_lens, kv_lens, rows, checks):
  heads = bp.SMOLLM2
  hq, hkv, d = heads
  sm_scale = 1 / math.sqrt(d)
  num_tokens = int(sum(q_lens))
  sp, args = spec_args(q_lens, kv_lens, heads)
  cfg = pp.Config.default_for(group_size=hq // hkv, head_dim=d, page_size=16,
                              dtype=jnp.bfloat16)

  def call(q, pool, kt, vt, qi, kl, plan=None):
    return pp.paged_prefill(q, pool, pool, kt, vt, qi, kl, None, causal=True,
                            sm_scale=sm_scale, config=cfg, plan=plan)[0]

  entries, plans, outs = [], {}, {}
  for order in ("sort", "rank"):
    # Compiled ahead, after clearing the trace caches: `paged_prefill` is a
    # jitted function, and a cached trace of the other order would serve.
    jax.clear_caches()
    with ordered_by(order):
      plan_fn = jax.jit(lambda qi, kl: cfg.plan(
          qi, kl, num_tokens=num_tokens, causal=True,
          window_left=-1)).lower(*args[4:]).compile()
      plans[order] = jax.block_until_ready(plan_fn(*args[4:]))
      counted = jax.jit(call).lower(*args).compile()
      reused = jax.jit(call).lower(*args, plans[order]).compile()
    outs[order] = jax.block_until_ready(counted(*args))
    rows.append(dict(spec=name, impl=f"plan alone, {order}",
                     kernels_us=_timing.kernel_breakdown_us(
                         plan_fn, args[4:], CALLS)))
    rows.append(dict(spec=name, impl=f"call, plan counted, {order}",
                     kernels_us=_timing.kernel_breakdown_us(
                         counted, args, CALLS)))
    entries += [(f"pkvattn default, plan counted, {order}", counted, args),
                (f"pkvattn default, plan reused, {order}", reused,
                 args + (plans[order],))]
  same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
      jax.tree.leaves(plans["sort"]), jax.tree.leaves(plans["rank"])))
  checks.append(dict(spec=name, check="rank plan == sort plan", ok=same))
  same_out = np.array_equal(np.asarray(outs["sort"], np.float32),
                            np.asarray(outs["rank"], np.float32))
  checks.append(dict(spec=name, check="outputs equal", ok=same_out))
  fi_run = fa3_run(name, sp, heads, outs["rank"], checks)
  time_rounds(name, entries, fi_run, rows)


def fa3_run(name, sp, heads, want, checks, *, window_left: int = -1,
            against: str = "pkvattn"):
  """FlashInfer 0.7.2's FA3 prefill (causal, page 16, `window_left`) on
  `sp`'s pages, its output checked against `want` (a check row
  "flashinfer fa3 vs <against>" in `checks`): its `run`, or None without
  the wheel (or its JIT)."""
  hq, hkv, d = heads
  try:
    cache, table = bp.flashinfer_cache(sp, 16)
    fi_run, fi_out = _flashinfer.prefill_fn(
        sp["q"], cache, table, np.asarray(sp["q_indptr"]),
        np.asarray(sp["kv_lens"]), num_qo_heads=hq, num_kv_heads=hkv,
        causal=True, sm_scale=1 / math.sqrt(d), backend="fa3",
        window_left=window_left)
  except Exception as e:  # noqa: BLE001  (no flashinfer wheel, no JIT)
    if not isinstance(e, ImportError):
      traceback.print_exc()
    print(f"  {name} flashinfer fa3: skipped ({repr(e)[:200]})")
    return None
  err = _timing.rel_err(fi_out, want)
  checks.append(dict(spec=name, check=f"flashinfer fa3 vs {against}",
                     rel_err=err, ok=err < 1e-2))
  return fi_run


def time_rounds(name, entries, fi_run, rows):
  """Times each `(impl, fn, args)` entry and FA3's `fi_run` (may be None)
  per call and by GPU time in `ROUNDS` interleaved rounds (the best round
  each), appends a row per impl to `rows` (with the speed of FA3 against
  it), and prints the spec's rows (breakdown rows too)."""
  timed = {}
  for _ in range(ROUNDS):  # interleaved: the GPU's clocks drift
    for impl, fn, fargs in entries:
      t = _timing.time_fn(fn, *fargs, iters=10, min_time_s=0.1)
      k = _timing.device_kernel_ms(fn, lambda fargs=fargs: fargs, calls=3)
      timed.setdefault(impl, []).append((t["median_ms"], k))
    if fi_run is not None:
      timed.setdefault("flashinfer fa3", []).append(
          (_flashinfer.torch_time(fi_run, iters=10, min_time_s=0.1),
           _flashinfer.kernel_ms(fi_run, calls=3)))
  for impl, ts in timed.items():
    per_call = min(t for t, _ in ts)
    rows.append(dict(spec=name, impl=impl, per_call_us=1e3 * per_call,
                     gpu_us=1e3 * min(k for _, k in ts),
                     round_per_call_us=[1e3 * t for t, _ in ts]))
  fa3 = next((r for r in rows if r["spec"] == name and
              r["impl"] == "flashinfer fa3"), None)
  for r in rows:
    if r["spec"] != name:
      continue
    if "kernels_us" in r:
      r["gpu_us"] = sum(r["kernels_us"].values())
      r["kernels"] = len(r["kernels_us"])
    elif fa3 is not None:
      r["fa3_over_ours"] = fa3["per_call_us"] / r["per_call_us"]
      r["fa3_over_ours_gpu"] = fa3["gpu_us"] / r["gpu_us"]
    print(f"  {name} {r['impl']:40s} per call "
          f"{r.get('per_call_us', float('nan')):7.1f} us  GPU "
          f"{r['gpu_us']:7.1f} us", flush=True)


def compile_arm(name, arm, cfg, args, rows, *, num_tokens: int,
                sm_scale: float, window_left: int = -1):
  """One arm of a config comparison: `paged_prefill` with `cfg` on `args`
  (`spec_args`'s), compiled after `jax.clear_caches()` with the plan
  counted and reused; appends the counted call's per-kernel GPU time to
  `rows`. Returns (its output, its two `time_rounds` entries)."""
  def call(q, pool, kt, vt, qi, kl, plan=None):
    return pp.paged_prefill(q, pool, pool, kt, vt, qi, kl, None, causal=True,
                            sm_scale=sm_scale, window_left=window_left,
                            config=cfg, plan=plan)[0]

  jax.clear_caches()
  plan = jax.block_until_ready(jax.jit(lambda qi, kl: cfg.plan(
      qi, kl, num_tokens=num_tokens, causal=True,
      window_left=window_left))(*args[4:]))
  counted = jax.jit(call).lower(*args).compile()
  reused = jax.jit(call).lower(*args, plan).compile()
  out = jax.block_until_ready(counted(*args))
  rows.append(dict(spec=name, impl=f"call, plan counted, {arm}",
                   kernels_us=_timing.kernel_breakdown_us(counted, args,
                                                          CALLS)))
  return out, [(f"pkvattn, {arm}, plan counted", counted, args),
               (f"pkvattn, {arm}, plan reused", reused, args + (plan,))]


def selected_specs(specs, description: str):
  """The specs (tuples led by their name) that the command line's
  `--specs` names (comma-separated; default all); an argparse error for a
  name not among them."""
  ap = argparse.ArgumentParser(description=description)
  ap.add_argument("--specs", default="",
                  help="comma-separated spec names (default: all)")
  want = [x for x in ap.parse_args().specs.split(",") if x]
  unknown = set(want) - {spec[0] for spec in specs}
  if unknown:
    ap.error(f"unknown --specs {sorted(unknown)}")
  return [spec for spec in specs if not want or spec[0] in want]


def run_specs(prefix: str, specs, run_spec, description: str):
  """A bench's command line (`--specs` names, default all) over `specs`
  (tuples led by their name; `run_spec(*spec, rows=..., checks=...)` runs
  one):
  results written to `bench/results/<prefix>_<device>.json` after every
  spec (a run cut short keeps what it measured), failed checks and a
  table printed last."""
  specs = selected_specs(specs, description)
  env = _timing.environment()
  print(env, flush=True)
  dev = env["device"].replace(" ", "_")
  rows, checks = [], []
  written = None
  for spec in specs:
    run_spec(*spec, rows=rows, checks=checks)
    written = _timing.write_results(
        f"{prefix}_{dev}", rows,
        extra=dict(checks=checks, versions=_flashinfer.versions()))
  for c in checks:
    if not c["ok"]:
      print("CHECK FAILED", c)
  print("wrote", written)
  _timing.print_table([r for r in rows if "per_call_us" in r],
                      ["spec", "impl", "per_call_us", "gpu_us",
                       "fa3_over_ours", "fa3_over_ours_gpu"])


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--specs", default=",".join(n for n, _, _ in SPECS),
                  help="comma-separated spec names (default: all)")
  names = ap.parse_args().specs.split(",")
  unknown = set(names) - {n for n, _, _ in SPECS}
  if unknown:
    ap.error(f"unknown --specs {sorted(unknown)}")
  env = _timing.environment()
  print(env, flush=True)
  rows, checks = [], []
  for name, q_lens, kv_lens in SPECS:
    if name not in names:
      continue
    run_spec(name, q_lens, kv_lens, rows, checks)
  for c in checks:
    print(c)
  dev = env["device"].replace(" ", "_")
  versions = _flashinfer.versions()
  print("wrote", _timing.write_results(
      f"prefill_plan_{dev}", rows,
      extra=dict(checks=checks, versions=versions)))
  _timing.print_table(rows, ["spec", "impl", "per_call_us", "gpu_us",
                             "kernels", "fa3_over_ours",
                             "fa3_over_ours_gpu"])


if __name__ == "__main__":
  main()
