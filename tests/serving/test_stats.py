"""`EngineStats`: a fresh engine has counted nothing, and the derived rates
are the ratios their docstrings state (0, or None, when nothing ran)."""

from __future__ import annotations

import dataclasses

import pytest

from pkvattn.serving.stats import EngineStats

_RATES = ("prefix_hit_rate", "host_hit_rate", "kv_bytes_saved",
          "prefill_tokens_per_s", "decode_tokens_per_s")


def test_a_fresh_engine_has_counted_nothing():
  s = EngineStats()
  for f in dataclasses.fields(s):
    value = getattr(s, f.name)
    if f.name in ("flat_peak_kv_bytes", "slots_saved_by_scratch",
                  "kv_saturated_values"):
      assert value is None, f.name  # "None for a flat engine", "not active"
    elif f.name == "peak_group_slots":
      assert value == ()
    elif f.name == "kv_cache_dtype":
      assert value == ""
    elif f.name == "kv_scales_calibrated":
      assert value is False
    else:
      assert value == 0 and not isinstance(value, bool), (f.name, value)
  assert [getattr(s, r) for r in _RATES] == [0.0, 0.0, None, 0.0, 0.0]


def test_rates_are_the_documented_ratios(rng):
  n = [int(x) for x in rng.integers(1, 10**6, 8)]
  t = [float(x) for x in rng.uniform(0.01, 100.0, 2)]
  s = EngineStats(prompt_tokens=n[0], reused_tokens=n[1], host_lookups=n[2],
                  host_hits=n[3], peak_kv_bytes=n[4], flat_peak_kv_bytes=n[5],
                  prefill_tokens=n[6], decode_tokens=n[7],
                  prefill_time_s=t[0], decode_time_s=t[1])
  want = dict(prefix_hit_rate=n[1] / n[0], host_hit_rate=n[3] / n[2],
              kv_bytes_saved=n[5] - n[4], prefill_tokens_per_s=n[6] / t[0],
              decode_tokens_per_s=n[7] / t[1])
  assert {r: getattr(s, r) for r in _RATES} == pytest.approx(want, rel=1e-12)
  d = s.as_dict()
  assert d == {**dataclasses.asdict(s), **want}
  # A zero denominator: 0, whatever the numerator; no flat figure: None.
  none_ran = dataclasses.replace(s, prompt_tokens=0, host_lookups=0,
                                 flat_peak_kv_bytes=None, prefill_time_s=0.0,
                                 decode_time_s=0.0)
  assert [getattr(none_ran, r) for r in _RATES] == [0.0, 0.0, None, 0.0, 0.0]
