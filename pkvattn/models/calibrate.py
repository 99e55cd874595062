"""FP8 KV scales per layer or per layer and KV head: calibration from a
prefill, and placing them.

An FP8 KV pool stores `x / scale` (saturated to +-448, `pkvattn._kv`); each
attention layer has one `k_scale` and one `v_scale` (vLLM's per-tensor
`--kv-cache-dtype fp8` scales, kept in the layer's parameters as vLLM keeps
them on its attention layers), or one per KV head (`f32[num_kv_heads]`,
vLLM's per-head scales: a head with small values keeps its own range).
`calibrate_kv_scales` runs the model over some prompts with an unquantized
pool and sets each scale so that the largest K (after RoPE) or V value seen
maps to `FP8_MAX / headroom`; `set_kv_scales`
writes given scales into a parameter tree. `check_kv_scales` measures how
given scales fit a prefill's K and V: values that saturate, and how much of
e4m3's range the largest value uses.
"""

from __future__ import annotations

import dataclasses
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

# `ScaleCheck.problems` thresholds. A layer's K or V scale is reported when
# more than FP8_SATURATION_WARN of its values (a fraction, 0.1%) clip at
# +-FP8_MAX, or when its largest value maps below FP8_MIN_RANGE_USED
# (amax / scale < 1: under 1/448 of e4m3's range, so most values land in
# e4m3's subnormals or round to zero).
FP8_SATURATION_WARN = 1e-3
FP8_MIN_RANGE_USED = 1.0


def _layer_list(params):
  return params["layers"] if isinstance(params["layers"], (list, tuple)) \
      else None


def set_kv_scales(params, k_scale, v_scale):
  """`params` with `attn.k_scale` / `attn.v_scale` of every layer set.

  Args:
    params: a decoder parameter tree, layers stacked (`params["layers"]` a
      dict of `[num_layers, ...]`) or unstacked (a list of per-layer trees).
    k_scale, v_scale: `f32[num_layers]` (array or list), one float for
      every layer, or `f32[num_layers, num_kv_heads]` (one per layer and KV
      head); None removes the scales (an unquantized pool).

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
    if arr.shape[:1] != (n,) or arr.ndim > 2:
      raise ValueError(
          f"Invalid shape of {name}: expected ({n},) (one per layer), ({n}, "
          f"num_kv_heads) (one per layer and KV head) or a scalar, got "
          f"{arr.shape}")
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


@functools.partial(jax.jit,
                   static_argnames=("cfg", "page_size", "impl", "per_head"))
def kv_amax(params, cfg: _decoder.DecoderConfig, tokens, q_indptr, *,
            page_size: int = 16, impl=None, per_head: bool = False):
  """Largest `|K|` (after RoPE) and `|V|` per layer (or per layer and KV
  head) over a prefill.

  Args:
    params: decoder parameters (compute dtype; any FP8 scales are ignored).
    cfg: static architecture.
    tokens: `i32[num_tokens]`, the prompts one after the other.
    q_indptr: `i32[batch_size + 1]`, prompt `b` is
      `tokens[q_indptr[b]:q_indptr[b + 1]]`; tokens past `q_indptr[-1]` are
      padding.
    page_size: static, pages of the temporary pool.
    impl: attention implementation.
    per_head: static, one amax per layer and KV head.

  Returns:
    `(k_amax, v_amax)`, `f32[num_layers]` each (`f32[num_layers,
    num_kv_heads]` with `per_head`).
  """
  pages = _prefill_abs_kv(params, cfg, tokens, q_indptr, page_size, impl)
  amax = jnp.max(pages, axis=(0, 3, 5))  # [L, 2, heads]
  if not per_head:
    amax = jnp.max(amax, axis=-1)
  return amax[:, 0], amax[:, 1]


def _prefill_abs_kv(params, cfg, tokens, q_indptr, page_size, impl):
  """`|K|` (after RoPE) and `|V|` of a prefill, f32[num_slots, num_layers,
  2, page_size, num_kv_heads, head_dim]; rows no token wrote are zeros."""
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
  return jnp.abs(pool.astype(jnp.float32)).reshape(
      num_slots, L, 2, page_size, cfg.num_kv_heads, cfg.head_dim)


def get_kv_scales(params):
  """`(k_scale, v_scale)`, `f32[num_layers]` (or `[num_layers,
  num_kv_heads]`) each, of a parameter tree with scales (`set_kv_scales`),
  layers stacked or unstacked.

  Raises:
    ValueError: the tree has no `attn.k_scale` / `attn.v_scale`.
  """
  layers = params["layers"]
  attns = [lp["attn"] for lp in layers] if _layer_list(params) is not None \
      else None
  out = []
  for name in ("k_scale", "v_scale"):
    if attns is not None:
      if not all(name in a for a in attns):
        raise ValueError(f"Invalid params: expected attn.{name} in every "
                         "layer, got a layer without it")
      out.append(jnp.stack([jnp.asarray(a[name], jnp.float32)
                            for a in attns]))
    else:
      if name not in layers["attn"]:
        raise ValueError(f"Invalid params: expected attn.{name}, got none")
      out.append(jnp.asarray(layers["attn"][name], jnp.float32))
  return tuple(out)


@functools.partial(jax.jit, static_argnames=("cfg", "page_size", "impl"))
def kv_saturation(params, cfg: _decoder.DecoderConfig, tokens, q_indptr, *,
                  page_size: int = 16, impl=None):
  """Per-layer amax and saturated-value counts of a prefill under the FP8
  scales in `params`.

  Args: as `kv_amax`; `params` holds `attn.k_scale` / `attn.v_scale`
  (`set_kv_scales`); the prefill itself runs with an unquantized pool.

  Returns:
    `(k_amax, v_amax, k_saturated, v_saturated)`, each shaped as the scales
    (`[num_layers]`, or `[num_layers, num_kv_heads]` per head): the largest
    `|K|` (after RoPE) / `|V|` (f32), and how many K / V values have
    `|x| / scale > FP8_MAX` (i32; stored clipped to +-448).
  """
  k_scale, v_scale = get_kv_scales(params)
  per_head = k_scale.ndim == 2
  heads = (cfg.num_layers, cfg.num_kv_heads)
  limit = _kv.FP8_MAX * jnp.stack([  # [L, 2, heads]
      jnp.broadcast_to(s.reshape(cfg.num_layers, -1), heads)
      for s in (k_scale, v_scale)], axis=1)
  pages = _prefill_abs_kv(params, cfg, tokens, q_indptr, page_size, impl)
  amax = jnp.max(pages, axis=(0, 3, 5))
  saturated = jnp.sum(pages > limit[None, :, :, None, :, None],
                      axis=(0, 3, 5), dtype=jnp.int32)
  if not per_head:
    amax, saturated = jnp.max(amax, axis=-1), jnp.sum(saturated, axis=-1)
  return amax[:, 0], amax[:, 1], saturated[:, 0], saturated[:, 1]


def _calibration_batch(prompts, num_tokens, max_prompts):
  """`(tokens i32[num_tokens], q_indptr i32[max_prompts + 1], real tokens)`
  of the first `max_prompts` prompts cut to `num_tokens` in all.

  Raises:
    ValueError: no prompt with a token.
  """
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
  return jnp.asarray(tokens), jnp.asarray(indptr, jnp.int32), len(toks)


def calibrate_kv_scales(params, cfg: _decoder.DecoderConfig, prompts, *,
                        num_tokens: int = 512, max_prompts: int = 8,
                        headroom: float = DEFAULT_HEADROOM, impl=None,
                        per_head: bool = False):
  """Per-layer (or per layer and KV head) FP8 scales from a prefill of
  `prompts` (at most `num_tokens`).

  Args:
    params, cfg: the model.
    prompts: token-id sequences; the first `max_prompts`, each cut so the
      total stays within `num_tokens`, are prefilled from position 0.
    num_tokens, max_prompts: static sizes of the calibration batch (one
      compiled program per pair).
    headroom: the largest value seen maps to `FP8_MAX / headroom`.
    per_head: one scale per layer and KV head (vLLM's per-head KV scales):
      a head whose values are much smaller than its layer's largest keeps
      its own range instead of rounding to a few FP8 steps.

  Returns:
    `(k_scale, v_scale)`, `np.float32[num_layers]` each, or
    `[num_layers, num_kv_heads]` with `per_head` (a layer or head that saw
    only zeros gets 1.0).

  Raises:
    ValueError: no prompt with a token, or `headroom < 1`.
  """
  if headroom < 1:
    raise ValueError(f"Invalid headroom: expected >= 1, got {headroom}")
  tokens, indptr, _ = _calibration_batch(prompts, num_tokens, max_prompts)
  k_amax, v_amax = jax.device_get(kv_amax(params, cfg, tokens, indptr,
                                          impl=impl, per_head=per_head))
  target = _kv.FP8_MAX / headroom

  def scale(amax):
    amax = np.asarray(amax, np.float32)
    return np.where(amax > 0, amax / target, 1.0).astype(np.float32)

  return scale(k_amax), scale(v_amax)


@dataclasses.dataclass(frozen=True)
class ScaleCheck:
  """How per-layer FP8 scales fit one prefill's K (after RoPE) and V.

  Attributes:
    k_scale, v_scale: the scales checked, `np.float32[num_layers]` (or
      `[num_layers, num_kv_heads]` per head); the other arrays are shaped
      alike, one entry per scale.
    k_amax, v_amax: the largest `|K|` / `|V|` a scale covers.
    k_saturated, v_saturated: values with `|x| / scale > 448` (stored
      clipped to +-448).
    values_per_layer: K (or V) values each layer wrote: tokens x
      num_kv_heads x head_dim.
  """
  k_scale: np.ndarray
  v_scale: np.ndarray
  k_amax: np.ndarray
  v_amax: np.ndarray
  k_saturated: np.ndarray
  v_saturated: np.ndarray
  values_per_layer: int

  @property
  def num_saturated(self) -> int:
    """Saturated values over every layer, K and V."""
    return int(self.k_saturated.sum() + self.v_saturated.sum())

  def problems(self, saturation: float = FP8_SATURATION_WARN,
               min_range_used: float = FP8_MIN_RANGE_USED) -> list[str]:
    """One line per layer and K / V whose scale saturates more than
    `saturation` (a fraction) of its values, or maps its largest value below
    `min_range_used` (`amax / scale`; e4m3's largest is 448). A layer whose
    values are all zero uses no range and is not reported."""
    out = []
    for kind, scale, amax, sat in (
        ("K", self.k_scale, self.k_amax, self.k_saturated),
        ("V", self.v_scale, self.v_amax, self.v_saturated)):
      # One scale covers a layer's values, or a head's share of them.
      values = self.values_per_layer // (
          1 if scale.ndim == 1 else scale.shape[1])
      for at in np.ndindex(scale.shape):
        where = f"layer {at[0]}" + (f" head {at[1]}" if len(at) > 1 else "")
        frac = int(sat[at]) / max(values, 1)
        if frac > saturation:
          out.append(
              f"{where} {kind}: scale {float(scale[at]):.3g} saturates "
              f"{int(sat[at])} of {values} values ({frac:.2%}; expected at "
              f"most {saturation:.2%}): amax {float(amax[at]):.4g} needs a "
              f"scale of at least {float(amax[at]) / _kv.FP8_MAX:.3g}")
        used = float(amax[at]) / float(scale[at])
        if amax[at] > 0 and used < min_range_used:
          out.append(
              f"{where} {kind}: scale {float(scale[at]):.3g} maps the "
              f"largest value ({float(amax[at]):.4g}) to {used:.3g} "
              f"(expected at least {min_range_used:g} of e4m3's 448): "
              "most values round to zero or to subnormals")
    return out


def check_kv_scales(params, cfg: _decoder.DecoderConfig, prompts, *,
                    num_tokens: int = 512, max_prompts: int = 8,
                    impl=None) -> ScaleCheck:
  """How the FP8 scales in `params` fit a prefill of `prompts`.

  Args:
    params: decoder parameters holding `attn.k_scale` / `attn.v_scale`
      (`set_kv_scales`).
    cfg: the model's architecture.
    prompts, num_tokens, max_prompts: the batch, as `calibrate_kv_scales`
      takes it (one compiled program per size pair).
    impl: attention implementation of the prefill.

  Returns:
    A `ScaleCheck` (`ScaleCheck.problems()` lists the scales that saturate
    or waste the range).

  Raises:
    ValueError: no prompt with a token, or `params` without scales.
  """
  tokens, indptr, n = _calibration_batch(prompts, num_tokens, max_prompts)
  k_scale, v_scale = jax.device_get(get_kv_scales(params))
  k_amax, v_amax, k_sat, v_sat = jax.device_get(kv_saturation(
      params, cfg, tokens, indptr, impl=impl))
  return ScaleCheck(
      k_scale=np.asarray(k_scale), v_scale=np.asarray(v_scale),
      k_amax=np.asarray(k_amax), v_amax=np.asarray(v_amax),
      k_saturated=np.asarray(k_sat), v_saturated=np.asarray(v_sat),
      values_per_layer=n * cfg.num_kv_heads * cfg.head_dim)
