"""Checked mode: the runtime contract of the public ops turned into errors.

Unchecked (the default), out-of-contract *values* never raise: cache ops
refuse the request (`ok=False`) or ignore it, and the attention ops read
whatever the tables point at. Checked mode adds `jax.experimental.checkify`
checks of those values, so a caller's bug surfaces as an error naming the
argument, the offending entry and the expected range.

Turning it on:
  * `with pkvattn.checked(): ...` (or `pkvattn.cache.checked()`): every public
    op traced inside the block checks its contract. The flag is a
    `jax.make_user_context`, part of every `jax.jit` cache key, so a function
    jitted before the block is traced again inside it (and not otherwise).
  * `check=True` on one call (`check=False` turns it off inside the block;
    `None`, the default, follows the block).

Where the errors surface:
  * Eager calls (no argument is a tracer): the op runs its checks as one small
    jitted, checkified function and raises `checkify.JaxRuntimeError` (a
    `ValueError`) before doing any work.
  * Inside the caller's own `jax.jit` (or scan, vmap, ...): the checks are
    staged into the caller's program, which must then be functionalized by
    `jax.experimental.checkify.checkify`:

        with pkvattn.checked():
          err, out = checkify.checkify(jax.jit(step))(*args)
        err.throw()

    (`jax.jit(checkify.checkify(step))` works too.) Without `checkify`, JAX
    refuses to trace the staged checks ("Cannot abstractly evaluate a
    checkify.check which was not functionalized"). A staged op whose
    contract fails does not run its attention kernels (`guard`) and
    returns NaN. The other ops do what they do unchecked, where nothing
    goes out of range: append ops skip the offending tokens (and write
    nothing for a bad FP8 scale), cache ops refuse or ignore the request,
    and `page_table` returns an all -1 table for a bad `layer`.

The checks are a separate small function of the ops' integer inputs; the
ops' own bodies (and the kernels) are traced with the flag off
(`unchecked()`), so checked mode reuses their unchecked compilations.
Unchecked, none of this code runs: the compiled programs are those of the ops
alone (`tests/test_checked.py` compares the lowered text).

This module depends on jax only (the `cache` package never imports `pkvattn`).
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
from jax.experimental import checkify

# Read at trace time; part of the jit cache key (jax.make_user_context).
_CHECKED = jax.make_user_context(False)
# `run`'s staged branch: a stack of predicate lists that `require` fills.
_COLLECTING = threading.local()


def checked(enabled: bool = True):
  """Context manager: public ops traced inside it check their contract.

  Covered: `paged_decode`, `paged_prefill`, `append_paged_kv`,
  `apply_rope_and_append(_qkv)` (their tables and indices, and FP8
  `k_scale` / `v_scale` given as arrays), the cache ops `claim_batch`,
  `extend`, `commit`, `release`, `finish_step`, `fork`, and `page_table`'s
  array `layer` (each op's `check` argument lists its clauses). Eager calls raise at once. Inside your own jitted
  function, functionalize the staged checks with checkify:

      with pkvattn.checked():
        err, out = checkify.checkify(jax.jit(step))(*args)
      err.throw()

  The flag keys the jit cache (`jax.make_user_context`): `step` is traced
  again inside the block, and its unchecked compilation is reused outside.

  Args:
    enabled: True turns checked mode on, False off (e.g. to exempt one block
      inside an outer `checked()`).

  Returns:
    A context manager (no `as` value). Nestable and thread-local.

  Example:
    >>> import jax.numpy as jnp
    >>> import pkvattn
    >>> from pkvattn import cache
    >>> st = cache.init_cache(cache.CacheConfig(num_slots=4, page_size=4,
    ...                                         num_layers=1, max_seqs=2,
    ...                                         max_pages=2))
    >>> with pkvattn.checked():
    ...   st = cache.release(st, [0, 7])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    jax._src.checkify.JaxRuntimeError: Invalid seq_ids: seq_ids[1] = 7 is ...
  """
  return _CHECKED(bool(enabled))


def enabled(check: bool | None) -> bool:
  """The effective checked flag of one call (`None` follows `checked()`)."""
  if check is None:
    return bool(_CHECKED.value)
  return bool(check)


def unchecked():
  """Context manager for an op's own (check-free) body: traced as unchecked,
  so checked mode reuses the op's unchecked compilation (the flag is part of
  every jit cache key) instead of compiling it again."""
  return _CHECKED(False)


def require(pred, msg: str, *fmt_args) -> None:
  """`checkify.check(pred, msg, *fmt_args)`: one contract clause.

  Inside `run`'s staged branch the predicate is also collected, so that
  `run` can return whether every clause held."""
  checkify.check(pred, msg, *fmt_args)
  stack = getattr(_COLLECTING, "stack", None)
  if stack:
    stack[-1].append(pred)


def first_true(mask):
  """Flat index of the first True entry of `mask` (0 if none), `i32[]`.

  `mask` must be non-empty (the index is used to gather the offending value).
  """
  return jnp.argmax(mask.reshape(-1)).astype(jnp.int32)


def require_ids(seq_ids, max_seqs: int, name: str, *, unique: bool = True):
  """Ids are -1 (padding) or in `[0, max_seqs)`; with `unique`, no id twice."""
  if seq_ids.shape[0] == 0:
    return
  ids = seq_ids.astype(jnp.int32)
  bad = (ids < -1) | (ids >= max_seqs)
  i = first_true(bad)
  require(~jnp.any(bad),
          f"Invalid {name}: {name}[{{}}] = {{}} is not -1 (padding) or in "
          f"[0, max_seqs={max_seqs})", i, ids[i])
  if unique and ids.shape[0] > 1:
    same = ((ids[:, None] == ids[None, :]) & (ids[None, :] >= 0)
            & ~jnp.eye(ids.shape[0], dtype=bool))
    j = first_true(jnp.any(same, axis=1))
    require(~jnp.any(same),
            f"Invalid {name}: id {{}} appears more than once (first at "
            f"{name}[{{}}]); every id may appear once per call", ids[j], j)


def _is_traced(tree) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


@functools.lru_cache(maxsize=None)
def _functionalized(fn, statics):
  """`jit(checkify(fn))` with the static keyword arguments bound (cached)."""
  return jax.jit(checkify.checkify(functools.partial(fn, **dict(statics))))


def run(fn, *args, **statics):
  """Runs the contract function `fn(*args, **statics)` (made of `require`s).

  Eager (no tracer among `args`): runs it jitted and checkified, raising
  `checkify.JaxRuntimeError` (a `ValueError`) on the first violated clause,
  and returns None. Traced: stages the checks into the caller's program
  (module docstring) and returns `bool[]`, True where every clause holds,
  for `guard`. `statics` must be hashable.
  """
  if _is_traced(args):
    stack = _COLLECTING.__dict__.setdefault("stack", [])
    stack.append([])
    try:
      fn(*args, **statics)
    finally:
      preds = stack.pop()
    ok = jnp.bool_(True)
    for pred in preds:
      ok = ok & jnp.asarray(pred, bool)
    return ok
  err, _ = _functionalized(fn, tuple(sorted(statics.items())))(*args)
  err.throw()
  return None


def guard(ok, body, fallback):
  """`body()` where the staged contract holds, else `fallback()`.

  `ok` is `run`'s result: None (eager, already checked, or unchecked) runs
  `body()` alone; a `bool[]` runs `jax.lax.cond(ok, body, fallback)`, so a
  staged call whose contract fails never runs the op's body (a kernel
  would read or write pages outside the pools: on a GPU, an illegal
  address that ends the process's CUDA context). The two must return the
  same shapes and dtypes.
  """
  if ok is None:
    return body()
  return jax.lax.cond(ok, body, fallback)
