"""Engine with FP8 vs bf16 KV pages on the Llama-3.2-1B shape (GPU).

Random bf16 weights of Llama 3.2 1B's shapes (`bench_engine.LLAMA_3_2_1B`),
`--num-prompts` prompts of `--prompt-len` tokens, `--new-tokens` greedy new
tokens (EOS ignored), all running at once (max_seqs = num_prompts), pallas
kernels, through `Engine` with `kv_cache_dtype="auto"` (bf16) and "fp8_e4m3"
(scales calibrated from the prompts) in the same process. Reported: decode
tokens/s (decode-only steps and bursts, compilation excluded), prefill
tokens/s, and for a fixed KV byte budget (`--kv-gib`) the slots each dtype
gets and the sequences of `prompt_len + new_tokens` tokens they hold.

With `--trace`, a second `generate` per dtype runs under jax.profiler and
its decode phase (after the last prefill-kernel launch) is summed by
kernel kind: GPU-busy time per decode step against the step's wall time
(the difference is launch gaps and host work), with the GPU's idle time
per step by gap size and the largest gaps (`idle_gaps`). `--dtypes` runs
one dtype only (a diagnostic: nothing is compared or written), and
`--prefill-backend` forces paged_prefill's kernel (an A/B of its default).

Run:  python -m bench.bench_engine_fp8 [--num-prompts 256] [--prompt-len 1024]
Results: bench/results/engine_fp8.json (and $OUT).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import _timing
from bench.bench_engine import LLAMA_3_2_1B
from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.models import Model, init_params
from pkvattn.serving.config import slots_for_memory


def _kind(name: str) -> str:
  n = name.lower()
  for key, kind in (("paged_decode", "decode attention"),
                    ("prefill", "prefill attention"),
                    ("rope", "rope+append"), ("append", "rope+append"),
                    ("gemm", "matmul"), ("xmma", "matmul"),
                    ("cutlass", "matmul"), ("cublas", "matmul"),
                    ("memcpy", "memcpy"), ("memset", "memset")):
    if key in n:
      return kind
  return "other (fusions)"


def idle_gaps(events, steps: int) -> dict:
  """Where the GPU idles between kernels: the idle time per step in gaps of
  each size class, and the largest gaps with the kernels around them (a
  burst boundary, a per-iteration sync and launch-bound runs of short
  kernels look different here)."""
  edges = (0.01, 0.1, 1.0)  # ms
  per = {f"<{edges[0]}ms": 0.0, **{f"{a}-{b}ms": 0.0 for a, b in
                                   zip(edges, edges[1:])},
         f">{edges[-1]}ms": 0.0}
  counts = dict.fromkeys(per, 0)
  gaps, end = [], None
  for start, dur, name in events:
    if end is not None and start > end[0]:
      gap = (start - end[0]) / 1e6
      gaps.append((gap, end[1], name))
      i = sum(gap >= e for e in edges)
      key = list(per)[i]
      per[key] += gap / steps
      counts[key] += 1
    if end is None or start + dur > end[0]:
      end = (start + dur, name)
  top = sorted(gaps, key=lambda g: -g[0])[:8]
  return dict(idle_ms_per_step={k: round(v, 4) for k, v in per.items()},
              gap_counts=counts,
              largest=[(round(g, 3), a[:40], b[:40]) for g, a, b in top])


def decode_trace(engine, prompts, new_tokens: int, num_layers: int) -> dict:
  """Kernel time of the decode phase of one `generate`, by kind, per step."""
  events = _timing.gpu_trace_events([lambda: engine.generate(
      prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))])
  # Decode-only steps: after the last prefill-kernel launch (mixed steps
  # run both kernels).
  last = max((i for i, e in enumerate(events) if "prefill" in e[2]),
             default=-1)
  dec = events[last + 1:]
  if not any("paged_decode" in e[2] for e in dec):
    return {}
  span_ms = (dec[-1][0] + dec[-1][1] - dec[0][0]) / 1e6
  steps = max(1, sum("paged_decode" in e[2] for e in dec) // num_layers)
  by, other = {}, {}
  for _, dur, name in dec:
    kind, ms = _kind(name), dur / 1e6 / steps
    by[kind] = by.get(kind, 0.0) + ms
    if kind == "other (fusions)":
      other[name] = other.get(name, 0.0) + ms
  busy = sum(by.values())
  top = sorted(other.items(), key=lambda kv: -kv[1])[:10]
  return dict(decode_steps=steps, step_wall_ms=span_ms / steps,
              idle_gaps=idle_gaps(dec, steps),
              top_other_ms={k[:80]: round(v, 4) for k, v in top},
              step_gpu_busy_ms=busy,
              step_ms_by_kind={k: round(v, 4) for k, v in sorted(
                  by.items(), key=lambda kv: -kv[1])})


def _force_prefill_backend(backend: str):
  """Every `paged_prefill.Config.default_for` call in this process picks
  `backend` (its other choices unchanged)."""
  from pkvattn.pallas_kernels import paged_prefill
  default_for = paged_prefill.Config.default_for.__func__
  paged_prefill.Config.default_for = classmethod(
      lambda cls, **kw: default_for(cls, **{**kw, "backend": backend}))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--num-prompts", type=int, default=256)
  ap.add_argument("--prompt-len", type=int, default=1024)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--kv-gib", type=float, default=8.0)
  ap.add_argument("--decode-steps", type=int, default=8)
  ap.add_argument("--dtypes", default="auto,fp8_e4m3",
                  help="comma list of kv_cache_dtype values to run")
  ap.add_argument("--prefill-backend", default="auto",
                  choices=("auto", "triton", "mosaic"),
                  help="force paged_prefill's kernel (an A/B of the default)")
  ap.add_argument("--trace", action="store_true",
                  help="profile a second generate's decode phase per dtype")
  args = ap.parse_args()
  if args.prefill_backend != "auto":
    _force_prefill_backend(args.prefill_backend)
  mcfg = LLAMA_3_2_1B
  params = init_params(mcfg, jax.random.key(0), jnp.bfloat16)
  model = Model("llama-3.2-1b-shape", mcfg, params, None)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(1000, 100000, size=args.prompt_len))
             for _ in range(args.num_prompts)]
  total = args.prompt_len + args.new_tokens
  blocks = -(-total // args.page_size)
  rows, outs = [], {}
  for dt in args.dtypes.split(","):
    cfg = EngineConfig(
        page_size=args.page_size, num_slots=args.num_prompts * blocks + 8,
        max_seqs=args.num_prompts, max_num_tokens=8192,
        max_model_len=blocks * args.page_size, impl="pallas",
        enable_prefix_reuse=False, decode_steps=args.decode_steps,
        kv_cache_dtype=dt)
    engine = Engine(model, cfg)
    t0 = time.perf_counter()
    engine.warmup()
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs[dt] = engine.generate(prompts, SamplingParams(
        max_new_tokens=args.new_tokens, ignore_eos=True))
    wall = time.perf_counter() - t0
    st = engine.stats
    budget = int(args.kv_gib * 2**30)
    slots = slots_for_memory(dataclasses.replace(cfg, kv_cache_memory=budget),
                             mcfg, engine.pool.dtype)
    rows.append(dict(
        kv_cache_dtype=st.kv_cache_dtype, kv_cache_bytes=st.kv_cache_bytes,
        prefill_backend=args.prefill_backend,
        decode_tok_s=st.decode_tokens_per_s,
        prefill_tok_s=st.prefill_tokens_per_s, warmup_s=warm, wall_s=wall,
        num_compiles_after_warmup=st.num_compiles - len(engine.programs()),
        budget_gib=args.kv_gib, budget_slots=slots,
        budget_sequences=slots // blocks))
    if args.trace:
      rows[-1]["decode_trace"] = decode_trace(engine, prompts,
                                              args.new_tokens,
                                              mcfg.num_layers)
    print(rows[-1], flush=True)
    del engine
    gc.collect()
  if len(rows) < 2:  # one dtype: a diagnostic run, nothing to compare
    return
  agree = float(np.mean([np.mean(np.equal(a, b))
                         for a, b in zip(outs["auto"], outs["fp8_e4m3"])]))
  extra = dict(num_prompts=args.num_prompts, prompt_len=args.prompt_len,
               new_tokens=args.new_tokens, decode_steps=args.decode_steps,
               token_agreement=agree,
               decode_fp8_over_bf16=rows[1]["decode_tok_s"]
               / rows[0]["decode_tok_s"],
               budget_sequences_ratio=rows[1]["budget_sequences"]
               / rows[0]["budget_sequences"])
  _timing.write_results("engine_fp8", rows, extra)
  print(f"decode tok/s bf16 {rows[0]['decode_tok_s']:,.0f}, fp8 "
        f"{rows[1]['decode_tok_s']:,.0f} ({extra['decode_fp8_over_bf16']:.2f}x);"
        f" sequences in {args.kv_gib} GiB: {rows[0]['budget_sequences']} vs "
        f"{rows[1]['budget_sequences']}; token agreement {agree:.2f}")

if __name__ == "__main__":
  main()
