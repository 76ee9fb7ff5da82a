"""A processor, or one request's custom-backend call, that runs past the per-step limit fails its own
requests in the very step it slowed; the step goes on without waiting for it, and a call that never
returns holds one bounded thread (issue 35, item 8). Real engine on the tiny qwen3 fixture."""

from __future__ import annotations

import contextvars
import threading
import time

import pytest
from conftest import fixture_dir
from pydantic import BaseModel

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.processors import LogitsProcessor
from fastdeploy_lp.processors.custom_backends import CustomBackend

MODEL = fixture_dir("qwen3")
PROMPTS = [[5, 6, 7, 5, 6], [300, 301, 302], [9, 9, 9, 9]]
LIMIT_S = 0.3
HANG_S = 5.0  # how long a hanging call would hold a step today (released early by the tests)


class HangArgs(BaseModel):
    hang_in: str | None = None  # "update_state" or "apply": wait there until released (at most HANG_S)


class HangingLogitsProcessor(LogitsProcessor):
    """Hangs in `update_state` or `apply` while a row that asks for it is in the batch."""

    args_model = HangArgs
    release = threading.Event()

    def update_state(self, share_inputs):
        active = [a for a, f in zip(share_inputs["logits_processors_args"], share_inputs["stop_flags"]) if not f]
        self.where = {a.hang_in for a in active}
        self._hang("update_state")

    def apply(self, logits):
        self._hang("apply")
        return logits

    def _hang(self, where):
        if where in self.where:
            self.release.wait(HANG_S)


def greedy(max_tokens=6, **args):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logits_processors_args=args or None)


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_num_seqs=4, device="cpu", guided_decoding_backend="off",
               logits_processors=["test_processor_deadlines:HangingLogitsProcessor"],
               logits_processor_timeout_s=LIMIT_S)


def timed_generate(llm, params):
    start = time.monotonic()
    outs = llm.generate(PROMPTS[:len(params)], params, use_tqdm=False)
    return [o.outputs for o in outs], time.monotonic() - start


@pytest.mark.parametrize("where", ["update_state", "apply"])
def test_a_processor_past_its_limit_fails_its_requests_in_the_step_it_slowed(llm, where):
    reference, _ = timed_generate(llm, [greedy(), greedy(), greedy()])
    HangingLogitsProcessor.release.clear()
    outs, seconds = timed_generate(llm, [greedy(), greedy(hang_in=where), greedy()])
    assert seconds < HANG_S / 2  # the step went on at the limit, not when the call returned
    assert outs[1].finish_reason == "error"
    assert "HangingLogitsProcessor took longer than the per-step limit of 0.3 s" in outs[1].error
    assert [o.token_ids for o in (outs[0], outs[2])] == [reference[0].token_ids, reference[2].token_ids]

    # While that call still runs, the processor takes no call: its requests fail at once, the rest run.
    outs, seconds = timed_generate(llm, [greedy(hang_in="nowhere"), greedy()])
    assert seconds < HANG_S / 2
    assert outs[0].finish_reason == "error" and "still running a call that passed the per-step limit" in outs[0].error
    assert outs[1].token_ids == reference[1].token_ids

    HangingLogitsProcessor.release.set()  # the late call returns: the processor serves again
    deadline = time.monotonic() + 10
    while llm.engine.pipeline.registered._threads[0].late and time.monotonic() < deadline:
        time.sleep(0.01)
    outs, _ = timed_generate(llm, [greedy(hang_in="nowhere")])
    assert outs[0].finish_reason == "length" and outs[0].token_ids == reference[0].token_ids
    assert llm.engine.pipeline.timings["HangingLogitsProcessor"].timeouts >= 1


# -- custom guided-decoding backends: one request's call that hangs fails that request only ----------
BACKEND_RELEASE = threading.Event()
FORCED = 7


def passthrough(input_ids, scores):
    return scores


def force_token(input_ids, scores):
    scores[:] = float("-inf")
    scores[FORCED] = 0.0
    return scores


def hanging(input_ids, scores):
    BACKEND_RELEASE.wait(HANG_S)
    return scores


async def _no_processor(request, tokenizer):  # the server's hook; offline requests carry their processor
    return None


def backend_llm(max_num_seqs):
    return LLM(MODEL, max_num_seqs=max_num_seqs, device="cpu", logits_processor_timeout_s=LIMIT_S,
               custom_guided_decoding_backends={"t": CustomBackend("t", _no_processor)})


def with_proc(proc, max_tokens=6):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra={
        "request_logits_processor": proc, "request_context": contextvars.copy_context(), "request_backend": "t"})


def test_a_hanging_backend_call_fails_its_request_only_and_the_others_keep_their_results():
    llm = backend_llm(4)
    reference, _ = timed_generate(llm, [greedy(), greedy(), greedy()])
    BACKEND_RELEASE.clear()
    try:  # the hanging call comes first: its deadline used to be everyone's
        outs, seconds = timed_generate(llm, [with_proc(hanging), with_proc(force_token), with_proc(passthrough)])
    finally:
        BACKEND_RELEASE.set()
    assert seconds < HANG_S / 2
    assert outs[0].finish_reason == "error" and "--logits-processor-timeout" in outs[0].error, outs[0].error
    assert outs[1].finish_reason == "length" and outs[1].token_ids == [FORCED] * 6, outs[1].error
    assert outs[2].finish_reason == "length" and outs[2].token_ids == reference[2].token_ids, outs[2].error


def test_backend_calls_that_never_return_hold_a_bounded_number_of_threads():
    llm = backend_llm(1)  # 2 x max_num_seqs threads
    adapter = llm.engine.pipeline.processors[-1]
    BACKEND_RELEASE.clear()
    try:
        for _ in range(2):
            outs, _ = timed_generate(llm, [with_proc(hanging)])
            assert outs[0].finish_reason == "error" and "--logits-processor-timeout" in outs[0].error
        outs, seconds = timed_generate(llm, [with_proc(passthrough)])
        assert outs[0].finish_reason == "error" and "all 2 threads for backend calls are held" in outs[0].error
        assert seconds < LIMIT_S + 1  # refused at once, not after the limit
        assert plain_still_runs(llm)
    finally:
        BACKEND_RELEASE.set()
    deadline = time.monotonic() + 10  # the stuck calls return: their threads take calls again
    outs, _ = timed_generate(llm, [with_proc(force_token)])
    while outs[0].finish_reason == "error" and time.monotonic() < deadline:
        time.sleep(0.05)
        outs, _ = timed_generate(llm, [with_proc(force_token)])
    assert outs[0].token_ids == [FORCED] * 6
    assert adapter._threads._count == 2


def plain_still_runs(llm) -> bool:
    outs, _ = timed_generate(llm, [greedy()])
    return outs[0].finish_reason == "length"
