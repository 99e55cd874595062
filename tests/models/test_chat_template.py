"""`pkvattn.models.chat_template` against transformers' own Jinja environment
(`transformers.utils.chat_template_utils._compile_jinja_template`, the one
`apply_chat_template` renders with): block whitespace (`trim_blocks`,
`lstrip_blocks`), `tojson` (no ASCII or HTML escaping, key order kept),
loop controls, special tokens as variables, `add_generation_prompt`."""

from __future__ import annotations

import json

import pytest

from pkvattn.models.chat_template import ChatTemplateMixin
from pkvattn.models.chat_template import render_chat_template

transformers = pytest.importorskip("transformers")
# A private function: a transformers that renames it skips these tests
# rather than failing them.
_compile_jinja_template = getattr(pytest.importorskip(
    "transformers.utils.chat_template_utils"), "_compile_jinja_template", None)
if _compile_jinja_template is None:
  pytest.skip("transformers has no chat_template_utils._compile_jinja_template",
              allow_module_level=True)

# Block tags indented and followed by newlines (lstrip_blocks drops the
# indent before a block tag, trim_blocks the newline after it), a `break`
# and a `continue`, `tojson` of a message, the special tokens and the
# generation prompt.
TEMPLATE = """\
{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'skip' %}
        {% continue %}
    {% endif %}
    {% if m['role'] == 'stop' %}
        {% break %}
    {% endif %}
<|{{ m['role'] }}|>
    {{ m['content'] }}
    {{ m | tojson }}
{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
    <|assistant|>
{% endif %}
"""

# Text whose JSON differs with `ensure_ascii` (non-ASCII), with Jinja's
# HTML-escaping `tojson` (<, >, &, ') and with sorted keys.
_PIECES = ["é", "日本", "🤖", "<b>", "&", "'", '"', "\\", "\n", " ", "a", "z9"]


def _messages(rng, n):
  """The first a user's; each content has a non-ASCII piece and an
  HTML-escaped one."""
  roles = ["user", "assistant", "system", "skip"]
  out = []
  for i in range(n):
    content = list(rng.choice(_PIECES, rng.integers(0, 6))) + [
        rng.choice(_PIECES[:3]), rng.choice(_PIECES[3:6])]
    content = "".join(rng.permutation(content))
    # Keys out of sorted order ("role" > "content" > "a_note").
    out.append({"role": "user" if i == 0 else str(rng.choice(roles)),
                "content": content,
                "a_note": "".join(rng.choice(_PIECES, 2))})
  return out


def _transformers_render(template, messages, add_generation_prompt,
                         **special_tokens):
  return _compile_jinja_template(template).render(
      messages=messages, add_generation_prompt=add_generation_prompt,
      **special_tokens)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers(add_generation_prompt, rng):
  messages = _messages(rng, 5)
  messages.insert(int(rng.integers(1, 5)), {"role": "stop", "content": "x"})
  tokens = {"bos_token": "<s>", "eos_token": "</s>"}
  got = render_chat_template(TEMPLATE, messages,
                             add_generation_prompt=add_generation_prompt,
                             special_tokens=tokens)
  want = _transformers_render(TEMPLATE, messages, add_generation_prompt,
                              **tokens)
  assert got == want
  # The oracle's rules, checked on the text itself: no block tag leaves its
  # line's indent or newline behind, the JSON is neither ASCII- nor
  # HTML-escaped, keys keep their order.
  first = messages[0]
  assert got.startswith(f"<s>\n<|user|>\n    {first['content']}\n"
                        f"    {json.dumps(first, ensure_ascii=False)}\n</s>\n")
  assert got.endswith("\n    <|assistant|>\n") == add_generation_prompt


def test_generation_prompt_is_opened_by_default(rng):
  """`add_generation_prompt` defaults to True (the engine generates the
  assistant's turn), unlike transformers' `apply_chat_template`."""
  messages = _messages(rng, 2)
  got = render_chat_template(TEMPLATE, messages, special_tokens={})
  assert got.endswith("<|assistant|>\n")
  assert got == _transformers_render(TEMPLATE, messages, True)


def test_special_tokens_none_are_undefined():
  """None-valued special tokens are left undefined (transformers passes
  only the tokens a tokenizer has); the others are the template's
  variables; no special tokens at all renders too."""
  template = ("{{ bos_token is defined }} {{ bos_token }} "
              "{{ pad_token is defined }} [{{ pad_token }}]")
  got = render_chat_template(
      template, [], special_tokens={"bos_token": "<s>", "pad_token": None})
  assert got == "True <s> False []"
  assert render_chat_template(template, []) == "False  False []"


class _CharTokenizer(ChatTemplateMixin):
  """Token ids are code points; the special tokens are the template's
  variables."""

  def __init__(self, template, tokens):
    self.chat_template = template
    self._tokens = tokens

  @property
  def special_tokens_map(self):
    return self._tokens

  def encode_no_special(self, text):
    return [ord(c) for c in text]


def test_apply_chat_template_is_one_user_turn_with_generation_prompt(rng):
  """`apply_chat_template(prompt)`: the template rendered over one user
  message with the assistant's turn opened and the tokenizer's special
  tokens, encoded without adding special tokens."""
  prompt = "".join(rng.choice(_PIECES, 6))
  tokens = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": None}
  tok = _CharTokenizer(TEMPLATE, tokens)
  want = _transformers_render(TEMPLATE, [{"role": "user", "content": prompt}],
                              True, bos_token="<s>", eos_token="</s>")
  assert tok.apply_chat_template(prompt) == [ord(c) for c in want]
  with pytest.raises(ValueError, match="no chat template"):
    _CharTokenizer(None, tokens).apply_chat_template(prompt)
