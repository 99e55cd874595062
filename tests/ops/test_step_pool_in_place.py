"""An engine step updates its KV pool in place: no pool-sized copy.

The pool is the step's largest argument; the engine donates it and XLA must
alias it to the returned pool (`input_output_alias`) and write the new rows
into it with scatters. A loop that reads the pool (the XLA prefill's query
tiles and key blocks) next to an append that writes it can make XLA copy
it: a layout chosen differently on the two sides, or a read that may not
precede the write. These tests compile a step with a prefill chunk (the
loops run) on a one-kv-head model (tiny-llama: the case whose size-1 head
axis gave XLA that layout choice), f32 and FP8 pages, and read the compiled
program: every unfused pool-sized instruction must be a view (bitcast,
tuple, loop carry) or an in-place scatter.
"""

from __future__ import annotations

import dataclasses
import math

import cpu_options
import jax
import jax.numpy as jnp
import pytest

from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.models import load_model
from hlo_text import VIEW_OPS
from hlo_text import materialized

# The engine's programs compile for its device; XLA:CPU's are the ones read
# (on a GPU the kernels append in place: test_rope_append_mgpu.py).
pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="reads XLA:CPU's engine programs")

CFG = EngineConfig(page_size=8, num_slots=32, max_seqs=4, max_num_tokens=32,
                   max_model_len=64, token_buckets=(32,))


@pytest.fixture(scope="module")
def model():
  return load_model("tiny-llama")


def _pool_passes(engine, key):
  """The unfused pool-sized ops of program `key` that are neither views nor
  scatters; asserts the pool is aliased and scattered into."""
  text = engine._lower(key).compile(
      cpu_options.default_codegen_options()).as_text()
  assert "input_output_alias" in text, key
  ops = materialized(text, math.prod(engine.pool.shape))
  assert any("scatter" in op for op in ops), (key, ops)
  return [op for op in ops
          if op.split()[0] not in VIEW_OPS and "scatter" not in op]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_steps_update_the_pool_in_place(model, kv_cache_dtype):
  """The prefill step (its loops in the program) and the decode step."""
  scales = {} if kv_cache_dtype == "auto" else dict(k_scale=0.05, v_scale=0.05)
  engine = Engine(model, dataclasses.replace(
      CFG, kv_cache_dtype=kv_cache_dtype, **scales))
  prompt = model.tokenizer.encode("hello world paged attention in place")
  engine.add_request(prompt, SamplingParams(max_new_tokens=2,
                                            ignore_eos=True))
  engine.step()  # the admission: the program of no tokens
  admit = engine.last_program
  assert admit.num_tokens == 0
  text = engine._lower(admit).compile(
      cpu_options.default_codegen_options()).as_text()
  assert "input_output_alias" in text
  assert all(op.split()[0] in VIEW_OPS  # the pool passes through untouched
             for op in materialized(text, math.prod(engine.pool.shape)))
  engine.step()
  prefill = engine.last_program
  assert " while(" in engine._lower(prefill).as_text(dialect="hlo")
  engine.step()
  decode = engine.last_program
  assert engine.last_inputs.tokens.shape[0] < len(prompt)  # a decode step
  for key in (prefill, decode):
    assert not _pool_passes(engine, key), key
  if kv_cache_dtype == "fp8":  # the XLA path holds FP8 pages as bytes
    assert engine.pool.dtype == jnp.uint8
    assert engine.stats.kv_cache_dtype == "float8_e4m3fn"
  else:
    assert engine.pool.dtype == jnp.float32
