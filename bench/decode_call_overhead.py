"""What one decode call costs the host: pkvattn's default `paged_decode`
beside a trivial jitted call on the same arguments and FlashInfer 0.7.2's
tensor-core decode, in one process.

Run on an H100 / H200:
  `python -m bench.decode_call_overhead [--specs 4,5,7,8] [--rounds 5]`

A lone decode call of 50-75 us (SmolLM2 / Gemma 3 270M heads) is short
enough that the host's launch of the next call can take longer than the
GPU's run of this one. Per spec of `bench_decode_mosaic.SPECS` (same pages,
"flashinfer" kv_cache format), three arms:

* `jax floor`: `jax.jit(lambda q, kv, t, n: q * 2)` on the decode's four
  arguments: JAX's dispatch of a one-kernel program with those inputs;
* `pkvattn default`: `paged_decode` with the default routing (on Hopper the
  per-warp Mosaic-GPU kernel);
* `flashinfer tc`: `BatchDecodeWithPagedKVCacheWrapper.run()` with tensor
  cores (planned once);
* `pkvattn triton`: `paged_decode` on the Pallas-Triton kernel (its
  default config for the spec);
* `jax add` / `torch add`: `kv_cache + 1` as one jitted program / one
  `torch.add(..., out=)`: the GPU time a program launch adds between
  back-to-back programs (`us - kernel_us`) in each framework, with no
  attention kernel.

In `--rounds` interleaved rounds, each arm gets `_timing.pipelined_ms`
(`ms`: the wall time a call adds to a stream of back-to-back calls) and
`host_us`: the time the Python loop of those calls takes before its
closing synchronisation, per call (the host's launch cost; the GPU queue
is far from full). `kernel_us` is the summed GPU kernel time per call
(`_timing.device_kernel_ms`, `_flashinfer.kernel_ms`). Reported per arm:
the median and the spread (min, max) over rounds. A call is host-bound
where `host_us` >= `kernel_us`; then `ms` measures dispatch, not the
kernel. Writes `bench/results/decode_call_overhead_<device>.json` (and
under `$OUT`); prints a table last.
"""

from __future__ import annotations

import os

# torch and jax share the GPU: no preallocation (set before jax loads).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import _flashinfer  # noqa: E402
from bench import _timing  # noqa: E402
from bench.bench_decode_mosaic import SHAPES, SPECS, _inputs, decode_fn  # noqa: E402
from pkvattn.pallas_kernels import paged_decode as kernel  # noqa: E402


def host_us(launch, sync, calls: int = 16) -> float:
  """Host time per `launch()` of `calls` back-to-back launches, us (the
  loop before its closing `sync`; few enough calls that neither JAX's
  limit on in-flight programs nor the GPU's queue holds the loop back)."""
  sync(launch())
  t0 = time.perf_counter()
  out = None
  for _ in range(calls):
    out = launch()
  t1 = time.perf_counter()
  sync(out)
  return (t1 - t0) / calls * 1e6


def run_spec(spec, rounds: int) -> list[dict]:
  import torch  # pylint: disable=import-outside-toplevel
  shape, b, s, ps = spec
  hq, hkv, d = SHAPES[shape]
  name = f"{shape}_b{b}_s{s}_p{ps}"
  q, kv, table, lens = _inputs(hq, hkv, d, b, s, ps)
  args = (q, kv, jnp.asarray(table), jnp.asarray(lens))
  floor = jax.jit(lambda q, kv, t, n: q * 2)
  ours = decode_fn(None, head_dim=d)
  triton = decode_fn(kernel.Config.default_for(
      batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
      head_dim=d, backend="triton"), head_dim=d)
  ref = ours(*args)
  run, fi_out = _flashinfer.decode_fn(q, kv, table, lens, num_qo_heads=hq,
                                      num_kv_heads=hkv, use_tensor_cores=True)
  err = _timing.rel_err(fi_out, ref)
  # One elementwise kernel over the pages in each framework: the GPU time a
  # program launch adds to a stream of them, with no attention kernel.
  add = jax.jit(lambda x: x + 1)
  kv_t = _flashinfer.to_torch(kv)
  kv_out = torch.empty_like(kv_t)

  def torch_add():
    return torch.add(kv_t, 1, out=kv_out)

  def jax_sync(x):
    jax.block_until_ready(x)

  def torch_sync(_):
    torch.cuda.synchronize()

  arms = {
      "jax floor": (lambda: floor(*args), jax_sync,
                    _timing.device_kernel_ms(floor, lambda: args, calls=5)),
      "pkvattn default": (lambda: ours(*args), jax_sync,
                          _timing.device_kernel_ms(ours, lambda: args,
                                                   calls=5)),
      "flashinfer tc": (run, torch_sync, _flashinfer.kernel_ms(run, calls=5)),
      "pkvattn triton": (lambda: triton(*args), jax_sync,
                         _timing.device_kernel_ms(triton, lambda: args,
                                                  calls=5)),
      "jax add": (lambda: add(kv), jax_sync,
                  _timing.device_kernel_ms(add, lambda: (kv,), calls=5)),
      "torch add": (torch_add, torch_sync,
                    _flashinfer.kernel_ms(torch_add, calls=5)),
  }
  samples = {k: ([], []) for k in arms}
  for _ in range(rounds):
    for label, (launch, sync, _) in arms.items():
      for _ in range(3):
        sync(launch())
      ms = _timing.pipelined_ms(launch, sync, iters=20,
                                min_time_s=0.2)["median_ms"]
      samples[label][0].append(ms * 1e3)
      samples[label][1].append(host_us(launch, sync))
  rows = []
  for label, (_, _, kms) in arms.items():
    per_call, host = samples[label]
    rows.append(dict(
        spec=name, impl=label, kernel_us=kms * 1e3,
        us=statistics.median(per_call), us_min=min(per_call),
        us_max=max(per_call), host_us=statistics.median(host),
        host_us_min=min(host), host_us_max=max(host),
        rounds=rounds, per_call_us_rounds=per_call, host_us_rounds=host,
        err_vs_pkvattn=err if label == "flashinfer tc" else None))
  fi = next(r for r in rows if r["impl"] == "flashinfer tc")
  for r in rows:
    if r["impl"] not in ("pkvattn default", "pkvattn triton",
                         "flashinfer tc"):
      continue
    r["x_flashinfer"] = fi["us"] / r["us"]
    r["x_flashinfer_kernel"] = fi["kernel_us"] / r["kernel_us"]
  for r in rows:
    print({k: v for k, v in r.items() if not k.endswith("_rounds")},
          flush=True)
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--specs", default="4,5,7,8",
                  help="comma-separated indices into "
                  "bench_decode_mosaic.SPECS (default: the small-head ones)")
  ap.add_argument("--rounds", type=int, default=5,
                  help="interleaved timing rounds per arm")
  args = ap.parse_args()
  if args.rounds < 1:
    ap.error(f"--rounds: expected >= 1, got {args.rounds}")
  picks = args.specs.split(",")
  if not all(i.isdigit() and int(i) < len(SPECS) for i in picks):
    ap.error(f"--specs: expected indices in [0, {len(SPECS)}), got "
             f"{args.specs!r}")
  env = _timing.environment()
  print(env, flush=True)
  rows = []
  for i in picks:
    rows += run_spec(SPECS[int(i)], args.rounds)
    _timing.write_results(
        f"decode_call_overhead_{env['device'].replace(' ', '_')}", rows,
        extra=dict(flashinfer=_flashinfer.versions()))
  print()
  _timing.print_table(rows, ["spec", "impl", "us", "us_min", "us_max",
                             "host_us", "kernel_us", "x_flashinfer",
                             "x_flashinfer_kernel"])


if __name__ == "__main__":
  main()
