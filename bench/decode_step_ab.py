"""Decode step of the serving benchmark: code paths, kernel configs and XLA options, A/B in one process.

The engine and workload of `bench_serving` (SmolLM2-135M's shape, random bf16
weights, `bench_serving.CFG`): 256 prompts are run to the all-decode state,
then the engine's decode burst program is compiled once per variant, each
from the same copies of the engine's state. A variant picks

  * a code path: "slice" (the fused qkv projection sliced into q, k, v before
    RoPE + append, as before), "layer_table" (`apply_rope_and_append_qkv`
    reads the heads of each projected row in place, through the layer's page
    table) or "inplace" (the library's `attention_block`: that, and in
    decode-sized steps through each token's table row);
  * the `rope_append` and `paged_decode` launch-config rules: "new" (the
    kernels' `Config.default_for`) or "old" (the rules before 2026-11-23,
    restated here);
  * XLA debug options for that one compilation (`Lowered.compile(
    compiler_options=...)`, no process-wide XLA_FLAGS): "engine" = the
    engine's own (`serving.programs.compiler_options()`), or a dict, e.g.
    Triton gemm fusions on or off.

Per variant: GPU kernel time per decode step (sum of kernel and memcpy
durations in a profiler trace of 3 bursts / decode_steps) with the per-kernel
breakdown, wall time per step (median of 10 bursts / decode_steps, inputs
ready), compile time, and the burst's tokens and pool against the first
variant's (same inputs; with random weights the logits are nearly flat, so
any rounding change flips some argmax tokens). Then:

  * the engine's own program (`bench_serving.kernel_breakdown`, `profile`);
  * numerics: logits of one 256-token forward in bf16 with Triton gemms and
    with cuBLAS against the same weights in f32 (xla attention);
  * forward GPU time with and without Triton gemms at other shapes
    (SmolLM2 prefill of 4096 tokens, Llama-3.2-1B decode 256 / prefill 4096);
  * kernel sweeps: `rope_append_qkv` and `paged_decode` configs at the step's
    shapes and, for `paged_decode`, longer contexts.

Results: JSON `bench/results/decode_step_ab.json` (and $OUT), the burst's
optimized HLO as `$OUT/decode_step_hlo.txt.gz`.

Usage: `python bench/decode_step_ab.py [--variants a,b] [--no-extras]`
(`--model small` for a CPU smoke run).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import _timing  # noqa: E402
from bench import bench_serving  # noqa: E402
from pkvattn import flax as _flax  # noqa: E402
from pkvattn.engine import Engine, SamplingParams  # noqa: E402
from pkvattn.models import Model, init_params  # noqa: E402
from pkvattn.models import decoder as _decoder  # noqa: E402
from pkvattn.serving import profile as _profile  # noqa: E402
from pkvattn.serving import programs as _programs  # noqa: E402

_ORIGINAL_BLOCK = _decoder.attention_block


def _slice_attention_block(params, x, kv_cache, plan, spec, *, impl=None,
                           dtype=None, reduce_axis=None):
  """The fused projection sliced into q, k, v, then `paged_attention` (the
  path before RoPE + append read the projected rows in place)."""
  if "qkv_proj" not in params or reduce_axis is not None:
    return _ORIGINAL_BLOCK(params, x, kv_cache, plan, spec, impl=impl,
                           dtype=dtype, reduce_axis=reduce_axis)
  dtype = dtype or x.dtype
  t, d = x.shape[0], spec.head_dim
  qkv = _flax._dense(params["qkv_proj"], x, dtype)
  nq, nk = spec.num_qo_heads * d, spec.num_kv_heads * d
  q = qkv[:, :nq].reshape(t, spec.num_qo_heads, d)
  k = qkv[:, nq:nq + nk].reshape(t, spec.num_kv_heads, d)
  v = qkv[:, nq + nk:].reshape(t, spec.num_kv_heads, d)
  out, kv_cache = _flax.paged_attention(
      q, k, v, kv_cache, plan, rope=spec.rope, sm_scale=spec.sm_scale,
      window_left=spec.window_left, logits_soft_cap=spec.logits_soft_cap,
      impl=impl)
  out = out.reshape(t, spec.num_qo_heads * d)
  return _flax._dense(params["o_proj"], out, dtype), kv_cache


def _layer_table_attention_block(params, x, kv_cache, plan, spec, *,
                                 impl=None, dtype=None, reduce_axis=None):
  """The fused projection read in place by RoPE + append, always through
  the layer's page table (before decode-sized steps took the per-token table
  rows, 2026-11-23: XLA copied the layer's table for the kernel per layer)."""
  t = x.shape[0]
  if "qkv_proj" not in params or reduce_axis is not None or spec.rope is None:
    return _ORIGINAL_BLOCK(params, x, kv_cache, plan, spec, impl=impl,
                           dtype=dtype, reduce_axis=reduce_axis)
  from pkvattn import rope as _rope
  dtype = dtype or x.dtype
  qkv = _flax._dense(params["qkv_proj"], x, dtype)
  q, kv_cache = _rope.apply_rope_and_append_qkv(
      qkv, plan.batch_indices, plan.positions, kv_cache, plan.page_table,
      spec.rope, impl=impl)
  out = _flax._attend(q, kv_cache, plan, sm_scale=spec.sm_scale,
                      window_left=spec.window_left,
                      logits_soft_cap=spec.logits_soft_cap, impl=impl)
  out = out.reshape(t, spec.num_qo_heads * spec.head_dim)
  return _flax._dense(params["o_proj"], out, dtype), kv_cache


CODE_PATHS = {"slice": _slice_attention_block,
              "layer_table": _layer_table_attention_block,
              "inplace": _ORIGINAL_BLOCK}


def _old_rope_default(num_tokens, num_qo_heads, num_kv_heads):
  """`rope_append.Config.default_for` before 2026-11-23 (no one-head
  fallback)."""
  from pkvattn.pallas_kernels import rope_append as kernel
  if num_tokens >= 8192:
    return kernel.Config._split(8, 8, num_qo_heads, num_kv_heads)
  block_tokens = 4 if num_tokens <= 512 else 8
  tiles = -(-num_tokens // block_tokens)
  return kernel.Config._split(block_tokens, 1 << (-(-512 // tiles) - 1).bit_length(),
                              num_qo_heads, num_kv_heads)


def _old_decode_default(*, batch_size, num_kv_heads, page_size, max_pages,
                        head_dim, num_sms=132):
  """`paged_decode.Config.default_for` before 2026-11-23 (4 warps, 3 stages,
  64-token steps at head_dim 64)."""
  from pkvattn.pallas_kernels import paged_decode as kernel
  programs = batch_size * num_kv_heads
  block_tokens = 32 if head_dim > 128 else 64
  if head_dim <= 128 and programs >= 8 * num_sms:
    block_tokens = 128
  ppb = max(1, block_tokens // page_size)
  want = 1 << (max(1, -(-2 * num_sms // programs)) - 1).bit_length()
  max_steps = max(1, -(-max_pages // ppb))
  cap = 1 << (max(1, max_steps // 2) - 1).bit_length()
  if cap > max_steps // 2 and cap > 1:
    cap //= 2
  return kernel.Config(ppb, max(1, min(want, cap, 64)), 4, 3)


class _Rules:
  """Patches the kernels' config rules ("old") for one trace."""

  def __init__(self, rope: str, decode: str):
    from pkvattn.pallas_kernels import paged_decode
    from pkvattn.pallas_kernels import rope_append
    self.targets = [
        (rope_append.Config, staticmethod(_old_rope_default), rope),
        (paged_decode.Config,
         classmethod(lambda cls, **kw: _old_decode_default(**kw)), decode)]

  def __enter__(self):
    self.saved = [c.__dict__["default_for"] for c, _, _ in self.targets]
    for c, old, which in self.targets:
      if which == "old":
        c.default_for = old

  def __exit__(self, *exc):
    for (c, _, _), saved in zip(self.targets, self.saved):
      c.default_for = saved


TRITON = {"xla_gpu_enable_triton_gemm": True}
CUBLAS = {"xla_gpu_enable_triton_gemm": False}

# name: (code path, rope rule, decode rule, XLA options or "engine")
VARIANTS = {
    "before": ("slice", "old", "old", TRITON),
    "inplace_cublas": ("layer_table", "old", "old", CUBLAS),
    "inplace_cublas_rope1h": ("layer_table", "new", "old", CUBLAS),
    "layer_table": ("layer_table", "new", "new", "engine"),
    "after": ("inplace", "new", "new", "engine"),
    "after_triton": ("inplace", "new", "new", TRITON),
    "after_rerun": ("inplace", "new", "new", "engine"),
    "before_rerun": ("slice", "old", "old", TRITON),
}


def decode_state(mcfg, cfg, num_prompts):
  """An engine with `num_prompts` requests all decoding (burst pending)."""
  params = init_params(mcfg, jax.random.key(0), jnp.bfloat16, scale=0.02)
  engine = Engine(Model("bench", mcfg, params, None), cfg)
  t0 = time.perf_counter()
  engine.warmup()
  warmup_s = time.perf_counter() - t0
  rng = np.random.default_rng(0)
  sp = SamplingParams(max_new_tokens=64, ignore_eos=True)
  for p in bench_serving.prompts(rng, num_prompts, mcfg.vocab_size):
    engine.add_request(p, sp)
  while not engine._burst_eligible():
    engine.step()
  for _ in range(4):  # some context: ~41 + 33 tokens, as bench_serving
    engine.step()
  return engine, warmup_s


def breakdown(events, per):
  rows = _timing.kernel_groups(events, per, name_len=80)
  return dict(gpu_us_per_step=sum(r[2] for r in rows),
              kernels_per_step=sum(r[1] for r in rows),
              kernels=[dict(kernel=k, count=round(c, 3), us=round(t, 3))
                       for k, c, t in rows])


def run_variant(engine, code, rope, decode, options, iters=10):
  """Compiles the burst with `code`, the config rules and `options`; returns
  measurements and (tokens, pool) of one burst from the engine's current
  state."""
  if options == "engine":
    options = _programs.compiler_options()
  cfg, mcfg = engine.config, engine.model.cfg
  prog = _profile.profile_programs(engine)
  greedy = engine._variant("burst", cfg.max_seqs,
                           engine._burst_greedy()).greedy_only
  _decoder.attention_block = CODE_PATHS[code]
  jax.clear_caches()  # retrace the nested jits with this code and rules
  try:
    with _Rules(rope, decode):
      fn = jax.jit(functools.partial(
          _programs.device_decode_burst, model_cfg=mcfg, cfg=cfg, mesh=None,
          greedy_only=greedy), donate_argnums=(1, 2, 3))
      t0 = time.perf_counter()
      lowered = fn.lower(*prog["step_args"]())
      lower_s = time.perf_counter() - t0
      compiled = lowered.compile(compiler_options=options or None)
      compile_s = time.perf_counter() - t0 - lower_s
  finally:
    _decoder.attention_block = _ORIGINAL_BLOCK
    jax.clear_caches()
  per = prog["per"]
  out = jax.block_until_ready(compiled(*prog["step_args"]()))
  tokens, pool = out[3].tokens, out[0]
  walls = []
  for _ in range(iters):
    args = jax.block_until_ready(prog["step_args"]())
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    walls.append((time.perf_counter() - t0) * 1e3 / per)
  args = [prog["step_args"]() for _ in range(3)]
  jax.block_until_ready(args)
  events = _timing.gpu_stream_events([lambda a=a: compiled(*a) for a in args])
  res = dict(code=code, rope_rule=rope, decode_rule=decode,
             options={k: str(v) for k, v in options.items()},
             lower_s=round(lower_s, 2), compile_s=round(compile_s, 2),
             wall_ms_per_step=float(np.median(walls)),
             wall_ms_p10=float(np.percentile(walls, 10)),
             wall_ms_p90=float(np.percentile(walls, 90)),
             **breakdown(events, len(args) * per))
  res["gpu_ms_per_step"] = res["gpu_us_per_step"] / 1e3
  res["wall_over_gpu"] = (res["wall_ms_per_step"] / res["gpu_ms_per_step"]
                          if res["gpu_ms_per_step"] else None)
  return res, (tokens, pool), compiled


def compare(ref, got):
  """Token agreement and pool relative error against the first variant."""
  t_ref, p_ref = ref
  t_got, p_got = got
  same = float(jnp.mean((t_ref == t_got).astype(jnp.float32)))
  diff = jnp.linalg.norm((p_got.astype(jnp.float32)
                          - p_ref.astype(jnp.float32)).ravel())
  norm = jnp.linalg.norm(p_ref.astype(jnp.float32).ravel())
  return dict(tokens_equal_frac=same,
              pool_rel_err=float(diff / jnp.maximum(norm, 1e-30)))


def _kernel_us(fn, make_args, prefix, calls=20):
  """GPU time per call, us: `(kernels named prefix*, all kernels)`."""
  jax.block_until_ready(fn(*make_args()))
  args = [make_args() for _ in range(calls)]
  jax.block_until_ready(args)
  events = _timing.gpu_stream_events([lambda a=a: fn(*a) for a in args])
  ns = [n for name, n in events if name.startswith(prefix)]
  total = sum(n for _, n in events) / calls / 1e3
  return (sum(ns) / calls / 1e3 if ns else None), total


def sweep_rope_append(num_tokens, hq, hkv, d, page_size=16, num_pages=32768,
                      interpret=False):
  """`rope_append_qkv` (rows from a split table in the kernel) per Config."""
  from pkvattn.pallas_kernels import rope_append as kernel
  rng = np.random.default_rng(1)
  max_pages = 64
  qkv = jnp.asarray(rng.standard_normal((num_tokens, (hq + 2 * hkv) * d)),
                    jnp.bfloat16)
  pos = jnp.asarray(rng.integers(60, 100, num_tokens), jnp.int32)
  bi = jnp.arange(num_tokens, dtype=jnp.int32)
  table = jnp.asarray(rng.permutation(num_pages)[:num_tokens * 2 * max_pages]
                      .reshape(num_tokens, 2, max_pages), jnp.int32)
  pool = jnp.asarray(rng.standard_normal((num_pages, page_size, hkv, d)),
                     jnp.bfloat16)
  inv = jnp.asarray(1.0 / (10000.0 ** (np.arange(0, d, 2) / d)), jnp.float32)
  configs = {"default": kernel.Config.default_for(num_tokens, hq, hkv),
             "old_default": _old_rope_default(num_tokens, hq, hkv),
             "one_head_bt4_w4": kernel.Config(4, 1, 4, one_head=True)}
  if hq == 9:  # the step's shape: more configs
    for bt, w in ((4, 2), (4, 1), (8, 2)):
      configs[f"one_head_bt{bt}_w{w}"] = kernel.Config(bt, 1, w, one_head=True)
  rows = []
  for name, cfg in configs.items():
    def run(qkv, pos, pool, cfg=cfg):  # pool not donated: XLA copies it first
      q, pool, _ = kernel.rope_append_qkv(
          qkv, pos, None, None, inv, pool, None, config=cfg,
          interpret=interpret, paged=(bi, table, "split"))
      return q, pool
    try:
      us, _ = _kernel_us(jax.jit(run), lambda: (qkv, pos, pool),
                         "rope_append")
      rows.append(dict(config=name, **dataclasses.asdict(cfg), us=us,
                       shape=[num_tokens, hq, hkv, d]))
    except Exception as e:  # noqa: BLE001  (a config that does not lower)
      rows.append(dict(config=name, **dataclasses.asdict(cfg),
                       error=f"{type(e).__name__}: {str(e)[:200]}"))
  return rows


def sweep_paged_decode(batch, hq, hkv, d, page_size=16, num_pages=32768,
                       max_pages=64, kv_range=(70, 91), interpret=False):
  """`paged_decode` per Config, kv_lens drawn from `kv_range`."""
  from pkvattn.pallas_kernels import paged_decode as kernel
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((batch, hq, d)), jnp.bfloat16)
  pool = jnp.asarray(rng.standard_normal((num_pages, page_size, hkv, d)),
                     jnp.bfloat16)
  pages = rng.permutation(num_pages)[:batch * 2 * max_pages]
  k_table = jnp.asarray(pages[:batch * max_pages].reshape(batch, max_pages),
                        jnp.int32)
  v_table = jnp.asarray(pages[batch * max_pages:].reshape(batch, max_pages),
                        jnp.int32)
  kv_lens = jnp.asarray(rng.integers(*kv_range, batch), jnp.int32)
  shape = dict(batch_size=batch, num_kv_heads=hkv, page_size=page_size,
               max_pages=max_pages, head_dim=d)
  new, old = kernel.Config.default_for(**shape), _old_decode_default(**shape)
  configs = {"default": new, "old_default": old}
  for ppb, w, st in ((2, 2, 3), (4, 2, 3), (2, 4, 2), (1, 2, 2), (2, 1, 2)):
    configs[f"ppb{ppb}_w{w}_s{st}"] = dataclasses.replace(
        new, pages_per_block=ppb, num_warps=w, num_stages=st)
  rows = []
  for name, cfg in configs.items():
    f = jax.jit(functools.partial(kernel.paged_decode, sm_scale=d ** -0.5,
                                  config=cfg, interpret=interpret))
    try:
      # With splits the combine is a separate (XLA) kernel: the total
      # counts it too.
      us, total = _kernel_us(
          f, lambda: (q, pool, pool, k_table, v_table, kv_lens), "paged_decode")
      rows.append(dict(config=name, **dataclasses.asdict(cfg), us=us,
                       us_with_combine=total))
    except Exception as e:  # noqa: BLE001
      rows.append(dict(config=name, **dataclasses.asdict(cfg),
                       error=f"{type(e).__name__}: {str(e)[:200]}"))
  return rows


def _forward_setup(mcfg, num_tokens, num_seqs, dtype, page_size=16):
  """Params (as the engine keeps them), tokens, an empty pool and the plan
  of `num_seqs` sequences prefilling `num_tokens / num_seqs` tokens each."""
  from pkvattn.flax import AttentionPlan, layer_page_tables
  params = init_params(mcfg, jax.random.key(3), jnp.bfloat16, scale=0.02)
  params = jax.tree.map(lambda a: a.astype(dtype), params)
  params = _decoder.unstack_layers(_decoder.fuse_projections(params))
  per = num_tokens // num_seqs
  pages = -(-per // page_size)
  slots = jnp.arange(num_seqs * pages, dtype=jnp.int32).reshape(num_seqs, pages)
  tables = layer_page_tables(slots, mcfg.num_layers)
  pool = jnp.zeros(mcfg.pool_shape(num_seqs * pages, page_size), dtype)
  lens = jnp.full((num_seqs,), per, jnp.int32)
  q_indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens)])
  plan = AttentionPlan.create(tables, q_indptr, lens, num_tokens)
  tokens = jax.random.randint(jax.random.key(4), (num_tokens,), 3,
                              mcfg.vocab_size, jnp.int32)
  return params, tokens, pool, plan, q_indptr[1:] - 1


def _forward_fn(mcfg, impl, options):
  fn = jax.jit(lambda params, tokens, pool, plan, idx: _decoder.forward(
      params, mcfg, tokens, pool, plan, logits_indices=idx, impl=impl))
  setup = {}

  def compiled(*args):
    if "c" not in setup:
      setup["c"] = fn.lower(*args).compile(compiler_options=options or None)
    return setup["c"](*args)
  return compiled


def numerics(mcfg, num_tokens=256):
  """Logits of one forward (256 one-token sequences) in bf16 with Triton
  and with cuBLAS gemms, against the same weights in f32 (xla attention,
  default options)."""
  args32 = _forward_setup(mcfg, num_tokens, num_tokens, jnp.float32)
  with jax.default_matmul_precision("highest"):  # no tf32
    ref = np.asarray(_forward_fn(mcfg, "xla", {})(*args32)[0], np.float64)
  del args32
  args16 = _forward_setup(mcfg, num_tokens, num_tokens, jnp.bfloat16)
  out = {}
  logits = {}
  for name, opts in (("triton", TRITON), ("cublas", CUBLAS)):
    logits[name] = np.asarray(_forward_fn(mcfg, None, opts)(*args16)[0],
                              np.float64)
    out[f"{name}_vs_f32_rel_err"] = float(
        np.linalg.norm(logits[name] - ref) / np.linalg.norm(ref))
    out[f"{name}_argmax_eq_f32"] = float(
        np.mean(logits[name].argmax(-1) == ref.argmax(-1)))
  out["cublas_vs_triton_rel_err"] = float(
      np.linalg.norm(logits["cublas"] - logits["triton"])
      / np.linalg.norm(logits["triton"]))
  return out


def forward_times(cases):
  """GPU kernel time of one forward, Triton gemms vs cuBLAS, per case
  `(label, model, num_tokens, num_seqs)`."""
  rows = []
  for label, mcfg, num_tokens, num_seqs in cases:
    args = _forward_setup(mcfg, num_tokens, num_seqs, jnp.bfloat16)
    row = dict(case=label, num_tokens=num_tokens, num_seqs=num_seqs)
    for name, opts in (("triton", TRITON), ("cublas", CUBLAS)):
      f = _forward_fn(mcfg, None, opts)
      row[f"{name}_ms"] = _timing.device_kernel_ms(f, lambda: args, calls=5)
    rows.append(row)
    print(f"forward {label}: {row}", flush=True)
    del args
  return rows


def engine_program(engine):
  """The engine's own burst program (its jit and compiler options): kernel
  breakdown and `Engine.profile`."""
  kb = bench_serving.kernel_breakdown(engine, top=20)
  prof = engine.profile()
  return dict(gpu_ms_per_step=kb["gpu_us_per_step"] / 1e3,
              kernels_per_step=kb["kernels_per_step"], top=kb["top"],
              profile=prof, wall_over_gpu=prof["step_ms"] * 1e3
              / kb["gpu_us_per_step"])


def run_extras(engine, mcfg, cfg, n, t_start, only=None):
  """Engine program, numerics, forward times and kernel sweeps (GPU)."""
  extras = {}
  gpu = jax.default_backend() == "gpu"
  kw = {} if gpu else dict(num_pages=2048, interpret=True)  # CPU smoke
  steps = [
      ("engine_program", lambda: engine_program(engine) if gpu else None),
      ("numerics", lambda: numerics(mcfg)),
      ("rope_append_qkv", lambda: sweep_rope_append(
          n, mcfg.num_qo_heads, mcfg.num_kv_heads, mcfg.head_dim,
          cfg.page_size, **kw)),
      ("paged_decode", lambda: sweep_paged_decode(
          n, mcfg.num_qo_heads, mcfg.num_kv_heads, mcfg.head_dim,
          cfg.page_size, **kw)),
  ]
  if gpu:
    steps += [
        ("rope_append_qkv_llama8b", lambda: [
            r for t in (8, 64, 256)
            for r in sweep_rope_append(t, 32, 8, 128, cfg.page_size)]),
        ("paged_decode_kv300", lambda: sweep_paged_decode(
            n, mcfg.num_qo_heads, mcfg.num_kv_heads, mcfg.head_dim,
            cfg.page_size, kv_range=(250, 350))),
        ("paged_decode_kv1000", lambda: sweep_paged_decode(
            n, mcfg.num_qo_heads, mcfg.num_kv_heads, mcfg.head_dim,
            cfg.page_size, kv_range=(900, 1024))),
        ("forward", lambda: forward_times([
            ("smollm2_prefill", mcfg, 4096, 16),
            ("llama1b_decode", bench_serving.LLAMA_3_2_1B, 256, 256),
            ("llama1b_prefill", bench_serving.LLAMA_3_2_1B, 4096, 16)])),
    ]
  for name, fn in steps:
    if only and name not in only:
      continue
    try:
      extras[name] = fn()
    except Exception as e:  # noqa: BLE001  (keep the other results)
      extras[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    print(f"{name} done ({time.perf_counter() - t_start:.0f} s): "
          f"{str(extras[name])[:300]}", flush=True)
  return extras


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", choices=("smollm2", "small"), default="smollm2")
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--no-extras", action="store_true")
  ap.add_argument("--hlo-variant", default="after")
  ap.add_argument("--deadline-s", type=float, default=1e9,
                  help="skip the variants left once this much time has passed")
  ap.add_argument("--extras-after", default="after_rerun",
                  help="run the extras after this variant")
  ap.add_argument("--extras", default="",
                  help="comma-separated extras to run (default: all)")
  args = ap.parse_args(argv)
  t_start = time.perf_counter()
  mcfg = bench_serving.MODELS[args.model]
  cfg, n = bench_serving.CFG, 256
  if args.model == "small":  # a CPU smoke run
    cfg = dataclasses.replace(cfg, num_slots=256, max_seqs=8,
                              max_num_tokens=64, max_model_len=128,
                              decode_steps=4)
    n = 8
  engine, warmup_s = decode_state(mcfg, cfg, n)
  print(f"decode state after {time.perf_counter() - t_start:.1f} s "
        f"(warmup {warmup_s:.1f} s)", flush=True)
  out_dir = os.environ.get("OUT")
  rows, ref = [], None
  extra = dict(model=args.model, config=dataclasses.asdict(cfg),
               num_requests=n, engine_compiler_options={
                   k: str(v) for k, v in _programs.compiler_options().items()},
               extras={})
  for name in args.variants.split(","):
    code, rope, decode, options = VARIANTS[name]
    if time.perf_counter() - t_start > args.deadline_s:
      rows.append(dict(variant=name, code=code, error="skipped: deadline"))
      continue
    try:
      res, got, compiled = run_variant(engine, code, rope, decode, options)
    except Exception as e:  # noqa: BLE001  (an option XLA rejects)
      rows.append(dict(variant=name, code=code, rope_rule=rope,
                       decode_rule=decode, options=str(options),
                       error=f"{type(e).__name__}: {str(e)[:300]}"))
      print(f"{name}: {rows[-1]['error']}", flush=True)
      continue
    if ref is None:
      ref = got
    res.update(compare(ref, got))
    rows.append(dict(variant=name, **res))
    if name == args.hlo_variant and out_dir:
      with gzip.open(os.path.join(out_dir, "decode_step_hlo.txt.gz"), "wt") as f:
        f.write(compiled.as_text())
    del got, compiled
    print(f"{name}: GPU {res['gpu_ms_per_step']:.3f} ms, wall "
          f"{res['wall_ms_per_step']:.3f} ms, {res['kernels_per_step']:.1f} "
          f"kernels, compile {res['compile_s']:.1f} s, tokens equal "
          f"{res['tokens_equal_frac']:.3f}, pool rel err "
          f"{res['pool_rel_err']:.2e} ({time.perf_counter() - t_start:.0f} s)",
          flush=True)
    _timing.write_results("decode_step_ab", rows, extra)
    if name == args.extras_after and not args.no_extras:
      extra["extras"] = run_extras(engine, mcfg, cfg, n, t_start,
                                   [e for e in args.extras.split(",") if e])
      _timing.write_results("decode_step_ab", rows, extra)
  ref = None
  _timing.write_results("decode_step_ab", rows, extra)
  summary(rows, extra["extras"])
  print(f"total {time.perf_counter() - t_start:.0f} s")


def summary(rows, extras):
  def top(r, k=10):
    return ", ".join(f"{x['kernel'][:28]} {x['us']:.0f}"
                     for x in r.get("kernels", [])[:k])
  print()
  for r in rows:
    if "error" not in r:
      print(f"{r['variant']}: {top(r)}")
  for kind, srows in extras.items():
    if not isinstance(srows, list) or not srows or "us" not in srows[0]:
      continue
    ok = sorted((r for r in srows if r.get("us")), key=lambda r: r["us"])
    print(f"{kind}: " + "; ".join(
        f"{r['config']} {r['us']:.2f}" + (
            f"/{r['us_with_combine']:.2f}" if "us_with_combine" in r else "")
        for r in ok[:8]))
  for name in ("engine_program", "numerics", "forward"):
    print(f"{name}: {str(extras.get(name))[:600]}")
  print()
  _timing.print_table(
      [dict(variant=r["variant"], gpu_ms=r.get("gpu_ms_per_step"),
            wall_ms=r.get("wall_ms_per_step"),
            kernels=r.get("kernels_per_step"), compile_s=r.get("compile_s"),
            tok_eq=r.get("tokens_equal_frac"), pool_err=r.get("pool_rel_err"),
            error=(r.get("error") or "")[:40]) for r in rows],
      ["variant", "gpu_ms", "wall_ms", "kernels", "compile_s", "tok_eq",
       "pool_err", "error"])


if __name__ == "__main__":
  main()
