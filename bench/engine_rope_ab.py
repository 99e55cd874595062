"""The engine with its RoPE + paged append, its decode attention or its
prefill attention on each kernel (Hopper).

Run on an H100 / H200:
  `python -m bench.engine_rope_ab [--model smollm2] [--op rope|decode|prefill]`

`bench/bench_serving.py`'s pkvattn workload (random bf16 weights of the
model's shape, 256 prompts x 256 new tokens, its `EngineConfig`) in one
process, in arms that alternate (`--arms`, each a fresh engine after
`jax.clear_caches()`): with `rope_append`'s default, the Mosaic-GPU kernel
on Hopper (`rope_append_mgpu`), and with the default forced to the
Pallas-Triton kernel (`rope_append.default_config` patched to
`Config.default_for`). With `--op decode` the arms are the decode
attention's default (on Hopper the per-warp Mosaic-GPU kernel,
`paged_decode_mma`) and the Triton kernel (`paged_decode._mma_default`
patched to False); with `--op prefill` the prefill attention's default
(at head_dim 64 on Hopper the packed, persistent Mosaic-GPU kernel) and
the Triton kernel (`paged_prefill.Config.default_for` patched to
`backend="triton"`); `--kv-cache-dtype fp8_e4m3` runs them on FP8 pages.
Each arm reports warm-up time (every program compiled; later arms reuse
what XLA cached), throughput after warm-up and the compilations during
it, the decode step's wall time and GPU time at 256 rows and the op's
kernels' share, and the greedy tokens of the first batch (eight
requests), which must be the same in every arm (the file keeps their
SHA-1).

Writes `bench/results/engine_rope_ab_<model>_<device>.json` (`--op decode`
/ `prefill`: `engine_decode_ab_...` / `engine_prefill_ab_...`, with
`_<kv_cache_dtype>` after the model where given; and under `$OUT`) and
prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import json
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from bench import _timing
from bench import bench_serving as serving
from pkvattn.engine import Engine, SamplingParams
from pkvattn.models import Model, init_params
from pkvattn.pallas_kernels import paged_decode
from pkvattn.pallas_kernels import paged_prefill
from pkvattn.pallas_kernels import rope_append


def _triton_default(num_tokens, num_qo_heads, num_kv_heads, **_):
  return rope_append.Config.default_for(num_tokens, num_qo_heads,
                                        num_kv_heads)


def _arm(mcfg, params, batch1, batch2, sp, op: str = "rope",
         ecfg=None) -> dict:
  res = {}
  t0 = time.perf_counter()
  engine = Engine(Model("bench", mcfg, params, None), ecfg or serving.CFG)
  engine.warmup()
  res["warmup_s"] = time.perf_counter() - t0
  out = engine.generate(batch1, sp)
  res["first_tokens"] = [list(map(int, o)) for o in out[:8]]
  jax.block_until_ready(engine.pool)
  counter = serving.CompileCounter()
  t1 = time.perf_counter()
  out = engine.generate(batch2, sp)
  res["throughput_tok_s"] = sum(map(len, out)) / (time.perf_counter() - t1)
  res["compiles_in_timed_run"] = counter.n
  for p in batch1:
    engine.add_request(p, SamplingParams(max_new_tokens=64, ignore_eos=True))
  while not engine._burst_eligible():
    engine.step()
  for _ in range(4):
    engine.step()
  res["decode_step_wall_ms"] = engine.profile()["step_ms"]
  kb = serving.kernel_breakdown(engine, top=40)
  res["decode_step_gpu_us"] = kb["gpu_us_per_step"]
  name = {"rope": "rope_append", "decode": "paged_decode"}.get(op)
  if name:  # prefill runs in no decode step
    ks = [r for r in kb["top"] if name in r["kernel"]]
    res[f"{op}_us_per_step"] = sum(r["us"] for r in ks)
    res[f"{op}_kernels"] = sorted({r["kernel"] for r in ks})
  res["top"] = kb["top"][:8]
  while engine.has_unfinished():
    engine.step()
  del engine
  gc.collect()
  return res


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", choices=("smollm2", "llama1b"),
                  default="smollm2")
  ap.add_argument("--arms", default="triton,mosaic,triton,mosaic",
                  help="the arms in order (each a fresh engine)")
  ap.add_argument("--op", choices=("rope", "decode", "prefill"),
                  default="rope",
                  help="the op whose kernel the arms change")
  ap.add_argument("--kv-cache-dtype", default=None,
                  help="EngineConfig.kv_cache_dtype (e.g. fp8_e4m3); "
                       "default: the serving config's")
  args = ap.parse_args(argv)
  ecfg = serving.CFG
  if args.kv_cache_dtype:
    ecfg = dataclasses.replace(ecfg, kv_cache_dtype=args.kv_cache_dtype)
  mcfg = serving.MODELS[args.model]
  rng = np.random.default_rng(0)
  batch1 = serving.prompts(rng, 256, mcfg.vocab_size)
  batch2 = serving.prompts(rng, 256, mcfg.vocab_size)
  sp = SamplingParams(max_new_tokens=256, ignore_eos=True)
  params = init_params(mcfg, jax.random.key(0), jnp.bfloat16, scale=0.02)
  rows = []
  for name in args.arms.split(","):
    jax.clear_caches()  # the other arm's traces hold its kernel
    if name == "triton" and args.op == "rope":
      patch = mock.patch.object(rope_append, "default_config",
                                _triton_default)
    elif name == "triton" and args.op == "prefill":
      default_for = paged_prefill.Config.default_for.__func__
      patch = mock.patch.object(
          paged_prefill.Config, "default_for", classmethod(
              lambda cls, **kw: default_for(cls, **{**kw,
                                                    "backend": "triton"})))
    elif name == "triton":
      patch = mock.patch.object(paged_decode, "_mma_default",
                                lambda **_: False)
    else:
      patch = contextlib.nullcontext()
    with patch:
      res = _arm(mcfg, params, batch1, batch2, sp, args.op, ecfg)
    rows.append({f"{args.op}_kernel": name, **res})
    print({k: v for k, v in rows[-1].items()
           if k not in ("first_tokens", "top")}, flush=True)
  same = all(r["first_tokens"] == rows[0]["first_tokens"] for r in rows)
  for r in rows:  # the file keeps a digest of the tokens
    r["first_tokens_sha1"] = hashlib.sha1(
        json.dumps(r.pop("first_tokens")).encode()).hexdigest()
  env = _timing.environment()
  tag = f"_{args.kv_cache_dtype}" if args.kv_cache_dtype else ""
  _timing.write_results(
      f"engine_{args.op}_ab_{args.model}{tag}_"
      + env["device"].replace(" ", "_"),
      rows, extra=dict(model=args.model, same_tokens=same,
                       kv_cache_dtype=ecfg.kv_cache_dtype))
  print(f"same greedy tokens in every arm: {same}")
  _timing.print_table(rows, [f"{args.op}_kernel", "warmup_s",
                             "throughput_tok_s", "compiles_in_timed_run",
                             "decode_step_wall_ms", "decode_step_gpu_us"]
                      + ([] if args.op == "prefill" else
                         [f"{args.op}_us_per_step"]))


if __name__ == "__main__":
  main()
