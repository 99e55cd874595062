"""Static engine sizes (`EngineConfig`) and the cache sizes they imply.

The request record lives in `serving.request`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pkvattn import _checks
from pkvattn import _kv
from pkvattn import cache as _cache
from pkvattn.types import Implementation


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static sizes of the engine: they fix the set of compiled programs.

  Attributes:
    page_size: tokens per KV block (a power of two).
    num_slots: slots in the pool (a slot = one block of every layer, K and V).
    max_seqs: rows of the step batch = sequences running at once.
    max_num_tokens: token budget of one step (the static `num_tokens`); decode
      rows take one token each, prefill chunks share the rest. `>= max_seqs`.
    max_model_len: prompt + generated tokens of one request at most.
    max_admit: claims per step; None = `max_seqs`.
    enable_prefix_reuse: publish full blocks (`commit`) so later prompts with
      the same prefix reuse them.
    enable_swa_scratch_reuse: passed to the cache for models with
      sliding-window layers; scratch blocks are handled by `claim_batch` /
      `extend` and `page_table`. Where scratch is active (all layers SWA) the
      engine prefills a prompt in one step, so `len(prompt) + max_new_tokens`
      must fit `max_num_tokens`.
    impl: attention / rope / sampling-floor implementation ("pallas",
      "xla", None = auto).
    hash_ways: prefix-cache hash-table associativity.
    token_buckets: padded step sizes; a step runs at the smallest bucket that
      holds its tokens (one program per bucket, like CUDA-graph capture
      sizes). None = `(max_seqs, max_num_tokens)`: decode-only steps stop
      paying for the prefill budget.
    decode_steps: when every running request is decoding and nothing waits
      for a free row, run this many decode iterations in one device call
      (`lax.scan`: tokens fed back, stop tokens, max lengths and `extend`
      checked on device; vLLM's multi-step scheduling). 1 = off. Amortises
      the host's per-step work; a request finishing mid-burst frees its row
      only at the end of the burst (the next burst releases it). Bursts are
      chained: the next is dispatched from the device's end state of this
      one before the host reads it (with requests waiting, only while no
      running request reaches its length in the burst in flight).
    burst_rows: row counts of the burst programs (with `decode_steps > 1`):
      a burst runs the model over the first R rows, R the smallest of them
      above every running request's row (rows are handed out lowest first),
      like `token_buckets` for steps (vLLM captures a CUDA graph per batch
      size). None = `(min(64, max_seqs), max_seqs)`: a 64-row decode step
      reads each weight once as a 1-row one does, while a model whose
      `max_seqs`-row step is compute-bound (Llama-3.2-1B at 256 rows) pays
      for every row; `max_seqs` is always added. One program (two on a GPU:
      greedy-only and sampled) per row count.
    scan_layers: run the layers under `lax.scan` over stacked weights (True)
      or as an unrolled loop over per-layer weights (False: the engine keeps
      `pkvattn.models.unstack_layers(params)`, MaxText's `scan_layers`).
      None = False: on a GPU a scanned layer copies each weight slice
      before its matmul every step (`pkvattn.models.decoder`), and on a CPU
      the scanned decode step is several times slower than the unrolled one
      (measured: docs/performance.md). The unrolled loop traces and lowers
      one layer per distinct window (a nested jit), so it compiles fast too.
    check: checked mode (`pkvattn.checked`): every program checks the
      runtime contract of the ops it runs (page ids in range, `q_indptr`,
      `kv_lens`, unique ids in cache ops) with `jax.experimental.checkify`
      and a step raises `checkify.JaxRuntimeError` (a ValueError) naming the
      first violation. Costs device time; for tests and debugging.
    kv_groups: per-window-group slot spaces (`pkvattn.cache.HybridCacheConfig`)
      for models whose layers differ in `window_left` (Gemma 2 / 3): each
      group of layers with one window gets its own slots, and a sliding
      group keeps only the blocks its window can still see, so it needs far
      fewer. None = on for such models; False = one slot space for every
      layer (a sliding layer's slot then lives as long as the global
      layers').
    group_num_slots: slots per window group (global group first, then by
      decreasing window); None = `HybridCacheConfig.from_budget(num_slots,
      ...)`: the global groups get `num_slots`' worth of the flat pool's
      bytes left after each sliding group gets what its sequences can use.
    compile_cache_dir: a directory for the engine's compiled programs and
      JAX's persistent compilation cache (`jax_compilation_cache_dir`;
      `serving.compile_cache`); a later process with the same model and
      config loads its programs from there instead of tracing and
      compiling them. None = leave JAX's setting as it is (off unless the
      user enabled it) and save no programs.
    kv_cache_dtype: "auto" (the model's compute dtype) or "fp8_e4m3" (alias
      "fp8"): float8_e4m3fn pages with one `k_scale` / `v_scale` per layer
      (vLLM's `--kv-cache-dtype fp8`): half the bytes per token of bf16.
    kv_cache_memory: bytes for the KV pool; when set, `num_slots` is derived
      from it (`kv_cache_memory // (num_layers * 2 * page_size *
      num_kv_heads * head_dim * itemsize)`), so FP8 holds twice the tokens
      of bf16 in the same bytes. None = `num_slots` as given.
    k_scale, v_scale: FP8 scales for every layer (stored value = x / scale);
      None = calibrated from the first prompts' prefill
      (`pkvattn.models.calibrate.calibrate_kv_scales`, on the first
      `calibration_tokens` tokens of the first requests, before their
      first step). Calibrated or given, the scales are then checked on
      that batch (`calibrate.check_kv_scales`): a `RuntimeWarning` when a
      layer's scale saturates more than `calibrate.FP8_SATURATION_WARN`
      (0.1%) of its K or V values or maps the largest below 1 of e4m3's
      448; `EngineStats.kv_saturated_values` counts the clipped values.
    kv_scales: "per_tensor" (one `k_scale` / `v_scale` per layer) or
      "per_head" (one per layer and KV head, vLLM's per-head FP8 scales:
      a head whose values are much smaller than its layer's largest keeps
      its own range). Per head, a given `k_scale` / `v_scale` starts every
      head; calibration sets each head's own.
    calibration_tokens: tokens of the calibration prefill.
    host_kv_cache_bytes: bytes of host memory for a second KV tier
      (`pkvattn.serving.host_tier`, docs/kv_cache.md "Host tier"): cached
      prefix blocks about to be evicted from the pool are copied to host
      slots (`host_kv_cache_bytes // (num_layers * 2 * page_size *
      num_kv_heads * head_dim * itemsize)` of them), and a later prompt that
      matches them brings them back instead of recomputing. 0 = off. At
      most the machine's memory (the engine raises ValueError otherwise, as
      vLLM does for a swap space it cannot hold). One
      flat slot space only: per-window-group caches and SWA scratch raise
      ValueError (pass `kv_groups=False`).
    finished_history: finished requests kept for `Engine.get_request` after
      they finish (the most recent ones; older ones are dropped), so a
      long-running engine holds bounded host memory. `Engine.generate`
      drops its own requests when it returns them. 0 = keep none.
  """
  page_size: int = 16
  num_slots: int = 256
  max_seqs: int = 8
  max_num_tokens: int = 256
  max_model_len: int = 1024
  max_admit: int | None = None
  enable_prefix_reuse: bool = True
  enable_swa_scratch_reuse: bool = False
  impl: Implementation | None = None
  hash_ways: int = 8
  token_buckets: tuple[int, ...] | None = None
  decode_steps: int = 1
  burst_rows: tuple[int, ...] | None = None
  scan_layers: bool | None = None
  check: bool = False
  kv_groups: bool | None = None
  group_num_slots: tuple[int, ...] | None = None
  compile_cache_dir: str | None = None
  kv_cache_dtype: str = "auto"
  kv_cache_memory: int | None = None
  k_scale: float | None = None
  v_scale: float | None = None
  kv_scales: str = "per_tensor"
  calibration_tokens: int = 512
  finished_history: int = 1024
  host_kv_cache_bytes: int = 0

  def __post_init__(self):
    for name in ("page_size", "num_slots", "max_seqs", "max_num_tokens",
                 "max_model_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"Invalid {name}: expected a positive int, got {value!r}")
    if self.page_size & (self.page_size - 1):
      raise ValueError(
          f"Invalid page_size: expected a power of two, got {self.page_size}")
    if self.max_num_tokens < self.max_seqs:
      raise ValueError(
          f"Invalid max_num_tokens: expected >= max_seqs={self.max_seqs}, got "
          f"{self.max_num_tokens}")
    if self.max_admit is not None and (
        not isinstance(self.max_admit, int) or self.max_admit <= 0):
      raise ValueError(
          f"Invalid max_admit: expected None or a positive int, got "
          f"{self.max_admit!r}")
    if self.impl is not None:
      _checks.check_choice(self.impl, ("pallas", "xla"), "impl")
    if (not isinstance(self.decode_steps, int) or isinstance(self.decode_steps, bool)
        or self.decode_steps < 1):
      raise ValueError(
          f"Invalid decode_steps: expected an int >= 1, got {self.decode_steps!r}")
    if self.group_num_slots is not None and (
        not isinstance(self.group_num_slots, tuple) or any(
            not isinstance(n, int) or isinstance(n, bool) or n <= 0
            for n in self.group_num_slots)):
      raise ValueError(
          "Invalid group_num_slots: expected None or a tuple of positive ints,"
          f" got {self.group_num_slots!r}")
    if self.kv_cache_dtype == "fp8":
      object.__setattr__(self, "kv_cache_dtype", "fp8_e4m3")
    _checks.check_choice(self.kv_cache_dtype, KV_CACHE_DTYPES, "kv_cache_dtype")
    if self.kv_cache_memory is not None and (
        not isinstance(self.kv_cache_memory, int)
        or isinstance(self.kv_cache_memory, bool) or self.kv_cache_memory <= 0):
      raise ValueError(
          "Invalid kv_cache_memory: expected None or a positive int (bytes), "
          f"got {self.kv_cache_memory!r}")
    for name in ("k_scale", "v_scale"):
      value = getattr(self, name)
      if value is None:
        continue
      if self.kv_cache_dtype != "fp8_e4m3":
        raise ValueError(
            f"Invalid {name}: expected None with kv_cache_dtype="
            f"{self.kv_cache_dtype!r} (scales apply to FP8 pages), got {value!r}")
      if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(
            f"Invalid {name}: expected a positive finite float, got {value!r}")
    if self.kv_scales not in ("per_tensor", "per_head"):
      raise ValueError(
          "Invalid kv_scales: expected 'per_tensor' or 'per_head', got "
          f"{self.kv_scales!r}")
    if self.kv_scales == "per_head" and self.kv_cache_dtype != "fp8_e4m3":
      raise ValueError(
          f"Invalid kv_scales: expected 'per_tensor' with kv_cache_dtype="
          f"{self.kv_cache_dtype!r} (scales apply to FP8 pages), got "
          "'per_head'")
    if (self.k_scale is None) != (self.v_scale is None):
      raise ValueError(
          "Invalid k_scale / v_scale: expected both or neither, got "
          f"k_scale={self.k_scale!r}, v_scale={self.v_scale!r}")
    if (not isinstance(self.finished_history, int)
        or isinstance(self.finished_history, bool)
        or self.finished_history < 0):
      raise ValueError(
          "Invalid finished_history: expected an int >= 0, got "
          f"{self.finished_history!r}")
    if (not isinstance(self.host_kv_cache_bytes, int)
        or isinstance(self.host_kv_cache_bytes, bool)
        or self.host_kv_cache_bytes < 0):
      raise ValueError(
          "Invalid host_kv_cache_bytes: expected an int >= 0 (bytes; 0 = no "
          f"host tier), got {self.host_kv_cache_bytes!r}")
    if self.host_kv_cache_bytes and not self.enable_prefix_reuse:
      raise ValueError(
          "Invalid host_kv_cache_bytes: the host tier keeps prefix-cache "
          "blocks, expected 0 with enable_prefix_reuse=False, got "
          f"{self.host_kv_cache_bytes}")
    if (not isinstance(self.calibration_tokens, int)
        or isinstance(self.calibration_tokens, bool)
        or self.calibration_tokens <= 0):
      raise ValueError(
          "Invalid calibration_tokens: expected a positive int, got "
          f"{self.calibration_tokens!r}")
    if self.token_buckets is not None and any(
        int(b) <= 0 for b in self.token_buckets):
      raise ValueError(
          f"Invalid token_buckets: expected positive sizes, got "
          f"{self.token_buckets}")
    if self.burst_rows is not None and (
        not isinstance(self.burst_rows, tuple) or not self.burst_rows
        or any(not isinstance(r, int) or isinstance(r, bool)
               or not 0 < r <= self.max_seqs for r in self.burst_rows)):
      raise ValueError(
          f"Invalid burst_rows: expected None or a non-empty tuple of ints in "
          f"[1, max_seqs={self.max_seqs}], got {self.burst_rows!r}")

  @property
  def buckets(self) -> tuple[int, ...]:
    """Sorted step sizes, the last one `max_num_tokens`."""
    sizes = self.token_buckets or (self.max_seqs,)
    return tuple(sorted({min(int(b), self.max_num_tokens) for b in sizes}
                        | {self.max_num_tokens}))

  @property
  def burst_buckets(self) -> tuple[int, ...]:
    """Sorted row counts of the burst programs, the last one `max_seqs`."""
    rows = self.burst_rows or (min(64, self.max_seqs),)
    return tuple(sorted(set(rows) | {self.max_seqs}))

  @property
  def max_pages(self) -> int:
    return -(-self.max_model_len // self.page_size)

  @property
  def num_admit(self) -> int:
    return self.max_admit or self.max_seqs


KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def kv_dtype(cfg: EngineConfig, compute_dtype):
  """The pool dtype for `cfg.kv_cache_dtype`."""
  return _kv.FP8_DTYPE if cfg.kv_cache_dtype == "fp8_e4m3" else compute_dtype


def slots_for_memory(cfg: EngineConfig, model_cfg, pool_dtype) -> int:
  """`num_slots` of `cfg.kv_cache_memory` bytes (slots span every layer).

  Raises:
    ValueError: the bytes do not hold one sequence of `max_model_len`, or
      hold more slots than the pool's int32 page ids name
      (`cache.MAX_POOL_PAGES`).
  """
  block = (2 * cfg.page_size * model_cfg.num_kv_heads * model_cfg.head_dim
           * jnp.dtype(pool_dtype).itemsize)
  slots = cfg.kv_cache_memory // (block * model_cfg.num_layers)
  most = _cache.MAX_POOL_PAGES // (2 * model_cfg.num_layers)
  if slots > most:
    raise ValueError(
        f"Invalid kv_cache_memory: expected at most "
        f"{most * block * model_cfg.num_layers} bytes ({most} slots of "
        f"{model_cfg.num_layers} layers x {block} bytes: the pool's page ids "
        f"are int32), got {cfg.kv_cache_memory}")
  if slots < cfg.max_pages:
    raise ValueError(
        f"Invalid kv_cache_memory: {cfg.kv_cache_memory} bytes hold {slots} "
        f"slots of {model_cfg.num_layers} layers x {block} bytes, fewer than "
        f"one sequence of max_model_len={cfg.max_model_len} needs "
        f"({cfg.max_pages})")
  return int(slots)


def cache_config(cfg: EngineConfig, model_cfg):
  """The engine's cache config: per-window-group slot spaces
  (`HybridCacheConfig`) where `cfg.kv_groups` asks for them (None: when the
  model's layers differ in window), else one `CacheConfig`.

  Raises:
    ValueError: `group_num_slots` without per-group spaces or of the wrong
      length, or a budget too small for one sequence per group.
  """
  windows = tuple(model_cfg.windows)
  grouped = (len(set(windows)) > 1 if cfg.kv_groups is None
             else bool(cfg.kv_groups))
  scratch = bool(cfg.enable_swa_scratch_reuse and model_cfg.has_sliding_window)
  if not grouped:
    if cfg.group_num_slots is not None:
      raise ValueError(
          "Invalid group_num_slots: expected None with one slot space "
          f"(kv_groups={cfg.kv_groups}, windows {sorted(set(windows))}), got "
          f"{cfg.group_num_slots}")
    return _cache.CacheConfig(
        num_slots=cfg.num_slots, page_size=cfg.page_size,
        num_layers=model_cfg.num_layers, max_seqs=cfg.max_seqs,
        max_pages=cfg.max_pages, hash_ways=cfg.hash_ways,
        layer_windows=windows, enable_swa_scratch_reuse=scratch)
  common = dict(page_size=cfg.page_size, max_seqs=cfg.max_seqs,
                max_pages=cfg.max_pages, hash_ways=cfg.hash_ways,
                enable_swa_scratch_reuse=scratch)
  if cfg.group_num_slots is not None:
    return _cache.HybridCacheConfig(windows, cfg.group_num_slots, **common)
  return _cache.HybridCacheConfig.from_budget(
      cfg.num_slots, windows, max_num_tokens=cfg.max_num_tokens, **common)


def num_pool_pages(cache_cfg) -> int:
  """Pages of the engine's KV pool for its cache config."""
  return cache_cfg.num_pool_pages


def group_slots(cache_cfg) -> tuple[int, ...]:
  """Slots per slot space (one entry for a flat cache)."""
  if isinstance(cache_cfg, _cache.HybridCacheConfig):
    return cache_cfg.group_num_slots
  return (cache_cfg.num_slots,)
