"""The Paddle decoder matches `transformers` on the reference checkpoints (one per architecture,
plus llama3 RoPE scaling and Llama's `attention_bias`/`mlp_bias`)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import paddle
import pytest
from conftest import FIXTURE_MODELS, fixture_dir, load_reference
from safetensors.numpy import load_file, save_file

from fastdeploy_lp import LLM, FDConfig, ModelConfig, SamplingParams
from fastdeploy_lp.model import AttentionBatch, cpu_kernels, load_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# llama-bias: `attention_bias` (q/k/v *and* o_proj biases) and `mlp_bias` (gate/up/down biases).
MODELS = list(dict.fromkeys([*FIXTURE_MODELS, "llama-bias"]))


def _model(path: str, dtype: str | None = None):
    return load_model(FDConfig.create(path, device="cpu", dtype=dtype).model_config)


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers_at_every_position(name):
    model = _model(fixture_dir(name))
    inputs, ref = load_reference(name)
    for i, ids in enumerate(inputs):
        with paddle.no_grad():
            logits = model.full_logits(ids).numpy()
        np.testing.assert_allclose(logits, ref[f"logits_{i}"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kernels", ["1", "0"])
@pytest.mark.parametrize("name", MODELS)
def test_cached_decode_logits_match_transformers(name, kernels, monkeypatch):
    """Prefill half the prompt into scattered cache blocks, then feed the rest one token per pass
    (with every C kernel where they build, and with Paddle's ops only, which other devices use)."""
    monkeypatch.setattr(cpu_kernels, "_mode", kernels)
    model = _model(fixture_dir(name))
    inputs, ref = load_reference(name)
    ids = inputs[0]
    cfg, block_size = model.config, 4
    blocks = [5, 2, 7, 1, 3, 6, 4, 8, 9, 10, 11, 12, 13, 14, 15][: -(-len(ids) // block_size)]
    shape = [16 * cfg.num_key_value_heads * block_size, cfg.head_dim]
    caches = [(paddle.full(shape, float("nan")), paddle.full(shape, float("nan"))) for _ in model.layers]
    half = len(ids) // 2
    fresh = list(blocks)  # NaN everywhere: the pass must zero the blocks it hands out before reading them

    def run(tokens, start):
        batch = AttentionBatch.paged([(blocks, start, len(tokens))], block_size, cfg.num_key_value_heads,
                                     cfg.num_attention_heads // cfg.num_key_value_heads, fresh)
        fresh.clear()
        with paddle.no_grad():
            return model.logits(model(paddle.to_tensor(tokens, dtype="int64"), batch, caches)).numpy()

    got = [run(ids[:half], 0)]
    got += [run([t], half + k) for k, t in enumerate(ids[half:])]
    np.testing.assert_allclose(np.concatenate(got), ref["logits_0"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_matches_transformers_alone_and_batched(name):
    llm = LLM(fixture_dir(name), max_num_seqs=4, device="cpu")
    inputs, ref = load_reference(name)
    batched = llm.generate(inputs, GREEDY, use_tqdm=False)
    for i, ids in enumerate(inputs):
        expected = ref[f"greedy_{i}"].tolist()
        assert batched[i].outputs.token_ids == expected
        assert llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs.token_ids == expected


def _copy_fixture(name, tmp_path):
    out = tmp_path / name
    shutil.copytree(fixture_dir(name), out)
    os.chmod(out, 0o755)
    for p in out.iterdir():
        os.chmod(p, 0o644)
    return out


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    out = _copy_fixture("llama", tmp_path)
    tensors = load_file(out / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, out / file)
    (out / "model.safetensors").unlink()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    inputs, ref = load_reference("llama")
    with paddle.no_grad():
        logits = _model(str(out)).full_logits(inputs[1]).numpy()
    np.testing.assert_allclose(logits, ref["logits_1"], atol=1e-4, rtol=0)


def test_float16_checkpoint_is_upcast_on_cpu(tmp_path):
    out = _copy_fixture("qwen3", tmp_path)
    tensors = load_file(out / "model.safetensors")
    save_file({k: v.astype(np.float16) for k, v in tensors.items()}, out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(cfg))
    assert FDConfig.create(str(out), device="cpu").model_config.dtype == "float32"
    inputs, ref = load_reference("qwen3")
    with paddle.no_grad():
        logits = _model(str(out)).full_logits(inputs[0]).numpy()
    np.testing.assert_allclose(logits, ref["logits_0"], atol=5e-2, rtol=0)  # fp16 weights, fp32 math


def test_unsupported_architecture_and_missing_files_fail_clearly(tmp_path):
    out = _copy_fixture("llama", tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        _model(str(out))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        ModelConfig.from_pretrained(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("fixture, arch", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                           ("qwen3", "Qwen3ForCausalLM")])
def test_a_config_without_architectures_is_read_by_its_model_type(tmp_path, fixture, arch):
    out = _copy_fixture(fixture, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("architectures")
    (out / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_pretrained(str(out)).architecture == arch
    (out / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*LlamaForCausalLM"):
        ModelConfig.from_pretrained(str(out))


def test_both_config_styles_and_generation_config_are_read():
    new_style = ModelConfig.from_pretrained(fixture_dir("llama"))
    old_style = ModelConfig.from_pretrained(fixture_dir("llama3-rope"))
    assert new_style.rope_theta == 10000.0 and new_style.rope_scaling is None
    assert old_style.rope_theta == 500000.0 and old_style.rope_scaling["rope_type"] == "llama3"
    assert old_style.tie_word_embeddings and not new_style.tie_word_embeddings
    assert ModelConfig.from_pretrained(fixture_dir("qwen2")).checkpoint_dtype == "bfloat16"
    assert ModelConfig.from_pretrained(fixture_dir("qwen3")).qk_norm
    assert new_style.eos_token_ids == [2]
    assert not (new_style.attention_bias or new_style.o_proj_bias or new_style.mlp_bias)
    biased = ModelConfig.from_pretrained(fixture_dir("llama-bias"))
    assert biased.attention_bias and biased.o_proj_bias and biased.mlp_bias and biased.hidden_act == "silu"
    qwen2 = ModelConfig.from_pretrained(fixture_dir("qwen2"))  # q/k/v bias without a config key, never o_proj
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.mlp_bias


def test_mistral_checkpoint_runs_as_llama_with_its_window_capping_the_context(tmp_path):
    out = _copy_fixture("llama", tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    (out / "config.json").write_text(json.dumps(cfg))
    fd_config = FDConfig.create(str(out), device="cpu")
    assert fd_config.model_config.architecture == "MistralForCausalLM"
    assert fd_config.max_model_len == 64
    inputs, ref = load_reference("llama")
    with paddle.no_grad():
        logits = load_model(fd_config.model_config).full_logits(inputs[2]).numpy()
    np.testing.assert_allclose(logits, ref["logits_2"], atol=1e-4, rtol=0)
