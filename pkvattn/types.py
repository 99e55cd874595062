"""Shared type aliases."""

from __future__ import annotations

from typing import Literal, Tuple, Union

import jax

Implementation = Literal["pallas", "xla"]

# A kv_cache is one of:
#   (k_pages, v_pages)   each [num_pages, page_size, num_kv_heads, head_dim], shared table
#   pool                 [num_pages, page_size, num_kv_heads, head_dim], split table
#   fi_cache             [num_pages, 2, page_size, num_kv_heads, head_dim], shared table
KVCache = Union[Tuple[jax.Array, jax.Array], jax.Array]
