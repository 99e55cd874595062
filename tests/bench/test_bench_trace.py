"""The trace arithmetic of bench_engine_fp8: GPU idle gaps by size."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import bench_engine_fp8  # noqa: E402  (repo root, for the bench package)


def test_idle_gaps_against_a_busy_timeline():
  # Random kernels on one stream (some overlapping their predecessor): the
  # idle time per size class must be what a 1-ns timeline leaves unbusy.
  # Times in whole microseconds (ns in the events), so a 1-us timeline is
  # exact.
  rng = np.random.default_rng()
  events, t = [], 0
  for _ in range(200):
    t += int(rng.choice([0, rng.integers(1, 30), rng.integers(5, 3_000)]))
    dur = int(rng.integers(1, 20))
    events.append((t * 1000, dur * 1000, f"k{len(events)}"))
    t += dur - int(rng.integers(0, dur + 1)) // 4  # may overlap the next
  events.sort()
  steps = 4
  got = bench_engine_fp8.idle_gaps(events, steps)
  t0 = events[0][0] // 1000
  busy = np.zeros(max(s + d for s, d, _ in events) // 1000 - t0, bool)
  for s, d, _ in events:
    busy[s // 1000 - t0:(s + d) // 1000 - t0] = True
  # Idle runs of the timeline, classified as the function does (ms).
  edges = np.flatnonzero(np.diff(np.concatenate([[1], busy.view(np.int8),
                                                  [1]])))
  runs = (edges[1::2] - edges[::2]) / 1e3
  want = [runs[runs < 0.01].sum(), runs[(runs >= 0.01) & (runs < 0.1)].sum(),
          runs[(runs >= 0.1) & (runs < 1.0)].sum(), runs[runs >= 1.0].sum()]
  assert list(got["idle_ms_per_step"]) == [
      "<0.01ms", "0.01-0.1ms", "0.1-1.0ms", ">1.0ms"]
  np.testing.assert_allclose(list(got["idle_ms_per_step"].values()),
                             np.round(np.array(want) / steps, 4), atol=1e-4)
  assert sum(got["gap_counts"].values()) == len(runs)
  assert got["largest"][0][0] == round(runs.max(), 3)


def test_event_spans_split_at_idle_gaps():
  # Clusters of random kernels (overlapping or a few us apart) separated by
  # idle gaps longer than the threshold: one span per cluster, first start
  # to last end, whatever the order of overlapping ends.
  from bench import _timing  # noqa: PLC0415
  rng = np.random.default_rng()
  events, want, t = [], [], 0
  for _ in range(int(rng.integers(1, 8))):
    first, last = t, t
    for _ in range(int(rng.integers(1, 30))):
      dur = int(rng.integers(1_000, 200_000))
      events.append((t, dur, "k"))
      last = max(last, t + dur)
      t += int(rng.integers(0, dur + 50_000))  # overlap, or a short gap
    want.append((last - first) / 1e6)
    t = last + int(rng.integers(2_600_000, 10_000_000))  # > 2.5 ms idle
  events.sort()
  got = _timing.event_spans_ms(events, 2_500_000)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)


def test_kernel_groups_sum_by_name_per_call():
  # Random launches of a few kernels (names with and without a "(...)"
  # suffix), shuffled: per name, launches and us divided by `per`, most
  # time first, names cut at "(" and to `name_len`.
  from bench import _timing  # noqa: PLC0415
  rng = np.random.default_rng()
  names = ["fusion_a", "paged_prefill_bq42", "x" * 90]
  events, want = [], {}
  for name in names:
    for _ in range(int(rng.integers(1, 20))):
      ns = int(rng.integers(1_000, 100_000))
      suffix = "(id=%d)" % rng.integers(9) if rng.random() < 0.5 else ""
      events.append((name + suffix, ns))
      n, us = want.get(name[:80], (0, 0.0))
      want[name[:80]] = (n + 1, us + ns / 1e3)
  rng.shuffle(events)
  per = int(rng.integers(1, 5))
  got = _timing.kernel_groups(events, per, name_len=80)
  assert [us for _, _, us in got] == sorted((us for _, _, us in got),
                                           reverse=True)
  assert {k for k, _, _ in got} == set(want)
  for key, n, us in got:
    assert n == want[key][0] / per
    np.testing.assert_allclose(us, want[key][1] / per, rtol=1e-12)


def test_decode_layers_program_chains_its_layers():
  # bench/decode_layers.py's one-program form of L decode layers: each
  # layer's q depends on the last layer's output (so XLA can neither drop
  # nor merge a layer), and the program equals the same chain of separate
  # calls. Interpret mode, a small SmolLM2-headed case.
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from bench import decode_layers  # noqa: PLC0415
  rows = decode_layers.run_spec(decode_layers.SMOKE_SPEC, 2,
                                flashinfer=False, interpret=True)
  assert rows[0]["err_last_vs_per_call"] == 0.0
  shape, b, s, ps = decode_layers.SMOKE_SPEC
  hq, hkv, d = decode_layers.SHAPES[shape]
  _, kv, table, lens = decode_layers._inputs(hq, hkv, d, b, s, ps)
  qs = jax.random.normal(jax.random.key(3), (2, b, hq, d), jnp.bfloat16)
  cfg = decode_layers.kernel.Config.default_for(
      batch_size=b, num_kv_heads=hkv, page_size=ps, max_pages=s // ps,
      head_dim=d, interpret=True)
  args = (jnp.asarray(table), jnp.asarray(lens))
  _, chained = decode_layers.layers_fn(cfg, head_dim=d, num_layers=2,
                                       interpret=True)(qs, kv, *args)
  _, alone = decode_layers.layers_fn(cfg, head_dim=d, num_layers=1,
                                     interpret=True)(qs[1:], kv, *args)
  assert np.isfinite(np.asarray(chained, np.float32)).all()
  assert not np.array_equal(np.asarray(chained, np.float32),
                            np.asarray(alone, np.float32))


def test_pipelined_time_cancels_a_samples_fixed_cost(monkeypatch):
  # On a fake clock: every launch costs `call` (the GPU's time per call in a
  # stream) and every sync a fixed `fixed` (first-call launch + wake-up).
  # The pair difference must give `call` exactly, whatever the fixed cost,
  # while T(n)/n keeps a share of it.
  from bench import _timing  # noqa: PLC0415
  rng = np.random.default_rng()
  call, fixed = float(rng.uniform(1, 5)), float(rng.uniform(0.5, 50))
  now = [0.0]
  launches = []

  def launch():
    now[0] += call
    launches.append(now[0])
    return len(launches)

  def sync(out):
    assert out == len(launches)  # the last launch's output is synced
    now[0] += fixed

  monkeypatch.setattr(_timing.time, "perf_counter", lambda: now[0])
  got = _timing.pipelined_ms(launch, sync, iters=5, min_time_s=0.0)
  n = _timing.MIN_INNER  # the fake calls last seconds: the fewest calls
  np.testing.assert_allclose(
      [got["median_ms"], got["p10_ms"], got["p90_ms"]], [call * 1e3] * 3,
      rtol=1e-9)
  np.testing.assert_allclose(got["sync_ms"], (call + fixed / n) * 1e3,
                             rtol=1e-9)
  # Warm-up, calibration, then 5 pairs of n and 2n calls.
  assert len(launches) == 2 + 5 * 3 * n
