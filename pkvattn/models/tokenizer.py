"""The tokenizer protocol of the engine and the CLI, over `tokenizers.Tokenizer`.

Every tokenizer `load_model` returns (`ByteTokenizer`, `HFTokenizer`,
`GGUFTokenizer`) has:
  * `encode(text) -> list[int]`: adds BOS / EOS as the model's tokenizer
    does (transformers' `add_special_tokens=True`);
  * `decode(ids) -> str`: special tokens skipped;
  * `eos_token_ids: tuple[int, ...]`: the tokens that end generation (EOS
    and the chat template's end-of-turn token);
  * `chat_template: str | None`;
  * `apply_chat_template(prompt) -> list[int]`: one user turn, the
    assistant's turn opened (ValueError without a chat template).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from pkvattn.models.chat_template import ChatTemplateMixin

# Texts of the special tokens that close a chat turn in common chat templates
# (ChatML, Llama 3, Gemma, Phi-3, ...). One of them that the chat template
# writes is a stop token (transformers' generation configs and llama.cpp's
# end-of-generation set list it next to EOS).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>",
                      "<end_of_turn>", "<|end|>", "<|endoftext|>",
                      "<|end_of_text|>", "<|return|>", "<EOT>")


def end_of_turn_ids(chat_template: str | None,
                    special_tokens: Iterable[tuple[str, int]]) -> tuple[int, ...]:
  """Ids of the special tokens in `END_OF_TURN_TOKENS` that the template writes.

  Args:
    chat_template: Jinja source, or None (then no ids).
    special_tokens: `(text, id)` of the tokenizer's special tokens.
  """
  if not chat_template:
    return ()
  return tuple(sorted({i for text, i in special_tokens
                       if text in END_OF_TURN_TOKENS and text in chat_template}))


class TokenizersTokenizer(ChatTemplateMixin):
  """A `tokenizers.Tokenizer` with the engine's tokenizer protocol.

  Args:
    tokenizer: a `tokenizers.Tokenizer` whose post-processor adds BOS / EOS
      as the model wants (so `encode` needs no extra logic).
    bos_token_id: BOS id or None.
    eos_token_ids: the model's EOS ids; the chat template's end-of-turn token
      is added to them.
    chat_template: Jinja source or None.
    special_tokens: template variables (`bos_token`, `eos_token`, `unk_token`,
      `pad_token`: their text, or None).
  """

  def __init__(self, tokenizer, *, bos_token_id: int | None = None,
               eos_token_ids: Sequence[int] = (),
               chat_template: str | None = None,
               special_tokens: dict[str, str | None] | None = None):
    self._tok = tokenizer
    self.bos_token_id = bos_token_id
    self.chat_template = chat_template
    self._special_tokens = dict(special_tokens or {})
    added = [(t.content, i) for i, t in
             tokenizer.get_added_tokens_decoder().items() if t.special]
    eot = end_of_turn_ids(chat_template, added)
    self.eos_token_ids = tuple(dict.fromkeys(
        [int(i) for i in eos_token_ids] + list(eot)))

  @property
  def special_tokens_map(self) -> dict[str, str | None]:
    return dict(self._special_tokens)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, with BOS / EOS added as the model wants."""
    return list(self._tok.encode(text, add_special_tokens=True).ids)

  def encode_no_special(self, text: str) -> list[int]:
    """Token ids of `text` without added BOS / EOS (special tokens written
    in the text are still matched whole)."""
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def decode(self, ids) -> str:
    """Text of `ids`, special tokens skipped."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)
