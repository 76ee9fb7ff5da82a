"""Strict checkpoint loading: every tensor in the file is used, every tensor the model needs is
there in its shape, and every config switch is implemented or refused by name (never a warning
and a silently different model). Real Paddle loads of the tiny fixtures in tests/fixtures/hf."""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import numpy as np
import paddle
import pytest
import safetensors.paddle as paddle_safetensors
from conftest import fixture_dir, load_reference
from safetensors.numpy import load_file
from test_model_reference import _copy_fixture as _copy

from fastdeploy_lp import LLM, FDConfig, ModelConfig
from fastdeploy_lp.model_config import HIDDEN_ACTIVATIONS
from fastdeploy_lp.model import UnsupportedCheckpointError, expected_tensors, load_model, save_pretrained
from fastdeploy_lp.model.activations import ACTIVATIONS

_DROP = object()  # a config key to remove


def _fixture_config(name):
    with open(os.path.join(fixture_dir(name), "config.json")) as f:
        return json.load(f)


def _edit_config(out, **changes):
    cfg = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(out, add=None, drop=(), rename=None):
    """Rewrite the fixture's model.safetensors (through Paddle: numpy has no bfloat16)."""
    tensors = paddle_safetensors.load_file(out / "model.safetensors")
    for name in drop:
        del tensors[name]
    for old, new in (rename or {}).items():
        tensors[new] = tensors.pop(old)
    tensors.update({k: paddle.to_tensor(v) for k, v in (add or {}).items()})
    paddle_safetensors.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def _load(path):
    return load_model(FDConfig.create(str(path), device="cpu").model_config)


def _assert_load_refused(out, match):
    with pytest.raises(UnsupportedCheckpointError, match=match):
        _load(out)


def _logits(model, ids):
    with paddle.no_grad():
        return model.full_logits(ids).numpy()


# -- tensors the model would not use, missing tensors, wrong shapes ---------------------------------

@pytest.mark.parametrize("extra", [
    "model.layers.0.self_attn.o_proj.bias",  # the HF Llama attention_bias case the old loader dropped
    "model.layers.1.mlp.down_proj.bias",
    "model.extra_projection.weight",
    "lm_head.bias",
])
def test_a_tensor_the_model_does_not_use_is_refused_by_name(tmp_path, extra):
    out = _copy("llama", tmp_path)
    _edit_tensors(out, add={extra: np.ones(64, np.float32)})
    _assert_load_refused(out, r"does not use.*" + re.escape(repr(extra)))


def test_qwen2_has_qkv_biases_but_an_o_proj_bias_is_refused(tmp_path):
    out = _copy("qwen2", tmp_path)
    _edit_tensors(out, add={"model.layers.1.self_attn.o_proj.bias": np.zeros(64, np.float32)})
    _assert_load_refused(out, re.escape("'model.layers.1.self_attn.o_proj.bias'"))


@pytest.mark.parametrize("name,missing", [
    ("llama", "model.layers.1.mlp.up_proj.weight"),
    ("llama-bias", "model.layers.0.self_attn.o_proj.bias"),
    ("llama-bias", "model.layers.1.mlp.gate_proj.bias"),
    ("llama", "lm_head.weight"),  # untied head
    ("qwen3", "model.layers.0.self_attn.k_norm.weight"),
    ("qwen2", "model.layers.0.self_attn.v_proj.bias"),
])
def test_a_missing_tensor_is_refused_by_name(tmp_path, name, missing):
    out = _copy(name, tmp_path)
    _edit_tensors(out, drop=[missing])
    _assert_load_refused(out, r"missing: .*" + re.escape(repr(missing)))


def test_all_problems_are_reported_together(tmp_path):
    out = _copy("llama", tmp_path)
    _edit_tensors(out, drop=["model.norm.weight"], add={
        "model.layers.0.mlp.up_proj.weight": np.ones((8, 64), np.float32), "model.unused": np.ones(3, np.float32)})
    with pytest.raises(UnsupportedCheckpointError) as err:
        _load(out)
    message = str(err.value)
    assert "'model.unused'" in message and "'model.norm.weight'" in message
    assert "'model.layers.0.mlp.up_proj.weight' is [8, 64], config.json says [160, 64]" in message


def test_a_config_that_disagrees_with_the_tensor_shapes_is_refused(tmp_path):
    out = _copy("llama", tmp_path)
    _edit_config(out, intermediate_size=128)
    _assert_load_refused(out, re.escape("'model.layers.0.mlp.gate_proj.weight' is "
                                        "[160, 64], config.json says [128, 64]"))


def test_a_non_float_tensor_is_refused_by_name(tmp_path):
    out = _copy("llama", tmp_path)
    _edit_tensors(out, add={"model.norm.weight": np.ones(64, np.int8)})
    _assert_load_refused(out, re.escape("'model.norm.weight' (I8)"))


def test_the_checkpoint_without_surprises_loads_exactly_its_tensors():
    config = ModelConfig.from_pretrained(fixture_dir("llama-bias"))
    stored = load_file(os.path.join(fixture_dir("llama-bias"), "model.safetensors"))
    assert {k: v.shape for k, v in stored.items()} == expected_tensors(config)


def test_rope_frequency_buffers_of_old_checkpoints_load_only_if_they_match_the_config(tmp_path):
    out = _copy("llama", tmp_path)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, 16, 2, dtype=np.float64) / 16)
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _edit_tensors(out, add={name: inv_freq.astype(np.float32)})
    inputs, ref = load_reference("llama")
    np.testing.assert_allclose(_logits(_load(out), inputs[0]), ref["logits_0"], atol=1e-4, rtol=0)
    _edit_tensors(out, add={name: (inv_freq / 8).astype(np.float32)})  # a checkpoint trained with other RoPE
    _assert_load_refused(out, re.escape(repr(name)))


# -- config switches -------------------------------------------------------------------------------

@pytest.mark.parametrize("changes,named", [
    ({"hidden_act": "foo"}, "hidden_act='foo'"),
    ({"hidden_act": "prelu"}, "hidden_act='prelu'"),
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
    ({"rope_parameters": _DROP, "rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope scaling type 'dynamic'"),
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "llama3", "factor": 8.0}}, "rope scaling type 'llama3'"),
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e4, "rope_type": "default"}}}, "rope_parameters="),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config (quant_method 'gptq')"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"architectures": ["MistralForCausalLM"], "attention_bias": True}, "attention_bias=true"),
    ({"architectures": ["Qwen3ForCausalLM"], "mlp_bias": True}, "mlp_bias=true"),
    ({"architectures": ["Qwen2ForCausalLM"], "attention_bias": False}, "attention_bias=false"),
    ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "sliding_window": 32,
      "layer_types": ["full_attention", "chunked_attention"]}, "layer_types="),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": -1}, "sliding_window=-1"),
])
def test_an_unimplemented_config_switch_is_refused_by_name(tmp_path, changes, named):
    out = _copy("llama", tmp_path)
    _edit_config(out, **changes)
    with pytest.raises(UnsupportedCheckpointError, match=r"unsupported config switch " + re.escape(named)):
        ModelConfig.from_pretrained(str(out))
    with pytest.raises(UnsupportedCheckpointError, match=re.escape(named)):
        LLM(str(out), device="cpu")


def test_which_projections_have_biases_follows_each_transformers_class():
    def parse(arch, **cfg):
        base = _fixture_config("llama")
        merged = {k: v for k, v in {**base, "architectures": [arch], **cfg}.items() if v is not _DROP}
        config = ModelConfig.from_dict(merged)
        return config.attention_bias, config.o_proj_bias, config.mlp_bias

    assert parse("LlamaForCausalLM", attention_bias=True, mlp_bias=True) == (True, True, True)
    assert parse("LlamaForCausalLM", attention_bias=False, mlp_bias=True) == (False, False, True)
    assert parse("Qwen3ForCausalLM", attention_bias=True) == (True, True, False)  # o_proj too, like Llama
    assert parse("Qwen2ForCausalLM", attention_bias=_DROP) == (True, False, False)
    assert parse("MistralForCausalLM") == (False, False, False)


def test_sliding_window_is_read_per_architecture_like_transformers():
    base = _fixture_config("llama")

    def window(arch, **cfg):
        return ModelConfig.from_dict({**base, "architectures": [arch], "attention_bias": None, **cfg}).sliding_window

    assert window("LlamaForCausalLM", sliding_window=64) is None  # LlamaAttention has no window
    assert window("MistralForCausalLM") == 4096  # MistralConfig's default
    assert window("MistralForCausalLM", sliding_window=None) is None
    assert window("MistralForCausalLM", sliding_window=64) == 64
    assert window("Qwen2ForCausalLM", sliding_window=64) is None  # use_sliding_window defaults to false
    assert window("Qwen2ForCausalLM", sliding_window=64, use_sliding_window=True) is None  # max_window_layers 28
    assert window("Qwen2ForCausalLM", sliding_window=64, use_sliding_window=True, max_window_layers=1) == 64
    assert window("Qwen3ForCausalLM", sliding_window=64, use_sliding_window=True,
                  layer_types=["full_attention", "sliding_attention"]) == 64
    assert window("Qwen3ForCausalLM", sliding_window=64, use_sliding_window=True,
                  layer_types=["full_attention", "full_attention"]) is None


def test_qwen3_head_dim_defaults_like_its_config_class():
    base = _fixture_config("qwen3")
    base.pop("head_dim")
    assert ModelConfig.from_dict(base).head_dim == 128
    assert ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"]}).head_dim == 16


# -- hidden_act ------------------------------------------------------------------------------------

def _erf_gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _tanh_gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


_NUMPY_ACT = {  # transformers' ACT2FN formulas
    "silu": lambda x: x / (1 + np.exp(-x)), "swish": lambda x: x / (1 + np.exp(-x)),
    "gelu": _erf_gelu, "gelu_python": _erf_gelu, "gelu_new": _tanh_gelu, "gelu_pytorch_tanh": _tanh_gelu,
    "gelu_python_tanh": _tanh_gelu, "gelu_accurate": _tanh_gelu,
    "gelu_fast": lambda x: 0.5 * x * (1 + np.tanh(x * 0.7978845608 * (1 + 0.044715 * x * x))),
    "gelu_10": lambda x: np.clip(_erf_gelu(x), -10, 10), "quick_gelu": lambda x: x / (1 + np.exp(-1.702 * x)),
    "relu": lambda x: np.maximum(x, 0), "relu2": lambda x: np.maximum(x, 0) ** 2,
    "relu6": lambda x: np.clip(x, 0, 6), "leaky_relu": lambda x: np.where(x > 0, x, 0.01 * x),
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "tanh": np.tanh,
    "mish": lambda x: x * np.tanh(np.log1p(np.exp(x))),
    "laplace": lambda x: 0.5 * (1 + np.vectorize(math.erf)((x - 0.707107) / (0.282095 * math.sqrt(2)))),
    "linear": lambda x: x,
}


def test_every_hidden_act_computes_the_transformers_formula():
    assert set(ACTIVATIONS) == set(HIDDEN_ACTIVATIONS) == set(_NUMPY_ACT)
    x = np.linspace(-12, 12, 481).astype(np.float64)
    for name, fn in ACTIVATIONS.items():
        got = fn(paddle.to_tensor(x.astype(np.float32))).numpy()
        np.testing.assert_allclose(got, _NUMPY_ACT[name](x), atol=2e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "relu", "silu"])
def test_the_mlp_uses_hidden_act_and_its_biases(tmp_path, act):
    """One decoder MLP (llama-bias weights) against numpy on the Hugging Face tensors."""
    out = _copy("llama-bias", tmp_path)
    _edit_config(out, hidden_act=act)
    model = _load(out)
    w = load_file(out / "model.safetensors")
    p = "model.layers.1.mlp."
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    gate = x @ w[p + "gate_proj.weight"].T + w[p + "gate_proj.bias"]
    up = x @ w[p + "up_proj.weight"].T + w[p + "up_proj.bias"]
    want = (_NUMPY_ACT[act](gate.astype(np.float64)) * up) @ w[p + "down_proj.weight"].T + w[p + "down_proj.bias"]
    with paddle.no_grad():
        got = model.layers[1].mlp(paddle.to_tensor(x)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


# -- tied embeddings -------------------------------------------------------------------------------

def test_tied_checkpoint_with_an_identical_lm_head_copy_stays_tied(tmp_path):
    out = _copy("qwen3", tmp_path)
    tensors = load_file(out / "model.safetensors")
    _edit_tensors(out, add={"lm_head.weight": tensors["model.embed_tokens.weight"].copy()})
    model = _load(out)
    assert model.lm_head is None
    inputs, ref = load_reference("qwen3")
    np.testing.assert_allclose(_logits(model, inputs[1]), ref["logits_1"], atol=1e-4, rtol=0)


def test_tied_config_with_a_different_lm_head_is_untied_as_transformers_does(tmp_path):
    """transformers (>= 5) does not tie when both matrices are in the file and differ: the file's
    lm_head is the head. The untied llama fixture declared tied must still give its reference."""
    out = _copy("llama", tmp_path)
    _edit_config(out, tie_word_embeddings=True)
    model = _load(out)
    assert model.lm_head is not None and not model.config.tie_word_embeddings
    inputs, ref = load_reference("llama")
    np.testing.assert_allclose(_logits(model, inputs[1]), ref["logits_1"], atol=1e-4, rtol=0)


def test_tied_checkpoint_holding_only_lm_head_ties_the_embedding_to_it(tmp_path):
    out = _copy("qwen3", tmp_path)
    _edit_tensors(out, rename={"model.embed_tokens.weight": "lm_head.weight"})
    inputs, ref = load_reference("qwen3")
    np.testing.assert_allclose(_logits(_load(out), inputs[0]), ref["logits_0"], atol=1e-4, rtol=0)


def test_untied_config_needs_its_lm_head(tmp_path):
    out = _copy("qwen3", tmp_path)
    _edit_config(out, tie_word_embeddings=False)
    _assert_load_refused(out, re.escape("missing: 'lm_head.weight'"))


# -- round trip ------------------------------------------------------------------------------------

def test_save_pretrained_writes_back_every_bias(tmp_path):
    model = _load(fixture_dir("llama-bias"))
    save_pretrained(model, str(tmp_path / "saved"))
    for f in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(fixture_dir("llama-bias"), f), tmp_path / "saved" / f)
    original = load_file(os.path.join(fixture_dir("llama-bias"), "model.safetensors"))
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert set(saved) == set(original)
    for name, value in original.items():
        np.testing.assert_array_equal(saved[name], value, err_msg=name)
    inputs, ref = load_reference("llama-bias")
    np.testing.assert_allclose(_logits(_load(tmp_path / "saved"), inputs[2]), ref["logits_2"], atol=1e-4, rtol=0)
