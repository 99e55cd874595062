"""Tensor-parallel and data-parallel scaling: tp = 1, 2, 4 and engine replicas.

Three modes, one script (random weights of real models' shapes:
`bench/common/models.py`; `impl` defaults to pallas on GPU, xla elsewhere):

* **engine** (default for `--model llama3.2-1b`): `pkvattn.engine.Engine`
  on one device and on `make_mesh(tp)` for each `--tp`, the same greedy
  workload (16 prompts of 512 tokens, 64 new tokens, EOS ignored); each
  engine runs it twice and the second run is reported. Prefill tokens/s =
  prompt tokens / wall time of steps that carried prefill; decode tokens/s
  = decode tokens / wall time of decode-only steps (host work included).
  Correctness first: one-step prefill logits, tp vs one device.

* **grid** (default for `--model llama3-8b`): the model's step programs as
  the engine lays them out (`serving.runner.prepare_model`: unstacked
  layers, fused projections, sharded heads / MLP / LM head / pool), timed
  without the engine's bookkeeping, for every tp in `--tp` (default the
  ones of 1, 2, 4 the machine has) in one run:
  - correctness first: the greedy tokens of a 2-layer f32 copy of the shape
    through the Engine (prefill + decode bursts, full-precision matmuls)
    must be identical at every tp;
  - decode: one greedy step of `rows` sequences at `context` tokens each
    (the pool's contents do not change the speed: it is left zeros and the
    lengths are set, so no prefill is timed or needed), back to back with
    the pool donated (`timing.pipelined_ms`); tokens/s = rows / step time.
    Cells that do not fit a device's memory are reported as skipped;
  - time per output token of one request: the decode step at 1 row;
  - prefill: 8 prompts of 2,048 tokens in one step, tokens/s;
  - collectives: one decode step per tp under `jax.profiler`; the NCCL
    kernels' time per step (all-reduce, all-gather, ...), beside the ideal
    from the compiled program's collectives: the bytes a ring moves per
    device (all-reduce 2 (tp-1)/tp x size, all-gather (tp-1)/tp x size)
    over `--link-gbps` (default 450 GB/s: H100 SXM NVLink 4, 18 links x 25
    GB/s per direction). Kernel times include waiting for the slowest peer.
  `speedup_vs_tp1` = tokens/s over tp=1's in the same cell.

* **replicas** (`--replicas N`): throughput of N data-parallel engines (one
  per device, `parallel.replica_meshes`, one thread each:
  `parallel.generate_on_replicas`) against one engine and against one
  engine at tp=N, on the same requests (`--model` either shape).

`--quick` trims the grid (1k contexts only, fewer timing samples; about 6
minutes for tp = 1, 2, 4 of the 8B shape on 4 H100s); `--small` runs a tiny
model on forced host CPU devices (a smoke run). Writes
`<out>/tp_<mode>_<model>_<device>.json`; prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# H100 SXM NVLink 4: 18 links x 25 GB/s per direction.
DEFAULT_LINK_GBPS = 450.0


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


def _parse(argv):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", choices=("llama3.2-1b", "llama3-8b"),
                  default="llama3.2-1b", help="the shape (random weights)")
  ap.add_argument("--mode", choices=("engine", "grid"), default=None,
                  help="default: engine for llama3.2-1b, grid for llama3-8b")
  ap.add_argument("--small", action="store_true",
                  help="tiny model and workload on forced CPU devices")
  ap.add_argument("--quick", action="store_true",
                  help="grid: 1k contexts only, fewer samples")
  ap.add_argument("--tp", type=_ints, default=None,
                  help="comma-separated tp sizes, e.g. 1,2,4 (tp=1 always "
                  "runs as the baseline); default: 2 in engine mode, the "
                  "ones of 1,2,4 the machine has in grid mode")
  ap.add_argument("--replicas", type=int, default=0,
                  help="N > 1: N one-device engines vs one engine vs tp=N")
  ap.add_argument("--out", default="bench/results",
                  help="results folder (default bench/results)")
  ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                  help="default: float32 on CPU, bfloat16 on GPU")
  ap.add_argument("--impl", choices=("pallas", "xla"), default=None,
                  help="default: pallas on GPU, xla elsewhere")
  ap.add_argument("--rows", type=_ints, default=None,
                  help="grid: decode rows (default 64,256)")
  ap.add_argument("--contexts", type=_ints, default=None,
                  help="grid: decode contexts (default 1024,4096; --quick "
                  "1024)")
  ap.add_argument("--prefill", default=None,
                  help="grid: PROMPTSxLEN of the prefill step (default 8x2048; "
                  "0x0: none)")
  ap.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS,
                  help="grid: link bandwidth per direction for the ideal "
                  f"collective time, GB/s (default {DEFAULT_LINK_GBPS:g}, "
                  "H100 SXM NVLink 4)")
  ap.add_argument("--no-check", action="store_true",
                  help="grid: skip the f32 token-identity check")
  ap.add_argument("--no-profile", action="store_true",
                  help="grid: skip the collective profile")
  ap.add_argument("--num-prompts", type=int, default=None)
  ap.add_argument("--prompt-len", type=int, default=None)
  ap.add_argument("--new-tokens", type=int, default=None)
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--max-num-tokens", type=int, default=None)
  ap.add_argument("--decode-steps", type=int, default=None)
  return ap.parse_args(argv)


def _devices_needed(args) -> int:
  tps = args.tp or ([2] if (args.mode or _default_mode(args)) == "engine"
                    else [1, 2])
  return max([2, *tps, args.replicas])


def _default_mode(args) -> str:
  return "grid" if args.model == "llama3-8b" else "engine"


def main(argv=None):
  args = _parse(argv)
  args.mode = args.mode or _default_mode(args)
  if args.small and "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    # Read when the backend starts (below), so setting it here is enough.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count="
                               f"{_devices_needed(args)}").strip()

  import jax
  import jax.numpy as jnp

  from bench.common import results
  from bench.common import timing as _timing
  from bench.common.models import SHAPES, SMALL

  env = results.environment()
  ndev = len(jax.devices())
  mcfg = SMALL if args.small else SHAPES[args.model]
  dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  if args.dtype is not None:
    dtype = jnp.dtype(args.dtype)
  if args.replicas:
    if args.replicas < 2 or args.replicas > ndev:
      sys.exit(f"--replicas must be in [2, {ndev}] (devices), got "
               f"{args.replicas}")
    tps = [1]
  elif args.tp is None:
    tps = [1, 2] if args.mode == "engine" else [t for t in (1, 2, 4)
                                                 if t <= ndev]
  else:
    tps = sorted({1, *args.tp})
  if max(tps) > ndev:
    sys.exit(f"need {max(tps)} devices, found {ndev}")
  name = "small" if args.small else args.model
  impl = args.impl or ("pallas" if jax.default_backend() == "gpu" else "xla")
  ctx = dict(args=args, mcfg=mcfg, dtype=dtype, impl=impl, tps=tps,
             name=name)
  if args.replicas:
    rows, extra, cols = _run_replicas(**ctx)
    mode = f"replicas{args.replicas}"
  elif args.mode == "engine":
    rows, extra, cols = _run_engine(**ctx)
    mode = "engine"
  else:
    rows, extra, cols = _run_grid(**ctx)
    mode = "grid"
  extra = dict(model=name, dtype=str(jnp.dtype(dtype)), impl=impl, tps=tps,
               quick=args.quick, **extra,
               model_config=dataclasses.asdict(mcfg) | {"rope": str(mcfg.rope)})
  fname = f"tp_{mode}_{name}"
  if jnp.dtype(dtype) == jnp.float32 and jax.default_backend() != "cpu":
    fname += "_f32"
  fname += f"_{results.device_tag()}"
  for path in results.write(fname, rows, out=args.out, extra=extra, env=env):
    print("wrote", path)
  _timing.print_table(rows, cols)


# ------------------------------------------------------------------ engine
def _workload(args, mcfg, small):
  import numpy as np
  num_prompts = args.num_prompts or (4 if small else 16)
  prompt_len = args.prompt_len or (48 if small else 512)
  new_tokens = args.new_tokens or (16 if small else 64)
  rng = np.random.default_rng(0)
  prompts = [[mcfg.bos_token_id % mcfg.vocab_size]
             + rng.integers(0, mcfg.vocab_size, prompt_len - 1).tolist()
             for _ in range(num_prompts)]
  return prompts, new_tokens


def _engine_config(args, num_prompts, prompt_len, new_tokens, small):
  from pkvattn.engine import EngineConfig
  blocks = -(-(prompt_len + new_tokens) // args.page_size)
  budget = args.max_num_tokens or (64 if small else 2048)
  return EngineConfig(
      page_size=args.page_size, num_slots=num_prompts * blocks + 8,
      max_seqs=num_prompts, max_num_tokens=max(budget, num_prompts),
      max_model_len=blocks * args.page_size, impl=args.impl,
      enable_prefix_reuse=False,
      decode_steps=args.decode_steps or (4 if small else 8),
      token_buckets=(max(budget, num_prompts),))


def _timed_generate(run, engines):
  """Runs `run()` twice (the first compiles); returns (outputs, wall s of
  the second, wall s of the first, each engine's EngineStats of the
  second)."""
  t0 = time.perf_counter()
  run()
  first = time.perf_counter() - t0
  # The scheduler and compiler hold the engine's stats object: difference
  # its counters rather than replace it.
  before = [dataclasses.asdict(e.stats) for e in engines]
  t0 = time.perf_counter()
  outs = run()
  wall = time.perf_counter() - t0
  stats = []
  for e, b in zip(engines, before):
    st = dataclasses.replace(e.stats)
    for k, v in dataclasses.asdict(e.stats).items():
      if isinstance(v, (int, float)) and not isinstance(v, bool):
        setattr(st, k, v - b[k])
    stats.append(st)
  return outs, wall, first, stats


def _run_engine(*, args, mcfg, dtype, impl, tps, name):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pkvattn import parallel
  from pkvattn.engine import Engine, SamplingParams
  from pkvattn.flax import AttentionPlan, layer_page_tables
  from pkvattn.models import Model, forward, init_params

  params = init_params(mcfg, jax.random.key(0), dtype, scale=0.02)
  model = Model(name, mcfg, params, None)
  prompts, new_tokens = _workload(args, mcfg, args.small)
  prompt_len = len(prompts[0])

  # --- correctness: one-step prefill logits, tp=N vs one device.
  lens = [len(p) for p in prompts[:2]]
  max_pages = -(-max(lens) // args.page_size)
  slot_table = np.arange(2 * max_pages, dtype=np.int32).reshape(2, max_pages)
  q_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  plan = AttentionPlan.create(
      layer_page_tables(jnp.asarray(slot_table), mcfg.num_layers), q_indptr,
      np.asarray(lens, np.int32), int(q_indptr[-1]))
  tokens = jnp.asarray(np.concatenate(prompts[:2]), jnp.int32)
  last = jnp.asarray(q_indptr[1:] - 1)

  def prefill_logits(m, mesh):
    pool = jnp.zeros(m.cfg.pool_shape(slot_table.size, args.page_size), dtype)
    if mesh is None:
      fn = jax.jit(lambda p, kv: forward(p, m.cfg, tokens, kv, plan,
                                         logits_indices=last, impl=args.impl))
    else:
      fn = jax.jit(lambda p, kv: parallel.tp_forward(
          p, m.cfg, tokens, kv, plan, mesh, logits_indices=last,
          impl=args.impl))
    return np.asarray(fn(m.params, pool)[0], np.float32)

  expected = prefill_logits(model, None)
  checks = {}
  for tp in tps[1:]:
    mesh = parallel.make_mesh(tp)
    actual = prefill_logits(parallel.shard_model(model, mesh), mesh)
    checks[f"tp{tp}"] = dict(
        prefill_logits_max_abs_diff=float(np.max(np.abs(actual - expected))),
        prefill_logits_max_abs=float(np.max(np.abs(expected))),
        prefill_argmax_equal=bool(
            (actual.argmax(-1) == expected.argmax(-1)).all()))
  print("checks:", checks, flush=True)

  cfg = _engine_config(args, len(prompts), prompt_len, new_tokens, args.small)
  sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
  rows, outputs = [], {}
  for tp in tps:
    engine = Engine(model, cfg, mesh=None if tp == 1 else parallel.make_mesh(tp))
    outs, wall, first, (st,) = _timed_generate(
        lambda: engine.generate(prompts, sp), [engine])
    outputs[tp] = outs
    rows.append(dict(
        tp=tp, impl=impl, num_prompts=len(prompts), prompt_len=prompt_len,
        new_tokens=new_tokens, steps=st.num_steps,
        prefill_tokens=st.prefill_tokens, decode_tokens=st.decode_tokens,
        prefill_tok_s=st.prefill_tokens_per_s,
        decode_tok_s=st.decode_tokens_per_s,
        prefill_time_s=st.prefill_time_s, decode_time_s=st.decode_time_s,
        host_time_s=st.host_time_s, wall_s=wall, first_run_s=first,
        pool_sharding=str(engine.pool.sharding.spec) if tp > 1 else "one device"))
    print(f"[tp={tp}] prefill {rows[-1]['prefill_tok_s']:,.0f} tok/s, decode "
          f"{rows[-1]['decode_tok_s']:,.0f} tok/s (first run incl. compile "
          f"{first:.1f} s)", flush=True)
    del engine
    gc.collect()

  agreement = {}
  for r in rows:
    a, b = outputs[1], outputs[r["tp"]]
    r["identical_sequences_frac"] = float(np.mean([x == y for x, y in zip(a, b)]))
    r["token_agreement"] = float(np.mean([np.mean(np.equal(x, y))
                                          for x, y in zip(a, b)]))
    agreement[r["tp"]] = r["identical_sequences_frac"]
    for key in ("prefill_tok_s", "decode_tok_s"):
      base = rows[0][key]
      r[f"{key.split('_')[0]}_speedup_vs_tp1"] = r[key] / base if base else None
  print("identical sequences vs tp=1:", agreement)
  return rows, dict(checks=checks), [
      "tp", "impl", "prefill_tok_s", "decode_tok_s", "prefill_speedup_vs_tp1",
      "decode_speedup_vs_tp1", "identical_sequences_frac", "steps",
      "first_run_s", "pool_sharding"]


# -------------------------------------------------------------------- grid
def _token_check(mcfg, tps, args):
  """Greedy tokens of a 2-layer f32 copy of `mcfg` through the Engine at
  every tp (full-precision matmuls): `{tp: outputs}` and whether all equal."""
  import jax
  import jax.numpy as jnp
  from pkvattn import parallel
  from pkvattn.engine import Engine, SamplingParams
  from pkvattn.models import Model, init_params

  cfg = dataclasses.replace(mcfg, num_layers=2)
  # 1 / sqrt(hidden): random weights whose greedy tokens follow the input
  # (at 0.02 a small model repeats one token, a check that checks little).
  params = init_params(cfg, jax.random.key(1), jnp.float32,
                       scale=cfg.hidden_size ** -0.5)
  model = Model("check", cfg, params, None)
  small = args.small
  prompts, _ = _workload(argparse.Namespace(
      num_prompts=4 if small else 8, prompt_len=24 if small else 100,
      new_tokens=None), cfg, small)
  new_tokens = 8 if small else 16
  ecfg = dataclasses.replace(
      _engine_config(args, len(prompts), len(prompts[0]), new_tokens, small),
      decode_steps=4)
  sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
  outs = {}
  with jax.default_matmul_precision("highest"):
    for tp in tps:
      engine = Engine(model, ecfg,
                      mesh=None if tp == 1 else parallel.make_mesh(tp))
      outs[tp] = engine.generate(prompts, sp)
      del engine
      gc.collect()
  same = {tp: outs[tp] == outs[tps[0]] for tp in tps}
  return outs, same


def _device_bytes() -> float | None:
  import jax
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 (CPU: no stats)
    stats = {}
  return stats.get("bytes_limit")


def _collective_bytes(hlo: str, tp: int) -> dict:
  """Per program call: `{kind: (count, bytes a ring moves per device)}` of
  the collectives in compiled HLO text (layers unrolled: every op runs
  once per call; a `-start` / `-done` pair counts once)."""
  sizes = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8,
           "s64": 8, "pred": 1, "s8": 1, "u8": 1}
  out = {}
  pat = re.compile(r"= (.*?) (all-reduce|all-gather|reduce-scatter|"
                   r"collective-permute|all-to-all)(-start)?\(")
  for line in hlo.splitlines():
    m = pat.search(line)
    if not m:
      continue
    arrays = [sizes.get(t, 4) * _prod(d)
              for t, d in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))]
    kind = m.group(2)
    if kind == "all-reduce":
      size = sum(arrays)
      wire = 2 * (tp - 1) / tp * size
    elif kind == "all-gather":  # -start results hold (input, output)
      size = max(arrays)
      wire = (tp - 1) / tp * size
    else:
      size = max(arrays)
      wire = (tp - 1) / tp * size
    n, b = out.get(kind, (0, 0.0))
    out[kind] = (n + 1, b + wire)
  return out


def _prod(dims: str) -> int:
  n = 1
  for d in dims.split(","):
    if d:
      n *= int(d)
  return n


def _classify(name: str) -> str | None:
  """The collective a GPU kernel runs, by name: NCCL kernels
  (`ncclDevKernel_AllReduce...`) and XLA's own collective kernels, which
  carry the op's name (`psum_<n>_fusion` for a `lax.psum`)."""
  key = name.lower().replace("-", "").replace("_", "")
  for kind, tags in (("all-reduce", ("allreduce", "psum")),
                     ("all-gather", ("allgather",)),
                     ("reduce-scatter", ("reducescatter",)),
                     ("nccl-other", ("nccl", "sendrecv"))):
    if any(t in key for t in tags):
      return kind
  return None


class _Step:
  """One jitted greedy step of the engine's layout on `rows` sequences of
  `context` cached tokens plus `q_len` new tokens each; the pool donated."""

  def __init__(self, model, mesh, *, rows, context, q_len, page_size, impl,
               dtype):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pkvattn import parallel
    from pkvattn.flax import AttentionPlan, layer_page_tables
    from pkvattn.models import decoder
    from pkvattn.serving import programs

    cfg = model.cfg
    max_pages = -(-(context + q_len) // page_size)
    slot_table = np.arange(rows * max_pages, dtype=np.int32).reshape(
        rows, max_pages)
    shape = cfg.pool_shape(slot_table.size, page_size)
    sharding = (parallel.pool_sharding(mesh) if mesh is not None
                else jax.sharding.make_single_device_sharding(jax.devices()[0]))
    self.pool = jax.jit(lambda: jnp.zeros(shape, dtype),
                        out_shardings=sharding)()
    num_tokens = rows * q_len
    q_indptr = np.arange(rows + 1, dtype=np.int32) * q_len
    inputs = dict(
        tokens=np.arange(num_tokens, dtype=np.int32) * 7 % cfg.vocab_size,
        tables=np.asarray(layer_page_tables(jnp.asarray(slot_table),
                                            cfg.num_layers)),
        q_indptr=q_indptr,
        kv_lens=np.full(rows, context + q_len, np.int32))
    if mesh is not None:
      inputs = jax.device_put(inputs, parallel.replicated(mesh))
    else:
      inputs = jax.device_put(inputs, jax.devices()[0])
    self.inputs = inputs

    def step(params, pool, inp):
      plan = AttentionPlan.create(inp["tables"], inp["q_indptr"],
                                  inp["kv_lens"], num_tokens)
      last = inp["q_indptr"][1:] - 1
      if mesh is None:
        logits, pool = decoder.forward(params, cfg, inp["tokens"], pool, plan,
                                       logits_indices=last, impl=impl)
        return jnp.argmax(logits, -1).astype(jnp.int32), pool
      logits, pool = parallel.tp_forward(params, cfg, inp["tokens"], pool,
                                         plan, mesh, logits_indices=last,
                                         impl=impl)
      return parallel.greedy_tokens(logits, mesh), pool

    self.params = model.params
    t0 = time.perf_counter()
    self.compiled = jax.jit(
        step, donate_argnums=1,
        compiler_options=programs.compiler_options() or None).lower(
            self.params, self.pool, self.inputs).compile()
    self.compile_s = time.perf_counter() - t0

  def __call__(self):
    tokens, self.pool = self.compiled(self.params, self.pool, self.inputs)
    return tokens

  def release(self):
    self.pool.delete()


def _pool_bytes(cfg, rows, context, page_size, tp, dtype_bytes) -> float:
  pages = -(-(context + 16) // page_size)
  return (rows * pages * page_size * cfg.num_layers * 2
          * (cfg.num_kv_heads // tp) * cfg.head_dim * dtype_bytes)


def _run_grid(*, args, mcfg, dtype, impl, tps, name):
  import jax
  import jax.numpy as jnp
  from bench.common import timing as _timing
  from bench.common.models import init_params_on_devices
  from pkvattn import parallel
  from pkvattn.engine import EngineConfig
  from pkvattn.models import Model
  from pkvattn.models.decoder import param_count
  from pkvattn.serving import runner

  small = args.small
  row_set = args.rows or ([4, 8] if small else [64, 256])
  contexts = args.contexts or ([64] if small else
                               [1024] if args.quick else [1024, 4096])
  n_pre, len_pre = (_ints(args.prefill.replace("x", ","))
                    if args.prefill else ((2, 64) if small else (8, 2048)))
  iters = 3 if args.quick or small else 10
  cells = [(1, contexts[0])] + [(r, c) for c in contexts for r in row_set]

  extra = dict(link_gbps=args.link_gbps, cells=cells,
               prefill=dict(prompts=n_pre, prompt_len=len_pre))
  if not args.no_check and len(tps) > 1:
    t0 = time.perf_counter()
    outs, same = _token_check(mcfg, tps, args)
    extra["token_check"] = dict(
        layers=2, dtype="float32", identical={str(k): v for k, v in same.items()},
        tokens_tp1=outs[tps[0]][:2],
        distinct_tokens=len({t for o in outs[tps[0]] for t in o}),
        seconds=time.perf_counter() - t0)
    print(f"token check (2 layers, f32): identical at every tp: "
          f"{all(same.values())} {same}, "
          f"{extra['token_check']['distinct_tokens']} distinct tokens "
          f"({extra['token_check']['seconds']:.0f} s)",
          flush=True)
    if not all(same.values()):
      print("WARNING: tokens differ across tp; timings follow anyway",
            flush=True)
  gc.collect()

  limit = _device_bytes()
  itemsize = jnp.dtype(dtype).itemsize
  total_params = None
  rows = []
  base = {}
  for tp in tps:
    mesh = None if tp == 1 else parallel.make_mesh(tp)
    t0 = time.perf_counter()
    params = init_params_on_devices(mcfg, jax.random.key(0), dtype, mesh)
    model = Model(name, mcfg, params, None)
    del params
    ecfg = EngineConfig(scan_layers=False, impl=args.impl)
    model = runner.prepare_model(model, ecfg, mesh, dtype)
    jax.block_until_ready(model.params)
    total_params = total_params or param_count(model.params)
    weight_bytes = sum(
        s.data.nbytes for a in jax.tree.leaves(model.params)
        for s in a.addressable_shards if s.device == jax.devices()[0])
    print(f"[tp={tp}] weights on device 0: {weight_bytes / 1e9:.2f} GB "
          f"(init {time.perf_counter() - t0:.1f} s)", flush=True)

    def run_cell(kind, rows_, context, q_len):
      need = weight_bytes + _pool_bytes(model.cfg, rows_, context + q_len,
                                        args.page_size, tp, itemsize)
      row = dict(kind=kind, tp=tp, rows=rows_, context=context,
                 new_tokens_per_row=q_len)
      workspace = 6e9  # activations of a 16k-token prefill, cuBLAS, XLA
      if limit and need + workspace > limit:
        row["skipped"] = (f"needs {need / 1e9:.1f} GB + workspace of "
                          f"{limit / 1e9:.1f} GB")
        print(f"  {kind} rows={rows_} ctx={context}: skipped "
              f"({row['skipped']})", flush=True)
        return row, None
      step = None
      try:
        step = _Step(model, mesh, rows=rows_, context=context, q_len=q_len,
                     page_size=args.page_size, impl=args.impl, dtype=dtype)
        t = _timing.pipelined_ms(step, jax.block_until_ready, iters=iters,
                                 min_time_s=0.1 if small else 0.5)
      except Exception as e:  # noqa: BLE001 (out of memory: report, go on)
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in \
            str(e).lower():
          raise
        if step is not None:
          step.release()
        row["skipped"] = "out of memory: " + str(e).splitlines()[0][:200]
        print(f"  {kind} rows={rows_} ctx={context}: {row['skipped']}",
              flush=True)
        gc.collect()
        return row, None
      tokens = rows_ * q_len
      row.update(ms_per_step=t["median_ms"], p10_ms=t["p10_ms"],
                 p90_ms=t["p90_ms"], tok_s=tokens / (t["median_ms"] * 1e-3),
                 compile_s=step.compile_s)
      print(f"  {kind} rows={rows_} ctx={context}: {t['median_ms']:.2f} "
            f"ms/step, {row['tok_s']:,.0f} tok/s (compile "
            f"{step.compile_s:.1f} s)", flush=True)
      return row, step

    for r_, c_ in cells:
      kind = "tpot" if r_ == 1 else "decode"
      row, step = run_cell(kind, r_, c_, 1)
      rows.append(row)
      if step is None:
        continue
      if kind == "decode" and (r_, c_) == (row_set[-1], contexts[0]) and \
          not args.no_profile:
        row.update(_profile(step, tp, args.link_gbps, small))
      step.release()
      del step
      gc.collect()
    if n_pre:
      row, step = run_cell("prefill", n_pre, 0, len_pre)
      rows.append(row)
      if step is not None:
        step.release()
    del model
    gc.collect()

  for r in rows:
    key = (r["kind"], r["rows"], r["context"])
    if r["tp"] == 1:
      base[key] = r.get("tok_s")
    b = base.get(key)
    r["speedup_vs_tp1"] = r["tok_s"] / b if b and r.get("tok_s") else None
    if r["kind"] == "tpot" and r.get("ms_per_step"):
      r["tpot_ms"] = r["ms_per_step"]
  extra["param_count"] = total_params
  return rows, extra, [
      "kind", "tp", "rows", "context", "ms_per_step", "tok_s",
      "speedup_vs_tp1", "coll_ms_per_step", "coll_ideal_ms", "compile_s",
      "skipped"]


def _profile(step, tp, link_gbps, small) -> dict:
  """Collective kernel time per step on GPU 0 (profile) beside the ideal
  from the compiled program's collectives at `link_gbps`, and GPU 0's
  largest kernels per step."""
  from bench.common import timing as _timing
  calls = 3
  out = {}
  if tp > 1:
    coll = _collective_bytes(step.compiled.as_text(), tp)
    out["collectives_hlo"] = {k: dict(count=n, wire_bytes=b)
                              for k, (n, b) in coll.items()}
    wire = sum(b for _, b in coll.values())
    out["coll_ideal_ms"] = wire / (link_gbps * 1e9) * 1e3
  # Every device runs the same program: one device's time per step.
  events = _timing.gpu_trace_events([step] * calls, device="/device:GPU:0")
  if not events:
    out["coll_ms_per_step"] = None
    return out
  per = {}
  for _, dur, name in events:
    kind = _classify(name)
    if kind:
      per[kind] = per.get(kind, 0.0) + dur / 1e6 / calls
  out["collectives_profile_ms"] = per
  out["coll_ms_per_step"] = sum(per.values())
  out["device_ms_per_step"] = sum(d for _, d, _ in events) / 1e6 / calls
  out["top_kernels"] = [
      (name, round(n, 1), round(us, 1)) for name, n, us in
      _timing.kernel_groups([(n, d) for _, d, n in events], calls)[:15]]
  return out


# ---------------------------------------------------------------- replicas
def _run_replicas(*, args, mcfg, dtype, impl, tps, name):
  import jax
  from bench.common.models import init_params_on_devices
  from pkvattn import parallel
  from pkvattn.engine import Engine, SamplingParams
  from pkvattn.models import Model

  n = args.replicas
  small = args.small
  wl = argparse.Namespace(
      num_prompts=args.num_prompts or (4 * n if small else 32 * n),
      prompt_len=args.prompt_len or (48 if small else 512),
      new_tokens=args.new_tokens or (16 if small else 128))
  prompts, new_tokens = _workload(wl, mcfg, small)
  sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
  rows, outputs = [], {}
  # (replicas, tp): one engine; n one-device engines; one engine at tp=n.
  for reps, tp in ((1, 1), (n, 1), (1, n)):
    meshes = parallel.replica_meshes(reps, tp)
    engines = []
    for mesh in meshes:
      params = init_params_on_devices(mcfg, jax.random.key(0), dtype, mesh)
      per = len(prompts) // reps
      cfg = _engine_config(args, per + 1, len(prompts[0]), new_tokens, small)
      engines.append(Engine(Model(name, mcfg, params, None), cfg, mesh=mesh))
      del params
    outs, wall, first, stats = _timed_generate(
        lambda: parallel.generate_on_replicas(engines, prompts, sp),
        engines)
    outputs[(reps, tp)] = outs
    tokens = sum(len(o) for o in outs)
    rows.append(dict(
        replicas=reps, tp=tp, devices=reps * tp, num_prompts=len(prompts),
        prompt_len=len(prompts[0]), new_tokens=new_tokens, wall_s=wall,
        first_run_s=first, output_tok_s=tokens / wall,
        total_tok_s=(tokens + sum(len(p) for p in prompts)) / wall,
        decode_tok_s_per_engine=[s.decode_tokens_per_s for s in stats]))
    print(f"[replicas={reps} tp={tp}] {rows[-1]['output_tok_s']:,.0f} output "
          f"tok/s (wall {wall:.1f} s, first run {first:.1f} s)", flush=True)
    del engines
    gc.collect()
  base = rows[0]["output_tok_s"]
  for r in rows:
    r["speedup_vs_one"] = r["output_tok_s"] / base
    r["identical_to_one"] = outputs[(r["replicas"], r["tp"])] == outputs[(1, 1)]
  return rows, dict(replicas=n), [
      "replicas", "tp", "devices", "output_tok_s", "speedup_vs_one",
      "identical_to_one", "wall_s", "first_run_s"]


if __name__ == "__main__":
  main()
