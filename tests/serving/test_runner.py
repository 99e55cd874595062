"""`pkvattn.serving.runner.prepare_model`: the layout the engine runs.

Per-layer or stacked weights (`scan_layers`, and a model given already
unstacked), q/k/v and gate/up fused, on one device and on a one-device
"tp" mesh, and the FP8 scale parameters (given, or 1.0 until calibrated;
per layer or per layer and KV head). Weights are compared with the model's
own, sliced and concatenated here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pkvattn import parallel
from pkvattn.models import unstack_layers
from pkvattn.serving.config import EngineConfig
from pkvattn.serving.runner import prepare_model, run_program

CFG = EngineConfig(impl="xla")


def _per_layer(params):
  return list(unstack_layers(params)["layers"])


def _check_fused(prepared, original):
  """Each prepared layer's qkv / gate-up kernels are the original
  projections side by side; the other weights are the original ones."""
  got, want = _per_layer(prepared.params), _per_layer(original.params)
  assert len(got) == len(want) == original.cfg.num_layers
  for g, w in zip(got, want):
    attn, mlp = w["attn"], w["mlp"]
    qkv = np.concatenate([np.asarray(attn[n]["kernel"])
                          for n in ("q_proj", "k_proj", "v_proj")], axis=-1)
    np.testing.assert_array_equal(np.asarray(g["attn"]["qkv_proj"]["kernel"]),
                                  qkv)
    gate_up = np.concatenate([np.asarray(mlp[n]["kernel"])
                              for n in ("gate_proj", "up_proj")], axis=-1)
    np.testing.assert_array_equal(
        np.asarray(g["mlp"]["gate_up_proj"]["kernel"]), gate_up)
    assert "q_proj" not in g["attn"] and "gate_proj" not in g["mlp"]
    np.testing.assert_array_equal(np.asarray(g["attn"]["o_proj"]["kernel"]),
                                  np.asarray(attn["o_proj"]["kernel"]))


@pytest.mark.parametrize("mesh", [False, True])
@pytest.mark.parametrize("scan_layers,given", [
    (None, "stacked"), (False, "stacked"), (True, "stacked"),
    (False, "unstacked"), (None, "unstacked")])
def test_layers_stacked_or_per_layer_and_fused(model, mesh, scan_layers,
                                               given):
  # `scan_layers` keeps the stacked tree; otherwise the engine runs a tuple
  # of per-layer trees, whichever way the model came.
  src = model if given == "stacked" else dataclasses.replace(
      model, params=unstack_layers(model.params))
  cfg = dataclasses.replace(CFG, scan_layers=scan_layers)
  prepared = prepare_model(src, cfg, parallel.make_mesh(1) if mesh else None,
                           jnp.float32)
  layers = prepared.params["layers"]
  if scan_layers and given == "stacked":
    assert isinstance(layers, dict)
  else:
    assert isinstance(layers, tuple) and len(layers) == model.cfg.num_layers
  _check_fused(prepared, model)
  # No scales for 16- or 32-bit pages.
  assert all("k_scale" not in layer["attn"] for layer in
             _per_layer(prepared.params))


@pytest.mark.parametrize("kv_scales", ["per_tensor", "per_head"])
@pytest.mark.parametrize("scale", [None, 0.25])
def test_fp8_scales_are_layer_parameters(model, kv_scales, scale):
  cfg = dataclasses.replace(CFG, kv_cache_dtype="fp8", kv_scales=kv_scales,
                            k_scale=scale, v_scale=None if scale is None
                            else 2 * scale)
  prepared = prepare_model(model, cfg, None, jnp.float8_e4m3fn)
  layers = _per_layer(prepared.params)
  want = (1.0, 1.0) if scale is None else (scale, 2 * scale)
  for layer in layers:
    for name, value in zip(("k_scale", "v_scale"), want):
      got = np.asarray(layer["attn"][name])
      assert got.shape == ((model.cfg.num_kv_heads,)
                           if kv_scales == "per_head" else ())
      assert got.dtype == np.float32
      np.testing.assert_array_equal(got, np.full(got.shape, value))
  # 16-bit pages carry none.
  plain = prepare_model(model, CFG, None, jnp.bfloat16)
  assert all("k_scale" not in layer["attn"]
             for layer in _per_layer(plain.params))


def test_run_program_places_inputs_and_splits_checked_results():
  seen = []

  def program(*args):
    seen.append(args)
    return ("error", "result")

  inputs = {"tokens": np.arange(4, dtype=np.int32)}
  # Host inputs go to the executable as they are off a mesh ...
  assert run_program(program, (1, 2), inputs, check=False) == (
      ("error", "result"), None)
  assert seen[-1][:2] == (1, 2) and seen[-1][2] is inputs
  # ... and are placed with the mesh's replicated sharding on one.
  sharding = parallel.replicated(parallel.make_mesh(1))
  assert run_program(program, (1, 2), inputs, check=True,
                     inputs_sharding=sharding) == ("result", "error")
  placed = seen[-1][2]["tokens"]
  assert isinstance(placed, jax.Array) and placed.sharding == sharding
  np.testing.assert_array_equal(np.asarray(placed), inputs["tokens"])
