"""Tensor-parallel engine benchmark: a Llama-3.2-1B-shaped model, tp=2 vs tp=1.

Full run (2 GPUs): random bf16 weights with Llama 3.2 1B's shapes (16 layers,
hidden 2048, 32/8 heads of 64, vocab 128256), 16 prompts of 512 tokens, 64
new tokens each (greedy, EOS ignored), through `pkvattn.engine.Engine` on one
device (tp=1, no mesh) and with `mesh=pkvattn.parallel.make_mesh(2)` (tp=2:
heads, MLP columns and the KV pool sharded, one `shard_map` per step), in the
same run. `impl` defaults to None (pallas on GPU).

Correctness first: the last-token logits of a one-step prefill of two prompts
under tp=2 vs tp=1 (max abs difference, argmax equality), then the greedy
tokens of the timed runs (identical sequences, token agreement; bf16 random
weights may flip a near-tie, since the row-parallel sums run in another
order).

Timing: each engine runs the workload twice; the second run is reported
(every bucket and the decode burst are compiled by then). Prefill tokens/s =
prompt tokens computed / wall time of steps that carried prefill tokens;
decode tokens/s = decode tokens / wall time of decode-only steps (both include
the per-step host work and the one device->host sync per device call).
`speedup_vs_tp1 = tok_s[tp=2] / tok_s[tp=1]` (> 1 = tp=2 faster).

`--small`: a tiny model on 2 forced host CPU devices (f32, xla). Writes
`<out>/tp[_small|_f32]_<device>.json`; prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(argv):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true",
                  help="tiny model and workload on 2 forced CPU devices")
  ap.add_argument("--tp", type=int, default=2, help="compared with tp=1")
  ap.add_argument("--out", default="bench/results",
                  help="results folder (default bench/results)")
  ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                  help="default: float32 on CPU, bfloat16 on GPU; float32 on GPU "
                  "shows the greedy tokens are identical up to summation order")
  ap.add_argument("--impl", choices=("pallas", "xla"), default=None,
                  help="default: pallas on GPU, xla elsewhere")
  ap.add_argument("--num-prompts", type=int, default=None)
  ap.add_argument("--prompt-len", type=int, default=None)
  ap.add_argument("--new-tokens", type=int, default=None)
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--max-num-tokens", type=int, default=None)
  ap.add_argument("--decode-steps", type=int, default=None)
  return ap.parse_args(argv)


def main(argv=None):
  args = _parse(argv)
  if args.small and "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    # Read when the backend starts (below), so setting it here is enough.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count="
                               f"{max(args.tp, 2)}").strip()

  import jax
  import jax.numpy as jnp
  import numpy as np

  from bench.common import results
  from bench.common import timing as _timing
  from bench.common.models import LLAMA_3_2_1B
  from bench.common.models import SMALL
  from pkvattn import parallel
  from pkvattn.engine import Engine, EngineConfig, EngineStats, SamplingParams
  from pkvattn.flax import AttentionPlan, layer_page_tables
  from pkvattn.models import Model, forward, init_params

  small = args.small
  env = results.environment()
  mcfg = SMALL if small else LLAMA_3_2_1B
  num_prompts = args.num_prompts or (4 if small else 16)
  prompt_len = args.prompt_len or (48 if small else 512)
  new_tokens = args.new_tokens or (16 if small else 64)
  decode_steps = args.decode_steps or (4 if small else 8)
  budget = args.max_num_tokens or (64 if small else 2048)
  dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  if args.dtype is not None:
    dtype = jnp.dtype(args.dtype)
  if len(jax.devices()) < args.tp:
    sys.exit(f"need {args.tp} devices, found {len(jax.devices())}")
  mesh = parallel.make_mesh(args.tp)

  params = init_params(mcfg, jax.random.key(0), dtype, scale=0.02)
  model = Model("small" if small else "llama-3.2-1b-shaped", mcfg, params, None)
  rng = np.random.default_rng(0)
  prompts = [[mcfg.bos_token_id % mcfg.vocab_size]
             + rng.integers(0, mcfg.vocab_size, prompt_len - 1).tolist()
             for _ in range(num_prompts)]

  # --- correctness: one-step prefill logits, tp=N vs one device.
  lens = [len(p) for p in prompts[:2]]
  max_pages = -(-max(lens) // args.page_size)
  slot_table = np.arange(2 * max_pages, dtype=np.int32).reshape(2, max_pages)
  q_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  plan = AttentionPlan.create(
      layer_page_tables(jnp.asarray(slot_table), mcfg.num_layers), q_indptr,
      np.asarray(lens, np.int32), int(q_indptr[-1]))
  tokens = jnp.asarray(np.concatenate(prompts[:2]), jnp.int32)

  def prefill_logits(m, mesh_):
    pool = jnp.zeros(m.cfg.pool_shape(slot_table.size, args.page_size), dtype)
    fn = jax.jit(lambda p, kv: forward(
        p, m.cfg, tokens, kv, plan, logits_indices=jnp.asarray(q_indptr[1:] - 1),
        impl=args.impl, mesh=mesh_))
    return np.asarray(fn(m.params, pool)[0], np.float32)

  expected = prefill_logits(model, None)
  actual = prefill_logits(parallel.shard_model(model, mesh), mesh)
  checks = dict(
      prefill_logits_max_abs_diff=float(np.max(np.abs(actual - expected))),
      prefill_logits_max_abs=float(np.max(np.abs(expected))),
      prefill_argmax_equal=bool((actual.argmax(-1) == expected.argmax(-1)).all()))
  print("checks:", checks, flush=True)

  # --- timed engine runs.
  blocks = -(-(prompt_len + new_tokens) // args.page_size)
  cfg = EngineConfig(
      page_size=args.page_size, num_slots=num_prompts * blocks + 8,
      max_seqs=num_prompts, max_num_tokens=max(budget, num_prompts),
      max_model_len=blocks * args.page_size, impl=args.impl,
      enable_prefix_reuse=False, decode_steps=decode_steps)
  sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
  rows, outputs = [], {}
  for tp in (1, args.tp):
    t0 = time.perf_counter()
    engine = Engine(model, cfg, mesh=None if tp == 1 else mesh)
    engine.generate(prompts, sp)            # compiles every bucket + burst
    warm_s = time.perf_counter() - t0
    engine.stats = EngineStats()
    t0 = time.perf_counter()
    outputs[tp] = engine.generate(prompts, sp)
    wall = time.perf_counter() - t0
    st = engine.stats
    rows.append(dict(
        tp=tp, impl=args.impl or ("pallas" if jax.default_backend() == "gpu"
                                  else "xla"),
        num_prompts=num_prompts, prompt_len=prompt_len, new_tokens=new_tokens,
        steps=st.num_steps, prefill_tokens=st.prefill_tokens,
        decode_tokens=st.decode_tokens,
        prefill_tok_s=st.prefill_tokens_per_s,
        decode_tok_s=st.decode_tokens_per_s,
        prefill_time_s=st.prefill_time_s, decode_time_s=st.decode_time_s,
        host_time_s=st.host_time_s, wall_s=wall, first_run_s=warm_s,
        pool_sharding=str(engine.pool.sharding.spec) if tp > 1 else "one device"))
    print(f"[tp={tp}] prefill {rows[-1]['prefill_tok_s']:,.0f} tok/s, decode "
          f"{rows[-1]['decode_tok_s']:,.0f} tok/s (first run incl. compile "
          f"{warm_s:.1f} s)", flush=True)
    del engine
    gc.collect()

  a, b = outputs[1], outputs[args.tp]
  extra = dict(
      model=model.name, dtype=str(jnp.dtype(dtype)), tp=args.tp, **checks,
      identical_sequences_frac=float(np.mean([x == y for x, y in zip(a, b)])),
      token_agreement=float(np.mean([np.mean(np.equal(x, y))
                                     for x, y in zip(a, b)])),
      model_config=dataclasses.asdict(mcfg) | {"rope": str(mcfg.rope)})
  for key in ("prefill_tok_s", "decode_tok_s"):
    base = rows[0][key]
    rows[1][f"{key.split('_')[0]}_speedup_vs_tp1"] = (
        rows[1][key] / base if base else None)
  print(f"tp={args.tp} vs tp=1: identical sequences "
        f"{100 * extra['identical_sequences_frac']:.0f}%, token agreement "
        f"{100 * extra['token_agreement']:.1f}%")
  _timing.print_table(rows, ["tp", "impl", "prefill_tok_s", "decode_tok_s",
                             "prefill_speedup_vs_tp1", "decode_speedup_vs_tp1",
                             "steps", "first_run_s", "pool_sharding"])
  name = "tp_small" if small else "tp"
  if args.dtype == "float32" and not small:
    name = "tp_f32"
  name += f"_{results.device_tag()}"
  for path in results.write(name, rows, out=args.out, extra=extra, env=env):
    print("wrote", path)


if __name__ == "__main__":
  main()
