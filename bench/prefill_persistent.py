"""The unpacked Mosaic-GPU prefill kernel: one CTA per (head, tile) item
against one CTA per SM (`Config.mosaic_persistent`), both ways round from
the default config, on the same pages in one process.

Specs (page 16, causal, bf16; Llama-3-8B heads 32/8/128 unless named):
prompts (4 x 4,096, 2 x 2,048, 1 x 16,384), chunked prefill (8 x 512 at
kv 8,192), mixed engine steps (2 x 2,048 + 64 decode rows at 4,096; 4 x
512 + 60 x 4 + 64 x 1 at 2,048), a speculative-decoding verify step (64 x
4 at 2,048), Llama-3-70B (64/8/128) and Qwen2-7B (28/4/128) heads,
Mistral-7B's 4,096-key window, Gemma 3 270M heads (4/1/256) and the
three-consumer head_dim-64 configs (SmolLM2, Llama-3.2-1B heads). Each
arm's output is compared with the other's (bit-identical expected: the
same tiles in another order), then timed by GPU kernel time (profiler,
best of three traces of five calls). Writes
`bench/results/prefill_persistent_<device>.json`, a table last.

  python -m bench.prefill_persistent [--specs causal_b4_s4096,...]
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from bench import _timing  # noqa: E402
from bench import bench_prefill as bp  # noqa: E402
from bench import prefill_plan  # noqa: E402
from pkvattn.pallas_kernels import paged_prefill as pp  # noqa: E402

L8 = bp.LLAMA3_8B
GEMMA3 = (4, 1, 256)
# (name, heads, new tokens per sequence, kv tokens per sequence, window_left)
SPECS = [
    ("mixed_2x2048_64x1_kv4096", L8, [2048] * 2 + [1] * 64,
     [2048] * 2 + [4096] * 64, -1),
    ("causal_b4_s4096", L8, [4096] * 4, [4096] * 4, -1),
    ("causal_b2_s2048", L8, [2048] * 2, [2048] * 2, -1),
    ("causal_b1_s16384", L8, [16384], [16384], -1),
    ("chunk_b8_q512_kv8192", L8, [512] * 8, [8192] * 8, -1),
    ("verify_64x4_kv2048", L8, [4] * 64, [2048] * 64, -1),
    ("mixed_4x512_60x4_64x1", L8, [512] * 4 + [4] * 60 + [1] * 64,
     [2048] * 128, -1),
    ("mistral_b2_s8192_w4096", L8, [8192] * 2, [8192] * 2, 4096),
    ("llama70b_chunk_b4_q1024_kv4096", (64, 8, 128), [1024] * 4, [4096] * 4,
     -1),
    ("qwen7b_b8_s1024", (28, 4, 128), [1024] * 8, [1024] * 8, -1),
    ("gemma3_b4_s2048", GEMMA3, [2048] * 4, [2048] * 4, -1),
    ("gemma3_b16_s512", GEMMA3, [512] * 16, [512] * 16, -1),
    ("smollm2_b4_s4096", bp.SMOLLM2, [4096] * 4, [4096] * 4, -1),
    ("llama1b_b4_s4096", bp.LLAMA32_1B, [4096] * 4, [4096] * 4, -1),
]


def run_spec(name, heads, q_lens, kv_lens, window_left, *, rows, checks):
  hq, hkv, d = heads
  _, args, cfg, _ = prefill_plan.default_setup(q_lens, kv_lens, heads,
                                               window_left)
  outs = {}
  for persistent in (cfg.mosaic_persistent, not cfg.mosaic_persistent):
    c = dataclasses.replace(cfg, mosaic_persistent=persistent)

    def call(q, pool, kt, vt, qi, kl, c=c):
      return pp.paged_prefill(q, pool, pool, kt, vt, qi, kl, None,
                              causal=True, sm_scale=1 / math.sqrt(d),
                              window_left=window_left, config=c)[0]
    fn = jax.jit(call)
    outs[persistent] = np.asarray(jax.block_until_ready(fn(*args)),
                                  np.float32)
    traces = [_timing.kernel_breakdown_us(fn, args, 5) for _ in range(3)]
    totals = [sum(t.values()) for t in traces]
    best = traces[int(np.argmin(totals))]
    rows.append(dict(
        spec=name, heads=f"{hq}/{hkv}/{d}", window_left=window_left,
        arm="one CTA per SM" if persistent else "one CTA per item",
        default=persistent == cfg.mosaic_persistent,
        consumers=cfg.mosaic_consumers(hq // hkv), gpu_us=min(totals),
        main_us=sum(v for k, v in best.items() if "entry" in k)))
  same = np.array_equal(outs[True], outs[False], equal_nan=True)
  checks.append(dict(spec=name, check="persistent output == per-item",
                     ok=bool(same)))
  per_item = [r for r in rows[-2:] if r["arm"] == "one CTA per item"][0]
  for r in rows[-2:]:
    r["vs_per_item"] = r["gpu_us"] / per_item["gpu_us"]


def main():
  specs = prefill_plan.selected_specs(SPECS, __doc__.split("\n")[0])
  env = _timing.environment()
  print(env, flush=True)
  dev = env["device"].replace(" ", "_")
  rows, checks = [], []
  for spec in specs:
    run_spec(*spec, rows=rows, checks=checks)
    written = _timing.write_results(f"prefill_persistent_{dev}", rows,
                                    extra=dict(checks=checks))
  for c in checks:
    if not c["ok"]:
      print("CHECK FAILED", c)
  print("wrote", written)
  _timing.print_table(rows, ["spec", "arm", "default", "gpu_us", "main_us",
                             "vs_per_item"])


if __name__ == "__main__":
  main()
