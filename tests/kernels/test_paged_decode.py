"""Paged decode: Pallas kernel (interpret mode on CPU) and xla path vs the float64 oracle.

Each case packs several edge lengths ({0, 1, ps-1, ps, ps+1, max}) into one
batch, with shuffled page ids and NaN in every page a sequence does not own and
in every row past its length (`make_paged`). The kernel runs on a subset
that still covers all three formats, group sizes 1/4/8, page sizes 8/16, the
split-K combine (k_splits > 1), window, soft cap, sinks and lse; the xla path
runs the wider matrix. Also: determinism, kv_lens == 0, merge_state, and the
public API's ValueErrors.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import pkvattn
from pkvattn import _kv
from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import paged_decode as kernel
from attention_utils import (FORMATS, assert_close, assert_lse_close,
                             dense_attention, make_paged)

HEAD_DIM = 64
NUM_KV_HEADS = 2


def _lens(page_size, max_len):
  return [0, 1, page_size - 1, page_size, page_size + 1, max_len]


def _case(rng, fmt, group_size, page_size, dtype, kv_lens, sinks):
  p = make_paged(rng, kv_lens, page_size=page_size, num_kv_heads=NUM_KV_HEADS,
                 head_dim=HEAD_DIM, dtype=dtype, fmt=fmt)
  hq = group_size * NUM_KV_HEADS
  q = rng.standard_normal((len(kv_lens), hq, HEAD_DIM)).astype(np.float32)
  q = np.asarray(jnp.asarray(q, dtype).astype(jnp.float32))
  s = rng.standard_normal(hq).astype(np.float32) if sinks else None
  return p, q, s


def _check(out, lse, p, q, sinks, dtype, *, window_left=-1, soft_cap=None):
  assert out.shape == q.shape and out.dtype == dtype
  assert lse.shape == q.shape[:2] and lse.dtype == jnp.float32
  for b, n in enumerate(p.kv_lens):
    exp, exp_lse = dense_attention(
        q[b:b + 1], p.k[b], p.v[b], [n - 1], n, sm_scale=HEAD_DIM**-0.5,
        window_left=window_left, logits_soft_cap=soft_cap, sinks=sinks)
    assert_close(out[b:b + 1], exp, dtype, f"b={b} kv_len={n}")
    assert_lse_close(lse[b], exp_lse[0], dtype, f"lse b={b} kv_len={n}")


def _run_kernel(p, q, sinks, dtype, config, **kw):
  """Kernel in interpret mode with an explicit config (public API otherwise);
  FlashInfer's cache through its one interleaved table, as the public op
  passes it."""
  view = _kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
  k_table, v_table, il = view.decode_tables()
  return kernel.paged_decode(
      jnp.asarray(q, dtype), view.k_pool, view.v_pool, k_table, v_table,
      jnp.asarray(p.kv_lens), None if sinks is None else jnp.asarray(sinks),
      sm_scale=HEAD_DIM**-0.5, window_left=kw.get("window_left", -1),
      logits_soft_cap=kw.get("soft_cap"), interpret=True, config=config,
      interleaved_kv=il)


# (fmt, group_size, page_size, dtype, window_left, soft_cap, sinks, config)
KERNEL_CASES = [
    ("pair", 4, 16, jnp.float32, -1, None, False, None),
    ("pool", 8, 8, jnp.bfloat16, -1, None, True, kernel.TritonConfig(2, 1)),
    ("flashinfer", 1, 16, jnp.float32, 20, 5.0, False, kernel.TritonConfig(1, 4)),
    ("pair", 8, 16, jnp.float16, 30, None, True, kernel.TritonConfig(2, 2)),
    ("pool", 4, 8, jnp.float32, -1, 10.0, True, kernel.TritonConfig(4, 4)),
    ("flashinfer", 4, 8, jnp.bfloat16, 9, None, False, kernel.TritonConfig(1, 2)),
    # Page ids loaded a step ahead, with and without splits.
    ("pool", 8, 8, jnp.bfloat16, -1, None, True,
     kernel.TritonConfig(2, 1, prefetch_ids=True)),
    ("flashinfer", 4, 8, jnp.float32, 9, 5.0, False,
     kernel.TritonConfig(2, 2, prefetch_ids=True)),
]


@pytest.mark.parametrize(
    "fmt,group_size,page_size,dtype,window_left,soft_cap,sinks,config",
    KERNEL_CASES)
def test_kernel_matches_oracle(fmt, group_size, page_size, dtype, window_left,
                               soft_cap, sinks, config):
  rng = np.random.default_rng(hash((fmt, group_size, page_size)) % 2**32)
  kv_lens = _lens(page_size, 5 * page_size + 3)
  p, q, s = _case(rng, fmt, group_size, page_size, dtype, kv_lens, sinks)
  out, lse = _run_kernel(p, q, s, dtype, config, window_left=window_left,
                         soft_cap=soft_cap)
  _check(out, lse, p, q, s, dtype, window_left=window_left, soft_cap=soft_cap)
  # Determinism: same inputs, bit-identical outputs.
  out2, lse2 = _run_kernel(p, q, s, dtype, config, window_left=window_left,
                           soft_cap=soft_cap)
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(out2, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))


def test_kernel_public_api_interpret():
  """impl="pallas" off-GPU runs the kernel in interpret mode (default
  config)."""
  rng = np.random.default_rng(1)
  p, q, _ = _case(rng, "pool", 4, 16, jnp.float32, [17, 0, 40], False)
  out, lse = pkvattn.paged_decode(
      jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table),
      jnp.asarray(p.kv_lens), return_lse=True, impl="pallas", window_left=20)
  _check(out, lse, p, q, None, jnp.float32, window_left=20)


@pytest.mark.parametrize("config", [None, kernel.TritonConfig(1, 4)])
def test_kernel_all_empty(config):
  """kv_lens == 0 everywhere (all table entries -1): zeros and lse = -inf."""
  rng = np.random.default_rng(2)
  p, q, s = _case(rng, "pair", 4, 8, jnp.float32, [0, 0], True)
  out, lse = _run_kernel(p, q, s, jnp.float32, config)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  assert np.isneginf(np.asarray(lse)).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size", [1, 4, 8])
@pytest.mark.parametrize("page_size", [8, 16])
def test_xla_matches_oracle(fmt, group_size, page_size):
  rng = np.random.default_rng(group_size * 100 + page_size)
  # Rotate the options over the matrix so every combination shows up somewhere.
  k = (FORMATS.index(fmt) + group_size + page_size) % 4
  window_left = (-1, 7, -1, 25)[k]
  soft_cap = (None, None, 8.0, 3.0)[k]
  sinks = k in (1, 2)
  dtype = (jnp.float32, jnp.bfloat16)[k % 2]
  p, q, s = _case(rng, fmt, group_size, page_size, dtype,
                  _lens(page_size, 4 * page_size + 5), sinks)
  out, lse = pkvattn.paged_decode(
      jnp.asarray(q, dtype), p.kv_cache, jnp.asarray(p.page_table),
      jnp.asarray(p.kv_lens), window_left=window_left,
      logits_soft_cap=soft_cap, sinks=None if s is None else jnp.asarray(s),
      return_lse=True, impl="xla")
  _check(out, lse, p, q, s, dtype, window_left=window_left, soft_cap=soft_cap)


def test_return_lse_false_returns_array():
  rng = np.random.default_rng(3)
  p, q, _ = _case(rng, "pair", 4, 8, jnp.float32, [5, 9], False)
  out = pkvattn.paged_decode(jnp.asarray(q), p.kv_cache,
                             jnp.asarray(p.page_table), jnp.asarray(p.kv_lens),
                             impl="xla")
  assert isinstance(out, jax.Array) and out.shape == q.shape


# ----------------------------------------------------------------------------
# merge_state
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_merge_state_of_two_key_halves_equals_full(impl):
  """Keys [0, h) (query at h-1) merged with keys [h, n) (window) == keys [0, n)."""
  rng = np.random.default_rng(4)
  n, h = 37, 15
  p, q, _ = _case(rng, "pair", 4, 8, jnp.float32, [n, n], False)
  args = (jnp.asarray(q), p.kv_cache, jnp.asarray(p.page_table))
  full_len = jnp.asarray([n, n], jnp.int32)
  out_a, lse_a = pkvattn.paged_decode(*args, jnp.asarray([h, h], jnp.int32),
                                      return_lse=True, impl=impl)
  out_b, lse_b = pkvattn.paged_decode(*args, full_len, window_left=n - h - 1,
                                      return_lse=True, impl=impl)
  out, lse = pkvattn.merge_state(out_a, lse_a, out_b, lse_b)
  exp_out, exp_lse = pkvattn.paged_decode(*args, full_len, return_lse=True,
                                          impl="xla")
  np.testing.assert_allclose(np.asarray(out), np.asarray(exp_out), atol=2e-5,
                             rtol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(exp_lse), atol=2e-5,
                             rtol=2e-5)


def test_merge_state_neg_inf():
  rng = np.random.default_rng(5)
  out_a = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
  out_b = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
  lse_a = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
  ninf = jnp.full((3, 4), -jnp.inf, jnp.float32)
  # One side empty: the other passes through unchanged.
  out, lse = pkvattn.merge_state(out_a, lse_a, jnp.zeros_like(out_b), ninf)
  np.testing.assert_allclose(np.asarray(out), np.asarray(out_a), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_a), rtol=1e-6)
  out, lse = pkvattn.merge_state(jnp.zeros_like(out_a), ninf, out_b, lse_a)
  np.testing.assert_allclose(np.asarray(out), np.asarray(out_b), rtol=1e-6)
  # Both empty: zeros and -inf, no NaN.
  out, lse = pkvattn.merge_state(out_a, ninf, out_b, ninf)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  assert np.isneginf(np.asarray(lse)).all()
  # Equal lse: the mean, lse + log 2.
  out, lse = pkvattn.merge_state(out_a, lse_a, out_b, lse_a)
  np.testing.assert_allclose(np.asarray(out), np.asarray((out_a + out_b) / 2),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_a) + np.log(2),
                             rtol=1e-6)


def test_merge_state_bad_shapes():
  o = jnp.zeros((2, 4, 8))
  l = jnp.zeros((2, 4))
  with pytest.raises(ValueError, match="out_b"):
    pkvattn.merge_state(o, l, jnp.zeros((2, 4, 16)), l)
  with pytest.raises(ValueError, match="lse_a"):
    pkvattn.merge_state(o, jnp.zeros((2,)), o, l)
  with pytest.raises(ValueError, match="lse_b"):
    pkvattn.merge_state(o, l, o, jnp.zeros((4, 2)))


# ----------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------


def _good():
  q = jnp.zeros((2, 8, 64), jnp.bfloat16)
  k = v = jnp.zeros((6, 16, 2, 64), jnp.bfloat16)
  table = jnp.zeros((2, 3), jnp.int32)
  kv_lens = jnp.asarray([5, 20], jnp.int32)
  return q, (k, v), table, kv_lens


@pytest.mark.parametrize("mutate,match", [
    (lambda q, c, t, n: (q[0], c, t, n), "rank of q"),
    (lambda q, c, t, n: (q.astype(jnp.float32), c, t, n), "dtype of kv_cache"),
    (lambda q, c, t, n: (q.astype(jnp.int32), c, t, n), "dtype of q"),
    (lambda q, c, t, n: (q[..., :32], c, t, n), "head_dim of q"),
    (lambda q, c, t, n: (q[:, :6], (c[0][:, :, :1].repeat(4, 2),
                                    c[1][:, :, :1].repeat(4, 2)), t, n),
     "multiple of num_kv_heads"),
    (lambda q, c, t, n: (q, c, t[None, None], n), "rank of page_table"),
    (lambda q, c, t, n: (q, c, t[:, None].repeat(2, 1), n), "shared"),
    (lambda q, c, t, n: (q, c[0], t, n), "split"),
    (lambda q, c, t, n: (q, c[0][:, None].repeat(3, 1), t, n), "kv_cache"),
    (lambda q, c, t, n: (q, jnp.stack(c, 1), t[:, None].repeat(2, 1), n),
     "shared"),
    (lambda q, c, t, n: (q, c, t.astype(jnp.float32), n), "page_table"),
    (lambda q, c, t, n: (q, c, t[:1], n), "page_table"),
    (lambda q, c, t, n: (q, c, t, n[:1]), "kv_lens"),
    (lambda q, c, t, n: (q, c, t, n.astype(jnp.float32)), "kv_lens"),
    (lambda q, c, t, n: (q, (c[0], c[1][:3]), t, n), "v_pages"),
    (lambda q, c, t, n: (q, (c[0], c[1].astype(jnp.float16)), t, n), "v_pages"),
    (lambda q, c, t, n: (q[..., :48].repeat(2, -1)[..., :96],
                         (jnp.zeros((6, 16, 2, 96), jnp.bfloat16),) * 2, t, n),
     "head_dim"),
    (lambda q, c, t, n: (q, (jnp.zeros((6, 24, 2, 64), jnp.bfloat16),) * 2, t,
                         n), "page_size"),
    (lambda q, c, t, n: (q, (c[0], c[1], c[0]), t, n), "pair"),
])
def test_bad_input_raises(mutate, match):
  args = mutate(*_good())
  with pytest.raises(ValueError, match=match):
    pkvattn.paged_decode(*args, impl="xla")


def test_bad_sinks_and_window():
  q, c, t, n = _good()
  with pytest.raises(ValueError, match="sinks"):
    pkvattn.paged_decode(q, c, t, n, sinks=jnp.zeros((4,)), impl="xla")
  with pytest.raises(ValueError, match="window_left"):
    pkvattn.paged_decode(q, c, t, n, window_left=-2, impl="xla")
  with pytest.raises(ValueError, match="impl"):
    pkvattn.paged_decode(q, c, t, n, impl="cuda")


def test_kernel_not_implemented_and_config_validation():
  q = jnp.zeros((1, 2, 96), jnp.float32)
  pool = jnp.zeros((2, 8, 1, 96), jnp.float32)
  t = jnp.zeros((1, 1), jnp.int32)
  with pytest.raises(NotImplementedError, match="head_dim"):
    kernel.paged_decode(q, pool, pool, t, t, jnp.ones((1,), jnp.int32),
                        sm_scale=1.0, interpret=True)
  base = dict(dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, head_dim=128,
              page_size=16)
  assert kernel.supports(**base) is None
  for kw in (dict(kv_dtype=jnp.float8_e4m3fn),
             dict(dtype=jnp.float32, kv_dtype=jnp.float8_e4m3fn),
             dict(dtype=jnp.float16, kv_dtype=jnp.float16, head_dim=64,
                  page_size=128), dict(head_dim=256, page_size=8)):
    assert kernel.supports(**{**base, **kw}) is None, kw
  for kw, word in ((dict(dtype=jnp.int8, kv_dtype=jnp.int8), "dtype"),
                   (dict(kv_dtype=jnp.float16), "pages"),
                   (dict(head_dim=96), "head_dim"),
                   (dict(page_size=4), "page_size"),
                   (dict(page_size=48), "page_size"),
                   (dict(page_size=256), "page_size")):
    assert word in kernel.supports(**{**base, **kw}), kw
  for kw, match in ((dict(k_splits=3), "k_splits"),
                    (dict(pages_per_block=0), "pages_per_block"),
                    (dict(num_warps=16), "num_warps"),
                    (dict(num_stages=0), "num_stages"),
                    (dict(kv_eviction="evict_sometimes"), "kv_eviction"),
                    (dict(fp8_convert="asm"), "fp8_convert"),
                    (dict(prefetch_ids=1), "prefetch_ids")):
    with pytest.raises(ValueError, match=match):
      kernel.TritonConfig(**{**dict(pages_per_block=2, k_splits=1), **kw})
  for kw, match in ((dict(k_splits=3), "k_splits"),
                    (dict(k_splits=128), "k_splits"),
                    (dict(k_splits=2, tiles=3), "tiles")):
    with pytest.raises(ValueError, match=match):
      kernel.MmaConfig(**kw)
  q = jnp.zeros((1, 2, 64), jnp.float32)
  pool = jnp.zeros((2, 8, 1, 64), jnp.float32)
  with pytest.raises(ValueError, match="TritonConfig or an MmaConfig"):
    kernel.paged_decode(q, pool, pool, t, t, jnp.ones((1,), jnp.int32),
                        sm_scale=1.0, interpret=True,
                        config=dispatch.Choice("triton", None))


def _default(batch_size, num_kv_heads, max_pages, head_dim, page_size=16,
             gpu=dispatch.AMPERE):
  return dispatch.decode(
      gpu=gpu, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, head_dim=head_dim,
      group_size=4, page_size=page_size, batch_size=batch_size,
      num_kv_heads=num_kv_heads, max_pages=max_pages).config


def test_default_config_heuristics():
  """The Triton rule (a GPU other than Hopper): enough programs for the SMs,
  but no split without two steps of the longest sequence."""
  c = _default(64, 8, 256, 128)
  assert c.pages_per_block * 16 >= 64
  assert c.k_splits == 1  # 512 programs already fill 132 SMs
  c = _default(8, 8, 1024, 128)
  assert c.k_splits >= 4  # 64 programs alone would leave SMs idle
  c = _default(1, 1, 2, 64, page_size=64)
  assert c.k_splits == 1  # too short to split
  c = _default(256, 8, 64, 128)
  assert (c.pages_per_block, c.k_splits) == (8, 1)  # many programs: 128 tokens
  assert c.num_warps == 4
  c = _default(256, 3, 64, 64)
  assert (c.pages_per_block, c.k_splits, c.num_warps) == (4, 1, 2)  # d64: 2 warps
  # Interpret mode takes the same rule; the SM count is a constant, not the
  # device's, so Ada's choices are Ampere's for 16-bit pages.
  for shape in ((8, 8, 1024, 128), (256, 3, 64, 64), (3, 2, 100, 256)):
    assert (_default(*shape, gpu=dispatch.INTERPRET) == _default(*shape)
            == _default(*shape, gpu=dispatch.ADA))


@pytest.mark.parametrize("gpu,kernel_name", [
    (dispatch.HOPPER, "mosaic_gpu"), (dispatch.AMPERE, "paged_decode_g4")])
def test_default_follows_current_gpu(fake_gpu, gpu, kernel_name,
                                     cuda_lowering):
  """With `config=None` the kernel asks `dispatch.current_gpu` (faked here)
  and runs `dispatch.decode`'s choice: cross-lowered for CUDA on any host,
  the per-warp Mosaic-GPU kernel on Hopper, the Triton one elsewhere."""
  fake_gpu(gpu)
  jax.clear_caches()  # paged_decode is jitted: trace it again
  sds = jax.ShapeDtypeStruct
  args = [sds((3, 8, 64), jnp.bfloat16), sds((16, 16, 2, 64), jnp.bfloat16),
          sds((16, 16, 2, 64), jnp.bfloat16), sds((3, 4), jnp.int32),
          sds((3, 4), jnp.int32), sds((3,), jnp.int32)]
  f = jax.jit(lambda q, kp, vp, kt, vt, n: kernel.paged_decode(
      q, kp, vp, kt, vt, n, sm_scale=0.125))
  text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert kernel_name in text
  other = {"mosaic_gpu": "paged_decode_g4", "paged_decode_g4": "mosaic_gpu"}
  assert other[kernel_name] not in text
  jax.clear_caches()
