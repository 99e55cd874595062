"""The Mosaic-GPU RoPE + paged append kernel (`pallas_kernels/rope_append_mgpu.py`).

On the CPU CI: the config rule and its errors, the routing of
`rope_append`'s default (the Triton kernel off Hopper and in interpret
mode), and a cross-lowering of the kernel for CUDA (Pallas -> Mosaic GPU
MLIR, pools aliased in and out) for every table kind, RoPE style, partial
rotary, fused qkv rows, chunk size and head split, and inside `shard_map`,
`lax.scan` and `checkify` as the engine runs it. Mosaic GPU has no
interpret mode, so the numerics run only on a Hopper GPU
(`test_matches_oracle_gpu`, skipped elsewhere): against the float64 numpy
oracle of `test_rope_append` on NaN-filled pools, where every row the
oracle does not write must stay NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pkvattn
from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import reference
from pkvattn.pallas_kernels import rope_append as kernel
from pkvattn.pallas_kernels import rope_append_mgpu as mgpu
from rope_utils import np_inv_freq, np_rope

PAGE, NUM_PAGES, NUM_TOKENS, MAX_PAGES = 16, 24, 45, 3
TOL = {jnp.bfloat16: 1.6e-2, jnp.float16: 2e-3}  # |err| / (1 + |x|)
_M = mgpu.Config

CASES = [  # hq, hkv, d, rotary_dim (None: no rotation), style, dtype, fused,
           # table_kind (None: explicit rows), has_q, config
    (8, 2, 128, 128, "neox", jnp.bfloat16, False, "shared", True, _M()),
    (9, 3, 64, 64, "neox", jnp.bfloat16, False, "flashinfer", True,
     _M(chunk_bytes=4)),
    (4, 1, 256, 256, "neox", jnp.bfloat16, True, "shared", True,
     _M(chunk_bytes=8)),
    (8, 2, 128, 128, "gptj", jnp.float16, False, "split", True,
     _M(num_splits=2)),
    (8, 4, 64, 32, "neox", jnp.bfloat16, True, "split", True,
     _M(num_splits=4, max_loads=4)),
    (6, 2, 128, 64, "gptj", jnp.bfloat16, False, None, True,
     _M(chunk_bytes=4)),
    (8, 8, 128, 128, "neox", jnp.float16, False, "shared", False,
     _M(num_splits=8)),
    (8, 2, 64, None, "neox", jnp.bfloat16, False, "flashinfer", True,
     _M(chunk_bytes=4)),
    (9, 3, 64, 64, "gptj", jnp.bfloat16, True, "shared", True,
     _M(one_head=True)),
    (4, 2, 128, 96, "neox", jnp.float16, False, "split", False,
     _M(one_head=True, chunk_bytes=4)),
    # float8_e4m3fn pools (k_scale, v_scale = FP8_SCALES).
    (8, 2, 128, 128, "neox", jnp.bfloat16, False, "shared", True,
     _M(chunk_bytes=8), True),
    (9, 3, 64, 64, "gptj", jnp.float16, True, "flashinfer", True,
     _M(chunk_bytes=4), True),
    (4, 1, 256, 128, "neox", jnp.bfloat16, False, "split", False,
     _M(chunk_bytes=16, one_head=True), True),
]
FP8_SCALES = (0.03, 0.02)
FP8_TOL = 2 ** -4 + 1e-3  # e4m3: 3 mantissa bits, half an ulp relative


def _tokens(rng):
  """Two sequences, padding tokens (-1) and positions past the table or on
  an unallocated page (no row written)."""
  bi = np.array([0] * 20 + [1] * 17 + [-1] * 4 + [1] * 4, np.int32)
  pos = np.array(list(range(5, 25)) + list(range(30, 47)) + [0] * 4
                 + [47, 48, 3 * PAGE + 1, 99], np.int32)
  assert bi.shape == pos.shape == (NUM_TOKENS,)
  return bi, pos


def _tables(rng, table_kind):
  """(table as the kernel takes it, K page table, V page table, shared
  pool?) with one unallocated page (-1)."""
  perm = rng.permutation(NUM_PAGES)
  if table_kind == "split":
    table = perm[:12].reshape(2, 2, MAX_PAGES).astype(np.int32)
    table[1, :, 2] = -1
    return table, table[:, 0], table[:, 1], True
  if table_kind == "flashinfer":  # K page 2t, V page 2t + 1 of one pool
    table = rng.permutation(NUM_PAGES // 2)[:6].reshape(2, MAX_PAGES)
    table = table.astype(np.int32)
    table[1, 2] = -1
    return (table, np.where(table >= 0, 2 * table, -1),
            np.where(table >= 0, 2 * table + 1, -1), True)
  table = perm[:6].reshape(2, MAX_PAGES).astype(np.int32)
  table[1, 2] = -1
  return table, table, table, False


def _run(case, seed, *, lower_only=False):
  """The kernel on one case: returns (outputs, expected) as float64 numpy
  (FP8 pools dequantized), or with `lower_only` the lowered module's
  text."""
  hq, hkv, d, rot, style, dtype, fused, table_kind, has_q, cfg, *fp8 = case
  fp8 = bool(fp8 and fp8[0])
  scales = (dict(k_scale=jnp.float32(FP8_SCALES[0]),
                 v_scale=jnp.float32(FP8_SCALES[1])) if fp8 else {})
  rng = np.random.default_rng(seed)
  x = [rng.standard_normal((NUM_TOKENS, h, d)) for h in (hq, hkv, hkv)]
  q, k, v = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32),
                        np.float64) for a in x)
  bi, pos = _tokens(rng)
  table, k_table, v_table, shared = _tables(rng, table_kind or "shared")
  k_rows, v_rows = (np.asarray(reference.append_rows(
      jnp.asarray(bi), jnp.asarray(pos), jnp.asarray(tb), PAGE, NUM_PAGES))
      for tb in (k_table, v_table))
  inv = None if rot is None else np_inv_freq(d, 10000.0, rot).astype(
      np.float32)
  pool = np.full((NUM_PAGES, PAGE, hkv, d), np.nan)
  interleaved = style == "gptj"

  def call(q_in, k_in, v_in, qkv_in, kp, vp, pos_in, bi_in, table_in, kr,
           vr):
    paged = None if table_kind is None else (bi_in, table_in, table_kind)
    rows = (None, None) if table_kind is not None else (kr, vr)
    inv_in = None if inv is None else jnp.asarray(inv)
    if fused:
      return kernel.rope_append_qkv(
          qkv_in.reshape(NUM_TOKENS, -1), pos_in, *rows, inv_in, kp, vp,
          interleaved=interleaved, config=cfg, paged=paged, **scales)
    return kernel.rope_append(
        q_in if has_q else None, k_in, v_in, pos_in, *rows, inv_in, kp, vp,
        interleaved=interleaved, config=cfg, paged=paged, **scales)

  j = lambda a: jnp.asarray(a, dtype)  # noqa: E731
  jp = (lambda a: jnp.asarray(a, jnp.float8_e4m3fn)) if fp8 else j
  args = (j(q), j(k), j(v), j(np.concatenate([q, k, v], axis=1)), jp(pool),
          None if shared else jp(pool), jnp.asarray(pos), jnp.asarray(bi),
          jnp.asarray(table), jnp.asarray(k_rows), jnp.asarray(v_rows))
  if lower_only:
    return jax.jit(call, donate_argnums=(4,)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
  q_out, k_pool, v_pool = jax.jit(call)(*args)
  rot_q = np_rope(q, pos, inv, style) if inv is not None else q
  rot_k = np_rope(k, pos, inv, style) if inv is not None else k
  exp_k = pool.reshape(-1, hkv, d).copy()
  exp_v = exp_k if shared else exp_k.copy()
  for i in range(NUM_TOKENS):
    if k_rows[i] < exp_k.shape[0]:
      exp_k[k_rows[i]] = rot_k[i]
    if v_rows[i] < exp_v.shape[0]:
      exp_v[v_rows[i]] = v[i]
  got = [k_pool, k_pool if shared else v_pool]
  if fp8:  # dequantized row by row (a shared pool holds K and V rows)
    per_row = []
    for i in range(2):
      sc = np.full(exp_k.shape[0], FP8_SCALES[i])
      if shared:
        sc[v_rows[v_rows < sc.shape[0]]] = FP8_SCALES[1]
        sc[k_rows[k_rows < sc.shape[0]]] = FP8_SCALES[0]
      per_row.append(sc)
    got = [np.asarray(g.astype(jnp.float32)).reshape(exp_k.shape)
           * sc[:, None, None] for g, sc in zip(got, per_row)]
  want = [exp_k, exp_v]
  if has_q or fused:
    got.append(q_out)
    want.append(rot_q)
  got = [np.asarray(jnp.asarray(g).astype(jnp.float32), np.float64).reshape(
      w.shape) for g, w in zip(got, want)]
  return got, want


def _case_id(c) -> str:
  return (f"{c[0]}-{c[1]}-{c[2]}-rot{c[3]}-{c[4]}-{jnp.dtype(c[5]).name}"
          f"-{'qkv' if c[6] else 'sep'}-{c[7]}-q{int(c[8])}"
          f"{'-fp8' if len(c) > 10 and c[10] else ''}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_lowers_to_mosaic_gpu_aliasing_the_pools(case):
  """Pallas -> Mosaic GPU cross-lowering for CUDA: the layout, address
  and shape code of every variant runs, and the pools are aliased in and
  out of the kernel (in place under the donated jit)."""
  text = _run(case, 0, lower_only=True)
  assert "mosaic_gpu" in text
  assert "output_operand_aliases" in text


def _hopper() -> bool:
  return dispatch.current_gpu().is_hopper


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_oracle_gpu(case):
  fp8 = len(case) > 10 and case[10]
  got_all, want_all = _run(case, CASES.index(case))
  for i, (got, want) in enumerate(zip(got_all, want_all)):
    assert np.array_equal(np.isnan(got), np.isnan(want))
    m = ~np.isnan(want)
    err = np.max(np.abs(got[m] - want[m]) / (1 + np.abs(want[m])))
    pool = i < 2
    assert err <= (FP8_TOL if fp8 and pool else TOL[case[5]]), (i, err)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_default_is_mosaic_on_hopper_and_matches_xla():
  """The public op's default on Hopper is this kernel, and agrees with the
  XLA path on a NaN-filled cache."""
  rope = pkvattn.RopeConfig(theta=10000.0)
  rng = np.random.default_rng(3)
  bi, pos = _tokens(rng)
  q, k, v = (jnp.asarray(rng.standard_normal((NUM_TOKENS, h, 64)),
                         jnp.bfloat16) for h in (9, 3, 3))
  cache = jnp.full((NUM_PAGES // 2, 2, PAGE, 3, 64), jnp.nan, jnp.bfloat16)
  table, *_ = _tables(rng, "flashinfer")
  choice = dispatch.rope_append(
      gpu=dispatch.current_gpu(), dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
      pool_dtype=jnp.bfloat16, head_dim=64, num_qo_heads=9, num_kv_heads=3,
      num_tokens=NUM_TOKENS)
  assert choice.backend == "mosaic" and isinstance(choice.config,
                                                   mgpu.Config)
  res = {impl: jax.jit(lambda *a, impl=impl: pkvattn.apply_rope_and_append(
      *a, rope=rope, impl=impl))(q, k, v, jnp.asarray(bi), jnp.asarray(pos),
                                  cache, jnp.asarray(table))
         for impl in ("xla", "pallas")}
  for a, e in zip(jax.tree.leaves(res["pallas"]), jax.tree.leaves(res["xla"])):
    a, e = (np.asarray(x.astype(jnp.float32)) for x in (a, e))
    assert np.array_equal(np.isnan(a), np.isnan(e))
    np.testing.assert_allclose(a[~np.isnan(e)], e[~np.isnan(e)], atol=2e-2)


def test_default_rule():
  # Heads split over the largest power of two <= 8 dividing both counts;
  # 4-byte chunks up to SMALL_CHUNK_MAX_TOKENS tokens, 8 beyond.
  small = mgpu.SMALL_CHUNK_MAX_TOKENS
  for t, hq, hkv, splits, chunk in [
      (8, 32, 8, 8, 4), (small, 9, 3, 1, 4), (small + 1, 4, 1, 1, 8),
      (65536, 32, 8, 8, 8), (256, 12, 4, 4, 4), (256, 16, 2, 2, 4)]:
    cfg = _M.default_for(t, hq, hkv)
    assert (cfg.num_splits, cfg.chunk_bytes, cfg.one_head) == (
        splits, chunk, False), (t, hq, hkv, cfg)


def test_config_routing_and_errors():
  # Hopper: this kernel for the cases it takes; other GPUs and interpret
  # mode: the Triton kernel. The backend names the config's kernel.
  args = dict(head_dim=128, num_qo_heads=32, num_kv_heads=8, num_tokens=64,
              dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
              pool_dtype=jnp.bfloat16)
  for gpu, backend in ((dispatch.HOPPER, "mosaic"), (dispatch.ADA, "triton"),
                       (dispatch.AMPERE, "triton"),
                       (dispatch.INTERPRET, "triton")):
    choice = dispatch.rope_append(gpu=gpu, **args)
    assert (choice.backend, choice.config.backend) == (backend, backend)
    assert isinstance(choice.config, mgpu.Config if backend == "mosaic"
                      else kernel.TritonConfig)
  for over in (dict(dtype=jnp.float32, kv_dtype=jnp.float32,
                    pool_dtype=jnp.float32),
               dict(kv_dtype=jnp.float32), dict(rotary_dim=18),
               dict(pool_dtype=jnp.float8_e4m3fn, has_scales=False)):
    assert dispatch.rope_append(gpu=dispatch.HOPPER,
                                **{**args, **over}).backend == "triton", over
  assert dispatch.rope_append(
      gpu=dispatch.HOPPER, **{**args, "pool_dtype": jnp.float8_e4m3fn}
  ).backend == "mosaic"  # FP8 pools: scales by default
  for bad, name in ((dict(chunk_bytes=32), "chunk_bytes"),
                    (dict(num_splits=0), "num_splits"),
                    (dict(max_loads=0), "max_loads")):
    with pytest.raises(ValueError, match=name):
      _M(**bad)
  assert _M(one_head=True).programs(9, 3) == 12
  assert _M(num_splits=4).programs(32, 8) == 4
  # What the kernel refuses, and why.
  ok = dict(dtype=jnp.bfloat16, pool_dtype=jnp.bfloat16, head_dim=128,
            half=64, interleaved=False, num_qo_heads=32, num_kv_heads=8,
            num_splits=8, has_scales=False)
  assert mgpu.supports(**ok) is None
  assert mgpu.supports(**{**ok, "pool_dtype": jnp.float8_e4m3fn,
                          "has_scales": True}) is None
  for over, why in [(dict(pool_dtype=jnp.float8_e4m3fn), "FP8"),
                    (dict(has_scales=True), "FP8"),
                    (dict(pool_dtype=jnp.float16), "pools of float16"),
                    (dict(dtype=jnp.float32, pool_dtype=jnp.float32), "not bf16"),
                    (dict(half=20), "chunks"),
                    (dict(num_splits=3), "divide"),
                    (dict(head_dim=512, half=0, chunk_bytes=4), "threads")]:
    assert why in mgpu.supports(**{**ok, **over}), over
  # An explicit Mosaic config where its kernel cannot run.
  q = jnp.zeros((4, 8, 64), jnp.bfloat16)
  kv = jnp.zeros((4, 2, 64), jnp.bfloat16)
  pool = jnp.zeros((2, 16, 2, 64), jnp.bfloat16)
  rows = jnp.arange(4, dtype=jnp.int32)
  inv = jnp.ones((32,), jnp.float32)
  with pytest.raises(ValueError, match="interpret"):
    kernel.rope_append(q, kv, kv, rows, rows, rows, inv, pool, pool,
                       config=_M(), interpret=True)
  with pytest.raises(ValueError, match="FP8"):  # scales for bf16 pools
    jax.jit(lambda: kernel.rope_append(
        q, kv, kv, rows, rows, rows, inv, pool, pool, config=_M(),
        k_scale=1.0, v_scale=1.0)).trace()
  with pytest.raises(ValueError, match="dtype"):
    jax.jit(lambda: mgpu.rope_append_mgpu(
        q.astype(jnp.float16), kv, kv, rows, rows, rows, inv, pool, pool,
        interleaved=False)).trace()


def test_lowers_inside_shard_map_scan_and_checkify():
  """The pools' `jax.Ref`s compose with what the engine wraps the op in:
  `shard_map` (tensor parallel), `lax.scan` (scanned layers, bursts) and
  `checkify` (checked mode); each still lowers to the Mosaic kernel with
  the pools aliased."""
  from jax.experimental import checkify
  from jax.sharding import Mesh, PartitionSpec as P
  from pkvattn import parallel
  t, hq, hkv, d = 16, 8, 4, 64
  sds = jax.ShapeDtypeStruct
  args = [sds((t, hq, d), jnp.bfloat16), sds((t, hkv, d), jnp.bfloat16),
          sds((t, hkv, d), jnp.bfloat16), sds((t,), jnp.int32),
          sds((t,), jnp.int32), sds((2, 4), jnp.int32),
          sds((d // 2,), jnp.float32), sds((8, 16, hkv, d), jnp.bfloat16),
          sds((8, 16, hkv, d), jnp.bfloat16)]

  def op(q, k, v, pos, bi, table, inv, kp, vp):
    return mgpu.rope_append_mgpu(q, k, v, pos, None, None, inv, kp, vp,
                                 interleaved=False, paged=(bi, table,
                                                           "shared"))

  def scanned(q, k, v, pos, bi, table, inv, kp, vp):
    def layer(pools, _):
      q_out, *pools = op(q, k, v, pos, bi, table, inv, *pools)
      return tuple(pools), q_out
    pools, q_out = jax.lax.scan(layer, (kp, vp), None, length=3)
    return q_out, *pools

  def checked(*a):
    checkify.check(jnp.all(a[3] >= 0), "negative position")
    return op(*a)

  mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  heads = P(None, "tp")
  sharded = parallel.shard_map(
      op, mesh=mesh, in_specs=(heads, heads, heads, P(), P(), P(), P(),
                               P(None, None, "tp"), P(None, None, "tp")),
      out_specs=(heads, P(None, None, "tp"), P(None, None, "tp")))
  for f in (sharded, scanned, checkify.checkify(checked)):
    text = jax.jit(f, donate_argnums=(7, 8)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert "output_operand_aliases" in text
