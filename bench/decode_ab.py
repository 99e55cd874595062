"""Interleaved A/B timing of paged-decode configs (issue 2's decode specs).

Single sweeps of the decode kernel drift 5-10% between runs on the H200, more
than the differences between good configs. This times a few named configs in
`--rounds` interleaved rounds on the same inputs and reports per config the
median GPU kernel time (jax.profiler trace, `_timing.device_kernel_ms`) and
the KV bandwidth from it, against the torch copy roof measured in the same
run. Every config is checked against the f32 reference first.

Usage: `python bench/decode_ab.py --specs llama3_8b_decode_b256_s1024_p16
--configs default,default+ef,8/1/4/3,8/1/4/3+ef` where a config is `default`
(`Config.default_for`) or `pages_per_block/k_splits/num_warps/num_stages`,
`+ef` adding the evict-first L2 hint on the K/V loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import _timing  # noqa: E402
from bench.bench_decode import (HEAD_DIM, NUM_KV_HEADS, SPECS, bytes_moved,  # noqa: E402
                                make_inputs, rel_err)
from pkvattn.pallas_kernels import paged_decode as kernel  # noqa: E402
from pkvattn.pallas_kernels import reference  # noqa: E402


def parse_config(text: str, spec: dict) -> kernel.Config:
  base, _, hint = text.partition("+")
  if base == "default":
    cfg = kernel.Config.default_for(
        batch_size=spec["batch_size"], num_kv_heads=NUM_KV_HEADS,
        page_size=spec["page_size"],
        max_pages=spec["seq_len"] // spec["page_size"], head_dim=HEAD_DIM)
  else:
    ppb, ks, w, st = (int(x) for x in base.split("/"))
    cfg = kernel.Config(ppb, ks, w, st)
  if hint == "ef":
    cfg = dataclasses.replace(cfg, kv_eviction="evict_first")
  return cfg


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--specs", default=",".join(SPECS))
  ap.add_argument("--configs", default="default,default+ef")
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args(argv)
  roof = _timing.torch_copy_roof_gbps() or _timing.copy_roof_gbps()
  rows = []
  for name in args.specs.split(","):
    spec = SPECS[name]
    q, k, v, table, kv_lens = make_inputs(**spec)
    nbytes = bytes_moved(spec["batch_size"], np.asarray(kv_lens),
                         spec["page_size"])
    scale = HEAD_DIM**-0.5
    want, _ = reference.paged_decode_reference(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        table, table, kv_lens, sm_scale=scale)
    fns = {}
    for c in args.configs.split(","):
      cfg = parse_config(c, spec)
      fn = jax.jit(lambda q, k, v, t, n, cfg=cfg: kernel.paged_decode(
          q, k, v, t, t, n, sm_scale=scale, config=cfg)[0])
      try:
        err = rel_err(fn(q, k, v, table, kv_lens), want)
      except Exception as e:  # noqa: BLE001  (e.g. over shared memory)
        print(f"{name} {c}: skipped, {type(e).__name__}: {str(e)[:200]}")
        continue
      if not err < 2e-2:
        raise AssertionError(f"{name} {c}: rel_err {err}")
      fns[c] = (cfg, fn)
    times = {c: [] for c in fns}
    for _ in range(args.rounds):
      for c, (_, fn) in fns.items():
        times[c].append(_timing.device_kernel_ms(
            fn, lambda: (q, k, v, table, kv_lens), calls=10))
    for c, (cfg, _) in fns.items():
      ms = float(np.median(times[c]))
      gbps = nbytes / (ms * 1e-3) / 1e9
      rows.append(dict(spec=name, config=c, config_fields=dataclasses.asdict(cfg),
                       kernel_ms=ms, round_ms=times[c], achieved_tbps=gbps / 1e3,
                       fraction_of_copy_roof=gbps / roof))
  _timing.print_table(rows, ["spec", "config", "kernel_ms", "achieved_tbps",
                             "fraction_of_copy_roof"])
  _timing.write_results("decode_ab", rows, extra=dict(copy_roof_gbps=roof))


if __name__ == "__main__":
  main()
