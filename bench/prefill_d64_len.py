"""Head_dim-64 prefill by tokens per sequence: the Pallas-Triton kernel
against the Mosaic-GPU kernel's forms (the basis of
`paged_prefill.MOSAIC_D64_MIN_TOKENS`); paged_prefill's default for each
shape runs first (the reference check, and a row with its plan reused).

Causal prompts of 1,024 / 2,048 / 8,192 tokens (16 / 8 / 2 sequences, page
16) with Llama-3.2-1B (32/8/64) and SmolLM2 (9/3/64) heads, each config
checked and timed by `bench_prefill.run_spec` (per call and by kernel time;
cuDNN on contiguous K/V beside them). With SmolLM2's group of 3 the Triton
kernel also runs 32-token tiles (`128 // next_pow2(group)`): the tile count
and rows of its earlier layout, each token padded to 4 rows, against the
default's 42 tokens in 128 rows. Writes
`bench/results/prefill_d64_len_<device>.json`.

Every mode also runs the Mosaic kernel persistent (`Config.mosaic_persistent`:
one CTA per SM) and with the GQA group packed into its tile rows
(`Config.mosaic_pack_gqa`), with three and two consumers.

With `--short`: prompts of 256 / 512 / 1,024 tokens (64 / 32 / 16
sequences), the Mosaic-GPU kernel also with two consumer warpgroups
(128-token tiles, ping-pong), and FlashInfer 0.7.2's FA3 prefill on the
same pages; writes `prefill_d64_len_short_<device>.json`.

With `--sweep`: the Triton kernel's tiling around its default (query rows
per tile, keys per step, warps, stages, launch order) at 256 / 512 /
1,024 tokens with FlashInfer FA3 beside it; writes
`prefill_d64_sweep_<device>`.

  python bench/prefill_d64_len.py [--short | --sweep] [--heads smollm2]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from bench import _timing  # noqa: E402
from bench import bench_prefill as bp  # noqa: E402
from pkvattn.pallas_kernels import paged_prefill as pp  # noqa: E402
from pkvattn.pallas_kernels._compat import pl  # noqa: E402

SHAPES = [(16, 1024), (8, 2048), (2, 8192)]  # (sequences, tokens each)


SHORT_SHAPES = [(64, 256), (32, 512), (16, 1024)]


def sweep_configs(base):
  """The Triton kernel's tiling around `base`: half / twice the query
  rows per tile (8 warps for twice), 32 / 128 keys per step, 8 warps, 2
  stages, kv heads inner; 32 keys per step on 4 stages."""
  r = dataclasses.replace
  return [r(base, block_q=base.block_q // 2),
          r(base, block_q=base.block_q * 2, num_warps=8),
          r(base, block_k=32), r(base, block_k=32, num_stages=4),
          r(base, block_k=128, num_stages=2),
          r(base, num_warps=8), r(base, num_stages=2),
          r(base, heads_outer=False)]


def main():
  ap = argparse.ArgumentParser()
  mode = ap.add_mutually_exclusive_group()
  mode.add_argument("--short", action="store_true",
                    help="256..1,024-token prompts, two-consumer Mosaic "
                         "and FlashInfer FA3 too")
  mode.add_argument("--sweep", action="store_true",
                    help="the Triton kernel's tiling at 256..1,024 tokens")
  ap.add_argument("--heads", choices=("all", "llama32_1b", "smollm2"),
                  default="all", help="which head shapes (default both)")
  args = ap.parse_args()
  heads_list = {"all": (bp.LLAMA32_1B, bp.SMOLLM2),
                "llama32_1b": (bp.LLAMA32_1B,),
                "smollm2": (bp.SMOLLM2,)}[args.heads]
  env = _timing.environment()
  print(env, flush=True)
  rows, checks = [], []
  for heads in heads_list:
    hq, hkv, d = heads
    kw = dict(group_size=hq // hkv, head_dim=d, page_size=16,
              dtype=jnp.bfloat16)
    mosaic3 = pp.Config.default_for(**kw, backend="mosaic",
                                    num_tokens=pp.MOSAIC_D64_MIN_TOKENS,
                                    batch_size=1)
    configs = [pp.Config.default_for(**kw, backend="triton"), mosaic3]
    if hq // hkv & (hq // hkv - 1):
      configs.insert(1, dataclasses.replace(
          configs[0], block_q=128 // pl.next_power_of_2(hq // hkv)))
    if args.short:
      configs.append(dataclasses.replace(
          configs[-1], block_q=pp.paged_prefill_mgpu.tile_q(2),
          mosaic_schedule="pingpong"))
    # The Mosaic kernel persistent (one CTA per SM), and with the GQA group
    # packed into its tile rows: three consumers (ring) and two (ping-pong),
    # persistent or not.
    g = hq // hkv
    configs.append(dataclasses.replace(mosaic3, mosaic_persistent=True))
    configs += [dataclasses.replace(
        mosaic3, mosaic_pack_gqa=True,
        block_q=pp.paged_prefill_mgpu.tile_q(n, g), mosaic_schedule=sched,
        mosaic_persistent=per)
                for n, sched, per in ((3, "ring", True), (2, "pingpong", True),
                                      (2, "pingpong", False))]
    shapes = SHORT_SHAPES if args.short else SHAPES
    if args.sweep:
      configs = [configs[0]] + sweep_configs(configs[0])
      shapes = SHORT_SHAPES
    for b, s in shapes:
      # First (checked against the reference, and timed with its plan
      # reused too): paged_prefill's default for the shape.
      run = configs
      if not args.sweep:
        first = pp.Config.default_for(**kw, num_tokens=b * s, batch_size=b)
        run = [first] + [c for c in configs if c != first]
      bp.run_spec(f"causal_b{b}_s{s}_p16_{hq}_{hkv}_{d}", [s] * b, [s] * b,
                  16, run, with_xla=False, with_mha=False, rows=rows,
                  checks=checks, heads=heads,
                  with_flashinfer=args.short or args.sweep)
  dev = env["device"].replace(" ", "_")
  name = ("prefill_d64_len_short" if args.short else
          "prefill_d64_sweep" if args.sweep else "prefill_d64_len") + (
              "" if args.heads == "all" else "_" + args.heads)
  print("wrote", _timing.write_results(f"{name}_{dev}", rows,
                                       extra=dict(checks=checks)))
  _timing.print_table([r for r in rows if r["impl"].startswith(
      ("pallas", "flashinfer", "cudnn"))],
                      ["spec", "impl", "median_ms", "kernel_ms"])


if __name__ == "__main__":
  main()
