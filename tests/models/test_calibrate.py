"""`pkvattn.models.calibrate` on a tiny decoder (CPU).

The prefill's K (after RoPE) / V amax, the calibrated scales and the
saturation counts are checked against the float64 numpy decoder of
`decoder_oracle` (`np_forward`, written from the formulas) and the
docstrings' rules: scale = amax * headroom / 448 (1.0 for a layer or head
that saw only zeros; headroom 2 by default, docs/fp8.md), saturated =
`|x| > 448 * scale` (a value exactly at the limit is not), the batch cut
to the first `max_prompts` prompts and `num_tokens` tokens. The model's weights
zero one layer's V and one layer's K of one KV head, so the all-zero rule
shows per layer and per head. The parameter-tree helpers and
`ScaleCheck.problems`' thresholds are checked on hand-made inputs.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pkvattn
from pkvattn.models import calibrate
from pkvattn.models import decoder
from decoder_oracle import np_forward

CFG = decoder.DecoderConfig(
    vocab_size=48, hidden_size=64, intermediate_size=96, num_layers=2,
    num_qo_heads=4, num_kv_heads=2, head_dim=64,
    rope=pkvattn.RopeConfig(theta=10000.0))
L, H, D = CFG.num_layers, CFG.num_kv_heads, CFG.head_dim
FP8_MAX = 448.0


def _params(rng):
  """Random weights; layer 1's V projection is zero (its V amax is 0) and so
  is layer 0's K projection of KV head 1 (one head sees only zeros)."""
  p = decoder.init_params(CFG, jax.random.key(int(rng.integers(2 ** 31))),
                          jnp.float32, scale=0.2)
  attn = dict(p["layers"]["attn"])
  attn["v_proj"] = {"kernel": attn["v_proj"]["kernel"].at[1].set(0.0)}
  attn["k_proj"] = {"kernel": attn["k_proj"]["kernel"].at[0, :, D:].set(0.0)}
  return dict(p, layers=dict(p["layers"], attn=attn))


def _prompts(rng, lens):
  return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lens]


def _np_abs_kv(params, prompts):
  """`|K|` and `|V|` of every prompt's prefill (float64 oracle), as
  `[L, 2, H, values]`: the values of all the prompts' tokens and dims."""
  kvs = [np_forward(params, CFG, p)[1] for p in prompts]
  return np.stack([np.stack([
      np.concatenate([np.abs(kv[l][i]).transpose(1, 0, 2).reshape(H, -1)
                      for kv in kvs], axis=1) for i in (0, 1)])
                   for l in range(L)])


def _cut(prompts, num_tokens, max_prompts):
  """The batch the docstring describes: the first `max_prompts` prompts,
  each cut so the total stays within `num_tokens`."""
  out, left = [], num_tokens
  for p in prompts[:max_prompts]:
    if p[:left]:
      out.append(p[:left])
    left -= len(p[:left])
  return out


def _per(a, per_head):
  """`[L, 2, H]` -> (K, V) each `[L, H]`, or `[L]` (largest head)."""
  if not per_head:
    a = a.max(axis=-1)
  return a[:, 0], a[:, 1]


@pytest.mark.parametrize("per_head, layout", [(False, "scanned"),
                                              (True, "unstacked")])
def test_kv_amax_matches_numpy_decoder(per_head, layout, rng):
  """`kv_amax` is the numpy decoder's largest `|K|` (after RoPE) / `|V|`
  over two prompts, per layer or per layer and KV head, whatever the
  layout: tokens past `q_indptr[-1]` (random ids here) are padding, and
  FP8 scales in the tree are ignored."""
  params = _params(rng)
  prompts = _prompts(rng, [int(rng.integers(5, 14)), int(rng.integers(1, 7))])
  n = sum(map(len, prompts))
  tokens = rng.integers(0, CFG.vocab_size, 24).astype(np.int32)
  tokens[:n] = np.concatenate(prompts)
  run = calibrate.set_kv_scales(params, 1e-30, 1e-30)
  if layout == "unstacked":
    run = decoder.unstack_layers(run)
  got = calibrate.kv_amax(run, CFG, jnp.asarray(tokens),
                          jnp.asarray([0, len(prompts[0]), n], jnp.int32),
                          page_size=8, impl="xla", per_head=per_head)
  want = _per(_np_abs_kv(params, prompts).max(axis=-1), per_head)
  for g, w in zip(got, want):
    assert g.shape == w.shape
    np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("per_head", [False, True])
def test_calibrate_maps_amax_to_fp8_max_over_headroom(per_head, rng):
  """Scales are `amax * headroom / 448` of the batch cut to `num_tokens`
  (the second prompt cut, the third dropped, one of the `max_prompts` slots
  left empty), 1.0 where a layer or head saw only zeros; a headroom of
  exactly 1 is allowed, and without one the largest value maps to 224
  (docs/fp8.md: a factor of 2 of headroom)."""
  params = _params(rng)
  prompts = _prompts(rng, [7, 12, 5])
  amax = _np_abs_kv(params, _cut(prompts, 16, 4)).max(axis=-1)
  for headroom in (float(rng.uniform(1.5, 4.0)), 1.0, None):
    kw = {} if headroom is None else {"headroom": headroom}
    got = calibrate.calibrate_kv_scales(params, CFG, prompts, num_tokens=16,
                                        max_prompts=4, impl="xla",
                                        per_head=per_head, **kw)
    headroom = 2.0 if headroom is None else headroom
    for g, a in zip(got, _per(amax, per_head)):
      assert g.dtype == np.float32 and g.shape == a.shape
      np.testing.assert_allclose(
          g, np.where(a > 0, a * headroom / FP8_MAX, 1.0), rtol=1e-4)
  assert (got[1][1] == 1.0).all()  # layer 1's V is all zeros
  if per_head:
    assert got[0][0, 1] == 1.0  # layer 0, KV head 1: K all zeros


def test_impl_is_the_prefills(rng):
  """`impl` reaches the prefill's attention: `kv_amax`,
  `calibrate_kv_scales` and `check_kv_scales` refuse a name that is not an
  implementation."""
  params = calibrate.set_kv_scales(_params(rng), 1.0, 1.0)
  tokens = jnp.asarray(_prompts(rng, [8])[0], jnp.int32)
  match = r"Invalid impl: expected one of \('pallas', 'xla'\), got 'cuda'"
  for call in (
      lambda: calibrate.kv_amax(params, CFG, tokens,
                                jnp.asarray([0, 8], jnp.int32), impl="cuda"),
      lambda: calibrate.calibrate_kv_scales(params, CFG, [tokens.tolist()],
                                            impl="cuda"),
      lambda: calibrate.check_kv_scales(params, CFG, [tokens.tolist()],
                                        impl="cuda")):
    with pytest.raises(ValueError, match=match):
      call()


def test_calibrate_rejects_headroom_below_one_and_no_tokens(rng):
  """A headroom under 1 and a batch without a token (the only non-empty
  prompt past `max_prompts`) are refused."""
  params = _params(rng)
  with pytest.raises(ValueError, match=r"Invalid headroom: expected >= 1, "
                     r"got 0\.99"):
    calibrate.calibrate_kv_scales(params, CFG, [[1, 2]], headroom=0.99)
  for fn in (calibrate.calibrate_kv_scales, calibrate.check_kv_scales):
    with pytest.raises(ValueError, match="Invalid prompts: expected at least "
                       "one token, got none"):
      fn(calibrate.set_kv_scales(params, 1.0, 1.0), CFG, [[], [3, 4]],
         max_prompts=1)


def _limit_between_values(values, rng):
  """A `448 * scale` limit halfway between two neighbouring values of the
  upper half (the widest gap of a few), so f32 vs f64 rounding cannot move
  a value across it; and how many values exceed it."""
  a = np.sort(values)
  if a[-1] == 0:
    return 1.0 * FP8_MAX, 0
  j = len(a) // 2 + int(rng.integers(len(a) // 4))
  j += int(np.argmax(np.diff(a[j:j + 8])))
  return (a[j] + a[j + 1]) / 2, len(a) - j - 1


@pytest.mark.parametrize("per_head", [False, True])
def test_check_counts_values_past_448_times_scale(per_head, rng):
  """`check_kv_scales` reports the scales it checked, the batch's amax, the
  values with `|x| > 448 * scale` per layer (or per head: each head counts
  against its own scale), and the real tokens' value count; the third
  prompt is past `max_prompts` and not counted."""
  params = _params(rng)
  prompts = _prompts(rng, [9, 10, 4])
  vals = _np_abs_kv(params, prompts[:2])  # [L, 2, H, values]
  if not per_head:
    vals = vals.reshape(L, 2, 1, -1)
  limits = np.zeros(vals.shape[:3])
  counts = np.zeros(vals.shape[:3], np.int64)
  for at in np.ndindex(limits.shape):
    limits[at], counts[at] = _limit_between_values(vals[at], rng)
  scales = (limits / FP8_MAX).astype(np.float32)
  if not per_head:
    scales, counts = scales[..., 0], counts[..., 0]
  check = calibrate.check_kv_scales(
      calibrate.set_kv_scales(params, scales[:, 0], scales[:, 1]), CFG,
      prompts, num_tokens=24, max_prompts=2, impl="xla")
  amax = vals.max(axis=-1) if per_head else vals.max(axis=-1)[..., 0]
  np.testing.assert_array_equal(check.k_scale, scales[:, 0])
  np.testing.assert_array_equal(check.v_scale, scales[:, 1])
  np.testing.assert_allclose(check.k_amax, amax[:, 0], rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(check.v_amax, amax[:, 1], rtol=1e-4, atol=1e-6)
  np.testing.assert_array_equal(check.k_saturated, counts[:, 0])
  np.testing.assert_array_equal(check.v_saturated, counts[:, 1])
  assert check.num_saturated == counts.sum() > 0
  assert check.values_per_layer == 19 * H * D


def _scale_at_limit(a):
  """An f32 scale whose f32 product with 448 is exactly `a`, or None where
  no scale within a few steps of `a / 448` gives it."""
  a = np.float32(a)
  s = a / np.float32(FP8_MAX)
  for _ in range(4):
    s = np.nextafter(s, np.float32(0))
  for _ in range(9):
    if np.float32(FP8_MAX) * s == a:
      return s
    s = np.nextafter(s, np.float32(np.inf))
  return None


def test_value_at_exactly_448_times_scale_does_not_saturate(rng):
  """A head's largest value equal to `448 * scale` (f32) is not counted,
  only values past it are (`|x| > 448 * scale`): with the scale one f32 step
  lower, the largest value is."""
  params = _params(rng)
  prompts = _prompts(rng, [9, 10])
  # The batch's exact f32 amax, per layer and KV head, from the same check.
  amax = calibrate.check_kv_scales(
      calibrate.set_kv_scales(params, np.ones((L, H)), np.ones((L, H))), CFG,
      prompts, num_tokens=24, max_prompts=2, impl="xla")
  amax = np.stack([amax.k_amax, amax.v_amax], axis=1)  # [L, 2, H]
  at = np.full(amax.shape, np.nan, np.float32)
  for i in np.ndindex(amax.shape):
    if amax[i] > 0 and (s := _scale_at_limit(amax[i])) is not None:
      at[i] = s
  exact = ~np.isnan(at)
  assert exact.any()  # found for a nonzero head's amax with p ~ 0.9
  # Heads without an exact scale get one that covers twice their amax.
  at = np.where(exact, at, np.maximum(amax, 1.0) * 2 / FP8_MAX).astype(
      np.float32)
  below = np.where(exact, np.nextafter(at, np.float32(0)), at)
  while (np.float32(FP8_MAX) * below >= amax)[exact].any():
    below = np.where(exact & (np.float32(FP8_MAX) * below >= amax),
                     np.nextafter(below, np.float32(0)), below)
  for scales, want in ((at, np.zeros(amax.shape)), (below, exact)):
    check = calibrate.check_kv_scales(
        calibrate.set_kv_scales(params, scales[:, 0], scales[:, 1]), CFG,
        prompts, num_tokens=24, max_prompts=2, impl="xla")
    np.testing.assert_array_equal(check.k_amax, amax[:, 0])
    np.testing.assert_array_equal(check.v_amax, amax[:, 1])
    saturated = np.stack([check.k_saturated, check.v_saturated], axis=1)
    np.testing.assert_array_equal(saturated > 0, want)


@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_set_and_get_kv_scales(layout, rng):
  """`set_kv_scales` writes per-layer, per-head or scalar scales into a new
  tree (every layer its own row when unstacked) and `get_kv_scales` reads
  them back; None removes them, and reading a tree without them fails."""
  params = _params(rng)
  if layout == "unstacked":
    params = decoder.unstack_layers(params)
  k = rng.uniform(0.01, 2.0, L).astype(np.float32)
  v = rng.uniform(0.01, 2.0, (L, H)).astype(np.float32)
  got = calibrate.set_kv_scales(params, list(k), v)
  np.testing.assert_array_equal(calibrate.get_kv_scales(got)[0], k)
  np.testing.assert_array_equal(calibrate.get_kv_scales(got)[1], v)
  if layout == "unstacked":
    for i, lp in enumerate(got["layers"]):
      np.testing.assert_array_equal(lp["attn"]["v_scale"], v[i])
  scalar = calibrate.get_kv_scales(calibrate.set_kv_scales(got, 0.5, 2.0))
  np.testing.assert_array_equal(scalar[0], np.full(L, 0.5, np.float32))
  np.testing.assert_array_equal(scalar[1], np.full(L, 2.0, np.float32))
  # The input tree is not modified; None removes the scales.
  for tree in (params, calibrate.set_kv_scales(got, None, None)):
    with pytest.raises(ValueError,
                       match=r"Invalid params: expected attn\.k_scale"):
      calibrate.get_kv_scales(tree)
  only_k = calibrate.set_kv_scales(got, 3.0, None)
  with pytest.raises(ValueError, match=r"Invalid params: expected attn\."
                     r"v_scale"):
    calibrate.get_kv_scales(only_k)
  # Only V's scales: K's removed, V's where they belong.
  only_v = calibrate.set_kv_scales(got, None, v)
  with pytest.raises(ValueError, match=r"Invalid params: expected attn\."
                     r"k_scale"):
    calibrate.get_kv_scales(only_v)
  if layout == "unstacked":
    for i, lp in enumerate(only_v["layers"]):
      assert "k_scale" not in lp["attn"]
      np.testing.assert_array_equal(lp["attn"]["v_scale"], v[i])
    # One layer without scales is enough to refuse the tree.
    mixed = dict(got, layers=[got["layers"][0], params["layers"][1]])
    with pytest.raises(ValueError, match=r"expected attn\.k_scale in every "
                       "layer"):
      calibrate.get_kv_scales(mixed)
  else:
    assert "k_scale" not in only_v["layers"]["attn"]
    np.testing.assert_array_equal(only_v["layers"]["attn"]["v_scale"], v)


@pytest.mark.parametrize("k, v, match", [
    (np.ones(L + 1), 1.0, r"Invalid shape of k_scale: expected \(2,\)"),
    (1.0, np.ones((L, H, 1)), r"Invalid shape of v_scale: .* got \(2, 2, 1\)"),
    (1.0, [1.0, 0.0], "Invalid v_scale: expected positive finite scales"),
    (-1.0, 1.0, "Invalid k_scale: expected positive finite scales"),
    (np.inf, 1.0, "Invalid k_scale: expected positive finite scales"),
    (1.0, [np.nan, 1.0], "Invalid v_scale: expected positive finite"),
], ids=["length", "rank", "zero", "negative", "inf", "nan"])
def test_set_kv_scales_rejects_bad_scales(k, v, match, rng):
  """Scales of the wrong length or rank, and scales that are not positive
  and finite, are refused."""
  with pytest.raises(ValueError, match=match):
    calibrate.set_kv_scales(_params(rng), k, v)


def _check(scale, amax, sat, values_per_layer):
  """A `ScaleCheck` of the given K arrays; its V arrays map every amax to
  224 and saturate nothing."""
  scale = np.asarray(scale, np.float32)
  return calibrate.ScaleCheck(
      k_scale=scale, v_scale=scale, k_amax=np.asarray(amax, np.float32),
      v_amax=scale * 224, k_saturated=np.asarray(sat, np.int32),
      v_saturated=np.zeros(scale.shape, np.int32),
      values_per_layer=values_per_layer)


def test_problems_thresholds_per_head_and_per_layer():
  """`problems()` reports a scale that saturates more than the fraction of
  the values it covers (per head: `values_per_layer / heads`), or maps its
  amax below `min_range_used`; exactly at either threshold, or with an amax
  of 0, it does not. The lines name the layer (and head) and the scale the
  amax needs (`amax / 448`)."""
  # 2 layers x 3 heads, 1000 values per head. Layer 0: 2 of 1000 saturate
  # (0.2%), 1 of 1000 (at 0.1%); layer 1: amax / scale 0.25, amax 0.
  check = _check([[1.0, 1.0, 1.0], [2.0, 4.0, 1.0]],
                 [[448.0, 224.0, 224.0], [0.5, 0.0, 224.0]],
                 [[2, 1, 0], [0, 0, 0]], 3000)
  assert check.num_saturated == 3
  problems = check.problems()
  assert [p.split(":")[0] for p in problems] == ["layer 0 head 0 K",
                                                 "layer 1 head 0 K"]
  assert re.search(r"saturates 2 of 1000 values \(0\.20%; .*needs a scale "
                   r"of at least 1$", problems[0]), problems[0]
  assert "maps the largest value (0.5) to 0.25 " in problems[1], problems[1]
  assert [p.split(":")[0] for p in check.problems(
      saturation=0.5e-3, min_range_used=0.25)] == ["layer 0 head 0 K",
                                                   "layer 0 head 1 K"]
  # Per layer, 1000 values each: 1 of 1000 is at the threshold; used 1.0 is.
  check = _check([1.0, 2.0], [100.0, 2.0], [1, 5], 1000)
  assert [p.split(":")[0] for p in check.problems()] == ["layer 1 K"]
  assert [p.split(":")[0] for p in check.problems(min_range_used=1.5)] == [
      "layer 1 K", "layer 1 K"]
  # One value per scale, saturated: 1 of 1; a check of no values reports
  # nothing.
  (line,) = _check([1.0], [500.0], [1], 1).problems()
  assert "saturates 1 of 1 values (100.00%;" in line, line
  assert _check([1.0, 1.0], [0.0, 0.0], [0, 0], 0).problems() == []
