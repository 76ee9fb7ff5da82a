"""Weights as small as the model allows: 16-bit checkpoints kept 2 bytes a weight on CPU, and
`wint8` (int8 per output row, quantized at load), against the float32 path on real checkpoints."""

from __future__ import annotations

import os
import sys

import numpy as np
import paddle
import pytest
from safetensors.numpy import load_file

from fastdeploy_lp import LLM, FDConfig, SamplingParams
from fastdeploy_lp.config import default_model_path, normalize_quantization
from fastdeploy_lp.model import cpu_kernels, load_model
from fastdeploy_lp.model.loader import quantize_rows, save_pretrained, weight_bytes
from fastdeploy_lp.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")
sys.path.insert(0, os.path.join(ROOT, "train"))
from build_corpus import build_corpus  # noqa: E402
from evaluate_default_model import perplexity  # noqa: E402

paddle.set_device("cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)


def _model(path: str, **kwargs):
    return load_model(FDConfig.create(path, device="cpu", **kwargs).model_config)


@pytest.fixture(scope="module")
def bf16_qwen2():
    """The qwen2 parity fixture, stored in bfloat16 (its transformers reference logits are
    checked in test_model_reference.py, now with the weights held in bfloat16)."""
    path = os.path.join(FIXTURES, "qwen2")
    assert FDConfig.create(path, device="cpu").model_config.checkpoint_dtype == "bfloat16"
    return path


@pytest.mark.parametrize("mode", ["1", "0"])  # the bf16 kernels; Paddle widening one layer at a time
def test_bfloat16_checkpoint_stays_bfloat16_and_matches_its_float32_upcast(bf16_qwen2, mode, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_mode", mode)
    held, upcast = _model(bf16_qwen2), _model(bf16_qwen2, dtype="float32")
    attn = held.layers[0].self_attn
    assert attn.qkv_weight.dtype == paddle.bfloat16 and held.embed_tokens.weight.dtype == paddle.bfloat16
    assert held.norm.weight.dtype == paddle.float32  # norms and activations stay float32
    assert weight_bytes(held) < 0.55 * weight_bytes(upcast)
    ids = list(range(3, 40))
    with paddle.no_grad():
        np.testing.assert_allclose(held.full_logits(ids).numpy(), upcast.full_logits(ids).numpy(), atol=1e-4, rtol=0)


def test_bfloat16_greedy_decode_equals_float32(bf16_qwen2):
    prompts = [[5, 17, 99, 3], list(range(10, 30))]
    held = LLM(bf16_qwen2, max_num_seqs=2, device="cpu").generate(prompts, GREEDY, use_tqdm=False)
    upcast = LLM(bf16_qwen2, max_num_seqs=2, device="cpu", dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
    for a, b in zip(held, upcast):
        assert a.outputs.token_ids == b.outputs.token_ids
        np.testing.assert_allclose([p.logprob for p in a.outputs.logprobs], [p.logprob for p in b.outputs.logprobs],
                                   atol=1e-4)


def test_bfloat16_weights_multiply_bfloat16_activations_where_the_cpu_has_avx512_bf16(bf16_qwen2, monkeypatch):
    """On AVX-512 BF16 CPUs the kernels round a bfloat16 model's activations to bfloat16 before each
    linear layer (`vdpbf16ps`, dot_bf16.h; the test session switches it off for the float32
    references): the logits move by that rounding, and by no more than it."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("the CPU kernels cannot be built here")
    monkeypatch.setattr(cpu_kernels, "_mode", "1")
    before = kernels.bf16_dot
    kernels.set_bf16_dot(True)
    try:
        if not kernels.bf16_dot:
            pytest.skip("this CPU has no AVX-512 BF16")
        held, ids = _model(bf16_qwen2), list(range(3, 23))  # 20 rows: the kernels' linear, in panels
        with paddle.no_grad():
            rounded = held.full_logits(ids).numpy()
            kernels.set_bf16_dot(False)
            exact = held.full_logits(ids).numpy()
    finally:
        kernels.set_bf16_dot(before)
    moved = np.abs(rounded - exact).max()
    assert 1e-5 < moved < 2e-2, moved


def test_a_float32_checkpoint_asked_for_as_bfloat16_is_converted_at_load():
    model = _model(os.path.join(FIXTURES, "llama"), dtype="bfloat16")
    assert model.layers[0].mlp.gate_up_weight.dtype == paddle.bfloat16


def test_quantize_rows_is_symmetric_per_row():
    w = paddle.to_tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -3.0]])
    q, scale = quantize_rows(w)
    assert q.dtype == paddle.int8 and scale.dtype == paddle.float32
    np.testing.assert_array_equal(q.numpy(), [[64, -127, 32], [0, 0, 0], [127, 64, -127]])
    np.testing.assert_allclose((q.astype("float32") * scale.unsqueeze(1)).numpy(), w.numpy(), atol=0.012)


def _heldout_perplexity(model, tokenizer: Tokenizer, texts: list[str]) -> float:
    """The default model's evaluation perplexity, every token of each text scored."""
    pairs = [(ids, [1] * len(ids)) for ids in map(tokenizer.encode, texts)]
    with paddle.no_grad():
        return perplexity(model, pairs)


def test_wint8_perplexity_on_held_out_text_within_two_percent_of_float32():
    texts = build_corpus(seed=0)["heldout"]["text"][:40]
    tokenizer = Tokenizer(default_model_path())
    full = _heldout_perplexity(_model(default_model_path()), tokenizer, texts)
    quantized = _model(default_model_path(), quantization="wint8")
    assert quantized.layers[0].mlp.down_weight.dtype == paddle.int8
    assert quantized.embed_tokens.weight.dtype == paddle.int8  # the tied LM head too
    assert _heldout_perplexity(quantized, tokenizer, texts) / full - 1 <= 0.02


def test_wint8_greedy_decode_mostly_agrees_with_float32_and_reports_itself():
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,", "What is the capital of Japan?"]
    full = LLM(max_num_seqs=4, device="cpu").generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(max_num_seqs=4, device="cpu", quantization="wint8")
    assert llm.fd_config.model_config.quantization == "wint8"
    quantized = llm.generate(prompts, GREEDY, use_tqdm=False)
    same = [a.outputs.token_ids[:8] == b.outputs.token_ids[:8] for a, b in zip(full, quantized)]
    assert sum(same) >= 3, [(a.outputs.text, b.outputs.text) for a, b in zip(full, quantized)]


def test_a_wint8_model_saves_the_values_its_int8_weights_stand_for(tmp_path):
    model = _model(os.path.join(FIXTURES, "llama"), quantization="wint8")
    assert model.lm_head.dtype == paddle.int8  # the llama fixture's head is untied
    save_pretrained(model, str(tmp_path))
    saved = load_file(tmp_path / "model.safetensors")
    original = load_file(os.path.join(FIXTURES, "llama", "model.safetensors"))
    for name in ("model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        scale = np.abs(original[name]).max(axis=1, keepdims=True) / 127
        assert np.all(np.abs(saved[name] - original[name]) <= scale / 2 + 1e-7), name


@pytest.mark.parametrize("value,error", [("wint2", "unsupported value 'wint2'; use wint8, wint4 or none"),
                                         ("fp8", "unsupported value")])
def test_unsupported_quantization_is_refused_by_name(value, error):
    with pytest.raises(ValueError, match=f"quantization: .*{error}"):
        normalize_quantization(value)
    assert normalize_quantization("none") is None and normalize_quantization("WINT8") == "wint8"
    assert normalize_quantization("wint4") == "wint4"
