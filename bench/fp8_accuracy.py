"""FP8 KV accuracy on a real model: SmolLM2-135M-Instruct, f32 compute, CPU.

Two measures, FP8 KV pages (per-layer scales calibrated on the prompts by
the engine) against unquantized f32 KV pages, same weights, same process:

1. Greedy tokens, 16 chat prompts x 64 new tokens (EOS ignored) through the
   engine: tokens identical, and the first divergence per prompt.
2. Teacher forcing: one forward over a fixed 512-token text
   (`bench.common.text.TEACHER_TEXT`), the next-token distribution at every position with FP8 vs
   f32 pages: mean and max per-token KL(f32 || fp8) in nats. The scales come
   from the prompts of (1), not from this text.

Run:  python bench/fp8_accuracy.py [--new-tokens 64] [--prompts 16]
Writes `<out>/fp8_accuracy.json` (and under $OUT); prints a table last.
"""

from __future__ import annotations

import argparse
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


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--text-tokens", type=int, default=512)
  results.add_out_arg(ap)
  args = ap.parse_args()
  env = results.environment()
  model = models.load_model(models.DEFAULT_MODEL)
  tok = model.tokenizer
  ids = [tok.apply_chat_template(f"Explain {t} in a few sentences.")
         for t in TOPICS[:args.prompts]]
  sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
  outs, engines = {}, {}
  for dt in ("auto", "fp8"):
    cfg = EngineConfig(max_seqs=args.prompts, num_slots=256,
                       max_num_tokens=512, max_model_len=256,
                       kv_cache_dtype=dt, calibration_tokens=512)
    e = Engine(model, cfg)
    outs[dt] = e.generate(ids, sp)
    engines[dt] = e
  same, first = [], []
  for a, b in zip(outs["auto"], outs["fp8"]):
    a, b = list(a), list(b)
    same.append(a == b)
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    first.append(diff[0] if diff else None)
  # Teacher forcing over a text the scales never saw.
  text_ids = tok.encode(text.TEACHER_TEXT)[:args.text_tokens]
  fp8_params = engines["fp8"].model.params
  ref = teacher_forced_logits(model, model.params, text_ids, jnp.float32)
  got = teacher_forced_logits(model, calibrate.set_kv_scales(
      model.params, *_scales(fp8_params)), text_ids, jnp.float8_e4m3fn)
  per_token = kl(ref, got)
  res = dict(
      prompts=len(ids), new_tokens=args.new_tokens,
      identical_sequences=int(sum(same)),
      token_agreement=float(np.mean([np.mean(np.array(list(a)) == np.array(
          list(b))) for a, b in zip(outs["auto"], outs["fp8"])])),
      first_divergence=first, text_tokens=len(text_ids),
      mean_kl_nats=float(per_token.mean()), max_kl_nats=float(per_token.max()),
      top1_agreement=float(np.mean(ref.argmax(-1) == got.argmax(-1))))
  results.write("fp8_accuracy", [res], out=args.out, env=env)
  _timing.print_table([res], ["prompts", "new_tokens", "identical_sequences",
                              "token_agreement", "mean_kl_nats",
                              "max_kl_nats", "top1_agreement"])
  print(f"greedy: {sum(same)}/{len(same)} sequences identical; mean KL "
        f"{res['mean_kl_nats']:.2e} nats (bar 1e-2), max {res['max_kl_nats']:.2e}")


def _scales(params):
  layers = params["layers"]
  if isinstance(layers, list):
    return ([float(lp["attn"]["k_scale"]) for lp in layers],
            [float(lp["attn"]["v_scale"]) for lp in layers])
  return layers["attn"]["k_scale"], layers["attn"]["v_scale"]


if __name__ == "__main__":
  main()
