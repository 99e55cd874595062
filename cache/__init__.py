"""Functional KV-cache state: a pytree plus pure, jit-compiled functions.

Users write `pkvattn.cache.init_cache(cfg)`, `pkvattn.cache.claim_batch(...)`,
and so on; see `cache/state.py` for the pool layout and `cache/alloc.py` for
the semantics shared by all operations. `checked()` (also `pkvattn.checked`)
turns the ops' runtime contract into errors (`cache/_contract.py`).
"""

from ._contract import checked as checked
from .alloc import ClaimResult as ClaimResult
from .alloc import ExtendResult as ExtendResult
from .alloc import ForkResult as ForkResult
from .alloc import claim_batch as claim_batch
from .alloc import commit as commit
from .alloc import extend as extend
from .alloc import finish_step as finish_step
from .alloc import fork as fork
from .alloc import release as release
from .state import NULL_PAGE as NULL_PAGE
from .state import NULL_SEQ as NULL_SEQ
from .state import CacheConfig as CacheConfig
from .state import CacheState as CacheState
from .state import init_cache as init_cache
from .state import stats as stats
from .tables import page_table as page_table
from .validate import validate as validate
from .window import PageIndexMode as PageIndexMode
from .window import SwaScratchPlan as SwaScratchPlan
from .window import swa_scratch_plan as swa_scratch_plan

__all__ = [
    "CacheConfig",
    "CacheState",
    "ClaimResult",
    "ExtendResult",
    "ForkResult",
    "NULL_PAGE",
    "NULL_SEQ",
    "PageIndexMode",
    "SwaScratchPlan",
    "checked",
    "claim_batch",
    "commit",
    "extend",
    "finish_step",
    "fork",
    "init_cache",
    "page_table",
    "release",
    "stats",
    "swa_scratch_plan",
    "validate",
]
