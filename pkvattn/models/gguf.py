"""Loading GGUF files (llama.cpp's format): config, weights and tokenizer.

The file is parsed once, memory-mapped, by `pkvattn.models.gguf_reader`
(`gguf.GGUFReader` only for big-endian files); config and tokenizer come from
the same parsed metadata. Its metadata (`{arch}.block_count`, `{arch}.attention.head_count`, ...) is
mapped to a transformers-style config dict, so `config_from_hf` builds the
`DecoderConfig` (one mapping for both formats). Tensor names go through the
`gguf` package's own HF <-> GGUF name map, and weights are dequantized one
tensor at a time, cast to the requested dtype and written into per-layer
stacks (`pkvattn.models.hf.build_params`), so the host never holds an f32
copy of the whole model. A tensor is dequantized by the `gguf` package's own
block decoders (`gguf.quants.<TYPE>.dequantize_blocks`, so the values equal
`gguf.quants.dequantize` bit for bit), applied to chunks of
`DEQUANT_CHUNK_BLOCKS` blocks on a thread pool (numpy releases the GIL)
rather than to groups of 16 rows as `gguf.quants.dequantize` does.

Two layout differences from transformers are undone:
  * llama.cpp's converter permutes the rows of each head of `attn_q` /
    `attn_k` of Llama-family models, so its interleaved-pair RoPE equals
    transformers' rotate-half RoPE: within a head of `head_dim` rows, HF row
    `i` is stored at row `2i` and HF row `head_dim/2 + i` at row `2i + 1`.
    Qwen2 and Gemma 2 use rotate-half in llama.cpp too and are stored as is.
  * Gemma 2 norm weights are stored as `1 + w` (llama.cpp applies them as
    `x * w`); `w` is recovered by subtracting 1.

Supported: architectures `SUPPORTED_ARCHITECTURES`, tensor types
`SUPPORTED_TENSOR_TYPES`.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import jax.numpy as jnp
import numpy as np

from pkvattn.models.decoder import DecoderConfig
from pkvattn.models.gguf_tokenizer import GGUFTokenizer
from pkvattn.models.hf import aligned_empty
from pkvattn.models.hf import build_params
from pkvattn.models.hf import config_from_hf

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma2", "gemma3")

# GGML tensor types `gguf.quants.dequantize` handles that are loaded here.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0",
                          "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

# Architectures whose attn_q / attn_k rows llama.cpp's converter permutes.
_PERMUTED_QK = ("llama",)

# Llama 3 RoPE scaling is stored as per-frequency factors (`rope_freqs`); the
# published Llama 3.x configs use these band limits.
_LLAMA3_FREQ_BANDS = dict(low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)


def _import_gguf():
  try:
    import gguf
  except ImportError as e:  # a declared dependency; say how to get it
    raise ValueError(
        "Invalid model: loading a .gguf file needs the 'gguf' package "
        "(python3 -m pip install gguf)") from e
  return gguf


# Blocks per dequantization task: enough that numpy's per-call overhead
# vanishes, few enough that a task's temporaries stay in cache.
DEQUANT_CHUNK_BLOCKS = 1 << 12


@functools.lru_cache(maxsize=1)
def _open(path: str, mtime_ns: int, size: int):
  # Reading the config first and the weights next reuses one parse (keyed by
  # the file's identity, so a rewritten file is read again).
  from pkvattn.models.gguf_reader import GGUFFile
  from pkvattn.models.gguf_reader import NotLittleEndianError
  try:
    return GGUFFile(path)
  except NotLittleEndianError:
    return _import_gguf().GGUFReader(path)


def open_gguf(path: str):
  """The parsed GGUF file at `path` (memory-mapped; cached for the last file).

  Returns:
    A `pkvattn.models.gguf_reader.GGUFFile` (a `gguf.GGUFReader` for a
    big-endian file); both have `.tensors`, and `read_metadata` reads either.

  Raises:
    ValueError: `path` is not a readable GGUF file.
  """
  _import_gguf()
  path = os.path.realpath(path)
  try:
    st = os.stat(path)
  except OSError as e:
    raise ValueError(f"Invalid model path: cannot read {path!r} ({e})") from e
  try:
    return _open(path, st.st_mtime_ns, st.st_size)
  except Exception as e:  # bad magic, version, truncated header, ...
    raise ValueError(
        f"Invalid GGUF file {path!r}: {type(e).__name__}: {e}") from e


def read_metadata(reader) -> dict[str, Any]:
  """`{key: value}` of a parsed GGUF file (arrays as lists, str decoded).

  Args:
    reader: a `GGUFFile` (its parsed `metadata`, returned as is: do not
      modify it) or a `gguf.GGUFReader` (its fields decoded).
  """
  metadata = getattr(reader, "metadata", None)
  if isinstance(metadata, dict):
    return metadata
  return {name: field.contents() for name, field in reader.fields.items()
          if not name.startswith("GGUF.")}


def _tensor_type_name(tensor) -> str:
  t = tensor.tensor_type
  return getattr(t, "name", str(t))


def dequantize_tensor(tensor) -> np.ndarray:
  """One GGUF tensor as f32, in numpy (row-major) order.

  GGUF lists dimensions fastest-first (`ne0` = columns); the result has them
  reversed, so a 2-D weight is `f32[rows, cols]` = transformers'
  `[out_features, in_features]`.

  Args:
    tensor: a `gguf_reader.GGUFTensor` or `gguf.ReaderTensor`.

  Returns:
    `f32[*reversed(tensor.shape)]`, equal bit for bit to
    `gguf.quants.dequantize(tensor.data, tensor.tensor_type)`; may be a
    read-only view of the file for F32 tensors.

  Raises:
    ValueError: the tensor type is not in `SUPPORTED_TENSOR_TYPES`.
  """
  gguf = _import_gguf()
  name = _tensor_type_name(tensor)
  if name not in SUPPORTED_TENSOR_TYPES:
    raise ValueError(
        f"Invalid GGUF tensor {tensor.name!r}: tensor type {name} is not "
        f"supported; expected one of {SUPPORTED_TENSOR_TYPES}")
  shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
  if name in ("F32", "F16", "BF16"):
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(shape)
  block_len, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
  blocks = np.asarray(tensor.data).view(np.uint8).reshape(-1, block_bytes)
  out = aligned_empty((blocks.shape[0], block_len), np.float32)
  decode = getattr(gguf.quants, name)
  decode.init_grid()  # lookup grids of the i-quants; a no-op for these types

  def run(lo):
    hi = lo + DEQUANT_CHUNK_BLOCKS
    out[lo:hi] = decode.dequantize_blocks(blocks[lo:hi])

  starts = range(0, blocks.shape[0], DEQUANT_CHUNK_BLOCKS)
  if len(starts) > 1:
    list(_pool().map(run, starts))
  else:
    run(0)
  return out.reshape(shape)


@functools.lru_cache(maxsize=2)
def _pool(workers: int | None = None):
  """A process-wide thread pool: `workers` threads, default one per core
  (at most 8) for the dequantization chunks."""
  from concurrent.futures import ThreadPoolExecutor
  n = workers or max(1, min(8, os.cpu_count() or 1))
  return ThreadPoolExecutor(max_workers=n, thread_name_prefix="pkvattn-gguf")


def unpermute_qk_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's per-head row permutation of a Llama q / k weight.

  Args:
    w: `[num_heads * head_dim, ...]` as stored in the GGUF (rows of head
      `h` interleaved: stored row `2i` = HF row `i`, `2i + 1` = HF row
      `head_dim/2 + i`); a weight or a bias.
    num_heads: heads of this projection (`num_kv_heads` for k).

  Returns:
    The same shape in transformers' row order.

  Raises:
    ValueError: rows not divisible into `num_heads` heads of even size.
  """
  rows = w.shape[0]
  if num_heads <= 0 or rows % (2 * num_heads):
    raise ValueError(
        f"Invalid q/k weight: expected rows divisible by 2 * num_heads = "
        f"{2 * num_heads}, got {rows}")
  half = rows // num_heads // 2
  return (w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def _llama3_scaling_from_freqs(freqs: np.ndarray, theta: float, head_dim: int):
  """transformers' `rope_scaling` dict matching llama.cpp's `rope_freqs`.

  `rope_freqs[i]` divides the frequency of pair `i`; for Llama 3 scaling it is
  1 above the high-frequency band, `factor` below the low one and smooth
  between. The band limits are not stored, so the published ones are assumed
  and checked against every factor.
  """
  from pkvattn.rope import Llama3RopeScaling
  from pkvattn.rope import RopeConfig
  freqs = np.asarray(freqs, np.float64).reshape(-1)
  if np.allclose(freqs, 1.0):
    return None
  scaling = dict(rope_type="llama3", factor=float(freqs.max()),
                 **_LLAMA3_FREQ_BANDS)
  rope = RopeConfig(theta=theta, scaling=Llama3RopeScaling(
      **{k: v for k, v in scaling.items() if k != "rope_type"}))
  base = RopeConfig(theta=theta).inv_freq(head_dim)
  implied = base / rope.inv_freq(head_dim)
  if implied.shape != freqs.shape or not np.allclose(implied, freqs, rtol=1e-3):
    raise ValueError(
        "Invalid GGUF rope_freqs: the per-frequency RoPE factors do not match "
        f"Llama 3 scaling with {_LLAMA3_FREQ_BANDS} (supported RoPE: plain, "
        "linear, Llama 3)")
  return scaling


def hf_config_from_gguf(metadata: dict[str, Any], tensors: dict) -> dict:
  """A transformers-style config dict from GGUF metadata.

  Args:
    metadata: `read_metadata(reader)`.
    tensors: `{name: gguf.ReaderTensor}` (ties, biases and `rope_freqs` are
      read off the tensors).

  Raises:
    ValueError: an unsupported architecture or RoPE scaling, missing keys,
      or per-layer values (KV head counts, Gemma 3's sliding flags) that do
      not fit the layers.
  """
  arch = metadata.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
        f"Invalid GGUF model: architecture {arch!r} is not supported; "
        f"expected one of {SUPPORTED_ARCHITECTURES}")

  def key(name, default=None, required=False):
    k = f"{arch}.{name}"
    if k not in metadata:
      if required:
        raise ValueError(f"Invalid GGUF model: missing metadata key {k!r}")
      return default
    return metadata[k]

  hidden = int(key("embedding_length", required=True))
  num_heads = int(key("attention.head_count", required=True))
  num_kv = key("attention.head_count_kv", num_heads)
  if isinstance(num_kv, list):  # per-layer counts; uniform models only
    if len(set(num_kv)) != 1:
      raise ValueError(
          f"Invalid GGUF model: per-layer KV head counts {sorted(set(num_kv))} "
          f"are not supported")
    num_kv = num_kv[0]
  head_dim = int(key("attention.key_length", hidden // num_heads))
  num_layers = int(key("block_count", required=True))
  embed = tensors.get("token_embd.weight")
  if embed is None:
    raise ValueError("Invalid GGUF model: no token_embd.weight tensor")
  vocab = int(embed.shape[-1])
  theta = float(key("rope.freq_base", 10000.0))
  hf = dict(
      model_type=arch,
      num_hidden_layers=num_layers,
      hidden_size=hidden,
      intermediate_size=int(key("feed_forward_length", required=True)),
      num_attention_heads=num_heads,
      num_key_value_heads=int(num_kv),
      head_dim=head_dim,
      vocab_size=vocab,
      rope_theta=theta,
      rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
      max_position_embeddings=int(key("context_length", 8192)),
      tie_word_embeddings="output.weight" not in tensors,
      attention_bias="blk.0.attn_q.bias" in tensors,
      bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
      eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
  )
  rotary = key("rope.dimension_count")
  if rotary is not None and int(rotary) != head_dim:
    hf["partial_rotary_factor"] = int(rotary) / head_dim
  scaling_type = key("rope.scaling.type")
  if scaling_type not in (None, "none"):
    if scaling_type != "linear":
      raise ValueError(
          f"Invalid GGUF model: rope.scaling.type {scaling_type!r} is not "
          f"supported; expected 'none' or 'linear' (or Llama 3 rope_freqs)")
    hf["rope_scaling"] = dict(rope_type="linear",
                              factor=float(key("rope.scaling.factor", 1.0)))
  if "rope_freqs.weight" in tensors:
    scaling = _llama3_scaling_from_freqs(
        dequantize_tensor(tensors["rope_freqs.weight"]), theta,
        int(rotary or head_dim))
    if scaling is not None:
      hf["rope_scaling"] = scaling
  if arch == "gemma2":
    hf.update(
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=key("attention.sliding_window"),
        attn_logit_softcapping=key("attn_logit_softcapping"),
        final_logit_softcapping=key("final_logit_softcapping"),
        # llama.cpp scales Gemma 2 queries by 1/sqrt(head_dim), except the
        # 27B model (46 layers): 1/sqrt(hidden_size / num_heads).
        query_pre_attn_scalar=(hidden // num_heads if num_layers == 46
                               else head_dim),
    )
  if arch == "gemma3":
    # llama.cpp hard-codes what the file does not say: 5 sliding layers per
    # global one, sliding RoPE base 10,000, queries scaled by
    # 1/sqrt(head_dim) (transformers' query_pre_attn_scalar = head_dim).
    hf.update(
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=key("attention.sliding_window"),
        rope_local_base_freq=10000.0,
        query_pre_attn_scalar=head_dim,
    )
    pattern = key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
      # The key's other form (gguf's writer, llama.cpp's swa_layers): a flag
      # per layer, true where the layer slides.
      if len(pattern) != num_layers:
        raise ValueError(
            f"Invalid GGUF model: {arch}.attention.sliding_window_pattern "
            f"has {len(pattern)} per-layer flags, expected {num_layers}")
      hf["layer_types"] = ["sliding_attention" if bool(x) else
                           "full_attention" for x in pattern]
    else:
      hf["sliding_window_pattern"] = int(pattern)
  return hf


def config_from_gguf(reader) -> DecoderConfig:
  """`DecoderConfig` of a GGUF file (see `hf_config_from_gguf`).

  Raises:
    ValueError: unsupported architecture / RoPE, missing metadata.
  """
  tensors = {t.name: t for t in reader.tensors}
  return config_from_hf(hf_config_from_gguf(read_metadata(reader), tensors))


def _tokenizer_and_config(reader):
  metadata = read_metadata(reader)
  tensors = {t.name: t for t in reader.tensors}
  cfg = config_from_hf(hf_config_from_gguf(metadata, tensors))
  tok = GGUFTokenizer.from_metadata(metadata)
  # Generation stops at the tokenizer's EOS and end-of-turn tokens.
  cfg = _replace(cfg, eos_token_ids=tuple(tok.eos_token_ids))
  return cfg, tok


def load_gguf_config(path: str) -> tuple[DecoderConfig, GGUFTokenizer]:
  """Config and tokenizer of a GGUF file, without reading any weight.

  Raises:
    ValueError: not a GGUF file, unsupported architecture / RoPE / tokenizer.
  """
  return _tokenizer_and_config(open_gguf(path))


def load_gguf(path: str, dtype=jnp.float32, timings: dict | None = None):
  """Loads a GGUF file: config, dequantized weights and tokenizer.

  Args:
    path: a `.gguf` file (one file; split GGUFs are not supported).
    dtype: parameter dtype (f32, bf16 or f16); each tensor is dequantized to
      f32 and cast to it.
    timings: if a dict, the wall seconds of each phase are added to it:
      "read" (parsing the file), "config", "tokenizer", "dequantize",
      "host_copy" (casting into the per-layer stacks), "device_transfer"
      (`jax.device_put` of the stacks and their transposes on the device,
      waited for).

  Returns:
    `(cfg: DecoderConfig, params, tokenizer: GGUFTokenizer)`, params in the
    `pkvattn.models.decoder.forward` layout (`[in, out]` kernels stacked on a
    leading layer axis).

  Raises:
    ValueError: not a GGUF file, an unsupported architecture, tensor type,
      RoPE scaling or tokenizer, or a missing tensor.
  """
  gguf = _import_gguf()
  clock = timings if timings is not None else {}
  t0 = time.perf_counter()
  reader = open_gguf(path)
  t1 = time.perf_counter()
  metadata = read_metadata(reader)
  tensors = {t.name: t for t in reader.tensors}
  cfg = config_from_hf(hf_config_from_gguf(metadata, tensors))
  t2 = time.perf_counter()
  for key, secs in (("read", t1 - t0), ("config", t2 - t1)):
    clock[key] = clock.get(key, 0.0) + secs
  # The tokenizer is built on its own thread while the weights are
  # dequantized (its merge ranking holds the GIL, numpy's decoders mostly
  # release it); "tokenizer" is its own wall time.
  tok_future = _pool(1).submit(_timed, GGUFTokenizer.from_metadata, metadata)
  try:
    cfg, params = _load_weights(path, gguf, reader, metadata, tensors, cfg,
                                dtype, timings)
  except BaseException:
    # A bad tokenizer is reported first, as when it was read first.
    if tok_future.exception() is not None:
      tok_future.result()
    raise
  tok, secs = tok_future.result()
  clock["tokenizer"] = clock.get("tokenizer", 0.0) + secs
  # Generation stops at the tokenizer's EOS and end-of-turn tokens.
  cfg = _replace(cfg, eos_token_ids=tuple(tok.eos_token_ids))
  return cfg, params, tok


def _timed(fn, *args):
  t0 = time.perf_counter()
  out = fn(*args)
  return out, time.perf_counter() - t0


def _load_weights(path, gguf, reader, metadata, tensors, cfg, dtype, timings):
  arch = metadata["general.architecture"]
  unsupported = sorted({_tensor_type_name(t) for t in reader.tensors}
                       - set(SUPPORTED_TENSOR_TYPES))
  if unsupported:
    raise ValueError(
        f"Invalid GGUF model {path!r}: tensor types {unsupported} are not "
        f"supported; expected one of {SUPPORTED_TENSOR_TYPES}")
  arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
  names = gguf.get_tensor_name_map(arch_enum, cfg.num_layers)

  def gguf_name(hf_name):
    full = hf_name if hf_name.startswith("lm_head") else "model." + hf_name
    name = names.get_name(full, try_suffixes=(".weight", ".bias"))
    return name if name in tensors else None

  def has(hf_name):
    return gguf_name(hf_name) is not None

  def get(hf_name):
    name = gguf_name(hf_name)
    if name is None:
      raise ValueError(
          f"Invalid GGUF model {path!r}: no tensor for {hf_name!r}")
    w = dequantize_tensor(tensors[name])
    if arch in _PERMUTED_QK:
      if ".attn_q." in name:
        w = unpermute_qk_rows(w, cfg.num_qo_heads)
      elif ".attn_k." in name:
        w = unpermute_qk_rows(w, cfg.num_kv_heads)
    if cfg.norm_plus_one and name.endswith("norm.weight"):
      w = w - 1.0
    return w

  cfg, params = build_params(cfg, get, has, dtype, timings=timings)
  if timings is not None:
    timings["dequantize"] = (timings.get("dequantize", 0.0)
                             + timings.pop("weights", 0.0))
  return cfg, params


def _replace(cfg, **kw):
  import dataclasses
  return dataclasses.replace(cfg, **kw)

