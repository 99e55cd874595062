"""`pkvattn.serving.programs`, piece by piece: what a burst program of a
row bucket computes over, and the token buffer an admission writes.

The programs' results through the engine (tokens, reuse, preemption) are
the engine tests'; these pin what those cannot see: the rows a burst's
model runs over (its work, not its tokens) and the prompt rows recorded
before any token of them is fed.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.serving import programs

CFG = EngineConfig(page_size=8, num_slots=40, max_seqs=4, max_num_tokens=32,
                   max_model_len=64, decode_steps=2, burst_rows=(2,),
                   impl="xla")


@pytest.fixture(scope="module")
def buffers(model):
  """An engine's `(params, pool, state, seq_tokens)`, for lowering."""
  return Engine(model, CFG)._buffers()


def _logit_rows(text, vocab):
  """Row counts of the `[rows, vocab]` f32 tensors in a lowered module."""
  return {int(m) for m in re.findall(rf"tensor<(\d+)x{vocab}xf32>", text)}


@pytest.mark.parametrize("rows", [2, 4])
def test_a_burst_computes_over_its_row_bucket(model, buffers, rows):
  assert CFG.burst_buckets == (2, 4)
  fn = programs.jitted_program(model.cfg, CFG, None, "burst", False,
                               rows=rows)
  inputs = programs.burst_input_shapes(CFG)
  # Its outputs keep every row, whatever its bucket.
  out = jax.eval_shape(fn, *buffers, inputs)[3]
  S, k = CFG.max_seqs, CFG.decode_steps
  assert (out.tokens.shape, out.preempted.shape) == ((k, S), (S,))
  assert {a.shape for a in jax.tree.leaves(out.carry)} == {(S,)}
  text = fn.lower(*buffers, inputs).as_text()
  # The [hidden, vocab] LM head aside, every [n, vocab] tensor is the
  # bucket's rows' logits.
  found = _logit_rows(text, model.cfg.vocab_size) - {model.cfg.hidden_size}
  assert found == {rows}


def test_burst_rows_are_checked_when_traced(model, buffers):
  for rows in (0, 5):
    fn = programs.jitted_program(model.cfg, CFG, None, "burst", True,
                                 rows=rows)
    with pytest.raises(ValueError, match=r"Invalid rows: expected an int in "
                       rf"\[1, 4\], got {rows}"):
      fn.lower(*buffers, programs.burst_input_shapes(CFG))


def test_admission_records_the_prompt_before_it_is_fed(model):
  engine = Engine(model, CFG)
  prompts = [[256, 9, 8, 7, 6, 5], [256, 1, 2]]
  for p in prompts:
    engine.add_request(p, SamplingParams(max_new_tokens=2))
  engine.step()   # admits both: no token fed yet
  assert engine.stats.prefill_tokens == 0
  tokens = np.asarray(engine.seq_tokens)
  for row, p in enumerate(prompts):
    np.testing.assert_array_equal(tokens[row, :len(p)], p)


@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_programs_are_jitted_with_the_backends_compiler_options(
    monkeypatch, model, backend):
  made = []
  monkeypatch.setattr(programs.jax, "default_backend", lambda: backend)
  monkeypatch.setattr(programs.jax, "jit",
                      lambda fn, **kw: made.append(kw) or fn)
  # Uncached (`__wrapped__`): the stand-in jit must not reach the cache.
  for kind in ("step", "step_cache", "reserve", "burst"):
    programs.jitted_program.__wrapped__(model.cfg, CFG, None, kind, True,
                                        rows=2)
  options = programs.compiler_options()
  assert bool(options) == (backend == "gpu")
  # Every program gets the GPU options; elsewhere none are passed.
  assert [kw["compiler_options"] for kw in made] == [options or None] * 4
  assert all(kw["donate_argnums"] == (1, 2, 3) for kw in made)
