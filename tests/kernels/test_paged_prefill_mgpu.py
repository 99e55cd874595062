"""The Mosaic-GPU prefill backend (`pallas_kernels/paged_prefill_mgpu.py`).

On the CPU CI: the 8-aligned plan it runs on (every token covered exactly
once, tile rows inside the 128- or 192-row window from an 8-aligned origin),
the backend choice (head_dim 64 by tokens per sequence) and its errors, and a
cross-lowering of the kernel for CUDA (Pallas -> Mosaic GPU MLIR) with both
consumer schedules, which runs the layout / shape checks of the lowering
without a GPU. Mosaic GPU has no interpret mode for warp-specialised kernels,
so the numerics run only on a Hopper GPU (`test_matches_oracle_gpu`,
`test_schedules_match_oracle_gpu`, `test_head_dim_256_matches_oracle_gpu`,
skipped elsewhere;
`bench/bench_prefill.py` checks the same there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_utils import assert_tile_rows, dense_attention, make_paged
from pkvattn import _kv
from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import paged_prefill as kernel
from pkvattn.pallas_kernels import paged_prefill_mgpu as mgpu
from pkvattn.pallas_kernels import plan as plan_lib

def _default(gpu=dispatch.HOPPER, *, group_size, head_dim, page_size=16,
             dtype=jnp.bfloat16, kv_dtype=None, window_left=-1,
             num_tokens=1024, batch_size=4, backend=None):
  """`dispatch.prefill`'s config for a call (on a Hopper GPU by default)."""
  return dispatch.prefill(
      gpu=gpu, dtype=dtype, kv_dtype=kv_dtype, head_dim=head_dim,
      group_size=group_size, page_size=page_size, window_left=window_left,
      num_tokens=num_tokens, batch_size=batch_size, backend=backend).config


def _mosaic(group_size=4, head_dim=128, page_size=16):
  """The Mosaic-GPU config for long prompts: one query head per CTA, one
  CTA per tile (at head_dim 64 three consumers; shorter prompts get the
  packed, persistent form, `test_default_head_dim_64_by_tokens_...`)."""
  return _default(group_size=group_size, head_dim=head_dim,
                  page_size=page_size, backend="mosaic",
                  num_tokens=dispatch.PREFILL_D64_MIN_TOKENS, batch_size=1)


@pytest.mark.parametrize("head_dim,pack", [(128, False), (64, False),
                                           (64, True)])
@settings(max_examples=25, deadline=None)
@given(q_lens=st.lists(st.one_of(st.integers(0, 300), st.integers(1, 9)),
                      min_size=1, max_size=5),
       extra=st.lists(st.integers(0, 200), min_size=5, max_size=5),
       padding=st.integers(0, 20))
def test_aligned_plan_covers_every_token_once(head_dim, pack, q_lens, extra,
                                             padding):
  """Main tiles (8-aligned origins; 128 tokens, or 192 with three consumers
  at head_dim 64; with the group of 3 packed, 42 tokens from the first
  token) and decode rows together cover every token exactly once, each
  with its sequence's metadata and a decode row with its token's keys."""
  q_lens = np.asarray(q_lens)
  kv_lens = (q_lens + np.asarray(extra[:len(q_lens)])).astype(np.int32)
  q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  num_tokens = int(q_indptr[-1]) + padding
  if num_tokens == 0:
    return
  config = _mosaic(group_size=3, head_dim=head_dim)
  if pack:
    # The packed default: no short launch, 2-8-token sequences in tiles.
    config = _default(group_size=3, head_dim=head_dim, backend="mosaic",
                      num_tokens=num_tokens, batch_size=len(q_lens))
    assert config.pack_gqa and config.short_block_q == 0
    config.validate(group_size=3)
  plan = config.plan(jnp.asarray(q_indptr), jnp.asarray(kv_lens),
                     num_tokens=num_tokens, causal=True, window_left=-1)
  tile = mgpu.tile_q(2, 3) if pack else mgpu.tile_q(
      3 if head_dim == 64 else 2)
  align = 1 if pack else 8
  assert (plan.block_q, plan.align) == (tile, align)
  seen = np.zeros(num_tokens, int)
  for seq, start, end, kv, off in np.asarray(plan.tiles):
    if end <= start:
      continue
    origin = start - start % align
    rows = np.arange(start, min(end, origin + tile))
    seen[rows] += 1
    assert_tile_rows(seq, kv, off, rows, q_indptr, q_lens, kv_lens)
  # No short launch: sequences of up to R tokens are decode rows, one per
  # token (R = 8 unpacked at group 3; packed, 2-8 tokens run in tiles).
  rows_per_seq = plan.decode_rows_per_seq
  assert plan.short_tiles is None
  assert rows_per_seq == (1 if pack else 8)
  rows = np.asarray(plan.decode_rows).reshape(-1, rows_per_seq)
  keys = (kv_lens[:, None] if plan.decode_kv_lens is None else
          np.asarray(plan.decode_kv_lens).reshape(-1, rows_per_seq))
  for b, ql in enumerate(q_lens):
    for r in range(rows_per_seq):
      t = rows[b, r]
      assert (t < num_tokens) == (r < ql <= rows_per_seq)
      if t < num_tokens:
        assert t == q_indptr[b] + r
        assert keys[b, r] == kv_lens[b] - ql + r + 1  # its position + 1
        seen[t] += 1
  np.testing.assert_array_equal(seen, 1)


def test_default_head_dim_64_by_tokens_per_sequence():
  """On Hopper, head_dim 64 runs the three-consumer Mosaic-GPU kernel from
  `PREFILL_D64_MIN_TOKENS` new tokens per sequence, its packed persistent
  form below, the Triton kernel wherever the Mosaic-GPU kernel does not
  serve the case."""
  kw = dict(group_size=3, head_dim=64)
  n = dispatch.PREFILL_D64_MIN_TOKENS
  cfg = _default(**kw, num_tokens=4 * n, batch_size=4)
  assert (cfg.backend, cfg.block_q, cfg.schedule) == (
      "mosaic", mgpu.tile_q(3), "ring")
  assert not (cfg.pack_gqa or cfg.persistent)
  cfg.validate(group_size=3)
  # Below: the group packed into the rows of two consumers, one CTA per SM.
  for tokens in (1, 4 * n - 1):
    cfg = _default(**kw, num_tokens=tokens, batch_size=4)
    assert (cfg.backend, cfg.block_q, cfg.schedule, cfg.pack_gqa,
            cfg.persistent, cfg.plan_align, cfg.short_block_q) == (
                "mosaic", 42, "pingpong", True, True, 1,
                0)  # 2-8-token sequences: main tiles
    assert cfg.num_consumers(3) == 2
    cfg.validate(group_size=3)
  for other in (dict(gpu=dispatch.INTERPRET), dict(gpu=dispatch.ADA),
                dict(dtype=jnp.float32), dict(head_dim=96)):
    assert _default(**{**kw, **other}, num_tokens=n,
                    batch_size=1).backend == "triton"
  cfg = _default(**kw, window_left=128)  # windows too
  assert (cfg.backend, cfg.pack_gqa) == ("mosaic", True)
  for d, block_k in ((128, 128), (256, 64)):  # any length
    cfg = _default(**{**kw, "head_dim": d})
    assert (cfg.backend, cfg.block_q, cfg.block_k, cfg.schedule,
            cfg.pack_gqa) == ("mosaic", mgpu.TILE_Q, block_k, "pingpong",
                              False)


def test_default_head_dim_128_persistent_where_spare_tiles_dominate():
  """On Hopper at head_dim 128, a step whose plan can have at least twice
  the tiles its tokens fill (many sequences, few prompts) runs one CTA per
  SM; prompts, windows, head_dim 256 and unknown token counts keep one CTA
  per item. The plan (tiles and bound) does not depend on the choice."""
  kw = dict(group_size=4, head_dim=128)

  def cfg_for(q_lens, **over):
    return _default(**{**kw, **over}, num_tokens=sum(q_lens),
                    batch_size=len(q_lens))

  engine_steps = ([2048] * 2 + [1] * 64,       # two prompts, decode rows
                  [512] * 4 + [4] * 60 + [1] * 64,
                  [4] * 64,                     # speculative verify step
                  [1] * 256)                    # decode only
  prompts = ([4096] * 4, [2048] * 2, [16384], [512] * 8, [1024] * 8)
  for q_lens in engine_steps:
    cfg = cfg_for(q_lens)
    assert (cfg.backend, cfg.persistent, cfg.pack_gqa) == (
        "mosaic", True, False), q_lens
    cfg.validate(group_size=4)
    assert not cfg_for(q_lens, window_left=4096).persistent
    assert not cfg_for(q_lens, head_dim=256).persistent
    # The static grid of one CTA per item: mostly tiles no token fills.
    bound = plan_lib.max_tiles(sum(q_lens), len(q_lens), cfg.block_q,
                               plan_lib.tile_min_tokens(
                                   cfg.short_block_q, cfg.split_decode_rows,
                                   cfg.decode_rows_per_seq))
    filled = sum(-(-q // cfg.block_q) for q in q_lens
                 if q > cfg.decode_rows_per_seq)
    assert bound >= 2 * (filled + 1)
  for q_lens in prompts:
    assert not cfg_for(q_lens).persistent, q_lens
  # The same plan either way: a plan made for one runs the other (the jnp
  # plan here: the plan kernel's output equals it, `test_plan_mgpu`).
  a = dataclasses.replace(cfg_for(engine_steps[0]), plan_kernel=False)
  b = dataclasses.replace(a, persistent=False)
  q_indptr = jnp.asarray(np.cumsum([0] + engine_steps[0]), jnp.int32)
  kv_lens = jnp.full((len(engine_steps[0]),), 4096, jnp.int32)
  pa, pb = (c.plan(q_indptr, kv_lens, num_tokens=4160, causal=True,
                   window_left=-1) for c in (a, b))
  np.testing.assert_array_equal(np.asarray(pa.tiles), np.asarray(pb.tiles))


def test_fp8_pages_in_kernel_run_two_consumers(cuda_lowering):
  """A 192-token (three-consumer) config on FP8 pages read in the kernel
  runs the two-consumer kernel: the lowering for CUDA must succeed (the
  three-consumer kernel refuses FP8 pages)."""
  t, hq, hkv, d, ps, pages, b = 64, 8, 2, 64, 16, 32, 4
  sds = jax.ShapeDtypeStruct
  cfg = dataclasses.replace(_mosaic(head_dim=d), fp8_pages="kernel")
  assert cfg.block_q == mgpu.tile_q(3)

  def f(q, pool, table, q_indptr, kv_lens, scale):
    return kernel.paged_prefill(q, pool, pool, table, table, q_indptr,
                                kv_lens, None, sm_scale=0.1, config=cfg,
                                k_scale=scale, v_scale=scale)
  text = jax.jit(f).trace(
      sds((t, hq, d), jnp.bfloat16),
      sds((pages, ps, hkv, d), jnp.float8_e4m3fn), sds((b, 8), jnp.int32),
      sds((b + 1,), jnp.int32), sds((b,), jnp.int32),
      sds((), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_backend_choice_and_errors():
  # Without a Hopper GPU here, the default is the Triton kernel.
  if not _hopper():
    cfg = _default(dispatch.current_gpu(), group_size=4, head_dim=128)
    assert cfg.backend == "triton" and cfg.plan_align == 1
  # Unsupported cases fall back whatever the GPU; `supports` says why.
  args = dict(dtype=jnp.bfloat16, head_dim=128, page_size=16)
  assert mgpu.supports(**args) is None
  assert mgpu.supports(**{**args, "head_dim": 64}) is None
  for kw, why in ((dict(dtype=jnp.float32), "float32"),
                  (dict(head_dim=96), "head_dim 96"),
                  (dict(page_size=4), "page_size 4"),
                  (dict(page_size=48), "page_size 48")):
    assert why in mgpu.supports(**{**args, **kw}), kw
    assert _default(**{**dict(group_size=4, head_dim=128), **kw}).backend == (
        "triton")
  cfg = _mosaic()
  assert (cfg.backend, cfg.block_q, cfg.plan_align) == ("mosaic", 128, 8)
  with pytest.raises(ValueError, match="block_q"):
    dataclasses.replace(cfg, block_q=64).validate(group_size=4)
  # 192-token tiles (three consumers) need the ring schedule.
  dataclasses.replace(cfg, block_q=192, schedule="ring").validate(4)
  dataclasses.replace(cfg, schedule="ring").validate(4)
  for kw in (dict(block_q=192), dict(schedule="round")):
    with pytest.raises(ValueError, match="schedule"):
      dataclasses.replace(cfg, **kw).validate(group_size=4)
  # Packed tiles: 64 // group tokens per consumer; groups up to 64.
  packed = dataclasses.replace(cfg, pack_gqa=True, block_q=32)
  packed.validate(group_size=4)
  assert packed.plan_align == 1
  dataclasses.replace(packed, block_q=48, schedule="ring").validate(
      group_size=4)
  with pytest.raises(ValueError, match="block_q"):
    packed.validate(group_size=3)  # expects 42 or 63
  with pytest.raises(ValueError, match="schedule"):
    dataclasses.replace(packed, block_q=48).validate(group_size=4)
  with pytest.raises(ValueError, match="group_size"):
    dataclasses.replace(packed, block_q=1).validate(group_size=65)
  with pytest.raises(ValueError, match="backend"):
    _default(group_size=4, head_dim=128, backend="cuda")
  q = jnp.zeros((16, 8, 128), jnp.bfloat16)
  pool = jnp.zeros((4, 16, 2, 128), jnp.bfloat16)
  table = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="mosaic backend"):
    kernel.paged_prefill(q, pool, pool, table, table,
                         jnp.array([0, 16], jnp.int32),
                         jnp.array([16], jnp.int32), sm_scale=0.1,
                         config=cfg, interpret=True)
  # A plan without the 8-row alignment does not fit the mosaic kernel.
  plan = plan_lib.plan_prefill(jnp.array([0, 16], jnp.int32),
                               jnp.array([16], jnp.int32), num_tokens=16,
                               block_q=128, short_block_q=cfg.short_block_q)
  with pytest.raises(ValueError, match="Invalid plan"):
    kernel.paged_prefill(q, pool, pool, table, table,
                         jnp.array([0, 16], jnp.int32),
                         jnp.array([16], jnp.int32), sm_scale=0.1,
                         config=cfg, plan=plan)
  with pytest.raises(ValueError, match="head_dim"):
    mgpu.paged_prefill_mgpu(
        jnp.zeros((16, 8, 96), jnp.bfloat16),
        jnp.zeros((4, 16, 2, 96), jnp.bfloat16),
        jnp.zeros((4, 16, 2, 96), jnp.bfloat16), table, table,
        plan.tiles, causal=True, sm_scale=0.1)
  # head_dim 256: 64-key steps by default; 128-key steps, packed tiles or
  # two FP8 staging stages do not fit in shared memory. Sequences of up to
  # 8 tokens go to the decode kernel, a token a row (no Triton short
  # launch), whatever the call's tokens per sequence (prompts, all
  # multi-token decode, or unknown).
  for tokens in (8 * 64 + 1, 8 * 64, 64):
    d256 = _default(dispatch.AMPERE, group_size=4, head_dim=256,
                    backend="mosaic", num_tokens=tokens, batch_size=64)
    assert (d256.block_q, d256.block_k, d256.pack_gqa,
            d256.short_block_q, d256.decode_rows_per_seq) == (
                128, 64, False, 0, 8)
  with pytest.raises(ValueError, match="decode_rows_per_seq"):
    dataclasses.replace(d256, decode_rows_per_seq=0).validate(group_size=4)
  assert mgpu.supports(dtype=jnp.bfloat16, head_dim=256, page_size=16,
                       block_kv=64) is None
  q256 = jnp.zeros((16, 8, 256), jnp.bfloat16)
  pool256 = jnp.zeros((4, 16, 2, 256), jnp.bfloat16)
  for kv_dtype, kw, match in (
      (jnp.float8_e4m3fn, dict(block_kv=64, k_scale=1.0, v_scale=1.0,
                               fp8_stages=2), "shared memory"),
      (jnp.bfloat16, dict(block_kv=128), "shared memory"),
      (jnp.bfloat16, dict(block_kv=64, pack_gqa=True), "shared memory")):
    with pytest.raises(ValueError, match=match):
      mgpu.paged_prefill_mgpu(q256, pool256.astype(kv_dtype),
                              pool256.astype(kv_dtype), table, table,
                              plan.tiles, causal=True, sm_scale=0.1, **kw)
  # Three consumers: the ring schedule, head_dim 64, 16-bit pages only.
  for d, kv_dtype, kw in (
      (64, jnp.bfloat16, dict(num_consumers=3)),
      (128, jnp.bfloat16, dict(num_consumers=3, schedule="ring")),
      (64, jnp.float8_e4m3fn, dict(num_consumers=3, schedule="ring",
                                   k_scale=1.0, v_scale=1.0)),
      (64, jnp.bfloat16, dict(num_consumers=4, schedule="ring")),
      (64, jnp.bfloat16, dict(schedule="round"))):
    with pytest.raises(ValueError, match="num_consumers, schedule"):
      mgpu.paged_prefill_mgpu(
          jnp.zeros((16, 8, d), jnp.bfloat16),
          jnp.zeros((4, 16, 2, d), kv_dtype),
          jnp.zeros((4, 16, 2, d), kv_dtype), table, table,
          plan.tiles, causal=True, sm_scale=0.1, **kw)


@pytest.mark.parametrize(
    "num_tokens,page_size,head_dim,causal,soft_cap,sinks,fp8,consumers,"
    "schedule,pack,persistent,window_left", [
        # (..., pack, persistent, window_left) last.
        (512, 16, 128, True, None, False, False, 2, "pingpong", 0, 0, -1),
        (300, 8, 64, True, None, True, False, 2, "pingpong", 0, 0, -1),  # q pad
        (256, 256, 128, False, 30.0, False, False, 2, "pingpong", 0, 0, -1),
        (384, 64, 128, True, 50.0, True, False, 2, "pingpong", 0, 0, -1),
        # FP8 pages: TMA into the staging ring, the producer converts.
        (512, 16, 128, True, None, False, True, 2, "pingpong", 0, 0, -1),
        (300, 8, 64, False, 30.0, True, True, 2, "pingpong", 0, 0, -1),
        # The token ring: two consumers, and three at head_dim 64.
        (384, 64, 128, True, 50.0, True, False, 2, "ring", 0, 0, -1),
        (300, 8, 64, True, None, True, False, 3, "ring", 0, 0, -1),
        (512, 256, 64, False, 30.0, False, False, 3, "ring", 0, 0, -1),
        # The group packed into the rows (per-thread q loads and stores),
        # one CTA per SM, and both.
        (300, 16, 64, True, None, True, False, 2, "pingpong", 1, 1, -1),
        (384, 64, 128, True, 50.0, False, True, 2, "pingpong", 1, 0, -1),
        (300, 8, 64, False, 30.0, True, False, 3, "ring", 0, 1, -1),
        # Sliding windows: steps from the first key's block, edge masks.
        (512, 16, 128, True, None, True, False, 2, "pingpong", 0, 0, 100),
        (300, 16, 64, True, 30.0, False, False, 2, "pingpong", 1, 1, 7),
        (300, 8, 64, False, None, True, False, 3, "ring", 0, 1, 64),
        (384, 64, 128, True, None, False, True, 2, "pingpong", 1, 0, 300),
        # head_dim 256: output tiles in the q tiles' memory, 64-key steps.
        (512, 16, 256, True, None, True, False, 2, "pingpong", 0, 0, -1),
        (300, 8, 256, True, 50.0, False, False, 2, "ring", 0, 1, 511),
        # ... with FP8 pages: one 64-key staging stage, 128-column converts.
        (512, 16, 256, True, None, True, True, 2, "pingpong", 0, 0, -1),
        (300, 8, 256, False, 50.0, False, True, 2, "ring", 0, 1, 511),
        # ... with per-KV-head scales, read per item.
        (384, 64, 128, True, 50.0, False, "head", 2, "pingpong", 1, 1, -1),
        (300, 8, 64, True, None, True, "head", 2, "pingpong", 0, 0, 7),
        (300, 8, 256, False, 50.0, False, "head", 2, "ring", 0, 1, 511),
    ])
def test_kernel_lowers_to_mosaic_gpu(num_tokens, page_size, head_dim, causal,
                                     soft_cap, sinks, fp8, consumers,
                                     schedule, pack, persistent, window_left):
  """Cross-lowers the kernel for CUDA on the CPU: every TMA slice, layout and
  barrier of the Mosaic-GPU lowering (and the per-thread row copies of
  packed tiles) must be accepted, and (FP8, three consumers) the buffers
  must fit in shared memory. FP8 scales per tensor or (`fp8="head"`) per
  KV head."""
  hq, hkv, b, pages = 8, 2, 3, 64
  sds = jax.ShapeDtypeStruct
  kv_dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
  args = [sds((num_tokens, hq, head_dim), jnp.bfloat16),
          sds((pages, page_size, hkv, head_dim), kv_dtype),
          sds((pages, page_size, hkv, head_dim), kv_dtype),
          sds((b, 16), jnp.int32), sds((b, 16), jnp.int32),
          sds((plan_lib.max_tiles(
              num_tokens, b, mgpu.tile_q(consumers, hq // hkv if pack else 1)),
               plan_lib.NUM_FIELDS), jnp.int32),
          sds((hq,), jnp.float32) if sinks else None]
  scales = dict(num_consumers=consumers, schedule=schedule,
                pack_gqa=bool(pack), persistent=bool(persistent),
                window_left=window_left,
                block_kv=64 if head_dim == 256 else 128)
  if fp8:
    shape = (hkv,) if fp8 == "head" else ()
    scales.update(k_scale=sds(shape, jnp.float32),
                  v_scale=sds(shape, jnp.float32))
  lowered = mgpu.paged_prefill_mgpu.trace(
      *args, causal=causal, sm_scale=head_dim ** -0.5,
      logits_soft_cap=soft_cap, **scales).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "mosaic_gpu" in text


def _hopper() -> bool:
  return dispatch.current_gpu().is_hopper


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize(
    "page_size,group,d,causal,soft_cap,sinks,padding,q_lens,kv_lens", [
        (16, 4, 128, True, None, False, 5, [300, 1, 77, 129],
         [300, 500, 200, 129]),
        (8, 1, 64, True, None, True, 300, [300, 1, 77, 129],
         [300, 500, 200, 129]),
        (128, 8, 128, False, 30.0, False, 5, [300, 1, 77, 129],
         [300, 500, 200, 129]),
        # Steps with no prompt at all: decode rows, a short chunk and a
        # padding pseudo-sequence spanning several tiles (negative positions).
        (16, 4, 128, True, None, False, 250, [1, 1, 4], [700, 9, 300]),
        (16, 4, 64, True, None, False, 136, [0], [0]),
    ])
@pytest.mark.parametrize("persistent", [False, True])
def test_matches_oracle_gpu(page_size, group, d, causal, soft_cap, sinks,
                            padding, q_lens, kv_lens, persistent):
  """NaN in every page a sequence does not own and past kv_len; ragged,
  unaligned sequence starts, decode rows and padding tokens; one CTA per
  item or one per SM."""
  cfg = _mosaic(group, d, page_size)
  cfg = dataclasses.replace(cfg, persistent=persistent)
  _check_oracle(cfg, page_size, group, d, causal, soft_cap, sinks, padding,
                q_lens, kv_lens)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize(
    "page_size,group,causal,soft_cap,sinks,padding,q_lens,kv_lens,window",
    [
        # Gemma 3 270M's group and its sliding layers' window; odd lengths.
        (16, 4, True, None, False, 5, [300, 1, 7, 129, 1500],
         [300, 500, 200, 129, 1501], -1),
        (16, 4, True, None, True, 3, [2000, 7, 300], [2000, 900, 300], 511),
        # Gemma 2's soft cap, group 2; page sizes 8 and 64; not causal.
        (8, 2, True, 50.0, False, 250, [1, 1, 4, 191], [700, 9, 300, 191],
         -1),
        (64, 1, False, None, True, 9, [300, 1, 77, 129], [300, 500, 200, 129],
         -1),
    ])
@pytest.mark.parametrize("schedule,persistent", [("pingpong", False),
                                                 ("ring", True)])
def test_head_dim_256_matches_oracle_gpu(page_size, group, causal, soft_cap,
                                         sinks, padding, q_lens, kv_lens,
                                         window, schedule, persistent):
  """Head_dim 256 (output tiles in the q tiles' shared memory, 64-key
  steps), the default at that size: against the float64 oracle with NaN in
  unowned pages and past kv_len, decode rows, padding, released pages
  before a window; one CTA per tile, or one per SM taking several (the
  next item's q lands where the last item's output was stored from)."""
  cfg = _default(dispatch.current_gpu(), group_size=group, head_dim=256,
                 page_size=page_size, window_left=window,
                 num_tokens=sum(q_lens) + padding, batch_size=len(q_lens))
  assert (cfg.backend, cfg.block_k) == ("mosaic", 64)
  cfg = dataclasses.replace(cfg, schedule=schedule, persistent=persistent)
  _check_oracle(cfg, page_size, group, 256, causal, soft_cap, sinks, padding,
                q_lens, kv_lens, window_left=window)


# Oracle cases of both ring-schedule tests: (page_size, group, d, causal,
# soft_cap, sinks, padding, q_lens, kv_lens).
_RING_CASES = [
    (16, 3, 64, True, None, False, 5, [300, 1, 77, 129, 4095],
     [300, 500, 200, 129, 4095]),
    (8, 1, 64, True, None, True, 300, [300, 1, 7, 193],
     [300, 500, 200, 400]),
    (128, 8, 64, False, 30.0, False, 5, [300, 1, 77, 129],
     [300, 500, 200, 129]),
    (16, 5, 64, True, 50.0, True, 250, [1, 1, 4, 191], [700, 9, 300, 191]),
]


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("block_q,schedule", [(128, "ring"), (192, "ring")])
@pytest.mark.parametrize(
    "page_size,group,d,causal,soft_cap,sinks,padding,q_lens,kv_lens",
    _RING_CASES + [
        (16, 4, 64, True, None, False, 136, [0], [0]),
        (64, 4, 128, True, None, True, 9, [300, 1, 77, 129],
         [300, 500, 200, 129]),
    ])
def test_schedules_match_oracle_gpu(block_q, schedule, page_size, group, d,
                                    causal, soft_cap, sinks, padding, q_lens,
                                    kv_lens):
  """The ring schedule with two and three consumers: the oracle cases above
  plus groups 1-8, a 4,095-token prompt and tiles of 191 / 193 tokens."""
  if block_q == 192 and d != 64:
    pytest.skip("three consumers serve head_dim 64 only")
  cfg = dataclasses.replace(
      _mosaic(group, d, page_size),
      block_q=block_q, schedule=schedule)
  _check_oracle(cfg, page_size, group, d, causal, soft_cap, sinks, padding,
                q_lens, kv_lens)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("consumers,schedule", [(2, "pingpong"),
                                                (3, "ring")])
@pytest.mark.parametrize(
    "page_size,group,d,causal,soft_cap,sinks,padding,q_lens,kv_lens",
    _RING_CASES + [
        (16, 7, 64, True, None, False, 3, [129, 7, 43], [4095, 7, 60]),
        # Some 240 (kv head, tile) items: persistent CTAs take two or more,
        # each item's q rows (and sinks) copied while the one before runs.
        (16, 3, 64, True, None, True, 7, [2000, 1500, 1100, 333],
         [2000, 1600, 1100, 400]),
        (16, 6, 128, True, None, True, 9, [300, 1, 77, 129],
         [300, 500, 200, 129]),
        (64, 4, 128, True, None, False, 136, [0], [0]),
        (32, 2, 128, False, 30.0, False, 0, [511, 1], [700, 1]),
    ])
def test_packed_gqa_matches_oracle_gpu(persistent, consumers, schedule,
                                       page_size, group, d, causal, soft_cap,
                                       sinks, padding, q_lens, kv_lens):
  """The GQA group packed into the tile rows (`pack_gqa`): groups
  1-8, 64 // group tokens per consumer, rows loaded and stored per thread;
  NaN-poisoned pages, ragged starts, decode rows, padding, a prompt of
  4,095 tokens and one chunk at kv 4,095; one CTA per item, or one per SM
  (`persistent`) with the K/V ring running on across items and
  each item's q rows copied during the item before."""
  if consumers == 3 and d != 64:
    pytest.skip("three consumers serve head_dim 64 only")
  cfg = dataclasses.replace(
      _mosaic(group, d, page_size),
      pack_gqa=True, block_q=mgpu.tile_q(consumers, group),
      schedule=schedule, persistent=persistent)
  _check_oracle(cfg, page_size, group, d, causal, soft_cap, sinks, padding,
                q_lens, kv_lens)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("d,page_size,group,window,sinks,q_lens,kv_lens", [
    (64, 16, 3, -1, False, [4, 8, 2, 300, 1, 7, 3],
     [2048, 900, 5, 300, 500, 7, 4095]),
    (64, 8, 1, 64, False, [5, 2, 129, 8, 1], [700, 2, 129, 1000, 90]),
    (64, 16, 8, 100, False, [6, 1500, 3, 2], [3000, 1500, 130, 2]),
    (256, 16, 4, -1, False, [4, 8, 2, 300, 1, 7, 3, 9],
     [2048, 900, 5, 300, 500, 7, 4095, 9]),
    (128, 8, 1, 64, True, [5, 2, 129, 16, 1, 17], [700, 2, 129, 1000, 90, 40]),
    (128, 16, 6, 100, False, [6, 1500, 3, 2, 8], [3000, 1500, 130, 2, 4095]),
    (256, 32, 2, 511, True, [3, 600, 8, 1], [4095, 600, 1200, 77]),
    # All multi-token decode (a verify step): 4 rows a CTA on 16 columns.
    (128, 16, 4, -1, False, [4, 4, 3, 8, 1, 2], [2048, 900, 5, 300, 77, 2]),
])
def test_default_runs_multi_token_rows_gpu(d, page_size, group, window,
                                           sinks, q_lens, kv_lens):
  """The default Mosaic-GPU configs have no (Pallas-Triton) short launch.
  Packed (head_dim 64): sequences of 2-8 new tokens (multi-token decode)
  run as tiles of the main launch. Unpacked (head_dim 128 / 256): those of
  up to `decode_rows_per_seq` tokens (8; 16 at group 1) run in the decode
  kernel, a decode query per token with its own key count, several per
  CTA. Beside prompts and split-K decode rows, or alone (a verify step);
  against the float64 oracle with NaN in unowned pages and past kv_len,
  with and without a window and sinks."""
  cfg = _default(dispatch.current_gpu(), group_size=group, head_dim=d,
                 page_size=page_size,
                       dtype=jnp.bfloat16, window_left=window,
                       num_tokens=sum(q_lens) + 5, batch_size=len(q_lens))
  assert cfg.backend == "mosaic" and cfg.short_block_q == 0
  assert cfg.pack_gqa == (d == 64)
  assert cfg.decode_rows_per_seq == (1 if d == 64 else max(8, 16 // group))
  _check_oracle(cfg, page_size, group, d, True, None, sinks, 5, q_lens,
                kv_lens, window_left=window)


def _release_before_window(p, q_lens, kv_lens, page_size, window_left):
  """As a sliding-window cache does: the pages wholly before the window of
  a prompt's first token go back to the pool (NaN there, -1 in the table)
  for sequences of more than 16 new tokens (the main launch's)."""
  pool = np.array(p.kv_cache.astype(jnp.float32))
  table = p.page_table.copy()
  for b, (ql, n) in enumerate(zip(q_lens, kv_lens)):
    if ql > 16:
      gone = max(n - ql - window_left, 0) // page_size
      pool[table[b, :, :gone].ravel()] = np.nan
      table[b, :, :gone] = -1
  p.kv_cache = jnp.asarray(pool, p.kv_cache.dtype)
  p.page_table = table


def _check_oracle(cfg, page_size, group, d, causal, soft_cap, sinks, padding,
                  q_lens, kv_lens, window_left=-1):
  rng = np.random.default_rng(page_size * 7 + group + padding)
  hkv = 2
  p = make_paged(rng, kv_lens, page_size=page_size, num_kv_heads=hkv,
                 head_dim=d, dtype=jnp.bfloat16, fmt="pool")
  if window_left >= 0:
    _release_before_window(p, q_lens, kv_lens, page_size, window_left)
  hq = hkv * group
  t = sum(q_lens) + padding
  q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.bfloat16)
  q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  s = (jnp.asarray(rng.standard_normal(hq) * 2, jnp.float32)
       if sinks else None)
  view = _kv.make_view(p.kv_cache, jnp.asarray(p.page_table))
  out, lse = kernel.paged_prefill(
      q, view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(q_indptr), jnp.asarray(p.kv_lens), s, causal=causal,
      sm_scale=d ** -0.5, logits_soft_cap=soft_cap, config=cfg,
      window_left=window_left)
  out = np.asarray(out.astype(jnp.float32))
  lse = np.asarray(lse)
  qf = np.asarray(q.astype(jnp.float32))
  for b, (n, ql) in enumerate(zip(kv_lens, q_lens)):
    if ql == 0:
      continue
    exp, exp_lse = dense_attention(
        qf[q_indptr[b]:q_indptr[b + 1]], p.k[b], p.v[b],
        np.arange(n - ql, n), n, causal=causal, window_left=window_left,
        sm_scale=d ** -0.5, logits_soft_cap=soft_cap,
        sinks=None if s is None else np.asarray(s))
    np.testing.assert_allclose(out[q_indptr[b]:q_indptr[b + 1]], exp,
                               atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse[q_indptr[b]:q_indptr[b + 1]], exp_lse,
                               atol=2e-2, rtol=2e-2)
  assert (out[q_indptr[-1]:] == 0).all()
  assert np.isneginf(lse[q_indptr[-1]:]).all()


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("form", ["unpacked", "packed", "packed ring"])
@pytest.mark.parametrize(
    "page_size,group,d,causal,soft_cap,sinks,padding,q_lens,kv_lens,window",
    [
        (16, 4, 128, True, None, True, 5, [1500, 1, 77, 129],
         [1500, 500, 200, 4095], 100),
        (16, 3, 64, True, 30.0, False, 3, [2000, 7, 300], [2000, 900, 300],
         7),
        (8, 1, 64, False, None, True, 0, [300, 1, 129], [700, 500, 129], 64),
        (64, 5, 64, True, None, False, 9, [1000, 33], [3000, 33], 1000),
        (128, 8, 128, True, None, False, 0, [700], [700], 127),
    ])
def test_window_matches_oracle_gpu(form, page_size, group, d, causal,
                                   soft_cap, sinks, padding, q_lens, kv_lens,
                                   window):
  """Sliding windows (`window_left`) against the float64 oracle: windows of
  7 keys to 1,000, causal or not, chunks at kv 3,000 / 4,095, decode rows;
  the pages before each prompt's window released (NaN, -1 in the table),
  besides NaN in unowned pages and past kv_len; one query head per CTA,
  or the group packed into the rows, persistent (two consumers in ping-pong
  or three in the ring)."""
  if form == "packed ring" and d != 64:
    pytest.skip("three consumers serve head_dim 64 only")
  cfg = _mosaic(group, d, page_size)
  if form != "unpacked":
    n = 3 if form == "packed ring" else 2
    cfg = dataclasses.replace(
        cfg, pack_gqa=True, block_q=mgpu.tile_q(n, group),
        schedule="ring" if n == 3 else "pingpong", persistent=True)
  _check_oracle(cfg, page_size, group, d, causal, soft_cap, sinks, padding,
                q_lens, kv_lens, window_left=window)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("fmt,page_size,group,d,causal,soft_cap,pack", [
    (*case, pack) for pack in (False, True) for case in (
        ("pool", 16, 4, 128, True, None),
        ("pair", 8, 1, 64, True, None),
        ("flashinfer", 128, 8, 128, False, 30.0),
        ("pool", 16, 3, 64, True, None))] + [
    # head_dim 256: unpacked tiles, one 64-key staging stage.
    ("pool", 16, 4, 256, True, None, False),
    ("flashinfer", 64, 2, 256, True, 50.0, False),
    ("pair", 8, 8, 256, False, None, False),
    # Unpacked tiles on one CTA per SM (the head_dim-128 default for steps
    # of many sequences): the staging ring runs on across items.
    ("pool", 16, 4, 128, True, None, "persistent"),
    ("flashinfer", 128, 8, 128, False, 30.0, "persistent"),
])
def test_fp8_pages_match_oracle_gpu(fmt, page_size, group, d, causal,
                                    soft_cap, pack):
  """FP8 pages through the mosaic backend (the producer warpgroup converts
  TMA-staged tiles) against the float64 oracle over the dequantised pages;
  NaN in every page no sequence owns and past kv_len; decode rows, padding;
  tiles packed or not, one CTA per item or per SM."""
  from attention_utils import fp8_paged as _fp8_paged  # noqa: PLC0415
  rng = np.random.default_rng(page_size + group)
  hkv = 2
  q_lens, kv_lens, padding = [300, 1, 77, 129], [300, 500, 200, 129], 11
  p, cache, tk, tv, ks, vs = _fp8_paged(rng, kv_lens, page_size=page_size,
                                        num_kv_heads=hkv, head_dim=d, fmt=fmt)
  hq = hkv * group
  t = sum(q_lens) + padding
  q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.bfloat16)
  q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  view = _kv.make_view(cache, jnp.asarray(p.page_table))
  cfg = _mosaic(group, d, page_size)
  if pack == "persistent":
    cfg = dataclasses.replace(cfg, persistent=True)
  elif pack:  # three consumers become two for FP8 pages in paged_prefill
    cfg = dataclasses.replace(cfg, pack_gqa=True,
                              block_q=mgpu.tile_q(3 if d == 64 else 2, group),
                              persistent=True)
  cfg = dataclasses.replace(cfg, fp8_pages="kernel")
  out, _ = kernel.paged_prefill(
      q, view.k_pool, view.v_pool, view.k_table, view.v_table,
      jnp.asarray(q_indptr), jnp.asarray(kv_lens), None, causal=causal,
      sm_scale=d ** -0.5, logits_soft_cap=soft_cap, config=cfg,
      k_scale=jnp.float32(ks), v_scale=jnp.float32(vs))
  out = np.asarray(out.astype(jnp.float32))
  qf = np.asarray(q.astype(jnp.float32))
  for b, (n, ql) in enumerate(zip(kv_lens, q_lens)):
    exp, _ = dense_attention(
        qf[q_indptr[b]:q_indptr[b + 1]], tk[b], tv[b], np.arange(n - ql, n),
        n, causal=causal, window_left=-1, sm_scale=d ** -0.5,
        logits_soft_cap=soft_cap)
    np.testing.assert_allclose(out[q_indptr[b]:q_indptr[b + 1]], exp,
                               atol=2e-2, rtol=2e-2)
  assert (out[q_indptr[-1]:] == 0).all()


@pytest.mark.parametrize("fp8", [False, True])
def test_head_dim_256_default_on_hopper(fake_gpu, fp8):
  """Cross-lowered for CUDA as on a Hopper GPU, the default at head_dim 256
  runs the main launch on the Mosaic-GPU kernel with 16-bit pages and with
  FP8 pages read in the kernel alike, on the step's plan: no Pallas-Triton
  launch is left."""
  import re
  fake_gpu(dispatch.HOPPER)
  t, hq, hkv, d, ps, pages, b = 48, 8, 2, 256, 16, 32, 3
  sds = jax.ShapeDtypeStruct
  kv_dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
  scales = dict(k_scale=0.5, v_scale=0.25) if fp8 else {}

  def f(q, pool, table, q_indptr, kv_lens):
    cfg = _default(dispatch.current_gpu(), group_size=hq // hkv,
                   head_dim=d, page_size=ps, kv_dtype=kv_dtype,
                   num_tokens=t, batch_size=b)
    plan = cfg.plan(q_indptr, kv_lens, num_tokens=t, causal=True,
                    window_left=-1)  # a step's plan, made for the default
    return kernel.paged_prefill(q, pool, pool, table[:, 0], table[:, 1],
                                q_indptr, kv_lens, None, sm_scale=0.1,
                                plan=plan, **scales)
  text = jax.jit(f).trace(
      sds((t, hq, d), jnp.bfloat16), sds((pages, ps, hkv, d), kv_dtype),
      sds((b, 2, 8), jnp.int32), sds((b + 1,), jnp.int32),
      sds((b,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  # Three Mosaic-GPU launches: the step's plan (a replanned call would run
  # the plan kernel once more), the main launch and the decode rows'.
  calls = re.findall(r"custom_call @(\w+)", text)
  assert len(calls) == 3 and all(c.startswith("mosaic_gpu") for c in calls)
  # Pallas-Triton kernels are named `paged_prefill_bq{block_q}_...`.
  assert not re.search(r"paged_prefill_bq\d+", text)


def test_mosaic_path_has_no_pool_copies(cuda_lowering):
  """Cross-lowered for CUDA, the mosaic path (main launch, short launch,
  decode rows) hands the pool to its kernels as is: no op other than a call
  or a kernel custom call touches a pool-shaped tensor."""
  import re
  t, hq, hkv, d, ps, pages, b = 512, 8, 2, 128, 16, 64, 3
  sds = jax.ShapeDtypeStruct
  cfg = _mosaic()

  def f(q, pool, table, q_indptr, kv_lens):
    return kernel.paged_prefill(q, pool, pool, table[:, 0], table[:, 1],
                                q_indptr, kv_lens, None, sm_scale=0.1,
                                config=cfg)
  text = jax.jit(f).trace(
      sds((t, hq, d), jnp.bfloat16), sds((pages, ps, hkv, d), jnp.bfloat16),
      sds((b, 2, 16), jnp.int32), sds((b + 1,), jnp.int32),
      sds((b,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  pool_type = f"tensor<{pages}x{ps}x{hkv}x{d}xbf16>"
  ops = set()
  for line in text.splitlines():
    m = re.match(r"\s*%\S+ = (\S+)", line)
    if m and pool_type in line:
      ops.add(m.group(1))
  assert ops and ops <= {"call", "stablehlo.custom_call"}, ops
