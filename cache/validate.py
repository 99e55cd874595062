"""Host-side check of every cache-state invariant (tests and debug mode only).

Data-dependent checks never run in the jitted path; `validate(state)` pulls the
state to the host and raises with the list of broken invariants.
"""

from __future__ import annotations

import numpy as np

from .state import CacheState


class CacheInvariantError(ValueError):
  """Raised by `validate` with one line per broken invariant."""


def validate(state: CacheState, *, allow_window_holes: bool = False,
             anchor_num_slots: int | None = None) -> None:
  """Checks every invariant of `state`; raises CacheInvariantError if one fails.

  Checked:
    * array shapes and dtypes against the config;
    * live rows hold exactly `cdiv(seq_lens, page_size)` blocks, all valid slot
      ids, no slot twice in a row; dead rows are empty with length 0;
    * SWA scratch: a -1 among a live row's blocks only when scratch is active
      and the block is out of the window of every query the sequence can
      still get (`(b + 1) * page_size <= seq_lens - max_rewind_len -
      scratch_window_left`); a running step's scratch range lies in the
      sequence's blocks and is -1 in its row; its `cdiv(count, num_layers)`
      scratch slots are valid, distinct, each held by nobody else, never
      published, and the unused entries are -1; no scratch when inactive or
      dead;
    * `slot_refcount[s]` equals the number of live (sequence, block) entries
      holding `s` (so free + used + cached = num_slots holds by construction,
      and no unreferenced slot is in any table);
    * a slot held by more than one entry, or published, is a full block in
      every row holding it (read-only: no holder ever writes into it);
    * the prefix-cache index: every table entry is a published slot whose
      `slot_hash_pos` points back at it and whose key hashes to that bucket;
      every published slot is in the table exactly once; no two published
      slots share a key; parents are valid slot ids or -1; a published
      slot's `slot_depth` is in `[0, max_pages)`, 0 exactly when it has no
      parent;
    * counters are non-negative and hits <= lookups.

  Args:
    state: the cache state.
    allow_window_holes: the state is a sliding group of a per-window-group
      cache (`cache/hybrid.py`), whose blocks out of every later query's
      window are released: -1 is allowed there as for scratch.

  Raises:
    CacheInvariantError: listing every violated invariant.
  """
  cfg = state.config
  f = {k: np.asarray(v) for k, v in vars(state).items() if k != "config"}
  errors: list[str] = []
  ns, ps, mp, ms = cfg.num_slots, cfg.page_size, cfg.max_pages, cfg.max_seqs
  expected = dict(
      slot_refcount=((ns,), np.int32), slot_last_use=((ns,), np.int32),
      slot_published=((ns,), np.bool_), slot_key=((ns, 2), np.uint32),
      slot_tokens=((ns, ps), np.int32), slot_scope=((ns,), np.int32),
      slot_parent=((ns,), np.int32), slot_parent_gen=((ns,), np.int32),
      slot_gen=((ns,), np.int32), slot_depth=((ns,), np.int32),
      slot_hash_pos=((ns,), np.int32),
      hash_table=((cfg.num_buckets, cfg.hash_ways), np.int32),
      seq_slots=((ms, mp), np.int32), seq_lens=((ms,), np.int32),
      seq_live=((ms,), np.bool_), seq_scope=((ms,), np.int32),
      seq_scratch_slots=((ms, cfg.max_scratch_slots), np.int32),
      seq_scratch_first=((ms,), np.int32), seq_scratch_count=((ms,), np.int32),
      clock=((), np.int32), num_lookups=((), np.int32),
      num_hits=((), np.int32))
  for name, (shape, dtype) in expected.items():
    a = f[name]
    if a.shape != shape or a.dtype != dtype:
      errors.append(f"{name}: expected {dtype.__name__}{list(shape)}, got "
                    f"{a.dtype}{list(a.shape)}")
  if errors:
    raise CacheInvariantError("\n".join(errors))

  owners = np.zeros(ns, np.int64)
  holders: dict[int, list[tuple[int, int]]] = {}
  for sid in range(ms):
    row, length, live = f["seq_slots"][sid], int(f["seq_lens"][sid]), bool(
        f["seq_live"][sid])
    scratch = f["seq_scratch_slots"][sid]
    first, count = (int(f["seq_scratch_first"][sid]),
                    int(f["seq_scratch_count"][sid]))
    if not live:
      if (row != -1).any() or length != 0:
        errors.append(f"seq {sid}: dead but holds blocks or length {length}")
      if (scratch != -1).any() or count != 0 or first != 0:
        errors.append(f"seq {sid}: dead but holds scratch {scratch}")
      continue
    nb = -(-length // ps)
    if not 0 <= length <= cfg.max_seq_len:
      errors.append(f"seq {sid}: length {length} out of [0, {cfg.max_seq_len}]")
      continue
    pos = np.arange(mp)
    holes = cfg.swa_scratch_active or (
        allow_window_holes and cfg.layer_windows is not None
        and min(cfg.layer_windows) >= 0)
    hole_window = max(cfg.layer_windows) if holes else -1
    stale = ((pos + 1) * ps <= length - cfg.max_rewind_len
             - hole_window) & holes
    held_mask = (pos < nb) & ~((row == -1) & stale)
    held = row[held_mask]
    if (held < 0).any() or (held >= ns).any():
      errors.append(f"seq {sid}: invalid slot in its first {nb} blocks: {row}")
    num_scratch_slots = -(-count // cfg.num_layers)
    if count < 0 or (count > 0 and not cfg.swa_scratch_active):
      errors.append(f"seq {sid}: scratch count {count} (scratch active: "
                    f"{cfg.swa_scratch_active})")
    elif count == 0:
      if (scratch != -1).any() or first != 0:
        errors.append(f"seq {sid}: no scratch blocks but scratch {scratch}, "
                      f"first {first}")
    else:
      in_range = (pos >= first) & (pos < first + count)
      if first < 0 or first + count > nb or (row[in_range] != -1).any():
        errors.append(f"seq {sid}: scratch blocks [{first}, {first + count}) "
                      f"not -1 blocks of its {nb}: {row}")
      if (~stale[in_range]).any():
        errors.append(f"seq {sid}: scratch blocks [{first}, {first + count}) "
                      f"visible to a query at or after {length}")
      used = scratch[:num_scratch_slots]
      if ((used < 0).any() or (used >= ns).any()
          or (scratch[num_scratch_slots:] != -1).any()
          or len(set(used.tolist())) != len(used)):
        errors.append(f"seq {sid}: expected {num_scratch_slots} distinct "
                      f"scratch slots, got {scratch}")
      for s in used.tolist():
        if 0 <= s < ns:
          owners[s] += 1
          holders.setdefault(s, []).append((sid, -1))
    if (row[nb:] != -1).any():
      errors.append(f"seq {sid}: blocks past cdiv(len, page_size)={nb}: {row}")
    if len(set(held.tolist())) != len(held):
      errors.append(f"seq {sid}: a slot appears twice: {row}")
    for pos, s in zip(np.flatnonzero(held_mask).tolist(), held.tolist()):
      if 0 <= s < ns:
        owners[s] += 1
        holders.setdefault(s, []).append((sid, pos))
  bad = np.nonzero(owners != f["slot_refcount"])[0]
  for s in bad[:10]:
    errors.append(f"slot {s}: refcount {f['slot_refcount'][s]} but "
                  f"{owners[s]} holders {holders.get(int(s), [])}")
  for s, hs in holders.items():
    scratch_holder = any(pos < 0 for _, pos in hs)
    if scratch_holder and (len(hs) > 1 or f["slot_published"][s]):
      errors.append(f"slot {s}: a scratch slot shared or published: {hs}")
      continue
    if len(hs) > 1 or f["slot_published"][s]:
      for sid, pos in hs:
        if pos >= int(f["seq_lens"][sid]) // ps:
          errors.append(
              f"slot {s}: shared or published but the partial block {pos} of "
              f"seq {sid} (length {f['seq_lens'][sid]})")

  table = f["hash_table"]
  flat = table.reshape(-1)
  pub = f["slot_published"]
  seen = np.zeros(ns, np.int64)
  for p, s in enumerate(flat.tolist()):
    if s < 0:
      continue
    if s >= ns:
      errors.append(f"hash_table[{p}] = {s} is not a slot id")
      continue
    seen[s] += 1
    if not pub[s]:
      errors.append(f"hash_table[{p}] = slot {s}, which is not published")
    if f["slot_hash_pos"][s] != p:
      errors.append(f"slot {s}: slot_hash_pos {f['slot_hash_pos'][s]} but in "
                    f"hash_table[{p}]")
    bucket = int(f["slot_key"][s, 0]) & (cfg.num_buckets - 1)
    if p // cfg.hash_ways != bucket:
      errors.append(f"slot {s}: key bucket {bucket} but stored in bucket "
                    f"{p // cfg.hash_ways}")
  for s in np.nonzero(pub & (seen != 1))[0][:10]:
    errors.append(f"slot {s}: published but in the hash table {seen[s]} times")
  for s in np.nonzero(~pub & (f["slot_hash_pos"] != -1))[0][:10]:
    errors.append(f"slot {s}: unpublished with slot_hash_pos "
                  f"{f['slot_hash_pos'][s]}")
  keys = [tuple(k) for k in f["slot_key"][pub].tolist()]
  if len(set(keys)) != len(keys):
    errors.append("two published slots share a key")
  parents = f["slot_parent"][pub]
  if anchor_num_slots is not None:
    if ((parents < 0) | (parents >= anchor_num_slots)).any():
      errors.append(f"published slot with an invalid anchor: {parents}")
  elif ((parents < -1) | (parents >= ns)).any():
    errors.append(f"published slot with an invalid parent: {parents}")
  else:
    depths = f["slot_depth"][pub]
    if ((depths < 0) | (depths >= mp) | ((parents < 0) != (depths == 0))).any():
      errors.append(f"published slot with an invalid depth: {depths} "
                    f"(parents {parents})")
  if f["num_lookups"] < 0 or f["num_hits"] < 0 or (
      f["num_hits"] > f["num_lookups"]):
    errors.append(f"counters: lookups {f['num_lookups']}, hits {f['num_hits']}")
  if (f["slot_refcount"] < 0).any():
    errors.append("negative refcount")
  if errors:
    raise CacheInvariantError("\n".join(errors))
