"""Chat templates: Jinja templates rendered as transformers renders them.

A chat template (`tokenizer.chat_template` in a GGUF, `chat_template` in a
Hugging Face `tokenizer_config.json` or a `chat_template.jinja` file) is
untrusted code from a model file, so it runs in Jinja's immutable sandbox. The
environment follows transformers' `apply_chat_template`: `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `raise_exception(message)`
global, a `strftime_now(format)` global, a `tojson` filter that does not
escape HTML, and the special tokens (`bos_token`, `eos_token`, ...) as
variables. The rendered text is tokenized WITHOUT adding special tokens (the
template writes them itself).
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Sequence


class ChatTemplateError(ValueError):
  """A chat template called `raise_exception(message)`."""


@functools.lru_cache(maxsize=8)
def _compile(template: str):
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise ChatTemplateError(f"Chat template error: {message}")

  def tojson(x, ensure_ascii=False, indent=None, separators=None,
             sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env.from_string(template)


def render_chat_template(
    template: str,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
) -> str:
  """Renders a conversation with a Jinja chat template.

  Args:
    template: the Jinja source.
    messages: `[{"role": ..., "content": ...}, ...]`.
    add_generation_prompt: open the assistant's turn at the end (the
      template's `add_generation_prompt` variable).
    special_tokens: template variables such as `bos_token` / `eos_token`
      (their text); None values are left undefined, as transformers does.

  Returns:
    The rendered text.

  Raises:
    ChatTemplateError (a ValueError): the template called `raise_exception`.
    jinja2.TemplateError: the template is malformed.
  """
  variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
  return _compile(template).render(
      messages=list(messages), add_generation_prompt=add_generation_prompt,
      **variables)


class ChatTemplateMixin:
  """`apply_chat_template` for a tokenizer with `chat_template`,
  `special_tokens_map` and `encode_no_special`."""

  chat_template: str | None = None

  @property
  def special_tokens_map(self) -> dict[str, str | None]:
    return {}

  def encode_no_special(self, text: str) -> list[int]:
    raise NotImplementedError

  def apply_chat_template(self, prompt: str) -> list[int]:
    """Token ids of one user turn with the assistant's turn opened.

    Equals transformers' `tokenizer.apply_chat_template([{"role": "user",
    "content": prompt}], add_generation_prompt=True, tokenize=True)` (the
    rendered text is encoded without adding BOS / EOS).

    Raises:
      ValueError: the tokenizer has no chat template, or the template raised.
    """
    if self.chat_template is None:
      raise ValueError(
          f"Invalid use of apply_chat_template: {type(self).__name__} has no "
          f"chat template (expected a model whose tokenizer defines one)")
    text = render_chat_template(
        self.chat_template, [{"role": "user", "content": prompt}],
        add_generation_prompt=True, special_tokens=self.special_tokens_map)
    return self.encode_no_special(text)
