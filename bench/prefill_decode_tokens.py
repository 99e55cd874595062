"""Multi-token sequences of a prefill call: Pallas-Triton short launch or
the Mosaic-GPU decode kernel, a token a row, beside FlashInfer's FA3.

The unpacked Mosaic-GPU prefill configs (head_dim 128 / 256 on Hopper)
used to run sequences of 2-8 new tokens (multi-token decode, the tail of a
chunked prompt) in a second, Pallas-Triton launch of 8-token tiles, which
ran in every call, 2.7-4 us with nothing to do (Gemma 3 270M heads, H200).
`Config.decode_rows_per_seq` sends them to the decode kernel that already
takes the call's one-token sequences (`paged_decode.paged_decode_rows`),
one decode query per token with its own key count; a CTA serves up to 16 /
group_size (8 / group_size at head_dim 256) of one sequence's token rows
in its MMA columns (`paged_decode_mma.row_packing`), so it reads the
sequence's pages once for them. Also here: the main kernel's lse rows are
stored in place (no per-tile scratch and XLA scatter).

Two arms in one process (each compiled after `jax.clear_caches()`):
"short launch" (`short_block_q`, one-token rows only in the decode
kernel) and "decode rows" (`decode_rows_per_seq` R = 8, or 16 at group 1,
no short launch; the default), on:

* pure prompts, where the short launch has nothing to do: Gemma 3 270M
  heads (4/1/256), 16 x 512 tokens, and 4 x 2,048 with its 511-key window;
  Llama-3-8B heads (32/8/128), 8 x 512;
* multi-token decode (speculative decoding's verify step): 64 sequences
  of 4 tokens at 2,048 keys (Llama-3-8B and Llama-3-70B heads, 64/8/128)
  and at 4,096 (Gemma 3; Gemma 2 2B, 8/4/256);
* a mixed step (Llama-3-8B heads): 2 prompts of 1,024 tokens, 16
  sequences of 3 tokens and 16 of one at 4,096 keys.

Per spec: per-kernel GPU time of a call (plan counted); per-call and GPU
time with the plan counted and reused (`prefill_plan.time_rounds`,
interleaved rounds); FlashInfer 0.7.2's FA3 prefill on the same pages.
The arms' outputs are checked against each other and FA3's against ours.
Writes `bench/results/prefill_decode_tokens_<device>.json`, prints a table
last.

  python -m bench.prefill_decode_tokens [--specs gemma3_b16_s512,...]
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from bench import _timing  # noqa: E402
from bench import prefill_d256  # noqa: E402
from bench import prefill_plan  # noqa: E402

LLAMA3_8B = (32, 8, 128)
G3 = prefill_d256.GEMMA3_270M
# (name, heads, q_lens, kv_lens[, window_left])
SPECS = [
    ("gemma3_b16_s512", G3, [512] * 16, [512] * 16),
    ("gemma3_b4_s2048_w511", G3, [2048] * 4, [2048] * 4, 511),
    ("llama8b_b8_s512", LLAMA3_8B, [512] * 8, [512] * 8),
    ("llama8b_spec_64x4_kv2048", LLAMA3_8B, [4] * 64, [2048] * 64),
    ("gemma3_spec_64x4_kv4096", G3, [4] * 64, [4096] * 64),
    ("llama8b_mixed_2x1024_16x3_16x1_kv4096", LLAMA3_8B,
     [1024] * 2 + [3] * 16 + [1] * 16, [1024] * 2 + [4096] * 32),
    # Other groups: 2 (4 token rows per decode CTA) and 8 (one).
    ("gemma2_2b_spec_64x4_kv4096", prefill_d256.GEMMA2_2B, [4] * 64,
     [4096] * 64),
    ("llama70b_spec_64x4_kv2048", (64, 8, 128), [4] * 64, [2048] * 64),
]


def arms(cfg):
  """{arm: config}: the default config of a call with its sequences of 2
  to R tokens in the short launch, and in the decode kernel (R = 8, or 16
  at group 1; `Config.default_for`'s choice)."""
  longest = max(cfg.short_block_q, cfg.decode_rows_per_seq)
  return {"short launch": dataclasses.replace(
              cfg, short_block_q=longest, short_block_k=cfg.short_block_k,
              decode_rows_per_seq=1),
          "decode rows": dataclasses.replace(
              cfg, short_block_q=0, decode_rows_per_seq=longest)}


def run_spec(name, heads, q_lens, kv_lens, window_left=-1, *, rows, checks):
  d = heads[2]
  sp, args, cfg, num_tokens = prefill_plan.default_setup(
      q_lens, kv_lens, heads, window_left)
  entries, outs = [], {}
  default = "decode rows" if cfg.decode_rows_per_seq > 1 else "short launch"
  checks.append(dict(spec=name, check=f"default: {default}", ok=True))
  for arm, acfg in arms(cfg).items():
    outs[arm], more = prefill_plan.compile_arm(
        name, arm, acfg, args, rows, num_tokens=num_tokens,
        sm_scale=1 / math.sqrt(d), window_left=window_left)
    entries += more
  err = _timing.rel_err(outs["decode rows"], outs["short launch"])
  checks.append(dict(spec=name, check="decode rows vs short launch",
                     rel_err=err, ok=err < 1e-2))
  fi_run = prefill_plan.fa3_run(name, sp, heads, outs["decode rows"], checks,
                                window_left=window_left)
  prefill_plan.time_rounds(name, entries, fi_run, rows)


if __name__ == "__main__":
  prefill_plan.run_specs("prefill_decode_tokens", SPECS, run_spec,
                         __doc__.split("\n")[0])
