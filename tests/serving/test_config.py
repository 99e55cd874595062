"""`pkvattn.serving.config`: `EngineConfig`'s checks, its derived sizes, and
the cache sizes an engine config implies for a model.

Host-only (no program runs): each rejected value is the nearest one past a
bound (0 where the bound is "positive", -1 where it is ">= 0", one past
`max_seqs`), each accepted one the bound itself, and the error names the
field. Sizes are checked against their definitions written out here
(bytes of a slot, a pool's pages), not against the module's own helpers.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from pkvattn import cache as pcache
from pkvattn.models.tiny import TINY_CONFIGS
from pkvattn.serving import config as sc
from pkvattn.serving.config import EngineConfig

LLAMA = TINY_CONFIGS["tiny-llama"]      # two global layers
GEMMA3 = TINY_CONFIGS["tiny-gemma3"]    # windows (15, 15, -1)

POSITIVE_INTS = ("page_size", "num_slots", "max_seqs", "max_num_tokens",
                 "max_model_len")


def _ok(**kw) -> EngineConfig:
  return EngineConfig(**kw)


def _bad(field: str, **kw) -> None:
  with pytest.raises(ValueError, match=f"Invalid {field}"):
    EngineConfig(**kw)


@pytest.mark.parametrize("field", POSITIVE_INTS)
@pytest.mark.parametrize("value", [0, -1, 1.0, True, "8", None])
def test_sizes_must_be_positive_ints(field, value):
  _bad(field, **{field: value})


@pytest.mark.parametrize("field", POSITIVE_INTS)
def test_sizes_of_one_are_valid(field):
  # A step of one token needs one row: max_num_tokens >= max_seqs.
  kw = {field: 1}
  if field == "max_num_tokens":
    kw["max_seqs"] = 1
  assert getattr(_ok(**kw), field) == 1


@pytest.mark.parametrize("page_size", [1, 2, 8, 16, 64, 1024])
def test_power_of_two_page_sizes(page_size):
  assert _ok(page_size=page_size).page_size == page_size


@pytest.mark.parametrize("page_size", [3, 6, 12, 24, 48, 1000])
def test_other_page_sizes_are_refused(page_size):
  _bad("page_size", page_size=page_size)


def test_the_token_budget_holds_a_token_per_row():
  assert _ok(max_seqs=8, max_num_tokens=8).max_num_tokens == 8
  with pytest.raises(ValueError, match="max_num_tokens: expected >= "
                     "max_seqs=8, got 7"):
    EngineConfig(max_seqs=8, max_num_tokens=7)


@pytest.mark.parametrize("field,good,bad", [
    ("max_admit", [None, 1, 8], [0, -1, 1.5]),
    ("decode_steps", [1, 8], [0, -1, True, 2.0]),
    ("kv_cache_memory", [None, 1, 1 << 30], [0, -1, True, 1.5]),
    ("finished_history", [0, 1, 4096], [-1, True, 1.5]),
    ("host_kv_cache_bytes", [0, 1, 1 << 20], [-1, True, 1.5]),
    ("calibration_tokens", [1, 512], [0, -1, True]),
    ("impl", [None, "pallas", "xla"], ["cuda", "triton", ""]),
    ("token_buckets", [None, (1,), (4, 256), (300,)], [(0,), (4, -1)]),
    ("group_num_slots", [None, (8,), (8, 1)],
     [[8, 8], (0,), (8, -1), (True,), (8.0,)]),
])
def test_field_bounds(field, good, bad):
  for value in good:
    assert getattr(_ok(**{field: value}), field) == value, value
  for value in bad:
    _bad(field, **{field: value})


def test_burst_rows_lie_in_one_to_max_seqs():
  for rows in [(1,), (8,), (1, 4, 8)]:
    assert _ok(max_seqs=8, burst_rows=rows).burst_rows == rows
  for rows in [(), (0,), (9,), (4, 9), [4], (True,), (4.0,)]:
    with pytest.raises(ValueError, match=r"burst_rows: .*\[1, max_seqs=8\]"):
      EngineConfig(max_seqs=8, burst_rows=rows)


def test_kv_cache_dtype_and_its_alias():
  assert _ok().kv_cache_dtype == "auto"
  assert _ok(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
  assert _ok(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
  for value in ("bf16", "fp8_e5m2", "FP8"):
    _bad("kv_cache_dtype", kv_cache_dtype=value)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_fp8_scales(name):
  other = "v_scale" if name == "k_scale" else "k_scale"
  fp8 = dict(kv_cache_dtype="fp8")
  for value in (1, 0.5, 1e-6, 448.0):
    assert getattr(_ok(**fp8, **{name: value, other: 1.0}), name) == value
  for value in (0, 0.0, -1.0, math.inf, math.nan, "1.0"):
    _bad(name, **fp8, **{name: value, other: 1.0})
  # Scales apply to FP8 pages only; one without the other is refused.
  with pytest.raises(ValueError, match=f"Invalid {name}: expected None with "
                     "kv_cache_dtype='auto'"):
    EngineConfig(**{name: 1.0})
  with pytest.raises(ValueError, match="k_scale / v_scale: expected both"):
    EngineConfig(**fp8, **{name: 1.0})


def test_kv_scales_per_head_needs_fp8_pages():
  assert _ok(kv_cache_dtype="fp8", kv_scales="per_head").kv_scales == "per_head"
  assert _ok(kv_scales="per_tensor").kv_scales == "per_tensor"
  with pytest.raises(ValueError, match="kv_scales: expected 'per_tensor' "
                     "with kv_cache_dtype='auto'"):
    EngineConfig(kv_scales="per_head")
  for value in ("per_token", "per_channel", None):
    _bad("kv_scales", kv_cache_dtype="fp8", kv_scales=value)


def test_host_tier_needs_prefix_reuse():
  assert _ok(host_kv_cache_bytes=0,
             enable_prefix_reuse=False).host_kv_cache_bytes == 0
  with pytest.raises(ValueError, match="host_kv_cache_bytes: the host tier "
                     "keeps prefix-cache blocks"):
    EngineConfig(host_kv_cache_bytes=1, enable_prefix_reuse=False)


@pytest.mark.parametrize("max_seqs,max_num_tokens,token_buckets,want", [
    (8, 256, None, (8, 256)),
    (256, 256, None, (256,)),
    # Past the budget a bucket is the budget; repeats collapse; the budget
    # is always a bucket.
    (8, 256, (16, 4, 16, 1024), (4, 16, 256)),
    (8, 256, (256,), (256,)),
    (1, 1, (5,), (1,)),
])
def test_step_buckets(max_seqs, max_num_tokens, token_buckets, want):
  cfg = _ok(max_seqs=max_seqs, max_num_tokens=max_num_tokens,
            token_buckets=token_buckets)
  assert cfg.buckets == want


@pytest.mark.parametrize("max_seqs,burst_rows,want", [
    (256, None, (64, 256)),
    (64, None, (64,)),
    (65, None, (64, 65)),
    (8, None, (8,)),
    (256, (128, 16, 128), (16, 128, 256)),
    (8, (8,), (8,)),
])
def test_burst_buckets(max_seqs, burst_rows, want):
  cfg = _ok(max_seqs=max_seqs, max_num_tokens=max(256, max_seqs),
            burst_rows=burst_rows)
  assert cfg.burst_buckets == want


@pytest.mark.parametrize("max_model_len,page_size", [
    (1, 16), (16, 16), (17, 16), (1024, 16), (1000, 64), (5, 1)])
def test_pages_of_a_sequence_and_claims_per_step(max_model_len, page_size):
  cfg = _ok(max_model_len=max_model_len, page_size=page_size)
  assert cfg.max_pages == math.ceil(max_model_len / page_size)
  assert cfg.max_pages * page_size >= max_model_len > (
      cfg.max_pages - 1) * page_size
  assert _ok(max_seqs=8).num_admit == 8
  assert _ok(max_seqs=8, max_admit=3).num_admit == 3


def test_kv_dtype():
  assert sc.kv_dtype(_ok(), jnp.bfloat16) == jnp.bfloat16
  assert sc.kv_dtype(_ok(), jnp.float32) == jnp.float32
  assert sc.kv_dtype(_ok(kv_cache_dtype="fp8"),
                     jnp.bfloat16) == jnp.float8_e4m3fn


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn,
                                   jnp.float32])
@pytest.mark.parametrize("page_size,max_model_len", [(16, 1024), (8, 100)])
def test_slots_for_memory(dtype, page_size, max_model_len):
  # A slot holds a page of every layer, K and V.
  slot_bytes = (LLAMA.num_layers * 2 * page_size * LLAMA.num_kv_heads
                * LLAMA.head_dim * np.dtype(dtype).itemsize)
  pages = -(-max_model_len // page_size)

  def slots(memory):
    cfg = _ok(page_size=page_size, max_model_len=max_model_len,
              kv_cache_memory=memory)
    return sc.slots_for_memory(cfg, LLAMA, dtype)

  # Whole slots only; the smallest pool holds one sequence.
  assert slots(pages * slot_bytes) == pages
  assert slots(pages * slot_bytes + slot_bytes - 1) == pages
  assert slots(1000 * slot_bytes + 1) == 1000
  with pytest.raises(ValueError, match=f"kv_cache_memory: .* hold {pages - 1}"
                     f" slots .* max_model_len={max_model_len} needs "
                     rf"\({pages}\)"):
    slots(pages * slot_bytes - 1)
  # The largest pool whose page ids fit int32 (num_slots * num_layers * 2 <
  # 2**31), to the byte; one slot more is refused.
  most = (2**31 - 1) // (2 * LLAMA.num_layers)
  assert slots(most * slot_bytes + slot_bytes - 1) == most
  with pytest.raises(ValueError, match=(
      rf"Invalid kv_cache_memory: expected at most {most * slot_bytes} bytes "
      rf"\({most} slots of {LLAMA.num_layers} layers x "
      rf"{slot_bytes // LLAMA.num_layers} bytes: the pool's page ids are "
      rf"int32\), got {(most + 1) * slot_bytes}")):
    slots((most + 1) * slot_bytes)
  pcache.CacheConfig(num_slots=most, page_size=page_size,
                     num_layers=LLAMA.num_layers, max_seqs=1, max_pages=1)
  with pytest.raises(ValueError, match="Invalid num_slots"):
    pcache.CacheConfig(num_slots=most + 1, page_size=page_size,
                       num_layers=LLAMA.num_layers, max_seqs=1, max_pages=1)


def test_fp8_pages_hold_twice_the_slots_of_bf16():
  cfg = _ok(kv_cache_memory=1 << 26)
  assert sc.slots_for_memory(cfg, LLAMA, jnp.float8_e4m3fn) == (
      2 * sc.slots_for_memory(cfg, LLAMA, jnp.bfloat16))


def test_one_slot_space_for_one_window():
  cfg = _ok(num_slots=100, page_size=8, max_seqs=4, max_model_len=100,
            hash_ways=4)
  cc = sc.cache_config(cfg, LLAMA)
  assert isinstance(cc, pcache.CacheConfig)
  assert (cc.num_slots, cc.page_size, cc.num_layers, cc.max_seqs,
          cc.max_pages, cc.hash_ways, cc.layer_windows) == (
              100, 8, LLAMA.num_layers, 4, 13, 4, (-1,) * LLAMA.num_layers)
  assert not cc.enable_swa_scratch_reuse
  assert sc.group_slots(cc) == (100,)
  assert sc.num_pool_pages(cc) == 100 * LLAMA.num_layers * 2
  # Scratch reuse needs a sliding layer.
  assert not sc.cache_config(
      _ok(enable_swa_scratch_reuse=True), LLAMA).enable_swa_scratch_reuse
  with pytest.raises(ValueError, match="group_num_slots: expected None with "
                     "one slot space"):
    sc.cache_config(_ok(group_num_slots=(8,)), LLAMA)


def test_window_groups_by_default_for_mixed_windows():
  cfg = _ok(num_slots=256, max_seqs=4, max_model_len=512)
  cc = sc.cache_config(cfg, GEMMA3)
  assert isinstance(cc, pcache.HybridCacheConfig)
  assert cc.layer_windows == GEMMA3.windows
  assert [g.window_left for g in cc.groups] == [-1, 15]
  # The budget's split: the sliding group keeps what its sequences can see,
  # so it has fewer slots than the global one, which has at least the flat
  # pool's num_slots; the pool is no larger than the flat one.
  glob, slide = sc.group_slots(cc)
  assert slide < glob and glob >= 256
  assert sc.num_pool_pages(cc) == glob * 1 * 2 + slide * 2 * 2
  assert sc.num_pool_pages(cc) <= 256 * GEMMA3.num_layers * 2
  # Given per-group slots are kept as they are.
  given = sc.cache_config(dataclasses.replace(cfg, group_num_slots=(40, 9)),
                          GEMMA3)
  assert sc.group_slots(given) == (40, 9)
  assert sc.num_pool_pages(given) == 40 * 2 + 9 * 4


def test_kv_groups_flag_overrides_the_windows():
  flat = sc.cache_config(_ok(kv_groups=False, enable_swa_scratch_reuse=True),
                         GEMMA3)
  assert isinstance(flat, pcache.CacheConfig)
  assert flat.layer_windows == GEMMA3.windows
  assert flat.enable_swa_scratch_reuse
  assert not sc.cache_config(_ok(kv_groups=False),
                             GEMMA3).enable_swa_scratch_reuse
  forced = sc.cache_config(_ok(kv_groups=True, group_num_slots=(32,)), LLAMA)
  assert isinstance(forced, pcache.HybridCacheConfig)
  assert sc.group_slots(forced) == (32,)
  assert sc.num_pool_pages(forced) == 32 * LLAMA.num_layers * 2
