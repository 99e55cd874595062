"""`claim_batch`: admitting new sequences with prefix reuse (two-phase claim).

Phase 1 matches each request's prompt against the prefix cache (whole blocks,
chain-verified); phase 2 admits requests all or nothing in batch order by
`alloc`'s admission rule and takes their new slots. The semantics every op
shares (padding ids, admission, eviction, SWA scratch, prefix-cache
verification) are `cache/alloc.py`'s module docstring; this module builds on
its helpers, and `cache/hybrid.py` on this module's phases (`_claim_inputs`,
`_claim_lookup`, `_claim_need`, `_claim_apply`) to claim in every window
group at once.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _checks
from . import _contract
from . import hashing
from .alloc import _admit
from .alloc import _block_view
from .alloc import _check_token_batch
from .alloc import _content_ok
from .alloc import _find
from .alloc import _leading_run
from .alloc import _open_seqs
from .alloc import _parent_ok
from .alloc import _replace
from .alloc import _select
from .alloc import _set_scratch
from .alloc import _shift_right
from .alloc import _step_plan
from .alloc import _step_ranks
from .alloc import _take_slots
from .state import CacheState


class ClaimResult(NamedTuple):
  ok: jax.Array                 # bool[n], admitted
  num_reused_tokens: jax.Array  # i32[n], prompt tokens served from the cache
  num_new_blocks: jax.Array     # i32[n], slots allocated for the rest (with
  #                               scratch: normal blocks + scratch slots)
  num_missed_blocks: jax.Array  # i32[n], reusable-position blocks not found


def claim_batch(
    state: CacheState,
    seq_ids: jax.Array,                   # i32[n]
    tokens: jax.Array,                    # i32[n, max_len]
    lengths: jax.Array,                   # i32[n]
    reuse_scope: jax.Array | None = None,  # i32[n]
    *,
    evict: bool = True,
    head_of_line: bool = True,
    check: bool | None = None,
) -> tuple[CacheState, ClaimResult]:
  """Admits a batch of new sequences with prefix reuse (two-phase claim).

  Phase 1 matches every valid request's prompt against the prefix cache (whole
  blocks, chain-verified, see the module docstring). Phase 2 admits requests
  all or nothing (module docstring, "Admission") and allocates the remaining
  blocks of the admitted ones, evicting only cached blocks that no admitted
  request reuses, in `eviction_order` (least recently released first, a
  chain's tail before its head): one request's allocation
  never evicts a block that another admitted request of the batch reuses,
  while the matches of a refused request protect nothing (so they never
  starve the others).

  Reuse rule: at least the last prompt token is always computed, so the engine
  gets its logits. At most `(lengths[r] - 1) // page_size` whole blocks are
  reused; a prompt that is entirely cached recomputes its last block.

  Args:
    state: the cache state.
    seq_ids: `i32[n]` (array or list), ids to create, in `[0, max_seqs)` and
      not live; -1 = padding.
    tokens: `i32[n, max_len]`, prompts; entries past `lengths[r]` are ignored.
    lengths: `i32[n]`, prompt tokens, `0 <= lengths[r] <= min(max_len,
      max_pages * page_size)`; the sequence reserves this many tokens.
    reuse_scope: `i32[n]` salt (tenant / adapter); blocks are shared only
      within one scope. `None` = scope 0 for all.
    evict: static. False: phase 2 takes free slots only (requests beyond
      them are refused, no cached block is evicted) and builds no `lax.cond`
      (a device-to-host sync on GPU); for callers that know the free count.
    head_of_line: static. True (first come, first served): once a valid
      request does not fit, every later one is refused. False: a later request
      that still fits once the refused ones are skipped is admitted (a
      `lax.scan` over the batch; module docstring).
    check: checked mode for this call (`pkvattn.checked`): ids in range and
      unique, live ones refused, lengths in range. `None` follows
      `checked()`; unchecked, such requests are refused (`ok=False`).

  Returns:
    `(state, ClaimResult)` with, per request, `ok`, `num_reused_tokens` (a
    multiple of page_size), `num_new_blocks` (slots taken: normal new blocks
    plus, with SWA scratch active, the step's scratch slots; the prefill of
    tokens `num_reused_tokens .. lengths` is the step, module docstring),
    `num_missed_blocks` (blocks at
    reusable positions, `(lengths - 1) // page_size`, not found). All zero
    where `ok` is False; the state is unchanged for those requests.

  Raises:
    ValueError: shapes or dtypes of the arguments (trace time).
    checkify.JaxRuntimeError: (a ValueError) checked mode, a violated
      contract (`cache/_contract.py` says where it surfaces).

  Example:
    Page size 8 and 4 slots; two 16-token prompts A and B are published and
    released (0 slots free, 4 cached). A+[1] and B+[2] each reuse their 2
    cached blocks and need 1 new slot. Together they need 2 new slots and
    keep 4 cached ones: 6 > 4. Alone, A+[1] fits (1 + 2 <= 4): it is
    admitted, and its new slot evicts a block of B, whose matches protect
    nothing since B is refused.

    >>> from pkvattn import cache
    >>> cfg = cache.CacheConfig(num_slots=4, page_size=8, num_layers=1,
    ...                         max_seqs=4, max_pages=4)
    >>> st = cache.init_cache(cfg)
    >>> a, b = [1] * 16 + [1], [2] * 16 + [2]
    >>> st, _ = cache.claim_batch(st, [0, 1], [a[:16], b[:16]], [16, 16])
    >>> st = cache.commit(st, [0, 1], [a[:16], b[:16]], [16, 16])
    >>> st = cache.release(st, [0, 1])
    >>> _, res = cache.claim_batch(st, [2, 3], [a, b], [17, 17])
    >>> res.ok.tolist(), res.num_reused_tokens.tolist()
    ([True, False], [16, 0])

    A third request C without reuse needing 1 slot, after the refused B:
    head of line refuses it; without, it fits next to A (1 + 2 + 1 <= 4).

    >>> c = [3] * 8 + [0] * 9
    >>> _, res = cache.claim_batch(st, [2, 3, 0], [a, b, c], [17, 17, 8])
    >>> res.ok.tolist()
    [True, False, False]
    >>> _, res = cache.claim_batch(st, [2, 3, 0], [a, b, c], [17, 17, 8],
    ...                            head_of_line=False)
    >>> res.ok.tolist()
    [True, False, True]
  """
  seq_ids, tokens, lengths = map(_checks.as_index_array,
                                 (seq_ids, tokens, lengths))
  if reuse_scope is not None:
    reuse_scope = _checks.as_index_array(reuse_scope)
  _check_token_batch(seq_ids, tokens, lengths)
  if _contract.enabled(check):
    _contract.run(_claim_contract, state, seq_ids, tokens, lengths)
  with _contract.unchecked():
    return _claim_batch(state, seq_ids, tokens, lengths, reuse_scope,
                        evict=evict, head_of_line=head_of_line)


def _claim_contract(state: CacheState, seq_ids, tokens, lengths):
  if seq_ids.shape[0] == 0:
    return
  cfg = state.config
  _contract.require_ids(seq_ids, cfg.max_seqs, "seq_ids")
  ids = seq_ids.astype(jnp.int32)
  idx = jnp.clip(ids, 0, cfg.max_seqs - 1)
  live = (ids >= 0) & state.seq_live[idx]
  i = _contract.first_true(live)
  _contract.require(~jnp.any(live),
                    "Invalid seq_ids: seq_ids[{}] = {} is live; claim_batch "
                    "creates sequences (release it first)", i, ids[i])
  cap = min(tokens.shape[1], cfg.max_seq_len)
  bad = (ids >= 0) & ((lengths < 0) | (lengths > cap))
  i = _contract.first_true(bad)
  _contract.require(~jnp.any(bad),
                    f"Invalid lengths: lengths[{{}}] = {{}}, expected in [0, "
                    f"{cap}] (min of max_len and max_pages * page_size)",
                    i, lengths[i].astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("evict", "head_of_line"))
def _claim_batch(state, seq_ids, tokens, lengths, reuse_scope=None, *,
                 evict=True, head_of_line=True):
  """`claim_batch` on arrays, unchecked (jitted once per config and statics)."""
  inp = _claim_inputs(state, seq_ids, tokens, lengths, reuse_scope)
  # Phase 1: match (a leading run of chain-verified blocks).
  cand, verified = _claim_lookup(state, inp)
  nbt = cand.shape[1]
  in_reach = jnp.arange(nbt)[None, :] < inp.matchable[:, None]
  matched = _leading_run(verified & in_reach) & inp.valid[:, None]
  reused = jnp.sum(matched, axis=1, dtype=jnp.int32)
  # Phase 2: admission (all or nothing; only admitted requests protect the
  # blocks they reuse), then allocation. The step computes tokens reused ..
  # length: with scratch active, its stale new blocks take scratch slots
  # (module docstring).
  plan, need = _claim_need(state.config, inp, reused)
  ok, need, protected = _admit(state, inp.valid, need, evict=evict,
                               head_of_line=head_of_line, cand=cand,
                               matched=matched)
  return _claim_apply(state, inp, ok, need, plan, protected, cand, matched,
                      reused, evict=evict)


class _ClaimInputs(NamedTuple):
  """A claim batch after validation (`[n]` each unless noted)."""
  idx: jax.Array        # i32, clipped rows
  valid: jax.Array      # bool, requests that may be admitted
  tokens: jax.Array     # i32[n, max_len]
  lengths: jax.Array    # i32, 0 where not valid
  scope: jax.Array      # i32
  matchable: jax.Array  # i32, blocks at reusable positions


def _claim_inputs(state, seq_ids, tokens, lengths, reuse_scope) -> _ClaimInputs:
  cfg = state.config
  ps = cfg.page_size
  n = _check_token_batch(seq_ids, tokens, lengths)
  if reuse_scope is None:
    scope = jnp.zeros((n,), jnp.int32)
  else:
    _checks.check_int(reuse_scope, "reuse_scope")
    _checks.check_shape(reuse_scope, (n,), "reuse_scope")
    scope = reuse_scope.astype(jnp.int32)
  max_len = tokens.shape[1]
  tokens = tokens.astype(jnp.int32)
  lengths = lengths.astype(jnp.int32)
  idx, valid = _select(state, seq_ids, want_live=False)
  valid &= (lengths >= 0) & (lengths <= min(max_len, cfg.max_seq_len))
  lengths = jnp.where(valid, lengths, 0)
  matchable = jnp.where(lengths > 0, (lengths - 1) // ps, 0)
  return _ClaimInputs(idx, valid, tokens, lengths, scope, matchable)


def _claim_lookup(state, inp: _ClaimInputs, anchor=None):
  """Prefix-cache candidates of each whole block of the prompts.

  Returns `(cand i32[n, nbt], verified bool[n, nbt])`, `nbt = min(max_len //
  page_size, max_pages)`: the slot holding each block's key, and whether it
  holds the very same tokens and scope and is linked to the right parent.
  The parent is the previous block's candidate (at the generation it had when
  the candidate was published), or, with `anchor = (slots, gens)` (both
  `i32[n, nbt]`), the given slot of another slot space at that generation
  (per-window-group caches: `cache/hybrid.py`).
  """
  cfg = state.config
  ps = cfg.page_size
  n = inp.tokens.shape[0]
  nbt = min(inp.tokens.shape[1] // ps, cfg.max_pages)
  if nbt == 0:
    return jnp.zeros((n, 0), jnp.int32), jnp.zeros((n, 0), bool)
  blocks = _block_view(inp.tokens, ps, nbt)
  keys = hashing.block_keys(blocks, inp.scope)
  cand, _, _ = _find(state, keys)
  if anchor is None:
    prev = _shift_right(cand, -1)
    first = jnp.arange(nbt)[None, :] == 0
    prev_gen = state.slot_gen[jnp.clip(prev, 0)]
    chain_ok = jnp.where(first, True, prev >= 0) & _parent_ok(
        state, cand, jnp.where(first, -1, prev), prev_gen)
  else:
    a_slot, a_gen = anchor
    chain_ok = (a_slot >= 0) & _parent_ok(state, cand, a_slot, a_gen)
  return cand, _content_ok(state, cand, blocks, inp.scope) & chain_ok


def _claim_need(cfg, inp: _ClaimInputs, reused):
  """The step plan and the slots each request needs, reusing `reused` blocks."""
  plan = _step_plan(cfg, reused * cfg.page_size, inp.lengths)
  need = jnp.where(
      inp.valid, plan.scratch_slots + plan.end_new - plan.normal_first, 0)
  return plan, need


def _claim_apply(state, inp: _ClaimInputs, ok, need, plan, protected, cand,
                 matched, reused, *, evict):
  """Allocates and records the admitted claims (`ok`; `need` zero elsewhere).

  `matched bool[n, nbt]` are the blocks each request reuses (their `cand`
  slots; any mask), `reused i32[n]` the blocks before the step's first new
  block.
  """
  cfg = state.config
  ps = cfg.page_size
  nbt = cand.shape[1]
  offset = jnp.cumsum(need) - need
  new_mask, ranks = _step_ranks(cfg, plan, ok, offset)
  state, taken = _take_slots(state, ranks, jnp.sum(need), protected,
                             evict=evict)

  row = jnp.where(new_mask, taken[:, :cfg.max_pages], -1)
  if nbt > 0:
    keep = matched & ok[:, None]
    row = row.at[:, :nbt].set(jnp.where(keep, cand, row[:, :nbt]))
  reused = jnp.where(ok, reused, 0)
  state, row_idx = _open_seqs(state, ok, inp.idx, row, inp.lengths,
                              inp.scope)
  state = _replace(
      state,
      num_lookups=state.num_lookups + jnp.sum(
          jnp.where(ok, inp.matchable, 0)),
      num_hits=state.num_hits + jnp.sum(reused),
  )
  state = _set_scratch(state, row_idx, plan, taken)
  return state, ClaimResult(
      ok=ok,
      num_reused_tokens=reused * ps,
      num_new_blocks=need,
      num_missed_blocks=jnp.where(ok, inp.matchable - reused, 0),
  )


claim_batch.__wrapped__ = _claim_batch.__wrapped__
