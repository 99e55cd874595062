"""A float64 numpy decoder written from the formulas: the oracle of
`pkvattn.models.decoder`.

`np_forward` prefills one sequence from an empty cache and returns its
logits and every layer's keys (after QK-norm and RoPE) and values; it
shares no code with the decoder (RoPE from `rope_utils`, attention from
`attention_utils.dense_attention`). `np_norm`, `np_dense` and `np_act` are
its RMSNorm, projection and gate activation. `test_decoder.py` checks the
decoder against them; `test_calibrate.py` checks the calibrated K/V amax
against `np_forward`'s keys and values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attention_utils import dense_attention
from rope_utils import np_inv_freq
from rope_utils import np_rope


def np_norm(x, w, eps, plus_one):
  """float64 RMSNorm over the last axis, the epsilon inside the square root:
  `x / sqrt(mean(x^2) + eps)` times `1 + w` (`plus_one`, Gemma) or `w`."""
  x = np.asarray(x, np.float64)
  w = np.asarray(w, np.float64)
  y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
  return y * (1.0 + w) if plus_one else y * w


def np_dense(p, x):
  """float64 `x @ kernel (+ bias)` of one projection's parameters `p`."""
  y = x @ np.asarray(p["kernel"], np.float64)
  if "bias" in p:
    y = y + np.asarray(p["bias"], np.float64)
  return y


def np_act(a, activation):
  """float64 gate activation: SiLU for "silu", else the tanh-approximated
  GELU."""
  if activation == "silu":
    return a / (1.0 + np.exp(-a))
  return 0.5 * a * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (a + 0.044715 * a ** 3)))


def np_forward(params, cfg, tokens):
  """float64 logits of one sequence prefilled from an empty cache, and the
  keys (after QK-norm and RoPE) and values of every layer."""
  f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  params = jax.tree.map(f64, params)
  norm = lambda x, w: np_norm(x, w, cfg.rms_norm_eps, cfg.norm_plus_one)
  n, d = len(tokens), cfg.head_dim
  pos = np.arange(n)
  kvs = []
  x = params["embed"][np.asarray(tokens)]
  if cfg.embed_scale is not None:
    x = x * cfg.embed_scale
  for l in range(cfg.num_layers):
    lp = jax.tree.map(lambda a, l=l: a[l], params["layers"])
    at = lp["attn"]
    h = norm(x, lp["attn_norm"])
    q = np_dense(at["q_proj"], h).reshape(n, cfg.num_qo_heads, d)
    k = np_dense(at["k_proj"], h).reshape(n, cfg.num_kv_heads, d)
    v = np_dense(at["v_proj"], h).reshape(n, cfg.num_kv_heads, d)
    if cfg.qk_norm:  # Gemma 3: always the (1 + w) form, per head
      q = np_norm(q, at["q_norm"], cfg.rms_norm_eps, True)
      k = np_norm(k, at["k_norm"], cfg.rms_norm_eps, True)
    window = cfg.windows[l]
    rope = cfg.rope_local if (cfg.rope_local and window >= 0) else cfg.rope
    inv = np_inv_freq(d, rope.theta, scaling=rope.scaling)
    q, k = np_rope(q, pos, inv, rope.style), np_rope(k, pos, inv, rope.style)
    kvs.append((k, v))
    o, _ = dense_attention(q, k, v, pos, n, window_left=window,
                           sm_scale=cfg.sm_scale or d ** -0.5,
                           logits_soft_cap=cfg.attn_logit_softcap)
    a = np_dense(at["o_proj"], o.reshape(n, -1))
    if cfg.sandwich_norms:
      a = norm(a, lp["post_attn_norm"])
    x = x + a
    mp = lp["mlp"]
    h = norm(x, lp["mlp_norm"])
    m = np_dense(mp["down_proj"], np_act(np_dense(mp["gate_proj"], h),
                                         cfg.activation)
                 * np_dense(mp["up_proj"], h))
    if cfg.sandwich_norms:
      m = norm(m, lp["post_mlp_norm"])
    x = x + m
  x = norm(x, params["final_norm"])
  head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  logits = x @ head
  if cfg.final_logit_softcap:
    c = cfg.final_logit_softcap
    logits = c * np.tanh(logits / c)
  return logits, kvs
