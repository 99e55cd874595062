"""Publishing blocks for prefix reuse: `commit`.

A sequence's full blocks are published in order into the hash table
(`CacheState.hash_table`, `hash_ways` ways per bucket, keyed by
`hashing.block_keys`), each with what `claim_batch` verifies before reusing
it: its key, tokens, scope and parent slot at that parent's publication
generation ("Prefix-cache verification" in `cache/alloc.py`, whose helpers
this module shares; `alloc` does not import it). Within one call the
considered blocks are deduplicated by key and by slot, and a bucket's free
ways go to new keys in row-major order: two stable sorts over the call's
blocks. A block whose prefix another sequence published already (a twin)
is skipped, and the sequence's chain goes on from the twin, so requests
that computed a prefix together both leave their whole history reusable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _checks
from . import _contract
from . import hashing
from .alloc import _block_view
from .alloc import _check_token_batch
from .alloc import _content_ok
from .alloc import _find
from .alloc import _leading_run
from .alloc import _oob_scatter_index
from .alloc import _parent_ok
from .alloc import _replace
from .alloc import _require_live
from .alloc import _select
from .alloc import _shift_right
from .alloc import _unpublish
from .state import CacheState


def commit(
    state: CacheState,
    seq_ids: jax.Array,  # i32[n]
    tokens: jax.Array,   # i32[n, max_len]
    lengths: jax.Array,  # i32[n]
    *,
    check: bool | None = None,
) -> CacheState:
  """Publishes the full blocks of live sequences for prefix reuse.

  For sequence `r`, blocks `i < min(lengths[r], seq_lens, max_len) //
  page_size` are considered. Its leading blocks that need no publishing are
  skipped, each the child of the slot serving the block before at that
  slot's generation: its own published slots (reused at claim, or committed
  before) and twins, published slots with the block's tokens and scope
  (another sequence computed and published the same prefix). As vLLM keeps
  caching past a block another request already cached, the first block
  after them is published as the child of the last one, and the blocks
  after it in order (own published ones again: their parent left the
  cache), until one cannot be:
    * an earlier considered block of this call has the same key or the same
      slot (first in row-major order wins; for the later sequence that
      block is a twin at its next commit, as at its release);
    * its hash bucket has no free way left (free ways go to this call's new
      keys in row-major order);
    * it is an SWA scratch block (no slot: -1 in the table). Its KV was
      overwritten by later layers, so neither it nor any later block of the
      sequence (whose chain needs it) is ever published.
  A published slot with the same key that is not a twin (an orphan whose
  parent was evicted, or a hash collision) is replaced: it leaves the cache.

  Args:
    state: the cache state.
    seq_ids: `i32[n]` (array or list), live ids; -1 = padding; invalid or
      duplicated ids are ignored.
    tokens: `i32[n, max_len]`, each sequence's tokens from position 0.
    lengths: `i32[n]`, tokens whose KV has been written (only those blocks are
      published; the caller vouches that `tokens` are what was written).
    check: checked mode for this call (`pkvattn.checked`): ids in range,
      unique and live, `lengths >= 0`. `None` follows `checked()`.

  Returns:
    The new state.

  Raises:
    ValueError: shapes or dtypes of the arguments (trace time).
    checkify.JaxRuntimeError: (a ValueError) checked mode, a violated
      contract.
  """
  seq_ids, tokens, lengths = map(_checks.as_index_array,
                                 (seq_ids, tokens, lengths))
  _check_token_batch(seq_ids, tokens, lengths)
  if _contract.enabled(check):
    _contract.run(_commit_contract, state, seq_ids, lengths)
  with _contract.unchecked():
    return _commit(state, seq_ids, tokens, lengths)


def _commit_contract(state: CacheState, seq_ids, lengths):
  if seq_ids.shape[0] == 0:
    return
  _contract.require_ids(seq_ids, state.config.max_seqs, "seq_ids")
  _require_live(state, seq_ids, "seq_ids", "commit")
  bad = (seq_ids >= 0) & (lengths < 0)
  i = _contract.first_true(bad)
  _contract.require(~jnp.any(bad), "Invalid lengths: lengths[{}] = {}, "
                    "expected >= 0", i, lengths[i].astype(jnp.int32))


@jax.jit
def _commit(state, seq_ids, tokens, lengths):
  """`commit` on arrays, unchecked."""
  return _commit_impl(state, seq_ids, tokens, lengths)


def _commit_impl(state, seq_ids, tokens, lengths, anchor=None):
  """`commit`'s body. `anchor = (slots, gens)`, both `i32[n, max_pages]`:
  each block's parent is the given slot of another slot space at that
  generation instead of the previous block (per-window-group caches,
  `cache/hybrid.py`); a block is then published on its own (no leading run:
  the anchor's chain vouches for the prefix) and only where its anchor
  slot is `>= 0`.

  One pass, no loop (a `while_loop` would cost every step program a
  device-to-host sync on a GPU): twins are blocks published before the
  call, and within the call the first block of a key wins."""
  cfg = state.config
  n = _check_token_batch(seq_ids, tokens, lengths)
  max_len = tokens.shape[1]
  nbt = min(max_len // cfg.page_size, cfg.max_pages)
  if nbt == 0:
    return state
  blocks = _block_view(tokens.astype(jnp.int32), cfg.page_size, nbt)
  idx, valid = _select(state, seq_ids, want_live=True)
  scope = state.seq_scope[idx]
  keys = hashing.block_keys(blocks, scope)
  valid &= lengths >= 0
  length = jnp.minimum(lengths.astype(jnp.int32), state.seq_lens[idx])
  num_full = jnp.where(valid, jnp.minimum(length, max_len) // cfg.page_size, 0)
  own = state.seq_slots[idx, :nbt]                           # [n, nbt]
  pos = jnp.arange(nbt)[None, :]
  in_range = pos < num_full[:, None]
  own_pub = state.slot_published[jnp.clip(own, 0)] & (own >= 0)
  existing, bucket, ways = _find(state, keys)
  content = _content_ok(state, existing, blocks, scope)
  if anchor is None:
    # The served run: leading blocks that need no publishing, each the child
    # (at its generation) of the slot serving the block before: the
    # sequence's own published slot (reused at claim, or committed before),
    # or a twin, a published slot with the block's tokens and scope.
    serving = jnp.where(own_pub, own, existing)
    prev = _shift_right(serving, -1)
    prev_gen = state.slot_gen[jnp.clip(prev, 0)]
    kept = own_pub & _parent_ok(state, own, prev, prev_gen)
    twin = (own >= 0) & content & _parent_ok(state, existing, prev, prev_gen)
    served = jnp.sum(_leading_run(in_range & (kept | twin)), axis=1)
  else:
    served = jnp.sum(_leading_run(in_range & own_pub), axis=1)
  before = pos < served[:, None]
  # A scratch block (-1 in the table) stops the run. An own published slot
  # after the served run is stale (its parent left the cache, as a twin's
  # source may, or was published again after a hash collision): it is
  # published again under the chain's current parent, as the blocks after
  # it must be (their parent's generation moves on). With an anchor, own
  # published slots stay as they are.
  consider = in_range & ~before & (own >= 0)
  if anchor is None:
    # The first block after the run is the child of its last serving slot;
    # a parent published in this call gets generation + 1.
    parent = _shift_right(jnp.where(before, serving, own), -1)
    parent_gen = jnp.where(
        parent < 0, 0,
        state.slot_gen[jnp.clip(parent, 0)]
        + _shift_right(consider, False).astype(jnp.int32))
  else:
    parent, parent_gen = anchor[0][:, :nbt], anchor[1][:, :nbt]
    consider &= ~own_pub & (parent >= 0)

  # Row-major first occurrence of each key and slot among considered blocks.
  size = n * nbt
  flat = jnp.arange(size, dtype=jnp.int32).reshape(n, nbt)
  cons_f = consider.reshape(-1)
  k0 = keys[..., 0].reshape(-1)
  k1 = keys[..., 1].reshape(-1)
  perm = jnp.lexsort((flat.reshape(-1), k1, k0, ~cons_f))
  s_k0, s_k1, s_cons = k0[perm], k1[perm], cons_f[perm]
  same_prev = jnp.concatenate([
      jnp.zeros((1,), bool),
      (s_k0[1:] == s_k0[:-1]) & (s_k1[1:] == s_k1[:-1]) & s_cons[:-1]])
  key_dup = jnp.zeros((size,), bool).at[perm].set(same_prev & s_cons)
  key_dup = key_dup.reshape(n, nbt)
  first_of_slot = jnp.full((state.num_slots,), size, jnp.int32).at[
      _oob_scatter_index(consider, own, state.num_slots)].min(flat, mode="drop")
  slot_dup = first_of_slot[jnp.clip(own, 0)] != flat

  candidate = consider & ~key_dup & ~slot_dup
  if anchor is not None:
    # A published slot with the block's tokens, scope and anchor serves it
    # already. (Without an anchor such a slot is a twin: it extended the
    # served run.)
    candidate &= ~(content & _parent_ok(state, existing, parent, parent_gen))
  fresh = candidate & (existing < 0)
  # Rank of each fresh block among the fresh blocks of its bucket, in
  # row-major order (so chain heads and earlier requests get the free ways).
  f_bkt = jnp.where(fresh.reshape(-1), bucket.reshape(-1), cfg.num_buckets)
  perm2 = jnp.lexsort((flat.reshape(-1), f_bkt))
  s_fb = f_bkt[perm2]
  is_start = jnp.concatenate([jnp.ones((1,), bool), s_fb[1:] != s_fb[:-1]])
  seg_start = jax.lax.cummax(
      jnp.where(is_start, jnp.arange(size, dtype=jnp.int32), 0), axis=0)
  rank = jnp.zeros((size,), jnp.int32).at[perm2].set(
      jnp.arange(size, dtype=jnp.int32) - seg_start)
  rank = rank.reshape(n, nbt)
  free_way = ways < 0
  nth = jnp.cumsum(free_way.astype(jnp.int32), axis=-1)
  way = jnp.argmax(free_way & (nth == rank[..., None] + 1), axis=-1)
  has_way = rank < jnp.sum(free_way, axis=-1)
  block_ok = candidate & ((existing >= 0) | has_way)
  if anchor is None:
    # Publish the leading run of publishable blocks after the served run.
    publish = _leading_run(jnp.where(consider, block_ok, before)) & consider
  else:
    publish = consider & block_ok

  hash_pos = jnp.where(
      existing >= 0, state.slot_hash_pos[jnp.clip(existing, 0)],
      bucket * cfg.hash_ways + way)
  state = _unpublish(state, jnp.where(publish & (existing >= 0), existing, -1))
  s = _oob_scatter_index(publish, own, state.num_slots)
  flat_table = state.hash_table.reshape(-1)
  flat_table = flat_table.at[
      _oob_scatter_index(publish, hash_pos, flat_table.size)].set(
          own, mode="drop")
  state = _replace(
      state,
      hash_table=flat_table.reshape(state.hash_table.shape),
      slot_hash_pos=state.slot_hash_pos.at[s].set(hash_pos, mode="drop"),
      slot_published=state.slot_published.at[s].set(True, mode="drop"),
      slot_key=state.slot_key.at[s].set(keys, mode="drop"),
      slot_tokens=state.slot_tokens.at[s].set(blocks, mode="drop"),
      slot_scope=state.slot_scope.at[s].set(
          jnp.broadcast_to(scope[:, None], s.shape), mode="drop"),
      slot_parent=state.slot_parent.at[s].set(parent, mode="drop"),
      slot_parent_gen=state.slot_parent_gen.at[s].set(parent_gen, mode="drop"),
      slot_gen=state.slot_gen.at[s].add(1, mode="drop"),
      slot_depth=state.slot_depth.at[s].set(
          jnp.broadcast_to(pos, s.shape).astype(jnp.int32), mode="drop"),
  )
  return state


commit.__wrapped__ = _commit.__wrapped__
