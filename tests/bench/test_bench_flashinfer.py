"""The CSR page description the benchmarks hand to FlashInfer."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.common import flashinfer as _flashinfer  # noqa: E402  (repo root, for the bench package)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_kv_indices_match_a_token_walk(page_size, rng):
  batch, max_pages = 7, 9
  table = rng.permutation(batch * max_pages).reshape(batch, max_pages)
  table = table.astype(np.int32)
  kv_lens = rng.integers(0, max_pages * page_size + 1, batch)
  kv_lens[0] = 0
  kv_lens[1] = max_pages * page_size
  indptr, indices, last = _flashinfer.paged_kv_indices(table, kv_lens,
                                                       page_size)
  assert indptr.shape == (batch + 1,) and last.shape == (batch,)
  assert indices.dtype == np.int32
  for b, n in enumerate(kv_lens):
    # Walk the tokens: token t lives in table[b, t // page_size].
    want = list(dict.fromkeys(table[b, t // page_size] for t in range(n)))
    assert list(indices[indptr[b]:indptr[b + 1]]) == want
    tokens = (len(want) - 1) * page_size + last[b] if want else 0
    assert tokens == n
    assert (last[b] == 0) == (n == 0)
