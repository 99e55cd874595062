"""`pkvattn.models.decoder` against a float64 numpy decoder written from the
formulas (CPU, tiny random configs).

The transformers parity tests pin the decoder on the configurations HF
checkpoints produce, where some terms barely show or never occur: an RMSNorm
epsilon of 1e-6 next to activations of variance ~1, MLP biases, exact vs
tanh GELU (~5e-4 apart), window 0, the returned pool of the scanned path,
config defaults, `init_params`, and the pallas plan (which only steers the
kernel's launch order). These tests build the decoder's own configs (every
optional term on, norm weights and biases random, epsilon comparable to the
activations' mean square) and compare the whole forward, scanned, unstacked
and fused, logits and written K/V, with a numpy oracle that shares no code
with it (`decoder_oracle`: RoPE from `rope_utils`, attention from
`attention_utils.dense_attention`); the MLP and RMSNorm alone at tighter
tolerances; and the static config logic directly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pkvattn
from attention_utils import prompt_prefill_inputs
from decoder_oracle import np_act
from decoder_oracle import np_forward
from decoder_oracle import np_norm
from pkvattn.models import decoder
from pkvattn.models.decoder import DecoderConfig

# f32 tolerances of a whole forward (logits and K/V of magnitude ~0.1-10;
# the f32 forward stays within ~1e-5 of the float64 oracle).
F32_TOL = 5e-5

_SMALL = dict(vocab_size=48, hidden_size=64, intermediate_size=96,
              num_layers=2, num_qo_heads=2, num_kv_heads=1, head_dim=64)

CONFIGS = {
    # Llama / Qwen2 family with every bias on, and an epsilon of the order of
    # the activations' mean square (so a wrong sign or a dropped epsilon
    # shows in the logits).
    "llama_biases": DecoderConfig(
        rope=pkvattn.RopeConfig(theta=10000.0), rms_norm_eps=0.05,
        qkv_bias=True, o_bias=True, mlp_bias=True, **_SMALL),
    # Gemma 2: (1 + w) norms, sandwich norms, tied head, scaled embeddings,
    # query_pre_attn_scalar, soft caps, a local layer then a global one.
    "gemma2": DecoderConfig(
        rope=pkvattn.RopeConfig(theta=10000.0), rms_norm_eps=0.05,
        norm_plus_one=True, activation="gelu_tanh", tie_word_embeddings=True,
        embed_scale=decoder.gemma_embed_scale(64), sm_scale=48 ** -0.5,
        layer_windows=(4, -1), attn_logit_softcap=3.0,
        final_logit_softcap=2.5, sandwich_norms=True, **_SMALL),
    # Gemma 3: QK-norm and a RoPE base per layer kind; two local layers per
    # global one over six layers (two scan steps of a 3-layer period).
    "gemma3": DecoderConfig(
        rope=pkvattn.RopeConfig(theta=1e6),
        rope_local=pkvattn.RopeConfig(theta=10.0), rms_norm_eps=0.05,
        qk_norm=True, norm_plus_one=True, activation="gelu_tanh",
        tie_word_embeddings=True, embed_scale=decoder.gemma_embed_scale(64),
        sm_scale=80 ** -0.5, layer_windows=(3, 3, -1, 3, 3, -1),
        sandwich_norms=True, **dict(_SMALL, num_layers=6)),
}


def _params(cfg, rng, dtype):
  """Random weights (biases included) with every norm weight away from its
  identity value, and embeddings whose mean square (~0.04) is of the order
  of the configs' epsilon."""
  p = decoder.init_params(cfg, jax.random.key(int(rng.integers(2 ** 31))),
                          jnp.float32, scale=0.2)

  def perturb(path, a):
    name = jax.tree_util.keystr(path)
    if "norm" in name:
      a = a + jnp.asarray(0.3 * rng.standard_normal(a.shape), jnp.float32)
    return a.astype(dtype)
  return jax.tree_util.tree_map_with_path(perturb, p)


def _pool_rows(pool, plan, layer, b, n, page_size):
  """Rows 0..n-1 of sequence b's K and V pages of `layer` in the pool."""
  table = np.asarray(plan.page_table)[layer, b]  # [2, max_pages]
  t = np.arange(n)
  pages = np.asarray(pool, np.float64)
  return (pages[table[0, t // page_size], t % page_size],
          pages[table[1, t // page_size], t % page_size])


def _prompts(rng, cfg, lens):
  return [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]


_jit_forward = jax.jit(decoder.forward, static_argnums=1,
                       static_argnames=("impl", "unroll"))


@pytest.mark.parametrize("layout", ["scanned", "unstacked", "fused"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_matches_numpy_decoder(name, layout, rng):
  """Ragged prefill of two prompts (longer than the local windows) gives the
  float64 oracle's logits for every token, and the pool holds every layer's
  keys (after QK-norm and RoPE) and values in that layer's pages, whatever
  the parameter layout: stacked layers under `lax.scan` (grouped by the
  layer period), the unstacked Python loop, and fused q/k/v + gate/up
  projections. The pool is NaN outside the written pages, so a stray read
  shows, and comes back with its shape and dtype."""
  cfg = CONFIGS[name]
  params = _params(cfg, rng, jnp.float32)
  prompts = _prompts(rng, cfg, [int(rng.integers(9, 17)), int(rng.integers(2, 9))])
  tokens, q_indptr, plan = prompt_prefill_inputs(
      prompts, num_layers=cfg.num_layers, page_size=8, num_slots=8,
      num_tokens=32, seed=int(rng.integers(1000)))
  run = params
  if layout == "unstacked":
    run = decoder.unstack_layers(params)
  elif layout == "fused":
    run = decoder.fuse_projections(params)
  pool = jnp.full(cfg.pool_shape(8, 8), jnp.nan, jnp.float32)
  logits, new_pool = _jit_forward(run, cfg, jnp.asarray(tokens), pool, plan,
                                  impl="xla")
  assert new_pool.shape == pool.shape and new_pool.dtype == pool.dtype
  for b, p in enumerate(prompts):
    want, kvs = np_forward(params, cfg, p)
    what = f"{name} {layout} prompt {b}"
    np.testing.assert_allclose(
        np.asarray(logits[q_indptr[b]:q_indptr[b + 1]]), want,
        atol=F32_TOL, rtol=F32_TOL, err_msg=what)
    for layer, (k, v) in enumerate(kvs):
      got_k, got_v = _pool_rows(new_pool, plan, layer, b, len(p), 8)
      np.testing.assert_allclose(got_k, k, atol=F32_TOL, rtol=F32_TOL,
                                 err_msg=f"{what} K of layer {layer}")
      np.testing.assert_allclose(got_v, v, atol=F32_TOL, rtol=F32_TOL,
                                 err_msg=f"{what} V of layer {layer}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("plus_one", [False, True])
def test_rms_norm_matches_numpy(plus_one, dtype, rng):
  """`rms_norm` over the last axis with the epsilon inside the square root:
  rows of mean square near and far below the epsilon (where a dropped or
  sign-flipped epsilon changes the result), in the input dtype."""
  eps = 1e-2
  x = rng.standard_normal((5, 3, 24)) * np.array([1.0, 0.1, 0.01])[:, None]
  w = rng.standard_normal(24)
  xj = jnp.asarray(x, dtype)
  wj = jnp.asarray(w, dtype)
  got = decoder.rms_norm(xj, wj, eps, plus_one)
  assert got.dtype == xj.dtype and got.shape == xj.shape
  want = np_norm(np.asarray(xj.astype(jnp.float32)),
                 np.asarray(wj.astype(jnp.float32)), eps, plus_one)
  dt = np.dtype(dtype)
  tol = {np.dtype(jnp.float32): 1e-5, np.dtype(jnp.bfloat16): 2e-2}[dt]
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want,
                             atol=tol, rtol=tol)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_mlp_matches_numpy(activation, fused, rng):
  """The gated MLP, `down(act(gate(x)) * up(x))` with biases, separate or
  fused gate/up: gate pre-activations spread over [-5, 5], where SiLU and
  the tanh-approximated GELU (Gemma's `gelu_pytorch_tanh`) differ from
  their neighbours (exact GELU: up to ~5e-4) by far more than the f32
  tolerance."""
  h, i = 16, 24
  x = rng.uniform(-1.0, 1.0, (7, h))
  p = {name: {"kernel": rng.standard_normal(shape) * sd,
              "bias": rng.standard_normal(shape[1]) * 0.5}
       for name, shape, sd in (("gate_proj", (h, i), 1.0),
                               ("up_proj", (h, i), 0.5),
                               ("down_proj", (i, h), 0.3))}
  m = lambda name, a: a @ p[name]["kernel"] + p[name]["bias"]  # noqa: E731
  want = m("down_proj", np_act(m("gate_proj", x), activation)
           * m("up_proj", x))
  pj = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)
  if fused:
    pj = decoder.fuse_layer_projections({"attn": {}, "mlp": pj})["mlp"]
    assert set(pj) == {"gate_up_proj", "down_proj"}
  got = decoder._mlp(pj, jnp.asarray(x, jnp.float32), activation)  # pylint: disable=protected-access
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def test_logits_indices_select_rows(rng):
  """`logits_indices` returns exactly those tokens' rows of the full logits
  (the final norm and soft cap applied after the selection)."""
  cfg = CONFIGS["gemma2"]
  params = _params(cfg, rng, jnp.float32)
  prompts = _prompts(rng, cfg, [11, 6])
  tokens, q_indptr, plan = prompt_prefill_inputs(
      prompts, num_layers=cfg.num_layers, page_size=8, num_slots=8,
      num_tokens=24)
  pool = jnp.zeros(cfg.pool_shape(8, 8), jnp.float32)
  full, _ = _jit_forward(params, cfg, jnp.asarray(tokens), pool, plan)
  idx = np.asarray([q_indptr[1] - 1, 0, q_indptr[2] - 1], np.int32)
  some, _ = _jit_forward(params, cfg, jnp.asarray(tokens), pool, plan,
                         logits_indices=jnp.asarray(idx))
  assert some.shape == (3, cfg.vocab_size)
  np.testing.assert_allclose(np.asarray(some), np.asarray(full)[idx],
                             atol=1e-5, rtol=1e-5)


def test_config_defaults_are_plain_llama():
  """A config naming only the shapes and RoPE is a plain Llama: `x * w`
  norms with epsilon 1e-6, SiLU, no biases, untied head, no embedding scale,
  soft caps, sandwich or QK norms, full attention in every layer. Every
  caller that leaves a field out (a user, `tiny-llama`) relies on these."""
  cfg = DecoderConfig(rope=pkvattn.RopeConfig(), **_SMALL)
  assert cfg.rms_norm_eps == 1e-6 and cfg.activation == "silu"
  assert not (cfg.norm_plus_one or cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias
              or cfg.tie_word_embeddings or cfg.sandwich_norms or cfg.qk_norm)
  assert cfg.embed_scale is None and cfg.sm_scale is None
  assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None
  assert cfg.rope_local is None and cfg.windows == (-1, -1)
  assert not cfg.has_sliding_window and cfg.layer_period == 1
  assert hash(cfg) == hash(DecoderConfig(rope=pkvattn.RopeConfig(), **_SMALL))
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.num_layers = 3  # a jit static argument must not change


def test_gemma_embed_scale_is_sqrt_hidden():
  """Gemma scales its embeddings by `sqrt(hidden_size)` (so the Gemma
  configs here run with a scale of 8)."""
  for h in (64, 2304, 3584):
    assert decoder.gemma_embed_scale(h) == pytest.approx(h ** 0.5, rel=1e-12)
  assert CONFIGS["gemma2"].embed_scale == CONFIGS["gemma3"].embed_scale == 8.0


def test_config_refuses_bad_heads_activation_and_windows():
  """`DecoderConfig` refuses query heads that are not a positive multiple of
  the KV heads, an activation other than SiLU / tanh-GELU, and a
  `layer_windows` whose length is not `num_layers`."""
  rope = pkvattn.RopeConfig()
  for kw, match in (
      (dict(num_qo_heads=3, num_kv_heads=2), "must be a positive multiple"),
      (dict(num_kv_heads=0), "must be a positive multiple"),
      (dict(activation="gelu"), r"Invalid activation: expected one of "
       r"\('silu', 'gelu_tanh'\), got 'gelu'"),
      (dict(layer_windows=(3, 3, 3)), r"Invalid layer_windows: expected 2 "
       r"entries, got 3")):
    with pytest.raises(ValueError, match=match):
      DecoderConfig(rope=rope, **{**_SMALL, **kw})


def test_unstack_stack_and_fuse_layouts(rng):
  """`unstack_layers` gives one tree per layer (layer i's slice of every
  stacked leaf) and is idempotent; `stack_layers` inverts it and leaves a
  stacked tree as it is; `fuse_projections` fuses unstacked layers as it
  fuses stacked ones, and is idempotent."""
  cfg = CONFIGS["llama_biases"]
  params = _params(cfg, rng, jnp.float32)
  flat = dict(jax.tree_util.tree_leaves_with_path(params["layers"]))
  un = decoder.unstack_layers(params)
  assert isinstance(un["layers"], tuple) and len(un["layers"]) == cfg.num_layers
  for i, lp in enumerate(un["layers"]):
    got = dict(jax.tree_util.tree_leaves_with_path(lp))
    assert got.keys() == flat.keys()
    for path, a in got.items():
      np.testing.assert_array_equal(a, flat[path][i])
  assert decoder.unstack_layers(un)["layers"] is un["layers"]
  for tree in (decoder.stack_layers(un), decoder.stack_layers(params)):
    jax.tree.map(np.testing.assert_array_equal, tree, params)
  fused = decoder.fuse_projections(params)
  fused_un = decoder.fuse_projections(un)
  assert isinstance(fused_un["layers"], tuple)
  jax.tree.map(np.testing.assert_array_equal, decoder.stack_layers(fused_un),
               fused)
  jax.tree.map(np.testing.assert_array_equal,
               decoder.fuse_projections(fused), fused)
  qkv = fused["layers"]["attn"]["qkv_proj"]["kernel"]
  np.testing.assert_array_equal(
      qkv, jnp.concatenate([params["layers"]["attn"][n]["kernel"]
                            for n in ("q_proj", "k_proj", "v_proj")], -1))


def test_forward_checks_tokens_tables_and_layer_count(rng):
  """`forward` refuses, at trace time, tokens that are not the plan's
  `num_tokens`, a page table without one table per layer, and unstacked
  params with another number of layers than the config."""
  cfg = CONFIGS["llama_biases"]
  params = _params(cfg, rng, jnp.float32)
  tokens, _, plan = prompt_prefill_inputs(
      [[1] * 5, [2] * 3], num_layers=cfg.num_layers, page_size=8,
      num_slots=4, num_tokens=8)
  pool = jax.ShapeDtypeStruct(cfg.pool_shape(4, 8), jnp.float32)

  def trace(p, toks, pl):
    return jax.eval_shape(lambda kv: decoder.forward(
        p, cfg, jnp.asarray(toks), kv, pl, impl="xla"), pool)
  trace(params, tokens, plan)  # the well-formed step traces
  with pytest.raises(ValueError, match=r"Invalid shape of tokens: expected "
                     r"\(8,\), got \(7,\)"):
    trace(params, tokens[:7], plan)
  with pytest.raises(ValueError, match=r"Invalid shape of plan\.page_table"):
    trace(params, tokens, plan.replace(page_table=plan.page_table[:1]))
  one = dict(params, layers=decoder.unstack_layers(params)["layers"][:1])
  with pytest.raises(ValueError, match=r"Invalid params\['layers'\]: "
                     r"expected 2 per-layer trees, got 1"):
    trace(one, tokens, plan)


@pytest.mark.parametrize("windows,period,sliding", [
    ((), 1, False),                          # all -1
    ((7, 7, 7, 7), 1, True),                 # Mistral
    ((0, -1, 0, -1), 2, True),               # Gemma 2; window 0 is a window
    ((5, 5, -1, 5, 5, -1), 3, True),         # Gemma 3 (shortened)
    ((5, -1, -1, 5), 4, True),               # no period shorter than L
    ((-1, -1, 3, 3), 4, True),
    ((2, 3, 2, 3, 2, 3), 2, True),
], ids=str)
def test_windows_period_and_sliding_flag(windows, period, sliding):
  """`layer_period` is the smallest p dividing num_layers with
  `windows[i] == windows[i % p]` (the scan groups layers by it, and every
  layer of a group needs the window of its position); `has_sliding_window`
  says whether any layer has `window_left >= 0`."""
  n = len(windows) or 4
  cfg = DecoderConfig(rope=pkvattn.RopeConfig(), layer_windows=windows,
                      **dict(_SMALL, num_layers=n))
  assert cfg.windows == (windows or (-1,) * n)
  assert cfg.layer_period == period
  assert cfg.has_sliding_window == sliding
  for layer in range(n):
    assert cfg.attention_spec(layer).window_left == cfg.windows[layer]


def test_attention_spec_picks_rope_and_qk_norm_per_layer():
  """Gemma 3: sliding layers (window >= 0, 0 included) take `rope_local`,
  global layers `rope`; QK-norm uses the model's epsilon; without
  `rope_local` every layer takes `rope`."""
  glob, local = pkvattn.RopeConfig(theta=1e6), pkvattn.RopeConfig(theta=10.0)
  cfg = DecoderConfig(rope=glob, rope_local=local, qk_norm=True,
                      rms_norm_eps=1e-5, layer_windows=(0, -1, 9, -1),
                      **dict(_SMALL, num_layers=4))
  ropes = [cfg.attention_spec(layer).rope for layer in range(4)]
  assert ropes == [local, glob, local, glob]
  assert all(cfg.attention_spec(layer).qk_norm_eps == 1e-5 for layer in range(4))
  plain = dataclasses.replace(cfg, rope_local=None, qk_norm=False)
  assert all(plain.attention_spec(layer).rope == glob for layer in range(4))
  assert plain.attention_spec(0).qk_norm_eps is None


def test_init_params_layout_and_scale(rng):
  """`init_params` gives each config exactly its parameters: biases per
  flag, QK / sandwich norms only when enabled, `lm_head` only when untied,
  norms at their identity value (0 for `(1 + w)` norms, 1 otherwise), every
  leaf with a leading `num_layers` axis, weights of standard deviation
  `scale`; and `pool_shape` is the documented multi-layer pool."""
  for name, cfg in CONFIGS.items():
    L, H, I, V = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size,
                  cfg.vocab_size)
    qd, kd = cfg.num_qo_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    scale = float(rng.uniform(0.05, 0.5))
    p = decoder.init_params(cfg, jax.random.key(int(rng.integers(2 ** 31))),
                            jnp.bfloat16, scale=scale)
    lay = p["layers"]
    want = {"q_proj": (H, qd), "k_proj": (H, kd), "v_proj": (H, kd),
            "o_proj": (qd, H)}
    for proj, (fi, fo) in want.items():
      assert lay["attn"][proj]["kernel"].shape == (L, fi, fo), (name, proj)
      bias = cfg.o_bias if proj == "o_proj" else cfg.qkv_bias
      assert ("bias" in lay["attn"][proj]) == bias, (name, proj)
    for proj, (fi, fo) in {"gate_proj": (H, I), "up_proj": (H, I),
                           "down_proj": (I, H)}.items():
      assert lay["mlp"][proj]["kernel"].shape == (L, fi, fo), (name, proj)
      assert ("bias" in lay["mlp"][proj]) == cfg.mlp_bias, (name, proj)
    assert ("q_norm" in lay["attn"]) == ("k_norm" in lay["attn"]) == cfg.qk_norm
    assert ("post_attn_norm" in lay) == ("post_mlp_norm" in lay) == (
        cfg.sandwich_norms)
    assert ("lm_head" in p) == (not cfg.tie_word_embeddings), name
    assert p["embed"].shape == (V, H)
    ident = 0.0 if cfg.norm_plus_one else 1.0
    for path, a in jax.tree_util.tree_leaves_with_path(p):
      key = jax.tree_util.keystr(path)
      assert a.dtype == jnp.bfloat16, key
      if key != "['embed']" and key != "['lm_head']" and key != "['final_norm']":
        assert a.shape[0] == L, key
      if "norm" in key:
        np.testing.assert_array_equal(np.asarray(a, np.float32), ident, key)
      elif a.size >= 1000:  # enough samples for the standard deviation
        std = float(np.asarray(a, np.float32).std())
        assert 0.85 * scale < std < 1.15 * scale, (key, std, scale)
    assert decoder.param_count(p) == sum(
        a.size for a in jax.tree.leaves(p))
    assert cfg.pool_shape(5, 16) == (5 * L * 2, 16, cfg.num_kv_heads,
                                     cfg.head_dim)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_pallas_forward_plans_the_kernel_once_per_step(impl, monkeypatch):
  """With the pallas kernel, `forward` plans the step ONCE (FlashInfer's
  plan/run split) for every layer: causal, for the step's shapes and
  dtypes, with no window when no layer has one and the widest window when
  every layer has one; a plan given in the step plan is reused; the xla
  path plans nothing; the layers' attention runs the implementation asked
  for, and the logits are f32 either way. Traced only (`jax.eval_shape`):
  the plan steers the kernel's launch order, which no CPU result shows.
  (Mixed local / global models get `max(windows)`, the local window; not
  pinned here.)"""
  cfg = dataclasses.replace(CONFIGS["gemma3"], layer_windows=())
  calls = []
  real = decoder._attention.plan_prefill  # pylint: disable=protected-access

  def spy(*args, **kw):
    calls.append(kw)
    return real(*args, **kw)
  monkeypatch.setattr(decoder._attention, "plan_prefill", spy)  # pylint: disable=protected-access
  impls = []

  def block_spy(*args, impl, **kw):
    impls.append(impl)
    return real_block(*args, impl=impl, **kw)
  real_block = decoder.attention_block
  monkeypatch.setattr(decoder, "attention_block", block_spy)
  params = decoder.init_params(cfg, jax.random.key(0), jnp.bfloat16)
  tokens, _, plan = prompt_prefill_inputs(
      [[1] * 9, [2] * 5], num_layers=cfg.num_layers, page_size=8,
      num_slots=4, num_tokens=16)
  pool = jax.ShapeDtypeStruct(cfg.pool_shape(4, 8), jnp.bfloat16)
  fwd = lambda pl: jax.eval_shape(  # noqa: E731
      lambda p, kv: decoder.forward(p, cfg, jnp.asarray(tokens), kv, pl,
                                    impl=impl), params, pool)
  logits, _ = fwd(plan)
  # f32 logits from bf16 weights (the head accumulates in f32).
  assert logits.shape == (16, cfg.vocab_size) and logits.dtype == jnp.float32
  assert impls and set(impls) == {impl}  # the scanned layer's attention
  if impl == "xla":
    assert calls == []
    return
  assert len(calls) == 1, calls
  kw = calls[0]
  assert kw["causal"] is True and kw["window_left"] == -1
  assert (kw["num_tokens"], kw["num_qo_heads"], kw["num_kv_heads"],
          kw["head_dim"]) == (16, 2, 1, 64)
  assert kw["dtype"] == jnp.bfloat16 and kw["kv_dtype"] == jnp.bfloat16
  calls.clear()
  # Mixed local / global layers: still one plan for all of them.
  cfg = CONFIGS["gemma3"]
  fwd(plan)
  assert len(calls) == 1 and calls[0]["causal"] is True
  calls.clear()
  # All layers sliding: the plan takes their widest window.
  cfg = dataclasses.replace(cfg, layer_windows=(3, 5, 3, 3, 5, 3))
  logits, _ = fwd(plan)
  assert len(calls) == 1 and calls[0]["window_left"] == 5
  # A plan made by the caller is used as is.
  calls.clear()
  kernel_plan = real(plan.q_indptr, plan.kv_lens, num_tokens=16,
                     num_qo_heads=2, num_kv_heads=1, head_dim=64,
                     dtype=jnp.bfloat16)
  fwd(plan.replace(kernel_plan=kernel_plan))
  assert calls == []


@pytest.mark.parametrize("layout", ["scanned", "unstacked"])
def test_fp8_pool_comes_back_in_its_own_dtype(layout, rng):
  """An FP8 pool passed as float8_e4m3fn comes back as float8_e4m3fn, and
  as `uint8` bytes when passed as bytes (the scan carries it as bytes
  inside): the same logits and the same pages either way, with this step's
  K/V rows written."""
  from pkvattn import _kv  # pylint: disable=import-outside-toplevel
  from pkvattn.models import calibrate  # pylint: disable=import-outside-toplevel
  cfg = CONFIGS["gemma2"]
  params = calibrate.set_kv_scales(_params(cfg, rng, jnp.float32), 0.5, 0.25)
  if layout == "unstacked":
    params = decoder.unstack_layers(params)
  tokens, _, plan = prompt_prefill_inputs(
      _prompts(rng, cfg, [10, 3]), num_layers=cfg.num_layers, page_size=8,
      num_slots=8, num_tokens=16)
  pool = jnp.zeros(cfg.pool_shape(8, 8), jnp.float8_e4m3fn)
  got, got_pool = _jit_forward(params, cfg, jnp.asarray(tokens), pool, plan,
                               impl="xla")
  want, want_pool = _jit_forward(params, cfg, jnp.asarray(tokens),
                                 _kv.as_bytes(pool), plan, impl="xla")
  assert got_pool.dtype == jnp.float8_e4m3fn and got_pool.shape == pool.shape
  assert want_pool.dtype == jnp.uint8 and want_pool.shape == pool.shape
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(_kv.as_bytes(got_pool)),
                                np.asarray(want_pool))
  assert np.asarray(want_pool).any()
