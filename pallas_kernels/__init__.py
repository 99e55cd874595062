"""Pallas GPU kernels of paged attention and the KV cache, with their references.

Each op has a wrapper module that runs a step and, per backend, a kernel:
Pallas-Triton (any CUDA GPU, and interpret mode on the CPU) or Pallas on
Mosaic GPU (Hopper only).

* Decode: `paged_decode` (wrapper and Triton split-K kernel) and
  `paged_decode_mma` (Mosaic GPU, `mma.sync` per warp).
* Prefill: `paged_prefill` (wrapper and Triton kernel),
  `paged_prefill_mgpu` (Mosaic GPU, warp-specialised TMA + wgmma) with
  `_mgpu_rows` (its packed-GQA row loads and stores); the tile schedule in
  `plan` (jnp) and `plan_mgpu` (Mosaic GPU, one launch).
* RoPE + paged K/V append: `rope_append` (wrapper and Triton kernel) and
  `rope_append_mgpu` (Mosaic GPU).
* `dispatch`: which kernel and config each op runs (one rule per op,
  mirrored by the tables of docs/kernels.md).
* `reference`: the pure-jnp oracle of every op (no Pallas or Triton
  import; runs anywhere, and is the `impl="xla"` path).
* Shared pieces: `_fp8` (FP8 page conversions), `_mlir` (inline PTX / MLIR
  for the per-thread Mosaic-GPU code), `_compat` (jax version shims and
  device queries).

Importing the package is cheap on a CPU-only machine: the kernel modules
reach Mosaic GPU only when a Hopper kernel is built.
"""
