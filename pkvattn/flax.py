"""Flax building blocks: a paged attention layer for nnx and linen, and a bare hook.

Everything here runs one *step* of a ragged token batch (vLLM / FlashInfer style):
`num_tokens` new tokens from `batch_size` sequences, flattened into one axis, with
an `AttentionPlan` that says which sequence each token belongs to, at which
position, and where its sequence's pages are. The layer

1. projects `x [num_tokens, hidden_size]` to q, k, v (optional bias),
2. applies RoPE to q and k and appends k, v into the paged pool
   (`pkvattn.apply_rope_and_append`, in place when the pool is donated; with
   fused `qkv_proj` weights `pkvattn.apply_rope_and_append_qkv`, which reads
   the heads out of the projected rows without slicing them apart),
3. runs `pkvattn.paged_prefill` (which serves prefill, chunked prefill and decode
   rows in one mixed batch), and
4. projects back with `o_proj`,

returning `(out [num_tokens, hidden_size], kv_cache)`. The pool is threaded
functionally: pass the returned pool to the next layer / step, and donate it
under `jax.jit(..., donate_argnums=...)` so XLA updates it in place.

The front ends share one functional core, `paged_attention` (with the
projections: `attention_block`, which the models in `pkvattn.models` run under
`lax.scan`):

* `PagedAttention` (flax.nnx), `LinenPagedAttention` (flax.linen): drop-in
  self-attention layers; parameters are `q_proj/k_proj/v_proj/o_proj` with
  `kernel [in, out]` (and `bias [out]`), Flax's `Linear`/`Dense` layout.
* `PagedAttentionFn`: a callable with Flax's `attention_fn` signature, for
  `nnx.MultiHeadAttention(attention_fn=...)` / `nn.MultiHeadDotProductAttention`;
  the updated pool is left on its `kv_cache` attribute.
* `paged_attention(q, k, v, kv_cache, plan, ...)`: the bare op.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from pkvattn import _checks
from pkvattn import attention as _attention
from pkvattn.rope import append_paged_kv as _append_paged_kv
from pkvattn.rope import apply_rope_and_append as _apply_rope_and_append
from pkvattn.rope import apply_rope_and_append_qkv as _apply_rope_and_append_qkv
from pkvattn.rope import get_batch_indices_positions as _get_batch_indices_positions
from pkvattn.types import Implementation

__all__ = [
    "AttentionPlan",
    "AttentionSpec",
    "LinenPagedAttention",
    "PagedAttention",
    "PagedAttentionFn",
    "attention_block",
    "layer_page_tables",
    "paged_attention",
]


@struct.dataclass
class AttentionPlan:
  """Per-step metadata shared by every attention layer (FlashInfer's "plan").

  For a single layer, `page_table` is that layer's table; for a model it may
  carry a leading `num_layers` axis (`for_layer(l)` slices it), each layer's
  indices already offset into the one multi-layer pool (TensorRT-LLM PER_LAYER).
  """
  page_table: jax.Array     # i32[batch_size, 2, max_pages] | i32[batch_size, max_pages]
  #                           (models: i32[num_layers, batch_size, 2, max_pages])
  q_indptr: jax.Array       # i32[batch_size + 1], cu_seqlens of the new tokens
  kv_lens: jax.Array        # i32[batch_size], tokens in cache incl. the new ones
  batch_indices: jax.Array  # i32[num_tokens], -1 for padding tokens
  positions: jax.Array      # i32[num_tokens]
  # Optional `pkvattn.plan_prefill(...)` result (the pallas kernel's tile
  # schedule), computed once per step and shared by every layer; None = the
  # kernel plans per call. Ignored by the xla path.
  kernel_plan: Any = None

  @classmethod
  def create(
      cls,
      page_table: jax.Array,  # i32[..., batch_size, 2, max_pages] | i32[..., batch_size, max_pages]
      q_indptr: jax.Array,    # i32[batch_size + 1]
      kv_lens: jax.Array,     # i32[batch_size]
      num_tokens: int,
      kernel_plan: Any = None,
  ) -> "AttentionPlan":
    """Builds a plan, deriving `batch_indices`/`positions` from the lengths.

    Args:
      page_table: page ids into the pool (split `[.., batch_size, 2, max_pages]`
        for a single 4-D pool, shared `[.., batch_size, max_pages]` for the
        pair / FlashInfer formats); -1 where there is no page.
      q_indptr: `i32[batch_size + 1]`, `q_indptr[0] == 0`, non-decreasing,
        `q_indptr[-1] <= num_tokens`.
      kv_lens: `i32[batch_size]`, tokens including this step's.
      num_tokens: static length of the (padded) token batch.
      kernel_plan: optional `pkvattn.plan_prefill(q_indptr, kv_lens,
        num_tokens=..., ...)` for the pallas kernel.

    Returns:
      The plan; tokens at or past `q_indptr[-1]` get batch index -1.
    """
    q_indptr = jnp.asarray(q_indptr, jnp.int32)
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    _checks.check_shape(q_indptr, (kv_lens.shape[0] + 1,), "q_indptr")
    batch_indices, positions = _get_batch_indices_positions(
        q_indptr, kv_lens, num_tokens)
    return cls(jnp.asarray(page_table, jnp.int32), q_indptr, kv_lens,
               batch_indices.astype(jnp.int32), positions.astype(jnp.int32),
               kernel_plan)

  @property
  def num_tokens(self) -> int:
    return self.batch_indices.shape[0]

  @property
  def batch_size(self) -> int:
    return self.kv_lens.shape[0]

  def for_layer(self, layer) -> "AttentionPlan":
    """The plan with `page_table[layer]` (layer may be traced, e.g. in `lax.scan`)."""
    return self.replace(page_table=self.page_table[layer])


def layer_page_tables(
    slot_table: jax.Array,  # i32[batch_size, max_pages]
    num_layers: int,
) -> jax.Array:             # i32[num_layers, batch_size, 2, max_pages]
  """Per-layer split tables into a multi-layer pool from a SHARED slot table.

  A slot holds one block of every layer, K and V; the pool is
  `[num_slots * num_layers * 2, page_size, num_kv_heads, head_dim]` and block `i`
  of layer `l` lives at `(slot * num_layers + l) * 2 + {0: K, 1: V}` (the
  layout of `pkvattn.cache.page_table`). Entries where `slot_table < 0` stay -1.
  """
  layers = jnp.arange(num_layers, dtype=jnp.int32)[:, None, None, None]
  role = jnp.arange(2, dtype=jnp.int32)[None, None, :, None]
  slots = slot_table.astype(jnp.int32)[None, :, None, :]
  return jnp.where(slots >= 0, (slots * num_layers + layers) * 2 + role, -1)


def paged_attention(
    q: jax.Array,  # [num_tokens, num_qo_heads, head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache,      # any pkvattn kv_cache format (see `paged_prefill`)
    plan: AttentionPlan,
    *,
    rope=None,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    impl: Implementation | None = None,
    k_scale=None,
    v_scale=None,
):
  """RoPE + in-place append of `k`, `v`, then paged attention of `q`.

  Args:
    q, k, v: this step's tokens (before RoPE), `q.dtype == kv_cache.dtype`.
    kv_cache: the pool; `plan.page_table` must fit its format.
    plan: an `AttentionPlan` with this layer's `page_table`.
    rope: a `pkvattn.RopeConfig`, or None for no rotary embedding.
    sm_scale: static; defaults to `1 / sqrt(head_dim)`.
    window_left: static; key `j` visible to query `i` iff `i - window_left <= j`;
      -1 = full attention (HF `sliding_window = W` is `window_left = W - 1`).
    logits_soft_cap: static; `c * tanh(s / c)` on the scaled logits.
    impl: "pallas", "xla" or None (pallas on GPU, xla elsewhere).
    k_scale, v_scale: f32 scalars or `f32[num_kv_heads]` for a
      float8_e4m3fn pool (quantized on write, dequantized on read;
      `pkvattn.paged_decode`), else None.

  Returns:
    `(out [num_tokens, num_qo_heads, head_dim] in q.dtype, kv_cache)`; padding
    tokens give zeros and write nothing.

  Raises:
    ValueError: shapes, dtypes or table/cache format mismatch (trace time).
  """
  _checks.check_ndim(q, (3,), "q")
  _checks.check_shape(k, (q.shape[0], None, q.shape[2]), "k")
  _checks.check_shape(v, k.shape, "v")
  _checks.check_shape(plan.batch_indices, (q.shape[0],), "plan.batch_indices")
  scales = dict(k_scale=k_scale, v_scale=v_scale)
  if rope is None:
    kv_cache = _append_paged_kv(k, v, plan.batch_indices, plan.positions,
                                kv_cache, plan.page_table, impl=impl, **scales)
  else:
    q, kv_cache = _apply_rope_and_append(
        q, k, v, plan.batch_indices, plan.positions, kv_cache, plan.page_table,
        rope, impl=impl, **scales)
  return _attend(q, kv_cache, plan, sm_scale=sm_scale, window_left=window_left,
                 logits_soft_cap=logits_soft_cap, impl=impl,
                 **scales), kv_cache


def _attend(q, kv_cache, plan: AttentionPlan, *, sm_scale, window_left,
            logits_soft_cap, impl, k_scale=None, v_scale=None):
  """`paged_prefill` of the rotated `q` over the updated pool (causal)."""
  return _attention.paged_prefill(
      q, kv_cache, plan.page_table, plan.q_indptr, plan.kv_lens, causal=True,
      sm_scale=sm_scale, window_left=window_left,
      logits_soft_cap=logits_soft_cap, impl=impl, plan=plan.kernel_plan,
      k_scale=k_scale, v_scale=v_scale)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Static configuration of one attention layer (hashable: a jit static)."""
  num_qo_heads: int
  num_kv_heads: int
  head_dim: int
  rope: Any = None                     # pkvattn.RopeConfig | None
  sm_scale: float | None = None        # None = 1 / sqrt(head_dim)
  window_left: int = -1                # -1 = full attention
  logits_soft_cap: float | None = None
  use_qkv_bias: bool = False
  use_o_bias: bool = False
  # QK-norm (Gemma 3): RMSNorm with `(1 + w)` over each q and k head before
  # RoPE, weights `q_norm` / `k_norm [head_dim]`, this epsilon; None = off.
  qk_norm_eps: float | None = None

  def __post_init__(self):
    _checks.check_heads(self.num_qo_heads, self.num_kv_heads)


def _head_rms_norm(x, w, eps: float):
  """Gemma's RMSNorm over the last axis: f32 statistics, `x * (1 + w)`."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def _dense(p, x, dtype):
  y = jnp.dot(x.astype(dtype), p["kernel"].astype(dtype))
  if "bias" in p:
    y = y + p["bias"].astype(dtype)
  return y


def attention_block(
    params,        # {"q_proj"|"k_proj"|"v_proj"|"o_proj": {"kernel": [in, out], "bias"?: [out]}}
    x: jax.Array,  # [num_tokens, hidden_size]
    kv_cache,
    plan: AttentionPlan,
    spec: AttentionSpec,
    *,
    impl: Implementation | None = None,
    dtype=None,
    reduce_axis: str | None = None,
    reduce_dtype=None,
):
  """Projections + `paged_attention`: the functional core of the Flax layers.

  Args:
    params: kernels `q_proj [hidden_size, num_qo_heads * head_dim]`,
      `k_proj`/`v_proj [hidden_size, num_kv_heads * head_dim]`,
      `o_proj [num_qo_heads * head_dim, hidden_size]`, optional biases; or
      `qkv_proj [hidden_size, (num_qo_heads + 2 * num_kv_heads) * head_dim]`
      (q, k, v columns concatenated: one matmul) in place of the three;
      with `spec.qk_norm_eps`, `q_norm` / `k_norm [head_dim]` too; with a
      float8_e4m3fn pool, `k_scale` / `v_scale` (f32 scalars or
      `f32[num_kv_heads]`: stored value = x / scale;
      `pkvattn.models.calibrate_kv_scales` computes them).
    x: `[num_tokens, hidden_size]`.
    kv_cache: the pool, dtype = `dtype` (default `x.dtype`), or
      float8_e4m3fn with the scales in `params`.
    plan: this layer's plan.
    spec: static layer configuration.
    impl: attention / rope implementation.
    dtype: compute dtype; defaults to `x.dtype`.
    reduce_axis: static; for tensor parallelism under `shard_map` (Megatron):
      `params` hold this shard's heads (q/k/v column slices, the matching
      `o_proj` row slice) and the pool this shard's kv heads; the `o_proj`
      partial products are `psum`-ed over this mesh axis in `reduce_dtype`
      and the `o_proj` bias is added once after the sum
      (`row_parallel_dense`). None = one device.
    reduce_dtype: the dtype of that `psum` (static); None = `dtype`, the
      activation dtype. Ignored without `reduce_axis`.

  Returns:
    `(out [num_tokens, hidden_size], kv_cache)`.
  """
  dtype = dtype or x.dtype
  t = x.shape[0]
  d = spec.head_dim
  statics = dict(sm_scale=spec.sm_scale, window_left=spec.window_left,
                 logits_soft_cap=spec.logits_soft_cap, impl=impl)
  scales = dict(k_scale=params.get("k_scale"), v_scale=params.get("v_scale"))
  if ("qkv_proj" in params and spec.rope is not None
      and spec.qk_norm_eps is None):
    # Fused (`pkvattn.models.fuse_projections`): RoPE + append read the q, k,
    # v heads of each projected row in place. Slicing them apart first would
    # add three copy kernels per layer to every step.
    qkv = _dense(params["qkv_proj"], x, dtype)
    _checks.check_shape(
        qkv, (t, (spec.num_qo_heads + 2 * spec.num_kv_heads) * d),
        "x @ params['qkv_proj']['kernel']")
    _checks.check_shape(plan.batch_indices, (t,), "plan.batch_indices")
    batch_indices, table = plan.batch_indices, plan.page_table
    if t <= plan.batch_size:
      # Decode-sized steps: `paged_prefill` runs each token as a decode row
      # over its sequence's table row, gathered for every layer at once
      # before the layers. RoPE + append take the same per-token rows (token
      # t as sequence t) instead of this layer's table, which XLA would copy
      # for the kernel once per layer.
      table = table[jnp.clip(batch_indices, 0)]
      batch_indices = jnp.where(batch_indices >= 0,
                                jnp.arange(t, dtype=jnp.int32), -1)
    q, kv_cache = _apply_rope_and_append_qkv(
        qkv, batch_indices, plan.positions, kv_cache, table, spec.rope,
        impl=impl, **scales)
    out = _attend(q, kv_cache, plan, **statics, **scales)
  else:
    if "qkv_proj" in params:
      qkv = _dense(params["qkv_proj"], x, dtype)
      nq, nk = spec.num_qo_heads * d, spec.num_kv_heads * d
      q = qkv[:, :nq].reshape(t, spec.num_qo_heads, d)
      k = qkv[:, nq:nq + nk].reshape(t, spec.num_kv_heads, d)
      v = qkv[:, nq + nk:].reshape(t, spec.num_kv_heads, d)
    else:
      q = _dense(params["q_proj"], x, dtype).reshape(t, spec.num_qo_heads, d)
      k = _dense(params["k_proj"], x, dtype).reshape(t, spec.num_kv_heads, d)
      v = _dense(params["v_proj"], x, dtype).reshape(t, spec.num_kv_heads, d)
    if spec.qk_norm_eps is not None:
      q = _head_rms_norm(q, params["q_norm"], spec.qk_norm_eps)
      k = _head_rms_norm(k, params["k_norm"], spec.qk_norm_eps)
    out, kv_cache = paged_attention(q, k, v, kv_cache, plan, rope=spec.rope,
                                    **statics, **scales)
  out = out.reshape(t, spec.num_qo_heads * d)
  if reduce_axis is None:
    return _dense(params["o_proj"], out, dtype), kv_cache
  return row_parallel_dense(params["o_proj"], out, reduce_axis, dtype,
                            reduce_dtype=reduce_dtype), kv_cache


def row_parallel_dense(p, x, axis: str, dtype, *, reduce_dtype=None):
  """`x @ kernel` over a row (input-dim) shard, summed over mesh `axis`.

  Megatron's row-parallel linear: `x [num_tokens, in / tp]` (this shard's
  input columns) times `kernel [in / tp, out]` gives this shard's partial
  product `[num_tokens, out]`; one all-reduce (`psum` over `axis`) sums the
  `tp` partials. The bias (replicated) is added once, after the sum.

  Args:
    p: `{"kernel": [in / tp, out], "bias"?: [out]}` (this shard's rows).
    x: `[num_tokens, in / tp]`.
    axis: the mesh axis to sum over (inside `shard_map`).
    dtype: compute dtype of the matmul and of the result.
    reduce_dtype: dtype of the partial products and of the all-reduce;
      None = `dtype`. With the activation dtype (the default) each shard's
      matmul is the one-device matmul (f32 accumulation inside the GEMM,
      rounded to `dtype` at its output) and the all-reduce moves
      `num_tokens * out * itemsize(dtype)` bytes: half of an f32 sum for a
      bf16 model, the dtype vLLM and TensorRT-LLM all-reduce in. In bf16 the
      `tp` partials are each rounded to bf16 before they are summed, so the
      result differs from the one-device dot by bf16 rounding (tokens of a
      bf16 model may differ from tp=1's); an f32 model sums in f32 and
      differs only by f32 summation order. `jnp.float32` for a bf16 model
      sums the f32 partials and rounds once (twice the bytes).

  Returns:
    `[num_tokens, out]` in `dtype`, replicated over `axis`.
  """
  reduce_dtype = dtype if reduce_dtype is None else reduce_dtype
  y = jnp.dot(x.astype(dtype), p["kernel"].astype(dtype),
              preferred_element_type=reduce_dtype)
  y = jax.lax.psum(y, axis).astype(dtype)
  if "bias" in p:
    y = y + p["bias"].astype(dtype)
  return y


class PagedAttention(nnx.Module):
  """Paged self-attention layer for flax.nnx.

  Example:
    >>> layer = PagedAttention(128, 2, 1, 64, rngs=nnx.Rngs(0))
    >>> pool = jnp.zeros((8, 8, 1, 64))        # 8 pages of 8 tokens
    >>> plan = AttentionPlan.create(jnp.array([[[0, 2], [1, 3]]]),
    ...                             jnp.array([0, 5]), jnp.array([5]), 8)
    >>> out, pool = layer(jnp.ones((8, 128)), pool, plan)
    >>> out.shape
    (8, 128)
  """

  def __init__(
      self,
      hidden_size: int,
      num_qo_heads: int,
      num_kv_heads: int,
      head_dim: int,
      *,
      rope=None,
      use_qkv_bias: bool = False,
      use_o_bias: bool = False,
      sm_scale: float | None = None,
      window_left: int = -1,
      logits_soft_cap: float | None = None,
      impl: Implementation | None = None,
      dtype=None,
      param_dtype=jnp.float32,
      kernel_init=nnx.initializers.lecun_normal(),
      rngs: nnx.Rngs,
  ):
    self.spec = AttentionSpec(num_qo_heads, num_kv_heads, head_dim, rope,
                              sm_scale, window_left, logits_soft_cap,
                              use_qkv_bias, use_o_bias)
    self.impl = impl
    self.dtype = dtype
    kw = dict(param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
    self.q_proj = nnx.Linear(hidden_size, num_qo_heads * head_dim,
                             use_bias=use_qkv_bias, **kw)
    self.k_proj = nnx.Linear(hidden_size, num_kv_heads * head_dim,
                             use_bias=use_qkv_bias, **kw)
    self.v_proj = nnx.Linear(hidden_size, num_kv_heads * head_dim,
                             use_bias=use_qkv_bias, **kw)
    self.o_proj = nnx.Linear(num_qo_heads * head_dim, hidden_size,
                             use_bias=use_o_bias, **kw)

  def __call__(
      self,
      x: jax.Array,  # [num_tokens, hidden_size]
      kv_cache,      # pool, e.g. [num_pages, page_size, num_kv_heads, head_dim]
      plan: AttentionPlan,
  ):
    """Returns `(out [num_tokens, hidden_size], kv_cache)` (see `attention_block`)."""
    params = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
      lin = getattr(self, name)
      params[name] = {"kernel": lin.kernel[...]}
      if lin.bias is not None:
        params[name]["bias"] = lin.bias[...]
    return attention_block(params, x, kv_cache, plan, self.spec,
                           impl=self.impl, dtype=self.dtype)


class LinenPagedAttention(nn.Module):
  """Paged self-attention layer for flax.linen (same semantics as `PagedAttention`).

  Example:
    >>> layer = LinenPagedAttention(128, 2, 1, 64)
    >>> pool = jnp.zeros((8, 8, 1, 64))
    >>> plan = AttentionPlan.create(jnp.array([[[0, 2], [1, 3]]]),
    ...                             jnp.array([0, 5]), jnp.array([5]), 8)
    >>> variables = layer.init(jax.random.key(0), jnp.ones((8, 128)), pool, plan)
    >>> out, pool = layer.apply(variables, jnp.ones((8, 128)), pool, plan)
  """
  hidden_size: int
  num_qo_heads: int
  num_kv_heads: int
  head_dim: int
  rope: Any = None
  use_qkv_bias: bool = False
  use_o_bias: bool = False
  sm_scale: float | None = None
  window_left: int = -1
  logits_soft_cap: float | None = None
  impl: Implementation | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Any = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(
      self,
      x: jax.Array,  # [num_tokens, hidden_size]
      kv_cache,
      plan: AttentionPlan,
  ):
    """Returns `(out [num_tokens, hidden_size], kv_cache)`."""
    spec = AttentionSpec(self.num_qo_heads, self.num_kv_heads, self.head_dim,
                         self.rope, self.sm_scale, self.window_left,
                         self.logits_soft_cap, self.use_qkv_bias,
                         self.use_o_bias)
    dense = lambda feats, bias, name: nn.Dense(
        feats, use_bias=bias, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, name=name)
    t, d = x.shape[0], self.head_dim
    q = dense(self.num_qo_heads * d, self.use_qkv_bias, "q_proj")(x)
    k = dense(self.num_kv_heads * d, self.use_qkv_bias, "k_proj")(x)
    v = dense(self.num_kv_heads * d, self.use_qkv_bias, "v_proj")(x)
    out, kv_cache = paged_attention(
        q.reshape(t, spec.num_qo_heads, d), k.reshape(t, spec.num_kv_heads, d),
        v.reshape(t, spec.num_kv_heads, d), kv_cache, plan, rope=spec.rope,
        sm_scale=spec.sm_scale, window_left=spec.window_left,
        logits_soft_cap=spec.logits_soft_cap, impl=self.impl)
    out = dense(self.hidden_size, self.use_o_bias, "o_proj")(
        out.reshape(t, spec.num_qo_heads * d))
    return out, kv_cache


class PagedAttentionFn:
  """A Flax `attention_fn` hook backed by the paged cache.

  Flax's attention modules call `attention_fn(query, key, value, bias=None,
  mask=None, **kwargs)` with `query [..., num_tokens, num_qo_heads, head_dim]`
  (leading batch dims must flatten to one ragged token axis, e.g. `[1, T, H,
  D]`). This object appends `key`/`value` to its pool, attends through the
  plan, and keeps the updated pool on `self.kv_cache` (read it back in the same
  trace, e.g. at the end of your jitted step). `mask`/`bias` are ignored: the
  plan defines the (causal, windowed) visibility. Dropout is not supported: a
  call that would apply it (`dropout_rate > 0` and not `deterministic`, which
  defaults to False as in Flax's `dot_product_attention`) raises
  NotImplementedError. Both are named parameters because linen passes an
  `attention_fn` only the keyword arguments its signature names.

  Example:
    >>> hook = PagedAttentionFn(pool, plan)
    >>> mha = nnx.MultiHeadAttention(2, 128, qkv_features=128, decode=False,
    ...                              attention_fn=hook, rngs=nnx.Rngs(0))
    >>> out = mha(x[None])           # x: [num_tokens, 128]
    >>> pool = hook.kv_cache
  """

  def __init__(self, kv_cache, plan: AttentionPlan, *, rope=None,
               sm_scale: float | None = None, window_left: int = -1,
               logits_soft_cap: float | None = None,
               impl: Implementation | None = None):
    self.kv_cache = kv_cache
    self.plan = plan
    self.rope = rope
    self.sm_scale = sm_scale
    self.window_left = window_left
    self.logits_soft_cap = logits_soft_cap
    self.impl = impl

  def __call__(self, query, key, value, bias=None, mask=None, *,
               dropout_rate: float = 0.0, deterministic: bool = False,
               **kwargs):
    del bias, mask, kwargs
    if dropout_rate and not deterministic:
      raise NotImplementedError("PagedAttentionFn does not support dropout")
    lead = query.shape[:-2]
    flat = lambda a: a.reshape(-1, *a.shape[-2:])
    out, self.kv_cache = paged_attention(
        flat(query), flat(key), flat(value), self.kv_cache, self.plan,
        rope=self.rope, sm_scale=self.sm_scale, window_left=self.window_left,
        logits_soft_cap=self.logits_soft_cap, impl=self.impl)
    return out.reshape(*lead, *out.shape[-2:])
