"""Custom guided-decoding backends (NIM layout) served end to end, and --tool-functions."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import openai
import pytest
from server_harness import QWEN2, start_server

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "examples",
                        "custom_backends")
NAME = "custom_decoding_test"


@pytest.fixture(scope="module")
def backends_dir(tmp_path_factory):
    """The shipped example plus a backend whose processor raises."""
    root = tmp_path_factory.mktemp("backends")
    shutil.copytree(os.path.join(EXAMPLES, NAME), root / NAME)
    (root / "broken").mkdir()
    (root / "broken" / "backend.py").write_text(
        "async def get_custom_guided_decoding_logits_processor(request, tokenizer):\n"
        "    def proc(input_ids, scores):\n"
        "        raise RuntimeError('broken backend')\n"
        "    return proc\n")
    return str(root)


@pytest.fixture(scope="module")
def server(backends_dir):
    srv = start_server("--trust-custom-code", "--custom-guided-decoding-backends", backends_dir,
                       "--max-num-seqs", "4")
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
    env = {k: v for k, v in os.environ.items() if k != "FASTDEPLOY_LP_TRUST_CUSTOM_CODE"}
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
