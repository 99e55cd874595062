"""Prefill kernel diagnostics (GPU): ours vs JAX `mha`, causal and not.

Times each variant in interleaved rounds (GPU kernel time from a profiler
trace and per-call wall time) on B=4 S=4096 Llama-3-8B heads, so the inner
loop (non-causal: no masks, no diagonal) and the causal schedule can be told
apart. With XLA_FLAGS=--xla_dump_to=DIR the PTX of every kernel lands in DIR
(registers and spills: `ptxas -v`).

  python bench/prefill_diag.py [--variants a,b,...] [--s 4096] [--b 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import jax
import jax.numpy as jnp

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(_ROOT)

from bench import _timing  # noqa: E402
from bench.bench_prefill import (D, HKV, HQ, build_spec, cudnn_fn,  # noqa: E402
                                  mha_fn, rel_err)
from pkvattn.pallas_kernels import paged_prefill as pp  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--b", type=int, default=4)
  ap.add_argument("--s", type=int, default=4096)
  ap.add_argument("--page", type=int, default=16)
  ap.add_argument("--configs", default="",
                  help="';'-separated name=field:v,field:v Config overrides")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--out", default="prefill_diag")
  ap.add_argument("--mgpu", action="store_true",
                  help="also time JAX's Mosaic-GPU attention (contiguous, "
                  "attention_mgpu: wgmma + TMA + warp specialization)")
  a = ap.parse_args()
  b, s = a.b, a.s
  sm_scale = 1 / math.sqrt(D)
  sp = build_spec(jax.random.key(0), [s] * b, [s] * b, a.page)
  args = (sp["q"], sp["pool"], sp["k_table"], sp["v_table"], sp["q_indptr"],
          sp["kv_lens"])
  default = pp.Config.default_for(group_size=HQ // HKV, head_dim=D,
                                  page_size=a.page, dtype=jnp.bfloat16)
  triton = pp.Config.default_for(group_size=HQ // HKV, head_dim=D,
                                 page_size=a.page, dtype=jnp.bfloat16,
                                 backend="triton")
  configs = {"default": default}
  if default.backend != "triton":
    configs["triton default"] = triton
  for item in filter(None, a.configs.split(";")):
    name, _, kvs = item.partition("=")
    kw = {}
    base = default
    for kv in filter(None, kvs.split(",")):
      k, _, v = kv.partition(":")
      if k == "backend" and v == "triton":
        base = triton
        continue
      kw[k] = v if isinstance(getattr(default, k), str) else type(
          getattr(default, k))(int(v))
    configs[name] = dataclasses.replace(base, **kw)

  def ours(cfg, causal):
    @jax.jit
    def f(q, pool, kt, vt, qi, kl):
      return pp.paged_prefill(q, pool, pool, kt, vt, qi, kl, None,
                              causal=causal, sm_scale=sm_scale, config=cfg)[0]
    return f

  qc = sp["q"].reshape(b, s, HQ, D)
  kr = jnp.repeat(sp["k"][:, :s], HQ // HKV, axis=2)
  vr = jnp.repeat(sp["v"][:, :s], HQ // HKV, axis=2)

  entries = []
  for causal in (True, False):
    cudnn = cudnn_fn(sm_scale, causal)
    ref = jax.block_until_ready(cudnn(qc, sp["k"][:, :s], sp["v"][:, :s]))
    for name, cfg in configs.items():
      f = ours(cfg, causal)
      err = rel_err(f(*args).reshape(b, s, HQ, D), ref)
      entries.append((f"ours {name}", causal, f, args, err))
    f = mha_fn(sm_scale, causal, best=True)
    entries.append(("mha 128/64/w4/s2", causal, f, (qc, kr, vr),
                    rel_err(f(qc, kr, vr), ref)))
    entries.append(("cudnn", causal, cudnn,
                    (qc, sp["k"][:, :s], sp["v"][:, :s]), 0.0))
    if a.mgpu:
      from jax.experimental.pallas.ops.gpu import attention_mgpu
      for bkv in (64, 128):
        cfg = attention_mgpu.TuningConfig(
            block_q=64, block_kv=bkv, max_concurrent_steps=2, causal=causal)
        # The kernel takes no sm_scale (it uses 1): q is pre-scaled. It ran
        # only in f16 with jax 0.11.2 (bf16 failed inside: "src had type
        # bfloat16 and dst had type float16"), so it gets f16 copies.
        f = jax.jit(lambda q, k, v, cfg=cfg: attention_mgpu.attention(
            q, k, v, cfg))
        kc = sp["k"][:, :s].astype(jnp.float16)
        vc = sp["v"][:, :s].astype(jnp.float16)
        qs = (qc.astype(jnp.float32) * sm_scale).astype(jnp.float16)
        try:
          err = rel_err(f(qs, kc, vc), ref)
        except Exception as e:  # noqa: BLE001
          print(f"mgpu bkv{bkv} failed: {repr(e)[:300]}")
          continue
        entries.append((f"mgpu attention bq64 bkv{bkv}", causal, f,
                        (qs, kc, vc), err))
  res = {}
  for _ in range(a.rounds):
    for name, causal, f, fargs, err in entries:
      t = _timing.time_fn(f, *fargs, iters=10, min_time_s=0.1)["median_ms"]
      k = _timing.device_kernel_ms(f, lambda fargs=fargs: fargs, calls=3)
      key = (name, causal)
      old = res.get(key)
      res[key] = dict(name=name, causal=causal, err=err,
                      wall_ms=min(t, old["wall_ms"]) if old else t,
                      kernel_ms=min(k, old["kernel_ms"]) if old else k)
  rows = []
  for r in res.values():
    fl = (2 if r["causal"] else 4) * s * s * D * HQ * b
    r["tflops_kernel"] = fl / (r["kernel_ms"] * 1e-3) / 1e12
    r["tflops_wall"] = fl / (r["wall_ms"] * 1e-3) / 1e12
    rows.append(r)
  _timing.write_results(a.out, rows, extra=dict(
      b=b, s=s, page_size=a.page,
      configs={k: dataclasses.asdict(v) for k, v in configs.items()}),
      out_dirs=())
  _timing.print_table(rows, ["name", "causal", "err", "kernel_ms", "wall_ms",
                             "tflops_kernel", "tflops_wall"])


if __name__ == "__main__":
  main()
