"""`pkvattn.models.chat_template` against transformers' own Jinja environment
(`transformers.utils.chat_template_utils._compile_jinja_template`, the one
`apply_chat_template` renders with): block whitespace (`trim_blocks`,
`lstrip_blocks`), `tojson` (no ASCII or HTML escaping, key order kept; its
options), `strftime_now`, loop controls (also in a process without
transformers), special tokens as variables, `add_generation_prompt`; the
mixin's defaults."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

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


def test_tojson_options_as_transformers(rng):
  """`tojson`'s keyword arguments (`indent`, `separators`, `sort_keys`,
  `ensure_ascii`) reach `json.dumps` as in transformers' filter (chat
  templates dump tool schemas with them). Each changes the text of these
  messages: keys out of sorted order, several keys, non-ASCII content."""
  messages = _messages(rng, 2)
  indent = int(rng.integers(1, 5))
  template = (
      "{% for m in messages %}"
      "{{ m | tojson(indent=" + str(indent) + ") }}\n"
      "{{ m | tojson(separators=(',', ':')) }}\n"
      "{{ m | tojson(sort_keys=true) }}\n"
      "{{ m | tojson(ensure_ascii=true) }}\n"
      "{% endfor %}")
  got = render_chat_template(template, messages)
  assert got == _transformers_render(template, messages, True)
  want = ""
  for m in messages:
    options = [json.dumps(m, ensure_ascii=False, indent=indent),
               json.dumps(m, ensure_ascii=False, separators=(",", ":")),
               json.dumps(m, ensure_ascii=False, sort_keys=True),
               json.dumps(m)]
    # Each option matters here: dropping it would change the text.
    assert json.dumps(m, ensure_ascii=False) not in options
    want += "".join(f"{o}\n" for o in options)
  assert got == want


def test_strftime_now_is_the_local_time(rng):
  """`strftime_now(format)` formats the current local time, as transformers'
  global does (templates stamp "Today Date: ..." into system prompts)."""
  directives = ["%Y", "%m", "%d", "%H", "%M", "%b", "%B", "%a", "%j", "%y"]
  fmt = " ".join(rng.choice(directives, 4))
  template = "{{ strftime_now('" + fmt + "') }}"
  render_chat_template(template, [])  # compiled before the clock is read
  before = datetime.datetime.now().strftime(fmt)
  got = render_chat_template(template, [])
  want = _transformers_render(template, [], True)
  after = datetime.datetime.now().strftime(fmt)
  assert got in {before, after} and want in {before, after}


class _BareTokenizer(ChatTemplateMixin):
  """Implements nothing of the mixin's protocol."""


def test_mixin_defaults_fail_loudly():
  """A tokenizer that sets no `chat_template` gets the mixin's "no chat
  template" ValueError (not an AttributeError), and one that does not
  implement `encode_no_special` gets NotImplementedError rather than None
  token ids."""
  with pytest.raises(ValueError, match="_BareTokenizer has no chat template"):
    _BareTokenizer().apply_chat_template("hi")
  tok = _BareTokenizer()
  tok.chat_template = "{{ messages[0]['content'] }}"
  with pytest.raises(NotImplementedError):
    tok.apply_chat_template("hi")


def test_renders_in_a_process_that_never_imported_transformers(rng):
  """The module imports what its environment uses (`jinja2.ext` for the
  loop controls) itself: this test process has transformers, which imports
  `jinja2.ext` as a side effect, but the CLI's process does not. A fresh
  interpreter renders a `break` / `continue` template as transformers does
  here."""
  messages = _messages(rng, 4)
  messages.insert(int(rng.integers(1, 4)), {"role": "stop", "content": "x"})
  code = ("import json, sys\n"
          "from pkvattn.models.chat_template import render_chat_template\n"
          "args = json.load(sys.stdin)\n"
          "print(render_chat_template(*args), end='')\n"
          "assert 'transformers' not in sys.modules\n")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # conftest's; jaxlib logs a line about them
  env["PYTHONIOENCODING"] = "utf-8"
  proc = subprocess.run([sys.executable, "-c", code],
                        input=json.dumps([TEMPLATE, messages]),
                        capture_output=True, encoding="utf-8", timeout=120,
                        env=env)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout == _transformers_render(TEMPLATE, messages, True)
