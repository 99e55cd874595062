"""`pkvattn-generate`'s usage errors, run in-process.

Every bad flag or input must end the CLI as argparse does: exit status 2,
nothing on stdout, no traceback, the usage and exactly one `error:` line.
`error_line` checks that and returns the line, for the tests of the CLI's
errors (`test_cli.py`) and of its checks at their documented edges
(`test_cli_checks.py`).
"""

from __future__ import annotations

import pytest

from pkvattn import cli


def error_line(capsys, argv) -> str:
  """Runs the CLI expecting a usage error; returns its one `error:` line."""
  with pytest.raises(SystemExit) as exc:
    cli.main(argv)
  assert exc.value.code == 2
  captured = capsys.readouterr()
  assert "Traceback" not in captured.err and not captured.out
  # Only a closed progress bar (its own line) may come before the usage.
  bar, usage, rest = captured.err.partition("usage: pkvattn-generate")
  assert usage and (not bar or bar.startswith("\rgenerating:") and
                    bar.endswith("\n")), captured.err
  lines = [l for l in rest.splitlines() if "error:" in l]
  assert len(lines) == 1, captured.err
  assert lines[0].startswith("pkvattn-generate: error: ")
  return lines[0]
