"""The sampler's kept-set floor: the sort-free kernel against the sort.

Run on a GPU:  `python -m bench.sampling [--specs NAME,...]
[--configs BLOCK:WARPS:WAYS,...]`

Specs (`SPECS`): rows x vocabulary of SmolLM2 (49,152), Llama 3 (128,256)
and Gemma 3 (262,144) at 64 and 256 rows, each with three settings: top-p
0.95, top-k 50 + top-p 0.95, top-k 50. Logits are normal with a scale that
gives a peaked row (most mass on a few hundred tokens) in half of the rows
and a flat one in the other half.

Arms: `sort` (`sample_floor.reference_floor`, a radix sort of the rows),
`kernel` (`sample_floor.sample_floor` with the dispatch rule's config, or
each of `--configs`), and the whole sampler (`pkvattn.sampling.sample`,
softmax + floor + draw) with either floor. Each kernel arm is checked
first: the kept set (`probs >= floor`) equal to the sort's on every row,
or, where a row differs, both floors within float32 rounding of the
float64 definition (`boundary_rows`). Times are GPU kernel time per call
(profiler trace); `x_sort` = the sort arm's time / the arm's.

Writes `<out>/sampling_<device>.json`; prints a table last.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import results
from bench.common import timing

VOCABS = {"smollm2": 49152, "llama3": 128256, "gemma3": 262144}
SETTINGS = {"p0.95": (0, 0.95), "k50_p0.95": (50, 0.95), "k50": (50, 1.0)}
SPECS = [f"{m}_r{r}_{s}" for m in VOCABS for r in (256, 64) for s in SETTINGS]


def make_inputs(name: str, seed: int = 0):
  """`(probs, top_k, top_p, active)` of a spec `<model>_r<rows>_<setting>`."""
  model, rows, setting = name.split("_", 2)
  rows, vocab = int(rows[1:]), VOCABS[model]
  k, p = SETTINGS[setting]
  rng = np.random.default_rng(seed)
  scale = np.where(np.arange(rows) % 2 == 0, 4.0, 0.5)[:, None]
  logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
  probs = jax.nn.softmax(jnp.asarray(logits), axis=-1)
  return (probs, jnp.full(rows, k, jnp.int32), jnp.full(rows, p, jnp.float32),
          jnp.ones(rows, bool))


def boundary_ok(probs, top_k, top_p, floor, tol: float = 1e-5) -> np.ndarray:
  """Per row: `floor` is the floor of the float64 definition up to `tol` of
  mass at the boundary (the smallest probability `v` with `C(v) < k` and
  `G(v) < top_p * M`; see `sample_floor`)."""
  p = np.asarray(probs, np.float64)
  ok = np.zeros(p.shape[0], bool)
  for r in range(p.shape[0]):
    row = np.sort(p[r])[::-1]
    cum = np.concatenate([[0.0], np.cumsum(row)])
    k = int(top_k[r]) if 0 < int(top_k[r]) < row.size else row.size
    m = cum[k]
    f = float(np.min(p[r][p[r] >= float(floor[r])]))  # the least value kept
    c = int(np.sum(p[r] > f))  # rank of its first copy
    g = cum[c]
    nxt = c + int(np.sum(p[r] == f))  # rank of the next smaller value
    holds = c < k and (g < top_p[r] * m + tol or top_p[r] >= 1)
    fails = nxt >= row.size or nxt >= k or (
        top_p[r] < 1 and cum[nxt] >= top_p[r] * m - tol)
    ok[r] = holds and fails
  return ok


def run_spec(name: str, configs, reps: int):
  from pkvattn import sampling  # pylint: disable=import-outside-toplevel
  from pkvattn.pallas_kernels import dispatch  # pylint: disable=import-outside-toplevel
  from pkvattn.pallas_kernels import sample_floor  # pylint: disable=import-outside-toplevel
  probs, top_k, top_p, active = make_inputs(name)
  rows, vocab = probs.shape
  sort = jax.jit(sample_floor.reference_floor)
  want = np.asarray(sort(probs, top_k, top_p))
  p = np.asarray(probs)
  out = []
  arms = [("sort", None, sort)]
  default = dispatch.sample_floor(gpu=dispatch.current_gpu(),
                                  dtype=probs.dtype, vocab_size=vocab).config
  for cfg in configs or [default]:
    arms.append(("kernel", cfg, jax.jit(functools.partial(
        sample_floor.sample_floor, config=cfg))))
  for arm, cfg, fn in arms:
    args = (probs, top_k, top_p) if arm == "sort" else (probs, top_k, top_p,
                                                        active)
    got = np.asarray(fn(*args))
    same = np.all((p >= got[:, None]) == (p >= want[:, None]), axis=1)
    boundary = np.flatnonzero(~same)
    ok = bool(np.all(boundary_ok(
        p[boundary], np.asarray(top_k)[boundary],
        np.asarray(top_p)[boundary], got[boundary]))) if boundary.size else True
    ms = timing.device_kernel_ms(fn, lambda args=args: args, calls=reps)
    out.append(dict(spec=name, rows=rows, vocab=vocab, arm=arm,
                    config=None if cfg is None else
                    f"{cfg.block}:{cfg.num_warps}:{cfg.ways}",
                    kernel_us=ms * 1e3, boundary_rows=int(boundary.size),
                    check_ok=ok))
  # The whole sampler, either floor.
  keys = (jnp.ones(rows), top_k, top_p, jnp.arange(rows, dtype=jnp.uint32),
          jnp.zeros(rows, jnp.int32))
  logits = jnp.log(probs)
  for impl in ("xla", None):
    fn = jax.jit(functools.partial(sampling.sample, cond=False, impl=impl))
    ms = timing.device_kernel_ms(fn, lambda: (logits, *keys), calls=reps)
    out.append(dict(spec=name, rows=rows, vocab=vocab,
                    arm="sampler, " + ("sort" if impl == "xla" else "kernel"),
                    config=None, kernel_us=ms * 1e3, boundary_rows=None,
                    check_ok=None))
  # Floors against the sort's floor, samplers against the sort's sampler.
  sort_us = {"floor": out[0]["kernel_us"],
             "sampler": next(r["kernel_us"] for r in out
                             if r["arm"] == "sampler, sort")}
  for r in out:
    ref = sort_us["sampler" if r["arm"].startswith("sampler") else "floor"]
    r["x_sort"] = ref / r["kernel_us"] if r["kernel_us"] else None
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--specs", default=None,
                  help=f"comma list (default all): {', '.join(SPECS)}")
  ap.add_argument("--configs", default=None,
                  help="kernel configs BLOCK:WARPS[:WAYS],... (default: the "
                  "dispatch rule's)")
  ap.add_argument("--reps", type=int, default=5)
  results.add_out_arg(ap)
  args = ap.parse_args(argv)
  from pkvattn.pallas_kernels import sample_floor  # pylint: disable=import-outside-toplevel
  names = args.specs.split(",") if args.specs else SPECS
  bad = [n for n in names if n not in SPECS]
  if bad:
    ap.error(f"--specs: unknown {bad}; expected names from {SPECS}")
  configs = None
  if args.configs:
    try:
      configs = [sample_floor.Config(*map(int, c.split(":")))
                 for c in args.configs.split(",")]
    except (TypeError, ValueError):
      ap.error(f"--configs: expected BLOCK:WARPS[:WAYS],..., got "
               f"{args.configs!r}")
  env = results.environment()
  rows = []
  for name in names:
    rows += run_spec(name, configs, args.reps)
  for p in results.write(f"sampling_{results.device_tag()}", rows,
                         out=args.out, env=env):
    print("wrote", p)
  timing.print_table(rows, ["spec", "arm", "config", "kernel_us", "x_sort",
                            "boundary_rows", "check_ok"])


if __name__ == "__main__":
  main()
