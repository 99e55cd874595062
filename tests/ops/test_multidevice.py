"""Tensor parallel (shard_map) and data parallel (pmap) on 4 forced CPU devices.

The device count is fixed when jax initialises its backend, and other tests
share this worker process, so the multi-device checks run ONCE in a
subprocess with `--xla_force_host_platform_device_count=4` (the script below)
that prints one JSON object; the tests assert on its parts. Config errors need
no devices and run in-process.
"""

import pytest

from pkvattn import parallel
from pkvattn.models import TINY_CONFIGS
from pkvattn.models.tiny import replace
from cpu_devices import run_script

_SCRIPT = r'''
import dataclasses
import json
import logging
import re
import jax
import jax.numpy as jnp
import numpy as np
from pkvattn import parallel
from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.flax import AttentionPlan, layer_page_tables
from pkvattn.models import Model, forward, init_params, load_model
from pkvattn.models.tiny import replace
from pkvattn.serving.compiler import ProgramKey

assert len(jax.devices()) == 4, jax.devices()
res = {"logits": {}, "pool": {}, "engine": {}, "sharding": {}}
tok = load_model("tiny-llama").tokenizer

def spec(x):  # PartitionSpec -> 4 entries (axis name or None), any jax version
  entries = [None if a is None else str(a) for a in x.sharding.spec]
  return entries + [None] * (x.ndim - len(entries))

_COLLECTIVES = ("all_reduce", "all_gather", "collective_permute",
                "all_to_all", "reduce_scatter", "collective_broadcast")

def lowered_collectives(text):  # StableHLO -> [[op, result type]]
  ops = "|".join(_COLLECTIVES)
  found = re.findall(r'"stablehlo\.(%s)".*?\) -> (tensor<[^>]*>)' % ops, text,
                     re.S)
  assert len(found) == len(re.findall(r"stablehlo\.(%s)\b" % ops, text))
  return [list(f) for f in found]

def compiled_collectives(text):  # HLO -> [[op, dtype, dims]]
  ops = "|".join(c.replace("_", "-") for c in _COLLECTIVES)
  found = re.findall(r"= (\w+)\[([\d,]*)\]\S* (%s)(?:-start)?\(" % ops, text)
  assert len(found) == len(re.findall(r" (%s)(?:-start)?\(" % ops, text))
  return [[op, dtype, [int(d) for d in dims.split(",") if d]]
          for dtype, dims, op in found]

def compiled_gathers(text):  # HLO -> [[dtype, dims, cond branch or None]]
  out = []
  for dtype, dims, name in re.findall(
      r"= (\w+)\[([\d,]*)\]\S* all-gather(?:-start)?\("
      r"[^\n]*op_name=\"([^\"]*)\"", text):
    branch = re.search(r"/cond/branch_(\d)_fun/", name)
    out.append([dtype, [int(d) for d in dims.split(",") if d],
                branch and int(branch[1])])
  return out

def model(name, **kw):
  cfg = replace(load_model(name).cfg, **kw)
  return Model(name, cfg, init_params(cfg, jax.random.key(1), scale=0.08), tok)

# tiny-llama with 4/2 heads: tp=2 splits kv heads, tp=4 replicates each twice.
# tiny-gemma2 (2/1 heads, SWA + soft caps + biasless): tp=2 replicates.
cases = {"llama": (model("tiny-llama", num_qo_heads=4, num_kv_heads=2),
                   (1, 2, 4)),
         "gemma2": (model("tiny-gemma2"), (1, 2))}
ps, b, n, mp = 8, 2, 21, 4
tables = layer_page_tables(
    jnp.asarray(np.random.default_rng(0).permutation(b * mp).reshape(b, mp)),
    2)
toks = jnp.arange(b * n, dtype=jnp.int32) * 7 % 250
plan = AttentionPlan.create(tables, jnp.array([0, n, 2 * n]),
                            jnp.array([n, n]), b * n)
for name, (m, tps) in cases.items():
  pool = jnp.zeros(m.cfg.pool_shape(b * mp, ps))
  expected, expected_pool = forward(m.params, m.cfg, toks, pool, plan)
  for tp in tps:
    mesh = parallel.make_mesh(tp)
    sm = parallel.shard_model(m, mesh)
    pool = jnp.zeros(sm.cfg.pool_shape(b * mp, ps))
    fn = jax.jit(lambda p, t, kv, pl: parallel.tp_forward(p, sm.cfg, t, kv, pl,
                                                       mesh),
                 donate_argnums=2)
    actual, actual_pool = fn(sm.params, toks, pool, plan)
    res["logits"][f"{name}/tp{tp}"] = float(jnp.max(jnp.abs(actual - expected)))
    # Replicated kv heads: copy j of head k sits at k * reps + j; take copy 0.
    reps = sm.cfg.num_kv_heads // m.cfg.num_kv_heads
    res["pool"][f"{name}/tp{tp}"] = float(jnp.max(jnp.abs(
        actual_pool[:, :, ::reps] - expected_pool)))
    res["sharding"][f"forward/{name}/tp{tp}"] = [
        spec(actual_pool),
        [list(s.data.shape) for s in actual_pool.addressable_shards]]

# The pallas kernels (interpret mode on CPU) per shard under shard_map.
m, _ = cases["llama"]
mesh = parallel.make_mesh(2)
sm = parallel.shard_model(m, mesh)
expected = forward(m.params, m.cfg, toks, jnp.zeros(m.cfg.pool_shape(b * mp, ps)),
                   plan)[0]
actual = jax.jit(lambda p, kv: parallel.tp_forward(p, sm.cfg, toks, kv, plan,
                                                   mesh, impl="pallas"))(
    sm.params, jnp.zeros(sm.cfg.pool_shape(b * mp, ps)))[0]
res["logits"]["llama/tp2/pallas"] = float(jnp.max(jnp.abs(actual - expected)))

# The engine: greedy, mixed prefill/decode steps and decode bursts.
m = cases["llama"][0]
prompts = [tok.encode(p) for p in ("hello world", "paged attention on", "a")]
sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
ec = EngineConfig(page_size=8, num_slots=32, max_seqs=4, max_num_tokens=32,
                  max_model_len=64, token_buckets=(32,))

class CompileNames(logging.Handler):  # jax_log_compiles -> program names
  def __init__(self):
    super().__init__()
    self.names = []
  def emit(self, record):
    found = re.match(r"Finished XLA compilation of (?:jit\()?(\w+)",
                     record.getMessage())
    if found:
      self.names.append(found.group(1))

# tp=1 under a mesh is covered by the logits above; tp=2 also runs decode
# bursts (decode_steps=4: the scan path), the others one step per call, and
# names the programs its construction compiles.
for tp in (None, 2, 4):
  handler = CompileNames()
  logging.getLogger("jax").addHandler(handler)
  jax.config.update("jax_log_compiles", tp == 2)
  e = Engine(m, dataclasses.replace(ec, decode_steps=4 if tp == 2 else 1),
             mesh=None if tp is None else parallel.make_mesh(tp))
  jax.config.update("jax_log_compiles", False)
  logging.getLogger("jax").removeHandler(handler)
  if tp == 2:
    res["construction_compiles"] = handler.names
  res["engine"][str(tp)] = e.generate(prompts, sp)
  if tp == 2:  # donated: the old pool is gone, the step aliases its shards
    e.add_request(prompts[0], SamplingParams(max_new_tokens=1))
    old_pool = e.pool
    e.step()
    hlo = e._lower(e.last_program).compile().as_text()
    shard_type = "f32[%s]" % ",".join(
        map(str, e.pool.addressable_shards[0].data.shape))
    res["donation"] = [old_pool.is_deleted(), "input_output_alias" in hlo,
                       not re.search(re.escape(shard_type) + r"[^\n]*\bcopy\(",
                                     hlo)]
  if tp == 2:  # the f32 model's all-reduces stay f32 (lowered, not run)
    res["collectives"] = {"lowered_f32": lowered_collectives(
        e._lower(ProgramKey("step", 32, False)).as_text())}
  if tp is not None:
    res["sharding"][f"engine/tp{tp}"] = [
        spec(e.pool),
        [list(s.data.shape) for s in e.pool.addressable_shards],
        spec(e.state.slot_refcount)]

# Sampled: on a mesh every device samples the gathered logits (shard_map),
# here with the floor kernel in interpret mode (impl="pallas"); the middle
# row is greedy (a step samples when any row does).
sampled = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9,
                         top_k=20, top_p=0.8, seed=3)
sps = [sampled, SamplingParams(max_new_tokens=6, ignore_eos=True), sampled]
res["sampled"] = {}
for tp in (None, 2):
  e = Engine(m, dataclasses.replace(ec, impl="pallas"),
             mesh=None if tp is None else parallel.make_mesh(tp))
  res["sampled"][str(tp)] = e.generate(prompts, sps)

# The collectives of a bf16 tp=2 step (compiled, not run). The
# lowered module shows the dtypes pkvattn asks for; the compiled one is what
# runs after SPMD partitioning (a resharding would add collectives there),
# but XLA's CPU backend computes a bf16 all-reduce in f32, so only its ops
# and shapes are checked there.
mb = Model("tiny-llama", m.cfg,
           init_params(m.cfg, jax.random.key(1), dtype=jnp.bfloat16,
                       scale=0.08), tok)
e = Engine(mb, ec, mesh=parallel.make_mesh(2))
low = e._lower(ProgramKey("step", 32, False))
compiled = low.compile().as_text()
res["collectives"].update(
    lowered_bf16=lowered_collectives(low.as_text()),
    compiled_bf16=compiled_collectives(compiled),
    gathers_bf16=compiled_gathers(compiled),
    vocab_size=mb.cfg.vocab_size,
    num_layers=mb.cfg.num_layers, hidden_size=mb.cfg.hidden_size,
    rows=ec.max_seqs)

# greedy_tokens (the engine's greedy programs on GPUs) vs jnp.argmax, with
# maxima tied across shards and within one, -inf rows and bf16 logits.
lg = np.array(jax.random.normal(jax.random.key(3), (6, 320)), np.float32)
lg[0, [250, 7, 90]] = 9.0   # tie across shards: the lowest index wins
lg[1, [5, 6]] = 9.0         # tie within a shard
lg[2, :] = -np.inf
lg[3, 319] = 1e30
res["greedy"] = {}
for tp in (2, 4):
  mesh = parallel.make_mesh(tp)
  for dt in ("float32", "bfloat16"):
    x = jnp.asarray(lg, dt)
    res["greedy"][f"tp{tp}/{dt}"] = [
        parallel.greedy_tokens(x, mesh).tolist(),
        jnp.argmax(x, -1).tolist()]

# row_parallel_dense on bf16 shards with a random bias: the all-reduce's
# dtype as asked, the bias added once after the sum, against float64.
from jax.sharding import PartitionSpec as P
from pkvattn.flax import row_parallel_dense
seed = int(np.random.SeedSequence().entropy % 2**32)
r = np.random.default_rng(seed)
x = jnp.asarray(r.standard_normal((64, 256)), jnp.bfloat16)
k = jnp.asarray(r.standard_normal((256, 96)) / 16, jnp.bfloat16)
bias = jnp.asarray(r.standard_normal(96), jnp.bfloat16)
f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
to_bf16 = lambda a: f64(jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16))
# The sum rounded to bf16 once, then the bias added (one more rounding).
expected = to_bf16(to_bf16(f64(x) @ f64(k)) + f64(bias))
res["row_parallel"] = {"seed": seed}
for red in ("float32", None):
  fn = jax.jit(parallel.shard_map(
      lambda p, x: row_parallel_dense(
          p, x, parallel.TP_AXIS, jnp.bfloat16,
          reduce_dtype=None if red is None else jnp.dtype(red)),
      mesh=parallel.make_mesh(2),
      in_specs=({"kernel": P(parallel.TP_AXIS, None), "bias": P()},
                P(None, parallel.TP_AXIS)), out_specs=P()))
  params = {"kernel": k, "bias": bias}
  y = fn(params, x)
  res["row_parallel"][str(red)] = {
      "dtype": str(y.dtype),
      "equal": float(np.mean(f64(y) == expected)),
      "max_err": float(np.max(np.abs(f64(y) - expected))),
      "collectives": lowered_collectives(fn.lower(params, x).as_text())}

# pmap: 2 independent groups of 2 equal-length prompts, vs the engine.
groups = np.array([[tok.encode("abcd"), tok.encode("wxyz")],
                   [tok.encode("1234"), tok.encode("hi!!")]], np.int32)
res["pmap"] = parallel.pmap_greedy_generate(
    m.params, m.cfg, groups, 6, page_size=8).tolist()
e = Engine(m, ec)
res["pmap_expected"] = e.generate(
    groups.reshape(4, -1).tolist(),
    SamplingParams(max_new_tokens=6, ignore_eos=True))

# The CLI: --tp 2 on the same 4 devices.
import contextlib, io
from pkvattn import cli
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
  res["cli_rc"] = cli.main(["--model", "tiny-llama", "--prompt",
                            "Hello, paged world", "--tp", "2",
                            "--max-new-tokens", "3", "--json", "--no-progress",
                            "--no-compile-cache"])
res["cli"] = json.loads(buf.getvalue())
print("RESULT" + json.dumps(res))
'''


@pytest.fixture(scope="module")
def results():
  return run_script(_SCRIPT)


def test_tp_logits_and_pool_match_one_device(results):
  assert set(results["logits"]) == {"llama/tp1", "llama/tp2", "llama/tp4",
                                    "gemma2/tp1", "gemma2/tp2",
                                    "llama/tp2/pallas"}
  for key, diff in results["logits"].items():
    assert diff < 1e-4, (key, diff)  # f32 logits of magnitude ~10
  for key, diff in results["pool"].items():
    assert diff < 1e-5, (key, diff)


def test_tp_engine_token_identical(results):
  expected = results["engine"]["None"]
  assert len(expected) == 3 and all(len(o) == 10 for o in expected)
  for tp in ("2", "4"):
    assert results["engine"][tp] == expected, tp


def test_tp_engine_construction_lays_out_weights_in_two_programs(results):
  """On a mesh, `Engine(...)` fuses (`parallel.shard_model`) and unstacks
  the weights in one program each, and allocates in a third; op by op it
  compiled one per weight shape. `_multi_slice` is JAX's own device_put
  onto the mesh, one per new array shape."""
  names = [n for n in results["construction_compiles"] if n != "_multi_slice"]
  assert names == ["_tp_projections", "_layer", "build"]


def test_tp_engine_samples_as_one_device(results):
  expected = results["sampled"]["None"]
  assert len(expected) == 3 and all(len(o) == 6 for o in expected)
  assert results["sampled"]["2"] == expected
  # The sampled rows sample (some token differs from the greedy run's);
  # the greedy row has the greedy run's tokens.
  greedy = [o[:6] for o in results["engine"]["None"]]
  assert [expected[0], expected[2]] != [greedy[0], greedy[2]]
  assert expected[1] == greedy[1]


def test_pool_is_sharded_on_kv_heads(results):
  sh = results["sharding"]
  # tiny llama 4/2 heads; pool [32 slots * 2 layers * 2, 8, kv, 64].
  kv_sharded = [None, None, "tp", None]
  spec, shards, state_spec = sh["engine/tp2"]
  assert spec == kv_sharded
  assert shards == [[128, 8, 1, 64]] * 2
  assert state_spec == [None]  # bookkeeping replicated
  spec, shards, _ = sh["engine/tp4"]  # kv heads replicated: 4 in all
  assert spec == kv_sharded
  assert shards == [[128, 8, 1, 64]] * 4
  spec, shards = sh["forward/gemma2/tp2"]
  assert spec == kv_sharded
  assert shards == [[32, 8, 1, 64]] * 2  # 8 slots * 2 layers * 2


def test_tp_step_donates_the_sharded_pool(results):
  deleted, aliased, no_copy = results["donation"]
  assert deleted and aliased and no_copy


def test_tp_step_collectives_in_the_activation_dtype(results):
  c = results["collectives"]
  layers, hidden, rows = c["num_layers"], c["hidden_size"], c["rows"]
  # Ideal: two all-reduces per layer (o_proj, down_proj) of [tokens, hidden]
  # in the model's dtype, and one all-gather: of the greedy (max, index)
  # words when every row is greedy, of the logits when some row samples (the
  # step's lax.cond picks). Lowered, the layer is one function called per
  # layer: its two sums.
  for dtype in ("bf16", "f32"):
    lowered = c[f"lowered_{dtype}"]
    assert [x for x in lowered if x[0] == "all_reduce"] == [
        ["all_reduce", f"tensor<32x{hidden}x{dtype}>"]] * 2, lowered
    assert [x for x in lowered if x[0] != "all_reduce"] == [
        ["all_gather", f"tensor<2x2x{rows}xi32>"]], lowered
  compiled = c["compiled_bf16"]
  reduces = [x for x in compiled if x[0] == "all-reduce"]
  assert len(reduces) == 2 * layers, compiled
  assert all(dims == [32, hidden] for _, _, dims in reduces), reduces
  others = [x for x in compiled if x[0] != "all-reduce"]
  assert sorted(others) == [["all-gather", "f32", [rows, c["vocab_size"]]],
                            ["all-gather", "s32", [2, 2, rows]]], others
  # The cond's false branch (every row greedy) gathers the words alone.
  assert sorted(c["gathers_bf16"]) == [["f32", [rows, c["vocab_size"]], 1],
                                       ["s32", [2, 2, rows], 0]]


def test_row_parallel_dense_reduce_dtype_and_bias(results):
  """A bf16 row-parallel layer: partials all-reduced in f32 where asked, in
  bf16 by default (the dtype shows in the program); either way the bias
  (random, replicated) is added once, after the sum. The f32 sum rounds
  once, so nearly every element equals the float64 sum rounded to bf16. The
  default's values are a rounding or two from it: equal almost everywhere
  with jaxlib 0.10.2 (XLA:CPU keeps the partials in f32), about three
  quarters of them with 0.11.2 (the partials rounded to bf16)."""
  rp = results["row_parallel"]
  seed = rp["seed"]
  for red, reduced in (("float32", "f32"), ("None", "bf16")):
    r = rp[red]
    assert r["dtype"] == "bfloat16", (seed, red, r)
    assert r["collectives"] == [["all_reduce", f"tensor<64x96x{reduced}>"]], \
        (seed, red, r["collectives"])
    # A bias subtracted or added per shard would miss by about |bias|.
    assert r["max_err"] <= 0.125, (seed, red, r)
  # f32 partial sums can flip a bf16 rounding, rarely.
  assert rp["float32"]["equal"] > 0.98, (seed, rp["float32"])


def test_greedy_tokens_match_argmax(results):
  assert len(results["greedy"]) == 4
  for key, (actual, expected) in results["greedy"].items():
    assert actual == expected, key
    assert actual[:2] == [7, 5], key


def test_pmap_loop_matches_engine(results):
  actual = [row for group in results["pmap"] for row in group]
  assert actual == results["pmap_expected"]


def test_cli_tp(results):
  assert results["cli_rc"] == 0
  assert results["cli"]["summary"]["tp"] == 2
  assert len(results["cli"]["outputs"][0]["token_ids"]) == 3


def test_cli_tp_too_many_devices(capsys):
  from pkvattn import cli
  with pytest.raises(SystemExit) as exc:
    cli.main(["--model", "tiny-llama", "--prompt", "a", "--tp", "999",
              "--no-progress"])
  assert exc.value.code == 2
  assert "error: argument --tp" in capsys.readouterr().err


def test_tp_config_errors():
  cfg = replace(TINY_CONFIGS["tiny-llama"], num_qo_heads=6, num_kv_heads=3)
  with pytest.raises(ValueError, match="num_kv_heads=3 must be divisible"):
    parallel.tp_config(cfg, 2)
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    parallel.tp_config(replace(cfg, num_qo_heads=12), 4)  # 4 > 3 kv heads
  with pytest.raises(ValueError, match="num_qo_heads"):
    parallel.tp_config(TINY_CONFIGS["tiny-llama"], 4)      # 2 q heads
  # tp > num_kv_heads, tp % num_kv_heads == 0: kv heads replicated.
  assert parallel.tp_config(TINY_CONFIGS["tiny-llama"], 2).num_kv_heads == 2
  assert parallel.shard_config(
      parallel.tp_config(TINY_CONFIGS["tiny-llama"], 2), 2).num_qo_heads == 1
  with pytest.raises(ValueError, match="Invalid tp"):
    parallel.make_mesh(len(__import__("jax").devices()) + 1)
