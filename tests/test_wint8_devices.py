"""`wint8` per device: on CPU the row-major int8 path as before; on GPU (gpu_weight_only) the
choices that can be checked without one — the options, the parameters built, the orientation of
Paddle's `weight_quantize` (its CPU kernel prepares a GPU arch's layout). The GPU ops themselves run
in test_gpu.py, which skips without a GPU."""

from __future__ import annotations

import os

import numpy as np
import paddle
import pytest

from fastdeploy_lp import FDConfig
from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.model import gpu_weight_only, load_model
from fastdeploy_lp.model.decoder import DecoderForCausalLM
from fastdeploy_lp.model.loader import hf_state_dict, quantize_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "tests", "fixtures", "hf", "llama")  # untied LM head

paddle.set_device("cpu")


def _config(device: str, **kwargs):
    return EngineArgs(model=LLAMA, device=device, **kwargs).create_engine_config().model_config


def test_wint8_on_gpu_needs_a_16_bit_dtype_and_other_devices_are_refused():
    config = _config("gpu", dtype="bfloat16", quantization="wint8")
    assert (config.quantization, config.dtype, config.weight_dtype) == ("wint8", "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="quantization: wint8 on GPU computes in bfloat16 or float16"):
        _config("gpu:1", quantization="wint8")  # the fixture is float32
    with pytest.raises(ValueError, match="quantization: wint8 runs on cpu and gpu, not on xpu"):
        _config("xpu", dtype="bfloat16", quantization="wint8")


def test_on_cpu_every_matrix_is_row_major_int8_with_a_float32_scale():
    model = load_model(_config("cpu", quantization="wint8"))
    for weight, scale in ((model.embed_tokens.weight, model.embed_tokens.weight_scale),
                          (model.lm_head, model.lm_head_scale),
                          (model.layers[0].mlp.down_weight, model.layers[0].mlp.down_weight_scale)):
        assert weight.dtype == paddle.int8 and scale.dtype == paddle.float32 and weight.place.is_cpu_place()
    qkv = model.layers[0].self_attn.qkv_weight
    value = hf_state_dict(model)["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(value, (qkv.astype("float32") * model.layers[0].self_attn.qkv_weight_scale
                                          .unsqueeze(1)).numpy()[:value.shape[0]])


def test_on_gpu_linear_layers_are_int8_and_the_vocabulary_matrices_stay_in_the_compute_dtype(monkeypatch):
    """The parameters a GPU model is built with (only their dtypes and shapes; nothing runs)."""
    monkeypatch.setattr(gpu_weight_only, "on_gpu", lambda: True)
    config = _config("gpu", dtype="bfloat16", quantization="wint8")
    model = DecoderForCausalLM(config)
    mlp = model.layers[0].mlp
    assert mlp.down_weight.dtype == paddle.int8 and mlp.down_weight.shape == [64, 160]
    assert mlp.down_weight_scale.dtype == paddle.bfloat16 and mlp.down_weight_scale.shape == [64]
    assert model.embed_tokens.weight.dtype == paddle.bfloat16 and model.embed_tokens.weight_scale is None
    assert model.lm_head.dtype == paddle.bfloat16 and model.lm_head_scale is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_quantize_keeps_the_out_in_orientation_and_the_row_scales(dtype):
    """Paddle's weight_quantize takes `[in, out]`: given the `[out, in]` checkpoint weight,
    `quantize` must return int8 `[out, in]` and our per-output-row scale, in the compute dtype."""
    weight = paddle.randn([96, 128])  # [out, in]
    q, scale = gpu_weight_only.quantize(weight, dtype, arch=80)
    assert q.dtype == paddle.int8 and q.shape == [96, 128]
    assert scale.dtype == getattr(paddle, dtype) and scale.shape == [96]
    _, ours = quantize_rows(weight.astype(dtype).astype("float32"))
    np.testing.assert_allclose(scale.astype("float32").numpy(), ours.numpy(), rtol=1e-2)
