"""Fixtures shared by the serving tests."""

import pytest

from pkvattn.models import load_model


@pytest.fixture(scope="module")
def model():
  """The tiny Llama every engine test drives (module-scoped: one load per
  test file; a file that needs other models defines its own `model`)."""
  return load_model("tiny-llama")


@pytest.fixture
def exploding_params():
  """`make(max_new_tokens)`: sampling parameters whose `temperature`
  raises when read, as a bug in a request's fields would; the engine must
  fail that request alone."""
  def make(max_new_tokens):
    class Exploding:
      ignore_eos, stop_token_ids, seed, top_k, top_p = True, None, 0, 0, 1.0

      @property
      def temperature(self):
        raise RuntimeError("boom")

    params = Exploding()
    params.max_new_tokens = max_new_tokens
    return params
  return make
