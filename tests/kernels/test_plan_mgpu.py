"""The prefill plan as one Mosaic-GPU launch (`pallas_kernels/plan_mgpu.py`).

On the CPU CI: its limits and errors, a cross-lowering for CUDA of every
option, and `paged_prefill.MosaicConfig.plan`'s routing (the kernel for mosaic
configs on Hopper, the jnp plan elsewhere). On a Hopper GPU: the kernel's
plan equals `plan.plan_prefill`'s (the pure-jnp reference) bit for bit, on
random batches of prompts, multi-token and single-token decode, empty
sequences and padding, over one CTA and several.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import paged_prefill as prefill
from pkvattn.pallas_kernels import plan as plan_lib
from pkvattn.pallas_kernels import plan_mgpu

OPTIONS = [
    dict(),
    dict(short_block_q=8, split_decode_rows=True, align=8),
    dict(longest_first=False, causal=False, window_left=30),
    dict(short_block_q=4, window_left=100),
    dict(split_decode_rows=True, align=64, longest_first=False),
    dict(split_decode_rows=True, decode_rows_per_seq=8, align=8),
    dict(split_decode_rows=True, decode_rows_per_seq=3, short_block_q=8,
         window_left=100),
]


def _batch(rng, batch_size, max_len, padding):
  """q_indptr / kv_lens of `batch_size` sequences: prompts up to
  `max_len` tokens, 2-8-token and 1-token rows, empty ones; kv lengths
  from the new tokens to 4,096 more."""
  kind = rng.integers(0, 4, batch_size)
  q_lens = np.where(kind == 0, rng.integers(9, max(max_len, 9) + 1,
                                            batch_size),
                    np.where(kind == 1, rng.integers(2, 9, batch_size),
                             np.where(kind == 2, 1, 0)))
  kv_lens = q_lens + rng.integers(0, 4097, batch_size)
  q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return q_indptr, kv_lens.astype(np.int32), int(q_indptr[-1]) + padding


def test_supports_and_errors():
  assert plan_mgpu.supports(num_tokens=4096, batch_size=64, block_q=42,
                            align=1) is None
  assert "exceed" in plan_mgpu.supports(num_tokens=1 << 16, batch_size=4,
                                        block_q=16, align=1)
  assert "exceed" in plan_mgpu.supports(num_tokens=8, batch_size=2048,
                                        block_q=128, align=1)
  # 2,000 sequences of 8,192 tokens: 2,065 tiles, unless sequences of up
  # to 8 tokens run as decode rows (at most 910 sequences take tiles).
  assert "exceed" in plan_mgpu.supports(num_tokens=8192, batch_size=2000,
                                        block_q=128, align=8)
  assert plan_mgpu.supports(num_tokens=8192, batch_size=2000, block_q=128,
                            align=8, min_tokens=9) is None
  assert "no sequences" in plan_mgpu.supports(num_tokens=8, batch_size=0,
                                              block_q=8, align=1)
  assert "power of two" in plan_mgpu.supports(num_tokens=8, batch_size=1,
                                              block_q=8, align=6)
  lens = jnp.zeros((3,), jnp.int32)
  with pytest.raises(ValueError, match="q_indptr shape"):
    plan_mgpu.plan_prefill_mgpu(jnp.zeros((3,), jnp.int32), lens,
                                num_tokens=8, block_q=8)
  with pytest.raises(ValueError, match="exceed"):
    plan_mgpu.plan_prefill_mgpu(jnp.zeros((4,), jnp.int32), lens,
                                num_tokens=1 << 16, block_q=16)


@pytest.mark.parametrize("kw", OPTIONS, ids=str)
def test_lowers_to_mosaic_gpu(kw):
  """Cross-lowered for CUDA (no GPU needed): one Mosaic-GPU custom call and
  nothing else of the plan's ops (no sort, reduce, scatter or gather)."""
  q_indptr, kv_lens, num_tokens = _batch(np.random.default_rng(0), 40, 300,
                                         5)

  def f(qi, kl):
    p = plan_mgpu.plan_prefill_mgpu(qi, kl, num_tokens=num_tokens,
                                    block_q=42, **kw)
    return p.tiles, p.short_tiles, p.decode_rows, p.decode_kv_lens
  text = jax.jit(f).trace(jnp.asarray(q_indptr), jnp.asarray(
      kv_lens)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
  for op in ("sort", "reduce", "scatter", "gather"):
    assert f"stablehlo.{op}" not in text


@pytest.mark.parametrize("hopper", [True, False])
def test_config_plan_routing(fake_gpu, hopper):
  """`MosaicConfig.plan` takes the kernel on Hopper (unless `plan_kernel=
  False` or the plan is too large), the jnp plan otherwise (and for a
  `TritonConfig`)."""
  fake_gpu(dispatch.HOPPER if hopper else dispatch.ADA)

  def config(backend):
    return dispatch.prefill(
        gpu=dispatch.HOPPER, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
        head_dim=64, group_size=3, page_size=16, num_tokens=512,
        batch_size=8, backend=backend).config
  cfg = config("mosaic")
  q_indptr, kv_lens, _ = _batch(np.random.default_rng(1), 8, 100, 0)
  for c, num_tokens, want in (
      (cfg, 512, hopper),
      (dataclasses.replace(cfg, plan_kernel=False), 512, False),
      (cfg, plan_mgpu.MAX_ROWS * cfg.block_q, False),
      (config("triton"), 512, False)):
    text = jax.jit(lambda qi, kl, c=c, n=num_tokens: c.plan(
        qi, kl, num_tokens=n, causal=True, window_left=-1).tiles).trace(
            jnp.asarray(q_indptr), jnp.asarray(kv_lens)).lower(
                lowering_platforms=("cuda",)).as_text()
    assert ("@mosaic_gpu" in text) == want


def _hopper() -> bool:
  return dispatch.current_gpu().is_hopper


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("kw", OPTIONS, ids=str)
@pytest.mark.parametrize("batch_size,max_len,padding,block_q", [
    (1, 1, 0, 42),        # one decode row
    (5, 40, 3, 16),       # one CTA
    (64, 256, 7, 42),     # ~400 tiles: four CTAs
    (300, 700, 0, 21),    # more sequences than threads; ~4,500 tiles?
    (130, 2000, 11, 128),
])
def test_matches_jnp_plan_gpu(kw, batch_size, max_len, padding, block_q):
  """The kernel's tiles, short tiles, decode rows and their key counts
  equal `plan.plan_prefill`'s, every field, in order."""
  rng = np.random.default_rng(batch_size * 7 + max_len + block_q)
  q_indptr, kv_lens, num_tokens = _batch(rng, batch_size, max_len, padding)
  if num_tokens == 0:
    num_tokens = 1
  if plan_mgpu.supports(num_tokens=num_tokens, batch_size=batch_size,
                        block_q=block_q, align=kw.get("align", 1)):
    num_tokens = min(num_tokens, (plan_mgpu.MAX_ROWS - batch_size - 1)
                     * block_q)
    q_indptr = np.minimum(q_indptr, num_tokens).astype(np.int32)
  args = (jnp.asarray(q_indptr), jnp.asarray(kv_lens))
  got = jax.jit(lambda qi, kl: plan_mgpu.plan_prefill_mgpu(
      qi, kl, num_tokens=num_tokens, block_q=block_q, **kw))(*args)
  want = jax.jit(lambda qi, kl: plan_lib.plan_prefill(
      qi, kl, num_tokens=num_tokens, block_q=block_q, **kw))(*args)
  assert got.decode_rows_per_seq == want.decode_rows_per_seq
  for name in ("tiles", "short_tiles", "decode_rows", "decode_kv_lens"):
    a, b = getattr(got, name), getattr(want, name)
    assert (a is None) == (b is None), name
    if a is not None:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=name)


def _default_call_on_hopper(fake_gpu, t, hq, hkv, d, b, ps=16, pages=32):
  """The StableHLO of a default `paged_prefill` call (plan computed in the
  call; `b` sequences of up to 128 keys), cross-lowered for CUDA as on a
  Hopper GPU."""
  fake_gpu(dispatch.HOPPER)
  sds = jax.ShapeDtypeStruct

  def f(q, pool, table, q_indptr, kv_lens):
    return prefill.paged_prefill(q, pool, pool, table, table, q_indptr,
                                 kv_lens, None, sm_scale=d ** -0.5)
  return jax.jit(f).trace(
      sds((t, hq, d), jnp.bfloat16), sds((pages, ps, hkv, d), jnp.bfloat16),
      sds((b, 8), jnp.int32), sds((b + 1,), jnp.int32),
      sds((b,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()


def test_packed_call_on_hopper_is_three_kernels(fake_gpu):
  """Cross-lowered for CUDA as on a Hopper GPU, a default head_dim-64 call
  (plan computed in the call) is three Mosaic-GPU launches: the plan, the
  packed main kernel and the decode kernel that reads its one-token rows
  from q and writes them into the output (one split here: in place). No
  XLA sort, scatter or gather is left around them."""
  text = _default_call_on_hopper(fake_gpu, t=64, hq=9, hkv=3, d=64, b=4)
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 3
  for op in ("sort", "scatter", "gather"):
    assert f"stablehlo.{op}" not in text


@pytest.mark.parametrize("t,b,hq,hkv,d", [
    (64, 4, 4, 1, 256),    # Gemma 3 270M heads, 16 tokens a sequence
    (64, 8, 4, 1, 256),    # at most 8 a sequence: a verify step
    (64, 8, 8, 2, 128),    # the same at head_dim 128 (16 MMA columns)
])
def test_unpacked_call_on_hopper_has_no_triton_launch(fake_gpu, t, b, hq, hkv,
                                                      d):
  """Cross-lowered for CUDA as on a Hopper GPU, a default head_dim-128 /
  256 call (plan computed in the call) is Mosaic-GPU launches only: the
  plan, the main kernel and the decode kernel, which also takes the
  2-8-token sequences (no Pallas-Triton short launch), whether or not the
  call may be all multi-token decode, and no XLA scatter of the main
  kernel's lse. (128 keys a sequence: one split for the decode rows,
  nothing to combine or scatter.)"""
  cfg = dispatch.prefill(gpu=dispatch.HOPPER, dtype=jnp.bfloat16,
                         kv_dtype=jnp.bfloat16, head_dim=d,
                         group_size=hq // hkv, page_size=16, num_tokens=t,
                         batch_size=b).config
  assert cfg.short_block_q == 0 and cfg.decode_rows_per_seq == 8
  text = _default_call_on_hopper(fake_gpu, t=t, hq=hq, hkv=hkv, d=d, b=b)
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 3
  assert "triton" not in text
  for op in ("sort", "scatter", "gather"):
    assert f"stablehlo.{op}" not in text


def test_supports_at_its_bounds():
  """`supports`'s documented limits, each at its edge: `MAX_ROWS` tiles
  (`plan.max_tiles` with `min_tokens`) and `MAX_ROWS - 1` sequences are
  taken, one more of either is not; `align` a power of two."""
  n = plan_mgpu.MAX_ROWS
  # 8 tokens a tile, one sequence: num_tokens // 8 + 1 + 1 tiles.
  assert plan_mgpu.supports(num_tokens=8 * (n - 2), batch_size=1, block_q=8,
                            align=1) is None
  assert "exceed" in plan_mgpu.supports(num_tokens=8 * (n - 1), batch_size=1,
                                        block_q=8, align=1)
  # min_tokens bounds the sequences with tiles: 1.5n tokens in 1.5n-token
  # tiles, n - 1 sequences: 1 + (n - 1) + 1 tiles (min_tokens 1, the
  # default), or with 2 tokens or more a sequence 1 + 0.75n + 1.
  kw = dict(num_tokens=3 * n // 2, batch_size=n - 1, block_q=3 * n // 2,
            align=1)
  assert "exceed" in plan_mgpu.supports(**kw)
  assert plan_mgpu.supports(**kw, min_tokens=2) is None
  assert plan_mgpu.supports(num_tokens=1, batch_size=n - 1, block_q=8,
                            align=1) is None
  assert "exceed" in plan_mgpu.supports(num_tokens=1, batch_size=n,
                                        block_q=8, align=1)
  for align in (1, 2, 4, 8, 64, 128):
    assert plan_mgpu.supports(num_tokens=64, batch_size=3, block_q=128,
                              align=align) is None
  for align in (0, -1, -4, 3, 6, 12, 24):
    assert "power of two" in plan_mgpu.supports(
        num_tokens=64, batch_size=3, block_q=128, align=align)


@pytest.mark.parametrize("kw", OPTIONS + [dict(
    short_block_q=1, split_decode_rows=True, decode_rows_per_seq=2)], ids=str)
def test_plan_shapes_as_the_jnp_plan(kw):
  """Traced on the CPU (no launch): the kernel's plan has the fields,
  shapes, dtypes and static sizes of `plan.plan_prefill`'s for the same
  arguments, and rejects what it documents."""
  sds = jax.ShapeDtypeStruct
  for b, num_tokens, block_q in ((1, 1, 42), (7, 300, 16), (130, 900, 128)):
    args = (sds((b + 1,), jnp.int32), sds((b,), jnp.int32))
    got = jax.eval_shape(lambda qi, kl, n=num_tokens, q=block_q: (
        plan_mgpu.plan_prefill_mgpu(qi, kl, num_tokens=n, block_q=q, **kw)),
                         *args)
    want = jax.eval_shape(lambda qi, kl, n=num_tokens, q=block_q: (
        plan_lib.plan_prefill(qi, kl, num_tokens=n, block_q=q, **kw)), *args)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert jax.tree.leaves(got) == jax.tree.leaves(want)
  lens = sds((4,), jnp.int32)
  for bad in (sds((4,), jnp.int32), sds((6,), jnp.int32)):
    with pytest.raises(ValueError, match="q_indptr shape"):
      jax.eval_shape(lambda qi, kl: plan_mgpu.plan_prefill_mgpu(
          qi, kl, num_tokens=8, block_q=8, **kw), bad, lens)
  for rows in (0, -1):
    with pytest.raises(ValueError, match="decode_rows_per_seq"):
      jax.eval_shape(lambda qi, kl, r=rows: plan_mgpu.plan_prefill_mgpu(
          qi, kl, num_tokens=8, block_q=8,
          **{**kw, "decode_rows_per_seq": r}), sds((5,), jnp.int32), lens)
  with pytest.raises(ValueError, match="Invalid case"):
    jax.eval_shape(lambda qi, kl: plan_mgpu.plan_prefill_mgpu(
        qi, kl, num_tokens=8 * plan_mgpu.MAX_ROWS, block_q=8, **kw),
                   sds((5,), jnp.int32), lens)
