"""Every results file names the build it measured, and the writer refuses to
write one that cannot."""

import glob
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
sys.path.insert(0, ROOT)
from bench.common import results  # noqa: E402  (repo root, for the bench package)

COMMIT = re.compile(r"^[0-9a-f]{40}(-dirty)?$")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")
FILES = sorted(glob.glob(os.path.join(ROOT, "bench", "results", "**",
                                      "*.json"), recursive=True))


def test_results_folder_has_files():
  assert FILES, "bench/results/ holds no JSON"


@pytest.mark.parametrize("path", FILES,
                         ids=[os.path.relpath(p, ROOT) for p in FILES])
def test_result_names_commit_date_and_device(path):
  with open(path) as f:
    data = json.load(f)
  assert isinstance(data, dict), "a results file is one JSON object"
  assert COMMIT.match(str(data.get("commit", ""))), data.get("commit")
  assert DATE.match(str(data.get("date", ""))), data.get("date")
  assert isinstance(data.get("device"), str) and data["device"]


def test_commit_from_environment(monkeypatch):
  monkeypatch.setenv(results.COMMIT_ENV, "ab" * 20)
  assert results.commit() == "ab" * 20


def test_commit_from_environment_must_be_full(monkeypatch):
  for short in ("ffef9a5", "ab" * 19, "AB" * 20):
    monkeypatch.setenv(results.COMMIT_ENV, short)
    with pytest.raises(ValueError, match="Invalid PKVATTN_COMMIT"):
      results.commit()


def test_commit_from_git_marks_a_dirty_tree(monkeypatch):
  monkeypatch.delenv(results.COMMIT_ENV, raising=False)
  answers = {("rev-parse", "HEAD"): "cd" * 20}
  for status, want in (("", "cd" * 20), (" M x.py", "cd" * 20 + "-dirty")):
    answers[("status", "--porcelain", "--untracked-files=no")] = status
    monkeypatch.setattr(results, "_git", lambda *a: answers[a])
    assert results.commit() == want


def test_write_refuses_without_a_commit(monkeypatch, tmp_path):
  monkeypatch.delenv(results.COMMIT_ENV, raising=False)
  monkeypatch.delenv("OUT", raising=False)

  def no_git(*args):
    raise OSError("no git here")
  monkeypatch.setattr(results, "_git", no_git)
  with pytest.raises(RuntimeError, match=results.COMMIT_ENV):
    results.write("x", [dict(a=1)], out=str(tmp_path))
  assert not list(tmp_path.iterdir())


def test_write_stamps_the_file(monkeypatch, tmp_path):
  monkeypatch.setenv(results.COMMIT_ENV, "ef" * 20)
  monkeypatch.delenv("OUT", raising=False)
  (path,) = results.write("x", [dict(a=1)], out=str(tmp_path),
                          extra=dict(note="n"))
  with open(path) as f:
    data = json.load(f)
  assert data["commit"] == "ef" * 20 and data["rows"] == [dict(a=1)]
  assert data["note"] == "n" and DATE.match(data["date"]) and data["device"]
  assert "jax" in data["versions"]
