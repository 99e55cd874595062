"""The FP8 scale contract of the attention and append ops.

A scale (`k_scale`, `v_scale`) must be finite and at least 2**-126 (the
smallest normal f32). Host numbers (Python `int` / `float`, numpy values) are
checked when the op is traced (`jax.eval_shape` below: no kernel runs) with a
`ValueError` naming the scale; jax arrays are checked in checked mode, eagerly
(`checkify.JaxRuntimeError`) or staged in a checkified jit, where attention
returns NaN and an append writes nothing. Oracles: float64 attention over the
dequantized pages (`attention_utils.dense_attention`) and the numpy storage
rule (`attention_utils.quantize_np`); inputs are fresh random values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import attention_utils as au
import pkvattn

FP8 = jnp.float8_e4m3fn
NUM_PAGES, PS, HKV, HQ, D = 6, 8, 2, 4, 64
BAD_SCALES = (0, 0.0, -0.0, -1.5, -3, float("nan"), float("inf"),
              float("-inf"), 1e-40, 10**400, np.float32(0), np.array(-2.0),
              np.array([np.nan], np.float32))
BAD_ARRAYS = (0.0, -1.0, np.nan, np.inf, -np.inf, 1e-40)


def _case(rng):
  """Random FP8 pools (finite e4m3 values), one sequence of `n` keys over
  two pages, one query token per op, and the tokens an append writes."""
  pools = tuple(jnp.asarray(rng.uniform(-400, 400, (NUM_PAGES, PS, HKV, D)),
                            jnp.float32).astype(FP8) for _ in range(2))
  pages = rng.choice(NUM_PAGES, 2, replace=False)
  table = jnp.asarray(pages[None, :], jnp.int32)
  n = int(rng.integers(PS + 1, 2 * PS + 1))
  q = jnp.asarray(rng.standard_normal((1, HQ, D)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((3, HKV, D)), jnp.float32)
          for _ in range(2))
  pos = jnp.asarray(rng.choice(n, 3, replace=False), jnp.int32)
  return dict(pools=pools, pages=pages, table=table, n=n, q=q, k=k, v=v,
              pos=pos, bidx=jnp.zeros(3, jnp.int32))


def _ops(c):
  """Each op as `f(k_scale, v_scale, **kw)` on case `c`, returning arrays."""
  lens = jnp.asarray([c["n"]], jnp.int32)
  qkv = jnp.concatenate([jnp.tile(c["q"], (3, 1, 1)).reshape(3, -1),
                         c["k"].reshape(3, -1), c["v"].reshape(3, -1)], axis=1)
  rope = pkvattn.RopeConfig()
  return {
      "paged_decode": lambda ks, vs, **kw: pkvattn.paged_decode(
          c["q"], c["pools"], c["table"], lens, impl="xla", k_scale=ks,
          v_scale=vs, **kw),
      "paged_prefill": lambda ks, vs, **kw: pkvattn.paged_prefill(
          c["q"], c["pools"], c["table"], jnp.asarray([0, 1]), lens,
          impl="xla", k_scale=ks, v_scale=vs, **kw),
      "append_paged_kv": lambda ks, vs, **kw: pkvattn.append_paged_kv(
          c["k"], c["v"], c["bidx"], c["pos"], c["pools"], c["table"],
          impl="xla", k_scale=ks, v_scale=vs, **kw),
      "apply_rope_and_append": lambda ks, vs, **kw: pkvattn.apply_rope_and_append(
          jnp.tile(c["q"], (3, 1, 1)), c["k"], c["v"], c["bidx"], c["pos"],
          c["pools"], c["table"], rope, impl="xla", k_scale=ks, v_scale=vs,
          **kw),
      "apply_rope_and_append_qkv": lambda ks, vs, **kw: (
          pkvattn.apply_rope_and_append_qkv(
              qkv, c["bidx"], c["pos"], c["pools"], c["table"], rope,
              impl="xla", k_scale=ks, v_scale=vs, **kw)),
  }


OPS = list(_ops(_case(np.random.default_rng(0))))
APPENDS = [name for name in OPS if "append" in name]


@pytest.mark.parametrize("name", OPS)
def test_host_scales_refused_at_trace_time(name, rng):
  op = _ops(_case(rng))[name]
  for bad in BAD_SCALES:
    good = float(rng.uniform(0.01, 2.0))
    for which in ("k_scale", "v_scale"):
      args = (bad, good) if which == "k_scale" else (good, bad)
      # eval_shape traces the op and runs nothing: the error is trace time.
      with pytest.raises(ValueError, match=rf"Invalid {which}: expected a "
                         r"finite scale >= 1\.175e-38 .*, got "):
        jax.eval_shape(lambda a=args: op(*a))
  for bad in (True, np.array(1, np.int32)):
    with pytest.raises(ValueError, match="Invalid dtype of k_scale"):
      jax.eval_shape(lambda b=bad: op(b, 1.0))


def test_int_scales_are_accepted(rng):
  """`k_scale=2` means 2.0: the same outputs, and the oracles hold."""
  c = _case(rng)
  ops = _ops(c)
  ks, vs = (int(x) for x in rng.integers(1, 5, 2))
  out = ops["paged_decode"](ks, vs)
  np.testing.assert_array_equal(out, ops["paged_decode"](float(ks), float(vs)))
  pages = [np.asarray(p.astype(jnp.float32), np.float64) for p in c["pools"]]
  tk = pages[0][c["pages"]].reshape(-1, HKV, D)[:c["n"]] * ks
  tv = pages[1][c["pages"]].reshape(-1, HKV, D)[:c["n"]] * vs
  want, _ = au.dense_attention(np.asarray(c["q"]), tk, tv, [c["n"] - 1],
                               c["n"], sm_scale=D**-0.5)
  # Values reach 400 * v_scale: f32 rounding of the weighted sum is
  # absolute in their size, so the tolerance scales with them (an output
  # near zero by cancellation keeps that absolute error).
  np.testing.assert_allclose(
      np.asarray(out, np.float64), want, rtol=au.RTOL[np.dtype(jnp.float32)],
      atol=au.ATOL[np.dtype(jnp.float32)] * np.abs(tv).max())
  np.testing.assert_array_equal(
      ops["paged_prefill"](ks, vs), ops["paged_prefill"](float(ks), float(vs)))
  for name in APPENDS:
    got = jax.tree.leaves(ops[name](ks, vs))
    want = jax.tree.leaves(ops[name](float(ks), float(vs)))
    for a, b in zip(got, want):
      np.testing.assert_array_equal(np.asarray(a, np.float32),
                                    np.asarray(b, np.float32))
  kp, vp = ops["append_paged_kv"](ks, np.int64(vs))
  for t, p in enumerate(np.asarray(c["pos"])):
    page = c["pages"][p // PS]
    np.testing.assert_array_equal(
        np.asarray(kp[page, p % PS], np.float32),
        au.quantize_np(c["k"][t], ks).astype(np.float32))
    np.testing.assert_array_equal(
        np.asarray(vp[page, p % PS], np.float32),
        au.quantize_np(c["v"][t], vs).astype(np.float32))


# A v_scale and f32 values whose exactly rounded quotient `x / scale` is an
# e4m3 rounding tie (-34, -84) while `x * (1 / scale)` is a hair past it, so
# the two store neighbouring e4m3 values (found by a search over random
# values): the storage rule is the product.
RECIPROCAL_SCALE = np.float32(0.0063317735)
RECIPROCAL_VALUES = np.float32([-0.21528031, -0.531869])


@pytest.mark.parametrize("name", APPENDS)
def test_appends_store_the_reciprocal_product(name, rng):
  """Every append stores `x * (1 / v_scale)` rounded to e4m3, as the numpy
  rule (`attention_utils.quantize_np`) does, also where an exactly rounded
  division would store the neighbouring value."""
  by_division = np.clip(RECIPROCAL_VALUES / RECIPROCAL_SCALE, -448, 448)
  want = au.quantize_np(RECIPROCAL_VALUES, RECIPROCAL_SCALE)
  assert (by_division.astype(want.dtype).view(np.uint8)
          != want.view(np.uint8)).all()  # the cases tell the rules apart
  c = _case(rng)
  n = RECIPROCAL_VALUES.size
  c["v"] = c["v"].at[0, 0, :n].set(RECIPROCAL_VALUES)
  vp = jax.tree.leaves(_ops(c)[name](1.0, float(RECIPROCAL_SCALE)))[-1]
  p = int(c["pos"][0])
  stored = np.asarray(vp[c["pages"][p // PS], p % PS, 0, :n])
  np.testing.assert_array_equal(stored.view(np.uint8), want.view(np.uint8))


def test_smallest_scale_never_poisons_the_cache(rng):
  """At 2**-126 the reciprocal is finite: every value saturates, 0 stays 0
  (a scale of 0 or a subnormal one would store NaN there); checked mode
  takes it, as a host number and as an array."""
  c = _case(rng)
  c["k"] = c["k"].at[0].set(0.0)
  with pkvattn.checked():
    kp, vp = _ops(c)["append_paged_kv"](2.0**-126, jnp.float32(2.0**-126))
  for t, p in enumerate(np.asarray(c["pos"])):
    page = c["pages"][p // PS]
    for pool, x in ((kp, c["k"][t]), (vp, c["v"][t])):
      row = np.asarray(pool[page, p % PS], np.float32)
      assert np.isfinite(row).all()
      np.testing.assert_array_equal(row, np.sign(np.asarray(x)) * 448.0)


@pytest.mark.parametrize("name", OPS)
def test_checked_mode_reports_array_scales(name, rng):
  c = _case(rng)
  op = _ops(c)[name]
  good = [jnp.float32(rng.uniform(0.01, 2.0)) for _ in range(2)]
  expected = op(*good)
  staged = jax.jit(checkify.checkify(lambda ks, vs: op(ks, vs)))
  with pkvattn.checked():
    for a, b in zip(jax.tree.leaves(op(*good)), jax.tree.leaves(expected)):
      np.testing.assert_array_equal(np.asarray(a, np.float32),
                                    np.asarray(b, np.float32))
    err, out = staged(*good)
    assert err.get() is None
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
      np.testing.assert_array_equal(np.asarray(a, np.float32),
                                    np.asarray(b, np.float32))
    for bad in BAD_ARRAYS:
      which = int(rng.integers(2))
      name_ = ("k_scale", "v_scale")[which]
      scales = list(good)
      scales[which] = jnp.float32(bad)
      msg = rf"Invalid {name_}: {name_} = \S+, expected a finite scale"
      with pytest.raises(checkify.JaxRuntimeError, match=msg):
        op(*scales)
      err, out = staged(*scales)
      assert err.get() is not None and name_ in err.get(), err.get()
      if name in APPENDS:  # nothing written: the pools as they came in
        pools = out if name == "append_paged_kv" else out[1]
        for a, b in zip(jax.tree.leaves(pools), jax.tree.leaves(c["pools"])):
          np.testing.assert_array_equal(np.asarray(a, np.float32),
                                        np.asarray(b, np.float32))
      else:  # no kernel ran: NaN
        assert np.isnan(np.asarray(out)).all()


@pytest.mark.parametrize("name", ["paged_decode", "apply_rope_and_append"])
def test_unchecked_array_scales_add_no_check(name, monkeypatch, rng):
  """Unchecked, array scales are not checked: no contract code runs."""
  op = _ops(_case(rng))[name]

  def forbidden(*a, **k):
    raise AssertionError("contract code ran on the unchecked path")

  monkeypatch.setattr(pkvattn._contract, "run", forbidden)
  out = jax.jit(lambda ks, vs: op(ks, vs))(jnp.float32(0.5), jnp.float32(0.5))
  assert all(np.isfinite(np.asarray(x, np.float32)).all()
             for x in jax.tree.leaves(out))
