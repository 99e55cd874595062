"""`serving.request`: a request's checks at each limit's edge, and its stop rule."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pkvattn.sampling import SamplingParams
from pkvattn.serving.request import (Request, RequestLimits, RequestStatus,
                                     check_stop, make_request, make_requests)

LIMITS = RequestLimits(max_model_len=40, page_size=8, max_slots=6,
                       pool_text="6 slots", vocab_size=100,
                       max_prefill_tokens=None, default_stop_ids=frozenset({2}))


def _sp(n, **kw):
  return SamplingParams(max_new_tokens=n, **kw)


def test_a_request_that_fits_exactly_is_taken():
  """Every limit is inclusive: prompt + max_new_tokens equal to
  `max_model_len`, to the slots' capacity and to one step's budget, and the
  token ids 0 and `vocab_size - 1`, are all accepted."""
  req = make_request([0] * 30 + [99], _sp(9), LIMITS)
  assert len(req.prompt) + req.params.max_new_tokens == 40
  assert req.request_id == -1 and req.status is RequestStatus.WAITING
  assert req.prompt == [0] * 30 + [99] and req.stop_ids == {2}
  # 48 tokens fill the 6 slots exactly (max_model_len not binding).
  roomy = dataclasses.replace(LIMITS, max_model_len=1000)
  make_request([5] * 40, _sp(8), roomy)
  budget = dataclasses.replace(roomy, max_prefill_tokens=20)
  make_request([5] * 10, _sp(10), budget)
  # A numpy prompt is taken as Python ints.
  req = make_request(np.arange(3, dtype=np.int16), _sp(1), LIMITS)
  assert req.prompt == [0, 1, 2] and type(req.prompt[0]) is int


@pytest.mark.parametrize("prompt,n,limits,match", [
    ([1] * 31, 10, LIMITS, "exceeds max_model_len=40"),
    ([1] * 41, 8, dataclasses.replace(LIMITS, max_model_len=1000),
     "need 7 slots of 8 tokens"),
    ([1] * 11, 10, dataclasses.replace(LIMITS, max_prefill_tokens=20),
     "must fit max_num_tokens=20"),
    ([1, 100], 1, LIMITS, r"got range \[1, 100\]"),
    ([-1, 5], 1, LIMITS, r"got range \[-1, 5\]"),
    ([], 1, LIMITS, "at least one token"),
    ("hello", 1, LIMITS, "encode it"),
    ([[1, 2]], 1, LIMITS, "1-D"),
    ([1.0, 2.0], 1, LIMITS, "int token ids"),
])
def test_one_past_a_limit_is_refused(prompt, n, limits, match):
  with pytest.raises(ValueError, match=match):
    make_request(prompt, _sp(n), limits)


def test_stop_ids_and_scope():
  """Stop ids: the request's own (checked against the vocabulary, the last
  id inclusive), else the model's EOS ids unless EOS is ignored. The reuse
  scope is an int32."""
  assert make_request([1], _sp(1, stop_token_ids=(0, 99)),
                      LIMITS).stop_ids == {0, 99}
  assert make_request([1], _sp(1, stop_token_ids=()), LIMITS).stop_ids == set()
  assert make_request([1], _sp(1, ignore_eos=True), LIMITS).stop_ids == set()
  with pytest.raises(ValueError, match="stop_token_ids.*got 100"):
    make_request([1], _sp(1, stop_token_ids=(3, 100)), LIMITS)
  for scope in (-2**31, 2**31 - 1, np.int64(7)):
    assert make_request([1], _sp(1), LIMITS, scope).reuse_scope == scope
  for scope in (-2**31 - 1, 2**31, True, 1.0):
    with pytest.raises(ValueError, match=r"reuse_scope: expected an int in "
                       rf"\[-2147483648, 2147483647\], got {scope!r}"):
      make_request([1], _sp(1), LIMITS, scope)
  with pytest.raises(ValueError, match="Invalid params"):
    make_request([1], {"max_new_tokens": 1}, LIMITS)


def test_a_batch_is_checked_whole():
  reqs = make_requests([[1], [2, 3]], _sp(2), LIMITS)
  assert [r.prompt for r in reqs] == [[1], [2, 3]]
  reqs = make_requests([[1], [2]], [_sp(1), _sp(3)], LIMITS)
  assert [r.params.max_new_tokens for r in reqs] == [1, 3]
  with pytest.raises(ValueError, match=r"prompts\[1\].*max_model_len"):
    make_requests([[1], [1] * 40], _sp(1), LIMITS)
  with pytest.raises(ValueError, match="one SamplingParams per prompt"):
    make_requests([[1], [2]], [_sp(1)], LIMITS)
  with pytest.raises(ValueError, match="Invalid prompts"):
    make_requests("12", _sp(1), LIMITS)


def test_check_stop():
  """A stop token wins over the length; the length ends a request at
  exactly `max_new_tokens`; with `ignore_eos` only the length counts, even
  for stop ids the request names (`make_request` keeps them)."""
  def req(output, n, **kw):
    return Request(0, [1], _sp(n, **kw), frozenset({2}), output=list(output))

  assert check_stop(req([], 3)) is None
  assert check_stop(req([5, 6], 3)) is None
  assert check_stop(req([5, 6, 7], 3)) == "length"
  assert check_stop(req([5, 2], 3)) == "stop"
  assert check_stop(req([5, 6, 2], 3)) == "stop"
  assert check_stop(req([2, 5], 3)) is None  # only the last token stops
  assert check_stop(req([5, 2], 3, ignore_eos=True)) is None
  named = make_request([1], _sp(3, stop_token_ids=(2,), ignore_eos=True),
                       LIMITS)
  named.output = [5, 2]
  assert named.stop_ids == {2} and check_stop(named) is None
  assert check_stop(req([5, 2, 2], 3, ignore_eos=True)) == "length"
  assert req([4], 3).tokens == [1, 4]


def test_a_new_request_holds_nothing_yet():
  """A fresh `Request` is WAITING with no row (`seq_id` -1), nothing
  computed, reused, generated or preempted, no finish reason, error or first
  token, in the default prefix-cache scope 0: the scope `make_request`,
  `make_requests` (`Engine.generate`) and `Engine.add_request` default to,
  so a batch shares its prefixes with default-scope requests."""
  rng = np.random.default_rng()
  prompt = rng.integers(0, 100, size=int(rng.integers(1, 20))).tolist()
  req = Request(int(rng.integers(0, 1000)), prompt, _sp(3), frozenset())
  assert (req.status, req.seq_id, req.output) == (RequestStatus.WAITING, -1, [])
  assert (req.num_computed, req.num_reused, req.num_preemptions) == (0, 0, 0)
  assert req.finish_reason is None and req.error is None
  assert req.first_token_step is None and not req.done
  assert req.reuse_scope == 0 and req.tokens == prompt
  assert make_request(prompt, _sp(3), LIMITS).reuse_scope == 0
  assert [r.reuse_scope for r in make_requests([prompt, [1]], _sp(3),
                                               LIMITS)] == [0, 0]


def test_limits_are_frozen():
  """`RequestLimits` is a frozen value: an engine's limits cannot be
  changed under its queued requests, and equal limits hash alike."""
  with pytest.raises(dataclasses.FrozenInstanceError):
    LIMITS.max_model_len = 1000
  assert hash(LIMITS) == hash(dataclasses.replace(LIMITS))
