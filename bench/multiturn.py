"""Host KV tier benchmark: multi-turn chat whose histories exceed the pool.

Run:  `python -m bench.multiturn [--host-gb 40] [--small] [--out DIR]`

Model: random bf16 weights with Llama 3 8B's shapes, or Llama 3.2 1B's
(`--model llama3.2-1b`; `bench/common/models`).
Workload: `--convs` conversations of `--turns` turns. Turn 0 sends a history
of `--history` random tokens (4,096) plus a user message of `--user` tokens;
each later turn appends the previous answer (`--answer` tokens, greedy, EOS
ignored) and a new user message, so histories grow to about
`history + turns * (user + answer)` tokens. The conversations of a turn are
submitted one after the other, each when the previous finished
(`--arrival sequential`: time to first token is the prefill, or the reload
plus the new message's prefill, alone), or all at once (`--arrival batch`:
time to first token includes the wait for a row); the device pool holds
about a quarter of the live histories (`--pool-frac`), so between turns most
of a conversation's blocks are evicted from it. The same engine config runs
with the host tier off and on (`EngineConfig.host_kv_cache_bytes`), in the
same process, after `warmup()` (both share the step programs), one engine
in device memory at a time: the tier-off engine runs both workloads and is
dropped before the tier-on engine is built.

Measured per request: time to first token (TTFT) = from its submission
(`add_request`) to the end of the engine step that booked its first token
(the host sees it then); reported as median / p90 over the returning turns
(turn >= 1) and over turn 0. Throughput = generated + prompt tokens / wall
time of all turns. The tier's stats: blocks offloaded / reloaded, host hit
rate, bytes and copy time (host side). Bandwidth: the reload path (the host
batches' copies to the device + the scatter into the pool) timed alone on
the warm engine, against the copy roofs of the same run: `jax.device_put` of
a large array from pinned host memory to HBM and back (`memory_kind=
"pinned_host"`, where the platform has it) and from a numpy array.

A second workload without reuse (distinct prompts, the pool filled so the
tier mirrors every eviction) checks what the tier costs when it cannot help:
`no_reuse_loss = 1 - throughput_on / throughput_off` (target < 2%).

Correctness first: the greedy answers with the tier on vs off (identical in
f32; bf16 may flip a near-tie between a block recomputed by a prefill and the
same block kept from the decode that wrote it) and the tier's invariants.

`--small`: a tiny f32 model on the CPU, seconds. Writes
`<out>/multiturn_<model>_<arrival>_history<N>_<device>.json`
(`multiturn_small_<device>.json` with `--small`); prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(argv):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true",
                  help="tiny f32 model and workload (CPU smoke run)")
  ap.add_argument("--convs", type=int, default=None)
  ap.add_argument("--turns", type=int, default=None)
  ap.add_argument("--history", type=int, default=None)
  ap.add_argument("--user", type=int, default=None)
  ap.add_argument("--answer", type=int, default=None)
  ap.add_argument("--max-seqs", type=int, default=None)
  ap.add_argument("--model", choices=("llama3.2-1b", "llama3-8b"),
                  default="llama3-8b", help="the shape (random weights)")
  ap.add_argument("--arrival", choices=("batch", "sequential"),
                  default="sequential",
                  help="a turn's conversations submitted at once (batch) or "
                  "one after the other, each when the previous finished "
                  "(sequential: time to first token without queueing)")
  ap.add_argument("--pool-frac", type=float, default=0.25,
                  help="device pool / live history tokens of the last turn")
  ap.add_argument("--host-gb", type=float, default=None)
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--out", default="bench/results",
                  help="results folder (default bench/results)")
  return ap.parse_args(argv)


def _percentile(xs, q):
  import numpy as np
  return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def _run_turns(engine, convs, turns, rng, hist0, user, answer, vocab,
               sequential=False):
  """Runs the multi-turn workload; returns (answers, ttft rows, wall s,
  tokens). `sequential`: a turn's conversations are submitted one after the
  other, each when the previous finished (time to first token without
  queueing); else all at once."""
  from pkvattn.engine import SamplingParams
  sp = SamplingParams(max_new_tokens=answer, ignore_eos=True)
  hist = [rng.integers(1, vocab, hist0).tolist() for _ in range(convs)]
  answers, ttft, tokens = [], [], 0
  t_start = time.perf_counter()

  def drain(submitted, first):
    while engine.has_unfinished():
      engine.step()
      now = time.perf_counter()
      for rid in submitted:
        if rid not in first and engine.get_request(rid).output:
          first[rid] = now

  for turn in range(turns):
    prompts = [h + rng.integers(1, vocab, user).tolist() for h in hist]
    submitted, first = {}, {}
    for c, p in enumerate(prompts):
      rid = engine.add_request(p, sp)
      submitted[rid] = (c, time.perf_counter())
      if sequential:
        drain(submitted, first)
    drain(submitted, first)
    outs = [None] * convs
    for rid, (c, t0) in submitted.items():
      req = engine.get_request(rid)
      outs[c] = list(req.output)
      ttft.append(dict(turn=turn, conv=c, ttft_s=first[rid] - t0,
                       prompt_len=len(prompts[c])))
      tokens += len(prompts[c]) + len(req.output)
    answers.append(outs)
    hist = [p + o for p, o in zip(prompts, outs)]
  return answers, ttft, time.perf_counter() - t_start, tokens


def _no_reuse(engine, n, length, answer, rng, vocab):
  from pkvattn.engine import SamplingParams
  sp = SamplingParams(max_new_tokens=answer, ignore_eos=True)
  prompts = [rng.integers(1, vocab, length).tolist() for _ in range(n)]
  t0 = time.perf_counter()
  outs = engine.generate(prompts, sp)
  wall = time.perf_counter() - t0
  return outs, sum(len(p) + len(o) for p, o in zip(prompts, outs)) / wall


def _roofs(mb: int):
  """GB/s of `jax.device_put` host <-> HBM for `mb` MiB: pinned host memory
  (where the platform has the memory kind) and a numpy array."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  out = {}
  n = mb * 2**20
  x = jnp.ones((n // 2,), jnp.bfloat16)
  x.block_until_ready()
  dev = jax.devices()[0]

  def timed(fn, reps=5):
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
      fn()
    return n * reps / (time.perf_counter() - t0) / 1e9

  kinds = {m.kind for m in dev.addressable_memories()} \
      if hasattr(dev, "addressable_memories") else set()
  if "pinned_host" in kinds and "device" in kinds:
    s = jax.sharding.make_single_device_sharding(dev)
    pinned = jax.device_put(x, s.with_memory_kind("pinned_host"))
    pinned.block_until_ready()
    out["pinned_h2d_gbps"] = timed(lambda: jax.device_put(
        pinned, s.with_memory_kind("device")).block_until_ready())
    out["pinned_d2h_gbps"] = timed(lambda: jax.device_put(
        x, s.with_memory_kind("pinned_host")).block_until_ready())
  host = np.asarray(x)
  out["numpy_h2d_gbps"] = timed(lambda: jax.device_put(host).block_until_ready())
  out["numpy_d2h_gbps"] = timed(lambda: np.asarray(x + 0))
  return out


def _reload_bandwidth(engine, blocks: int):
  """GB/s of the tier's reload path (batch copies to the device + scatter
  into the pool) alone, over up to `blocks` host slots that hold data."""
  import jax
  import numpy as np
  tier = engine.host_tier
  tier.flush()  # every batch in host memory
  jax.block_until_ready([b[0] for b in tier._batches.values()])  # noqa: SLF001
  hs = np.flatnonzero(tier._batch_of >= 0)[:blocks]  # noqa: SLF001
  if not len(hs):
    return float("nan")
  rows = np.full(len(hs), -1, np.int32)  # dropped by the scatter
  run = lambda: tier.load(  # noqa: E731
      engine.pool, engine.state, rows, np.zeros(len(hs), np.int32), hs)
  engine.pool = run()
  jax.block_until_ready(engine.pool)
  t0 = time.perf_counter()
  reps = 5
  for _ in range(reps):
    engine.pool = run()
  jax.block_until_ready(engine.pool)
  return len(hs) * tier.slot_bytes * reps / (time.perf_counter() - t0) / 1e9


def main(argv=None):
  args = _parse(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np

  from bench.common import results
  from bench.common.models import SHAPES, SMALL
  from pkvattn import cache
  from pkvattn.engine import Engine, EngineConfig
  from pkvattn.models import Model, init_params

  env = results.environment()
  small = args.small
  mcfg = SMALL if small else SHAPES[args.model]
  convs = args.convs or (6 if small else 32)
  turns = args.turns or (3 if small else 4)
  hist0 = args.history or (40 if small else 4096)
  user = args.user or (16 if small else 384)
  answer = args.answer or (4 if small else 32)
  max_seqs = args.max_seqs or (2 if small else 8)
  ps = args.page_size
  last_hist = hist0 + turns * (user + answer)
  max_len = -(-(last_hist + 8) // ps) * ps
  live = convs * last_hist
  num_slots = max(int(args.pool_frac * live) // ps,
                  max_seqs * (max_len // ps) + max_seqs)
  dtype = jnp.float32 if small and jax.default_backend() == "cpu" \
      else jnp.bfloat16
  slot_bytes = (mcfg.num_layers * 2 * ps * mcfg.num_kv_heads * mcfg.head_dim
                * jnp.dtype(dtype).itemsize)
  host_bytes = int(args.host_gb * 1e9) if args.host_gb else \
      2 * live // ps * slot_bytes
  cfg = EngineConfig(page_size=ps, num_slots=num_slots, max_seqs=max_seqs,
                     max_num_tokens=256 if small else 4096,
                     max_model_len=max_len, decode_steps=4 if small else 8,
                     token_buckets=None if small else (max_seqs, 512, 4096))
  params = init_params(mcfg, jax.random.key(0), dtype, scale=0.02)
  model = Model("small" if small else f"{args.model}-shaped", mcfg, params,
                None)
  print(f"pool {num_slots} slots ({num_slots * slot_bytes / 2**30:.2f} GiB, "
        f"{num_slots * ps} tokens) vs live histories {live} tokens; host "
        f"tier {host_bytes / 2**30:.2f} GiB", flush=True)

  # One engine in device memory at a time: each holds its own weights and
  # pool (an 8B shape's two engines did not fit an H100's 80 GB).
  nr_len = min(max_len - answer - 1, 1024 if not small else 40)
  n = max(2 * num_slots * ps // nr_len, 2 * max_seqs)
  rows, answers, nr = [], {}, []
  for tier in (False, True):
    e = Engine(model, dataclasses.replace(
        cfg, host_kv_cache_bytes=host_bytes if tier else 0))
    t0 = time.perf_counter()
    e.warmup()
    warm = time.perf_counter() - t0
    answers[tier], ttft, wall, toks = _run_turns(
        e, convs, turns, np.random.default_rng(1), hist0, user, answer,
        mcfg.vocab_size, sequential=args.arrival == "sequential")
    ret = [r["ttft_s"] for r in ttft if r["turn"] >= 1]
    first = [r["ttft_s"] for r in ttft if r["turn"] == 0]
    st = e.stats
    rows.append(dict(
        workload="multiturn", host_tier=tier, warmup_s=warm, wall_s=wall,
        tokens_per_s=toks / wall,
        ttft_returning_median_s=_percentile(ret, 50),
        ttft_returning_p90_s=_percentile(ret, 90),
        ttft_first_turn_median_s=_percentile(first, 50),
        prefill_tokens=st.prefill_tokens, reused_tokens=st.reused_tokens,
        host_blocks_offloaded=st.host_blocks_offloaded,
        host_blocks_reloaded=st.host_blocks_reloaded,
        host_hit_rate=st.host_hit_rate,
        host_bytes_offloaded=st.host_bytes_offloaded,
        host_bytes_reloaded=st.host_bytes_reloaded,
        host_transfer_s=st.host_transfer_s,
        host_phase_s=dict(e.host_tier.phase_s) if tier else {}, ttft=ttft))
    if tier:
      on, host = e, e.host_tier
      cache.validate(on.state)
      cache.validate_host_tier(host.state)
      assert on.stats.host_hits > 0, "no host hit on a multi-turn workload"
      roofs = _roofs(16 if small else 512)
      reload_gbps = _reload_bandwidth(on, 64 if small else 1024)
    # No reuse: distinct prompts, the pool filled (the tier mirrors
    # evictions).
    _no_reuse(e, max_seqs, nr_len, answer, np.random.default_rng(5),
              mcfg.vocab_size)  # fills the pool first
    if tier:  # the tier's work on this workload alone
      plans, phases = host.num_plans, dict(host.phase_s)
      blocks = on.stats.host_blocks_offloaded
    _, tps = _no_reuse(e, n, nr_len, answer, np.random.default_rng(7),
                       mcfg.vocab_size)
    nr.append(tps)
    del e
  a_off, a_on = answers[False], answers[True]
  flat_off = [t for turn in a_off for o in turn for t in o]
  flat_on = [t for turn in a_on for o in turn for t in o]
  agree = float(np.mean(np.asarray(flat_off) == np.asarray(flat_on)))
  if small:
    assert a_on == a_off, "greedy answers differ with the host tier (f32)"
  rows.append(dict(
      workload="no_reuse", prompts=n, prompt_len=nr_len,
      tokens_per_s_off=nr[0], tokens_per_s_on=nr[1], loss=1 - nr[1] / nr[0],
      host_blocks_offloaded=on.stats.host_blocks_offloaded - blocks,
      host_plans=host.num_plans - plans,
      host_phase_s={k: v - phases.get(k, 0.0)
                    for k, v in host.phase_s.items()}))
  r_off, r_on = rows[0], rows[1]
  extra = dict(
      config=dict(convs=convs, turns=turns, history=hist0, user=user,
                  answer=answer, max_seqs=max_seqs, page_size=ps,
                  num_slots=num_slots, host_bytes=host_bytes,
                  live_history_tokens=live, dtype=str(jnp.dtype(dtype)),
          model=args.model, arrival=args.arrival),
      token_agreement=agree, roofs=roofs, reload_path_gbps=reload_gbps,
      ttft_returning_speedup=(r_off["ttft_returning_median_s"]
                              / r_on["ttft_returning_median_s"]),
      throughput_speedup=r_on["tokens_per_s"] / r_off["tokens_per_s"],
      no_reuse_loss=rows[2]["loss"])
  name = ("multiturn_small" if small else
          f"multiturn_{args.model}_{args.arrival}_history{hist0}") + \
      f"_{results.device_tag()}"
  for path in results.write(name, rows, out=args.out, extra=extra, env=env):
    print("wrote", path)
  print(f"\n{'':24}{'tier off':>12}{'tier on':>12}")
  for key, unit in (("ttft_returning_median_s", "s"),
                    ("ttft_returning_p90_s", "s"),
                    ("ttft_first_turn_median_s", "s"),
                    ("tokens_per_s", "tok/s"), ("prefill_tokens", "tok"),
                    ("host_blocks_offloaded", "blk"),
                    ("host_blocks_reloaded", "blk")):
    print(f"{key:24}{r_off[key]:>12.4g}{r_on[key]:>12.4g}  {unit}")
  print(f"returning-turn median TTFT speedup {extra['ttft_returning_speedup']:.2f}x"
        f" (target >= 3x); throughput {extra['throughput_speedup']:.2f}x; "
        f"token agreement {agree:.3f}")
  print(f"no reuse: {nr[0]:.0f} vs {nr[1]:.0f} tok/s, loss "
        f"{100 * rows[2]['loss']:.2f}% (target < 2%); "
        f"{rows[2]['host_blocks_offloaded']} blocks mirrored in "
        f"{rows[2]['host_plans']} plans, host s: " + ", ".join(
            f"{k} {v:.3f}" for k, v in rows[2]["host_phase_s"].items()))
  print("bandwidth GB/s: reload path " f"{reload_gbps:.2f}; " + ", ".join(
      f"{k[:-5]} {v:.2f}" for k, v in roofs.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
