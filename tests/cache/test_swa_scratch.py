"""SWA scratch reuse through the cache state: claims, tables, e2e.

The pure planning parts are in `tests/cache/test_swa_plan.py`; here the
scratch path of `claim_batch` / `extend` / `page_table` / `finish_step` /
`commit`, a seeded random run against `cache/reference.py` with scratch on,
and an end-to-end chunked prefill through rope/append and paged prefill (xla,
f32) with scratch on vs off.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pkvattn
from pkvattn import cache
from pkvattn.cache import reference
from pkvattn.cache import window

from cache_asserts import Lockstep


def _i32(x):
  return jnp.asarray(np.asarray(x, np.int32))


def _used(state) -> int:
  return int(cache.stats(state)["num_used"])


# ---------------------------------------------------------------------------
# (a) The issue's figures through claim_batch.


@pytest.mark.parametrize("window_left,scratch,slots", [
    (127, 28, 5),   # 1 scratch slot + 4 normal blocks instead of 32 (-84%)
    (129, 27, 6),   # 1 scratch slot + 5 normal blocks (-81%)
])
def test_issue_figures_through_claim_batch(window_left, scratch, slots):
  cfg = cache.CacheConfig(num_slots=40, page_size=32, num_layers=32, max_seqs=2,
                          max_pages=32, layer_windows=(window_left,) * 32,
                          enable_swa_scratch_reuse=True)
  assert cfg.swa_scratch_active
  st = cache.init_cache(cfg)
  prompt = np.arange(1024, dtype=np.int32)[None]
  st, res = cache.claim_batch(st, _i32([0]), _i32(prompt), _i32([1024]))
  cache.validate(st)
  assert bool(res.ok[0]) and int(res.num_new_blocks[0]) == slots
  assert _used(st) == slots and int(cache.stats(st)["num_scratch"]) == 1
  assert int(st.seq_scratch_count[0]) == scratch
  assert int(st.seq_scratch_first[0]) == 0
  row = np.asarray(st.seq_slots[0])
  assert (row[:scratch] == -1).all() and (row[scratch:] >= 0).all()
  scratch_slot = int(st.seq_scratch_slots[0, 0])
  for layer in (0, 5, 31):  # scratch block i -> sub-page (i + layer) % 32
    table = np.asarray(cache.page_table(st, _i32([0]), layer))[0]
    expected_k = [(scratch_slot * 32 + (i + layer) % 32) * 2
                  for i in range(scratch)]
    expected_k += [(int(s) * 32 + layer) * 2 for s in row[scratch:]]
    np.testing.assert_array_equal(table[0], expected_k)
    np.testing.assert_array_equal(table[1], table[0] + 1)
    assert len(set(table[0].tolist())) == 32
  st = cache.finish_step(st, _i32([0]))
  cache.validate(st)
  assert _used(st) == slots - 1
  table = np.asarray(cache.page_table(st, _i32([0]), 3))[0]
  assert (table[:, :scratch] == -1).all() and (table[:, scratch:] >= 0).all()

  off = cache.init_cache(_replace_cfg(cfg, enable_swa_scratch_reuse=False))
  off, res = cache.claim_batch(off, _i32([0]), _i32(prompt), _i32([1024]))
  assert int(res.num_new_blocks[0]) == 32 and _used(off) == 32


def _replace_cfg(cfg, **kw):
  return dataclasses.replace(cfg, **kw)


def test_window_zero_scratch_spans_the_whole_table(rng):
  """`window_left = 0` and a prompt of exactly `max_pages` blocks: every new
  block is stale for the next query (`swa_scratch_plan`), so the running
  step's scratch range is the whole table, its last block included; every
  layer's table (ids -1..max_seqs) is the reference model's."""
  cfg = cache.CacheConfig(num_slots=8, page_size=4, num_layers=2, max_seqs=2,
                          max_pages=4, layer_windows=(0, 0),
                          enable_swa_scratch_reuse=True)
  run = Lockstep(cfg)
  n = cfg.page_size * cfg.max_pages
  res = run.claim([1, -1], rng.integers(0, 1000, (2, n)), [n, 0])
  assert res["ok"][0], res
  assert (int(run.state.seq_scratch_first[1]),
          int(run.state.seq_scratch_count[1])) == (0, cfg.max_pages)
  ids = np.arange(-1, cfg.max_seqs + 1)
  for layer in range(cfg.num_layers):
    for split in (True, False):
      np.testing.assert_array_equal(
          cache.page_table(run.state, _i32(ids), layer, split=split),
          run.ref.page_table(ids, layer, split=split))


# ---------------------------------------------------------------------------
# (c) Mixed groups, (e) SHARED mode, config edge cases.


def test_mixed_groups_global_layers_never_get_scratch():
  # Gemma-2-like: one slot space, so a block stale for the SWA layers is still
  # held for the global ones; no layer gets scratch (CacheConfig docstring).
  cfg = cache.CacheConfig(num_slots=40, page_size=8, num_layers=4, max_seqs=2,
                          max_pages=16, layer_windows=(15, -1, 15, -1),
                          enable_swa_scratch_reuse=True)
  assert not cfg.swa_scratch_active
  st = cache.init_cache(cfg)
  st, res = cache.claim_batch(st, _i32([0]), _i32(np.zeros((1, 128))),
                              _i32([128]))
  assert int(res.num_new_blocks[0]) == 16
  row = np.asarray(st.seq_slots[0])
  for layer in range(4):
    table = np.asarray(cache.page_table(st, _i32([0]), layer))[0]
    np.testing.assert_array_equal(table[0], (row * 4 + layer) * 2)
  # SHARED is fine here: no scratch can be active.
  shared = cache.page_table(st, _i32([0]), 1, mode=cache.PageIndexMode.SHARED)
  np.testing.assert_array_equal(shared[0], row)


def test_two_swa_windows_widest_decides():
  cfg = cache.CacheConfig(num_slots=40, page_size=8, num_layers=3, max_seqs=2,
                          max_pages=16, layer_windows=(7, 23, 15),
                          enable_swa_scratch_reuse=True, max_rewind_len=4)
  assert cfg.swa_scratch_active and cfg.scratch_window_left == 23
  st = cache.init_cache(cfg)
  st, res = cache.claim_batch(st, _i32([0]), _i32(np.zeros((1, 128))),
                              _i32([128]))
  plan = window.swa_scratch_plan(0, 128, 8, 23, 3, 4)
  assert int(res.num_new_blocks[0]) == plan.num_step_slots
  assert int(st.seq_scratch_count[0]) == plan.num_scratch_blocks == 12
  cache.validate(st)


def test_shared_mode_while_scratch_active_raises():
  cfg = cache.CacheConfig(num_slots=16, page_size=8, num_layers=2, max_seqs=2,
                          max_pages=8, layer_windows=(7, 7),
                          enable_swa_scratch_reuse=True)
  st = cache.init_cache(cfg)
  for mode in (cache.PageIndexMode.SHARED, "shared"):
    with pytest.raises(ValueError, match="PER_LAYER.*scratch"):
      cache.page_table(st, _i32([0]), 0, mode=mode)
  with pytest.raises(ValueError, match="page_index_mode"):
    cache.page_table(st, _i32([0]), 0, mode="bogus")
  # PER_LAYER by name works; without scratch, SHARED gives slot ids.
  cache.page_table(st, _i32([0]), 0, mode="per_layer")
  off = cache.init_cache(_replace_cfg(cfg, enable_swa_scratch_reuse=False))
  off, _ = cache.claim_batch(off, _i32([0]), _i32(np.zeros((1, 20))),
                             _i32([20]))
  shared = cache.page_table(off, _i32([0, 1]), 1, mode="shared")
  chex.assert_shape(shared, (2, 8))
  np.testing.assert_array_equal(shared, np.asarray(off.seq_slots[:2]))


# ---------------------------------------------------------------------------
# (d) Prefix reuse after a scratch prefill.

# A 16-token window over 8-token pages: a 32-token first chunk has 2 scratch
# blocks.
_CFG_W15 = cache.CacheConfig(num_slots=32, page_size=8, num_layers=2,
                             max_seqs=4, max_pages=12, layer_windows=(15, 15),
                             enable_swa_scratch_reuse=True)


def test_prefix_reuse_never_finds_scratch_blocks():
  cfg = _CFG_W15
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, 50, (1, 96)).astype(np.int32)
  st = cache.init_cache(cfg)
  # A 32-token first chunk with a 16-token window: blocks 0..1 are scratch.
  st, res = cache.claim_batch(st, _i32([0]), _i32(prompt[:, :32]), _i32([32]))
  assert int(st.seq_scratch_count[0]) == 2
  st = cache.commit(st, _i32([0]), _i32(prompt), _i32([32]))
  assert int(cache.stats(st)["num_published"]) == 0  # block 0 is scratch
  cache.validate(st)
  # A sequence whose first blocks were reused: scratch starts after them.
  other = cache.init_cache(cfg)
  other, _ = cache.claim_batch(other, _i32([0]), _i32(prompt[:, :16]),
                               _i32([16]))  # 2 blocks, none stale
  assert int(other.seq_scratch_count[0]) == 0
  other = cache.commit(other, _i32([0]), _i32(prompt), _i32([16]))
  other = cache.release(other, _i32([0]))
  other, res = cache.claim_batch(other, _i32([1]), _i32(prompt), _i32([96]))
  assert int(res.num_reused_tokens[0]) == 16
  assert int(other.seq_scratch_first[1]) == 2
  assert int(other.seq_scratch_count[1]) == (96 - 15) // 8 - 2
  other = cache.commit(other, _i32([1]), _i32(prompt), _i32([96]))
  published = np.asarray(other.slot_published)
  row = np.asarray(other.seq_slots[1])
  assert published[row[:2]].all() and published.sum() == 2
  other = cache.finish_step(other, _i32([1]))
  cache.validate(other)
  # Claim the same prompt again: only the two non-scratch published blocks.
  other, res = cache.claim_batch(other, _i32([2]), _i32(prompt), _i32([96]))
  assert bool(res.ok[0]) and int(res.num_reused_tokens[0]) == 16
  np.testing.assert_array_equal(np.asarray(other.seq_slots[2])[:2], row[:2])
  cache.validate(other)


def test_commit_stops_at_scratch_whatever_slot_0_holds():
  # A scratch block has no slot (-1): its commit run must not read slot 0's
  # flags for it (here slot 0 is another prompt's published first block).
  cfg = _CFG_W15
  rng = np.random.default_rng(1)
  first = rng.integers(0, 50, (1, 9)).astype(np.int32)
  prompt = rng.integers(0, 50, (1, 32)).astype(np.int32)
  st = cache.init_cache(cfg)
  st, _ = cache.claim_batch(st, _i32([3]), _i32(first), _i32([9]))
  st = cache.commit(st, _i32([3]), _i32(first), _i32([9]))
  assert int(st.seq_slots[3, 0]) == 0 and bool(st.slot_published[0])
  assert int(st.slot_parent[0]) == -1
  st, _ = cache.claim_batch(st, _i32([0]), _i32(prompt), _i32([32]))
  assert int(st.seq_scratch_count[0]) == 2  # blocks 0..1; 2..3 hold slots
  st = cache.commit(st, _i32([0]), _i32(prompt), _i32([32]))
  assert int(cache.stats(st)["num_published"]) == 1  # slot 0 alone
  cache.validate(st)


# ---------------------------------------------------------------------------
# Random operations against the pure-Python model, scratch on.

_RCFG = cache.CacheConfig(num_slots=16, page_size=4, num_layers=2, max_seqs=5,
                          max_pages=6, hash_ways=16, layer_windows=(5, 3),
                          enable_swa_scratch_reuse=True, max_rewind_len=1)


def _assert_same(state, ref):
  cache.validate(state)
  h = jax.device_get(state)
  for sid in range(_RCFG.max_seqs):
    assert h.seq_slots[sid].tolist() == ref.seq_row(sid), (sid, h.seq_slots)
    slots, first, count = ref.scratch_row(sid)
    assert h.seq_scratch_slots[sid].tolist() == slots, sid
    assert (int(h.seq_scratch_first[sid]), int(h.seq_scratch_count[sid])) == (
        first, count), sid
    live = sid in ref.seqs
    assert int(h.seq_lens[sid]) == (ref.seqs[sid].length if live else 0)
  assert h.slot_refcount.tolist() == ref.refcount
  assert h.slot_published.tolist() == ref.published
  assert h.slot_last_use.tolist() == ref.last_use
  assert h.slot_gen.tolist() == ref.gen
  got = {k: int(v) for k, v in jax.device_get(cache.stats(state)).items()
         if k != "hit_rate"}
  for k, v in ref.stats().items():
    assert got[k] == v, (k, got, ref.stats())
  ids = np.arange(-1, _RCFG.max_seqs + 1)
  for layer in range(_RCFG.num_layers):
    for split in (True, False):
      np.testing.assert_array_equal(
          cache.page_table(state, _i32(ids), layer, split=split),
          ref.page_table(ids, layer, split=split))


@pytest.mark.parametrize("first_seed", [0, 16])
def test_random_ops_with_scratch_match_reference(first_seed):
  for seed in range(first_seed, first_seed + 16):  # compiled once: cheap runs
    _random_run(seed)


def _random_run(seed):
  rng = np.random.default_rng(seed)
  bases = rng.integers(0, 3, (2, _RCFG.max_seq_len))
  state, ref = cache.init_cache(_RCFG), reference.ReferenceCache(_RCFG)
  future = {}
  for _ in range(40):
    kind = rng.choice(["claim", "claim", "extend", "extend", "commit",
                       "release", "finish", "fork"])
    live = sorted(ref.seqs)
    dead = [i for i in range(_RCFG.max_seqs) if i not in ref.seqs]
    pool = dead if kind in ("claim",) else live
    ids = list(rng.permutation(pool)[:3]) + [-1] * 3
    ids = [int(x) for x in ids[:3]]
    if kind == "claim":
      tokens = bases[rng.integers(0, 2, 3)].copy()
      for r in range(3):
        cut = int(rng.choice([24, 12, 8, 0]))
        tokens[r, cut:] = rng.integers(0, 3, _RCFG.max_seq_len - cut)
      lengths = rng.choice([24, 23, 17, 13, 9, 4, 1, 0], 3)
      state, res = cache.claim_batch(state, _i32(ids), _i32(tokens),
                                     _i32(lengths))
      want = ref.claim_batch(ids, tokens, lengths)
      for k, v in want.items():
        assert np.asarray(getattr(res, k)).tolist() == v, (k, res, want)
      for r, sid in enumerate(ids):
        if want["ok"][r]:
          future[sid] = tokens[r]
    elif kind == "extend":
      adds = rng.integers(0, 13, 3)
      state, res = cache.extend(state, _i32(ids), _i32(adds))
      want = ref.extend(ids, adds)
      assert np.asarray(res.ok).tolist() == want["ok"]
      assert np.asarray(res.num_new_blocks).tolist() == want["num_new_blocks"]
    elif kind == "commit":
      tokens = np.stack([future.get(s, bases[0]) for s in ids])
      lengths = rng.choice([24, 16, 13, 8], 3)
      state = cache.commit(state, _i32(ids), _i32(tokens), _i32(lengths))
      ref.commit(ids, tokens, lengths)
    elif kind == "release":
      state = cache.release(state, _i32(ids))
      ref.release(ids)
    elif kind == "finish":
      state = cache.finish_step(state, _i32(ids))
      ref.finish_step(ids)
    else:
      children = list(rng.permutation(dead)[:3]) + [-1] * 3
      children = [int(x) for x in children[:3]]
      state, res = cache.fork(state, _i32(ids), _i32(children))
      want = ref.fork(ids, children)
      assert np.asarray(res.ok).tolist() == want["ok"]
      for r, c in enumerate(children):
        if want["ok"][r]:
          future[c] = future[ids[r]]
    _assert_same(state, ref)


# ---------------------------------------------------------------------------
# (b) End to end: chunked prefill + decode on a 4-layer SWA stack, on vs off.

_LAYERS = 4
_WINDOWS = (15, 11, 15, 7)     # widest window (15) decides the scratch blocks
_QO, _KV, _D, _PS, _HIDDEN = 4, 2, 64, 8, 32
_T = 128                       # padded tokens per step


def _e2e_cfg(enable):
  return cache.CacheConfig(num_slots=48, page_size=_PS, num_layers=_LAYERS,
                           max_seqs=2, max_pages=24, layer_windows=_WINDOWS,
                           enable_swa_scratch_reuse=enable)


def _weights():
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  def n(key, shape, fan_in):
    return jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)

  return dict(
      embed=n(keys[0], (64, _HIDDEN), 1.0),
      wq=n(keys[1], (_LAYERS, _HIDDEN, _QO * _D), _HIDDEN),
      wk=n(keys[2], (_LAYERS, _HIDDEN, _KV * _D), _HIDDEN),
      wv=n(keys[3], (_LAYERS, _HIDDEN, _KV * _D), _HIDDEN),
      wo=n(keys[4], (_LAYERS, _QO * _D, _HIDDEN), _QO * _D))


@functools.partial(jax.jit, donate_argnums=(1,))
def _forward(w, pool, tables, tokens, batch_indices, positions, q_indptr,
             kv_lens):
  """Layers run one after the other (the pool threads through them)."""
  h = w["embed"][tokens]                                     # [T, hidden]
  outs = []
  for layer in range(_LAYERS):
    q = (h @ w["wq"][layer]).reshape(_T, _QO, _D)
    k = (h @ w["wk"][layer]).reshape(_T, _KV, _D)
    v = (h @ w["wv"][layer]).reshape(_T, _KV, _D)
    q, pool = pkvattn.apply_rope_and_append(
        q, k, v, batch_indices, positions, pool, tables[layer],
        pkvattn.RopeConfig(), impl="xla")
    out = pkvattn.paged_prefill(q, pool, tables[layer], q_indptr, kv_lens,
                                window_left=_WINDOWS[layer], impl="xla")
    outs.append(out)
    h = h + out.reshape(_T, _QO * _D) @ w["wo"][layer]
  return pool, jnp.stack(outs)


def _run_e2e(enable, prompts, chunks):
  """Chunked prefill of `prompts` (steps of `chunks[step][seq]` tokens), then a
  decode step; returns per-step outputs of the real tokens and the peak."""
  cfg = _e2e_cfg(enable)
  w = _weights()
  st = cache.init_cache(cfg)
  pool = jnp.full((cfg.num_pool_pages, _PS, _KV, _D), jnp.nan, jnp.float32)
  seq_ids = _i32([0, 1])
  lens = [0, 0]
  outputs, peak, scratch_seen = [], 0, 0
  steps = list(chunks) + [(1, 1)]  # the decode step feeds one token each
  full = [list(p) + [7] for p in prompts]  # token fed at decode
  for step, q_lens in enumerate(steps):
    if step == 0:
      first = np.zeros((2, max(q_lens)), np.int32)
      for b in range(2):
        first[b, :q_lens[b]] = full[b][:q_lens[b]]
      st, res = cache.claim_batch(st, seq_ids, _i32(first), _i32(q_lens))
    else:
      st, res = cache.extend(st, seq_ids, _i32(q_lens))
    assert np.asarray(res.ok).all()
    cache.validate(st)
    peak = max(peak, _used(st))
    scratch_seen += int(np.asarray(st.seq_scratch_count).sum())
    tokens, bidx, pos = [], [], []
    for b in range(2):
      tokens += full[b][lens[b]:lens[b] + q_lens[b]]
      bidx += [b] * q_lens[b]
      pos += list(range(lens[b], lens[b] + q_lens[b]))
      lens[b] += q_lens[b]
    n = len(tokens)
    pad = _T - n
    q_indptr = _i32([0, q_lens[0], q_lens[0] + q_lens[1]])
    tables = jnp.stack([cache.page_table(st, seq_ids, layer)
                        for layer in range(_LAYERS)])
    pool, outs = _forward(w, pool, tables, _i32(tokens + [0] * pad),
                          _i32(bidx + [-1] * pad), _i32(pos + [0] * pad),
                          q_indptr, _i32(lens))
    outputs.append(np.asarray(outs[:, :n]))
  return outputs, peak, scratch_seen


def test_end_to_end_chunked_prefill_scratch_on_equals_off():
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 64, n).tolist() for n in (160, 100)]
  chunks = [(64, 40), (64, 60), (32, 0)]
  on, peak_on, scratch_on = _run_e2e(True, prompts, chunks)
  off, peak_off, scratch_off = _run_e2e(False, prompts, chunks)
  assert scratch_on > 0 and scratch_off == 0
  # Off holds every block (20 + 13 + decode); on keeps a few plus scratch.
  assert peak_off == 21 + 13 and peak_on < peak_off // 2, (peak_on, peak_off)
  for step, (a, b) in enumerate(zip(on, off)):
    assert np.isfinite(a).all(), step
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6, err_msg=str(step))
