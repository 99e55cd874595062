"""The sort-free kept-set floor (`pallas_kernels.sample_floor`, interpret
mode) against the sorted reference and a float64 oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.sampling import boundary_ok
from pkvattn import sampling
from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import sample_floor as sf


def _rows(rng, rows, vocab):
  """Softmax rows, peaked and flat, one with its top probability tied five
  ways and one with a run of equal probabilities in the middle."""
  scale = rng.choice([0.3, 1.0, 4.0], size=(rows, 1))
  logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
  logits[0, :5] = logits[0].max() + 1.0
  logits[1, 10:30] = np.median(logits[1])
  return jax.nn.softmax(jnp.asarray(logits), axis=-1)


@pytest.mark.parametrize("vocab,block,ways", [
    (50, 64, 2), (300, 128, 4), (1000, 256, 8), (1000, 128, 3)])
def test_floor_keeps_the_reference_set(vocab, block, ways, rng):
  rows = 16
  probs = _rows(rng, rows, vocab)
  top_k = jnp.asarray(rng.choice([0, 1, 3, 40, vocab, vocab + 5], rows),
                      jnp.int32)
  top_p = jnp.asarray(rng.choice([1.0, 0.95, 0.5, 1e-6], rows), jnp.float32)
  active = jnp.asarray(rng.random(rows) < 0.8).at[:2].set(True)
  got = np.asarray(sf.sample_floor(probs, top_k, top_p, active,
                                   config=sf.Config(block, 4, ways),
                                   interpret=True))
  want = np.asarray(jax.jit(sf.reference_floor)(probs, top_k, top_p))
  p = np.asarray(probs)
  a = np.asarray(active)
  same = np.all((p >= got[:, None]) == (p >= want[:, None]), axis=1)
  # Rows that differ may only do so within rounding at the boundary (the
  # float64 definition holds for both floors).
  diff = np.flatnonzero(a & ~same)
  assert np.all(boundary_ok(probs, np.asarray(top_k), np.asarray(top_p),
                            got)[diff]), (diff, got[diff], want[diff])
  assert np.all(boundary_ok(probs[a], np.asarray(top_k)[a],
                            np.asarray(top_p)[a], got[a]))
  assert len(diff) <= 1, diff
  np.testing.assert_array_equal(got[~a], 0.0)  # greedy rows: no passes
  # Every kept set holds the most likely token.
  assert np.all(got[a] <= p[a].max(axis=1))


def test_floor_of_ties_at_the_top_k_boundary():
  # Three tokens tied for the top and top_k = 2: all three kept, by both.
  logits = jnp.asarray([[0.0, 2.0, -1.0, 2.0, 2.0, 1.0]], jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  args = (probs, jnp.asarray([2], jnp.int32), jnp.asarray([1.0]))
  got = sf.sample_floor(*args, jnp.asarray([True]), config=sf.Config(8, 4),
                        interpret=True)
  np.testing.assert_array_equal(np.asarray(got),
                                np.asarray(sf.reference_floor(*args)))
  np.testing.assert_array_equal(np.asarray(probs[0] >= got[0]),
                                [False, True, False, True, True, False])


def test_sampler_with_the_kernel_draws_the_reference_tokens(rng):
  """`sample(impl="pallas")` (the kernel's floor) against `impl="xla"` (the
  sort's): the same draw from the same kept set gives the same tokens."""
  rows, vocab = 32, 200
  logits = jnp.log(_rows(rng, rows, vocab))
  args = (logits, jnp.asarray(rng.choice([0.0, 0.7, 1.0], rows), jnp.float32),
          jnp.asarray(rng.choice([0, 5, 50], rows), jnp.int32),
          jnp.asarray(rng.choice([1.0, 0.9, 0.3], rows), jnp.float32),
          jnp.full(rows, rng.integers(2**32), jnp.uint32),
          jnp.arange(rows, dtype=jnp.int32))
  got = jax.jit(lambda *a: sampling.sample(*a, impl="pallas"))(*args)
  want = jax.jit(lambda *a: sampling.sample(*a, impl="xla"))(*args)
  assert np.mean(np.asarray(got) == np.asarray(want)) >= 30 / 32


def test_dispatch_takes_the_kernel_on_a_gpu_only():
  for gpu in (dispatch.HOPPER, dispatch.AMPERE):
    choice = dispatch.sample_floor(gpu=gpu, dtype=jnp.float32,
                                   vocab_size=49152)
    assert choice.backend == "triton" and choice.config.block == 4096
  small = dispatch.sample_floor(gpu=dispatch.ADA, dtype=jnp.float32,
                                vocab_size=300)
  assert small.config.block == 512
  for gpu, dtype in ((dispatch.INTERPRET, jnp.float32),
                     (dispatch.HOPPER, jnp.bfloat16)):
    assert dispatch.sample_floor(gpu=gpu, dtype=dtype,
                                 vocab_size=1000).backend == "xla"
  # The override (impl="pallas" on a CPU; impl="xla" on a GPU).
  forced = dispatch.sample_floor(gpu=dispatch.INTERPRET, dtype=jnp.float32,
                                 vocab_size=300, backend="triton")
  assert forced.backend == "triton" and forced.config.block == 512
  assert dispatch.sample_floor(gpu=dispatch.HOPPER, dtype=jnp.float32,
                               vocab_size=300, backend="xla").backend == "xla"
  with pytest.raises(ValueError, match="backend"):
    dispatch.sample_floor(gpu=dispatch.HOPPER, dtype=jnp.float32,
                          vocab_size=300, backend="mosaic")


def test_bad_impl_is_refused():
  probs = jnp.full((1, 4), 0.25)
  with pytest.raises(ValueError, match="impl"):
    sampling.kept_floor(probs, jnp.zeros(1, jnp.int32), jnp.ones(1),
                        jnp.ones(1, bool), impl="cuda")
