"""paged_prefill: xla path and the Pallas kernel (interpret mode) vs the float64 oracle.

Each case combines several features (format, group size, page size, edge
lengths, window / soft cap / sinks, mixed batches with decode rows, chunked
prefill over a cached prefix, multi-token decode, padding tokens, causal=False)
so the matrix is covered without its full product. The xla path runs the
whole list (fast); the interpret-mode kernel runs a chosen subset plus
direct-config cases that reach each code path of the kernel (page-gather vs
within-page loads, short-tile launch, single loop, token order).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pkvattn
from attention_utils import (assert_close, assert_lse_close, assert_tile_rows,
                             dense_attention, make_paged)
from pkvattn import _kv
from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import paged_prefill as kernel
from pkvattn.pallas_kernels import plan as plan_lib

HEAD_DIM = 64
NUM_KV_HEADS = 2


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  fmt: str
  group_size: int
  page_size: int
  kv_lens: tuple
  q_lens: tuple
  num_padding: int = 0
  causal: bool = True
  window_left: int = -1
  logits_soft_cap: float | None = None
  sinks: bool = False
  dtype: object = jnp.float32

  def __str__(self):
    return self.name


def _edge(ps):
  return (1, ps - 1, ps, ps + 1)


CASES = [
    # Full prompts at the edge lengths {1, ps-1, ps, ps+1, max}.
    Case("prompts_edges_pair_g1_p8", "pair", 1, 8, (1, 7, 8, 9, 37),
         (1, 7, 8, 9, 37)),
    Case("prompts_edges_pool_g4_p16", "pool", 4, 16, (1, 15, 16, 17, 40),
         (1, 15, 16, 17, 40), num_padding=3),
    # Mixed batch: decode rows (q_len 1) beside prompts, chunked prefill over a
    # cached prefix, multi-token decode (q_len <= 8), padding tokens.
    Case("mixed_flashinfer_g8_p8", "flashinfer", 8, 8, (33, 1, 20, 9),
         (12, 1, 1, 5), num_padding=4),
    Case("mixed_pair_g4_p16_window", "pair", 4, 16, (50, 17, 3, 31),
         (20, 1, 3, 8), window_left=9),
    Case("chunked_pool_g8_p16_softcap", "pool", 8, 16, (45, 16), (13, 2),
         logits_soft_cap=5.0, num_padding=2),
    Case("decode_only_pair_g4_p8_sinks", "pair", 4, 8, (9, 1, 24, 7),
         (1, 1, 1, 1), sinks=True),
    Case("window_sinks_flashinfer_g1_p16", "flashinfer", 1, 16, (40, 33),
         (40, 6), window_left=15, sinks=True),
    Case("noncausal_pool_g4_p8", "pool", 4, 8, (19, 8, 26), (5, 8, 1),
         causal=False, num_padding=2),
    Case("noncausal_window_pair_g8_p16", "pair", 8, 16, (30, 17), (9, 17),
         causal=False, window_left=4),
    Case("bf16_mixed_pool_g4_p16", "pool", 4, 16, (48, 1, 17), (30, 1, 4),
         window_left=20, logits_soft_cap=8.0, sinks=True, num_padding=1,
         dtype=jnp.bfloat16),
    Case("f16_prompts_pair_g8_p8", "pair", 8, 8, (23, 8), (23, 3),
         dtype=jnp.float16),
    # group_size 3 (not a power of two: heads packed densely, 21 tokens in
    # 64 rows per tile).
    Case("g3_mixed_pool_p8_window", "pool", 3, 8, (26, 1, 9), (10, 1, 9),
         window_left=6, num_padding=2),
]
# The interpret-mode kernel runs on this subset (it is ~100x slower on CPU).
KERNEL_CASES = [CASES[i] for i in (1, 2, 3, 4, 5, 6, 7, 9, 11)]


def _build(case: Case, seed: int = 0):
  rng = np.random.default_rng(seed)
  p = make_paged(rng, case.kv_lens, page_size=case.page_size,
                 num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                 dtype=case.dtype, fmt=case.fmt, extra_pages=2)
  num_qo_heads = NUM_KV_HEADS * case.group_size
  num_tokens = sum(case.q_lens) + case.num_padding
  q = rng.standard_normal((num_tokens, num_qo_heads, HEAD_DIM))
  q = jnp.asarray(q, case.dtype)
  q_indptr = np.concatenate([[0], np.cumsum(case.q_lens)]).astype(np.int32)
  sinks = (rng.standard_normal(num_qo_heads).astype(np.float32)
           if case.sinks else None)
  return p, q, q_indptr, sinks


def _expected(case: Case, p, q, q_indptr, sinks):
  qf = np.asarray(q.astype(jnp.float32))
  outs, lses = [], []
  for b, (n, ql) in enumerate(zip(case.kv_lens, case.q_lens)):
    out, lse = dense_attention(
        qf[q_indptr[b]:q_indptr[b + 1]], p.k[b], p.v[b],
        np.arange(n - ql, n), n, causal=case.causal,
        window_left=case.window_left, sm_scale=1 / np.sqrt(HEAD_DIM),
        logits_soft_cap=case.logits_soft_cap, sinks=sinks)
    outs.append(out)
    lses.append(lse)
  hq = q.shape[1]
  outs.append(np.zeros((case.num_padding, hq, HEAD_DIM)))
  lses.append(np.full((case.num_padding, hq), -np.inf))
  return np.concatenate(outs), np.concatenate(lses)


def _public(case, p, q, q_indptr, sinks, impl, **kw):
  return pkvattn.paged_prefill(
      q, p.kv_cache, jnp.asarray(p.page_table), jnp.asarray(q_indptr),
      jnp.asarray(p.kv_lens), causal=case.causal,
      window_left=case.window_left, logits_soft_cap=case.logits_soft_cap,
      sinks=None if sinks is None else jnp.asarray(sinks), return_lse=True,
      impl=impl, **kw)


def _check(case, out, lse, expected_out, expected_lse):
  assert out.shape == expected_out.shape and out.dtype == case.dtype
  assert lse.shape == expected_lse.shape and lse.dtype == jnp.float32
  assert_close(out, expected_out, case.dtype, case.name)
  assert_lse_close(lse, expected_lse, case.dtype, case.name + " lse")
  pad = slice(sum(case.q_lens), None)
  assert (np.asarray(out[pad].astype(jnp.float32)) == 0).all()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_xla_matches_oracle(case):
  p, q, q_indptr, sinks = _build(case)
  out, lse = _public(case, p, q, q_indptr, sinks, "xla")
  _check(case, out, lse, *_expected(case, p, q, q_indptr, sinks))


@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_kernel_interpret_matches_oracle(case):
  p, q, q_indptr, sinks = _build(case, seed=1)
  out, lse = _public(case, p, q, q_indptr, sinks, "pallas")
  _check(case, out, lse, *_expected(case, p, q, q_indptr, sinks))


def _direct(case, p, q, q_indptr, sinks, config, plan=None, interpret=True):
  view = _kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
  return kernel.paged_prefill(
      q, view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(q_indptr), jnp.asarray(p.kv_lens),
      None if sinks is None else jnp.asarray(sinks), causal=case.causal,
      sm_scale=1 / np.sqrt(HEAD_DIM), window_left=case.window_left,
      logits_soft_cap=case.logits_soft_cap, interpret=interpret, config=config,
      plan=plan)


# Configs that reach each kernel path: (case, config).
_C = kernel.TritonConfig


def _triton(*, group_size, head_dim, page_size, dtype, window_left=-1,
            num_tokens=1024, batch_size=4):
  """The Triton kernel's default config for a shape (`dispatch.prefill`)."""
  return dispatch.prefill(
      gpu=dispatch.INTERPRET, dtype=dtype, kv_dtype=dtype, head_dim=head_dim,
      group_size=group_size, page_size=page_size, window_left=window_left,
      num_tokens=num_tokens, batch_size=batch_size, backend="triton").config
CONFIG_CASES = [
    # block_k == page_size: one page per KV tile (strided loads, scalar table
    # read); single loop that masks every tile; token-order plan; kv heads
    # inner launch order; libdevice exp2; group 3 with 5 tokens a tile (15
    # of 16 rows used).
    (Case("within_page_1loop_pair_g3_p16", "pair", 3, 16, (40, 17, 1),
          (40, 3, 1), num_padding=2),
     _C(block_q=5, block_k=16, single_loop=True, longest_first=False,
        short_block_q=0, heads_outer=False, fast_exp2=False)),
    # block_k < page_size: half pages; window edge loops; short-tile launch.
    (Case("half_page_window_pool_g8_p32", "pool", 8, 32, (70, 1, 33),
          (20, 1, 2), window_left=21, sinks=True),
     _C(block_q=4, block_k=16, short_block_q=2)),
    # Several pages per KV tile (scalar page ids + select chain), G=1 with
    # 16-token tiles; 4 pages per tile.
    (Case("gather_flashinfer_g1_p8", "flashinfer", 1, 8, (60, 5), (35, 5),
          num_padding=3),
     _C(block_q=16, block_k=32, short_block_q=0)),
    # Sequences of up to 5 tokens in the decode kernel, one decode query per
    # token with its own key count (as the unpacked Mosaic-GPU defaults
    # run multi-token decode), beside prompt tiles; window and sinks.
    (Case("decode_rows_per_seq_pair_g3_p16", "pair", 3, 16,
          (50, 9, 30, 4, 12, 6), (20, 5, 3, 4, 1, 6), num_padding=3,
          window_left=7, sinks=True),
     _C(block_q=8, block_k=16, short_block_q=0, decode_rows_per_seq=5)),
]


@pytest.mark.parametrize("case,config", CONFIG_CASES,
                         ids=[c.name for c, _ in CONFIG_CASES])
def test_kernel_configs_match_oracle(case, config):
  p, q, q_indptr, sinks = _build(case, seed=2)
  out, lse = _direct(case, p, q, q_indptr, sinks, config)
  _check(case, out, lse, *_expected(case, p, q, q_indptr, sinks))


# On the GPU (in bf16 / f16: f32 dots may run in TF32 there): the 16-bit
# cases, a mixed batch and group 3 of the list above, plus groups that are
# not powers of two on longer, unaligned prompts.
GPU_CASES = [
    c if c.dtype != jnp.float32 else
    dataclasses.replace(c, name=c.name + "_bf16", dtype=jnp.bfloat16)
    for c in CASES if c.dtype != jnp.float32 or c.group_size == 3 or
    c.name.startswith("mixed")] + [
    Case("g3_prompts_pool_p16", "pool", 3, 16, (1024, 700, 1, 129),
         (1024, 129, 1, 129), num_padding=3, dtype=jnp.bfloat16),
    Case("g5_chunked_pair_p16_softcap", "pair", 5, 16, (4095, 200, 7),
         (300, 7, 7), logits_soft_cap=30.0, dtype=jnp.bfloat16),
    Case("g6_flashinfer_p8_sinks", "flashinfer", 6, 8, (130, 64, 1),
         (129, 64, 1), sinks=True, num_padding=5, dtype=jnp.float16),
    Case("g7_window_pool_p32", "pool", 7, 32, (300, 77), (300, 77),
         window_left=100, dtype=jnp.bfloat16),
]


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_kernel_matches_oracle_gpu(case):
  """The Triton kernel compiled for the GPU (default tiles: groups packed
  densely, 42 tokens of group 3 a tile) against the float64 oracle, with NaN
  in every page a sequence does not own and past kv_len."""
  p, q, q_indptr, sinks = _build(case, seed=5)
  config = _triton(
      group_size=case.group_size, head_dim=HEAD_DIM, page_size=case.page_size,
      dtype=case.dtype, window_left=case.window_left,
      num_tokens=q.shape[0], batch_size=len(p.kv_lens))
  out, lse = _direct(case, p, q, q_indptr, sinks, config, interpret=False)
  _check(case, out, lse, *_expected(case, p, q, q_indptr, sinks))


def test_plan_reuse_and_determinism():
  case = CASES[2]
  p, q, q_indptr, sinks = _build(case, seed=3)
  hq = q.shape[1]
  config = dispatch.prefill(
      gpu=dispatch.current_gpu(interpret=True), dtype=case.dtype,
      kv_dtype=case.dtype, head_dim=HEAD_DIM,
      group_size=hq // NUM_KV_HEADS, page_size=case.page_size,
      num_tokens=q.shape[0], batch_size=len(p.kv_lens)).config
  plan = jax.jit(
      config.plan, static_argnames=("num_tokens", "causal", "window_left"))(
          jnp.asarray(q_indptr), jnp.asarray(p.kv_lens),
          num_tokens=q.shape[0], causal=case.causal,
          window_left=case.window_left)
  a = _direct(case, p, q, q_indptr, sinks, config, plan)
  b = _direct(case, p, q, q_indptr, sinks, config, plan)
  c = _direct(case, p, q, q_indptr, sinks, config)
  for x in (0, 1):  # one program twice: bit for bit
    np.testing.assert_array_equal(np.asarray(a[x]), np.asarray(b[x]))
  # A plan passed in or computed inside: the same tiles in another program,
  # whose XLA:CPU code (interpret mode) may round an f32 ulp differently.
  for x in (0, 1):
    np.testing.assert_allclose(np.asarray(a[x], np.float32),
                               np.asarray(c[x], np.float32), rtol=1e-6, atol=0)
  _check(case, *a, *_expected(case, p, q, q_indptr, sinks))
  bad = dataclasses.replace(config, block_q=config.block_q * 2)
  with pytest.raises(ValueError, match="Invalid plan"):
    _direct(case, p, q, q_indptr, sinks, bad, plan)


def test_plan_covers_every_token_once():
  q_lens = np.array([5, 1, 0, 17, 2, 9])
  kv_lens = q_lens + np.array([3, 40, 0, 0, 7, 1])
  q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  num_tokens = int(q_indptr[-1]) + 6
  for short in (0, 2):
    plan = plan_lib.plan_prefill(
        jnp.asarray(q_indptr), jnp.asarray(kv_lens, jnp.int32),
        num_tokens=num_tokens, block_q=4, short_block_q=short)
    seen = np.zeros(num_tokens, int)
    groups = [(np.asarray(plan.tiles), 4)]
    if short:
      groups.append((np.asarray(plan.short_tiles), short))
    for tiles, bq in groups:
      for seq, start, end, kv, off in tiles:
        rows = np.arange(start, min(start + bq, end))
        seen[rows] += 1
        assert_tile_rows(seq, kv, off, rows, q_indptr, q_lens, kv_lens)
    np.testing.assert_array_equal(seen, 1)
    assert plan.num_tiles == plan_lib.max_tiles(num_tokens, len(q_lens), 4,
                                                short + 1)


@settings(max_examples=15, deadline=None)
@given(q_lens=st.lists(st.one_of(st.integers(0, 9), st.integers(120, 135),
                                 st.integers(248, 263), st.integers(0, 300)),
                       min_size=1, max_size=48),
       first=st.integers(0, 7), padding=st.integers(0, 140),
       rows=st.sampled_from([(0, True, 1), (0, True, 8), (8, False, 1),
                             (4, True, 8), (0, False, 1)]))
def test_plan_tiles_fit_the_static_bound(q_lens, first, padding, rows):
  """Sequences whose first token sits anywhere in an 8-row tile and whose
  length puts their last token just past a 128-token tile (the most tiles
  a grid of 8-aligned origins gives), among sequences of 0-9 tokens that
  run as decode rows or short tiles instead: every token is in exactly one
  main tile, short tile or decode row, so the static tile count
  (`plan.max_tiles`, from the tokens and the shortest sequence that takes
  main tiles) never drops one."""
  short_block_q, split, rows_per_seq = rows
  q_lens = np.asarray([first] + q_lens)   # the first sequence shifts the rest
  q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  num_tokens = int(q_indptr[-1]) + padding
  if num_tokens == 0:
    return
  kv_lens = (q_lens + 3).astype(np.int32)
  plan = jax.jit(plan_lib.plan_prefill, static_argnames=(
      "num_tokens", "block_q", "short_block_q", "align", "split_decode_rows",
      "decode_rows_per_seq"))(  # one compile, not one per jnp op
          jnp.asarray(q_indptr), jnp.asarray(kv_lens), num_tokens=num_tokens,
          block_q=128, short_block_q=short_block_q, align=8,
          split_decode_rows=split, decode_rows_per_seq=rows_per_seq)
  min_tokens = max(short_block_q, rows_per_seq if split else 0) + 1
  assert plan.num_tiles == (num_tokens // 128 + min(
      len(q_lens), num_tokens // min_tokens) + 1)
  seen = np.zeros(num_tokens, int)
  for seq, start, end, kv, off in np.asarray(plan.tiles):
    if end > start:
      tile_rows = np.arange(start, min(end, start - start % 8 + 128))
      seen[tile_rows] += 1
      assert_tile_rows(seq, kv, off, tile_rows, q_indptr, q_lens, kv_lens)
  if plan.short_tiles is not None:
    for _, start, end, _, _ in np.asarray(plan.short_tiles):
      seen[start:max(start, end)] += 1
  if plan.decode_rows is not None:
    for t in np.asarray(plan.decode_rows):
      if t < num_tokens:
        seen[t] += 1
  np.testing.assert_array_equal(seen, 1)


@pytest.mark.parametrize("rank_max_rows", [0, plan_lib.RANK_MAX_ROWS])
def test_plan_order_and_prefix_sum_match_numpy(monkeypatch, rank_max_rows, rng):
  # Both forms: the rank count and scatter / compare-all sum, and (with
  # RANK_MAX_ROWS = 0) argsort / cumsum. Eager, so each form is traced anew.
  monkeypatch.setattr(plan_lib, "RANK_MAX_ROWS", rank_max_rows)
  for n in (1, 2, 37, 300):
    work = rng.integers(-1, 6, n).astype(np.int32)  # many ties
    rows = rng.integers(-2**20, 2**20, (n, 5)).astype(np.int32)
    np.testing.assert_array_equal(
        plan_lib.order_by_work(jnp.asarray(rows), jnp.asarray(work)),
        rows[np.argsort(-work, kind="stable")])
    x = rng.integers(0, 50, n).astype(np.int32)
    np.testing.assert_array_equal(plan_lib.prefix_sum(jnp.asarray(x)),
                                  np.cumsum(x))


def test_config_validation():
  with pytest.raises(NotImplementedError):
    _C(block_q=2, block_k=64).validate(group_size=4)  # 8 rows < 16
  with pytest.raises(NotImplementedError, match="short_block_q"):
    _C(block_q=8, short_block_q=2).validate(group_size=3)  # 8 rows < 16
  # Fields alone are checked on construction, by name.
  for bad, name in ((dict(block_k=48), "block_k"), (dict(block_q=0), "block_q"),
                    (dict(short_block_q=8, short_block_k=8), "short_block_k"),
                    (dict(decode_rows_per_seq=0), "decode_rows_per_seq"),
                    (dict(fp8_pages="fast"), "fp8_pages")):
    with pytest.raises(ValueError, match=name):
      _C(**bad)
  with pytest.raises(TypeError, match="abstract"):
    kernel.PrefillConfig()
  _C(block_q=24, block_k=64).validate(group_size=1)  # 32 rows, 8 unused
  assert kernel.tile_rows(42, 3) == 128 and kernel.tile_rows(5, 3) == 16
  assert _triton(group_size=3, head_dim=64, page_size=16,
                 dtype=jnp.bfloat16).block_q == 42
  _triton(group_size=6, head_dim=128, page_size=16,
          dtype=jnp.bfloat16).validate(group_size=6)


def test_public_plan_reused_across_layers():
  """`pkvattn.plan_prefill` once, then `paged_prefill(plan=...)` per layer."""
  case = CASES[3]
  p, q, q_indptr, sinks = _build(case, seed=4)
  num_tokens, num_qo_heads, _ = q.shape
  plan = pkvattn.plan_prefill(
      jnp.asarray(q_indptr), jnp.asarray(p.kv_lens), num_tokens=num_tokens,
      num_qo_heads=num_qo_heads, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
      dtype=case.dtype, window_left=case.window_left)
  expected = _expected(case, p, q, q_indptr, sinks)
  for impl in ("pallas", "xla"):  # xla ignores the plan
    out, lse = _public(case, p, q, q_indptr, sinks, impl, plan=plan)
    _check(case, out, lse, *expected)
  other = pkvattn.plan_prefill(
      jnp.asarray(q_indptr), jnp.asarray(p.kv_lens),
      num_tokens=num_tokens + 1, num_qo_heads=num_qo_heads,
      num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=case.dtype)
  with pytest.raises(ValueError, match="Invalid plan"):
    _public(case, p, q, q_indptr, sinks, "pallas", plan=other)


@pytest.mark.parametrize("gpu", [dispatch.HOPPER, dispatch.AMPERE],
                         ids=["hopper", "ampere"])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)])
def test_public_plan_is_run_as_given(gpu, heads, monkeypatch):
  """On every GPU's dispatch, `pkvattn.plan_prefill` makes the plan that
  `paged_prefill(plan=...)` runs: the call plans nothing itself (a plan of
  another tile size would be replaced in every layer, silently). Traced
  on the CPU with the GPU's dispatch."""
  from pkvattn import _checks  # pylint: disable=import-outside-toplevel
  from pkvattn.pallas_kernels import plan_mgpu  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(dispatch, "_detected_gpu", lambda: gpu)
  monkeypatch.setattr(_checks, "is_gpu", lambda: True)
  hq, hkv = heads
  t, d, ps, n, b = 70, 64, 16, 16, 2
  sds = jax.ShapeDtypeStruct
  q_indptr, kv_lens = sds((b + 1,), jnp.int32), sds((b,), jnp.int32)
  plan = jax.eval_shape(lambda indptr, lens: pkvattn.plan_prefill(
      indptr, lens, num_tokens=t, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
      dtype=jnp.bfloat16), q_indptr, kv_lens)
  planned = []
  for mod, name in ((plan_lib, "plan_prefill"),
                    (plan_mgpu, "plan_prefill_mgpu")):
    monkeypatch.setattr(mod, name, lambda *a, **k: planned.append(a))
  jax.jit(lambda *a: pkvattn.paged_prefill(*a[:-1], plan=a[-1])).trace(
      sds((t, hq, d), jnp.bfloat16), sds((n, 2, ps, hkv, d), jnp.bfloat16),
      sds((b, n // b), jnp.int32), q_indptr, kv_lens, plan)
  assert not planned


@pytest.mark.parametrize("soft_cap,fast", [(None, True), (30.0, True),
                                           (None, False)])
def test_kernel_lowers_to_triton(soft_cap, fast, cuda_lowering):
  """Cross-lowers the kernel for CUDA on the CPU (Pallas -> Triton IR): the
  inline-PTX exp2 of `fast_exp2` (which interpret mode never runs) must be
  accepted by the Triton lowering, and absent when switched off."""
  from jax import export
  t, hq, hkv, d, ps, n, b = 64, 8, 2, 128, 16, 32, 2
  sds = jax.ShapeDtypeStruct
  args = [sds((t, hq, d), jnp.bfloat16), sds((n, ps, hkv, d), jnp.bfloat16),
          sds((b, 2, n // b), jnp.int32), sds((b + 1,), jnp.int32),
          sds((b,), jnp.int32)]
  # The Triton configs by name: on a Hopper host the default would be the
  # Mosaic-GPU kernel's. Decode rows stay in the short launch: the decode
  # kernel they would go to (on a Hopper host, a Mosaic-GPU one with its own
  # inline-PTX exp2) is not this config's.
  config = dataclasses.replace(
      _triton(group_size=hq // hkv, head_dim=d, page_size=ps,
              dtype=jnp.bfloat16, num_tokens=t, batch_size=b),
      fast_exp2=fast,
      split_decode_rows=False)

  def f(q, pool, table, q_indptr, kv_lens):
    return kernel.paged_prefill(
        q, pool, pool, table[:, 0], table[:, 1], q_indptr, kv_lens, None,
        sm_scale=d ** -0.5, logits_soft_cap=soft_cap, config=config)

  exp = export.export(
      jax.jit(f), platforms=["cuda"],
      disabled_checks=[export.DisabledSafetyCheck.custom_call(
          "__gpu$xla.gpu.triton")])(*args)
  text = exp.mlir_module()
  assert text.count("xla.gpu.triton") >= 2  # the long and the short launch
  # The Triton module is serialised into the custom call's config; the PTX
  # strings show up verbatim in it.
  assert ("ex2.approx.ftz.f32" in text) == fast
  assert ("fma.rn.ftz.f32" in text) == (fast and soft_cap is None)
