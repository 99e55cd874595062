"""Loading local Hugging Face checkpoints: config.json, *.safetensors, tokenizer.json.

Supported `model_type`s: llama, mistral, qwen2, gemma2. Weights are read with the
`safetensors` library (flax framework, so bf16 tensors load without torch),
transposed to `[in, out]` kernels and stacked along a leading layer axis.
"""

from __future__ import annotations

import glob
import json
import math
import os

import jax.numpy as jnp
import numpy as np

from pkvattn.models.decoder import DecoderConfig

from pkvattn.rope import RopeConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma2")


def config_from_hf(hf: dict) -> DecoderConfig:
  """`DecoderConfig` from a Hugging Face `config.json` dict.

  Sliding windows follow transformers' mask: `sliding_window = W` lets query
  `i` see key `j` iff `i - j < W`, i.e. `window_left = W - 1`.

  Raises:
    NotImplementedError: an unsupported `model_type` or RoPE type.
  """
  mt = hf.get("model_type")
  if mt not in SUPPORTED_MODEL_TYPES:
    raise NotImplementedError(
        f"model_type {mt!r} is not supported; expected one of "
        f"{SUPPORTED_MODEL_TYPES}")
  L = hf["num_hidden_layers"]
  nq = hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // nq
  sw = hf.get("sliding_window")
  layer_types = hf.get("layer_types")
  if mt == "qwen2" and not hf.get("use_sliding_window", False):
    sw = None
  if sw is None:
    windows = ()
  elif layer_types:
    windows = tuple(sw - 1 if t == "sliding_attention" else -1
                    for t in layer_types)
  elif mt == "gemma2":  # older configs: even layers are local
    windows = tuple(sw - 1 if i % 2 == 0 else -1 for i in range(L))
  else:
    windows = (sw - 1,) * L
  if all(w < 0 for w in windows):
    windows = ()
  eos = hf.get("eos_token_id")
  eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
  gemma = mt == "gemma2"
  bias = bool(hf.get("attention_bias", False))
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
  return DecoderConfig(
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"],
      num_layers=L,
      num_qo_heads=nq,
      num_kv_heads=hf.get("num_key_value_heads") or nq,
      head_dim=head_dim,
      rope=RopeConfig.from_hf_config(hf),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      norm_plus_one=gemma,
      qkv_bias=True if mt == "qwen2" else bias,
      o_bias=False if mt == "qwen2" else bias,
      mlp_bias=bool(hf.get("mlp_bias", False)),
      activation="gelu_tanh" if act in ("gelu_pytorch_tanh", "gelu_tanh") else "silu",
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
      embed_scale=math.sqrt(hf["hidden_size"]) if gemma else None,
      sm_scale=(hf["query_pre_attn_scalar"] ** -0.5
                if gemma and hf.get("query_pre_attn_scalar") else None),
      layer_windows=windows,
      attn_logit_softcap=hf.get("attn_logit_softcapping") if gemma else None,
      final_logit_softcap=hf.get("final_logit_softcapping") if gemma else None,
      sandwich_norms=gemma,
      bos_token_id=hf.get("bos_token_id"),
      eos_token_ids=eos,
      max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
      model_type=mt,
  )


def _read_tensors(path: str) -> dict[str, np.ndarray]:
  from safetensors import safe_open
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise ValueError(f"Invalid checkpoint path: no *.safetensors in {path!r}")
  out = {}
  for f in files:
    with safe_open(f, framework="flax") as st:
      for name in st.keys():
        out[name] = st.get_tensor(name)
  return out


def load_hf_checkpoint(path: str, dtype=jnp.float32):
  """Loads a local transformers checkpoint directory.

  Args:
    path: directory with `config.json` and `*.safetensors` (sharded is fine).
    dtype: parameter / compute dtype (f32, bf16 or f16).

  Returns:
    `(cfg: DecoderConfig, params)`, params in the `decoder.forward` layout.

  Raises:
    ValueError: no config.json / safetensors, or a missing weight.
    NotImplementedError: unsupported architecture.
  """
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_path):
    raise ValueError(f"Invalid checkpoint path: no config.json in {path!r}")
  with open(cfg_path) as f:
    hf = json.load(f)
  if "text_config" in hf and "num_hidden_layers" not in hf:
    hf = {**hf["text_config"], "model_type": hf.get("model_type")}
  cfg = config_from_hf(hf)
  tensors = _read_tensors(path)

  def get(name):
    for prefix in ("model.", "", "language_model.model."):
      if prefix + name in tensors:
        # Stays in the checkpoint dtype (bf16 via ml_dtypes): no f32 copy of
        # the whole model on the host.
        return np.asarray(tensors[prefix + name])
    raise ValueError(f"Invalid checkpoint: missing weight {name!r} in {path!r}")

  def stack(fmt, transpose):
    arrs = [get(fmt.format(i)) for i in range(cfg.num_layers)]
    a = np.stack([x.T if transpose else x for x in arrs])
    return jnp.asarray(a, dtype)

  def dense(name, bias):
    p = {"kernel": stack(f"layers.{{}}.{name}.weight", True)}
    if bias:
      p["bias"] = stack(f"layers.{{}}.{name}.bias", False)
    return p

  layers = {
      "attn": {"q_proj": dense("self_attn.q_proj", cfg.qkv_bias),
               "k_proj": dense("self_attn.k_proj", cfg.qkv_bias),
               "v_proj": dense("self_attn.v_proj", cfg.qkv_bias),
               "o_proj": dense("self_attn.o_proj", cfg.o_bias)},
      "mlp": {"gate_proj": dense("mlp.gate_proj", cfg.mlp_bias),
              "up_proj": dense("mlp.up_proj", cfg.mlp_bias),
              "down_proj": dense("mlp.down_proj", cfg.mlp_bias)},
      "attn_norm": stack("layers.{}.input_layernorm.weight", False),
  }
  if cfg.sandwich_norms:
    layers["post_attn_norm"] = stack("layers.{}.post_attention_layernorm.weight", False)
    layers["mlp_norm"] = stack("layers.{}.pre_feedforward_layernorm.weight", False)
    layers["post_mlp_norm"] = stack("layers.{}.post_feedforward_layernorm.weight", False)
  else:
    layers["mlp_norm"] = stack("layers.{}.post_attention_layernorm.weight", False)
  params = {"embed": jnp.asarray(get("embed_tokens.weight"), dtype),
            "layers": layers,
            "final_norm": jnp.asarray(get("norm.weight"), dtype)}
  if not cfg.tie_word_embeddings:
    if "lm_head.weight" in tensors:
      params["lm_head"] = jnp.asarray(
          np.asarray(tensors["lm_head.weight"]).T, dtype)
    else:  # some checkpoints tie without saying so
      cfg = _replace(cfg, tie_word_embeddings=True)
  return cfg, params


def _replace(cfg, **kw):
  import dataclasses
  return dataclasses.replace(cfg, **kw)


class HFTokenizer:
  """`tokenizers.Tokenizer` from tokenizer.json with encode/decode for the engine."""

  def __init__(self, path: str, bos_token_id=None, eos_token_ids=()):
    from tokenizers import Tokenizer
    self._tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    self.bos_token_id = bos_token_id
    self.eos_token_ids = tuple(eos_token_ids)

  def encode(self, text: str) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=True).ids)

  def decode(self, ids) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=True)
