"""Pallas GPU kernels (Triton lowering) and their pure-jnp references.

`reference` imports no Pallas or Triton and runs anywhere; the kernel modules import
Pallas lazily enough that importing this package on a CPU-only machine is cheap.
"""
