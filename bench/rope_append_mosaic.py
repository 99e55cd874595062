"""Mosaic-GPU against Pallas-Triton fused RoPE + paged append (Hopper).

Run on an H100 / H200:  `python -m bench.rope_append_mosaic`

Kernel time (`_timing.device_kernel_ms`, profiler trace) of both kernels'
defaults (`rope_append.Config.default_for`, `rope_append_mgpu.Config.
default_for`) and of the Mosaic kernel with the default's head split and
each chunk size (4, 8, 16 bytes) and with one head per program, on the
same inputs: donated pools (checked aliased and never copied in the
compiled module), page 16, the rows looked up in the kernel, bf16,
Llama-3-8B / SmolLM2-135M / Gemma 3 270M heads, from 65,536 tokens
(16 x 4,096-token prefill) down to 8 decode tokens. The two defaults'
outputs are compared (`identical`: bit for bit). `bytes_moved` counts q, k,
v read and q, k, v rows written once (decimal GB/s). `--fp8`: float8_e4m3fn
pools with k_scale = v_scale = 0.05 (quantized on write). Each spec also
times 30 chained calls in one program (`*_chained_us`, launch gaps
included). The numerics against the float64 oracle are
`tests/test_rope_append_mgpu.py`'s.

Writes `bench/results/rope_append_mosaic_<device>.json` (and under `$OUT`)
and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench import _timing
from bench.bench_rope_append import device_ms, hlo_report
from pkvattn.pallas_kernels import rope_append as triton_kernel
from pkvattn.pallas_kernels import rope_append_mgpu as mosaic_kernel

PAGE = 16
HEADS = {"llama3_8b": (32, 8, 128), "smollm2": (9, 3, 64),
         "gemma3_270m": (4, 1, 256)}
WORK = {"prefill_16x4096": (16, 4096), "prefill_2x4096": (2, 4096),
        "prefill_4x1024": (4, 1024), "prefill_2x1024": (2, 1024),
        "decode_256": (256, 1), "decode_8": (8, 1)}


def _inv_freq(rot: int, theta: float = 10000.0) -> np.ndarray:
  return (1.0 / theta ** (np.arange(0, rot, 2) / rot)).astype(np.float32)


def _inputs(hq, hkv, d, batch, q_len, seed=0):
  rng = np.random.default_rng(seed)
  ctx = 4096
  max_pages = ctx // PAGE
  num_pages = batch * max_pages + 64
  table = rng.permutation(num_pages)[:batch * max_pages].reshape(
      batch, max_pages).astype(np.int32)
  pos = (rng.integers(0, ctx, size=batch) if q_len == 1
         else np.tile(np.arange(q_len), batch))
  bi = np.repeat(np.arange(batch), q_len)
  t = batch * q_len
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (t, hq, d), jnp.bfloat16)
  k = jax.random.normal(kk, (t, hkv, d), jnp.bfloat16)
  v = jax.random.normal(kv, (t, hkv, d), jnp.bfloat16)
  return (q, k, v, jnp.asarray(bi, jnp.int32), jnp.asarray(pos, jnp.int32),
          jnp.asarray(table), num_pages)


FP8_SCALES = (0.05, 0.05)  # k_scale, v_scale of the FP8 pools (--fp8)


def _fn(backend, d, config=None, fp8=False):
  inv = jnp.asarray(_inv_freq(d, 500000.0))
  scales = (dict(k_scale=jnp.float32(FP8_SCALES[0]),
                 v_scale=jnp.float32(FP8_SCALES[1])) if fp8 else {})

  def f(q, k, v, bi, pos, cache, table):
    paged = (bi, table, "shared")
    if backend == "triton":
      cfg = triton_kernel.Config.default_for(k.shape[0], q.shape[1],
                                             k.shape[1])
    else:
      cfg = config or mosaic_kernel.Config.default_for(
          k.shape[0], q.shape[1], k.shape[1])
    q, kp, vp = triton_kernel.rope_append(
        q, k, v, pos, None, None, inv, cache[0], cache[1],
        interleaved=False, paged=paged, config=cfg, **scales)
    return q, (kp, vp)
  return jax.jit(f, donate_argnums=(5,))


def _label(c) -> str:
  return (("h1" if c.one_head else f"s{c.num_splits}")
          + (f"_l{c.max_loads}" if c.max_loads != mosaic_kernel.MAX_LOADS
             else "")
          + (f"_c{c.chunk_bytes}" if c.chunk_bytes != mosaic_kernel.CHUNK
             else ""))


CHAINED_STEPS = 30  # calls per program (a 30-layer model's appends)


def timings(variants_too: bool = True, fp8: bool = False):
  rows = []
  for hname, (hq, hkv, d) in HEADS.items():
    for wname, (batch, q_len) in WORK.items():
      q, k, v, bi, pos, table, num_pages = _inputs(hq, hkv, d, batch, q_len)
      t = q.shape[0]
      # q, k, v read, q written (2 bytes), k, v rows written (1 with FP8).
      bytes_moved = t * d * ((2 * hq + 2 * hkv) * 2 + 2 * hkv * (
          1 if fp8 else 2))
      shape = (num_pages, PAGE, hkv, d)
      pool_dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16

      def cache():
        return (jnp.zeros(shape, pool_dtype), jnp.zeros(shape, pool_dtype))

      default = mosaic_kernel.Config.default_for(t, hq, hkv)
      variants = [("triton", None), ("mosaic", None)]
      # The default's split with each chunk size; one head per program.
      cands = [dataclasses.replace(default, chunk_bytes=c) for c in (4, 8, 16)]
      cands.append(mosaic_kernel.Config(one_head=True, chunk_bytes=4))
      if variants_too:
        variants += [("mosaic", c) for c in cands if c != default]
      row = dict(heads=hname, work=wname, num_tokens=t,
                 mosaic_default=_label(default))
      outs = {}
      for backend, ns in variants:
        key = backend if ns is None else "mosaic_" + _label(ns)
        try:
          f = _fn(backend, d, ns, fp8)
          outs[key] = f(q, k, v, bi, pos, cache(), table)
          ms = _timing.device_kernel_ms(
              f, lambda: (q, k, v, bi, pos, cache(), table), calls=5)
          row[f"{key}_us"] = ms * 1e3
          row[f"{key}_gbps"] = bytes_moved / ms / 1e6
        except Exception:  # keep the run
          row[f"{key}_error"] = traceback.format_exc()[-1500:]
          print(row[f"{key}_error"], flush=True)
      for backend in ("triton", "mosaic"):  # launch gaps included
        try:
          row[f"{backend}_chained_us"] = 1e3 * device_ms(
              _fn(backend, d, fp8=fp8), (q, k, v, bi, pos, cache(), table),
              CHAINED_STEPS)
        except Exception:  # keep the run
          row[f"{backend}_chained_error"] = traceback.format_exc()[-800:]
      try:  # in place: the donated pools aliased, never copied
        f = _fn("mosaic", d, fp8=fp8)
        row["mosaic_hlo"] = hlo_report(
            f, (q, k, v, bi, pos, cache(), table),
            num_pages * PAGE * hkv * d * (1 if fp8 else 2))
      except Exception:  # keep the run
        row["mosaic_hlo"] = traceback.format_exc()[-800:]
      if "triton" in outs and "mosaic" in outs:
        same = all(bool(jnp.array_equal(a, b)) for a, b in zip(
            jax.tree.leaves(outs["triton"]), jax.tree.leaves(outs["mosaic"])))
        row["max_abs_diff"] = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(
                jnp.float32)))) for a, b in zip(
                    jax.tree.leaves(outs["triton"]),
                    jax.tree.leaves(outs["mosaic"])))
        row["identical"] = same
        row["triton_over_mosaic"] = row["triton_us"] / row["mosaic_us"]
      print(row, flush=True)
      rows.append(row)
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--defaults-only", action="store_true",
                  help="time only the two defaults (no Mosaic variants)")
  ap.add_argument("--tag", default="", help="suffix of the results name")
  ap.add_argument("--fp8", action="store_true",
                  help="float8_e4m3fn pools (k_scale = v_scale = 0.05)")
  args = ap.parse_args()
  env = _timing.environment()
  env["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  print(env, flush=True)
  rows = timings(variants_too=not args.defaults_only, fp8=args.fp8)
  name = ("rope_append_mosaic_" + ("fp8_" if args.fp8 else "")
          + env["device"].replace(" ", "_")
          + (f"_{args.tag}" if args.tag else ""))
  _timing.write_results(name, rows, extra=dict(xla_flags=env["xla_flags"]))
  cols = ["heads", "work", "num_tokens", "triton_us", "mosaic_us",
          "triton_chained_us", "mosaic_chained_us",
          "triton_over_mosaic", "mosaic_default", "max_abs_diff",
          "mosaic_hlo"]
  cols += sorted({k for r in rows for k in r if k.startswith("mosaic_")
                  and k.endswith("_us")})
  _timing.print_table(rows, cols)


if __name__ == "__main__":
  main()
