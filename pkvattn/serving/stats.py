"""`EngineStats`: counters and timers of one engine's life (host side)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
  """Counters of one engine's life (host side).

  Times are wall-clock seconds. `prefill_time_s` / `decode_time_s` never
  include compilation: a program compiled on first use (no `warmup()`) has
  its compile time in `compile_time_s` and the rest of that step in the
  prefill or decode time as usual.
  """
  num_steps: int = 0
  prompt_tokens: int = 0        # prompt tokens of admitted claims
  reused_tokens: int = 0        # of those, served by the prefix cache
  prefill_tokens: int = 0       # prompt tokens computed
  decode_tokens: int = 0        # tokens fed as decode rows
  generated_tokens: int = 0     # tokens sampled
  prefill_time_s: float = 0.0   # wall time of steps that carried prefill tokens
  decode_time_s: float = 0.0    # wall time of decode-only steps and bursts
  host_time_s: float = 0.0      # host scheduling + result handling
  compile_time_s: float = 0.0   # compiling programs (warmup or first use)
  warmup_time_s: float = 0.0    # wall time of `Engine.warmup()`
  num_compiles: int = 0         # programs this engine compiled (or loaded)
  # Peak slots in use: of the one slot space, or with per-window-group spaces
  # of group 0 (the global layers'); `peak_group_slots` has every group's.
  peak_used_slots: int = 0
  peak_group_slots: tuple[int, ...] = ()
  # Peak KV bytes held (slots in use x their layers x page bytes, K and V),
  # and what a flat layout (one slot space, every layer keeping every block:
  # the global group's blocks times all layers) would hold at that point;
  # None for a flat engine or a model without a global layer.
  peak_kv_bytes: int = 0
  flat_peak_kv_bytes: int | None = None
  # Slot allocations that SWA scratch reuse avoided at admission (new blocks
  # of the prompts minus slots taken); None when scratch is not active.
  slots_saved_by_scratch: int | None = None
  num_preemptions: int = 0
  num_refused_claims: int = 0
  # The KV pool: its page dtype ("bfloat16", "float8_e4m3fn", ...), its
  # bytes, and for FP8 pages the per-layer scales in use (calibrated or
  # given; None before calibration).
  kv_cache_dtype: str = ""
  kv_cache_bytes: int = 0
  kv_scales_calibrated: bool = False
  # FP8 pages: K and V values (all layers) of the first requests' prompts
  # (at most `calibration_tokens` tokens) whose `|x| / scale` exceeds 448,
  # so the pool stores them clipped; counted once, when the scales are
  # checked before the first step (`Engine._calibrate`), not per step, so
  # the step programs stay unchanged. None before that check or for 16-bit
  # pages.
  kv_saturated_values: int | None = None
  # Host KV tier (`EngineConfig.host_kv_cache_bytes`; all 0 when off): its
  # slots and bytes, blocks copied pool -> host (mirrored ahead of eviction)
  # and host -> pool (reloaded for admitted prompts), prompt blocks looked
  # up on the host and found there, the bytes moved each way, and the host
  # wall time spent on the copies (plans, gathers, waits for the device ->
  # host copies, host buffer writes, reload puts).
  host_num_slots: int = 0
  host_kv_cache_bytes: int = 0
  host_blocks_offloaded: int = 0
  host_blocks_reloaded: int = 0
  host_lookups: int = 0
  host_hits: int = 0
  host_bytes_offloaded: int = 0
  host_bytes_reloaded: int = 0
  host_transfer_s: float = 0.0

  @property
  def prefix_hit_rate(self) -> float:
    return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

  @property
  def host_hit_rate(self) -> float:
    """Prompt blocks found on the host / looked up there (0 if none)."""
    return self.host_hits / self.host_lookups if self.host_lookups else 0.0

  @property
  def kv_bytes_saved(self) -> int | None:
    """`flat_peak_kv_bytes - peak_kv_bytes` (per-window-group spaces)."""
    if self.flat_peak_kv_bytes is None:
      return None
    return self.flat_peak_kv_bytes - self.peak_kv_bytes

  @property
  def prefill_tokens_per_s(self) -> float:
    """Prefill tokens / prefill time (compilation excluded); 0 if none ran."""
    return self.prefill_tokens / self.prefill_time_s if self.prefill_time_s else 0.0

  @property
  def decode_tokens_per_s(self) -> float:
    """Decode tokens / decode time (compilation excluded); 0 if none ran."""
    return self.decode_tokens / self.decode_time_s if self.decode_time_s else 0.0

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(prefix_hit_rate=self.prefix_hit_rate,
             kv_bytes_saved=self.kv_bytes_saved,
             host_hit_rate=self.host_hit_rate,
             prefill_tokens_per_s=self.prefill_tokens_per_s,
             decode_tokens_per_s=self.decode_tokens_per_s)
    return d
