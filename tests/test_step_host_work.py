"""A decode step's host work on the built-in model at batch 8: what a step does outside the forward
pass grows with the rows it runs and the processors its requests enabled, never with the output's
length or with processors nobody asked for (`bench/step_profile.py` times the same parts)."""

from __future__ import annotations

import pytest

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.processors.registry import BUILTIN_PROCESSORS

OUTPUT = 40


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=8, logits_processors=list(BUILTIN_PROCESSORS))


def _count_calls(llm: LLM):
    """Per processor name, how many times its `apply` ran; and the length of every token list the
    tokenizer decoded."""
    engine = llm.engine
    applied = {name: 0 for name in engine.pipeline.names}
    decoded: list[int] = []
    for name, processor in zip(engine.pipeline.names, engine.pipeline.processors):
        def counted(*args, _inner=processor.apply, _name=name, **kwargs):
            applied[_name] += 1
            return _inner(*args, **kwargs)
        processor.apply = counted
    decode = engine.tokenizer.decode

    def counted_decode(ids, *args, **kwargs):
        decoded.append(len(ids))
        return decode(ids, *args, **kwargs)

    engine.tokenizer.decode = counted_decode
    return applied, decoded


def _run(llm: LLM, params: list[SamplingParams]) -> int:
    """Run one request per `params` (8 rows) to the end; returns the number of steps."""
    engine = llm.engine
    for i, p in enumerate(params):
        engine.add_request(f"Request {i} asks about the weather on day {i}", p, request_id=f"r{i}")
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps


def test_processors_no_request_enabled_do_no_work_and_detokenizing_is_incremental(llm):
    applied, decoded = _count_calls(llm)
    steps = _run(llm, [SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)] * 8)
    assert steps >= OUTPUT
    assert applied == {name: 0 for name in applied}  # registered, never enabled: never applied
    # every decode is of a short window around the new token, never the whole output
    assert len(decoded) >= 8 * OUTPUT
    assert max(decoded) < OUTPUT // 2


def test_an_enabled_processor_runs_once_per_step_for_its_request_only(llm):
    applied, _ = _count_calls(llm)
    biased = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True,
                            logits_processors_args={"logit_bias": {"5": 1.0}})
    plain = SamplingParams(temperature=0, max_tokens=OUTPUT // 2, ignore_eos=True)
    steps = _run(llm, [biased] + [plain] * 7)
    assert applied["LogitBiasLogitsProcessor"] == OUTPUT <= steps  # one apply per token of its one request
    assert all(count == 0 for name, count in applied.items() if name != "LogitBiasLogitsProcessor")
