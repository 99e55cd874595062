"""Synthetic GGUF files and HF checkpoint directories for the model tests.

* `write_gguf`: a GGUF of given tensors (raw blocks or arrays) and metadata;
  `random_k_blocks`: random raw K-quant blocks to put in one.
* A tiny random model (`VOCAB`, `HIDDEN`, `INTER`, `LAYERS`, `HEADS`,
  `KV_HEADS`, `HEAD_DIM`) of the llama / qwen2 / gemma2 architectures:
  `hf_weights` in transformers naming, written as a GGUF by
  `write_gguf_model` (q/k rows permuted as llama.cpp's converter does for
  llama, `llama_cpp_permute`; Gemma norms stored as `1 + w`) and as a
  checkpoint directory by `save_hf_dir` (`hf_config`'s config.json).
  "llama3" adds Llama 3 RoPE scaling (`LLAMA3_SCALING`), stored in a GGUF as
  `llama3_rope_freqs`.
* Vocabularies: `byte_level_vocab` ("gpt2") and `spm_vocab` (SentencePiece).

Importers skip without the `gguf` package (`pytest.importorskip("gguf")`)
before importing this module.
"""

from __future__ import annotations

import json

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

# The tiny model's sizes.
VOCAB = 300
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 2, 4, 2, 16

# config.json's `rope_scaling` of the "llama3" variant.
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0,
                      original_max_position_embeddings=8192)


def random_k_blocks(rng, qtype, num_blocks):
  """Random raw K-quant blocks with finite, moderate f16 super-block scales."""
  block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
  raw = rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)
  scale = lambda: rng.uniform(0.001, 0.1, (num_blocks, 1)).astype(
      np.float16).view(np.uint8)
  if qtype == Q.Q6_K:
    raw[:, 208:210] = scale()
  else:
    raw[:, 0:2], raw[:, 2:4] = scale(), scale()
  return raw


def write_gguf(path, arch, tensors, metadata=None, typed=None):
  """A GGUF with `tensors` = {name: (array, raw_dtype or None)}, metadata
  through the writer's `add_<key>` methods, and `typed` = {key: (value,
  GGUFValueType)} written as given."""
  w = gguf.GGUFWriter(str(path), arch)
  for key, value in (metadata or {}).items():
    getattr(w, f"add_{key}")(value)
  for key, (value, vtype) in (typed or {}).items():
    w.add_key_value(key, value, vtype)
  for name, (array, raw_dtype) in tensors.items():
    w.add_tensor(name, array, raw_dtype=raw_dtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def byte_level_vocab():
  """A 'gpt2' vocabulary: specials (ids 0-2), the 256 byte symbols, merges."""
  from tokenizers import pre_tokenizers
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  merges = ["Ġ t", "h e", "Ġt he"]
  tokens = specials + alphabet + [m.replace(" ", "") for m in merges]
  types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
  tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
  types += [5] * (VOCAB - len(types))
  return tokens, types, merges


def hf_weights(arch, rng):
  """Random weights in transformers naming and layout ([out, in]), on a
  2**-16 grid so that Gemma's stored `1 + w` is exact in f32."""
  w = lambda *s: (np.round(0.1 * rng.standard_normal(s) * 2**16)
                  / 2**16).astype(np.float32)
  qd, kd = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
  t = {"model.embed_tokens.weight": w(VOCAB, HIDDEN),
       "model.norm.weight": 1 + w(HIDDEN)}
  for i in range(LAYERS):
    p = f"model.layers.{i}."
    t.update({
        p + "self_attn.q_proj.weight": w(qd, HIDDEN),
        p + "self_attn.k_proj.weight": w(kd, HIDDEN),
        p + "self_attn.v_proj.weight": w(kd, HIDDEN),
        p + "self_attn.o_proj.weight": w(HIDDEN, qd),
        p + "mlp.gate_proj.weight": w(INTER, HIDDEN),
        p + "mlp.up_proj.weight": w(INTER, HIDDEN),
        p + "mlp.down_proj.weight": w(HIDDEN, INTER),
        p + "input_layernorm.weight": 1 + w(HIDDEN),
        p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
    })
    if arch == "qwen2":
      for n, d in (("q", qd), ("k", kd), ("v", kd)):
        t[p + f"self_attn.{n}_proj.bias"] = w(d)
    if arch == "gemma2":
      t[p + "pre_feedforward_layernorm.weight"] = w(HIDDEN)
      t[p + "post_feedforward_layernorm.weight"] = w(HIDDEN)
  if arch == "llama":
    t["lm_head.weight"] = w(VOCAB, HIDDEN)
  return t


def llama3_rope_freqs(theta=50000.0, head_dim=HEAD_DIM, factor=8.0, low=1.0,
                      high=4.0, old_context=8192):
  """`rope_freqs` as llama.cpp's converter writes it for Llama 3 scaling: the
  factor dividing each pair's frequency."""
  freqs = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  out = []
  for f in freqs:
    wavelen = 2 * np.pi / f
    if wavelen < old_context / high:
      out.append(1.0)
    elif wavelen > old_context / low:
      out.append(factor)
    else:
      smooth = (old_context / wavelen - low) / (high - low)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(out, np.float32)


def hf_config(arch):
  """The tiny model's config.json dict for `arch` ("llama", "llama3",
  "qwen2" or "gemma2"; "llama3" is llama with `LLAMA3_SCALING`)."""
  cfg = dict(model_type=arch, vocab_size=VOCAB, hidden_size=HIDDEN,
             intermediate_size=INTER, num_hidden_layers=LAYERS,
             num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
             head_dim=HEAD_DIM, rope_theta=50000.0, rms_norm_eps=2.0 ** -16,  # exact in the f32 GGUF field
             max_position_embeddings=512, bos_token_id=1, eos_token_id=0,
             tie_word_embeddings=arch != "llama")
  if arch == "llama3":
    cfg.update(model_type="llama", rope_scaling=LLAMA3_SCALING,
               tie_word_embeddings=False)
  if arch == "gemma2":
    cfg.update(hidden_activation="gelu_pytorch_tanh", sliding_window=16,
               query_pre_attn_scalar=HEAD_DIM, attn_logit_softcapping=50.0,
               final_logit_softcapping=30.0)
  return cfg


def llama_cpp_permute(w, n_head):
  """llama.cpp's converter permutation of Llama q/k rows (HF -> GGUF)."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def write_gguf_model(path, arch, hf_tensors, *, tokenizer="gpt2",
                     qtype=None, extra=None):
  """`hf_tensors` (`hf_weights`) as the tiny model's GGUF at `path`, as
  llama.cpp's converter writes it: GGUF tensor names, llama q/k rows
  permuted, Gemma 2 norms stored as `1 + w`, 2-D weights quantized to
  `qtype` if given, plus the `extra` tensors ({name: (array, raw_dtype)}).
  `tokenizer` "gpt2": `byte_level_vocab` with a chat template; another
  name: that tokenizer model over a dummy vocabulary; None: no vocabulary."""
  names = gguf.get_tensor_name_map(
      {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], LAYERS)
  tensors = {}
  for hf_name, w in hf_tensors.items():
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if arch == "llama" and ".attn_q." in name:
      w = llama_cpp_permute(w, HEADS)
    elif arch == "llama" and ".attn_k." in name:
      w = llama_cpp_permute(w, KV_HEADS)
    if arch == "gemma2" and name.endswith("norm.weight"):
      w = w + 1  # llama.cpp stores Gemma's (1 + w)
    if qtype is not None and w.ndim == 2:
      tensors[name] = (gguf.quants.quantize(w, qtype), qtype)
    else:
      tensors[name] = (w, None)
  tensors.update(extra or {})
  meta = dict(block_count=LAYERS, context_length=512, embedding_length=HIDDEN,
              feed_forward_length=INTER, head_count=HEADS,
              head_count_kv=KV_HEADS, key_length=HEAD_DIM,
              value_length=HEAD_DIM, rope_freq_base=50000.0,
              layer_norm_rms_eps=2.0 ** -16, rope_dimension_count=HEAD_DIM)
  if arch == "gemma2":
    meta.update(sliding_window=16, attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0)
  if tokenizer == "gpt2":
    tokens, types, merges = byte_level_vocab()
    meta.update(tokenizer_model="gpt2", tokenizer_pre="default",
                token_list=tokens, token_types=types, token_merges=merges,
                bos_token_id=1, eos_token_id=0, add_bos_token=False,
                chat_template="{% for m in messages %}<|im_start|>"
                              "{{ m['content'] }}<|im_end|>{% endfor %}")
  elif tokenizer is not None:
    meta.update(tokenizer_model=tokenizer, token_list=["a"] * VOCAB)
  write_gguf(path, arch, tensors, meta)


def save_hf_dir(path, arch, hf_tensors):
  """The tiny model as a checkpoint directory at `path` (created):
  `hf_config(arch)` as config.json, `hf_tensors` as model.safetensors."""
  from safetensors.numpy import save_file
  path.mkdir()
  (path / "config.json").write_text(json.dumps(hf_config(arch)))
  save_file(hf_tensors, str(path / "model.safetensors"))


def spm_vocab():
  """A small SentencePiece-style vocabulary: specials, bytes, pieces."""
  pieces = ["\u2581", "a", "b", "c", "d", "e", "h", "l", "o", "t", "w", "r",
            "\u2581t", "he", "\u2581the", "ll", "\u2581he", "llo", "\u2581hello",
            "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "ab", "\u2581a",
            "\u2581ab", "\u2581\u2581", "\u2581\u2581\u2581"]
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
  types = [2, 3, 3] + [6] * 256
  scores = [0.0, 0.0, 0.0] + [0.0] * 256
  for i, p in enumerate(pieces):  # longer pieces score higher
    tokens.append(p)
    types.append(1)
    scores.append(-100.0 + 10 * len(p) + 0.01 * i)
  return tokens, types, scores
