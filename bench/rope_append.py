"""Fused RoPE + paged K/V append: `pkvattn.apply_rope_and_append` against
its XLA path (`impl="xla"`) and the copy roof.

Run on a GPU:  `python -m bench.rope_append [--specs NAME,...] [--fp8]
[--backend triton,mosaic,mosaic-chunks] [--chained 30]`

Specs (`SPECS`; page 16, bf16, Llama 3 RoPE with theta 500000): prefill
batches of 16 x 4,096 / 2 x 4,096 / 4 x 1,024 tokens and decode batches of
256 / 8 tokens at random positions, with Llama-3-8B (32/8/128), SmolLM2
(9/3/64) and Gemma 3 270M (4/1/256) heads; the rows are looked up in the
shared page table, and the pools are donated (the call writes in place).

Each arm is checked against the XLA path on a NaN-filled cache first
(rotated q within 2e-2, written rows equal, every other row still NaN) and
its compiled module for pool-sized copies (`pool_copies`, `has_alias`).
Times: `kernel_us` (GPU kernel time of one call, profiler trace; the rates
use it), `per_call_us` (one jitted call per step, back to back, host
launch included) and `chained_us` (`--chained` calls unrolled in one jit,
q and the pools fed forward: launch gaps in, host dispatch once).
`gbps = bytes_moved / kernel_us` with `bytes_moved` = q, k, v read + rotated
q and the K/V rows written; `x_xla` = the XLA path's kernel time / the
arm's.

`--fp8`: float8_e4m3fn pools (`k_scale = v_scale = 0.05`).
Writes `<out>/rope_append[_fp8]_<device>.json`; prints a table last.
"""

from __future__ import annotations

import argparse
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import results
from bench.common import specs as specs_lib
from bench.common import timing

PAGE = 16
CTX = 4096
FP8_SCALE = 0.05
WORK = {"prefill_16x4096": (16, 4096), "prefill_2x4096": (2, 4096),
        "prefill_4x1024": (4, 1024), "decode_256": (256, 1),
        "decode_8": (8, 1)}
SPECS = [f"{h}_{w}" for h in ("llama3_8b", "smollm2", "gemma3_270m")
         for w in WORK]


def rope_config():
  import pkvattn  # pylint: disable=import-outside-toplevel
  return pkvattn.RopeConfig(theta=500000.0,
                            scaling=pkvattn.Llama3RopeScaling())


def make_inputs(name: str, seed: int = 0):
  """`(q, k, v, batch_indices, positions, page_table, num_pages)` of a
  spec name `<heads>_<work>`."""
  heads, work = name.split("_prefill_") if "_prefill_" in name else \
      name.split("_decode_")
  work = ("prefill_" if "_prefill_" in name else "decode_") + work
  hq, hkv, d = specs_lib.HEADS[heads]
  batch, q_len = WORK[work]
  rng = np.random.default_rng(seed)
  max_pages = CTX // PAGE
  num_pages = batch * max_pages + 64
  table = rng.permutation(num_pages)[:batch * max_pages].reshape(
      batch, max_pages).astype(np.int32)
  pos = (rng.integers(0, CTX // 2, size=batch) if q_len == 1
         else np.tile(np.arange(q_len), batch))
  bi = np.repeat(np.arange(batch), q_len)
  t = batch * q_len
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (t, hq, d), jnp.bfloat16)
  k = jax.random.normal(kk, (t, hkv, d), jnp.bfloat16)
  v = jax.random.normal(kv, (t, hkv, d), jnp.bfloat16)
  return (q, k, v, jnp.asarray(bi, jnp.int32), jnp.asarray(pos, jnp.int32),
          jnp.asarray(table), num_pages)


def public_fn(impl: str, fp8: bool):
  import pkvattn  # pylint: disable=import-outside-toplevel
  rope = rope_config()
  scales = (dict(k_scale=jnp.float32(FP8_SCALE),
                 v_scale=jnp.float32(FP8_SCALE)) if fp8 else {})

  def f(q, k, v, bi, pos, cache, table):
    return pkvattn.apply_rope_and_append(q, k, v, bi, pos, cache, table, rope,
                                         impl=impl, **scales)
  return f


def kernel_arms(names, q, k, fp8):
  if not names:
    return []
  from bench.common import kernels  # pylint: disable=import-outside-toplevel
  inv = rope_config().inv_freq(q.shape[-1])
  scales = (dict(k_scale=jnp.float32(FP8_SCALE),
                 v_scale=jnp.float32(FP8_SCALE)) if fp8 else {})
  out = []
  for name in names:
    for label, f in kernels.rope_append_arms(
        name, num_tokens=q.shape[0], num_qo_heads=q.shape[1],
        num_kv_heads=k.shape[1], inv_freq=inv):
      out.append((label, lambda *a, f=f: f(*a, **scales)))
  return out


def chained_ms(fn, args, steps: int) -> float:
  """GPU-stream time per call of `steps` calls unrolled in one jit, q and
  the pools fed forward (an optimization barrier between calls keeps XLA
  from merging them), ms."""
  def many(q, k, v, bi, pos, cache, table):
    for _ in range(steps):
      q, cache = fn(q, k, v, bi, pos, cache, table)
      q, k, v, cache = jax.lax.optimization_barrier((q, k, v, cache))
    return q, cache
  many = jax.jit(many, donate_argnums=(5,))
  q, k, v, bi, pos, cache, table = args
  state = {"q": q, "cache": cache}

  def step():
    state["q"], state["cache"] = many(state["q"], k, v, bi, pos,
                                      state["cache"], table)
    return state["q"]
  return timing.time_fn(step, iters=10, min_time_s=0.1)["median_ms"] / steps


def hlo_report(fn, args, pool_bytes) -> dict:
  """Does the compiled module alias the pool, and copy it?"""
  text = fn.lower(*args).compile().as_text()
  copies = 0
  for line in text.splitlines():
    if (" copy(" in line or "copy-start" in line) and "=" in line:
      shape = line.split("=")[1].split("copy")[0]
      dims = [int(x) for x in shape[shape.find("[") + 1:shape.find("]")]
              .split(",") if x.strip().isdigit()]
      if dims and np.prod(dims) >= pool_bytes:
        copies += 1
  return dict(has_alias="input_output_alias" in text, pool_copies=copies)


def run_spec(name, args) -> list[dict]:
  q, k, v, bi, pos, table, num_pages = make_inputs(name)
  hkv, d = k.shape[1], k.shape[2]
  t = q.shape[0]
  dtype = jnp.float8_e4m3fn if args.fp8 else jnp.bfloat16
  shape = (num_pages, PAGE, hkv, d)

  def nan_cache():
    fill = jnp.full(shape, jnp.nan, jnp.bfloat16).astype(dtype)
    return (fill, jnp.array(fill))  # two buffers: both are donated

  itemsize = 1 if args.fp8 else 2
  bytes_moved = t * d * ((2 * q.shape[1] + 2 * hkv) * 2 + 2 * hkv * itemsize)
  arms = [("pkvattn", public_fn("pallas", args.fp8)),
          ("xla", public_fn("xla", args.fp8))]
  arms += kernel_arms(args.backend, q, k, args.fp8)
  xla = jax.jit(arms[1][1], donate_argnums=(5,))
  want = xla(q, k, v, bi, pos, nan_cache(), table)
  rows = []
  for label, call in arms:
    fn = jax.jit(call, donate_argnums=(5,))
    try:
      got = fn(q, k, v, bi, pos, nan_cache(), table)
      ok = float(jnp.max(jnp.abs(got[0].astype(jnp.float32) - want[0].astype(
          jnp.float32)))) <= 2e-2
      for a, e in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        ok &= bool(np.array_equal(np.isnan(a), np.isnan(e)))
        m = ~np.isnan(e)
        ok &= bool(not m.any() or np.max(np.abs(a[m] - e[m])) <= 2e-2)
      state = {"cache": nan_cache()}

      def step(fn=fn, state=state):
        out, state["cache"] = fn(q, k, v, bi, pos, state["cache"], table)
        return out
      per_call = timing.time_fn(step)["median_ms"]
      kernel = timing.device_kernel_ms(
          fn, lambda fn=fn: (q, k, v, bi, pos, nan_cache(), table))
      row = dict(spec=name, impl=label, num_tokens=t, correct=bool(ok),
                 per_call_us=per_call * 1e3, kernel_us=kernel * 1e3 or None,
                 chained_us=1e3 * chained_ms(
                     call, (q, k, v, bi, pos, nan_cache(), table),
                     args.chained),
                 bytes_moved=bytes_moved,
                 **hlo_report(fn, (q, k, v, bi, pos, nan_cache(), table),
                              int(np.prod(shape)) * itemsize))
      if kernel:
        row["gbps"] = bytes_moved / (kernel * 1e-3) / 1e9
    except Exception:  # noqa: BLE001  (an arm that rejects the shape)
      traceback.print_exc()
      row = dict(spec=name, impl=label, error=traceback.format_exc()[-800:])
    rows.append(row)
    print(row, flush=True)
  x = next((r for r in rows if r["impl"] == "xla" and r.get("kernel_us")),
           None)
  for r in rows:
    if x and r.get("kernel_us"):
      r["x_xla"] = x["kernel_us"] / r["kernel_us"]
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--specs", default="llama3_8b_prefill_16x4096,"
                  "llama3_8b_decode_256",
                  help=f"comma-separated of {SPECS} or 'all'")
  ap.add_argument("--fp8", action="store_true",
                  help="float8_e4m3fn pools (k_scale = v_scale = 0.05)")
  ap.add_argument("--backend", default="",
                  help="comma-separated kernel arms: triton, mosaic, "
                  "mosaic-chunks (bench.common.kernels.ROPE_ARMS)")
  ap.add_argument("--chained", type=int, default=30,
                  help="calls per program of chained_us (a model's layers)")
  ap.add_argument("--roof", action="store_true",
                  help="measure the copy roof (x_roof per row)")
  results.add_out_arg(ap)
  args = ap.parse_args(argv)
  args.backend = [b for b in args.backend.split(",") if b]
  chosen = SPECS if args.specs == "all" else args.specs.split(",")
  for s in chosen:
    if s not in SPECS:
      ap.error(f"--specs: expected names of {SPECS}, got {s!r}")
  env = results.environment()
  print(env, flush=True)
  extra = dict(backend_arms=args.backend, chained_calls=args.chained)
  roof = None
  if args.roof:
    roof = max(timing.copy_roof_gbps(), timing.torch_copy_roof_gbps() or 0)
    extra["copy_roof_gbps"] = roof
  name = f"rope_append{'_fp8' if args.fp8 else ''}_{results.device_tag()}"
  rows = []
  for spec in chosen:
    rows += run_spec(spec, args)
    if roof:
      for r in rows:
        if r.get("gbps"):
          r["x_roof"] = r["gbps"] / roof
    results.write(name, rows, out=args.out, extra=extra, env=env)
  print()
  timing.print_table(rows, ["spec", "impl", "correct", "pool_copies",
                            "per_call_us", "chained_us", "kernel_us", "gbps",
                            "x_roof", "x_xla"])


if __name__ == "__main__":
  main()
