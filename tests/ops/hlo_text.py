"""Reading XLA's compiled HLO text: which unfused ops make an array of a
given size.

The in-place tests (`test_fp8_pool_traffic.py`, `test_step_pool_in_place.py`)
compile a step that is given the KV pool and read `compiled.as_text()`:
every unfused instruction whose result is pool-sized must be a view, the
loop carry (`VIEW_OPS`) or an in-place scatter, never a copy or a
conversion of the whole pool. `materialized` lists those instructions.
"""

from __future__ import annotations

import math
import re

# Ops that make no pass over the pool: views and the loop carry.
VIEW_OPS = ("parameter", "bitcast", "get-tuple-element", "tuple", "while")


def materialized(text: str, num_elements: int) -> list[str]:
  """Instructions of a compiled module's unfused computations (the entry,
  loop bodies) whose result holds `num_elements` elements, as `"opcode
  name"`. Ops inside fusions are left out: a convert fused into a gather
  runs per gathered element."""
  blocks = text.split("\n\n")
  fused = set(re.findall(r"fusion\(.*?calls=(%[\w.-]+)", text))
  found = []
  for block in blocks:
    head = block.lstrip().split(" ", 2)
    name = head[1] if head[0] == "ENTRY" else head[0]
    if not name.startswith("%") or name in fused:
      continue
    for line in block.splitlines()[1:]:
      m = re.match(r"\s*(?:ROOT )?(%\S+) = \w+\[([\d,]*)\]\S* (\S+?)\(", line)
      if m and m.group(2) and math.prod(
          int(x) for x in m.group(2).split(",")) == num_elements:
        found.append(f"{m.group(3)} {m.group(1)}")
  return found
