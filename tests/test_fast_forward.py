"""Forced-token fast-forward: tokens a processor declares certain are appended in one pass."""

from __future__ import annotations

import pytest
from conftest import fixture_dir, load_reference

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.processors import LogitsProcessor


class ForceAfterFirstToken(LogitsProcessor):
    """Test processor: after a request's first token, declare `force` (a token list) certain."""

    force = [5, 6, 7, 8, 9, 10]

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self.published: set[str] = set()

    def update_state(self, share_inputs):
        for slot, stopped in enumerate(share_inputs["stop_flags"]):
            rid = share_inputs["req_ids"][slot]
            args = share_inputs["logits_processors_args"][slot]
            if stopped or not args.force_after_first or rid in self.published:
                continue
            if len(share_inputs["output_ids"][slot]) >= 1:
                share_inputs["forced_tokens"][slot].extend(self.force)
                self.published.add(rid)


def _llm(fast_forward):
    return LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu", fast_forward=fast_forward,
               logits_processors=["test_fast_forward:ForceAfterFirstToken"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fast_forward_on_and_off_give_the_same_tokens_in_fewer_steps(temperature):
    prompts = load_reference("qwen2")[0]
    params = [SamplingParams(temperature=temperature, seed=11 + i, max_tokens=12, ignore_eos=True,
                             logits_processors_args={"force_after_first": i % 2 == 0}) for i in range(4)]
    all_forced = [p.clone(logits_processors_args={"force_after_first": True}) for p in params]
    results, steps = {}, {}
    for ff in (True, False):
        llm = _llm(ff)
        results[ff] = [o.outputs.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        before = llm.engine.num_steps
        llm.generate(prompts, all_forced, use_tqdm=False)
        steps[ff] = llm.engine.num_steps - before
    assert results[True] == results[False]
    for i, tokens in enumerate(results[True]):
        assert (tokens[1:7] == ForceAfterFirstToken.force) == (i % 2 == 0)
        assert len(tokens) == 12
    assert steps[True] == steps[False] - len(ForceAfterFirstToken.force)


def test_forced_tokens_respect_max_tokens():
    llm = _llm(True)
    out = llm.generate([load_reference("qwen2")[0][0]], SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logits_processors_args={"force_after_first": True}),
        use_tqdm=False)[0].outputs
    assert out.token_ids[1:] == ForceAfterFirstToken.force[:3]
    assert out.finish_reason == "length"
