"""Slow, loop-based model of the per-window-group cache: the test oracle.

The rules of `cache/hybrid.py`, written from their definitions with plain
Python lists, on top of one `reference.ReferenceCache` per window group (the
flat model, itself checked slot for slot against `cache/alloc.py`):

  * Sequences are the same in every group; admission is all or nothing
    across the groups, in batch order: request `r` is admitted iff it is
    valid and fits every group together with the requests admitted before it
    (a group's fit counts its new slots plus the cached blocks its admitted
    requests reuse, as in the flat model); with `head_of_line`, no request
    after the first valid refused one is admitted.
  * Reuse: group 0 matches a token-verified chain from block 0; a sliding
    group's block matches iff it holds the same tokens and scope and was
    published with group 0's matched slot of that block (at that slot's
    current generation) as its parent. A prompt reuses the largest `n`
    such that group 0 matches `[0, n)` and every other group matches
    `[lo_g(n), n)`, `lo_g(n) = max(min(n * page_size, length -
    max_rewind_len) - window_left_g, 0) // page_size`; the blocks before
    `lo_g(n)` are not held (-1).
  * `extend` first releases, in every sliding group, the listed live
    sequences' blocks `b` with `(b + 1) * page_size <= num_computed -
    max_rewind_len - window_left` (LRU clock of the group), then grows.
  * `commit`: group 0 publishes as the flat model; another group publishes
    every held, unpublished full block whose group-0 block is published,
    with that slot and its generation (after group 0's commit) as parent,
    independently of the blocks before it.

Keys are exact (scope and all tokens up to the block end), so this describes
a collision-free hash; it assumes no hash bucket overflows
(`hash_ways >= ` every group's slots).
"""

from __future__ import annotations

import numpy as np

from .hybrid import HybridCacheConfig
from .reference import ReferenceCache, _Seq
from .window import FULL_ATTENTION


def _cdiv(a, b):
  return -(-a // b)


class ReferenceHybridCache:
  """Pure-Python per-window-group cache with the results of `cache.hybrid`."""

  def __init__(self, config: HybridCacheConfig):
    self.cfg = config
    self.groups = [ReferenceCache(c) for c in config.group_configs]
    self.windows = [g.window_left for g in config.groups]

  @property
  def seqs(self) -> dict[int, _Seq]:
    """Group 0's sequences (ids, lengths and scopes are the same in all)."""
    return self.groups[0].seqs

  def _sliding(self):
    return [gid for gid, w in enumerate(self.windows) if w != FULL_ATTENTION]

  # --- admission -----------------------------------------------------------
  def _admit(self, valid, needs, reused=None, *, evict=True,
             head_of_line=True):
    """`ok` per request, and the protected (reused) slots of each group."""
    G, n = len(self.groups), len(valid)
    budgets, cached = [], []
    for g in self.groups:
      free, evictable = g._supply()
      budgets.append(len(free) + (len(evictable) if evict else 0))
      cached.append(set(evictable) if evict else set())
    spent = [0] * G
    protected = [set() for _ in range(G)]
    ok, blocked = [], False
    for r in range(n):
      if not valid[r] or blocked:
        ok.append(False)
        continue
      grown = [protected[g] | ((set(reused[g][r]) if reused else set())
                               & cached[g]) for g in range(G)]
      fits = all(spent[g] + needs[g][r] + len(grown[g]) <= budgets[g]
                 for g in range(G))
      ok.append(fits)
      if fits:
        for g in range(G):
          spent[g] += needs[g][r]
          protected[g] = grown[g]
      elif head_of_line:
        blocked = True
    protected = [{s for r in range(n) if ok[r] for s in reused[g][r]}
                 if reused else set() for g in range(G)]
    return ok, protected

  # --- operations ----------------------------------------------------------
  def claim_batch(self, seq_ids, tokens, lengths, reuse_scope=None, *,
                  evict=True, head_of_line=True):
    """Dict `ok`, `num_reused_tokens`, `num_new_blocks` (a list of
    per-group counts per request), `num_missed_blocks`."""
    cfg, ps = self.cfg, self.cfg.page_size
    g0 = self.groups[0]
    tokens = np.asarray(tokens).tolist()
    n = len(tokens)
    max_len = len(tokens[0]) if n else 0
    nbt = min(max_len // ps, cfg.max_pages)
    scopes = [0] * n if reuse_scope is None else [int(x) for x in reuse_scope]
    ids, valid = g0._ids(seq_ids, want_live=False)
    lengths = [int(x) for x in lengths]
    valid = [v and 0 <= L <= min(max_len, cfg.max_seq_len)
             for v, L in zip(valid, lengths)]
    lengths = [L if v else 0 for v, L in zip(valid, lengths)]
    matchable = [(L - 1) // ps if L > 0 else 0 for L in lengths]
    reused, held = [], []  # held[r][g]: {block: slot} reused in group g
    for r in range(n):
      keys = g0._block_keys(tokens[r], scopes[r], nbt)
      blocks = [tuple(tokens[r][i * ps:(i + 1) * ps]) for i in range(nbt)]
      chain = []  # group 0: verified chain from block 0
      for i in range(min(matchable[r], nbt) if valid[r] else 0):
        c = g0._find(keys[i])
        prev = chain[-1] if chain else -1
        if (c < 0 or g0.tokens[c] != blocks[i] or g0.scope[c] != scopes[r]
            or g0.parent[c] != prev
            or (prev >= 0 and g0.parent_gen[c] != g0.gen[prev])):
          break
        chain.append(c)

      def match(gid, i):
        g = self.groups[gid]
        c = g._find(keys[i])
        if c < 0 or i >= len(chain):
          return -1
        ok = (g.tokens[c] == blocks[i] and g.scope[c] == scopes[r]
              and g.parent[c] == chain[i]
              and g.parent_gen[c] == g0.gen[chain[i]])
        return c if ok else -1

      def floor(gid, num):
        first_query = min(num * ps, lengths[r] - cfg.max_rewind_len)
        return max(first_query - self.windows[gid], 0) // ps

      num = len(chain)
      while num > 0 and not all(
          match(gid, i) >= 0 for gid in range(1, len(self.groups))
          for i in range(floor(gid, num), num)):
        num -= 1
      reused.append(num)
      per_group = [{i: chain[i] for i in range(num)}]
      for gid in range(1, len(self.groups)):
        per_group.append({i: match(gid, i)
                          for i in range(floor(gid, num), num)})
      held.append(per_group)
    plans = [[g._plan(reused[r] * ps, lengths[r]) for r in range(n)]
             for g in self.groups]
    needs = [[(_cdiv(lengths[r], ps) - reused[r] - plans[gid][r][1]
               + plans[gid][r][2]) if valid[r] else 0 for r in range(n)]
             for gid in range(len(self.groups))]
    reuse_sets = [[list(held[r][gid].values()) for r in range(n)]
                  for gid in range(len(self.groups))]
    ok, protected = self._admit(valid, needs, reuse_sets, evict=evict,
                                head_of_line=head_of_line)
    for gid, g in enumerate(self.groups):
      taken = g._take(sum(needs[gid][r] for r in range(n) if ok[r]),
                      protected[gid])
      off = 0
      for r in range(n):
        if not ok[r]:
          continue
        new = taken[off:off + needs[gid][r]]
        off += needs[gid][r]
        first, num_scratch, num_scratch_slots = plans[gid][r]
        scratch, new = new[:num_scratch_slots], new[num_scratch_slots:]
        mine = held[r][gid]
        slots = ([mine.get(i, -1) for i in range(reused[r])]
                 + [-1] * num_scratch + new)
        for s in scratch + list(mine.values()) + new:
          g.refcount[s] += 1
        g.seqs[ids[r]] = _Seq(slots, lengths[r], scopes[r], scratch,
                              first if num_scratch else 0, num_scratch)
        g.num_lookups += matchable[r]
        g.num_hits += reused[r]
    return dict(
        ok=ok,
        num_reused_tokens=[reused[r] * ps if ok[r] else 0 for r in range(n)],
        num_new_blocks=[[needs[gid][r] if ok[r] else 0
                         for gid in range(len(self.groups))]
                        for r in range(n)],
        num_missed_blocks=[matchable[r] - reused[r] if ok[r] else 0
                           for r in range(n)])

  def _drop(self, gid, ids, valid, done):
    """Releases group `gid`'s blocks no query at or after `done -
    max_rewind_len` can see."""
    g, ps = self.groups[gid], self.cfg.page_size
    for sid, v, d in zip(ids, valid, done):
      if not v:
        continue
      cut = max(d - self.cfg.max_rewind_len - self.windows[gid], 0) // ps
      seq = g.seqs[sid]
      for b in range(min(cut, len(seq.slots))):
        s = seq.slots[b]
        if s >= 0:
          g.refcount[s] -= 1
          g.last_use[s] = g.clock
          seq.slots[b] = -1
    g.clock += 1

  def extend(self, seq_ids, num_new_tokens, num_computed=None, *,
             evict=True, head_of_line=True):
    """Dict `ok`, `num_new_blocks` (per-group counts per request)."""
    cfg, ps = self.cfg, self.cfg.page_size
    g0 = self.groups[0]
    ids, valid = g0._ids(seq_ids, want_live=True)
    add = [int(x) for x in num_new_tokens]
    n = len(ids)
    length = [g0.seqs[i].length if v else 0 for i, v in zip(ids, valid)]
    done = (length if num_computed is None else
            [min(max(int(c), 0), L) for c, L in zip(num_computed, length)])
    for gid in self._sliding():
      self._drop(gid, ids, valid, done)
    for g in self.groups:
      for i, v in zip(ids, valid):
        if v:  # the previous step is over
          g._retire(g.seqs[i])
    valid = [v and 0 <= a <= cfg.max_seq_len - L
             for v, a, L in zip(valid, add, length)]
    plans = [[g._plan(length[r], length[r] + add[r]) for r in range(n)]
             for g in self.groups]
    needs = [[(_cdiv(length[r] + add[r], ps) - _cdiv(length[r], ps)
               - plans[gid][r][1] + plans[gid][r][2]) if valid[r] else 0
              for r in range(n)] for gid in range(len(self.groups))]
    ok, _ = self._admit(valid, needs, evict=evict, head_of_line=head_of_line)
    for gid, g in enumerate(self.groups):
      taken = g._take(sum(needs[gid][r] for r in range(n) if ok[r]))
      off = 0
      for r in range(n):
        if not ok[r]:
          continue
        seq = g.seqs[ids[r]]
        new = taken[off:off + needs[gid][r]]
        off += needs[gid][r]
        first, num_scratch, num_scratch_slots = plans[gid][r]
        scratch, new = new[:num_scratch_slots], new[num_scratch_slots:]
        for s in scratch + new:
          g.refcount[s] += 1
        seq.slots = seq.slots + [-1] * num_scratch + new
        seq.length += add[r]
        seq.scratch, seq.scratch_count = scratch, num_scratch
        seq.scratch_first = first if num_scratch else 0
    return dict(ok=ok, num_new_blocks=[
        [needs[gid][r] if ok[r] else 0 for gid in range(len(self.groups))]
        for r in range(n)])

  def commit(self, seq_ids, tokens, lengths):
    cfg, ps = self.cfg, self.cfg.page_size
    g0 = self.groups[0]
    g0.commit(seq_ids, tokens, lengths)
    tokens = np.asarray(tokens).tolist()
    max_len = len(tokens[0]) if tokens else 0
    nbt = min(max_len // ps, cfg.max_pages)
    if nbt == 0:
      return
    ids, valid = g0._ids(seq_ids, want_live=True)
    lengths = [int(x) for x in lengths]
    for gid in range(1, len(self.groups)):
      g = self.groups[gid]
      seen_keys, seen_slots, plans = set(), set(), []
      for r in range(len(ids)):
        if not (valid[r] and lengths[r] >= 0):
          continue
        seq, anchors = g.seqs[ids[r]], g0.seqs[ids[r]].slots
        num_full = min(lengths[r], seq.length, max_len) // ps
        keys = g._block_keys(tokens[r], seq.scope, num_full)
        for i in range(num_full):
          s, a = seq.slots[i], anchors[i]
          if s < 0 or g.published[s] or a < 0 or not g0.published[a]:
            continue
          block = tuple(tokens[r][i * ps:(i + 1) * ps])
          existing = g._find(keys[i])
          identical = (existing >= 0 and g.tokens[existing] == block
                       and g.scope[existing] == seq.scope
                       and g.parent[existing] == a
                       and g.parent_gen[existing] == g0.gen[a])
          dup = keys[i] in seen_keys or s in seen_slots
          seen_keys.add(keys[i])
          seen_slots.add(s)
          if not identical and not dup:
            plans.append((s, keys[i], block, seq.scope, a, g0.gen[a],
                          existing, i))
      for s, key, block, scope, a, gen, existing, i in plans:
        if existing >= 0:
          g._unpublish(existing)
        g.published[s] = True
        g.key[s] = key
        g.index[key] = s
        g.tokens[s] = block
        g.scope[s] = scope
        g.parent[s] = a
        g.parent_gen[s] = gen
        g.gen[s] += 1
        g.depth[s] = i

  def release(self, seq_ids):
    for g in self.groups:
      g.release(seq_ids)

  def finish_step(self, seq_ids):
    for g in self.groups:
      g.finish_step(seq_ids)

  def fork(self, parent_ids, child_ids, *, head_of_line=True):
    """Dict `ok`, `copies`: per request None or a list of `(group, src_slot,
    dst_slot)`, one per group (the partial last block)."""
    ps = self.cfg.page_size
    pids, cids, valid, need = self.groups[0]._fork_requests(parent_ids,
                                                            child_ids)
    n = len(pids)
    ok, _ = self._admit(valid, [need] * len(self.groups),
                        head_of_line=head_of_line)
    copies = [None] * n
    for gid, g in enumerate(self.groups):
      taken = g._take(sum(need[r] for r in range(n) if ok[r]))
      off = 0
      for r in range(n):
        if not ok[r]:
          continue
        par = g.seqs[pids[r]]
        nf = par.length // ps
        slots = par.slots[:nf]
        if need[r]:
          copies[r] = (copies[r] or []) + [(gid, par.slots[nf], taken[off])]
          slots = slots + [taken[off]]
          off += 1
        for s in slots:
          if s >= 0:
            g.refcount[s] += 1
        g.seqs[cids[r]] = _Seq(list(slots), par.length, par.scope)
    return dict(ok=ok, copies=copies)

  # --- views ---------------------------------------------------------------
  def page_table(self, seq_ids, layer, split=True):
    """Model layer `layer`'s table in absolute pool pages."""
    gid = self.cfg.layer_group[layer]
    base = self.cfg.group_page_base[gid]
    t = self.groups[gid].page_table(seq_ids, self.cfg.layer_index[layer],
                                    split=split)
    step = base if split else base // 2
    return np.where(t >= 0, t + step, -1).astype(np.int32)

  def stats(self):
    """Per-group slot counters (lists) and group 0's sequence counters."""
    per = [g.stats() for g in self.groups]
    out = {k: [p[k] for p in per]
           for k in ("num_free", "num_used", "num_cached", "num_published",
                     "num_scratch")}
    for k in ("num_live_seqs", "num_lookups", "num_hits"):
      out[k] = per[0][k]
    return out
