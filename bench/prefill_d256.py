"""Head_dim-256 prefill on Hopper (Gemma 2 / Gemma 3 layers): the default
(the Mosaic-GPU kernel, output tiles in the q tiles' shared memory, 64-key
steps) against the Pallas-Triton kernel and FlashInfer 0.7.2's FA3 prefill,
on the same pages, in one process (`prefill_window.run_specs`: outputs
checked against the Triton kernel's, then timed per call with the plan
counted and by GPU kernel time, and with the plan reused).

Specs (page 16, causal, bf16):
* Gemma 3 270M heads (4/1/256): 16 prompts of 512 tokens; 4 of 2,048;
  4 of 2,048 with its sliding layers' window (`window_left` 511);
* Gemma 2 2B heads (8/4/256): 4 prompts of 2,048 tokens;
* Gemma 2 9B heads (16/8/256): 2 prompts of 4,096 tokens.

Writes `bench/results/prefill_d256_<device>.json`, prints a table last.

  python -m bench.prefill_d256
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from bench import prefill_window  # noqa: E402

GEMMA3_270M = (4, 1, 256)
GEMMA2_2B = (8, 4, 256)
GEMMA2_9B = (16, 8, 256)
# (name, heads, sequences, new tokens each, kv tokens each, window_left)
SPECS = [
    ("gemma3_270m_b16_s512", GEMMA3_270M, 16, 512, 512, -1),
    ("gemma3_270m_b4_s2048", GEMMA3_270M, 4, 2048, 2048, -1),
    ("gemma3_270m_b4_s2048_w511", GEMMA3_270M, 4, 2048, 2048, 511),
    ("gemma2_2b_b4_s2048", GEMMA2_2B, 4, 2048, 2048, -1),
    ("gemma2_9b_b2_s4096", GEMMA2_9B, 2, 4096, 4096, -1),
]


if __name__ == "__main__":
  prefill_window.run_specs(SPECS, "prefill_d256")
