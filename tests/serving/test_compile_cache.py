"""`pkvattn.serving.compile_cache` on its own: where programs are kept, what
their source digest covers, and how saving fails without a trace.

The engine-level behaviour (a second engine served from the directory, the
least recently used programs pruned, the digest's parts) is in
`test_engine_compile_once.py`.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest

import pkvattn.cache
import pkvattn.pallas_kernels
from pkvattn.serving import compile_cache


def test_default_dir_follows_xdg_cache_home(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache.default_dir() == str(tmp_path / "xdg" / "pkvattn" /
                                            "xla")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert compile_cache.default_dir() == str(tmp_path / "home" / ".cache" /
                                            "pkvattn" / "xla")
  monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty counts as unset
  assert compile_cache.default_dir().startswith(str(tmp_path / "home"))


def _tree(root, files):
  for rel, text in files.items():
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_source_digest_covers_every_python_file_below_the_packages(
    monkeypatch, tmp_path):
  # Three fake package roots stand in for pkvattn, pkvattn.cache and
  # pkvattn.pallas_kernels; the digest is recomputed (not the cached one).
  roots = [tmp_path / n for n in ("pkg", "cache", "kernels")]
  for root in roots:
    _tree(root, {"__init__.py": "", "sub/deep/mod.py": "x = 1\n",
                 "notes.txt": "a", "__pycache__/mod.cpython-311.pyc": "b"})
  for module, root in zip((sys.modules["pkvattn"], pkvattn.cache,
                           pkvattn.pallas_kernels), roots):
    monkeypatch.setattr(module, "__path__", [str(root)])
  digest = compile_cache.source_digest.__wrapped__
  base = digest()
  assert digest() == base
  # Byte caches and other files do not count ...
  for root in roots:
    _tree(root, {"__pycache__/mod.cpython-311.pyc": "changed",
                 "notes.txt": "changed", "sub/__pycache__/x.py": "y = 2\n"})
  assert digest() == base
  # ... every source file does, however deep, in each package.
  for i, root in enumerate(roots):
    _tree(root, {"sub/deep/mod.py": f"x = {i + 2}\n"})
    edited = digest()
    assert edited != base, root
    base = edited
  # A renamed file changes it even with the same contents.
  os.rename(roots[0] / "sub" / "deep" / "mod.py",
            roots[0] / "sub" / "deep" / "mod2.py")
  assert digest() != base


def test_kernel_runtime_is_loaded_on_gpus_only(monkeypatch):
  imported = []
  monkeypatch.setattr(compile_cache.importlib, "import_module",
                      lambda name: imported.append(name))
  load = compile_cache._load_kernel_runtime.__wrapped__
  monkeypatch.setattr(compile_cache._checks, "is_gpu", lambda: False)
  load()
  assert imported == []
  monkeypatch.setattr(compile_cache._checks, "is_gpu", lambda: True)
  load()
  assert imported == ["jax.experimental.mosaic.gpu"]

  def missing(name):
    raise ImportError(name)

  # A jaxlib without Mosaic GPU has no kernels to load: not an error.
  monkeypatch.setattr(compile_cache.importlib, "import_module", missing)
  load()


def _compiled():
  x = jnp.arange(4.0)
  return jax.jit(lambda v: v * 2).lower(x).compile()


def test_a_program_that_cannot_be_saved_leaves_nothing(tmp_path):
  path = str(tmp_path / "programs" / "p.pkl")
  # Not an executable: serialization fails before any file is made.
  assert compile_cache.save_program(path, object()) is False
  assert not os.path.exists(os.path.dirname(path))


def test_a_failed_write_removes_its_temporary_file(monkeypatch, tmp_path):
  path = str(tmp_path / "p.pkl")

  def fail(src, dst):
    raise OSError("disk full")

  monkeypatch.setattr(compile_cache.os, "replace", fail)
  assert compile_cache.save_program(path, _compiled()) is False
  assert os.listdir(tmp_path) == []
  monkeypatch.undo()
  assert compile_cache.save_program(path, _compiled()) is True
  assert os.listdir(tmp_path) == ["p.pkl"]
  loaded = compile_cache.load_program(path, jax.devices()[:1])
  assert loaded is not None
  assert list(loaded(jnp.arange(4.0))) == [0.0, 2.0, 4.0, 6.0]


def test_unreadable_programs_load_as_none(tmp_path):
  devices = jax.devices()[:1]
  assert compile_cache.load_program(str(tmp_path / "none.pkl"), devices) is None
  bad = tmp_path / "bad.pkl"
  bad.write_bytes(b"not a pickle")
  assert compile_cache.load_program(str(bad), devices) is None


def test_enable_refuses_a_path_it_cannot_use(tmp_path):
  afile = tmp_path / "f"
  afile.write_text("")
  with pytest.raises(ValueError, match="compile_cache_dir: cannot create"):
    compile_cache.enable(str(afile / "sub"))
