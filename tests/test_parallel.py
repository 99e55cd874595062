"""`pkvattn.parallel`'s layout helpers, replica meshes and drivers.

Parameter layouts (`fuse_projections`, `param_specs`, the kv-head
replication and tied head of `shard_model`) are checked against numpy
slicing and the documented specs; `generate_on_replicas` with stand-in
engines; the argument checks in-process (one CPU device). What needs several
devices (real replica meshes, a tp=2 forward) runs once in a subprocess with
4 forced host devices, as `tests/ops/test_multidevice.py` does (the device
count is fixed when jax initialises its backend), which prints one JSON
object the tests assert on.
"""

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pkvattn import parallel
from pkvattn.flax import AttentionPlan, layer_page_tables
from pkvattn.models import TINY_CONFIGS, forward, init_params
from pkvattn.models.tiny import replace
from cpu_devices import run_script

_SCRIPT = r'''
import dataclasses
import json
import sys
import jax
import jax.numpy as jnp
import numpy as np
from pkvattn import parallel
from pkvattn.flax import AttentionPlan, layer_page_tables
from pkvattn.models import Model, TINY_CONFIGS, forward, init_params
from pkvattn.models import unstack_layers
from pkvattn.models.tiny import replace

assert len(jax.devices()) == 4, jax.devices()
seed = int(sys.argv[1])
res = {"seed": seed}
ids = lambda m: [d.id for d in m.devices.flat]
devs = jax.devices()

# Replica meshes: replica r holds devices [r * tp, (r + 1) * tp).
res["replicas"] = {
    "2x2": [ids(m) for m in parallel.replica_meshes(2, 2)],
    "4x1": [ids(m) for m in parallel.replica_meshes(4)],
    "1x4": [ids(m) for m in parallel.replica_meshes(1, 4)],
    "1x1": [ids(m) for m in parallel.replica_meshes(1)],
    "tail": [ids(m) for m in parallel.replica_meshes(2, 1, devs[2:])],
    "axis": [list(m.axis_names)
             for m in parallel.replica_meshes(2, 2, axis="x")],
    "want_ids": [d.id for d in devs],
}

mesh = parallel.make_mesh(2)

def spec(a):
  return [None if s is None else str(s) for s in a.sharding.spec]

# A vocabulary that does not divide by tp (321 columns, tp=2): the head is
# replicated and so are the logits, which match one device's.
# Its one kv head is replicated on both devices.
cfg = replace(TINY_CONFIGS["tiny-llama"], vocab_size=321)
m = Model("odd", cfg, init_params(cfg, jax.random.key(seed), scale=0.08),
          None)
sm = parallel.shard_model(m, mesh)
ps, b, n, mp = 8, 2, 5, 2
rng = np.random.default_rng(seed)
tables = layer_page_tables(
    jnp.asarray(rng.permutation(b * mp).reshape(b, mp), jnp.int32),
    cfg.num_layers)
toks = jnp.asarray(rng.integers(0, cfg.vocab_size, b * n), jnp.int32)
plan = AttentionPlan.create(tables, jnp.array([0, n, 2 * n], jnp.int32),
                            jnp.array([n, n], jnp.int32), b * n)
expected = forward(m.params, m.cfg, toks,
                   jnp.zeros(cfg.pool_shape(b * mp, ps)), plan)[0]
actual = jax.jit(lambda p, kv: parallel.tp_forward(
    p, sm.cfg, toks, kv, plan, mesh))(
        sm.params, jnp.zeros(sm.cfg.pool_shape(b * mp, ps)))[0]
# The same model given unstacked (a tuple of per-layer trees) is laid out
# as the stacked one is, layer by layer.
try:
  su = parallel.shard_model(
      dataclasses.replace(m, params=unstack_layers(m.params)), mesh)
  want = unstack_layers(sm.params)
  assert jax.tree.structure(su.params) == jax.tree.structure(want)
  res["unstacked"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                         zip(jax.tree.leaves(su.params), jax.tree.leaves(want)))
  # Its tp=2 forward (the per-layer loop under shard_map) gives the same
  # logits as the unsharded model's.
  got = jax.jit(lambda p, kv: parallel.tp_forward(
      p, su.cfg, toks, kv, plan, mesh))(
          su.params, jnp.zeros(su.cfg.pool_shape(b * mp, ps)))[0]
  res["unstacked_forward_err"] = float(jnp.max(jnp.abs(got - expected)))
except Exception as e:  # pylint: disable=broad-except
  res["unstacked"] = f"{type(e).__name__}: {e}"
res["odd_vocab"] = {
    "head_spec": spec(sm.params["lm_head"]),
    "shape": list(actual.shape), "logits_spec": spec(actual),
    "max_err": float(jnp.max(jnp.abs(actual - expected)))}

# tp_forward given the unsharded config (one kv head on two devices) asks
# for shard_model's, before anything is traced.
try:
  parallel.tp_forward(m.params, cfg, toks,
                      jnp.zeros(cfg.pool_shape(b * mp, ps)), plan, mesh)
  res["cfg_error"] = None
except ValueError as e:
  res["cfg_error"] = str(e)

# greedy_tokens asks for a vocabulary that divides by tp.
try:
  parallel.greedy_tokens(jnp.zeros((3, 6)), parallel.make_mesh(4))
  res["greedy_error"] = None
except ValueError as e:
  res["greedy_error"] = str(e)

# pmap_greedy_generate on the devices given (the last three of four) runs
# its two groups on the first two of them, devices 1 and 2 (a step left on
# the default devices would put them on 0 and 1). jax.pmap is wrapped to
# see where the steps' outputs are.
pmap, steps = jax.pmap, []
def spy_pmap(fn, **kw):
  f = pmap(fn, **kw)
  def call(*args):
    out = f(*args)
    steps.append(sorted(d.id for d in out[0].devices()))
    return out
  return call
jax.pmap = spy_pmap
groups = rng.integers(0, cfg.vocab_size, (2, 1, 3))
res["pmap_devices"] = {
    "tokens": parallel.pmap_greedy_generate(
        m.params, cfg, groups, 2, page_size=8, devices=devs[1:]).tolist(),
    "steps": steps, "want": [d.id for d in devs[1:3]]}
jax.pmap = pmap
print("RESULT" + json.dumps(res))
'''


@pytest.fixture(scope="module")
def results():
  # Fresh inputs each run; `PKVATTN_TEST_SEED` replays a failing run's.
  seed = int(os.environ.get("PKVATTN_TEST_SEED")
             or np.random.SeedSequence().entropy) % 2**31
  return run_script(_SCRIPT, str(seed), timeout=300)


def test_replica_meshes_split_the_devices_in_order(results):
  r = results["replicas"]
  d = r["want_ids"]
  assert r["2x2"] == [d[0:2], d[2:4]]
  assert r["4x1"] == [[x] for x in d]  # tp defaults to 1
  assert r["1x4"] == [d]
  assert r["1x1"] == [d[:1]]
  assert r["tail"] == [[d[2]], [d[3]]]  # of the devices given
  assert r["axis"] == [["x"], ["x"]]


def test_tp_forward_odd_vocab_keeps_the_head_replicated(results):
  """A vocabulary that does not divide by tp: `shard_model` leaves the LM
  head replicated and `tp_forward` returns replicated logits of the full
  vocabulary, as one device computes them."""
  r = results["odd_vocab"]
  assert all(s is None for s in r["head_spec"]), r
  assert all(s is None for s in r["logits_spec"]), r
  assert r["shape"] == [10, 321]
  assert r["max_err"] < 1e-4, (results["seed"], r)


def test_shard_model_unstacked_with_replicated_kv_heads(results):
  """`shard_model` (so `Engine(..., mesh=...)`) takes a model given with
  unstacked layers when its kv heads are replicated (tp=2, one kv head)."""
  assert results["unstacked"] == 0.0, results["unstacked"]


def test_tp_forward_unstacked_matches_one_device(results):
  """`tp_forward` of the unstacked sharded model (each layer's o_proj and
  down_proj summed over the shards) gives one device's logits."""
  assert results["unstacked"] == 0.0, results["unstacked"]
  assert results["unstacked_forward_err"] < 1e-4, (
      results["seed"], results["unstacked_forward_err"])


def test_tp_forward_rejects_an_unsharded_config(results):
  """`tp_forward` with the model's own config where `shard_model` would
  replicate its one kv head over tp=2: the documented ValueError naming
  cfg, what it expects and the kv heads it got, not a sharding error from
  inside `shard_map` (the pool's one head does split nowhere)."""
  assert results["cfg_error"] == (
      "Invalid cfg: expected num_kv_heads >= tp=2 (use "
      "pkvattn.parallel.shard_model), got num_kv_heads=1")


def test_greedy_tokens_rejects_indivisible_vocab(results):
  assert "Invalid shape of logits" in results["greedy_error"]


def test_pmap_greedy_generate_runs_on_the_devices_given(results):
  """`devices=` (not the default: the last three of four devices) for two
  groups: the prefill and the decode step both run on the first two devices
  given, one group each."""
  r = results["pmap_devices"]
  assert np.asarray(r["tokens"]).shape == (2, 1, 2)
  assert r["steps"] == [r["want"]] * 2, r  # the prefill, one decode


def _projections(rng, num_layers, hidden, cols, bias):
  """q/k/v, gate/up, o/down projections of random values: stacked layers
  (leading `num_layers` axis), `cols` columns each (name -> count)."""
  def dense(fan_in, fan_out):
    p = {"kernel": rng.standard_normal((num_layers, fan_in, fan_out))}
    if bias:
      p["bias"] = rng.standard_normal((num_layers, fan_out))
    return {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}
  attn = {n: dense(hidden, cols[n]) for n in ("q_proj", "k_proj", "v_proj")}
  attn["o_proj"] = dense(cols["q_proj"], hidden)
  mlp = {n: dense(hidden, cols[n]) for n in ("gate_proj", "up_proj")}
  mlp["down_proj"] = dense(cols["gate_proj"], hidden)
  return {"embed": jnp.asarray(rng.standard_normal((7, hidden)), jnp.float32),
          "layers": {"attn": attn, "mlp": mlp,
                     "attn_norm": jnp.ones((num_layers, hidden))}}


def _shard_major(parts, tp):
  """numpy: for each shard i, its column block of every part, side by side."""
  parts = [np.asarray(p) for p in parts]
  blocks = []
  for i in range(tp):
    for p in parts:
      c = p.shape[-1] // tp
      blocks.append(p[..., i * c:(i + 1) * c])
  return np.concatenate(blocks, axis=-1)


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("stacked", [True, False])
def test_fuse_projections_is_shard_major(rng, tp, stacked):
  cols = {"q_proj": 12, "k_proj": 6, "v_proj": 6, "gate_proj": 18,
          "up_proj": 18}
  params = _projections(rng, 2, 6, cols, bias=True)
  layers = [jax.tree.map(lambda a, i=i: a[i], params["layers"])
            for i in range(2)]
  given = params if stacked else dict(params, layers=tuple(layers))
  fused = parallel.fuse_projections(given, tp)
  got = fused["layers"]
  assert isinstance(got, dict) == stacked
  per_layer = [got] if stacked else list(got)
  want = [params["layers"]] if stacked else layers
  for g, w in zip(per_layer, want):
    for group, names, name in (("attn", ("q_proj", "k_proj", "v_proj"),
                                "qkv_proj"),
                               ("mlp", ("gate_proj", "up_proj"),
                                "gate_up_proj")):
      assert set(g[group]) == {name, ("o_proj" if group == "attn"
                                      else "down_proj")}
      for k in ("kernel", "bias"):
        np.testing.assert_array_equal(
            np.asarray(g[group][name][k]),
            _shard_major([w[group][n][k] for n in names], tp))
    np.testing.assert_array_equal(np.asarray(g["attn"]["o_proj"]["kernel"]),
                                  np.asarray(w["attn"]["o_proj"]["kernel"]))
  np.testing.assert_array_equal(np.asarray(fused["embed"]),
                                np.asarray(params["embed"]))
  # Idempotent.
  again = parallel.fuse_projections(fused, tp)
  assert jax.tree.structure(again) == jax.tree.structure(fused)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(fused)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fuse_projections_rejects_indivisible_columns(rng):
  # 3 layers of [6, 5]: every axis but the columns divides by tp=3.
  params = _projections(rng, 3, 6, {"q_proj": 5, "k_proj": 5, "v_proj": 5,
                                    "gate_proj": 6, "up_proj": 6}, bias=False)
  with pytest.raises(ValueError, match="Invalid projection"):
    parallel.fuse_projections(params, 3)


def _spec_tree(params, **kw):
  specs = parallel.param_specs(params, "model", **kw)
  return jax.tree.map(tuple, specs,
                      is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))


def test_param_specs_stacked_and_unstacked(rng):
  """Column-parallel kernels and biases split on their last axis,
  row-parallel kernels on their input axis (biases replicated), the LM
  head on its vocabulary columns where `tp` divides them; stacked layers
  keep their leading axis unsplit."""
  cols = {"q_proj": 4, "k_proj": 2, "v_proj": 2, "gate_proj": 8,
          "up_proj": 8}
  params = _projections(rng, 2, 4, cols, bias=True)
  params["final_norm"] = jnp.ones((4,))
  params["lm_head"] = jnp.zeros((4, 12))
  layers = params["layers"]
  fused = parallel.fuse_projections(params, 2)
  for tree in (params, fused):
    s = _spec_tree(tree, tp=4)
    for group, projs in s["layers"].items():
      if group == "attn_norm":
        assert projs == ()
        continue
      for name, p in projs.items():
        if name in ("o_proj", "down_proj"):
          assert p == {"kernel": (None, "model", None), "bias": ()}, name
        else:
          assert p == {"kernel": (None, None, "model"),
                       "bias": (None, "model")}, name
    assert s["lm_head"] == (None, "model")
    assert s["embed"] == () and s["final_norm"] == ()
  assert _spec_tree(params, tp=5)["lm_head"] == ()  # 12 % 5
  assert _spec_tree(params)["lm_head"] == ()        # no tp given

  # Unstacked: a tuple of per-layer trees, no leading layer axis.
  per_layer = tuple(jax.tree.map(lambda a, i=i: a[i], layers)
                    for i in range(2))
  s = _spec_tree(dict(params, layers=per_layer), tp=3)
  assert s["lm_head"] == (None, "model")
  for lp in s["layers"]:
    assert lp["attn"]["q_proj"] == {"kernel": (None, "model"),
                                    "bias": ("model",)}
    assert lp["mlp"]["up_proj"] == {"kernel": (None, "model"),
                                    "bias": ("model",)}
    assert lp["attn"]["o_proj"] == {"kernel": ("model", None), "bias": ()}
    assert lp["mlp"]["down_proj"] == {"kernel": ("model", None), "bias": ()}
    assert lp["attn_norm"] == ()


def test_vocab_parallel_and_configs():
  cfg = replace(TINY_CONFIGS["tiny-llama"], num_qo_heads=4, num_kv_heads=2,
                vocab_size=320)
  # 320 = 2**6 * 5.
  assert [tp for tp in range(1, 11) if parallel.vocab_parallel(cfg, tp)] == [
      1, 2, 4, 5, 8, 10]
  assert parallel.tp_config(cfg, 2) == cfg   # tp == num_kv_heads
  assert parallel.tp_config(cfg, 4).num_kv_heads == 4
  local = parallel.shard_config(parallel.tp_config(cfg, 4), 4)
  assert (local.num_qo_heads, local.num_kv_heads,
          local.intermediate_size) == (1, 1, cfg.intermediate_size // 4)


def test_tp_config_rejects_indivisible_mlp(rng):
  """An MLP whose width does not divide by tp (the heads do) cannot be
  column-split: a ValueError naming `intermediate_size` and tp, not a
  per-shard config with the columns silently floored."""
  cfg = replace(TINY_CONFIGS["tiny-llama"], num_qo_heads=4, num_kv_heads=2)
  tp = int(rng.choice([2, 4]))
  width = tp * int(rng.integers(8, 64)) + int(rng.integers(1, tp))
  with pytest.raises(ValueError, match=re.escape(
      f"intermediate_size={width} must be divisible by tp={tp}")):
    parallel.tp_config(replace(cfg, intermediate_size=width), tp)


def test_make_mesh_rejects_bad_tp():
  devices = jax.devices()
  assert parallel.make_mesh(1).devices.tolist() == devices[:1]
  for tp in (0, -1, 1.0, len(devices) + 1):
    with pytest.raises(ValueError, match="Invalid tp"):
      parallel.make_mesh(tp)


def test_tp_size_rejects_a_mesh_without_the_axis(rng):
  """`tp_size` (so `shard_model` and `tp_forward`) on a mesh that lacks the
  axis: a ValueError naming the mesh, the axis asked for and the axes it
  has, not a KeyError from `mesh.shape`."""
  axis = f"ax{rng.integers(100)}"
  mesh = parallel.make_mesh(1, axis=axis)
  assert parallel.tp_size(mesh, axis) == 1
  want = re.escape(f"Invalid mesh: expected an axis named 'tp', got axes "
                   f"('{axis}',)")
  with pytest.raises(ValueError, match=want):
    parallel.tp_size(mesh)
  with pytest.raises(ValueError, match=want):
    parallel.shard_model(_model(), mesh)


def _model(**kw):
  cfg = replace(TINY_CONFIGS["tiny-llama"], **kw)
  from pkvattn.models import Model
  return Model("t", cfg, init_params(cfg, jax.random.key(0), scale=0.08), None)


def test_shard_model_unties_a_vocab_parallel_head():
  """A tied head whose vocabulary divides by tp (any, at tp=1) becomes its
  own `lm_head = embed.T`, placed vocab-sharded as `param_specs(..., tp=tp)`
  lays it out (so each device holds 1 / tp of it, not a replica); the
  projections stay unfused unless asked."""
  mesh = parallel.make_mesh(1)
  m = _model(tie_word_embeddings=True)
  sm = parallel.shard_model(m, mesh)
  assert sm.cfg == dataclasses.replace(m.cfg, tie_word_embeddings=False)
  np.testing.assert_array_equal(np.asarray(sm.params["lm_head"]),
                                np.asarray(m.params["embed"]).T)
  want = parallel.param_specs(sm.params, tp=1)
  got = jax.tree.map(lambda a: a.sharding.spec, sm.params)
  assert got == want
  assert got["lm_head"] == jax.sharding.PartitionSpec(None, parallel.TP_AXIS)
  assert "q_proj" in sm.params["layers"]["attn"]  # fuse defaults to False
  assert "qkv_proj" in parallel.shard_model(
      m, mesh, fuse=True).params["layers"]["attn"]


@pytest.mark.parametrize("stacked", [True, False])
def test_tp_layout_replicates_kv_heads(rng, stacked):
  """`shard_model`'s layout program with kv heads replicated: kv head k's
  k/v columns (kernel and bias) repeated `reps` times, head-major (copy j
  of head k at k * reps + j); the other weights untouched."""
  cfg = replace(TINY_CONFIGS["tiny-llama"], num_qo_heads=4, num_kv_heads=2,
                head_dim=8, hidden_size=16)
  params = _projections(rng, 2, 16, {"q_proj": 32, "k_proj": 16,
                                     "v_proj": 16, "gate_proj": 8,
                                     "up_proj": 8}, bias=True)
  layers = params["layers"]
  if not stacked:
    params = dict(params, layers=tuple(
        jax.tree.map(lambda a, i=i: a[i], layers) for i in range(2)))
  out = parallel._tp_layout(params, cfg, 3, False, None)  # noqa: SLF001
  got = out["layers"]
  if not stacked:
    got = jax.tree.map(lambda *a: jnp.stack(a), *got)
  for name in ("k_proj", "v_proj"):
    for k, a in layers["attn"][name].items():
      a = np.asarray(a)
      heads = a.reshape(*a.shape[:-1], 2, 1, 8)
      want = np.repeat(heads, 3, axis=-2).reshape(*a.shape[:-1], 48)
      np.testing.assert_array_equal(np.asarray(got["attn"][name][k]), want)
  for group, name in (("attn", "q_proj"), ("attn", "o_proj"),
                      ("mlp", "gate_proj"), ("mlp", "down_proj")):
    np.testing.assert_array_equal(np.asarray(got[group][name]["kernel"]),
                                  np.asarray(layers[group][name]["kernel"]))
  assert "lm_head" not in out


def test_generate_on_replicas_round_robin(rng):
  class Engine:
    def __init__(self, name):
      self.name = name

    def generate(self, prompts, params):
      if not isinstance(params, list):
        params = [params] * len(prompts)
      assert len(params) == len(prompts)
      return [[self.name, sp, *p] for p, sp in zip(prompts, params)]

  engines = [Engine(e) for e in range(3)]
  prompts = [rng.integers(0, 100, rng.integers(1, 4)).tolist()
             for _ in range(7)]
  per = rng.integers(0, 100, 7).tolist()
  for params in (per, tuple(per)):
    assert parallel.generate_on_replicas(engines, prompts, params) == [
        [i % 3, per[i], *p] for i, p in enumerate(prompts)]
  assert parallel.generate_on_replicas(iter(engines), prompts, -1) == [
      [i % 3, -1, *p] for i, p in enumerate(prompts)]
  # Prompts from an iterator too (taken once, then dealt out).
  assert parallel.generate_on_replicas(engines, iter(prompts), -1) == [
      [i % 3, -1, *p] for i, p in enumerate(prompts)]
  assert parallel.generate_on_replicas(engines[:1], prompts[:2], 5) == [
      [0, 5, *p] for p in prompts[:2]]
  with pytest.raises(ValueError, match="Invalid engines"):
    parallel.generate_on_replicas([], prompts, 0)
  with pytest.raises(ValueError, match="Invalid params"):
    parallel.generate_on_replicas(engines, prompts, per[:-1])

  class Broken(Engine):
    def generate(self, prompts, params):
      raise RuntimeError(f"engine {self.name} failed")
  with pytest.raises(RuntimeError, match="engine 1 failed"):
    parallel.generate_on_replicas([Engine(0), Broken(1)], prompts, 0)


def test_replica_meshes_errors():
  fake = [object()] * 4  # checked before any mesh is made
  for num_replicas, tp in ((0, 1), (1, 0), (-1, 1), (1, -1), (3, 2), (5, 1),
                           (1, 5), (2.0, 1), (1, 2.0)):
    with pytest.raises(ValueError, match="Invalid num_replicas"):
      parallel.replica_meshes(num_replicas, tp, fake)


def test_tp_forward_rejects_pool_of_other_heads():
  m = _model()
  pool = jnp.zeros((8, 4, m.cfg.num_kv_heads + 1, m.cfg.head_dim))
  tables = layer_page_tables(jnp.zeros((1, 1), jnp.int32), m.cfg.num_layers)
  plan = AttentionPlan.create(tables, jnp.array([0, 1], jnp.int32),
                              jnp.array([1], jnp.int32), 1)
  with pytest.raises(ValueError, match="Invalid shape of kv_cache"):
    parallel.tp_forward(m.params, m.cfg, jnp.zeros((1,), jnp.int32), pool,
                        plan, parallel.make_mesh(1))


def test_tp_forward_passes_impl_and_logits_indices(rng):
  """`tp_forward` hands `logits_indices` and `impl` to each shard's
  `forward`: at tp=1 its logits are `forward`'s rows at the indices, and an
  unknown impl raises the ValueError `forward` raises for it."""
  m = _model()
  b, n, ps = 2, 5, 8
  tables = layer_page_tables(
      jnp.asarray(rng.permutation(2 * b).reshape(b, 2), jnp.int32),
      m.cfg.num_layers)
  toks = jnp.asarray(rng.integers(0, m.cfg.vocab_size, b * n), jnp.int32)
  plan = AttentionPlan.create(tables, jnp.array([0, n, 2 * n], jnp.int32),
                              jnp.array([n, n], jnp.int32), b * n)
  idx = jnp.asarray(rng.choice(b * n, 3, replace=False), jnp.int32)
  pool = jnp.zeros(m.cfg.pool_shape(2 * b, ps))
  mesh = parallel.make_mesh(1)
  every = forward(m.params, m.cfg, toks, pool, plan)[0]
  got = parallel.tp_forward(m.params, m.cfg, toks, pool, plan, mesh,
                            logits_indices=idx, impl="xla")[0]
  assert got.shape == (3, m.cfg.vocab_size)
  np.testing.assert_allclose(np.asarray(got), np.asarray(every)[np.asarray(idx)],
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="impl"):
    parallel.tp_forward(m.params, m.cfg, toks, pool, plan, mesh, impl="bogus")


def test_pmap_greedy_generate_one_group_one_token(rng):
  """One group on the one device, one token: each prompt's greedy next
  token, as `forward` gives it for that prompt alone (the prompts given as
  nested lists)."""
  m = _model()
  b, n = 2, 5
  prompts = rng.integers(0, m.cfg.vocab_size, (1, b, n)).astype(np.int32)
  # Given as nested lists of Python ints, as the annotation's i32 array.
  actual = parallel.pmap_greedy_generate(m.params, m.cfg, prompts.tolist(), 1)
  assert actual.shape == (1, b, 1)
  tables = layer_page_tables(jnp.array([[3, 1]], jnp.int32),
                             m.cfg.num_layers)
  for i in range(b):
    plan = AttentionPlan.create(tables, jnp.array([0, n], jnp.int32),
                                jnp.array([n], jnp.int32), n)
    logits = forward(m.params, m.cfg, jnp.asarray(prompts[0, i]),
                     jnp.zeros(m.cfg.pool_shape(4, 8)), plan)[0]
    assert actual[0, i, 0] == int(jnp.argmax(logits[-1])), i


def test_pmap_greedy_generate_errors():
  m = _model()
  ndev = len(jax.local_devices())
  for shape in ((1, 4), (ndev + 1, 1, 1), (0, 1, 4), (1, 1, 1, 4)):
    with pytest.raises(ValueError, match="Invalid shape of prompts"):
      parallel.pmap_greedy_generate(m.params, m.cfg, np.zeros(shape), 2)
  with pytest.raises(ValueError, match="Invalid max_new_tokens"):
    parallel.pmap_greedy_generate(m.params, m.cfg, np.zeros((1, 1, 4)), 0)


def test_pmap_greedy_generate_decodes_across_pages(rng, monkeypatch):
  """Several tokens, the sequences crossing a page boundary: each request's
  greedy continuation, recomputed here from scratch (the whole sequence
  through `forward` each step, a fresh pool). The pool holds
  ceil((prompt_len + max_new_tokens) / page_size) pages per request, and
  every step's pool argument is donated (deleted after the step; the
  prefill's host pool is put on the devices here, so that its donation
  shows too). The `impl` given reaches both steps' `forward`."""
  m = _model()
  b, ps, t = 2, 8, 5
  n = int(rng.integers(4, 8))  # n + t in [9, 12]: two pages of 8
  prompts = rng.integers(0, m.cfg.vocab_size, (1, b, n)).astype(np.int32)
  pmap, pools, shapes = jax.pmap, [], []
  prefill = parallel._greedy_prefill  # noqa: SLF001

  def spy_prefill(params, pool, *args, **kw):
    shapes.append(pool.shape)
    return prefill(params, pool, *args, **kw)

  def spy_pmap(fn, **kw):
    f = pmap(fn, **kw)
    def call(params, pool, *args):
      if isinstance(pool, np.ndarray):  # the prefill's: on device first
        pool = pmap(lambda x: x)(pool)
      out = f(params, pool, *args)
      pools.append(pool)
      return out
    return call

  decoder_forward, impls = parallel._decoder.forward, []  # noqa: SLF001

  def spy_forward(*args, **kw):  # traced once per step program
    impls.append(kw.get("impl"))
    return decoder_forward(*args, **kw)

  monkeypatch.setattr(parallel, "_greedy_prefill", spy_prefill)
  monkeypatch.setattr(jax, "pmap", spy_pmap)
  monkeypatch.setattr(parallel._decoder, "forward", spy_forward)  # noqa: SLF001
  actual = parallel.pmap_greedy_generate(m.params, m.cfg, prompts, t,
                                         page_size=ps, impl="xla")
  monkeypatch.undo()
  assert impls == ["xla"] * 2, impls  # the prefill's, the decode's
  assert actual.shape == (1, b, t)
  assert shapes == [m.cfg.pool_shape(b * int(np.ceil((n + t) / ps)), ps)]
  assert len(pools) == t  # the prefill's, then t - 1 decodes
  assert [p.is_deleted() for p in pools] == [True] * t
  for i in range(b):
    seq = list(prompts[0, i])
    tables = layer_page_tables(
        jnp.asarray(rng.permutation(2)[None], jnp.int32), m.cfg.num_layers)
    for _ in range(t):
      k = len(seq)
      plan = AttentionPlan.create(tables, jnp.array([0, k], jnp.int32),
                                  jnp.array([k], jnp.int32), k)
      logits = forward(m.params, m.cfg, jnp.asarray(seq, jnp.int32),
                       jnp.zeros(m.cfg.pool_shape(2, ps)), plan)[0]
      seq.append(int(jnp.argmax(logits[-1])))
    np.testing.assert_array_equal(actual[0, i], seq[n:], err_msg=str(i))
