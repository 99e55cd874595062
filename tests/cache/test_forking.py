"""`fork` (`cache/forking.py`) against the pure-Python model, on scripted
batches that the random-operation tests reach only by chance.

Fork shares a parent's full blocks by reference count and copies its
partial last block into a new slot (copy-on-write, as vLLM's beam search
forks a sequence). Checked here, each against `cache/reference.py` slot
for slot (`cache_asserts.assert_same`): forks from every parent id,
including the last one, `max_seqs - 1`; parents with a full last block
(nothing to copy) and with a partial one; several children of one parent;
the returned copies in the pool layout the docstring gives (entry
`(r * num_layers + layer) * 2 + kv` is page `(slot * num_layers + layer)
* 2 + kv`, -1 where nothing is copied); and refused requests (invalid ids,
or no free slot for the copy) returning `ok = False`, no copies, and the
state unchanged.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pkvattn import cache
from cache_asserts import Lockstep

CFG = cache.CacheConfig(num_slots=12, page_size=4, num_layers=2, max_seqs=6,
                        max_pages=4)
MAX_LEN = CFG.page_size * CFG.max_pages


class _Pair(Lockstep):
  """`Lockstep` on `CFG`, with prompts made up from their lengths and the
  fork's copies checked against the model's."""

  def __init__(self):
    super().__init__(CFG)

  def claim(self, ids, lengths):
    tokens = np.arange(len(ids) * MAX_LEN, dtype=np.int32).reshape(
        len(ids), MAX_LEN) % 7
    assert super().claim(ids, tokens, lengths)["ok"] == [True] * len(ids)

  def fork(self, parents, children, head_of_line=True):
    """Forks on both; checks `ok`, the copies and the state against the
    model; returns `ok`."""
    got, want = super().fork(parents, children, head_of_line)
    nl2 = CFG.num_layers * 2
    src = np.asarray(got["src_pages"]).reshape(len(parents), nl2)
    dst = np.asarray(got["dst_pages"]).reshape(len(parents), nl2)
    for r, copy in enumerate(want["copies"]):
      if copy is None:
        assert (src[r] == -1).all() and (dst[r] == -1).all(), r
      else:
        # Page (slot * num_layers + layer) * 2 + kv, for every layer and kv.
        assert src[r].tolist() == [copy[0] * nl2 + j for j in range(nl2)], r
        assert dst[r].tolist() == [copy[1] * nl2 + j for j in range(nl2)], r
    return want["ok"]


def test_fork_from_every_parent_id():
  """Each id forks its neighbour: the last id, `max_seqs - 1`, is a parent
  like any other (its row, not its neighbour's, is shared and copied).
  Parents alternate a partial last block (a copy) and a full one (none)."""
  pair = _Pair()
  n = CFG.max_seqs // 2
  parents = list(range(n, CFG.max_seqs))   # the upper half, last id included
  # Distinct lengths so that rows differ: 5 (partial), 8 (full), 6 (partial).
  pair.claim(parents, [5, 8, 6])
  ok = pair.fork(parents[::-1], list(range(n)))
  assert ok == [True] * n
  # The child of the last id has its length, its full block, a copy.
  st = jax.device_get(pair.state)
  last = CFG.max_seqs - 1
  assert int(st.seq_lens[0]) == int(st.seq_lens[last]) == 6
  assert int(st.seq_slots[0, 0]) == int(st.seq_slots[last, 0])
  assert int(st.seq_slots[0, 1]) not in (-1, int(st.seq_slots[last, 1]))


def test_fork_several_children_and_chains():
  """Two children of one parent, then a child forked again: full blocks are
  shared three and four ways, each partial block copied once per child."""
  pair = _Pair()
  pair.claim([0, 1], [9, 4])
  assert pair.fork([0, 0, 1], [2, 3, 4]) == [True] * 3
  assert pair.fork([2, -1], [5, -1]) == [True, False]
  st = jax.device_get(pair.state)
  shared = int(st.seq_slots[0, 0])
  assert int(st.slot_refcount[shared]) == 4  # 0, 2, 3 and 5


def test_fork_invalid_requests_leave_state_unchanged():
  """Refused requests get `ok = False`, no copies, and change nothing: a
  dead parent, a live child, a child equal to its parent, a child listed
  twice, ids out of range (a parent one past the last row, with the last
  row live), -1 padding."""
  pair = _Pair()
  last = CFG.max_seqs - 1
  pair.claim([0, 1, last], [5, 8, 6])
  before = pair.state
  bad = pair.fork([3, 0, 1, 0, 0, CFG.max_seqs, 0, -1],
                  [4, 1, 1, 2, 2, 3, CFG.max_seqs, -1])
  assert bad == [False] * 8
  chex.assert_trees_all_equal(pair.state, before)


@pytest.mark.parametrize("head_of_line", [True, False])
def test_fork_without_a_free_slot(head_of_line):
  """With every slot held, a parent with a partial last block cannot get
  its copy: refused, the state unchanged. A parent whose blocks are all
  full needs no slot: admitted, unless it waits behind the refused request
  (`head_of_line`)."""
  pair = _Pair()
  pair.claim([0, 1, 2, 3], [5, 8, 16, 16])  # 2 + 2 + 4 + 4 = 12 slots
  before = pair.state
  assert int(jnp.sum(before.slot_refcount == 0)) == 0
  ok = pair.fork([0, 1], [4, 5], head_of_line=head_of_line)
  assert ok == [False, not head_of_line]
  if head_of_line:
    chex.assert_trees_all_equal(pair.state, before)
