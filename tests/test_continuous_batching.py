"""Continuous batching is invisible in results: alone, in a full batch, joining mid-way, reused slots."""

from __future__ import annotations

import pytest
from conftest import fixture_dir, load_reference

from fastdeploy_lp import FDConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    inputs, _ = load_reference("qwen2")
    # includes prompts of equal length, which are prefilled together in one pass
    return inputs + [inputs[0][:5], inputs[1][:5], inputs[2][:5], inputs[1][2:], inputs[2] + inputs[3][:3]]


def _engine(max_num_seqs):
    return LLMEngine(FDConfig.create(fixture_dir("qwen2"), max_num_seqs=max_num_seqs, device="cpu"))


def _run(engine, steps_between=None, requests=()):
    """Add `requests` ((prompt, params) pairs), optionally with steps in between; run to completion."""
    results, order = {}, []
    for k, (prompt, params) in enumerate(requests):
        order += engine.add_request(prompt, params, request_id=f"r{k}")
        for _ in range(steps_between or 0):
            results.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        results.update({o.request_id: o for o in engine.step() if o.finished})
    return [results[i].outputs.token_ids for i in order]


def test_request_gives_same_tokens_alone_in_full_batch_and_joining_midway(prompts):
    solo = [_run(_engine(1), requests=[(p, GREEDY)])[0] for p in prompts]
    full = _run(_engine(len(prompts)), requests=[(p, GREEDY) for p in prompts])
    assert full == solo
    staggered = _run(_engine(len(prompts)), steps_between=3, requests=[(p, GREEDY) for p in prompts])
    assert staggered == solo


def test_slots_are_reused_after_finishes(prompts):
    lengths = [3, 9, 5, 12, 4, 7, 6, 8, 2]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    solo = [_run(_engine(1), requests=[(p, sp)])[0] for p, sp in zip(prompts, params)]
    engine = _engine(2)
    shared = _run(engine, requests=list(zip(prompts, params)))
    assert shared == solo
    assert [len(t) for t in shared] == lengths
    assert engine.scheduler.share_inputs["stop_flags"].all()


def test_abort_frees_the_slot_for_the_next_request(prompts):
    engine = _engine(1)
    engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), request_id="long")
    engine.step()
    engine.abort_request("long")
    outs = engine.step()
    assert [o.outputs.finish_reason for o in outs if o.request_id == "long"] == ["abort"]
    assert _run(engine, requests=[(prompts[1], GREEDY)])[0] == _run(_engine(1), requests=[(prompts[1], GREEDY)])[0]
