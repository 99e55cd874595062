"""Sliding-window (SWA) scratch-slot reuse during prefill: the pure planning parts.

TensorRT-LLM PR #13368. While a long chunk is prefilled through sliding-window layers,
some of the chunk's new blocks will be outside the window of every future query as soon
as the chunk is history. Such a block is needed only while one layer computes its
attention over the chunk, so the next layer may overwrite it. A slot holds one block of
every layer (K and V), so one *scratch* slot, whose `L` per-layer sub-pages are re-used
as plain pages, serves `L` such blocks for the layer now running.

This module holds the parts that need no cache state:

* `swa_scratch_plan`: how many of a chunk's new blocks are scratch, for Python ints
  (host planning, reports) and for traced int32 arrays (inside the jitted cache
  functions, vectorised over a batch of sequences by broadcasting or `jax.vmap`).
* `layer_groups` / `group_scratch_plans`: layers with equal `window_left` form a group;
  full-attention groups (`window_left = -1`) never get scratch.
* `scratch_subpage` / `scratch_page_indices`: the PER_LAYER converter that maps
  scratch block `i` of layer `l` to a sub-page of a scratch slot, and
  `per_layer_page_indices` for normal blocks.
* `PageIndexMode` / `check_page_index_mode`: SHARED indices cannot address sub-pages,
  so SHARED with scratch active raises.

Conventions (as in the rest of the project):
  * Block `b` of a sequence holds tokens `[b * page_size, (b + 1) * page_size)`.
  * `window_left`: key `j` is visible to the query at position `p` iff
    `p - window_left <= j <= p`; `-1` = no window (FlashInfer). A 4,096-token window
    that includes the current token is `window_left = 4095`.
  * Multi-layer pool `[num_slots * num_layers * 2, page_size, num_kv_heads, head_dim]`;
    slot `s`, layer `l`, role `r` (0 = K, 1 = V) lives at page
    `(s * num_layers + l) * 2 + r` (TensorRT-LLM PER_LAYER, split tables).

The cache state uses these in `cache/alloc.py` (`claim_batch` / `extend` take the
scratch path, `finish_step` ends it) and `cache/tables.py` (`page_table` maps a running
step's scratch blocks to sub-pages). There one slot space serves every layer, so the
scratch blocks of a step are those every layer treats as scratch: all-SWA models only
(`CacheConfig` docstring).

This module depends only on jax/numpy (the `cache` package never imports `pkvattn`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Final, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

NULL_PAGE: Final = -1  # Table entry for "no block here" (same sentinel as the cache).
FULL_ATTENTION: Final = -1  # window_left of a layer without a sliding window.


def _is_traced(*xs) -> bool:
  """True if any argument is a jax/numpy array (jnp path), False for plain ints."""
  return any(isinstance(x, (jax.Array, np.ndarray)) for x in xs)


def _check_static_int(value, name: str, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(
        f"Invalid {name}: expected a static Python int >= {minimum}, got "
        f"{type(value).__name__} {value!r}")
  if value < minimum:
    raise ValueError(f"Invalid {name}: expected an int >= {minimum}, got {value}")


def _cdiv(a, b):
  return (a + b - 1) // b


class SwaScratchPlan(NamedTuple):
  """Scratch plan for one chunk of one sequence (fields are ints, or int32 arrays of
  the broadcast batch shape on the jnp path).

  Block indices are absolute block indices of the sequence (block `b` holds tokens
  `[b * page_size, (b + 1) * page_size)`). The chunk's new blocks are
  `[first_new_block, end_new_block)`; the scratch blocks are the prefix
  `[scratch_first, scratch_last)` of them (stale blocks are always the oldest ones), so
  `scratch_first == first_new_block` and normal blocks are
  `[scratch_last, end_new_block)`. Scratch block `b` sits at position
  `i = b - scratch_first` of the scratch range (the `i` of `scratch_subpage`).
  """
  first_new_block: int | jax.Array     # first block not holding any history token
  end_new_block: int | jax.Array       # cdiv(capacity, page_size); exclusive
  scratch_first: int | jax.Array       # == first_new_block
  scratch_last: int | jax.Array        # exclusive; == scratch_first if no scratch
  num_scratch_blocks: int | jax.Array  # scratch_last - scratch_first
  num_normal_blocks: int | jax.Array   # new blocks kept after the step
  num_scratch_slots: int | jax.Array   # cdiv(num_scratch_blocks, num_layers)
  num_step_slots: int | jax.Array      # num_scratch_slots + num_normal_blocks


def swa_scratch_plan(
    history_len,         # int | i32[*batch]: tokens already cached (before the chunk)
    capacity,            # int | i32[*batch]: tokens after the chunk
    page_size: int,
    window_left,         # int | i32[*batch]: -1 = full attention (no scratch)
    num_layers: int,
    max_rewind_len=0,    # int | i32[*batch]
) -> SwaScratchPlan:
  """Plans SWA scratch blocks for a chunk that grows a sequence to `capacity` tokens.

  Semantics. The chunk writes tokens `history_len .. capacity - 1`. Its *new*
  blocks are the blocks those tokens touch, minus a partial block that already holds
  history tokens (that block is owned by the sequence already, so it is not new):
  `[cdiv(history_len, page_size), cdiv(capacity, page_size))`. A block is *stale*
  for the query at position `p` when all its tokens are `< p - window_left`. Scratch
  blocks are the new blocks stale for every query at or after
  `capacity - max_rewind_len` (all future queries; the last `max_rewind_len` tokens
  of the chunk may be rolled back and re-queried, e.g. speculative drafts).
  Staleness only grows with `p`, so the binding query is
  `P = capacity - max_rewind_len`: block `b` is scratch iff it is new and
  `(b + 1) * page_size <= P - window_left`, i.e.
  `b < floor((P - window_left) / page_size)`. The stale blocks are therefore always
  the oldest new blocks.

  Slots for the step: each scratch slot carries `num_layers` sub-pages per role, so it
  serves `num_layers` scratch blocks for the layer now running:
  `num_scratch_slots = cdiv(num_scratch_blocks, num_layers)`, and the step takes
  `num_step_slots = num_scratch_slots + num_normal_blocks` new slots. The sequence's
  peak is its already-held slots plus `num_step_slots`; after the step the scratch slots
  return to the pool and only the normal blocks stay.

  Example (32 layers, page_size 32, a 1,024-token prompt in one chunk, 32 blocks):
  `window_left = 127` -> the first future query (1024) sees 897..1024, blocks 0..27 are
  stale: 28 scratch + 4 normal -> 1 + 4 = 5 slots instead of 32.
  `window_left = 129` -> 27 scratch + 5 normal -> 6 slots.

  >>> swa_scratch_plan(0, 1024, 32, 127, 32).num_step_slots
  5
  >>> swa_scratch_plan(0, 1024, 32, 129, 32)[4:]
  (27, 5, 1, 6)

  Python vs jnp path: with plain Python ints every field is a Python int and invalid
  values raise. If any of `history_len`, `capacity`, `window_left`, `max_rewind_len` is
  an array (traced or concrete), every field is an int32 array of the broadcast shape,
  so it runs inside `jax.jit` and is vectorised over a batch of sequences (or under
  `jax.vmap`). On that path values are not checked (no host sync); out-of-range values
  are clamped: a negative `history_len` counts as 0, `capacity < history_len` plans
  no new blocks, a negative `max_rewind_len` counts as 0, a negative
  `capacity - max_rewind_len` plans no scratch, and `window_left < 0` means full
  attention.

  Args:
    history_len: tokens cached before the chunk, `>= 0`.
    capacity: tokens after the chunk, `>= history_len`.
    page_size: static; tokens per block, `>= 1`.
    window_left: `>= -1`; `-1` = full attention (plans no scratch).
    num_layers: static; layers whose blocks a slot holds (the SWA group's size when
      groups have separate slot spaces), `>= 1`.
    max_rewind_len: tokens at the end of the chunk that may be rolled back, `>= 0`
      (default 0). Blocks visible to queries in the rewind range are not scratch.

  Returns:
    `SwaScratchPlan`; see its docstring for the fields.

  Raises:
    ValueError: `page_size` or `num_layers` not a static int `>= 1`; on the Python
      path also `history_len < 0`, `capacity < history_len`, `window_left < -1` or
      `max_rewind_len < 0`.
  """
  _check_static_int(page_size, "page_size", 1)
  _check_static_int(num_layers, "num_layers", 1)
  if _is_traced(history_len, capacity, window_left, max_rewind_len):
    return _plan_jnp(history_len, capacity, page_size, window_left, num_layers,
                     max_rewind_len)
  for value, name, minimum in ((history_len, "history_len", 0),
                               (window_left, "window_left", -1),
                               (max_rewind_len, "max_rewind_len", 0)):
    _check_static_int(value, name, minimum)
  _check_static_int(capacity, "capacity", 0)
  if capacity < history_len:
    raise ValueError(
        f"Invalid capacity: expected >= history_len={history_len}, got {capacity}")
  history_len, capacity = int(history_len), int(capacity)
  window_left, max_rewind_len = int(window_left), int(max_rewind_len)
  first_new = _cdiv(history_len, page_size)
  end_new = max(first_new, _cdiv(capacity, page_size))
  if window_left < 0:
    num_stale = 0
  else:
    num_stale = max(0, capacity - max_rewind_len - window_left) // page_size
  scratch_last = max(first_new, min(num_stale, end_new))
  num_scratch = scratch_last - first_new
  num_normal = end_new - scratch_last
  num_scratch_slots = _cdiv(num_scratch, num_layers)
  return SwaScratchPlan(first_new, end_new, first_new, scratch_last, num_scratch,
                        num_normal, num_scratch_slots, num_scratch_slots + num_normal)


def _plan_jnp(history_len, capacity, page_size, window_left, num_layers,
              max_rewind_len) -> SwaScratchPlan:
  """Same math as the Python path on int32 arrays (broadcasting, no checks)."""
  history_len, capacity, window_left, max_rewind_len = (
      jnp.asarray(x, jnp.int32)
      for x in (history_len, capacity, window_left, max_rewind_len))
  history_len = jnp.maximum(history_len, 0)
  max_rewind_len = jnp.maximum(max_rewind_len, 0)
  first_new = _cdiv(history_len, page_size)
  end_new = jnp.maximum(first_new, _cdiv(jnp.maximum(capacity, 0), page_size))
  num_stale = jnp.where(
      window_left < 0, 0,
      jnp.maximum(capacity - max_rewind_len - window_left, 0) // page_size)
  scratch_last = jnp.maximum(first_new, jnp.minimum(num_stale, end_new))
  num_scratch = scratch_last - first_new
  num_normal = end_new - scratch_last
  num_scratch_slots = _cdiv(num_scratch, num_layers)
  fields = (first_new, end_new, first_new, scratch_last, num_scratch, num_normal,
            num_scratch_slots, num_scratch_slots + num_normal)
  shape = jnp.broadcast_shapes(*(f.shape for f in fields))
  return SwaScratchPlan(*(jnp.broadcast_to(f, shape).astype(jnp.int32)
                          for f in fields))


# ----------------------------------------------------------------------------------
# Layer groups.


@dataclasses.dataclass(frozen=True)
class LayerGroup:
  """Layers sharing one `window_left`.

  `layers` are model layer indices in increasing order; the layer's index within the
  group (`layers.index(layer)`) is the `l` of the PER_LAYER converter.
  """
  window_left: int            # -1 = full attention
  layers: tuple[int, ...]     # model layer indices, increasing

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  @property
  def is_swa(self) -> bool:
    return self.window_left >= 0


def layer_groups(layer_windows: Sequence[int] | None,
                 num_layers: int) -> tuple[LayerGroup, ...]:
  """Groups layers by `window_left` (`CacheConfig.layer_windows`).

  Args:
    layer_windows: static; `window_left` per layer (`-1` = full attention), length
      `num_layers`; `None` = every layer full attention.
    num_layers: static; layers in the model, `>= 1`.

  Returns:
    One `LayerGroup` per distinct window, ordered by first layer. For Gemma-2-like
    alternation `(4095, -1, 4095, -1, ...)` that is the SWA group of even layers, then
    the full group of odd layers.

  Raises:
    ValueError: wrong length, or a window that is not an int `>= -1`.
  """
  _check_static_int(num_layers, "num_layers", 1)
  if layer_windows is None:
    return (LayerGroup(FULL_ATTENTION, tuple(range(num_layers))),)
  layer_windows = tuple(layer_windows)
  if len(layer_windows) != num_layers:
    raise ValueError(
        f"Invalid length of layer_windows: expected num_layers={num_layers}, got "
        f"{len(layer_windows)}")
  members: dict[int, list[int]] = {}
  for layer, window in enumerate(layer_windows):
    _check_static_int(window, f"layer_windows[{layer}]", -1)
    members.setdefault(int(window), []).append(layer)
  return tuple(LayerGroup(w, tuple(ls)) for w, ls in members.items())


def layer_group_tables(groups: Sequence[LayerGroup]) -> tuple[np.ndarray, ...]:
  """Static per-layer lookup tables, for a layer index that is traced (a scan).

  Returns:
    `(group_of_layer, index_in_group, group_num_layers)`, each `i32[num_layers]`
    (NumPy, so they become constants under jit): the layer's group, its index `l`
    within the group, and the group's size `L`.
  """
  num_layers = sum(g.num_layers for g in groups)
  group_of_layer = np.full(num_layers, -1, np.int32)
  index_in_group = np.full(num_layers, -1, np.int32)
  group_num_layers = np.zeros(num_layers, np.int32)
  for gid, group in enumerate(groups):
    for idx, layer in enumerate(group.layers):
      group_of_layer[layer], index_in_group[layer] = gid, idx
      group_num_layers[layer] = group.num_layers
  return group_of_layer, index_in_group, group_num_layers


def group_scratch_plans(
    groups: Sequence[LayerGroup],
    history_len,       # int | i32[*batch]
    capacity,          # int | i32[*batch]
    page_size: int,
    *,
    max_rewind_len=0,  # int | i32[*batch]
    enable_swa_scratch_reuse: bool = True,
) -> tuple[SwaScratchPlan, ...]:
  """`swa_scratch_plan` per group, each group a slot space of its own layers.

  Full-attention groups, and every group when `enable_swa_scratch_reuse` is False, get
  a plan with no scratch (all new blocks normal). An SWA group's scratch slot holds
  `group.num_layers` sub-pages per role, so its `num_scratch_slots` divides by the
  group size, not by the model's layer count.
  """
  return tuple(
      swa_scratch_plan(
          history_len, capacity, page_size,
          g.window_left if (enable_swa_scratch_reuse and g.is_swa) else FULL_ATTENTION,
          g.num_layers, max_rewind_len)
      for g in groups)


# ----------------------------------------------------------------------------------
# PER_LAYER page indices and the scratch sub-page converter.


class PageIndexMode(enum.Enum):
  """How page-table indices address the multi-layer pool (TensorRT-LLM naming).

  PER_LAYER: indices already include the layer's position in the slot,
    `(slot * num_layers + layer) * 2 + {0: K, 1: V}`; what the kernels consume.
  SHARED: the slot index only; the caller offsets the base per layer. It cannot
    express scratch sub-pages (the sub-page differs per block, not per layer).
  """
  PER_LAYER = "per_layer"
  SHARED = "shared"


def check_page_index_mode(mode: PageIndexMode | str,
                          scratch_active: bool) -> PageIndexMode:
  """Returns `mode` as a `PageIndexMode`, raising if it cannot express scratch.

  Args:
    mode: static; a `PageIndexMode` or its value (`"per_layer"`, `"shared"`).
    scratch_active: static; True when the cache can hand out scratch blocks
      (`CacheConfig.swa_scratch_active`: enabled and every layer SWA).

  Raises:
    ValueError: unknown mode, or SHARED while scratch is active.
  """
  try:
    mode = PageIndexMode(mode)
  except ValueError:
    raise ValueError(
        f"Invalid page_index_mode: expected one of "
        f"{tuple(m.value for m in PageIndexMode)}, got {mode!r}") from None
  if mode is PageIndexMode.SHARED and scratch_active:
    raise ValueError(
        "Invalid page_index_mode: expected PageIndexMode.PER_LAYER while SWA scratch "
        "reuse is active (scratch blocks live in per-layer sub-pages of a scratch "
        "slot, which a SHARED slot index cannot address), got PageIndexMode.SHARED; "
        "use PER_LAYER or set enable_swa_scratch_reuse=False")
  return mode


def per_layer_page_indices(
    slots,            # i32[*shape]: slot ids, NULL_PAGE where there is no block
    layer,            # int | i32[]: model layer (traced ok)
    num_layers: int,
) -> jax.Array:       # i32[*shape, 2]: (K page, V page), NULL_PAGE where slots < 0
  """PER_LAYER split indices of normal blocks: `(slot * num_layers + layer) * 2 + r`.

  The role axis is last; a split table `i32[batch, 2, max_pages]` is
  `jnp.moveaxis(out, -1, -2)` of a `[batch, max_pages]` slot table.
  """
  _check_static_int(num_layers, "num_layers", 1)
  slots = jnp.asarray(slots, jnp.int32)
  base = (slots * num_layers + jnp.asarray(layer, jnp.int32)) * 2
  pages = base[..., None] + jnp.arange(2, dtype=jnp.int32)
  return jnp.where(slots[..., None] < 0, NULL_PAGE, pages)


def scratch_subpage(block_pos, layer_in_group, group_num_layers):
  """The PR #13368 converter: `(scratch slot, sub-page)` of a scratch block.

  The block at position `i = block_pos` of the scratch range, for layer `l =
  layer_in_group` of an `L = group_num_layers`-layer group, lives in scratch slot
  `i // L` at sub-page `(i % L + l) % L`.

  Why a layer's scratch blocks never collide: blocks in different scratch slots
  (`i // L` differs) use different slots. The `L` blocks of one slot have `i % L =
  0 .. L-1`, and for fixed `l` the map `r -> (r + l) mod L` is a rotation of
  `Z_L`, hence a bijection: they take `L` distinct sub-pages, each once. So for a
  fixed layer, `i -> (i // L, (i % L + l) % L)` is injective and one scratch slot
  holds exactly `L` blocks of the running layer.

  Symmetrically, for a fixed block `i` the map `l -> (i % L + l) mod L` is a bijection
  too (the table is a Latin square), so the `L` layers of the group place block `i`
  in `L` different sub-pages; layer `l + 1`'s block `i` overwrites what was layer
  `l`'s block `i + 1` of the same slot. This is safe because layers run one after the
  other and layer `l` has finished with its scratch blocks before layer `l + 1`
  writes: scratch contents are live only within one layer's attention over the chunk.

  Works on ints and on int arrays (broadcasting; traced ok). Returns `(slot_pos,
  subpage)`: `slot_pos` indexes the step's scratch slots (0-based), `subpage` is in
  `[0, L)`.
  """
  L = group_num_layers
  return block_pos // L, (block_pos % L + layer_in_group) % L


def scratch_page_indices(
    scratch_slots,        # i32[*batch, max_scratch_slots]: the step's scratch slot ids
    num_scratch_blocks,   # int | i32[*batch]
    layer,                # int | i32[]: model layer (traced ok)
    *,
    num_layers: int,
    group_layers: Sequence[int] | None = None,
    max_scratch_blocks: int,
) -> jax.Array:           # i32[*batch, 2, max_scratch_blocks]
  """PER_LAYER split page indices of the scratch blocks for one layer.

  Scratch block `i` (position in the scratch range, `0 <= i < num_scratch_blocks`)
  of group layer `l` goes to scratch slot `scratch_slots[..., i // L]` at sub-page
  `s = (i % L + l) % L` (`scratch_subpage`), where `L = len(group_layers)`. A sub-page
  is a layer position of the slot: sub-page `s` is the slot's page of model layer
  `group_layers[s]`, so the index is
  `(scratch_slot * num_layers + group_layers[s]) * 2 + {0: K, 1: V}`. With one group
  of all layers (`group_layers=None`), `group_layers[s] = s` and this is
  `(scratch_slot * num_layers + s) * 2 + r`: the sub-page replaces the layer in the
  normal PER_LAYER formula.

  Args:
    scratch_slots: `i32[*batch, max_scratch_slots]`; slot ids of the step's scratch
      slots, in scratch order (`NULL_PAGE` for unused entries).
    num_scratch_blocks: `i32[*batch]` (or int); from `SwaScratchPlan`.
    layer: model layer index; may be traced (a scan over layers).
    num_layers: static; layers per slot of the pool (the model's, `>= 1`).
    group_layers: static; model layers of the SWA group in increasing order, whose
      positions in a slot serve as sub-pages; `None` = `range(num_layers)`.
    max_scratch_blocks: static; width of the result, `>= 1`.

  Returns:
    `i32[*batch, 2, max_scratch_blocks]`: row 0 the K pages, row 1 the V pages, for
    scratch blocks `0 .. max_scratch_blocks - 1`; `NULL_PAGE` past
    `num_scratch_blocks` or past the `max_scratch_slots * L` blocks the slots
    hold, where the scratch slot is `NULL_PAGE`, and for every block
    when `layer` is not in `group_layers` (e.g. a global layer of a mixed model: it
    never gets scratch).

  Raises:
    ValueError: bad static arguments (`group_layers` not distinct layers in range).
  """
  _check_static_int(num_layers, "num_layers", 1)
  _check_static_int(max_scratch_blocks, "max_scratch_blocks", 1)
  if group_layers is None:
    group_layers = tuple(range(num_layers))
  group_layers = tuple(int(x) for x in group_layers)
  if (not group_layers or len(set(group_layers)) != len(group_layers)
      or min(group_layers) < 0 or max(group_layers) >= num_layers):
    raise ValueError(
        f"Invalid group_layers: expected distinct layers in [0, {num_layers}), got "
        f"{group_layers}")
  L = len(group_layers)
  index_in_group = np.full(num_layers, -1, np.int32)
  index_in_group[list(group_layers)] = np.arange(L, dtype=np.int32)
  layer = jnp.asarray(layer, jnp.int32)
  l = jnp.asarray(index_in_group)[jnp.clip(layer, 0, num_layers - 1)]
  l = jnp.where((layer >= 0) & (layer < num_layers), l, -1)

  scratch_slots = jnp.asarray(scratch_slots, jnp.int32)
  num_scratch_blocks = jnp.asarray(num_scratch_blocks, jnp.int32)
  i = jnp.arange(max_scratch_blocks, dtype=jnp.int32)
  slot_pos, subpage = scratch_subpage(i, jnp.maximum(l, 0), L)
  max_scratch_slots = scratch_slots.shape[-1]
  slot = jnp.take(scratch_slots, jnp.minimum(slot_pos, max_scratch_slots - 1),
                  axis=-1)                                # [*batch, max_scratch_blocks]
  pool_layer = jnp.asarray(np.asarray(group_layers, np.int32))[subpage]
  base = (slot * num_layers + pool_layer) * 2
  valid = ((i < num_scratch_blocks[..., None]) & (slot_pos < max_scratch_slots)
           & (slot >= 0) & (l >= 0))
  pages = base[..., None, :] + jnp.arange(2, dtype=jnp.int32)[:, None]
  return jnp.where(valid[..., None, :], pages, NULL_PAGE)
