"""RoPE and fused RoPE + paged append.

Oracles: a numpy RoPE written here from the formulas (inverse frequencies by
loop, pairs by index), a numpy row-by-row scatter, and transformers' own rope
functions. The Pallas kernel runs in interpret mode on CPU.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_utils as au
import pkvattn
from rope_utils import np_inv_freq
from rope_utils import np_rope

ATOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}


# ---------------------------------------------------------------- numpy oracle

def np_append(k, v, batch_indices, positions, k_pool, v_pool, k_table, v_table):
  """Row-by-row scatter into float64 pools; `v_pool is k_pool` = one shared pool."""
  ps = k_pool.shape[1]
  for t, (b, p) in enumerate(zip(batch_indices, positions)):
    if b < 0:
      continue
    k_pool[k_table[b, p // ps], p % ps] = k[t]
    v_pool[v_table[b, p // ps], p % ps] = v[t]
  return k_pool, v_pool


# ---------------------------------------------------------------- inputs

def ragged_batch(rng, page_size=8, max_pages=4):
  """3 sequences: a chunk crossing pages from position 5, a decode token, a
  page-aligned prefill; plus 3 padding tokens. Returns batch_indices, positions."""
  b = [0] * 13 + [1] + [2] * page_size + [-1] * 3
  p = list(range(5, 18)) + [page_size * max_pages - 1] + list(range(page_size)) + [0] * 3
  assert max(p) < page_size * max_pages
  return np.array(b, np.int32), np.array(p, np.int32)


def make_cache(rng, fmt, num_pages, page_size, hkv, d, dtype, batch_size, max_pages):
  """NaN-filled cache in `fmt` and its table, plus (k_table, v_table) into the
  normalised view's pools (for the numpy oracle)."""
  if fmt == "pair":
    table = rng.permutation(num_pages)[:batch_size * max_pages].reshape(
        batch_size, max_pages)
    cache = tuple(jnp.full((num_pages, page_size, hkv, d), jnp.nan, dtype)
                  for _ in range(2))
    return cache, jnp.asarray(table, jnp.int32), (table, table)
  if fmt == "pool":
    table = rng.permutation(num_pages)[:2 * batch_size * max_pages].reshape(
        batch_size, 2, max_pages)
    cache = jnp.full((num_pages, page_size, hkv, d), jnp.nan, dtype)
    return cache, jnp.asarray(table, jnp.int32), (table[:, 0], table[:, 1])
  n = num_pages // 2
  table = rng.permutation(n)[:batch_size * max_pages].reshape(batch_size, max_pages)
  cache = jnp.full((n, 2, page_size, hkv, d), jnp.nan, dtype)
  return cache, jnp.asarray(table, jnp.int32), (2 * table, 2 * table + 1)


def pools_of(cache, fmt):
  """Cache -> (k_pool, v_pool) numpy f64 in the view's indexing."""
  if fmt == "pair":
    return tuple(np.asarray(c.astype(jnp.float32), np.float64) for c in cache)
  if fmt == "pool":
    a = np.asarray(cache.astype(jnp.float32), np.float64)
    return a, a
  n, _, ps, h, d = cache.shape
  a = np.asarray(cache.astype(jnp.float32), np.float64).reshape(2 * n, ps, h, d)
  return a, a


def expected_pools(fmt, cache, k, v, bi, pos, tables):
  k_pool, v_pool = pools_of(cache, fmt)
  if fmt != "pair":
    v_pool = k_pool  # K and V rows land in the same array
  return np_append(k, v, bi, pos, k_pool, v_pool, *tables)


def assert_pools(actual_cache, fmt, expected, atol):
  ak, av = pools_of(actual_cache, fmt)
  for a, e in ((ak, expected[0]), (av, expected[1])):
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e))  # unwritten rows stay NaN
    m = ~np.isnan(e)
    np.testing.assert_allclose(a[m], e[m], atol=atol, rtol=0)


# ---------------------------------------------------------------- RoPE

ROPES = [
    pkvattn.RopeConfig(theta=10000.0, style="neox"),
    pkvattn.RopeConfig(theta=10000.0, style="gptj"),
    pkvattn.RopeConfig(theta=10000.0, style="neox", rotary_dim=32),
    pkvattn.RopeConfig(theta=10000.0, style="gptj", rotary_dim=16),
    pkvattn.RopeConfig(theta=500000.0, scaling=pkvattn.Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    pkvattn.RopeConfig(theta=1e6, scaling=pkvattn.LinearRopeScaling(4.0)),
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: f"{r.style}-{r.rotary_dim}-{type(r.scaling).__name__}")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_apply_rope_matches_numpy(rope, dtype):
  rng = np.random.default_rng(0)
  t, hq, hkv, d = 9, 4, 2, 64
  q = jnp.asarray(rng.standard_normal((t, hq, d)), dtype)
  k = jnp.asarray(rng.standard_normal((t, hkv, d)), dtype)
  pos = jnp.asarray(rng.integers(0, 3000, t), jnp.int32)
  actual_q, actual_k = jax.jit(pkvattn.apply_rope, static_argnums=3)(q, k, pos, rope)
  chex.assert_shape(actual_q, q.shape)
  chex.assert_type((actual_q, actual_k), dtype)
  inv = np_inv_freq(d, rope.theta, rope.rotary_dim, rope.scaling)
  np.testing.assert_allclose(rope.inv_freq(d), inv, rtol=1e-6)
  for actual, x in ((actual_q, q), (actual_k, k)):
    expected = np_rope(np.asarray(x.astype(jnp.float32)), np.asarray(pos), inv,
                       rope.style)
    # f32: positions up to 3000 times a 1-ulp inv_freq difference ~ 2e-4 rad.
    atol = 5e-4 if dtype == jnp.float32 else ATOL[dtype]
    np.testing.assert_allclose(np.asarray(actual.astype(jnp.float32)), expected,
                               atol=atol, rtol=0)


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_matches_transformers(rope_type):
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from transformers import LlamaConfig
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
  scaling = {
      "default": None,
      "linear": dict(rope_type="linear", factor=4.0),
      "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                     high_freq_factor=4.0, original_max_position_embeddings=8192),
  }[rope_type]
  hf = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128,
                   rope_theta=500000.0, max_position_embeddings=131072,
                   rope_scaling=scaling)
  rope = pkvattn.RopeConfig.from_hf_config(hf.to_dict())
  assert rope.theta == 500000.0
  if rope_type == "default":
    inv_t = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
  else:
    inv_t, _ = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
  np.testing.assert_allclose(rope.inv_freq(128), inv_t.numpy(), rtol=1e-6)  # a few f32 ulps
  rng = np.random.default_rng(1)
  q = rng.standard_normal((6, 4, 128)).astype(np.float32)
  k = rng.standard_normal((6, 2, 128)).astype(np.float32)
  pos = np.array([0, 1, 17, 255, 1000, 4095])
  # transformers' own rotation with its own table, [T, H, D] layout.
  freqs = torch.tensor(pos)[:, None].float() * inv_t.float()[None, :]
  emb = torch.cat([freqs, freqs], -1)
  qt, kt = apply_rotary_pos_emb(torch.tensor(q), torch.tensor(k), emb.cos(),
                                emb.sin(), unsqueeze_dim=1)
  qa, ka = pkvattn.apply_rope(jnp.asarray(q), jnp.asarray(k),
                              jnp.asarray(pos, jnp.int32), rope)
  # 1-ulp inv_freq differences times position 4095 bound the gap.
  np.testing.assert_allclose(np.asarray(qa), qt.numpy(), atol=1e-3, rtol=0)
  np.testing.assert_allclose(np.asarray(ka), kt.numpy(), atol=1e-3, rtol=0)


def test_from_hf_config_partial_and_errors():
  cfg = dict(rope_theta=10000.0, partial_rotary_factor=0.5, head_dim=64,
             rope_scaling=None)
  assert pkvattn.RopeConfig.from_hf_config(cfg).rotary_dim == 32
  cfg = dict(hidden_size=256, num_attention_heads=4, partial_rotary_factor=0.25)
  assert pkvattn.RopeConfig.from_hf_config(cfg).rotary_dim == 16
  newer = dict(rope_parameters=dict(rope_type="linear", factor=2.0,
                                    rope_theta=1e6))
  r = pkvattn.RopeConfig.from_hf_config(newer)
  assert r.theta == 1e6 and r.scaling == pkvattn.LinearRopeScaling(2.0)
  with pytest.raises(NotImplementedError):
    pkvattn.RopeConfig.from_hf_config(dict(rope_scaling=dict(rope_type="yarn", factor=2.0)))


def test_rope_config_is_static_and_validated():
  a = pkvattn.RopeConfig(scaling=pkvattn.Llama3RopeScaling())
  b = pkvattn.RopeConfig(scaling=pkvattn.Llama3RopeScaling())
  assert a == b and hash(a) == hash(b)
  f = jax.jit(lambda x, r: x + r.inv_freq(64).sum(), static_argnums=1)
  f(jnp.zeros(()), a)
  for bad in (7, 0, -2, 2.5):
    with pytest.raises(ValueError, match="Invalid rotary_dim"):
      pkvattn.RopeConfig(rotary_dim=bad)
  for bad in (0.0, -1.0, float("nan")):
    with pytest.raises(ValueError, match="Invalid theta"):
      pkvattn.RopeConfig(theta=bad)
  assert pkvattn.RopeConfig(rotary_dim=2, theta=1e-3).rotary_dim == 2
  with pytest.raises(ValueError, match="Invalid scaling"):
    pkvattn.RopeConfig(scaling=8.0)
  for bad in (0.0, -8.0):
    with pytest.raises(ValueError, match="Invalid factor"):
      pkvattn.LinearRopeScaling(bad)
    with pytest.raises(ValueError, match="Invalid factor"):
      pkvattn.Llama3RopeScaling(factor=bad)
  for low, high in ((4.0, 4.0), (4.0, 1.0), (0.0, 4.0), (-1.0, 4.0)):
    with pytest.raises(ValueError, match="Invalid low_freq_factor"):
      pkvattn.Llama3RopeScaling(low_freq_factor=low, high_freq_factor=high)
  for bad in (0, -8192):
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
      pkvattn.Llama3RopeScaling(original_max_position_embeddings=bad)
  assert pkvattn.Llama3RopeScaling(factor=0.5, low_freq_factor=0.5,
                                   high_freq_factor=0.75,
                                   original_max_position_embeddings=1).factor
  with pytest.raises(ValueError, match="style"):
    pkvattn.RopeConfig(style="glm")
  with pytest.raises(ValueError, match="rotary_dim"):
    pkvattn.apply_rope(jnp.ones((2, 2, 64)), jnp.ones((2, 2, 64)),
                       jnp.zeros(2, jnp.int32), pkvattn.RopeConfig(rotary_dim=128))
  with pytest.raises(ValueError, match="k"):
    pkvattn.apply_rope(jnp.ones((2, 2, 64)), jnp.ones((3, 2, 64)),
                       jnp.zeros(2, jnp.int32), pkvattn.RopeConfig())
  with pytest.raises(ValueError, match="positions"):
    pkvattn.apply_rope(jnp.ones((2, 2, 64)), jnp.ones((2, 2, 64)),
                       jnp.zeros(2, jnp.float32), pkvattn.RopeConfig())


# ---------------------------------------------------------------- append

@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("fmt", ["pair", "pool", "flashinfer"])
def test_append_paged_kv(fmt, impl):
  rng = np.random.default_rng(2)
  ps, max_pages, hkv, d, dtype = 8, 4, 2, 64, jnp.bfloat16
  bi, pos = ragged_batch(rng, ps, max_pages)
  t = len(bi)
  k = jnp.asarray(rng.standard_normal((t, hkv, d)), dtype)
  v = jnp.asarray(rng.standard_normal((t, hkv, d)), dtype)
  cache, table, tables = make_cache(rng, fmt, 32, ps, hkv, d, dtype, 3, max_pages)
  expected = expected_pools(fmt, cache, np.asarray(k.astype(jnp.float32)),
                            np.asarray(v.astype(jnp.float32)), bi, pos, tables)
  f = jax.jit(functools.partial(pkvattn.append_paged_kv, impl=impl),
              donate_argnums=4)
  actual = f(k, v, jnp.asarray(bi), jnp.asarray(pos), cache, table)
  chex.assert_trees_all_equal_shapes_and_dtypes(actual, make_cache(
      rng, fmt, 32, ps, hkv, d, dtype, 3, max_pages)[0])
  assert_pools(actual, fmt, expected, atol=0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_append_drops_tokens_with_no_page(impl, rng):
  """Unchecked, a token whose batch index, position or table entry names
  no page is not written (padding, a batch index past the table, a position
  past its row, an entry of -1 or past the pool): the pools come back
  bit-equal but for the one valid token's row (page 0, position 0)."""
  num_pages, ps, hkv, d = 4, 8, 2, 64
  pools = tuple(jnp.asarray(rng.standard_normal((num_pages, ps, hkv, d)),
                            jnp.float32) for _ in range(2))
  # Row 2 owns pages 2 and 3, where a batch index of 3 clamped to the last
  # row would write.
  table = jnp.asarray([[0, 1], [-1, num_pages], [2, 3]], jnp.int32)
  bidx = jnp.asarray([-1, 3, 0, 1, 1, 0], jnp.int32)
  pos = jnp.asarray([0, 0, 2 * ps, 0, ps + 1, 0], jnp.int32)
  k, v = (jnp.asarray(rng.standard_normal((6, hkv, d)), jnp.float32)
          for _ in range(2))
  out = pkvattn.append_paged_kv(k, v, bidx, pos, pools, table, impl=impl)
  for got, pool, new in zip(out, pools, (k, v)):
    want = np.array(pool)
    want[0, 0] = np.asarray(new[5])
    np.testing.assert_array_equal(np.asarray(got), want)


CASES = [  # (impl, fmt, dtype, rope)
    ("xla", "pair", jnp.float32, ROPES[0]),
    ("xla", "pool", jnp.bfloat16, ROPES[4]),
    ("pallas", "pair", jnp.float32, ROPES[0]),
    ("pallas", "pool", jnp.bfloat16, ROPES[1]),
    ("pallas", "flashinfer", jnp.float16, ROPES[2]),
    ("pallas", "pair", jnp.bfloat16, ROPES[3]),
    ("pallas", "pool", jnp.float32, ROPES[5]),
]


@pytest.mark.parametrize("impl,fmt,dtype,rope", CASES,
                         ids=[f"{c[0]}-{c[1]}-{jnp.dtype(c[2]).name}-{c[3].style}{c[3].rotary_dim}"
                              for c in CASES])
def test_apply_rope_and_append(impl, fmt, dtype, rope):
  rng = np.random.default_rng(3)
  ps, max_pages, hq, hkv, d = 8, 4, 4, 2, 64
  bi, pos = ragged_batch(rng, ps, max_pages)
  t = len(bi)
  q = jnp.asarray(rng.standard_normal((t, hq, d)), dtype)
  k = jnp.asarray(rng.standard_normal((t, hkv, d)), dtype)
  v = jnp.asarray(rng.standard_normal((t, hkv, d)), dtype)
  cache, table, tables = make_cache(rng, fmt, 32, ps, hkv, d, dtype, 3, max_pages)
  inv = np_inv_freq(d, rope.theta, rope.rotary_dim, rope.scaling)
  f32 = lambda x: np.asarray(x.astype(jnp.float32))
  q_exp = np_rope(f32(q), pos, inv, rope.style)
  k_exp = np_rope(f32(k), pos, inv, rope.style)
  k_exp = f32(jnp.asarray(k_exp, jnp.float32).astype(dtype))  # cache holds dtype
  expected = expected_pools(fmt, cache, k_exp, f32(v), bi, pos, tables)
  f = jax.jit(functools.partial(pkvattn.apply_rope_and_append, rope=rope,
                                impl=impl), donate_argnums=5)
  actual_q, actual_cache = f(q, k, v, jnp.asarray(bi), jnp.asarray(pos), cache,
                             table)
  chex.assert_shape(actual_q, q.shape)
  chex.assert_type(actual_q, dtype)
  atol = ATOL[dtype] * 3 if dtype != jnp.float32 else 5e-5
  np.testing.assert_allclose(f32(actual_q), q_exp, atol=atol, rtol=0)
  assert_pools(actual_cache, fmt, expected, atol=atol)


def test_pallas_matches_xla_and_is_deterministic():
  rng = np.random.default_rng(4)
  ps, max_pages, hq, hkv, d, dtype = 16, 3, 8, 2, 128, jnp.bfloat16
  bi, pos = ragged_batch(rng, ps, max_pages)
  t = len(bi)
  q, k, v = (jnp.asarray(rng.standard_normal((t, h, d)), dtype)
             for h in (hq, hkv, hkv))
  cache, table, _ = make_cache(rng, "pool", 40, ps, hkv, d, dtype, 3, max_pages)
  rope = pkvattn.RopeConfig(theta=500000.0, scaling=pkvattn.Llama3RopeScaling())
  run = lambda impl: pkvattn.apply_rope_and_append(
      q, k, v, jnp.asarray(bi), jnp.asarray(pos), cache, table, rope, impl=impl)
  first, second, xla = run("pallas"), run("pallas"), run("xla")
  chex.assert_trees_all_equal(first, second)
  chex.assert_trees_all_close(jax.tree.map(lambda x: x.astype(jnp.float32), first),
                              jax.tree.map(lambda x: x.astype(jnp.float32), xla),
                              atol=ATOL[dtype])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_donated_jit_aliases_pool(impl):
  """Both impls: the compiled module aliases the pool and never copies it.

  On CPU the pallas path runs in interpret mode; XLA still updates the
  donated pool in place there (checked here), the GPU bench checks the kernel.
  """
  ps, hkv, d, n = 8, 2, 64, 512
  t, hq = 16, 4
  cache = jnp.zeros((n, ps, hkv, d), jnp.bfloat16)
  table = jnp.arange(8, dtype=jnp.int32).reshape(1, 2, 4)
  args = (jnp.ones((t, hq, d), jnp.bfloat16), jnp.ones((t, hkv, d), jnp.bfloat16),
          jnp.ones((t, hkv, d), jnp.bfloat16), jnp.zeros(t, jnp.int32),
          jnp.arange(t, dtype=jnp.int32), cache, table)
  f = jax.jit(functools.partial(pkvattn.apply_rope_and_append,
                                rope=pkvattn.RopeConfig(), impl=impl),
              donate_argnums=5)
  text = f.lower(*args).compile().as_text()
  assert "input_output_alias" in text
  pool_shape = f"bf16[{n},{ps},{hkv},{d}]"
  flat_shape = f"bf16[{n * ps},{hkv},{d}]"
  copies = [l for l in text.splitlines()
            if " copy(" in l and (pool_shape in l or flat_shape in l)]
  assert not copies, copies


def test_get_batch_indices_positions():
  q_indptr = jnp.asarray([0, 3, 4, 9], jnp.int32)
  kv_lens = jnp.asarray([10, 1, 5], jnp.int32)
  bi, pos = pkvattn.get_batch_indices_positions(q_indptr, kv_lens, 12)
  chex.assert_shape((bi, pos), (12,))
  np.testing.assert_array_equal(bi, [0, 0, 0, 1, 2, 2, 2, 2, 2, -1, -1, -1])
  np.testing.assert_array_equal(pos, [7, 8, 9, 0, 0, 1, 2, 3, 4, 0, 0, 0])
  with pytest.raises(ValueError, match="q_indptr"):
    pkvattn.get_batch_indices_positions(q_indptr[:3], kv_lens, 12)
  for bad in (-1, 2.5):
    with pytest.raises(ValueError, match="Invalid num_tokens: expected an int "
                       ">= 0"):
      pkvattn.get_batch_indices_positions(q_indptr, kv_lens, bad)
  bi, pos = pkvattn.get_batch_indices_positions(q_indptr, kv_lens, 0)
  assert bi.shape == pos.shape == (0,)


def test_get_batch_indices_positions_without_a_loop(rng):
  """A decode step's 256 rows: one fused count, no `while` (a binary search
  is a loop of small kernels, three launches per halving, in every step),
  and the numpy oracle's answer on a fresh ragged batch."""
  q_lens = rng.integers(0, 3, 256)
  q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  kv_lens = (q_lens + rng.integers(0, 100, 256)).astype(np.int32)
  f = jax.jit(pkvattn.get_batch_indices_positions, static_argnums=2)
  assert " while(" not in f.lower(q_indptr, kv_lens, 600).as_text(dialect="hlo")
  bi, pos = f(q_indptr, kv_lens, 600)
  t = np.arange(600)
  b = np.minimum(np.searchsorted(q_indptr[1:], t, side="right"), 255)
  valid = t < q_indptr[-1]
  np.testing.assert_array_equal(bi, np.where(valid, b, -1))
  np.testing.assert_array_equal(
      pos, np.where(valid, kv_lens[b] - q_lens[b] + t - q_indptr[b], 0))


@pytest.mark.parametrize("op", ["append_paged_kv", "apply_rope_and_append",
                                "apply_rope_and_append_qkv"])
def test_impl_picks_the_kernel_or_xla(op):
  """`impl="pallas"` runs the kernel (interpreted on a CPU), `impl="xla"`
  only XLA ops."""
  t, hq, hkv, d, ps = 4, 4, 2, 64, 8
  pool = (jnp.zeros((8, ps, hkv, d), jnp.bfloat16),) * 2
  table = jnp.zeros((1, 4), jnp.int32)
  bi = pos = jnp.zeros((t,), jnp.int32)
  q = jnp.zeros((t, hq, d), jnp.bfloat16)
  k = jnp.zeros((t, hkv, d), jnp.bfloat16)
  rope = pkvattn.RopeConfig()

  def call(impl):
    if op == "append_paged_kv":
      return pkvattn.append_paged_kv(k, k, bi, pos, pool, table, impl=impl)
    if op == "apply_rope_and_append":
      return pkvattn.apply_rope_and_append(q, k, k, bi, pos, pool, table,
                                           rope, impl=impl)
    qkv = jnp.zeros((t, (hq + 2 * hkv) * d), jnp.bfloat16)
    return pkvattn.apply_rope_and_append_qkv(qkv, bi, pos, pool, table, rope,
                                             impl=impl)

  for impl, want in (("pallas", True), ("xla", False)):
    assert au.runs_a_kernel(lambda: call(impl)) == want, impl


@pytest.mark.parametrize("rope", ROPES[:4], ids=lambda r: f"{r.style}-{r.rotary_dim}")
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_no_sequence_rotates_q_and_writes_nothing(rope, impl, rng):
  # A page table of no rows (every token padding, as in an idle engine
  # step): nothing can be written, q is still rotated in the rope's style.
  t, hq, hkv, d = 5, 4, 2, 64
  pos = rng.integers(0, 100, t).astype(np.int32)
  q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.float32)
  cache = tuple(jnp.full((4, 8, hkv, d), jnp.nan, jnp.float32) for _ in range(2))
  q_out, out = pkvattn.apply_rope_and_append(
      q, k, k, jnp.full((t,), -1, jnp.int32), jnp.asarray(pos), cache,
      jnp.zeros((0, 2), jnp.int32), rope, impl=impl)
  inv = np_inv_freq(d, rope.theta, rope.rotary_dim, rope.scaling)
  np.testing.assert_allclose(np.asarray(q_out),
                             np_rope(np.asarray(q), pos, inv, rope.style),
                             atol=5e-5, rtol=0)
  for a in out:
    assert np.isnan(np.asarray(a)).all()


def test_append_errors():
  k = jnp.ones((4, 2, 64))
  pair = (jnp.zeros((8, 8, 2, 64)), jnp.zeros((8, 8, 2, 64)))
  bi = pos = jnp.zeros(4, jnp.int32)
  for shape in ((1, 4), (1, 2), (1, 3, 4), (1, 1, 4)):  # pool: split table
    with pytest.raises(ValueError, match="Invalid shape of page_table: a "
                       "single 4-D kv_cache pool needs a split table"):
      pkvattn.append_paged_kv(k, k, bi, pos, pair[0],
                              jnp.zeros(shape, jnp.int32))
  with pytest.raises(ValueError, match="page_table"):  # pair needs a shared table
    pkvattn.append_paged_kv(k, k, bi, pos, pair, jnp.zeros((1, 2, 4), jnp.int32))
  with pytest.raises(ValueError, match="v"):
    pkvattn.append_paged_kv(k, k[:, :1], bi, pos, pair, jnp.zeros((1, 4), jnp.int32))
  with pytest.raises(ValueError, match="batch_indices"):
    pkvattn.append_paged_kv(k, k, bi[:3], pos, pair, jnp.zeros((1, 4), jnp.int32))
  with pytest.raises(ValueError, match="k"):
    pkvattn.append_paged_kv(jnp.ones((4, 3, 64)), k, bi, pos, pair,
                            jnp.zeros((1, 4), jnp.int32))
  with pytest.raises(ValueError, match="q"):
    pkvattn.apply_rope_and_append(jnp.ones((4, 3, 64)), k, k, bi, pos, pair,
                                  jnp.zeros((1, 4), jnp.int32), pkvattn.RopeConfig())
  with pytest.raises(ValueError, match="impl"):
    pkvattn.append_paged_kv(k, k, bi, pos, pair, jnp.zeros((1, 4), jnp.int32),
                            impl="triton")


@pytest.mark.parametrize("interleaved,rot,one_head,fused,unroll,paged",
                         [(False, 128, False, False, False, False),
                          (True, 64, True, False, False, False),
                          (False, 128, False, True, False, False),
                          (False, 128, False, False, True, True)])
def test_kernel_lowers_to_triton(interleaved, rot, one_head, fused, unroll,
                                 paged, cuda_lowering):
  """Cross-lowers the kernel for CUDA on the CPU (Pallas -> Triton IR): catches
  indexers or ops the Triton lowering rejects without a GPU. Checks the pool
  outputs alias the pool operands."""
  from jax import export
  from pkvattn.pallas_kernels import rope_append as kernel
  t, hq, hkv, d, ps, n = 64, 8, 2, 128, 16, 32
  sds = jax.ShapeDtypeStruct
  args = [sds((t, hq, d), jnp.bfloat16), sds((t, hkv, d), jnp.bfloat16),
          sds((t, hkv, d), jnp.bfloat16), sds((t,), jnp.int32),
          sds((t,), jnp.int32), sds((t,), jnp.int32), sds((rot // 2,), jnp.float32),
          sds((n, ps, hkv, d), jnp.bfloat16), sds((n, ps, hkv, d), jnp.bfloat16)]
  f = functools.partial(kernel.rope_append, interleaved=interleaved,
                        config=kernel.TritonConfig(16, 2, 2,
                                                   one_head=one_head,
                                                   unroll=unroll),
                        interpret=False)
  if paged:  # rows looked up in the kernel from a split table
    table = sds((4, 2, n // 4), jnp.int32)
    args = args[:4] + [args[4], args[6], args[7], args[8], table]

    def f(q, k, v, pos, bi, inv, kp, vp, table):
      return kernel.rope_append(q, k, v, pos, None, None, inv, kp, vp,
                                interleaved=interleaved,
                                config=kernel.TritonConfig(16, 2, 2,
                                                           unroll=unroll),
                                interpret=False, paged=(bi, table, "split"))
    donate = (6, 7)
  if fused:  # one [t, (hq + 2 hkv) * d] input replaces q, k, v
    args = [sds((t, (hq + 2 * hkv) * d), jnp.bfloat16)] + args[3:]
    f = functools.partial(kernel.rope_append_qkv, interleaved=interleaved,
                          config=_triton(t, hq, hkv),
                          interpret=False)
    donate = (5, 6)
  elif not paged:
    donate = (7, 8)
  exp = export.export(
      jax.jit(f, donate_argnums=donate), platforms=["cuda"],
      disabled_checks=[export.DisabledSafetyCheck.custom_call(
          "__gpu$xla.gpu.triton")])(*args)
  text = exp.mlir_module()
  assert "xla.gpu.triton" in text
  assert text.count("output_operand_alias<") == 2


def test_kernel_one_head_config_matches_xla():
  """Both program layouts of the kernel (head loop / one head per program)."""
  from pkvattn.pallas_kernels import reference
  from pkvattn.pallas_kernels import rope_append as kernel
  rng = np.random.default_rng(5)
  t, hq, hkv, d, ps, n = 21, 4, 2, 64, 8, 16
  q, k, v = (jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
             for h in (hq, hkv, hkv))
  pos = jnp.asarray(rng.permutation(n * ps)[:t], jnp.int32)
  rows = jnp.where(jnp.arange(t) % 5 == 4, n * ps, pos)  # every 5th skipped
  inv = jnp.asarray(pkvattn.RopeConfig().inv_freq(d))
  pools = (jnp.full((n, ps, hkv, d), jnp.nan), jnp.full((n, ps, hkv, d), jnp.nan))
  expected = (reference.rope_reference(q, pos, inv, interleaved=False),
              *reference.append_paged_kv_reference(
                  reference.rope_reference(k, pos, inv, interleaved=False), v,
                  jnp.where(rows < n * ps, 0, -1), pos, *pools,
                  jnp.arange(n, dtype=jnp.int32)[None], jnp.arange(n, dtype=jnp.int32)[None]))
  for cfg in (kernel.TritonConfig(8, 2, 1),
              kernel.TritonConfig(16, 1, 1, one_head=True),
              kernel.TritonConfig(8, 1, 1, unroll=True)):
    actual = kernel.rope_append(q, k, v, pos, rows, rows, inv, *pools,
                                config=cfg, interpret=True)
    chex.assert_trees_all_close(actual, expected, atol=2e-5)


def _triton(num_tokens, num_qo_heads, num_kv_heads):
  """The Triton kernel's default launch (`dispatch.rope_append`, no GPU)."""
  from pkvattn.pallas_kernels import dispatch
  choice = dispatch.rope_append(
      gpu=dispatch.INTERPRET, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
      pool_dtype=jnp.bfloat16, head_dim=128, num_qo_heads=num_qo_heads,
      num_kv_heads=num_kv_heads, num_tokens=num_tokens)
  assert choice.backend == "triton"
  return choice.config


def test_default_config_rule():
  """Heads that split far enough keep the split head loop; where they do not
  (9 q / 3 kv heads, or few tokens) one head per program; big batches keep
  their rule."""
  c = _triton(256, 32, 8)
  assert (c.num_splits, c.one_head, c.unroll) == (8, False, True)
  c = _triton(256, 9, 3)
  assert c.one_head and c.block_tokens == 4  # 768 programs, not 64
  c = _triton(8, 32, 8)
  assert c.one_head  # 2 tiles: 80 programs, not 16
  for t in (4096, 65536):  # enough tiles: no head split wanted
    assert not _triton(t, 9, 3).one_head
  assert _triton(0, 32, 8).block_tokens == 4  # no tokens: any launch


def test_default_configs_always_run():
  """Every launch the rule picks runs its heads: the ops call the kernel
  with the rule's config and have no other path (`check_supported` would
  raise NotImplementedError)."""
  from pkvattn.pallas_kernels import rope_append as kernel
  for hkv in (1, 2, 3, 4, 6, 8, 16):
    for group in (1, 2, 3, 4, 5, 7, 8):
      for t in (0, 1, 7, 64, 513, 4096, 65536):
        kernel.check_supported(hkv * group, hkv, _triton(t, hkv * group, hkv))


def test_triton_config_validation():
  from pkvattn.pallas_kernels import rope_append as kernel
  for bad, name in ((dict(block_tokens=12), "block_tokens"),
                    (dict(num_splits=0), "num_splits"),
                    (dict(num_warps=0), "num_warps")):
    with pytest.raises(ValueError, match=name):
      kernel.TritonConfig(**bad)
  with pytest.raises(NotImplementedError, match="num_splits"):
    kernel.check_supported(9, 3, kernel.TritonConfig(num_splits=2))


@pytest.mark.parametrize("impl,fmt", [("xla", "pair"), ("pallas", "pool"),
                                      ("pallas", "flashinfer")])
def test_apply_rope_and_append_qkv(impl, fmt):
  """Fused qkv rows give what the split q, k, v give (numpy oracle)."""
  rng = np.random.default_rng(6)
  ps, max_pages, hq, hkv, d, dtype = 8, 4, 4, 2, 64, jnp.bfloat16
  rope = ROPES[1] if fmt == "flashinfer" else ROPES[0]
  bi, pos = ragged_batch(rng, ps, max_pages)
  t = len(bi)
  qkv = jnp.asarray(rng.standard_normal((t, (hq + 2 * hkv) * d)), dtype)
  heads = np.asarray(qkv.astype(jnp.float32)).reshape(t, hq + 2 * hkv, d)
  q, k, v = heads[:, :hq], heads[:, hq:hq + hkv], heads[:, hq + hkv:]
  cache, table, tables = make_cache(rng, fmt, 32, ps, hkv, d, dtype, 3, max_pages)
  inv = np_inv_freq(d, rope.theta, rope.rotary_dim, rope.scaling)
  k_exp = np.asarray(jnp.asarray(np_rope(k, pos, inv, rope.style),
                                 jnp.float32).astype(dtype).astype(jnp.float32))
  expected = expected_pools(fmt, cache, k_exp, v, bi, pos, tables)
  f = jax.jit(functools.partial(pkvattn.apply_rope_and_append_qkv, rope=rope,
                                impl=impl), donate_argnums=3)
  actual_q, actual_cache = f(qkv, jnp.asarray(bi), jnp.asarray(pos), cache, table)
  chex.assert_shape(actual_q, (t, hq, d))
  chex.assert_type(actual_q, dtype)
  np.testing.assert_allclose(np.asarray(actual_q.astype(jnp.float32)),
                             np_rope(q, pos, inv, rope.style),
                             atol=3 * ATOL[dtype], rtol=0)
  assert_pools(actual_cache, fmt, expected, atol=3 * ATOL[dtype])
  # Not whole heads, or no room for a query head beside K's and V's.
  for width in (qkv.shape[1] - 1, 2 * hkv * d, hkv * d):
    with pytest.raises(ValueError, match="Invalid shape of qkv: expected "
                       r"\(num_tokens, \(num_qo_heads \+ 2"):
      pkvattn.apply_rope_and_append_qkv(qkv[:, :width], jnp.asarray(bi),
                                        jnp.asarray(pos), actual_cache, table,
                                        rope)
