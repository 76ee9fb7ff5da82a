"""The one-call decoder layers (`model/fused_layer.py`, `cpu_kernels/layer.h`) against the same
layers run step by step through the same kernels."""

import os

import numpy as np
import pytest

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.model import cpu_kernels, decoder

from conftest import FIXTURES

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: no CPU kernels")


@pytest.mark.parametrize("fixture", ["qwen2", "llama-bias"])  # q/k/v bias; every bias
@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("float16", None),
                                                ("float32", "wint8")])
def test_a_fused_layer_gives_the_step_by_step_tokens_and_logprobs(monkeypatch, fixture, dtype, quantization):
    monkeypatch.setattr(cpu_kernels, "_mode", "1")
    fused_calls = []
    run_fused_layers = decoder.run_fused_layers
    monkeypatch.setattr(decoder, "run_fused_layers", lambda *a: fused_calls.append(a[2].shape[0]) or run_fused_layers(*a))
    llm = LLM(model=os.path.join(FIXTURES, fixture), max_num_seqs=2, device="cpu", dtype=dtype,
              quantization=quantization, enable_prefix_caching=False)
    prompt = list(range(3, 23))  # one sequence of 20 tokens: its prefill is one fused pass, then each decode step
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    fused = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    assert fused_calls == [20] + [1] * 5  # every layer of each pass in one call

    monkeypatch.setattr(decoder, "fused_layer_kernels", lambda *a: None)
    plain = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    assert list(fused.token_ids) == list(plain.token_ids)
    np.testing.assert_allclose([p.logprob for p in fused.logprobs], [p.logprob for p in plain.logprobs], atol=1e-5)


def test_a_pass_of_several_groups_runs_layer_by_layer(monkeypatch):
    """Prompts of different lengths in one pass form several sequence groups: not fused."""
    monkeypatch.setattr(cpu_kernels, "_mode", "1")
    monkeypatch.setattr(decoder, "run_fused_layers", lambda *a: pytest.fail("fused a pass of several groups"))
    llm = LLM(model=os.path.join(FIXTURES, "qwen2"), max_num_seqs=2, device="cpu")
    llm.generate([list(range(3, 9)), list(range(3, 13))], SamplingParams(max_tokens=1), use_tqdm=False)
