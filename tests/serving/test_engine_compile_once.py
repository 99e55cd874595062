"""Compile once: after `Engine.warmup()` no workload compiles anything.

Compilations are counted with a `jax.monitoring` listener on XLA's backend
compile event (`compile_events.count_compiles`); the last test proves the
counter sees a compile by forcing one.
"""

from __future__ import annotations

import dataclasses
import os
import time

import chex
import jax
import jax.monitoring
import memory_maps
import numpy as np
import pytest

from pkvattn import cache
from pkvattn.engine import Engine, EngineConfig, RequestStatus, SamplingParams
from pkvattn.models import decoder
from pkvattn.serving import compile_cache, compiler, programs
from compile_events import count_compiles

# Small pool (12 slots of 8 tokens for 4 rows of up to 64 tokens): claims are
# refused and decodes preempted; bursts of 4 decode steps.
CFG = EngineConfig(page_size=8, num_slots=12, max_seqs=4, max_num_tokens=32,
                   max_model_len=64, decode_steps=4, check=True)


def test_program_list_is_small_and_known():
  gpu = compiler.program_keys(dataclasses.replace(CFG, token_buckets=None))
  # The cache programs (the step of no tokens, reserve; greedy only),
  # buckets (4, 32), one program each, + 2 burst variants.
  assert len(gpu) == 6 and len(set(gpu)) == 6
  assert {k.num_tokens for k in gpu if k.kind == "step"} == {0, 4, 32}
  assert [k for k in gpu if compiler.is_cache_program(k)] == [
      compiler.ProgramKey("step", 0, True),
      compiler.ProgramKey("reserve", 0, True)]
  assert [k.greedy_only for k in gpu if k.kind == "step" and k.num_tokens] == [
      False, False]  # a step samples under its lax.cond
  cpu = compiler.program_keys(CFG, split_variants=False)
  assert [(k.kind, k.num_tokens) for k in cpu] == [
      ("step", 0), ("step", 4), ("step", 32), ("reserve", 0), ("burst", 4)]
  assert cpu[:4] == gpu[:4]  # only the burst splits
  no_burst = compiler.program_keys(dataclasses.replace(CFG, decode_steps=1))
  assert all(k.kind == "step" for k in no_burst) and len(no_burst) == 3
  # The default engine config of the benchmark workload stays under 16: its
  # bursts come in two row buckets, 64 and max_seqs.
  bench = EngineConfig(page_size=16, num_slots=8192, max_seqs=256,
                       max_num_tokens=4096, max_model_len=1024, decode_steps=8)
  keys = compiler.program_keys(bench)
  assert len(keys) == 8
  # Each call runs a model program and a cache program; the cache programs
  # are lowered last.
  step = compiler.ProgramKey("step", 4096, False)
  burst = compiler.ProgramKey("burst", 64, False)
  assert compiler.program_sequence(step) == (step, keys[0])
  assert compiler.program_sequence(burst) == (
      compiler.ProgramKey("reserve", 0, True), burst)
  assert compiler.program_sequence(keys[0]) == (keys[0],)
  # The model program's place in each sequence (None: a cache program alone).
  for key in keys:
    seq = compiler.program_sequence(key)
    at = compiler.model_position(key)
    assert [i for i, k in enumerate(seq)
            if k.kind in ("step", "burst") and k.num_tokens] == (
                [] if at is None else [at])
  assert sorted({k.num_tokens for k in keys if k.kind == "burst"}) == [64, 256]
  one = dataclasses.replace(bench, burst_rows=(256,))
  assert len(compiler.program_keys(one)) == 6
  assert [str(k) for k in keys[:2]] == ["step[no tokens]", "step[256 tokens]"]


def test_lowering_order_puts_the_longest_compiles_first():
  bench = EngineConfig(page_size=16, num_slots=8192, max_seqs=256,
                       max_num_tokens=4096, max_model_len=1024, decode_steps=8)
  keys = compiler.program_keys(bench)
  for given in (list(keys), list(reversed(keys))):
    order = compiler.lowering_order(given)
    assert sorted(order, key=keys.index) == list(keys)  # a permutation
    assert [(k.kind, k.num_tokens) for k in order] == (
        [("step", 4096)] + [("burst", 256)] * 2 + [("burst", 64)] * 2
        + [("step", 256), ("step", 0), ("reserve", 0)])
    # In each row bucket the sampled burst first (its compile is the
    # longer); the cache programs last.
    assert [k.greedy_only for k in order] == [False] + [False, True] * 2 + [
        False, True, True]
  assert compiler.lowering_order([]) == []


@pytest.mark.parametrize("split", [True, False])
def test_each_call_takes_its_program_and_jit(model, monkeypatch, split):
  """A step always takes its bucket's one program, a burst its greedy-only
  variant only where the variants are split (GPU backends), a cache program
  its greedy-only key; a burst's jit covers its row bucket, and the
  sampler's `lax.cond` is built in everywhere but split bursts (and
  `reserve`: the cache programs sample nothing either way)."""
  comp = Engine(model, CFG).compiler
  comp.split_variants = split
  Key = compiler.ProgramKey
  for greedy in (True, False):
    assert comp.key("step", 32, greedy) == Key("step", 32, False)
    assert comp.key("burst", 4, greedy) == Key("burst", 4, greedy and split)
    assert comp.key("step", 0, greedy) == Key("step", 0, True)
    assert comp.key("reserve", 0, greedy) == Key("reserve", 0, True)
  made = []
  monkeypatch.setattr(programs, "jitted_program",
                      lambda *args, **kw: made.append((args[3:], kw)))
  for key in (Key("step", 32, False), Key("step", 0, True),
              Key("reserve", 0, True), Key("burst", 4, True)):
    comp.jitted(key)
  cond = not split
  assert made == [
      (("step", False), dict(rows=None, sample_cond=True)),
      (("step_cache", True), dict(rows=None, sample_cond=True)),
      (("reserve", True), dict(rows=None, sample_cond=cond)),
      (("burst", True), dict(rows=4, sample_cond=cond))]


def _workload(rng, vocab, n):
  """Mixed lengths, a shared prefix for half the prompts, mixed sampling."""
  shared = rng.integers(1, vocab, 16).tolist()
  out = []
  for i in range(n):
    tail = rng.integers(1, vocab, int(rng.integers(1, 24))).tolist()
    prompt = (shared + tail) if i % 2 else tail
    sampled = rng.random() < 0.4
    stop = (tuple(int(t) for t in rng.integers(1, 256, programs.MAX_STOP_IDS))
            if rng.random() < 0.5 else None)
    sp = SamplingParams(
        max_new_tokens=int(rng.integers(1, 64 - len(prompt) + 1)),
        temperature=0.9 if sampled else 0.0, top_k=20 if sampled else 0,
        seed=i, stop_token_ids=stop)
    out.append((prompt, sp))
  return out


def test_no_compilation_after_warmup(model):
  engine = Engine(model, CFG)
  seen = []
  t0 = time.perf_counter()
  report = engine.warmup(progress=lambda key, s: seen.append((key, s)))
  wall = time.perf_counter() - t0
  assert set(report) == set(engine.programs())
  # The callback hears each program once, with its time; a program's
  # lowering is part of it, and every one fits in the warmup.
  assert sorted(seen, key=str) == sorted(report.items(), key=str)
  lower = engine.compiler.lower_times
  assert all(0 < lower[k] <= report[k] for k in lower)
  assert all(0 < t <= wall for t in report.values())
  assert 0 < engine.stats.warmup_time_s <= wall
  rng = np.random.default_rng(0)
  reqs = _workload(rng, model.cfg.vocab_size, 24)
  with count_compiles() as compiles:
    ids = []
    # Requests arrive in waves while others decode.
    for i, (prompt, sp) in enumerate(reqs):
      ids.append(engine.add_request(prompt, sp))
      if i % 5 == 4:
        for _ in range(int(rng.integers(1, 6))):
          engine.step()
    while engine.has_unfinished():
      engine.step()
  st = engine.stats
  assert compiles == [], f"{len(compiles)} compilations after warmup"
  # The workload did exercise what it claims to.
  assert st.num_preemptions > 0 and st.num_refused_claims > 0
  assert st.reused_tokens > 0
  reasons = {engine.get_request(i).finish_reason for i in ids}
  assert reasons == {"stop", "length"}
  assert all(len(engine.get_request(i).output) <= sp.max_new_tokens
             for i, (_, sp) in zip(ids, reqs))
  cache.validate(engine.state)
  # Decode bursts ran (their program was used).
  assert engine.last_program is not None


def test_engine_construction_compiles_two_programs(model):
  """`Engine(...)` lays out the weights in one program (called per layer)
  and allocates the pool, state and token rows in another, not a program
  per array shape; the layout is the one `fuse_projections` and
  `unstack_layers` give op by op."""
  jax.clear_caches()
  with count_compiles() as compiles:
    engine = Engine(model, CFG)
  assert len(compiles) == 2
  want = decoder.fuse_projections(decoder.unstack_layers(model.params))
  chex.assert_trees_all_equal(engine.model.params, want)
  state = cache.init_cache(engine.cache_config)
  chex.assert_trees_all_equal(engine.state, state)
  assert not np.asarray(engine.pool).any()
  assert not np.asarray(engine.seq_tokens).any()
  chex.assert_shape(engine.seq_tokens, (CFG.max_seqs, CFG.max_model_len))


def test_step_of_no_tokens_admits_without_a_forward(model):
  engine = Engine(model, dataclasses.replace(CFG, check=False))
  sp = SamplingParams(max_new_tokens=3)
  rid = engine.add_request([256, 1, 2, 3, 4, 5], sp)
  engine.step()  # the admission alone: nothing is computed yet
  key = engine.last_program
  assert key.kind == "step" and key.num_tokens == 0
  req = engine.get_request(rid)
  assert req.status is RequestStatus.PREFILL and req.output == []
  assert int(engine.state.seq_lens[req.seq_id]) == 6  # the claim settled
  # Its program holds no matmul (the model does not run); a bucket's does.
  assert "dot_general" not in engine._lower(key).as_text()  # noqa: SLF001
  fed = engine.compiler.key("step", 32, True)
  assert "dot_general" in engine._lower(fed).as_text()  # noqa: SLF001
  while engine.has_unfinished():
    engine.step()
  assert len(req.output) == 3  # (outputs: the parity tests, test_models_hf)


def test_cache_programs_hold_the_cache_ops_and_no_model(model):
  """The cache programs hold no matmul, the model programs do. The burst's
  reservation has no conditional: the host dispatches it and the burst
  without waiting for the burst in flight."""
  engine = Engine(model, dataclasses.replace(CFG, check=False))
  texts = {str(k): engine._lower(k).as_text()  # noqa: SLF001
           for k in engine.programs()}
  for name, text in texts.items():
    cache_program = name in ("step[no tokens]", "reserve")
    assert ("dot_general" in text) != cache_program, name
  assert "stablehlo.case" not in texts["reserve"]
  assert "stablehlo.case" in texts["step[no tokens]"]  # the eviction cond
  # A model program's state comes back as it went in.
  fed = engine.compiler.key("step", 32, True)
  hlo = engine._lower(fed).compile().as_text()  # noqa: SLF001
  assert "input_output_alias" in hlo


def test_counter_sees_a_forced_compile(model):
  engine = Engine(model, CFG)
  engine.warmup()
  # Forget one program everywhere: its next use must compile and be counted.
  key = engine.programs()[0]
  del engine.compiler.compiled[key]
  compiler.clear_compiled()
  jax.clear_caches()
  t0 = time.perf_counter()
  with count_compiles() as compiles:
    engine.generate([[256, 1, 2]], SamplingParams(max_new_tokens=1))
  wall = time.perf_counter() - t0
  assert len(compiles) >= 1
  assert engine.stats.num_compiles == len(engine.programs()) + 1
  # Its lowering and compile are timed within the call.
  times = engine.compiler.compile_times
  assert 0 < engine.compiler.lower_times[key] <= times[key] <= wall


def test_persistent_cache_serves_a_new_engine(model, tmp_path):
  """A later engine of the same model and config loads every program from
  `compile_cache_dir` (nothing traced, lowered or compiled, the same
  tokens); with the saved programs unreadable it lowers them again and
  JAX's persistent cache in the same directory serves their compiles."""
  hits = []

  def listener(name, **kwargs):
    del kwargs
    if name == "/jax/compilation_cache/cache_hits":
      hits.append(name)
  old_dir = jax.config.jax_compilation_cache_dir
  cfg = dataclasses.replace(CFG, max_seqs=2, max_num_tokens=16, decode_steps=1,
                            check=False,
                            compile_cache_dir=str(tmp_path / "xla"))
  prompts = [[256, 1, 2, 3], [256, 7]]
  sp = SamplingParams(max_new_tokens=5, ignore_eos=True)

  def fresh_engine():
    # Nothing compiled earlier in this process may serve it.
    compiler.clear_compiled()
    jax.clear_caches()
    engine = Engine(model, cfg)
    with count_compiles() as compiles:
      engine.warmup()
    return engine, compiles

  jax.monitoring.register_event_listener(listener)
  try:
    first, _ = fresh_engine()
    want = first.generate(prompts, sp)
    saved = sorted((tmp_path / "xla" / compile_cache.PROGRAMS_SUBDIR).iterdir())
    assert len(saved) == len(first.programs()) == len(first.lower_times)
    second, compiles = fresh_engine()
    assert compiles == [] and second.lower_times == {}
    assert second.stats.num_compiles == len(second.programs())
    assert second.generate(prompts, sp) == want
    for path in saved:  # unreadable: lowered again, compiled from JAX's cache
      path.write_bytes(path.read_bytes()[:100])
    hits.clear()
    third, _ = fresh_engine()
    assert len(third.lower_times) == len(third.programs())
    assert len(hits) >= len(third.programs())
    assert third.generate(prompts, sp) == want
    # The programs JAX's cache served are not saved again (one that JAX
    # deserialized does not serialize whole on XLA:CPU): a fourth engine
    # lowers them again and runs them.
    assert all(p.stat().st_size == 100 for p in saved)
    fourth, _ = fresh_engine()
    assert len(fourth.lower_times) == len(fourth.programs())
    assert fourth.generate(prompts, sp) == want
  finally:
    jax.monitoring.unregister_event_listener(listener)
    jax.config.update("jax_compilation_cache_dir", old_dir)
    compile_cache.reset()
    compiler.clear_compiled()


def test_saved_programs_keep_the_most_recently_used(tmp_path):
  for i in range(5):
    path = tmp_path / f"{i}.pkl"
    path.write_bytes(b"x")
    os.utime(path, ns=(i * 10**9, i * 10**9))
  os.utime(tmp_path / "1.pkl")  # used now
  compile_cache.prune_programs(str(tmp_path), keep=2)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1.pkl", "4.pkl"]


def test_saved_program_digest_covers_code_config_and_flags(monkeypatch):
  base = compile_cache.program_digest("model", "config")
  assert compile_cache.program_digest("model", "config") == base
  assert compile_cache.program_digest("model", "config2") != base
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
  flagged = compile_cache.program_digest("model", "config")
  assert flagged != base
  monkeypatch.setattr(compile_cache, "source_digest", lambda: "edited")
  assert compile_cache.program_digest("model", "config") != flagged


def test_gpu_compiler_options_are_valid_xla_options(monkeypatch):
  # XLA parses every option when it compiles, on any backend: a misspelt
  # field or enum value (a command buffer type) fails here, not on a GPU.
  import jax.numpy as jnp
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  options = programs.compiler_options()
  monkeypatch.undo()
  assert "WHILE" in options["xla_gpu_enable_command_buffer"].split(",")
  x = jnp.arange(3.0)
  out = jax.jit(lambda v: v + 1, compiler_options=options).lower(x).compile()(x)
  np.testing.assert_array_equal(np.asarray(out), np.arange(3.0) + 1)
  bad = dict(options, xla_gpu_enable_command_buffer="FUSION,WHILEX")
  with pytest.raises(Exception, match="WHILEX"):
    jax.jit(lambda v: v + 2, compiler_options=bad).lower(x).compile()


@pytest.mark.skipif(jax.default_backend() != "cpu" or memory_maps.count() is None,
                    reason="XLA:CPU's maps, read from /proc")
def test_released_executables_unmap_their_memory(model):
  # tests/conftest keeps each worker under Linux's cap on memory maps by
  # releasing the executables it keeps: that works only if nothing else
  # (the engine's per-process executables, jax's caches) still holds them.
  memory_maps.release_executables()
  before = memory_maps.count()
  # Shapes no other test compiles; two programs (no bursts, one bucket).
  engine = Engine(model, dataclasses.replace(
      CFG, max_seqs=3, check=False, decode_steps=1, token_buckets=(32,)))
  engine.warmup()
  assert len(engine.programs()) == 2
  grown = memory_maps.count() - before
  assert grown > 100 * len(engine.programs())
  del engine
  memory_maps.release_executables()
  assert memory_maps.count() - before < grown // 4
