"""Rotary position embeddings, fused with appending K/V into a paged cache.

RoPE follows Hugging Face transformers: for pair `i` of a head's first
`rotary_dim` features, `angle = position * inv_freq[i]` with
`inv_freq[i] = theta ** (-2i / rotary_dim)` (then scaled, see
`Llama3RopeScaling` / `LinearRopeScaling`), and

  out_a = x_a cos(angle) - x_b sin(angle)
  out_b = x_b cos(angle) + x_a sin(angle)

where the pair `(a, b)` is `(i, i + rotary_dim / 2)` for `style="neox"`
(`rotate_half`, Llama / Mistral / Qwen2 / Gemma) and `(2i, 2i + 1)` for
`style="gptj"` (interleaved, GPT-J `rotate_every_two`). Features past
`rotary_dim` pass through. Angles, sin and cos are f32; the result is cast
back to the input dtype.

Appending (TensorRT-LLM `qkv_preprocessing`): token `t` of sequence
`b = batch_indices[t]` at position `p = positions[t]` is written to row
`p % page_size` of block `p // page_size`: K into page `page_table[b, 0, block]`
and V into `page_table[b, 1, block]` for a split table, both into
`page_table[b, block]` of their pools for a shared table. Padding tokens
(`batch_indices[t] == -1`) write nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pkvattn import _checks
from pkvattn import _contract
from pkvattn import _kv
from pkvattn.pallas_kernels import reference
from pkvattn.types import Implementation

RopeStyle = Literal["neox", "gptj"]


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama 3.1 frequency scaling (transformers `rope_type="llama3"`).

  With `wavelen = 2 pi / inv_freq`, `low = original_max_position_embeddings /
  low_freq_factor`, `high = original_max_position_embeddings / high_freq_factor`:
  wavelengths above `low` are divided by `factor`, below `high` kept, and in
  between interpolated with `smooth = (original_max_position_embeddings /
  wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)`:
  `(1 - smooth) * inv_freq / factor + smooth * inv_freq`.
  """
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.factor <= 0:
      raise ValueError(f"Invalid factor: expected > 0, got {self.factor}")
    if not self.high_freq_factor > self.low_freq_factor > 0:
      raise ValueError(
          "Invalid low_freq_factor/high_freq_factor: expected 0 < low < high, "
          f"got {self.low_freq_factor=}, {self.high_freq_factor=}")
    if self.original_max_position_embeddings <= 0:
      raise ValueError(
          "Invalid original_max_position_embeddings: expected > 0, got "
          f"{self.original_max_position_embeddings}")


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
  """Linear position interpolation (transformers `rope_type="linear"`): `inv_freq / factor`."""
  factor: float

  def __post_init__(self):
    if self.factor <= 0:
      raise ValueError(f"Invalid factor: expected > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Static RoPE configuration; frozen and hashable, so usable as a jit static arg.

  Attributes:
    theta: base wavelength (`rope_theta`), > 0.
    style: "neox" (rotate halves) or "gptj" (interleaved pairs).
    rotary_dim: features rotated per head, even; None = all of `head_dim`.
      Must be <= head_dim (checked when applied).
    scaling: None, `Llama3RopeScaling(...)` or `LinearRopeScaling(factor)`.

  Example:
    >>> rope = RopeConfig(theta=500000.0, scaling=Llama3RopeScaling())
    >>> rope.inv_freq(128).shape
    (64,)
  """
  theta: float = 10000.0
  style: RopeStyle = "neox"
  rotary_dim: int | None = None
  scaling: Llama3RopeScaling | LinearRopeScaling | None = None

  def __post_init__(self):
    _checks.check_choice(self.style, ("neox", "gptj"), "style")
    if not self.theta > 0:
      raise ValueError(f"Invalid theta: expected > 0, got {self.theta}")
    if self.rotary_dim is not None and (
        int(self.rotary_dim) != self.rotary_dim or self.rotary_dim <= 0
        or self.rotary_dim % 2):
      raise ValueError(
          f"Invalid rotary_dim: expected a positive even int or None, got "
          f"{self.rotary_dim!r}")
    if self.scaling is not None and not isinstance(
        self.scaling, (Llama3RopeScaling, LinearRopeScaling)):
      raise ValueError(
          "Invalid scaling: expected None, Llama3RopeScaling or "
          f"LinearRopeScaling, got {type(self.scaling).__name__}")

  def get_rotary_dim(self, head_dim: int) -> int:
    """`rotary_dim` resolved against `head_dim`; ValueError if it does not fit."""
    rot = head_dim if self.rotary_dim is None else int(self.rotary_dim)
    if rot > head_dim or rot % 2:
      raise ValueError(
          f"Invalid rotary_dim: expected an even int <= head_dim={head_dim}, "
          f"got {rot}")
    return rot

  def inv_freq(self, head_dim: int) -> np.ndarray:
    """Scaled inverse frequencies, `f32[rotary_dim // 2]` (a host constant).

    Computed in f64 and rounded to f32 once; transformers computes the same
    formula in f32, so entries can differ from its table by 1 ulp.
    """
    rot = self.get_rotary_dim(head_dim)
    inv = 1.0 / (float(self.theta) ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
    s = self.scaling
    if isinstance(s, LinearRopeScaling):
      inv = inv / s.factor
    elif isinstance(s, Llama3RopeScaling):
      old = float(s.original_max_position_embeddings)
      low_wavelen = old / s.low_freq_factor
      high_wavelen = old / s.high_freq_factor
      wavelen = 2 * math.pi / inv
      scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
      smooth = (old / wavelen - s.low_freq_factor) / (
          s.high_freq_factor - s.low_freq_factor)
      smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
      medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
      inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)

  @classmethod
  def from_hf_config(cls, config: Mapping[str, Any] | Any,
                     style: RopeStyle = "neox") -> "RopeConfig":
    """Builds a RopeConfig from a transformers config (dict or config object).

    Reads `rope_theta` (default 10000), `rope_scaling` or the newer
    `rope_parameters` (`rope_type`/`type` in "default", "llama3", "linear"),
    `partial_rotary_factor` (default 1) and `head_dim` (default
    `hidden_size // num_attention_heads`, needed only for partial rotary).

    Raises:
      NotImplementedError: another `rope_type` (yarn, dynamic, longrope, ...).
    """
    if not isinstance(config, Mapping):
      config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    prf = float(params.get("partial_rotary_factor",
                           config.get("partial_rotary_factor", 1.0)) or 1.0)
    rotary_dim = None
    if prf != 1.0:
      head_dim = config.get("head_dim") or (
          config["hidden_size"] // config["num_attention_heads"])
      rotary_dim = int(head_dim * prf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
      scaling = None
    elif rope_type == "linear":
      scaling = LinearRopeScaling(float(params["factor"]))
    elif rope_type == "llama3":
      scaling = Llama3RopeScaling(
          factor=float(params["factor"]),
          low_freq_factor=float(params["low_freq_factor"]),
          high_freq_factor=float(params["high_freq_factor"]),
          original_max_position_embeddings=int(
              params["original_max_position_embeddings"]))
    else:
      raise NotImplementedError(f"Unsupported rope_type: {rope_type!r}")
    return cls(theta=theta, style=style, rotary_dim=rotary_dim, scaling=scaling)


def _check_rope(rope) -> None:
  if not isinstance(rope, RopeConfig):
    raise ValueError(
        f"Invalid rope: expected a RopeConfig, got {type(rope).__name__}")


def _check_tokens(x, name: str, num_tokens: int | None, head_dim: int | None):
  _checks.check_ndim(x, (3,), name)
  _checks.check_dtype(x, _kv.SUPPORTED_DTYPES, name)
  _checks.check_shape(x, (num_tokens, None, head_dim), name)


def _check_index(x, name: str, num_tokens: int):
  _checks.check_int(x, name)
  _checks.check_shape(x, (num_tokens,), name)


def apply_rope(
    q: jax.Array,          # [num_tokens, num_qo_heads, head_dim]
    k: jax.Array,          # [num_tokens, num_kv_heads, head_dim]
    positions: jax.Array,  # i32[num_tokens]
    rope: RopeConfig,
) -> tuple[jax.Array, jax.Array]:
  """Applies RoPE to q and k (pure jnp; XLA fuses it).

  Args:
    q: `[num_tokens, num_qo_heads, head_dim]`; bf16, f16 or f32.
    k: `[num_tokens, num_kv_heads, head_dim]`; any supported dtype.
    positions: `i32[num_tokens]` (array or list), token positions (any
      integer, >= 0 in use).
    rope: static `RopeConfig`.

  Returns:
    `(q, k)` rotated, same shapes and dtypes as the inputs.

  Raises:
    ValueError: ranks, dtypes, head_dim mismatch, positions not
      `[num_tokens]`, rotary_dim > head_dim.

  Example:
    >>> q = jnp.ones((3, 4, 64)); k = jnp.ones((3, 2, 64))
    >>> q2, k2 = apply_rope(q, k, jnp.arange(3), RopeConfig())
    >>> q2.shape, k2.shape
    ((3, 4, 64), (3, 2, 64))
  """
  _check_rope(rope)
  q, k = jnp.asarray(q), jnp.asarray(k)
  positions = _checks.as_index_array(positions)
  _check_tokens(q, "q", None, None)
  num_tokens, _, head_dim = q.shape
  _check_tokens(k, "k", num_tokens, head_dim)
  _check_index(positions, "positions", num_tokens)
  inv_freq = jnp.asarray(rope.inv_freq(head_dim))
  interleaved = rope.style == "gptj"
  return (reference.rope_reference(q, positions, inv_freq, interleaved=interleaved),
          reference.rope_reference(k, positions, inv_freq, interleaved=interleaved))


def _append_checks(k, v, batch_indices, positions, view: _kv.KVView):
  _check_tokens(k, "k", None, view.head_dim)
  num_tokens = k.shape[0]
  _checks.check_shape(k, (num_tokens, view.num_kv_heads, view.head_dim), "k")
  _checks.check_shape(v, k.shape, "v")
  _checks.check_dtype(v, _kv.SUPPORTED_DTYPES, "v")
  _check_index(batch_indices, "batch_indices", num_tokens)
  _check_index(positions, "positions", num_tokens)


def _index_arrays(batch_indices, positions, page_table):
  """Lists (and numpy arrays) to jax arrays; tracers and arrays unchanged."""
  return tuple(map(_checks.as_index_array,
                   (batch_indices, positions, page_table)))


def _append_contract(view: _kv.KVView, batch_indices, positions, check,
                     scales=(None, None), k_scale=None, v_scale=None):
  """Checked mode's clauses of the append ops.

  Returns the staged result of the scale clause (`bool[]`), or None (eager,
  unchecked, or no scale given as a jax array). The index clauses need no
  guard (unchecked, an out-of-range token is not written); a bad scale
  would quantize every token wrong (scale 0 stores NaN), so `_guarded`
  writes nothing where it fails.
  """
  if not _contract.enabled(check):
    return None
  _contract.run(_contract.append_contract, view.table, batch_indices,
                positions, num_pages=view.num_pages, page_size=view.page_size)
  return _kv.run_scale_contract(scales, k_scale, v_scale)


def _guarded(ok, view: _kv.KVView, body):
  """`body()` (`(q_rotated or None, kv_cache)`) where the staged scale clause
  holds, else NaN `q_rotated` and the pools unchanged (`_contract.guard`)."""
  if ok is None:
    return body()

  def fallback():
    q_shape, _ = jax.eval_shape(body)
    q = (None if q_shape is None
         else jnp.full(q_shape.shape, jnp.nan, q_shape.dtype))
    return q, _kv.rebuild(view, view.k_pool, view.v_pool)

  return _contract.guard(ok, body, fallback)


def _nothing_to_write(view: _kv.KVView, num_tokens: int) -> bool:
  """No token can be written: no tokens, or no sequences (all padding)."""
  return num_tokens == 0 or view.table.shape[0] == 0


def _paged(view: _kv.KVView, batch_indices):
  """The kernel's in-place table lookup: `(batch_indices, table, table_kind)`
  (rows computed in the kernel, `reference.append_rows`' rule)."""
  return (batch_indices, view.table, view.table_kind)


def _append_xla(k, v, batch_indices, positions, k_pool, v_pool, k_table,
                v_table):
  """`reference.append_paged_kv_reference`'s update as one scatter into the
  4-D pool(s), indexed by `(page, slot in page)`; `v_pool=None`: V shares
  `k_pool`. Returns `(k_pool, v_pool)` (`v_pool` None when shared).

  The reference scatters into the pool reshaped to flat rows
  `[num_pages * page_size, num_kv_heads, head_dim]`. With one kv head (a
  tensor-parallel shard's, or a small model's) that reshape leaves XLA a
  choice of where the size-1 axis goes in memory, and where a loop (the XLA
  prefill's) also reads the pool, layout assignment has picked a different
  one for the two sides and inserted whole-pool copies (and a copy of the
  donated argument) into the step. Scattering at `(page, slot)` keeps the
  pool's own shape, so there is no layout to choose. Rows the reference
  drops (`append_rows` gives `num_pages * page_size`) give page `num_pages`,
  out of range, dropped by `mode="drop"`.
  """
  n, ps = k_pool.shape[:2]
  k_rows = reference.append_rows(batch_indices, positions, k_table, ps, n)
  v_rows = reference.append_rows(batch_indices, positions, v_table, ps, n)
  if v_pool is None:
    rows = jnp.concatenate([k_rows, v_rows])
    vals = jnp.concatenate([k, v]).astype(k_pool.dtype)
    return k_pool.at[rows // ps, rows % ps].set(vals, mode="drop"), None
  k_pool = k_pool.at[k_rows // ps, k_rows % ps].set(k.astype(k_pool.dtype),
                                                     mode="drop")
  v_pool = v_pool.at[v_rows // ps, v_rows % ps].set(v.astype(v_pool.dtype),
                                                     mode="drop")
  return k_pool, v_pool


def _run(q, k, v, batch_indices, positions, view: _kv.KVView, inv_freq,
         interleaved: bool, impl: str, scales=(None, None)):
  """Shared body: returns (q_rotated or None, kv_cache in the caller's format).
  `scales`: `(k_scale, v_scale)` of FP8 pages (quantized on write)."""
  if impl == "xla":
    if scales[0] is not None:  # FP8: K rotated in f32, rounded once (to FP8)
      k = k.astype(jnp.float32)
    if inv_freq is not None:
      inv = jnp.asarray(inv_freq)
      q = reference.rope_reference(q, positions, inv, interleaved=interleaved)
      k = reference.rope_reference(k, positions, inv, interleaved=interleaved)
    k_pool, v_pool = view.k_pool, None if view.same_pool else view.v_pool
    if scales[0] is not None:
      # Scattered as their bytes: XLA has no FP8 scatter on every backend
      # and otherwise converts the whole pool to a wider float, scatters
      # and converts it back (a pass over every page, every layer, every
      # step). A bitcast is free and keeps the update in place.
      k = _kv.as_bytes(_kv.quantize(k, scales[0]))
      v = _kv.as_bytes(_kv.quantize(v, scales[1]))
      k_pool = _kv.as_bytes(k_pool)
      v_pool = None if v_pool is None else _kv.as_bytes(v_pool)
    k_pool, v_pool = _append_xla(k, v, batch_indices, positions, k_pool,
                                 v_pool, view.k_table, view.v_table)
    if scales[0] is not None:
      k_pool = _kv.from_bytes(k_pool)
      v_pool = None if v_pool is None else _kv.from_bytes(v_pool)
    return q, _kv.rebuild(view, k_pool, v_pool)
  from pkvattn.pallas_kernels import rope_append as kernel
  q_out, k_pool, v_pool = kernel.rope_append(
      q, k, v, positions, None, None,
      None if inv_freq is None else jnp.asarray(inv_freq),
      view.k_pool, None if view.same_pool else view.v_pool,
      interleaved=interleaved, interpret=not _checks.is_gpu(),
      paged=_paged(view, batch_indices), **_scale_kwargs(scales))
  return q_out, _kv.rebuild(view, k_pool, v_pool)


def append_paged_kv(
    k: jax.Array,              # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,              # [num_tokens, num_kv_heads, head_dim]
    batch_indices: jax.Array,  # i32[num_tokens]
    positions: jax.Array,      # i32[num_tokens]
    kv_cache,                  # see pkvattn.paged_decode
    page_table: jax.Array,     # i32[batch_size, max_pages] | i32[batch_size, 2, max_pages]
    *,
    impl: Implementation | None = None,
    check: bool | None = None,
    k_scale: jax.Array | float | None = None,  # f32[] | [num_kv_heads]: FP8
    v_scale: jax.Array | float | None = None,  # f32[] | [num_kv_heads]: FP8
):
  """Writes each token's K and V row into the paged cache.

  Token `t` with `b = batch_indices[t]`, `p = positions[t]` goes to row
  `p % page_size` of block `p // page_size` (K via the K table, V via the V
  table). Tokens with `b == -1`, a block past `max_pages` or a table entry
  `< 0` are not written. Two tokens writing the same row: unspecified winner.

  Args:
    k, v: `[num_tokens, num_kv_heads, head_dim]`; cast to the cache dtype
      (FP8 pages: quantized, `x / k_scale` resp. `x / v_scale` saturated to
      +-448, `pkvattn` FP8 convention as vLLM / FlashInfer).
    batch_indices: `i32[num_tokens]` (array or list), sequence of each
      token, -1 = padding.
    positions: `i32[num_tokens]` (array or list), position of each token in
      its sequence.
    kv_cache: `(k_pages, v_pages)` with a shared table, one 4-D pool with a
      split table `[batch_size, 2, max_pages]`, or FlashInfer's
      `[num_pages, 2, page_size, num_kv_heads, head_dim]` with a shared table.
    page_table: page ids (see `kv_cache`).
    impl: "pallas" (kernel; interpret mode off GPU), "xla" (`.at[].set`,
      `mode="drop"`), None (pallas on GPU, xla elsewhere).
    check: checked mode (`pkvattn.checked`; None follows it): `batch_indices`
      in `[-1, batch_size)`, and every non-padding token lands in a page:
      `0 <= positions[t] < max_pages * page_size` and a page id in `[0,
      num_pages)` at its block (unchecked, such tokens are not written);
      `k_scale` / `v_scale` given as jax arrays finite and `>= 2**-126`
      (staged, a call with a bad scale writes nothing).
    k_scale, v_scale: for a float8_e4m3fn `kv_cache` (required there,
      refused otherwise), f32 scalars or `f32[num_kv_heads]` as in
      `pkvattn.paged_decode`: finite and `>= 2**-126`, Python / numpy
      numbers checked at trace time. Per-head scales divide K and V per head
      before the write (`_kv.unit_head_scales`), which then uses scale 1.

  Returns:
    The updated kv_cache in the format it came in. Donate it
    (`jax.jit(..., donate_argnums=...)`) to update in place: both impls alias
    the pool, so no pool copy is made. With `num_tokens == 0` or
    `batch_size == 0` (every token padding) it is returned unchanged.

  Raises:
    ValueError: shapes, dtypes, table/kv_cache format mismatch, a host
      scale that is not finite or below `2**-126`.
    checkify.JaxRuntimeError: (a ValueError) checked mode, a violated
      contract (`pkvattn.checked` says where it surfaces).
  """
  batch_indices, positions, page_table = _index_arrays(
      batch_indices, positions, page_table)
  view = _kv.make_view(kv_cache, page_table)
  _append_checks(k, v, batch_indices, positions, view)
  scales = _kv.check_scales(view.k_pool, k_scale, v_scale,
                            num_kv_heads=view.num_kv_heads)
  ok = _append_contract(view, batch_indices, positions, check, scales,
                        k_scale, v_scale)
  k, v, scales = _per_head_to_unit(k, v, scales)
  if _nothing_to_write(view, k.shape[0]):
    return kv_cache
  impl = _checks.resolve_impl(impl)
  with _contract.unchecked():  # the kernels: their unchecked compilation
    _, kv_cache = _guarded(ok, view, lambda: _run(
        None, k, v, batch_indices, positions, view, None, False, impl, scales))
  return kv_cache


def _per_head_to_unit(k, v, scales):
  """Per-KV-head scales applied to `k` / `v` (`_kv.unit_head_scales`), the
  write then at scale 1; per-tensor scales (or none) unchanged."""
  if not _kv.is_per_head(scales):
    return k, v, scales
  k, v = (_kv.unit_head_scales(x, jnp.broadcast_to(s, (x.shape[1],)))
          for x, s in zip((k, v), scales))
  one = jnp.ones((), jnp.float32)
  return k, v, (one, one)


def _scale_kwargs(scales):
  """The kernel's FP8 arguments (none for unquantized pages)."""
  if scales[0] is None:
    return {}
  return dict(k_scale=scales[0], v_scale=scales[1])


def apply_rope_and_append(
    q: jax.Array,              # [num_tokens, num_qo_heads, head_dim]
    k: jax.Array,              # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,              # [num_tokens, num_kv_heads, head_dim]
    batch_indices: jax.Array,  # i32[num_tokens]
    positions: jax.Array,      # i32[num_tokens]
    kv_cache,
    page_table: jax.Array,     # i32[batch_size, max_pages] | i32[batch_size, 2, max_pages]
    rope: RopeConfig,
    *,
    impl: Implementation | None = None,
    check: bool | None = None,
    k_scale: jax.Array | float | None = None,  # f32[] | [num_kv_heads]: FP8
    v_scale: jax.Array | float | None = None,  # f32[] | [num_kv_heads]: FP8
):
  """RoPE on q and k, then K/V appended to the paged cache, in one pass.

  Equivalent to `q, k = apply_rope(q, k, positions, rope)` followed by
  `append_paged_kv(k, v, batch_indices, positions, kv_cache, page_table)`;
  `impl="pallas"` is one kernel that reads q, k, v once and writes rotated q
  and the cache rows, aliasing the pool(s).

  Args:
    q: `[num_tokens, num_qo_heads, head_dim]`; bf16, f16 or f32.
    k, v: `[num_tokens, num_kv_heads, head_dim]`.
    batch_indices, positions, kv_cache, page_table, impl, check, k_scale,
      v_scale: as `append_paged_kv` (FP8 pages are quantized in the kernel).
    rope: static `RopeConfig`.

  Returns:
    `(q_rotated [num_tokens, num_qo_heads, head_dim] in q.dtype, kv_cache)`.
    Rows of padding tokens in `q_rotated` are rotated as if at their position.

  Raises:
    ValueError: as `append_paged_kv` and `apply_rope`.
    checkify.JaxRuntimeError: (a ValueError) checked mode, as
      `append_paged_kv`.

  Example:
    >>> q = jnp.ones((2, 4, 64)); k = v = jnp.ones((2, 2, 64))
    >>> cache = (jnp.zeros((3, 8, 2, 64)), jnp.zeros((3, 8, 2, 64)))
    >>> q, cache = apply_rope_and_append(
    ...     q, k, v, jnp.array([0, -1]), jnp.array([9, 0]), cache,
    ...     jnp.array([[2, 0]]), RopeConfig(), impl="xla")
    >>> float(cache[1][0, 1, 0, 0])  # block 1 of seq 0 is page 0, row 9 % 8
    1.0
  """
  _check_rope(rope)
  batch_indices, positions, page_table = _index_arrays(
      batch_indices, positions, page_table)
  view = _kv.make_view(kv_cache, page_table)
  _check_tokens(q, "q", None, view.head_dim)
  _append_checks(k, v, batch_indices, positions, view)
  _checks.check_shape(q, (k.shape[0], None, view.head_dim), "q")
  _checks.check_heads(q.shape[1], k.shape[1])
  scales = _kv.check_scales(view.k_pool, k_scale, v_scale,
                            num_kv_heads=view.num_kv_heads)
  ok = _append_contract(view, batch_indices, positions, check, scales,
                        k_scale, v_scale)
  k, v, scales = _per_head_to_unit(k, v, scales)
  inv_freq = rope.inv_freq(view.head_dim)
  if _nothing_to_write(view, k.shape[0]):
    q = reference.rope_reference(q, positions, jnp.asarray(inv_freq),
                                 interleaved=rope.style == "gptj")
    return q, kv_cache
  impl = _checks.resolve_impl(impl)
  with _contract.unchecked():  # the kernels: their unchecked compilation
    return _guarded(ok, view, lambda: _run(
        q, k, v, batch_indices, positions, view, inv_freq,
        rope.style == "gptj", impl, scales))


def apply_rope_and_append_qkv(
    qkv: jax.Array,            # [num_tokens, (num_qo_heads + 2 * num_kv_heads) * head_dim]
    batch_indices: jax.Array,  # i32[num_tokens]
    positions: jax.Array,      # i32[num_tokens]
    kv_cache,
    page_table: jax.Array,     # i32[batch_size, max_pages] | i32[batch_size, 2, max_pages]
    rope: RopeConfig,
    *,
    impl: Implementation | None = None,
    check: bool | None = None,
    k_scale: jax.Array | float | None = None,  # f32[] | [num_kv_heads]: FP8
    v_scale: jax.Array | float | None = None,  # f32[] | [num_kv_heads]: FP8
):
  """`apply_rope_and_append` on a fused qkv projection (TensorRT-LLM layout).

  Each row of `qkv` holds the q heads, then the k heads, then the v heads,
  `head_dim` features each; `num_kv_heads` and `head_dim` come from
  `kv_cache`, `num_qo_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads`.
  The Pallas kernel reads the row in place; slicing q, k, v apart first
  would copy them. `batch_indices`, `positions`, `kv_cache`, `page_table`,
  `rope`, `impl`, `check`, `k_scale` and `v_scale` are as in
  `apply_rope_and_append`.

  Returns:
    `(q_rotated [num_tokens, num_qo_heads, head_dim] in qkv.dtype, kv_cache)`.

  Raises:
    ValueError: `qkv.shape[1]` not `(num_qo_heads + 2 * num_kv_heads) *
      head_dim` with `num_qo_heads` a positive multiple of `num_kv_heads`, and
      as `apply_rope_and_append`.
    checkify.JaxRuntimeError: (a ValueError) checked mode, as
      `append_paged_kv`.
  """
  _check_rope(rope)
  batch_indices, positions, page_table = _index_arrays(
      batch_indices, positions, page_table)
  view = _kv.make_view(kv_cache, page_table)
  _checks.check_ndim(qkv, (2,), "qkv")
  _checks.check_dtype(qkv, _kv.SUPPORTED_DTYPES, "qkv")
  num_tokens, width = qkv.shape
  hkv, d = view.num_kv_heads, view.head_dim
  num_qo_heads = width // d - 2 * hkv
  if width % d or num_qo_heads <= 0:
    raise ValueError(
        f"Invalid shape of qkv: expected (num_tokens, (num_qo_heads + 2 * "
        f"{hkv}) * {d}), got {tuple(qkv.shape)}")
  _checks.check_heads(num_qo_heads, hkv)
  _check_index(batch_indices, "batch_indices", num_tokens)
  _check_index(positions, "positions", num_tokens)
  scales = _kv.check_scales(view.k_pool, k_scale, v_scale,
                            num_kv_heads=view.num_kv_heads)
  ok = _append_contract(view, batch_indices, positions, check, scales,
                        k_scale, v_scale)
  if _kv.is_per_head(scales):  # K and V heads divided, q's unchanged
    one = jnp.ones((num_qo_heads,), jnp.float32)
    per_head = jnp.concatenate(
        [one] + [jnp.broadcast_to(x, (hkv,)) for x in scales])
    qkv = _kv.unit_head_scales(
        qkv.reshape(num_tokens, num_qo_heads + 2 * hkv, d),
        per_head).reshape(qkv.shape)
    scales = (one[0], one[0])
  inv_freq = rope.inv_freq(d)
  interleaved = rope.style == "gptj"
  impl = _checks.resolve_impl(impl)
  heads = qkv.reshape(num_tokens, num_qo_heads + 2 * hkv, d)
  if _nothing_to_write(view, num_tokens):
    q = reference.rope_reference(heads[:, :num_qo_heads], positions,
                                 jnp.asarray(inv_freq), interleaved=interleaved)
    return q, kv_cache

  def body():
    if impl == "pallas":
      from pkvattn.pallas_kernels import rope_append as kernel
      q_out, k_pool, v_pool = kernel.rope_append_qkv(
          qkv, positions, None, None, jnp.asarray(inv_freq), view.k_pool,
          None if view.same_pool else view.v_pool, interleaved=interleaved,
          interpret=not _checks.is_gpu(), paged=_paged(view, batch_indices),
          **_scale_kwargs(scales))
      return q_out, _kv.rebuild(view, k_pool, v_pool)
    q = heads[:, :num_qo_heads]
    k = heads[:, num_qo_heads:num_qo_heads + hkv]
    v = heads[:, num_qo_heads + hkv:]
    return _run(q, k, v, batch_indices, positions, view, inv_freq, interleaved,
                "xla", scales)

  with _contract.unchecked():  # the kernels: their unchecked compilation
    return _guarded(ok, view, body)


def get_batch_indices_positions(
    q_indptr: jax.Array,  # i32[batch_size + 1]
    kv_lens: jax.Array,   # i32[batch_size]
    num_tokens: int,
) -> tuple[jax.Array, jax.Array]:
  """Sequence index and position of every token of a ragged batch (FlashInfer helper).

  Token `t` in `[q_indptr[b], q_indptr[b+1])` belongs to sequence `b` at
  position `kv_lens[b] - q_len[b] + (t - q_indptr[b])` (`kv_lens` includes the
  new tokens). Tokens at or past `q_indptr[-1]` get batch index -1, position 0.

  Args:
    q_indptr: `i32[batch_size + 1]` (array or list), non-decreasing
      cu_seqlens, `[0] == 0`.
    kv_lens: `i32[batch_size]` (array or list), tokens per sequence including
      the new ones.
    num_tokens: static, padded token count.

  Returns:
    `(batch_indices i32[num_tokens], positions i32[num_tokens])`; with
    `batch_size == 0` every token is padding.

  Raises:
    ValueError: non-integer inputs or `q_indptr` not `[batch_size + 1]`.
  """
  q_indptr = _checks.as_index_array(q_indptr)
  kv_lens = _checks.as_index_array(kv_lens)
  _checks.check_int(kv_lens, "kv_lens")
  _checks.check_ndim(kv_lens, (1,), "kv_lens")
  _checks.check_int(q_indptr, "q_indptr")
  _checks.check_shape(q_indptr, (kv_lens.shape[0] + 1,), "q_indptr")
  if int(num_tokens) != num_tokens or num_tokens < 0:
    raise ValueError(f"Invalid num_tokens: expected an int >= 0, got {num_tokens!r}")
  if kv_lens.shape[0] == 0:
    return (jnp.full((int(num_tokens),), -1, jnp.int32),
            jnp.zeros((int(num_tokens),), jnp.int32))
  return reference.token_metadata(q_indptr.astype(jnp.int32),
                                  kv_lens.astype(jnp.int32), int(num_tokens))
