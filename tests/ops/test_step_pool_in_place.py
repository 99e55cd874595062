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

import jax
import jax.numpy as jnp
import pytest

from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.models import load_model
from test_fp8_pool_traffic import ALLOWED, _materialized

CFG = EngineConfig(page_size=8, num_slots=32, max_seqs=4, max_num_tokens=32,
                   max_model_len=64, token_buckets=(32,))


@pytest.fixture(scope="module")
def model():
  return load_model("tiny-llama")


@pytest.mark.parametrize("kv_cache_dtype", ["auto"])
def test_prefill_step_updates_the_pool_in_place(model, kv_cache_dtype):
  scales = {} if kv_cache_dtype == "auto" else dict(k_scale=0.05, v_scale=0.05)
  engine = Engine(model, dataclasses.replace(
      CFG, kv_cache_dtype=kv_cache_dtype, **scales))
  prompt = model.tokenizer.encode("hello world paged attention in place")
  engine.add_request(prompt, SamplingParams(max_new_tokens=1))
  engine.step()
  assert engine.last_inputs is not None
  text = engine._lower(engine.last_program).compile().as_text()
  assert "input_output_alias" in text
  assert " while(" in text  # the XLA prefill's loops are in this step
  numel = math.prod(engine.pool.shape)
  ops = _materialized(text, numel)
  assert any("scatter" in op for op in ops), ops
  passes = [op for op in ops
            if op.split()[0] not in ALLOWED and "scatter" not in op]
  assert not passes, passes
  if kv_cache_dtype == "fp8":
    assert engine.stats.kv_cache_dtype == "float8_e4m3fn"
  else:
    assert engine.pool.dtype == jnp.float32
    jax.block_until_ready(engine.pool)
