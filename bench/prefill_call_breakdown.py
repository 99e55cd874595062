"""Where a short-prompt head_dim-64 prefill call spends its GPU time.

Per-kernel GPU time (one `jax.profiler` trace, launch gaps and host time
excluded, `_timing.gpu_stream_events`) of `paged_prefill_kernel.paged_prefill`
calls with the plan reused, on causal prompts of 256 / 512 / 1,024 tokens
(64 / 32 / 16 sequences, page 16, bf16) with SmolLM2's 9/3/64 heads:

* the Triton default, then without the split-K decode path for q_len-1
  rows (`split_decode_rows=False`), then its main launch alone (no short
  launch either): what a pure prompt batch pays for the launches that serve
  a mixed batch's decode rows and multi-token decode;
* the Mosaic-GPU kernel's packed, persistent form (`Config.mosaic_pack_gqa`,
  `Config.mosaic_persistent`): the whole call, its main launch alone, and
  the main launch with three stages or with 64-key steps on four;
* the plan alone (`Config.plan`, once per step in a model);
* FlashInfer 0.7.2's FA3 prefill on the same pages (its `run`; its plan is
  host work), when the wheel is installed.

Writes `bench/results/prefill_call_breakdown_<device>.json` (and under
`$OUT`) and prints a table last.

  python -m bench.prefill_call_breakdown
"""

from __future__ import annotations

import dataclasses
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

SHAPES = [(64, 256), (32, 512), (16, 1024)]  # (sequences, tokens each)
CALLS = 5


def configs(heads):
  hq, hkv, d = heads
  kw = dict(group_size=hq // hkv, head_dim=d, page_size=16,
            dtype=jnp.bfloat16)
  r = dataclasses.replace
  triton = pp.Config.default_for(**kw, backend="triton")
  # The packed, persistent Mosaic-GPU form (two consumers).
  packed = pp.Config.default_for(**kw, backend="mosaic")
  bare = dict(split_decode_rows=False, short_block_q=0)
  return {"triton default": triton,
          "triton, no decode path": r(triton, split_decode_rows=False),
          "triton main launch only": r(triton, **bare),
          "mosaic packed persistent": packed,
          "mosaic packed persistent, main launch only": r(packed, **bare),
          "mosaic packed persistent, 3 stages, main only": r(
              packed, num_stages=3, **bare),
          "mosaic packed persistent, 64-key steps x 4, main only": r(
              packed, block_k=64, num_stages=4, **bare)}


def main():
  env = _timing.environment()
  print(env, flush=True)
  heads = bp.SMOLLM2
  hq, hkv, d = heads
  sm_scale = 1 / math.sqrt(d)
  rows = []
  for b, s in SHAPES:
    spec = f"causal_b{b}_s{s}_p16_{hq}_{hkv}_{d}"
    sp = bp.build_spec(jax.random.key(0), [s] * b, [s] * b, 16, heads)
    args = (sp["q"], sp["pool"], sp["k_table"], sp["v_table"],
            sp["q_indptr"], sp["kv_lens"])
    for name, cfg in configs(heads).items():
      plan = cfg.plan(sp["q_indptr"], sp["kv_lens"], num_tokens=b * s,
                      causal=True, window_left=-1)
      fn = jax.jit(lambda q, pool, kt, vt, qi, kl, plan, cfg=cfg:
                   pp.paged_prefill(q, pool, pool, kt, vt, qi, kl, None,
                                    causal=True, sm_scale=sm_scale,
                                    config=cfg, plan=plan)[0])
      rows.append(dict(spec=spec, impl=name, kernels_us=(
          _timing.kernel_breakdown_us(fn, args + (plan,), CALLS))))
    cfg = configs(heads)["triton default"]
    plan_fn = jax.jit(lambda qi, kl, cfg=cfg, n=b * s: cfg.plan(
        qi, kl, num_tokens=n, causal=True, window_left=-1))
    rows.append(dict(spec=spec, impl="plan alone",
                     kernels_us=_timing.kernel_breakdown_us(
                         plan_fn, (sp["q_indptr"], sp["kv_lens"]), CALLS)))
    try:
      cache, table = bp.flashinfer_cache(sp, 16)
      run, _ = _flashinfer.prefill_fn(
          sp["q"], cache, table, np.asarray(sp["q_indptr"]),
          np.asarray(sp["kv_lens"]), num_qo_heads=hq, num_kv_heads=hkv,
          causal=True, sm_scale=sm_scale, backend="fa3")
      rows.append(dict(spec=spec, impl="flashinfer fa3",
                       kernels_us={"fa3 run": 1e3 * _flashinfer.kernel_ms(
                           run, calls=CALLS)}))
    except Exception as e:  # noqa: BLE001  (no flashinfer wheel, no JIT)
      if not isinstance(e, ImportError):
        traceback.print_exc()
      print(f"  {spec} flashinfer fa3: skipped ({repr(e)[:200]})")
    for row in rows:
      if row["spec"] == spec:
        row["total_us"] = sum(row["kernels_us"].values())
        top = sorted(row["kernels_us"].items(), key=lambda kv: -kv[1])[:4]
        print(f"  {spec} {row['impl']:40s} {row['total_us']:7.1f} us  "
              + "  ".join(f"{k[:32]}={v:.1f}" for k, v in top), flush=True)
  dev = env["device"].replace(" ", "_")
  versions = _flashinfer.versions()
  print("wrote", _timing.write_results(f"prefill_call_breakdown_{dev}",
                                       rows, extra=dict(versions=versions)))
  _timing.print_table(rows, ["spec", "impl", "total_us"])


if __name__ == "__main__":
  main()
