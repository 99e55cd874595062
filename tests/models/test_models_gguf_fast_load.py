"""The fast GGUF load path against the `gguf` package it replaces.

* `GGUFFile` (one-pass parser) reads the same metadata (values and Python
  types) and the same tensor views as `gguf.GGUFReader`, on a synthetic file
  with every value type the format has;
* `dequantize_tensor` (the package's block decoders over chunks on a thread
  pool) equals `gguf.quants.dequantize` bit for bit, for every supported
  block type, with a chunk size that leaves a ragged last chunk, and on one
  tensor of each type of the built-in models where their packages are
  installed;
* SentencePiece merges (`_spm_merges`) equal the definition: every split of
  a mergeable token into two tokens, by score, then token id, then left id;
* `load_gguf(timings=...)` reports each phase.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pkvattn import models  # noqa: E402
from pkvattn.models import gguf as pk_gguf  # noqa: E402
from pkvattn.models import gguf_tokenizer  # noqa: E402
from pkvattn.models.gguf_reader import GGUFFile  # noqa: E402
from pkvattn.models.hf import aligned_empty  # noqa: E402
from model_files import write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
BLOCK_TYPES = [t for t in pk_gguf.SUPPORTED_TENSOR_TYPES
               if t not in ("F32", "F16", "BF16")]


def _blocks(rng, type_name, num_blocks):
  """Random raw blocks with finite, moderate f16 scales (any byte layout)."""
  block_bytes = gguf.GGML_QUANT_SIZES[Q[type_name]][1]
  raw = rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)
  scale = lambda: rng.uniform(-0.1, 0.1, (num_blocks, 1)).astype(
      np.float16).view(np.uint8)
  if type_name == "Q6_K":
    raw[:, 208:210] = scale()
  elif type_name.endswith("_K"):
    raw[:, 0:2], raw[:, 2:4] = scale(), scale()
  else:  # Q4_0 .. Q8_0: d (and m) lead the block
    raw[:, 0:2] = scale()
    if type_name in ("Q4_1", "Q5_1"):
      raw[:, 2:4] = scale()
  return raw


def test_parser_matches_gguf_reader(tmp_path):
  rng = np.random.default_rng(0)
  V = gguf.GGUFValueType
  metadata = {
      "t.u8": (7, V.UINT8), "t.i8": (-7, V.INT8), "t.u16": (700, V.UINT16),
      "t.i16": (-700, V.INT16), "t.u32": (70000, V.UINT32),
      "t.i32": (-70000, V.INT32), "t.f32": (0.25, V.FLOAT32),
      "t.bool": (True, V.BOOL), "t.str": ("héllo ▁ 🤖", V.STRING),
      "t.u64": (2**40, V.UINT64), "t.i64": (-2**40, V.INT64),
      "t.f64": (1 / 3, V.FLOAT64),
      "t.strs": (["a", "", "▁b", "<0x0A>", "日本"], V.ARRAY),
      "t.ints": ([1, -2, 3], V.ARRAY), "t.floats": ([0.5, -1.5], V.ARRAY),
      "t.bools": ([True, False], V.ARRAY),
  }
  q = Q.Q4_K
  tensors = {
      "a": (rng.standard_normal((3, 5)).astype(np.float32), None),
      "b": (rng.standard_normal((4, 64)).astype(np.float16), None),
      "c": (_blocks(rng, "Q4_K", 6).reshape(3, -1), q),
      "d": (gguf.quants.quantize(
          rng.standard_normal((2, 64)).astype(np.float32), Q.Q8_0), Q.Q8_0),
  }
  path = tmp_path / "m.gguf"
  write_gguf(path, "llama", tensors, typed=metadata)
  ours = GGUFFile(str(path))
  ref = gguf.GGUFReader(str(path))
  expected = {k: f.contents() for k, f in ref.fields.items()
              if not k.startswith("GGUF.")}
  assert set(ours.metadata) == set(expected)
  for key, value in expected.items():
    assert ours.metadata[key] == value, key
    assert type(ours.metadata[key]) is type(value), key
  assert pk_gguf.read_metadata(ours) is ours.metadata
  assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
  for a, b in zip(ours.tensors, ref.tensors):
    assert a.tensor_type == b.tensor_type
    assert a.shape.tolist() == b.shape.tolist()
    assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
    np.testing.assert_array_equal(a.data, b.data)


def test_parser_rejects_non_gguf(tmp_path):
  path = tmp_path / "x.gguf"
  path.write_bytes(b"GGML" + bytes(60))
  with pytest.raises(ValueError, match="magic"):
    GGUFFile(str(path))
  path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(8))
  with pytest.raises(ValueError, match="truncated|Invalid"):
    GGUFFile(str(path))


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_chunked_dequantize_is_bit_exact(type_name, monkeypatch):
  rng = np.random.default_rng(BLOCK_TYPES.index(type_name))
  block_len = gguf.GGML_QUANT_SIZES[Q[type_name]][0]
  rows = 5
  cols = 3 * block_len if block_len == 256 else 9 * block_len
  raw = _blocks(rng, type_name, rows * cols // block_len).reshape(rows, -1)
  monkeypatch.setattr(pk_gguf, "DEQUANT_CHUNK_BLOCKS", 4)  # ragged chunks

  class Tensor:  # the fields dequantize_tensor reads
    name = "w"
    tensor_type = Q[type_name]
    shape = np.array([cols, rows], np.uint64)
    data = raw

  got = pk_gguf.dequantize_tensor(Tensor)
  want = gguf.quants.dequantize(raw, Q[type_name])
  assert got.shape == (rows, cols) and got.dtype == np.float32
  assert np.isfinite(want).all()
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _installed(name):
  try:
    return models.builtin_gguf_path(name)
  except ValueError:
    return None


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_tensors_dequantize_bit_exact(name):
  path = _installed(name)
  if path is None:
    pytest.skip(f"{name} is not installed")
  f = pk_gguf.open_gguf(path)
  smallest = {}
  for t in f.tensors:
    kind = t.tensor_type.name
    if kind not in smallest or t.n_elements < smallest[kind].n_elements:
      smallest[kind] = t
  assert len(smallest) >= 2
  for t in smallest.values():
    got = pk_gguf.dequantize_tensor(t)
    want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type),
                      np.float32).reshape(got.shape)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                  err_msg=t.name)


def _reference_merges(tokens, scores, mergeable):
  vocab = {t: i for i, t in enumerate(tokens)}
  found = []
  for i in mergeable:
    for k in range(1, len(tokens[i])):
      left, right = tokens[i][:k], tokens[i][k:]
      if left in vocab and right in vocab:
        found.append((-scores[i], i, vocab[left], left, right))
  return [(f[3], f[4]) for f in sorted(found)]


def test_spm_merges_match_definition():
  rng = np.random.default_rng(0)
  alphabet = list("ab▁c")
  tokens = list(dict.fromkeys(
      alphabet + ["".join(rng.choice(alphabet, int(rng.integers(2, 7))))
                  for _ in range(400)]))
  # Coarse scores: many ties, broken by token id then left id.
  scores = rng.integers(-5, 0, len(tokens)).astype(np.float32).tolist()
  mergeable = [i for i in range(len(tokens)) if i % 7]
  vocab = {t: i for i, t in enumerate(tokens)}
  got = gguf_tokenizer._spm_merges(tokens, vocab, scores, mergeable)
  want = _reference_merges(tokens, scores, mergeable)
  assert len(want) > 100
  assert got == want


def test_load_gguf_reports_phases(tmp_path):
  path = _installed("smollm2-135m")
  if path is None:
    pytest.skip("smollm2-135m is not installed")
  timings = {}
  cfg, params, tok = pk_gguf.load_gguf(path, timings=timings)
  assert set(timings) == {"read", "config", "tokenizer", "dequantize",
                          "host_copy", "device_transfer"}
  assert all(v >= 0 for v in timings.values())
  assert tok.eos_token_ids == cfg.eos_token_ids
  assert params["embed"].shape == (cfg.vocab_size, cfg.hidden_size)


def test_aligned_empty():
  for shape, dtype in (((3, 5), np.float32), ((7,), np.uint16), ((0,), "f4")):
    a = aligned_empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous
    assert a.size == 0 or a.ctypes.data % 64 == 0
