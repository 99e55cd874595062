"""Per-kernel device time of one cache `extend` and one decode forward (ncu).

Wall time inside a jit includes the gaps between kernel launches; the issue
bars speak of device time. Run under Nsight Compute with the profiler range
limited to one call (after warm-up):

  ncu --clock-control none --profile-from-start off --csv \
      --metrics gpu__time_duration.sum python bench/ncu_kernels.py TARGET \
      > ncu.csv
  python bench/ncu_kernels.py --summarize ncu.csv

TARGET: `extend` (65,536 slots, page 16, 256 sequences +1 token, as
bench_cache's extend_free) or `decode` (Llama-3.2-1B-shaped forward of 64
decode tokens at kv ~1,100, bf16, pallas), `decode_xla` (same, xla).
"""

from __future__ import annotations

import collections
import csv
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cudart():
  for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
    try:
      return ctypes.CDLL(name)
    except OSError:
      pass
  import glob
  import site
  for d in site.getsitepackages():
    for p in glob.glob(os.path.join(d, "nvidia", "cu*", "lib", "libcudart.so*")) + \
        glob.glob(os.path.join(d, "nvidia", "cuda_runtime", "lib", "libcudart.so*")):
      return ctypes.CDLL(p)
  raise OSError("libcudart not found")


def _extend():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pkvattn import cache
  cfg = cache.CacheConfig(num_slots=65536, page_size=16, num_layers=32,
                          max_seqs=768, max_pages=256)
  rng = np.random.default_rng(0)
  nd = 256
  lens = rng.integers(512, 1536, nd).astype(np.int32)
  toks = rng.integers(0, 32000, (nd, cfg.max_seq_len)).astype(np.int32)
  ids = jnp.arange(nd, dtype=jnp.int32)
  state = cache.init_cache(cfg)
  state, _ = cache.claim_batch(state, ids, jnp.asarray(toks), jnp.asarray(lens))
  one = jnp.ones(nd, jnp.int32)
  fn = lambda: cache.extend(state, ids, one)
  return fn


def _decode(impl):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from bench.bench_engine import LLAMA_3_2_1B, SMALL
  mcfg = SMALL if os.environ.get("NCU_SMALL") else LLAMA_3_2_1B
  from pkvattn.flax import AttentionPlan, layer_page_tables
  from pkvattn.models import forward, init_params
  b, kv, ps = 64, 1100, 16
  params = init_params(mcfg, jax.random.key(0), jnp.bfloat16, scale=0.02)
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


def profile(target: str) -> None:
  import jax
  fn = {"extend": _extend, "decode": lambda: _decode("pallas"),
        "decode_xla": lambda: _decode("xla")}[target]()
  for _ in range(3):
    jax.block_until_ready(fn())
  rt = _cudart()
  rt.cudaProfilerStart()
  jax.block_until_ready(fn())
  rt.cudaProfilerStop()


def summarize(path: str) -> None:
  rows = []
  with open(path) as f:
    lines = [l for l in f if l.startswith('"')]
  for r in csv.DictReader(lines):
    if r.get("Metric Name") == "gpu__time_duration.sum":
      scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(
          r["Metric Unit"], 1.0)
      rows.append((r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * scale))
  total = sum(t for _, t in rows)
  groups = collections.defaultdict(lambda: [0, 0.0])
  for name, t in rows:
    key = name.split("(")[0][:60]
    groups[key][0] += 1
    groups[key][1] += t
  print(f"{path}: {len(rows)} kernels, device time {total:.1f} us")
  for key, (n, t) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:15]:
    print(f"  {t:9.1f} us  {n:4d}x  {key}")


def wall(targets) -> None:
  """Median wall time per call (jitted, host-timed), for comparison."""
  from bench import _timing
  for t in targets:
    fn = {"extend": _extend, "decode": lambda: _decode("pallas"),
          "decode_xla": lambda: _decode("xla")}[t]()
    print(f"{t}: wall {_timing.time_fn(fn)['median_ms'] * 1e3:.1f} us per call")


if __name__ == "__main__":
  if sys.argv[1] == "--wall":
    wall(sys.argv[2:])
  elif sys.argv[1] == "--summarize":
    for p in sys.argv[2:]:
      summarize(p)
  else:
    profile(sys.argv[1])
