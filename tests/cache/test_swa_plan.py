"""Tests for the pure SWA scratch-reuse parts (`cache/window.py`)."""

from __future__ import annotations

import dataclasses
import itertools

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pkvattn.cache import window


def brute_force_plan(history_len, capacity, page_size, window_left, num_layers,
                     max_rewind_len=0):
  """Enumerates blocks and future queries: which new blocks are stale for all.

  Independent of `window.swa_scratch_plan`: a block is new when the chunk writes one
  of its tokens and it holds no history token; it is stale for the query at `p` when
  every token `t` of it has `t < p - window_left`; scratch = new blocks stale for every
  query `p` in `[capacity - max_rewind_len, ...)` (enumerated up to a horizon past the
  end of the chunk).
  """
  num_blocks = -(-capacity // page_size) + 1
  tokens = np.arange(num_blocks * page_size).reshape(num_blocks, page_size)
  touched = ((tokens >= history_len) & (tokens < capacity)).any(axis=1)
  holds_history = (tokens < history_len).any(axis=1)
  new_blocks = np.flatnonzero(touched & ~holds_history)
  first_query = max(capacity - max_rewind_len, 0)
  queries = np.arange(first_query, capacity + 2 * page_size + 1)
  if window_left < 0:  # full attention: nothing ever leaves the window
    stale = np.zeros((queries.size, new_blocks.size), bool)
  else:
    stale = (tokens[new_blocks][None, :, :]
             < (queries - window_left)[:, None, None]).all(axis=2)
  scratch = new_blocks[stale.all(axis=0)]
  num_scratch = int(scratch.size)
  num_normal = int(new_blocks.size) - num_scratch
  num_scratch_slots = -(-num_scratch // num_layers)
  first_new = int(new_blocks[0]) if new_blocks.size else -(-history_len // page_size)
  return dict(
      scratch_blocks=[int(b) for b in scratch],
      new_blocks=[int(b) for b in new_blocks],
      first_new=first_new,
      num_scratch_blocks=num_scratch,
      num_normal_blocks=num_normal,
      num_scratch_slots=num_scratch_slots,
      num_step_slots=num_scratch_slots + num_normal,
  )


def assert_plan_matches(history_len, capacity, page_size, window_left, num_layers,
                        max_rewind_len=0):
  actual = window.swa_scratch_plan(history_len, capacity, page_size, window_left,
                                   num_layers, max_rewind_len)
  expected = brute_force_plan(history_len, capacity, page_size, window_left,
                              num_layers, max_rewind_len)
  args = (history_len, capacity, page_size, window_left, num_layers, max_rewind_len)
  assert list(range(actual.first_new_block, actual.end_new_block)) == (
      expected["new_blocks"]), args
  assert list(range(actual.scratch_first, actual.scratch_last)) == (
      expected["scratch_blocks"]), args
  for name in ("num_scratch_blocks", "num_normal_blocks", "num_scratch_slots",
               "num_step_slots"):
    assert getattr(actual, name) == expected[name], (name, args)
  return actual


@pytest.mark.parametrize("window_left,scratch,normal,slots", [
    (127, 28, 4, 5),   # 128-token window incl. the current token: -84%
    (129, 27, 5, 6),   # the PR text's figure: -81%
    (-1, 0, 32, 32),   # full attention: no scratch
])
def test_issue_figures(window_left, scratch, normal, slots):
  plan = assert_plan_matches(0, 1024, 32, window_left, 32)
  assert (plan.num_scratch_blocks, plan.num_normal_blocks,
          plan.num_step_slots) == (scratch, normal, slots)
  assert plan.num_scratch_slots == (1 if scratch else 0)
  assert (plan.scratch_first, plan.scratch_last) == (0, scratch)


@pytest.mark.parametrize(
    "history_len,capacity,page_size,window_left,num_layers,max_rewind_len", [
        (0, 1024, 32, 127, 32, 0),
        (0, 1000, 32, 127, 32, 0),       # partial last block
        (100, 1124, 32, 127, 32, 0),     # partial first block holds history: not new
        (96, 1120, 32, 127, 32, 0),      # history ends on a block boundary
        (1024, 2048, 32, 127, 32, 0),    # second chunk: history blocks not in plan
        (0, 1024, 32, 127, 32, 64),      # rewindable drafts keep two more blocks
        (0, 1024, 32, 127, 32, 1024),    # everything may be rolled back: no scratch
        (0, 1024, 32, 127, 32, 5000),    # rewind past the start: no scratch
        (500, 530, 16, 7, 4, 0),         # window smaller than the chunk
        (0, 256, 16, 1000, 4, 0),        # window larger than the chunk: no scratch
        (3000, 3100, 64, 2000, 8, 0),    # history only is stale: nothing new is
        (0, 4096, 8, 0, 3, 0),           # window_left 0: only the current token
        (0, 4096, 128, 511, 5, 0),       # page_size 128
        (7, 7, 16, 3, 2, 0),             # empty chunk
        (0, 1, 8, 0, 1, 0),              # single token
        (0, 33, 32, 0, 32, 0),           # the last block is partial
        (33, 100, 16, 10, 2, 3),         # partial first block + rewind
    ])
def test_table_vs_brute_force(history_len, capacity, page_size, window_left,
                              num_layers, max_rewind_len):
  assert_plan_matches(history_len, capacity, page_size, window_left, num_layers,
                      max_rewind_len)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    history_len=st.integers(0, 400),
    chunk_len=st.integers(0, 400),
    page_size=st.sampled_from([8, 16, 32, 64, 128]),
    window_left=st.integers(-1, 500),
    num_layers=st.integers(1, 40),
    max_rewind_len=st.one_of(st.just(0), st.integers(0, 300)),
)
def test_hypothesis_vs_brute_force(history_len, chunk_len, page_size, window_left,
                                   num_layers, max_rewind_len):
  assert_plan_matches(history_len, history_len + chunk_len, page_size, window_left,
                      num_layers, max_rewind_len)


def _random_cases(seed, n):
  rng = np.random.default_rng(seed)
  history_len = rng.integers(0, 3000, n)
  capacity = history_len + rng.integers(0, 3000, n)
  window_left = rng.integers(-1, 1500, n)
  window_left[::7] = -1
  window_left[1::7] = 0  # the current token alone
  max_rewind_len = np.where(rng.random(n) < 0.5, 0, rng.integers(0, 200, n))
  return [x.astype(np.int32) for x in (history_len, capacity, window_left,
                                        max_rewind_len)]


@pytest.mark.parametrize("page_size,num_layers", [(16, 32), (32, 5)])
def test_jit_and_vmap_match_python(page_size, num_layers):
  chex.clear_trace_counter()  # the counter is keyed by code: reset per parameter
  plan_fn = chex.assert_max_traces(n=1)(
      lambda h, c, w, r: window.swa_scratch_plan(h, c, page_size, w, num_layers, r))
  batched = jax.jit(plan_fn)
  mapped = jax.jit(jax.vmap(
      lambda h, c, w, r: window.swa_scratch_plan(h, c, page_size, w, num_layers, r)))
  for seed in (0, 1):  # different values, same shapes: no retrace
    cases = _random_cases(seed, 64)
    actual = batched(*cases)
    actual_vmap = mapped(*cases)
    chex.assert_trees_all_equal(actual, actual_vmap)
    chex.assert_shape(list(actual), (64,))
    for field in actual:
      assert field.dtype == jnp.int32
    for b in range(64):
      expected = window.swa_scratch_plan(
          *(int(x[b]) for x in cases[:2]), page_size, int(cases[2][b]), num_layers,
          int(cases[3][b]))
      assert tuple(int(f[b]) for f in actual) == tuple(expected), b


def test_jnp_broadcasts_scalar_window():
  plan = window.swa_scratch_plan(jnp.array([0, 0, 100]), jnp.array([1024, 1024, 1124]),
                                 32, 127, 32)
  assert plan.num_step_slots.tolist() == [5, 5, 6]  # block 3 holds history: 27 + 5


@pytest.mark.parametrize("page_size,num_layers", [(1, 2), (2, 1), (3, 3), (4, 2)])
def test_small_cases_exhaustive_both_paths(page_size, num_layers):
  """Every small case against the brute force, on the Python path, and the jnp path
  (one jitted call over all of them) against the Python path.

  The off-by-ones hide at the edges the random cases rarely reach: an empty sequence
  (`history_len = capacity = 0`), a first chunk (`history_len = 0`) under full
  attention, a window wider than what the binding query sees (the stale count's clamp
  at 0, a whole block when `page_size` is 1), and `page_size` 1 itself.
  """
  grid = np.array(list(itertools.product(range(8), range(8), range(-1, 9), (0, 1, 3))),
                  np.int32)  # history_len, chunk_len, window_left, max_rewind_len
  history_len, capacity = grid[:, 0], grid[:, 0] + grid[:, 1]
  window_left, max_rewind_len = grid[:, 2], grid[:, 3]
  batched = jax.jit(lambda h, c, w, r: window.swa_scratch_plan(
      h, c, page_size, w, num_layers, r))(history_len, capacity, window_left,
                                          max_rewind_len)
  batched = np.stack([np.asarray(f) for f in batched], axis=1)
  for k in range(len(grid)):
    expected = assert_plan_matches(int(history_len[k]), int(capacity[k]), page_size,
                                   int(window_left[k]), num_layers,
                                   int(max_rewind_len[k]))
    assert tuple(batched[k].tolist()) == tuple(expected), grid[k]


@pytest.mark.parametrize("page_size", [1, 16])
def test_jnp_path_clamps_out_of_range_values(page_size):
  """The jnp path checks nothing (no host sync) and clamps instead, as its docstring
  says: `capacity < history_len` plans no new blocks, a rewind past the start plans
  no scratch, `window_left < -1` is full attention, and a negative `history_len`
  counts as 0 (with `page_size` 1 an unclamped `cdiv` would make block -1 the first
  new block), as does a negative `max_rewind_len` (unclamped, it would plan blocks
  the last queries still see as scratch). Expected plans are the Python path's for
  the clamped values."""
  plan = lambda *a: tuple(int(f) for f in window.swa_scratch_plan(
      *(jnp.int32(x) for x in a[:2]), page_size, jnp.int32(a[2]), 3, jnp.int32(a[3])))
  first = -(-50 // page_size)
  assert plan(50, 20, 7, 0) == (first, first, first, first, 0, 0, 0, 0)
  assert plan(0, 40, 5, 100) == window.swa_scratch_plan(0, 40, page_size, 5, 3, 40)
  assert plan(0, 40, -7, 0) == window.swa_scratch_plan(0, 40, page_size, -1, 3, 0)
  for history_len in (-1, -3):
    assert plan(history_len, 40, 5, 0) == window.swa_scratch_plan(
        0, 40, page_size, 5, 3, 0)
  for max_rewind_len in (-1, -16, -40):
    assert plan(0, 40, 5, max_rewind_len) == window.swa_scratch_plan(
        0, 40, page_size, 5, 3, 0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(history_len=10, capacity=5), "capacity"),
    (dict(history_len=-1), "history_len"),
    (dict(window_left=-2), "window_left"),
    (dict(max_rewind_len=-1), "max_rewind_len"),
    (dict(page_size=0), "page_size"),
    (dict(num_layers=0), "num_layers"),
    (dict(page_size=jnp.int32(16)), "page_size"),
])
def test_invalid_arguments(kwargs, match):
  args = dict(history_len=0, capacity=64, page_size=16, window_left=15, num_layers=4)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    window.swa_scratch_plan(**args)


@pytest.mark.parametrize("L", [1, 2, 3, 4, 5, 7])
def test_subpage_converter_never_collides(L):
  num_blocks = 3 * L + 2
  for l in range(L):
    used = [window.scratch_subpage(i, l, L) for i in range(num_blocks)]
    assert len(set(used)) == num_blocks, (L, l)  # injective for a fixed layer
    assert all(0 <= s < L for _, s in used)
    assert max(p for p, _ in used) == -(-num_blocks // L) - 1  # cdiv(n, L) slots
  for i in range(num_blocks):  # Latin square: a block's L layers use L sub-pages
    assert sorted(window.scratch_subpage(i, l, L)[1] for l in range(L)) == list(
        range(L))


def test_subpage_converter_jnp_matches_python():
  i, l = np.meshgrid(np.arange(40), np.arange(6), indexing="ij")
  slot_pos, subpage = jax.jit(window.scratch_subpage, static_argnums=2)(i, l, 6)
  for a, b in itertools.product(range(40), range(6)):
    assert (int(slot_pos[a, b]), int(subpage[a, b])) == window.scratch_subpage(a, b, 6)


@pytest.mark.parametrize("num_layers", [1, 3, 4])
def test_scratch_page_indices_single_group(num_layers):
  # Row 1 counts more blocks than its 4 slots hold (4 * num_layers): those
  # past them are NULL_PAGE too.
  max_blocks = 4 * num_layers + 2
  scratch_slots = jnp.array([[9, 2, 5, window.NULL_PAGE], [4, 7, 1, 0]], jnp.int32)
  num_scratch = jnp.array([2 * num_layers + 1, max_blocks], jnp.int32)
  fn = jax.jit(lambda layer: window.scratch_page_indices(
      scratch_slots, num_scratch, layer, num_layers=num_layers,
      max_scratch_blocks=max_blocks))
  for layer in range(num_layers):
    pages = np.asarray(fn(layer))
    chex.assert_shape(pages, (2, 2, max_blocks))
    for b in range(2):
      n = min(int(num_scratch[b]), 4 * num_layers)
      k, v = pages[b, 0], pages[b, 1]
      assert (k[n:] == window.NULL_PAGE).all() and (v[n:] == window.NULL_PAGE).all()
      assert (v[:n] == k[:n] + 1).all() and (k[:n] % 2 == 0).all()
      assert len(set(k[:n].tolist())) == n  # no two scratch blocks of a layer collide
      for i in range(n):
        slot_pos, subpage = window.scratch_subpage(i, layer, num_layers)
        slot = int(scratch_slots[b, slot_pos])
        assert k[i] == (slot * num_layers + subpage) * 2


def test_scratch_page_indices_mixed_groups():
  # Gemma-2-like: even layers SWA, odd layers global; one slot space of 6 layers.
  groups = window.layer_groups([63, -1] * 3, 6)
  swa = groups[0]
  scratch_slots = jnp.array([3, 8], jnp.int32)
  pages_of = jax.jit(lambda layer: window.scratch_page_indices(
      scratch_slots, 6, layer, num_layers=6, group_layers=swa.layers,
      max_scratch_blocks=6))
  for layer in range(-1, 7):
    pages = np.asarray(pages_of(layer))
    if layer % 2 or not 0 <= layer < 6:  # global or no layer: never scratch
      assert (pages == window.NULL_PAGE).all()
      continue
    k = pages[0]
    assert len(set(k.tolist())) == 6
    pool_layers = (k // 2) % 6
    assert set(pool_layers.tolist()) <= set(swa.layers)  # only SWA layers' pages
  # Every layer in the group: pages for layers 0..5, none for layers past them.
  all_swa = jax.jit(lambda layer: window.scratch_page_indices(
      scratch_slots, 6, layer, num_layers=6, max_scratch_blocks=6))
  assert all((np.asarray(all_swa(layer)) != window.NULL_PAGE).all()
             for layer in (0, 5))
  assert all((np.asarray(all_swa(layer)) == window.NULL_PAGE).all()
             for layer in (-1, 6))
  for bad in ((), (0, 2, 2), (-1, 2), (0, 6)):
    with pytest.raises(ValueError, match="group_layers"):
      window.scratch_page_indices(scratch_slots, 6, 0, num_layers=6,
                                  group_layers=bad, max_scratch_blocks=6)


def test_scratch_page_indices_width_one_and_null_slots():
  """A width of one block is allowed (zero is refused); a scratch block whose slot
  entry is `NULL_PAGE` gets `NULL_PAGE` even when `num_scratch_blocks` counts it
  (the docstring's "where the scratch slot is NULL_PAGE")."""
  one = window.scratch_page_indices(jnp.array([[5]], jnp.int32), jnp.array([1]), 0,
                                    num_layers=2, max_scratch_blocks=1)
  assert one.tolist() == [[[(5 * 2 + 0) * 2], [(5 * 2 + 0) * 2 + 1]]]
  with pytest.raises(ValueError, match="max_scratch_blocks"):
    window.scratch_page_indices(jnp.array([[5]], jnp.int32), 1, 0, num_layers=2,
                                max_scratch_blocks=0)
  # Two layers per slot: blocks 0, 1 in slot 7, blocks 2, 3 in the NULL entry.
  pages = np.asarray(window.scratch_page_indices(
      jnp.array([7, window.NULL_PAGE], jnp.int32), 4, 1, num_layers=2,
      max_scratch_blocks=4))
  for i in range(2):  # block i of layer 1: sub-page (i + 1) % 2 of slot 7
    assert pages[:, i].tolist() == [(7 * 2 + (i + 1) % 2) * 2,
                                    (7 * 2 + (i + 1) % 2) * 2 + 1]
  assert (pages[:, 2:] == window.NULL_PAGE).all()


def test_per_layer_page_indices():
  slots = jnp.array([[3, window.NULL_PAGE, 0]], jnp.int32)
  pages = window.per_layer_page_indices(slots, jnp.int32(2), 4)
  assert pages.tolist() == [[[(3 * 4 + 2) * 2, (3 * 4 + 2) * 2 + 1], [-1, -1],
                             [2 * 2, 2 * 2 + 1]]]


def test_per_layer_page_indices_one_layer_and_zero_layers():
  """With one layer per slot a slot's pages are `2 * slot + r`; a pool of zero
  layers per slot is refused."""
  slots = jnp.array([2, window.NULL_PAGE, 0], jnp.int32)
  assert window.per_layer_page_indices(slots, 0, 1).tolist() == [
      [4, 5], [-1, -1], [0, 1]]
  with pytest.raises(ValueError, match="num_layers"):
    window.per_layer_page_indices(slots, 0, 0)


def test_layer_groups_alternating_gives_global_layers_no_scratch():
  layer_windows = [127, -1] * 4
  groups = window.layer_groups(layer_windows, 8)
  assert [(g.window_left, g.layers) for g in groups] == [
      (127, (0, 2, 4, 6)), (-1, (1, 3, 5, 7))]
  swa_plan, full_plan = window.group_scratch_plans(groups, 0, 1024, 32)
  assert swa_plan.num_scratch_blocks == 28
  assert swa_plan.num_scratch_slots == 7  # 28 blocks / 4 sub-pages per slot
  assert full_plan.num_scratch_blocks == 0 and full_plan.num_normal_blocks == 32
  off = window.group_scratch_plans(groups, 0, 1024, 32, enable_swa_scratch_reuse=False)
  assert all(p.num_scratch_blocks == 0 for p in off)
  group_of_layer, index_in_group, group_num_layers = window.layer_group_tables(groups)
  assert group_of_layer.tolist() == [0, 1] * 4
  assert index_in_group.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
  assert group_num_layers.tolist() == [4] * 8


def test_layer_groups_none_and_errors():
  (group,) = window.layer_groups(None, 3)
  assert group.layers == (0, 1, 2) and not group.is_swa
  with pytest.raises(ValueError, match="layer_windows"):
    window.layer_groups([1, 2], 3)
  with pytest.raises(ValueError, match=r"layer_windows\[1\]"):
    window.layer_groups([1, -5, 2], 3)
  # window_left 0 (the current token alone) is a sliding window: its group
  # gets the SWA plan's scratch.
  zero, full = window.layer_groups([0, -1, 0], 3)
  assert zero.is_swa and not full.is_swa
  plans = window.group_scratch_plans((zero, full), 0, 1024, 32)
  assert plans[0] == window.swa_scratch_plan(0, 1024, 32, 0, 2)
  assert plans[0].num_scratch_blocks > 0
  assert plans[1].num_scratch_blocks == 0


def test_layer_groups_single_layer_and_bad_arguments():
  """One layer is a model (its group holds it); zero layers and a window below -1
  (only -1 means full attention) are refused."""
  assert window.layer_groups([5], 1) == (window.LayerGroup(5, (0,)),)
  assert window.layer_groups(None, 1) == (window.LayerGroup(-1, (0,)),)
  with pytest.raises(ValueError, match="num_layers"):
    window.layer_groups(None, 0)
  with pytest.raises(ValueError, match="num_layers"):
    window.layer_groups([], 0)
  with pytest.raises(ValueError, match=r"layer_windows\[0\]"):
    window.layer_groups([-2, 3], 2)


def test_layer_group_is_immutable_and_hashable():
  """`LayerGroup` is a frozen value: a config's cached groups cannot be changed
  through it, and equal groups hash alike (usable as dict keys or static jit
  arguments)."""
  group = window.LayerGroup(127, (0, 2))
  with pytest.raises(dataclasses.FrozenInstanceError):
    group.window_left = 3
  assert {group: 1}[window.LayerGroup(127, (0, 2))] == 1


def test_page_index_mode():
  P = window.PageIndexMode
  assert window.check_page_index_mode("per_layer", True) is P.PER_LAYER
  assert window.check_page_index_mode(P.SHARED, False) is P.SHARED
  with pytest.raises(ValueError, match="PER_LAYER.*scratch"):
    window.check_page_index_mode(P.SHARED, True)
  with pytest.raises(ValueError, match="page_index_mode"):
    window.check_page_index_mode("bogus", False)
