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
from pkvattn.models import decoder as _decoder
from pkvattn.serving import programs as _programs
from pkvattn.serving.compiler import model_position
from pkvattn.serving.compiler import program_inputs


def copy_tree(tree):
  """Fresh device copies of every array of `tree` (for donating calls)."""
  return jax.tree.map(jnp.copy, tree)


def profile_programs(engine) -> dict:
  """The programs `profile` times, on copies of the current state.

  Keys: `step`, a call as the engine runs it (its model and cache programs
  in order, `Compiler.sequence`), with `step_args()`; `model`, the model
  program alone, with `model_args()` (a burst's on the state its cache
  program leaves); `cache_ops`, the cache program alone, with
  `cache_ops_args()`; `per` (steps per call); `attention_inputs` (a
  `StepInputs` of the step). Every program is the engine's compiled one.

  Raises:
    ValueError: nothing to profile yet (no step run, no burst pending, or
      the last step fed no token).
  """
  if engine.scheduler.burst_eligible():
    # `Scheduler.schedule` admits nothing in this state (it may release
    # finished rows, which attention ignores): its inputs are one decode step
    # of the current batch (for attention).
    attention_inputs = engine.scheduler.schedule().inputs
    key = engine.compiler.key("burst", engine.scheduler.burst_rows(),
                              engine.scheduler.burst_greedy())
    inp = jax.tree.map(jnp.asarray, engine.scheduler.burst_inputs())
    per = engine.config.decode_steps
  elif engine.last_inputs is None:
    raise ValueError("Invalid call: profile() needs at least one step() first")
  elif not engine.last_inputs.tokens.shape[0]:
    raise ValueError("Invalid call: profile() times a step that feeds "
                     "tokens; the last step fed none (it only admitted, "
                     "published or released): step() again first")
  else:
    attention_inputs = engine.last_inputs
    key = engine.last_program
    inp = jax.tree.map(jnp.asarray, engine.last_inputs)
    per = 1
  buffers = engine._buffers()  # noqa: SLF001
  keys = engine.compiler.sequence(key)
  fns = [engine.compiler.program(k, buffers) for k in keys]
  model_at = model_position(key)
  cache_at = 1 - model_at
  params = engine.model.params

  def args(state=None):
    state = engine.state if state is None else state
    return (params, copy_tree(engine.pool), copy_tree(state),
            copy_tree(engine.seq_tokens), inp)

  inputs = [program_inputs(k, inp) for k in keys]

  def call(params, pool, state, seq_tokens, _):
    for fn, x in zip(fns, inputs):
      pool, state, seq_tokens, out = fn(params, pool, state, seq_tokens, x)
    return pool, state, seq_tokens, out

  def cache_args():
    return args()[:4] + (inputs[cache_at],)

  model_state = engine.state
  if model_at == 1:  # the burst runs on the state its reservation leaves
    model_state = jax.block_until_ready(fns[0](*args())[1])
  return dict(step=call, step_args=args, per=per,
              model=fns[model_at], model_args=lambda: args(model_state),
              cache_ops=fns[cache_at], cache_ops_args=cache_args,
              attention_inputs=jax.tree.map(jnp.asarray, attention_inputs))


def profile(engine, iters: int = 10) -> dict:
  """Times the pieces of the next step on copies of the state (GPU runs).

  While the engine decodes in bursts (`decode_steps > 1`) the step profiled
  is one decode iteration of the current batch inside a burst (burst time /
  `decode_steps`); otherwise the last step.

  Returns milliseconds per step:
    * `step_ms`: the jitted step (or burst iteration) as the engine runs it;
    * `bookkeeping_ms`: what the cache program adds to it: `step_ms` minus
      the model program alone;
    * `bookkeeping_in_jit_ms`: the cache program alone (commit / release /
      extend / claim; in a burst, its publish / release and one `extend`,
      divided by `decode_steps`) on a donated state, less the time of a
      trivial jitted call (the dispatch floor), per step;
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
  bare_ms = timed(prog["model"], prog["model_args"], per=per)

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
