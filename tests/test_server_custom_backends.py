"""Custom guided-decoding backends (NIM layout) served end to end, and --tool-functions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from server_harness import QWEN2, start_server

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "examples",
                        "custom_backends")
NAME = "custom_decoding_test"


def _processor_backend(body: str) -> str:
    return ("import time\n\n"
            "async def get_custom_guided_decoding_logits_processor(request, tokenizer):\n"
            "    def proc(input_ids, scores):\n"
            f"        {body}\n"
            "    return proc\n")


def _hook_backend(body: str) -> str:
    return ("import time\n\n"
            "async def get_custom_guided_decoding_logits_processor(request, tokenizer):\n"
            f"    {body}\n")


# Backends that break their contract, each in its own way.
BAD_BACKENDS = {
    "broken": _processor_backend("raise RuntimeError('broken backend')"),
    "none_proc": _processor_backend("return None"),
    "garbage_proc": _processor_backend("return 42"),
    "hanging_proc": _processor_backend("time.sleep(120)"),
    "no_processor": _hook_backend("return None"),
    "garbage_hook": _hook_backend("return 42"),
    "hanging_compile": _hook_backend("time.sleep(120)"),
    "garbage_post": _processor_backend("return scores") + (
        "\nasync def get_guided_decoding_constrained_generator(response, raw_request):\n"
        "    if isinstance(response, dict):\n"
        "        return 42\n"
        "    async def chunks():\n"
        "        async for chunk in response:\n"
        "            yield chunk\n"
        "            yield {'not': 'text'}\n"
        "    return chunks()\n"),
}
COMPILE_LIMIT_S = 2  # FDLP_GUIDED_COMPILE_TIMEOUT_S: built-in guided decoding's compile limit
STEP_LIMIT_S = 1  # --logits-processor-timeout
STRICT_SCHEMA = {"type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}


@pytest.fixture(scope="module")
def backends_dir(tmp_path_factory):
    """The shipped example plus the backends that break their contract."""
    root = tmp_path_factory.mktemp("backends")
    shutil.copytree(os.path.join(EXAMPLES, NAME), root / NAME)
    for name, code in BAD_BACKENDS.items():
        (root / name).mkdir()
        (root / name / "backend.py").write_text(code)
    return str(root)


@pytest.fixture(scope="module")
def server(backends_dir):
    srv = start_server("--trust-custom-code", "--custom-guided-decoding-backends", backends_dir,
                       "--max-num-seqs", "4", "--logits-processor-timeout", str(STEP_LIMIT_S),
                       env={"FDLP_GUIDED_COMPILE_TIMEOUT_S": str(COMPILE_LIMIT_S)})
    yield srv
    srv.stop()


def _chat(server, **extra):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="EMPTY")
    return client.chat.completions.create(model="default", max_tokens=40, temperature=0,
                                          messages=[{"role": "user", "content": "Hello"}], extra_body=extra)


def test_nim_example_backend_answers_through_nvext(server):
    resp = _chat(server, nvext={"guided_decoding_backend": NAME})
    assert resp.choices[0].message.content == "Custom decoding test"
    assert resp.choices[0].finish_reason == "stop"


def test_state_hook_reaches_the_processor_and_post_hook_rewrites_the_response(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0,
            "nvext": {"guided_decoding_backend": NAME, "answer_suffix": " two"}}
    data = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60).json()
    assert data["choices"][0]["message"]["content"] == "Custom decoding test two"
    assert data["nvext"] == {"guided_decoding_backend": NAME}


def test_top_level_field_and_completions_and_streaming(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="EMPTY")
    done = client.completions.create(model="default", prompt=["Hello", "World"], max_tokens=40, temperature=0,
                                     extra_body={"guided_decoding_backend": NAME})
    assert [c.text for c in done.choices] == ["Custom decoding test"] * 2
    chunks = client.chat.completions.create(model="default", max_tokens=40, stream=True,
                                            messages=[{"role": "user", "content": "Hi"}],
                                            extra_body={"nvext": {"guided_decoding_backend": NAME}})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Custom decoding test"


def test_unknown_backend_is_a_400_and_a_failing_backend_fails_only_its_request(server):
    r = httpx.post(server.url("/v1/chat/completions"), timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "nvext": {"guided_decoding_backend": "nope"}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "nvext.guided_decoding_backend"
    assert "custom_decoding_test" in r.json()["error"]["message"]
    broken = _chat(server, guided_decoding_backend="broken")
    assert broken.choices[0].finish_reason == "error"
    plain = _chat(server)
    assert plain.choices[0].finish_reason in ("stop", "length")


def test_refuses_to_start_without_trust(backends_dir):
    cmd = [sys.executable, "-m", "fastdeploy_lp.entrypoints.openai.api_server", "--model", QWEN2,
           "--custom-guided-decoding-backends", backends_dir]
    env = {k: v for k, v in os.environ.items() if k != "FDLP_TRUST_CUSTOM_CODE"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "--trust-custom-code" in done.stderr


def test_tool_functions_flag_serves_tool_execution(tmp_path):
    (tmp_path / "demo_tools.py").write_text("REGISTRY = {'multiply': lambda a, b: a * b}\n")
    srv = start_server("--logits-processors", "test_tool_execution:ForceText", "ToolExecutionLogitsProcessor",
                       "--tool-functions", "demo_tools:REGISTRY",
                       env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.path.dirname(__file__)])})
    try:
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="EMPTY")
        done = client.completions.create(model="default", prompt="Hello", max_tokens=60, temperature=0, extra_body={
            "logits_processors_args": {"force_text": ["<function>multiply(3, 302)</function>"],
                                       "tool_execution": True}})
        assert "<function>multiply(3, 302)</function><results>906</results>" in done.choices[0].text
    finally:
        srv.stop()


def _post(server, backend, stream=False, **extra):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "temperature": 0,
            "guided_decoding_backend": backend, "stream": stream, **extra}
    return httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)


def _served(server):
    assert _chat(server).choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("backend,returned", [("none_proc", "returned None"), ("garbage_proc", "returned int")])
def test_a_processor_returning_none_or_garbage_fails_its_request_never_unconstrained(server, backend, returned):
    r = _post(server, backend, response_format=STRICT_SCHEMA)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "error" and choice["message"]["content"] == "", choice
    assert backend in choice["error"]["message"] and returned in choice["error"]["message"], choice
    with httpx.stream("POST", server.url("/v1/chat/completions"), timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "stream": True,
            "guided_decoding_backend": backend, "response_format": STRICT_SCHEMA}) as streamed:
        lines = [line for line in streamed.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    finish = json.loads(lines[-2][len("data: "):])["choices"][0]
    assert finish["finish_reason"] == "error" and returned in finish["error"]["message"]
    _served(server)


@pytest.mark.parametrize("backend,extra,message", [
    ("no_processor", {"response_format": STRICT_SCHEMA}, "returned no logits processor for a request constrained "
                                                         "by response_format"),
    ("garbage_hook", {}, "returned int, not a callable"),
    ("garbage_post", {}, "get_guided_decoding_constrained_generator returned int, not a response object"),
])
def test_a_backend_hook_with_a_malformed_result_is_a_json_error_naming_it(server, backend, extra, message):
    r = _post(server, backend, **extra)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "custom_backend_error" and backend in err["message"] and message in err["message"], err
    _served(server)


def test_a_backend_that_returns_no_processor_for_a_free_request_just_generates(server):
    r = _post(server, "no_processor")
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text


def test_a_stream_the_post_hook_corrupts_ends_with_an_error_event_and_done(server):
    with httpx.stream("POST", server.url("/v1/chat/completions"), timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "stream": True,
            "guided_decoding_backend": "garbage_post"}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    err = json.loads(lines[-2][len("data: "):])["error"]
    assert err["code"] == "custom_backend_error" and "yielded dict" in err["message"], err


def test_a_hanging_compile_ends_the_request_within_the_compile_limit_and_blocks_nobody(server):
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("r", _post(server, "hanging_compile")))
    start = time.monotonic()
    waiter.start()
    time.sleep(0.2)
    _served(server)
    assert time.monotonic() - start < 10  # the hook used to hold the event loop for its whole 120 s
    waiter.join(30)
    assert time.monotonic() - start < COMPILE_LIMIT_S + 3
    r = result["r"]
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_decoding_backend" and f"within {COMPILE_LIMIT_S} s" in err["message"], err


def test_a_hanging_processor_fails_its_request_within_the_step_limit(server):
    start = time.monotonic()
    r = _post(server, "hanging_proc", response_format=STRICT_SCHEMA)
    assert time.monotonic() - start < STEP_LIMIT_S + 5
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "error" and "--logits-processor-timeout" in choice["error"]["message"], choice
    _served(server)
    assert _chat(server, guided_decoding_backend=NAME).choices[0].message.content == "Custom decoding test"


@pytest.mark.parametrize("code,message", [("raise RuntimeError('no licence file')", "RuntimeError: no licence file"),
                                          ("import sys\nsys.exit(3)", "SystemExit: 3")])
def test_a_backend_that_raises_or_exits_at_import_is_a_start_up_error_naming_it(tmp_path, code, message):
    (tmp_path / "doomed").mkdir()
    (tmp_path / "doomed" / "backend.py").write_text(code + "\n")
    cmd = [sys.executable, "-m", "fastdeploy_lp.entrypoints.openai.api_server", "--model", QWEN2,
           "--trust-custom-code", "--custom-guided-decoding-backends", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "cannot start" in done.stderr and "'doomed'" in done.stderr and message in done.stderr, done.stderr[-2000:]
