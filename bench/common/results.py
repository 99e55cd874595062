"""The results files of the benchmarks: one JSON per benchmark and device,
stamped with the build it measured.

Every file written here carries `commit` (the measured source tree),
`device`, `date` (UTC, ISO 8601), the platform and the versions of
jax / jaxlib / torch / flashinfer-python that are importable, beside the
benchmark's own `rows` and extras.

`commit` is `$PKVATTN_COMMIT` where set (a GPU machine often gets a copy of
the tree without `.git`: export the hash of the tree that was copied), else
`git rev-parse HEAD` of this checkout with `-dirty` appended when tracked
files have uncommitted changes. Without either, `commit()` raises
RuntimeError and nothing is written: a figure whose build is unknown is not
kept.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
DEFAULT_OUT = os.path.join("bench", "results")
COMMIT_ENV = "PKVATTN_COMMIT"


def _git(*args) -> str:
  return subprocess.run(["git", "-C", ROOT, *args], check=True,
                        capture_output=True, text=True).stdout.strip()


def commit() -> str:
  """The measured build: `$PKVATTN_COMMIT`, else `git rev-parse HEAD`
  (+ "-dirty" with uncommitted changes to tracked files).

  Raises:
    RuntimeError: neither is available.
    ValueError: `$PKVATTN_COMMIT` is not a full 40-digit hex commit (a
      short one would fail the results check only once the file is in the
      repository).
  """
  env = os.environ.get(COMMIT_ENV, "").strip()
  if env:
    if not re.fullmatch(r"[0-9a-f]{40}(-dirty)?", env):
      raise ValueError(
          f"Invalid {COMMIT_ENV}: expected a full commit (40 hex digits, "
          f"`git rev-parse HEAD`), got {env!r}")
    return env
  try:
    head = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
  except (OSError, subprocess.CalledProcessError) as e:
    raise RuntimeError(
        f"cannot name the measured commit: set {COMMIT_ENV} (e.g. "
        f"`export {COMMIT_ENV}=$(git rev-parse HEAD)` where the tree was "
        f"copied from) or run inside the git checkout ({e})") from e
  return head + ("-dirty" if dirty else "")


def versions() -> dict[str, str]:
  """Installed versions of jax, jaxlib, torch and flashinfer-python (the
  ones importable)."""
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  out = {}
  for pkg in ("jax", "jaxlib", "torch", "flashinfer-python"):
    try:
      out[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
      pass
  return out


def device_name() -> str:
  """`device_kind` of the first JAX device (e.g. "NVIDIA H100 80GB HBM3")."""
  import jax  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  return getattr(dev, "device_kind", str(dev))


def device_tag() -> str:
  """The device name as a file-name part ("NVIDIA_H100_80GB_HBM3")."""
  return device_name().replace(" ", "_")


def environment() -> dict:
  """The stamp of a results file: commit, device, platform, versions, date.
  Call it before measuring: it raises (`commit`) before any time is spent
  on a run whose results could not be written."""
  import jax  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  return dict(
      commit=commit(),
      device=getattr(dev, "device_kind", str(dev)),
      platform=dev.platform,
      versions=versions(),
      python=platform.python_version(),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
  )


def write(name: str, rows: list[dict], *, out: str = DEFAULT_OUT,
          extra: dict | None = None, env: dict | None = None) -> list[str]:
  """Writes `{environment, extra, rows}` to `<out>/<name>.json` (and to
  `$OUT/<name>.json` where `$OUT` is set, as on the lent GPU machines).

  Args:
    name: file name without `.json`, e.g. `f"decode_{device_tag()}"`.
    rows: the measured rows.
    out: folder (created if missing).
    extra: more top-level fields (roofs, checks, notes).
    env: a stamp from `environment()` taken when the run started (its
      commit and date); a fresh one if None.

  Returns:
    The paths written.

  Raises:
    RuntimeError: the commit cannot be named (`commit`).
  """
  stamp = dict(env) if env is not None else environment()
  if not stamp.get("commit"):
    raise RuntimeError("refusing to write results without a commit")
  payload = dict(stamp, **(extra or {}), rows=rows)
  dirs = [out]
  if os.environ.get("OUT") and os.path.abspath(os.environ["OUT"]) != \
      os.path.abspath(out):
    dirs.append(os.environ["OUT"])
  paths = []
  for d in dirs:
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, f"{name}.json")
    with open(p, "w") as f:
      json.dump(payload, f, indent=1, default=float)
    paths.append(p)
  return paths


def add_out_arg(parser, default: str = DEFAULT_OUT) -> None:
  """The `--out DIR` option every benchmark takes."""
  parser.add_argument("--out", default=default,
                      help=f"results folder (default {default})")
