"""Per-layer FP8 KV scales: calibration from a prefill, and placing them.

An FP8 KV pool stores `x / scale` (saturated to +-448, `pkvattn._kv`); each
attention layer has one `k_scale` and one `v_scale` (vLLM's per-tensor
`--kv-cache-dtype fp8` scales, kept in the layer's parameters as vLLM keeps
them on its attention layers). `calibrate_kv_scales` runs the model over some
prompts with an unquantized pool and sets each scale so that the largest K
(after RoPE) or V value seen maps to `FP8_MAX / headroom`; `set_kv_scales`
writes given scales into a parameter tree.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pkvattn import _kv
from pkvattn.flax import AttentionPlan, layer_page_tables
from pkvattn.models import decoder as _decoder

# The calibrated maximum maps to FP8_MAX / DEFAULT_HEADROOM: later tokens may
# exceed the calibration prompts' maximum by this factor before saturating.
DEFAULT_HEADROOM = 2.0


def _layer_list(params):
  return params["layers"] if isinstance(params["layers"], (list, tuple)) \
      else None


def set_kv_scales(params, k_scale, v_scale):
  """`params` with `attn.k_scale` / `attn.v_scale` of every layer set.

  Args:
    params: a decoder parameter tree, layers stacked (`params["layers"]` a
      dict of `[num_layers, ...]`) or unstacked (a list of per-layer trees).
    k_scale, v_scale: `f32[num_layers]` (array or list), or one float for
      every layer; None removes the scales (an unquantized pool).

  Returns:
    A new tree (the input is not modified).

  Raises:
    ValueError: a scale that is not positive and finite, or of the wrong
      length.
  """
  layers = params["layers"]
  unstacked = _layer_list(params) is not None
  n = len(layers) if unstacked else jax.tree.leaves(layers)[0].shape[0]
  values = []
  for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
    if x is None:
      values.append(None)
      continue
    arr = np.broadcast_to(np.asarray(x, np.float32), (n,)) if np.ndim(x) == 0 \
        else np.asarray(x, np.float32)
    if arr.shape != (n,):
      raise ValueError(
          f"Invalid shape of {name}: expected ({n},) (one per layer) or a "
          f"scalar, got {arr.shape}")
    if not np.all(np.isfinite(arr) & (arr > 0)):
      raise ValueError(
          f"Invalid {name}: expected positive finite scales, got {arr}")
    values.append(jnp.asarray(arr))

  def with_scales(attn, i=None):
    attn = {k: v for k, v in attn.items() if k not in ("k_scale", "v_scale")}
    for name, arr in zip(("k_scale", "v_scale"), values):
      if arr is not None:
        attn[name] = arr if i is None else arr[i]
    return attn

  out = dict(params)
  if unstacked:
    out["layers"] = [dict(lp, attn=with_scales(lp["attn"], i))
                     for i, lp in enumerate(layers)]
  else:
    out["layers"] = dict(layers, attn=with_scales(layers["attn"]))
  return out


@functools.partial(jax.jit, static_argnames=("cfg", "page_size", "impl"))
def kv_amax(params, cfg: _decoder.DecoderConfig, tokens, q_indptr, *,
            page_size: int = 16, impl=None):
  """Largest `|K|` (after RoPE) and `|V|` per layer over a prefill.

  Args:
    params: decoder parameters (compute dtype; any FP8 scales are ignored).
    cfg: static architecture.
    tokens: `i32[num_tokens]`, the prompts one after the other.
    q_indptr: `i32[batch_size + 1]`, prompt `b` is
      `tokens[q_indptr[b]:q_indptr[b + 1]]`; tokens past `q_indptr[-1]` are
      padding.
    page_size: static, pages of the temporary pool.
    impl: attention implementation.

  Returns:
    `(k_amax f32[num_layers], v_amax f32[num_layers])`.
  """
  params = set_kv_scales(params, None, None)
  n = tokens.shape[0]
  batch_size = q_indptr.shape[0] - 1
  L = cfg.num_layers
  max_pages = -(-n // page_size)
  num_slots = batch_size * max_pages
  slots = jnp.arange(num_slots, dtype=jnp.int32).reshape(batch_size, max_pages)
  kv_lens = (q_indptr[1:] - q_indptr[:-1]).astype(jnp.int32)
  dtype = params["embed"].dtype
  pool = jnp.zeros((num_slots * L * 2, page_size, cfg.num_kv_heads,
                    cfg.head_dim), dtype)
  plan = AttentionPlan.create(layer_page_tables(slots, L), q_indptr, kv_lens,
                             num_tokens=n)
  _, pool = _decoder.forward(params, cfg, tokens, pool, plan, impl=impl,
                             logits_indices=jnp.zeros((1,), jnp.int32))
  pages = jnp.abs(pool.astype(jnp.float32)).reshape(
      num_slots, L, 2, -1)  # unwritten rows are zeros
  amax = jnp.max(pages, axis=(0, 3))
  return amax[:, 0], amax[:, 1]


def calibrate_kv_scales(params, cfg: _decoder.DecoderConfig, prompts, *,
                        num_tokens: int = 512, max_prompts: int = 8,
                        headroom: float = DEFAULT_HEADROOM, impl=None):
  """Per-layer FP8 scales from a prefill of `prompts` (at most `num_tokens`).

  Args:
    params, cfg: the model.
    prompts: token-id sequences; the first `max_prompts`, each cut so the
      total stays within `num_tokens`, are prefilled from position 0.
    num_tokens, max_prompts: static sizes of the calibration batch (one
      compiled program per pair).
    headroom: the largest value seen maps to `FP8_MAX / headroom`.

  Returns:
    `(k_scale, v_scale)`, `np.float32[num_layers]` each (a layer that saw
    only zeros gets 1.0).

  Raises:
    ValueError: no prompt with a token, or `headroom < 1`.
  """
  if headroom < 1:
    raise ValueError(f"Invalid headroom: expected >= 1, got {headroom}")
  toks, indptr = [], [0]
  for p in list(prompts)[:max_prompts]:
    take = list(p)[:num_tokens - len(toks)]
    toks += take
    indptr.append(len(toks))
  if not toks:
    raise ValueError("Invalid prompts: expected at least one token, got none")
  indptr += [indptr[-1]] * (max_prompts + 1 - len(indptr))
  tokens = np.zeros(num_tokens, np.int32)
  tokens[:len(toks)] = toks
  k_amax, v_amax = jax.device_get(kv_amax(
      params, cfg, jnp.asarray(tokens), jnp.asarray(indptr, jnp.int32),
      impl=impl))
  target = _kv.FP8_MAX / headroom

  def scale(amax):
    amax = np.asarray(amax, np.float32)
    return np.where(amax > 0, amax / target, 1.0).astype(np.float32)

  return scale(k_amax), scale(v_amax)
