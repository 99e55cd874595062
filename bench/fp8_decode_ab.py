"""FP8 decode A/B: the dot dtype FP8 tiles convert to, and tile sizes.

Run on a GPU:  `python -m bench.fp8_decode_ab [--out DIR]`

For the four Llama-3-8B decode specs of bench_decode, times the FP8-page
decode kernel with FP8 tiles converted to bf16 vs f16 for the dots
(`_compat.FP8_DOT_DTYPE`, read at trace time), and with 2x / 4x the tokens
per loop step of the default config (FP8 pages are half the bytes), against
bf16 pages with the default config; same process, `_timing.time_fn`.
(`results/fp8_decode_ab.json`, 2026-11-24, ran the step / warp variants
with f16 dots: its `fp8_f16_*` keys.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from bench import _timing
from bench.bench_decode import HEAD_DIM, NUM_KV_HEADS, NUM_QO_HEADS, SPECS
from pkvattn import _kv
from pkvattn.pallas_kernels import _compat
from pkvattn.pallas_kernels import paged_decode as kernel


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="bench/results")
  args = ap.parse_args()
  rows = []
  for name, spec in SPECS.items():
    b, s, ps = spec["batch_size"], spec["seq_len"], spec["page_size"]
    pages = b * s // ps
    k = jax.random.normal(jax.random.key(1), (pages, ps, NUM_KV_HEADS,
                                              HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(2), k.shape, jnp.bfloat16)
    k8, v8 = _kv.quantize(k, 4 / 448), _kv.quantize(v, 4 / 448)
    table = jax.random.permutation(jax.random.key(3), pages).astype(
        jnp.int32).reshape(b, s // ps)
    lens = jnp.full((b,), s, jnp.int32)
    q = jax.random.normal(jax.random.key(4), (b, NUM_QO_HEADS, HEAD_DIM),
                          jnp.bfloat16)
    base = kernel.Config.default_for(batch_size=b, num_kv_heads=NUM_KV_HEADS,
                                     page_size=ps, max_pages=s // ps,
                                     head_dim=HEAD_DIM)
    sc = jnp.float32(4 / 448)

    def run(pk, pv, cfg, scaled):
      kw = dict(k_scale=sc, v_scale=sc) if scaled else {}
      f = jax.jit(lambda q, a, c: kernel.paged_decode(
          q, a, c, table, table, lens, sm_scale=HEAD_DIM**-0.5, config=cfg,
          **kw))
      return _timing.time_fn(f, q, pk, pv)["median_ms"]

    row = dict(spec=name, base=dataclasses.asdict(base),
               bf16_pages_ms=run(k, v, base, False))
    for dot in ("bfloat16", "float16"):
      _compat.FP8_DOT_DTYPE = jnp.dtype(dot)
      row[f"fp8_{dot}_ms"] = run(k8, v8, base, True)
    _compat.FP8_DOT_DTYPE = None
    for mult in (2, 4):
      ppb = base.pages_per_block * mult
      if ppb * ps > 256:
        continue
      cfg = dataclasses.replace(base, pages_per_block=ppb,
                                k_splits=max(1, base.k_splits // mult))
      row[f"fp8_ppb{ppb}_ms"] = run(k8, v8, cfg, True)
    for warps in (8,):
      cfg = dataclasses.replace(base, num_warps=warps)
      row[f"fp8_w{warps}_ms"] = run(k8, v8, cfg, True)
    rows.append(row)
    print(json.dumps(row))
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "fp8_decode_ab.json")
  with open(path, "w") as f:
    json.dump(dict(environment=_timing.environment(), rows=rows), f, indent=1)
  print("->", path)


if __name__ == "__main__":
  main()
