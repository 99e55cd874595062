"""Timing and roof helpers shared by the GPU benchmarks.

How a call is timed (`pipelined_ms`): back to back, as a model's steps run,
the fixed cost of each sample cancelled by pairs of n and 2n calls. How a
kernel is timed (`device_kernel_ms`, `kernel_groups`): the summed kernel and
memcpy durations on the device's stream lines of a `jax.profiler` trace,
launch gaps and host time excluded. Roofs: a device copy (`copy_roof_gbps`,
`torch_copy_roof_gbps`), a read-only pass (`read_roof_gbps`) and a bf16
matmul (`matmul_roof_tflops`).

Units: times in milliseconds (`*_ms`), bandwidth in decimal GB/s / TB/s (1e9 / 1e12
bytes per second), compute in TFLOP/s (1e12 FLOP per second).
"""

from __future__ import annotations

import collections
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


# Fewest back-to-back calls per timed sample (`time_fn`,
# `flashinfer.torch_time`).
MIN_INNER = 3
# Wall time one sample of n back-to-back calls should last at least, s.
SAMPLE_S = 5e-3


def pipelined_ms(launch, sync, *, iters: int = 20,
                 min_time_s: float = 0.2) -> dict:
  """Per-call time of `launch()` in a stream of back-to-back calls, ms.

  A sample times n back-to-back `launch()` calls closed by one `sync(last)`
  (`n >= MIN_INNER`, calibrated so a sample lasts >= `SAMPLE_S`), so the
  host launches the next call while the GPU runs the last. Samples of n
  and 2n calls alternate; each pair gives `(T(2n) - T(n)) / n`, the wall
  time a call adds to the stream, in which the fixed cost of a sample
  cancels: the GPU idling while the host launches the first call and the
  final synchronisation. Where the host launches slower than the GPU runs, the
  difference is the host's launch time: host-bound calls show as such.

  Returns dict(median_ms, p10_ms, p90_ms) of the pair estimates, and
  `sync_ms`: the median `T(n) / n`, the per-call time with that fixed
  cost spread over n calls.
  """
  sync(launch())
  t0 = time.perf_counter()
  sync(launch())
  one = max(time.perf_counter() - t0, 1e-6)
  n = max(MIN_INNER, int(SAMPLE_S / one) + 1)

  def sample(calls):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
      out = launch()
    sync(out)
    return (time.perf_counter() - t0) * 1e3

  est, singles = [], []
  start = time.perf_counter()
  while len(est) < iters or time.perf_counter() - start < min_time_s:
    t_n = sample(n)
    t_2n = sample(2 * n)
    est.append((t_2n - t_n) / n)
    singles.append(t_n / n)
    if len(est) > 10 * iters:
      break
  return dict(median_ms=statistics.median(est),
              p10_ms=float(np.percentile(est, 10)),
              p90_ms=float(np.percentile(est, 90)),
              sync_ms=statistics.median(singles))


def rel_err(actual, expected) -> float:
  """`||actual - expected|| / ||expected||` in float64 (NaN if `actual` has
  a NaN)."""
  a = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  e = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
  if np.isnan(a).any():
    return float("nan")
  return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))


def time_fn(fn, *args, warmup: int = 3, iters: int = 20, min_time_s: float = 0.2):
  """Times `fn(*args)`, a jitted JAX call, the way a model's steps run:
  back to back (`pipelined_ms`).

  Returns dict(compile_ms, median_ms, p10_ms, p90_ms, sync_ms): the first
  call (compile + run) is reported separately as `compile_ms`; the rest
  are `pipelined_ms`'s, ms per call.
  """
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  compile_ms = (time.perf_counter() - t0) * 1e3
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  t = pipelined_ms(lambda: fn(*args), jax.block_until_ready, iters=iters,
                   min_time_s=min_time_s)
  return dict(compile_ms=compile_ms, **t)


def gpu_trace_events(thunks, device: str = "/device:GPU"
                     ) -> list[tuple[int, int, str]]:
  """Runs each `thunk()` (blocking on its result) under a jax.profiler trace
  and returns `(start_ns, duration_ns, name)` of every kernel / memcpy event
  on the stream lines of the trace planes named `device...` (default every
  GPU; `"/device:GPU:0"`: the first one only), in start order. Empty where
  the trace has no GPU lines (CPU)."""
  import glob
  import tempfile
  d = tempfile.mkdtemp()
  jax.profiler.start_trace(d)
  for thunk in thunks:
    jax.block_until_ready(thunk())
  jax.profiler.stop_trace()
  path = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"),
                          recursive=True))[-1]
  events = []
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    if plane.name.startswith(device):
      for line in plane.lines:
        if line.name.startswith("Stream"):
          events.extend((ev.start_ns, ev.duration_ns, ev.name)
                        for ev in line.events)
  return sorted(events)


def gpu_stream_events(thunks) -> list[tuple[str, int]]:
  """`(name, duration_ns)` of `gpu_trace_events(thunks)`: GPU time without
  launch gaps or host time."""
  return [(name, dur) for _, dur, name in gpu_trace_events(thunks)]


def kernel_groups(events, per: float, name_len: int = 80):
  """`gpu_stream_events` grouped by kernel name (cut at its first `(` and
  to `name_len` characters): `[(name, launches / per, us / per)]`, most
  time first. `per`: the calls (or steps) the events cover."""
  groups = collections.defaultdict(lambda: [0, 0.0])
  for name, ns in events:
    key = name.split("(")[0][:name_len]
    groups[key][0] += 1
    groups[key][1] += ns / 1e3
  return sorted(((k, n / per, t / per) for k, (n, t) in groups.items()),
                key=lambda r: -r[2])


def kernel_breakdown_us(fn, args, calls: int = 5) -> dict[str, float]:
  """GPU time per kernel name of one `fn(*args)` call, us (`kernel_groups`
  over `calls` calls, run once first)."""
  jax.block_until_ready(fn(*args))
  events = gpu_stream_events([lambda: fn(*args)] * calls)
  return {name: us for name, _, us in kernel_groups(events, calls)}


def device_kernel_ms(fn, make_args, calls: int = 3) -> float:
  """GPU kernel time of one `fn(*make_args())` call, ms: the sum of kernel and
  memcpy durations on the device's stream lines of a jax.profiler trace
  (launch gaps and host time excluded). 0.0 where the trace has no GPU lines
  (CPU)."""
  jax.block_until_ready(fn(*make_args()))
  args = [make_args() for _ in range(calls)]
  jax.block_until_ready(args)
  events = gpu_stream_events([lambda a=a: fn(*a) for a in args])
  return sum(ns for _, ns in events) / calls / 1e6


def event_spans_ms(events, min_gap_ns: float) -> list[float]:
  """Splits `(start_ns, duration_ns, name)` events, in start order, into
  clusters separated by idle gaps longer than `min_gap_ns` (overlapping
  events join one cluster) and returns each cluster's span, first start to
  last end, ms."""
  spans, start, end = [], None, None
  for t0, dur, _ in events:
    if start is not None and t0 - end > min_gap_ns:
      spans.append((end - start) / 1e6)
      start = None
    if start is None:
      start, end = t0, t0 + dur
    end = max(end, t0 + dur)
  if start is not None:
    spans.append((end - start) / 1e6)
  return spans


def gpu_span_ms(thunks, pause_s: float = 0.005) -> list[float]:
  """Per `thunk()`, ms: the GPU time from its first kernel's start to its
  last kernel's end in a jax.profiler trace (`gpu_trace_events`), launch
  gaps between its kernels included, host time before the first kernel
  excluded. The thunks run `pause_s` apart, so each one's events form a
  cluster separated by more than half of that (`event_spans_ms`). Empty
  where the trace has no GPU lines (CPU)."""
  def paused(thunk):
    def run():
      jax.block_until_ready(thunk())
      time.sleep(pause_s)
    return run
  events = gpu_trace_events([paused(t) for t in thunks])
  return event_spans_ms(events, pause_s * 0.5e9)


def idle_gaps(events, steps: int) -> dict:
  """Where the GPU idles between kernels of `(start_ns, duration_ns, name)`
  events in start order (`gpu_trace_events`) covering `steps` steps: the
  idle time per step in gaps of each size class (ms), the number of gaps of
  each class, and the largest gaps with the kernels around them (a burst
  boundary, a per-iteration sync and launch-bound runs of short kernels
  look different here)."""
  edges = (0.01, 0.1, 1.0)  # ms
  per = {f"<{edges[0]}ms": 0.0, **{f"{a}-{b}ms": 0.0 for a, b in
                                   zip(edges, edges[1:])},
         f">{edges[-1]}ms": 0.0}
  counts = dict.fromkeys(per, 0)
  gaps, end = [], None
  for start, dur, name in events:
    if end is not None and start > end[0]:
      gap = (start - end[0]) / 1e6
      gaps.append((gap, end[1], name))
      i = sum(gap >= e for e in edges)
      key = list(per)[i]
      per[key] += gap / steps
      counts[key] += 1
    if end is None or start + dur > end[0]:
      end = (start + dur, name)
  top = sorted(gaps, key=lambda g: -g[0])[:8]
  return dict(idle_ms_per_step={k: round(v, 4) for k, v in per.items()},
              gap_counts=counts,
              largest=[(round(g, 3), a[:40], b[:40]) for g, a, b in top])


def copy_roof_gbps(num_bytes: int = 2 << 30) -> float:
  """Measured device copy bandwidth, read + write bytes counted, decimal GB/s.

  Uses a u32 elementwise op: XLA's bf16 elementwise kernels run below the
  bandwidth of a plain copy, which would understate the roof.
  """
  n = num_bytes // 4
  x = jax.random.bits(jax.random.key(0), (n,), jnp.uint32)
  f = jax.jit(lambda a: a ^ jnp.uint32(0x9E3779B9))
  t = time_fn(f, x)
  return 2 * x.size * x.dtype.itemsize / (t["median_ms"] * 1e-3) / 1e9


def torch_copy_roof_gbps(num_bytes: int = 2 << 30) -> float | None:
  """`torch.Tensor.copy_` bandwidth (read + write, decimal GB/s, CUDA events),
  or None without torch + CUDA. Faster than XLA's elementwise copy on
  Hopper, hence the stricter roof."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
    if not torch.cuda.is_available():
      return None
    a = torch.empty(num_bytes // 2, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    times = []
    for i in range(23):
      e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
      e0.record()
      b.copy_(a)
      e1.record()
      torch.cuda.synchronize()
      if i >= 3:
        times.append(e0.elapsed_time(e1))
    del a, b
    torch.cuda.empty_cache()
    return 2 * num_bytes / (statistics.median(times) * 1e-3) / 1e9
  except Exception:  # noqa: BLE001  (no torch / no GPU: no torch roof)
    return None


def read_roof_gbps(num_bytes: int = 2 << 30) -> dict:
  """Measured read-only bandwidth, decimal GB/s: the bytes of one array
  reduced to a scalar, best of XLA's reduction (`xla`) and, with torch +
  CUDA, torch's (`torch`, CUDA events). A decode kernel reads its pages and
  writes little, so this, not a copy (whose writes share the bus), is the
  roof for its bytes.

  Returns dict(best=..., xla=..., torch=...) (torch None without it).
  """
  n = num_bytes // 4
  x = jax.random.bits(jax.random.key(0), (n,), jnp.uint32)
  t = time_fn(jax.jit(jnp.max), x)
  out = dict(xla=num_bytes / (t["median_ms"] * 1e-3) / 1e9, torch=None)
  del x
  try:
    import torch  # pylint: disable=import-outside-toplevel
    if torch.cuda.is_available():
      a = torch.rand(n, device="cuda", dtype=torch.float32)
      times = []
      for i in range(23):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        a.sum()
        e1.record()
        torch.cuda.synchronize()
        if i >= 3:
          times.append(e0.elapsed_time(e1))
      del a
      torch.cuda.empty_cache()
      out["torch"] = num_bytes / (statistics.median(times) * 1e-3) / 1e9
  except Exception:  # noqa: BLE001  (no torch / no GPU: XLA's figure only)
    pass
  out["best"] = max(v for v in out.values() if v is not None)
  return out


def matmul_roof_tflops(n: int = 8192) -> float:
  """Measured bf16 matmul rate on random data, TFLOP/s."""
  ka, kb = jax.random.split(jax.random.key(1))
  a = jax.random.normal(ka, (n, n), jnp.bfloat16)
  b = jax.random.normal(kb, (n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  t = time_fn(f, a, b)
  return 2 * n**3 / (t["median_ms"] * 1e-3) / 1e12


def print_table(rows: list[dict], cols: list[str]) -> None:
  """Prints `rows` as a plain-text table of the columns `cols` ("-" where a
  row has no value; floats to 4 significant digits)."""
  widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
  print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
  for r in rows:
    print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)))


def _fmt(v) -> str:
  if v is None:
    return "-"
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)
