"""`Engine.profile`: where the time of one engine step goes (GPU runs).

Each piece is timed alone on copies of the engine's state, so profiling
changes nothing in the engine.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from pkvattn import _kv
from pkvattn import attention as _attention
from pkvattn import cache as _cache
from pkvattn.models import decoder as _decoder
from pkvattn.serving import programs as _programs


def copy_tree(tree):
  """Fresh device copies of every array of `tree` (for donating calls)."""
  return jax.tree.map(jnp.copy, tree)


def profile_programs(engine) -> dict:
  """The programs `profile` times, on copies of the current state.

  Keys: `step` (jitted step or burst) with `step_args()` / `bare_args()`
  (the latter adds precomputed page tables: no cache op runs), `per` (steps
  per call), `cache_ops` (jitted, donating: the step's cache ops alone) with
  `cache_ops_args()`, `attention_inputs` (a `StepInputs` of the step).

  Raises:
    ValueError: nothing to profile yet (no step run, no burst pending, or
      the last step fed no token).
  """
  cfg, mcfg = engine.config, engine.model.cfg
  L, S, k = mcfg.num_layers, cfg.max_seqs, cfg.decode_steps
  if engine.scheduler.burst_eligible():
    # `Scheduler.schedule` admits nothing in this state (it may release
    # finished rows, which attention ignores): its inputs are one decode step
    # of the current batch (for attention).
    attention_inputs = engine.scheduler.schedule().inputs
    rows = engine.scheduler.burst_rows()
    fn = engine.compiler.jitted(engine.compiler.key(
        "burst", rows, engine.scheduler.burst_greedy()))
    binp = jax.tree.map(jnp.asarray, engine.scheduler.burst_inputs())
    ids = jnp.where(binp.active, jnp.arange(S, dtype=jnp.int32), -1)
    # Tables that already hold the burst's new blocks (timing only).
    grown, _ = _cache.extend(engine.state, ids, jnp.full((S,), k, jnp.int32))
    tables = _programs.layer_tables(grown, L, S)
    args = lambda: (engine.model.params, copy_tree(engine.pool), copy_tree(engine.state),
                    copy_tree(engine.seq_tokens), binp)
    seq_tokens = engine.seq_tokens

    def cache_ops(state):  # as the burst does, once
      return _programs.reserve_burst(state, seq_tokens, binp, num_layers=L,
                                     decode_steps=k,
                                     commit=cfg.enable_prefix_reuse)
    per = k
  elif engine.last_inputs is None:
    raise ValueError("Invalid call: profile() needs at least one step() first")
  elif not engine.last_inputs.tokens.shape[0]:
    raise ValueError("Invalid call: profile() times a step that feeds "
                     "tokens; the last step fed none (it only admitted, "
                     "published or released): step() again first")
  else:
    attention_inputs = engine.last_inputs
    inp = jax.tree.map(jnp.asarray, engine.last_inputs)
    fn = engine.compiler.jitted(engine.last_program)
    tables = _programs.layer_tables(engine.state, L, S)
    args = lambda: (engine.model.params, copy_tree(engine.pool), copy_tree(engine.state),
                    copy_tree(engine.seq_tokens), inp)
    seq_tokens = engine.seq_tokens

    def cache_ops(state):  # as the step does, around its forward
      t = _programs.layer_tables(state, L, S)
      state, ext, claim = _programs.cache_ops_after(
          state, seq_tokens, inp, commit=cfg.enable_prefix_reuse,
          finished=_programs.finished_tokens(seq_tokens, inp))
      return state, t, ext.ok, claim.ok
    per = 1
  return dict(step=fn, step_args=args, bare_args=lambda: args() + (tables,),
              per=per, cache_ops=jax.jit(cache_ops, donate_argnums=0),
              cache_ops_args=lambda: (copy_tree(engine.state),),
              attention_inputs=jax.tree.map(jnp.asarray, attention_inputs))


def profile(engine, iters: int = 10) -> dict:
  """Times the pieces of the next step on copies of the state (GPU runs).

  While the engine decodes in bursts (`decode_steps > 1`) the step profiled
  is one decode iteration of the current batch inside a burst (burst time /
  `decode_steps`); otherwise the last step.

  Returns milliseconds per step:
    * `step_ms`: the jitted step (or burst iteration) as the engine runs it;
    * `bookkeeping_ms`: what the cache ops add to it: `step_ms` minus the
      same program with the cache ops removed (page tables precomputed; no
      commit / release / extend / claim);
    * `bookkeeping_in_jit_ms`: the cache ops alone (page tables + commit /
      release / extend / claim; in a burst, its one `extend` + page tables,
      divided by `decode_steps`) in one jit on a donated state, less the
      time of a trivial jitted call (the dispatch floor), per step;
    * `attention_ms`: every layer's `paged_prefill` on the step's plan (q
      of ones in the model's compute dtype; FP8 pages with unit scales,
      which the kernels' time does not depend on), alone;
    * `rest_ms = step_ms - attention_ms - bookkeeping_ms` (projections,
      MLP, RoPE + append, sampling).
  Nothing here changes the engine's state.

  Raises:
    NotImplementedError: the engine runs on a mesh (the split times
      single-device pieces only).
    ValueError: nothing to profile yet (no step run, no burst pending, or
      the last step fed no token).
  """
  if engine.config.check:
    raise ValueError("Invalid call: profile() times unchecked programs; got an "
                     "engine with EngineConfig(check=True)")
  if engine.mesh is not None:
    raise NotImplementedError(
        "Engine.profile() times a single-device step; got an engine with a "
        "mesh")
  prog = profile_programs(engine)
  cfg, mcfg = engine.config, engine.model.cfg
  L, S = mcfg.num_layers, cfg.max_seqs
  inp = prog["attention_inputs"]

  def timed(fn, make_args, per=1):
    jax.block_until_ready(fn(*make_args()))
    times = []
    for _ in range(iters):
      args = jax.block_until_ready(make_args())
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append((time.perf_counter() - t0) * 1e3 / per)
    return float(np.median(times))

  per = prog["per"]
  step_ms = timed(prog["step"], prog["step_args"], per=per)
  bare_ms = timed(prog["step"], prog["bare_args"], per=per)

  dtype = engine.model.params["embed"].dtype   # the compute dtype

  def attention_only(pool, state, inp):
    if pool.dtype == jnp.uint8:  # FP8 pages held as bytes (XLA path)
      pool = _kv.from_bytes(pool)
    tables = _programs.layer_tables(state, L, S)
    q = jnp.ones((inp.tokens.shape[0], mcfg.num_qo_heads, mcfg.head_dim),
                 dtype)
    scales = {}
    if pool.dtype == _kv.FP8_DTYPE:
      scales = dict(k_scale=jnp.float32(1.0), v_scale=jnp.float32(1.0))
    acc = jnp.zeros((), jnp.float32)
    kernel_plan = None
    if _decoder._uses_pallas(cfg.impl):  # as the model does: one plan a step
      kernel_plan = _attention.plan_prefill(
          inp.q_indptr, inp.kv_lens, num_tokens=q.shape[0],
          num_qo_heads=mcfg.num_qo_heads, num_kv_heads=mcfg.num_kv_heads,
          head_dim=mcfg.head_dim, dtype=dtype,
          window_left=max(mcfg.windows))
    for layer in range(L):
      spec = mcfg.attention_spec(layer)
      o = _attention.paged_prefill(
          q, pool, tables[layer], inp.q_indptr, inp.kv_lens,
          sm_scale=spec.sm_scale, window_left=spec.window_left,
          logits_soft_cap=spec.logits_soft_cap, impl=cfg.impl,
          plan=kernel_plan, **scales)
      acc = acc + o[0, 0, 0].astype(jnp.float32)
      q = q + o * 0  # keep the layers sequential, as in the model
    return acc

  floor = timed(jax.jit(lambda st: st.seq_lens + 1, donate_argnums=0),
                lambda: (copy_tree(engine.state),))
  ops = timed(prog["cache_ops"], prog["cache_ops_args"])
  result = {
      "step_ms": step_ms,
      "bookkeeping_ms": max(step_ms - bare_ms, 0.0),
      "bookkeeping_in_jit_ms": max(ops - floor, 0.0) / per,
      "attention_ms": timed(jax.jit(attention_only), lambda: (
          engine.pool, engine.state, inp)),
  }
  result["rest_ms"] = (result["step_ms"] - result["attention_ms"]
                       - result["bookkeeping_ms"])
  return result
