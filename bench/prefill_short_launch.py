"""Multi-token decode rows (2-8 new tokens) of a packed head_dim-64 call: a
short launch of their own (Pallas-Triton, 8-token tiles) against tiles of
the main launch (the packed, persistent Mosaic-GPU kernel).

The default for head_dim 64 below `MOSAIC_D64_MIN_TOKENS` tokens per
sequence packs the GQA group into the tile rows, so a sequence of a few
tokens fills a main tile's rows with the whole group; without the short
launch a call runs one Triton launch and part of the plan fewer. This bench
runs both configs in one process (each compiled after `jax.clear_caches()`)
on SmolLM2's heads (9/3/64, page 16, bf16):

* prompts of 256 / 512 / 1,024 tokens (64 / 32 / 16 sequences);
* 64 sequences of 4 new tokens at 2,048 keys (multi-token decode);
* a mixed step: 4 prompts of 512 tokens, 60 sequences of 4 tokens and 64
  decode rows at 2,048 keys.

Per spec: the per-kernel GPU time of a call (plan counted); per-call time
and GPU time with the plan counted and reused (`prefill_plan.time_rounds`,
interleaved rounds); FlashInfer 0.7.2's FA3 prefill on the same pages. The
two configs' outputs and FA3's are checked against each other. Writes
`bench/results/prefill_short_launch_<device>.json`, prints a table last.

  python -m bench.prefill_short_launch [--specs causal_b64_s256,...]
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from bench import _timing  # noqa: E402
from bench import bench_prefill as bp  # noqa: E402
from bench import prefill_plan  # noqa: E402
from pkvattn.pallas_kernels import paged_prefill as pp  # noqa: E402

# (name, q_lens, kv_lens)
SPECS = [(f"causal_b{b}_s{s}", [s] * b, [s] * b)
         for b, s in ((64, 256), (32, 512), (16, 1024))]
SPECS += [("multi_token_64x4_kv2048", [4] * 64, [2048] * 64),
          ("mixed_4x512_60x4_64x1_kv2048", [512] * 4 + [4] * 60 + [1] * 64,
           [512] * 4 + [2048] * 124)]


def run_spec(name, q_lens, kv_lens, *, rows, checks):
  heads = bp.SMOLLM2
  hq, hkv, d = heads
  num_tokens = int(sum(q_lens))
  sp, args = prefill_plan.spec_args(q_lens, kv_lens, heads)
  main = pp.Config.default_for(group_size=hq // hkv, head_dim=d,
                               page_size=16, dtype=jnp.bfloat16)
  arms = {"main launch": main,
          "short launch": dataclasses.replace(main, short_block_q=8)}
  entries, outs = [], {}
  for arm, cfg in arms.items():
    outs[arm], more = prefill_plan.compile_arm(
        name, arm, cfg, args, rows, num_tokens=num_tokens,
        sm_scale=1 / math.sqrt(d))
    entries += more
  err = _timing.rel_err(outs["short launch"], outs["main launch"])
  checks.append(dict(spec=name, check="main launch vs short launch",
                     rel_err=err, ok=err < 1e-2))
  fi_run = prefill_plan.fa3_run(name, sp, heads, outs["main launch"], checks)
  prefill_plan.time_rounds(name, entries, fi_run, rows)


if __name__ == "__main__":
  prefill_plan.run_specs("prefill_short_launch", SPECS, run_spec,
                         __doc__.split("\n")[0])
