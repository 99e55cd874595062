"""Checkpoint-directory loading (`pkvattn.models.hf`) on tiny synthetic inputs.

Expected values come from transformers' config semantics (its
`configuration_*.py` defaults and per-layer `layer_types`), the module's
docstrings and `DecoderConfig`'s field comments:

* `config_from_hf`: defaults of optional keys, sliding windows per model
  type (`window_left = sliding_window - 1`; Gemma 2's even layers local,
  Gemma 3's every `sliding_window_pattern`-th layer global, Qwen2's layers
  from `max_window_layers` on local, only with `use_sliding_window`),
  biases, Gemma's scales and soft caps, Gemma 3's two RoPEs, EOS forms;
* `load_hf_checkpoint`: weights land transposed (`[in, out]` kernels) in
  their slots, under any of the known name prefixes, in the asked dtype;
  an untied config without `lm_head.weight` is tied; the multimodal
  Gemma 3 wrapper's text model (`load_config_and_tokenizer` reads the same
  config); missing files / weights, wrong shapes;
* `HFTokenizer`: special tokens as AddedToken dicts, named chat templates,
  `chat_template.jinja` (which transformers prefers over the config's).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # model_files imports it

from pkvattn import models  # noqa: E402
from pkvattn.models import HFTokenizer  # noqa: E402
from pkvattn.models.hf import aligned_empty  # noqa: E402
from pkvattn.models.hf import build_params  # noqa: E402
from pkvattn.models.hf import config_from_hf  # noqa: E402
from pkvattn.models.hf import load_hf_checkpoint  # noqa: E402
from pkvattn.rope import LinearRopeScaling  # noqa: E402
from model_files import HEAD_DIM  # noqa: E402
from model_files import HIDDEN  # noqa: E402
from model_files import LAYERS  # noqa: E402
from model_files import hf_config  # noqa: E402
from model_files import hf_weights  # noqa: E402
from model_files import save_hf_dir  # noqa: E402


def _cfg(model_type="llama", **kw):
  """A minimal config.json dict (4 layers of 4 heads of 16) plus `kw`."""
  return {"model_type": model_type, "vocab_size": 32, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 4,
          "num_attention_heads": 4, **kw}


# ------------------------------------------------------------ config_from_hf
def test_optional_keys_take_transformers_defaults():
  """Without head_dim / num_key_value_heads / biases / activation / EOS /
  rms_norm_eps: head_dim = hidden // heads (an int), no GQA, no biases,
  SiLU, untied, no windows, epsilon 1e-6; none of Gemma's options and no
  second RoPE."""
  cfg = config_from_hf(_cfg())
  assert cfg.head_dim == 16 and type(cfg.head_dim) is int
  assert cfg.num_kv_heads == 4 and cfg.rms_norm_eps == 1e-6
  assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias)
  assert cfg.activation == "silu" and not cfg.tie_word_embeddings
  assert cfg.layer_windows == () and cfg.eos_token_ids == ()
  assert cfg.bos_token_id is None
  assert cfg.rope_local is None and not cfg.qk_norm
  assert cfg.embed_scale is None and cfg.sm_scale is None
  assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None
  assert not (cfg.norm_plus_one or cfg.sandwich_norms)


def test_explicit_keys_are_taken():
  """Given head_dim (not hidden / heads), KV heads, Llama's attention_bias
  (q/k/v and o), mlp_bias, a tanh-GELU hidden_act, EOS as a list, the
  RMSNorm epsilon."""
  cfg = config_from_hf(_cfg(
      head_dim=32, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
      hidden_act="gelu_pytorch_tanh", eos_token_id=[5, 7], bos_token_id=3,
      max_position_embeddings=1000, tie_word_embeddings=True,
      rms_norm_eps=1e-5))
  assert cfg.head_dim == 32 and cfg.num_kv_heads == 2
  assert cfg.rms_norm_eps == 1e-5
  assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias
  assert cfg.activation == "gelu_tanh"
  assert cfg.eos_token_ids == (5, 7) and cfg.bos_token_id == 3
  assert cfg.max_position_embeddings == 1000 and cfg.tie_word_embeddings
  assert config_from_hf(_cfg(eos_token_id=2)).eos_token_ids == (2,)


def test_qwen2_biases():
  """Qwen2: bias on q/k/v, none on o_proj, whatever attention_bias says."""
  for bias in (True, False):
    cfg = config_from_hf(_cfg("qwen2", attention_bias=bias))
    assert cfg.qkv_bias and not cfg.o_bias


def test_mistral_window_on_every_layer():
  """`sliding_window = W`: window_left W - 1 on every layer, W = 1 (a token
  sees itself only) included."""
  assert config_from_hf(_cfg("mistral", sliding_window=12)).windows == (
      11, 11, 11, 11)
  assert config_from_hf(_cfg("mistral", sliding_window=1)).windows == (
      0, 0, 0, 0)
  assert config_from_hf(_cfg("mistral", sliding_window=None)).windows == (
      -1, -1, -1, -1)


def test_layer_types_choose_the_sliding_layers():
  """transformers' `layer_types` list wins over the model type's pattern."""
  types = ["full_attention", "sliding_attention", "sliding_attention",
           "full_attention"]
  for mt in ("mistral", "gemma2", "gemma3_text"):
    cfg = config_from_hf(_cfg(mt, sliding_window=8, layer_types=types))
    assert cfg.windows == (-1, 7, 7, -1), mt


def test_all_global_layers_give_no_windows():
  """Layer types all global: `layer_windows == ()`, the form `DecoderConfig`
  documents for "all -1", so the config equals the windowless one."""
  cfg = config_from_hf(_cfg("gemma3_text", sliding_window=8,
                            layer_types=["full_attention"] * 4))
  assert cfg.layer_windows == ()
  assert cfg == config_from_hf(_cfg("gemma3_text"))


def test_qwen2_window_needs_use_sliding_window():
  """Qwen2 ignores sliding_window unless use_sliding_window; then layers
  `i >= max_window_layers` (default 28) are local, as transformers'
  Qwen2Config builds its layer_types."""
  assert config_from_hf(_cfg("qwen2", sliding_window=8,
                            max_window_layers=0)).windows == (-1, -1, -1, -1)
  cfg = config_from_hf(_cfg("qwen2", sliding_window=8, use_sliding_window=True,
                            max_window_layers=2))
  assert cfg.windows == (-1, -1, 7, 7)
  cfg = config_from_hf(_cfg("qwen2", sliding_window=8, use_sliding_window=True,
                            max_window_layers=0))
  assert cfg.windows == (7, 7, 7, 7)
  cfg = config_from_hf(_cfg("qwen2", sliding_window=8, use_sliding_window=True,
                            num_hidden_layers=30))
  assert cfg.windows == (-1,) * 28 + (7, 7)


def test_gemma2_even_layers_are_local():
  """Gemma 2 without layer_types (older configs): even layers local."""
  cfg = config_from_hf(_cfg("gemma2", num_hidden_layers=5, sliding_window=8))
  assert cfg.windows == (7, -1, 7, -1, 7)


def test_gemma3_every_pattern_th_layer_is_global():
  """Gemma 3 without layer_types: layer i is global iff (i + 1) % pattern
  == 0; the pattern under either key, 6 by default."""
  expected = {6: (7, 7, 7, 7, 7, -1, 7), 3: (7, 7, -1, 7, 7, -1, 7)}
  base = _cfg("gemma3_text", num_hidden_layers=7, sliding_window=8)
  assert config_from_hf(base).windows == expected[6]
  for key in ("sliding_window_pattern", "_sliding_window_pattern"):
    assert config_from_hf({**base, key: 3}).windows == expected[3], key


def test_gemma_options():
  """Gemma 2: query scale query_pre_attn_scalar ** -0.5, sqrt(hidden)
  embedding scale, soft caps, (1 + w) and sandwich norms, tanh GELU, tied
  by default; no query_pre_attn_scalar: the default 1 / sqrt(head_dim)."""
  cfg = config_from_hf(_cfg(
      "gemma2", query_pre_attn_scalar=144, attn_logit_softcapping=50.0,
      final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
      hidden_act="silu"))
  assert cfg.sm_scale == pytest.approx(1 / 12)
  assert cfg.embed_scale == pytest.approx(8.0)
  assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)
  assert cfg.norm_plus_one and cfg.sandwich_norms and cfg.tie_word_embeddings
  assert cfg.activation == "gelu_tanh" and not cfg.qk_norm
  assert config_from_hf(_cfg("gemma2")).sm_scale is None
  untied = config_from_hf(_cfg("gemma2", tie_word_embeddings=False))
  assert not untied.tie_word_embeddings


def test_non_gemma_ignores_gemma_keys():
  """Soft caps and query_pre_attn_scalar apply to Gemma only."""
  cfg = config_from_hf(_cfg(query_pre_attn_scalar=144,
                            attn_logit_softcapping=50.0,
                            final_logit_softcapping=30.0))
  assert cfg.sm_scale is None
  assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None


def test_gemma3_ropes_from_rope_parameters():
  """transformers 5's per-layer-type rope_parameters: the global RoPE
  (scaled here) and the sliding one; without a sliding entry, 10,000,
  unscaled even next to a leftover top-level rope_scaling (the per-type
  parameters are the only ones read)."""
  full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
  cfg = config_from_hf(_cfg("gemma3_text", rope_parameters={
      "full_attention": full,
      "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}}))
  assert cfg.qk_norm and cfg.norm_plus_one and cfg.sandwich_norms
  assert cfg.rope.theta == 1e6 and cfg.rope.scaling == LinearRopeScaling(8.0)
  assert cfg.rope_local.theta == 5e4 and cfg.rope_local.scaling is None
  cfg = config_from_hf(_cfg("gemma3_text",
                            rope_parameters={"full_attention": full}))
  assert cfg.rope_local.theta == 1e4 and cfg.rope_local.scaling is None
  cfg = config_from_hf(_cfg(
      "gemma3_text", rope_scaling={"rope_type": "linear", "factor": 4.0},
      rope_parameters={"full_attention": {"rope_type": "default",
                                          "rope_theta": 1e6}}))
  assert cfg.rope.theta == 1e6 and cfg.rope.scaling is None
  assert cfg.rope_local.theta == 1e4 and cfg.rope_local.scaling is None


def test_gemma3_ropes_from_older_keys():
  """rope_theta / rope_scaling for the global RoPE, rope_local_base_freq
  (default 10,000, never scaled) for the sliding one."""
  cfg = config_from_hf(_cfg(
      "gemma3_text", rope_theta=1e6, rope_local_base_freq=5e4,
      rope_scaling={"rope_type": "linear", "factor": 8.0}))
  assert cfg.rope.theta == 1e6 and cfg.rope.scaling == LinearRopeScaling(8.0)
  assert cfg.rope_local.theta == 5e4 and cfg.rope_local.scaling is None
  cfg = config_from_hf(_cfg("gemma3_text", rope_theta=1e6))
  assert cfg.rope_local.theta == 1e4


def test_unsupported_model_type_raises():
  with pytest.raises(NotImplementedError, match="'phi3' is not supported"):
    config_from_hf(_cfg("phi3"))


def test_activations():
  """transformers' names of SiLU and tanh-GELU map to the decoder's; any
  other MLP activation (exact GELU, ReLU) is refused rather than run as
  SiLU. Gemma's `hidden_activation` wins over `hidden_act`."""
  for name, want in (("silu", "silu"), ("swish", "silu"),
                     ("gelu_pytorch_tanh", "gelu_tanh")):
    assert config_from_hf(_cfg("llama", hidden_act=name)).activation == want
  assert config_from_hf(_cfg(
      "gemma2", hidden_act="silu",
      hidden_activation="gelu_pytorch_tanh")).activation == "gelu_tanh"
  for name in ("gelu", "relu"):
    with pytest.raises(NotImplementedError, match=f"activation '{name}'"):
      config_from_hf(_cfg("llama", hidden_act=name))


# -------------------------------------------------------- load_hf_checkpoint
def _kernel(w):
  """A transformers `[out, in]` weight as the `[in, out]` kernel."""
  return np.asarray(w).T


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def _check_params(params, t, arch, prefix="model."):
  """Every parameter equals its transformers weight `t[...]` (kernels
  transposed, one slot per layer)."""
  lay = params["layers"]
  np.testing.assert_array_equal(params["embed"],
                                t[prefix + "embed_tokens.weight"])
  np.testing.assert_array_equal(params["final_norm"], t[prefix + "norm.weight"])
  for i in range(LAYERS):
    p = f"{prefix}layers.{i}."
    for group, name in (("attn", "self_attn.q_proj"),
                        ("attn", "self_attn.k_proj"),
                        ("attn", "self_attn.v_proj"),
                        ("attn", "self_attn.o_proj"),
                        ("mlp", "mlp.gate_proj"), ("mlp", "mlp.up_proj"),
                        ("mlp", "mlp.down_proj")):
      leaf = lay[group][name.split(".")[1]]
      np.testing.assert_array_equal(leaf["kernel"][i],
                                    _kernel(t[p + name + ".weight"]), name)
      if arch == "qwen2" and name in _QKV:
        np.testing.assert_array_equal(leaf["bias"][i], t[p + name + ".bias"])
    norms = {"attn_norm": "input_layernorm"}
    if arch == "gemma2":
      norms.update(post_attn_norm="post_attention_layernorm",
                   mlp_norm="pre_feedforward_layernorm",
                   post_mlp_norm="post_feedforward_layernorm")
    else:
      norms.update(mlp_norm="post_attention_layernorm")
    for ours, theirs in norms.items():
      np.testing.assert_array_equal(lay[ours][i], t[p + theirs + ".weight"])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_weights_land_transposed_in_their_slots(arch, tmp_path):
  """Each layer's weights in its slot of the stacks, `[out, in]` weights as
  `[in, out]` kernels; Llama's lm_head too, Qwen2's q/k/v biases, Gemma 2's
  four norms (post-attention, pre- and post-feedforward)."""
  t = hf_weights(arch, np.random.default_rng(0))
  save_hf_dir(tmp_path / "hf", arch, t)
  cfg, params = load_hf_checkpoint(str(tmp_path / "hf"))
  _check_params(params, t, arch)
  assert ("lm_head" in params) == (arch == "llama")
  if arch == "llama":
    np.testing.assert_array_equal(params["lm_head"],
                                  _kernel(t["lm_head.weight"]))
    assert not cfg.tie_word_embeddings
  if arch == "qwen2":
    assert "bias" not in params["layers"]["attn"]["o_proj"]
  assert "bias" not in params["layers"]["mlp"]["up_proj"]


def test_bfloat16_load_casts_every_weight(tmp_path):
  """dtype=bfloat16: every parameter is bf16, equal to the f32 weight
  rounded to bf16."""
  t = hf_weights("llama", np.random.default_rng(1))
  save_hf_dir(tmp_path / "hf", "llama", t)
  _, params = load_hf_checkpoint(str(tmp_path / "hf"), jnp.bfloat16)
  bf16 = {k: np.asarray(v).astype(jnp.bfloat16) for k, v in t.items()}
  _check_params(params, bf16, "llama")
  np.testing.assert_array_equal(params["lm_head"],
                                _kernel(bf16["lm_head.weight"]))
  leaves = [params["embed"], params["final_norm"], params["lm_head"],
            params["layers"]["attn"]["q_proj"]["kernel"],
            params["layers"]["attn_norm"]]
  assert all(x.dtype == jnp.bfloat16 for x in leaves)


def _aligned(w):
  out = aligned_empty(w.shape, w.dtype)
  out[...] = w
  return out


def test_build_params_casts_aligned_sources_and_aliases_f32(tmp_path):
  """Sources already 64-byte aligned: cast to bf16 all the same; in f32
  on the CPU, handed to the device without a copy (the module's "aliased,
  not copied")."""
  t = {k.removeprefix("model."): _aligned(v) for k, v in
       hf_weights("llama", np.random.default_rng(8)).items()}
  cfg = config_from_hf(hf_config("llama"))
  _, params = build_params(cfg, t.__getitem__, t.__contains__, jnp.bfloat16)
  assert params["embed"].dtype == params["lm_head"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(params["embed"],
                                t["embed_tokens.weight"].astype(jnp.bfloat16))
  _, params = build_params(cfg, t.__getitem__, t.__contains__, jnp.float32)
  np.testing.assert_array_equal(params["final_norm"], t["norm.weight"])
  if jax.default_backend() == "cpu":
    for name in ("embed", "final_norm"):
      src = t["embed_tokens.weight" if name == "embed" else "norm.weight"]
      assert params[name].unsafe_buffer_pointer() == src.ctypes.data, name


def test_aligned_empty_is_aligned_for_any_allocation():
  """Every array starts on a 64-byte boundary, whatever the (16-byte
  aligned) allocation under it, and spans exactly its bytes."""
  keep = []
  for n in range(1, 200):
    a = aligned_empty((n,), np.uint8)
    assert a.ctypes.data % 64 == 0 and a.nbytes == n, n
    a[...] = n % 251
    keep.append(a)
  assert all((a == (a.size % 251)).all() for a in keep)


def test_untied_config_without_lm_head_is_tied(tmp_path):
  """A config that unties but has no lm_head.weight: tied (build_params'
  docstring: some checkpoints tie without saying so)."""
  t = hf_weights("llama", np.random.default_rng(2))
  del t["lm_head.weight"]
  save_hf_dir(tmp_path / "hf", "llama", t)
  cfg, params = load_hf_checkpoint(str(tmp_path / "hf"))
  assert cfg.tie_word_embeddings and "lm_head" not in params


@pytest.mark.parametrize("prefix", ["", "language_model.model."])
def test_other_name_prefixes(prefix, tmp_path):
  """Weights named without `model.` or under the multimodal wrapper's
  `language_model.model.` load the same."""
  t = hf_weights("qwen2", np.random.default_rng(3))
  renamed = {prefix + k.removeprefix("model."): v for k, v in t.items()}
  save_hf_dir(tmp_path / "hf", "qwen2", renamed)
  _, params = load_hf_checkpoint(str(tmp_path / "hf"))
  _check_params(params, renamed, "qwen2", prefix)


def _gemma3_weights(rng):
  """Gemma 2's weights plus Gemma 3's per-head q / k norms."""
  t = hf_weights("gemma2", rng)
  for i in range(LAYERS):
    for n in "qk":
      t[f"model.layers.{i}.self_attn.{n}_norm.weight"] = rng.standard_normal(
          HEAD_DIM).astype(np.float32)
  return t


def test_gemma3_wrapper_loads_its_text_model(tmp_path):
  """The multimodal Gemma 3 config (`text_config`, weights under
  `language_model.model.`): its text model as "gemma3_text", with the
  q / k norms in their slots."""
  t = _gemma3_weights(np.random.default_rng(4))
  text = {**hf_config("gemma2"), "model_type": "gemma3_text",
          "layer_types": ["sliding_attention", "full_attention"]}
  path = tmp_path / "hf"
  save_hf_dir(path, "gemma2", {"language_model." + k: v for k, v in t.items()})
  (path / "config.json").write_text(json.dumps(
      {"model_type": "gemma3", "text_config": text}))
  cfg, params = load_hf_checkpoint(str(path))
  assert cfg.model_type == "gemma3_text" and cfg.qk_norm
  # load_config_and_tokenizer: "the results equal load_model(...).cfg".
  assert models.load_config_and_tokenizer(str(path)) == (cfg, None)
  assert cfg.windows == (15, -1) and cfg.num_layers == LAYERS
  for i in range(LAYERS):
    for n in "qk":
      np.testing.assert_array_equal(
          params["layers"]["attn"][f"{n}_norm"][i],
          t[f"model.layers.{i}.self_attn.{n}_norm.weight"])
  _check_params(params, t, "gemma2")


def test_top_level_config_wins_over_text_config(tmp_path):
  """A config with its own num_hidden_layers is the text model's even when it
  also has a `text_config`."""
  t = hf_weights("qwen2", np.random.default_rng(5))
  path = tmp_path / "hf"
  save_hf_dir(path, "qwen2", t)
  (path / "config.json").write_text(json.dumps(
      {**hf_config("qwen2"), "text_config": {"model_type": "llama"}}))
  cfg, _ = load_hf_checkpoint(str(path))
  assert cfg.model_type == "qwen2" and cfg.qkv_bias


def test_missing_files_and_weights_raise(tmp_path):
  t = hf_weights("qwen2", np.random.default_rng(6))
  with pytest.raises(ValueError, match="no config.json"):
    load_hf_checkpoint(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(hf_config("qwen2")))
  with pytest.raises(ValueError, match=r"no \*\.safetensors"):
    load_hf_checkpoint(str(tmp_path))
  del t["model.layers.1.mlp.up_proj.weight"]
  save_hf_dir(tmp_path / "hf", "qwen2", t)
  with pytest.raises(ValueError, match="missing weight 'layers.1.mlp.up_proj"):
    load_hf_checkpoint(str(tmp_path / "hf"))


def test_wrong_shape_raises(tmp_path):
  t = hf_weights("qwen2", np.random.default_rng(7))
  t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, HIDDEN),
                                                         np.float32)
  save_hf_dir(tmp_path / "hf", "qwen2", t)
  with pytest.raises(ValueError, match=r"expected shape \(32, 64\), got "
                                       r"\(8, 64\)"):
    load_hf_checkpoint(str(tmp_path / "hf"))


# ------------------------------------------------------------- HFTokenizer
def _save_tokenizer(path):
  """A word-level tokenizer.json; `<s>`, `</s>`, `<|end|>` special."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  words = ["<s>", "</s>", "<|end|>", "[UNK]", "hi"]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                   unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(words[:3])
  tok.save(str(path / "tokenizer.json"))


def test_special_tokens_as_added_token_dicts(tmp_path):
  """tokenizer_config.json may spell a special token as an AddedToken dict:
  its `content` is the text; a missing or non-text entry is None."""
  _save_tokenizer(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(
      bos_token={"content": "<s>", "lstrip": False, "special": True},
      eos_token="</s>", pad_token=7)))
  tok = HFTokenizer(str(tmp_path), 0, (1,))
  assert tok.bos_token_id == 0 and tok.eos_token_ids == (1,)
  assert tok.special_tokens_map == {"bos_token": "<s>", "eos_token": "</s>",
                                    "unk_token": None, "pad_token": None}


def test_without_tokenizer_config(tmp_path):
  """Only tokenizer.json: no chat template, no special token texts."""
  _save_tokenizer(tmp_path)
  tok = HFTokenizer(str(tmp_path), 0, (1,))
  assert tok.chat_template is None
  assert set(tok.special_tokens_map.values()) == {None}
  assert tok.encode("hi") == [4]


def test_named_chat_templates_use_the_default(tmp_path):
  """A list of named templates: the one named "default"."""
  _save_tokenizer(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(
      chat_template=[{"name": "tool_use", "template": "T"},
                     {"name": "default", "template": "D <|end|>"}])))
  tok = HFTokenizer(str(tmp_path), 0, (1,))
  assert tok.chat_template == "D <|end|>"
  assert tok.eos_token_ids == (1, 2)


def test_chat_template_jinja_file(tmp_path):
  """chat_template.jinja is read when tokenizer_config.json has none."""
  _save_tokenizer(tmp_path)
  (tmp_path / "chat_template.jinja").write_text("J <|end|>")
  assert HFTokenizer(str(tmp_path)).chat_template == "J <|end|>"
  (tmp_path / "tokenizer_config.json").write_text("{}")
  assert HFTokenizer(str(tmp_path)).chat_template == "J <|end|>"


def test_chat_template_jinja_wins_like_transformers(tmp_path):
  """Both a config template and chat_template.jinja: transformers takes the
  file ("independent chat template files take priority")."""
  transformers = pytest.importorskip("transformers")
  _save_tokenizer(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(
      chat_template="C")))
  (tmp_path / "chat_template.jinja").write_text("J")
  expected = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert expected.chat_template == "J"
  assert HFTokenizer(str(tmp_path)).chat_template == "J"
