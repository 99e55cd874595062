"""FP8 KV scale granularity on a real model (SmolLM2-135M-Instruct, f32, CPU).

Does a finer scale than vLLM's per-tensor `k_scale` / `v_scale` measurably
help accuracy? `bench/fp8_accuracy.py`'s teacher-forced forward over the
same 512-token text runs on f32 pages whose K/V rows are rounded through
e4m3 on write (`x -> dequantize(quantize(x, s), s)`, the values an FP8 page
would hold) with scales at three granularities, each the amax of its group
mapped to 448:

* per tensor: one scale per layer for K and one for V over the whole text;
* per page and kv head: over the page's 16 rows x head_dim;
* per token and kv head: over one row's head_dim (the finest possible).

The real FP8 pages with the engine's calibrated per-layer scales (amax of
other prompts mapped to 224) run as well. Each is compared with f32 pages:
mean / max per-token KL(f32 || scaled) in nats and top-1 agreement.

The per-page scales are taken over the whole page, which a cache only knows
once the page is full (decode appends one row at a time), so they bound from
above what per-page scales could give.

Run:  python bench/fp8_scale_granularity.py [--text-tokens 512]
Writes bench/results/fp8_scale_granularity.json (and $OUT).
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import _timing  # noqa: E402
from bench.fp8_accuracy import TOPICS, _scales, kl, teacher_forced_logits  # noqa: E402
from pkvattn import _kv  # noqa: E402
from pkvattn import models  # noqa: E402
from pkvattn.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from pkvattn.models import calibrate  # noqa: E402
from pkvattn.pallas_kernels import reference  # noqa: E402

PAGE_SIZE = 16  # teacher_forced_logits' pages


def fake_quant(x, positions, group: str):
  """`x [num_tokens, num_kv_heads, head_dim]` rounded through e4m3 with one
  scale per `group` ("tensor", "page" or "token", x kv head for the last
  two): amax / FP8_MAX, positions `i32[num_tokens]` of one sequence."""
  a = jnp.abs(x.astype(jnp.float32)).max(axis=-1)  # [T, H]
  if group == "tensor":
    a = jnp.broadcast_to(a.max(), a.shape)
  elif group == "page":
    page = positions // PAGE_SIZE
    per_page = jax.ops.segment_max(a, page, num_segments=x.shape[0])
    a = per_page[page]
  elif group != "token":
    raise ValueError(f"Invalid group: expected tensor, page or token, got "
                     f"{group!r}")
  scale = jnp.where(a > 0, a / _kv.FP8_MAX, 1.0)[..., None]
  return _kv.dequantize(_kv.quantize(x, scale), scale).astype(x.dtype)


def scaled_logits(model, text_ids, group: str):
  """Teacher-forced logits with every K/V row written through `fake_quant`."""
  append = reference.append_paged_kv_reference

  def rounded(k, v, batch_indices, positions, *rest):
    return append(fake_quant(k, positions, group),
                  fake_quant(v, positions, group), batch_indices, positions,
                  *rest)

  with mock.patch.object(reference, "append_paged_kv_reference", rounded):
    return teacher_forced_logits(model, model.params, text_ids, jnp.float32)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--text-tokens", type=int, default=512)
  ap.add_argument("--prompts", type=int, default=16)
  args = ap.parse_args()
  model = models.load_model(models.DEFAULT_MODEL)
  tok = model.tokenizer
  here = os.path.dirname(os.path.abspath(__file__))
  with open(os.path.join(here, "..", "README.md"), encoding="utf-8") as f:
    text_ids = tok.encode(f.read())[:args.text_tokens]
  ref = teacher_forced_logits(model, model.params, text_ids, jnp.float32)
  # The engine's calibration on other prompts (as fp8_accuracy.py).
  ids = [tok.apply_chat_template(f"Explain {t} in a few sentences.")
         for t in TOPICS[:args.prompts]]
  engine = Engine(model, EngineConfig(
      max_seqs=args.prompts, num_slots=256, max_num_tokens=512,
      max_model_len=256, kv_cache_dtype="fp8", calibration_tokens=512))
  engine.generate(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))
  runs = {"fp8 pages, calibrated per-layer scales": teacher_forced_logits(
      model, calibrate.set_kv_scales(model.params,
                                     *_scales(engine.model.params)),
      text_ids, jnp.float8_e4m3fn)}
  for group in ("tensor", "page", "token"):
    runs[f"e4m3-rounded, per-{group} amax scales"] = scaled_logits(
        model, text_ids, group)
  rows = []
  for name, got in runs.items():
    per_token = kl(ref, got)
    if not per_token.any():
      raise RuntimeError(f"{name}: logits equal f32 pages' exactly; the "
                         "rounded append did not run")
    rows.append(dict(scales=name, mean_kl_nats=float(per_token.mean()),
                     max_kl_nats=float(per_token.max()),
                     top1_agreement=float(np.mean(ref.argmax(-1)
                                                  == got.argmax(-1)))))
    print(rows[-1], flush=True)
  _timing.write_results("fp8_scale_granularity", rows,
                        extra=dict(model=models.DEFAULT_MODEL,
                                   text_tokens=len(text_ids),
                                   page_size=PAGE_SIZE))
  _timing.print_table(rows, ["scales", "mean_kl_nats", "max_kl_nats",
                             "top1_agreement"])


if __name__ == "__main__":
  main()
