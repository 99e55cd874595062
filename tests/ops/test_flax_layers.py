"""The Flax front ends (nnx layer, linen layer, attention_fn hook) on CPU.

Oracle: dense causal attention in numpy on contiguous K/V (with RoPE from
`pkvattn.apply_rope`), f32. The pool is NaN-poisoned everywhere a sequence does
not write, and page ids are shuffled.
"""

from __future__ import annotations

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


def _dense_attention(q, k, v, window_left=-1):
  """q [S, Hq, D], k/v [S, Hkv, D] for one sequence -> [S, Hq, D] (causal)."""
  s, hq, d = q.shape
  g = hq // k.shape[1]
  k = np.repeat(k, g, axis=1)
  v = np.repeat(v, g, axis=1)
  logits = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
  i, j = np.arange(s)[:, None], np.arange(s)[None, :]
  mask = j <= i
  if window_left >= 0:
    mask &= j >= i - window_left
  logits = np.where(mask[None], logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hqk,khd->qhd", p, v)


def _reference(params, x_seqs, rope, window_left=-1):
  """Per-sequence dense self-attention with the layer's projections."""
  outs = []
  for x in x_seqs:
    proj = lambda name: np.asarray(x @ params[name]["kernel"] + params[name].get(
        "bias", 0.0))
    q = proj("q_proj").reshape(len(x), NQ, D)
    k = proj("k_proj").reshape(len(x), NKV, D)
    v = proj("v_proj").reshape(len(x), NKV, D)
    pos = jnp.arange(len(x), dtype=jnp.int32)
    q, k = pkvattn.apply_rope(jnp.asarray(q), jnp.asarray(k), pos, rope)
    o = _dense_attention(np.asarray(q), np.asarray(k), v, window_left)
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
  params = {name: {"kernel": rng.normal(size=(i, o)).astype(np.float32) * 0.2,
                   "bias": rng.normal(size=(o,)).astype(np.float32) * 0.2}
            for name, i, o in (("q_proj", HIDDEN, NQ * D),
                               ("k_proj", HIDDEN, NKV * D),
                               ("v_proj", HIDDEN, NKV * D),
                               ("o_proj", NQ * D, HIDDEN))}
  fused = {"o_proj": params["o_proj"], "qkv_proj": {
      k: np.concatenate([params[n][k] for n in ("q_proj", "k_proj", "v_proj")],
                        axis=-1) for k in ("kernel", "bias")}}
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
  x64 = x.astype(np.float64)
  want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * (1 + w)
  got = np.asarray(_head_rms_norm(jnp.asarray(x), jnp.asarray(w), eps))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(got[1, 2], 0.0)


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
