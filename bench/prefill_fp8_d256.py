"""Head_dim-256 prefill on FP8 pages on Hopper (Gemma 2 / Gemma 3 layers on
an FP8 KV cache): the calls below `paged_prefill.DEQUANTIZE_MIN_ROWS` query
rows per sequence read the FP8 pages in the kernel. Arms, on the same pages
in one process:

* `mosaic fp8 in kernel`: the default there, the Mosaic-GPU kernel (TMA
  into one 64-key FP8 staging stage, the producer warpgroup converts);
* `triton fp8 in kernel`: the Pallas-Triton kernel reading FP8 pages;
* `mosaic fp8 dequantize`: the pages the tables name gathered into a
  bf16 pool first (`fp8_pages="dequantize"`), then the 16-bit kernel;
* `mosaic bf16 pages`: the same call on the bf16 pages the FP8 ones were
  quantized from (the speed FP8 pages would ideally keep).

Each FP8 arm's output is checked against the Triton FP8 arm's (the f64
oracle tests are in tests/test_paged_prefill_mgpu.py), then each arm is
timed per call (`_timing.time_fn`, plan counted; `per_call_us`) and by GPU
kernel time (`gpu_us`).

Specs (page 16, causal; NaN in the pool's unowned pages):
* Gemma 3 270M heads (4/1/256): 16 chunks of 128 tokens at kv 2,048, with
  and without its sliding layers' window (511); a mixed engine step, two
  256-token prompts beside 62 decode rows at kv 2,048; 4 prompts of 2,048
  tokens (which the default dequantizes: the crossover);
* Gemma 2 9B heads (16/8/256): 4 chunks of 128 tokens at kv 4,096.

Writes `bench/results/prefill_fp8_d256_<device>.json`, prints a table last.

  python -m bench.prefill_fp8_d256 [--specs gemma3_270m_mixed,...]
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
from bench import _timing  # noqa: E402
from bench import bench_prefill as bp  # noqa: E402
from bench import prefill_plan  # noqa: E402
from pkvattn import _kv  # noqa: E402
from pkvattn.pallas_kernels import paged_prefill as pp  # noqa: E402

GEMMA3_270M = (4, 1, 256)
GEMMA2_9B = (16, 8, 256)
# (name, heads, q_lens, kv_lens, window_left)
SPECS = [
    ("gemma3_270m_b16_q128_kv2048", GEMMA3_270M, [128] * 16, [2048] * 16,
     -1),
    ("gemma3_270m_b16_q128_kv2048_w511", GEMMA3_270M, [128] * 16,
     [2048] * 16, 511),
    ("gemma3_270m_mixed", GEMMA3_270M, [256] * 2 + [1] * 62,
     [256] * 2 + [2048] * 62, -1),
    ("gemma3_270m_b4_s2048", GEMMA3_270M, [2048] * 4, [2048] * 4, -1),
    ("gemma2_9b_b4_q128_kv4096", GEMMA2_9B, [128] * 4, [4096] * 4, -1),
]


def run_spec(name, heads, q_lens, kv_lens, w, *, rows, checks):
  """Checks and times the four arms on one spec (`prefill_plan.run_specs`)."""
  hq, hkv, d = heads
  b, t = len(q_lens), sum(q_lens)
  sm_scale = 1 / math.sqrt(d)
  sp = bp.build_spec(jax.random.key(0), q_lens, kv_lens, 16, heads)
  pool = sp["pool"]
  scale = float(jnp.nanmax(jnp.abs(pool.astype(jnp.float32)))) / _kv.FP8_MAX
  pool8 = _kv.quantize(pool, scale)
  kw = dict(group_size=hq // hkv, head_dim=d, page_size=16,
            dtype=jnp.bfloat16, window_left=w)
  default = pp.Config.default_for(**kw, num_tokens=t, batch_size=b)
  triton = pp.Config.default_for(**kw, backend="triton")
  arms = {
      "mosaic fp8 in kernel": (dataclasses.replace(
          default, fp8_pages="kernel"), pool8),
      "triton fp8 in kernel": (dataclasses.replace(
          triton, fp8_pages="kernel"), pool8),
      "mosaic fp8 dequantize": (dataclasses.replace(
          default, fp8_pages="dequantize"), pool8),
      "mosaic bf16 pages": (default, pool),
  }
  flops = 4 * d * hq * bp.visible_pairs(q_lens, kv_lens, w)

  def fn(cfg, fp8):
    scales = dict(k_scale=jnp.float32(scale),
                  v_scale=jnp.float32(scale)) if fp8 else {}
    return jax.jit(lambda q, p, kt, vt, qi, kl: pp.paged_prefill(
        q, p, p, kt, vt, qi, kl, None, causal=True, sm_scale=sm_scale,
        window_left=w, config=cfg, **scales)[0])

  calls = {}
  for impl, (cfg, p) in arms.items():
    calls[impl] = (fn(cfg, p.dtype != pool.dtype),
                   (sp["q"], p, sp["k_table"], sp["v_table"],
                    sp["q_indptr"], sp["kv_lens"]))
  f, a = calls["triton fp8 in kernel"]
  want = jax.block_until_ready(f(*a))
  for impl, (f, a) in calls.items():
    err = bp.rel_err(f(*a), want)
    # bf16 pages differ from FP8 ones by the quantization (~3% a value).
    tol = 1e-1 if impl.endswith("bf16 pages") else 1e-2
    checks.append(dict(spec=name, check=f"{impl} vs triton fp8",
                       rel_err=err, ok=err < tol))
  for impl, (f, a) in calls.items():
    tm = _timing.time_fn(f, *a, iters=10, min_time_s=0.1)
    k = _timing.device_kernel_ms(f, lambda a=a: a, calls=3)
    rows.append(dict(spec=name, impl=impl, per_call_us=1e3 * tm["median_ms"],
                     gpu_us=1e3 * k, kernel_tflops=flops / k / 1e9))
    print(f"  {name} {impl:24s} {rows[-1]['per_call_us']:8.1f} us "
          f"{rows[-1]['gpu_us']:8.1f} us GPU", flush=True)


if __name__ == "__main__":
  prefill_plan.run_specs("prefill_fp8_d256", SPECS, run_spec,
                         __doc__.split("\n")[0])
