"""The main job's serving benchmark: pkvattn's engine vs transformers' continuous batching.

Workload (the main job at scale): a model of SmolLM2-135M-Instruct's shape (Llama
architecture, 30 layers, 9 / 3 heads of 64, vocab 49152; or `--model llama1b`:
Llama-3.2-1B's shape), random bf16 weights (speed does not depend on weight
values), 256 prompts of 35-47 random tokens (≈41, the chat prompts' length),
256 new tokens each, greedy, EOS ignored, `EngineConfig(page_size=16,
num_slots=8192, max_seqs=256, max_num_tokens=4096, max_model_len=1024,
decode_steps=8)`.

Measured, in one process:
  * pkvattn cold: `Engine(...)` → `warmup()` (every program compiled, or
    loaded from the persistent cache in `--cache-dir`) → `generate` of the
    256 prompts: start-up time and end-to-end time;
  * pkvattn after warmup: `generate` of 256 fresh prompts (no prefix hits),
    generated tokens / wall time, and the compilations it triggered (0);
  * decode step at 256 rows: wall time per step (`Engine.profile`) and GPU
    kernel time per step (profiler trace of one burst / decode_steps), with
    the per-kernel breakdown;
  * transformers continuous batching (`model.generate_batch`, sdpa, bf16,
    same prompts and token counts): its warm-up (a first `generate_batch` on
    a few prompts), then the 256 prompts; end to end = both.
`--phase warm` only builds the engine and runs `warmup()` (a second process
over the same `--cache-dir` measures the persistent-cache start-up).

Results: JSON `bench/results/serving_<model>.json` (and $OUT).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.monitoring  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import _timing  # noqa: E402
from bench.bench_engine import LLAMA_3_2_1B, SMALL  # noqa: E402
from pkvattn import RopeConfig  # noqa: E402
from pkvattn.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from pkvattn.models import DecoderConfig, Model, init_params  # noqa: E402
from pkvattn.serving import profile as _profile  # noqa: E402

SMOLLM2_135M = DecoderConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_qo_heads=9, num_kv_heads=3, head_dim=64,
    rope=RopeConfig(theta=100000.0), rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    max_position_embeddings=8192, model_type="llama")

MODELS = {"smollm2": SMOLLM2_135M, "llama1b": LLAMA_3_2_1B, "small": SMALL}
CFG = EngineConfig(page_size=16, num_slots=8192, max_seqs=256,
                   max_num_tokens=4096, max_model_len=1024, decode_steps=8)


def prompts(rng, n, vocab):
  return [rng.integers(3, vocab, int(rng.integers(35, 48))).tolist()
          for _ in range(n)]


class CompileCounter:
  def __init__(self):
    self.n = 0
    jax.monitoring.register_event_duration_secs_listener(self)

  def __call__(self, name, secs, **kw):
    if name == "/jax/core/compile/backend_compile_duration":
      self.n += 1


def kernel_breakdown(engine: Engine, top: int = 12):
  """GPU kernel time of one decode iteration of the next burst, by kernel."""
  prog = _profile.profile_programs(engine)
  args = [prog["step_args"]() for _ in range(3)]
  jax.block_until_ready(prog["step"](*prog["step_args"]()))
  events = _timing.gpu_stream_events(
      [lambda a=a: prog["step"](*a) for a in args])
  per = len(args) * prog["per"]
  rows = _timing.kernel_groups(events, per, name_len=60)
  total = sum(r[2] for r in rows)
  return dict(gpu_us_per_step=total,
              kernels_per_step=sum(r[1] for r in rows),
              top=[dict(kernel=k, count=c, us=t) for k, c, t in rows[:top]])


def run_pkvattn(mcfg, params, cfg, batch1, batch2, sp, phase):
  res = {}
  t0 = time.perf_counter()
  engine = Engine(Model("bench", mcfg, params, None), cfg)
  times = engine.warmup()
  res["warmup_s"] = time.perf_counter() - t0
  res["num_programs"] = len(times)
  res["compile_s_per_program"] = {str(k): round(v, 2) for k, v in times.items()}
  res["lower_s_per_program"] = {str(k): round(v, 2)
                                for k, v in engine.lower_times.items()}
  if phase == "warm":
    return res
  out = engine.generate(batch1, sp)
  res["e2e_cold_s"] = time.perf_counter() - t0
  res["e2e_cold_tokens"] = sum(map(len, out))
  counter = CompileCounter()
  jax.block_until_ready(engine.pool)
  t1 = time.perf_counter()
  out = engine.generate(batch2, sp)
  res["throughput_s"] = time.perf_counter() - t1
  res["throughput_tokens"] = sum(map(len, out))
  res["throughput_tok_s"] = res["throughput_tokens"] / res["throughput_s"]
  res["compiles_after_warmup"] = counter.n
  res["stats"] = engine.stats.as_dict()
  # Decode step at 256 rows: step until every request decodes, then profile.
  for p in batch1:
    engine.add_request(p, dataclasses.replace(sp, max_new_tokens=64))
  while not engine._burst_eligible():
    engine.step()
  for _ in range(4):  # some context: ~41 + 33 tokens
    engine.step()
  prof = engine.profile()
  res["decode_step_wall_ms"] = prof["step_ms"]
  res["decode_profile"] = prof
  if jax.default_backend() == "gpu":
    res["decode_kernels"] = kernel_breakdown(engine)
    res["decode_step_gpu_ms"] = res["decode_kernels"]["gpu_us_per_step"] / 1e3
  while engine.has_unfinished():
    engine.step()
  del engine
  gc.collect()
  return res


def run_transformers(mcfg, batch1, warm_prompts, new_tokens):
  import torch
  import transformers
  res = {"transformers_version": transformers.__version__}
  hf = transformers.LlamaConfig(
      vocab_size=mcfg.vocab_size, hidden_size=mcfg.hidden_size,
      intermediate_size=mcfg.intermediate_size,
      num_hidden_layers=mcfg.num_layers,
      num_attention_heads=mcfg.num_qo_heads,
      num_key_value_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
      rms_norm_eps=mcfg.rms_norm_eps, rope_theta=mcfg.rope.theta,
      tie_word_embeddings=mcfg.tie_word_embeddings, max_position_embeddings=8192,
      bos_token_id=1, eos_token_id=2, pad_token_id=0)
  torch.manual_seed(0)
  with torch.device("cuda"):
    model = transformers.LlamaForCausalLM._from_config(
        hf, torch_dtype=torch.bfloat16, attn_implementation="sdpa").eval()
  gen = transformers.GenerationConfig(
      max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
      pad_token_id=0)
  t0 = time.perf_counter()
  # generate_batch runs its own loop thread (no inference_mode around it).
  model.generate_batch(inputs=warm_prompts, generation_config=gen)
  torch.cuda.synchronize()
  res["warmup_s"] = time.perf_counter() - t0
  t1 = time.perf_counter()
  out = model.generate_batch(inputs=batch1, generation_config=gen)
  torch.cuda.synchronize()
  res["generate_s"] = time.perf_counter() - t1
  res["e2e_s"] = time.perf_counter() - t0
  res["tokens"] = int(sum(len(o.generated_tokens) for o in out.values()))
  res["tok_s"] = res["tokens"] / res["generate_s"]
  del model
  gc.collect()
  torch.cuda.empty_cache()
  return res


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", choices=tuple(MODELS), default="smollm2")
  ap.add_argument("--phase", choices=("full", "warm"), default="full")
  ap.add_argument("--cache-dir", default=None)
  ap.add_argument("--num-prompts", type=int, default=256)
  ap.add_argument("--new-tokens", type=int, default=256)
  ap.add_argument("--no-transformers", action="store_true")
  ap.add_argument("--scan-layers", choices=("auto", "0", "1"), default="auto")
  args = ap.parse_args(argv)
  mcfg = MODELS[args.model]
  cfg = dataclasses.replace(
      CFG, compile_cache_dir=args.cache_dir,
      scan_layers=None if args.scan_layers == "auto" else args.scan_layers == "1")
  if args.model == "small":  # a CPU smoke run
    cfg = dataclasses.replace(cfg, num_slots=256, max_seqs=8,
                              max_num_tokens=64, max_model_len=128,
                              decode_steps=4)
  rng = np.random.default_rng(0)
  batch1 = prompts(rng, args.num_prompts, mcfg.vocab_size)
  batch2 = prompts(rng, args.num_prompts, mcfg.vocab_size)
  sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
  params = init_params(mcfg, jax.random.key(0), jnp.bfloat16, scale=0.02)
  row = dict(model=args.model, phase=args.phase, config=dataclasses.asdict(cfg))
  row["pkvattn"] = run_pkvattn(mcfg, params, cfg, batch1, batch2, sp,
                               args.phase)
  del params
  gc.collect()
  name = f"serving_{args.model}" + ("_warm" if args.phase == "warm" else "")
  if args.scan_layers != "auto":
    name += f"_scan{args.scan_layers}"
  _timing.write_results(name, [row])  # again below, with the peer
  pk = row["pkvattn"]
  print(f"\n== {args.model} ({args.phase}, scan_layers={args.scan_layers}) on "
        f"{_timing.environment()['device']}")
  print(f"pkvattn warmup {pk['warmup_s']:.1f} s, {pk['num_programs']} programs, "
        f"lowering {sum(pk['lower_s_per_program'].values()):.1f} s in all")
  if args.phase == "full":
    print(f"pkvattn e2e cold {pk['e2e_cold_s']:.1f} s; after warmup "
          f"{pk['throughput_tok_s']:,.0f} tok/s; compiles after warmup "
          f"{pk['compiles_after_warmup']}; decode step wall "
          f"{pk['decode_step_wall_ms']:.3f} ms, GPU "
          f"{pk.get('decode_step_gpu_ms', float('nan')):.3f} ms", flush=True)
    for r in pk.get("decode_kernels", {}).get("top", []):
      print(f"   {r['us']:8.1f} us {r['count']:6.1f}x  {r['kernel']}")
  if args.phase == "full" and not args.no_transformers:
    row["transformers"] = run_transformers(mcfg, batch1, batch2[:8],
                                           args.new_tokens)
    pk, tf = row["pkvattn"], row["transformers"]
    row["throughput_vs_transformers"] = pk["throughput_tok_s"] / tf["tok_s"]
    row["e2e_cold_vs_transformers"] = (
        (pk["e2e_cold_tokens"] / pk["e2e_cold_s"])
        / (tf["tokens"] / tf["e2e_s"]))
    _timing.write_results(name, [row])
    tf = row["transformers"]
    print(f"transformers CB: warmup {tf['warmup_s']:.1f} s, "
          f"{tf['tok_s']:,.0f} tok/s ({tf['tokens']} tokens), e2e "
          f"{tf['e2e_s']:.1f} s")
    print(f"throughput ratio {row['throughput_vs_transformers']:.2f}x, "
          f"e2e cold ratio {row['e2e_cold_vs_transformers']:.2f}x")


if __name__ == "__main__":
  main()
