"""Paged prefill benchmark (GPU): correctness first, then TFLOP/s against peers.

Run on the GPU machine from the repository root, with `pkvattn` importable
(installed, or a folder mapping `pkvattn.pallas_kernels` / `pkvattn.cache`):
  python bench/bench_prefill.py [--quick] [--specs b4_s4096,mixed]
                                [--no-flashinfer]

Specs (bf16, page_size 16 unless named; heads as num_qo_heads /
num_kv_heads / head_dim, Llama-3-8B's 32/8/128 unless named):
  causal_b4_s4096_p16, causal_b4_s4096_p64, causal_b1_s16384_p16: full causal
    prefill (q_len = kv_len = S);
  mixed_2x2048_64x4096_p16: one engine step: 2 prompts of 2048 tokens + 64
    decode rows (q_len 1) at kv_len 4096;
  causal_b4_s4096_p16_d64: Llama-3.2-1B heads (32/8/64);
  causal_b4_s4096_p16_smollm2: SmolLM2 heads (9/3/64, a GQA group of 3).
The head_dim-64 specs sweep the default config, the Pallas-Triton default
and, where the default is not the Mosaic-GPU kernel, the Mosaic-GPU one
(`backend="mosaic"`; a config that fails to compile or run is reported and
skipped).

FLOPs: the usual convention, causal prefill = `2 * S**2 * head_dim *
num_qo_heads` per sequence (QK^T and PV over the causal half, 2 FLOPs per
multiply-add). For the mixed batch: `4 * head_dim * num_qo_heads * pairs`,
with `pairs` the exact number of visible (query, key) pairs (the same
convention: it gives ~2 S^2 D H for a causal prompt).

Peers, timed on the same K/V made contiguous: cuDNN
(`jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)`), JAX's
contiguous Pallas `mha` (`jax.experimental.pallas.ops.gpu.attention.mha`, at its
defaults and at block_q=128, block_k=64, num_warps=4, num_stages=2; it has no
GQA, so K/V are repeated to all qo heads, which does not change its FLOPs),
the pkvattn xla reference where it fits, and the bf16 matmul roof. A peer
that fails on a shape is reported and left out.

FlashInfer 0.7.2's paged prefill (`BatchPrefillWithPagedKVCacheWrapper`,
FA3 backend, "flashinfer fa3") runs in the same process on the very same
pages: each spec's pages are copied once into FlashInfer's NHD layout
`[num_pages, 2, page_size, num_kv_heads, head_dim]` (pkvattn's "flashinfer"
kv_cache format) with a shared page table, and both FlashInfer and
`pkvattn.paged_prefill(impl="pallas")` ("pkvattn default, flashinfer
layout") read that buffer (handed to torch by DLPack, no copy). FlashInfer's
output is checked against pkvattn's on it. It is timed in the same
interleaved rounds as every other entry and the same way: the per-call time
of back-to-back calls (`_flashinfer.torch_time`, `_timing.pipelined_ms`'s
method: the fixed cost of a sample's first launch and final sync cancels), and GPU
kernel time from the same profiler trace (`_flashinfer.kernel_ms`). Needs a
CUDA build of torch and the wheels `flashinfer-python==0.7.2.post1` +
`apache-tvm-ffi==0.1.15.post2`; FlashInfer's kernels JIT-compile on first use
(~70 s for the FA3 prefill, once per head configuration). Without them (or
with `--no-flashinfer`) the FlashInfer rows are skipped.

Before timing, each spec is checked: the whole output against cuDNN, and the
last tokens (the most expensive tiles) against the f32 xla reference; every
swept config against the checked default. Small NaN-poisoned cases (all
kernel features, GQA 1/2/4/8, pages 8..64, head_dim 64/128/256) are checked
against the float64 oracle of the tests first. Timings: the fastest of
`ROUNDS` interleaved rounds' medians (the shared GPU's clocks drift by
10-20%), per call (`median_ms`, launch and our plan's small ops included) and
in GPU kernel time from a profiler trace (`kernel_ms`, the `*_kernel` ratios
of the summary; "pallas best" is picked by it). Summary ratios are pkvattn's
TFLOP/s over the peer's (> 1: pkvattn faster): `{best,default}_vs_cudnn`,
`..._vs_mha_best`, `..._vs_flashinfer` (and `layout_vs_flashinfer`, the
public API on FlashInfer's own pages), each also as `..._kernel`.

Writes bench/results/prefill_<device>.json (and $OUT/...) and a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

# Appended, not prepended: an installed `pkvattn` (with its mapped
# `pkvattn.pallas_kernels` / `pkvattn.cache`) must win over the bare folder.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(_ROOT)
sys.path.append(os.path.join(_ROOT, "tests"))

from bench import _flashinfer  # noqa: E402
from bench import _timing  # noqa: E402
from pkvattn.pallas_kernels import paged_prefill as pp  # noqa: E402
from pkvattn.pallas_kernels import paged_prefill_mgpu as mgpu  # noqa: E402
from pkvattn.pallas_kernels import reference  # noqa: E402

# Attention heads (num_qo_heads, num_kv_heads, head_dim) of the specs.
LLAMA3_8B = (32, 8, 128)
LLAMA32_1B = (32, 8, 64)
SMOLLM2 = (9, 3, 64)
HQ, HKV, D = LLAMA3_8B  # the default heads (build_spec's, prefill_diag's)
ROUNDS = 2
DTYPE = jnp.bfloat16


# --------------------------------------------------------------------------
# Correctness on small random inputs with NaN-poisoned pages (tests' builder).
# --------------------------------------------------------------------------

def check_small(seed: int = 0) -> list[dict]:
  from attention_utils import dense_attention, make_paged
  from pkvattn._kv import make_view
  rng = np.random.default_rng(seed)
  cases = [
      dict(name="g4_p16_mixed", hkv=8, g=4, d=128, ps=16,
           kv=[700, 1, 300, 17, 64], ql=[700, 1, 50, 8, 1], kw={}),
      dict(name="g8_p64_window_sinks", hkv=2, g=8, d=128, ps=64,
           kv=[900, 130, 5], ql=[600, 3, 5], kw=dict(window_left=100),
           sinks=True),
      dict(name="g4_p16_softcap_noncausal", hkv=4, g=4, d=128, ps=16,
           kv=[400, 33], ql=[100, 33], kw=dict(logits_soft_cap=30.0,
                                               causal=False)),
      dict(name="g1_p8_d64", hkv=4, g=1, d=64, ps=8, kv=[333, 9], ql=[333, 2],
           kw={}),
      dict(name="g2_p32_d256_window", hkv=2, g=2, d=256, ps=32, kv=[500, 40],
           ql=[200, 40], kw=dict(window_left=63)),
      dict(name="g8_p16_chunked", hkv=1, g=8, d=128, ps=16, kv=[1500, 777],
           ql=[256, 7], kw={}),
      # Mosaic backend specifics: pages larger than a KV step, sinks without
      # a window, non-causal over a cached prefix, kv_len % 128 != 0.
      dict(name="g4_p128_sinks", hkv=2, g=4, d=128, ps=128,
           kv=[1000, 129, 128], ql=[1000, 129, 9], kw={}, sinks=True),
      dict(name="g2_p32_noncausal_prefix", hkv=2, g=2, d=64, ps=32,
           kv=[600, 201], ql=[300, 100], kw=dict(causal=False)),
  ]
  rows = []
  for c in cases:
    p = make_paged(rng, c["kv"], page_size=c["ps"], num_kv_heads=c["hkv"],
                   head_dim=c["d"], dtype=DTYPE, fmt="pool")
    hq = c["hkv"] * c["g"]
    t = sum(c["ql"]) + 5  # 5 padding tokens
    q = jnp.asarray(rng.standard_normal((t, hq, c["d"])), DTYPE)
    qi = np.concatenate([[0], np.cumsum(c["ql"])]).astype(np.int32)
    sinks = (rng.standard_normal(hq).astype(np.float32) * 2
             if c.get("sinks") else None)
    view = make_view(p.kv_cache, jnp.asarray(p.page_table))
    kw = dict(causal=True, window_left=-1, logits_soft_cap=None)
    kw.update(c["kw"])
    sm_scale = 1 / math.sqrt(c["d"])
    out, lse = pp.paged_prefill(
        q, view.k_pool, view.v_pool, view.k_table, view.v_table,
        jnp.asarray(qi), jnp.asarray(p.kv_lens),
        None if sinks is None else jnp.asarray(sinks), sm_scale=sm_scale, **kw)
    out = np.asarray(out.astype(jnp.float32))
    lse = np.asarray(lse)
    qf = np.asarray(q.astype(jnp.float32))
    errs, lerrs = [], []
    for b, (n, ql) in enumerate(zip(c["kv"], c["ql"])):
      exp, exp_lse = dense_attention(
          qf[qi[b]:qi[b + 1]], p.k[b], p.v[b], np.arange(n - ql, n), n,
          causal=kw["causal"], window_left=kw["window_left"],
          sm_scale=sm_scale, logits_soft_cap=kw["logits_soft_cap"],
          sinks=sinks)
      got = out[qi[b]:qi[b + 1]]
      errs.append(float(np.abs(got - exp).max()))
      lerrs.append(float(np.abs(lse[qi[b]:qi[b + 1]] - exp_lse).max()))
    pad_ok = bool((out[qi[-1]:] == 0).all() and np.isneginf(lse[qi[-1]:]).all())
    ok = (not np.isnan(out).any() and max(errs) < 2e-2 and max(lerrs) < 2e-2
          and pad_ok)
    rows.append(dict(case=c["name"], max_abs_err=max(errs),
                     max_lse_err=max(lerrs), padding_zero=pad_ok, ok=ok))
  return rows


# --------------------------------------------------------------------------
# Big specs.
# --------------------------------------------------------------------------

def build_spec(key, q_lens, kv_lens, page_size, heads=LLAMA3_8B):
  """Random q and contiguous K/V, scattered into a shuffled paged pool.

  `heads` = (num_qo_heads HQ, num_kv_heads HKV, head_dim D). Returns dict
  with q [T, HQ, D], k/v contiguous [B, S, HKV, D], pool [N, ps, HKV, D]
  (split table: K and V pages in one pool), k_table/v_table, q_indptr,
  kv_lens.
  """
  hq, hkv, d = heads
  batch_size = len(kv_lens)
  kq, kk, kv_, kp = jax.random.split(key, 4)
  t = int(sum(q_lens))
  q = jax.random.normal(kq, (t, hq, d), jnp.float32).astype(DTYPE)
  s_max = int(max(kv_lens))
  max_pages = -(-s_max // page_size)
  k = jax.random.normal(kk, (batch_size, max_pages * page_size, hkv, d),
                        jnp.float32).astype(DTYPE)
  v = jax.random.normal(kv_, (batch_size, max_pages * page_size, hkv, d),
                        jnp.float32).astype(DTYPE)
  num_pages = 2 * batch_size * max_pages + 7
  perm = jax.random.permutation(kp, num_pages)[:2 * batch_size * max_pages]
  ids = perm.reshape(batch_size, 2, max_pages).astype(jnp.int32)
  pool = jnp.full((num_pages, page_size, hkv, d), jnp.nan, DTYPE)
  kb = k.reshape(batch_size * max_pages, page_size, hkv, d)
  vb = v.reshape(batch_size * max_pages, page_size, hkv, d)
  pool = pool.at[ids[:, 0].reshape(-1)].set(kb)
  pool = pool.at[ids[:, 1].reshape(-1)].set(vb)
  # -1 past each sequence's pages (never read).
  need = -(-np.asarray(kv_lens) // page_size)
  col = np.arange(max_pages)[None, :]
  valid = jnp.asarray(col < need[:, None])
  k_table = jnp.where(valid, ids[:, 0], -1)
  v_table = jnp.where(valid, ids[:, 1], -1)
  qi = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return dict(q=q, k=k, v=v, pool=pool, k_table=k_table, v_table=v_table,
              q_indptr=jnp.asarray(qi), kv_lens=jnp.asarray(kv_lens, jnp.int32),
              q_lens=list(q_lens), kv_list=list(kv_lens))


def visible_pairs(q_lens, kv_lens, window_left: int = -1):
  """(query, key) pairs causal attention computes over the sequences;
  with `window_left` >= 0 a query at position p sees min(p, window_left)
  + 1 keys."""
  total = 0
  for ql, kl in zip(q_lens, kv_lens):
    pos = np.arange(kl - ql, kl)
    if window_left >= 0:
      pos = np.minimum(pos, window_left)
    total += int(np.sum(pos + 1))
  return total


rel_err = _timing.rel_err


def cudnn_fn(sm_scale: float, causal: bool):
  """cuDNN attention on contiguous [B, S, H, D] q / k / v (the peer)."""
  return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, scale=sm_scale, implementation="cudnn"))


def mha_fn(sm_scale: float, causal: bool, best: bool):
  """JAX's contiguous Pallas `mha` (no GQA: k / v repeated to all heads), at
  its defaults or at the issue's best tuning (128/64/w4/s2)."""
  from jax.experimental.pallas.ops.gpu import attention as jax_attn
  kw = dict(block_sizes=jax_attn.BlockSizes(block_q=128, block_k=64),
            num_warps=4, num_stages=2) if best else {}
  return jax.jit(lambda q, k, v: jax_attn.mha(
      q, k, v, None, sm_scale=sm_scale, causal=causal, **kw))


def flashinfer_cache(sp, page_size):
  """The spec's pages in FlashInfer's NHD layout `[batch * max_pages, 2,
  page_size, num_kv_heads, head_dim]` and its shared page table.

  Page `b * max_pages + i` holds `[pool[k_table[b, i]], pool[v_table[b,
  i]]]` (K at index 0, V at 1); blocks past a sequence's pages (-1 in the
  split tables, never read) hold a copy of a valid page.
  """
  kt = np.asarray(sp["k_table"])
  vt = np.asarray(sp["v_table"])
  batch_size, max_pages = kt.shape
  fill_k, fill_v = int(kt[kt >= 0][0]), int(vt[vt >= 0][0])
  kt = np.where(kt >= 0, kt, fill_k).reshape(-1)
  vt = np.where(vt >= 0, vt, fill_v).reshape(-1)
  pool = sp["pool"]
  cache = jnp.stack([pool[jnp.asarray(kt)], pool[jnp.asarray(vt)]], axis=1)
  table = np.arange(batch_size * max_pages, dtype=np.int32).reshape(
      batch_size, max_pages)
  assert cache.shape[2] == page_size
  return cache, table


def run_spec(name, q_lens, kv_lens, page_size, configs, *, with_xla, with_mha,
             rows, checks, heads=LLAMA3_8B, with_flashinfer=True):
  hq, hkv, d = heads
  sm_scale = 1 / math.sqrt(d)
  sp = build_spec(jax.random.key(hash(name) % 2**31), q_lens, kv_lens,
                  page_size, heads)
  is_prompt = all(ql == kl for ql, kl in zip(q_lens, kv_lens)) and len(
      set(q_lens)) == 1
  if is_prompt:
    s = q_lens[0]
    flops = 2 * s * s * d * hq * len(q_lens)  # the usual formula
  else:
    flops = 4 * d * hq * visible_pairs(q_lens, kv_lens)
  heads_tag = f"{hq}/{hkv}/{d}"

  def pallas_fn(cfg):
    @jax.jit
    def f(q, pool, kt, vt, qi, kl):
      return pp.paged_prefill(q, pool, pool, kt, vt, qi, kl, None,
                              causal=True, sm_scale=sm_scale, config=cfg)[0]
    return f

  args = (sp["q"], sp["pool"], sp["k_table"], sp["v_table"], sp["q_indptr"],
          sp["kv_lens"])

  # --- correctness: reference on the last tokens of sequence 0.
  default_cfg = configs[0]
  out = pallas_fn(default_cfg)(*args)
  out = jax.block_until_ready(out)
  n_chk = min(128, q_lens[0])
  ql0 = q_lens[0]
  sub_qi = jnp.asarray([0, n_chk], jnp.int32)
  sub_q = sp["q"][ql0 - n_chk:ql0]
  ref_out, _ = reference.paged_prefill_reference(
      sub_q.astype(jnp.float32), sp["pool"].astype(jnp.float32),
      sp["pool"].astype(jnp.float32), sp["k_table"][:1], sp["v_table"][:1],
      sub_qi, sp["kv_lens"][:1], None, causal=True, sm_scale=sm_scale,
      chunk=8)
  err_ref = rel_err(out[ql0 - n_chk:ql0], ref_out)
  nan_free = not bool(jnp.isnan(out.astype(jnp.float32)).any())
  checks.append(dict(spec=name, check="last tokens vs f32 xla reference",
                     rel_err=err_ref, ok=err_ref < 1e-2 and nan_free))

  # --- peers on contiguous K/V.
  cud_fn = None
  if is_prompt:
    b = len(q_lens)
    s = q_lens[0]
    qc = sp["q"].reshape(b, s, hq, d)
    kc = sp["k"][:, :s]
    vc = sp["v"][:, :s]
    cud_fn = cudnn_fn(sm_scale, True)
    cud_args = (qc, kc, vc)
    try:
      cud_out = jax.block_until_ready(cud_fn(*cud_args))
      err = rel_err(out.reshape(b, s, hq, d), cud_out)
      checks.append(dict(spec=name, check="all tokens vs cuDNN contiguous",
                         rel_err=err, ok=err < 1e-2))
    except Exception as e:  # noqa: BLE001
      print("cudnn failed:", repr(e)[:300])
      cud_fn = None
  else:
    # Mixed batch: cuDNN on the prompts + cuDNN on the decode rows (2 calls).
    prompts = [i for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)) if ql == kl]
    decodes = [i for i, ql in enumerate(q_lens) if ql == 1]
    sp_len = q_lens[prompts[0]]
    dk = kv_lens[decodes[0]]
    qi = np.asarray(sp["q_indptr"])
    qp = jnp.concatenate([sp["q"][qi[i]:qi[i + 1]] for i in prompts]).reshape(
        len(prompts), sp_len, hq, d)
    kp = sp["k"][jnp.asarray(prompts), :sp_len]
    vp = sp["v"][jnp.asarray(prompts), :sp_len]
    qd = jnp.stack([sp["q"][qi[i]] for i in decodes])[:, None]
    kd = sp["k"][jnp.asarray(decodes), :dk]
    vd = sp["v"][jnp.asarray(decodes), :dk]

    @jax.jit
    def cud_fn(qp, kp, vp, qd, kd, vd):
      a = jax.nn.dot_product_attention(qp, kp, vp, is_causal=True,
                                       scale=sm_scale, implementation="cudnn")
      b_ = jax.nn.dot_product_attention(qd, kd, vd, is_causal=False,
                                        scale=sm_scale, implementation="cudnn")
      return a, b_
    cud_args = (qp, kp, vp, qd, kd, vd)
    try:
      a, b_ = jax.block_until_ready(cud_fn(*cud_args))
      err = rel_err(out[qi[decodes[0]]], b_[0, 0])
      checks.append(dict(spec=name, check="decode row vs cuDNN", rel_err=err,
                         ok=err < 1e-2))
    except Exception as e:  # noqa: BLE001
      print("cudnn failed:", repr(e)[:300])
      cud_fn = None

  # Collect every timed callable first, then time them in ROUNDS interleaved
  # rounds and keep the fastest round's median: the shared GPU's clocks drift
  # by 10-20% over a run, and interleaving keeps the ratios fair. An entry
  # whose extra has runtime="torch" is a torch launch `fn()` (FlashInfer),
  # timed by `_flashinfer`'s twins of the jax timers.
  entries = []  # (impl, fn, args, cfg, extra)

  for i, cfg in enumerate(configs):
    diag = False
    tag = ((f"pallas mosaic bq{cfg.block_q} bk{cfg.block_k} "
            f"s{cfg.num_stages}" if cfg.backend == "mosaic" else
            f"pallas bq{cfg.block_q} bk{cfg.block_k} w{cfg.num_warps} "
            f"s{cfg.num_stages}") + (" 1loop" if cfg.single_loop else "")
           + (f" {cfg.mosaic_schedule}" if cfg.backend == "mosaic" and
              cfg.mosaic_schedule != "pingpong" else "")
           + (" pack" if cfg.mosaic_pack_gqa else "")
           + (" persist" if cfg.mosaic_persistent else "")
           + ("" if cfg.longest_first else " tokenorder")
           + ("" if cfg.heads_outer else " headsinner")
           + ("" if cfg.fast_exp2 else " libdevice-exp2")
           + (f" short{cfg.short_block_q}/bk{cfg.short_block_k}"
              f"/w{cfg.short_num_warps}/s{cfg.short_num_stages}"
              if cfg.short_block_q else " noshort")
           + (" (default)" if i == 0 else ""))
    fn = pallas_fn(cfg)
    ok = True
    if i > 0 and not diag:  # every config must match the checked default
      try:
        err = rel_err(fn(*args), out)
      except Exception as e:  # noqa: BLE001  (a backend that rejects a shape)
        print(f"  {tag}: failed, skipped: {repr(e)[:400]}")
        checks.append(dict(spec=name, check=f"{tag} runs", ok=None,
                           skipped=repr(e)[:400]))
        continue
      ok = err < 1e-2
      if not ok:
        print(f"  {tag}: mismatch vs default, rel_err={err:.3g}")
    entries.append((tag, fn, args, cfg, dict(matches_default=ok,
                                             diagnostic=diag)))
  # The default again with the plan computed outside (as once per step, reused
  # by every layer): the kernel time alone.
  plan = jax.jit(functools.partial(
      default_cfg.plan, num_tokens=int(sum(q_lens)), causal=True,
      window_left=-1))(sp["q_indptr"], sp["kv_lens"])

  @jax.jit
  def planned(q, pool, kt, vt, qi, kl, plan):
    return pp.paged_prefill(q, pool, pool, kt, vt, qi, kl, None, causal=True,
                            sm_scale=sm_scale, config=default_cfg,
                            plan=plan)[0]
  entries.append(("pallas default, plan reused (kernel only)", planned,
                  args + (plan,), default_cfg, dict(diagnostic=True)))
  if cud_fn is not None:
    entries.append(("cudnn contiguous", cud_fn, cud_args, None, {}))
  if with_mha and is_prompt:
    kr = jnp.repeat(kc, hq // hkv, axis=2)
    vr = jnp.repeat(vc, hq // hkv, axis=2)
    entries.append(("jax pallas mha (defaults)",
                    mha_fn(sm_scale, True, best=False), (qc, kr, vr), None,
                    {}))
    entries.append(("jax pallas mha (128/64/w4/s2)",
                    mha_fn(sm_scale, True, best=True), (qc, kr, vr), None,
                    {}))
  if with_flashinfer:
    # FlashInfer and pkvattn's public API on the very same pages, in
    # FlashInfer's layout (shared table).
    fi_cache = fi_table = pk_out = None
    try:
      import pkvattn  # pylint: disable=import-outside-toplevel
      fi_cache, fi_table = flashinfer_cache(sp, page_size)
      layout_fn = jax.jit(lambda q, c, t, qi, kl: pkvattn.paged_prefill(
          q, c, t, qi, kl, impl="pallas", causal=True, sm_scale=sm_scale))
      layout_args = (sp["q"], fi_cache, jnp.asarray(fi_table),
                     sp["q_indptr"], sp["kv_lens"])
      pk_out = jax.block_until_ready(layout_fn(*layout_args))
      err = rel_err(pk_out, out)
      checks.append(dict(spec=name, check="pkvattn flashinfer layout vs "
                         "split pool default", rel_err=err, ok=err < 1e-2))
      entries.append(("pkvattn default, flashinfer layout", layout_fn,
                      layout_args, None, dict(matches_default=err < 1e-2)))
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      print(f"  {name} pkvattn default, flashinfer layout failed: "
            f"{repr(e)[:300]}")
    if fi_cache is not None:
      try:
        t_jit = time.time()
        run, fi_out = _flashinfer.prefill_fn(
            sp["q"], fi_cache, fi_table, np.asarray(sp["q_indptr"]),
            np.asarray(sp["kv_lens"]), num_qo_heads=hq, num_kv_heads=hkv,
            causal=True, sm_scale=sm_scale, backend="fa3")
        print(f"  flashinfer fa3 planned and run once "
              f"({time.time() - t_jit:.1f}s, JIT included)", flush=True)
        ref = pk_out if pk_out is not None else out
        err = rel_err(fi_out, ref)
        ok = err < 1e-2
        checks.append(dict(spec=name, check="flashinfer fa3 vs pkvattn "
                           "(same pages)", rel_err=err, ok=ok))
        if not ok:
          print(f"  flashinfer fa3: mismatch vs pkvattn, rel_err={err:.3g}")
        entries.append(("flashinfer fa3", run, (), None,
                        dict(runtime="torch", matches_pkvattn=ok)))
      except Exception as e:  # noqa: BLE001  (no flashinfer wheel, no JIT)
        if not isinstance(e, ImportError):
          traceback.print_exc()
        print(f"  {name} flashinfer fa3: skipped ({repr(e)[:300]})")
        checks.append(dict(spec=name, check="flashinfer fa3 vs pkvattn "
                           "(same pages)", ok=None,
                           skipped=repr(e)[:300]))
  timings = {}
  kernel_ms = {}
  for rnd in range(ROUNDS):
    for impl, fn, fargs, _, extra in entries:
      try:
        if extra.get("runtime") == "torch":
          t = dict(median_ms=_flashinfer.torch_time(fn, iters=10,
                                                    min_time_s=0.1))
          k = _flashinfer.kernel_ms(fn, calls=3)
        else:
          t = _timing.time_fn(fn, *fargs, iters=10, min_time_s=0.1)
          # GPU kernel time (profiler): launch gaps and host time excluded,
          # so peers with one kernel and ours with its plan ops compare
          # fairly.
          k = _timing.device_kernel_ms(fn, lambda fargs=fargs: fargs,
                                       calls=3)
      except Exception as e:  # noqa: BLE001
        print(f"{name} {impl} failed: {repr(e)[:400]}")
        continue
      timings.setdefault(impl, []).append(t)
      kernel_ms.setdefault(impl, []).append(k)
  if with_xla:  # slow: one round
    @jax.jit
    def xla_fn(q, pool, kt, vt, qi, kl):
      return reference.paged_prefill_reference(
          q, pool, pool, kt, vt, qi, kl, None, causal=True,
          sm_scale=sm_scale)[0]
    timings["pkvattn xla"] = [_timing.time_fn(xla_fn, *args, iters=3,
                                              min_time_s=0.0)]
    entries.append(("pkvattn xla", None, None, None, {}))
  best = None
  for impl, _, _, cfg, extra in entries:
    if impl not in timings:
      continue
    ts = timings[impl]
    t = dict(min(ts, key=lambda x: x["median_ms"]))
    t["round_medians_ms"] = [x["median_ms"] for x in ts]
    row = dict(spec=name, impl=impl, heads=heads_tag, page_size=page_size,
               **t, tflops=flops / (t["median_ms"] * 1e-3) / 1e12, **extra)
    if kernel_ms.get(impl) and min(kernel_ms[impl]) > 0:
      row["kernel_ms"] = min(kernel_ms[impl])
      row["tflops_kernel"] = flops / (row["kernel_ms"] * 1e-3) / 1e12
    if cfg is not None:
      row["config"] = dataclasses.asdict(cfg)
    rows.append(row)
    print(f"  {name:28s} {impl:60s} {t['median_ms']:8.3f} ms "
          f"{row['tflops']:7.1f} TFLOP/s  kernel "
          f"{row.get('tflops_kernel', 0.0):7.1f} TFLOP/s  rounds "
          f"{t['round_medians_ms']}", flush=True)
    if (impl.startswith(("pallas bq", "pallas mosaic"))
        and extra.get("matches_default")
        and not extra.get("diagnostic")
        and (best is None or row.get("kernel_ms", row["median_ms"])
             < best.get("kernel_ms", best["median_ms"]))):
      best = row
  if best is not None:
    rows.append(dict(best, impl="pallas best", best_of=best["impl"]))


def small_head_configs(heads, page_size: int, num_tokens: int | None = None,
                       batch_size: int | None = None) -> list:
  """The head_dim-64 sweep: the default for the spec's tokens per sequence,
  the Pallas-Triton default and the
  Mosaic-GPU kernel's two-consumer ping-pong, two-consumer ring and
  three-consumer ring (duplicates dropped; a Mosaic-GPU config the kernel
  rejects is skipped at run time)."""
  hq, hkv, d = heads
  kw = dict(group_size=hq // hkv, head_dim=d, page_size=page_size,
            dtype=DTYPE)
  configs = [pp.Config.default_for(**kw, num_tokens=num_tokens,
                                   batch_size=batch_size),
             pp.Config.default_for(**kw, backend="triton")]
  try:
    # The unpacked form (one query head per CTA) that long prompts get.
    mosaic = pp.Config.default_for(**kw, backend="mosaic",
                                   num_tokens=pp.MOSAIC_D64_MIN_TOKENS,
                                   batch_size=1)
  except Exception as e:  # noqa: BLE001
    print(f"mosaic config for heads {hq}/{hkv}/{d}: {repr(e)[:200]}")
  else:
    R = dataclasses.replace
    configs += [R(mosaic, block_q=mgpu.tile_q(2), mosaic_schedule=s)
                for s in ("pingpong", "ring")]
    if d == 64:
      configs.append(R(mosaic, block_q=mgpu.tile_q(3),
                       mosaic_schedule="ring"))
  out = []
  for c in configs:
    if c not in out:
      out.append(c)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--specs", default="all")
  ap.add_argument("--no-plot", action="store_true")
  ap.add_argument("--configs", default="",
                  help="';'-separated positional Config ints (block_q,block_k,"
                  "warps,stages,...) overriding every sweep (first = default)")
  ap.add_argument("--skip-small-checks", action="store_true",
                  help="skip the small NaN-poisoned oracle checks")
  ap.add_argument("--no-flashinfer", action="store_true",
                  help="skip FlashInfer's FA3 prefill (and pkvattn on its "
                  "page layout)")
  a = ap.parse_args()
  env = _timing.environment()
  print(env, flush=True)
  t0 = time.time()
  checks = ([] if a.skip_small_checks
            else [dict(check="small", **r) for r in check_small()])
  for c in checks:
    print(c, flush=True)
  print(f"small checks {time.time() - t0:.1f}s", flush=True)
  C = pp.Config
  hq, hkv, d = LLAMA3_8B  # the heads of the main sweeps
  default = C.default_for(group_size=hq // hkv, head_dim=d, page_size=16,
                          dtype=DTYPE)
  R = dataclasses.replace
  # On Hopper the default is the Mosaic-GPU kernel; the Pallas-Triton
  # kernel's default and an older Triton default (256 rows on 8 warps,
  # 2 stages, libdevice exp2) stay in the sweep as before/after references.
  triton = C.default_for(group_size=hq // hkv, head_dim=d, page_size=16,
                         dtype=DTYPE, backend="triton")
  before = R(triton, block_q=256 // (hq // hkv), num_warps=8, num_stages=2,
             heads_outer=False, fast_exp2=False)
  if default.backend == "mosaic":
    sweeps = {
        "causal": [default, R(default, block_k=64, num_stages=4), triton,
                   before],
        "p64": [default, triton, before],
        "mixed": [default, R(default, short_block_k=64), triton, before],
    }
  else:
    sweeps = {
        "causal": [default, R(default, heads_outer=False),
                   R(default, num_stages=2), before],
        "p64": [default, R(default, num_stages=2), before],
        "mixed": [default, R(default, short_block_k=64),
                  R(default, short_block_q=0), before],
    }
  if a.quick:
    sweeps = {k: v[:3] for k, v in sweeps.items()}
  over = None
  if a.configs:
    over = [C(*[int(x) for x in c.split(",")]) for c in a.configs.split(";")]
    sweeps = {k: over for k in sweeps}
  rows = []
  roofs = dict(matmul_roof_tflops=_timing.matmul_roof_tflops(),
               copy_roof_gbps=_timing.copy_roof_gbps())
  print(roofs, flush=True)
  # (name, q_lens, kv_lens, page_size, with_xla, heads)
  specs = [
      ("causal_b4_s4096_p16", [4096] * 4, [4096] * 4, 16, True, LLAMA3_8B),
      ("causal_b1_s16384_p16", [16384], [16384], 16, False, LLAMA3_8B),
      ("causal_b4_s4096_p64", [4096] * 4, [4096] * 4, 64, False, LLAMA3_8B),
      ("mixed_2x2048_64x4096_p16", [2048] * 2 + [1] * 64,
       [2048] * 2 + [4096] * 64, 16, True, LLAMA3_8B),
      ("causal_b4_s4096_p16_d64", [4096] * 4, [4096] * 4, 16, False,
       LLAMA32_1B),
      ("causal_b4_s4096_p16_smollm2", [4096] * 4, [4096] * 4, 16, False,
       SMOLLM2),
  ]
  if a.specs != "all":
    keep = a.specs.split(",")
    specs = [s for s in specs if any(k in s[0] for k in keep)]
  for name, ql, kl, ps, xla, heads in specs:
    t1 = time.time()
    if heads == LLAMA3_8B:
      kind = ("mixed" if "mixed" in name else "p64" if "p64" in name
              else "causal")
      configs = sweeps[kind]
    else:
      configs = over or small_head_configs(heads, ps, num_tokens=sum(ql),
                                           batch_size=len(ql))
    print(f"{name} heads {heads}: {len(configs)} configs", flush=True)
    try:
      run_spec(name, ql, kl, ps, configs, with_xla=xla, with_mha=True,
               rows=rows, checks=checks, heads=heads,
               with_flashinfer=not a.no_flashinfer)
    except Exception as e:  # noqa: BLE001  (keep the other specs going)
      traceback.print_exc()
      checks.append(dict(spec=name, check="spec runs", ok=False,
                         error=repr(e)[:400]))
    print(f"{name}: {time.time() - t1:.1f}s", flush=True)
  # Ratios.
  summary = []
  for name, *_, heads in specs:
    by = {r["impl"]: r for r in rows if r["spec"] == name}
    best = by.get("pallas best")
    dflt = next((r for r in rows if r["spec"] == name and
                 r["impl"].endswith("(default)")), None)
    s = dict(spec=name, heads="/".join(map(str, heads)))
    for k, r in (("best", best), ("default", dflt)):
      if r is None:
        continue
      s[f"pallas_{k}_tflops"] = r["tflops"]
      s[f"pallas_{k}_tflops_kernel"] = r.get("tflops_kernel")
      for peer, tag in (("cudnn contiguous", "cudnn"),
                        ("jax pallas mha (128/64/w4/s2)", "mha_best"),
                        ("flashinfer fa3", "flashinfer")):
        if peer not in by:
          continue
        s[f"{k}_vs_{tag}"] = r["tflops"] / by[peer]["tflops"]
        if r.get("tflops_kernel") and by[peer].get("tflops_kernel"):
          s[f"{k}_vs_{tag}_kernel"] = (r["tflops_kernel"]
                                       / by[peer]["tflops_kernel"])
      if "pkvattn xla" in by:
        s[f"speedup_vs_xla_{k}"] = (by["pkvattn xla"]["median_ms"]
                                    / r["median_ms"])
    # The public API and FlashInfer on the very same pages (FlashInfer's
    # layout, shared table).
    lay, fi = by.get("pkvattn default, flashinfer layout"), by.get(
        "flashinfer fa3")
    if lay is not None and fi is not None:
      s["layout_vs_flashinfer"] = lay["tflops"] / fi["tflops"]
      if lay.get("tflops_kernel") and fi.get("tflops_kernel"):
        s["layout_vs_flashinfer_kernel"] = (lay["tflops_kernel"]
                                            / fi["tflops_kernel"])
    summary.append(s)
  dev = env["device"].replace(" ", "_")
  paths = _timing.write_results(
      f"prefill_{dev}", rows,
      extra=dict(roofs, checks=checks, summary=summary,
                 flops_convention="causal prefill 2*S^2*head_dim*num_qo_heads "
                 "per sequence (issue 2); mixed: 4*head_dim*num_qo_heads*"
                 "visible_pairs"))
  print("wrote", paths)
  if not a.no_plot:
    try:
      plot(rows, specs, dev, roofs)
    except Exception as e:  # noqa: BLE001
      print("plot failed:", repr(e)[:200])
  print()
  _timing.print_table([c for c in checks], ["spec", "case", "check", "rel_err",
                                            "max_abs_err", "ok", "skipped"])
  print()
  _timing.print_table(rows, ["spec", "impl", "median_ms", "tflops",
                             "kernel_ms", "tflops_kernel"])
  print()
  cols = []  # every spec's keys (the peers differ per spec)
  for s in summary:
    cols += [c for c in s if c not in cols]
  _timing.print_table(summary, cols)


def plot(rows, specs, dev, roofs):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  impls = ["pallas best", "flashinfer fa3", "cudnn contiguous",
           "jax pallas mha (defaults)", "jax pallas mha (128/64/w4/s2)",
           "pkvattn xla"]
  names = [s[0] for s in specs]
  heads = ["/".join(map(str, s[-1])) for s in specs]
  fig, ax = plt.subplots(figsize=(max(10, 1.9 * len(names)), 4.5))
  w = 0.8 / len(impls)
  for i, impl in enumerate(impls):
    vals = [next((r.get("tflops_kernel") or r["tflops"] for r in rows
                  if r["spec"] == n and r["impl"] == impl), 0.0)
            for n in names]
    ax.bar(np.arange(len(names)) + (i - (len(impls) - 1) / 2) * w, vals, w,
           label=impl)
  ax.axhline(roofs["matmul_roof_tflops"], color="k", ls="--", lw=0.8,
             label="bf16 matmul roof")
  ax.set_xticks(np.arange(len(names)))
  ax.set_xticklabels([f"{n}\n{h}" for n, h in zip(names, heads)], fontsize=7)
  ax.set_ylabel("TFLOP/s (GPU kernel time)")
  head_set = sorted(set(heads))
  title_heads = (f"heads {head_set[0]} (qo/kv/head_dim)" if len(head_set) == 1
                 else "heads qo/kv/head_dim under each spec")
  ax.set_title(f"paged prefill, {title_heads}, bf16, {dev}")
  ax.legend(fontsize=7)
  fig.tight_layout()
  for d in ["bench/results"] + ([os.environ["OUT"]] if os.environ.get("OUT")
                                else []):
    fig.savefig(os.path.join(d, f"prefill_{dev}.png"), dpi=110)


if __name__ == "__main__":
  main()
