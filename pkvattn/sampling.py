"""Token sampling for the engine: greedy, temperature, top-k, top-p, seeded per row.

Randomness is per request and per generated index (`fold_in(key(seed), index)`),
so a request samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from pkvattn import _checks

INT32_MAX = 2**31 - 1
# The largest finite float32: a larger finite Python float becomes inf on the
# device.
F32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request generates.

  Every field is checked here against what the engine's device programs
  hold (int32 counts and token ids, a uint32 seed, float32 numbers), so a
  request that would overflow a step's input arrays is refused when it is
  built, never inside a step. Token ids are checked against the model's
  vocabulary when the request is submitted (`serving.request.make_request`).

  Attributes:
    max_new_tokens: int in [1, 2**31 - 1], tokens to generate at most.
    temperature: number in [0, float32 max]; 0 = greedy (argmax), otherwise
      logits are divided by it.
    top_k: int in [0, 2**31 - 1]; keep the `top_k` most likely tokens; 0 = all.
    top_p: number in (0, 1]; keep the smallest set of most likely tokens whose
      probability reaches `top_p` (nucleus); 1.0 = all.
    seed: any int, the request's random seed (taken modulo 2**32: the
      device key is a uint32).
    stop_token_ids: a sequence of token ids (ints in [0, 2**31 - 1]) that end
      generation (kept in the output); None = the model's EOS ids.
    ignore_eos: bool, generate exactly `max_new_tokens`.

  Raises:
    ValueError: a field of the wrong type or out of range, naming it with the
      expected range and the value got.
  """
  max_new_tokens: int = 32
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_token_ids: tuple[int, ...] | None = None
  ignore_eos: bool = False

  def __post_init__(self):
    def is_int(x):
      return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    def is_real(x):
      return isinstance(x, (int, float, np.integer, np.floating)) and (
          not isinstance(x, bool)) and math.isfinite(x)

    if (not is_int(self.max_new_tokens)
        or not 1 <= self.max_new_tokens <= INT32_MAX):
      raise ValueError("Invalid max_new_tokens: expected an int in [1, "
                       f"{INT32_MAX}], got {self.max_new_tokens!r}")
    if not is_real(self.temperature) or not 0 <= self.temperature <= F32_MAX:
      raise ValueError("Invalid temperature: expected a finite number in [0, "
                       f"{F32_MAX:.4g}] (float32), got {self.temperature!r}")
    if not is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
      raise ValueError(f"Invalid top_k: expected an int in [0, {INT32_MAX}] "
                       f"(0 = off), got {self.top_k!r}")
    if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
      raise ValueError(
          f"Invalid top_p: expected a number in (0, 1], got {self.top_p!r}")
    if not is_int(self.seed):
      raise ValueError(f"Invalid seed: expected an int, got {self.seed!r}")
    if self.stop_token_ids is not None:
      if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(
          self.stop_token_ids, "__iter__"):
        raise ValueError("Invalid stop_token_ids: expected a sequence of token"
                         f" ids or None, got {self.stop_token_ids!r}")
      bad = [t for t in self.stop_token_ids
             if not is_int(t) or not 0 <= t <= INT32_MAX]
      if bad:
        raise ValueError(
            f"Invalid stop_token_ids: expected token ids (ints in [0, "
            f"{INT32_MAX}]) or None, got {bad[0]!r} in "
            f"{self.stop_token_ids!r}")
    if not isinstance(self.ignore_eos, (bool, np.bool_)):
      raise ValueError(
          f"Invalid ignore_eos: expected a bool, got {self.ignore_eos!r}")


# The draw's inverse CDF runs over blocks of this many vocabulary entries:
# block sums, their cumulative sum, then one block's entries.
_DRAW_BLOCK = 256


def _inverse_cdf(kept, u):
  """Per row, the first index where the running sum of `kept` (f32[rows,
  vocab], zero outside the kept set) exceeds `u * sum(kept)`; always an entry
  with `kept > 0` (rounding at the end falls back to the last kept entry of
  the block)."""
  rows, vocab = kept.shape
  nb = -(-vocab // _DRAW_BLOCK)
  blocks = jnp.pad(kept, ((0, 0), (0, nb * _DRAW_BLOCK - vocab))).reshape(
      rows, nb, _DRAW_BLOCK)
  block_sums = jnp.sum(blocks, axis=-1)
  block_cum = jnp.cumsum(block_sums, axis=-1)
  target = u * block_cum[:, -1]
  arange_nb = jnp.arange(nb)
  last_block = jnp.max(jnp.where(block_sums > 0, arange_nb, 0), axis=-1)
  blk = jnp.minimum(jnp.sum(block_cum <= target[:, None], axis=-1), last_block)
  before = jnp.where(blk > 0, jnp.take_along_axis(
      block_cum, jnp.maximum(blk - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
  inner = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]
  inner_cum = before[:, None] + jnp.cumsum(inner, axis=-1)
  idx = jnp.sum(inner_cum <= target[:, None], axis=-1)
  arange_b = jnp.arange(_DRAW_BLOCK)
  # The last kept entry at or before `idx` (is `idx` itself unless the sums'
  # rounding left `target` past the block's end).
  idx = jnp.max(jnp.where((inner > 0) & (arange_b <= idx[:, None]),
                          arange_b, 0), axis=-1)
  return (blk * _DRAW_BLOCK + idx).astype(jnp.int32)


def kept_floor(probs, top_k, top_p, active, impl: str | None = None):
  """Per row, the probability of the last token top-k then top-p keep in
  sorted order: the row keeps `probs >= floor` (ties with it too).

  One dispatch rule (`pallas_kernels.dispatch.sample_floor`): on a GPU the
  sort-free search kernel (`pallas_kernels.sample_floor`), elsewhere the
  floor read off the sorted row (`sample_floor.reference_floor`).

  Args:
    probs: `f32[rows, vocab]` softmax rows.
    top_k: `i32[rows]`, 0 = off. top_p: `f32[rows]`, 1 = off.
    active: `bool[rows]`, rows that sample (others may get any floor).
    impl: None = the dispatch rule; "xla" = the sorted reference; "pallas"
      = the kernel (interpret mode without a GPU).

  Returns:
    `f32[rows]`.
  """
  from pkvattn.pallas_kernels import dispatch  # noqa: PLC0415
  from pkvattn.pallas_kernels import sample_floor  # noqa: PLC0415
  if impl is not None:
    _checks.check_choice(impl, ("pallas", "xla"), "impl")
  gpu = dispatch.current_gpu()
  choice = dispatch.sample_floor(
      gpu=gpu, dtype=probs.dtype, vocab_size=probs.shape[-1],
      backend={None: None, "pallas": "triton", "xla": "xla"}[impl])
  if choice.backend == "triton":
    return sample_floor.sample_floor(probs, top_k, top_p, active,
                                     config=choice.config,
                                     interpret=gpu.interpret)
  return sample_floor.reference_floor(probs, top_k, top_p)


def sample(
    logits: jax.Array,       # f32[batch_size, vocab_size]
    temperature: jax.Array,  # f32[batch_size], 0 = greedy
    top_k: jax.Array,        # i32[batch_size], 0 = off
    top_p: jax.Array,        # f32[batch_size], 1 = off
    seeds: jax.Array,        # u32[batch_size]
    indices: jax.Array,      # i32[batch_size], generated-token index (rng stream)
    *,
    greedy_only: bool = False,
    cond: bool = True,
    impl: str | None = None,
) -> jax.Array:              # i32[batch_size]
  """Samples one token per row; rows with `temperature == 0` take the argmax.

  A sampling row keeps the `top_k` most likely tokens, then the smallest set
  of them, most likely first, whose probability renormalised to the top k
  reaches `top_p` (HF transformers' and vLLM's order), and draws one of the
  kept tokens in proportion to its probability. Tokens tied in probability
  with the last one kept are kept too (a sort would break the tie by its
  order).

  The kept set is a probability threshold (`kept_floor`: on a GPU found by
  a search over counts and sums, no sort; elsewhere read off the
  probabilities sorted), and the draw is an inverse CDF in vocabulary order
  over the kept probabilities (`_inverse_cdf`), one uniform number per row
  from `fold_in(key(seed), index)`.

  The sampling path runs only when some row samples (`lax.cond`).
  `greedy_only` (static): the caller knows every row is greedy; the argmax
  alone is built (no `lax.cond`, which costs a device-to-host sync on GPU).
  `cond=False` (static): the caller knows some row samples; the sampling path
  runs unconditionally, again with no `lax.cond` (greedy rows still take the
  argmax). `impl` (static): the floor's backend (`kept_floor`).
  """
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if greedy_only:
    return greedy

  def stochastic(_):
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    probs = jax.nn.softmax(scaled, axis=-1)
    floor = kept_floor(probs, top_k, top_p, temperature > 0, impl)
    kept = jnp.where(probs >= floor[:, None], probs, 0.0)
    keys = jax.vmap(
        lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, indices)
    u = jax.vmap(jax.random.uniform)(keys)
    token = _inverse_cdf(kept, u)
    return jnp.where(temperature > 0, token, greedy)

  if not cond:
    return stochastic(None)
  return lax.cond(jnp.any(temperature > 0), stochastic, lambda _: greedy, None)
