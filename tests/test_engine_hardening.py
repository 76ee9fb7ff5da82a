"""No value a request sends and nothing a registered processor does stops the engine, and nothing
the engine returns is silently wrong (issue: hardening). Real engine, real forward passes."""

from __future__ import annotations

import logging
import queue

import numpy as np
import pytest
from conftest import fixture_dir

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.engine.engine import LLMEngine
from fastdeploy_lp.sampling_params import GuidedDecodingParams

MODEL = fixture_dir("qwen3")
PROMPTS = [[5, 6, 7, 5, 6], [300, 301, 302], [9, 9, 9, 9]]


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_num_seqs=4, device="cpu", guided_decoding_backend="off",
               logits_processors=["custom_processors:HostileLogitsProcessor", "custom_processors:RaisingLogitsProcessor"],
               logits_processor_timeout_s=0.25)


def greedy(max_tokens=6, **args):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logits_processors_args=args or None)


def run(llm, prompts, params):
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


# -- values are range-checked where they enter -------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("top_k", 2**70), ("seed", -1), ("seed", 2**64), ("n", 129), ("temperature", 1e308), ("max_tokens", 2**40),
    ("min_tokens", 2**40), ("repetition_penalty", 1e9), ("stop_token_ids", [True]), ("stop_token_ids", ["5"]),
    ("logit_bias", {"٣": 1.0}), ("logit_bias", {"5": 1e300}), ("bad_words", [""]), ("skip_special_tokens", "no"),
])
def test_out_of_range_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**{field: value})


def test_logit_bias_keys_are_ascii_token_ids():
    assert SamplingParams(logit_bias={"12": 1, 7: -2.5}).logit_bias == {12: 1.0, 7: -2.5}


# -- the engine loop survives what slips past validation ---------------------------------------------
def test_a_value_that_cannot_be_stored_fails_only_its_request(llm):
    bad = greedy()
    bad.top_k = 2**70  # past SamplingParams' own check, as a buggy caller could do
    reference = run(llm, PROMPTS[1:], greedy())
    outs = run(llm, PROMPTS, [bad, greedy(), greedy()])
    assert outs[0].finish_reason == "error" and "OverflowError" in outs[0].error
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in reference]
    assert run(llm, PROMPTS[:1], greedy())[0].finish_reason == "length"  # still serving


@pytest.mark.parametrize("where", ["update_state", "apply"])
def test_a_processor_raising_system_exit_fails_only_its_requests(llm, where):
    reference = run(llm, PROMPTS[1:], greedy())
    outs = run(llm, PROMPTS, [greedy(exit_in=where), greedy(), greedy()])
    assert outs[0].finish_reason == "error" and "HostileLogitsProcessor" in outs[0].error
    assert "SystemExit" in outs[0].error
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in reference]


def test_a_processor_blaming_a_slot_without_a_request_fails_only_its_own(llm):
    reference = run(llm, PROMPTS[1:], greedy())
    outs = run(llm, PROMPTS, [greedy(blame_empty_slot=True), greedy(), greedy()])
    assert outs[0].finish_reason == "error" and "HostileLogitsProcessor" in outs[0].error
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in reference]


@pytest.mark.parametrize("write", ["nan", "-inf"])
def test_nan_or_all_minus_inf_rows_fail_only_their_request(llm, write):
    reference = run(llm, PROMPTS[1:], greedy())
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                             logits_processors_args={"write": write})
    for first in (greedy(write=write), sampled):
        outs = run(llm, PROMPTS, [first, greedy(), greedy()])
        assert outs[0].finish_reason == "error" and "no token can be sampled" in outs[0].error
        assert outs[0].token_ids == []
        assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in reference]


def test_a_slow_processor_fails_the_requests_that_enabled_it(llm):
    outs = run(llm, PROMPTS[:2], [greedy(sleep_s=0.4), greedy()])
    assert outs[0].finish_reason == "error"
    assert "HostileLogitsProcessor took longer than the per-step limit of 0.25 s" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 6
    assert llm.engine.pipeline.timings["HostileLogitsProcessor"].timeouts >= 1


def test_a_processor_failing_every_step_logs_one_traceback(llm, caplog):
    with caplog.at_level(logging.ERROR, logger="fastdeploy_lp.processors.pipeline"):
        for _ in range(3):
            outs = run(llm, PROMPTS[:1], greedy(raise_in="apply"))
            assert outs[0].finish_reason == "error"
    traced = [r for r in caplog.records if r.exc_info and "RaisingLogitsProcessor" in r.getMessage()]
    assert len(traced) <= 1  # the first failure may have been logged by an earlier test
    assert llm.engine.pipeline.timings["RaisingLogitsProcessor"].failures >= 3


def test_tiny_temperatures_are_greedy(llm):
    tiny = SamplingParams(temperature=1e-300, max_tokens=6, ignore_eos=True, seed=1)
    assert [o.token_ids for o in run(llm, PROMPTS, tiny)] == [o.token_ids for o in run(llm, PROMPTS, greedy())]


# -- bookkeeping -------------------------------------------------------------------------------------
def test_an_abort_sent_between_the_two_inbox_reads_is_not_lost(llm):
    """The request is queued, then aborted, while the engine is reading its inbox."""
    engine: LLMEngine = llm.engine
    request = engine.make_requests(PROMPTS[0], greedy(max_tokens=50))[0]

    class RacingQueue(queue.SimpleQueue):
        raced = False

        def empty(self):
            if not self.raced:  # the client acts right when the engine first looks at this queue
                self.raced = True
                engine.enqueue([request])
                engine.abort_request(request.request_id)
            return super().empty()

    engine._aborts, original = RacingQueue(), engine._aborts
    try:
        outputs = engine.step()
    finally:
        engine._aborts = original
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = [o for o in outputs if o.request_id == request.request_id and o.finished]
    assert final and final[0].outputs.finish_reason == "abort"


def test_admission_ids_are_never_reused(llm):
    engine = llm.engine
    seen = []
    for _ in range(3):
        engine.add_request(PROMPTS[0], greedy(max_tokens=1), request_id="same-id")
        engine.step()
        seen.append(int(engine.scheduler.share_inputs["admission_ids"][0]))
        while engine.has_unfinished_requests():
            engine.step()
    assert len(set(seen)) == 3


def test_offline_guided_request_on_an_engine_without_guided_decoding_is_refused(llm):
    params = SamplingParams(max_tokens=None, guided_decoding=GuidedDecodingParams(choice=["a", "b"]))
    with pytest.raises(ValueError, match="^guided_decoding: guided decoding is off"):
        llm.generate(PROMPTS[0], params, use_tqdm=False)


# -- forced tokens are accounted like sampled ones ---------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_and_penalties_follow_forced_tokens(temperature):
    """Fast-forward on and off give the same tokens and logprobs when penalties depend on the
    forced tokens: each forced token is counted once, and its logprob is 0 (it had probability 1)."""
    from test_fast_forward import ForceAfterFirstToken

    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=12, ignore_eos=True, logprobs=2,
                            presence_penalty=2.0, frequency_penalty=2.0,
                            logits_processors_args={"force_after_first": True})
    results = {}
    for ff in (True, False):
        engine_llm = LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu", fast_forward=ff,
                         logits_processors=["test_fast_forward:ForceAfterFirstToken"])
        results[ff] = [o.outputs for o in engine_llm.generate(prompts, params, use_tqdm=False)]
    for on, off in zip(results[True], results[False]):
        assert on.token_ids == off.token_ids
        assert on.token_ids[1:7] == ForceAfterFirstToken.force
        assert [lp.logprob for lp in on.logprobs[1:7]] == [0.0] * 6
        np.testing.assert_allclose([lp.logprob for lp in on.logprobs], [lp.logprob for lp in off.logprobs],
                                   atol=1e-5)
        # Penalised by the forced tokens: none of them is sampled again after them.
        assert not set(on.token_ids[7:]) & set(ForceAfterFirstToken.force)


# -- text is exactly what the tokens say -------------------------------------------------------------
@pytest.fixture(scope="module")
def default_llm():
    return LLM(max_num_seqs=4, device="cpu")


def test_final_text_is_the_decode_of_the_output_ids(default_llm):
    tok = default_llm.tokenizer
    params = [SamplingParams(temperature=1.5, seed=s, max_tokens=40) for s in range(4)]
    for out in run(default_llm, ["Once upon a time"] * 4, params):
        ids = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids  # the EOS is not text
        assert out.text == tok.decode(ids)
    byte = tok.token_to_id("<0xE4>")  # the first of a three-byte character's bytes
    out = run(default_llm, ["Hello"], SamplingParams(temperature=0, max_tokens=1, logit_bias={byte: 100}))[0]
    assert out.token_ids == [byte] and out.text == tok.decode([byte]) == "\ufffd"


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(default_llm):
    tok = default_llm.tokenizer
    special = sorted(tok.special_token_ids - {tok.eos_token_id, tok.bos_token_id})[0]
    force = {special: 100}
    kept = run(default_llm, ["Hi"], SamplingParams(temperature=0, max_tokens=1, logit_bias=force,
                                                   skip_special_tokens=False))[0]
    skipped = run(default_llm, ["Hi"], SamplingParams(temperature=0, max_tokens=1, logit_bias=force))[0]
    assert kept.token_ids == skipped.token_ids == [special]
    assert kept.text == tok.decode([special], skip_special_tokens=False) != ""
    assert skipped.text == ""


# -- outputs cost O(new tokens) per step ------------------------------------------------------------
def test_step_outputs_do_not_copy_the_history(default_llm):
    """Each step's output views the request's lists instead of copying them, and the text is
    joined only when read; the final output still carries everything."""
    engine = default_llm.engine
    (rid,) = engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                                    logprobs=1))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    request_lists = outputs[-1].outputs.token_ids._items
    assert all(o.outputs.token_ids._items is request_lists for o in outputs)  # one list, viewed
    assert [len(o.outputs.token_ids) for o in outputs] == list(range(1, 31))
    assert outputs[3].outputs.token_ids == request_lists[:4]
    assert outputs[-1].outputs.logprobs[-2:] == list(outputs[-1].outputs.logprobs)[-2:]
    assert "".join(o.outputs.delta_text for o in outputs) == outputs[-1].outputs.text
    assert outputs[-1].outputs.text == default_llm.tokenizer.decode(outputs[-1].outputs.token_ids)
    assert outputs[5].outputs.text == "".join(o.outputs.delta_text for o in outputs[:6])


@pytest.mark.parametrize("value", [{"jsn": {}}, "json", 3, {}])
def test_guided_decoding_must_be_params_or_their_mapping(value):
    with pytest.raises(ValueError, match="^guided_decoding: "):
        SamplingParams(guided_decoding=value)


def test_guided_decoding_as_a_mapping_is_the_params():
    params = SamplingParams(guided_decoding={"regex": "[ab]+"})
    assert params.guided_decoding == GuidedDecodingParams(regex="[ab]+")
