"""`pkvattn-generate`: generate text with the paged engine.

Examples:
  pkvattn-generate --prompt "Hello, paged world"
  pkvattn-generate --model tiny-gemma2 --prompt a --prompt b --max-new-tokens 16
  pkvattn-generate --model ~/ckpt/Llama-3.2-1B --dtype bfloat16 \
      --prompts-file prompts.txt --impl pallas
  pkvattn-generate --model ~/ckpt/Llama-3.2-1B --tp 2   # 2 GPUs, tensor parallel

`--model` takes a built-in name (tiny-llama, tiny-gemma2: random weights, a
byte-level tokenizer, no files needed) or a local Hugging Face checkpoint
directory (config.json, *.safetensors, tokenizer.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_PROMPT = "Hello, paged world"


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="pkvattn-generate",
      description="Generate text with pkvattn's continuous-batching engine.")
  p.add_argument("--model", default="tiny-llama",
                 help="tiny-llama | tiny-gemma2 | path to a HF checkpoint dir "
                      "(default: %(default)s)")
  p.add_argument("--prompt", action="append", default=[],
                 help="a prompt (repeatable)")
  p.add_argument("--prompts-file",
                 help="a file with one prompt per line (blank lines skipped)")
  p.add_argument("--max-new-tokens", type=int, default=32)
  p.add_argument("--temperature", type=float, default=0.0,
                 help="0 = greedy (default)")
  p.add_argument("--top-k", type=int, default=0, help="0 = off")
  p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  p.add_argument("--seed", type=int, default=0,
                 help="sampling seed (and the built-in models' weight seed)")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--num-slots", type=int, default=256,
                 help="KV slots in the pool (a slot = one page of every layer)")
  p.add_argument("--max-seqs", type=int, default=8,
                 help="sequences running at once")
  p.add_argument("--max-num-tokens", type=int, default=256,
                 help="token budget per step (chunked prefill + decode)")
  p.add_argument("--decode-steps", type=int, default=None,
                 help="decode iterations per device call once every request "
                      "decodes (default: 8 on GPU, 1 elsewhere)")
  p.add_argument("--impl", choices=("pallas", "xla"), default=None,
                 help="attention implementation (default: pallas on GPU, xla "
                      "elsewhere)")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                 default=None,
                 help="parameter / KV dtype (default: float32 on CPU, bfloat16 "
                      "on GPU)")
  p.add_argument("--tp", type=int, default=1,
                 help="tensor-parallel degree: shard heads and the KV pool "
                      "over the first N devices (default: %(default)s)")
  p.add_argument("--no-prefix-reuse", action="store_true",
                 help="do not publish blocks for prefix reuse")
  p.add_argument("--swa-scratch-reuse", action="store_true",
                 help="SWA scratch-slot reuse for sliding-window models")
  p.add_argument("--ignore-eos", action="store_true")
  p.add_argument("--json", action="store_true",
                 help="print the results as one JSON object")
  p.add_argument("--no-progress", action="store_true",
                 help="hide the progress bar")
  return p


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  import jax
  import jax.numpy as jnp
  from tqdm import tqdm

  from pkvattn.engine import Engine, EngineConfig, SamplingParams
  from pkvattn.models import load_model

  prompts = list(args.prompt)
  if args.prompts_file:
    with open(args.prompts_file) as f:
      prompts += [line.rstrip("\n") for line in f if line.strip()]
  if not prompts:
    prompts = [DEFAULT_PROMPT]
  dtype = args.dtype or (
      "bfloat16" if jax.default_backend() == "gpu" else "float32")

  t0 = time.perf_counter()
  model = load_model(args.model, jnp.dtype(dtype), seed=args.seed)
  if model.tokenizer is None:
    print(f"error: no tokenizer.json in {args.model}", file=sys.stderr)
    return 2
  ids = [model.tokenizer.encode(p) for p in prompts]
  longest = max(len(i) for i in ids) + args.max_new_tokens
  max_model_len = -(-longest // args.page_size) * args.page_size
  config = EngineConfig(
      page_size=args.page_size, num_slots=args.num_slots,
      max_seqs=min(args.max_seqs, len(prompts)),
      # With SWA scratch reuse a prompt (+ a recompute's output) is prefilled
      # in one step, so the budget must hold the longest request.
      max_num_tokens=max(args.max_num_tokens, args.max_seqs,
                         longest if args.swa_scratch_reuse else 0),
      max_model_len=max_model_len, impl=args.impl,
      enable_prefix_reuse=not args.no_prefix_reuse,
      enable_swa_scratch_reuse=args.swa_scratch_reuse,
      decode_steps=args.decode_steps or (
          8 if jax.default_backend() == "gpu" else 1),
      # On a CPU one compile beats a second, decode-sized one; on a GPU the
      # decode bucket pays off at once.
      token_buckets=None if jax.default_backend() == "gpu" else (
          max(args.max_num_tokens, args.max_seqs,
              longest if args.swa_scratch_reuse else 0),))
  mesh = None
  if args.tp != 1:
    from pkvattn.parallel import make_mesh
    try:
      mesh = make_mesh(args.tp)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
  engine = Engine(model, config, mesh=mesh)
  load_s = time.perf_counter() - t0

  sp = [SamplingParams(max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed + i,
                       ignore_eos=args.ignore_eos)
        for i in range(len(prompts))]
  t0 = time.perf_counter()
  with tqdm(total=len(prompts) * args.max_new_tokens, unit="tok",
            desc="generating", disable=args.no_progress,
            file=sys.stderr) as bar:
    outputs = engine.generate(ids, sp, progress=bar.update)
  wall_s = time.perf_counter() - t0
  texts = [model.tokenizer.decode(o) for o in outputs]
  st = engine.stats
  summary = dict(
      model=model.name, device=jax.devices()[0].device_kind, dtype=dtype,
      impl=args.impl or ("pallas" if jax.default_backend() == "gpu" else "xla"),
      tp=args.tp,
      num_prompts=len(prompts), steps=st.num_steps,
      prompt_tokens=st.prompt_tokens, generated_tokens=st.generated_tokens,
      prefill_tokens_per_s=st.prefill_tokens_per_s,
      decode_tokens_per_s=st.decode_tokens_per_s,
      prefix_cache_hit_rate=st.prefix_hit_rate,
      peak_slots=st.peak_used_slots, num_slots=args.num_slots,
      slots_saved_by_scratch=st.slots_saved_by_scratch,
      preemptions=st.num_preemptions, load_s=load_s,
      compile_s=st.compile_time_s, wall_s=wall_s)
  if args.json:
    print(json.dumps(dict(outputs=[dict(prompt=p, text=t, token_ids=o)
                                   for p, t, o in zip(prompts, texts, outputs)],
                          summary=summary)))
    return 0
  for i, (p, t) in enumerate(zip(prompts, texts)):
    print(f"[{i}] {p!r}\n  -> {t!r}")
  saved = summary["slots_saved_by_scratch"]
  print(
      f"\nsummary: {summary['model']} on {summary['device']} "
      f"({summary['impl']}, {dtype}, tp={args.tp}), {len(prompts)} prompts, "
      f"{st.num_steps} steps\n"
      f"  prefill: {st.prefill_tokens} tokens, "
      f"{st.prefill_tokens_per_s:,.1f} tokens/s\n"
      f"  decode:  {st.decode_tokens} tokens, "
      f"{st.decode_tokens_per_s:,.1f} tokens/s\n"
      f"  prefix-cache hit rate: {100 * st.prefix_hit_rate:.1f}% "
      f"({st.reused_tokens}/{st.prompt_tokens} prompt tokens)\n"
      f"  peak slots: {st.peak_used_slots}/{args.num_slots}; slots saved by "
      f"scratch reuse: {'n/a' if saved is None else saved}\n"
      f"  preemptions: {st.num_preemptions}; compile {st.compile_time_s:.1f} s,"
      f" wall {wall_s:.1f} s (first step includes compilation; tokens/s "
      f"exclude it)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
