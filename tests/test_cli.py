"""`pkvattn-generate` end to end, in-process (CPU): the built-in model and a
local Hugging Face checkpoint directory."""

from __future__ import annotations

import json

import pytest

from pkvattn import cli


def test_cli_builtin_model_text_output(capsys):
  assert cli.main(["--prompt", "Hello, paged world", "--prompt",
                   "Hello, paged universe", "--max-new-tokens", "6",
                   "--page-size", "8", "--num-slots", "32", "--no-progress"]) == 0
  out = capsys.readouterr().out
  assert "[0] 'Hello, paged world'" in out and "[1] 'Hello, paged universe'" in out
  for field in ("prefill:", "decode:", "tokens/s", "prefix-cache hit rate",
                "peak slots", "slots saved by scratch reuse"):
    assert field in out


def _save_gemma2_checkpoint(path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from tokenizers import Tokenizer, models, pre_tokenizers, processors
  torch.manual_seed(0)
  cfg = transformers.Gemma2Config(
      vocab_size=256, hidden_size=128, intermediate_size=256,
      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
      head_dim=64, sliding_window=8, query_pre_attn_scalar=64)
  transformers.Gemma2ForCausalLM(cfg).save_pretrained(path)
  tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)},
                                   unk_token="w3"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.post_processor = processors.TemplateProcessing(
      single="w2 $A", special_tokens=[("w2", 2)])
  tok.save(str(path / "tokenizer.json"))


def test_cli_hf_checkpoint_prompts_file_sampling_json(tmp_path, capsys):
  _save_gemma2_checkpoint(tmp_path / "ckpt")
  prompts = tmp_path / "prompts.txt"
  prefix = " ".join(f"w{i}" for i in range(10, 30))
  prompts.write_text(f"{prefix} w40\n\n{prefix} w41\n")
  assert cli.main(["--model", str(tmp_path / "ckpt"), "--prompts-file",
                   str(prompts), "--max-new-tokens", "5", "--temperature", "0.8",
                   "--top-k", "20", "--top-p", "0.9", "--seed", "3",
                   "--page-size", "8", "--num-slots", "32", "--max-seqs", "1",
                   "--ignore-eos", "--json", "--no-progress"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert [o["prompt"] for o in result["outputs"]] == [f"{prefix} w40",
                                                      f"{prefix} w41"]
  assert all(len(o["token_ids"]) == 5 for o in result["outputs"])
  assert all(o["text"] == " ".join(f"w{t}" for t in o["token_ids"] if t != 2)
             for o in result["outputs"])  # BOS (w2) is skipped in the text
  summary = result["summary"]
  assert summary["model"] == "ckpt" and summary["generated_tokens"] == 10
  # One sequence at a time: the second prompt reuses the first's full blocks
  # (BOS + 20 shared words = 2 full pages of 8).
  assert summary["prefix_cache_hit_rate"] == pytest.approx(16 / 44)
  assert 0 < summary["peak_slots"] <= 32
