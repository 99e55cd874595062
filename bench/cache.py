"""Cache bookkeeping cost: `extend` and `claim_batch` on a large pool.

Workloads (pool of 65,536 slots, page_size 16, 32 layers):
  extend_free    `extend` by one token for 256 live sequences (lengths 512..1535
                 tokens, so about 1/16 of them cross a page boundary); the pool
                 has free slots.
  extend_free_noevict  the same with `evict=False` (no eviction path, no
                 `lax.cond`), as an engine's decode burst runs it when the free
                 slots cover the burst.
  extend_evict   the same with no free slot left: every new block evicts a
                 cached one (the LRU sort path).
  claim_half_hit `claim_batch` of 32 prompts of 2,048 tokens whose first 1,024
                 tokens (64 of 128 blocks) are in the prefix cache.
Each row reports the median time per call on the default device (`median_ms`:
back-to-back jitted calls with block_until_ready, so host dispatch overlaps
device work), for `extend` also per call when 16 calls run inside one jit as in
an engine step (`in_jit_ms`: no dispatch, and state updates in place as in a
donated engine step; `median_ms` also pays for copying the updated state
fields, since a repeated call cannot donate its input), on the host CPU backend
(`cpu_median_ms`), and the slow pure-Python model (`reference_ms`). Targets
on an H200: extend <= 0.05 ms, claim <= 1 ms.
Before timing, the device result is checked against the reference model on the
same inputs.

Usage: python bench/bench_cache.py [--small]   (or python -m bench.bench_cache)
  --small: tiny sizes, a quick CPU smoke run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # `python bench/bench_cache.py` from the repo root
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import results
from bench.common import timing as _timing
from pkvattn import cache
from pkvattn.cache import reference


def _sizes(small: bool) -> dict:
  if small:
    return dict(num_slots=1024, page_size=16, num_layers=4, num_decode=16,
                decode_len=(64, 192), num_prompts=4, prompt_len=256)
  return dict(num_slots=65536, page_size=16, num_layers=32, num_decode=256,
              decode_len=(512, 1536), num_prompts=32, prompt_len=2048)


def _config(s) -> cache.CacheConfig:
  max_pages = 2 * s["prompt_len"] // s["page_size"]
  return cache.CacheConfig(
      num_slots=s["num_slots"], page_size=s["page_size"],
      num_layers=s["num_layers"], max_seqs=2 * s["num_decode"] + 4 * s[
          "num_prompts"], max_pages=max_pages)


def _ref_config(cfg):
  # The model assumes no bucket overflow; its answers do not depend on ways.
  return cache.CacheConfig(**{**cfg.__dict__, "hash_ways": cfg.num_slots,
                              "hash_buckets": 1})


def _both(ops, state, ref):
  """Applies `ops` (list of (name, args)) to the device state and the model."""
  for name, args in ops:
    out = getattr(cache, name)(state, *[jnp.asarray(a) for a in args])
    state = out[0] if isinstance(out, tuple) else out
    getattr(ref, name)(*args)
  return state


def _time_ref(fn, make_arg, reps):
  times = []
  for _ in range(reps):
    arg = make_arg()
    t0 = time.perf_counter()
    fn(arg)
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


IN_JIT_STEPS = 16


def _compile_ms(fn, args):
  jax.clear_caches()  # otherwise the executable of the earlier calls is reused
  t0 = time.perf_counter()
  jax.jit(getattr(fn, "__wrapped__", fn)).lower(*args).compile()
  return (time.perf_counter() - t0) * 1e3


def _extend_steps(state, ids, num_new, evict=True):
  """IN_JIT_STEPS decode steps inside one jit, as an engine step would run them."""
  for _ in range(IN_JIT_STEPS):
    state, _ = cache.extend(state, ids, num_new, evict=evict)
  return state


def _extend_no_evict(state, ids, num_new):
  return cache.extend(state, ids, num_new, evict=False)


def _extend_steps_no_evict(state, ids, num_new):
  return _extend_steps(state, ids, num_new, evict=False)


def _row(name, fn, args, ref_ms, extra, in_jit=None):
  """median_ms: one jitted call per step (includes host dispatch, overlapped).
  in_jit_ms: per call when IN_JIT_STEPS calls run inside one jit (no dispatch)."""
  dev = _timing.time_fn(fn, *args)
  cpu = jax.devices("cpu")[0]
  cpu_args = jax.device_put(args, cpu)
  cpu_t = _timing.time_fn(fn, *cpu_args, iters=5, min_time_s=0.05)
  row = dict(spec=name, impl="jax", median_ms=dev["median_ms"],
             p10_ms=dev["p10_ms"], p90_ms=dev["p90_ms"],
             compile_ms=_compile_ms(fn, args),
             cpu_median_ms=cpu_t["median_ms"], reference_ms=ref_ms,
             speedup_vs_reference=ref_ms / dev["median_ms"], **extra)
  if in_jit is not None:
    t = _timing.time_fn(jax.jit(in_jit), *args)
    row["in_jit_ms"] = t["median_ms"] / IN_JIT_STEPS
  return row


def run(small: bool) -> list[dict]:
  s = _sizes(small)
  cfg = _config(s)
  ps = s["page_size"]
  rng = np.random.default_rng(0)
  rows = []

  # ---- decode population: num_decode live sequences -------------------------
  nd = s["num_decode"]
  lo, hi = s["decode_len"]
  lens = rng.integers(lo, hi, nd).astype(np.int32)
  width = cfg.max_seq_len
  toks = rng.integers(0, 32000, (nd, width)).astype(np.int32)
  ids = np.arange(nd, dtype=np.int32)
  state = cache.init_cache(cfg)
  ref = reference.ReferenceCache(_ref_config(cfg))
  state = _both([("claim_batch", (ids, toks, lens))], state, ref)
  one = np.ones(nd, np.int32)

  def check_extend(st, rf):
    new_st, res = cache.extend(st, jnp.asarray(ids), jnp.asarray(one))
    rf = rf.copy()
    want = rf.extend(ids, one)
    assert np.asarray(res.ok).tolist() == want["ok"]
    got_rows = np.asarray(new_st.seq_slots)[ids]
    assert all(got_rows[i].tolist() == rf.seq_row(int(i)) for i in ids)
    return int(np.asarray(res.num_new_blocks).sum())

  new_blocks = check_extend(state, ref)
  ref_ms = _time_ref(lambda r: r.extend(ids, one), lambda: ref.copy(), 3)
  rows.append(_row("extend_free", cache.extend,
                   (state, jnp.asarray(ids), jnp.asarray(one)), ref_ms,
                   dict(batch=nd, new_blocks=new_blocks,
                        num_slots=cfg.num_slots, page_size=ps),
                   in_jit=_extend_steps))
  print(rows[-1], file=sys.stderr)
  rows.append(_row("extend_free_noevict", jax.jit(_extend_no_evict),
                   (state, jnp.asarray(ids), jnp.asarray(one)), ref_ms,
                   dict(batch=nd, new_blocks=new_blocks,
                        num_slots=cfg.num_slots, page_size=ps),
                   in_jit=_extend_steps_no_evict))
  print(rows[-1], file=sys.stderr)

  # ---- fill the rest of the pool with cached blocks -> extend must evict ----
  free = int(cache.stats(state)["num_free"])
  per = cfg.max_pages
  nfill = -(-free // per)
  fill_ids = np.arange(nd, nd + nfill, dtype=np.int32)
  fill_tok = rng.integers(0, 32000, (nfill, width)).astype(np.int32)
  blocks = [per] * (free // per) + ([free % per] if free % per else [])
  fill_len = np.asarray(blocks, np.int32) * ps
  for start in range(0, nfill, 64):
    sl = slice(start, start + 64)
    state = _both([("claim_batch", (fill_ids[sl], fill_tok[sl], fill_len[sl])),
                   ("commit", (fill_ids[sl], fill_tok[sl], fill_len[sl])),
                   ("release", (fill_ids[sl],))], state, ref)
  st_now = cache.stats(state)
  assert int(st_now["num_free"]) == 0, st_now
  new_blocks = check_extend(state, ref)
  ref_ms = _time_ref(lambda r: r.extend(ids, one), lambda: ref.copy(), 3)
  rows.append(_row("extend_evict", cache.extend,
                   (state, jnp.asarray(ids), jnp.asarray(one)), ref_ms,
                   dict(batch=nd, new_blocks=new_blocks,
                        num_slots=cfg.num_slots, page_size=ps,
                        num_free=int(st_now["num_free"]),
                        num_cached=int(st_now["num_cached"])),
                   in_jit=_extend_steps))
  print(rows[-1], file=sys.stderr)

  # ---- claim: prompts whose first half is cached ------------------------------
  state = cache.init_cache(cfg)
  ref = reference.ReferenceCache(_ref_config(cfg))
  npr, plen = s["num_prompts"], s["prompt_len"]
  prompts = rng.integers(0, 32000, (npr, plen)).astype(np.int32)
  half = plen // 2
  warm_ids = np.arange(npr, dtype=np.int32)
  half_len = np.full(npr, half, np.int32)
  # Publish the first halves (one extra token so all half blocks are full and
  # committed), then release them into the cache.
  state = _both([("claim_batch", (warm_ids, prompts, half_len + 1)),
                 ("commit", (warm_ids, prompts, half_len + 1)),
                 ("release", (warm_ids,))], state, ref)
  claim_ids = np.arange(npr, 2 * npr, dtype=np.int32)
  full_len = np.full(npr, plen, np.int32)
  args = (state, jnp.asarray(claim_ids), jnp.asarray(prompts),
          jnp.asarray(full_len))
  _, res = cache.claim_batch(*args)
  want = ref.copy().claim_batch(claim_ids, prompts, full_len)
  assert np.asarray(res.ok).tolist() == want["ok"]
  assert np.asarray(res.num_reused_tokens).tolist() == want["num_reused_tokens"]
  reused = int(np.asarray(res.num_reused_tokens).sum()) // ps
  total = int(np.asarray(res.num_new_blocks).sum()) + reused
  ref_ms = _time_ref(lambda r: r.claim_batch(claim_ids, prompts, full_len),
                     lambda: ref.copy(), 3)
  rows.append(_row("claim_half_hit", cache.claim_batch, args, ref_ms,
                   dict(batch=npr, prompt_len=plen, reused_blocks=reused,
                        total_blocks=total, num_slots=cfg.num_slots,
                        page_size=ps)))
  print(rows[-1], file=sys.stderr)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true",
                      help="tiny sizes for a quick CPU run")
  results.add_out_arg(parser)
  args = parser.parse_args(argv)
  env = results.environment()
  rows = run(args.small)
  _timing.print_table(rows, ["spec", "batch", "median_ms", "in_jit_ms",
                             "p10_ms", "p90_ms", "cpu_median_ms",
                             "reference_ms", "compile_ms"])
  name = f"cache{'_small' if args.small else ''}_{results.device_tag()}"
  for p in results.write(name, rows, out=args.out, env=env, extra=dict(
      targets_ms=dict(extend=0.05, claim_batch=1.0))):
    print("wrote", p)


if __name__ == "__main__":
  main()
