"""What a prefill call runs beside its main kernel: the plan, and the
one-token sequences' decode path, before and after both moved into
Mosaic-GPU kernels of their own.

* The plan: `Config.plan` builds a step's tile schedule in one Mosaic-GPU
  launch (`plan_mgpu`, `Config.plan_kernel`) where `plan.plan_prefill`
  runs 7-12 small XLA kernels (prefix sum, search, rank count, scatter,
  selects; 1-2 us each).
* The decode path: `paged_prefill` sends sequences of one new token to the
  split-K decode kernel, which (`paged_decode.paged_decode_rows`) now
  reads those rows of the call's q itself and, with one split, writes the
  call's output rows in place. Before, the call gathered the rows, zeroed
  the other sequences' lengths and scattered the decode output back:
  three more XLA kernels, even with no decode row at all. The old path is
  restored by patching `paged_decode_rows` with it.

Three arms in one process (each compiled after `jax.clear_caches()`):
"before" (jnp plan, gather + scatter), "rows in kernel" (jnp plan) and
"after" (plan kernel, rows in kernel; the default), on:

* SmolLM2 heads (9/3/64, the packed Mosaic-GPU default): prompts of 256 /
  512 tokens (64 / 32 sequences);
* Gemma 3 270M heads (4/1/256): 16 prompts of 512 tokens; 4 of 2,048
  with its 511-key window;
* mixed steps, SmolLM2 heads: 4 prompts of 512 tokens with 64 decode rows
  at 2,048 keys (the decode kernel splits: its partials are combined and
  scattered), and with 124 (one split: written in place).

Per spec: per-kernel GPU time of the plan alone and of a call (plan
counted); per-call and GPU time with the plan counted and reused
(`prefill_plan.time_rounds`, interleaved rounds); FlashInfer 0.7.2's FA3
prefill on the same pages (with the same window). The arms' plans and
outputs are checked equal and FA3's against ours. Writes
`bench/results/prefill_call_overhead_<device>.json`, prints a table last.

  python -m bench.prefill_call_overhead [--specs smollm2_b32_s512,...]
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from bench import _timing  # noqa: E402
from bench import bench_prefill as bp  # noqa: E402
from bench import prefill_d256  # noqa: E402
from bench import prefill_plan  # noqa: E402
from pkvattn.pallas_kernels import paged_decode  # noqa: E402
from pkvattn.pallas_kernels import paged_prefill as pp  # noqa: E402

# (name, heads, q_lens, kv_lens[, window_left])
SPECS = [(f"smollm2_b{b}_s{s}", bp.SMOLLM2, [s] * b, [s] * b)
         for b, s in ((64, 256), (32, 512))]
SPECS += [("gemma3_b16_s512", prefill_d256.GEMMA3_270M, [512] * 16,
           [512] * 16),
          ("gemma3_b4_s2048_w511", prefill_d256.GEMMA3_270M, [2048] * 4,
           [2048] * 4, 511)]
SPECS += [(f"mixed_4x512_{n}x1_kv2048", bp.SMOLLM2, [512] * 4 + [1] * n,
           [512] * 4 + [2048] * n) for n in (64, 124)]


def gather_scatter(out, lse, q, q_rows, k_pool, v_pool, k_table, v_table,
                   kv_lens, sinks=None, **kw):
  """The path `paged_decode_rows` replaced: gather the rows, decode them
  (other sequences at length 0), scatter the output back."""
  num_tokens = q.shape[0]
  # R token rows a sequence (`Config.decode_rows_per_seq`): table row b // R.
  rows_per_seq = q_rows.shape[0] // k_table.shape[0]
  if rows_per_seq > 1:
    k_table, v_table = (jnp.repeat(t, rows_per_seq, axis=0)
                        for t in (k_table, v_table))
  d_out, d_lse = paged_decode.paged_decode(
      q[jnp.minimum(q_rows, num_tokens - 1)], k_pool, v_pool, k_table,
      v_table, jnp.where(q_rows < num_tokens, kv_lens, 0), sinks, **kw)
  return (out.at[q_rows].set(d_out, mode="drop"),
          lse.at[q_rows].set(d_lse, mode="drop"))


# arm: (Config.plan_kernel, the decode path)
ARMS = {"before": (False, gather_scatter),
        "rows in kernel": (False, paged_decode.paged_decode_rows),
        "after": (True, paged_decode.paged_decode_rows)}


def run_spec(name, heads, q_lens, kv_lens, window_left=-1, *, rows, checks):
  d = heads[2]
  sp, args, cfg, num_tokens = prefill_plan.default_setup(
      q_lens, kv_lens, heads, window_left)
  entries, outs, plans = [], {}, {}
  for arm, (plan_kernel, rows_fn) in ARMS.items():
    acfg = dataclasses.replace(cfg, plan_kernel=plan_kernel)

    def call(q, pool, kt, vt, qi, kl, plan=None, acfg=acfg):
      return pp.paged_prefill(q, pool, pool, kt, vt, qi, kl, None,
                              causal=True, sm_scale=1 / math.sqrt(d),
                              window_left=window_left, config=acfg,
                              plan=plan)[0]

    def plan_fn(qi, kl, acfg=acfg):
      return acfg.plan(qi, kl, num_tokens=num_tokens, causal=True,
                       window_left=window_left)
    jax.clear_caches()
    with mock.patch.object(paged_decode, "paged_decode_rows", rows_fn):
      planner = jax.jit(plan_fn).lower(*args[4:]).compile()
      plan = jax.block_until_ready(planner(*args[4:]))
      counted = jax.jit(call).lower(*args).compile()
      reused = jax.jit(call).lower(*args, plan).compile()
    plans[arm] = plan
    outs[arm] = jax.block_until_ready(counted(*args))
    if arm != "rows in kernel":
      rows.append(dict(spec=name, impl=f"plan alone, {arm}",
                       kernels_us=_timing.kernel_breakdown_us(
                           planner, args[4:], prefill_plan.CALLS)))
    rows.append(dict(spec=name, impl=f"call, plan counted, {arm}",
                     kernels_us=_timing.kernel_breakdown_us(
                         counted, args, prefill_plan.CALLS)))
    entries += [(f"pkvattn, {arm}, plan counted", counted, args),
                (f"pkvattn, {arm}, plan reused", reused, args + (plan,))]
  for arm in ARMS:
    same_plan = all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
            jax.tree.leaves(plans[arm]), jax.tree.leaves(plans["before"])))
    same_out = bool(np.array_equal(np.asarray(outs[arm]),
                                   np.asarray(outs["before"])))
    checks.append(dict(spec=name, check=f"{arm} == before (plan, output)",
                       ok=same_plan and same_out))
  fi_run = prefill_plan.fa3_run(name, sp, heads, outs["after"], checks,
                                window_left=window_left)
  prefill_plan.time_rounds(name, entries, fi_run, rows)


if __name__ == "__main__":
  prefill_plan.run_specs("prefill_call_overhead", SPECS, run_spec,
                         __doc__.split("\n")[0])
