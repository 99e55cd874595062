"""Model definitions built on pkvattn layers: Llama / Mistral / Qwen2 / Gemma 2.

`load_model("tiny-llama" | "tiny-gemma2" | "/path/to/hf/checkpoint")` returns a
`Model(name, cfg, params, tokenizer)`; `forward` runs one ragged step over the
multi-layer paged pool (see `pkvattn.models.decoder`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp

from pkvattn.models.decoder import DecoderConfig as DecoderConfig
from pkvattn.models.decoder import forward as forward
from pkvattn.models.decoder import fuse_projections as fuse_projections
from pkvattn.models.decoder import init_params as init_params
from pkvattn.models.decoder import stack_layers as stack_layers
from pkvattn.models.decoder import unstack_layers as unstack_layers
from pkvattn.models.hf import HFTokenizer as HFTokenizer
from pkvattn.models.hf import config_from_hf as config_from_hf
from pkvattn.models.hf import load_hf_checkpoint as load_hf_checkpoint
from pkvattn.models.tiny import TINY_CONFIGS as TINY_CONFIGS
from pkvattn.models.tiny import ByteTokenizer as ByteTokenizer
from pkvattn.models.tiny import tiny_model as tiny_model

__all__ = [
    "ByteTokenizer",
    "DecoderConfig",
    "HFTokenizer",
    "Model",
    "TINY_CONFIGS",
    "config_from_hf",
    "forward",
    "fuse_projections",
    "init_params",
    "load_hf_checkpoint",
    "load_model",
    "stack_layers",
    "tiny_model",
    "unstack_layers",
]


@dataclasses.dataclass(frozen=True)
class Model:
  """A decoder ready for the engine: static config, parameters, tokenizer."""
  name: str
  cfg: DecoderConfig
  params: Any
  tokenizer: Any  # .encode(str) -> list[int], .decode(ids) -> str, or None


def load_model(name_or_path: str, dtype=jnp.float32, seed: int = 0) -> Model:
  """Loads a built-in tiny model by name or a local HF checkpoint directory.

  Args:
    name_or_path: "tiny-llama", "tiny-gemma2", or a directory with config.json,
      *.safetensors and (optionally) tokenizer.json.
    dtype: parameter / compute dtype.
    seed: weight seed of the built-in models.

  Raises:
    ValueError: neither a built-in name nor a checkpoint directory.
  """
  dtype = jnp.dtype(dtype)
  if name_or_path in TINY_CONFIGS:
    cfg, params = tiny_model(name_or_path, dtype, seed)
    return Model(name_or_path, cfg, params, ByteTokenizer())
  if not os.path.isdir(name_or_path):
    raise ValueError(
        f"Invalid model: expected one of {tuple(TINY_CONFIGS)} or a checkpoint "
        f"directory, got {name_or_path!r}")
  cfg, params = load_hf_checkpoint(name_or_path, dtype)
  tok = None
  if os.path.isfile(os.path.join(name_or_path, "tokenizer.json")):
    tok = HFTokenizer(name_or_path, cfg.bos_token_id, cfg.eos_token_ids)
  return Model(os.path.basename(os.path.normpath(name_or_path)), cfg, params, tok)
