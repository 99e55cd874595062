"""Chained 64-bit block keys for the prefix cache, computed in parallel.

A block's key chains its parent's key, its own tokens and the request's
`reuse_scope` (tenant / adapter salt), as in vLLM's and TensorRT-LLM's block
hashes. A serial chain over `max_pages` blocks would be `max_pages` dependent
steps on the device; instead each block contributes an affine map
`x -> a_i * x + b_i (mod 2**32)` (`a_i` odd, both mixed from the block's
tokens), and the chain value after block `i` is the composition of the maps of
blocks `0..i` applied to a scope-derived seed `x_-1`:

    x_i = A_i * x_-1 + B_i,   A_i = a_0 * .. * a_i,
    B_i = sum_{j <= i} b_j * a_{j+1} * .. * a_i = A_i * sum_{j <= i} b_j / A_j

(odd numbers are invertible mod 2**32). So a cumulative product, one
elementwise inverse and a cumulative sum give every prefix key: three
operations in the program (each one XLA reduce-window), where an
associative scan of the maps unrolled into hundreds, and every engine step
hashes twice (claim and commit). A final murmur3 mix spreads the bits.

Two independent 32-bit lanes (a trailing axis of 2) make a 64-bit key.
Keys only speed up the lookup: a match is always verified against the
stored tokens, scope and parent block (see `cache/alloc.py`), so a
collision can cost reuse but never correctness.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_LANE_SALTS = (0x9E3779B9, 0x7F4A7C15)
_A_SALT = 0x632BE5AB
_B_SALT = 0x2545F491


def num_buckets(num_slots: int, hash_ways: int,
                hash_buckets: int | None) -> int:
  """Buckets of a set-associative key table: `hash_buckets` if given, else
  the smallest power of two `>= 4 * num_slots / hash_ways` (load factor at
  most 1/4: with 16 ways a bucket overflows with probability about 1e-6
  even when every slot is in the table)."""
  if hash_buckets is not None:
    return hash_buckets
  want = max(1, -(-4 * num_slots // hash_ways))
  return 1 << (want - 1).bit_length()


def fmix32(h: jax.Array) -> jax.Array:  # u32[...]
  """murmur3's 32-bit finaliser (a bijection on u32 with good avalanche)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _inverse_odd(a: jax.Array) -> jax.Array:  # u32[...], odd
  """`a**-1 mod 2**32` for odd `a`: Newton's iteration `x <- x (2 - a x)`
  doubles the correct low bits, and `x = a` starts with 3 (`a * a = 1 mod
  8` for odd `a`): four steps give 48 >= 32."""
  x = a
  for _ in range(4):
    x = x * (jnp.uint32(2) - a * x)
  return x


def block_maps(
    block_tokens: jax.Array,  # i32[n, num_blocks, page_size]
) -> tuple[jax.Array, jax.Array]:  # (a, b), u32[n, num_blocks, 2] each
  """Each block's affine map `x -> a * x + b (mod 2**32)` per lane (`a`
  odd), mixed from its tokens and their positions in the block."""
  salt = jnp.asarray(_LANE_SALTS, jnp.uint32)                # [2]
  tok = block_tokens.astype(jnp.uint32)[..., None]           # [n, nb, ps, 1]
  pos = jnp.arange(block_tokens.shape[2], dtype=jnp.uint32)[:, None]
  pos_mix = fmix32(pos * jnp.uint32(0x01000193) + salt)      # [ps, 2]
  # Per-block digest: order-sensitive sum of mixed (token, position) pairs.
  digest = fmix32(jnp.sum(fmix32(tok ^ pos_mix), axis=2, dtype=jnp.uint32)
                  + salt)
  a = fmix32(digest ^ jnp.uint32(_A_SALT)) | jnp.uint32(1)
  b = fmix32(digest ^ jnp.uint32(_B_SALT))
  return a, b


def block_keys(
    block_tokens: jax.Array,  # i32[n, num_blocks, page_size]
    scope: jax.Array,         # i32[n]
) -> jax.Array:               # u32[n, num_blocks, 2]
  """Chained keys of every block prefix of `n` token rows.

  Args:
    block_tokens: `i32[n, num_blocks, page_size]`, row `r`'s tokens cut into
      blocks (block `i` holds tokens `i*page_size .. (i+1)*page_size - 1`).
    scope: `i32[n]`, the reuse scope of each row; different scopes give
      unrelated keys.

  Returns:
    `u32[n, num_blocks, 2]`: key of block `i` of row `r`, a function of the
    scope and of all tokens of blocks `0..i` (not of padding past them):
    `fmix32(x_i)` of the module docstring's chain, per lane.
  """
  a, b = block_maps(block_tokens)
  salt = jnp.asarray(_LANE_SALTS, jnp.uint32)
  seed = fmix32(scope.astype(jnp.uint32)[:, None] ^ salt)[:, None, :]
  prod = jnp.cumprod(a, axis=1, dtype=jnp.uint32)            # A_i
  x = prod * (seed + jnp.cumsum(b * _inverse_odd(prod), axis=1,
                                dtype=jnp.uint32))
  return fmix32(x)
