"""The model runner: the model as the engine runs it, and one program call.

The engine's device state is four buffers, `(params, pool, state,
seq_tokens)`: the model's parameters, the KV pages, the cache state and each
row's token ids. Every program takes them and returns the last three
(donated: updated in place, never copied), with its outputs. This module
prepares the model once (`prepare_model`) and makes that call
(`run_program`), so the engine loop never handles shardings, donation or
checked-mode errors itself.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pkvattn.models import Model
from pkvattn.models import calibrate as _calibrate
from pkvattn.models import decoder as _decoder
from pkvattn.serving.config import EngineConfig


def prepare_model(model: Model, config: EngineConfig,
                  mesh: jax.sharding.Mesh | None, pool_dtype) -> Model:
  """The model as the engine runs it.

  * On a mesh ("tp" axis): laid out by `pkvattn.parallel.shard_model`,
    q/k/v and gate/up fused shard-major (one matmul per shard) and the LM
    head vocab-sharded where the vocabulary divides by tp.
  * Unless `config.scan_layers`: per-layer weights
    (`pkvattn.models.unstack_layers`), re-sharded on the mesh.
  * Off a mesh: q/k/v and gate/up projections fused into one matmul each
    (`decoder.fuse_projections`): the weights are concatenated once here
    rather than inside a gemm fusion every step (measured:
    docs/performance.md).
  * FP8 pages (`pool_dtype` float8_e4m3fn): per-layer `k_scale` / `v_scale`
    (`f32[num_kv_heads]` each with `config.kv_scales == "per_head"`) in the
    layer parameters (`config.k_scale` / `v_scale`, or 1.0 until
    calibrated), inputs of the programs, so calibrating compiles nothing.

  Raises:
    ValueError: the model's heads do not split over `mesh`.
  """
  if mesh is not None:
    from pkvattn import parallel as _parallel  # parallel imports models
    model = _parallel.shard_model(model, mesh, fuse=True)
    layers = model.params["layers"]
    if not config.scan_layers and not isinstance(layers, (tuple, list)):
      one = jax.eval_shape(_layer, layers, np.int32(0))
      take = jax.jit(_layer, out_shardings=jax.tree.map(
          lambda s: jax.sharding.NamedSharding(mesh, s),
          _parallel.param_specs(one, tp=_parallel.tp_size(mesh))))
      num_layers = jax.tree.leaves(layers)[0].shape[0]
      model = dataclasses.replace(model, params=dict(
          model.params, layers=tuple(take(layers, np.int32(i))
                                     for i in range(num_layers))))
  elif config.scan_layers or isinstance(model.params["layers"], (tuple, list)):
    model = dataclasses.replace(
        model, params=_decoder.fuse_projections(model.params))
  else:
    layers = model.params["layers"]
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    model = dataclasses.replace(model, params=dict(
        model.params, layers=tuple(_fused_layer(layers, np.int32(i))
                                   for i in range(num_layers))))
  if jnp.dtype(pool_dtype) == jnp.dtype(jnp.float8_e4m3fn):
    shape = _scale_shape(model.cfg, config)
    model = dataclasses.replace(model, params=_calibrate.set_kv_scales(
        model.params, np.full(shape, config.k_scale or 1.0, np.float32),
        np.full(shape, config.v_scale or 1.0, np.float32)))
  return model


def _layer(layers, i):
  """Layer `i` (i32[], traced: one program serves every layer) of stacked
  `layers`."""
  return jax.tree.map(lambda a: a[i], layers)


@jax.jit
def _fused_layer(layers, i):
  """Layer `i` (i32[]) of stacked `layers`, q/k/v and gate/up fused
  (`decoder.fuse_layer_projections`): one program for every layer, where
  slicing and concatenating op by op compiled a program per array shape."""
  return _decoder.fuse_layer_projections(_layer(layers, i))


def _scale_shape(cfg, config: EngineConfig) -> tuple[int, ...]:
  """`[num_layers]`, or `[num_layers, num_kv_heads]` with per-head scales:
  the programs' scale inputs, the same before and after calibration."""
  if config.kv_scales == "per_head":
    return (cfg.num_layers, cfg.num_kv_heads)
  return (cfg.num_layers,)


def calibrate(model: Model, config: EngineConfig, prompts) -> Model:
  """`model` with FP8 `k_scale` / `v_scale` per layer calibrated from a
  prefill of the first prompts (`pkvattn.models.calibrate`: the first
  `config.calibration_tokens` tokens of at most `config.max_seqs` prompts).
  The scales are parameters, so the engine's programs need no recompile."""
  k_scale, v_scale = _calibrate.calibrate_kv_scales(
      model.params, model.cfg, prompts,
      num_tokens=config.calibration_tokens, max_prompts=config.max_seqs,
      impl=config.impl, per_head=config.kv_scales == "per_head")
  return dataclasses.replace(model, params=_calibrate.set_kv_scales(
      model.params, k_scale, v_scale))


def check_scales(model: Model, config: EngineConfig,
                 prompts) -> _calibrate.ScaleCheck:
  """How `model`'s FP8 scales (calibrated or given) fit a prefill of the
  first prompts, the batch `calibrate` takes
  (`pkvattn.models.calibrate.check_kv_scales`)."""
  return _calibrate.check_kv_scales(
      model.params, model.cfg, prompts,
      num_tokens=config.calibration_tokens, max_prompts=config.max_seqs,
      impl=config.impl)


def run_program(program, buffers, inputs, *, check: bool,
                inputs_sharding=None):
  """Calls a compiled engine program; returns `((pool, state, seq_tokens,
  outputs), error)`.

  Args:
    program: a compiled step or burst (`serving.compiler.Compiler.program`).
    buffers: `(params, pool, state, seq_tokens)`; the last three are donated
      (deleted by the call: keep the returned ones).
    inputs: the program's `StepInputs` / `BurstInputs`. Host arrays go to
      the executable as they are (its C++ call path copies them, cheaper
      than a `jax.device_put` per array); on a mesh they are first
      replicated with `inputs_sharding`.
    check: the program was built checked (`EngineConfig.check`): it returns
      `(checkify.Error, result)`.

  Returns:
    The program's result and, in checked mode, its `checkify.Error` (None
    otherwise). The caller keeps the new buffers first, then raises the
    error (`error.throw()`: the first contract violation as a
    `checkify.JaxRuntimeError`), so a failed check leaves it with live
    buffers.
  """
  if inputs_sharding is not None:
    inputs = jax.device_put(inputs, inputs_sharding)
  result = program(*buffers, inputs)
  if check:
    err, result = result
    return result, err
  return result, None
