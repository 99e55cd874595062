"""`TokenizersTokenizer` over a hand-built `tokenizers.Tokenizer`: the
protocol of the module docstring (BOS added by `encode` only, special tokens
skipped by `decode`, EOS ids plus the template's end-of-turn token) and
`len(tokenizer)`-style `vocab_size` (Hugging Face counts added tokens)."""

from __future__ import annotations

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from pkvattn.models.tokenizer import TokenizersTokenizer  # noqa: E402
from pkvattn.models.tokenizer import end_of_turn_ids  # noqa: E402

_VOCAB = {"<s>": 0, "</s>": 1, "<|im_end|>": 2, "hello": 3, "world": 4,
          "<unk>": 5}
_TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['content'] }}"
             "<|im_end|></s>{% endfor %}<|end|>")


def _tok(**kw):
  """Word-level vocabulary `_VOCAB` (6 ids), special `<s>`, `</s>`,
  `<|im_end|>` and added `<|eot_id|>` (6, special) and `<|end|>` (7, not
  special); the post-processor prepends `<s>`."""
  t = tokenizers.Tokenizer(tokenizers.models.WordLevel(_VOCAB,
                                                       unk_token="<unk>"))
  t.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  t.add_special_tokens(["<s>", "</s>", "<|im_end|>", "<|eot_id|>"])
  t.add_tokens(["<|end|>"])
  t.post_processor = tokenizers.processors.TemplateProcessing(
      single="<s> $A", special_tokens=[("<s>", 0)])
  return TokenizersTokenizer(t, **kw)


def test_encode_decode_and_vocab_size():
  tok = _tok(bos_token_id=0)
  assert tok.vocab_size == 8  # 6 in the vocabulary + 2 added
  assert tok.encode("hello world") == [0, 3, 4]
  assert tok.encode_no_special("hello <|im_end|> world") == [3, 2, 4]
  assert tok.decode(np.array([0, 3, 2, 4, 1])) == "hello world"
  assert tok.bos_token_id == 0


def test_eos_ids_gain_the_templates_end_of_turn_token():
  """Only special tokens that are both end-of-turn texts and written by the
  template count: not `</s>` (not an end-of-turn text), not `<|eot_id|>`
  (absent from the template), not `<|end|>` (not special)."""
  special = {"bos_token": "<s>", "eos_token": "</s>"}
  tok = _tok(eos_token_ids=[np.int64(1), 2], chat_template=_TEMPLATE,
             special_tokens=special)
  assert tok.eos_token_ids == (1, 2) and type(tok.eos_token_ids[0]) is int
  assert _tok(eos_token_ids=(1,), chat_template=_TEMPLATE).eos_token_ids == (
      1, 2)
  assert _tok(eos_token_ids=(1,)).eos_token_ids == (1,)
  assert tok.special_tokens_map == special
  tok.special_tokens_map["bos_token"] = "x"  # a copy
  assert tok.special_tokens_map == special and _tok().special_tokens_map == {}


def test_end_of_turn_ids():
  pairs = [("<|eot_id|>", 9), ("<|im_end|>", 7), ("</s>", 1), ("<|end|>", 3)]
  assert end_of_turn_ids("<|im_end|> <|eot_id|> </s>", pairs) == (7, 9)
  assert end_of_turn_ids(None, pairs) == () and end_of_turn_ids("", pairs) == ()
  assert end_of_turn_ids("plain", pairs) == ()
