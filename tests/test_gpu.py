"""The same engine on a GPU (skipped where Paddle sees none, as in CI)."""

from __future__ import annotations

import paddle
import pytest
from conftest import fixture_dir, load_reference

from fastdeploy_lp import LLM, GuidedDecodingParams, SamplingParams

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
