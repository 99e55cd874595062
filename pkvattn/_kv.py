"""Normalises the three kv_cache formats into one view the kernels consume.

Formats (one mechanism serves all three: a pool of pages and a table of page ids
per sequence, for K and for V):
  pair:       `(k_pages, v_pages)`, each `[num_pages, page_size, num_kv_heads, head_dim]`,
              with a shared table `i32[batch_size, max_pages]` (vLLM / FlashInfer NHD).
  pool:       one `[num_pages, page_size, num_kv_heads, head_dim]` pool with a split
              table `i32[batch_size, 2, max_pages]` (TensorRT-LLM: row 0 = K page, row 1 = V page).
  flashinfer: `[num_pages, 2, page_size, num_kv_heads, head_dim]` with a shared table:
              the split case with K at page `2p` and V at `2p + 1` after a free reshape.

Every format becomes `KVView(k_pool, v_pool, k_table, v_table)`, where the kernels read
K block `i` of sequence `b` at `k_pool[k_table[b, i]]` and V at `v_pool[v_table[b, i]]`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pkvattn import _checks
from pkvattn import _contract

Format = Literal["pair", "pool", "flashinfer"]

SUPPORTED_PAGE_SIZES = (8, 16, 32, 64, 128)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# FP8 KV pages (vLLM `--kv-cache-dtype fp8`, FlashInfer `kv_data_type=
# float8_e4m3fn`): stored value = x / scale, saturated to +-FP8_MAX; read as
# value * scale. One f32 scale per K tensor and one per V tensor (per layer),
# or one per KV head of each (`check_scales`).
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
KV_DTYPES = SUPPORTED_DTYPES + (FP8_DTYPE,)


@dataclasses.dataclass(frozen=True)
class KVView:
  k_pool: jax.Array   # [num_pages', page_size, num_kv_heads, head_dim]
  v_pool: jax.Array   # [num_pages', page_size, num_kv_heads, head_dim] (may be k_pool)
  k_table: jax.Array  # i32[batch_size, max_pages]
  v_table: jax.Array  # i32[batch_size, max_pages]
  fmt: Format
  table: jax.Array | None = None  # the caller's table, int32 (kernels that
  #                                 read it in place: no k/v slices)

  @property
  def table_kind(self) -> str:
    """How `table` maps to pool pages: "split" (pool), "flashinfer", "shared"."""
    return {"pool": "split", "flashinfer": "flashinfer"}.get(self.fmt, "shared")

  @property
  def num_pages(self) -> int:
    """Pages the caller's `table` indexes (FlashInfer: `[num_pages, 2, ...]`
    entries, i.e. half the pages of the reshaped pool)."""
    n = self.k_pool.shape[0]
    return n // 2 if self.fmt == "flashinfer" else n

  @property
  def same_pool(self) -> bool:
    return self.fmt != "pair"

  def decode_tables(self):
    """`(k_table, v_table, interleaved_kv)` for the decode kernels
    (`pallas_kernels.paged_decode`): FlashInfer's cache keeps its one table,
    whose entry `t` the kernels read as pages `2 t` (K) and `2 t + 1` (V) of
    the reshaped pool, so no K and V tables are computed before the launch
    (one XLA kernel less per call); other formats give their own tables."""
    if self.fmt == "flashinfer":
      return self.table, self.table, True
    return self.k_table, self.v_table, False

  @property
  def page_size(self) -> int:
    return self.k_pool.shape[1]

  @property
  def num_kv_heads(self) -> int:
    return self.k_pool.shape[2]

  @property
  def head_dim(self) -> int:
    return self.k_pool.shape[3]


def detect_format(kv_cache) -> Format:
  """Returns the format of `kv_cache`, raising ValueError if it fits none."""
  if isinstance(kv_cache, (tuple, list)):
    if len(kv_cache) != 2:
      raise ValueError(
          "Invalid kv_cache: expected a pair (k_pages, v_pages), got a "
          f"sequence of length {len(kv_cache)}")
    return "pair"
  ndim = getattr(kv_cache, "ndim", None)
  if ndim == 4:
    return "pool"
  if ndim == 5:
    if kv_cache.shape[1] != 2:
      raise ValueError(
          "Invalid shape of kv_cache: expected [num_pages, 2, page_size, "
          f"num_kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    return "flashinfer"
  raise ValueError(
      "Invalid kv_cache: expected (k_pages, v_pages), a 4-D pool with a split "
      "table, or a 5-D [num_pages, 2, page_size, num_kv_heads, head_dim] cache; "
      f"got {type(kv_cache).__name__} with ndim={ndim}")


def make_view(kv_cache, page_table) -> KVView:
  """Validates `kv_cache` against `page_table` and returns the normalised view.

  Raises:
    ValueError: the format does not fit the table (a 4-D pool needs a split
      table `[batch_size, 2, max_pages]`, the pair and the 5-D cache a shared
      `[batch_size, max_pages]` one), mismatched K/V shapes or dtypes, an
      unsupported `page_size` / `head_dim` / dtype, or a non-integer table.
  """
  fmt = detect_format(kv_cache)
  _checks.check_int(page_table, "page_table")
  _checks.check_ndim(page_table, (2, 3), "page_table")
  if fmt == "pool":
    if page_table.ndim != 3 or page_table.shape[1] != 2:
      raise ValueError(
          "Invalid shape of page_table: a single 4-D kv_cache pool needs a split "
          "table, expected (batch_size, 2, max_pages), got "
          f"{tuple(page_table.shape)}")
    pool = kv_cache
    _check_pool(pool, "kv_cache")
    table = page_table.astype(jnp.int32)
    return KVView(pool, pool, table[:, 0], table[:, 1], fmt, table)
  if page_table.ndim != 2:
    raise ValueError(
        f"Invalid shape of page_table: kv_cache format {fmt!r} needs a shared "
        f"table, expected (batch_size, max_pages), got {tuple(page_table.shape)}")
  table = page_table.astype(jnp.int32)
  if fmt == "pair":
    k_pages, v_pages = kv_cache
    _check_pool(k_pages, "k_pages")
    _checks.check_shape(v_pages, k_pages.shape, "v_pages")
    _checks.check_same_dtype(v_pages, k_pages, "v_pages", "k_pages")
    return KVView(k_pages, v_pages, table, table, fmt, table)
  # flashinfer: [num_pages, 2, ...] -> [2 * num_pages, ...] is a free reshape.
  n, _, ps, h, d = kv_cache.shape
  pool = kv_cache.reshape(2 * n, ps, h, d)
  _check_pool(pool, "kv_cache")
  k_table = jnp.where(table >= 0, 2 * table, -1)
  v_table = jnp.where(table >= 0, 2 * table + 1, -1)
  return KVView(pool, pool, k_table, v_table, fmt, table)


def rebuild(view: KVView, k_pool, v_pool=None):
  """Returns updated pools in the format `view` came from."""
  if view.fmt == "pair":
    return (k_pool, v_pool)
  if view.fmt == "pool":
    return k_pool
  n2, ps, h, d = k_pool.shape
  return k_pool.reshape(n2 // 2, 2, ps, h, d)


def is_fp8(x) -> bool:
  """Whether an array (or dtype) holds FP8 KV pages."""
  return jnp.dtype(getattr(x, "dtype", x)) == jnp.dtype(FP8_DTYPE)


# The smallest scale accepted: the smallest normal f32 (2**-126), so that the
# quantizers' `1 / scale` is finite (a subnormal scale's reciprocal is inf, and
# `0 * inf` would store NaN) and no backend flushes the scale itself to 0.
MIN_SCALE = float(np.finfo(np.float32).tiny)


def _host_scale(x):
  """`x` as an f32 numpy value if it is known on the host (a Python or numpy
  number, or a numpy array), else None (a jax array, concrete or traced)."""
  if isinstance(x, (bool, np.bool_)):
    return None
  if isinstance(x, (int, float, np.integer, np.floating)):
    with np.errstate(over="ignore"):
      try:
        return np.float32(float(x))
      except OverflowError:  # an int past float's range
        return np.float32(np.inf if x > 0 else -np.inf)
  if isinstance(x, (list, tuple)):
    try:
      x = np.asarray(x, np.float64)
    except (TypeError, ValueError):
      return None
  if isinstance(x, np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
    with np.errstate(over="ignore"):
      return x.astype(np.float32)
  return None


def check_scales(pool, k_scale, v_scale, pool_name: str = "kv_cache",
                 num_kv_heads: int | None = None):
  """Validates the dequantisation scales of `pool` (trace time).

  A scale must be finite and at least `MIN_SCALE` (the smallest normal f32):
  0 would give uniform attention (K) or zeros (V) and store NaN on append, a
  negative scale flips signs, NaN / inf give NaN. Values known on the host
  (Python `int` / `float`, numpy numbers and arrays) are checked here; jax
  arrays (concrete or traced) are checked in checked mode
  (`_contract.scale_contract`),
  so the unchecked path adds no device work and no host sync.

  Args:
    pool: the K (or shared) page pool.
    k_scale, v_scale: for an FP8 pool, each one scale per tensor (a Python
      float or int, a 0-d or `(1,)` array) or, with `num_kv_heads`
      given, one per KV head (`f32[num_kv_heads]`, vLLM's per-head KV
      scales); arrays may be traced. None for other pools.
    num_kv_heads: the pool's KV heads, where per-head scales are accepted.

  Returns:
    `(k_scale, v_scale)` as `f32[]` or `f32[num_kv_heads]` arrays, or
    `(None, None)` for a pool that is not FP8.

  Raises:
    ValueError: an FP8 pool without both scales, a scale of another shape,
      a host scale that is not finite or below `MIN_SCALE`, or scales given
      with a pool that is not FP8 (they would be ignored).
  """
  if not is_fp8(pool):
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
      if x is not None:
        raise ValueError(
            f"Invalid {name}: expected None for a {jnp.dtype(pool.dtype)} "
            f"{pool_name} (scales apply to float8_e4m3fn pages), got {x!r}")
    return None, None
  out = []
  for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
    if x is None:
      raise ValueError(
          f"Invalid {name}: expected an f32 scalar for a float8_e4m3fn "
          f"{pool_name} (stored value = x / scale), got None")
    host = _host_scale(x)
    if host is not None:
      x = host
    x = jnp.asarray(x)
    per_head = (num_kv_heads is not None and num_kv_heads > 1
                and x.shape == (num_kv_heads,))
    if not per_head and (x.size != 1 or x.ndim > 1):
      heads = ("" if num_kv_heads is None else
               f" or ({num_kv_heads},) (one per KV head)")
      raise ValueError(
          f"Invalid shape of {name}: expected () (one scale per tensor)"
          f"{heads}, got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(
          f"Invalid dtype of {name}: expected a float, got {x.dtype}")
    if host is not None:
      values = np.asarray(host, np.float64).reshape(-1)
      if not (np.isfinite(values).all() and (values >= MIN_SCALE).all()):
        raise ValueError(
            f"Invalid {name}: expected a finite scale >= {MIN_SCALE:.4g} "
            f"(the smallest normal f32; stored value = x / scale), got "
            f"{_scale_repr(k_scale if name == 'k_scale' else v_scale)}")
    out.append((x if per_head else x.reshape(())).astype(jnp.float32))
  return tuple(out)


def is_per_head(scales) -> bool:
  """`check_scales`' result holds a per-KV-head scale."""
  return scales[0] is not None and max(s.ndim for s in scales) == 1


def unit_head_scales(x, scale):
  """`x` `[num_tokens, num_kv_heads, head_dim]` divided by its head's
  `scale` (`f32[num_kv_heads]`), so that a write with scale 1 stores
  `x / scale` per head: how the append ops take per-head scales (K's RoPE
  is linear per head, so the division commutes with the rotation). Divided
  in f32, then back to `x`'s dtype: a bf16 `x` is rounded to bf16 before
  FP8, which moves a value by at most one FP8 step, and only next to a
  rounding tie."""
  return (x.astype(jnp.float32) / scale[:, None]).astype(x.dtype)


def _scale_repr(x) -> str:
  """A scale as the caller gave it, for error messages (a huge int as its
  f32 value)."""
  shown = repr(x.tolist()) if isinstance(x, np.ndarray) else repr(x)
  return shown if len(shown) <= 32 else f"{_host_scale(x)} (as f32)"


def run_scale_contract(scales, k_scale, v_scale):
  """Checked mode's clause on the scales given as jax arrays.

  `scales` is `check_scales`' result for the caller's `k_scale`, `v_scale`;
  host numbers were checked there, so only jax arrays (concrete or traced)
  go to `_contract.scale_contract`. Returns `_contract.run`'s result (None
  when eager or when there is nothing to check; `bool[]` when staged).
  """
  arrays = tuple(None if s is None or _host_scale(x) is not None else s
                 for s, x in zip(scales, (k_scale, v_scale)))
  if arrays == (None, None):
    return None
  return _contract.run(_contract.scale_contract, *arrays)


def quantize(x, scale):
  """`x * (1 / scale)` saturated to `[-FP8_MAX, FP8_MAX]`, as float8_e4m3fn.

  Overflow (and +-inf) saturates instead of becoming NaN (e4m3fn has no
  infinity); NaN stays NaN. Follows vLLM's `scaled_fp8_quant` / FlashInfer.
  """
  # Multiplied by the f32 reciprocal (one multiply per value in the
  # kernels, as vLLM's quantization kernels do); `rope_append` does the same.
  y = x.astype(jnp.float32) * (1.0 / jnp.asarray(scale, jnp.float32))
  return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def as_bytes(x):
  """FP8 values `x` as `uint8` of the same shape (a bitcast, no copy).

  The XLA paths move FP8 pages as bytes: gathers and scatters of `uint8`
  run natively on every backend, where some (the CPU's among them) widen an
  FP8 gather or scatter to f16 or f32, converting the whole operand (the
  pool) first.
  """
  return jax.lax.bitcast_convert_type(x, jnp.uint8)


def from_bytes(x):
  """Inverse of `as_bytes`: `uint8` bytes as float8_e4m3fn (a bitcast)."""
  return jax.lax.bitcast_convert_type(x, FP8_DTYPE)


def _check_pool(pool, name: str) -> None:
  _checks.check_ndim(pool, (4,), name)
  _checks.check_dtype(pool, KV_DTYPES, name)
  _, page_size, _, head_dim = pool.shape
  if page_size not in SUPPORTED_PAGE_SIZES:
    raise ValueError(
        f"Invalid page_size of {name}: expected one of {SUPPORTED_PAGE_SIZES}, "
        f"got {page_size}")
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise ValueError(
        f"Invalid head_dim of {name}: expected one of {SUPPORTED_HEAD_DIMS}, "
        f"got {head_dim}")
