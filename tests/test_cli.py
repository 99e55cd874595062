"""`pkvattn-generate` end to end on the built-in model, in-process (CPU)."""

from __future__ import annotations

import json

from pkvattn import cli


def test_cli_text_output(capsys):
  assert cli.main(["--prompt", "Hello, paged world", "--prompt",
                   "Hello, paged universe", "--max-new-tokens", "6",
                   "--page-size", "8", "--num-slots", "32", "--no-progress"]) == 0
  out = capsys.readouterr().out
  assert "[0] 'Hello, paged world'" in out and "[1] 'Hello, paged universe'" in out
  for field in ("prefill:", "decode:", "tokens/s", "prefix-cache hit rate",
                "peak slots", "slots saved by scratch reuse"):
    assert field in out


def test_cli_json_prompts_file_and_sampling(tmp_path, capsys):
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("The same long prefix, then one\n\n"
                     "The same long prefix, then two\n")
  assert cli.main(["--model", "tiny-gemma2", "--prompts-file", str(prompts),
                   "--max-new-tokens", "5", "--temperature", "0.8",
                   "--top-k", "20", "--top-p", "0.9", "--seed", "3",
                   "--page-size", "8", "--num-slots", "32", "--max-seqs", "1",
                   "--ignore-eos", "--json", "--no-progress"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert [o["prompt"] for o in result["outputs"]] == [
      "The same long prefix, then one", "The same long prefix, then two"]
  assert all(len(o["token_ids"]) == 5 for o in result["outputs"])
  summary = result["summary"]
  assert summary["generated_tokens"] == 10
  # One sequence at a time: the second prompt reuses the first's full blocks.
  assert summary["prefix_cache_hit_rate"] > 0
  assert 0 < summary["peak_slots"] <= 32
