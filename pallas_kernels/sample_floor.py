"""The sampler's kept-set floor per row without a sort (Pallas-Triton).

`pkvattn.sampling.sample` keeps, in a row of probabilities `p`, every token
with `p >= floor`, the floor being the probability of the last token kept
by top-k then top-p in sorted order (HF transformers' and vLLM's order; ties
with it are kept too). Its reference, `reference_floor`, reads the floor off
the row sorted; a sort of `[rows, vocab]` f32 is a multi-pass radix sort on
a GPU and the costliest kernel of a sampled decode step at hundreds of rows.

This kernel finds the same floor from counts and sums alone. For a value
`v` let `C(v)` be the number of probabilities `> v` and `G(v)` their sum:
the first sorted token of value `v` has rank `C(v)` and `G(v)` of mass
before it, so a value is kept iff `C(v) < k` and `G(v) < top_p * M` (`M`
the top-k mass, or the whole row's), a predicate that only turns from
false to true as `v` grows. The floor is the smallest probability where it
holds: a search over float32 bit patterns in `[0, bits(1.0)]` (ordered as
the values), each step one pass over the row that probes `ways - 1`
thresholds at once (per lane a count and a sum per probe, reduced once a
pass) and keeps the part of the interval between the last probe that fails
and the first that holds: 15 passes at 4 ways, 30 at 2. A pass over a row
that stays in L2 (SmolLM2's 49,152 entries) is bound by its compares, one
that streams from HBM (Llama 3's 128,256) by its bytes; 4 ways on 32 warps
serve both. With `0 < top_k < vocab`, the k-th largest probability `t_k`
comes first by the same search (`C(v) < k`), and `M = G(t_k) + (k -
C(t_k)) * t_k` (ties at `t_k` counted as the sort would, up to `k`). A row
with `top_p >= 1` takes `t_k` (0 without top-k: every token), an inactive
row (greedy) 0 at once.

The sums run in a different order than the reference's cumulative sum, so
a row whose `G(v)` lies within rounding of `top_p * M` at a boundary may
keep one token more or fewer; otherwise the floors are equal. FlashInfer's
sampling kernels (`top_k_top_p_sampling_from_probs`) avoid the sort as
well, by rejection sampling with pivots (a different draw per seed);
the search keeps the reference's draw.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pkvattn.pallas_kernels._compat import pltriton
from pkvattn.pallas_kernels._compat import suppress_triton_deprecation
from pkvattn.pallas_kernels._compat import triton_params

# float32 1.0's bit pattern: probabilities lie in [0, 1], whose bit patterns
# are [0, _ONE_BITS] in the same order as the values.
_ONE_BITS = 0x3F800000


@dataclasses.dataclass(frozen=True)
class Config:
  """Launch config: `block` probabilities per loop step (a power of two),
  `num_warps` per program (one program per row), `ways`: the search's
  branching (`ways - 1` probes a pass over the row; 2 = bisection)."""
  block: int = 4096
  num_warps: int = 32
  ways: int = 4


def reference_floor(probs, top_k, top_p):
  """The floor read off the sorted probabilities (pure jnp; any backend).

  Args:
    probs: `f32[rows, vocab]`, each row a softmax.
    top_k: `i32[rows]`, 0 (or >= vocab) = off.
    top_p: `f32[rows]`, >= 1 = off.

  Returns:
    `f32[rows]`: keep `probs >= floor`.
  """
  # The probabilities alone, most likely first: a sort of one operand (no
  # index payload), whose values give the kept set's threshold.
  desc = -jnp.sort(-probs, axis=-1)
  cum = jnp.cumsum(desc, axis=-1)
  before = jnp.pad(cum[:, :-1], ((0, 0), (1, 0)))  # never decreases
  vocab = probs.shape[-1]
  rank = jnp.arange(vocab)[None, :]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  # top-p on the distribution renormalised to the top k.
  top_k_mass = jnp.take_along_axis(cum, k[:, None] - 1, axis=-1)
  keep = (rank < k[:, None]) & ((before < top_p[:, None] * top_k_mass)
                                | (top_p[:, None] >= 1))
  num_kept = jnp.maximum(jnp.sum(keep, axis=-1), 1)
  return jnp.take_along_axis(desc, num_kept[:, None] - 1, axis=-1)[:, 0]


def _steps(ways: int) -> int:
  """Search steps that narrow [0, _ONE_BITS] to one pattern, `ways`-ary."""
  steps, size = 0, _ONE_BITS + 1
  while size > 1:
    size, steps = -(-size // ways), steps + 1
  return steps


def _kernel(top_k_ref, top_p_ref, active_ref, probs_ref, floor_ref, *,
            vocab: int, block: int, ways: int):
  row = pl.program_id(0)
  k = top_k_ref[row]
  k = jnp.where((k > 0) & (k < vocab), k, vocab)
  top_p = top_p_ref[row]
  lanes = lax.iota(jnp.int32, block)

  def above(vs, with_mass=True):
    """`[(C(v), G(v)) for v in vs]`: the count and sum of the row's
    probabilities > v, every v in one pass (G 0 without `with_mass`)."""
    def body(i, acc):
      start = i * block
      # Padding reads -1, never above a v >= 0.
      x = pltriton.load(probs_ref.at[pl.ds(start, block)],
                        mask=start + lanes < vocab, other=-1.0)
      out = []
      for v, (count, mass) in zip(vs, acc):
        hit = x > v
        out.append((count + hit.astype(jnp.int32),
                    mass + jnp.where(hit, x, 0.0) if with_mass else mass))
      return tuple(out)
    zeros = (jnp.zeros((block,), jnp.int32), jnp.zeros((block,), jnp.float32))
    acc = lax.fori_loop(0, pl.cdiv(vocab, block), body, (zeros,) * len(vs))
    return [(jnp.sum(count), jnp.sum(mass)) for count, mass in acc]

  def smallest_true(pred, with_mass=True):
    """The smallest float32 in [0, 1] where `pred` (false below, true above)
    holds: a `ways`-ary search over bit patterns, `ways - 1` probes a pass.
    `pred` maps the probes' `above` results to booleans."""
    def body(_, lo_hi):
      lo, hi = lo_hi  # pred(hi) holds; the answer is in [lo, hi]
      step = (hi - lo + ways) // ways  # ceil((hi - lo + 1) / ways)
      probes = [jnp.minimum(lo - 1 + j * step, hi) for j in range(1, ways)]
      ok = [pred(r) for r in above(
          [lax.bitcast_convert_type(m, jnp.float32) for m in probes],
          with_mass)]
      # The probes that fail are a prefix: the answer lies past the last.
      new_lo, new_hi = lo, probes[0]
      for j in range(1, ways):
        nxt = probes[j] if j < ways - 1 else hi
        new_lo = jnp.where(ok[j - 1], new_lo, probes[j - 1] + 1)
        new_hi = jnp.where(ok[j - 1], new_hi, nxt)
      return new_lo, new_hi
    _, hi = lax.fori_loop(0, _steps(ways), body,
                          (jnp.int32(0), jnp.int32(_ONE_BITS)))
    return lax.bitcast_convert_type(hi, jnp.float32)

  def top_k_floor(_):
    return smallest_true(lambda count_mass: count_mass[0] < k,
                         with_mass=False)

  def floor(zero):
    # (Branches return their operand rather than a constant: the Triton
    # lowering of `lax.cond` yields values, not literals.)
    t_k = lax.cond(k < vocab, top_k_floor, lambda z: z, zero)

    def top_p_floor(t_k):
      (count, mass), (_, total) = above([t_k, jnp.float32(-0.5)])
      m = jnp.where(k < vocab, mass + (k - count).astype(jnp.float32) * t_k,
                    total)

      def kept(count_mass):
        count, mass = count_mass
        return (count < k) & (mass < top_p * m)
      return smallest_true(kept)
    return lax.cond(top_p < 1.0, top_p_floor, lambda t: t, t_k)

  zero = (k - k).astype(jnp.float32)
  floor_ref[row] = lax.cond(active_ref[row] != 0, floor, lambda z: z, zero)


def supports(dtype, vocab_size: int) -> str | None:
  """None if the kernel takes rows of `vocab_size` probabilities of
  `dtype`, else why not."""
  if jnp.dtype(dtype) != jnp.float32:
    return f"probabilities of {jnp.dtype(dtype)}: expected float32"
  if vocab_size < 1:
    return f"vocab_size {vocab_size}: expected >= 1"
  return None


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def sample_floor(probs, top_k, top_p, active, *, config: Config = Config(),
                 interpret: bool = False):
  """The kept-set floor of each row (what `reference_floor` returns, up to
  the rounding of sums at a boundary; see the module docstring).

  Args:
    probs: `f32[rows, vocab]`, each row a softmax (values in [0, 1]).
    top_k: `i32[rows]`, 0 (or >= vocab) = off.
    top_p: `f32[rows]`, >= 1 = off.
    active: `bool[rows]`; inactive rows (greedy) get 0 without a pass.
    config: block and warps (`Config`).
    interpret: Pallas interpret mode (no GPU).

  Returns:
    `f32[rows]`.
  """
  rows, vocab = probs.shape
  whole = pl.BlockSpec((rows,), lambda r: (0,))
  with suppress_triton_deprecation():
    return pl.pallas_call(
        functools.partial(_kernel, vocab=vocab, block=config.block,
                          ways=config.ways),
        grid=(rows,),
        in_specs=[whole, whole, whole,
                  pl.BlockSpec((None, vocab), lambda r: (r, 0))],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((rows,), jnp.float32),
        compiler_params=triton_params(config.num_warps, num_stages=1),
        interpret=interpret,
        name=(f"sample_floor_b{config.block}_w{config.num_warps}"
              f"_r{config.ways}"),
    )(top_k.astype(jnp.int32), top_p.astype(jnp.float32),
      active.astype(jnp.int32), probs)
