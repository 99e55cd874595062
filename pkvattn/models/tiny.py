"""Built-in tiny models (seeded random weights) and a byte-level tokenizer.

They need no files, so the CLI and CI run anywhere. The weights are random:
the text they generate is noise, but deterministic for a given seed.
"""

from __future__ import annotations

import dataclasses

import jax

from pkvattn.models.chat_template import ChatTemplateMixin
from pkvattn.models.decoder import DecoderConfig
from pkvattn.models.decoder import gemma_embed_scale
from pkvattn.models.decoder import init_params

from pkvattn.rope import RopeConfig


class ByteTokenizer(ChatTemplateMixin):
  """UTF-8 bytes are ids 0..255; then BOS = 256, EOS = 257, PAD = 258.

  It has no chat template (`chat_template` is None, `apply_chat_template`
  raises ValueError).
  """
  chat_template = None
  bos_token_id = 256
  eos_token_id = 257
  pad_token_id = 258
  vocab_size = 259

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    return (self.eos_token_id,)

  def encode(self, text: str) -> list[int]:
    return [self.bos_token_id] + list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode(
        "utf-8", errors="replace")


_BASE = dict(vocab_size=320, hidden_size=128, intermediate_size=256,
             num_layers=2, num_qo_heads=2, num_kv_heads=1, head_dim=64,
             bos_token_id=ByteTokenizer.bos_token_id,
             eos_token_ids=(ByteTokenizer.eos_token_id,),
             max_position_embeddings=4096)

TINY_CONFIGS = {
    "tiny-llama": DecoderConfig(rope=RopeConfig(theta=10000.0),
                                model_type="llama", **_BASE),
    "tiny-gemma2": DecoderConfig(
        rope=RopeConfig(theta=10000.0), model_type="gemma2",
        norm_plus_one=True, activation="gelu_tanh", tie_word_embeddings=True,
        embed_scale=gemma_embed_scale(_BASE["hidden_size"]), sm_scale=64**-0.5,
        layer_windows=(31, -1), attn_logit_softcap=50.0,
        final_logit_softcap=30.0, sandwich_norms=True, **_BASE),
    # Gemma 3's layer: QK-norm, a RoPE base per layer kind, no soft caps; two
    # 16-token sliding layers per global one (the real models: five).
    "tiny-gemma3": DecoderConfig(
        rope=RopeConfig(theta=1e6), rope_local=RopeConfig(theta=10000.0),
        model_type="gemma3_text", qk_norm=True, norm_plus_one=True,
        activation="gelu_tanh", tie_word_embeddings=True,
        embed_scale=gemma_embed_scale(_BASE["hidden_size"]), sm_scale=64**-0.5,
        layer_windows=(15, 15, -1), sandwich_norms=True,
        **dict(_BASE, num_layers=3)),
}


def tiny_model(name: str, dtype, seed: int = 0):
  """Returns `(cfg, params)` of a built-in model."""
  if name not in TINY_CONFIGS:
    raise ValueError(
        f"Invalid model name: expected one of {tuple(TINY_CONFIGS)}, got {name!r}")
  cfg = TINY_CONFIGS[name]
  # A larger init scale than training inits so the random model's
  # distribution is not flat (greedy text then varies with the prompt).
  params = init_params(cfg, jax.random.key(seed), dtype, scale=0.08)
  return cfg, params


def replace(cfg: DecoderConfig, **kw) -> DecoderConfig:
  return dataclasses.replace(cfg, **kw)
