"""FP8 KV pages in the engine: sizes, calibration, compile once, bad config.

One FP8 engine on tiny-llama (xla on the CPU) serves the module. The
calibration check is the meaning of the scales: once calibrated from some
prompts, those prompts' own K (after RoPE) and V, written to the pool,
stay within `FP8_MAX / headroom` in every layer and are not all tiny (a
wrong layer order, K before RoPE or a stale scale would break one of the
two bounds).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pkvattn import _checks
from pkvattn import _kv
from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.models import calibrate
from compile_events import count_compiles

CFG = EngineConfig(page_size=8, num_slots=24, max_seqs=2, max_num_tokens=32,
                   max_model_len=64, kv_cache_dtype="fp8",
                   calibration_tokens=64)


@pytest.fixture(scope="module")
def fp8_run(model):
  """A warmed-up FP8 engine, its pool after prefilling (and calibrating on)
  two prompts, its outputs for three prompts, and what it compiled."""
  engine = Engine(model, CFG)
  engine.warmup()
  rng = np.random.default_rng(7)
  prompts = [list(rng.integers(3, 250, size=n)) for n in (29, 11, 6)]
  with count_compiles() as compiles, warnings.catch_warnings(
      record=True) as caught:
    warnings.simplefilter("always")
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=1,
                                                ignore_eos=True))
    pool = _pages(engine.pool).astype(np.float32)  # host: no compile
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6,
                                                   ignore_eos=True))
  return engine, prompts, pool, outs, list(compiles), [
      w for w in caught if issubclass(w.category, RuntimeWarning)]


def _pages(pool) -> np.ndarray:
  """The pool's FP8 values on the host (a byte pool viewed, no device op)."""
  a = np.asarray(pool)
  return a.view(jnp.float8_e4m3fn) if a.dtype == np.uint8 else a


def test_fp8_pool_bytes_and_compile_once(model, fp8_run):
  engine, _, _, outs, compiles, _ = fp8_run
  assert not compiles  # calibration included: compiled by warmup
  # Stored as bytes on the XLA path (the default off a GPU), as
  # float8_e4m3fn for the Pallas kernels.
  assert engine.pool.dtype == (jnp.float8_e4m3fn if _checks.is_gpu()
                               else jnp.uint8)
  assert engine.stats.kv_cache_dtype == "float8_e4m3fn"
  assert engine.stats.kv_scales_calibrated
  assert all(len(o) == 6 for o in outs)
  base = Engine(model, dataclasses.replace(CFG, kv_cache_dtype="auto"))
  itemsize = jnp.dtype(base.pool.dtype).itemsize
  assert engine.stats.kv_cache_bytes * itemsize == base.stats.kv_cache_bytes
  assert engine.stats.kv_cache_bytes == engine.pool.size


def test_calibrated_scales_fit_the_calibration_prompts(model, fp8_run):
  engine, prompts, pool, _, _, _ = fp8_run
  layers = engine.model.params["layers"]
  k_scale = np.array([float(lp["attn"]["k_scale"]) for lp in layers])
  v_scale = np.array([float(lp["attn"]["v_scale"]) for lp in layers])
  want = calibrate.calibrate_kv_scales(model.params, model.cfg, prompts,
                                       num_tokens=64, max_prompts=2)
  np.testing.assert_allclose(k_scale, want[0], rtol=1e-6)
  np.testing.assert_allclose(v_scale, want[1], rtol=1e-6)
  # The first call prefilled the two calibration prompts (and nothing else)
  # with these scales: every layer's stored values stay within 448 /
  # headroom and reach at least half of it.
  L = model.cfg.num_layers
  pages = np.abs(pool).reshape(-1, L, 2, pool[0].size)
  top = pages.max(axis=(0, 3))  # [L, K/V]
  limit = _kv.FP8_MAX / calibrate.DEFAULT_HEADROOM
  assert (top <= limit * 1.07).all(), top  # e4m3 rounding: 3 mantissa bits
  assert (top >= limit * 0.5).all(), top


def test_calibrated_scales_pass_the_check(fp8_run):
  """Calibrated scales map the calibration prompts' amax to 224: nothing
  saturates and nothing warns."""
  engine, *_, caught = fp8_run
  assert not caught, [str(w.message) for w in caught]
  assert engine.stats.kv_saturated_values == 0
  assert engine.stats.as_dict()["kv_saturated_values"] == 0


def _prompt():
  return [list(np.random.default_rng(3).integers(3, 250, size=20))]


def test_tiny_given_scale_saturates_and_warns(model):
  """A scale of 1e-30 clips every nonzero value at +-448."""
  engine = Engine(model, dataclasses.replace(CFG, k_scale=1e-30,
                                             v_scale=1e-30))
  assert engine.stats.kv_saturated_values is None
  with pytest.warns(RuntimeWarning, match=r"layer 0 K: .*saturates"):
    engine.generate(_prompt(), SamplingParams(max_new_tokens=1))
  cfg = model.cfg
  written = cfg.num_layers * 2 * 20 * cfg.num_kv_heads * cfg.head_dim
  assert 0.99 * written <= engine.stats.kv_saturated_values <= written


def test_huge_given_scale_warns_about_unused_range(model):
  """A scale of 1e30 maps every value to ~1e-30: all round to zero."""
  engine = Engine(model, dataclasses.replace(CFG, k_scale=1e30,
                                             v_scale=1e30))
  with pytest.warns(RuntimeWarning, match=r"layer 0 V: .*round to zero"):
    engine.generate(_prompt(), SamplingParams(max_new_tokens=1))
  assert engine.stats.kv_saturated_values == 0


def test_check_counts_values_past_the_scale(model):
  """`check_kv_scales` counts `|x| > 448 * scale` per layer: with scales
  that map half of each layer's K / V amax to 448, the values above half
  the amax saturate, as many as the 16-bit engine's pool holds after a
  prefill of the same prompt."""
  prompts = _prompt()
  k_amax, v_amax = calibrate.kv_amax(
      model.params, model.cfg, jnp.asarray(prompts[0], jnp.int32),
      jnp.asarray([0, 20], jnp.int32))
  half_k, half_v = np.asarray(k_amax) / 2, np.asarray(v_amax) / 2
  params = calibrate.set_kv_scales(model.params, half_k / _kv.FP8_MAX,
                                   half_v / _kv.FP8_MAX)
  check = calibrate.check_kv_scales(params, model.cfg, prompts,
                                    num_tokens=32, max_prompts=2)
  # The oracle: the 16-bit engine's pool after prefilling the prompt.
  engine = Engine(model, dataclasses.replace(CFG, kv_cache_dtype="auto"))
  engine.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))
  L = model.cfg.num_layers
  pool = np.abs(np.asarray(engine.pool).astype(np.float32))
  pages = pool.reshape(-1, L, 2, pool[0].size)
  want_k = (pages[:, :, 0] > half_k[None, :, None]).sum(axis=(0, 2))
  want_v = (pages[:, :, 1] > half_v[None, :, None]).sum(axis=(0, 2))
  # The decode step wrote one more token: at most one token's values more.
  extra = model.cfg.num_kv_heads * model.cfg.head_dim
  assert (check.k_saturated > 0).all() and (check.v_saturated > 0).all()
  assert (want_k - check.k_saturated >= 0).all()
  assert (want_k - check.k_saturated <= extra).all()
  assert (want_v - check.v_saturated >= 0).all()
  assert (want_v - check.v_saturated <= extra).all()
  assert check.values_per_layer == 20 * extra
  assert any("saturates" in p for p in check.problems())


def test_profile_on_fp8_pages(model, fp8_run):
  """`Engine.profile()` times an FP8 engine's step and its attention alone
  (q in the model's compute dtype, FP8 pages read with scales), leaving
  the engine's state alone."""
  engine = fp8_run[0]
  engine.add_request([256, 5, 6, 7, 8], SamplingParams(max_new_tokens=3))
  engine.step()  # the admission: it feeds no token
  with pytest.raises(ValueError, match="the last step fed none"):
    engine.profile(iters=1)
  engine.step()  # the prefill
  before = [np.asarray(x) for x in jax.tree.leaves(engine.state)]
  prof = engine.profile(iters=1)
  assert prof["step_ms"] > 0 and prof["attention_ms"] > 0
  for a, b in zip(before, jax.tree.leaves(engine.state)):
    np.testing.assert_array_equal(a, np.asarray(b))
  while engine.has_unfinished():
    engine.step()


def test_given_scales_skip_calibration(model):
  engine = Engine(model, dataclasses.replace(CFG, k_scale=0.05, v_scale=0.02))
  assert engine.stats.kv_scales_calibrated
  lp = engine.model.params["layers"][0]["attn"]
  assert float(lp["k_scale"]) == pytest.approx(0.05)
  assert float(lp["v_scale"]) == pytest.approx(0.02)


def test_kv_cache_memory_sets_slots(model):
  mib = 2**20
  fp8 = Engine(model, dataclasses.replace(CFG, kv_cache_memory=mib))
  full = Engine(model, dataclasses.replace(CFG, kv_cache_memory=mib,
                                           kv_cache_dtype="auto"))
  itemsize = jnp.dtype(full.pool.dtype).itemsize
  assert fp8.config.num_slots == itemsize * full.config.num_slots
  assert fp8.stats.kv_cache_bytes <= mib and full.stats.kv_cache_bytes <= mib


@pytest.mark.parametrize("kw, match", [
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
    (dict(kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0), "k_scale"),
    (dict(k_scale=1.0), "k_scale / v_scale"),
    (dict(k_scale=-1.0, v_scale=1.0), "k_scale"),
    (dict(kv_cache_memory=0), "kv_cache_memory"),
    (dict(calibration_tokens=0), "calibration_tokens"),
    (dict(kv_scales="per_layer"), "kv_scales: expected 'per_tensor' or "
                                  "'per_head', got 'per_layer'"),
    (dict(kv_cache_dtype="auto", kv_scales="per_head"),
     "kv_scales: expected 'per_tensor' with kv_cache_dtype='auto'"),
])
def test_bad_fp8_config(kw, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(CFG, **kw)


def test_kv_cache_memory_too_small(model):
  with pytest.raises(ValueError, match="kv_cache_memory"):
    Engine(model, dataclasses.replace(CFG, kv_cache_memory=4096))


@pytest.fixture(scope="module")
def two_head_model(model):
  """tiny-llama with 2 KV heads (4 query heads), head 1's K and V
  projections 8x head 0's: per-head scales differ by about 8x."""
  from pkvattn.models import Model, TINY_CONFIGS, init_params
  cfg = dataclasses.replace(TINY_CONFIGS["tiny-llama"], num_qo_heads=4,
                            num_kv_heads=2)
  params = init_params(cfg, jax.random.key(5), jnp.float32)
  attn = dict(params["layers"]["attn"])
  for name in ("k_proj", "v_proj"):
    w = attn[name]["kernel"]
    attn[name] = {"kernel": w.at[..., cfg.head_dim:].multiply(8.0)}
  params = dict(params, layers=dict(params["layers"], attn=attn))
  return Model("tiny-llama-2kv", cfg, params, model.tokenizer)


def test_per_head_scales_calibrate_each_head_without_a_compile(
    two_head_model):
  # Per-head scales: each layer's K / V scale per KV head, calibrated from
  # the first prompts as per-layer ones are (the programs take them as
  # inputs of the same shape before and after: no compile after warmup),
  # and the calibration prompts' stored values fill every head's range.
  model = two_head_model
  engine = Engine(model, dataclasses.replace(CFG, kv_scales="per_head"))
  engine.warmup()
  rng = np.random.default_rng(11)
  prompts = [list(rng.integers(3, 250, size=n)) for n in (29, 11)]
  with count_compiles() as compiles:
    engine.generate(prompts, SamplingParams(max_new_tokens=1,
                                            ignore_eos=True))
  assert not compiles
  k_scale, v_scale = jax.device_get(calibrate.get_kv_scales(
      engine.model.params))
  L, H, D = model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim
  assert k_scale.shape == v_scale.shape == (L, H)
  want = calibrate.calibrate_kv_scales(model.params, model.cfg, prompts,
                                       num_tokens=64, max_prompts=2,
                                       per_head=True)
  np.testing.assert_allclose(k_scale, want[0], rtol=1e-6)
  np.testing.assert_allclose(v_scale, want[1], rtol=1e-6)
  per_layer = calibrate.calibrate_kv_scales(
      model.params, model.cfg, prompts, num_tokens=64, max_prompts=2)
  np.testing.assert_allclose(k_scale.max(axis=1), per_layer[0], rtol=1e-6)
  np.testing.assert_allclose(v_scale.max(axis=1), per_layer[1], rtol=1e-6)
  assert (v_scale[:, 1] > 4 * v_scale[:, 0]).all(), v_scale
  # The first call prefilled the two prompts with these scales: every
  # head's stored values stay within 448 / headroom and reach half of it.
  pool = _pages(engine.pool).astype(np.float32)
  top = np.abs(pool).reshape(-1, L, 2, CFG.page_size, H, D).max(
      axis=(0, 3, 5))  # [L, K/V, H]
  limit = _kv.FP8_MAX / calibrate.DEFAULT_HEADROOM
  assert (top <= limit * 1.07).all(), top  # e4m3 rounding: 3 mantissa bits
  assert (top >= limit * 0.5).all(), top
  assert engine.stats.kv_saturated_values == 0


def test_per_head_given_scale_warns_per_head(two_head_model):
  engine = Engine(two_head_model, dataclasses.replace(
      CFG, kv_scales="per_head", k_scale=1e-4, v_scale=1.0))
  with pytest.warns(RuntimeWarning, match=r"layer 0 head 0 K: scale 0.0001 "
                    r"saturates"):
    engine.generate(_prompt(), SamplingParams(max_new_tokens=1))
