"""`pkvattn-generate`'s pure checks at their documented edges (no model
runs): every inclusive bound of a flag is accepted, `--kv-cache-memory`
sizes parse by their units, the help states each default once, and the
summary's rates are n/a where nothing was timed; one short run of the tiny
model checks the backend's default dtype and attention implementation."""

from __future__ import annotations

import json
import re

import pytest

from pkvattn import cli
from pkvattn.engine import EngineStats
from cli_errors import error_line

MAX_SEED = 2**32 - 1  # the help: seeds are in [0, 4294967295]


def _checked(argv) -> tuple[list[str], object]:
  """`(prompts, args)` after the CLI's flag checks, which must pass."""
  parser = cli._parser()
  args = parser.parse_args(argv)
  return cli._check_flags(parser, args), args


@pytest.mark.parametrize("argv", [
    ["--page-size", "8"], ["--page-size", "128"],   # a power of two in [8, 128]
    ["--max-new-tokens", "1"], ["--num-slots", "1"], ["--tp", "1"],
    ["--decode-steps", "1"],                         # >= 1
    ["--max-seqs", "1", "--max-num-tokens", "1"],    # >= --max-seqs
    ["--max-seqs", "16", "--max-num-tokens", "16"],
    ["--max-model-len", "2"],                        # 1 prompt + 1 new token
    ["--temperature", "0"], ["--temperature", "100"],  # in [0, 100]
    ["--top-p", "1"], ["--top-p", "1e-9"],           # in (0, 1]
    ["--top-k", "0"],
    ["--seed", "0"], ["--seed", str(MAX_SEED)],      # in [0, 2**32 - 1]
    ["--host-kv-cache-gb", "0"], ["--host-kv-cache-gb", "1e-9"],
    ["--kv-cache-dtype", "fp8", "--kv-scales", "per-head"],
])
def test_inclusive_bounds_are_accepted(argv):
  """Each bound the help states as included passes the flag checks."""
  assert _checked(["--prompt", "a"] + argv)[0] == ["a"]


def test_seed_plus_prompt_index_reaches_the_top_seed(capsys):
  """Prompt i samples with seed + i: seed 2**32 - 2 fits two prompts (the
  second gets the top seed), 2**32 - 1 does not."""
  argv = ["--prompt", "a", "--prompt", "b", "--seed"]
  assert _checked(argv + [str(MAX_SEED - 1)])[0] == ["a", "b"]
  line = error_line(capsys, ["--model", "tiny-llama"] + argv + [str(MAX_SEED)])
  assert f"argument --seed: expected <= {MAX_SEED - 1} " in line


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_host_kv_cache_gb_must_be_finite(capsys, value):
  """`--host-kv-cache-gb` is a number of GB >= 0: inf and nan are errors."""
  line = error_line(capsys, ["--model", "tiny-llama", "--prompt", "a",
                             "--host-kv-cache-gb", value])
  assert "argument --host-kv-cache-gb: expected a number of GB >= 0" in line


@pytest.mark.parametrize("text, size", [
    ("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("1e9", 10**9),
    ("1000000000", 10**9), ("3KiB", 3 * 1024), ("2TiB", 2 * 1024**4),
    ("3kB", 3000), ("5MB", 5 * 10**6), ("7GB", 7 * 10**9), ("0.5GiB", 2**29),
    ("64B", 64),  # a B suffix: bytes
])
def test_parse_size_units(text, size):
  """`parse_size` reads the binary (KiB..TiB) and decimal (kB..GB) units of
  its docstring, and a plain number of bytes."""
  assert cli.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "8XB", "GiB", "1e999", "nan",
                                  "-1e999", "-inf", "1e308TiB", "-1e308GB"])
def test_parse_size_rejects_non_sizes(text):
  """Not a size (no number, an unknown unit, a number or size beyond a
  float, either sign): None, so the CLI prints an error line."""
  assert cli.parse_size(text) is None


def test_kv_cache_memory_beyond_a_float_is_an_error_line(capsys):
  """A size that overflows once its unit applies is refused like any other
  non-size, with the CLI's error line (not a traceback)."""
  line = error_line(capsys, ["--model", "tiny-llama", "--prompt", "a",
                             "--kv-cache-memory=1e308TiB"])
  assert line.endswith("argument --kv-cache-memory: expected a positive "
                       "size such as 8GiB, 512MiB or 1000000000, got "
                       "'1e308TiB'")


def test_prompts_file_lines_are_prompts(tmp_path):
  """`--prompts-file`: one prompt per line, blank lines skipped."""
  path = tmp_path / "prompts.txt"
  path.write_text("first\n\n  \nsecond\n")
  assert _checked(["--prompts-file", str(path)])[0] == ["first", "second"]


def test_unreadable_prompts_file_names_the_path_once(capsys, tmp_path):
  """The error names the file once, then why it cannot be read."""
  missing = str(tmp_path / "missing.txt")
  line = error_line(capsys, ["--model", "tiny-llama",
                             "--prompts-file", missing])
  assert f"argument --prompts-file: cannot read {missing!r}: " in line
  assert line.count(missing) == 1


def test_kv_cache_memory_flag(capsys):
  """`--kv-cache-memory` takes a size (kept as bytes for the engine); one
  that is not a positive size is an error line naming the text."""
  for text, size in (("512MiB", 512 * 2**20), ("1", 1)):
    assert _checked(["--prompt", "a", "--kv-cache-memory", text])[
        1].kv_cache_memory == size
  assert _checked(["--prompt", "a"])[1].kv_cache_memory is None
  for text in ("lots", "0", "-1GiB"):
    line = error_line(capsys, ["--model", "tiny-llama", "--prompt", "a",
                               f"--kv-cache-memory={text}"])
    assert line.endswith("argument --kv-cache-memory: expected a positive "
                         "size such as 8GiB, 512MiB or 1000000000, got "
                         f"{text!r}")


def test_pool_check_counts_cached_tokens_exactly(capsys):
  """The cache holds at most len(prompt) + new - 1 tokens, one slot per
  started page: 9 + 8 - 1 = 16 tokens fill exactly 2 pages of 8."""
  parser = cli._parser()
  ids = [[1] * 9]

  def plan(num_slots):
    args = parser.parse_args(["--page-size", "8", "--max-new-tokens", "8",
                              "--num-slots", str(num_slots)])
    return cli._plan_lengths(parser, args, ids, 4096, False)

  assert plan(2) == (24, [8])   # 9 + 8 = 17 tokens, rounded up to 3 pages
  with pytest.raises(SystemExit) as exc:
    plan(1)
  assert exc.value.code == 2
  assert "error: argument --num-slots: expected >= 2, got 1" in (
      capsys.readouterr().err)


def test_pool_check_names_the_largest_request(capsys):
  """The --num-slots error names the request that needs the most pages,
  wherever it stands among the prompts."""
  parser = cli._parser()
  args = parser.parse_args(["--page-size", "8", "--max-new-tokens", "4",
                            "--num-slots", "2"])
  for lens in ([20, 3, 9], [3, 20, 9]):
    with pytest.raises(SystemExit):
      cli._plan_lengths(parser, args, [[1] * n for n in lens], 4096, False)
    i = lens.index(20)  # 20 + 4 - 1 = 23 cached tokens: 3 pages of 8
    assert (f"error: argument --num-slots: expected >= 3, got 2: prompt {i} "
            "(20 tokens) + 4 new tokens need 3 pages of 8 tokens") in (
                capsys.readouterr().err)


def test_max_model_len_may_equal_max_position_embeddings():
  """`--max-model-len` is bounded by the model's max_position_embeddings,
  inclusive."""
  parser = cli._parser()
  args = parser.parse_args(["--page-size", "8", "--max-model-len", "64",
                            "--max-new-tokens", "10"])
  assert cli._plan_lengths(parser, args, [[1] * 60], 64, False) == (64, [4])


def test_rates_without_tokens_or_time_are_none():
  """A rate needs both tokens and a measured time; otherwise it is n/a
  (never 0.0 tokens/s, never a division by zero)."""
  assert cli._rate(6, 1.5) == 4.0
  assert cli._rate(0, 1.5) is None
  assert cli._rate(6, 0.0) is None
  assert cli._fmt_rate(cli._rate(6, 0.0)) == "n/a"


def test_fmt_rate_switches_to_whole_numbers_at_1000():
  """Three significant digits below 1000, whole numbers with thousands
  separators from 1000 on, and for the rates just under it that three
  digits would round up to 1000 (never "1e+03")."""
  assert cli._fmt_rate(999.0) == "999"
  assert cli._fmt_rate(999.4) == "999"
  assert cli._fmt_rate(999.5) == "1,000"
  assert cli._fmt_rate(999.6) == "1,000"
  assert cli._fmt_rate(0.01234) == "0.0123"
  assert cli._fmt_rate(1000.0) == "1,000"
  assert cli._fmt_rate(1234.5) == "1,234"


def test_a_short_compilation_still_leaves_the_step_out():
  """Any compile time in a step (here 0.2 s) makes it a compiling step:
  its tokens and time enter no rate."""
  timed = cli._Timed()
  after = EngineStats(prefill_tokens=4, prefill_time_s=0.1,
                      generated_tokens=1, compile_time_s=0.2)
  assert timed.add(EngineStats(), after, step_s=0.3, num_sampled=1) is True
  assert (timed.generated_tokens, timed.prefill_tokens) == (0, 0)
  assert timed.compile_s == 0.2


def test_decode_rate_counts_each_step_s_own_time():
  """A timed decode step adds its own tokens and seconds (the stats'
  differences), not the running totals."""
  timed = cli._Timed()
  before = EngineStats(decode_tokens=5, decode_time_s=0.25)
  after = EngineStats(decode_tokens=9, decode_time_s=0.75)
  assert timed.add(before, after, step_s=0.5, num_sampled=4) is False
  assert cli._rate(timed.decode_tokens, timed.decode_s) == 4 / 0.5


def test_help_states_each_default_once(capsys):
  """An option whose help states its default gets no second `(default:`."""
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  text = " ".join(capsys.readouterr().out.split())
  blocks = re.split(r" (?=--[a-z])", text.split("options:", 1)[1])
  for block in blocks:
    assert block.count("(default") <= 1, block
  assert "(default: none)" in text and "(default: [])" not in text


def test_dtype_and_impl_defaults_follow_the_backend(capsys):
  """Without --dtype / --impl a run uses bfloat16 and the Pallas kernels on a
  GPU, float32 and XLA elsewhere (the help's defaults); --no-progress keeps
  stderr free of progress output."""
  import jax
  gpu = jax.default_backend() == "gpu"
  assert cli.main(["--model", "tiny-llama", "--page-size", "8",
                   "--num-slots", "32", "--max-model-len", "64",
                   "--prompt", "Hello", "--prompt", "paged",
                   "--max-new-tokens", "1", "--json", "--no-progress"]) == 0
  captured = capsys.readouterr()
  assert "compiling" not in captured.err  # --no-progress: no progress lines
  summary = json.loads(captured.out)["summary"]
  assert (summary["dtype"], summary["impl"]) == (
      ("bfloat16", "pallas") if gpu else ("float32", "xla"))
