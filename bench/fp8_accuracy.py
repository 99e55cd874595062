"""FP8 KV accuracy on a real model (SmolLM2-135M-Instruct or Gemma 3 270M), CPU.

Arms, each against the model with f32 compute and f32 KV pages, same
weights, same process: FP8 pages with per-layer (per-tensor) scales, FP8
pages with per-layer-and-head scales (both calibrated on the prompts by the
engine), and the whole model in bf16 (weights, compute and pages: what
16-bit serving costs, for scale). Two measures per arm:

1. Greedy tokens, 16 prompts x 64 new tokens (EOS ignored; chat-templated
   where the model has a template) through the engine: sequences identical,
   tokens agreeing position by position, and the first divergence per
   prompt.
2. Teacher forcing: one forward over a fixed 512-token text
   (`bench.common.text.TEACHER_TEXT`) the scales never saw: per position,
   KL(f32 || arm) of the next-token distribution in nats, the mean absolute
   logit error, and top-1 agreement.

Run:  python bench/fp8_accuracy.py [--model smollm2-135m|gemma3-270m]
      [--new-tokens 64] [--prompts 16]
Writes `<out>/fp8_accuracy_<model>.json` (and under $OUT); prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import results  # noqa: E402
from bench.common import text  # noqa: E402
from bench.common import timing as _timing  # noqa: E402
from pkvattn import models  # noqa: E402
from pkvattn.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from pkvattn.flax import AttentionPlan, layer_page_tables  # noqa: E402
from pkvattn.models import calibrate  # noqa: E402

TOPICS = [
    "the water cycle", "how a bicycle gear works", "why the sky is blue",
    "photosynthesis", "the French revolution", "binary search",
    "how vaccines work", "the history of the printing press",
    "plate tectonics", "how a compiler works", "the rules of chess",
    "black holes", "how bread rises", "the stock market", "volcanoes",
    "the human heart", "how rainbows form", "the Roman empire",
]


def teacher_forced_logits(model, params, tokens, pool_dtype):
  """Logits f32[n, vocab] of one forward over `tokens` (one sequence)."""
  cfg = model.cfg
  n, ps = len(tokens), 16
  pages = -(-n // ps)
  slots = jnp.arange(pages, dtype=jnp.int32)[None]
  plan = AttentionPlan.create(layer_page_tables(slots, cfg.num_layers),
                              jnp.array([0, n], jnp.int32),
                              jnp.array([n], jnp.int32), num_tokens=n)
  pool = jnp.zeros((pages * cfg.num_layers * 2, ps, cfg.num_kv_heads,
                    cfg.head_dim), pool_dtype)
  logits, _ = jax.jit(lambda p, t, c: models.forward(
      p, cfg, t, c, plan, impl="xla"))(params, jnp.asarray(tokens, jnp.int32),
                                       pool)
  return np.asarray(logits, np.float64)


def kl(p_logits, q_logits):
  """Per-row KL(p || q) in nats from logits."""
  lp = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
  lq = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
  return np.sum(np.exp(lp) * (lp - lq), axis=-1)


ARMS = {  # name: (EngineConfig fields, model dtype)
    "fp8 per-tensor": (dict(kv_cache_dtype="fp8"), jnp.float32),
    "fp8 per-head": (dict(kv_cache_dtype="fp8", kv_scales="per_head"),
                     jnp.float32),
    "bf16": ({}, jnp.bfloat16),
}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", choices=("smollm2-135m", "gemma3-270m"),
                  default=models.DEFAULT_MODEL)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--text-tokens", type=int, default=512)
  results.add_out_arg(ap)
  args = ap.parse_args()
  env = results.environment()
  model = models.load_model(args.model)
  tok = model.tokenizer
  # Chat prompts where the tokenizer has a template (SmolLM2-Instruct); the
  # same text as plain prompts for a base model (Gemma 3 270M).
  encode = (tok.apply_chat_template if getattr(tok, "chat_template", None)
            else tok.encode)
  ids = [encode(f"Explain {t} in a few sentences.")
         for t in TOPICS[:args.prompts]]
  sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
  base = EngineConfig(max_seqs=args.prompts, num_slots=256,
                      max_num_tokens=512, max_model_len=256,
                      calibration_tokens=512)
  ref_out = Engine(model, base).generate(ids, sp)
  text_ids = tok.encode(text.TEACHER_TEXT)[:args.text_tokens]
  ref = teacher_forced_logits(model, model.params, text_ids, jnp.float32)
  rows = []
  for arm, (fields, dtype) in ARMS.items():
    m = model if dtype == jnp.float32 else models.load_model(args.model,
                                                             dtype=dtype)
    e = Engine(m, dataclasses.replace(base, **fields))
    outs = e.generate(ids, sp)
    if fields.get("kv_cache_dtype") == "fp8":
      params = calibrate.set_kv_scales(
          model.params, *calibrate.get_kv_scales(e.model.params))
      got = teacher_forced_logits(model, params, text_ids, jnp.float8_e4m3fn)
    else:
      got = teacher_forced_logits(m, m.params, text_ids, dtype)
    same = [list(a) == list(b) for a, b in zip(ref_out, outs)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
             for a, b in zip(ref_out, outs)]
    per_token = kl(ref, got)
    rows.append(dict(
        model=args.model, arm=arm, prompts=len(ids),
        new_tokens=args.new_tokens, identical_sequences=int(sum(same)),
        token_agreement=float(np.mean([np.mean(np.array(list(a)) == np.array(
            list(b))) for a, b in zip(ref_out, outs)])),
        first_divergence=first,
        median_first_divergence=float(np.median(
            [args.new_tokens if f is None else f for f in first])),
        text_tokens=len(text_ids), mean_kl_nats=float(per_token.mean()),
        max_kl_nats=float(per_token.max()),
        mean_abs_logit_error=float(np.mean(np.abs(ref - got))),
        top1_agreement=float(np.mean(ref.argmax(-1) == got.argmax(-1)))))
  results.write(f"fp8_accuracy_{args.model}", rows, out=args.out, env=env,
                extra=dict(num_kv_heads=model.cfg.num_kv_heads))
  _timing.print_table(rows, ["arm", "identical_sequences", "token_agreement",
                             "median_first_divergence", "mean_kl_nats",
                             "max_kl_nats", "mean_abs_logit_error",
                             "top1_agreement"])


if __name__ == "__main__":
  main()
