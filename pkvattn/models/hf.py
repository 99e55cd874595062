"""Loading local Hugging Face checkpoints: config.json, *.safetensors, tokenizer.json.

Supported `model_type`s: llama, mistral, qwen2, gemma2, gemma3_text (and
gemma3 checkpoints' text model). Weights are read one tensor at a time
with the `safetensors` library (numpy framework: bf16 through `ml_dtypes`,
no torch), stacked along a leading layer axis on the host and transposed
to `[in, out]` kernels on the device.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pkvattn.models.decoder import DecoderConfig
from pkvattn.models.tokenizer import TokenizersTokenizer
from pkvattn.rope import RopeConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma2", "gemma3_text",
                         "gemma3")
# transformers' `ACT2FN` names -> `DecoderConfig.activation`: SiLU ("swish"
# is its other name) and GELU's tanh approximation.
_ACTIVATIONS = {"silu": "silu", "swish": "silu",
                "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def read_hf_config(path: str) -> dict:
  """The text model's `config.json` dict of checkpoint directory `path`:
  a multimodal wrapper's `text_config` (without its own layer count), and
  the Gemma 3 wrapper's model type read as its text model's, "gemma3_text".

  Raises:
    ValueError: no config.json in `path`.
  """
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_path):
    raise ValueError(f"Invalid checkpoint path: no config.json in {path!r}")
  with open(cfg_path) as f:
    hf = json.load(f)
  if "text_config" in hf and "num_hidden_layers" not in hf:
    hf = {**hf["text_config"], "model_type": hf.get("model_type")}
  if hf.get("model_type") == "gemma3":  # the multimodal wrapper's text model
    hf = {**hf, "model_type": "gemma3_text"}
  return hf


def config_from_hf(hf: dict) -> DecoderConfig:
  """`DecoderConfig` from a Hugging Face `config.json` dict.

  Sliding windows follow transformers' mask: `sliding_window = W` lets query
  `i` see key `j` iff `i - j < W`, i.e. `window_left = W - 1`.

  Raises:
    NotImplementedError: an unsupported `model_type`, RoPE type or MLP
      activation (`hidden_activation`, else `hidden_act`).
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
  elif mt == "qwen2":  # layers from max_window_layers on are local
    first = hf.get("max_window_layers", 28)
    windows = tuple(sw - 1 if i >= first else -1 for i in range(L))
  elif mt in _GEMMA3:  # layer i is global iff (i + 1) % pattern == 0
    pattern = int(hf.get("sliding_window_pattern")
                  or hf.get("_sliding_window_pattern") or 6)
    windows = tuple(-1 if (i + 1) % pattern == 0 else sw - 1
                    for i in range(L))
  else:
    windows = (sw - 1,) * L
  if all(w < 0 for w in windows):
    windows = ()
  eos = hf.get("eos_token_id")
  eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
  gemma = mt in ("gemma2",) + _GEMMA3
  rope, rope_local = _ropes(hf) if mt in _GEMMA3 else (
      RopeConfig.from_hf_config(hf), None)
  bias = bool(hf.get("attention_bias", False))
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
  if act not in _ACTIVATIONS:
    raise NotImplementedError(
        f"activation {act!r} is not supported; expected one of "
        f"{tuple(_ACTIVATIONS)}")
  return DecoderConfig(
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"],
      num_layers=L,
      num_qo_heads=nq,
      num_kv_heads=hf.get("num_key_value_heads") or nq,
      head_dim=head_dim,
      rope=rope,
      rope_local=rope_local,
      qk_norm=mt in _GEMMA3,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      norm_plus_one=gemma,
      qkv_bias=True if mt == "qwen2" else bias,
      o_bias=False if mt == "qwen2" else bias,
      mlp_bias=bool(hf.get("mlp_bias", False)),
      activation=_ACTIVATIONS[act],
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


_GEMMA3 = ("gemma3_text", "gemma3")


def _ropes(hf: dict):
  """Gemma 3's `(global, sliding)` RoPE: transformers 5's per-layer-type
  `rope_parameters`, or `rope_theta` / `rope_scaling` and
  `rope_local_base_freq` (default 10,000, never scaled)."""
  per_type = hf.get("rope_parameters") or {}
  if "full_attention" in per_type:
    base = {k: v for k, v in hf.items()
            if k not in ("rope_parameters", "rope_scaling")}
    glob = RopeConfig.from_hf_config(
        {**base, "rope_parameters": per_type["full_attention"]})
    local = RopeConfig.from_hf_config(
        {**base, "rope_parameters": per_type.get(
            "sliding_attention", {"rope_theta": 10000.0})})
    return glob, local
  return (RopeConfig.from_hf_config(hf),
          RopeConfig(theta=float(hf.get("rope_local_base_freq", 10000.0))))


def _open_tensors(path: str, stack: contextlib.ExitStack) -> dict:
  """`{name: open safetensors file}` over the checkpoint's shards, each
  file opened once (numpy framework: a tensor is read from the file only
  when `get_tensor` asks for it; `ml_dtypes`, which jax imports, gives
  numpy its bf16)."""
  from safetensors import safe_open
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise ValueError(f"Invalid checkpoint path: no *.safetensors in {path!r}")
  out = {}
  for f in files:
    st = stack.enter_context(safe_open(f, framework="numpy"))
    out.update(dict.fromkeys(st.keys(), st))
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
  cfg = config_from_hf(read_hf_config(path))
  with contextlib.ExitStack() as files:
    tensors = _open_tensors(path, files)

    def find(name):
      for prefix in ("model.", "", "language_model.model."):
        if prefix + name in tensors:
          return prefix + name
      return None

    def get(name):
      key = find(name)
      if key is None:
        raise ValueError(
            f"Invalid checkpoint: missing weight {name!r} in {path!r}")
      return tensors[key].get_tensor(key)

    return build_params(cfg, get, lambda name: find(name) is not None, dtype)


def build_params(cfg: DecoderConfig, get, has, dtype=jnp.float32,
                 timings: dict | None = None):
  """The `decoder.forward` parameter tree from transformers-named weights.

  Each weight is fetched once, cast to `dtype` on the host and written into
  its slot of a preallocated `[num_layers, ...]` stack, so at most one source
  tensor (in its own dtype) and the stacks (in `dtype`) are alive at a time.
  Host copies stay contiguous: the `[out, in] -> [in, out]` transposes run
  on the device, one per stack, which briefly holds that stack twice
  (numpy's copy of a transposed matrix runs far below memory bandwidth once
  the matrix outgrows the cache: docs/performance.md, Start-up).

  Args:
    cfg: the architecture.
    get: `get(name) -> np.ndarray` in transformers' layout (`[out, in]`
      weights), `name` without the `model.` prefix
      (`"layers.3.self_attn.q_proj.weight"`, `"embed_tokens.weight"`,
      `"norm.weight"`, `"lm_head.weight"`); raises ValueError when missing.
    has: `has(name) -> bool` (used for `lm_head.weight`).
    dtype: parameter dtype.
    timings: if a dict, seconds are added to its keys "weights" (in `get`),
      "host_copy" (casting into the stacks) and "device_transfer"
      (`jax.device_put` of the stacks and the transposes on the device,
      waited for).

  Returns:
    `(cfg, params)`; `cfg.tie_word_embeddings` is set when the config unties
    but no `lm_head.weight` exists (some checkpoints tie without saying so).

  Raises:
    ValueError: a missing weight, or one whose shape differs from `cfg`.
  """
  np_dtype = jnp.dtype(dtype)
  L = cfg.num_layers
  clock = _Clock(timings)

  def fetch(name, shape):
    with clock("weights"):
      w = get(name)
    if tuple(w.shape) != tuple(shape):
      raise ValueError(
          f"Invalid weight {name!r}: expected shape {tuple(shape)}, got "
          f"{tuple(w.shape)}")
    return w

  def stack(fmt, shape, transpose):
    out = None
    for i in range(L):
      w = fetch(fmt.format(i), shape)
      if out is None:
        out = aligned_empty((L, *w.shape), np_dtype)
      with clock("host_copy"):
        out[i] = w  # casts on the host: no f32 copy of the whole stack
    return to_device(out, transpose)

  def to_device(x, transpose=False):
    with clock("device_transfer"):
      # On the CPU a 64-byte aligned array is aliased, not copied
      # (`jnp.asarray` always copies); the host arrays are not written
      # again after this.
      y = jax.device_put(x)
      if transpose:
        y = _swap_last(y)
      if timings is not None:
        y.block_until_ready()
    return y

  H, I = cfg.hidden_size, cfg.intermediate_size
  qd, kd = cfg.num_qo_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

  def dense(name, fan_in, fan_out, bias):
    p = {"kernel": stack(f"layers.{{}}.{name}.weight", (fan_out, fan_in), True)}
    if bias:
      p["bias"] = stack(f"layers.{{}}.{name}.bias", (fan_out,), False)
    return p

  norm = lambda name: stack(f"layers.{{}}.{name}.weight", (H,), False)
  layers = {
      "attn": {"q_proj": dense("self_attn.q_proj", H, qd, cfg.qkv_bias),
               "k_proj": dense("self_attn.k_proj", H, kd, cfg.qkv_bias),
               "v_proj": dense("self_attn.v_proj", H, kd, cfg.qkv_bias),
               "o_proj": dense("self_attn.o_proj", qd, H, cfg.o_bias)},
      "mlp": {"gate_proj": dense("mlp.gate_proj", H, I, cfg.mlp_bias),
              "up_proj": dense("mlp.up_proj", H, I, cfg.mlp_bias),
              "down_proj": dense("mlp.down_proj", I, H, cfg.mlp_bias)},
      "attn_norm": norm("input_layernorm"),
  }
  if cfg.qk_norm:
    d = cfg.head_dim
    layers["attn"]["q_norm"] = stack("layers.{}.self_attn.q_norm.weight", (d,),
                                     False)
    layers["attn"]["k_norm"] = stack("layers.{}.self_attn.k_norm.weight", (d,),
                                     False)
  if cfg.sandwich_norms:
    layers["post_attn_norm"] = norm("post_attention_layernorm")
    layers["mlp_norm"] = norm("pre_feedforward_layernorm")
    layers["post_mlp_norm"] = norm("post_feedforward_layernorm")
  else:
    layers["mlp_norm"] = norm("post_attention_layernorm")
  def cast(w, transpose=False):
    w = np.asarray(w)
    if w.dtype != np_dtype or w.ctypes.data % _ALIGN:
      with clock("host_copy"):
        out = aligned_empty(w.shape, np_dtype)
        out[...] = w
      w = out
    return to_device(w, transpose)

  params = {"embed": cast(fetch("embed_tokens.weight", (cfg.vocab_size, H))),
            "layers": layers,
            "final_norm": cast(fetch("norm.weight", (H,)))}
  if not cfg.tie_word_embeddings:
    if has("lm_head.weight"):
      params["lm_head"] = cast(fetch("lm_head.weight", (cfg.vocab_size, H)),
                               transpose=True)
    else:  # some checkpoints tie without saying so
      cfg = _replace(cfg, tie_word_embeddings=True)
  return cfg, params


@jax.jit
def _swap_last(x):
  """`[..., m, n] -> [..., n, m]` on `x`'s device."""
  return jnp.swapaxes(x, -1, -2)


# Alignment, bytes, of host arrays handed to `jax.device_put`: XLA:CPU
# aliases a numpy array aligned to 64 bytes instead of copying it.
_ALIGN = 64


def aligned_empty(shape, dtype) -> np.ndarray:
  """An uninitialised C-contiguous array whose data starts on a `_ALIGN`-byte
  boundary (numpy guarantees 16)."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + _ALIGN, np.uint8)
  off = -raw.ctypes.data % _ALIGN
  return raw[off:off + nbytes].view(dtype).reshape(shape)


class _Clock:
  """`with clock(key):` adds the block's wall seconds to `timings[key]`
  (nothing when `timings` is None)."""

  def __init__(self, timings: dict | None):
    self.timings = timings

  @contextlib.contextmanager
  def __call__(self, key: str):
    if self.timings is None:
      yield
      return
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self.timings[key] = (self.timings.get(key, 0.0)
                           + time.perf_counter() - t0)


def _replace(cfg, **kw):
  import dataclasses
  return dataclasses.replace(cfg, **kw)


class HFTokenizer(TokenizersTokenizer):
  """A checkpoint's `tokenizer.json` with the engine's tokenizer protocol.

  `encode` adds special tokens as the tokenizer.json's post-processor says;
  the chat template and the special tokens' text come from
  `tokenizer_config.json` (`chat_template`, `bos_token`, ...) or a
  `chat_template.jinja` file, as transformers reads them.

  Args:
    path: checkpoint directory with `tokenizer.json`.
    bos_token_id: BOS id (from config.json) or None.
    eos_token_ids: EOS ids (from config.json); the chat template's
      end-of-turn token is added.
  """

  def __init__(self, path: str, bos_token_id=None, eos_token_ids=()):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    config = {}
    config_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config_path):
      with open(config_path) as f:
        config = json.load(f)
    super().__init__(
        tok, bos_token_id=bos_token_id, eos_token_ids=eos_token_ids,
        chat_template=_read_chat_template(path, config),
        special_tokens={name: _token_text(config.get(name)) for name in
                        ("bos_token", "eos_token", "unk_token", "pad_token")})


def _token_text(value) -> str | None:
  """A special token of tokenizer_config.json: a string or an AddedToken dict."""
  if isinstance(value, dict):
    return value.get("content")
  return value if isinstance(value, str) else None


def _read_chat_template(path: str, config: dict) -> str | None:
  # As in transformers, a chat_template.jinja file wins over the config's.
  jinja_path = os.path.join(path, "chat_template.jinja")
  if os.path.isfile(jinja_path):
    with open(jinja_path) as f:
      return f.read()
  template = config.get("chat_template")
  if isinstance(template, list):  # named templates: use the default one
    named = {t.get("name"): t.get("template") for t in template
             if isinstance(t, dict)}
    template = named.get("default")
  if isinstance(template, str):
    return template
  return None
