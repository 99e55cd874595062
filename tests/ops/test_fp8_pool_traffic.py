"""An FP8 decode step on the XLA path touches its new rows, not the pool.

XLA's CPU backend has no FP8 scatter or dynamic-update-slice: given a
float8_e4m3fn operand it converts the whole operand to f16, updates it and
converts it back. The XLA append therefore scatters FP8 rows as bytes, and a
decoder step given the pool as `uint8` bytes updates it in place. The checks
are XLA's own cost analysis of the compiled step (bytes accessed), compared
between a small and a large pool, so they do not depend on timing: the step
over a pool 64 times larger may access only a few bytes more.
"""

from __future__ import annotations

import cpu_options
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pkvattn
from pkvattn import _kv
from pkvattn import models
from pkvattn.flax import AttentionPlan, layer_page_tables
from pkvattn.models import calibrate
from hlo_text import VIEW_OPS
from hlo_text import materialized


def _append_and_attend(qkv, pool):
  t = qkv.shape[0]
  table = jnp.arange(t * 2 * 2, dtype=jnp.int32).reshape(t, 2, 2)
  pos = jnp.arange(t, dtype=jnp.int32) + 3
  q, pool = pkvattn.apply_rope_and_append_qkv(
      qkv, jnp.arange(t, dtype=jnp.int32), pos, pool, table, pkvattn.RopeConfig(),
      impl="xla", k_scale=0.5, v_scale=0.25)
  out = pkvattn.paged_prefill(
      q, pool, table, jnp.arange(t + 1, dtype=jnp.int32), pos + 1, impl="xla",
      k_scale=0.5, v_scale=0.25)
  return out, pool


def test_fp8_append_never_widens_the_pool():
  """No unfused op of the compiled append + attention makes a pool-sized
  array but the in-place byte scatter (and free bitcasts): no f16 copy
  around an FP8 scatter."""
  pool, qkv = cpu_options.to_cpu((
      jnp.zeros((512, 16, 2, 64), jnp.float8_e4m3fn),
      jnp.ones((4, 8 * 64), jnp.float32)))
  text = jax.jit(_append_and_attend, donate_argnums=1).lower(
      qkv, pool).compile(cpu_options.default_codegen_options()).as_text()
  ops = materialized(text, pool.size)
  assert any("scatter" in op for op in ops), ops
  wide = [op for op in ops if op.split()[0] not in VIEW_OPS
          and "bitcast-convert" not in op and "scatter" not in op]
  assert not wide, wide


@pytest.mark.parametrize("scan", [True, False])
def test_decoder_step_on_fp8_bytes_updates_in_place(scan):
  """A decode step given the pool as bytes: its only pool-sized ops are the
  in-place byte scatters (no conversion, no copy), scanned or unrolled
  layers; and the bytes give what the float8_e4m3fn pool gives."""
  cfg = models.DecoderConfig(
      vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
      num_qo_heads=2, num_kv_heads=1, head_dim=64, rope=pkvattn.RopeConfig())
  params = calibrate.set_kv_scales(
      models.init_params(cfg, jax.random.key(0)), 0.5, 0.25)
  if not scan:
    params = models.unstack_layers(params)
  batch, pages = 3, 2
  table = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
  plan = AttentionPlan.create(
      layer_page_tables(jnp.asarray(table), cfg.num_layers),
      np.arange(batch + 1, dtype=np.int32), np.full(batch, 9, np.int32), batch)
  tokens = jnp.arange(batch, dtype=jnp.int32)
  params, plan, tokens, pool = cpu_options.to_cpu(
      (params, plan, tokens, jnp.zeros(cfg.pool_shape(8, 16), jnp.uint8)))
  step = lambda p, pool: models.forward(p, cfg, tokens, pool, plan,  # noqa: E731
                                        impl="xla")
  text = jax.jit(step, donate_argnums=1).lower(params, pool).compile(
      cpu_options.default_codegen_options()).as_text()
  ops = materialized(text, pool.size)
  assert any("scatter" in op for op in ops), ops
  passes = [op for op in ops
            if op.split()[0] not in VIEW_OPS and "scatter" not in op]
  assert not passes, passes
  got, new_pool = jax.jit(step)(params, pool)
  want, want_pool = jax.jit(step)(params, _kv.from_bytes(pool))
  assert new_pool.dtype == jnp.uint8
  assert np.asarray(new_pool).any()  # the step wrote its rows
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(new_pool),
                                np.asarray(_kv.as_bytes(want_pool)))
