"""Public paged attention ops: `paged_decode`, `paged_prefill`, `merge_state`.

Thin layer: trace-time checks, kv_cache format normalisation (`_kv.make_view`), and
dispatch between the Pallas kernels (`impl="pallas"`) and plain XLA (`impl="xla"`:
decode rows through the pure-jnp reference, which gathers each row's pages
once; prefill through the flash-style `pkvattn.xla_attention`). Semantics
follow FlashInfer (see `pallas_kernels/reference.py`).

An eager call whose arguments are all jax arrays (the bare op in a Python
loop, as a user or a benchmark calls it) runs as one `jax.jit` of the whole
op (`_call`): the checks and the layout normalisation happen when that
function is traced, once per shape, and every later call is one dispatch of
the compiled program, as a torch op is one launch. Otherwise (lists, Python
scale numbers, checked mode, or inside the caller's own trace) the op runs
as written, so its checks see host values and its contract is staged into
the caller's program.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pkvattn import _checks
from pkvattn import _contract
from pkvattn import _kv
from pkvattn import xla_attention
from pkvattn.pallas_kernels import dispatch
from pkvattn.pallas_kernels import reference
from pkvattn.types import Implementation


def _common_checks(q, view: _kv.KVView, kv_lens, sinks, batch_size, name_q,
                   k_scale=None, v_scale=None):
  """Trace-time checks; returns the FP8 scales (`f32[]` or
  `f32[num_kv_heads]` each, or None)."""
  _checks.check_ndim(q, (3,), name_q)
  _checks.check_dtype(q, _kv.SUPPORTED_DTYPES, name_q)
  scales = _kv.check_scales(view.k_pool, k_scale, v_scale,
                            num_kv_heads=view.num_kv_heads)
  if not _kv.is_fp8(view.k_pool):
    _checks.check_same_dtype(view.k_pool, q, "kv_cache", name_q)
  num_qo_heads, head_dim = q.shape[1], q.shape[2]
  if head_dim != view.head_dim:
    raise ValueError(
        f"Invalid head_dim of {name_q}: expected {view.head_dim} (the head_dim "
        f"of kv_cache), got {head_dim}")
  _checks.check_heads(num_qo_heads, view.num_kv_heads)
  _checks.check_int(kv_lens, "kv_lens")
  _checks.check_shape(kv_lens, (batch_size,), "kv_lens")
  if view.k_table.shape[0] != batch_size:
    raise ValueError(
        f"Invalid shape of page_table: expected batch_size={batch_size} rows, "
        f"got {view.k_table.shape[0]}")
  if sinks is not None:
    _checks.check_shape(sinks, (num_qo_heads,), "sinks")
  return scales


def _statics(head_dim, sm_scale, window_left, logits_soft_cap):
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  if not isinstance(window_left, int) or window_left < -1:
    raise ValueError(
        f"Invalid window_left: expected an int >= -1 (-1 = no window), got "
        f"{window_left!r}")
  if logits_soft_cap is not None and logits_soft_cap <= 0:
    logits_soft_cap = None
  return float(sm_scale), window_left, (
      None if logits_soft_cap is None else float(logits_soft_cap))


def paged_decode(
    q: jax.Array,           # [batch_size, num_qo_heads, head_dim]
    kv_cache,               # see below
    page_table: jax.Array,  # i32[batch_size, max_pages] | i32[batch_size, 2, max_pages]
    kv_lens: jax.Array,     # i32[batch_size]
    *,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[num_qo_heads]
    return_lse: bool = False,
    impl: Implementation | None = None,
    check: bool | None = None,
    k_scale: jax.Array | float | None = None,  # f32[] | [num_kv_heads]: FP8
    v_scale: jax.Array | float | None = None,  # f32[] | [num_kv_heads]: FP8
):
  """One-token-per-sequence attention over a paged KV cache (FlashInfer decode).

  For sequence `b` and query head `h`, the query sits at position
  `kv_lens[b] - 1` and attends to keys `0 .. kv_lens[b] - 1` of kv head
  `h // group_size` (within the window, if any).

  Args:
    q: `[batch_size, num_qo_heads, head_dim]`; bf16, f16 or f32.
    kv_cache: one of
      * `(k_pages, v_pages)`, each `[num_pages, page_size, num_kv_heads, head_dim]`,
        with a shared `page_table` `i32[batch_size, max_pages]`;
      * one pool `[num_pages, page_size, num_kv_heads, head_dim]` with a split
        `page_table` `i32[batch_size, 2, max_pages]` (row 0 K pages, row 1 V
        pages: TensorRT-LLM);
      * FlashInfer's `[num_pages, 2, page_size, num_kv_heads, head_dim]` with a
        shared table.
      Same dtype as `q`, or float8_e4m3fn (FP8 pages, with `k_scale` /
      `v_scale`); `page_size` in {8, ..., 128}, `head_dim` in {64, 128, 256}.
    page_table: page ids (array or nested list); entries past
      `cdiv(kv_lens[b], page_size)` or wholly outside the window are never
      read and may be -1.
    kv_lens: `i32[batch_size]` (array or list), tokens in the cache including
      the current one, in `[0, max_pages * page_size]`.
    sm_scale: static; defaults to `1 / sqrt(head_dim)`.
    window_left: static; key `j` is visible iff `kv_lens[b] - 1 - window_left
      <= j`; -1 = no window (FlashInfer).
    logits_soft_cap: static; `c * tanh(s / c)` on the scaled logits; None or
      <= 0 = off (FlashInfer's 0.0).
    sinks: optional `f32[num_qo_heads]`, a per-head logit that joins the
      softmax denominator only (gpt-oss).
    return_lse: also return `lse f32[batch_size, num_qo_heads]`, natural-log
      sum-exp over visible keys (sink excluded).
    impl: "pallas" (GPU kernel; interpret mode elsewhere), "xla" (pure jnp), or
      None (pallas on GPU, xla elsewhere).
    check: checked mode (`pkvattn.checked`; None follows it): `kv_lens` in
      `[0, max_pages * page_size]`, a page id in `[0, num_pages)` for every
      block the query can see (from the window start, or 0, to
      `cdiv(kv_lens[b], page_size)`), and `k_scale` / `v_scale` given as jax
      arrays finite and `>= 2**-126`. Unchecked, nothing verifies them: an
      out-of-range page reads whatever the XLA gather clamps to, and out of
      bounds in the GPU kernels (undefined; an illegal-address error ends
      the CUDA context). Staged in a caller's checkified jit, a call whose
      contract fails runs no kernel and returns NaN `out` and `lse`.
    k_scale, v_scale: for an FP8 `kv_cache`, each an f32 scalar (a Python
      float or int, a 0-d array; may be traced) or one per KV head
      (`f32[num_kv_heads]`, vLLM's per-head scales): a stored page value `x`
      of head `h` means `x * k_scale[h]` (vLLM / FlashInfer convention,
      stored value = x / scale). Required with FP8 pages, refused
      otherwise. Each must be finite and `>= 2**-126` (the smallest normal
      f32): Python and numpy numbers are checked at trace time, jax arrays
      in checked mode. The kernels read FP8 pages and dequantize on the
      fly (K's scale folded into the logits scale, V's into the output);
      accumulation is f32 and `q` keeps its dtype. Per-head scales are
      read per KV head: each decode and prefill kernel multiplies a query
      row's logits by its kv head's K scale and its output by the V scale
      (the Triton prefill tiles, which read one scale per tensor, run on
      pages dequantized first), and the xla path dequantizes each head's
      pages by its own scales.

  Returns:
    `out [batch_size, num_qo_heads, head_dim]` in `q.dtype`, and `lse` if
    `return_lse`. Sequences with `kv_lens[b] == 0` give zeros and `lse = -inf`;
    `batch_size == 0` gives empty arrays.

  Raises:
    ValueError: shapes, dtypes, table/kv_cache format mismatch, heads not
      divisible, unsupported head_dim / page_size, a host scale that is not
      finite or below `2**-126` (at trace time).
    checkify.JaxRuntimeError: (a ValueError) checked mode, a violated
      contract (`pkvattn.checked` says where it surfaces).

  Example:
    >>> q = jnp.zeros((2, 8, 64), jnp.float32)
    >>> k = v = jnp.ones((4, 8, 2, 64), jnp.float32)
    >>> out = paged_decode(q, (k, v), jnp.array([[0, 1], [2, 3]]),
    ...                    jnp.array([9, 3]), impl="xla")
    >>> out.shape
    (2, 8, 64)
  """
  return _call(_paged_decode, _decode_program,
               (q, kv_cache, page_table, kv_lens, sinks, k_scale, v_scale),
               dict(sm_scale=sm_scale, window_left=window_left,
                    logits_soft_cap=logits_soft_cap, return_lse=return_lse,
                    impl=impl), check)


def _paged_decode(q, kv_cache, page_table, kv_lens, sinks, k_scale, v_scale,
                  *, sm_scale, window_left, logits_soft_cap, return_lse, impl,
                  check):
  """`paged_decode`, run as written (the module docstring: when)."""
  q, page_table, kv_lens, sinks = _arrays(q, page_table, kv_lens, sinks)
  view = _kv.make_view(kv_cache, page_table)
  scales = _common_checks(q, view, kv_lens, sinks, q.shape[0], "q", k_scale,
                          v_scale)
  sm_scale, window_left, logits_soft_cap = _statics(
      q.shape[-1], sm_scale, window_left, logits_soft_cap)
  impl = _checks.resolve_impl(impl)
  ok = None
  if _contract.enabled(check):
    ok = _contract.run(_contract.attention_contract, view.table, kv_lens,
                       num_pages=view.num_pages, page_size=view.page_size,
                       num_tokens=q.shape[0], window_left=window_left)
    ok = _contract.both(ok, _kv.run_scale_contract(scales, k_scale, v_scale))
  kv_lens = kv_lens.astype(jnp.int32)

  def body():
    if q.shape[0] == 0:
      return _empty(q)
    if impl == "xla":
      return reference.paged_decode_reference(
          q, view.k_pool, view.v_pool, view.k_table, view.v_table, kv_lens, sinks,
          *scales, sm_scale=sm_scale, window_left=window_left,
          logits_soft_cap=logits_soft_cap)
    from pkvattn.pallas_kernels import paged_decode as kernel
    k_table, v_table, interleaved = view.decode_tables()
    return kernel.paged_decode(
        q, view.k_pool, view.v_pool, k_table, v_table, kv_lens, sinks,
        sm_scale=sm_scale, window_left=window_left,
        logits_soft_cap=logits_soft_cap, interpret=not _checks.is_gpu(),
        interleaved_kv=interleaved, **_scale_kwargs(scales))

  with _contract.unchecked():  # the kernels: their unchecked compilation
    out, lse = _contract.guard(ok, body, lambda: _violated(q))
  return (out, lse) if return_lse else out


def _scale_kwargs(scales):
  """The kernels' FP8 arguments (none for unquantized pages)."""
  if scales[0] is None:
    return {}
  return dict(k_scale=scales[0], v_scale=scales[1])


def paged_prefill(
    q: jax.Array,           # [num_tokens, num_qo_heads, head_dim]
    kv_cache,
    page_table: jax.Array,  # i32[batch_size, max_pages] | i32[batch_size, 2, max_pages]
    q_indptr: jax.Array,    # i32[batch_size + 1]
    kv_lens: jax.Array,     # i32[batch_size]
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[num_qo_heads]
    return_lse: bool = False,
    impl: Implementation | None = None,
    plan=None,
    check: bool | None = None,
    k_scale: jax.Array | float | None = None,  # f32[] | [num_kv_heads]: FP8
    v_scale: jax.Array | float | None = None,  # f32[] | [num_kv_heads]: FP8
):
  """Ragged-batch attention of new tokens over a paged KV cache (FlashInfer prefill).

  `q[q_indptr[b]:q_indptr[b+1]]` are sequence `b`'s new tokens, which occupy
  its LAST `q_len` positions: token `i` of them sits at position
  `kv_lens[b] - q_len + i`. Handles mixed batches (decode rows with q_len 1
  beside long prompts), chunked prefill over a cached prefix, and multi-token
  decode. Tokens at or past `q_indptr[-1]` are padding.

  When `causal` and `num_tokens <= batch_size` (static: e.g. an engine's
  decode-only step), every token runs as an independent decode row through
  the split-K decode path (same result; `plan` is then unused).

  Args:
    q: `[num_tokens, num_qo_heads, head_dim]`; bf16, f16 or f32.
    kv_cache, page_table: as in `paged_decode`.
    q_indptr: `i32[batch_size + 1]` (array or list), non-decreasing,
      `q_indptr[0] == 0`, `q_indptr[-1] <= num_tokens` (cu_seqlens).
    kv_lens: `i32[batch_size]` (array or list), tokens including the new
      ones; `kv_lens[b] >= q_len[b]`.
    causal: static; False lets every new token see all `kv_lens[b]` keys.
    sm_scale, window_left, logits_soft_cap, sinks, return_lse, impl: as in
      `paged_decode`; the window is relative to each query's position.
    plan: optional `plan_prefill(...)` result for this step's `q_indptr` /
      `kv_lens` (FlashInfer's plan/run split): computed once, reused by every
      layer; used by the pallas kernel, ignored by the xla path. None = the
      kernel plans for itself.
    check: checked mode (`pkvattn.checked`; None follows it): the
      `q_indptr` and `kv_lens` clauses above, `kv_lens <= max_pages *
      page_size`, and a page id in `[0, num_pages)` for every block a query
      can see (from the first query's window start, or 0, to
      `cdiv(kv_lens[b], page_size)`; rows without queries see none).
      Unchecked and staged as in `paged_decode`.
    k_scale, v_scale: as in `paged_decode` (FP8 pages). With at least 512 query
      rows (tokens x GQA group) per sequence (1,024 with a window), the pallas
      path first dequantizes the pages the table names into a compact 16-bit
      pool (one XLA gather, `batch_size * max_pages` pages held for the call)
      and runs the 16-bit kernels, which is faster for prompts
      (`pallas_kernels.paged_prefill.PrefillConfig.fp8_pages`). Per-head scales
      always take that path there (each head's pages scaled by its own; the
      prefill kernels read one scale per tensor), except calls that run as
      decode rows (`causal` with `num_tokens <= batch_size`), which read them
      per KV head as `paged_decode` does; the xla path applies them per KV head
      as well.

  Returns:
    `out [num_tokens, num_qo_heads, head_dim]` in `q.dtype` (zeros for padding
    tokens), and `lse f32[num_tokens, num_qo_heads]` if `return_lse`
    (`-inf` for padding tokens). `batch_size == 0` makes every token padding;
    `num_tokens == 0` gives empty arrays.

  Raises:
    ValueError: as `paged_decode`, plus `q_indptr` not `[batch_size + 1]`,
      or a `plan` made for another shape or dtype.
    checkify.JaxRuntimeError: (a ValueError) checked mode, a violated
      contract.
  """
  return _call(_paged_prefill, _prefill_program,
               (q, kv_cache, page_table, q_indptr, kv_lens, sinks, plan,
                k_scale, v_scale),
               dict(causal=causal, sm_scale=sm_scale, window_left=window_left,
                    logits_soft_cap=logits_soft_cap, return_lse=return_lse,
                    impl=impl), check)


def _paged_prefill(q, kv_cache, page_table, q_indptr, kv_lens, sinks, plan,
                   k_scale, v_scale, *, causal, sm_scale, window_left,
                   logits_soft_cap, return_lse, impl, check):
  """`paged_prefill`, run as written (the module docstring: when)."""
  q, page_table, kv_lens, sinks = _arrays(q, page_table, kv_lens, sinks)
  q_indptr = _checks.as_index_array(q_indptr)
  view = _kv.make_view(kv_cache, page_table)
  batch_size = view.k_table.shape[0]
  scales = _common_checks(q, view, kv_lens, sinks, batch_size, "q", k_scale,
                          v_scale)
  _checks.check_int(q_indptr, "q_indptr")
  _checks.check_shape(q_indptr, (batch_size + 1,), "q_indptr")
  sm_scale, window_left, logits_soft_cap = _statics(
      q.shape[-1], sm_scale, window_left, logits_soft_cap)
  impl = _checks.resolve_impl(impl)
  ok = None
  if _contract.enabled(check):
    ok = _contract.run(_contract.attention_contract, view.table, kv_lens,
                       q_indptr, num_pages=view.num_pages,
                       page_size=view.page_size, num_tokens=q.shape[0],
                       window_left=window_left)
    ok = _contract.both(ok, _kv.run_scale_contract(scales, k_scale, v_scale))
  kv_lens = kv_lens.astype(jnp.int32)
  q_indptr = q_indptr.astype(jnp.int32)

  def body():
    if batch_size == 0 or q.shape[0] == 0:
      return _empty(q)
    if causal and q.shape[0] <= batch_size:
      return _prefill_as_decode(
          q, view, q_indptr, kv_lens, sinks, scales, impl=impl,
          sm_scale=sm_scale, window_left=window_left,
          logits_soft_cap=logits_soft_cap)
    if impl == "xla":
      return xla_attention.paged_prefill(
          q, view.k_pool, view.v_pool, view.k_table, view.v_table, q_indptr,
          kv_lens, sinks, *scales, causal=bool(causal), sm_scale=sm_scale,
          window_left=window_left, logits_soft_cap=logits_soft_cap)
    from pkvattn.pallas_kernels import paged_prefill as kernel
    return kernel.paged_prefill(
        q, view.k_pool, view.v_pool, view.k_table, view.v_table, q_indptr,
        kv_lens, sinks, causal=bool(causal), sm_scale=sm_scale,
        window_left=window_left, logits_soft_cap=logits_soft_cap,
        interpret=not _checks.is_gpu(), plan=plan, **_scale_kwargs(scales))

  with _contract.unchecked():  # the kernels: their unchecked compilation
    out, lse = _contract.guard(ok, body, lambda: _violated(q))
  return (out, lse) if return_lse else out


def _arrays(q, page_table, kv_lens, sinks):
  """Lists (and numpy arrays) to jax arrays; tracers and arrays unchanged."""
  return (jnp.asarray(q), _checks.as_index_array(page_table),
          _checks.as_index_array(kv_lens),
          None if sinks is None else jnp.asarray(sinks))


def _call(op, program, arrays, statics, check):
  """`program(*arrays, **statics)`, the jit of `op`, where the call can run
  as one program (`_one_program`), else `op(*arrays, **statics, check=)`."""
  if _one_program(arrays, statics, check):
    return program(*arrays, **statics, gpu=_gpu())
  return op(*arrays, **statics, check=check)


def _one_program(arrays, statics, check) -> bool:
  """Whether an op call runs as one jitted program: every array argument is
  a jax array outside any trace (no list, Python number or tracer), the
  static arguments are plain hashable values, and checked mode is off (its
  eager checks run before the op, on the host's values)."""
  for x in jax.tree.leaves(arrays):
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
      return False
  return (not _contract.enabled(check)
          and all(v is None or isinstance(v, (bool, int, float, str))
                  for v in statics.values()))


def _gpu() -> dispatch.Gpu:
  """The GPU the kernels are chosen for: read while tracing, so part of the
  jitted ops' cache key."""
  return dispatch.current_gpu(interpret=not _checks.is_gpu())


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "window_left", "logits_soft_cap",
                              "return_lse", "impl", "gpu"))
def _decode_program(q, kv_cache, page_table, kv_lens, sinks, k_scale, v_scale,
                    *, sm_scale, window_left, logits_soft_cap, return_lse,
                    impl, gpu):
  """`_paged_decode` as one program; `gpu` (`_gpu()`) only keys the cache."""
  del gpu
  return _paged_decode(q, kv_cache, page_table, kv_lens, sinks, k_scale,
                       v_scale, sm_scale=sm_scale, window_left=window_left,
                       logits_soft_cap=logits_soft_cap, return_lse=return_lse,
                       impl=impl, check=False)


@functools.partial(
    jax.jit, static_argnames=("causal", "sm_scale", "window_left",
                              "logits_soft_cap", "return_lse", "impl", "gpu"))
def _prefill_program(q, kv_cache, page_table, q_indptr, kv_lens, sinks, plan,
                     k_scale, v_scale, *, causal, sm_scale, window_left,
                     logits_soft_cap, return_lse, impl, gpu):
  """`_paged_prefill` as one program; `gpu` (`_gpu()`) only keys the cache."""
  del gpu
  return _paged_prefill(q, kv_cache, page_table, q_indptr, kv_lens, sinks,
                        plan, k_scale, v_scale, causal=causal,
                        sm_scale=sm_scale, window_left=window_left,
                        logits_soft_cap=logits_soft_cap, return_lse=return_lse,
                        impl=impl, check=False)


def _empty(q):
  """The output of tokens that see nothing (padding): zeros and -inf."""
  out = jnp.zeros(q.shape, q.dtype)
  return out, jnp.full(q.shape[:2], -jnp.inf, jnp.float32)


def _violated(q):
  """The output of a staged checked call whose contract failed: NaN."""
  out = jnp.full(q.shape, jnp.nan, q.dtype)
  return out, jnp.full(q.shape[:2], jnp.nan, jnp.float32)


def _prefill_as_decode(q, view: _kv.KVView, q_indptr, kv_lens, sinks, scales,
                       *, impl, sm_scale, window_left, logits_soft_cap):
  """Causal prefill of <= batch_size tokens, each token as one decode row.

  Under causal masking token `t` (sequence `b`, position `p`) attends to keys
  `0..p` of `b` within the window: exactly a decode query with `kv_len = p + 1`
  over `b`'s table row. When the step has no more tokens than sequences (the
  engine's decode-only steps, multi-token decode of a few rows), at most
  `num_tokens` KV walks are done, and the split-K decode kernel keeps the GPU
  busy where the prefill kernel has one short query tile per sequence.
  Padding tokens get `kv_len = 0`: zeros and `lse = -inf`, as in prefill.
  """
  bidx, pos = reference.token_metadata(q_indptr, kv_lens, q.shape[0])
  valid = bidx >= 0
  rows = jnp.clip(bidx, 0)
  tok_kv_lens = jnp.where(valid, pos + 1, 0).astype(jnp.int32)
  if impl == "xla":
    return reference.paged_decode_reference(
        q, view.k_pool, view.v_pool, view.k_table[rows], view.v_table[rows],
        tok_kv_lens, sinks, *scales, sm_scale=sm_scale,
        window_left=window_left, logits_soft_cap=logits_soft_cap)
  from pkvattn.pallas_kernels import paged_decode as kernel
  k_table, v_table, interleaved = view.decode_tables()
  k_table = k_table[rows]
  v_table = k_table if interleaved else v_table[rows]
  return kernel.paged_decode(
      q, view.k_pool, view.v_pool, k_table, v_table, tok_kv_lens, sinks,
      sm_scale=sm_scale, window_left=window_left,
      logits_soft_cap=logits_soft_cap, interpret=not _checks.is_gpu(),
      interleaved_kv=interleaved, **_scale_kwargs(scales))


def plan_prefill(
    q_indptr: jax.Array,  # i32[batch_size + 1]
    kv_lens: jax.Array,   # i32[batch_size]
    *,
    num_tokens: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.bfloat16,
    causal: bool = True,
    window_left: int = -1,
    kv_dtype=None,
):
  """Schedule of one step's `paged_prefill` calls (FlashInfer's plan/run split).

  Which query tile belongs to which sequence, the short-tile class of decode
  rows, and the longest-first launch order depend only on `q_indptr`,
  `kv_lens` (and the static shapes), so compute them once per step and pass
  the result as `paged_prefill(..., plan=...)` to every layer. On Hopper
  (the Mosaic-GPU prefill configs) one small kernel
  (`pallas_kernels.plan_mgpu`), elsewhere a few jnp ops
  (`pallas_kernels.plan`); jit-compatible, no host sync.

  Args:
    q_indptr: `i32[batch_size + 1]` (array or list), as in `paged_prefill`.
    kv_lens: `i32[batch_size]` (array or list), as in `paged_prefill`.
    num_tokens: static, `q.shape[0]` of the calls it serves.
    num_qo_heads, num_kv_heads, head_dim, dtype: static, those of `q` (they
      choose the kernel's tile size).
    causal, window_left: static; only steer the launch order.
    kv_dtype: static, the pages' dtype if not `dtype` (float8_e4m3fn
      pages mostly take the same kernel, and so the same plan, as 16-bit
      pages of `dtype`; `pallas_kernels.dispatch.prefill`).

  Returns:
    A `PrefillPlan` pytree (`pkvattn.pallas_kernels.plan`).

  Raises:
    ValueError: heads not divisible, or `q_indptr` / `kv_lens` shapes.

  Example:
    >>> plan = plan_prefill(jnp.array([0, 5, 6]), jnp.array([5, 9]),
    ...                     num_tokens=8, num_qo_heads=8, num_kv_heads=2,
    ...                     head_dim=64)
    >>> plan.batch_size, plan.num_tokens
    (2, 8)
  """
  from pkvattn.pallas_kernels import dispatch
  q_indptr = _checks.as_index_array(q_indptr)
  kv_lens = _checks.as_index_array(kv_lens)
  _checks.check_heads(num_qo_heads, num_kv_heads)
  _checks.check_int(kv_lens, "kv_lens")
  _checks.check_ndim(kv_lens, (1,), "kv_lens")
  _checks.check_int(q_indptr, "q_indptr")
  _checks.check_shape(q_indptr, (kv_lens.shape[0] + 1,), "q_indptr")
  config = dispatch.prefill(
      gpu=dispatch.current_gpu(interpret=not _checks.is_gpu()), dtype=dtype,
      kv_dtype=kv_dtype, head_dim=head_dim,
      group_size=num_qo_heads // num_kv_heads, page_size=None,
      window_left=window_left, num_tokens=num_tokens,
      batch_size=kv_lens.shape[0]).config
  return config.plan(
      jnp.asarray(q_indptr, jnp.int32), jnp.asarray(kv_lens, jnp.int32),
      num_tokens=num_tokens, causal=causal, window_left=window_left)


def merge_state(
    out_a: jax.Array,  # [..., num_qo_heads, head_dim]
    lse_a: jax.Array,  # f32[..., num_qo_heads]
    out_b: jax.Array,  # [..., num_qo_heads, head_dim]
    lse_b: jax.Array,  # f32[..., num_qo_heads]
):
  """Combines two attention states over disjoint key sets (FlashInfer `merge_state`).

  `out = (exp(lse_a) out_a + exp(lse_b) out_b) / (exp(lse_a) + exp(lse_b))`,
  `lse = logaddexp(lse_a, lse_b)`, computed stably in f32. Where both lse are
  -inf the output is zeros and lse is -inf.

  Returns:
    `(out [..., num_qo_heads, head_dim] in out_a.dtype, lse f32[..., num_qo_heads])`.

  Raises:
    ValueError: shapes of the two states differ, or lse shape is not
      `out.shape[:-1]`.
  """
  _checks.check_shape(out_b, out_a.shape, "out_b")
  _checks.check_shape(lse_a, out_a.shape[:-1], "lse_a")
  _checks.check_shape(lse_b, out_a.shape[:-1], "lse_b")
  return reference.merge_state_reference(out_a, lse_a, out_b, lse_b)
