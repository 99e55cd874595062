"""Looks for pool-sized copies in every program the engine may run.

The pool is donated and every write to it is aliased (rope/append kernel,
`input_output_aliases`); a `copy` of a pool-shaped buffer in the compiled HLO
means XLA could not keep it in place (e.g. around a custom call inside the
layer `while` loop) and every step pays ~2x the pool size in HBM traffic.
Also counts `conditional` ops (each one syncs the host on GPU) per program.

Usage: `python -m bench.tools.check_engine_hlo [--small] [--impl pallas]`;
writes `<out>/check_engine_hlo[_small]_<device>.json`, prints a table last.
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp

from bench.common import results as results_lib
from bench.common import timing
from bench.common.models import LLAMA_3_2_1B, SMALL
from pkvattn.engine import Engine, EngineConfig
from pkvattn.models import Model, init_params


def analyze(name: str, hlo: str, pool) -> dict:
  dims = ",".join(str(d) for d in pool.shape)
  pat = re.compile(rf"\[{dims}\]")
  lines = [l.strip() for l in hlo.splitlines() if pat.search(l)]
  copies = [l for l in lines if re.search(r"= \S+ copy(-start)?\(", l)]
  res = dict(
      program=name, pool_shape=dims, pool_lines=len(lines),
      pool_copies=len(copies),
      conditionals=len(re.findall(r" conditional\(", hlo)),
      whiles=len(re.findall(r" while\(", hlo)),
      aliased="input_output_alias" in hlo,
  )
  print(res, flush=True)
  for c in copies[:5]:
    print("   COPY:", c[:240], flush=True)
  return res


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--small", action="store_true",
                  help="a tiny model (CPU)")
  ap.add_argument("--impl", default=None, help="EngineConfig.impl")
  results_lib.add_out_arg(ap)
  args = ap.parse_args(argv)
  env = results_lib.environment()
  mcfg = SMALL if args.small else LLAMA_3_2_1B
  dtype = jnp.float32 if args.small else jnp.bfloat16
  n, plen, new = (4, 40, 12) if args.small else (64, 1024, 16)
  model = Model("probe", mcfg, init_params(mcfg, jax.random.key(0), dtype,
                                           scale=0.02), None)
  blocks = -(-(plen + new) // 16)
  cfg = EngineConfig(page_size=16, num_slots=n * blocks + 8, max_seqs=n,
                     max_num_tokens=64 if args.small else 4096,
                     max_model_len=blocks * 16, impl=args.impl,
                     enable_prefix_reuse=False, decode_steps=4)
  eng = Engine(model, cfg)
  # Every program the engine may run (its bounded list), compiled ahead.
  results = [analyze(str(key), eng._lower(key).compile().as_text(), eng.pool)
             for key in eng.programs()]
  total = sum(r["pool_copies"] for r in results)
  name = ("check_engine_hlo" + ("_small" if args.small else "")
          + f"_{results_lib.device_tag()}")
  results_lib.write(name, results, out=args.out, env=env,
                    extra=dict(impl=args.impl))
  timing.print_table(results, ["program", "pool_copies", "conditionals",
                               "whiles", "aliased"])
  print(f"pool-sized copies across {len(results)} programs: {total}")


if __name__ == "__main__":
  main()
