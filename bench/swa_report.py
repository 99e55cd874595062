"""Peak KV slots of a prefill with and without SWA scratch reuse (issue 5 report).

`python -m bench.swa_report` (CPU, ~30 s) prints two tables and writes
`bench/results/swa_report.json` and `bench/results/swa_report.png`.

What the implemented cache does (read this first). `pkvattn.cache` has ONE slot space:
a slot holds one block (`page_size` tokens, K and V) of EVERY layer. A block that is
stale for the sliding-window layers is still needed by any global layer, so its slot
must stay; scratch would free nothing. Hence `CacheConfig.swa_scratch_active` is true
only when every layer is sliding-window: a mixed model (Gemma-2/3-like: any global
layer) takes no scratch at all and its peak is the same with reuse on or off. Only
all-SWA models (Mistral-like) save.

Two kinds of figures, kept apart in every column name, table and the plot:

  * `impl_*` -- implemented (one slot space), MEASURED. For each model and prompt
    length a real `CacheConfig` (`layer_windows` of the model, `max_pages = 32768 / 32
    = 1024`, `num_slots = 1024`, `max_seqs = 1`, reuse on/off) is driven through the
    jitted `claim_batch` / `extend`, and the slots in use are read from
    `pkvattn.cache.stats(state)["num_used"]` right after each step's allocation (the
    step's scratch slots are held then; `extend` retires the previous step's scratch
    before it allocates, so that is the step's peak). `impl_*_arith_slots` is the
    same figure predicted from `swa_scratch_plan` over one slot space (the model's
    widest window, `num_layers` of the model, and no scratch at all if any layer is
    global); the script refuses to write the report if the two disagree.
  * `pergroup_*` -- per-group slot spaces (TensorRT-LLM style, NOT implemented here),
    ARITHMETIC. Each layer group (layers with equal `window_left`) has its own slot
    space, as TensorRT-LLM allocates per window-size group: a group slot holds one
    block of every layer *of that group*, so an SWA group's scratch slot serves
    `group.num_layers` scratch blocks (21 for Gemma-2-9B's local group, 32 for
    Mistral) and global groups keep every block. This is what a mixed model could save
    with a per-group pool; the cache here does not have one.

Models (bf16 KV, page_size 32 tokens, one sequence):
  * Mistral-like: Mistral-7B-v0.1 shapes, 32 layers, all sliding-window, 8 KV heads,
    head_dim 128.
  * Gemma-2-like: Gemma-2-9B shapes, 42 layers alternating local (even layers,
    sliding window) and global (odd layers), 8 KV heads, head_dim 256.
  Both windows are 4,096 tokens including the current one (HF `sliding_window=4096`:
  key j visible to query i iff i - j < 4096), i.e. `window_left = 4095`.
  * Extra, not asked by the issue: Gemma-3-like, Gemma-3-12B shapes, 48 layers, 5 local
    (window 1,024, `window_left = 1023`) to 1 global (layers 5, 11, ...), 8 KV heads,
    head_dim 256: a short window, where the per-group saving already shows at 1k-4k.
  With a 4,096-token window nothing is stale until the prompt exceeds 4,096 + 32
  tokens, so the 1k-4k rows of the first two models show no saving, by design.

Accounting:
  * Slots are *full-model slot equivalents*: one = `page_size` tokens of every layer,
    K and V (for `impl_*` that is exactly a cache slot; for `pergroup_*` it is
    `sum_g slots_g * L_g / L`). GiB are 2**30 bytes,
    `bytes = slot-layer blocks * page_size * 2 (K, V) * num_kv_heads * head_dim * 2`.
  * Peak = the most slots the sequence holds at once during the prefill. For a step
    that is (slots held from earlier chunks) + the chunk's scratch slots + its normal
    new blocks; scratch slots return to the pool after the step.
  * Scenarios:
      `no_reuse`: every block of every layer is kept (`cdiv(prompt_len, page_size)`
        slots; the same single-chunk or chunked).
      `reuse_1chunk`: the whole prompt in one `claim_batch` (history 0), reuse on.
      `reuse_chunked`: `CHUNK_LEN`-token chunks (`claim_batch` of the first chunk,
        then one `extend` per chunk), reuse on; normal blocks of earlier chunks stay
        held even once they leave the window (the cache frees blocks only on
        release).
      `reuse_chunked_release` (per-group arithmetic only): as `reuse_chunked`, but
        history blocks out of the window of the chunk's first query are released
        before the step. NOT implemented by the cache; a bound.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp

from bench import _timing
from pkvattn import cache
from pkvattn.cache import window

PAGE_SIZE = 32
CHUNK_LEN = 8192
PROMPT_LENS = (1024, 2048, 4096, 8192, 16384, 32768)
MAX_PROMPT_LEN = max(PROMPT_LENS)
BYTES_PER_ELEMENT = 2  # bf16
IMPL_SCENARIOS = ("no_reuse", "reuse_1chunk", "reuse_chunked")
PERGROUP_SCENARIOS = IMPL_SCENARIOS + ("reuse_chunked_release",)
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  name: str
  layer_windows: tuple[int, ...]   # window_left per layer, -1 = global
  num_kv_heads: int
  head_dim: int

  @property
  def num_layers(self) -> int:
    return len(self.layer_windows)

  @property
  def layer_block_bytes(self) -> int:
    """Bytes of one block (page_size tokens, K and V) of one layer."""
    return PAGE_SIZE * 2 * self.num_kv_heads * self.head_dim * BYTES_PER_ELEMENT

  @property
  def is_mixed(self) -> bool:
    return any(w < 0 for w in self.layer_windows)


MODELS = (
    ModelSpec("mistral_7b_like_swa4096", (4095,) * 32, num_kv_heads=8, head_dim=128),
    ModelSpec("gemma2_9b_like_local4096_global", (4095, -1) * 21, num_kv_heads=8,
              head_dim=256),
    ModelSpec("gemma3_12b_like_5local1024_1global", ((1023,) * 5 + (-1,)) * 8,
              num_kv_heads=8, head_dim=256),
)


def _chunks(prompt_len: int, chunk_len: int):
  return [(h, min(h + chunk_len, prompt_len)) for h in range(0, prompt_len, chunk_len)]


# ----------------------------------------------------------------------------------
# Arithmetic.


def group_step_slots(group: window.LayerGroup, prompt_len: int, *, chunk_len: int,
                     reuse: bool, release: bool = False) -> list[int]:
  """Slots of `group`'s slot space held during each chunk's step."""
  held_blocks: list[int] = []  # block indices of kept (normal) blocks
  per_step = []
  for history_len, capacity in _chunks(prompt_len, chunk_len):
    plan = window.swa_scratch_plan(
        history_len, capacity, PAGE_SIZE,
        group.window_left if reuse else window.FULL_ATTENTION, group.num_layers)
    if release and group.is_swa:
      # Blocks whose tokens are all < history_len - window_left are out of the window
      # of the chunk's first query (and of every later one).
      held_blocks = [b for b in held_blocks
                     if (b + 1) * PAGE_SIZE > history_len - group.window_left]
    per_step.append(len(held_blocks) + plan.num_step_slots)
    held_blocks += range(plan.scratch_last, plan.end_new_block)
  return per_step


def _settings(prompt_len: int) -> dict[str, dict]:
  return dict(
      no_reuse=dict(chunk_len=prompt_len, reuse=False),
      reuse_1chunk=dict(chunk_len=prompt_len, reuse=True),
      reuse_chunked=dict(chunk_len=CHUNK_LEN, reuse=True),
      reuse_chunked_release=dict(chunk_len=CHUNK_LEN, reuse=True, release=True),
  )


def pergroup_arith(model: ModelSpec, prompt_len: int) -> dict:
  """Per-group slot spaces (TensorRT-LLM style, not implemented here)."""
  groups = window.layer_groups(model.layer_windows, model.num_layers)
  out = dict(groups={})
  for scenario, kwargs in _settings(prompt_len).items():
    steps = [group_step_slots(g, prompt_len, **kwargs) for g in groups]
    # Groups step together (every layer runs every chunk): the model's peak is the
    # max over steps of the layer-weighted sum; each group's pool needs its own max.
    layer_blocks = max(sum(s[t] * g.num_layers for s, g in zip(steps, groups))
                       for t in range(len(steps[0])))
    out[f"pergroup_{scenario}_slots"] = layer_blocks / model.num_layers
    out[f"pergroup_{scenario}_gib"] = layer_blocks * model.layer_block_bytes / GIB
    for g, s in zip(groups, steps):
      key = f"window_left={g.window_left} ({g.num_layers} layers)"
      out["groups"].setdefault(key, {})[f"pergroup_{scenario}_slots"] = max(s)
  return out


def impl_arith(model: ModelSpec, prompt_len: int) -> dict:
  """Implemented cache (one slot space) predicted from `swa_scratch_plan`.

  One group of all layers; its window is the widest SWA window when every layer is
  SWA (`CacheConfig.scratch_window_left`), and full attention (no scratch) as soon
  as one layer is global (`CacheConfig.swa_scratch_active`).
  """
  window_left = (window.FULL_ATTENTION if model.is_mixed
                 else max(model.layer_windows))
  one_space = window.LayerGroup(window_left, tuple(range(model.num_layers)))
  return {f"impl_{scenario}_arith_slots": max(group_step_slots(
              one_space, prompt_len, **_settings(prompt_len)[scenario]))
          for scenario in IMPL_SCENARIOS}


# ----------------------------------------------------------------------------------
# Measurement through the real cache.


def _config(model: ModelSpec, reuse: bool) -> cache.CacheConfig:
  max_pages = MAX_PROMPT_LEN // PAGE_SIZE
  return cache.CacheConfig(
      num_slots=max_pages, page_size=PAGE_SIZE, num_layers=model.num_layers,
      max_seqs=1, max_pages=max_pages, layer_windows=model.layer_windows,
      enable_swa_scratch_reuse=reuse)


def _num_used(state) -> tuple[int, int]:
  s = jax.device_get(cache.stats(state))
  return int(s["num_used"]), int(s["num_scratch"])


def measure(model: ModelSpec, reuse: bool) -> dict[int, dict]:
  """Peak slots in use per prompt length, single chunk and `CHUNK_LEN` chunks.

  One `CacheConfig` per (model, reuse): `claim_batch` and `extend` compile once and
  serve every prompt length (the token array is always `MAX_PROMPT_LEN` wide; the
  lengths are data). A fresh state per run: nothing is published, so no prefix
  reuse interferes.
  """
  cfg = _config(model, reuse)
  seq = jnp.array([0], jnp.int32)
  tokens = jnp.arange(MAX_PROMPT_LEN, dtype=jnp.int32)[None]
  out = {}
  for prompt_len in PROMPT_LENS:
    # Single chunk: the claim allocates the whole prompt (incl. scratch slots).
    state, res = cache.claim_batch(cache.init_cache(cfg), seq, tokens,
                                   jnp.array([prompt_len], jnp.int32))
    if not bool(res.ok[0]):
      raise RuntimeError(f"{model.name} {prompt_len}: claim refused")
    used, scratch = _num_used(state)
    row = dict(single=used, single_scratch_slots=scratch)
    # Chunked: claim the first chunk, then extend by one chunk per step.
    steps, step_scratch = [], []
    state = cache.init_cache(cfg)
    for history_len, capacity in _chunks(prompt_len, CHUNK_LEN):
      if history_len == 0:
        state, res = cache.claim_batch(state, seq, tokens,
                                       jnp.array([capacity], jnp.int32))
      else:
        state, res = cache.extend(state, seq,
                                  jnp.array([capacity - history_len], jnp.int32))
      if not bool(res.ok[0]):
        raise RuntimeError(f"{model.name} {prompt_len}: step to {capacity} refused")
      used, scratch = _num_used(state)
      steps.append(used)
      step_scratch.append(scratch)
    row.update(chunked=max(steps), chunked_steps=steps,
               chunked_step_scratch_slots=step_scratch)
    out[prompt_len] = row
  return out


def model_rows(model: ModelSpec) -> list[dict]:
  t0 = time.perf_counter()
  on, off = measure(model, reuse=True), measure(model, reuse=False)
  wall_s = time.perf_counter() - t0
  rows = []
  for prompt_len in PROMPT_LENS:
    row = dict(model=model.name, num_layers=model.num_layers,
               mixed=model.is_mixed,
               swa_scratch_active=_config(model, True).swa_scratch_active,
               prompt_len=prompt_len, page_size=PAGE_SIZE, chunk_len=CHUNK_LEN,
               num_blocks=-(-prompt_len // PAGE_SIZE))
    measured = dict(no_reuse=max(off[prompt_len]["single"],
                                 off[prompt_len]["chunked"]),
                    reuse_1chunk=on[prompt_len]["single"],
                    reuse_chunked=on[prompt_len]["chunked"])
    for scenario, slots in measured.items():
      row[f"impl_{scenario}_slots"] = slots
      row[f"impl_{scenario}_gib"] = (
          slots * model.num_layers * model.layer_block_bytes / GIB)
    row["impl_no_reuse_single_slots"] = off[prompt_len]["single"]
    row["impl_no_reuse_chunked_slots"] = off[prompt_len]["chunked"]
    row["impl_reuse_1chunk_scratch_slots"] = on[prompt_len]["single_scratch_slots"]
    row["impl_reuse_chunked_steps"] = on[prompt_len]["chunked_steps"]
    row["impl_reuse_chunked_step_scratch_slots"] = on[prompt_len][
        "chunked_step_scratch_slots"]
    row.update(impl_arith(model, prompt_len))
    row.update(pergroup_arith(model, prompt_len))
    for prefix, scenarios in (("impl", IMPL_SCENARIOS),
                              ("pergroup", PERGROUP_SCENARIOS)):
      for scenario in scenarios[1:]:
        row[f"{prefix}_{scenario}_saving_pct"] = 100.0 * (
            1 - row[f"{prefix}_{scenario}_slots"] / row[f"{prefix}_no_reuse_slots"])
    row["measure_wall_s"] = wall_s
    rows.append(row)
  return rows


# ----------------------------------------------------------------------------------
# Checks.


def check_issue_figures() -> None:
  """Refuses to report if the planner misses the issue's worked example."""
  for window_left, slots in ((127, 5), (129, 6)):
    got = window.swa_scratch_plan(0, 1024, 32, window_left, 32).num_step_slots
    if got != slots:
      raise RuntimeError(f"swa_scratch_plan(window_left={window_left}): expected "
                         f"{slots} slots, got {got}")


def check_measured(rows: list[dict]) -> None:
  """Measured == one-slot-space arithmetic everywhere; for an all-SWA model (one
  group) that is also the per-group figure, so the two kinds agree there."""
  bad = []
  for r in rows:
    for scenario in IMPL_SCENARIOS:
      got, want = r[f"impl_{scenario}_slots"], r[f"impl_{scenario}_arith_slots"]
      if got != want:
        bad.append(f"{r['model']} {r['prompt_len']} {scenario}: measured {got}, "
                   f"one-slot-space arithmetic {want}")
      if not r["mixed"] and got != r[f"pergroup_{scenario}_slots"]:
        bad.append(f"{r['model']} {r['prompt_len']} {scenario}: measured {got}, "
                   f"per-group arithmetic {r[f'pergroup_{scenario}_slots']}")
    if r["mixed"] and r["impl_reuse_1chunk_slots"] != r["impl_no_reuse_slots"]:
      bad.append(f"{r['model']} {r['prompt_len']}: mixed model saved slots")
  if bad:
    raise RuntimeError("measured peaks disagree:\n  " + "\n  ".join(bad))


# ----------------------------------------------------------------------------------
# Output.


def plot(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.ticker
  import matplotlib.pyplot as plt

  chunk = f"{CHUNK_LEN // 1024}k chunks"
  series = (  # (key, label, color, marker, linestyle, linewidth, markersize)
      ("impl_no_reuse", "implemented, no reuse (measured)", "k", "o", "-", 2.2, 8),
      ("impl_reuse_1chunk", "implemented, reuse, 1 chunk (measured)", "tab:blue",
       "s", "-", 2.2, 6.5),
      ("impl_reuse_chunked", f"implemented, reuse, {chunk} (measured)",
       "tab:orange", "^", "-", 2.2, 5),
      ("pergroup_no_reuse", "per-group, no reuse (arithmetic)", "k", "o", "--", 1.1,
       3),
      ("pergroup_reuse_1chunk", "per-group, reuse, 1 chunk (arithmetic)",
       "tab:blue", "s", "--", 1.1, 3),
      ("pergroup_reuse_chunked", f"per-group, reuse, {chunk} (arithmetic)",
       "tab:orange", "^", "--", 1.1, 3),
      ("pergroup_reuse_chunked_release",
       f"per-group, reuse, {chunk} + release old blocks* (arithmetic)",
       "tab:green", "v", ":", 1.1, 3),
  )
  fig, axes = plt.subplots(1, len(MODELS), figsize=(6 * len(MODELS), 5.6))
  for ax, model in zip(axes, MODELS):
    mrows = [r for r in rows if r["model"] == model.name]
    xs = [r["prompt_len"] for r in mrows]
    for key, label, color, marker, ls, lw, ms in series:
      ax.plot(xs, [r[f"{key}_slots"] for r in mrows], color=color, marker=marker,
              ls=ls, lw=lw, ms=ms, label=label)
    for r in mrows:
      for key, color, dy in (("impl_reuse_1chunk", "tab:blue", -14),
                             ("pergroup_reuse_1chunk", "tab:blue", -14)):
        pct = r[f"{key}_saving_pct"]
        if pct > 0.5 and (key.startswith("impl") or model.is_mixed):
          ax.annotate(f"-{pct:.0f}%", (r["prompt_len"], r[f"{key}_slots"]),
                      textcoords="offset points", xytext=(0, dy), ha="center",
                      fontsize=8, color=color,
                      fontstyle="normal" if key.startswith("impl") else "italic")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda y, _: f"{y:g}"))
    ax.set_xticks(xs, [f"{x // 1024}k" for x in xs])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("peak slots of the sequence (log scale; slot = 32 tokens "
                  "of every layer)", fontsize=8.5)
    gib_per_slot = model.num_layers * model.layer_block_bytes / GIB
    sec = ax.secondary_yaxis(
        "right", functions=(lambda s, k=gib_per_slot: s * k,
                            lambda g, k=gib_per_slot: g / k))
    sec.set_ylabel("GiB (bf16)", fontsize=8.5)
    sec.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=2))
    sec.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda y, _: f"{y:g}"))
    sec.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    windows = sorted({w for w in model.layer_windows if w >= 0})
    num_swa = sum(w >= 0 for w in model.layer_windows)
    ax.set_title(f"{model.name}\n{num_swa}/{model.num_layers} layers SWA "
                 f"(window_left {', '.join(map(str, windows))}), page_size "
                 f"{PAGE_SIZE}", fontsize=10)
    note = ("mixed model: implemented cache takes NO scratch\n"
            "(global layers hold every block of the one slot space);\n"
            "solid lines coincide, dashed = per-group pools (not implemented)"
            if model.is_mixed else
            "all SWA: one layer group, so measured (solid) =\n"
            "per-group arithmetic (dashed)")
    # Mixed panels: the upper left is empty; the all-SWA panel has the legend there.
    xy, ha, va = ((0.02, 0.97), "left", "top") if model.is_mixed else (
        (0.98, 0.03), "right", "bottom")
    ax.text(*xy, note, transform=ax.transAxes, ha=ha, va=va,
            fontsize=7.5, bbox=dict(facecolor="white", alpha=0.85, lw=0.5))
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7, loc="upper left")
  fig.suptitle("SWA scratch-slot reuse: peak KV slots of one sequence during prefill\n"
               "solid: implemented cache (one slot space), measured through "
               "claim_batch/extend; dashed: per-group slot spaces (TensorRT-LLM "
               "style, not implemented here), arithmetic", fontsize=9.5)
  fig.text(0.01, 0.01, "* releasing out-of-window history blocks is implemented by "
           "neither; shown as a bound. -x%: saving of the 1-chunk prefill vs no "
           "reuse (upright: measured; italic: per-group arithmetic).", fontsize=7.5)
  fig.tight_layout(rect=(0, 0.03, 1, 0.97))
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main() -> None:
  check_issue_figures()
  rows = [r for m in MODELS for r in model_rows(m)]
  check_measured(rows)
  print("Implemented cache (ONE slot space: a slot holds a block of every layer), "
        "MEASURED through claim_batch/extend, peak slots.\nMixed models (any global "
        "layer) take no scratch: a block stale for the SWA layers is still needed "
        "by the global ones,\nso its slot cannot be freed; reuse on == reuse off "
        "for them. Only all-SWA models save.")
  _timing.print_table(rows, [
      "model", "prompt_len", "impl_no_reuse_slots", "impl_reuse_1chunk_slots",
      "impl_reuse_1chunk_saving_pct", "impl_reuse_chunked_slots",
      "impl_reuse_chunked_saving_pct"])
  print("\nPer-group slot spaces (TensorRT-LLM style, NOT implemented here), "
        "ARITHMETIC, full-model slot equivalents.\nFor the all-SWA model this "
        "equals the measured figures above; for mixed models it is what a per-group "
        "pool would save.")
  _timing.print_table(rows, [
      "model", "prompt_len", "pergroup_no_reuse_slots", "pergroup_reuse_1chunk_slots",
      "pergroup_reuse_1chunk_saving_pct", "pergroup_reuse_chunked_slots",
      "pergroup_reuse_chunked_saving_pct", "pergroup_reuse_chunked_release_slots",
      "pergroup_reuse_chunked_release_saving_pct"])
  print()
  for r in rows:
    if len(r["groups"]) > 1 and r["prompt_len"] == MAX_PROMPT_LEN:
      print("per-group peaks per pool:", r["model"], r["prompt_len"], r["groups"])
  extra = dict(
      page_size=PAGE_SIZE, chunk_len=CHUNK_LEN, bytes_per_element=BYTES_PER_ELEMENT,
      units=dict(slots="full-model slot equivalents (page_size tokens of every "
                 "layer, K and V)", gib="2**30 bytes"),
      implemented=("impl_*: measured through pkvattn.cache (one slot space; mixed "
                   "models take no scratch, so they save nothing)"),
      per_group=("pergroup_*: arithmetic for per-group slot spaces (TensorRT-LLM "
                 "style), not implemented here"),
      description=__doc__,
      models=[dataclasses.asdict(m) for m in MODELS],
  )
  paths = _timing.write_results("swa_report", rows, extra)
  os.makedirs("bench/results", exist_ok=True)
  png = "bench/results/swa_report.png"
  plot(rows, png)
  print("wrote", *paths, png)


if __name__ == "__main__":
  main()
