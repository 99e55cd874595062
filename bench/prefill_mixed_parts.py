"""The mixed engine step against cuDNN, part by part: where the GPU time of
one paged call (2 prompts of 2,048 tokens + 64 decode rows at 4,096 keys,
Llama-3-8B heads 32/8/128, page 16, bf16: `bench_prefill`'s
mixed_2x2048_64x4096_p16) goes, against cuDNN's two contiguous calls.

Arms, each by GPU kernel time per kernel name (profiler, five calls):
our default call on the whole step; the same entry on the prompts alone and
on the decode rows alone (the same pages); cuDNN causal on the prompts and
cuDNN on the decode rows (q_len 1 over 4,096 contiguous keys), as
`bench_prefill` times them. One decode row's output is checked against
cuDNN's. Bytes of the decode part: K and V of 64 x 4,096 keys x 8 kv heads
x 128, bf16 (1.07 GB). Writes `bench/results/prefill_mixed_parts_<device>.json`.

  python -m bench.prefill_mixed_parts
"""

from __future__ import annotations

import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from bench import _timing  # noqa: E402
from bench import bench_prefill as bp  # noqa: E402
from pkvattn.pallas_kernels import paged_prefill as pp  # noqa: E402

HQ, HKV, D = bp.LLAMA3_8B
PROMPTS, PROMPT_LEN, DECODES, DECODE_KV = 2, 2048, 64, 4096
SM_SCALE = 1 / math.sqrt(D)


def _paged(sp, rows):
  """Our default call, jitted, on sequences `rows` of the spec, and its
  arguments."""
  rows = np.asarray(rows)
  q_lens = np.diff(np.asarray(sp["q_indptr"]))[rows]
  qi = np.asarray(sp["q_indptr"])
  q = jnp.concatenate([sp["q"][qi[i]:qi[i + 1]] for i in rows])
  cfg = pp.Config.default_for(group_size=HQ // HKV, head_dim=D, page_size=16,
                              dtype=jnp.bfloat16, num_tokens=int(q_lens.sum()),
                              batch_size=len(rows))

  def call(q, pool, kt, vt, q_indptr, kv_lens):
    return pp.paged_prefill(q, pool, pool, kt, vt, q_indptr, kv_lens, None,
                            causal=True, sm_scale=SM_SCALE, config=cfg)[0]
  return jax.jit(call), (q, sp["pool"], sp["k_table"][rows],
                         sp["v_table"][rows],
                         jnp.asarray(np.r_[0, np.cumsum(q_lens)], jnp.int32),
                         sp["kv_lens"][rows])


def main():
  env = _timing.environment()
  print(env, flush=True)
  q_lens = [PROMPT_LEN] * PROMPTS + [1] * DECODES
  kv_lens = [PROMPT_LEN] * PROMPTS + [DECODE_KV] * DECODES
  sp = bp.build_spec(jax.random.key(0), q_lens, kv_lens, 16, bp.LLAMA3_8B)
  n = PROMPTS * PROMPT_LEN
  qp = sp["q"][:n].reshape(PROMPTS, PROMPT_LEN, HQ, D)
  kp, vp = sp["k"][:PROMPTS, :PROMPT_LEN], sp["v"][:PROMPTS, :PROMPT_LEN]
  qd = sp["q"][n:][:, None]
  kd, vd = sp["k"][PROMPTS:, :DECODE_KV], sp["v"][PROMPTS:, :DECODE_KV]

  ours = _paged(sp, range(PROMPTS + DECODES))
  arms = [("ours, whole step", *ours),
          ("ours, prompts alone", *_paged(sp, range(PROMPTS))),
          ("ours, decode rows alone",
           *_paged(sp, range(PROMPTS, PROMPTS + DECODES))),
          ("cudnn, prompts", bp.cudnn_fn(SM_SCALE, True), (qp, kp, vp)),
          ("cudnn, decode rows", bp.cudnn_fn(SM_SCALE, False),
           (qd, kd, vd))]
  out = np.asarray(ours[0](*ours[1]), np.float32)
  want = np.asarray(arms[4][1](qd, kd, vd), np.float32)[0, 0]
  err = float(np.abs(out[n] - want).max())
  checks = [dict(check="decode row vs cuDNN", max_abs=err, ok=err < 1e-2)]
  decode_bytes = 2 * DECODES * DECODE_KV * HKV * D * 2
  rows = []
  for name, fn, args in arms:
    kernels = _timing.kernel_breakdown_us(fn, args, 5)
    total = sum(kernels.values())
    row = dict(arm=name, gpu_us=total, kernels_us=kernels)
    if "decode" in name:
      row["tb_per_s"] = decode_bytes / total / 1e6
    rows.append(row)
    print(f"{name:26s} {total:8.1f} us", flush=True)
  ours_us = rows[0]["gpu_us"]
  cudnn_us = rows[3]["gpu_us"] + rows[4]["gpu_us"]
  summary = dict(ours_us=ours_us, cudnn_two_calls_us=cudnn_us,
                 ours_vs_cudnn=cudnn_us / ours_us)
  written = _timing.write_results(
      f"prefill_mixed_parts_{env['device'].replace(' ', '_')}", rows,
      extra=dict(checks=checks, summary=summary))
  print("wrote", written, "checks", checks)
  print(summary)


if __name__ == "__main__":
  main()
