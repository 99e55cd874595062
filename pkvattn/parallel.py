"""Multi-device inference: tensor parallelism with `shard_map`, data parallelism with `pmap`.

**Tensor parallel (TP), one mesh axis (default "tp").** The Pallas kernels are
not sharding-aware, so (as tpu-inference does) the whole model forward runs
under ONE `shard_map` over the tp axis, each device holding

* its heads: q/k/v projections column-sliced by heads, `o_proj` row-sliced
  (one psum after it per layer), the KV pool sliced on its `num_kv_heads`
  axis (`[num_pages, page_size, num_kv_heads / tp, head_dim]` per device);
  attention, RoPE + append run per shard on the local heads with the group
  size unchanged;
* its MLP columns (Megatron): gate/up column-sliced, down row-sliced (one
  psum);
* its vocabulary columns of the LM head (`lm_head [hidden, vocab]`
  column-sliced; a tied head gets its own transposed copy of the
  embedding): each device reads `1 / tp` of the head per step and returns
  its logits columns, vocab-sharded. Greedy sampling takes the argmax per
  shard and gathers only `(max, index)` per row, in one all-gather
  (`greedy_tokens`); other
  sampling gathers the logits (`gather_logits`). A vocabulary that does not
  divide by tp keeps the head replicated;
* replicated: the embedding table (a step reads only its tokens' rows),
  norms, biases of `o_proj` / `down_proj` (added once after the psum), and
  the cache state / page tables / step inputs (the bookkeeping is identical
  on every device, so it runs replicated under `jit` outside the
  `shard_map`).

Communication per step: two all-reduces of `[num_tokens, hidden]` per layer
(after `o_proj` and `down_proj`) in the activation dtype (bf16 for a bf16
model) and, for greedy sampling, one all-gather of `[tp, 2, rows]` 32-bit
words (each shard's maxima and indices); nothing else. Other sampling
gathers the rows' logits instead (`[rows, vocab]` f32).

**Fused projections** (`fuse_projections`, the engine's layout): q/k/v and
gate/up kernels concatenated shard-major, so each device's column slice is
its own `[q_i | k_i | v_i]` / `[gate_i | up_i]` and runs one matmul (and the
in-place RoPE + append kernel) as on one device.

The row-parallel partial products are rounded to the activation dtype and
summed in it (`pkvattn.flax.row_parallel_dense`), as vLLM and TensorRT-LLM
all-reduce: an f32 model's tp=N differs from one device only by f32
summation order (greedy tokens match); a bf16 model's all-reduce moves half
the bytes of an f32 one, and its sum of bf16-rounded partials differs from
the one-device matmul by bf16 rounding.

**KV-head replication.** When `tp > num_kv_heads` and `tp % num_kv_heads ==
0`, each kv head is replicated `tp / num_kv_heads` times (the k/v projection
columns of head `k` are repeated, `shard_model` returns a config with
`num_kv_heads = tp`): device `i` holds q heads
`[i * num_qo_heads / tp, (i + 1) * num_qo_heads / tp)` and the one kv head they
read, `i // (tp / num_kv_heads)`. The pool then holds `tp / num_kv_heads`
copies of each kv head (per device: the size of one kv head's pool). Other
head counts raise `ValueError`.

**Data parallel.** `pmap_greedy_generate` is the `pmap` loop: one independent
group of requests (own pool, own page tables) per device. Serving replicas:
`replica_meshes` splits the devices into groups, one engine per group
(`Engine(model, config, mesh=m)`), each driven by its own thread
(`generate_on_replicas`) or process.

**Multi-process / multi-host.** Call `jax.distributed.initialize()` first in
every process (`pkvattn.distributed.initialize` reads the launch from the
environment); then `jax.devices()` lists every process's devices and the
same `make_mesh(tp)` / `Engine(..., mesh=mesh)` code runs SPMD in every
process, with the same requests (no other transport).

Example (2 devices; on a CPU set
`XLA_FLAGS=--xla_force_host_platform_device_count=2` before jax starts):
  >>> mesh = make_mesh(2)                                  # doctest: +SKIP
  >>> engine = Engine(load_model("tiny-llama"), EngineConfig(),
  ...                 mesh=mesh)                           # doctest: +SKIP
  >>> engine.pool.sharding.spec                            # doctest: +SKIP
  PartitionSpec(None, None, 'tp')
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pkvattn.flax import AttentionPlan
from pkvattn.flax import layer_page_tables
from pkvattn.models import Model
from pkvattn.models import decoder as _decoder
from pkvattn.types import Implementation

__all__ = [
    "TP_AXIS",
    "fuse_projections",
    "gather_logits",
    "generate_on_replicas",
    "greedy_tokens",
    "make_mesh",
    "param_specs",
    "pmap_greedy_generate",
    "pool_sharding",
    "pool_spec",
    "replica_meshes",
    "replicated",
    "shard_map",
    "shard_model",
    "shard_config",
    "tp_config",
    "tp_forward",
    "tp_size",
    "vocab_parallel",
]

TP_AXIS = "tp"


def shard_map(f, *, mesh: Mesh, in_specs, out_specs):
  """`jax.shard_map` (newer jax) or `jax.experimental.shard_map` (older).

  Replication checking is off: `pallas_call` inside the body carries no
  replication rule, and the outputs we declare replicated (logits) are
  replicated by construction (they follow a psum).
  """
  if hasattr(jax, "shard_map"):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
  from jax.experimental.shard_map import shard_map as _shard_map
  return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                    check_rep=False)


def make_mesh(tp: int, devices: Sequence[Any] | None = None,
              axis: str = TP_AXIS) -> Mesh:
  """A 1-D mesh of the first `tp` devices (all hosts' devices, multi-host).

  Raises:
    ValueError: `tp < 1` or more than the available devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  if not isinstance(tp, int) or tp < 1 or tp > len(devices):
    raise ValueError(
        f"Invalid tp: expected an int in [1, {len(devices)}] (the devices "
        f"available), got {tp!r}")
  return Mesh(np.asarray(devices[:tp]), (axis,))


def tp_size(mesh: Mesh, axis: str = TP_AXIS) -> int:
  """Devices on the tensor-parallel axis of `mesh`.

  Raises:
    ValueError: `mesh` has no axis named `axis`.
  """
  if axis not in mesh.shape:
    raise ValueError(
        f"Invalid mesh: expected an axis named {axis!r}, got axes "
        f"{tuple(mesh.axis_names)}")
  return int(mesh.shape[axis])


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def pool_spec(axis: str = TP_AXIS) -> P:
  """Pool `[num_pages, page_size, num_kv_heads, head_dim]`: kv heads sharded."""
  return P(None, None, axis, None)


def pool_sharding(mesh: Mesh, axis: str = TP_AXIS) -> NamedSharding:
  return NamedSharding(mesh, pool_spec(axis))


def tp_config(cfg: _decoder.DecoderConfig, tp: int) -> _decoder.DecoderConfig:
  """The global config for `tp` devices (kv heads replicated if `tp > num_kv_heads`).

  Raises:
    ValueError: `num_qo_heads % tp`, `intermediate_size % tp`, or
      `num_kv_heads % tp` (when `tp <= num_kv_heads`) / `tp % num_kv_heads`
      (when `tp > num_kv_heads`, replication) is not 0.
  """
  nq, nk = cfg.num_qo_heads, cfg.num_kv_heads
  if nq % tp:
    raise ValueError(f"{nq=} (num_qo_heads) must be divisible by {tp=}")
  if cfg.intermediate_size % tp:
    raise ValueError(
        f"intermediate_size={cfg.intermediate_size} must be divisible by {tp=}")
  if tp <= nk:
    if nk % tp:
      raise ValueError(
          f"num_kv_heads={nk} must be divisible by {tp=} (or tp a multiple of "
          f"num_kv_heads, which replicates each kv head tp / num_kv_heads "
          f"times)")
    return cfg
  if tp % nk:
    raise ValueError(
        f"{tp=} > num_kv_heads={nk}: kv-head replication needs tp to be a "
        f"multiple of num_kv_heads")
  return dataclasses.replace(cfg, num_kv_heads=tp)


def shard_config(cfg: _decoder.DecoderConfig, tp: int) -> _decoder.DecoderConfig:
  """The per-device config inside `shard_map` (from a `tp_config` result)."""
  return dataclasses.replace(
      cfg, num_qo_heads=cfg.num_qo_heads // tp,
      num_kv_heads=cfg.num_kv_heads // tp,
      intermediate_size=cfg.intermediate_size // tp)


def _replicate_kv_heads(params, cfg: _decoder.DecoderConfig, reps: int):
  """Repeats each kv head's k/v projection columns `reps` times (head-major);
  stacked or unstacked layers."""
  d, nk = cfg.head_dim, cfg.num_kv_heads

  def rep(a):  # [..., nk * d] -> [..., nk * reps * d]
    a = a.reshape(*a.shape[:-1], nk, 1, d)
    a = jnp.broadcast_to(a, (*a.shape[:-2], reps, d))
    return a.reshape(*a.shape[:-3], nk * reps * d)

  def layer(lp):
    attn = dict(lp["attn"])
    for name in ("k_proj", "v_proj"):
      attn[name] = jax.tree.map(rep, attn[name])
    return dict(lp, attn=attn)

  layers = params["layers"]
  if isinstance(layers, (tuple, list)):
    return dict(params, layers=tuple(map(layer, layers)))
  return dict(params, layers=layer(layers))


# Sliced parameters: column-parallel (last axis) and row-parallel (axis -2).
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj",
           "gate_up_proj")
_ROW = ("o_proj", "down_proj")


def vocab_parallel(cfg: _decoder.DecoderConfig, tp: int) -> bool:
  """Whether the LM head is split by vocabulary columns over `tp` devices
  (`cfg.vocab_size % tp == 0`; else it stays replicated)."""
  return cfg.vocab_size % tp == 0


def param_specs(params, axis: str = TP_AXIS, *, tp: int | None = None):
  """PartitionSpecs of a decoder parameter tree (layers stacked on axis 0,
  or unstacked: a tuple of per-layer trees).

  Column-parallel `kernel [L, in, out]` → `P(None, None, axis)`, its bias
  `[L, out]` → `P(None, axis)` (fused `qkv_proj` / `gate_up_proj` must be in
  `fuse_projections`' shard-major order); row-parallel `kernel [L, in, out]`
  → `P(None, axis, None)`, its bias replicated; `lm_head [hidden, vocab]` →
  `P(None, axis)` when `tp` is given and divides its vocab columns;
  everything else replicated.
  """
  def spec(path, leaf):
    names = [getattr(k, "key", None) for k in path]
    if len(names) >= 2 and names[-2] in _COLUMN:
      return P(*([None] * (leaf.ndim - 1)), axis)
    if len(names) >= 2 and names[-2] in _ROW and names[-1] == "kernel":
      return P(*([None] * (leaf.ndim - 2)), axis, None)
    if (names == ["lm_head"] and tp is not None and leaf.ndim == 2
        and leaf.shape[-1] % tp == 0):
      return P(None, axis)
    return P()

  return jax.tree_util.tree_map_with_path(spec, params)


def fuse_projections(params, tp: int):
  """q/k/v → `qkv_proj` and gate/up → `gate_up_proj`, shard-major.

  Each projection's columns are cut into `tp` blocks and the fused kernel
  holds, for shard `i`, `[q_i | k_i | v_i]` (`[gate_i | up_i]`), so its
  column slice `i` (`param_specs`) is exactly shard `i`'s fused projection:
  one matmul per shard, and the in-place RoPE + append of
  `pkvattn.flax.attention_block`. At `tp = 1` this is
  `pkvattn.models.fuse_projections`. Biases likewise; stacked or unstacked
  layers. Idempotent.

  Raises:
    ValueError: a projection's columns do not divide by `tp`.
  """
  def cat(parts):
    blocks = []
    for a in parts:
      if a.shape[-1] % tp:
        raise ValueError(
            f"Invalid projection: expected columns divisible by {tp=}, got "
            f"shape {a.shape}")
      blocks.append(a.reshape(*a.shape[:-1], tp, a.shape[-1] // tp))
    fused = jnp.concatenate(blocks, axis=-1)
    return fused.reshape(*fused.shape[:-2], -1)

  def fuse(layer):
    attn, mlp = dict(layer["attn"]), dict(layer["mlp"])
    for group, names, fused in ((attn, ("q_proj", "k_proj", "v_proj"),
                                 "qkv_proj"),
                                (mlp, ("gate_proj", "up_proj"),
                                 "gate_up_proj")):
      if names[0] in group:
        parts = [group.pop(n) for n in names]
        group[fused] = {k: cat([q[k] for q in parts]) for k in parts[0]}
    return dict(layer, attn=attn, mlp=mlp)

  layers = params["layers"]
  if isinstance(layers, (tuple, list)):
    return dict(params, layers=tuple(fuse(lp) for lp in layers))
  return dict(params, layers=fuse(layers))


def shard_model(model: Model, mesh: Mesh, axis: str = TP_AXIS, *,
                fuse: bool = False) -> Model:
  """Lays a model out for tensor parallelism over `mesh[axis]`.

  Returns a `Model` whose config is `tp_config(model.cfg, tp)` (kv heads
  replicated if needed) and whose parameters are placed with
  `param_specs(..., tp=tp)`. With a vocabulary that divides by tp, the LM
  head is vocab-sharded; a tied model gets `lm_head = embed.T` (its own
  sharded copy; `tie_word_embeddings=False` in the returned config). `fuse`:
  q/k/v and gate/up fused shard-major (`fuse_projections`), the layout the
  engine runs.

  Raises:
    ValueError: see `tp_config`; `mesh` lacks `axis`.
  """
  tp = tp_size(mesh, axis)
  cfg = tp_config(model.cfg, tp)
  reps = cfg.num_kv_heads // model.cfg.num_kv_heads
  tie = cfg.tie_word_embeddings and vocab_parallel(cfg, tp)
  params = model.params
  if reps > 1 or tie or fuse:
    params = _tp_layout(params, model.cfg, reps, tie, tp if fuse else None)
  if tie:
    cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s),
                           param_specs(params, axis, tp=tp))
  params = jax.device_put(params, shardings)
  return dataclasses.replace(model, cfg=cfg, params=params)


def _tp_layout(params, cfg: _decoder.DecoderConfig, reps: int, tie: bool,
               fuse_tp: int | None):
  """`params` with kv heads repeated `reps` times, `lm_head = embed.T` if
  `tie`, and q/k/v and gate/up fused for `fuse_tp` shards (None: not),
  computed in one program (`_tp_projections`), not in one per array shape
  as op by op. Only the q/k/v and gate/up projections and the embedding go
  through it: the other weights are not copied."""
  layers = params["layers"]
  stacked = not isinstance(layers, (tuple, list))
  sub = {"layers": (_projection_subtree(layers) if stacked
                    else tuple(map(_projection_subtree, layers)))}
  if tie:
    sub["embed"] = params["embed"]
  new = _tp_projections(sub, cfg, reps, tie, fuse_tp)
  layers = (_merge_layer(layers, new["layers"]) if stacked
            else tuple(map(_merge_layer, layers, new["layers"])))
  out = dict(params, layers=layers)
  if tie:
    out["lm_head"] = new["lm_head"]
  return out


def _projection_subtree(layer):
  """The column-parallel projections (`_COLUMN`: q/k/v and gate/up, fused
  or not) of one layer tree, stacked or not."""
  return {group: {n: p for n, p in layer[group].items() if n in _COLUMN}
          for group in ("attn", "mlp")}


def _merge_layer(layer, new):
  """`layer` with its column-parallel projections replaced by `new`'s."""
  out = dict(layer)
  for group, projections in new.items():
    out[group] = {**{n: p for n, p in layer[group].items()
                     if n not in _COLUMN}, **projections}
  return out


@functools.partial(jax.jit, static_argnames=("cfg", "reps", "tie", "fuse_tp"))
def _tp_projections(sub, cfg, reps, tie, fuse_tp):
  """`_tp_layout`'s program over the projections (and `embed`) in `sub`."""
  if reps > 1:
    sub = _replicate_kv_heads(sub, cfg, reps)
  if tie:
    sub = {"layers": sub["layers"], "lm_head": sub["embed"].T}
  if fuse_tp is not None:
    sub = fuse_projections(sub, fuse_tp)
  return sub


def _logits_spec(params, cfg: _decoder.DecoderConfig, tp: int,
                 axis: str) -> P:
  """Vocab-sharded logits where the head is (`param_specs`), else replicated."""
  if ("lm_head" in params and not cfg.tie_word_embeddings
      and params["lm_head"].shape[-1] % tp == 0):
    return P(None, axis)
  return P()


def tp_forward(
    params,
    cfg: _decoder.DecoderConfig,
    tokens: jax.Array,    # i32[num_tokens], replicated
    kv_cache: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim], kv heads sharded
    plan: AttentionPlan,  # replicated
    mesh: Mesh,
    *,
    logits_indices: jax.Array | None = None,  # i32[n], replicated
    impl: Implementation | None = None,
    axis: str = TP_AXIS,
):
  """`pkvattn.models.forward` under one `shard_map` over `mesh[axis]`.

  Args:
    params, cfg: from `shard_model` (cfg = the global `tp_config`).
    tokens, kv_cache, plan, logits_indices, impl: as in `forward`; the pool
      may be laid out anyhow (`shard_map` reshards it to `pool_spec(axis)`),
      but laid out so already, nothing moves. FP8 pages as float8_e4m3fn or
      as their `uint8` bytes, as `forward` takes them (each shard's forward
      converts as `forward` does; returned in the dtype given): hold them
      as bytes on the XLA path, where a float8_e4m3fn pool is converted to
      bytes and back around each step's in-place update.

  Returns:
    `(logits f32[n or num_tokens, vocab_size], kv_cache sharded with
    pool_spec(axis))`. The logits are sharded on the vocabulary where the
    LM head is (`shard_model`: each device computed its columns; read them
    as any array, or sample with `greedy_tokens` / `gather_logits`), else
    replicated.

  Raises:
    ValueError: `cfg` does not split over the axis (see `tp_config`), or
      `kv_cache` does not have `cfg.num_kv_heads` heads.
  """
  tp = tp_size(mesh, axis)
  if tp_config(cfg, tp) != cfg:
    raise ValueError(
        f"Invalid cfg: expected num_kv_heads >= tp={tp} (use "
        f"pkvattn.parallel.shard_model), got num_kv_heads={cfg.num_kv_heads}")
  if kv_cache.ndim != 4 or kv_cache.shape[2] != cfg.num_kv_heads:
    raise ValueError(
        f"Invalid shape of kv_cache: expected (num_pages, page_size, "
        f"{cfg.num_kv_heads}, {cfg.head_dim}), got {kv_cache.shape}")
  local = shard_config(cfg, tp)
  # The kernel plan depends on the per-shard head counts: planned inside.
  plan = plan.replace(kernel_plan=None)

  def body(params, tokens, kv_cache, plan, logits_indices):
    return _decoder.forward(params, local, tokens, kv_cache, plan,
                            logits_indices=logits_indices, impl=impl,
                            tp_axis=axis)

  fn = shard_map(body, mesh=mesh,
                 in_specs=(param_specs(params, axis, tp=tp), P(),
                           pool_spec(axis), P(), P()),
                 out_specs=(_logits_spec(params, cfg, tp, axis),
                            pool_spec(axis)))
  return fn(params, tokens, kv_cache, plan, logits_indices)


def greedy_tokens(logits: jax.Array, mesh: Mesh,
                  axis: str = TP_AXIS) -> jax.Array:
  """`argmax(logits, -1)` as i32[n] (replicated), without gathering logits.

  Each device takes the max and first argmax of its vocabulary columns
  (`logits` f32[n, vocab], vocab-sharded as `tp_forward` returns it; a
  replicated one is sliced locally), then one all-gather of the maxima
  (their f32 bits) and indices packed as i32[2, n] (one collective per
  step, not two: its fixed latency counts once) picks the largest, the
  lowest shard on a tie: the lowest index, as `jnp.argmax` picks.

  Raises:
    ValueError: `logits` is not 2-D or its vocab does not divide by tp.
  """
  tp = tp_size(mesh, axis)
  if logits.ndim != 2 or logits.shape[1] % tp:
    raise ValueError(
        f"Invalid shape of logits: expected (n, vocab) with vocab divisible "
        f"by tp={tp}, got {logits.shape}")
  cols = logits.shape[1] // tp

  def body(local):
    best = jnp.max(local, axis=-1).astype(jnp.float32)  # exact from bf16
    index = (jnp.argmax(local, axis=-1).astype(jnp.int32)
             + jax.lax.axis_index(axis).astype(jnp.int32) * cols)
    # The bit pattern travels (an all-gather only moves words), so the
    # maxima come back exactly, NaN included.
    packed = jnp.stack([jax.lax.bitcast_convert_type(best, jnp.int32),
                        index])                           # [2, n]
    packed = jax.lax.all_gather(packed, axis)             # [tp, 2, n]
    best = jax.lax.bitcast_convert_type(packed[:, 0], jnp.float32)
    index = packed[:, 1]
    shard = jnp.argmax(best, axis=0)         # first max: lowest index
    return jnp.take_along_axis(index, shard[None], axis=0)[0]

  return shard_map(body, mesh=mesh, in_specs=(P(None, axis),),
                   out_specs=P())(logits)


def gather_logits(logits: jax.Array, mesh: Mesh) -> jax.Array:
  """`logits` replicated on `mesh` (an all-gather if vocab-sharded), for
  samplers that need every column (top-k / top-p sort)."""
  return jax.lax.with_sharding_constraint(logits, replicated(mesh))


def replica_meshes(num_replicas: int, tp: int = 1,
                   devices: Sequence[Any] | None = None,
                   axis: str = TP_AXIS) -> list[Mesh]:
  """Disjoint `tp`-device meshes for `num_replicas` data-parallel engines.

  Replica `r` gets devices `[r * tp, (r + 1) * tp)` of `devices` (default
  `jax.local_devices()`: replicas of one process; run one process per
  replica to keep their host work apart). Each engine
  (`Engine(model, config, mesh=meshes[r])`) holds its own weights, pool and
  queue.

  Raises:
    ValueError: fewer than `num_replicas * tp` devices, or a count < 1.
  """
  devices = list(jax.local_devices() if devices is None else devices)
  if (not isinstance(num_replicas, int) or not isinstance(tp, int)
      or num_replicas < 1 or tp < 1 or num_replicas * tp > len(devices)):
    raise ValueError(
        f"Invalid num_replicas * tp: expected ints >= 1 with a product <= "
        f"{len(devices)} (the devices), got {num_replicas=}, {tp=}")
  return [make_mesh(tp, devices[r * tp:(r + 1) * tp], axis)
          for r in range(num_replicas)]


def generate_on_replicas(engines, prompts, params) -> list[list[int]]:
  """Runs `prompts` over data-parallel `engines`, one thread each.

  Prompt `i` goes to engine `i % len(engines)`; each engine runs its share
  with `engine.generate` in its own thread (the device work of the engines
  overlaps; the threads share the host's interpreter for their scheduling).
  Returns the generated ids per prompt, in order. `params`: one
  `SamplingParams` for all, or one per prompt.

  Raises:
    ValueError: no engines, or `params` is a sequence whose length differs
      from `prompts`'.
    Exception: the first engine's error, re-raised after every thread ended.
  """
  import concurrent.futures  # pylint: disable=import-outside-toplevel
  engines = list(engines)
  prompts = list(prompts)
  if not engines:
    raise ValueError("Invalid engines: expected at least one, got none")
  if isinstance(params, (list, tuple)):
    if len(params) != len(prompts):
      raise ValueError(
          f"Invalid params: expected {len(prompts)} (one per prompt), got "
          f"{len(params)}")
    per = [list(params[r::len(engines)]) for r in range(len(engines))]
  else:
    per = [params] * len(engines)
  with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
    futures = [pool.submit(e.generate, prompts[r::len(engines)], per[r])
               for r, e in enumerate(engines)]
    shares = [f.result() for f in futures]
  out = [None] * len(prompts)
  for r, share in enumerate(shares):
    out[r::len(engines)] = share
  return out


# --------------------------------------------------------------- data parallel
def _greedy_prefill(params, pool, prompts, *, cfg, tables, impl):
  b, n = prompts.shape
  q_indptr = jnp.arange(b + 1, dtype=jnp.int32) * n
  plan = AttentionPlan.create(tables, q_indptr, jnp.full((b,), n, jnp.int32),
                              b * n)
  logits, pool = _decoder.forward(params, cfg, prompts.reshape(-1), pool, plan,
                                  logits_indices=q_indptr[1:] - 1, impl=impl)
  return jnp.argmax(logits, -1).astype(jnp.int32), pool


def _greedy_decode(params, pool, tokens, kv_lens, *, cfg, tables, impl):
  b = tokens.shape[0]
  plan = AttentionPlan.create(tables, jnp.arange(b + 1, dtype=jnp.int32),
                              kv_lens, b)
  logits, pool = _decoder.forward(params, cfg, tokens, pool, plan, impl=impl)
  return jnp.argmax(logits, -1).astype(jnp.int32), pool


def pmap_greedy_generate(
    params,
    cfg: _decoder.DecoderConfig,
    prompts,              # i32[num_devices, batch_size, prompt_len]
    max_new_tokens: int,
    *,
    page_size: int = 16,
    impl: Implementation | None = None,
    devices: Sequence[Any] | None = None,
) -> np.ndarray:          # i32[num_devices, batch_size, max_new_tokens]
  """Data parallel greedy generation: a Python loop of `pmap`-ed steps.

  Each device runs an independent group of `batch_size` requests (equal
  prompt lengths) with its own pool and static page tables (sequence `b` owns
  slots `[b * max_pages, (b + 1) * max_pages)`): one prefill step, then
  `max_new_tokens - 1` decode steps, the pool donated at every step. EOS is
  not checked.

  Args:
    params: one device's (unsharded) parameters; copied to every device.
    cfg: model config.
    prompts: `i32[num_devices, batch_size, prompt_len]`, `num_devices <=
      len(devices)`.
    max_new_tokens: tokens to generate per request, >= 1.
    page_size: tokens per page.
    impl: attention implementation.
    devices: default `jax.local_devices()`.

  Returns:
    `i32[num_devices, batch_size, max_new_tokens]` greedy tokens.

  Raises:
    ValueError: `prompts` not 3-D, more groups than devices, or
      `max_new_tokens < 1`.
  """
  prompts = np.asarray(prompts, np.int32)
  devices = list(jax.local_devices() if devices is None else devices)
  if prompts.ndim != 3 or not 1 <= prompts.shape[0] <= len(devices):
    raise ValueError(
        f"Invalid shape of prompts: expected (num_devices <= {len(devices)}, "
        f"batch_size, prompt_len), got {prompts.shape}")
  if max_new_tokens < 1:
    raise ValueError(f"Invalid max_new_tokens: expected >= 1, got {max_new_tokens}")
  ndev, b, n = prompts.shape
  devices = devices[:ndev]
  max_pages = -(-(n + max_new_tokens) // page_size)
  slot_table = np.arange(b * max_pages, dtype=np.int32).reshape(b, max_pages)
  tables = layer_page_tables(jnp.asarray(slot_table), cfg.num_layers)
  dtype = jax.tree.leaves(params)[0].dtype
  pool = np.zeros((ndev, *cfg.pool_shape(b * max_pages, page_size)), dtype)
  kw = dict(cfg=cfg, tables=tables, impl=impl)
  prefill = jax.pmap(functools.partial(_greedy_prefill, **kw),
                     in_axes=(None, 0, 0), donate_argnums=1, devices=devices)
  decode = jax.pmap(functools.partial(_greedy_decode, **kw),
                    in_axes=(None, 0, 0, None), donate_argnums=1,
                    devices=devices)
  token, pool = prefill(params, pool, prompts)
  out = [token]
  for i in range(1, max_new_tokens):
    kv_lens = jnp.full((b,), n + i, jnp.int32)  # incl. the token fed now
    token, pool = decode(params, pool, token, kv_lens)
    out.append(token)
  return np.stack([np.asarray(t) for t in out], axis=-1)
