"""The Flax front ends (nnx layer, linen layer, attention_fn hook) on CPU.

Oracle: dense causal attention in numpy on contiguous K/V (with RoPE from
`pkvattn.apply_rope`), f32. The pool is NaN-poisoned everywhere a sequence does
not write, and page ids are shuffled.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pkvattn
from pkvattn import cache
from pkvattn.flax import AttentionPlan
from pkvattn.flax import LinenPagedAttention
from pkvattn.flax import PagedAttention
from pkvattn.flax import PagedAttentionFn
from pkvattn.flax import layer_page_tables

HIDDEN, NQ, NKV, D, PS = 128, 4, 2, 64, 8
ROPE = pkvattn.RopeConfig(theta=10000.0)


def _dense_attention(q, k, v, window_left=-1, sm_scale=None,
                     logits_soft_cap=None):
  """q [S, Hq, D], k/v [S, Hkv, D] for one sequence -> [S, Hq, D] (causal;
  logits scaled by `sm_scale`, default 1 / sqrt(D), then soft-capped)."""
  s, hq, d = q.shape
  g = hq // k.shape[1]
  k = np.repeat(k, g, axis=1)
  v = np.repeat(v, g, axis=1)
  scale = 1 / np.sqrt(d) if sm_scale is None else sm_scale
  logits = np.einsum("qhd,khd->hqk", q, k) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
  i, j = np.arange(s)[:, None], np.arange(s)[None, :]
  mask = j <= i
  if window_left >= 0:
    mask &= j >= i - window_left
  logits = np.where(mask[None], logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hqk,khd->qhd", p, v)


def _rms_norm64(x, w, eps):
  """Gemma's RMSNorm over the last axis in float64: `x / rms(x) * (1 + w)`."""
  x = np.asarray(x, np.float64)
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1 + w)


def _reference(params, x_seqs, rope, window_left=-1, qk_norm_eps=None,
               **statics):
  """Per-sequence dense self-attention with the layer's projections (and
  QK-norm before RoPE with `qk_norm_eps`; no RoPE with `rope=None`;
  `statics`: `sm_scale`, `logits_soft_cap`)."""
  outs = []
  for x in x_seqs:
    proj = lambda name: np.asarray(x @ params[name]["kernel"] + params[name].get(
        "bias", 0.0))
    q = proj("q_proj").reshape(len(x), NQ, D)
    k = proj("k_proj").reshape(len(x), NKV, D)
    v = proj("v_proj").reshape(len(x), NKV, D)
    if qk_norm_eps is not None:
      q = _rms_norm64(q, params["q_norm"], qk_norm_eps).astype(np.float32)
      k = _rms_norm64(k, params["k_norm"], qk_norm_eps).astype(np.float32)
    if rope is not None:
      pos = jnp.arange(len(x), dtype=jnp.int32)
      q, k = pkvattn.apply_rope(jnp.asarray(q), jnp.asarray(k), pos, rope)
    o = _dense_attention(np.asarray(q), np.asarray(k), v, window_left,
                         **statics)
    outs.append(o.reshape(len(x), NQ * D) @ np.asarray(params["o_proj"]["kernel"])
                + np.asarray(params["o_proj"].get("bias", 0.0)))
  return outs


def _layout(lens, max_pages=4, num_pages=16, seed=0):
  """Shuffled split tables and a NaN pool for sequences of `lens` tokens."""
  perm = np.random.default_rng(seed).permutation(num_pages)
  table = np.full((len(lens), 2, max_pages), -1, np.int32)
  nxt = 0
  for b, n in enumerate(lens):
    for i in range(-(-n // PS)):
      table[b, 0, i], table[b, 1, i] = perm[nxt], perm[nxt + 1]
      nxt += 2
  pool = jnp.full((num_pages, PS, NKV, D), jnp.nan, jnp.float32)
  return jnp.asarray(table), pool


def _nnx_params(layer):
  out = {}
  for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    lin = getattr(layer, name)
    out[name] = {"kernel": np.asarray(lin.kernel[...])}
    if lin.bias is not None:
      out[name]["bias"] = np.asarray(lin.bias[...])
  return out


def _random_params(rng, *, qkv_bias=True, o_bias=True, qk_norm=False,
                   scale=0.2):
  """Split q/k/v/o projections in Flax's `kernel [in, out]` layout (kernels
  of standard deviation `scale`)."""
  params = {}
  for name, i, o in (("q_proj", HIDDEN, NQ * D), ("k_proj", HIDDEN, NKV * D),
                     ("v_proj", HIDDEN, NKV * D), ("o_proj", NQ * D, HIDDEN)):
    params[name] = {
        "kernel": rng.normal(size=(i, o)).astype(np.float32) * scale}
    if (o_bias if name == "o_proj" else qkv_bias):
      params[name]["bias"] = rng.normal(size=(o,)).astype(np.float32) * 0.2
  if qk_norm:
    params["q_norm"] = rng.normal(size=(D,)).astype(np.float32) * 0.5
    params["k_norm"] = rng.normal(size=(D,)).astype(np.float32) * 0.5
  return params


def _fused(params):
  """`params` with q/k/v concatenated into `qkv_proj` (`fuse_projections`)."""
  out = {k: v for k, v in params.items()
         if k not in ("q_proj", "k_proj", "v_proj")}
  out["qkv_proj"] = {
      k: np.concatenate([params[n][k] for n in ("q_proj", "k_proj", "v_proj")],
                        axis=-1) for k in params["q_proj"]}
  return out


@pytest.mark.parametrize("window_left", [-1, 5])
def test_nnx_layer_chunked_prefill_and_decode(window_left):
  layer = PagedAttention(HIDDEN, NQ, NKV, D, rope=ROPE, use_qkv_bias=True,
                         window_left=window_left, impl="xla",
                         rngs=nnx.Rngs(0))
  lens = [15, 7, 19]
  rng = np.random.default_rng(1)
  xs = [rng.normal(size=(n, HIDDEN)).astype(np.float32) for n in lens]
  table, pool = _layout(lens)
  expected = _reference(_nnx_params(layer), xs, ROPE, window_left)

  @nnx.jit
  def run(layer, x, pool, plan):
    return layer(x, pool, plan)

  # Step 1: prompt prefixes; step 2: the rest of the prompts (chunked prefill
  # over a cached prefix) mixed with a decode row; then decode steps.
  schedule = [[9, 4, 8], [4, 1, 9], [1, 1, 1], [1, 1, 1]]
  assert [sum(c) for c in zip(*schedule)] == lens
  done = [0] * len(lens)
  actual = [[] for _ in lens]
  num_tokens = 32
  for q_lens in schedule:
    x = np.zeros((num_tokens, HIDDEN), np.float32)
    q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    for b in range(len(lens)):
      x[q_indptr[b]:q_indptr[b + 1]] = xs[b][done[b]:done[b] + q_lens[b]]
    kv_lens = np.asarray([d + q for d, q in zip(done, q_lens)], np.int32)
    plan = AttentionPlan.create(table, q_indptr, kv_lens, num_tokens)
    out, pool = run(layer, jnp.asarray(x), pool, plan)
    assert out.shape == (num_tokens, HIDDEN)
    np.testing.assert_array_equal(np.asarray(out[q_indptr[-1]:]), 0.0)
    for b in range(len(lens)):
      actual[b].append(np.asarray(out[q_indptr[b]:q_indptr[b + 1]]))
      done[b] += q_lens[b]
  for b in range(len(lens)):
    np.testing.assert_allclose(np.concatenate(actual[b]), expected[b],
                               atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_attention_block_fused_qkv_matches_split(impl):
  """`qkv_proj` weights (RoPE + append read the heads of each projected row in
  place; in decode-sized steps through each token's table row) give the
  outputs and pool writes of separate q/k/v projections, and match the dense
  oracle. Pallas runs in interpret mode on the CPU."""
  from pkvattn.flax import AttentionSpec
  from pkvattn.flax import attention_block
  lens = [14, 8]
  rng = np.random.default_rng(7)
  params = _random_params(rng)
  fused = _fused(params)
  xs = [rng.normal(size=(n, HIDDEN)).astype(np.float32) for n in lens]
  expected = _reference(params, xs, ROPE)
  spec = AttentionSpec(NQ, NKV, D, rope=ROPE, use_qkv_bias=True)
  table, pool = _layout(lens)
  step = jax.jit(lambda p, x, pool, plan: attention_block(
      p, x, pool, plan, spec, impl=impl))
  # (tokens of seq 0, of seq 1, padded step size): a cached prefix of seq 0
  # (split weights only), a chunk + a prompt, two decode-sized steps (tokens
  # <= sequences), the last with seq 0 idle and a padding token.
  schedule = [((0, 8), (0, 0), 16), ((8, 13), (0, 6), 16),
              ((13, 14), (6, 7), 2), ((14, 14), (7, 8), 2)]
  for n, (s0, s1, num_tokens) in enumerate(schedule):
    x = np.zeros((num_tokens, HIDDEN), np.float32)
    q0, q1 = s0[1] - s0[0], s1[1] - s1[0]
    x[:q0], x[q0:q0 + q1] = xs[0][s0[0]:s0[1]], xs[1][s1[0]:s1[1]]
    plan = AttentionPlan.create(table, np.array([0, q0, q0 + q1], np.int32),
                                np.array([s0[1], s1[1]], np.int32), num_tokens)
    out_split, pool_split = step(params, jnp.asarray(x), pool, plan)
    if n:
      out_fused, pool_fused = step(fused, jnp.asarray(x), pool, plan)
      # f32: one fused projection and three split ones sum in different
      # orders (about 1e-5 apart once XLA:CPU's optimizations are off).
      np.testing.assert_allclose(np.asarray(out_fused), np.asarray(out_split),
                                 atol=5e-5, rtol=5e-5)
      np.testing.assert_allclose(np.asarray(pool_fused), np.asarray(pool_split),
                                 atol=5e-5, rtol=5e-5)  # NaN where none wrote
      np.testing.assert_allclose(np.asarray(out_fused[:q0]),
                                 expected[0][s0[0]:s0[1]], atol=2e-4, rtol=2e-4)
      np.testing.assert_allclose(np.asarray(out_fused[q0:q0 + q1]),
                                 expected[1][s1[0]:s1[1]], atol=2e-4, rtol=2e-4)
      # Padding rows: zero attention, so the o_proj bias alone.
      np.testing.assert_allclose(
          np.asarray(out_fused[q0 + q1:]),
          np.broadcast_to(params["o_proj"]["bias"],
                          (num_tokens - q0 - q1, HIDDEN)), atol=1e-6)
    pool = pool_split
  bad = dict(fused, qkv_proj={"kernel": fused["qkv_proj"]["kernel"][:, :-D]})
  with pytest.raises(ValueError, match="qkv_proj"):
    attention_block(bad, jnp.asarray(x), pool, plan, spec, impl=impl)


def test_linen_layer_matches_nnx():
  lens = [11, 6]
  num_tokens = 24
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(num_tokens, HIDDEN)), jnp.float32)
  table, pool = _layout(lens)
  q_indptr = np.array([0, 11, 17], np.int32)
  plan = AttentionPlan.create(table, q_indptr, np.asarray(lens, np.int32),
                              num_tokens)
  linen = LinenPagedAttention(HIDDEN, NQ, NKV, D, rope=ROPE, impl="xla")
  variables = linen.init(jax.random.key(0), x, pool, plan)
  out, new_pool = jax.jit(linen.apply)(variables, x, pool, plan)
  p = variables["params"]
  layer = PagedAttention(HIDDEN, NQ, NKV, D, rope=ROPE, impl="xla",
                         rngs=nnx.Rngs(0))
  for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    getattr(layer, name).kernel[...] = p[name]["kernel"]
  expected, expected_pool = layer(x, pool, plan)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-5)
  np.testing.assert_array_equal(np.isnan(new_pool), np.isnan(expected_pool))
  xs = [np.asarray(x[:11]), np.asarray(x[11:17])]
  ref = _reference({k: {"kernel": np.asarray(v["kernel"])} for k, v in p.items()},
                   xs, ROPE)
  np.testing.assert_allclose(np.asarray(out[:17]), np.concatenate(ref),
                             atol=2e-4, rtol=2e-4)


def test_attention_fn_hook_in_nnx_multihead_attention():
  # nnx.MultiHeadAttention (no RoPE, num_kv_heads == num_qo_heads) with the
  # paged hook vs. the same module with its own causal dot-product attention.
  n = 10
  mha = nnx.MultiHeadAttention(NKV, HIDDEN, qkv_features=NKV * D, decode=False,
                               rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(3).normal(size=(1, n, HIDDEN)),
                  jnp.float32)
  expected = mha(x, mask=nnx.make_causal_mask(jnp.ones((1, n))))
  table, pool = _layout([n])
  plan = AttentionPlan.create(table, np.array([0, n], np.int32),
                              np.array([n], np.int32), n)
  hook = PagedAttentionFn(pool, plan, impl="xla")
  mha.attention_fn = hook
  actual = mha(x)
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected),
                             atol=2e-5, rtol=2e-5)
  written = ~np.isnan(np.asarray(hook.kv_cache)).all(axis=(1, 2, 3))
  assert written.sum() == 4  # 2 blocks x (K page, V page)


def test_layer_page_tables_match_cache_layout():
  cfg = cache.CacheConfig(num_slots=8, page_size=PS, num_layers=3, max_seqs=2,
                          max_pages=4)
  state = cache.init_cache(cfg)
  state, res = cache.claim_batch(state, jnp.array([0, 1]),
                                 jnp.zeros((2, 20), jnp.int32),
                                 jnp.array([20, 9]))
  assert bool(res.ok.all())
  ours = layer_page_tables(state.seq_slots, cfg.num_layers)
  assert ours.shape == (3, 2, 2, 4)
  for layer in range(cfg.num_layers):
    np.testing.assert_array_equal(
        np.asarray(ours[layer]),
        np.asarray(cache.page_table(state, jnp.array([0, 1]), layer)))


def test_plan_and_layer_errors():
  with pytest.raises(ValueError, match="q_indptr"):
    AttentionPlan.create(jnp.zeros((2, 2, 4), jnp.int32), jnp.array([0, 3]),
                         jnp.array([3, 4]), 8)
  with pytest.raises(ValueError, match="num_qo_heads"):
    PagedAttention(HIDDEN, 3, 2, D, rngs=nnx.Rngs(0))


def test_attention_fn_hook_in_linen_multihead_attention():
  import flax.linen as nn
  n = 10
  x = jnp.asarray(np.random.default_rng(4).normal(size=(1, n, HIDDEN)),
                  jnp.float32)
  mha = nn.MultiHeadDotProductAttention(num_heads=NKV, qkv_features=NKV * D)
  variables = mha.init(jax.random.key(0), x)
  expected = mha.apply(variables, x, mask=nn.make_causal_mask(jnp.ones((1, n))))
  table, pool = _layout([n])
  plan = AttentionPlan.create(table, np.array([0, n], np.int32),
                              np.array([n], np.int32), n)
  hook = PagedAttentionFn(pool, plan, impl="xla")
  actual = nn.MultiHeadDotProductAttention(
      num_heads=NKV, qkv_features=NKV * D, attention_fn=hook).apply(variables, x)
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected),
                             atol=2e-5, rtol=2e-5)
  assert (~np.isnan(np.asarray(hook.kv_cache)).all(axis=(1, 2, 3))).sum() == 4


def test_qk_norm_matches_numpy_and_keeps_zero_heads_zero(rng):
  # Gemma 3's QK-norm over each head: f32 statistics, `x * (1 + w)`, the
  # epsilon inside the square root, so a head of zeros (a padding row)
  # stays zero instead of becoming NaN.
  from pkvattn.flax import _head_rms_norm  # pylint: disable=import-outside-toplevel
  x = rng.standard_normal((3, 4, D)).astype(np.float32)
  x[1, 2] = 0.0
  w = rng.standard_normal(D).astype(np.float32)
  eps = 1e-6
  want = _rms_norm64(x, w, eps)
  got = np.asarray(_head_rms_norm(jnp.asarray(x), jnp.asarray(w), eps))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(got[1, 2], 0.0)


@pytest.mark.parametrize("rope,qk_norm_eps", [(None, None), (ROPE, 1e-6)],
                         ids=["no_rope", "qk_norm"])
def test_attention_block_fused_qkv_sliced_apart(rng, rope, qk_norm_eps):
  """Fused `qkv_proj` weights that RoPE + append cannot read in place (no
  RoPE, or Gemma 3's QK-norm between the projection and RoPE) are sliced
  into q, k, v: outputs and pool writes match split weights, and both match
  the numpy oracle (QK-norm before RoPE). The spec's window is left at its
  default, full attention, and the spec is a jit static (hashable)."""
  from pkvattn.flax import AttentionSpec
  from pkvattn.flax import attention_block
  lens, num_tokens = [7, 4], 12
  params = _random_params(rng, qk_norm=qk_norm_eps is not None)
  xs = [rng.normal(size=(n, HIDDEN)).astype(np.float32) for n in lens]
  x = np.zeros((num_tokens, HIDDEN), np.float32)
  x[:7], x[7:11] = xs
  expected = _reference(params, xs, rope, qk_norm_eps=qk_norm_eps)
  spec = AttentionSpec(NQ, NKV, D, rope=rope, use_qkv_bias=True,
                       use_o_bias=True, qk_norm_eps=qk_norm_eps)
  table, pool = _layout(lens)
  plan = AttentionPlan.create(table, np.array([0, 7, 11], np.int32),
                              np.asarray(lens, np.int32), num_tokens)
  step = jax.jit(attention_block, static_argnames=("spec", "impl"))
  out_split, pool_split = step(params, jnp.asarray(x), pool, plan, spec=spec,
                               impl="xla")
  out_fused, pool_fused = step(_fused(params), jnp.asarray(x), pool, plan,
                               spec=spec, impl="xla")
  for out in (out_split, out_fused):
    np.testing.assert_allclose(np.asarray(out[:7]), expected[0],
                               atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(np.asarray(out[7:11]), expected[1],
                               atol=2e-4, rtol=2e-4)
  np.testing.assert_allclose(np.asarray(pool_fused), np.asarray(pool_split),
                             atol=5e-5, rtol=5e-5)  # NaN where none wrote


def test_bare_op_and_hook_defaults(rng):
  """`paged_attention` and `PagedAttentionFn` left at their defaults attend
  causally over each whole sequence with `1 / sqrt(head_dim)` (no RoPE), as
  the float64 oracle does; the hook takes `[num_tokens, heads, head_dim]` as
  well as a leading batch axis `[1, num_tokens, ...]` and returns the shape it
  was given; padding tokens give zeros."""
  from pkvattn.flax import paged_attention
  lens, num_tokens = [6, 9], 17
  q = rng.normal(size=(num_tokens, NQ, D)).astype(np.float32)
  k = rng.normal(size=(num_tokens, NKV, D)).astype(np.float32)
  v = rng.normal(size=(num_tokens, NKV, D)).astype(np.float32)
  table, pool = _layout(lens)
  plan = AttentionPlan.create(table, np.array([0, 6, 15], np.int32),
                              np.asarray(lens, np.int32), num_tokens)
  assert (plan.num_tokens, plan.batch_size) == (num_tokens, 2)
  f64 = lambda a: np.asarray(a, np.float64)
  expected = np.concatenate([
      _dense_attention(f64(q[a:b]), f64(k[a:b]), f64(v[a:b]))
      for a, b in ((0, 6), (6, 15))])
  out, new_pool = jax.jit(paged_attention)(q, k, v, pool, plan)
  hook = PagedAttentionFn(pool, plan)
  flat = hook(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  hook_pool = hook.kv_cache
  batched = PagedAttentionFn(pool, plan)(q[None], k[None], v[None])
  assert flat.shape == (num_tokens, NQ, D)
  assert batched.shape == (1, num_tokens, NQ, D)
  for got in (out, flat, batched[0]):
    np.testing.assert_allclose(np.asarray(got[:15]), expected,
                               atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(got[15:]), 0.0)
  np.testing.assert_array_equal(np.asarray(hook_pool), np.asarray(new_pool))


@pytest.mark.parametrize("kw", [{}, {"use_qkv_bias": True},
                                {"use_o_bias": True}],
                         ids=["default", "qkv_bias", "o_bias"])
def test_parameter_layout(kw):
  """Both layers hold Flax's `Linear` / `Dense` parameters: `kernel [in,
  out]` for q/k/v/o, and a `bias [out]` only where asked (none by
  default, as in Llama)."""
  qkv_bias, o_bias = kw.get("use_qkv_bias", False), kw.get("use_o_bias", False)
  want = {"q_proj": (HIDDEN, NQ * D), "k_proj": (HIDDEN, NKV * D),
          "v_proj": (HIDDEN, NKV * D), "o_proj": (NQ * D, HIDDEN)}
  layer = PagedAttention(HIDDEN, NQ, NKV, D, rngs=nnx.Rngs(0), **kw)
  table, pool = _layout([3])
  plan = AttentionPlan.create(table, np.array([0, 3], np.int32),
                              np.array([3], np.int32), 4)
  x = jnp.zeros((4, HIDDEN), jnp.float32)
  linen = jax.eval_shape(LinenPagedAttention(HIDDEN, NQ, NKV, D, **kw).init,
                         jax.random.key(0), x, pool, plan)["params"]
  assert set(linen) == set(want)
  for name, (i, o) in want.items():
    bias = o_bias if name == "o_proj" else qkv_bias
    lin = getattr(layer, name)
    assert lin.kernel[...].shape == (i, o)
    assert (lin.bias is not None) == bias
    assert linen[name]["kernel"].shape == (i, o)
    assert set(linen[name]) == ({"kernel", "bias"} if bias else {"kernel"})
    if bias:
      assert lin.bias[...].shape == linen[name]["bias"].shape == (o,)


def test_nnx_layer_compute_dtype(rng):
  """`dtype=bfloat16` with float32 parameters and inputs (a bfloat16 pool):
  the projections and attention run in bfloat16 and the output is bfloat16,
  within bfloat16 rounding of the float32 oracle."""
  lens, num_tokens = [5, 3], 8
  layer = PagedAttention(HIDDEN, NQ, NKV, D, rope=ROPE, dtype=jnp.bfloat16,
                         impl="xla", rngs=nnx.Rngs(0))
  xs = [rng.normal(size=(n, HIDDEN)).astype(np.float32) for n in lens]
  table, pool = _layout(lens)
  plan = AttentionPlan.create(table, np.array([0, 5, 8], np.int32),
                              np.asarray(lens, np.int32), num_tokens)
  out, new_pool = layer(jnp.asarray(np.concatenate(xs)),
                        pool.astype(jnp.bfloat16), plan)
  assert out.dtype == new_pool.dtype == jnp.bfloat16
  expected = np.concatenate(_reference(_nnx_params(layer), xs, ROPE))
  np.testing.assert_allclose(np.asarray(out, np.float32), expected,
                             atol=5e-2, rtol=5e-2)


def test_attention_block_fused_decode_step_checked(rng):
  """A decode-sized fused step (tokens <= sequences: RoPE + append take each
  token's table row, the token as its own sequence) with an idle sequence
  and a padding token keeps the append's contract, so it runs in checked
  mode (batch indices in `[-1, batch_size)`), and its outputs and pool
  writes equal those of split weights."""
  from pkvattn.flax import AttentionSpec
  from pkvattn.flax import attention_block
  params = _random_params(rng)
  spec = AttentionSpec(NQ, NKV, D, rope=ROPE, use_qkv_bias=True,
                       use_o_bias=True)
  table, pool = _layout([3, 9])
  # Cached prefixes: 3 and 8 tokens written by a split-weights prefill.
  pre = AttentionPlan.create(table, np.array([0, 3, 11], np.int32),
                             np.array([3, 8], np.int32), 12)
  _, pool = attention_block(params, jnp.asarray(
      rng.normal(size=(12, HIDDEN)), jnp.float32), pool, pre, spec, impl="xla")
  # Sequence 0 idle, one token of sequence 1, one padding token.
  plan = AttentionPlan.create(table, np.array([0, 0, 1], np.int32),
                              np.array([3, 9], np.int32), 2)
  x = jnp.asarray(rng.normal(size=(2, HIDDEN)), jnp.float32)
  want, want_pool = attention_block(params, x, pool, plan, spec, impl="xla")
  with pkvattn.checked():
    out, new_pool = attention_block(_fused(params), x, pool, plan, spec,
                                    impl="xla")
  np.testing.assert_allclose(np.asarray(out), np.asarray(want),
                             atol=5e-5, rtol=5e-5)
  np.testing.assert_allclose(np.asarray(new_pool), np.asarray(want_pool),
                             atol=5e-5, rtol=5e-5)  # NaN where none wrote


def test_attention_fn_hook_refuses_dropout():
  """Dropout is not supported, so the hook raises wherever Flax's attention
  would apply it: `dropout_rate > 0` and not `deterministic` (False unless
  given, as in Flax's `dot_product_attention`), called from nnx and from
  linen, which passes an `attention_fn` only the keyword arguments its
  signature names. Deterministic calls attend as the modules' own causal
  attention does."""
  import flax.linen as nn
  n = 10
  x = jnp.asarray(np.random.default_rng(6).normal(size=(1, n, HIDDEN)),
                  jnp.float32)
  table, pool = _layout([n])
  plan = AttentionPlan.create(table, np.array([0, n], np.int32),
                              np.array([n], np.int32), n)
  causal = nn.make_causal_mask(jnp.ones((1, n)))
  close = lambda a, b: np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)
  mha = nnx.MultiHeadAttention(NKV, HIDDEN, qkv_features=NKV * D, decode=False,
                               dropout_rate=0.5, rngs=nnx.Rngs(0))
  expected = mha(x, mask=causal, deterministic=True)
  mha.attention_fn = PagedAttentionFn(pool, plan, impl="xla")
  close(mha(x, deterministic=True), expected)
  with pytest.raises(NotImplementedError, match="dropout"):
    mha(x, deterministic=False, rngs=nnx.Rngs(dropout=1))
  kw = dict(num_heads=NKV, qkv_features=NKV * D, dropout_rate=0.5)
  variables = nn.MultiHeadDotProductAttention(**kw).init(
      jax.random.key(0), x, deterministic=True)
  expected = nn.MultiHeadDotProductAttention(**kw).apply(
      variables, x, mask=causal, deterministic=True)
  paged = nn.MultiHeadDotProductAttention(
      **kw, attention_fn=PagedAttentionFn(pool, plan, impl="xla"))
  close(paged.apply(variables, x, deterministic=True), expected)
  with pytest.raises(NotImplementedError, match="dropout"):
    paged.apply(variables, x, deterministic=False,
                rngs={"dropout": jax.random.key(1)})
  q = jnp.zeros((n, NKV, D), jnp.float32)
  with pytest.raises(NotImplementedError, match="dropout"):
    PagedAttentionFn(pool, plan, impl="xla")(q, q, q, dropout_rate=0.5)


def _statics(rng) -> dict:
  """Random non-default attention statics: scale, window and soft cap."""
  return dict(sm_scale=float(rng.uniform(0.05, 0.3)),
              window_left=int(rng.integers(2, 6)),
              logits_soft_cap=float(rng.uniform(2.0, 8.0)))


def test_layers_and_hook_apply_scale_window_and_soft_cap(rng):
  """`sm_scale`, `window_left` and `logits_soft_cap` given to the nnx layer,
  the linen layer or the `attention_fn` hook (each with RoPE) are applied as
  the float64 oracle applies them; the layers' biases (random, not their
  zero init) enter the projections."""
  lens, num_tokens = [9, 5], 16
  statics = _statics(rng)
  xs = [rng.normal(size=(n, HIDDEN)).astype(np.float32) for n in lens]
  x = np.zeros((num_tokens, HIDDEN), np.float32)
  x[:9], x[9:14] = xs
  table, pool = _layout(lens)
  plan = AttentionPlan.create(table, np.array([0, 9, 14], np.int32),
                              np.asarray(lens, np.int32), num_tokens)
  kw = dict(rope=ROPE, use_qkv_bias=True, use_o_bias=True, impl="xla",
            **statics)

  def check(out, params):
    expected = np.concatenate(_reference(params, xs, ROPE, **statics))
    np.testing.assert_allclose(np.asarray(out[:14]), expected,
                               atol=2e-4, rtol=2e-4)

  params = _random_params(rng)
  layer = PagedAttention(HIDDEN, NQ, NKV, D, rngs=nnx.Rngs(0), **kw)
  for name, p in params.items():
    getattr(layer, name).kernel[...] = p["kernel"]
    getattr(layer, name).bias[...] = p["bias"]
  check(layer(jnp.asarray(x), pool, plan)[0], params)
  out, _ = LinenPagedAttention(HIDDEN, NQ, NKV, D, **kw).apply(
      {"params": params}, jnp.asarray(x), pool, plan)
  check(out, params)

  q = rng.normal(size=(num_tokens, NQ, D)).astype(np.float32)
  k = rng.normal(size=(num_tokens, NKV, D)).astype(np.float32)
  v = rng.normal(size=(num_tokens, NKV, D)).astype(np.float32)
  out = PagedAttentionFn(pool, plan, rope=ROPE, impl="xla", **statics)(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  for a, b in ((0, 9), (9, 14)):
    pos = jnp.arange(b - a, dtype=jnp.int32)
    qr, kr = pkvattn.apply_rope(jnp.asarray(q[a:b]), jnp.asarray(k[a:b]), pos,
                                ROPE)
    want = _dense_attention(np.asarray(qr, np.float64),
                            np.asarray(kr, np.float64),
                            np.asarray(v[a:b], np.float64), **statics)
    np.testing.assert_allclose(np.asarray(out[a:b]), want, atol=2e-5,
                               rtol=2e-5)


def test_linen_layer_compute_dtype(rng):
  """`dtype=bfloat16` with float32 parameters and inputs (a bfloat16 pool):
  the linen layer, as the nnx one, computes in bfloat16 and returns
  bfloat16, within bfloat16 rounding of the float32 oracle."""
  lens, num_tokens = [5, 3], 8
  xs = [rng.normal(size=(n, HIDDEN)).astype(np.float32) for n in lens]
  table, pool = _layout(lens)
  plan = AttentionPlan.create(table, np.array([0, 5, 8], np.int32),
                              np.asarray(lens, np.int32), num_tokens)
  # Kernels of the layers' init scale (lecun normal: 1 / sqrt(fan_in)).
  params = _random_params(rng, qkv_bias=False, o_bias=False,
                          scale=HIDDEN**-0.5)
  out, new_pool = LinenPagedAttention(
      HIDDEN, NQ, NKV, D, rope=ROPE, dtype=jnp.bfloat16, impl="xla").apply(
          {"params": params}, jnp.asarray(np.concatenate(xs)),
          pool.astype(jnp.bfloat16), plan)
  assert out.dtype == new_pool.dtype == jnp.bfloat16
  expected = np.concatenate(_reference(params, xs, ROPE))
  np.testing.assert_allclose(np.asarray(out, np.float32), expected,
                             atol=5e-2, rtol=5e-2)


def test_kernel_init_and_param_dtype(rng):
  """Both layers create every projection kernel with `kernel_init`, and
  every parameter in `param_dtype`."""
  import flax.linen as nn
  c = float(rng.uniform(0.5, 2.0))
  table, pool = _layout([3])
  plan = AttentionPlan.create(table, np.array([0, 3], np.int32),
                              np.array([3], np.int32), 4)
  kw = dict(param_dtype=jnp.bfloat16, use_qkv_bias=True, use_o_bias=True)
  layer = PagedAttention(HIDDEN, NQ, NKV, D, rngs=nnx.Rngs(0),
                         kernel_init=nnx.initializers.constant(c), **kw)
  linen = LinenPagedAttention(HIDDEN, NQ, NKV, D,
                              kernel_init=nn.initializers.constant(c), **kw)
  variables = linen.init(jax.random.key(0), jnp.zeros((4, HIDDEN)), pool, plan)
  for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    for kernel in (getattr(layer, name).kernel[...],
                   variables["params"][name]["kernel"]):
      assert kernel.dtype == jnp.bfloat16
      np.testing.assert_array_equal(np.asarray(kernel, np.float32),
                                    np.float32(jnp.bfloat16(c)))
    assert getattr(layer, name).bias[...].dtype == jnp.bfloat16
    assert variables["params"][name]["bias"].dtype == jnp.bfloat16


def test_plan_fields_are_int32(rng):
  """`AttentionPlan.create` takes the lengths and the table as Python lists
  or int64 arrays and holds every field as an int32 array."""
  lens = [int(n) for n in rng.integers(1, 9, size=3)]
  q_indptr = np.concatenate([[0], np.cumsum(lens)])  # int64
  table = np.arange(3 * 2 * 2).reshape(3, 2, 2)      # int64
  plan = AttentionPlan.create(table.tolist(), q_indptr.tolist(), lens, 32)
  for field in ("page_table", "q_indptr", "kv_lens", "batch_indices",
                "positions"):
    value = getattr(plan, field)
    assert isinstance(value, jax.Array) and value.dtype == jnp.int32, field
  np.testing.assert_array_equal(np.asarray(plan.kv_lens), lens)
  plan = AttentionPlan.create(table, q_indptr, np.asarray(lens), 32)
  assert plan.kv_lens.dtype == plan.q_indptr.dtype == jnp.int32


def test_shape_mismatches_are_errors_naming_the_array(rng):
  """`q` must be `[num_tokens, num_qo_heads, head_dim]`, `k` and `v` of one
  shape with `q`'s tokens and head_dim, the plan one batch index per token
  (fused `qkv_proj` rows too): a mismatch is a ValueError naming the array,
  raised when traced."""
  from pkvattn.flax import AttentionSpec
  from pkvattn.flax import attention_block
  from pkvattn.flax import paged_attention
  table, pool = _layout([4])
  plan = AttentionPlan.create(table, np.array([0, 4], np.int32),
                              np.array([4], np.int32), 4)
  q = jnp.asarray(rng.normal(size=(4, NQ, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(4, NKV, D)), jnp.float32)
  cases = [((q.reshape(4, NQ * D), k, k, plan), "Invalid rank of q"),
           ((q[None], k, k, plan), "Invalid rank of q"),
           ((q, k[:3], k[:3], plan), "Invalid shape of k"),
           ((q, k[..., :D // 2], k[..., :D // 2], plan), "Invalid shape of k"),
           ((q, k, k[:, :1], plan), "Invalid shape of v"),
           ((q[:3], k[:3], k[:3], plan), "Invalid shape of plan.batch_indices")]
  for args, message in cases:
    with pytest.raises(ValueError, match=re.escape(message)):
      paged_attention(*args[:3], pool, args[3])
  spec = AttentionSpec(NQ, NKV, D, rope=ROPE)
  fused = _fused(_random_params(rng))
  x = jnp.asarray(rng.normal(size=(3, HIDDEN)), jnp.float32)
  with pytest.raises(ValueError,
                     match=re.escape("Invalid shape of plan.batch_indices")):
    attention_block(fused, x, pool, plan, spec, impl="xla")


def test_attention_block_sums_o_proj_in_reduce_dtype(rng):
  """Under `shard_map` with `reduce_axis`, the `o_proj` partial products are
  summed over that mesh axis in `reduce_dtype` (float32 here, for a
  bfloat16 model; by default the activation dtype): on a one-device mesh the
  output is the one-device block's, within bfloat16 rounding."""
  from jax.sharding import PartitionSpec as P
  from pkvattn import parallel
  from pkvattn.flax import AttentionSpec
  from pkvattn.flax import attention_block
  lens, num_tokens = [5, 3], 8
  table, pool = _layout(lens)
  pool = pool.astype(jnp.bfloat16)
  plan = AttentionPlan.create(table, np.array([0, 5, 8], np.int32),
                              np.asarray(lens, np.int32), num_tokens)
  params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16),
                        _random_params(rng, scale=HIDDEN**-0.5))
  x = jnp.asarray(rng.normal(size=(num_tokens, HIDDEN)), jnp.bfloat16)
  spec = AttentionSpec(NQ, NKV, D, rope=ROPE)
  want, _ = jax.jit(lambda p, x, pool: attention_block(
      p, x, pool, plan, spec, impl="xla"))(params, x, pool)

  def sums(jaxpr):
    """The dtypes `psum` reduces in, nested jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
      if eqn.primitive.name.startswith("psum"):
        out += [v.aval.dtype for v in eqn.invars]
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        out += sums(sub)
    return out

  for reduce_dtype, summed in ((jnp.float32, jnp.float32),
                               (None, jnp.bfloat16)):
    fn = parallel.shard_map(
        lambda p, x, pool, reduce_dtype=reduce_dtype: attention_block(
            p, x, pool, plan, spec, impl="xla",
            reduce_axis=parallel.TP_AXIS, reduce_dtype=reduce_dtype),
        mesh=parallel.make_mesh(1), in_specs=(P(), P(), P()),
        out_specs=(P(), P()))
    assert sums(jax.make_jaxpr(fn)(params, x, pool).jaxpr) == [
        jnp.dtype(summed)]
  out, _ = jax.jit(fn)(params, x, pool)  # reduce_dtype None
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(want, np.float32), atol=5e-2,
                             rtol=5e-2)


def _num_kernels(fn, *args) -> int:
  """Pallas kernels (`pallas_call`s, nested jaxprs included) in `fn(*args)`."""
  def count(jaxpr):
    return sum((eqn.primitive.name == "pallas_call") + sum(
        count(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns)
  return count(jax.make_jaxpr(fn)(*args).jaxpr)


def test_impl_reaches_the_append_and_the_attention(rng):
  """`impl="pallas"` runs both the append (plain, with RoPE, or from fused
  `qkv_proj` rows) and the attention as Pallas kernels in every front end:
  each traces to the kernels of its append plus those of `paged_prefill`;
  `impl="xla"` traces to none."""
  from pkvattn import rope as rope_ops
  from pkvattn.flax import AttentionSpec
  from pkvattn.flax import attention_block
  from pkvattn.flax import paged_attention
  lens, num_tokens = [6, 5], 12
  table, pool = _layout(lens)
  plan = AttentionPlan.create(table, np.array([0, 6, 11], np.int32),
                              np.asarray(lens, np.int32), num_tokens)
  x = jnp.asarray(rng.normal(size=(num_tokens, HIDDEN)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(num_tokens, NQ, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(num_tokens, NKV, D)), jnp.float32)
  qkv = jnp.concatenate([q.reshape(num_tokens, -1), k.reshape(num_tokens, -1),
                         k.reshape(num_tokens, -1)], axis=1)
  idx = (plan.batch_indices, plan.positions)
  params = _random_params(rng)
  spec = AttentionSpec(NQ, NKV, D, rope=ROPE, use_qkv_bias=True,
                       use_o_bias=True)
  for impl in ("xla", "pallas"):
    attend = _num_kernels(lambda q, pool: pkvattn.paged_prefill(
        q, pool, plan.page_table, plan.q_indptr, plan.kv_lens, impl=impl),
        q, pool)
    append = {
        None: _num_kernels(lambda k, pool: rope_ops.append_paged_kv(
            k, k, *idx, pool, plan.page_table, impl=impl), k, pool),
        "rope": _num_kernels(lambda q, k, pool: rope_ops.apply_rope_and_append(
            q, k, k, *idx, pool, plan.page_table, ROPE, impl=impl), q, k,
            pool),
        "qkv": _num_kernels(lambda qkv, pool: (
            rope_ops.apply_rope_and_append_qkv(
                qkv, *idx, pool, plan.page_table, ROPE, impl=impl)), qkv,
            pool)}
    if impl == "xla":
      assert attend == sum(append.values()) == 0
    else:
      assert attend >= 1 and min(append.values()) >= 1
    nnx_layer = PagedAttention(HIDDEN, NQ, NKV, D, rope=ROPE, impl=impl,
                               rngs=nnx.Rngs(0))
    linen = LinenPagedAttention(HIDDEN, NQ, NKV, D, rope=ROPE, impl=impl)
    variables = jax.eval_shape(linen.init, jax.random.key(0), x, pool, plan)
    hook = PagedAttentionFn(pool, plan, impl=impl)
    runs = {
        None: [
            lambda: paged_attention(q, k, k, pool, plan, impl=impl),
            lambda: hook(q, k, k)],
        "rope": [
            lambda: paged_attention(q, k, k, pool, plan, rope=ROPE, impl=impl),
            lambda: attention_block(params, x, pool, plan, spec, impl=impl),
            lambda: nnx_layer(x, pool, plan),
            lambda: linen.apply(jax.tree.map(
                lambda s: jnp.zeros(s.shape, s.dtype), variables), x, pool,
                plan)],
        "qkv": [
            lambda: attention_block(_fused(params), x, pool, plan, spec,
                                    impl=impl)]}
    for kind, fns in runs.items():
      for fn in fns:
        assert _num_kernels(fn) == append[kind] + attend, (impl, kind)


def test_for_layer_takes_that_layer_s_table(rng):
  """A model's plan (per-layer tables from `layer_page_tables`) gives each
  layer its own table with `for_layer`, the layer index static or traced
  (as in `lax.scan` over the layers); the other fields stay the plan's."""
  num_layers = 3
  slots = rng.permutation(8)[:6].reshape(2, 3).astype(np.int32)
  slots[1, 2] = -1
  tables = layer_page_tables(jnp.asarray(slots), num_layers)
  plan = AttentionPlan.create(tables, np.array([0, 5, 7], np.int32),
                              np.array([5, 2], np.int32), 8)
  fields = lambda p: (p.q_indptr, p.kv_lens, p.batch_indices, p.positions)
  for layer in range(num_layers):
    one = plan.for_layer(layer)
    np.testing.assert_array_equal(np.asarray(one.page_table),
                                  np.asarray(tables[layer]))
    for got, want in zip(fields(one), fields(plan)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  _, scanned = jax.lax.scan(lambda c, l: (c, plan.for_layer(l).page_table),
                            0, jnp.arange(num_layers))
  np.testing.assert_array_equal(np.asarray(scanned), np.asarray(tables))


def test_attention_block_computes_in_the_input_dtype(rng):
  """Without `dtype`, `attention_block` computes in `x`'s dtype: bfloat16
  tokens with float32 parameters over a bfloat16 pool give bfloat16 outputs
  and pool, within bfloat16 rounding of the float32 oracle."""
  from pkvattn.flax import AttentionSpec
  from pkvattn.flax import attention_block
  lens, num_tokens = [6, 4], 10
  params = _random_params(rng, scale=HIDDEN**-0.5)
  xs = [rng.normal(size=(n, HIDDEN)).astype(np.float32) for n in lens]
  table, pool = _layout(lens)
  plan = AttentionPlan.create(table, np.array([0, 6, 10], np.int32),
                              np.asarray(lens, np.int32), num_tokens)
  spec = AttentionSpec(NQ, NKV, D, rope=ROPE)
  x = jnp.asarray(np.concatenate(xs), jnp.bfloat16)
  out, new_pool = attention_block(params, x, pool.astype(jnp.bfloat16), plan,
                                  spec, impl="xla")
  assert out.dtype == new_pool.dtype == jnp.bfloat16
  expected = np.concatenate(_reference(params, [np.asarray(
      jnp.asarray(a, jnp.bfloat16), np.float32) for a in xs], ROPE))
  np.testing.assert_allclose(np.asarray(out, np.float32), expected,
                             atol=5e-2, rtol=5e-2)
