"""Shared builders and an independent numpy oracle for the attention tests.

`make_paged` builds a paged KV cache in any of the three formats from random
contiguous K/V, with shuffled page ids, -1 in unused table entries, and NaN in
every page a sequence does not own and in every row past `kv_lens[b]` of its
last page. `dense_attention` is the tests' own float64 numpy reference (it does
not use pallas_kernels/reference.py, which is itself under test).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pkvattn import _kv

ATOL = {
    np.dtype(jnp.float32): 2e-5,
    np.dtype(jnp.bfloat16): 2e-2,
    np.dtype(jnp.float16): 3e-3,
}
RTOL = {k: v for k, v in ATOL.items()}

FORMATS = ("pair", "pool", "flashinfer")
FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass
class Paged:
  kv_cache: object          # format-specific
  page_table: np.ndarray    # i32[B, P] or i32[B, 2, P]
  k: list                   # per sequence f32[kv_len, Hkv, D] (contiguous truth)
  v: list
  kv_lens: np.ndarray       # i32[B]


def make_paged(rng: np.random.Generator, kv_lens, *, page_size, num_kv_heads,
               head_dim, dtype, fmt, max_pages=None, extra_pages=3) -> Paged:
  kv_lens = np.asarray(kv_lens, np.int32)
  b = len(kv_lens)
  need = [-(-int(n) // page_size) for n in kv_lens]
  if max_pages is None:
    max_pages = max(max(need), 1)
  # Split format uses separate K and V pages out of one pool; the others one id per block.
  per_block = 2 if fmt == "pool" else 1
  total = sum(need) * per_block + extra_pages
  ids = rng.permutation(total).astype(np.int32)
  shape = (total, page_size, num_kv_heads, head_dim)
  np_dtype = np.float32
  k_pool = np.full(shape, np.nan, np_dtype)
  v_pool = np.full(shape, np.nan, np_dtype)
  if fmt == "pool":
    table = np.full((b, 2, max_pages), -1, np.int32)
  else:
    table = np.full((b, max_pages), -1, np.int32)
  ks, vs = [], []
  cursor = 0
  for i, n in enumerate(kv_lens):
    k = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np_dtype)
    v = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np_dtype)
    # Round through the storage dtype so the oracle sees what the kernel sees.
    k = np.asarray(jnp.asarray(k, dtype).astype(jnp.float32))
    v = np.asarray(jnp.asarray(v, dtype).astype(jnp.float32))
    ks.append(k)
    vs.append(v)
    for blk in range(need[i]):
      rows = slice(blk * page_size, min((blk + 1) * page_size, n))
      r = rows.stop - rows.start
      if fmt == "pool":
        kp, vp = ids[cursor], ids[cursor + 1]
        cursor += 2
        table[i, 0, blk], table[i, 1, blk] = kp, vp
      else:
        kp = vp = ids[cursor]
        cursor += 1
        table[i, blk] = kp
      k_pool[kp, :r] = k[rows]
      v_pool[vp, :r] = v[rows]
  if fmt == "pool":
    # K and V pages live in one pool: merge (they never overlap).
    pool = np.where(np.isnan(k_pool), v_pool, k_pool)
    kv_cache = jnp.asarray(pool, dtype)
  elif fmt == "pair":
    kv_cache = (jnp.asarray(k_pool, dtype), jnp.asarray(v_pool, dtype))
  else:
    kv_cache = jnp.asarray(np.stack([k_pool, v_pool], axis=1), dtype)
  return Paged(kv_cache, table, ks, vs, kv_lens)


def dense_attention(q, k, v, q_positions, kv_len, *, causal=True,
                    window_left=-1, sm_scale, logits_soft_cap=None, sinks=None):
  """float64 oracle for one sequence.

  q f32[T, Hq, D]; k, v f32[kv_len, Hkv, D]; q_positions i[T].
  Returns (out f64[T, Hq, D], lse f64[T, Hq]); rows with no visible key are
  zeros / -inf.
  """
  q = np.asarray(q, np.float64)
  k = np.asarray(k, np.float64)[:kv_len]
  v = np.asarray(v, np.float64)[:kv_len]
  t, hq, d = q.shape
  hkv = k.shape[1]
  g = hq // hkv
  kh = np.repeat(k, g, axis=1)  # [S, Hq, D]
  vh = np.repeat(v, g, axis=1)
  s = np.einsum("thd,shd->ths", q, kh) * sm_scale
  if logits_soft_cap:
    s = logits_soft_cap * np.tanh(s / logits_soft_cap)
  j = np.arange(kv_len)[None, :]
  i = np.asarray(q_positions)[:, None]
  mask = np.ones((t, kv_len), bool)
  if causal:
    mask &= j <= i
  if window_left >= 0:
    mask &= j >= i - window_left
  mask = mask[:, None, :]
  s = np.where(mask, s, -np.inf)
  m = s.max(axis=-1, initial=-np.inf)
  if sinks is not None:
    m = np.maximum(m, np.asarray(sinks, np.float64)[None, :])
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.where(mask, np.exp(s - m[..., None]), 0.0)
  den = p.sum(-1)
  with np.errstate(divide="ignore"):
    lse = np.where(den > 0, np.log(den) + m, -np.inf)
  if sinks is not None:
    den = den + np.exp(np.asarray(sinks, np.float64)[None, :] - m)
  out = np.einsum("ths,shd->thd", p, vh) / np.where(den > 0, den, 1.0)[..., None]
  return out, lse


def paged_decode_case(rng, *, group, head_dim, page_size, fmt, kw,
                      num_kv_heads=2, kv_lens=(0, 1, 7, 129, 4095),
                      dtype=jnp.bfloat16):
  """Inputs of a paged decode oracle test: `(paged, q, sinks, kw)`, the
  NaN-poisoned cache of `make_paged`, q `[B, group * num_kv_heads,
  head_dim]` of `dtype`, sinks `f32[num_qo_heads]` where `kw` has
  `sinks=True` (else None), and `kw` without that key."""
  p = make_paged(rng, list(kv_lens), page_size=page_size,
                 num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                 fmt=fmt)
  hq = group * num_kv_heads
  q = jnp.asarray(rng.standard_normal((len(kv_lens), hq, head_dim)), dtype)
  kw = dict(kw)
  sinks = (jnp.asarray(rng.standard_normal(hq) * 2, jnp.float32)
           if kw.pop("sinks", False) else None)
  return p, q, sinks, kw


def assert_decode_matches(out, lse, q, k, v, kv_lens, dtype, *, sm_scale,
                          window_left=-1, logits_soft_cap=None, sinks=None):
  """Each decode row `b` of `out [B, Hq, D]` / `lse [B, Hq]` against
  `dense_attention` over its truth `k[b]`, `v[b]` (query at kv_lens[b] - 1)."""
  for b, n in enumerate(kv_lens):
    want, want_lse = dense_attention(
        q[b:b + 1], k[b], v[b], [n - 1], n, sm_scale=sm_scale,
        window_left=window_left, logits_soft_cap=logits_soft_cap, sinks=sinks)
    assert_close(out[b:b + 1], want, dtype, f"b={b}")
    assert_lse_close(lse[b], want_lse[0], dtype)


def assert_prefill_matches(out, lse, q, k, v, q_indptr, kv_lens, dtype, *,
                           sm_scale, window_left=-1, logits_soft_cap=None):
  """Each sequence's rows of a ragged prefill `out [T, Hq, D]` / `lse [T,
  Hq]` against `dense_attention` (its new tokens are its last positions),
  and zeros for the padding tokens past `q_indptr[-1]`."""
  for b, n in enumerate(kv_lens):
    rows = slice(q_indptr[b], q_indptr[b + 1])
    pos = np.arange(n - (q_indptr[b + 1] - q_indptr[b]), n)
    want, want_lse = dense_attention(
        q[rows], k[b], v[b], pos, n, sm_scale=sm_scale,
        window_left=window_left, logits_soft_cap=logits_soft_cap)
    assert_close(out[rows], want, dtype, f"b={b}")
    assert_lse_close(lse[rows], want_lse, dtype)
  assert not np.asarray(out[q_indptr[-1]:], np.float32).any()


def assert_close(actual, expected, dtype, what=""):
  actual = np.asarray(jnp.asarray(actual).astype(jnp.float32), np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  assert not np.isnan(actual).any(), f"NaN in {what}"
  atol = ATOL[np.dtype(dtype)]
  np.testing.assert_allclose(actual, expected, atol=atol, rtol=RTOL[np.dtype(dtype)],
                             err_msg=what)


def assert_lse_close(actual, expected, dtype, what="lse"):
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape
  both_inf = np.isneginf(actual) & np.isneginf(expected)
  assert (np.isneginf(actual) == np.isneginf(expected)).all(), what
  atol = 10 * ATOL[np.dtype(dtype)]
  np.testing.assert_allclose(np.where(both_inf, 0, actual),
                             np.where(both_inf, 0, expected), atol=atol,
                             rtol=1e-3, err_msg=what)


def assert_tile_rows(seq, kv, off, rows, q_indptr, q_lens, kv_lens) -> None:
  """A plan tile's metadata is right for each token in `rows` it covers:
  its sequence, that sequence's kv_len, and `token + off` = the token's
  position (padding tokens past `q_indptr[-1]`: kv_len 0)."""
  for t in rows:
    if t < q_indptr[-1]:
      b = np.searchsorted(q_indptr[1:], t, side="right")
      assert seq == b and kv == kv_lens[b]
      assert t + off == kv_lens[b] - q_lens[b] + (t - q_indptr[b])
    else:
      assert kv == 0


def prompt_prefill_inputs(prompts, *, num_layers: int, page_size: int,
                          num_slots: int, num_tokens: int, seed: int = 0):
  """A one-step ragged prefill of `prompts` (lists of token ids) over a
  multi-layer pool whose slots are shuffled.

  Returns `(tokens i32[num_tokens], q_indptr i32[batch_size + 1], plan)`:
  the prompts laid out back to back (zero padding), and an `AttentionPlan`
  whose per-layer tables point into `num_slots` shuffled slots.
  """
  from pkvattn.flax import AttentionPlan, layer_page_tables
  lens = [len(p) for p in prompts]
  max_pages = max(-(-n // page_size) for n in lens)
  order = iter(np.random.default_rng(seed).permutation(num_slots))
  slot_table = np.full((len(lens), max_pages), -1, np.int32)
  for b, n in enumerate(lens):
    for i in range(-(-n // page_size)):
      slot_table[b, i] = next(order)
  tokens = np.zeros(num_tokens, np.int32)
  tokens[:sum(lens)] = np.concatenate(prompts)
  q_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  plan = AttentionPlan.create(
      layer_page_tables(jnp.asarray(slot_table), num_layers), q_indptr,
      np.asarray(lens, np.int32), num_tokens)
  return tokens, q_indptr, plan


# ---------------------------------------------------------------- FP8 pages

def quantize_np(x, scale):
  """The storage rule in numpy, as `pkvattn._kv.quantize` computes it: x times
  the f32 reciprocal of scale, saturated, cast (NaN stays). Not numpy's
  exactly rounded `x / scale`: for about one value in five million the
  quotient sits on an e4m3 rounding tie where the product is a hair past it,
  and the two store neighbouring e4m3 values."""
  r = np.float32(1) / np.float32(scale)
  y = np.clip(np.asarray(x, np.float32) * r, -448, 448)
  return y.astype(ml_dtypes.float8_e4m3fn)


def fp8_paged(rng, kv_lens, *, page_size, num_kv_heads, head_dim, fmt):
  """`make_paged` in f32, then quantized: (paged with FP8 kv_cache and the
  dequantized per-sequence K/V truths, k_scale, v_scale)."""
  p = make_paged(rng, kv_lens, page_size=page_size,
                    num_kv_heads=num_kv_heads, head_dim=head_dim,
                    dtype=jnp.float32, fmt=fmt)
  amax_k = max(float(np.abs(k).max()) for k in p.k if k.size)
  amax_v = max(float(np.abs(v).max()) for v in p.v if v.size)
  ks, vs = amax_k / 448 * 1.5, amax_v / 448
  if fmt == "pair":
    cache = (_kv.quantize(p.kv_cache[0], ks), _kv.quantize(p.kv_cache[1], vs))
  elif fmt == "flashinfer":
    cache = jnp.stack([_kv.quantize(p.kv_cache[:, 0], ks),
                       _kv.quantize(p.kv_cache[:, 1], vs)], axis=1)
  else:  # one pool holds K and V pages: quantize each page with its scale
    is_v = np.zeros(p.kv_cache.shape[0], bool)
    is_v[p.page_table[:, 1][p.page_table[:, 1] >= 0]] = True
    pool = np.asarray(p.kv_cache)
    cache = jnp.asarray(np.where(
        is_v[:, None, None, None],
        quantize_np(pool, vs).astype(np.float32),
        quantize_np(pool, ks).astype(np.float32)), FP8)
  deq = lambda x, s: quantize_np(x, s).astype(np.float64) * s  # noqa: E731
  truth_k = [deq(k, ks) for k in p.k]
  truth_v = [deq(v, vs) for v in p.v]
  return p, cache, truth_k, truth_v, ks, vs


def query_and_sinks(rng, batch, num_qo_heads, head_dim, kw):
  """A decode query (f32 holding bf16 values, `[batch, num_qo_heads,
  head_dim]`) and, where `kw` has `sinks=True`, f32 sinks
  `[num_qo_heads]` (else None); returns (q, sinks, kw without "sinks")."""
  q = np.asarray(jnp.asarray(rng.standard_normal((batch, num_qo_heads,
                                                  head_dim)),
                             jnp.bfloat16).astype(jnp.float32))
  kw = dict(kw)
  sinks = None
  if kw.pop("sinks", False):
    sinks = rng.standard_normal(num_qo_heads).astype(np.float32)
  return q, sinks, kw


def primitive_names(jaxpr) -> set[str]:
  """Names of the primitives in `jaxpr` and every jaxpr nested in it."""
  out = set()
  for eqn in jaxpr.eqns:
    out.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      out |= primitive_names(sub)
  return out


@contextlib.contextmanager
def cuda_target(device_kind: str = "NVIDIA H100 80GB HBM3"):
  """Lowering for CUDA on a machine without a GPU, as for `device_kind`.
  jax 0.11 and later take the compute capability a Pallas-Triton kernel is
  lowered for from the default device or the abstract mesh's device, and
  refuse a CPU ("No supported GPU devices found"); jax 0.10 needed no device.
  On a GPU machine the GPU itself is the target."""
  if jax.default_backend() == "gpu":
    yield
    return
  device = jax.sharding.AbstractDevice(device_kind=device_kind,
                                       num_cores=None, platform="gpu")
  with jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((), (), abstract_device=device)):
    yield


def runs_a_kernel(fn) -> bool:
  """Whether `fn()` runs a Pallas kernel: a `pallas_call` in its jaxpr (the
  Triton kernels, and every kernel interpreted on a CPU) or, on a GPU, a
  Mosaic-GPU kernel in its lowering (jax 0.11 traces `pl.kernel` into
  primitives of its own, without a `pallas_call`)."""
  if "pallas_call" in primitive_names(jax.make_jaxpr(fn)().jaxpr):
    return True
  return (jax.default_backend() == "gpu"
          and "mosaic_gpu" in jax.jit(fn).lower().as_text())
