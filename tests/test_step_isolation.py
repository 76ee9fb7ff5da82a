"""A processor cannot corrupt the engine or another request through `share_inputs`, an exception
outside every request's isolation fails a batch and not the engine, and an interrupted
`generate()` leaves nothing running (issue "Hardening II"). Built-in model, real forward passes."""

from __future__ import annotations

import pytest

from fastdeploy_lp import LLM, SamplingParams

PROCESSOR = "step_processors:StepAttackLogitsProcessor"
PROMPTS = ["Once upon a time", "The cat sat on", "In the morning"]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, device="cpu", logits_processors=[PROCESSOR])


def greedy(max_tokens=8, **args):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logits_processors_args=args or None)


def run(llm, prompts, params):
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(llm):
    return run(llm, PROMPTS, greedy())


def assert_serves(llm, reference):
    out = run(llm, PROMPTS[:1], greedy())[0]
    assert out.finish_reason == "length" and out.token_ids == reference[0].token_ids


@pytest.mark.parametrize("attack", [{"force_token": 10**9}, {"force_token": -5}, {"force_others": 7},
                                    {"force_token": 11, "force_count": 10**5}])
def test_forced_tokens_that_break_the_contract_fail_only_the_processors_requests(llm, reference, attack):
    outs = run(llm, PROMPTS, [greedy(**attack), greedy(), greedy()])
    hostile = outs[0]
    assert hostile.finish_reason == "error" and "StepAttackLogitsProcessor" in hostile.error, hostile
    assert "forced" in hostile.error
    assert hostile.token_ids == []  # nothing it forced reached the output or the detokenizer
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in reference[1:]]
    assert [o.text for o in outs[1:]] == [o.text for o in reference[1:]]
    assert_serves(llm, reference)


@pytest.mark.parametrize("attack", [{"pop_key": "output_ids"}, {"pop_key": "forced_tokens"},
                                    {"pop_key": "stop_flags"}, {"overwrite": True}])
def test_popping_or_overwriting_share_inputs_changes_nothing_the_engine_uses(llm, reference, attack):
    outs = run(llm, PROMPTS, [greedy(**attack), greedy(), greedy()])
    assert [o.finish_reason for o in outs] == ["length"] * 3, [o.error for o in outs]
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert_serves(llm, reference)


def test_valid_forced_tokens_of_an_enabled_request_still_land(llm):
    out = run(llm, PROMPTS[:1], greedy(max_tokens=4, force_token=11))[0]
    assert out.finish_reason == "length" and out.token_ids == [11, 11, 11, 11]


def test_a_processor_failing_some_requests_still_forces_for_the_others(llm):
    outs = run(llm, PROMPTS[:2], [greedy(max_tokens=3, force_token=11, fail=True), greedy(max_tokens=3, force_token=12)])
    assert outs[0].finish_reason == "error" and "asked to fail" in outs[0].error
    assert outs[1].finish_reason == "length" and outs[1].token_ids == [12, 12, 12]


def test_a_processor_naming_requests_that_did_not_enable_it_fails_only_its_own(llm):
    """A RequestFailures naming a neighbour that never enabled the processor is the processor's own
    failure: the request that enabled it fails, the neighbour goes on untouched."""
    outs = run(llm, PROMPTS[:2], [greedy(max_tokens=3, fail_others=True), greedy(max_tokens=3)])
    assert outs[0].finish_reason == "error" and "StepAttackLogitsProcessor" in outs[0].error
    assert outs[1].finish_reason == "length" and outs[1].error is None


def explode(*args, **kwargs):
    raise RuntimeError("detokenizer exploded")


def finish_broken(engine, params, method):
    """Run one request whose detokenizer raises in `method`; its final output."""
    requests = engine.make_requests(PROMPTS[0], params)
    setattr(requests[0].detokenizer, method, explode)
    engine.enqueue(requests)
    outputs = []
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        outputs += engine.step()
    assert not engine.has_unfinished_requests()
    final = [o.outputs for o in outputs if o.finished]
    assert len(final) == 1 and final[0].finish_reason == "error"
    return final[0]


def test_an_exception_outside_request_isolation_fails_the_batch_not_the_engine(llm, reference):
    """A detokenizer that raises on a forced token fails outside any processor's isolation: the
    step's requests end with an error naming it, and the engine serves the next request."""
    out = finish_broken(llm.engine, greedy(max_tokens=4, force_token=11), "add")
    assert "the engine step failed: RuntimeError: detokenizer exploded" in out.error
    assert_serves(llm, reference)


def test_a_detokenizer_that_keeps_failing_fails_its_batch_and_the_engine_serves_on(llm, reference):
    out = finish_broken(llm.engine, greedy(max_tokens=4), "take_delta")
    assert "detokenizer exploded" in out.error and out.text == "" and len(out.token_ids) == 1
    assert_serves(llm, reference)


def test_an_interrupted_generate_aborts_its_requests_before_it_propagates(llm, reference):
    params = SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=200, ignore_eos=True,
                            logits_processors_args={"interrupt_after": 3})
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS * 2, params, use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.num_running == 0 and engine.num_waiting == 0
    steps = engine.num_steps
    assert_serves(llm, reference)
    assert engine.num_steps - steps <= 9  # 8 tokens: nothing left over from the interrupted call
