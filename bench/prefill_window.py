"""Sliding-window prefill on Hopper: the Mosaic-GPU kernel (the default)
against the Pallas-Triton kernel and FlashInfer 0.7.2's FA3 prefill with
the same `window_left`, on the same pages, in one process.

Specs (page 16, causal, bf16):
* Mistral-7B heads (32/8/128), 2 prompts of 8,192 tokens, window 4,096;
* Llama-3-8B heads (32/8/128), 8 chunks of 512 tokens at kv 8,192,
  window 2,048 (chunked prefill);
* SmolLM2 heads (9/3/64), 4 prompts of 4,096 tokens, window 1,024;
* SmolLM2 heads, 64 prompts of 256 tokens, window 128.

Each config's output, and FA3's, is checked against the Triton kernel's,
then timed per call (`_timing.time_fn`, plan
counted) and by GPU kernel time (profiler), with the plan reused for the
default too (a model plans once per step). Writes
`bench/results/prefill_window_<device>.json` and prints a table last.

  python -m bench.prefill_window [--specs smollm2_b64_s256_w128,...]
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from bench import _flashinfer  # noqa: E402
from bench import _timing  # noqa: E402
from bench import bench_prefill as bp  # noqa: E402
from bench import prefill_plan  # noqa: E402
from pkvattn.pallas_kernels import paged_prefill as pp  # noqa: E402

MISTRAL_7B = (32, 8, 128)
# (name, heads, sequences, new tokens each, kv tokens each, window_left)
SPECS = [
    ("mistral_b2_s8192_w4096", MISTRAL_7B, 2, 8192, 8192, 4096),
    ("llama3_8b_chunk_b8_q512_kv8192_w2048", bp.LLAMA3_8B, 8, 512, 8192,
     2048),
    ("smollm2_b4_s4096_w1024", bp.SMOLLM2, 4, 4096, 4096, 1024),
    ("smollm2_b64_s256_w128", bp.SMOLLM2, 64, 256, 256, 128),
]


def main():
  run_specs(prefill_plan.selected_specs(SPECS, __doc__.split("\n")[0]),
            "prefill_window")


def run_specs(specs, result_name: str):
  """Checks and times the default, the Triton kernel and FA3 on each
  `(name, (num_qo_heads, num_kv_heads, head_dim), sequences, new tokens,
  kv tokens, window_left)` spec; writes `<result_name>_<device>.json`."""
  env = _timing.environment()
  print(env, flush=True)
  rows, checks = [], []
  for name, heads, b, ql, kl, w in specs:
    hq, hkv, d = heads
    sm_scale = 1 / math.sqrt(d)
    sp = bp.build_spec(jax.random.key(0), [ql] * b, [kl] * b, 16, heads)
    args = (sp["q"], sp["pool"], sp["k_table"], sp["v_table"],
            sp["q_indptr"], sp["kv_lens"])
    kw = dict(group_size=hq // hkv, head_dim=d, page_size=16,
              dtype=jnp.bfloat16, window_left=w)
    default = pp.Config.default_for(**kw, num_tokens=b * ql, batch_size=b)
    configs = {"default": default,
               "triton": pp.Config.default_for(**kw, backend="triton")}
    flops = 4 * d * hq * bp.visible_pairs([ql] * b, [kl] * b, w)

    def fn(cfg):
      return jax.jit(lambda q, pool, kt, vt, qi, kl, cfg=cfg: pp.paged_prefill(
          q, pool, pool, kt, vt, qi, kl, None, causal=True,
          sm_scale=sm_scale, window_left=w, config=cfg)[0])

    plan = jax.jit(lambda qi, kl: default.plan(
        qi, kl, num_tokens=b * ql, causal=True, window_left=w))(
            sp["q_indptr"], sp["kv_lens"])
    reused = jax.jit(lambda q, pool, kt, vt, qi, kl, plan: pp.paged_prefill(
        q, pool, pool, kt, vt, qi, kl, None, causal=True, sm_scale=sm_scale,
        window_left=w, config=default, plan=plan)[0])
    entries = [(f"pallas {k} ({c.backend})", fn(c), args)
               for k, c in configs.items()]
    entries.append(("pallas default, plan reused", reused, args + (plan,)))
    want = jax.block_until_ready(entries[1][1](*args))  # Triton
    for impl, f, a in entries:
      err = bp.rel_err(f(*a), want)
      checks.append(dict(spec=name, check=f"{impl} vs triton", rel_err=err,
                         ok=err < 1e-2))
    run = prefill_plan.fa3_run(name, sp, heads, want, checks, window_left=w,
                               against="triton")
    for impl, f, a in entries:
      t = _timing.time_fn(f, *a, iters=10, min_time_s=0.1)
      k = _timing.device_kernel_ms(f, lambda a=a: a, calls=3)
      rows.append(dict(spec=name, impl=impl, median_ms=t["median_ms"],
                       kernel_ms=k, kernel_tflops=flops / k / 1e9))
      if impl.startswith("pallas default"):
        # Where the call's GPU time goes, kernel by kernel.
        rows[-1]["kernels_us"] = _timing.kernel_breakdown_us(f, a, calls=3)
    if run is not None:
      t = _flashinfer.torch_time(run, iters=10, min_time_s=0.1)
      k = _flashinfer.kernel_ms(run, calls=3)
      rows.append(dict(spec=name, impl="flashinfer fa3", median_ms=t,
                       kernel_ms=k, kernel_tflops=flops / k / 1e9))
    for r in rows:
      if r["spec"] == name:
        print(f"  {name} {r['impl']:34s} {1e3 * r['median_ms']:8.1f} us "
              f"{1e3 * r['kernel_ms']:8.1f} us kernel", flush=True)
        for kname, us in r.get("kernels_us", {}).items():
          print(f"      {us:7.1f} us  {kname[:70]}", flush=True)
    print("  default:", dataclasses.asdict(default), flush=True)
  for c in checks:
    if not c["ok"]:
      print("CHECK FAILED", c)
  dev = env["device"].replace(" ", "_")
  print("wrote", _timing.write_results(f"{result_name}_{dev}", rows,
                                       extra=dict(checks=checks)))
  _timing.print_table(rows, ["spec", "impl", "median_ms", "kernel_ms",
                             "kernel_tflops"])


if __name__ == "__main__":
  main()
