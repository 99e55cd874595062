"""The benchmarks' trace and timing arithmetic (`bench.common.timing`,
`idle_gaps`), the multi-layer decode program of `bench.decode --layers`
and the short-context decode specs (`--specs short`)."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.common import timing as _timing  # noqa: E402  (repo root, for the bench package)


def test_idle_gaps_against_a_busy_timeline(rng):
  # Random kernels on one stream (some overlapping their predecessor): the
  # idle time per size class must be what a 1-ns timeline leaves unbusy.
  # Times in whole microseconds (ns in the events), so a 1-us timeline is
  # exact.
  events, t = [], 0
  for _ in range(200):
    t += int(rng.choice([0, rng.integers(1, 30), rng.integers(5, 3_000)]))
    dur = int(rng.integers(1, 20))
    events.append((t * 1000, dur * 1000, f"k{len(events)}"))
    t += dur - int(rng.integers(0, dur + 1)) // 4  # may overlap the next
  events.sort()
  steps = 4
  got = _timing.idle_gaps(events, steps)
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


def test_event_spans_split_at_idle_gaps(rng):
  # Clusters of random kernels (overlapping or a few us apart) separated by
  # idle gaps longer than the threshold: one span per cluster, first start
  # to last end, whatever the order of overlapping ends.
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


def test_kernel_groups_sum_by_name_per_call(rng):
  # Random launches of a few kernels (names with and without a "(...)"
  # suffix), shuffled: per name, launches and us divided by `per`, most
  # time first, names cut at "(" and to `name_len`.
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
  # bench/decode.py's one-program form of L decode layers (--layers): each
  # layer's q depends on the last layer's output, so XLA can neither drop
  # nor merge a layer: the last output of a 2-layer program equals the
  # same chain of separate calls and differs from the unchained layer.
  # The public call, interpret mode on the CPU, a small SmolLM2-headed case.
  import jax.numpy as jnp  # noqa: PLC0415
  from bench import decode  # noqa: PLC0415
  from bench.common import specs  # noqa: PLC0415
  spec = specs.DecodeSpec("smollm2", 2, 64, 16)
  qs, kv, table, lens = specs.decode_inputs(spec, num_layers=2)
  args = (kv, jnp.asarray(table), jnp.asarray(lens))
  call = decode.pkvattn_fn(fp8=False)
  first, last = decode.layers_fn(call, 2, False)(qs, *args)
  q1 = (qs[1].astype(jnp.float32)
        + decode.DEP * call(qs[0], *args).astype(jnp.float32)).astype(
            qs.dtype)
  chained = call(q1, *args)
  alone = call(qs[1], *args)
  np.testing.assert_array_equal(np.asarray(first, np.float32),
                                np.asarray(call(qs[0], *args), np.float32))
  np.testing.assert_allclose(np.asarray(last, np.float32),
                             np.asarray(chained, np.float32), atol=2e-2)
  assert np.isfinite(np.asarray(last, np.float32)).all()
  assert not np.array_equal(np.asarray(last, np.float32),
                            np.asarray(alone, np.float32))


def test_pipelined_time_cancels_a_samples_fixed_cost(monkeypatch, rng):
  # On a fake clock: every launch costs `call` (the GPU's time per call in a
  # stream) and every sync a fixed `fixed` (first-call launch + wake-up).
  # The pair difference must give `call` exactly, whatever the fixed cost,
  # while T(n)/n keeps a share of it.
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


def test_short_decode_specs_pad_the_table_with_nan_pages():
  # bench/decode.py --specs short: each sequence's own pages first, then
  # table entries up to the table's width that name NaN pages (so a kernel
  # that read past kv_lens would show), and the public call still matches
  # the same spec with a table of just its pages.
  import jax.numpy as jnp  # noqa: PLC0415
  from bench import decode  # noqa: PLC0415
  from bench.common import specs  # noqa: PLC0415
  short = specs.select(specs.DECODE + specs.DECODE_EXTRA, "short")
  assert short and all(s.table_pages == 64 and "short" in s.groups
                       for s in short)
  assert len({s.name for s in short}) == len(short)
  spec = specs.DecodeSpec("smollm2", 3, 40, 16, table_pages=6)
  assert spec.name == "smollm2_b3_s40_t6_p16" and spec.max_pages == 6
  q, kv, table, lens = specs.decode_inputs(spec)
  assert table.shape == (3, 6) and (lens == 40).all()
  pages = np.asarray(kv[jnp.asarray(table)], np.float32)
  assert np.isfinite(pages[:, :3]).all()       # 3 pages hold 40 keys
  assert np.isnan(pages[:, 3:]).all()
  assert len(set(table[:, :3].ravel())) == 9   # no page shared
  call = decode.pkvattn_fn(fp8=False)
  out = call(q, kv, jnp.asarray(table), jnp.asarray(lens))
  narrow = call(q, kv, jnp.asarray(table[:, :3]), jnp.asarray(lens))
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(narrow, np.float32))
  assert np.isfinite(np.asarray(out, np.float32)).all()
