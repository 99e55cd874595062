"""Slow, loop-based model of the cache semantics: the test oracle (never jitted).

Mirrors the device ops (`cache/alloc.py`, `publish.py`, `forking.py`) rule
by rule with plain Python lists and dicts, so that a random sequence of
operations can be run through both and compared slot for slot. Where the device code uses a 64-bit chained hash, this model
uses an exact key (a nested tuple of the scope and all tokens up to the end
of the block), so it
describes the behaviour of a collision-free hash. It assumes no hash bucket
overflows (`hash_ways >= num_slots` guarantees that).

SWA scratch is modelled from its definition, not from
`window.swa_scratch_plan`: a new block of a step is scratch when every one of
its tokens is older than `P - window` for the first query `P = capacity -
max_rewind_len` that may still come (staleness only grows with the query
position), with the widest window of an all-SWA model.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from .state import CacheConfig


@dataclasses.dataclass
class _Seq:
  slots: list[int]       # slot per block, -1 for scratch blocks
  length: int
  scope: int
  scratch: list[int] = dataclasses.field(default_factory=list)  # step's slots
  scratch_first: int = 0  # first scratch block of the running step
  scratch_count: int = 0  # scratch blocks of the running step


class ReferenceCache:
  """Pure-Python cache with the same operations and results as `cache.alloc`."""

  def __init__(self, config: CacheConfig):
    if config.hash_ways < config.num_slots:
      raise ValueError(
          "ReferenceCache models no bucket overflow: expected hash_ways >= "
          f"num_slots={config.num_slots}, got {config.hash_ways}")
    self.cfg = config
    n = config.num_slots
    self.refcount = [0] * n
    self.last_use = [0] * n
    self.published = [False] * n
    self.key: list[tuple | None] = [None] * n
    self.tokens: list[tuple | None] = [None] * n
    self.scope = [0] * n
    self.parent = [-1] * n
    self.parent_gen = [0] * n
    self.gen = [0] * n
    self.depth = [0] * n  # block index in its sequence at publication
    self.seqs: dict[int, _Seq] = {}
    self.index: dict[tuple, int] = {}  # key -> published slot (keys are unique)
    self.clock = 0
    self.num_lookups = 0
    self.num_hits = 0

  def copy(self) -> "ReferenceCache":
    """An independent copy (keys and tokens are immutable tuples: shared)."""
    out = copy.copy(self)
    for name in ("refcount", "last_use", "published", "key", "tokens", "scope",
                 "parent", "parent_gen", "gen", "depth"):
      setattr(out, name, list(getattr(self, name)))
    out.seqs = {k: _Seq(list(v.slots), v.length, v.scope, list(v.scratch),
                        v.scratch_first, v.scratch_count)
                for k, v in self.seqs.items()}
    out.index = dict(self.index)
    return out

  # --- helpers -------------------------------------------------------------
  def _ids(self, ids, want_live, dedupe=False):
    """Valid ids: in range, right liveness, listed once (with `dedupe`: the
    first occurrence of an id listed several times)."""
    ids = [int(x) for x in ids]
    in_range = [0 <= x < self.cfg.max_seqs for x in ids]
    out = []
    for r, (x, ok) in enumerate(zip(ids, in_range)):
      count = sum(1 for y, o in zip(ids, in_range) if o and y == x)
      unique = (x not in ids[:r]) if dedupe else count == 1
      out.append(ok and unique and ((x in self.seqs) == want_live))
    return ids, out

  def _find(self, key):
    return self.index.get(key, -1)

  def _supply(self, protected=()):
    free = [s for s in range(self.cfg.num_slots)
            if self.refcount[s] == 0 and not self.published[s]]
    evictable = sorted(
        (s for s in range(self.cfg.num_slots)
         if self.refcount[s] == 0 and self.published[s] and s not in protected),
        key=lambda s: (self.last_use[s], -self.depth[s], s))
    return free, evictable

  def _unpublish(self, s):
    self.published[s] = False
    if self.index.get(self.key[s]) == s:
      del self.index[self.key[s]]

  def _admission(self, valid, need, head_of_line=True, evict=True,
                 reused=None):
    """All or nothing, in batch order, from the definition (`cache/alloc.py`,
    "Admission"): a set A of requests fits iff its new slots plus the cached
    blocks its members reuse (which stop being evictable) fit in the free +
    cached slots (free only without eviction, where reuse costs nothing).
    Request r is admitted iff it is valid and A + {r} fits, A the requests
    admitted before it; with `head_of_line`, no request after the first
    valid refused one is admitted. Returns (ok, protected slots)."""
    free, cached = self._supply()
    budget = len(free) + (len(cached) if evict else 0)
    cached = set(cached) if evict else set()
    ok, spent, protected, blocked = [], 0, set(), False
    for r in range(len(need)):
      if not valid[r] or blocked:
        ok.append(False)
        continue
      mine = set(reused[r]) if reused is not None else set()
      grown = protected | (mine & cached)
      fits = spent + need[r] + len(grown) <= budget
      ok.append(fits)
      if fits:
        spent += need[r]
        protected = grown
      elif head_of_line:
        blocked = True
    admitted = {s for r in range(len(need)) if ok[r] and reused is not None
                for s in reused[r]}
    return ok, admitted

  def _admit(self, valid, need, head_of_line=True, evict=True):
    """Admission without reuse; returns (ok, slots taken for the admitted
    requests, in order)."""
    ok, _ = self._admission(valid, need, head_of_line, evict)
    return ok, self._take(sum(need[r] for r in range(len(need)) if ok[r]))

  def _take(self, count, protected=()):
    free, evictable = self._supply(protected)
    order = free + evictable
    assert count <= len(order)
    taken = order[:count]
    for s in taken:
      if self.published[s]:
        self._unpublish(s)
    return taken

  def _plan(self, history, capacity):
    """(first new block, scratch blocks, scratch slots) of a step."""
    cfg, ps = self.cfg, self.cfg.page_size
    first = -(-history // ps)
    end = max(first, -(-capacity // ps))
    if not cfg.swa_scratch_active:
      return first, 0, 0
    window = max(cfg.layer_windows)
    query = capacity - cfg.max_rewind_len  # the first query still to come
    scratch = [b for b in range(first, end)
               if all(t < query - window for t in range(b * ps, (b + 1) * ps))]
    assert scratch == list(range(first, first + len(scratch)))
    return first, len(scratch), -(-len(scratch) // cfg.num_layers)

  def _retire(self, seq):
    for s in seq.scratch:
      self.refcount[s] -= 1
    seq.scratch, seq.scratch_first, seq.scratch_count = [], 0, 0

  def _block_keys(self, toks, scope, num_blocks):
    """Exact chained keys: key_i = (key_{i-1}, tokens of block i), key_-1 =
    scope. Equal keys <=> equal scope and equal tokens up to the block end."""
    ps = self.cfg.page_size
    keys, key = [], (scope,)
    for i in range(num_blocks):
      key = (key, tuple(toks[i * ps:(i + 1) * ps]))
      keys.append(key)
    return keys

  # --- operations ----------------------------------------------------------
  def claim_batch(self, seq_ids, tokens, lengths, reuse_scope=None, *,
                  evict=True, head_of_line=True):
    """Returns lists ok, num_reused_tokens, num_new_blocks, num_missed_blocks."""
    cfg, ps = self.cfg, self.cfg.page_size
    tokens = np.asarray(tokens).tolist()
    n = len(tokens)
    max_len = len(tokens[0]) if n else 0
    scopes = [0] * n if reuse_scope is None else [int(x) for x in reuse_scope]
    ids, valid = self._ids(seq_ids, want_live=False)
    lengths = [int(x) for x in lengths]
    valid = [v and 0 <= L <= min(max_len, cfg.max_seq_len)
             for v, L in zip(valid, lengths)]
    matched: list[list[int]] = []
    for r in range(n):
      run = []
      if valid[r]:
        L = lengths[r]
        matchable = (L - 1) // ps if L > 0 else 0
        prev = -1
        keys = self._block_keys(tokens[r], scopes[r], matchable)
        for i in range(matchable):
          c = self._find(keys[i])
          if c < 0 or self.tokens[c] != tuple(tokens[r][i * ps:(i + 1) * ps]):
            break
          if self.scope[c] != scopes[r] or self.parent[c] != prev:
            break
          if prev >= 0 and self.parent_gen[c] != self.gen[prev]:
            break
          run.append(c)
          prev = c
      matched.append(run)
    plans = [self._plan(len(matched[r]) * ps, lengths[r]) if valid[r] else None
             for r in range(n)]
    need = [(-(-lengths[r] // ps) - len(matched[r]) - plans[r][1]
             + plans[r][2]) if valid[r] else 0
            for r in range(n)]
    ok, protected = self._admission(valid, need, head_of_line, evict, matched)
    total = sum(need[r] for r in range(n) if ok[r])
    taken = self._take(total, protected)
    res = dict(ok=ok, num_reused_tokens=[0] * n, num_new_blocks=[0] * n,
               num_missed_blocks=[0] * n)
    off = 0
    for r in range(n):
      if not ok[r]:
        continue
      L = lengths[r]
      new = taken[off:off + need[r]]
      off += need[r]
      first, num_scratch, num_scratch_slots = plans[r]
      scratch, new = new[:num_scratch_slots], new[num_scratch_slots:]
      slots = matched[r] + [-1] * num_scratch + new
      for s in scratch + matched[r] + new:
        self.refcount[s] += 1
      self.seqs[ids[r]] = _Seq(slots, L, scopes[r], scratch,
                               first if num_scratch else 0, num_scratch)
      matchable = (L - 1) // ps if L > 0 else 0
      self.num_lookups += matchable
      self.num_hits += len(matched[r])
      res["num_reused_tokens"][r] = len(matched[r]) * ps
      res["num_new_blocks"][r] = need[r]
      res["num_missed_blocks"][r] = matchable - len(matched[r])
    return res

  def extend(self, seq_ids, num_new_tokens, *, evict=True, head_of_line=True):
    cfg, ps = self.cfg, self.cfg.page_size
    ids, valid = self._ids(seq_ids, want_live=True)
    add = [int(x) for x in num_new_tokens]
    n = len(ids)
    for i, v in zip(ids, valid):
      if v:  # the previous step is over
        self._retire(self.seqs[i])
    valid = [v and 0 <= a <= cfg.max_seq_len - self.seqs[i].length
             for v, i, a in zip(valid, ids, add)]
    plans = [self._plan(self.seqs[ids[r]].length,
                        self.seqs[ids[r]].length + add[r]) if valid[r] else None
             for r in range(n)]
    need = [(-(-(self.seqs[ids[r]].length + add[r]) // ps)
             - -(-self.seqs[ids[r]].length // ps) - plans[r][1]
             + plans[r][2]) if valid[r] else 0
            for r in range(n)]
    ok, taken = self._admit(valid, need, head_of_line, evict)
    off = 0
    for r in range(n):
      if ok[r]:
        seq = self.seqs[ids[r]]
        new = taken[off:off + need[r]]
        off += need[r]
        first, num_scratch, num_scratch_slots = plans[r]
        scratch, new = new[:num_scratch_slots], new[num_scratch_slots:]
        for s in scratch + new:
          self.refcount[s] += 1
        seq.slots = seq.slots + [-1] * num_scratch + new
        seq.length += add[r]
        seq.scratch, seq.scratch_count = scratch, num_scratch
        seq.scratch_first = first if num_scratch else 0
    return dict(ok=ok, num_new_blocks=[need[r] if ok[r] else 0
                                       for r in range(n)])

  def commit(self, seq_ids, tokens, lengths):
    cfg, ps = self.cfg, self.cfg.page_size
    tokens = np.asarray(tokens).tolist()
    max_len = len(tokens[0]) if tokens else 0
    nbt = min(max_len // ps, cfg.max_pages)
    if nbt == 0:
      return
    ids, valid = self._ids(seq_ids, want_live=True)
    lengths = [int(x) for x in lengths]
    seen_keys, seen_slots = set(), set()
    plans = []
    for r in range(len(ids)):
      if not (valid[r] and lengths[r] >= 0):
        continue
      seq = self.seqs[ids[r]]
      num_full = min(lengths[r], seq.length, max_len) // ps
      own = seq.slots
      keys = self._block_keys(tokens[r], seq.scope, num_full)
      tok = lambda i, r=r: tuple(tokens[r][i * ps:(i + 1) * ps])  # noqa: E731
      # The served run: own published slots and twins (published slots with
      # the block's tokens and scope), each the child of the slot serving
      # the block before at its generation.
      served, serving = 0, -1
      while served < num_full and own[served] >= 0:
        s, e = own[served], self._find(keys[served])
        child = lambda x, p=serving: (  # noqa: E731
            self.parent[x] == p
            and (p < 0 or self.parent_gen[x] == self.gen[p]))
        if self.published[s] and child(s):
          serving = s
        elif (e >= 0 and self.tokens[e] == tok(served)
              and self.scope[e] == seq.scope and child(e)):
          serving = e
        else:
          break
        served += 1
      # Scratch blocks (-1) are never considered: they stop the run. Own
      # published slots after the run are stale: published again.
      considered = [i for i in range(served, num_full) if own[i] >= 0]
      ok_block = {}
      for i in considered:
        key = keys[i]
        existing = self._find(key)
        # The first block after the served run is the child of its last
        # serving slot; a parent published in this call gets generation + 1.
        parent = serving if i == served else own[i - 1]
        parent_gen = (self.gen[parent] + (1 if (i - 1) in considered else 0)
                      if parent >= 0 else 0)
        dup = key in seen_keys or own[i] in seen_slots
        seen_keys.add(key)
        seen_slots.add(own[i])
        ok_block[i] = (not dup, key, existing, parent, parent_gen, tok(i),
                       seq.scope, own[i])
      for i in range(served, num_full):
        if i not in ok_block or not ok_block[i][0]:
          break
        plans.append((i,) + ok_block[i][1:])
    for i, key, existing, parent, parent_gen, tok, scope, s in plans:
      if existing >= 0:
        self._unpublish(existing)
      self.published[s] = True
      self.key[s] = key
      self.index[key] = s
      self.tokens[s] = tok
      self.scope[s] = scope
      self.parent[s] = parent
      self.parent_gen[s] = parent_gen
      self.gen[s] += 1
      self.depth[s] = i

  def release(self, seq_ids):
    ids, valid = self._ids(seq_ids, want_live=True, dedupe=True)
    for x, v in zip(ids, valid):
      if v:
        seq = self.seqs.pop(x)
        self._retire(seq)
        for s in seq.slots:
          if s >= 0:
            self.refcount[s] -= 1
            self.last_use[s] = self.clock
    self.clock += 1

  def _fork_requests(self, parent_ids, child_ids):
    """`(parent ids, child ids, valid, need)` of a fork batch: a live parent,
    a dead child listed once (so no parent of the batch); one new slot for a
    partial last block."""
    cfg, ps = self.cfg, self.cfg.page_size
    pids = [int(x) for x in parent_ids]
    cids, c_ok = self._ids(child_ids, want_live=False)
    p_ok = [0 <= p < cfg.max_seqs and p in self.seqs for p in pids]
    valid = [po and co for po, co in zip(p_ok, c_ok)]
    need = [int(valid[r] and self.seqs[pids[r]].length % ps != 0)
            for r in range(len(pids))]
    return pids, cids, valid, need

  def fork(self, parent_ids, child_ids, *, head_of_line=True):
    """Returns dict ok, copies ((src_slot, dst_slot) or None per request)."""
    ps = self.cfg.page_size
    pids, cids, valid, need = self._fork_requests(parent_ids, child_ids)
    n = len(pids)
    ok, taken = self._admit(valid, need, head_of_line)
    copies = [None] * n
    off = 0
    for r in range(n):
      if not ok[r]:
        continue
      par = self.seqs[pids[r]]
      nf = par.length // ps
      slots = par.slots[:nf]
      if need[r]:
        new = taken[off]
        off += 1
        copies[r] = (par.slots[nf], new)
        slots = slots + [new]
      for s in slots:
        if s >= 0:
          self.refcount[s] += 1
      self.seqs[cids[r]] = _Seq(list(slots), par.length, par.scope)
    return dict(ok=ok, copies=copies)

  def finish_step(self, seq_ids):
    ids, valid = self._ids(seq_ids, want_live=True, dedupe=True)
    for x, v in zip(ids, valid):
      if v:
        self._retire(self.seqs[x])

  # --- views ---------------------------------------------------------------
  def seq_row(self, sid) -> list[int]:
    slots = self.seqs[sid].slots if sid in self.seqs else []
    return slots + [-1] * (self.cfg.max_pages - len(slots))

  def scratch_row(self, sid) -> tuple[list[int], int, int]:
    """(scratch slots padded with -1, first scratch block, scratch blocks)."""
    seq = self.seqs.get(sid, _Seq([], 0, 0))
    width = self.cfg.max_scratch_slots
    return (seq.scratch + [-1] * (width - len(seq.scratch)),
            seq.scratch_first, seq.scratch_count)

  def page_table(self, seq_ids, layer, split=True, mode="per_layer"):
    nl = self.cfg.num_layers
    out = []
    for sid in seq_ids:
      sid = int(sid)
      row = self.seq_row(sid) if 0 <= sid < self.cfg.max_seqs else (
          [-1] * self.cfg.max_pages)
      if str(getattr(mode, "value", mode)) == "shared":
        out.append(row)
        continue
      shared = [s * nl + layer if s >= 0 else -1 for s in row]
      if sid in self.seqs:  # the running step's scratch blocks: sub-pages
        seq = self.seqs[sid]
        for i in range(seq.scratch_count):
          sub = (i % nl + layer) % nl
          shared[seq.scratch_first + i] = seq.scratch[i // nl] * nl + sub
      if split:
        out.append([[2 * q if q >= 0 else -1 for q in shared],
                    [2 * q + 1 if q >= 0 else -1 for q in shared]])
      else:
        out.append(shared)
    return np.asarray(out, np.int32)

  def stats(self):
    n = self.cfg.num_slots
    free = sum(1 for s in range(n)
               if self.refcount[s] == 0 and not self.published[s])
    cached = sum(1 for s in range(n)
                 if self.refcount[s] == 0 and self.published[s])
    return dict(num_free=free, num_cached=cached,
                num_used=sum(1 for s in range(n) if self.refcount[s] > 0),
                num_published=sum(self.published),
                num_scratch=sum(len(s.scratch) for s in self.seqs.values()),
                num_live_seqs=len(self.seqs), num_lookups=self.num_lookups,
                num_hits=self.num_hits)
