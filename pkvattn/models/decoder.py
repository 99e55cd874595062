"""A Llama-family decoder over the multi-layer paged pool.

One config covers Llama 2/3 (Llama 3 RoPE scaling), Mistral (sliding window),
Qwen2 (qkv bias), Gemma 2 (alternating local/global layers, attention and
final logit soft caps, sandwich norms, `(1 + w)` RMSNorm, embeddings scaled by
`sqrt(hidden_size)`, `query_pre_attn_scalar`, tanh-GeGLU) and Gemma 3 (Gemma
2's layer plus QK-norm, 5 sliding layers per global one, a separate RoPE base
for the sliding layers, no soft caps).

Layers run under `lax.scan` over stacked parameters (`params["layers"]`, each
leaf with a leading `num_layers` axis). All layers share ONE pool
`[num_slots * num_layers * 2, page_size, num_kv_heads, head_dim]`; layer `l`
only gets its own page table (`plan.page_table[l]`, indices already offset by
the layer, TensorRT-LLM's PER_LAYER mode), so no layer's cache is ever sliced
out and copied. Models whose layers differ in window (Gemma 2) scan over the
repeating period of layers (2 for Gemma 2), unrolled inside the scan body, so
every attention call keeps a static `window_left`.

Unstacked layers (`unstack_layers`, MaxText's `scan_layers=False`): the same
forward over a tuple of per-layer parameter trees, as a Python loop. On a GPU
the scanned form pays for it: each iteration's dynamic slice of a stacked
weight that feeds a cuBLAS matmul is materialised first (a device copy of
every weight, every step), which at decode batch sizes costs about as much as
reading the weights. Unstacked weights are read in place; the loop compiles
`num_layers` copies of the layer (longer compile).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pkvattn import _checks
from pkvattn import _kv
from pkvattn import attention as _attention
from pkvattn.flax import AttentionPlan
from pkvattn.flax import AttentionSpec
from pkvattn.flax import attention_block
from pkvattn.flax import row_parallel_dense
from pkvattn.types import Implementation


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Static architecture of a decoder (hashable; a jit static argument)."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_qo_heads: int
  num_kv_heads: int
  head_dim: int
  rope: Any                                 # pkvattn.RopeConfig
  rms_norm_eps: float = 1e-6
  norm_plus_one: bool = False               # Gemma: x * (1 + w)
  qkv_bias: bool = False                    # Qwen2; Llama attention_bias
  o_bias: bool = False                      # Llama attention_bias
  mlp_bias: bool = False
  activation: str = "silu"                  # "silu" | "gelu_tanh"
  tie_word_embeddings: bool = False
  embed_scale: float | None = None          # Gemma: sqrt(hidden_size)
  sm_scale: float | None = None             # None = 1 / sqrt(head_dim)
  layer_windows: tuple[int, ...] = ()       # window_left per layer; () = all -1
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  sandwich_norms: bool = False              # Gemma 2 post-attn / pre+post-mlp norms
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  max_position_embeddings: int = 8192
  model_type: str = "llama"
  qk_norm: bool = False                     # Gemma 3: RMSNorm on q, k heads
  rope_local: Any = None                    # Gemma 3: RoPE of sliding layers

  def __post_init__(self):
    _checks.check_heads(self.num_qo_heads, self.num_kv_heads)
    _checks.check_choice(self.activation, ("silu", "gelu_tanh"), "activation")
    if self.layer_windows and len(self.layer_windows) != self.num_layers:
      raise ValueError(
          f"Invalid layer_windows: expected {self.num_layers} entries, got "
          f"{len(self.layer_windows)}")

  @property
  def windows(self) -> tuple[int, ...]:
    """`window_left` of every layer (-1 = full attention)."""
    return self.layer_windows or (-1,) * self.num_layers

  @property
  def has_sliding_window(self) -> bool:
    return any(w >= 0 for w in self.windows)

  @property
  def layer_period(self) -> int:
    """Smallest p dividing num_layers with windows[i] == windows[i % p]."""
    w = self.windows
    for p in range(1, self.num_layers + 1):
      if self.num_layers % p == 0 and all(w[i] == w[i % p] for i in range(len(w))):
        return p
    return self.num_layers

  def attention_spec(self, layer: int) -> AttentionSpec:
    rope = self.rope
    if self.rope_local is not None and self.windows[layer] >= 0:
      rope = self.rope_local
    return AttentionSpec(
        self.num_qo_heads, self.num_kv_heads, self.head_dim, rope=rope,
        qk_norm_eps=self.rms_norm_eps if self.qk_norm else None,
        sm_scale=self.sm_scale, window_left=self.windows[layer],
        logits_soft_cap=self.attn_logit_softcap, use_qkv_bias=self.qkv_bias,
        use_o_bias=self.o_bias)

  def pool_shape(self, num_slots: int, page_size: int) -> tuple[int, ...]:
    """Shape of the multi-layer pool for `num_slots` slots."""
    return (num_slots * self.num_layers * 2, page_size, self.num_kv_heads,
            self.head_dim)


def init_params(cfg: DecoderConfig, key: jax.Array, dtype=jnp.float32,
                scale: float = 0.02):
  """Random parameters (normal * `scale`; norms at their identity value).

  Returns the parameter tree used by `forward`: `embed [vocab, hidden]`,
  `layers` (each leaf with a leading `num_layers` axis), `final_norm [hidden]`
  and, unless tied, `lm_head [hidden, vocab]`.
  """
  L, H, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
  qd, kd = cfg.num_qo_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  keys = iter(jax.random.split(key, 32))

  def normal(*shape):
    return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

  def dense(fan_in, fan_out, bias):
    p = {"kernel": normal(L, fan_in, fan_out)}
    if bias:
      p["bias"] = normal(L, fan_out)
    return p

  norm_init = 0.0 if cfg.norm_plus_one else 1.0
  norm = lambda *s: jnp.full(s, norm_init, dtype)
  layers = {
      "attn": {"q_proj": dense(H, qd, cfg.qkv_bias),
               "k_proj": dense(H, kd, cfg.qkv_bias),
               "v_proj": dense(H, kd, cfg.qkv_bias),
               "o_proj": dense(qd, H, cfg.o_bias)},
      "mlp": {"gate_proj": dense(H, I, cfg.mlp_bias),
              "up_proj": dense(H, I, cfg.mlp_bias),
              "down_proj": dense(I, H, cfg.mlp_bias)},
      "attn_norm": norm(L, H),
      "mlp_norm": norm(L, H),
  }
  if cfg.qk_norm:
    layers["attn"]["q_norm"] = norm(L, cfg.head_dim)
    layers["attn"]["k_norm"] = norm(L, cfg.head_dim)
  if cfg.sandwich_norms:
    layers["post_attn_norm"] = norm(L, H)
    layers["post_mlp_norm"] = norm(L, H)
  params = {"embed": normal(cfg.vocab_size, H), "layers": layers,
            "final_norm": norm(H)}
  if not cfg.tie_word_embeddings:
    params["lm_head"] = normal(H, cfg.vocab_size)
  return params


def unstack_layers(params):
  """`params` with `layers` as a tuple of per-layer trees (no leading axis).

  The forward then runs its layers as an unrolled Python loop with every
  weight its own buffer (module docstring). Idempotent; `stack_layers`
  inverts it.
  """
  layers = params["layers"]
  if isinstance(layers, (tuple, list)):
    return params
  num_layers = jax.tree.leaves(layers)[0].shape[0]
  per_layer = tuple(jax.tree.map(lambda a, i=i: a[i], layers)
                    for i in range(num_layers))
  return dict(params, layers=per_layer)


def fuse_projections(params):
  """`params` with q/k/v and gate/up kernels (and biases) concatenated.

  `attn.qkv_proj` is `[hidden, (num_qo_heads + 2 * num_kv_heads) * head_dim]`
  (q, k, v columns in that order) and `mlp.gate_up_proj` is
  `[hidden, 2 * intermediate]` (gate, up): one matmul each instead of three
  and two (vLLM's `QKVParallelLinear` / `MergedColumnParallelLinear`), which
  at decode batch sizes saves a kernel launch and a pass over `x` per fused
  matmul. The forward accepts either layout; stacked (leading layer axis) and
  unstacked layers alike. Idempotent. Not for tensor-parallel shards (their
  column slices are per projection).
  """
  layers = params["layers"]
  if isinstance(layers, (tuple, list)):
    return dict(params, layers=tuple(fuse_layer_projections(lp)
                                     for lp in layers))
  return dict(params, layers=fuse_layer_projections(layers))


def fuse_layer_projections(layer):
  """One layer's tree (stacked or not) with q/k/v and gate/up fused, as
  `fuse_projections` lays out every layer. Idempotent."""
  attn, mlp = dict(layer["attn"]), dict(layer["mlp"])
  if "q_proj" in attn:
    parts = [attn.pop(n) for n in ("q_proj", "k_proj", "v_proj")]
    attn["qkv_proj"] = {k: jnp.concatenate([q[k] for q in parts], axis=-1)
                        for k in parts[0]}
  if "gate_proj" in mlp:
    parts = [mlp.pop(n) for n in ("gate_proj", "up_proj")]
    mlp["gate_up_proj"] = {k: jnp.concatenate([q[k] for q in parts], axis=-1)
                           for k in parts[0]}
  return dict(layer, attn=attn, mlp=mlp)


def stack_layers(params):
  """Inverse of `unstack_layers` (leading `num_layers` axis on every leaf)."""
  layers = params["layers"]
  if not isinstance(layers, (tuple, list)):
    return params
  return dict(params, layers=jax.tree.map(lambda *a: jnp.stack(a), *layers))


def rms_norm(x, w, eps: float, plus_one: bool):
  """HF RMSNorm: statistics in f32; Llama casts before `* w`, Gemma after `(1 + w)`."""
  xf = x.astype(jnp.float32)
  xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  if plus_one:
    return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
  return w * xf.astype(x.dtype)


def _dense(p, x):
  y = jnp.dot(x, p["kernel"].astype(x.dtype))
  if "bias" in p:
    y = y + p["bias"].astype(x.dtype)
  return y


def _mlp(p, x, activation, tp_axis: str | None = None):
  act = jax.nn.silu if activation == "silu" else (
      lambda a: jax.nn.gelu(a, approximate=True))
  if "gate_up_proj" in p:  # fused (`fuse_projections`): one matmul
    gate, up = jnp.split(_dense(p["gate_up_proj"], x), 2, axis=-1)
  else:
    gate, up = _dense(p["gate_proj"], x), _dense(p["up_proj"], x)
  h = act(gate) * up
  if tp_axis is None:
    return _dense(p["down_proj"], h)
  # Megatron: gate/up are column shards, down a row shard, one psum.
  return row_parallel_dense(p["down_proj"], h, tp_axis, x.dtype)


def decoder_layer(lp, x, kv_cache, plan: AttentionPlan, cfg: DecoderConfig,
                  layer: int, impl: Implementation | None,
                  tp_axis: str | None = None):
  """One pre-norm block. `layer` is static (it picks the window).

  With `tp_axis` (inside `shard_map`), `cfg`, `lp` and `kv_cache` are this
  shard's heads / MLP columns and the block runs two psums (o_proj, down_proj).
  """
  norm = lambda h, w: rms_norm(h, w, cfg.rms_norm_eps, cfg.norm_plus_one)
  h = norm(x, lp["attn_norm"])
  a, kv_cache = attention_block(lp["attn"], h, kv_cache, plan,
                                cfg.attention_spec(layer), impl=impl,
                                reduce_axis=tp_axis)
  if cfg.sandwich_norms:
    a = norm(a, lp["post_attn_norm"])
  x = x + a
  m = _mlp(lp["mlp"], norm(x, lp["mlp_norm"]), cfg.activation, tp_axis)
  if cfg.sandwich_norms:
    m = norm(m, lp["post_mlp_norm"])
  return x + m, kv_cache


# `decoder_layer` as one jitted function per (cfg, window position, impl): a
# nested jit is traced once per argument shapes and lowered once per
# enclosing program however often it is called.
_traced_layer = jax.jit(decoder_layer,
                        static_argnames=("cfg", "layer", "impl", "tp_axis"))


def forward(
    params,
    cfg: DecoderConfig,
    tokens: jax.Array,    # i32[num_tokens]
    kv_cache: jax.Array,  # [num_slots * num_layers * 2, page_size, num_kv_heads, head_dim]
    plan: AttentionPlan,  # page_table i32[num_layers, batch_size, 2, max_pages]
    *,
    logits_indices: jax.Array | None = None,  # i32[n]
    impl: Implementation | None = None,
    tp_axis: str | None = None,
    unroll: int | bool = 1,
):
  """Runs the decoder on one ragged token batch, appending its K/V to the pool.

  Args:
    params: tree from `init_params` / `load_hf_checkpoint` (its dtype is the
      compute dtype; the pool must have the same dtype), layers stacked
      (scanned) or unstacked by `unstack_layers` (a Python loop).
    cfg: static architecture.
    tokens: `i32[num_tokens]` token ids; padding tokens (plan batch index -1)
      may hold any id.
    kv_cache: the multi-layer pool; FP8 pages as float8_e4m3fn or as their
      `uint8` bytes (`pkvattn._kv.as_bytes`, returned as bytes too). Hold
      an FP8 pool as bytes where the step runs on the XLA path: XLA's CPU
      backend has no FP8 scatter, and with a float8_e4m3fn argument the
      step converts the whole pool to bytes and back to update it in place
      (a pass over every page per step); a `uint8` argument is updated in
      place with no such pass.
    plan: the step plan with one split page table per layer.
    logits_indices: token rows whose logits to return (e.g. each sequence's
      last new token, `q_indptr[1:] - 1`); None = all tokens.
    impl: attention implementation.
    tp_axis: static; set only inside `shard_map` (the per-shard body: `cfg` /
      `params` / `kv_cache` are one shard, psum over this axis). The forward
      over a whole tensor-parallel mesh is `pkvattn.parallel.tp_forward`,
      which calls this one per shard (models never import the parallel
      layer).
    unroll: static; `lax.scan`'s `unroll` for stacked layers (counted in
      periods of `cfg.layer_period` layers).

  Returns:
    `(logits f32[n or num_tokens, vocab_size], kv_cache)`.

  Raises:
    ValueError: `plan.page_table` is not `[num_layers, batch_size, 2, max_pages]`,
      or other shape mismatches (trace time).
  """
  L = cfg.num_layers
  _checks.check_shape(plan.page_table, (L, plan.batch_size, 2, None),
                      "plan.page_table")
  as_bytes = kv_cache.dtype == jnp.uint8  # FP8 pages held as their bytes
  if as_bytes:
    kv_cache = _kv.from_bytes(kv_cache)
  logits, kv_cache = _forward(params, cfg, tokens, kv_cache, plan,
                              logits_indices, impl, tp_axis, unroll)
  return logits, _kv.as_bytes(kv_cache) if as_bytes else kv_cache


def _forward(params, cfg: DecoderConfig, tokens, kv_cache, plan: AttentionPlan,
             logits_indices, impl, tp_axis, unroll):
  """`forward` on a pool of a float dtype (FP8 pages as float8_e4m3fn)."""
  L, p = cfg.num_layers, cfg.layer_period
  _checks.check_shape(tokens, (plan.num_tokens,), "tokens")
  dtype = params["embed"].dtype
  if plan.kernel_plan is None and _uses_pallas(impl):
    # Plan once per step, run per layer (FlashInfer's plan/run split). One
    # window serves local and global layers alike: it only orders the tiles,
    # whose sizes do not depend on it over 16-bit pages.
    plan = plan.replace(kernel_plan=_attention.plan_prefill(
        plan.q_indptr, plan.kv_lens, num_tokens=plan.num_tokens,
        num_qo_heads=cfg.num_qo_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=params["embed"].dtype,
        kv_dtype=kv_cache.dtype, causal=True,
        window_left=max(cfg.windows)))
  x = jnp.take(params["embed"], tokens, axis=0)
  if cfg.embed_scale is not None:
    # HF Gemma multiplies by the normalizer cast to the activation dtype.
    x = x * jnp.asarray(cfg.embed_scale, dtype)

  if isinstance(params["layers"], (tuple, list)):
    if len(params["layers"]) != L:
      raise ValueError(
          f"Invalid params['layers']: expected {L} per-layer trees, got "
          f"{len(params['layers'])}")
    # Each layer's table is a dynamic slice at an index XLA cannot fold (it
    # passes an optimization barrier): a static slice would give every layer
    # a table copy of its own offset, L distinct kernels to compile; these
    # are L launches of one kernel.
    layer_ids = lax.optimization_barrier(
        tuple(jnp.int32(layer) for layer in range(L)))
    for layer, lp in enumerate(params["layers"]):
      # Layers with the same window are one traced function: traced and
      # lowered once per program, called L times (XLA inlines the calls, so
      # the compiled program is the unrolled loop with every weight read in
      # place). Tracing and lowering each layer anew made compile time grow
      # with the depth (Pallas kernels lower in Python).
      table = lax.dynamic_index_in_dim(plan.page_table, layer_ids[layer],
                                       keepdims=False)
      x, kv_cache = _traced_layer(
          lp, x, kv_cache, plan.replace(page_table=table),
          cfg=cfg, layer=layer % p, impl=impl, tp_axis=tp_axis)
    return _head(params, cfg, x, logits_indices), kv_cache

  grouped = jax.tree.map(lambda a: a.reshape(L // p, p, *a.shape[1:]),
                         params["layers"])
  tables = plan.page_table.reshape(L // p, p, *plan.page_table.shape[1:])

  # An FP8 pool is carried through the scan as bytes: each layer's update is
  # a byte scatter (`pkvattn.rope`), and a float8_e4m3fn carry would put a
  # whole-pool conversion on both sides of it in every iteration.
  fp8 = _kv.is_fp8(kv_cache)

  def body(carry, xs):
    h, pool = carry
    lp, tbl = xs
    if fp8:
      pool = _kv.from_bytes(pool)
    for j in range(p):
      h, pool = decoder_layer(jax.tree.map(lambda a: a[j], lp), h, pool,
                              plan.replace(page_table=tbl[j]), cfg, j, impl,
                              tp_axis)
    return (h, _kv.as_bytes(pool) if fp8 else pool), None

  carry = (x, _kv.as_bytes(kv_cache) if fp8 else kv_cache)
  (x, kv_cache), _ = lax.scan(body, carry, (grouped, tables), unroll=unroll)
  if fp8:
    kv_cache = _kv.from_bytes(kv_cache)
  return _head(params, cfg, x, logits_indices), kv_cache


def _head(params, cfg: DecoderConfig, x, logits_indices):
  """Final norm and LM head (f32 logits, final soft cap)."""
  if logits_indices is not None:
    x = jnp.take(x, logits_indices, axis=0)
  x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_plus_one)
  head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  logits = jnp.dot(x, head.astype(x.dtype),
                   preferred_element_type=jnp.float32)
  if cfg.final_logit_softcap:
    c = cfg.final_logit_softcap
    logits = c * jnp.tanh(logits / c)
  return logits


def _uses_pallas(impl) -> bool:
  return _checks.resolve_impl(impl) == "pallas"


def param_count(params) -> int:
  return int(sum(np.prod(a.shape) for a in jax.tree.leaves(params)))


def gemma_embed_scale(hidden_size: int) -> float:
  return math.sqrt(hidden_size)
