"""`pkvattn.__version__`: the installed distribution's version.

Read from the package metadata (`importlib.metadata`); in a source tree that
was never installed, from the `version = "..."` line of the project's
pyproject.toml; `"0+unknown"` when neither is found. Imports nothing heavy, so
`pkvattn-generate --version` stays cheap.
"""

from __future__ import annotations

import os
import re
from importlib import metadata


def _read_version() -> str:
  try:
    return metadata.version("pkvattn")
  except metadata.PackageNotFoundError:
    pass
  pyproject = os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "pyproject.toml")
  try:
    with open(pyproject, encoding="utf-8") as f:
      match = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
  except OSError:
    match = None
  return match.group(1) if match else "0+unknown"


__version__ = _read_version()
