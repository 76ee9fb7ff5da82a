"""The same engine on a GPU (skipped where Paddle sees none, as in CI)."""

from __future__ import annotations

import os

import numpy as np
import paddle
import pytest
from conftest import fixture_dir, load_reference
from safetensors.numpy import load_file

from fastdeploy_lp import LLM, FDConfig, GuidedDecodingParams, SamplingParams
from fastdeploy_lp.config import default_model_path
from fastdeploy_lp.model import gpu_weight_only, load_model
from fastdeploy_lp.model.loader import hf_state_dict

pytestmark = pytest.mark.skipif(
    not (paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0),
    reason="needs paddlepaddle-gpu and a visible GPU")


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_greedy_tokens_match_transformers_on_gpu(name):
    llm = LLM(fixture_dir(name), max_num_seqs=4, device="gpu", dtype="float32")
    inputs, ref = load_reference(name)
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs.token_ids == ref[f"greedy_{i}"].tolist()


def test_processors_and_guided_decoding_run_on_the_logits_device():
    llm = LLM(fixture_dir("qwen2"), max_num_seqs=4, device="gpu",
              logits_processors=["LogitBiasLogitsProcessor", "NoRepeatNGramLogitsProcessor"])
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=24, logits_processors_args={
        "logit_bias": {"5": 3.0}, "no_repeat_ngram_size": 2},
        guided_decoding=GuidedDecodingParams(regex="(Paris|London)"))
    out = llm.generate(["The capital is"] * 2, params, use_tqdm=False)
    assert all(o.outputs.text in ("Paris", "London") for o in out)


def test_wint8_linear_through_weight_only_linear_and_back():
    """gpu_weight_only: the `[out, in]` checkpoint weight quantized for this GPU's arch, multiplied
    by `weight_only_linear`, and dequantized, against the bfloat16 product."""
    paddle.set_device("gpu")
    weight = paddle.randn([384, 256]).astype("bfloat16")  # [out, in]
    q, scale = gpu_weight_only.quantize(weight, "bfloat16")
    assert q.dtype == paddle.int8 and q.shape == [384, 256] and scale.shape == [384]
    row_error = (weight.astype("float32").abs().max(axis=1) / 127).numpy()
    back = gpu_weight_only.dequantize(q, scale).astype("float32").numpy()
    assert back.shape == (384, 256)
    w = weight.astype("float32").numpy()
    assert np.all(np.abs(back - w) <= row_error[:, None] * 0.51 + np.abs(w) * 2 ** -7)  # int8 step, bf16 rounding
    x = paddle.randn([5, 256]).astype("bfloat16")
    bias = paddle.randn([384]).astype("bfloat16")
    out = gpu_weight_only.linear(x, q, bias, scale).astype("float32").numpy()
    ref = (paddle.matmul(x, weight, transpose_y=True) + bias).astype("float32").numpy()
    assert np.abs(out - ref).max() <= 0.05 * np.abs(ref).max()


def test_wint8_on_gpu_generates_like_bfloat16_and_saves_its_values(tmp_path):
    """The built-in model (its shapes are multiples of 64, as the weight-only GEMM wants)."""
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,", "What is the capital of Japan?"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = LLM(max_num_seqs=4, device="gpu", dtype="bfloat16").generate(prompts, greedy, use_tqdm=False)
    llm = LLM(max_num_seqs=4, device="gpu", dtype="bfloat16", quantization="wint8")
    quantized = llm.generate(prompts, greedy, use_tqdm=False)
    same = [a.outputs.token_ids[:8] == b.outputs.token_ids[:8] for a, b in zip(full, quantized)]
    assert sum(same) >= 3, [(a.outputs.text, b.outputs.text) for a, b in zip(full, quantized)]
    model = load_model(FDConfig.create(default_model_path(), device="gpu", dtype="bfloat16",
                                       quantization="wint8").model_config)
    assert model.layers[0].mlp.down_weight.dtype == paddle.int8
    assert model.embed_tokens.weight.dtype == paddle.bfloat16  # a lookup cannot read the GPU layout
    saved = hf_state_dict(model)["model.layers.0.mlp.down_proj.weight"]
    original = load_file(os.path.join(default_model_path(), "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    scale = np.abs(original).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(saved - original) <= scale * 0.51 + np.abs(original) * 2 ** -6)


def test_gguf_and_wint4_weights_on_a_gpu_are_refused_naming_the_cpu(tmp_path):
    """No GPU kernels for block formats yet: a clear start-up error, not a crash in a CPU kernel."""
    from gguf_files import write_gguf

    path = write_gguf(fixture_dir("llama"), str(tmp_path / "m.gguf"), types=lambda name, w: "Q8_0")
    with pytest.raises(ValueError, match="GGUF weights run on cpu .* not on gpu"):
        LLM(path, device="gpu")
    with pytest.raises(ValueError, match="wint4 runs on cpu"):
        LLM(fixture_dir("llama"), device="gpu", quantization="wint4")
