"""A request crosses two threads: the event loop (HTTP, validation, admission, shaping the answer)
and the engine thread (the steps), in through the engine's inbox and out through
`call_soon_threadsafe`. Only a request with an output constraint is admitted on a worker thread,
where its grammar compiles (README "Where a request goes").

The server runs in-process on an event loop whose default executor records every call, so a hop
to a worker thread (`asyncio.to_thread`, `run_in_executor(None, …)`) shows up."""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import httpx
import pytest
import uvicorn
from pydantic import BaseModel

from fastdeploy_lp.config import EngineArgs, FDConfig
from fastdeploy_lp.engine.engine import LLMEngine
from fastdeploy_lp.entrypoints.openai.api_server import build_app, settings_from_args
from fastdeploy_lp.entrypoints.openai.args import ServerArgs
from fastdeploy_lp.processors import LogitsProcessor
from server_harness import QWEN2, free_port, wait_healthy

LOOP_THREAD = "test-event-loop"
PROCESSOR_THREAD = "logits-processor-ThreadRecorder"  # its own, under the step's time limit


class RecordArgs(BaseModel):
    record_threads: bool | None = None


class ThreadRecorder(LogitsProcessor):
    """Notes the thread of each of its calls, (call, thread name); requests enable it with
    `record_threads` (so that `apply` runs)."""

    args_model = RecordArgs
    argmax_invariant = True
    calls: ClassVar[list[tuple[str, str]]] = []

    def validate_request(self, params) -> None:
        self.calls.append(("validate_request", threading.current_thread().name))

    def update_state(self, share_inputs) -> None:
        self.calls.append(("update_state", threading.current_thread().name))

    def apply(self, logits):
        self.calls.append(("apply", threading.current_thread().name))
        return logits


class RecordingExecutor(ThreadPoolExecutor):
    """The loop's default executor: what `to_thread` and `run_in_executor(None, …)` hand to it."""

    def __init__(self):
        super().__init__(2, thread_name_prefix="test-worker")
        self.submitted: list[str] = []

    def submit(self, fn, /, *args, **kwargs):
        work = fn.args[0] if isinstance(fn, functools.partial) and fn.args else fn  # asyncio.to_thread's ctx.run
        self.submitted.append(getattr(work, "__qualname__", type(work).__name__))
        return super().submit(fn, *args, **kwargs)


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(FDConfig.create(QWEN2, max_num_seqs=2,
                                       logits_processors=["test_request_threads:ThreadRecorder"]))
    app = build_app(engine, settings_from_args(ServerArgs(served_model_name=["q"]), EngineArgs(QWEN2)))
    outputs_seen_on: list[str] = []
    metrics = app.state.async_engine.observer

    def observer(out, now, stream):
        outputs_seen_on.append(threading.current_thread().name)
        metrics(out, now, stream)

    app.state.async_engine.observer = observer
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    executor = RecordingExecutor()

    def serve():
        loop = asyncio.new_event_loop()
        loop.set_default_executor(executor)
        loop.run_until_complete(server.serve())

    thread = threading.Thread(target=serve, name=LOOP_THREAD, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, 60)
    yield base, executor, outputs_seen_on
    server.should_exit = True
    thread.join(30)
    executor.shutdown(wait=False)


def _run(server, path: str, body: dict) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """(executor calls, processor calls, threads outputs were routed on) of one request."""
    base, executor, outputs_seen_on = server
    executor.submitted.clear()
    ThreadRecorder.calls.clear()
    outputs_seen_on.clear()
    body = {"model": "q", "max_tokens": 3, "logits_processors_args": {"record_threads": True}, **body}
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return list(executor.submitted), list(ThreadRecorder.calls), list(outputs_seen_on)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True}),
    ("/v1/completions", {"prompt": "Hello there", "logprobs": 2}),
    ("/v1/completions", {"prompt": ["One", "Two prompts"], "stream": True}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 3}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 3, "stream": True}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "stream": True}),
], ids=["chat", "chat-stream", "completion", "completion-batch-stream", "responses", "responses-stream",
        "messages", "messages-stream"])
def test_a_request_runs_on_the_event_loop_and_the_engine_thread_only(server, path, body):
    submitted, calls, routed_on = _run(server, path, body)
    assert submitted == [], "a request without a constraint must not wait on a worker thread"
    threads = {call: {t for c, t in calls if c == call} for call, _ in calls}
    assert threads["validate_request"] == {LOOP_THREAD}
    assert threads["update_state"] == threads["apply"] == {PROCESSOR_THREAD}
    assert routed_on and set(routed_on) == {LOOP_THREAD}


def test_only_a_constrained_request_is_admitted_on_a_worker_thread(server):
    submitted, calls, routed_on = _run(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_object"}})
    assert submitted == ["LLMEngine.make_requests"]  # the grammar compiles there, nothing else leaves the loop
    assert {t for c, t in calls if c == "validate_request"} <= {f"test-worker_{i}" for i in range(2)}
    assert {t for c, t in calls if c != "validate_request"} == {PROCESSOR_THREAD}
    assert set(routed_on) == {LOOP_THREAD}


def test_a_large_body_is_parsed_on_a_worker_thread_and_nothing_else_leaves_the_loop(server):
    padding = "x" * (80 << 10)  # an ignored field: the body is over request_body.INLINE_PARSE_BYTES
    submitted, calls, routed_on = _run(server, "/v1/completions", {"prompt": "Hello", "padding": padding})
    assert submitted == ["parse_json_body"]
    assert {t for c, t in calls if c == "validate_request"} == {LOOP_THREAD}
    assert set(routed_on) == {LOOP_THREAD}
