"""Every row of the dispatch tables in docs/kernels.md against `dispatch`.

Each op's table sits between `<!-- dispatch:OP -->` and `<!-- /dispatch:OP -->`
markers. Its columns are keyword arguments of `pallas_kernels.dispatch.OP`
(values: `hopper` / `ada` / `ampere` / `interpret` for `gpu`, dtype names,
integers, `true` / `false`, `-` for None), then `backend` (asserted) and
optionally `config` (`field=value` pairs, asserted on the chosen config). A
column whose header is in parentheses is prose for the reader and is not
passed.
"""

from __future__ import annotations

import os
import re

import jax.numpy as jnp
import pytest

from pkvattn.pallas_kernels import dispatch

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "docs", "kernels.md")
OPS = ("decode", "prefill", "rope_append", "sample_floor")
DTYPES = {"f32": jnp.float32, "float32": jnp.float32,
          "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
          "f16": jnp.float16, "float16": jnp.float16,
          "e4m3": jnp.float8_e4m3fn, "float8_e4m3fn": jnp.float8_e4m3fn}


def _value(text: str):
  text = text.strip().strip("`")
  if text in dispatch.GPUS:
    return dispatch.GPUS[text]
  if text in DTYPES:
    return jnp.dtype(DTYPES[text])
  if text in ("-", "None"):
    return None
  if text in ("true", "false"):
    return text == "true"
  if re.fullmatch(r"-?\d+", text):
    return int(text)
  return text


def _cells(line: str) -> list[str]:
  return [c.strip() for c in line.strip().strip("|").split("|")]


def table_rows(op: str, path: str = DOC) -> list[dict[str, str]]:
  """The rows of `op`'s table in `path` as {header: cell} dicts."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  m = re.search(rf"<!-- dispatch:{op} -->(.*?)<!-- /dispatch:{op} -->", text,
                re.S)
  assert m, f"docs/kernels.md has no dispatch:{op} table"
  lines = [ln for ln in m.group(1).splitlines() if ln.strip().startswith("|")]
  header = _cells(lines[0])
  assert set(_cells(lines[1])) <= {"---", ":---", "---:", ":---:"} or all(
      set(c) <= set("-: ") for c in _cells(lines[1])), lines[1]
  rows = [dict(zip(header, _cells(ln))) for ln in lines[2:]]
  assert rows, f"the dispatch:{op} table has no rows"
  return rows


def _cases():
  for op in OPS:
    for i, row in enumerate(table_rows(op)):
      yield pytest.param(op, row, id=f"{op}-{i}")


def _parse_config(text: str) -> dict:
  if text.strip() in ("", "-"):
    return {}
  pairs = [p.strip() for p in text.strip("`").split(",") if p.strip()]
  out = {}
  for pair in pairs:
    key, _, value = pair.partition("=")
    out[key.strip()] = _value(value)
  return out


@pytest.mark.parametrize("op, row", list(_cases()))
def test_dispatch_table_row(op, row):
  kwargs = {k: _value(v) for k, v in row.items()
            if k not in ("backend", "config") and not k.startswith("(")}
  choice = getattr(dispatch, op)(**kwargs)
  assert isinstance(choice, dispatch.Choice)
  assert choice.backend == row["backend"].strip("`"), (kwargs, choice)
  for field, expected in _parse_config(row.get("config", "")).items():
    actual = getattr(choice.config, field)
    assert actual == expected, (field, actual, expected, choice)


def test_every_op_has_a_table():
  for op in OPS:
    assert callable(getattr(dispatch, op)), op
    assert table_rows(op)


def _is_pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def test_pow2_at_least_is_the_smallest_power_of_two_not_below():
  for x in range(-3, 300):
    want = 1
    while want < x:
      want *= 2
    assert dispatch._pow2_at_least(x) == want, x  # noqa: SLF001


@pytest.mark.parametrize("per_sm", [2, 4])
@pytest.mark.parametrize("pages_per_block", [1, 2, 4, 8])
def test_decode_splits_keep_two_steps_each(per_sm, pages_per_block):
  """A power of two, at most 64, at most the programs per SM asked for
  (rounded up to a power of two), every split >= 2 steps of the longest
  sequence; and the largest such (doubling it breaks one of those)."""
  sms = dispatch.DECODE_NUM_SMS
  for programs in [1, 2, 3, 7, 64, 131, 132, 264, 265, 528, 1000, 5000]:
    want = dispatch._pow2_at_least(-(-per_sm * sms // programs))
    for max_pages in [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 63, 64, 65,
                      255, 256, 1000, 4096, 65536]:
      s = dispatch._decode_splits(programs, max_pages, pages_per_block,
                                  per_sm=per_sm, num_sms=sms)
      steps = max(1, -(-max_pages // pages_per_block))
      case = (programs, max_pages, s)
      assert _is_pow2(s) and s <= min(64, want), case
      assert s == 1 or 2 * s <= steps, case
      assert s in (64, want) or 4 * s > steps, case


@pytest.mark.parametrize("ctas_per_sm", [1.25, 2.5])
@pytest.mark.parametrize("pages_per_round", [1, 2, 4, 8])
def test_mma_splits_nearest_power_of_two_with_two_rounds_each(
    ctas_per_sm, pages_per_round):
  """The power of two nearest the CTAs per SM asked for (within a factor of
  sqrt(2)), halved only as far as every split keeps >= 2 rounds, at most
  64."""
  sms = dispatch.DECODE_NUM_SMS
  for items in [1, 2, 3, 5, 8, 24, 64, 100, 165, 330, 331, 1000, 4096]:
    want = ctas_per_sm * sms / items
    for max_pages in [0, 1, 2, 3, 4, 5, 8, 16, 17, 64, 256, 1024, 65536]:
      s = dispatch._mma_splits(items, max_pages,
                               pages_per_round=pages_per_round,
                               ctas_per_sm=ctas_per_sm, num_sms=sms)
      rounds = max(1, -(-max_pages // pages_per_round))
      case = (items, max_pages, s)
      assert _is_pow2(s) and s <= 64, case
      assert s == 1 or 2 * s <= rounds, case
      if s < 64 and 4 * s <= rounds:  # not capped: the nearest power of two
        assert max(want, 1) / 2 ** 0.5 <= s <= max(want, 1) * 2 ** 0.5, case



@pytest.mark.parametrize("gpu", ["hopper", "ampere", "interpret"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_prefill_plan_fields_ignore_the_window(gpu, dtype):
  """A model of local and global layers plans each step once, for one of
  its windows (`models.decoder`), and every layer's call takes that plan:
  so over 16-bit pages the window changes none of the config fields a plan
  is checked against (`paged_prefill` re-plans a call whose config differs
  in them), only how the layer runs it (`persistent` at head_dim 128)."""
  def plan_fields(window_left, **kw):
    c = dispatch.prefill(gpu=dispatch.GPUS[gpu], dtype=dtype, kv_dtype=None,
                         window_left=window_left, **kw).config
    return (c.block_q, c.short_block_q, c.plan_align, c.split_decode_rows,
            c.decode_rows_per_seq)
  for head_dim in (64, 128, 256):
    for group_size in (1, 2, 4, 8):
      for num_tokens, batch_size in ((16, 1), (4096, 1), (4096, 256),
                                     (8192, 8), (512, 64), (20000, 2)):
        kw = dict(head_dim=head_dim, group_size=group_size, page_size=None,
                  num_tokens=num_tokens, batch_size=batch_size)
        for window_left in (0, 511, 4095):
          assert plan_fields(window_left, **kw) == plan_fields(-1, **kw), (
              kw, window_left)
