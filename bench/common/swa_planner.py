"""Predicted KV slots of one sequence, per window group, step by step.

Pure Python arithmetic (no cache state, no JAX): what `pkvattn.cache` should
hold for ONE sequence that is prefilled (in one chunk or in fixed-size
chunks) and then decodes token by token. `bench/swa_report.py` checks these
figures against the real `claim_batch` / `extend` and refuses to write its
report where they differ; `tests/bench/test_swa_report.py` checks them
against a token-level brute force.

Steps of a run (`run_steps`), one sequence, `P` prompt tokens, chunks of `C`
tokens (`C = P`: one chunk), `D` decode tokens:

  * step 0, `claim_batch` of the first chunk: tokens `0 .. min(C, P)`;
  * one `extend` per further chunk: history `h = k * C` to `min(h + C, P)`,
    `num_computed = h` (every earlier token is written);
  * one `extend` of 1 token per decode step: history `h = P + i` to `h + 1`,
    `num_computed = h`.

Slots of a group right after a step's allocation (the step's peak: `extend`
releases first, then allocates), for a group of `L` layers with window
`window_left = w` (`-1` = global) and `page_size = ps`:

    held + swa_scratch_plan(h, capacity, ps, w if scratch else -1, L).num_step_slots

`held` counts the group's normal blocks of earlier steps still kept. A
per-window-group slot space releases at every `extend` the blocks wholly
before `num_computed - w` (`cut = max(num_computed - w, 0) // ps` blocks):
`held` = earlier normal blocks `>= cut`. A global group keeps every block.
With `release=False` (one slot space shared by all layers, as the flat
`CacheConfig`: it releases nothing before `release`) every earlier normal
block stays. Scratch slots of a step go back at the next `extend`, so they
never count in `held`.

Units: slots of the group's own slot space (one slot = `ps` tokens of each of
the group's `L` layers, K and V); `layer_blocks` = slots x `L`.
"""

from __future__ import annotations

import dataclasses

from pkvattn.cache import swa_scratch_plan

FULL_ATTENTION = -1


@dataclasses.dataclass(frozen=True)
class Scenario:
  """One sequence's run.

  Attributes:
    prompt_len: prompt tokens `P`, `>= 1`.
    chunk_len: prefill chunk `C` in tokens; `None` or `>= prompt_len` = the
      whole prompt in one `claim_batch`.
    num_decode: decode tokens `D` (one `extend` of 1 token each), `>= 0`.
    page_size: tokens per block, `>= 1`.
  """
  prompt_len: int
  chunk_len: int | None
  num_decode: int
  page_size: int

  def __post_init__(self):
    for name in ("prompt_len", "page_size"):
      if getattr(self, name) < 1:
        raise ValueError(
            f"Invalid {name}: expected >= 1, got {getattr(self, name)}")
    if self.num_decode < 0:
      raise ValueError(
          f"Invalid num_decode: expected >= 0, got {self.num_decode}")
    if self.chunk_len is not None and self.chunk_len < 1:
      raise ValueError(
          f"Invalid chunk_len: expected >= 1 or None, got {self.chunk_len}")

  @property
  def chunk(self) -> int:
    """Effective chunk length in tokens."""
    return min(self.chunk_len or self.prompt_len, self.prompt_len)


def run_steps(scenario: Scenario) -> list[tuple[int, int, int]]:
  """`(history_len, capacity, num_computed)` of every step, in order.

  Step 0 is the `claim_batch` (history 0); the others are `extend`s (module
  docstring).
  """
  P, C = scenario.prompt_len, scenario.chunk
  out = [(h, min(h + C, P), h) for h in range(0, P, C)]
  out += [(P + i, P + i + 1, P + i) for i in range(scenario.num_decode)]
  return out


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def group_steps(window_left: int, num_layers: int, scenario: Scenario, *,
                scratch: bool, release: bool = True) -> list[dict]:
  """Per step, what a group of `num_layers` layers with `window_left` holds.

  Args:
    window_left: the group's window (`-1` = global: no release, no scratch).
    num_layers: layers of the group (`L`): a scratch slot serves `L` blocks.
    scenario: the run.
    scratch: SWA scratch reuse on (`enable_swa_scratch_reuse`).
    release: the slot space releases blocks out of reach at each `extend`
      (per-window-group spaces); False = a flat one-slot-space cache.

  Returns:
    One dict per step of `run_steps`: `slots` (held + the step's new slots:
    the measured `num_used`), `scratch_slots`, `scratch_blocks`,
    `kept_blocks` (normal blocks held during the step: earlier ones still
    kept + the step's normal new ones).

  Raises:
    ValueError: `num_layers < 1` or `window_left < -1`.
  """
  if num_layers < 1 or window_left < -1:
    raise ValueError(
        f"Invalid group: expected num_layers >= 1 and window_left >= -1, got "
        f"{num_layers=}, {window_left=}")
  ps = scenario.page_size
  sliding = window_left != FULL_ATTENTION
  ranges: list[list[int]] = []  # held normal blocks, as merged [lo, hi)
  out = []
  for history_len, capacity, num_computed in run_steps(scenario):
    if sliding and release:
      cut = max(num_computed - window_left, 0) // ps
      ranges = [[max(lo, cut), hi] for lo, hi in ranges if hi > cut]
    held = sum(hi - lo for lo, hi in ranges)
    plan = swa_scratch_plan(
        history_len, capacity, ps,
        window_left if (scratch and sliding) else FULL_ATTENTION, num_layers)
    out.append(dict(
        slots=held + plan.num_step_slots,
        scratch_slots=plan.num_scratch_slots,
        scratch_blocks=plan.num_scratch_blocks,
        kept_blocks=held + plan.num_normal_blocks))
    lo, hi = plan.scratch_last, plan.end_new_block
    if hi > lo:
      if ranges and ranges[-1][1] == lo:
        ranges[-1][1] = hi
      else:
        ranges.append([lo, hi])
  return out


def group_step_slots(window_left: int, num_layers: int, scenario: Scenario, *,
                     scratch: bool, release: bool = True) -> list[int]:
  """`num_used` of the group right after each step (`group_steps`)."""
  return [s["slots"] for s in group_steps(window_left, num_layers, scenario,
                                          scratch=scratch, release=release)]


def window_groups(layer_windows) -> dict[int, int]:
  """`{window_left: number of layers}` of a model (`-1` = global)."""
  out: dict[int, int] = {}
  for w in layer_windows:
    out[int(w)] = out.get(int(w), 0) + 1
  return out


def plan_run(layer_windows, scenario: Scenario, *, scratch: bool,
             release: bool = True) -> dict:
  """Every group's slots per step and the model's layer-block figures.

  Args:
    layer_windows: `window_left` per model layer.
    scenario, scratch, release: as `group_steps`.

  Returns:
    dict with `group_steps` (`{window_left: [slots per step]}`),
    `group_peak_slots` (`{window_left: max slots}`),
    `peak_layer_blocks` (max over steps of `sum_g slots_g * L_g`: the
    sequence's peak), `pool_layer_blocks` (`sum_g peak_g * L_g`: what static
    per-group pools must hold) and `floor_layer_blocks` (max over steps of
    `sum_g kept_g * L_g + scratch_blocks_g`: the blocks that a query of the
    running layer or a future query can see, scratch counted for the one
    running layer, i.e. without rounding scratch up to whole slots).
  """
  groups = window_groups(layer_windows)
  per = {w: group_steps(w, n, scenario, scratch=scratch, release=release)
         for w, n in groups.items()}
  num_steps = len(run_steps(scenario))
  steps = {w: [s["slots"] for s in v] for w, v in per.items()}
  return dict(
      group_steps=steps,
      group_peak_slots={w: max(v) for w, v in steps.items()},
      peak_layer_blocks=max(sum(steps[w][t] * groups[w] for w in groups)
                            for t in range(num_steps)),
      pool_layer_blocks=sum(max(steps[w]) * groups[w] for w in groups),
      floor_layer_blocks=max(
          sum(per[w][t]["kept_blocks"] * groups[w] + per[w][t]["scratch_blocks"]
              for w in groups) for t in range(num_steps)),
  )


def flat_step_slots(scenario: Scenario) -> list[int]:
  """A flat all-global cache: `cdiv(capacity, page_size)` slots per step."""
  return [_cdiv(cap, scenario.page_size) for _, cap, _ in run_steps(scenario)]
