"""Functional KV-cache state: a pytree plus pure, jit-compiled functions."""
