"""Model shapes the engine benchmarks run with random weights.

Speed does not depend on weight values, so the engine, serving, tp and
trace benchmarks build `pkvattn.models.DecoderConfig`s of real models'
shapes and initialise random bf16 weights (`pkvattn.models.init_params`).
"""

from __future__ import annotations

import dataclasses

from pkvattn import Llama3RopeScaling, RopeConfig
from pkvattn.models import DecoderConfig

# Llama 3.2 1B: 16 layers, hidden 2048, 32 / 8 heads of 64, vocab 128256,
# Llama 3 RoPE scaling.
LLAMA_3_2_1B = DecoderConfig(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
    num_qo_heads=32, num_kv_heads=8, head_dim=64,
    rope=RopeConfig(theta=500000.0, scaling=Llama3RopeScaling(
        factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)),
    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000,
    eos_token_ids=(128001,), max_position_embeddings=131072,
    model_type="llama")

# SmolLM2-135M-Instruct: 30 layers, hidden 576, 9 / 3 heads of 64, vocab
# 49152 (Llama architecture).
SMOLLM2_135M = DecoderConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_qo_heads=9, num_kv_heads=3, head_dim=64,
    rope=RopeConfig(theta=100000.0), rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    max_position_embeddings=8192, model_type="llama")

# A tiny Llama for CPU runs (`--small`).
SMALL = dataclasses.replace(
    LLAMA_3_2_1B, vocab_size=512, hidden_size=128, intermediate_size=256,
    num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=64)

# Llama 3 8B: 32 layers, hidden 4096, 32 / 8 heads of 128, MLP 14336, vocab
# 128256, untied LM head, RoPE theta 500000 without scaling.
LLAMA_3_8B = DecoderConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_qo_heads=32, num_kv_heads=8, head_dim=128,
    rope=RopeConfig(theta=500000.0), rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=128000,
    eos_token_ids=(128001, 128009), max_position_embeddings=8192,
    model_type="llama")

# `--model` names of the shapes above.
SHAPES = {"llama3.2-1b": LLAMA_3_2_1B, "llama3-8b": LLAMA_3_8B}


def init_params_on_devices(cfg: DecoderConfig, key, dtype, mesh=None, *,
                           scale: float = 0.02):
  """Random parameters in `pkvattn.models.init_params`' tree, created where
  they live: layers unstacked (`unstack_layers`, the engine's layout), each
  leaf drawn by a small jitted call directly in its sharding
  (`pkvattn.parallel.param_specs` on `mesh`, else the default device); the
  norms at their identity value.

  With partitionable threefry (jax's default), each device draws only its
  own shard, so an 8B model never passes through host memory or one
  device. One program per distinct (shape, sharding), reused across the
  layers: a single program producing every leaf compiles for minutes at
  8B. Layout transforms the engine applies later (`shard_model`: fused
  projections, a tied head's copy) run on these arrays where they are.
  """
  import functools  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from pkvattn import parallel  # pylint: disable=import-outside-toplevel
  from pkvattn.models import init_params, unstack_layers  # pylint: disable=import-outside-toplevel

  shapes = jax.eval_shape(
      lambda k: unstack_layers(init_params(cfg, k, dtype, scale=scale)), key)
  if mesh is None:
    device = jax.sharding.make_single_device_sharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, shapes)
  else:
    tp = parallel.tp_size(mesh)
    shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s),
                             parallel.param_specs(shapes, tp=tp))
  norm_value = 0.0 if cfg.norm_plus_one else 1.0

  @functools.lru_cache(maxsize=None)
  def program(shape, sharding, norm):
    def draw(k):
      if norm:
        return jnp.full(shape, norm_value, dtype)
      return (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
    return jax.jit(draw, out_shardings=sharding)

  paths = jax.tree_util.tree_flatten_with_path(shapes)[0]
  keys = jax.random.split(key, len(paths))
  flat_shardings = jax.tree.leaves(shardings)
  leaves = []
  for (path, leaf), k, sharding in zip(paths, keys, flat_shardings):
    name = str(getattr(path[-1], "key", ""))
    leaves.append(program(leaf.shape, sharding, name.endswith("norm"))(k))
  return jax.tree.unflatten(jax.tree.structure(shapes), leaves)
