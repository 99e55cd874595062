"""Paged decode benchmark: pkvattn pallas / xla vs FlashInfer 0.7.2, JAX
`paged_attention` and the copy roof.

Run on a GPU:  `python -m bench.bench_decode [--quick] [--specs a,b]`
Plot locally:  `python -m bench.bench_decode --plot bench/results/decode_<device>.json`

Specs: Llama-3-8B heads (32 qo, 8 kv, head_dim 128) at four batch / length /
page shapes, and the small-head shapes SmolLM2 (9/3/64), group 6 at head_dim
128 (48/8/128) and Gemma 3 270M (4/1/256); bf16, every sequence at full
length S (shuffled pages, a few NaN-poisoned spare pages in the pool).
Before timing, each spec is checked against the f32 reference on the same
inputs, and a GPU correctness sweep on small NaN-poisoned caches (all formats,
GQA 1/4/8, pages 16/64, window, soft cap, sinks) runs first.

FlashInfer (`flashinfer-python==0.7.2.post1` + `apache-tvm-ffi==0.1.15.post2`;
its kernels JIT-compile on first use, ~20 s per head_dim) runs its CUDA-core
and tensor-core `BatchDecodeWithPagedKVCacheWrapper` on the pages stacked
into its layout `[num_pages, 2, page_size, num_kv_heads, head_dim]`, which
pkvattn's default also runs on ("default, flashinfer layout"): same buffers,
outputs checked against the reference, timed per call (back-to-back calls,
median) and by GPU kernel time (profiler trace) like every other row.
`x_flashinfer[_kernel]` = FlashInfer's faster mode's time / the row's time
(> 1: faster than FlashInfer). `--no-flashinfer` skips it. `--quick` on four
specs with FlashInfer took about 4 minutes on an H100 (FlashInfer's JIT
included); run the specs in groups (`--specs`) to stay inside a device call.

Bytes moved (decimal units, `achieved_tbps = bytes_moved / median_s / 1e12`):
  `bytes_moved = q + touched K/V pages + out`
  `= B*Hq*D*2 + 2 * sum_b(cdiv(kv_len_b, page_size) * page_size) * Hkv*D*2 + B*Hq*D*2`.
The copy roof counts read + write bytes of a 2 GiB device copy.
`speedup_vs_xla = median_ms[xla] / median_ms[impl]` (>1 = faster than xla).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench import _flashinfer
from bench import _timing
from pkvattn.pallas_kernels import paged_decode as kernel
from pkvattn.pallas_kernels import reference

NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
LLAMA3_8B = (NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM)
SMOLLM2 = (9, 3, 64)
GROUP6_D128 = (48, 8, 128)
GEMMA3_270M = (4, 1, 256)
SPECS = {
    "llama3_8b_decode_b64_s4096_p16": dict(batch_size=64, seq_len=4096, page_size=16),
    "llama3_8b_decode_b64_s4096_p64": dict(batch_size=64, seq_len=4096, page_size=64),
    "llama3_8b_decode_b8_s16384_p16": dict(batch_size=8, seq_len=16384, page_size=16),
    "llama3_8b_decode_b256_s1024_p16": dict(batch_size=256, seq_len=1024, page_size=16),
    # Small heads: SmolLM2 (head_dim 64, group 3), group 6 at head_dim 128,
    # Gemma 3 270M (head_dim 256, one kv head, group 4).
    "smollm2_decode_b64_s4096_p16": dict(batch_size=64, seq_len=4096, page_size=16,
                                         heads=SMOLLM2),
    "smollm2_decode_b256_s1024_p16": dict(batch_size=256, seq_len=1024, page_size=16,
                                          heads=SMOLLM2),
    "g6_d128_decode_b64_s4096_p16": dict(batch_size=64, seq_len=4096, page_size=16,
                                         heads=GROUP6_D128),
    "gemma3_270m_decode_b64_s4096_p16": dict(batch_size=64, seq_len=4096,
                                             page_size=16, heads=GEMMA3_270M),
}
SPARE_PAGES = 8


def make_inputs(batch_size, seq_len, page_size, dtype=jnp.bfloat16, seed=0,
                heads=LLAMA3_8B):
  """Shared-table pair cache with shuffled page ids and NaN spare pages;
  `heads = (num_qo_heads, num_kv_heads, head_dim)`."""
  num_qo_heads, num_kv_heads, head_dim = heads
  pages_per_seq = seq_len // page_size
  num_pages = batch_size * pages_per_seq + SPARE_PAGES
  kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
  shape = (num_pages, page_size, num_kv_heads, head_dim)
  k_pages = jax.random.normal(kk, shape, dtype)
  v_pages = jax.random.normal(kv, shape, dtype)
  perm = jax.random.permutation(kp, num_pages).astype(jnp.int32)
  table = perm[:batch_size * pages_per_seq].reshape(batch_size, pages_per_seq)
  spare = perm[batch_size * pages_per_seq:]
  k_pages = k_pages.at[spare].set(jnp.nan)
  v_pages = v_pages.at[spare].set(jnp.nan)
  q = jax.random.normal(kq, (batch_size, num_qo_heads, head_dim), dtype)
  kv_lens = jnp.full((batch_size,), seq_len, jnp.int32)
  return q, k_pages, v_pages, table, kv_lens


def bytes_moved(batch_size, kv_lens, page_size, itemsize=2, heads=LLAMA3_8B):
  num_qo_heads, num_kv_heads, head_dim = heads
  touched = sum(-(-int(n) // page_size) * page_size for n in kv_lens)
  q_out = 2 * batch_size * num_qo_heads * head_dim * itemsize
  return q_out + 2 * touched * num_kv_heads * head_dim * itemsize


rel_err = _timing.rel_err


def gpu_correctness():
  """Small NaN-poisoned caches through the public API on the GPU kernel."""
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
  import attention_utils as au  # pylint: disable=import-outside-toplevel
  import pkvattn  # pylint: disable=import-outside-toplevel
  rows = []
  rng = np.random.default_rng(int(time.time()))
  cases = [
      dict(fmt="pair", g=4, ps=16, kw={}),
      dict(fmt="pool", g=8, ps=16, kw=dict(window_left=37)),
      dict(fmt="flashinfer", g=4, ps=64, kw=dict(logits_soft_cap=30.0)),
      dict(fmt="pair", g=1, ps=8, kw=dict(sinks=True)),
      dict(fmt="pair", g=8, ps=64, kw=dict(window_left=100, sinks=True,
                                          logits_soft_cap=20.0)),
      dict(fmt="pool", g=4, ps=128, kw={}),
  ]
  for dtype in (jnp.bfloat16, jnp.float16):
    for c in cases:
      ps, g, hkv = c["ps"], c["g"], 2
      kv_lens = [0, 1, ps - 1, ps, ps + 1, 3 * ps + 5, 700, 1500]
      p = au.make_paged(rng, kv_lens, page_size=ps, num_kv_heads=hkv,
                        head_dim=128, dtype=dtype, fmt=c["fmt"])
      q = rng.standard_normal((len(kv_lens), g * hkv, 128)).astype(np.float32)
      qd = np.asarray(jnp.asarray(q, dtype).astype(jnp.float32))
      kw = dict(c["kw"])
      sinks = None
      if kw.pop("sinks", False):
        sinks = rng.standard_normal(g * hkv).astype(np.float32)
        kw["sinks"] = jnp.asarray(sinks)
      try:
        out, lse = pkvattn.paged_decode(
            jnp.asarray(qd, dtype), p.kv_cache, jnp.asarray(p.page_table),
            jnp.asarray(p.kv_lens), return_lse=True, impl="pallas", **kw)
        out2, _ = pkvattn.paged_decode(
            jnp.asarray(qd, dtype), p.kv_cache, jnp.asarray(p.page_table),
            jnp.asarray(p.kv_lens), return_lse=True, impl="pallas", **kw)
        deterministic = bool(jnp.array_equal(out, out2))
        ok = True
        worst = 0.0
        for b, n in enumerate(kv_lens):
          exp, exp_lse = au.dense_attention(
              qd[b:b + 1], p.k[b], p.v[b], [n - 1], n, sm_scale=128**-0.5,
              window_left=kw.get("window_left", -1),
              logits_soft_cap=kw.get("logits_soft_cap"), sinks=sinks)
          try:
            au.assert_close(out[b:b + 1], exp, dtype, f"b={b}")
            au.assert_lse_close(lse[b], exp_lse[0], dtype)
          except AssertionError as e:
            ok = False
            print("MISMATCH", c, dtype, b, str(e)[:300])
          if n:
            worst = max(worst, rel_err(out[b:b + 1], exp.astype(np.float32)))
        rows.append(dict(case=str({k: v for k, v in c.items()}),
                         dtype=jnp.dtype(dtype).name, ok=ok,
                         deterministic=deterministic, worst_rel_err=worst))
      except Exception:  # noqa: BLE001
        traceback.print_exc()
        rows.append(dict(case=str(c), dtype=jnp.dtype(dtype).name, ok=False,
                         error=traceback.format_exc()[-400:]))
  return rows


def extra_roofs(num_bytes=2 << 30):
  """Cross-checks of the shared copy roof, decimal TB/s.

  * `xla_read`: an XLA sum over a `num_bytes` bf16 array (read-only traffic,
    which is what decode does).
  * `torch_copy`: `torch.Tensor.copy_` of `num_bytes`, read + write counted,
    timed with CUDA events (the figure DESIGN.md quotes).
  """
  res = {}
  try:
    n = num_bytes // 2
    x = jax.random.normal(jax.random.key(3), (n // 1024, 1024), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.sum(a, axis=0, dtype=jnp.float32))
    t = _timing.time_fn(f, x)
    res["xla_read"] = num_bytes / (t["median_ms"] * 1e-3) / 1e12
    del x
  except Exception:  # noqa: BLE001
    traceback.print_exc()
  torch_copy = _timing.torch_copy_roof_gbps(num_bytes)
  if torch_copy:
    res["torch_copy"] = torch_copy / 1e3
  return res


def default_config(spec):
  """`paged_decode`'s own choice for the spec (what the public API runs)."""
  hq, hkv, d = spec.get("heads", LLAMA3_8B)
  return kernel.Config.default_for(
      batch_size=spec["batch_size"], num_kv_heads=hkv,
      page_size=spec["page_size"],
      max_pages=spec["seq_len"] // spec["page_size"], head_dim=d,
      group_size=hq // hkv, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16)


def pallas_configs(spec, quick):
  ps = spec["page_size"]
  default = default_config(spec)
  out = [("default", default)]
  if quick:
    return out
  seen = {default}
  for tokens in (64, 128):
    ppb = max(1, tokens // ps)
    for ks in sorted({max(1, default.k_splits // 2), default.k_splits,
                      default.k_splits * 2}):
      for warps, stages in ((4, 2), (4, 3), (4, 4), (2, 3)):
        c = kernel.Config(ppb, ks, warps, stages)
        if c not in seen:
          seen.add(c)
          out.append((f"ppb{ppb}_ks{ks}_w{warps}_s{stages}", c))
  return out


def jax_paged_attention_fn(**tuning):
  from jax.experimental.pallas.ops.gpu import paged_attention as jpa  # pylint: disable=import-outside-toplevel
  fn = jax.jit(lambda q, k, v, t, n: jpa.paged_attention(q, k, v, t, n, **tuning))
  return fn


def peer_flashinfer(record, q, k_pages, v_pages, table, kv_lens, heads):
  """FlashInfer 0.7.2's CUDA-core and tensor-core decode, and pkvattn's
  default, on one cache in FlashInfer's layout `[num_pages, 2, page_size,
  num_kv_heads, head_dim]` (pkvattn's "flashinfer" kv_cache format): the
  same buffers, each output checked against the f32 reference, timed per
  call and by kernel time."""
  import pkvattn  # pylint: disable=import-outside-toplevel
  hq, hkv, _ = heads
  kv = jnp.stack([k_pages, v_pages], axis=1)
  fn = jax.jit(lambda q, c, t, n: pkvattn.paged_decode(q, c, t, n,
                                                       impl="pallas"))
  record("pallas", "default, flashinfer layout", fn, (q, kv, table, kv_lens))
  for tc in (False, True):
    label = "tensor cores" if tc else "cuda cores"
    try:
      peer = _flashinfer.decode_fn(
          q, kv, np.asarray(table), np.asarray(kv_lens), num_qo_heads=hq,
          num_kv_heads=hkv, use_tensor_cores=tc)
    except Exception:  # noqa: BLE001  (no flashinfer wheel, no JIT)
      traceback.print_exc()
      print(f"  flashinfer {label}: skipped")
      continue
    record("flashinfer", label, None, (), peer=peer)
  del kv


def run_spec(name, spec, quick, time_budget_s, with_flashinfer=True):
  rows = []
  t_spec = time.perf_counter()
  b, s, ps = spec["batch_size"], spec["seq_len"], spec["page_size"]
  heads = spec.get("heads", LLAMA3_8B)
  d = heads[2]
  q, k_pages, v_pages, table, kv_lens = make_inputs(b, s, ps, heads=heads)
  nbytes = bytes_moved(b, np.asarray(kv_lens), ps, heads=heads)
  scale = d**-0.5
  expected, _ = reference.paged_decode_reference(
      q.astype(jnp.float32), k_pages.astype(jnp.float32),
      v_pages.astype(jnp.float32), table, table, kv_lens, sm_scale=scale)
  expected = jax.block_until_ready(expected)

  iters, min_time_s = (15, 0.15) if quick else (30, 0.3)

  def record(impl, config_name, fn, args, check=True, peer=None):
    """Checks and times `fn(*args)`, or with `peer=(run, out)` a torch
    launch `run()` whose output `out` its wrapper already computed."""
    try:
      if peer is None:
        out = fn(*args)
        out = out[0] if isinstance(out, tuple) else out
        t = _timing.time_fn(fn, *args, iters=iters, min_time_s=min_time_s)
        # GPU kernel time alone (profiler): back-to-back calls above also
        # pay XLA's per-call launch, 10-15% of a 0.3 ms kernel and up to a
        # third of a small-head one.
        t["kernel_ms"] = _timing.device_kernel_ms(fn, lambda: args, calls=10)
      else:
        run, out = peer
        t = dict(median_ms=_flashinfer.torch_time(run, iters=iters,
                                                  min_time_s=min_time_s),
                 kernel_ms=_flashinfer.kernel_ms(run, calls=10))
      err = rel_err(out, expected) if check else None
      ok = err is not None and err < 2e-2
      row = dict(spec=name, impl=impl, config=config_name, **spec,
                 rel_err=err, correct=ok, bytes_moved=nbytes, **t,
                 achieved_tbps=nbytes / (t["median_ms"] * 1e-3) / 1e12,
                 kernel_tbps=(nbytes / (t["kernel_ms"] * 1e-3) / 1e12
                              if t["kernel_ms"] else None))
      if not ok:
        # never report bandwidth of a wrong kernel
        row["achieved_tbps"] = row["kernel_tbps"] = None
      rows.append(row)
      print(f"  {impl:10s} {config_name:26s} {t['median_ms']:.4f} ms "
            f"{nbytes / (t['median_ms'] * 1e-3) / 1e12:.3f} TB/s, kernel "
            f"{t['kernel_ms']:.4f} ms, err={err}", flush=True)
    except Exception:  # noqa: BLE001
      print(f"  {impl} {config_name} FAILED")
      traceback.print_exc()
      rows.append(dict(spec=name, impl=impl, config=config_name, **spec,
                       error=traceback.format_exc()[-600:]))

  for cname, cfg in pallas_configs(spec, quick):
    if time.perf_counter() - t_spec > time_budget_s and cname != "default":
      print("  (sweep cut by time budget)")
      break
    fn = jax.jit(lambda q, k, v, t, n, cfg=cfg: kernel.paged_decode(
        q, k, v, t, t, n, sm_scale=scale, config=cfg))
    record("pallas", cname, fn, (q, k_pages, v_pages, table, kv_lens))

  if with_flashinfer:
    peer_flashinfer(record, q, k_pages, v_pages, table, kv_lens, heads)

  # The default again, last: its spread between the two timings is the noise.
  cfg = default_config(spec)
  fn = jax.jit(lambda q, k, v, t, n, cfg=cfg: kernel.paged_decode(
      q, k, v, t, t, n, sm_scale=scale, config=cfg))
  record("pallas", "default_repeat", fn, (q, k_pages, v_pages, table, kv_lens))
  cfg = dataclasses.replace(cfg, kv_eviction="evict_first")
  fn = jax.jit(lambda q, k, v, t, n, cfg=cfg: kernel.paged_decode(
      q, k, v, t, t, n, sm_scale=scale, config=cfg))
  record("pallas", "default_evict_first", fn,
         (q, k_pages, v_pages, table, kv_lens))

  xla = jax.jit(lambda q, k, v, t, n: reference.paged_decode_reference(
      q, k, v, t, t, n, sm_scale=scale)[0])
  record("xla", "reference", xla, (q, k_pages, v_pages, table, kv_lens))

  # JAX paged_attention: head-major pages, transposed outside the timed region;
  # it does not scale q, so pass q * sm_scale. Its spare NaN pages are unread.
  kh = jnp.transpose(k_pages, (2, 0, 1, 3))
  vh = jnp.transpose(v_pages, (2, 0, 1, 3))
  qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
  tunings = [("defaults", {})]
  pages = s // ps
  for ppcb, ks, w, st in ((4, 8, 4, 1), (8, 8, 4, 1), (4, 16, 4, 1),
                          (2, 8, 4, 1), (4, 4, 4, 1), (8, 16, 4, 2)):
    if pages % ks == 0 and (pages // ks) % min(ppcb, pages // ks) == 0:
      tunings.append((f"ppcb{ppcb}_ks{ks}_w{w}_s{st}",
                      dict(pages_per_compute_block=ppcb, k_splits=ks,
                           num_warps=w, num_stages=st)))
  if quick:
    tunings = tunings[:2]
  for tname, tune in tunings:
    record("jax_paged_attention", tname, jax_paged_attention_fn(**tune),
           (qs, kh, vh, table, kv_lens))
  del kh, vh
  return rows


def hlo_copy_check():
  """Counts pool-sized copies/transposes in the compiled public decode (all formats)."""
  import pkvattn  # pylint: disable=import-outside-toplevel
  res = {}
  q, k, v, table, n = make_inputs(8, 1024, 16)
  pool = jnp.concatenate([k, v])
  fi = jnp.stack([k, v], axis=1)
  split = jnp.stack([table, table + k.shape[0]], axis=1)
  for fmt, cache, tbl in (("pair", (k, v), table), ("pool", pool, split),
                          ("flashinfer", fi, table)):
    f = jax.jit(lambda q, c, t, n: pkvattn.paged_decode(q, c, t, n,
                                                        impl="pallas"))
    txt = f.lower(q, cache, tbl, n).compile().as_text()
    big = [ln for ln in txt.splitlines()
           if ("copy" in ln or "transpose" in ln) and
           (f"[{k.shape[0]}," in ln or f"[{2 * k.shape[0]}," in ln or
            f"[{k.shape[0]},2," in ln)]
    res[fmt] = len(big)
    if big:
      print(fmt, "pool-sized copies:", big[:3])
  return res


def plot(path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  with open(path) as f:
    data = json.load(f)
  rows = [r for r in data["rows"] if r.get("achieved_tbps")]
  specs = list(dict.fromkeys(r["spec"] for r in rows))
  series = {
      "pkvattn pallas (best)": lambda r: r["impl"] == "pallas",
      "pkvattn pallas (default)": lambda r: r["impl"] == "pallas" and r["config"] == "default",
      "pkvattn xla": lambda r: r["impl"] == "xla",
      "FlashInfer 0.7.2 (faster mode)": lambda r: r["impl"] == "flashinfer",
      "JAX paged_attention (defaults)": lambda r: r["impl"] == "jax_paged_attention" and r["config"] == "defaults",
      "JAX paged_attention (best)": lambda r: r["impl"] == "jax_paged_attention",
  }
  fig, ax = plt.subplots(figsize=(12, 4.5))
  width = 0.8 / (len(series) + 1)
  for i, (label, sel) in enumerate(series.items()):
    vals = [max([r["achieved_tbps"] for r in rows if r["spec"] == s and sel(r)],
                default=0.0) for s in specs]
    ax.bar(np.arange(len(specs)) + i * width, vals, width, label=label)
  roof = data.get("copy_roof_tbps")
  if roof:
    ax.axhline(roof, color="k", ls="--", lw=1,
               label=f"copy roof (bench/_timing) {roof:.2f} TB/s")
    ax.axhline(0.85 * roof, color="gray", ls=":", lw=1, label="0.85 x copy roof")
  best = data.get("best_roof_tbps")
  if best and best > (roof or 0) * 1.01:
    ax.axhline(best, color="r", ls="--", lw=1,
               label=f"best measured roof {best:.2f} TB/s")
  ax.set_xticks(np.arange(len(specs)) + 0.4 - width / 2)
  ax.set_xticklabels([s.replace("_decode", "") for s in specs], fontsize=7,
                     rotation=20)
  ax.set_ylabel("KV bandwidth, TB/s (decimal)")
  ax.set_title(f"Paged decode, bf16 — {data['device']} "
               f"({data['date'][:10]})")
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  out = os.path.splitext(path)[0] + ".png"
  fig.savefig(out, dpi=120)
  print("wrote", out)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--plot", default=None)
  ap.add_argument("--specs", default=",".join(SPECS))
  ap.add_argument("--spec-budget-s", type=float, default=60.0)
  ap.add_argument("--no-flashinfer", action="store_true",
                  help="skip the FlashInfer peer")
  args = ap.parse_args()
  if args.plot:
    plot(args.plot)
    return
  env = _timing.environment()
  print(env, flush=True)
  t0 = time.perf_counter()
  correctness = gpu_correctness()
  print(f"correctness ({time.perf_counter() - t0:.0f}s):")
  _timing.print_table(correctness, ["case", "dtype", "ok", "deterministic",
                                    "worst_rel_err"])
  hlo = {}
  try:
    hlo = hlo_copy_check()
    print("pool-sized copies in compiled HLO:", hlo)
  except Exception:  # noqa: BLE001
    traceback.print_exc()
  roof = _timing.copy_roof_gbps() / 1e3
  roofs = dict(shared_copy=roof, **extra_roofs())
  best_roof = max(roofs.values())
  print(f"copy roof {roof:.3f} TB/s; cross-checks {roofs}", flush=True)
  rows = []
  device = env["device"].replace(" ", "_")
  for name in args.specs.split(","):
    print(name, flush=True)
    rows += run_spec(name, SPECS[name], args.quick, args.spec_budget_s,
                     with_flashinfer=not args.no_flashinfer)
    # Partial results survive a run cut short.
    _timing.write_results(f"decode_{device}_partial", rows, out_dirs=())
  for r in rows:
    if r.get("achieved_tbps"):
      r["fraction_of_copy_roof"] = r["achieved_tbps"] / roof
      r["fraction_of_best_roof"] = r["achieved_tbps"] / best_roof
  for name in args.specs.split(","):
    xla = [r for r in rows if r["spec"] == name and r["impl"] == "xla"
           and "median_ms" in r]
    fi = [r for r in rows if r["spec"] == name and r["impl"] == "flashinfer"
          and r.get("correct")]
    fi_ms = min((r["median_ms"] for r in fi), default=None)
    fi_kernel = min((r["kernel_ms"] for r in fi if r.get("kernel_ms")),
                    default=None)
    for r in rows:
      if r["spec"] == name and xla and "median_ms" in r:
        r["speedup_vs_xla"] = xla[0]["median_ms"] / r["median_ms"]
      # > 1: faster than FlashInfer's faster decode mode on this spec.
      if r["spec"] == name and r.get("correct") and fi_ms:
        r["x_flashinfer"] = fi_ms / r["median_ms"]
        if fi_kernel and r.get("kernel_ms"):
          r["x_flashinfer_kernel"] = fi_kernel / r["kernel_ms"]
  _timing.write_results(f"decode_{device}", rows, extra=dict(
      copy_roof_tbps=roof, roofs_tbps=roofs, best_roof_tbps=best_roof,
      gpu_correctness=correctness, hlo_pool_copies=hlo))
  summary = []
  for name in args.specs.split(","):
    def best(impl, config=None, name=name):
      c = [r for r in rows if r["spec"] == name and r["impl"] == impl
           and r.get("achieved_tbps") and (config is None or r["config"] == config)]
      return max(c, key=lambda r: r["achieved_tbps"], default=None)
    for label, r in (("pallas best", best("pallas")),
                     ("pallas default", best("pallas", "default")),
                     ("pallas default again", best("pallas", "default_repeat")),
                     ("pallas default, fi layout",
                      best("pallas", "default, flashinfer layout")),
                     ("flashinfer cuda cores", best("flashinfer", "cuda cores")),
                     ("flashinfer tensor cores",
                      best("flashinfer", "tensor cores")),
                     ("xla", best("xla")),
                     ("jax_pa defaults", best("jax_paged_attention", "defaults")),
                     ("jax_pa best", best("jax_paged_attention"))):
      if r:
        summary.append(dict(spec=name.replace("_decode", ""),
                            impl=label, config=r["config"],
                            ms=r["median_ms"], tbps=r["achieved_tbps"],
                            x_roof=r["achieved_tbps"] / roof,
                            x_best_roof=r["achieved_tbps"] / best_roof,
                            kernel_ms=r.get("kernel_ms"),
                            kernel_tbps=r.get("kernel_tbps"),
                            x_fi=r.get("x_flashinfer"),
                            x_fi_kernel=r.get("x_flashinfer_kernel"),
                            kernel_x_best_roof=(r["kernel_tbps"] / best_roof
                                                if r.get("kernel_tbps")
                                                else None)))
  print(f"\nroofs {roofs} TB/s on {env['device']}")
  _timing.print_table(summary, ["spec", "impl", "ms", "tbps", "x_roof",
                                "kernel_ms", "kernel_tbps",
                                "kernel_x_best_roof", "x_fi", "x_fi_kernel"])
  _timing.write_results(f"decode_{device}_summary", summary,
                        extra=dict(roofs_tbps=roofs))


if __name__ == "__main__":
  main()
