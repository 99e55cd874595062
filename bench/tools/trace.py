"""Per-kernel GPU time of one cache `extend` and one decode forward (jax.profiler).

Wall time inside a jit includes launch gaps between kernels; this sums the
kernel durations on the device's stream lines of a `jax.profiler` trace
(`jax.profiler.ProfileData`, no TensorBoard needed), per call, grouped by
kernel name.

Targets: `extend` / `extend_noevict` (65,536 slots, page 16, 256 sequences
+1 token, as bench/cache.py's extend_free; chained calls on a donated state;
`evict=False` has no `lax.cond`, nor `extend_branchless`'s
`evict="branchless"`); `decode` / `decode_xla` (Llama-3.2-1B-shaped
forward of 64 decode tokens at kv ~1,100, bf16, layers scanned) and
`decode_unstacked` / `decode_xla_unstacked` (the same over unstacked
layers). `--small` shrinks the model for a CPU smoke run (no device lines
there).

Usage: `python -m bench.tools.trace [--small] [--out DIR] [target ...]`
(default: all). Writes `<out>/trace_<device>.json`; prints per-kernel
times per target.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import results
from bench.common import timing as _timing

CALLS = 5


def _extend(evict=True, branchless=False):
  """Chained donated calls (as inside an engine step: the state is updated in
  place, no copy of it)."""
  from pkvattn import cache
  cfg = cache.CacheConfig(num_slots=65536, page_size=16, num_layers=32,
                          max_seqs=768, max_pages=256)
  rng = np.random.default_rng(0)
  nd = 256
  lens = rng.integers(512, 1536, nd).astype(np.int32)
  toks = rng.integers(0, 32000, (nd, cfg.max_seq_len)).astype(np.int32)
  ids = jnp.arange(nd, dtype=jnp.int32)
  state, _ = cache.claim_batch(cache.init_cache(cfg), ids, jnp.asarray(toks),
                               jnp.asarray(lens))
  one = jnp.ones(nd, jnp.int32)
  mode = "branchless" if branchless else evict

  def call(st):
    return cache.extend.__wrapped__(st, ids, one, evict=mode)
  f = jax.jit(call, donate_argnums=0)
  box = {"state": state}

  def fn():
    box["state"], res = f(box["state"])
    return res
  return fn


SMALL_MODEL = []  # [True] with --small


def _decode(impl, unstacked=False):
  from bench.common.models import LLAMA_3_2_1B, SMALL
  from pkvattn.flax import AttentionPlan, layer_page_tables
  from pkvattn.models import forward, init_params, unstack_layers
  mcfg = SMALL if SMALL_MODEL else LLAMA_3_2_1B
  b, kv, ps = 64, 1100, 16
  params = init_params(mcfg, jax.random.key(0), jnp.bfloat16, scale=0.02)
  if unstacked:
    params = unstack_layers(params)
  max_pages = -(-(kv + 16) // ps)
  slot_table = np.random.default_rng(0).permutation(b * max_pages).astype(
      np.int32).reshape(b, max_pages)
  pool = jnp.zeros(mcfg.pool_shape(slot_table.size, ps), jnp.bfloat16)
  plan = AttentionPlan.create(
      layer_page_tables(jnp.asarray(slot_table), mcfg.num_layers),
      np.arange(b + 1, dtype=np.int32), np.full(b, kv, np.int32), b)
  tokens = jnp.asarray(np.arange(b, dtype=np.int32))
  f = jax.jit(forward, static_argnames=("cfg", "impl"), donate_argnums=(3,))
  state = {"pool": pool}

  def fn():
    logits, state["pool"] = f(params, cfg=mcfg, tokens=tokens,
                              kv_cache=state["pool"], plan=plan, impl=impl)
    return logits
  return fn


TARGETS = {"extend": _extend, "extend_noevict": lambda: _extend(False),
           "extend_branchless": lambda: _extend(True, True),
           "decode": lambda: _decode("pallas"),
           "decode_unstacked": lambda: _decode("pallas", True),
           "decode_xla": lambda: _decode("xla"),
           "decode_xla_unstacked": lambda: _decode("xla", True)}


def trace(name: str) -> dict:
  fn = TARGETS[name]()
  for _ in range(3):
    jax.block_until_ready(fn())
  t0 = time.perf_counter()
  for _ in range(CALLS):
    jax.block_until_ready(fn())
  wall_us = (time.perf_counter() - t0) / CALLS * 1e6
  rows = _timing.kernel_groups(
      _timing.gpu_stream_events([fn] * CALLS), CALLS, name_len=70)
  total = sum(t for _, _, t in rows)
  count = sum(n for _, n, _ in rows)
  print(f"{name}: wall {wall_us:.1f} us/call, kernels {count:.0f}/call, "
        f"device time {total:.1f} us/call", flush=True)
  for key, n, t in rows[:12]:
    print(f"   {t:9.1f} us  {n:5.0f}x  {key}")
  return dict(target=name, wall_us=wall_us, kernels_per_call=count,
              device_us=total)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("targets", nargs="*", choices=[[]] + list(TARGETS),
                  help="default: all")
  ap.add_argument("--small", action="store_true",
                  help="a tiny model (CPU smoke run)")
  results.add_out_arg(ap)
  args = ap.parse_args(argv)
  if args.small:
    SMALL_MODEL.append(True)
  env = results.environment()
  rows = [trace(t) for t in (args.targets or list(TARGETS))]
  results.write(f"trace_{results.device_tag()}", rows, out=args.out, env=env)
  _timing.print_table(rows, ["target", "wall_us", "kernels_per_call",
                             "device_us"])


if __name__ == "__main__":
  main()
