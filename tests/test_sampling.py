"""The engine's sampler (`pkvattn.sampling.sample`) against a float64 oracle."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pkvattn.sampling import SamplingParams
from pkvattn.sampling import sample


def test_sampler():
  sample_fn = jax.jit(sample)
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 50)),
                       jnp.float32)
  greedy = np.argmax(np.asarray(logits), -1)
  zeros = jnp.zeros(4, jnp.int32)
  seeds = jnp.arange(4, dtype=jnp.uint32)
  # Greedy rows, top_k = 1 and a tiny top_p all give the argmax.
  for temp, k, p in ((0.0, 0, 1.0), (1.0, 1, 1.0), (1.0, 0, 1e-6)):
    out = sample_fn(logits, jnp.full(4, temp), jnp.full(4, k, jnp.int32),
                 jnp.full(4, p), seeds, zeros)
    np.testing.assert_array_equal(np.asarray(out), greedy)
  # top_k = 3: always one of the 3 best; deterministic for a seed and index.
  out = [np.asarray(sample_fn(logits, jnp.ones(4), jnp.full(4, 3, jnp.int32),
                           jnp.ones(4), seeds, jnp.full(4, i, jnp.int32)))
         for i in range(20)]
  top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
  assert all(np.isin(o[b], top3[b]) for o in out for b in range(4))
  assert len({tuple(o) for o in out}) > 1
  again = sample_fn(logits, jnp.ones(4), jnp.full(4, 3, jnp.int32), jnp.ones(4),
                 seeds, jnp.full(4, 5, jnp.int32))
  np.testing.assert_array_equal(np.asarray(again), out[5])
  # Without the cond (the caller knows a row samples): the same tokens, and
  # greedy rows still take the argmax.
  mixed = (logits, jnp.asarray([0.0, 1.0, 0.0, 0.7]), jnp.full(4, 3, jnp.int32),
           jnp.ones(4), seeds, jnp.full(4, 2, jnp.int32))
  no_cond = jax.jit(lambda *a: sample(*a, cond=False))(*mixed)
  np.testing.assert_array_equal(np.asarray(no_cond),
                                np.asarray(sample_fn(*mixed)))
  np.testing.assert_array_equal(np.asarray(no_cond)[[0, 2]], greedy[[0, 2]])


def _kept_distribution(logits, temperature, top_k, top_p):
  """float64 oracle: HF transformers' top-k then top-p (on the top-k
  renormalised softmax), renormalised over the kept tokens."""
  z = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-z, kind="stable")
  p = np.exp(z[order] - z[order].max())
  p /= p.sum()
  k = top_k if top_k > 0 else len(p)
  p[k:] = 0
  p /= p.sum()
  before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
  p[before >= top_p] = 0
  p /= p.sum()
  out = np.zeros_like(p)
  out[order] = p
  return out


@pytest.mark.parametrize("vocab,params_a,params_b", [
    (12, (1.0, 0, 1.0), (0.7, 5, 1.0)),
    (12, (1.3, 0, 0.8), (1.0, 6, 0.7)),
    # Several draw blocks, the last one partial; rows of both settings share
    # the batch.
    (300, (1.0, 0, 0.9), (0.8, 40, 0.95)),
])
def test_sampler_draws_the_kept_distribution(vocab, params_a, params_b, rng):
  n = 20_000  # draws per setting: one row per generated-token index
  logits = np.sort(rng.normal(scale=1.5 if vocab < 100 else 3.0,
                              size=vocab).astype(np.float32))[::-1]
  # The two most likely tokens first and last, the rest shuffled: every
  # setting keeps tokens in the first draw block and in the last (partial)
  # one.
  logits = np.concatenate([logits[:1], rng.permutation(logits[2:]),
                           logits[1:2]])
  # Rows alternate between the two settings.
  params = np.asarray([params_a, params_b] * n, np.float64)
  out = np.asarray(jax.jit(sample)(
      jnp.broadcast_to(jnp.asarray(logits), (2 * n, vocab)),
      jnp.asarray(params[:, 0], jnp.float32),
      jnp.asarray(params[:, 1], jnp.int32),
      jnp.asarray(params[:, 2], jnp.float32),
      jnp.full(2 * n, rng.integers(2**32), jnp.uint32),
      jnp.arange(2 * n, dtype=jnp.int32)))
  for half, (temperature, top_k, top_p) in enumerate((params_a, params_b)):
    want = _kept_distribution(logits, temperature, top_k, top_p)
    freq = np.bincount(out[half::2], minlength=vocab) / n
    assert np.all(freq[want == 0] == 0), (freq, want)
    # Five binomial standard deviations per token (and an absolute floor).
    tol = 5 * np.sqrt(want * (1 - want) / n) + 1e-3
    np.testing.assert_array_less(np.abs(freq - want), tol)


def test_sampler_keeps_ties_and_the_top_token(rng):
  n = 6_000
  draw = jax.jit(lambda logits, k, p: sample(
      jnp.broadcast_to(logits, (n, logits.shape[0])), jnp.ones(n),
      jnp.full(n, k, jnp.int32), jnp.full(n, p, jnp.float32),
      jnp.full(n, 7, jnp.uint32), jnp.arange(n, dtype=jnp.int32)))
  # Three tokens tied for the top: top_k = 2 keeps all three (the boundary's
  # ties), in equal shares.
  logits = jnp.asarray([0.0, 2.0, -1.0, 2.0, 2.0, 1.0], jnp.float32)
  freq = np.bincount(np.asarray(draw(logits, 2, 1.0)), minlength=6) / n
  assert set(np.flatnonzero(freq)) == {1, 3, 4}, freq
  np.testing.assert_allclose(freq[[1, 3, 4]], 1 / 3, atol=0.03)
  # Greedy rows beside sampling ones take the argmax (the first of tied
  # tokens), never a draw among the tied.
  temps = jnp.asarray([0.0, 1.0] * (n // 2))
  out = np.asarray(jax.jit(sample)(
      jnp.broadcast_to(logits, (n, 6)), temps, jnp.zeros(n, jnp.int32),
      jnp.ones(n), jnp.full(n, 7, jnp.uint32), jnp.arange(n, dtype=jnp.int32)))
  assert (out[::2] == 1).all()
  assert {1, 3, 4} <= set(out[1::2].tolist())  # the sampling rows draw
  # A top_p whose target rounds to zero still keeps the most likely token.
  logits = jnp.asarray(rng.normal(size=300), jnp.float32)
  out = np.asarray(draw(logits, 0, 1e-45))
  np.testing.assert_array_equal(out, int(np.argmax(np.asarray(logits))))


def test_sampler_branches_only_where_asked():
  """By default the sampling path sits under one `lax.cond` on whether any
  row samples; `cond=False` and `greedy_only` build none (on a GPU a
  `lax.cond` reads its predicate back on the host), and `greedy_only` builds
  no sampling path at all (no random key)."""
  rows, vocab = 3, 40
  args = (jnp.zeros((rows, vocab)), jnp.ones(rows), jnp.zeros(rows, jnp.int32),
          jnp.ones(rows), jnp.zeros(rows, jnp.uint32),
          jnp.zeros(rows, jnp.int32))

  def primitives(**kw):
    jaxpr = jax.make_jaxpr(lambda *a: sample(*a, **kw))(*args)
    return {e.primitive.name for e in jaxpr.jaxpr.eqns}

  assert "cond" in primitives()
  no_cond = primitives(cond=False)
  assert "cond" not in no_cond and "random_fold_in" in no_cond
  greedy = primitives(greedy_only=True)
  assert "cond" not in greedy and "random_fold_in" not in greedy


def test_inverse_cdf_at_the_edges(rng):
  """The draw's inverse CDF against numpy, exact: integer masses (sums exact
  in f32) and `u` in 1/1024 steps, over 1,000 entries (4 blocks of 256) with
  empty blocks first, last and between, zeros inside blocks, and `u` of 0
  (the first kept entry) and 1 (rounding's end: the last kept entry)."""
  from pkvattn.sampling import _inverse_cdf
  vocab = 1000
  kept = rng.integers(0, 8, (6, vocab)) * (rng.random((6, vocab)) < 0.3)
  kept[0, :256] = 0                  # block 0 empty
  kept[1, 512:] = 0                  # blocks 2 and 3 empty
  kept[2, 256:512] = 0               # an empty block between
  kept[3] = 0
  kept[3, [3, 700]] = [5, 2]         # two entries, far apart
  kept[4, :300] = 0                  # a block that starts empty inside
  kept[5, 1:] = 0
  kept[5, 0] = 1                     # one entry
  us = np.concatenate([[0.0, 1.0], rng.integers(0, 1024, 30) / 1024])
  got = np.stack([np.asarray(_inverse_cdf(
      jnp.asarray(kept, jnp.float32), jnp.full((6,), u, jnp.float32)))
      for u in us], axis=1)
  cum = np.cumsum(kept, axis=1)
  for r in range(6):
    last = np.flatnonzero(kept[r])[-1]
    for j, u in enumerate(us):
      above = np.flatnonzero(cum[r] > u * cum[r, -1])
      want = above[0] if len(above) else last
      assert kept[r, want] > 0
      assert got[r, j] == want, (r, u)


def test_sampling_params_defaults_are_a_plain_greedy_request():
  """`SamplingParams()` as declared: 32 greedy tokens (temperature 0), no
  top-k or top-p cut (0 and 1 = off), seed 0, stopped by the model's EOS ids
  (None) and not made to ignore them."""
  p = SamplingParams()
  assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (
      32, 0.0, 0, 1.0, 0)
  assert p.stop_token_ids is None and p.ignore_eos is False
  # A checked request stays as checked: its fields cannot be reassigned.
  with pytest.raises(dataclasses.FrozenInstanceError):
    p.top_k = -1


@pytest.mark.parametrize("impl,backend", [(None, None), ("pallas", "triton"),
                                          ("xla", "xla")])
def test_kept_floor_asks_the_dispatch_rule_about_the_rows(impl, backend, rng,
                                                          monkeypatch):
  """`kept_floor` hands the dispatch rule the probabilities' dtype and row
  length (the vocabulary, not the number of rows: the kernel's block is
  sized from it) and `impl` as the rule's backend override."""
  from pkvattn import sampling
  from pkvattn.pallas_kernels import dispatch
  rows, vocab = rng.choice(np.arange(2, 40), 2, replace=False)
  asked = []
  rule = dispatch.sample_floor

  def spy(**kw):
    asked.append(kw)
    return rule(**kw)

  monkeypatch.setattr(dispatch, "sample_floor", spy)
  probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(rows, vocab)),
                                     jnp.float32))
  sampling.kept_floor(probs, jnp.zeros(rows, jnp.int32), jnp.ones(rows),
                      jnp.ones(rows, bool), impl)
  assert len(asked) == 1
  assert asked[0]["vocab_size"] == vocab
  assert asked[0]["dtype"] == jnp.float32
  assert asked[0]["backend"] == backend
  assert asked[0]["gpu"] == dispatch.current_gpu()


def test_stop_token_ids_start_at_zero():
  """Token ids are in [0, 2**31 - 1]: -1 (one below) is refused, 0 taken."""
  with pytest.raises(ValueError, match="Invalid stop_token_ids: expected"):
    SamplingParams(stop_token_ids=(3, -1))
  assert SamplingParams(stop_token_ids=(0,)).stop_token_ids == (0,)
