"""GGUF metadata -> `DecoderConfig` mapping on tiny config-only GGUF files.

Each file holds metadata and a `token_embd.weight` (the loader reads the
vocabulary size off it), no other weight. The expected values come from the
GGUF spec (ggml/docs/gguf.md) and llama.cpp's documented defaults, or from
`pkvattn.models.gguf`'s docstrings and comments:

* optional keys: `head_count_kv` defaults to `head_count` (no GQA),
  `key_length` to `embedding_length / head_count`, `rope.freq_base` to
  10,000; `head_count_kv` may be a per-layer array (uniform ones only);
* `rope.dimension_count` below the head size is partial rotary; the
  `rope.scaling.type` "linear" with its factor, "none", others rejected;
  Llama 3 `rope_freqs` hold one factor per rotary pair;
* Gemma 2's query scale 1/sqrt(head_dim), 1/sqrt(hidden / heads) for the 27B
  model (46 layers); Gemma 3's 5 sliding layers per global one (or the
  file's `sliding_window_pattern`), local RoPE base 10,000;
* missing required keys and a missing `token_embd.weight` raise ValueError.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pkvattn.models import gguf as pk_gguf  # noqa: E402
from pkvattn.models.hf import config_from_hf  # noqa: E402
from pkvattn.rope import LinearRopeScaling  # noqa: E402
from pkvattn.rope import Llama3RopeScaling  # noqa: E402
from model_files import hf_weights  # noqa: E402
from model_files import llama3_rope_freqs  # noqa: E402
from model_files import random_k_blocks  # noqa: E402
from model_files import write_gguf  # noqa: E402
from model_files import write_gguf_model  # noqa: E402

V = gguf.GGUFValueType
VOCAB = 40

REQUIRED = dict(block_count=2, embedding_length=48, head_count=3,
                feed_forward_length=64)


def _config(path, arch="llama", meta=None, typed=None, tensors=None,
            embed=True):
  """`config_from_gguf` of a GGUF holding `meta` (writer `add_<key>`
  methods, over `REQUIRED`), `typed` keys and a random token_embd."""
  meta = {**REQUIRED, **(meta or {})}
  rng = np.random.default_rng()
  all_tensors = dict(tensors or {})
  if embed:
    all_tensors["token_embd.weight"] = (rng.standard_normal(
        (VOCAB, meta.get("embedding_length") or 8)).astype(np.float32), None)
  write_gguf(path, arch, all_tensors,
         {k: v for k, v in meta.items() if v is not None}, typed)
  return pk_gguf.config_from_gguf(pk_gguf.open_gguf(str(path)))


def test_optional_keys_take_the_spec_defaults(tmp_path):
  """Without head_count_kv, key_length, rope.freq_base, context_length:
  all heads are KV heads and head_dim = embedding_length / head_count (GGUF
  spec), RoPE base 10,000 (llama.cpp's default), no partial rotary or
  scaling, and the context length the checkpoint loader assumes."""
  cfg = _config(tmp_path / "m.gguf")
  assert cfg.vocab_size == VOCAB
  assert cfg.hidden_size == 48 and cfg.num_layers == 2
  assert cfg.intermediate_size == 64
  assert cfg.num_qo_heads == 3 and cfg.num_kv_heads == 3
  assert cfg.head_dim == 16
  assert cfg.rope.theta == 10000.0
  assert cfg.rope.rotary_dim is None and cfg.rope.scaling is None
  hf_default = config_from_hf(dict(
      model_type="llama", vocab_size=VOCAB, hidden_size=48,
      intermediate_size=64, num_hidden_layers=2, num_attention_heads=3))
  assert cfg.max_position_embeddings == hf_default.max_position_embeddings


def test_per_layer_kv_head_counts(tmp_path):
  """head_count_kv as an array of per-layer counts: a uniform one is that
  count, a varying one is rejected."""
  cfg = _config(tmp_path / "u.gguf",
                meta=dict(head_count=4, head_count_kv=[2, 2]))
  assert cfg.num_qo_heads == 4 and cfg.num_kv_heads == 2
  one = _config(tmp_path / "one.gguf",
                meta=dict(block_count=1, head_count=4, head_count_kv=[2]))
  assert one.num_layers == 1 and one.num_kv_heads == 2
  with pytest.raises(ValueError,
                     match=r"per-layer KV head counts \[1, 2\] are not"):
    _config(tmp_path / "v.gguf", meta=dict(head_count=4, head_count_kv=[2, 1]))


def test_rope_dimension_count_is_partial_rotary(tmp_path):
  """rope.dimension_count below the head size rotates only that many
  leading dimensions of each head; equal to it is full rotary."""
  cfg = _config(tmp_path / "p.gguf",
                meta=dict(key_length=32, rope_dimension_count=8))
  assert cfg.head_dim == 32 and cfg.rope.rotary_dim == 8
  cfg = _config(tmp_path / "f.gguf",
                meta=dict(key_length=32, rope_dimension_count=32))
  assert cfg.head_dim == 32 and cfg.rope.rotary_dim in (None, 32)


def test_rope_scaling_type(tmp_path, rng):
  """rope.scaling.type: "linear" divides positions by rope.scaling.factor,
  "none" is unscaled, another type ("yarn") is rejected."""
  R = gguf.RopeScalingType
  factor = float(rng.integers(2, 9))
  cfg = _config(tmp_path / "l.gguf", meta=dict(
      rope_scaling_type=R.LINEAR, rope_scaling_factor=factor))
  assert cfg.rope.scaling == LinearRopeScaling(factor=factor)
  cfg = _config(tmp_path / "n.gguf", meta=dict(rope_scaling_type=R.NONE))
  assert cfg.rope.scaling is None
  with pytest.raises(ValueError, match=r"rope\.scaling\.type 'yarn'"):
    _config(tmp_path / "y.gguf", meta=dict(rope_scaling_type=R.YARN,
                                           rope_scaling_factor=4.0))


@pytest.mark.parametrize("rotary", [None, 8])
def test_llama3_rope_freqs_cover_the_rotary_pairs(rotary, tmp_path):
  """Llama 3 `rope_freqs` has one factor per rotated pair: head_dim / 2
  without rope.dimension_count, rotary / 2 with a partial one."""
  head_dim = 32
  freqs = llama3_rope_freqs(theta=500000.0, head_dim=rotary or head_dim)
  cfg = _config(tmp_path / "m.gguf", meta=dict(
      key_length=head_dim, rope_freq_base=500000.0,
      rope_dimension_count=rotary),
      tensors={"rope_freqs.weight": (freqs, None)})
  assert cfg.rope.theta == 500000.0
  assert cfg.rope.scaling == Llama3RopeScaling(
      factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_position_embeddings=8192)
  assert cfg.rope.rotary_dim in ((None, head_dim) if rotary is None
                                 else (rotary,))


@pytest.mark.parametrize("missing", sorted(REQUIRED))
def test_missing_required_key_raises(missing, tmp_path):
  """block_count, embedding_length, head_count and feed_forward_length have
  no default: a file without one is rejected, naming the key."""
  key = {"head_count": "attention.head_count"}.get(missing, missing)
  with pytest.raises(ValueError,
                     match=rf"missing metadata key 'llama\.{key}'"):
    _config(tmp_path / "m.gguf", meta={missing: None})


def test_missing_token_embd_raises(tmp_path):
  """The vocabulary size is read off token_embd.weight; without it the
  file is rejected."""
  with pytest.raises(ValueError, match=r"no token_embd\.weight"):
    _config(tmp_path / "m.gguf", embed=False,
            tensors={"output_norm.weight": (np.ones(48, np.float32), None)})


@pytest.mark.parametrize("layers", [2, 46])
def test_gemma2_query_scale(layers, tmp_path):
  """Gemma 2 queries are scaled by 1/sqrt(head_dim), except the 27B model
  (46 layers): 1/sqrt(embedding_length / head_count)."""
  cfg = _config(tmp_path / "g.gguf", arch="gemma2", meta=dict(
      block_count=layers, embedding_length=64, head_count=2, key_length=16,
      sliding_window=8))
  assert cfg.head_dim == 16 and cfg.num_layers == layers
  expected = 16 ** -0.5 if layers != 46 else (64 / 2) ** -0.5
  assert cfg.sm_scale == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("pattern", [None, 3])
def test_gemma3_layer_pattern_and_ropes(pattern, tmp_path):
  """Gemma 3: layer i is global iff (i + 1) % pattern == 0, pattern 6 unless
  the file gives one; sliding layers see `sliding_window` keys and use RoPE
  base 10,000, global ones the file's base; queries scaled by
  1/sqrt(head_dim) (key_length, here unlike embedding_length / heads)."""
  layers, window = 13, 8
  cfg = _config(tmp_path / "g.gguf", arch="gemma3", meta=dict(
      block_count=layers, embedding_length=64, head_count=2, key_length=16,
      rope_freq_base=1e6, sliding_window=window,
      sliding_window_pattern=pattern))
  p = pattern or 6
  assert cfg.windows == tuple(-1 if (i + 1) % p == 0 else window - 1
                              for i in range(layers))
  assert cfg.rope.theta == 1e6 and cfg.rope_local.theta == 10000.0
  assert cfg.qk_norm and cfg.norm_plus_one
  assert cfg.sm_scale == pytest.approx(16 ** -0.5, rel=1e-12)
  assert cfg.embed_scale == pytest.approx(math.sqrt(64))


def test_gemma3_per_layer_sliding_flags(tmp_path, rng):
  """`sliding_window_pattern` as a flag per layer (the key's array form,
  llama.cpp's `swa_layers`): layer i slides where its flag is true, and
  sliding layers take the local RoPE base; a flag count other than the
  layer count is refused."""
  layers, window = 7, 8
  flags = [bool(x) for x in rng.integers(0, 2, layers)]
  flags[0], flags[-1] = True, False  # both kinds present
  meta = dict(block_count=layers, embedding_length=64, head_count=2,
              key_length=16, rope_freq_base=1e6, sliding_window=window)
  cfg = _config(tmp_path / "g.gguf", arch="gemma3",
                meta=dict(meta, sliding_window_pattern=flags))
  assert cfg.windows == tuple(window - 1 if f else -1 for f in flags)
  assert cfg.rope.theta == 1e6 and cfg.rope_local.theta == 10000.0
  with pytest.raises(ValueError, match=r"sliding_window_pattern has 6 "
                     r"per-layer flags, expected 7"):
    _config(tmp_path / "h.gguf", arch="gemma3",
            meta=dict(meta, sliding_window_pattern=flags[:6]))


def test_unpermute_qk_rows_rejects_uneven_heads():
  """Rows that do not split into `num_heads` heads of an even size, or no
  heads at all, are rejected."""
  w = np.zeros((6, 4), np.float32)
  with pytest.raises(ValueError, match=r"divisible by 2 \* num_heads = 4, "
                                       r"got 6"):
    pk_gguf.unpermute_qk_rows(w, 2)
  with pytest.raises(ValueError, match=r"divisible by 2 \* num_heads = 0"):
    pk_gguf.unpermute_qk_rows(w, 0)


def test_unpermute_qk_rows_of_one_head(rng):
  """One head of 4 rows: stored row 2i is HF row i, stored row 2i + 1 is HF
  row head_dim/2 + i, so stored [r0, r2, r1, r3] is HF [r0, r1, r2, r3]."""
  hf = rng.standard_normal((4, 3)).astype(np.float32)
  stored = hf[[0, 2, 1, 3]]
  np.testing.assert_array_equal(pk_gguf.unpermute_qk_rows(stored, 1), hf)


@pytest.mark.parametrize("chunk", [4, 7, 8])
def test_dequantize_in_two_chunks_or_one(chunk, monkeypatch, tmp_path, rng):
  """A tensor of 8 blocks in chunks of 4 (two full), 7 (a ragged second) or
  8 (one) equals `gguf.quants.dequantize` of the stored blocks."""
  values = rng.standard_normal((2, 4 * 32)).astype(np.float32)  # 8 blocks
  stored = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
  path = tmp_path / "q.gguf"
  write_gguf(path, "llama", {"w": (stored, gguf.GGMLQuantizationType.Q8_0)})
  (tensor,) = gguf.GGUFReader(str(path)).tensors
  monkeypatch.setattr(pk_gguf, "DEQUANT_CHUNK_BLOCKS", chunk)
  got = pk_gguf.dequantize_tensor(tensor)
  want = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType.Q8_0)
  assert got.shape == (2, 128)
  np.testing.assert_array_equal(got, want)


def test_open_gguf_reuses_the_parse_of_an_unchanged_file(tmp_path):
  """Opening the same file twice returns the cached parse; a rewritten file
  is parsed again."""
  path = tmp_path / "m.gguf"
  _config(path)
  first = pk_gguf.open_gguf(str(path))
  assert pk_gguf.open_gguf(str(path)) is first
  cfg = _config(path, meta=dict(block_count=5, context_length=77))
  assert cfg.num_layers == 5
  assert pk_gguf.open_gguf(str(path)) is not first


def test_open_gguf_caches_only_the_last_file(tmp_path):
  """Only the last file's parse is kept: after another file is opened, the
  first is parsed again."""
  a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
  _config(a)
  _config(b)
  first = pk_gguf.open_gguf(str(a))
  assert pk_gguf.open_gguf(str(b)) is not first
  assert pk_gguf.open_gguf(str(a)) is not first


@pytest.mark.parametrize("cpus, workers, want", [
    (4, None, 4), (1, None, 1), (64, None, 8), (None, None, 1), (4, 1, 1),
    (4, 3, 3)])
def test_dequantize_pool_size(cpus, workers, want, monkeypatch):
  """The pool has `workers` threads, by default one per core, at least 1
  (also when the core count is unknown) and at most 8."""
  monkeypatch.setattr(pk_gguf.os, "cpu_count", lambda: cpus)
  pool = pk_gguf._pool.__wrapped__(workers)  # a new pool, not the cached one
  try:
    assert pool._max_workers == want
  finally:
    pool.shutdown()


def test_load_gguf_timings_are_wall_seconds_added(tmp_path, rng):
  """`load_gguf(timings=...)` adds each phase's wall seconds to the dict:
  every phase grows by at least 0 and at most the call's wall time."""
  import time
  path = tmp_path / "m.gguf"
  write_gguf_model(path, "qwen2",
                    hf_weights("qwen2", rng))
  phases = ("read", "config", "tokenizer", "dequantize", "host_copy",
            "device_transfer")
  timings = {k: 100.0 for k in phases}
  t0 = time.perf_counter()
  pk_gguf.load_gguf(str(path), timings=timings)
  wall = time.perf_counter() - t0
  assert set(timings) == set(phases)
  for k in phases:
    assert 100.0 <= timings[k] <= 100.0 + wall, (k, timings[k], wall)


def test_bad_tokenizer_is_reported_before_bad_weights(tmp_path, rng):
  """A file with both an unsupported tokenizer and an unsupported tensor
  type reports the tokenizer (as when it was read before the weights)."""
  q3k = random_k_blocks(rng, gguf.GGMLQuantizationType.Q3_K, 4).reshape(4, -1)
  path = tmp_path / "m.gguf"
  write_gguf_model(path, "qwen2", hf_weights("qwen2", rng), tokenizer="bert",
                    extra={"blk.0.ffn_up.weight": (
                        q3k, gguf.GGMLQuantizationType.Q3_K)})
  with pytest.raises(ValueError, match=r"'bert'"):
    pk_gguf.load_gguf(str(path))
