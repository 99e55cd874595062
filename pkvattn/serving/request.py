"""A generation request on the host: its record, its status and its checks.

`Request` is the engine's only per-request state on the host (the device
knows a request only as a row of the cache, `seq_id`). Its status follows
vLLM's request life cycle, with the running phase split in two because a
prompt may take several steps (chunked prefill):

    WAITING -> PREFILL -> DECODE -> FINISHED
       ^          |          |
       +----------+----------+   preempted (recomputed from prompt + output)

`make_request` validates a request against what an engine can hold
(`RequestLimits`) before anything is queued, so a request that can never run
fails at `add_request`, not steps later.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from pkvattn.sampling import SamplingParams


class RequestStatus(str, enum.Enum):
  """Where a request is in its life (a `str` enum: `status == "finished"`
  holds for `RequestStatus.FINISHED`, and `str(status)` is its value).

  WAITING: queued, holds no row (new, refused by a full pool, or preempted).
  PREFILL: admitted to a row; its prompt (+ output, after a preemption) is
    being computed, in chunks of the step's token budget.
  DECODE: every token but the last sampled one is in the cache; it feeds one
    token per step (or `decode_steps` per burst).
  FINISHED: stopped by a stop token or its length, or failed alone
    (`finish_reason == "error"`); its row is released.
  """
  WAITING = "waiting"
  PREFILL = "prefill"
  DECODE = "decode"
  FINISHED = "finished"

  def __str__(self) -> str:
    return self.value


@dataclasses.dataclass
class Request:
  """A generation request and its progress (host side).

  Attributes:
    request_id: the id `Engine.add_request` returned.
    prompt: prompt token ids.
    params: how it samples and stops.
    stop_ids: token ids that end it (empty with `params.ignore_eos`).
    output: generated token ids (the stop token, if any, included).
    status: a `RequestStatus`.
    seq_id: its row of the step batch and sequence id in the cache; -1 while
      it holds none.
    num_computed: tokens whose KV is in the cache.
    num_reused: prompt tokens served by the prefix cache at its last claim.
    finish_reason: "stop" (a stop token), "length" (`max_new_tokens`) or
      "error" (an exception while its inputs were prepared or its outputs
      booked: `error` says which; the other requests go on); None until it
      finishes.
    error: the message of the exception that finished it with "error", else
      None.
    num_preemptions: times it was preempted and requeued.
    first_token_step: `EngineStats.num_steps` when its first token was
      sampled.
    reuse_scope: prefix-cache scope (tenant / adapter salt).
  """
  request_id: int
  prompt: list[int]
  params: SamplingParams
  stop_ids: frozenset
  output: list[int] = dataclasses.field(default_factory=list)
  status: RequestStatus = RequestStatus.WAITING
  seq_id: int = -1
  num_computed: int = 0
  num_reused: int = 0
  finish_reason: str | None = None
  num_preemptions: int = 0
  first_token_step: int | None = None
  reuse_scope: int = 0
  error: str | None = None

  @property
  def tokens(self) -> list[int]:
    """What the cache must hold before the next sample: prompt + generated."""
    return self.prompt + self.output

  @property
  def done(self) -> bool:
    return self.status is RequestStatus.FINISHED


@dataclasses.dataclass(frozen=True)
class RequestLimits:
  """What one engine can hold of a request (checked by `make_request`).

  Attributes:
    max_model_len: prompt + generated tokens at most.
    page_size: tokens per slot.
    max_slots: slots of the smallest slot space (one request must fit each).
    pool_text: the pool's size in words, for error messages.
    vocab_size: token ids lie in `[0, vocab_size)`.
    max_prefill_tokens: None, or the token budget of one step when a prompt
      (or a recompute of prompt + output) must be prefilled in one step (SWA
      scratch blocks live for one step only).
    default_stop_ids: the model's EOS ids, for requests naming none.
  """
  max_model_len: int
  page_size: int
  max_slots: int
  pool_text: str
  vocab_size: int
  max_prefill_tokens: int | None
  default_stop_ids: frozenset


def make_request(prompt, params: SamplingParams, limits: RequestLimits,
                 reuse_scope: int = 0) -> Request:
  """A validated `Request` (id -1, not queued).

  Args:
    prompt: token ids: a sequence of ints or a 1-D integer array.
    params: a `SamplingParams`.
    limits: the engine's `RequestLimits`.
    reuse_scope: prefix-cache scope, an int in [-2**31, 2**31 - 1] (it is an
      int32 input of the claim).

  Raises:
    ValueError: a prompt that is not a 1-D sequence of ints (e.g. a str), an
      empty prompt, `len(prompt) + max_new_tokens` over `max_model_len`, over
      the smallest slot space or (SWA scratch) over one step's budget, token
      ids (prompt or `params.stop_token_ids`) outside the vocabulary,
      `params` not a `SamplingParams`, or `reuse_scope` not an int32.
  """
  if isinstance(prompt, (str, bytes)):
    raise ValueError(
        f"Invalid prompt: expected a sequence of token ids, got "
        f"{type(prompt).__name__} (encode it with the model's tokenizer)")
  if not isinstance(params, SamplingParams):
    raise ValueError(
        f"Invalid params: expected a SamplingParams, got "
        f"{type(params).__name__}")
  if (not isinstance(reuse_scope, (int, np.integer))
      or isinstance(reuse_scope, bool)
      or not -2**31 <= reuse_scope <= 2**31 - 1):
    raise ValueError(
        f"Invalid reuse_scope: expected an int in [{-2**31}, {2**31 - 1}], "
        f"got {reuse_scope!r}")
  try:
    arr = np.asarray(prompt)
  except (TypeError, ValueError) as e:
    raise ValueError(f"Invalid prompt: expected token ids, got {prompt!r}") from e
  if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
    raise ValueError(
        f"Invalid prompt: expected a 1-D sequence of int token ids, got "
        f"shape {arr.shape} of {arr.dtype}")
  prompt = arr.tolist()  # Python ints, in one call rather than one per token
  if not prompt:
    raise ValueError("Invalid prompt: expected at least one token, got none")
  total = len(prompt) + params.max_new_tokens
  if total > limits.max_model_len:
    raise ValueError(
        f"Invalid request: len(prompt) + max_new_tokens = {total} exceeds "
        f"max_model_len={limits.max_model_len}")
  blocks = -(-total // limits.page_size)
  if blocks > limits.max_slots:
    raise ValueError(
        f"Invalid request: len(prompt) + max_new_tokens = {total} tokens need "
        f"{blocks} slots of {limits.page_size} tokens, but the pool has "
        f"{limits.pool_text}")
  if limits.max_prefill_tokens is not None and total > limits.max_prefill_tokens:
    raise ValueError(
        f"Invalid request: with SWA scratch reuse, len(prompt) + "
        f"max_new_tokens = {total} must fit max_num_tokens="
        f"{limits.max_prefill_tokens}")
  lo, hi = int(arr.min()), int(arr.max())
  if lo < 0 or hi >= limits.vocab_size:
    raise ValueError(
        f"Invalid prompt: token ids must be in [0, {limits.vocab_size}),"
        f" got range [{lo}, {hi}]")
  if params.stop_token_ids is not None:
    stop = frozenset(int(t) for t in params.stop_token_ids)
    if stop and max(stop) >= limits.vocab_size:
      raise ValueError(
          f"Invalid stop_token_ids: token ids must be in [0, "
          f"{limits.vocab_size}), got {max(stop)}")
  else:
    stop = frozenset() if params.ignore_eos else limits.default_stop_ids
  return Request(-1, prompt, params, stop, reuse_scope=int(reuse_scope))


def make_requests(prompts, params, limits: RequestLimits) -> list[Request]:
  """Validated requests of a batch (`Engine.generate`): all of them are
  checked before the caller queues any.

  Args:
    prompts: a sequence of prompts (each as `make_request` takes it).
    params: one `SamplingParams` for all, or one per prompt.
    limits: the engine's `RequestLimits`.

  Raises:
    ValueError: `prompts` is a str, `params` a sequence whose length differs
      from `prompts`', or `prompts[i]` is invalid (the message names `i`).
  """
  if isinstance(prompts, (str, bytes)):
    raise ValueError(
        "Invalid prompts: expected a list of token-id sequences, got a str")
  prompts = list(prompts)
  if isinstance(params, SamplingParams):
    params = [params] * len(prompts)
  else:
    params = list(params)
    if len(params) != len(prompts):
      raise ValueError(
          f"Invalid params: expected one SamplingParams per prompt "
          f"({len(prompts)}), got {len(params)}")
  reqs = []
  for i, (p, sp) in enumerate(zip(prompts, params)):
    try:
      reqs.append(make_request(p, sp, limits))
    except ValueError as e:
      raise ValueError(f"Invalid prompts[{i}]: {e}") from e
  return reqs


def check_stop(req: Request) -> str | None:
  """Why `req` ends after the tokens just booked: "stop" (its last token is a
  stop token and EOS is not ignored), "length" (`max_new_tokens` reached),
  else None. A stop token wins over the length, as in vLLM's `check_stop`."""
  if req.output and req.output[-1] in req.stop_ids and not req.params.ignore_eos:
    return "stop"
  if len(req.output) >= req.params.max_new_tokens:
    return "length"
  return None
