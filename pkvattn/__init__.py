"""pkvattn: paged attention and a functional KV cache for JAX on NVIDIA GPUs.

Dimension glossary (used in every shape comment):

| name | meaning |
|---|---|
| `num_tokens` | static length of a ragged token batch (padded) |
| `batch_size` | sequences in the step |
| `num_qo_heads`, `num_kv_heads`, `group_size` | heads; q head `h` reads kv head `h // group_size` |
| `head_dim` | features per head (64, 128, 256) |
| `num_pages`, `page_size` | pages in a pool; tokens per page |
| `max_pages` | width of a page table |
| `q_indptr` | `i32[batch_size + 1]`, cu_seqlens of the new (query) tokens |
| `kv_lens` | `i32[batch_size]`, tokens in the cache including the new ones |
| `window_left` | key `j` visible to query at `i` iff `i - window_left <= j <= i`; -1 = none |

Einsum letters: `b` batch, `t` token, `h` q-head, `k` kv-head, `g` group, `s` kv
token, `d` head_dim.

Checked mode: inside `with pkvattn.checked():` (or with `check=True` on one
call) the attention, append and cache ops turn their runtime contract (page
ids of visible blocks, `q_indptr`, `kv_lens`, sequence ids) into errors via
`jax.experimental.checkify`; see `pkvattn.cache._contract` for use inside
`jax.jit`. Unchecked (the default) nothing is added to the programs.
"""

from pkvattn import cache as cache
from pkvattn._contract import checked as checked
from pkvattn._version import __version__ as __version__
from pkvattn.attention import merge_state as merge_state
from pkvattn.attention import paged_decode as paged_decode
from pkvattn.attention import paged_prefill as paged_prefill
from pkvattn.attention import plan_prefill as plan_prefill
from pkvattn.copy_pages import copy_pages as copy_pages
from pkvattn.rope import Llama3RopeScaling as Llama3RopeScaling
from pkvattn.rope import LinearRopeScaling as LinearRopeScaling
from pkvattn.rope import RopeConfig as RopeConfig
from pkvattn.rope import append_paged_kv as append_paged_kv
from pkvattn.rope import apply_rope as apply_rope
from pkvattn.rope import apply_rope_and_append as apply_rope_and_append
from pkvattn.rope import apply_rope_and_append_qkv as apply_rope_and_append_qkv
from pkvattn.rope import get_batch_indices_positions as get_batch_indices_positions

__all__ = [
    "__version__",
    "Llama3RopeScaling",
    "LinearRopeScaling",
    "RopeConfig",
    "append_paged_kv",
    "apply_rope",
    "apply_rope_and_append",
    "apply_rope_and_append_qkv",
    "cache",
    "checked",
    "copy_pages",
    "get_batch_indices_positions",
    "merge_state",
    "paged_decode",
    "paged_prefill",
    "plan_prefill",
]
