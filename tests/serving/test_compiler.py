"""`pkvattn.serving.compiler.Compiler` without compiling: the input shapes
and placement a program is lowered with, and how many threads warmup
compiles on. The program list, lowering order and per-call keys, and the
compiles themselves, are in `test_engine_compile_once.py`.
"""

from __future__ import annotations

import concurrent.futures

import jax
import pytest

from pkvattn import parallel
from pkvattn.models.tiny import TINY_CONFIGS
from pkvattn.serving import compiler, programs
from pkvattn.serving.config import EngineConfig
from pkvattn.serving.stats import EngineStats

MODEL = TINY_CONFIGS["tiny-llama"]
CFG = EngineConfig(page_size=8, num_slots=12, max_seqs=4, max_num_tokens=32,
                   max_model_len=64, decode_steps=4, impl="xla")


def _compiler(**kw):
  return compiler.Compiler(MODEL, CFG, None, EngineStats(), **kw)


class _Recorder:
  """Stands in for a program's jit: records what `lower` is given."""

  def __init__(self):
    self.calls = []

  def lower(self, *args):
    self.calls.append(args)
    return "lowered"


@pytest.mark.parametrize("mesh", [False, True])
def test_programs_are_lowered_on_their_input_shapes_and_placement(mesh):
  sharding = parallel.replicated(parallel.make_mesh(1)) if mesh else None
  comp = _compiler(inputs_sharding=sharding)
  rec = _Recorder()
  comp.jitted = lambda key: rec
  buffers = ("params", "pool", "state", "tokens")
  for key, want in ((compiler.ProgramKey("step", 32, False),
                     programs.step_input_shapes(CFG, 32)),
                    (compiler.ProgramKey("burst", 4, True),
                     programs.burst_input_shapes(CFG))):
    assert comp.lower(key, buffers) == "lowered"
    args = rec.calls[-1]
    assert args[:4] == buffers
    got = args[4]
    assert type(got) is type(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert (g.shape, g.dtype) == (w.shape, w.dtype)
      assert g.sharding == sharding


class _Stop(Exception):
  pass


@pytest.mark.parametrize("cpus,max_workers,want", [
    (64, None, 6),     # one thread per program to compile
    (3, None, 3),      # at most one per core
    (None, None, 1),   # cores unknown
    (64, 2, 2),        # as asked
])
def test_warmup_threads(monkeypatch, cpus, max_workers, want):
  comp = _compiler()
  comp.split_variants = True   # six programs: two burst variants
  assert len(comp.keys()) == 6
  seen = []

  def pool(workers):
    seen.append(workers)
    raise _Stop

  monkeypatch.setattr(compiler.os, "cpu_count", lambda: cpus)
  monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", pool)
  with pytest.raises(_Stop):
    comp.warmup(None, max_workers=max_workers)
  assert seen == [want]
