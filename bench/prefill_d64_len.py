"""Head_dim-64 prefill by tokens per sequence: the Pallas-Triton kernel
against the three-consumer Mosaic-GPU kernel (the basis of
`paged_prefill.MOSAIC_D64_MIN_TOKENS`).

Causal prompts of 1,024 / 2,048 / 8,192 tokens (16 / 8 / 2 sequences, page
16) with Llama-3.2-1B (32/8/64) and SmolLM2 (9/3/64) heads, each config
checked and timed by `bench_prefill.run_spec` (per call and by kernel time;
cuDNN on contiguous K/V beside them). Writes
`bench/results/prefill_d64_len_<device>.json`.

  python bench/prefill_d64_len.py
"""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from bench import _timing  # noqa: E402
from bench import bench_prefill as bp  # noqa: E402
from pkvattn.pallas_kernels import paged_prefill as pp  # noqa: E402

SHAPES = [(16, 1024), (8, 2048), (2, 8192)]  # (sequences, tokens each)


def main():
  env = _timing.environment()
  print(env, flush=True)
  rows, checks = [], []
  for heads in (bp.LLAMA32_1B, bp.SMOLLM2):
    hq, hkv, d = heads
    kw = dict(group_size=hq // hkv, head_dim=d, page_size=16,
              dtype=jnp.bfloat16)
    configs = [pp.Config.default_for(**kw, backend="triton"),
               pp.Config.default_for(**kw, backend="mosaic")]
    for b, s in SHAPES:
      bp.run_spec(f"causal_b{b}_s{s}_p16_{hq}_{hkv}_{d}", [s] * b, [s] * b,
                  16, configs, with_xla=False, with_mha=False, rows=rows,
                  checks=checks, heads=heads, with_flashinfer=False)
  dev = env["device"].replace(" ", "_")
  print("wrote", _timing.write_results(f"prefill_d64_len_{dev}", rows,
                                       extra=dict(checks=checks)))
  _timing.print_table([r for r in rows if r["impl"].startswith("pallas")],
                      ["spec", "impl", "median_ms", "kernel_ms"])


if __name__ == "__main__":
  main()
