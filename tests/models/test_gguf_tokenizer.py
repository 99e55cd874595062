"""`GGUFTokenizer.from_metadata` on tiny synthetic GGUF vocabularies.

Expected values come from the module's docstring (llama.cpp's token types,
BOS / EOS flags and their defaults, the pre-tokenizers by
`tokenizer.ggml.pre`, SentencePiece spaces), SentencePiece's handling of
unknown characters, and BPE run by hand on vocabularies small enough to
follow:

* errors: no vocabulary, unsupported model or pre-tokenizer, token types or
  scores not one per token, "gpt2" without merges;
* BOS / EOS: added per `add_bos_token` / `add_eos_token` (default: "llama"
  adds BOS, "gpt2" nothing); ids outside the vocabulary count as absent;
  the special tokens' texts and the end-of-generation ids;
* control tokens matched whole and skipped by `decode`, user-defined ones
  matched whole and kept (SentencePiece: with their raw spelling);
* "gpt2" pre-tokenizers: GPT-2's split, SmolLM's digits, Llama 3's regex;
* "llama": tokens of spaces spelled as spaces, `add_space_prefix`, unknown
  characters without byte tokens (SentencePiece: one `<unk>` per run).
"""

from __future__ import annotations

import pytest

gguf = pytest.importorskip("gguf")

from pkvattn.models.gguf_tokenizer import GGUFTokenizer  # noqa: E402
from pkvattn.models.gguf_tokenizer import _merge_pair  # noqa: E402
from model_files import byte_level_vocab  # noqa: E402
from model_files import spm_vocab  # noqa: E402

SP = "\u2581"  # SentencePiece's space


def _gpt2(**kw):
  """A "gpt2" vocabulary (model_files'): `<|endoftext|>` (0),
  `<|im_start|>` (1), `<|im_end|>` (2) control, then the 256 byte symbols,
  "Ġt" (259), "he" (260), "Ġthe" (261), unused tokens; `kw` keys are
  `tokenizer.ggml.<key>`."""
  tokens, types, merges = byte_level_vocab()
  meta = {"model": "gpt2", "tokens": tokens, "token_type": types,
          "merges": merges, **kw}
  return GGUFTokenizer.from_metadata(
      {f"tokenizer.ggml.{k}": v for k, v in meta.items()})


def _sym(text):
  """Id of a byte-level symbol in `_gpt2`'s vocabulary."""
  return byte_level_vocab()[0].index(text)


def _spm_meta(tokens=None, types=None, **kw):
  """`tokenizer.ggml.*` of model_files' SentencePiece vocabulary
  (`<unk>` 0, `<s>` 1, `</s>` 2, byte tokens, pieces scored by length)."""
  t, ty, scores = spm_vocab()
  meta = {"model": "llama", "tokens": tokens or t, "token_type": types or ty,
          "scores": scores, "bos_token_id": 1, "eos_token_id": 2,
          "unknown_token_id": 0, **kw}
  return {f"tokenizer.ggml.{k}": v for k, v in meta.items() if v is not None}


def _spm(tokens=None, types=None, **kw):
  return GGUFTokenizer.from_metadata(_spm_meta(tokens, types, **kw))


def _spm_id(piece):
  return spm_vocab()[0].index(piece)


def test_token_type_values_are_llama_cpps():
  """The token type constants are llama.cpp's (the `gguf` package's
  `TokenType`)."""
  from pkvattn.models import gguf_tokenizer as gt
  for t in gguf.TokenType:
    assert getattr(gt, t.name) == t.value, t.name


# -------------------------------------------------------------------- errors
def test_invalid_metadata_raises():
  tokens, types, merges = byte_level_vocab()
  gpt2 = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.merges": merges}
  with pytest.raises(ValueError, match="no tokenizer.ggml.tokens"):
    GGUFTokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})
  with pytest.raises(ValueError, match=r"'bert' is not supported"):
    GGUFTokenizer.from_metadata({**gpt2, "tokenizer.ggml.model": "bert"})
  with pytest.raises(ValueError,
                     match=rf"expected {len(tokens)} token types, got 2"):
    GGUFTokenizer.from_metadata({**gpt2, "tokenizer.ggml.token_type": [1, 1]})
  with pytest.raises(ValueError, match="needs tokenizer.ggml.merges"):
    GGUFTokenizer.from_metadata({**gpt2, "tokenizer.ggml.merges": []})
  with pytest.raises(ValueError, match=r"pre 'qwerty' is not supported"):
    GGUFTokenizer.from_metadata({**gpt2, "tokenizer.ggml.pre": "qwerty"})
  spm = _spm_meta()
  for scores in (None, spm["tokenizer.ggml.scores"][1:]):
    meta = {**spm, "tokenizer.ggml.scores": scores}
    with pytest.raises(ValueError, match="one tokenizer.ggml.scores entry"):
      GGUFTokenizer.from_metadata(meta)


# ----------------------------------------------------------------- BOS / EOS
def test_gpt2_adds_nothing_without_flags():
  """A "gpt2" vocabulary without add_bos_token adds no BOS; BPE merges
  " the" into "Ġthe" (261)."""
  tok = _gpt2(bos_token_id=1, eos_token_id=0)
  assert tok.encode(" the") == [261]
  assert tok.encode("the") == [_sym("t"), 260]
  assert _gpt2(bos_token_id=1, add_bos_token=False).encode(" the") == [261]


def test_bos_and_eos_flags():
  """add_bos_token / add_eos_token add the ids given; a flag without its id,
  or an id outside the vocabulary (or negative), adds nothing."""
  both = _gpt2(bos_token_id=1, eos_token_id=2, add_bos_token=True,
               add_eos_token=True)
  assert both.encode(" the") == [1, 261, 2]
  assert _gpt2(bos_token_id=0, add_bos_token=True).encode(" the") == [0, 261]
  assert _gpt2(eos_token_id=0, add_eos_token=True).encode(" the") == [261, 0]
  assert _gpt2(add_bos_token=True, add_eos_token=True).encode(" the") == [261]
  n = len(byte_level_vocab()[0])
  for bad in (n, -1):
    tok = _gpt2(bos_token_id=bad, eos_token_id=bad, add_bos_token=True,
                add_eos_token=True)
    assert tok.encode(" the") == [261], bad
    assert tok.bos_token_id is None and tok.eos_token_ids == ()
  last = _gpt2(bos_token_id=n - 1, add_bos_token=True)
  assert last.encode(" the") == [n - 1, 261] and last.bos_token_id == n - 1


def test_special_token_texts_and_stop_ids():
  """The template variables are the texts of the bos / eos / unknown /
  padding ids (None when absent); EOS, EOT and EOM ids all stop."""
  tok = _gpt2(bos_token_id=1, eos_token_id=0, padding_token_id=2,
              eot_token_id=2)
  assert tok.special_tokens_map == {
      "bos_token": "<|im_start|>", "eos_token": "<|endoftext|>",
      "unk_token": None, "pad_token": "<|im_end|>"}
  assert tok.bos_token_id == 1 and tok.eos_token_ids == (0, 2)
  assert _gpt2(eom_token_id=1).eos_token_ids == (1,)
  tok = _spm()
  assert tok.special_tokens_map == {"bos_token": "<s>", "eos_token": "</s>",
                                    "unk_token": "<unk>", "pad_token": None}


def test_llama_adds_bos_unless_told_not_to():
  """A "llama" vocabulary adds BOS by default (llama.cpp), not EOS; with
  add_bos_token false, none."""
  ids = _spm().encode("hello")
  assert ids == [1, _spm_id(SP + "hello")]
  assert _spm(add_bos_token=False).encode("hello") == ids[1:]
  assert _spm(add_eos_token=True).encode("hello") == ids + [2]


# ------------------------------------------------ control and user tokens
def test_control_and_user_defined_tokens():
  """Control tokens are matched whole and skipped by decode; user-defined
  ones are matched whole and kept."""
  tokens, types, merges = byte_level_vocab()
  tokens[-1], types[-1] = "<tool>", 4
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
  tok = GGUFTokenizer.from_metadata(meta)
  n = len(tokens)
  ids = tok.encode("<|im_start|> the<tool>")
  assert ids == [1, 261, n - 1]
  assert tok.decode(ids) == " the<tool>"


def test_without_token_types_all_tokens_are_normal():
  """No token_type: every token is normal, so `<|im_start|>` is not matched
  whole (no merge builds it) and not skipped by decode."""
  tokens, _, merges = byte_level_vocab()
  tok = GGUFTokenizer.from_metadata({
      "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
      "tokenizer.ggml.merges": merges})
  ids = tok.encode("<|im_start|>")
  assert ids == [_sym(c) for c in "<|im_start|>"]
  assert tok.decode(ids) == "<|im_start|>"


def test_a_merge_line_splits_at_its_first_space():
  """A merge line is split at its first space only (llama.cpp's loader):
  "x  y" is the pair ("x", " y") of the vocabulary's "x y", and the
  tokenizer builds and encodes as before (split at every space, the line
  would be three parts and refused)."""
  tokens, types, merges = byte_level_vocab()
  tokens[262:264], types[262:264] = [" y", "x y"], [1, 1]
  tok = GGUFTokenizer.from_metadata({
      "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
      "tokenizer.ggml.token_type": types,
      "tokenizer.ggml.merges": merges + ["x  y"]})
  assert tok.encode(" the") == [261]


def test_a_merge_line_may_start_with_a_space():
  """llama.cpp splits a merge line at its first space from the second
  character on: "  x" is the pair (" ", "x"), not ("", " x") (a token ""
  the vocabulary lacks). A line without such a space names no pair and is
  skipped; the tokenizer still loads and encodes as before."""
  tokens, types, merges = byte_level_vocab()
  tokens[262:265], types[262:265] = [" ", "x", " x"], [1, 1, 1]
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": types}
  tok = GGUFTokenizer.from_metadata(
      {**meta, "tokenizer.ggml.merges": merges + ["  x", "xy"]})
  assert tok.encode(" the") == [261]
  assert _merge_pair("  x") == (" ", "x")
  assert _merge_pair("Ġ t") == ("Ġ", "t")
  assert _merge_pair("x  y") == ("x", " y")
  assert _merge_pair("xy") is None and _merge_pair(" ") is None


# --------------------------------------------------------- pre-tokenizers
def _digits_gpt2(pre):
  """`_gpt2` plus digit merges "3 4" (first), "1 2", "12 3"."""
  tokens, types, merges = byte_level_vocab()
  extra = ["3 4", "1 2", "12 3"]
  for i, m in enumerate(extra):
    tokens[262 + i] = m.replace(" ", "")
    types[262 + i] = 1
  return GGUFTokenizer.from_metadata({
      "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
      "tokenizer.ggml.token_type": types, "tokenizer.ggml.pre": pre,
      "tokenizer.ggml.merges": extra + merges})


def test_digit_splits_by_pre_tokenizer():
  """"1234" under GPT-2's split is one piece ("34" merges first, then
  "12"); SmolLM splits every digit; Llama 3 splits 3 digits at a time
  ("123" + "4")."""
  tokens = byte_level_vocab()[0]
  n12, n34, n123 = 263, 262, 264
  assert _digits_gpt2("default").encode("1234") == [n12, n34]
  assert _digits_gpt2("gpt-2").encode(" the1234") == [261, n12, n34]
  assert _digits_gpt2("smollm").encode("1234") == [
      _sym(c) for c in "1234"]
  assert _digits_gpt2("llama-bpe").encode("1234") == [n123, _sym("4")]
  assert tokens[_sym("4")] == "4"


# ------------------------------------------------------- SentencePiece
def test_tokens_of_spaces_spelled_as_spaces():
  """A converter that stores "▁▁" as two spaces gives the same tokenizer
  (SentencePiece spells spaces "▁")."""
  tokens = spm_vocab()[0]
  spaced = [t.replace(SP, " ") if not t.strip(SP) else t for t in tokens]
  assert spaced != tokens
  for text in ["a  b", "hello   world", "  a"]:
    assert _spm(spaced).encode(text) == _spm().encode(text), text
  ids = _spm(spaced).encode("a  b")
  assert _spm_id(SP + SP) in ids
  assert _spm(spaced).decode(ids) == "a  b"


def test_user_defined_tokens_keep_their_spelling():
  """A user-defined token of two spaces is matched on the raw text (not
  respelled "▁▁"), and decodes to its spaces."""
  tokens, types, _ = spm_vocab()
  i = _spm_id(SP + SP)
  tokens[i], types[i] = "  ", 4
  tok = _spm(tokens, types)
  ids = tok.encode("a  b")
  assert ids == [1, _spm_id(SP + "a"), i, _spm_id("b")]
  assert tok.decode(ids) == "a  b"


def test_space_prefix_and_decode():
  """add_space_prefix (default true) prepends "▁" to the text, and decode
  strips exactly one leading space (no trailing one); without it, neither."""
  tok = _spm()
  for text in ["hello", "hello ", "a  b"]:
    assert tok.decode(tok.encode(text)) == text, text
  assert tok.encode("a  b") == [1, _spm_id(SP + "a"), _spm_id(SP + SP),
                                _spm_id("b")]
  ids = [_spm_id(SP + SP), _spm_id(SP + "hello"), _spm_id(SP)]
  assert tok.decode(ids) == "  hello "
  bare = _spm(add_space_prefix=False)
  assert bare.encode("hello") == [1, _spm_id("he"), _spm_id("llo")]
  assert bare.decode(ids) == "   hello "
  for text in ["hello", " hello", "  a "]:
    assert bare.decode(bare.encode(text)) == text, text


def test_unknown_characters_without_byte_tokens():
  """No `<0xXX>` tokens: a run of unknown characters is one `<unk>`
  (SentencePiece merges continuous runs of unknown pieces)."""
  tokens, types, scores = spm_vocab()
  keep = [i for i, ty in enumerate(types) if ty != 6]
  tokens = [tokens[i] for i in keep]
  tok = GGUFTokenizer.from_metadata(_spm_meta(
      tokens, [types[i] for i in keep],
      scores=[scores[i] for i in keep]))
  sp = tokens.index(SP)
  assert tok.encode("hello \u00df\u00fc world") == [
      1, tokens.index(SP + "hello"), sp, 0, tokens.index(SP + "world")]
  assert tok.encode("\u20ac\u20ac\u20ac") == [1, sp, 0]
