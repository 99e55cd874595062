"""FlashInfer 0.7.2 beside pkvattn in one process: the same pages, timed the
same way.

FlashInfer's NHD paged layout `[num_pages, 2, page_size, num_kv_heads,
head_dim]` is pkvattn's "flashinfer" kv_cache format, and its
`indptr / indices / last_page_len` describe the same page table, so both
libraries read the very same device buffers (handed over by DLPack, no copy).
Needs `flashinfer-python==0.7.2.post1` and `apache-tvm-ffi==0.1.15.post2`
(its kernels JIT-compile on first use) and a CUDA build of torch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import timing as _timing


def to_torch(x):
  """A jax array as a torch CUDA tensor on the same buffer (FP8 via uint8)."""
  import torch  # pylint: disable=import-outside-toplevel
  if x.dtype == jnp.float8_e4m3fn:
    u8 = torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8))
    return u8.view(torch.float8_e4m3fn)
  return torch.from_dlpack(x)


def torch_time(fn, iters: int = 20, min_time_s: float = 0.2) -> float:
  """`timing.time_fn`'s method for a torch call (`timing.pipelined_ms`
  with `torch.cuda.synchronize`): median ms per call of back-to-back
  calls."""
  import torch  # pylint: disable=import-outside-toplevel
  for _ in range(4):
    fn()
  torch.cuda.synchronize()
  return _timing.pipelined_ms(fn, lambda _: torch.cuda.synchronize(),
                              iters=iters, min_time_s=min_time_s)["median_ms"]


def versions() -> dict[str, str]:
  """Installed versions of flashinfer-python and torch (empty if either is
  missing), for a results file."""
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  try:
    return {p: metadata.version(p) for p in ("flashinfer-python", "torch")}
  except metadata.PackageNotFoundError:
    return {}


def paged_kv_indices(page_table, kv_lens, page_size: int):
  """FlashInfer's CSR description of a shared page table.

  Args:
    page_table: `i32[batch_size, max_pages]`; kv_lens: `i32[batch_size]`,
      tokens per sequence; page_size: tokens per page.

  Returns:
    numpy `(indptr i64[batch_size + 1], indices i32[sum of pages],
    last_page_len i64[batch_size])`: sequence `b` owns pages
    `indices[indptr[b]:indptr[b + 1]]`, the first `cdiv(kv_lens[b],
    page_size)` entries of its table row, and its last page holds
    `last_page_len[b]` tokens (0 for an empty sequence).
  """
  kv_lens = np.asarray(kv_lens)
  table = np.asarray(page_table)
  pages = [table[b, :-(-int(n) // page_size)] for b, n in enumerate(kv_lens)]
  indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])])
  indices = (np.concatenate(pages).astype(np.int32) if indptr[-1]
             else np.zeros(0, np.int32))
  last = np.where(kv_lens > 0, (kv_lens - 1) % page_size + 1, 0)
  return indptr, indices, last


_WORKSPACE = []


def workspace():
  """One 256 MiB FlashInfer workspace per process."""
  import torch  # pylint: disable=import-outside-toplevel
  if not _WORKSPACE:
    _WORKSPACE.append(torch.empty(256 << 20, dtype=torch.uint8,
                                  device="cuda"))
  return _WORKSPACE[0]


def decode_wrapper(kv_cache, page_table, kv_lens, *, num_qo_heads: int,
                   num_kv_heads: int, q_dtype, use_tensor_cores: bool = False):
  """A FlashInfer `BatchDecodeWithPagedKVCacheWrapper` planned for
  `page_table` / `kv_lens` (numpy) over `kv_cache [num_pages, 2, page_size,
  num_kv_heads, head_dim]` (jax; float8_e4m3fn or `q_dtype`, a torch
  dtype), on this process's workspace; `run(q, cache)` as often as wanted."""
  import flashinfer  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  page_size, head_dim = kv_cache.shape[2], kv_cache.shape[4]
  indptr, indices, last = paged_kv_indices(page_table, kv_lens, page_size)
  dev = lambda a: torch.as_tensor(np.asarray(a, np.int32), device="cuda")  # noqa: E731
  kv_dtype = (torch.float8_e4m3fn if kv_cache.dtype == jnp.float8_e4m3fn
              else q_dtype)
  w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
      workspace(), "NHD", use_tensor_cores=use_tensor_cores)
  w.plan(dev(indptr), dev(indices), dev(last), num_qo_heads, num_kv_heads,
         head_dim, page_size, q_data_type=q_dtype, kv_data_type=kv_dtype)
  return w


def decode_fn(q, kv_cache, page_table, kv_lens, *, num_qo_heads: int,
              num_kv_heads: int, k_scale: float | None = None,
              v_scale: float | None = None, use_tensor_cores: bool = False):
  """A planned FlashInfer `BatchDecodeWithPagedKVCacheWrapper` call.

  Args:
    q: `[batch_size, num_qo_heads, head_dim]` bf16 / f16 (jax).
    kv_cache: `[num_pages, 2, page_size, num_kv_heads, head_dim]` (jax),
      q's dtype or float8_e4m3fn with `k_scale` / `v_scale`.
    page_table: `i32[batch_size, max_pages]` numpy; kv_lens: `i32[batch]`.
    use_tensor_cores: FlashInfer's tensor-core decode (its prefill kernel
      over the GQA group), which it recommends for larger groups.

  Returns:
    `(run, out)`: `run()` launches the decode (no host work but the launch)
    and `out` is its first result as a jax f32 array.
  """
  qt, ct = to_torch(q), to_torch(kv_cache)
  w = decode_wrapper(kv_cache, page_table, kv_lens, num_qo_heads=num_qo_heads,
                     num_kv_heads=num_kv_heads, q_dtype=qt.dtype,
                     use_tensor_cores=use_tensor_cores)
  scales = {} if k_scale is None else dict(k_scale=k_scale, v_scale=v_scale)
  run = lambda: w.run(qt, ct, **scales)  # noqa: E731
  out = jnp.asarray(run().float().cpu().numpy())
  return run, out


def kernel_ms(run, calls: int = 5) -> float:
  """GPU time of one `run()` (FlashInfer launches), ms: the summed kernel
  durations of `calls` runs, as `timing.device_kernel_ms` times pkvattn's
  calls (launch gaps and host time excluded).

  The trace is jax.profiler's (its CUPTI tracer sees every kernel of the
  process, torch's included); where it shows no GPU kernel, torch.profiler's
  CUDA activity is used instead. Returns 0.0 where neither sees one.
  """
  import torch  # pylint: disable=import-outside-toplevel
  run()
  torch.cuda.synchronize()

  def thunk():
    run()
    torch.cuda.synchronize()

  events = _timing.gpu_stream_events([thunk] * calls)
  if events:
    return sum(ns for _, ns in events) / calls / 1e6
  from torch.profiler import ProfilerActivity  # pylint: disable=import-outside-toplevel
  from torch.profiler import profile  # pylint: disable=import-outside-toplevel
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(calls):
      run()
    torch.cuda.synchronize()
  total_us = 0.0
  for ev in prof.events():
    if str(getattr(ev, "device_type", "")).endswith("CUDA"):
      total_us += getattr(ev, "device_time", None) or getattr(
          ev, "cuda_time", 0.0)
  return total_us / calls / 1e3


def prefill_fn(q, kv_cache, page_table, q_indptr, kv_lens, *,
               num_qo_heads: int, num_kv_heads: int, causal: bool = True,
               sm_scale: float | None = None, backend: str = "fa3",
               window_left: int = -1):
  """A planned FlashInfer `BatchPrefillWithPagedKVCacheWrapper` call.

  Args:
    q: `[num_tokens, num_qo_heads, head_dim]` bf16 / f16 (jax), the ragged
      query rows of every sequence back to back (`q_indptr`).
    kv_cache: `[num_pages, 2, page_size, num_kv_heads, head_dim]` (jax).
    page_table: `i32[batch_size, max_pages]` numpy; q_indptr:
      `i32[batch_size + 1]`; kv_lens: `i32[batch_size]`, tokens including
      the new ones (queries are the last `q_len` positions, FlashInfer's
      causal convention too).
    backend: FlashInfer's prefill backend ("fa3" on Hopper, "fa2", "auto").
    window_left: FlashInfer's (and pkvattn's) sliding window: a query at
      position p sees keys from p - window_left on; -1: none.

  Returns:
    `(run, out)` as `decode_fn`: `run()` launches the prefill, `out` is
    its first result `[num_tokens, num_qo_heads, head_dim]` as jax f32.
  """
  import flashinfer  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  page_size, head_dim = kv_cache.shape[2], kv_cache.shape[4]
  indptr, indices, last = paged_kv_indices(page_table, kv_lens, page_size)
  dev = lambda a: torch.as_tensor(np.asarray(a, np.int32), device="cuda")  # noqa: E731
  qt, ct = to_torch(q), to_torch(kv_cache)
  w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD",
                                                     backend=backend)
  w.plan(dev(q_indptr), dev(indptr), dev(indices), dev(last), num_qo_heads,
         num_kv_heads, head_dim, page_size, causal=causal, sm_scale=sm_scale,
         window_left=window_left, q_data_type=qt.dtype,
         kv_data_type=ct.dtype)
  run = lambda: w.run(qt, ct)  # noqa: E731
  out = jnp.asarray(run().float().cpu().numpy())
  return run, out
