"""Fixtures shared by the serving tests."""

import pytest

from pkvattn.models import load_model


@pytest.fixture(scope="module")
def model():
  """The tiny Llama every engine test drives (module-scoped: one load per
  test file; a file that needs other models defines its own `model`)."""
  return load_model("tiny-llama")
