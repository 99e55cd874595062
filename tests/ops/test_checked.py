"""Checked mode (`pkvattn.checked`, `check=True`): contracts become errors.

Every op is checked two ways: eagerly (the op raises `checkify.JaxRuntimeError`,
a ValueError, before doing any work) and staged inside a caller's
`jax.jit(checkify.checkify(f))`, where one compiled program reports the
violation of each bad input and nothing for fresh random valid inputs, whose
outputs equal the unchecked xla results. Both impls; the Pallas kernels run
in interpret mode on tiny shapes, compiled once per op. The unchecked path
must not contain any of it (`test_unchecked_path_adds_nothing`).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import attention_utils as au
import pkvattn
from pkvattn import cache

H, KV, D, PS = 2, 1, 64, 8
NUM_PAGES, MAX_PAGES, B, T = 8, 3, 2, 8  # T > B: the prefill kernel runs
CAP = MAX_PAGES * PS                      # 24 tokens per sequence
IMPLS = ["xla", "pallas"]


def _i32(x):
  return jnp.asarray(np.asarray(x, np.int32))


def _pool(seed=0):
  rng = np.random.default_rng(seed)
  k, v = rng.standard_normal((2, NUM_PAGES, PS, KV, D)).astype(np.float32)
  return jnp.asarray(k), jnp.asarray(v)


def _table(rng, kv_lens, first_query=None, window_left=-1):
  """Distinct random pages for the visible blocks, -1 elsewhere."""
  table = np.full((len(kv_lens), MAX_PAGES), -1, np.int32)
  pages = rng.permutation(NUM_PAGES)
  used = 0
  for b, n in enumerate(kv_lens):
    lo = 0
    if window_left >= 0 and first_query is not None:
      lo = max(first_query[b] - window_left, 0) // PS
    for i in range(lo, -(-n // PS)):
      table[b, i] = pages[used]
      used += 1
  return table


def _decode_case(rng, window_left=-1):
  kv_lens = rng.integers(0, CAP + 1, B)
  kv_lens[rng.integers(B)] = CAP
  table = _table(rng, kv_lens, kv_lens - 1, window_left)
  return rng.standard_normal((B, H, D)).astype(np.float32), table, kv_lens


def _prefill_case(rng, window_left=-1):
  q_lens = rng.multinomial(int(rng.integers(B, T + 1)), [1 / B] * B)
  kv_lens = q_lens + rng.integers(0, CAP + 1 - q_lens)
  q_indptr = np.r_[0, np.cumsum(q_lens)]
  table = _table(rng, kv_lens, kv_lens - q_lens, window_left)
  return (rng.standard_normal((T, H, D)).astype(np.float32), table, q_indptr,
          kv_lens)


def _decode(q, table, kv_lens, *, impl, window_left=-1, check=None):
  return pkvattn.paged_decode(q, _pool(), table, kv_lens, impl=impl,
                              window_left=window_left, check=check)


def _prefill(q, table, q_indptr, kv_lens, *, impl, window_left=-1, check=None):
  return pkvattn.paged_prefill(q, _pool(), table, q_indptr, kv_lens, impl=impl,
                               window_left=window_left, check=check)


def _staged(fn, **kw):
  """`jit(checkify(fn))`, traced in checked mode (the flag is read at trace
  time and keys the jit cache, so calls must stay inside the block)."""
  return jax.jit(checkify.checkify(functools.partial(fn, **kw)))


def _decode_bad_inputs(q, table, kv_lens):
  """(name, args, message regex) for every decode clause."""
  b = int(np.argmax(kv_lens))  # kv_lens[b] == CAP: every block visible
  out = []
  for value in (-1, NUM_PAGES):
    t = table.copy()
    t[b, MAX_PAGES - 1] = value
    out.append((f"page {value}", (q, t, kv_lens),
                rf"page_table\[{b}, {MAX_PAGES - 1}\] = {value} for a visible"))
  for value in (CAP + 1, -3):
    lens = kv_lens.copy()
    lens[1] = value
    out.append((f"kv_len {value}", (q, table, lens),
                rf"kv_lens\[1\] = {value}, expected in \[0, max_pages"))
  return out


def _prefill_bad_inputs(q, table, q_indptr, kv_lens):
  bad = []
  ptr = q_indptr.copy()
  ptr[0] = 1
  bad.append(("indptr[0]", (q, table, ptr, kv_lens), r"q_indptr\[0\] = 1"))
  ptr = q_indptr.copy()
  ptr[1] = ptr[2] + 1
  bad.append(("decreasing", (q, table, ptr, np.maximum(kv_lens, ptr[1])),
              r"q_indptr: decreasing at q_indptr\[1\]"))
  ptr = q_indptr.copy()
  ptr[-1] = T + 1
  bad.append(("past num_tokens", (q, table, ptr, np.full(B, CAP)),
              rf"q_indptr\[-1\] = {T + 1} > num_tokens = {T}"))
  q_len = np.diff(q_indptr)
  b = int(np.argmax(q_len))
  lens = kv_lens.copy()
  lens[b] = q_len[b] - 1
  bad.append(("kv_len < q_len", (q, table, q_indptr, lens),
              rf"kv_lens\[{b}\] = {q_len[b] - 1} < q_len = {q_len[b]}"))
  lens = kv_lens.copy()
  lens[b] = CAP + 2
  bad.append(("kv_len > cap", (q, table, q_indptr, lens),
              rf"kv_lens\[{b}\] = {CAP + 2}, expected"))
  t = table.copy()
  last = (kv_lens[b] - 1) // PS
  t[b, last] = -1
  bad.append(("page -1", (q, t, q_indptr, kv_lens),
              rf"page_table\[{b}, {last}\] = -1 for a visible block"))
  return bad


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_contract(impl, rng):
  with pkvattn.checked():
    staged = _staged(_decode, impl=impl)
    for _ in range(3):  # fresh valid inputs: no error, unchanged results
      q, table, kv_lens = _decode_case(rng)
      err, out = staged(q, table, kv_lens)
      assert err.get() is None, (table, kv_lens)
      expected = _decode(q, table, kv_lens, impl="xla", check=False)
      np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    for name, args, msg in _decode_bad_inputs(q, table, kv_lens):
      err, out = staged(*args)
      assert err.get() is not None and re.search(msg, err.get()), (
          name, err.get())
      # The kernel did not run on out-of-range ids (on a GPU it would read
      # outside the pools): the staged call's output is NaN.
      assert np.isnan(np.asarray(out)).all(), name
      with pytest.raises(checkify.JaxRuntimeError, match=msg):
        _decode(*args, impl=impl)
  # Outside the block the same jitted function is traced again, unchecked.
  for name, args, msg in _decode_bad_inputs(q, table, kv_lens)[:1]:
    err, _ = staged(*args)
    assert err.get() is None
    with pytest.raises(checkify.JaxRuntimeError, match=msg):
      _decode(*args, impl=impl, check=True)   # per call, no block needed


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_contract(impl, rng):
  with pkvattn.checked():
    staged = _staged(_prefill, impl=impl)
    for _ in range(3):
      q, table, q_indptr, kv_lens = _prefill_case(rng)
      err, out = staged(q, table, q_indptr, kv_lens)
      assert err.get() is None, (table, q_indptr, kv_lens)
      expected = _prefill(q, table, q_indptr, kv_lens, impl="xla", check=False)
      np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    for name, args, msg in _prefill_bad_inputs(q, table, q_indptr, kv_lens):
      err, out = staged(*args)
      assert err.get() is not None and re.search(msg, err.get()), (
          name, err.get())
      assert np.isnan(np.asarray(out)).all(), name
      with pytest.raises(checkify.JaxRuntimeError, match=msg):
        _prefill(*args, impl=impl)


def test_windowed_blocks_before_the_window_may_be_unmapped(rng):
  window_left = 9
  with pkvattn.checked():
    for _ in range(4):
      q, table, kv_lens = _decode_case(rng, window_left)
      _decode(q, table, kv_lens, impl="xla", window_left=window_left)
      q, table, q_indptr, kv_lens = _prefill_case(rng, window_left)
      _prefill(q, table, q_indptr, kv_lens, impl="xla",
               window_left=window_left)
    # The first visible block (the window start's) must be mapped.
    kv_lens = np.array([CAP, 0])
    table = _table(rng, kv_lens, kv_lens - 1, window_left)
    first = (CAP - 1 - window_left) // PS
    assert (table[0, :first] == -1).all() and table[0, first] >= 0
    table[0, first] = -1
    with pytest.raises(checkify.JaxRuntimeError,
                       match=rf"page_table\[0, {first}\] = -1"):
      _decode(q[:B], table, kv_lens, impl="xla", window_left=window_left)
    # Without the window every block is visible.
    with pytest.raises(checkify.JaxRuntimeError, match=r"page_table\[0, 0\]"):
      _decode(q[:B], _table(rng, kv_lens, kv_lens - 1, window_left), kv_lens,
              impl="xla")


def test_split_table_and_flashinfer_cache(rng):
  q, table, kv_lens = _decode_case(rng)
  kv_lens[0] = CAP
  table = _table(rng, kv_lens)
  k, v = _pool()
  pool = jnp.concatenate([k, v])                # K pages 0..7, V pages 8..15
  split = np.stack([table, np.where(table >= 0, table + NUM_PAGES, -1)], 1)
  fi = jnp.stack([k, v], axis=1)                # [NUM_PAGES, 2, ...]
  with pkvattn.checked():
    pkvattn.paged_decode(q, pool, split, kv_lens, impl="xla")
    pkvattn.paged_decode(q, fi, table, kv_lens, impl="xla")
    bad = split.copy()
    bad[0, 1, 2] = 2 * NUM_PAGES
    with pytest.raises(checkify.JaxRuntimeError,
                       match=rf"page_table\[0, 1, 2\] = {2 * NUM_PAGES} .*"
                       rf"num_pages={2 * NUM_PAGES}"):
      pkvattn.paged_decode(q, pool, bad, kv_lens, impl="xla")
    bad = table.copy()
    bad[0, 2] = NUM_PAGES   # a valid page of the reshaped pool, not of fi
    with pytest.raises(checkify.JaxRuntimeError,
                       match=rf"num_pages={NUM_PAGES}\)"):
      pkvattn.paged_decode(q, fi, bad, kv_lens, impl="xla")


def test_contract_edges_and_the_entries_its_messages_name(rng):
  """In contract: `window_left=0` (blocks before the current token's may be
  unmapped), a prefill row with no queries (it sees no block), an empty
  batch with `q_indptr = [0]`. Out of it, the message names the offending
  entry: a K row of a split table, the first decreasing `q_indptr` pair
  after an empty row, a split table's token past the first."""
  q = rng.standard_normal((B, H, D)).astype(np.float32)
  kv_lens = np.array([CAP, 5])
  table = np.array([[-1, -1, 1], [2, -1, -1]], np.int32)
  k, v = _pool()
  pool = jnp.concatenate([k, v])
  full = np.array([[0, 3, 1], [2, -1, -1]], np.int32)
  split = np.stack([full, np.where(full >= 0, full + NUM_PAGES, -1)], 1)
  qp = rng.standard_normal((T, H, D)).astype(np.float32)
  with pkvattn.checked():
    _decode(q, table, kv_lens, impl="xla", window_left=0)
    # Row 0 has no queries and no pages; row 1 queries its 5 keys.
    _prefill(qp, np.array([[-1, -1, -1], [2, -1, -1]], np.int32),
             np.array([0, 0, 3]), np.array([CAP, 5]), impl="xla")
    _prefill(qp, np.zeros((0, MAX_PAGES), np.int32), np.array([0]),
             np.zeros((0,), np.int32), impl="xla")
    with pytest.raises(checkify.JaxRuntimeError, match=r"q_indptr\[0\] = 1"):
      _prefill(qp, np.zeros((0, MAX_PAGES), np.int32), np.array([1]),
               np.zeros((0,), np.int32), impl="xla")
    bad = split.copy()
    bad[0, 0, 1] = 2 * NUM_PAGES
    with pytest.raises(checkify.JaxRuntimeError,
                       match=rf"page_table\[0, 0, 1\] = {2 * NUM_PAGES} "):
      pkvattn.paged_decode(q, pool, bad, kv_lens, impl="xla")
    three = np.array([[0, -1, -1], [1, -1, -1], [2, -1, -1]], np.int32)
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"decreasing at q_indptr\[2\] = 3 > "
                       r"q_indptr\[3\] = 2"):
      _prefill(qp, three, np.array([0, 0, 3, 2]), np.array([4, 4, 4]),
               impl="xla")
    kt, vt = (rng.standard_normal((3, KV, D)).astype(np.float32)
              for _ in range(2))
    bad = split.copy()
    bad[1, 1, 0] = -1   # token 2's V page (sequence 1, position 4)
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"token 2 .* is written to page -1"):
      pkvattn.append_paged_kv(kt, vt, np.array([-1, 0, 1]),
                              np.array([0, 20, 4]), pool, bad, impl="xla")


# ---------------------------------------------------------------------------
# Append.


def _append_case(rng):
  """Tokens of random sequences at distinct positions (two tokens writing
  one slot leave either's row, in any order on a GPU), padding anywhere."""
  bidx = rng.integers(-1, B, T)
  kv_lens = np.maximum(rng.integers(1, CAP + 1, B),
                       np.bincount(bidx[bidx >= 0], minlength=B))
  table = _table(rng, kv_lens)
  pos = rng.integers(-5, 50, T)  # padding: anything
  for b in range(B):
    mine = bidx == b
    pos[mine] = rng.choice(kv_lens[b], mine.sum(), replace=False)
  kv = rng.standard_normal((2, T, KV, D)).astype(np.float32)
  q = rng.standard_normal((T, H, D)).astype(np.float32)
  return q, kv[0], kv[1], bidx, pos, table


def _append(q, k, v, bidx, pos, table, *, impl, rope, check=None):
  if rope:
    return pkvattn.apply_rope_and_append(q, k, v, bidx, pos, _pool(), table,
                                         pkvattn.RopeConfig(), impl=impl,
                                         check=check)
  return q, pkvattn.append_paged_kv(k, v, bidx, pos, _pool(), table, impl=impl,
                                    check=check)


def _append_bad_inputs(q, k, v, bidx, pos, table):
  out = []
  t = int(np.argmax(bidx >= 0))
  b = int(bidx[t])
  for name, value, msg in (
      ("batch index", B, rf"batch_indices\[{t}\] = {B}, expected -1"),
      ("batch index", -2, rf"batch_indices\[{t}\] = -2, expected -1")):
    x = bidx.copy()
    x[t] = value
    out.append((name, (q, k, v, x, pos, table), msg))
  for value in (-1, CAP):
    x = pos.copy()
    x[t] = value
    out.append(("position", (q, k, v, bidx, x, table),
                rf"positions\[{t}\] = {value}, expected in \[0, "))
  for value in (-1, NUM_PAGES):
    x = table.copy()
    x[b, pos[t] // PS] = value
    out.append(("page", (q, k, v, bidx, pos, x),
                rf"token {t} .* is written to page {value}, expected"))
  return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rope", [False, True])
def test_append_contract(impl, rope, rng):
  with pkvattn.checked():
    staged = _staged(_append, impl=impl, rope=rope)
    for _ in range(3):
      args = _append_case(rng)
      err, out = staged(*args)
      assert err.get() is None, args[3:]
      expected = _append(*args, impl="xla", rope=rope, check=False)
      for a, e in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, e, atol=2e-5, rtol=2e-5)
    for name, bad, msg in _append_bad_inputs(*args):
      err, _ = staged(*bad)
      assert err.get() is not None and re.search(msg, err.get()), (
          name, err.get())
      with pytest.raises(checkify.JaxRuntimeError, match=msg):
        _append(*bad, impl=impl, rope=rope)


def test_qkv_append_contract(rng):
  q, k, v, bidx, pos, table = _append_case(rng)
  qkv = jnp.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)],
                        axis=1)
  rope = pkvattn.RopeConfig()
  with pkvattn.checked():
    pkvattn.apply_rope_and_append_qkv(qkv, bidx, pos, _pool(), table, rope,
                                      impl="xla")
    for name, bad, msg in _append_bad_inputs(q, k, v, bidx, pos, table):
      with pytest.raises(checkify.JaxRuntimeError, match=msg):
        pkvattn.apply_rope_and_append_qkv(qkv, *bad[3:5], _pool(), bad[5], rope,
                                          impl="xla")


# ---------------------------------------------------------------------------
# Cache ops.

CFG = cache.CacheConfig(num_slots=8, page_size=4, num_layers=1, max_seqs=4,
                        max_pages=4)


def _cache_state():
  """Sequences 0 (6 tokens) and 1 (4 tokens) live; 2 and 3 free."""
  st_ = cache.init_cache(CFG)
  st_, res = cache.claim_batch(st_, [0, 1], np.arange(12).reshape(2, 6),
                               [6, 4])
  assert np.asarray(res.ok).all()
  return st_


_CACHE_BAD = [
    ("claim: id out of range",
     lambda s: cache.claim_batch(s, [2, 4], np.zeros((2, 4), int), [4, 4]),
     r"seq_ids\[1\] = 4 is not -1 \(padding\) or in \[0, max_seqs=4\)"),
    ("claim: duplicate",
     lambda s: cache.claim_batch(s, [3, -1, 3], np.zeros((3, 4), int),
                                 [4, 0, 4]),
     r"id 3 appears more than once \(first at seq_ids\[0\]\)"),
    ("claim: live id",
     lambda s: cache.claim_batch(s, [2, 1], np.zeros((2, 4), int), [4, 4]),
     r"seq_ids\[1\] = 1 is live"),
    ("claim: live id 0",
     lambda s: cache.claim_batch(s, [0], np.zeros((1, 4), int), [4]),
     r"seq_ids\[0\] = 0 is live"),
    ("claim: length past max_len",
     lambda s: cache.claim_batch(s, [2, 3], np.zeros((2, 4), int), [4, 5]),
     r"lengths\[1\] = 5, expected in \[0, 4\]"),
    ("claim: negative length",
     lambda s: cache.claim_batch(s, [2], np.zeros((1, 4), int), [-1]),
     r"lengths\[0\] = -1"),
    ("claim: id 0 past max_len",
     lambda s: cache.claim_batch(cache.release(s, [0]), [0],
                                 np.zeros((1, 4), int), [5]),
     r"lengths\[0\] = 5, expected in \[0, 4\]"),
    ("extend: dead id",
     lambda s: cache.extend(s, [0, 2], [1, 1]),
     r"seq_ids\[1\] = 2 is not a live sequence \(extend"),
    ("extend: id 0 released",
     lambda s: cache.extend(cache.release(s, [0]), [0], [1]),
     r"seq_ids\[0\] = 0 is not a live sequence \(extend"),
    ("extend: negative",
     lambda s: cache.extend(s, [0, 1], [1, -2]),
     r"num_new_tokens\[1\] = -2 for a sequence of 4 tokens"),
    ("extend: past capacity",
     lambda s: cache.extend(s, [0], [11]),
     r"num_new_tokens\[0\] = 11 for a sequence of 6 tokens.*capacity 16"),
    ("extend: duplicate",
     lambda s: cache.extend(s, [1, 1], [1, 1]),
     r"id 1 appears more than once"),
    ("commit: dead id",
     lambda s: cache.commit(s, [3], np.zeros((1, 8), int), [8]),
     r"seq_ids\[0\] = 3 is not a live sequence \(commit"),
    ("commit: negative length",
     lambda s: cache.commit(s, [0], np.zeros((1, 8), int), [-4]),
     r"lengths\[0\] = -4, expected >= 0"),
    ("commit: one negative length of two",
     lambda s: cache.commit(s, [0, 1], np.zeros((2, 8), int), [4, -4]),
     r"lengths\[1\] = -4, expected >= 0"),
    ("release: duplicate",
     lambda s: cache.release(s, [0, 0]), r"id 0 appears more than once"),
    ("release: duplicate after the first id",
     lambda s: cache.release(s, [0, 1, 1]),
     r"id 1 appears more than once \(first at seq_ids\[1\]\)"),
    ("release: out of range",
     lambda s: cache.release(s, [-2]), r"seq_ids\[0\] = -2 is not -1"),
    ("finish_step: duplicate",
     lambda s: cache.finish_step(s, [1, 1]), r"id 1 appears more than once"),
    ("fork: dead parent",
     lambda s: cache.fork(s, [2], [3]), r"parent_ids\[0\] = 2 is not a live"),
    ("fork: live child",
     lambda s: cache.fork(s, [0], [1]), r"child_ids\[0\] = 1 is live"),
    ("fork: live child 0, second of two",
     lambda s: cache.fork(s, [1, 1], [2, 0]), r"child_ids\[1\] = 0 is live"),
    ("fork: duplicate child",
     lambda s: cache.fork(s, [0, 1], [2, 2]),
     r"child_ids: id 2 appears more than once"),
    ("fork: child without parent",
     lambda s: cache.fork(s, [-1], [2]),
     r"child_ids\[0\] = 2 with parent_ids\[0\] = -1"),
    ("fork: second child without parent",
     lambda s: cache.fork(s, [0, -1], [2, 3]),
     r"child_ids\[1\] = 3 with parent_ids\[1\] = -1"),
]


@pytest.mark.parametrize("name,op,msg", _CACHE_BAD, ids=[c[0] for c in _CACHE_BAD])
def test_cache_op_contract_raises(name, op, msg):
  st_ = _cache_state()
  with pkvattn.checked():
    with pytest.raises(checkify.JaxRuntimeError, match=msg):
      op(st_)
  op(st_)  # unchecked: a refused request or a no-op, never an error


def test_cache_op_contract_holds_at_its_bounds():
  """The bounds themselves are in contract: an extend to exactly the
  sequence capacity (6 + 10 = 16 tokens), a claim of as many tokens as its
  row holds, a commit of no tokens and forks to the smallest new id pass
  checked mode and are granted."""
  st_ = _cache_state()
  with pkvattn.checked():
    _, res = cache.extend(st_, [0, 1], [10, 0])
    assert np.asarray(res.ok).all()
    _, res = cache.claim_batch(st_, [2, 3], np.ones((2, 4), int), [4, 0])
    assert np.asarray(res.ok).all()
    # A commit of no tokens, and forks to a new id and to a released id 0
    # (padding beside them).
    cache.commit(st_, [0, 1], np.zeros((2, 8), int), [0, 4])
    _, res = cache.fork(st_, [0, -1], [2, -1])
    assert np.asarray(res.ok).tolist() == [True, False]
    _, res = cache.fork(cache.release(st_, [0]), [1], [0])
    assert np.asarray(res.ok).all()


def test_cache_ops_checked_valid_sequence_matches_unchecked(rng):
  """Random in-contract calls: checked mode raises nothing and changes
  nothing (same results and states as unchecked)."""
  plain, checked_ = _cache_state(), _cache_state()
  for step in range(15):
    live = [int(i) for i in np.flatnonzero(np.asarray(plain.seq_live))]
    dead = [i for i in range(CFG.max_seqs) if i not in live]
    lens = np.asarray(plain.seq_lens)
    kind = ("claim", "extend", "commit", "fork", "release")[step % 5]
    if kind == "claim":  # up to 2 new ids, padded with -1
      ids = ([int(i) for i in rng.permutation(dead)[:2]] + [-1, -1])[:2]
      op, args = cache.claim_batch, (ids, rng.integers(0, 3, (2, 8)),
                                     rng.integers(0, 9, 2))
    elif kind == "extend":
      ids = [int(i) for i in rng.permutation(live)[:2]]
      room = CFG.max_seq_len - lens[ids]
      op, args = cache.extend, (ids, rng.integers(0, 6, len(ids)) % (room + 1))
    elif kind == "commit":
      ids = live[:2]
      op, args = cache.commit, (ids, rng.integers(0, 3, (len(ids), 16)),
                                [16] * len(ids))
    elif kind == "fork":
      n = min(len(live), len(dead), 1)
      op, args = cache.fork, (live[:n], dead[:n])
    else:
      op, args = cache.release, (live[:1],)
    want = op(plain, *args)
    got = op(checked_, *args, check=True)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    plain = want[0] if isinstance(want, tuple) else want
    checked_ = got[0] if isinstance(got, tuple) else got


def test_cache_op_contract_staged_in_a_jitted_step():
  st_ = _cache_state()

  def step(state, ids, adds):
    state, _ = cache.extend(state, ids, adds)
    return cache.release(state, ids)

  with pkvattn.checked():
    staged = jax.jit(checkify.checkify(step))
    err, _ = staged(st_, _i32([0, 1]), _i32([1, 1]))
    assert err.get() is None
    err, _ = staged(st_, _i32([0, 0]), _i32([1, 1]))
    assert "id 0 appears more than once" in err.get()
    # Only the state traced, the ids given as constants: still staged.
    err, _ = jax.jit(checkify.checkify(
        lambda state: step(state, _i32([0, 0]), _i32([1, 1]))))(st_)
    assert "id 0 appears more than once" in err.get()
    # Documented alternative: checkify around the jitted function.
    err, _ = checkify.checkify(jax.jit(step))(st_, _i32([0, 3]), _i32([1, 1]))
    assert "seq_ids[1] = 3 is not a live sequence" in err.get()
    # Staged checks need checkify: a plain jit refuses to trace them.
    with pytest.raises(ValueError, match="not functionalized"):
      jax.jit(step)(st_, _i32([0, 1]), _i32([1, 1]))
  jax.jit(step)(st_, _i32([0, 0]), _i32([1, 1]))  # unchecked: traced anew


# ---------------------------------------------------------------------------
# Unchecked, nothing of the above is in the program.


_UNCHECKED_OPS = {
    "paged_decode": lambda check: (
        lambda q, t, n: _decode(q, t, n, impl="xla", check=check),
        _decode_case(np.random.default_rng(0))),
    "paged_prefill": lambda check: (
        lambda q, t, p, n: _prefill(q, t, p, n, impl="xla", check=check),
        _prefill_case(np.random.default_rng(0))),
    "apply_rope_and_append": lambda check: (
        lambda *a: _append(*a, impl="xla", rope=True, check=check),
        _append_case(np.random.default_rng(0))),
    "claim_batch": lambda check: (
        lambda s, ids, tok, n: cache.claim_batch(s, ids, tok, n, check=check),
        (cache.init_cache(CFG), _i32([0, 1]), _i32(np.zeros((2, 8))),
         _i32([5, 8]))),
    "extend": lambda check: (
        lambda s, ids, n: cache.extend(s, ids, n, check=check),
        (cache.init_cache(CFG), _i32([0, 1]), _i32([1, 2]))),
    "release": lambda check: (
        lambda s, ids: cache.release(s, ids, check=check),
        (cache.init_cache(CFG), _i32([0, 1]))),
}


@pytest.mark.parametrize("name", list(_UNCHECKED_OPS))
def test_unchecked_path_adds_nothing(name, monkeypatch):
  fn, args = _UNCHECKED_OPS[name](None)
  args = jax.tree.map(jnp.asarray, args)
  default = jax.jit(fn).lower(*args).as_text()
  checked_text = jax.jit(checkify.checkify(_UNCHECKED_OPS[name](True)[0])).lower(
      *args).as_text()
  assert checked_text != default  # the comparison below can fail

  def forbidden(*a, **k):
    raise AssertionError("contract code ran on the unchecked path")

  for module in (pkvattn._contract, cache._contract):
    monkeypatch.setattr(module, "run", forbidden)
    monkeypatch.setattr(module, "require", forbidden)
  fn_off, _ = _UNCHECKED_OPS[name](False)
  off = jax.jit(fn_off)
  assert off.lower(*args).as_text() == default
  assert "check" not in au.primitive_names(jax.make_jaxpr(fn_off)(*args).jaxpr)
  with pkvattn.checked(False):
    assert jax.jit(fn).lower(*args).as_text() == default
