"""Tokenizers rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no `tokenizer.json`: llama.cpp stores the vocabulary
(`tokenizer.ggml.tokens`), the token types (`token_type`: 1 normal, 2 unknown,
3 control, 4 user-defined, 5 unused, 6 byte), the BPE merges or SentencePiece
scores, the special token ids and flags. This module rebuilds an equivalent
`tokenizers.Tokenizer` from them:

* `tokenizer.ggml.model == "gpt2"`: byte-level BPE (`models.BPE` over the
  file's merges, a byte-level pre-tokenizer and decoder). The text is split
  before BPE as the vocabulary was trained, chosen by `tokenizer.ggml.pre`
  (`BPE_PRE_TOKENIZERS`).
* `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE. The file has
  scores instead of merges; a merge `(a, b)` exists for every token `a + b`
  whose halves are tokens, ranked by the score of `a + b` (SentencePiece merges
  the adjacent pair whose result scores highest). Spaces become "▁", a "▁" is
  prepended to the first piece of text when `tokenizer.ggml.add_space_prefix`
  (default true), and bytes missing from the vocabulary fall back to the
  `<0xXX>` tokens.

Control tokens are added as special tokens (matched whole, skipped by
`decode`), user-defined ones as normal added tokens. BOS / EOS are added by
`encode` when `tokenizer.ggml.add_bos_token` / `add_eos_token` say so (a
"llama" vocabulary without the flag adds BOS, as llama.cpp does).
"""

from __future__ import annotations

from typing import Any, Mapping

from pkvattn.models.tokenizer import TokenizersTokenizer

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

# Token types of `tokenizer.ggml.token_type` (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenization split patterns of the vocabularies' own tokenizers
# (the regexes their tokenizer.json files apply before byte-level BPE).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# `tokenizer.ggml.pre` -> how text is split before byte-level BPE:
#   "gpt2": GPT-2's split (the byte-level pre-tokenizer's built-in regex),
#   "digits+gpt2": every digit alone, then GPT-2's split (SmolLM),
#   a regex string: that split, then byte-level mapping.
BPE_PRE_TOKENIZERS = {
    "default": "gpt2",
    "gpt-2": "gpt2",
    "smollm": "digits+gpt2",
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}

# Llama 3 vocabularies look a whole pre-token up before merging (their
# tokenizer.json's `ignore_merges`; llama.cpp does the same for them).
_IGNORE_MERGES = {_LLAMA3_SPLIT}


class GGUFTokenizer(TokenizersTokenizer):
  """The tokenizer a GGUF file describes (see the module docstring)."""

  @classmethod
  def from_metadata(cls, metadata: Mapping[str, Any]) -> "GGUFTokenizer":
    """Builds the tokenizer from GGUF key/values.

    Args:
      metadata: `{key: value}` of the file (at least `tokenizer.ggml.model`,
        `tokenizer.ggml.tokens`; arrays as lists).

    Raises:
      ValueError: no vocabulary, an unsupported `tokenizer.ggml.model` or
        `tokenizer.ggml.pre`, or a "gpt2" vocabulary without merges.
    """
    from tokenizers import AddedToken
    from tokenizers import processors

    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
      raise ValueError(
          f"Invalid GGUF tokenizer: tokenizer.ggml.model {kind!r} is not "
          f"supported; expected one of {SUPPORTED_TOKENIZER_MODELS}")
    if not tokens:
      raise ValueError("Invalid GGUF tokenizer: no tokenizer.ggml.tokens")
    tokens = list(tokens)
    types = list(metadata.get("tokenizer.ggml.token_type") or
                 [NORMAL] * len(tokens))
    if len(types) != len(tokens):
      raise ValueError(
          f"Invalid GGUF tokenizer: expected {len(tokens)} token types, got "
          f"{len(types)}")
    if kind == "gpt2":
      tok = _byte_level_bpe(metadata, tokens)
    else:
      # User-defined tokens (Gemma's runs of spaces, tabs, newlines) are
      # matched whole on the raw text before the model, so they keep their
      # spelling.
      tokens = [t if ty == USER_DEFINED else r
                for t, r, ty in zip(tokens, _spm_respell(tokens), types)]
      tok = _sentencepiece_bpe(metadata, tokens, types)

    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])

    def token_id(key):
      i = metadata.get(f"tokenizer.ggml.{key}")
      return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token",
                                kind == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    single, specials = "$A", []
    if add_bos and bos is not None:
      single = f"{tokens[bos]} {single}"
      specials.append((tokens[bos], bos))
    if add_eos and eos is not None:
      single = f"{single} {tokens[eos]}"
      specials.append((tokens[eos], eos))
    if specials:
      tok.post_processor = processors.TemplateProcessing(
          single=single, special_tokens=list(dict.fromkeys(specials)))

    eos_ids = [i for i in (eos, token_id("eot_token_id"),
                           token_id("eom_token_id")) if i is not None]
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
             "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    special_tokens = {name: (tokens[token_id(key)] if token_id(key) is not None
                             else None) for name, key in names.items()}
    return cls(tok, bos_token_id=bos, eos_token_ids=eos_ids,
               chat_template=metadata.get("tokenizer.chat_template"),
               special_tokens=special_tokens)


def _byte_level_bpe(metadata, tokens):
  from tokenizers import Regex
  from tokenizers import Tokenizer
  from tokenizers import decoders
  from tokenizers import models
  from tokenizers import pre_tokenizers

  pre = metadata.get("tokenizer.ggml.pre", "default")
  split = BPE_PRE_TOKENIZERS.get(pre)
  if split is None:
    raise ValueError(
        f"Invalid GGUF tokenizer: tokenizer.ggml.pre {pre!r} is not supported; "
        f"expected one of {tuple(BPE_PRE_TOKENIZERS)}")
  merges = metadata.get("tokenizer.ggml.merges")
  if not merges:
    raise ValueError(
        "Invalid GGUF tokenizer: a 'gpt2' vocabulary needs tokenizer.ggml.merges")
  vocab = {t: i for i, t in enumerate(tokens)}
  pairs = [p for p in map(_merge_pair, merges) if p is not None]
  tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=split in _IGNORE_MERGES))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                        use_regex=split in ("gpt2", "digits+gpt2"))
  if split == "gpt2":
    tok.pre_tokenizer = byte_level
  elif split == "digits+gpt2":
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
  tok.decoder = decoders.ByteLevel()
  return tok


def _spm_respell(tokens):
  # Some converters store a token of spaces as spaces; SentencePiece spells
  # them "▁" (and text is respelled so before lookup).
  return ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]


def _sentencepiece_bpe(metadata, tokens, types):
  from tokenizers import Tokenizer
  from tokenizers import decoders
  from tokenizers import models
  from tokenizers import pre_tokenizers

  scores = metadata.get("tokenizer.ggml.scores")
  if scores is None or len(scores) != len(tokens):
    raise ValueError(
        "Invalid GGUF tokenizer: a 'llama' vocabulary needs one "
        "tokenizer.ggml.scores entry per token")
  vocab = {t: i for i, t in enumerate(tokens)}
  mergeable = [i for i, ty in enumerate(types) if ty in (NORMAL, USER_DEFINED)]
  merges = _spm_merges(tokens, vocab, scores, mergeable)
  unk = metadata.get("tokenizer.ggml.unknown_token_id")
  unk_token = tokens[int(unk)] if unk is not None else None
  tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk_token,
                             byte_fallback=True, fuse_unk=True))
  prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(
      replacement="\u2581", prepend_scheme="first" if prefix else "never",
      split=False)
  steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(),
           decoders.Fuse()]
  if prefix:
    steps.append(decoders.Strip(" ", 1, 0))
  tok.decoder = decoders.Sequence(steps)
  return tok


def _merge_pair(line: str) -> tuple[str, str] | None:
  """A `tokenizer.ggml.merges` line as its pair, split as llama.cpp's loader
  splits it: at the first space from the second character on, so a left
  half may itself be a space (byte-level vocabularies spell spaces "Ġ",
  others keep them). A line with no such space names no pair (llama.cpp
  ranks an empty pair that never matches): None."""
  pos = line.find(" ", 1)
  return (line[:pos], line[pos + 1:]) if pos > 0 else None


def _spm_merges(tokens, vocab, scores, mergeable):
  """BPE merges `(left, right)` of a SentencePiece vocabulary.

  Every split `token = left + right` of a mergeable token whose halves are
  both tokens is a merge, ranked by the token's score (highest first), ties
  by token id, then by the id of `left` (transformers' GGUF converter and
  SentencePiece's own extractor rank them the same way). The splits are
  enumerated one split position at a time over all tokens at once (C-level
  `map` over the vocabulary's `__contains__`), and ranked with one
  `np.lexsort`, so the cost is a few passes over the vocabulary's characters.
  """
  import itertools

  import numpy as np

  contains = vocab.__contains__
  items = [i for i in mergeable if len(tokens[i]) > 1]
  ids, lefts, rights = [], [], []
  k = 1
  while items:
    words = [tokens[i] for i in items]
    left = [w[:k] for w in words]
    has_left = list(map(contains, left))
    # Right halves only where the left one is a token (most splits fail
    # there), each string built once.
    cand = list(itertools.compress(range(len(items)), has_left))
    right = [words[j][k:] for j in cand]
    ok = list(map(contains, right))
    for j, r in itertools.compress(zip(cand, right), ok):
      ids.append(items[j])
      lefts.append(left[j])
      rights.append(r)
    k += 1
    items = [i for i, w in zip(items, words) if len(w) > k]
  if not ids:
    return []
  token_ids = np.asarray(ids, np.int64)
  left_ids = np.fromiter(map(vocab.__getitem__, lefts), np.int64, len(lefts))
  neg_score = -np.asarray(scores, np.float64)[token_ids]
  order = np.lexsort((left_ids, token_ids, neg_score)).tolist()
  return [(lefts[j], rights[j]) for j in order]
