"""End-to-end engine benchmark: a Llama-3.2-1B-shaped model, pallas vs xla.

Full run (GPU): random bf16 weights with Llama 3.2 1B's shapes (16 layers,
hidden 2048, 32/8 heads of 64, vocab 128256, Llama 3 RoPE scaling), 64 prompts
of 1,024 tokens, 256 new tokens each (greedy, EOS ignored), through
`pkvattn.engine.Engine` with `impl="pallas"` and `impl="xla"` in the same run.

Reported per impl:
  * prefill tokens/s: prompt tokens computed / wall time of steps that carried
    prefill tokens; decode tokens/s: decode tokens / wall time of decode-only
    steps (both include the per-step host work and the one device->host sync);
  * a step-time split (`Engine.profile`) measured once in the prefill phase and
    once in the decode phase (one iteration of a decode burst): `attention`
    (every layer's `paged_prefill` on the step's plan, alone), `bookkeeping`
    (what commit / release / page tables / extend / claim add to the step:
    the step minus the same program without them), `bookkeeping_in_jit` (the
    same cache ops alone in one jit on a donated state), `rest` (projections,
    MLP, RoPE + append, sampling), in ms, and the bookkeeping share of the
    step by either measure (target < 2%); on GPU also `device_step_ms` /
    `device_bookkeeping_ms` (`device_split`: GPU kernel time of the step and
    of its cache ops compiled alone, from profiler traces);
  * `decode_speedup_vs_xla = decode_tok_s[pallas] / decode_tok_s[xla]` (> 1 =
    pallas faster; target >= 2).
Before timing anything, both impls generate from the same prompts and the
token agreement is reported (bf16 kernels may flip near-ties on random
weights), and before that the last-token logits of a one-step prefill of two
prompts are compared across impls (max abs difference, argmax equality).

`--small` runs a tiny configuration (CPU is fine). Results: JSON through
`bench._timing.write_results("engine", ...)` into bench/results/ (and $OUT).
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import _timing  # noqa: E402
from pkvattn import Llama3RopeScaling, RopeConfig  # noqa: E402
from pkvattn.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from pkvattn.flax import AttentionPlan, layer_page_tables  # noqa: E402
from pkvattn.models import DecoderConfig, Model, forward, init_params  # noqa: E402

LLAMA_3_2_1B = DecoderConfig(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
    num_qo_heads=32, num_kv_heads=8, head_dim=64,
    rope=RopeConfig(theta=500000.0, scaling=Llama3RopeScaling(
        factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)),
    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000,
    eos_token_ids=(128001,), max_position_embeddings=131072,
    model_type="llama")

SMALL = dataclasses.replace(
    LLAMA_3_2_1B, vocab_size=512, hidden_size=128, intermediate_size=256,
    num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=64)


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


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true",
                  help="tiny model and workload (CPU smoke run)")
  ap.add_argument("--impls", default=None,
                  help="comma list (default: pallas,xla; --small: xla)")
  ap.add_argument("--num-prompts", type=int, default=None)
  ap.add_argument("--prompt-len", type=int, default=None)
  ap.add_argument("--new-tokens", type=int, default=None)
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--max-num-tokens", type=int, default=None)
  ap.add_argument("--decode-steps", type=int, default=None,
                  help="decode iterations per device call once all requests "
                       "decode (EngineConfig.decode_steps; 1 = one per call; "
                       "default 8, --small 4)")
  ap.add_argument("--no-profile", action="store_true")
  ap.add_argument("--scan-layers", choices=("auto", "true", "false"),
                  default="auto",
                  help="EngineConfig.scan_layers (auto: unstacked on GPU)")
  args = ap.parse_args(argv)

  small = args.small
  mcfg = SMALL if small else LLAMA_3_2_1B
  num_prompts = args.num_prompts or (4 if small else 64)
  prompt_len = args.prompt_len or (48 if small else 1024)
  new_tokens = args.new_tokens or (16 if small else 256)
  decode_steps = args.decode_steps or (4 if small else 8)
  budget = args.max_num_tokens or (64 if small else 4096)
  impls = (args.impls or ("xla" if small else "pallas,xla")).split(",")
  dtype = jnp.float32 if small and jax.default_backend() == "cpu" else jnp.bfloat16

  params = init_params(mcfg, jax.random.key(0), dtype, scale=0.02)
  model = Model("llama-3.2-1b-shaped" if not small else "small", mcfg, params,
                None)
  rng = np.random.default_rng(0)
  prompts = [[mcfg.bos_token_id % mcfg.vocab_size]
             + rng.integers(0, mcfg.vocab_size, prompt_len - 1).tolist()
             for _ in range(num_prompts)]
  blocks = -(-(prompt_len + new_tokens) // args.page_size)
  rows, outputs = [], {}
  checks = {}
  if len(impls) > 1:  # correctness first: same prefill logits across impls
    ref = _prefill_logits(model, prompts[:2], impls[-1], args.page_size)
    for impl in impls[:-1]:
      got = _prefill_logits(model, prompts[:2], impl, args.page_size)
      checks[f"prefill_logits_max_abs_diff_{impl}_vs_{impls[-1]}"] = float(
          np.max(np.abs(got - ref)))
      checks[f"prefill_argmax_equal_{impl}_vs_{impls[-1]}"] = bool(
          (got.argmax(-1) == ref.argmax(-1)).all())
    print("checks:", checks, flush=True)
  for impl in impls:
    cfg = EngineConfig(
        page_size=args.page_size, num_slots=num_prompts * blocks + 8,
        max_seqs=num_prompts, max_num_tokens=max(budget, num_prompts),
        max_model_len=blocks * args.page_size, impl=impl,
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
  name = "engine_small" if small else "engine"
  for path in _timing.write_results(name, rows, extra):
    print("wrote", path)


if __name__ == "__main__":
  main()
