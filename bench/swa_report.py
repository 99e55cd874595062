"""Peak KV bytes of hybrid sliding-window models: per-window-group slot spaces
vs a flat layout, MEASURED through the cache.

`python -m bench.swa_report [--planner] [--out DIR]` (CPU; a few minutes
on 2 cores) writes `<out>/swa_report.json` and `<out>/swa_report.png` and
prints a table last. `--planner` prints the planner's predicted peaks alone
(no cache, no JSON).

What is measured. One sequence (bf16 KV, page_size 16) is prefilled and then
decodes `NUM_DECODE = 1024` tokens, through the real jitted
`pkvattn.cache.claim_batch` / `extend` (staged, with `jax.vmap` over the
prompt lengths and prefill modes and a `lax.scan` over the steps: one
compilation per cache config). After each step's allocation the slots in use
are read from `cache.stats(state)["num_used"]` (per group for a
`HybridCacheState`): that is the step's peak, since `extend` first retires
the previous step's scratch and releases a sliding group's blocks out of
reach, then allocates. Steps:

  * `one_chunk`: the whole prompt in one `claim_batch`;
  * `chunked_8k`: `claim_batch` of the first 8,192 tokens, then one `extend`
    per further 8,192-token chunk with `num_computed` = tokens before the
    chunk (how `cache.extend` documents chunked prefill: a claim reserves its
    whole length, so claiming the full prompt would allocate every block up
    front);
  * then 1,024 `extend`s of 1 token, `num_computed` = tokens before it.

Layouts (each a real cache config, sized so that nothing is refused; a
refusal aborts the report):

  * `flat`: `CacheConfig` with every layer global, what a cache without
    per-group spaces allocates (a slot holds a block of every layer; every
    block is kept). One such config (`num_layers=1`) is measured for all
    models: a flat all-global cache allocates the same slots whatever its
    `num_layers` and KV shape (they only scale the pages of a slot), and its
    bytes are slots x the model's layers x the model's block bytes;
  * `pg` / `pg_noscratch`: `HybridCacheConfig` (one slot space per window
    group), SWA scratch reuse on / off. A sliding group keeps only the blocks
    a current or future query can see; with scratch its stale prefill blocks
    take scratch slots, each serving `L_g` blocks of the layer now running;
  * `impl` (all-SWA model only): the flat `CacheConfig` with the model's
    windows and scratch on, one slot space for all layers. It takes scratch
    but releases nothing before `release`. For a mixed model one slot space
    takes no scratch at all (`CacheConfig.swa_scratch_active`), so `impl`
    would equal `flat` there and is not reported.

Bytes. `layer_blocks x page_size x 2 (K, V) x num_kv_heads x head_dim x 2`
(bf16), `layer_blocks = sum_g slots_g x L_g` (`L_g` = layers of group g).
`peak_*` is the maximum over the run's steps of that sum (the sequence's
peak); `pools_*` sums each group's own peak (what static per-group pools,
`HybridCacheConfig.from_budget`, must hold for this sequence). `ratio` =
`pg` peak / `flat` peak. GiB = 2**30 bytes.

Planner. `bench/common/swa_planner.py` predicts every group's slots at every step
from the scenario alone (window, page size, layers per group, prompt, chunk,
decode tokens, scratch on/off; `cache.swa_scratch_plan` for a step's new
blocks). The report is written only if planner and measurement agree at every
step of every run.

Targets (`meets`): Gemma 3 at 32k <= 0.25x flat and at 128k <= 0.2x, Gemma 2
at 32k <= 0.6x. `floor` is the ratio a slot-granular cache cannot go below
with this schedule: every block that a query of the running layer or a
future query can see, the running layer's scratch blocks counted for that
layer only (no rounding to whole scratch slots). Where a target is missed,
the floor and its reason are recorded:

  * one chunk: the running sliding layer reads every key of the prompt, so
    one layer's worth of the whole prompt sits in scratch next to the global
    layers' whole prompt: floor ~ (global layers + 1) / layers;
  * chunks of C tokens: a chunk's first queries need the window before the
    chunk while the chunk's last window is kept for the next one, about two
    windows per sliding layer at once.

Models (window = tokens incl. the current one, `window_left = window - 1`):

  * `gemma3_270m`: 18 layers, layer i global iff (i + 1) % 6 == 0 (5 local :
    1 global), window 512, 1 KV head, head_dim 256;
  * `gemma3_27b_like`: 62 layers, 5:1 likewise, window 1,024, 16 KV heads,
    head_dim 128;
  * `gemma2_9b_like`: 42 layers alternating local (even) / global (odd),
    window 4,096, 8 KV heads, head_dim 256;
  * `gpt_oss_20b_like`: 24 layers alternating sliding (even, window 128) /
    full, 8 KV heads, head_dim 64;
  * `mistral_7b_like` (extra, all SWA): 32 layers, window 4,096, 8 KV heads,
    head_dim 128; one window group, so `pg` is a single sliding space.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.metadata
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import results
from bench.common import swa_planner as planner
from bench.common import timing as _timing
from pkvattn import cache

PAGE_SIZE = 16
CHUNK_LEN = 8192
NUM_DECODE = 1024
PROMPT_LENS = tuple(1024 * 2**i for i in range(8))  # 1k .. 128k
MAX_PROMPT_LEN = max(PROMPT_LENS)
MAX_PAGES = (MAX_PROMPT_LEN + NUM_DECODE) // PAGE_SIZE
MODES = {"one_chunk": None, "chunked_8k": CHUNK_LEN}
BYTES_PER_ELEMENT = 2  # bf16
GIB = 2**30
SLOT_MARGIN = 64


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  name: str
  layer_windows: tuple[int, ...]  # window_left per layer, -1 = global
  num_kv_heads: int
  head_dim: int
  targets: tuple[tuple[int, float], ...] = ()  # (prompt_len, max ratio)

  @property
  def num_layers(self) -> int:
    return len(self.layer_windows)

  @property
  def layer_block_bytes(self) -> int:
    """Bytes of one block (page_size tokens, K and V) of one layer."""
    return PAGE_SIZE * 2 * self.num_kv_heads * self.head_dim * BYTES_PER_ELEMENT

  @property
  def all_swa(self) -> bool:
    return all(w >= 0 for w in self.layer_windows)

  @property
  def num_global_layers(self) -> int:
    return sum(w < 0 for w in self.layer_windows)


def _five_to_one(num_layers: int, window_left: int) -> tuple[int, ...]:
  return tuple(-1 if (i + 1) % 6 == 0 else window_left for i in range(num_layers))


GEMMA3_TARGETS = ((32768, 0.25), (131072, 0.2))
MODELS = (
    ModelSpec("gemma3_270m", _five_to_one(18, 511), 1, 256, GEMMA3_TARGETS),
    ModelSpec("gemma3_27b_like", _five_to_one(62, 1023), 16, 128, GEMMA3_TARGETS),
    ModelSpec("gemma2_9b_like", (4095, -1) * 21, 8, 256, ((32768, 0.6),)),
    ModelSpec("gpt_oss_20b_like", (127, -1) * 12, 8, 64),
    ModelSpec("mistral_7b_like", (4095,) * 32, 8, 128),
)


# ----------------------------------------------------------------------------------
# Cache configs.


def _generous_sliding_slots(window_left: int, num_layers: int) -> int:
  """Slots a sliding group with scratch can hold at most for one sequence,
  bounded from first principles (not the planner): one-chunk scratch for the
  whole capacity, plus the window before and after a step, plus a margin."""
  window_blocks = -(-(window_left + 1) // PAGE_SIZE) + 1
  return -(-MAX_PAGES // num_layers) + 2 * window_blocks + SLOT_MARGIN


def layout_config(model: ModelSpec | None, layout: str):
  """The cache config of `layout` (module docstring) for `model` (`None`
  for `flat`, shared by every model)."""
  full = MAX_PAGES + SLOT_MARGIN
  if layout == "flat":
    return cache.CacheConfig(num_slots=full, page_size=PAGE_SIZE, num_layers=1,
                             max_seqs=1, max_pages=MAX_PAGES)
  if layout == "impl":
    return cache.CacheConfig(num_slots=full, page_size=PAGE_SIZE,
                             num_layers=model.num_layers, max_seqs=1,
                             max_pages=MAX_PAGES,
                             layer_windows=model.layer_windows,
                             enable_swa_scratch_reuse=True)
  scratch = layout == "pg"
  probe = cache.HybridCacheConfig(
      model.layer_windows, (1,) * len(set(model.layer_windows)),
      page_size=PAGE_SIZE, max_seqs=1, max_pages=MAX_PAGES)
  slots = tuple(
      _generous_sliding_slots(g.window_left, g.num_layers)
      if scratch and g.window_left >= 0 else full for g in probe.groups)
  return cache.HybridCacheConfig(
      model.layer_windows, slots, page_size=PAGE_SIZE, max_seqs=1,
      max_pages=MAX_PAGES, enable_swa_scratch_reuse=scratch)


def layouts(model: ModelSpec) -> tuple[str, ...]:
  return ("flat", "pg", "pg_noscratch") + (("impl",) if model.all_swa else ())


def group_windows(config) -> tuple[int, ...]:
  """`window_left` of each slot space of `config`, in `stats` order."""
  if isinstance(config, cache.HybridCacheConfig):
    return tuple(g.window_left for g in config.groups)
  return (-1,)  # one slot space (its counters are scalars)


# ----------------------------------------------------------------------------------
# Measurement.


def scenarios() -> list[tuple[int, str]]:
  return [(p, mode) for mode in MODES for p in PROMPT_LENS]


def _schedule():
  """Per scenario: the claim length and the extend steps `(seq, new, done)`.

  Every scenario gets the same number of extend steps (the most chunks any
  has, then the decode steps); the unused chunk steps are padding (`seq_id
  -1`: refused, no effect) and are dropped from the trajectory.
  """
  max_chunks = MAX_PROMPT_LEN // CHUNK_LEN - 1
  num_steps = max_chunks + NUM_DECODE
  rows = scenarios()
  first = np.zeros(len(rows), np.int32)
  seq = np.full((len(rows), num_steps), -1, np.int32)
  new = np.zeros((len(rows), num_steps), np.int32)
  done = np.zeros((len(rows), num_steps), np.int32)
  active = np.zeros((len(rows), num_steps), bool)
  for r, (prompt_len, mode) in enumerate(rows):
    steps = planner.run_steps(_scenario(prompt_len, mode))
    first[r] = steps[0][1]
    chunk_steps = [s for s in steps[1:] if s[0] < prompt_len]
    decode_steps = steps[1 + len(chunk_steps):]
    for i, (h, cap, n) in enumerate(chunk_steps):
      seq[r, i], new[r, i], done[r, i], active[r, i] = 0, cap - h, n, True
    for i, (h, cap, n) in enumerate(decode_steps):
      j = max_chunks + i
      seq[r, j], new[r, j], done[r, j], active[r, j] = 0, cap - h, n, True
  return first, seq, new, done, active


def _scenario(prompt_len: int, mode: str) -> planner.Scenario:
  return planner.Scenario(prompt_len, MODES[mode], NUM_DECODE, PAGE_SIZE)


def _run_program(config):
  """Jitted: `(first_len, seq, new, done)` per scenario -> slots per step."""
  tokens = jnp.arange(MAX_PROMPT_LEN, dtype=jnp.int32)[None]
  one_seq = jnp.zeros((1,), jnp.int32)

  def run(first_len, seq, new, done):
    state = cache.init_cache(config)
    # evict=False: nothing is ever published, so there is nothing to evict;
    # it also keeps the eviction's lax.cond (a select of both branches under
    # vmap) out of every step.
    state, claim = cache.claim_batch(state, one_seq, tokens, first_len[None],
                                     evict=False, check=False)
    used0 = jnp.atleast_1d(cache.stats(state)["num_used"])

    def step(state, x):
      s, n, d = x
      state, res = cache.extend(state, s[None], n[None], num_computed=d[None],
                                evict=False, check=False)
      return state, (res.ok[0], jnp.atleast_1d(cache.stats(state)["num_used"]))

    _, (ok, used) = jax.lax.scan(step, state, (seq, new, done))
    return claim.ok[0], used0, ok, used

  return jax.jit(jax.vmap(run))


def measure(model: ModelSpec | None, layout: str) -> dict:
  """Slots per group per step for every scenario, from the real cache ops.

  Returns `{(prompt_len, mode): {window_left: [slots per step]}}`.

  Raises:
    RuntimeError: a claim or a step was refused (a config too small).
  """
  config = layout_config(model, layout)
  first, seq, new, done, active = _schedule()
  t0 = time.perf_counter()
  compiled = _run_program(config).lower(first, seq, new, done).compile()
  t1 = time.perf_counter()
  claim_ok, used0, ok, used = jax.device_get(compiled(first, seq, new, done))
  t2 = time.perf_counter()
  windows = group_windows(config)
  out = {}
  for r, key in enumerate(scenarios()):
    if not claim_ok[r] or not ok[r][active[r]].all():
      name = model.name if model else "all models"
      raise RuntimeError(f"{name} {layout} {key}: a step was refused")
    traj = np.concatenate([used0[r][None], used[r][active[r]]], axis=0)
    out[key] = {w: traj[:, g].tolist() for g, w in enumerate(windows)}
  return dict(steps=out, compile_s=t1 - t0, run_s=t2 - t1)


def predict(model: ModelSpec, layout: str, prompt_len: int, mode: str) -> dict:
  """The planner's per-group trajectories for one measured run."""
  sc = _scenario(prompt_len, mode)
  if layout == "flat":
    return {-1: planner.flat_step_slots(sc)}
  if layout == "impl":  # one slot space of all layers, widest window, no release
    return {-1: planner.group_step_slots(max(model.layer_windows),
                                         model.num_layers, sc, scratch=True,
                                         release=False)}
  return planner.plan_run(model.layer_windows, sc,
                          scratch=layout == "pg")["group_steps"]


# ----------------------------------------------------------------------------------
# Rows.


def _layer_blocks(model: ModelSpec, layout: str, steps: dict) -> tuple[int, int]:
  """`(peak, pools)` layer-blocks of one run (module docstring)."""
  if layout in ("flat", "impl"):
    peak = max(steps[-1]) * model.num_layers
    return peak, peak
  groups = planner.window_groups(model.layer_windows)
  num = len(next(iter(steps.values())))
  peak = max(sum(steps[w][t] * groups[w] for w in groups) for t in range(num))
  return peak, sum(max(steps[w]) * groups[w] for w in groups)


FLOOR_REASONS = dict(
    one_chunk=("one-chunk prefill: the running sliding layer reads every key "
               "of the prompt (its stale blocks in scratch), next to the "
               "global layers' whole prompt: floor ~ (global layers + 1) / "
               "layers"),
    chunked_8k=("8k chunks: a chunk's first queries need the window before "
                "the chunk while its last window is kept for the next chunk "
                "(about two windows per sliding layer), next to the global "
                "layers' whole context"),
)


def model_rows(model: ModelSpec, measured: dict) -> tuple[list[dict], list[str]]:
  """Rows of one model and the planner/measurement disagreements."""
  rows, bad = [], []
  gib = model.layer_block_bytes / GIB
  targets = dict(model.targets)
  for prompt_len, mode in scenarios():
    key = (prompt_len, mode)
    row = dict(model=model.name, num_layers=model.num_layers,
               num_global_layers=model.num_global_layers,
               windows=sorted({w + 1 for w in model.layer_windows if w >= 0}),
               prompt_len=prompt_len, mode=mode, num_decode=NUM_DECODE,
               page_size=PAGE_SIZE, num_kv_heads=model.num_kv_heads,
               head_dim=model.head_dim)
    for layout in layouts(model):
      steps = measured[layout]["steps"][key]
      want = predict(model, layout, prompt_len, mode)
      for w, traj in steps.items():
        if traj != want[w]:
          t = next(i for i, (a, b) in enumerate(zip(traj, want[w])) if a != b)
          bad.append(f"{model.name} {layout} {prompt_len} {mode} window_left "
                     f"{w}: step {t} measured {traj[t]} slots, planner "
                     f"{want[w][t]} (peaks {max(traj)} vs {max(want[w])})")
      peak, pools = _layer_blocks(model, layout, steps)
      row[f"{layout}_peak_gib"] = peak * gib
      row[f"{layout}_pools_gib"] = pools * gib
      row[f"{layout}_peak_layer_blocks"] = peak
      row[f"{layout}_group_peak_slots"] = {str(w): max(t)
                                           for w, t in steps.items()}
    flat = row["flat_peak_layer_blocks"]
    for layout in layouts(model)[1:]:
      row[f"{layout}_ratio"] = row[f"{layout}_peak_layer_blocks"] / flat
    row["pg_pools_ratio"] = row["pg_pools_gib"] / row["flat_peak_gib"]
    plan = planner.plan_run(model.layer_windows, _scenario(prompt_len, mode),
                            scratch=True)
    row["floor"] = plan["floor_layer_blocks"] / flat
    row["target"] = targets.get(prompt_len)
    row["meets"] = (None if row["target"] is None
                    else bool(row["pg_ratio"] <= row["target"]))
    if row["meets"] is False:
      row["floor_reason"] = FLOOR_REASONS[mode]
      row["physical"] = bool(row["floor"] > row["target"])
    rows.append(row)
  return rows, bad


# ----------------------------------------------------------------------------------
# Output.


def plot(rows: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, axes = plt.subplots(2, 3, figsize=(16, 9.5))
  styles = dict(one_chunk=("tab:blue", "o"), chunked_8k=("tab:orange", "^"))
  for ax, model in zip(axes.flat, MODELS):
    mrows = [r for r in rows if r["model"] == model.name]
    for mode, (color, marker) in styles.items():
      rs = [r for r in mrows if r["mode"] == mode]
      xs = [r["prompt_len"] for r in rs]
      ax.plot(xs, [r["pg_ratio"] for r in rs], color=color, marker=marker,
              lw=2, label=f"per-group, scratch on, {mode}")
      ax.plot(xs, [r["pg_noscratch_ratio"] for r in rs], color=color,
              marker=marker, ls="--", lw=1, ms=3,
              label=f"per-group, scratch off, {mode}")
      ax.plot(xs, [r["floor"] for r in rs], color=color, ls=":", lw=1,
              label=f"floor, {mode}")
      if model.all_swa:
        ax.plot(xs, [r["impl_ratio"] for r in rs], color=color, marker="x",
                ls="-.", lw=1, label=f"one slot space + scratch, {mode}")
    for prompt_len, target in model.targets:
      verdict = ", ".join(
          f"{'1c' if r['mode'] == 'one_chunk' else '8k'} "
          f"{'met' if r['meets'] else 'missed'}"
          for r in mrows if r["prompt_len"] == prompt_len)
      ax.plot([prompt_len], [target], "r*", ms=14, zorder=5)
      ax.annotate(f"target <= {target}\n({verdict})", (prompt_len, target),
                  textcoords="offset points", xytext=(-6, 10), ha="center",
                  fontsize=7.5, color="r")
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(PROMPT_LENS), [f"{p // 1024}k" for p in PROMPT_LENS])
    ax.set_ylim(0, 1.08)
    ax.set_xlabel("prompt tokens (+1,024 decode)")
    ax.set_ylabel("peak KV bytes / flat layout")
    windows = sorted({w + 1 for w in model.layer_windows if w >= 0})
    ax.set_title(f"{model.name}: {model.num_layers} layers, "
                 f"{model.num_global_layers} global, window "
                 f"{', '.join(map(str, windows))}", fontsize=10)
    ax.grid(alpha=0.3)
  last = axes.flat[5]
  last.axis("off")
  # The all-SWA panel draws every series: its handles make the one legend.
  handles, labels = axes.flat[4].get_legend_handles_labels()
  last.legend(handles, labels, loc="upper left", fontsize=8, frameon=False)
  last.text(0, 0.38, (
      "Measured through cache.claim_batch / extend (one\n"
      f"sequence, page_size {PAGE_SIZE}, bf16, {NUM_DECODE} decode tokens);\n"
      "planner and measurement agree at every step.\n"
      "ratio = peak KV bytes, per-window-group slot spaces\n"
      "        / peak of a flat layout (every block kept)\n"
      "floor = blocks a query of the running layer or a\n"
      "        future query can see (scratch: one layer)\n"
      "red stars: targets (1c one chunk, 8k 8k chunks)"),
      va="top", family="monospace", fontsize=8.5)
  fig.suptitle("Per-window-group KV slot spaces: peak KV bytes of one sequence "
               "vs a flat layout", fontsize=12)
  fig.tight_layout(rect=(0, 0, 1, 0.97))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _versions() -> dict:
  out = dict(jax=jax.__version__, numpy=np.__version__)
  for dist in ("pkvattn", "jaxlib", "matplotlib"):
    try:
      out[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      out[dist] = None
  return out


def planner_table() -> list[dict]:
  """The planner's peak slots per window group (scratch on), per model,
  prompt length and prefill mode: no cache, no JAX."""
  table = []
  for m in MODELS:
    for prompt_len in PROMPT_LENS:
      for mode in MODES:
        plan = planner.plan_run(m.layer_windows, _scenario(prompt_len, mode),
                                scratch=True)
        table.append(dict(model=m.name, ctx=f"{prompt_len // 1024}k",
                          mode=mode, **{f"peak_slots_w{w}": n for w, n in
                                        plan["group_peak_slots"].items()}))
  return table


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--planner", action="store_true",
                  help="print the planner's predicted peaks only")
  results.add_out_arg(ap)
  args = ap.parse_args(argv)
  if args.planner:
    table = planner_table()
    _timing.print_table(table, list(dict.fromkeys(k for r in table
                                                  for k in r)))
    return
  env = results.environment()
  t0 = time.perf_counter()
  jobs = [(None, "flat")] + [(m, layout) for m in MODELS
                             for layout in layouts(m) if layout != "flat"]
  # Two workers: XLA compiles and runs without the GIL, so one config's
  # compilation overlaps another's run on a 2-core machine.
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    futures = {job: pool.submit(measure, *job) for job in jobs}
    measured = {job: f.result() for job, f in futures.items()}
  rows, bad = [], []
  for m in MODELS:
    r, b = model_rows(m, {layout: measured[(None if layout == "flat" else m,
                                            layout)]
                          for layout in layouts(m)})
    rows += r
    bad += b
  if bad:
    raise RuntimeError("planner and measurement disagree; report not written:\n  "
                       + "\n  ".join(bad))
  wall_s = time.perf_counter() - t0
  extra = dict(
      package_versions=_versions(),
      page_size=PAGE_SIZE, chunk_len=CHUNK_LEN, num_decode=NUM_DECODE,
      bytes_per_element=BYTES_PER_ELEMENT,
      units=dict(gib="2**30 bytes", layer_blocks="page_size tokens of one "
                 "layer, K and V", slots="slots of the group's own space"),
      models=[dataclasses.asdict(m) for m in MODELS],
      timings_s={f"{m.name if m else 'all'}/{layout}": dict(
          compile_s=round(measured[(m, layout)]["compile_s"], 2),
          run_s=round(measured[(m, layout)]["run_s"], 2)) for m, layout in jobs},
      measure_wall_s=round(wall_s, 1),
      planner_agrees=True,
      description=__doc__,
  )
  paths = results.write("swa_report", rows, out=args.out, extra=extra,
                        env=env)
  png = os.path.join(args.out, "swa_report.png")
  os.makedirs(os.path.dirname(png), exist_ok=True)
  plot(rows, png)
  misses = [r for r in rows if r["meets"] is False]
  for r in misses:
    print(f"MISSED {r['model']} {r['prompt_len']} {r['mode']}: ratio "
          f"{r['pg_ratio']:.3f} > target {r['target']}; floor {r['floor']:.3f} "
          f"({'physical' if r['physical'] else 'NOT physical'}): "
          f"{r['floor_reason']}")
  print("wrote", *paths, png, f"(measured in {wall_s:.0f} s)")
  print("\nPeak KV bytes of one sequence (prefill + 1,024 decode tokens), "
        "measured: ratio = per-window-group slot spaces / flat layout\n"
        "(scratch on; 'noscr' scratch off; 'impl' one slot space with "
        "scratch, all-SWA model only). 1c = one-chunk prefill, 8k = 8k "
        "chunks.")
  table = []
  for r1 in (r for r in rows if r["mode"] == "one_chunk"):
    r8 = next(r for r in rows if r["mode"] == "chunked_8k"
              and (r["model"], r["prompt_len"]) == (r1["model"],
                                                     r1["prompt_len"]))
    table.append({
        "model": r1["model"], "ctx": f"{r1['prompt_len'] // 1024}k",
        "flat_gib": r1["flat_peak_gib"],
        "ratio_1c": r1["pg_ratio"], "ratio_8k": r8["pg_ratio"],
        "noscr_1c": r1["pg_noscratch_ratio"], "noscr_8k": r8["pg_noscratch_ratio"],
        "impl_1c": r1.get("impl_ratio"), "impl_8k": r8.get("impl_ratio"),
        "floor_1c": r1["floor"], "floor_8k": r8["floor"],
        "target": r1["target"], "meets_1c": r1["meets"], "meets_8k": r8["meets"]})
  _timing.print_table(table, list(table[0]))

if __name__ == "__main__":
  main()
