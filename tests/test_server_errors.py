"""Bad requests get the right status and an OpenAI-shaped message naming the problem, and the server
serves normally right after each one. The server here requires an API key, rejects unknown
fields (--strict-fields), and lets nothing wait for a slot (--max-waiting-requests 0)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import uvicorn

from server_harness import QWEN2, free_port, openai_client, serving, start_server, wait_healthy

KEY = "test-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    yield from serving("--max-num-seqs", "2", "--max-waiting-requests", "0", "--strict-fields",
                       "--logits-processors", "LogitBiasLogitsProcessor", "server_processors:SlowLogitsProcessor",
                       env={"FDLP_API_KEY": KEY})


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY)


def post(server, path, body=None, *, content=None, headers=AUTH):
    return httpx.post(server.url(path), json=body, content=content, headers=headers, timeout=60)


def assert_serves(server):
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def wait_for_tokens(lines) -> None:
    """Read SSE lines until the chunk after the role chunk: the request has produced a token.

    `lines` is a live `iter_lines()` iterator: dropping it would close the connection (an abort).
    """
    seen = 0
    while seen < 2:
        if next(lines).startswith("data: "):
            seen += 1


def chat(**fields):
    return {"messages": CHAT, "max_tokens": 4, **fields}


BAD_REQUESTS = [
    # (id, path, body or raw bytes, status, param, words in the message)
    ("malformed-json", "/v1/chat/completions", b'{"messages": [}', 400, None, ["malformed JSON"]),
    ("trailing-comma-as-in-the-fastdeploy-zh-docs", "/v1/chat/completions",
     b'{"messages": [{"role":"user","content":"hi"}], "logits_processors_args": {"logit_bias": {"128": 5.0},}}',
     400, None, ["malformed JSON"]),
    ("nan", "/v1/chat/completions", b'{"messages": [{"role":"user","content":"hi"}], "temperature": NaN}', 400,
     None, ["NaN"]),
    ("body-not-an-object", "/v1/completions", b"[1, 2]", 400, None, ["JSON object"]),
    ("empty-body", "/v1/completions", b"", 400, None, ["empty"]),
    ("max_tokens-string", "/v1/chat/completions", chat(max_tokens="ten"), 400, "max_tokens", ["integer"]),
    ("max_tokens-zero", "/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens", ["greater than"]),
    ("temperature-string", "/v1/chat/completions", chat(temperature="hot"), 400, "temperature", ["number"]),
    ("temperature-negative", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature",
     ["greater than or equal to 0"]),
    ("stream-string", "/v1/chat/completions", chat(stream="yes"), 400, "stream", ["boolean"]),
    ("messages-string", "/v1/chat/completions", {"messages": "hi"}, 400, "messages", ["list"]),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, 400, "messages", ["at least 1"]),
    ("missing-messages", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages", ["required"]),
    ("bad-role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", ["robot"]),
    ("image-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]", ["text-only"]),
    ("prompt-wrong-type", "/v1/completions", {"prompt": 5}, 400, "prompt", ["token ids"]),
    ("prompt-ids-out-of-vocab", "/v1/completions", {"prompt": [1, 5000]}, 400, "prompt", ["0..1023"]),
    ("n-too-large", "/v1/chat/completions", chat(n=1000), 400, "n", ["--max-n"]),
    ("unknown-processor-arg", "/v1/chat/completions", chat(logits_processors_args={"no_such_key": 1}), 400,
     "logits_processors_args.no_such_key", ["no registered logits processor", "LogitBiasLogitsProcessor"]),
    ("processor-arg-wrong-type", "/v1/chat/completions", chat(logits_processors_args={"slow_ms": "slow"}), 400,
     "logits_processors_args.slow_ms", ["integer"]),
    ("logits_processors_args-not-object", "/v1/chat/completions", chat(logits_processors_args=[1]), 400,
     "logits_processors_args", ["dictionary"]),
    ("bias-id-out-of-vocab", "/v1/chat/completions", chat(logits_processors_args={"logit_bias": {"4096": 1.0}}),
     400, "logits_processors_args.logit_bias", ["4096", "vocabulary"]),
    ("openai-logit_bias-out-of-vocab", "/v1/chat/completions", chat(logit_bias={"99999": 5}), 400, "logit_bias",
     ["99999", "vocabulary"]),
    ("openai-logit_bias-out-of-range", "/v1/chat/completions", chat(logit_bias={"5": 150}), 400, "logit_bias",
     ["[-100, 100]"]),
    ("openai-logit_bias-bad-key", "/v1/chat/completions", chat(logit_bias={"hello": 5}), 400, "logit_bias",
     ["token ids"]),
    ("max_tokens-beyond-context", "/v1/chat/completions", chat(max_tokens=100000), 400, "max_tokens",
     ["max_model_len=512"]),
    ("max_completion_tokens-beyond-context", "/v1/chat/completions", chat(max_completion_tokens=600), 400,
     "max_completion_tokens", ["max_model_len=512"]),
    ("prompt-fills-the-context", "/v1/completions", {"prompt": [5] * 600}, 400, "prompt", ["max_model_len"]),
    ("top_logprobs-without-logprobs", "/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs",
     ["logprobs"]),
    ("stream_options-without-stream", "/v1/chat/completions", chat(stream_options={"include_usage": True}), 400,
     "stream_options", ["stream"]),
    ("stop-wrong-type", "/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", ["string"]),
    ("user-content-null", "/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400,
     "messages[0].content", ["a user message needs content"]),  # as OpenAI; an assistant turn may omit it
    ("stop-empty-string", "/v1/chat/completions", chat(stop=["END", ""]), 400, "stop",
     ["must not contain an empty string"]),
    ("two-constraints", "/v1/chat/completions", chat(guided_regex="a+", guided_choice=["a", "b"]), 400,
     "guided_choice", ["only one"]),
    ("unknown-response_format", "/v1/chat/completions", chat(response_format={"type": "xml"}), 400,
     "response_format.type", ["xml"]),
    ("response_format-regex-missing", "/v1/chat/completions", chat(response_format={"type": "regex"}), 400,
     "response_format.regex", ["required"]),
    ("guided_json-invalid-json", "/v1/chat/completions", chat(guided_json="{not json"), 400, "guided_json",
     ["not valid JSON"]),
    ("tool_choice-without-tools", "/v1/chat/completions", chat(tool_choice="required"), 400, "tool_choice",
     ["tools"]),
    ("unknown-field-strict", "/v1/chat/completions", chat(frobnicate=True), 400, "frobnicate", ["--strict-fields"]),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", ["not supported"]),
    ("hidden-states", "/v1/completions", {"prompt": "x", "return_hidden_states": True}, 400,
     "return_hidden_states", ["not supported"]),
    ("stream-reasoning-off", "/v1/chat/completions", chat(stream=True, stream_reasoning=False), 400,
     "stream_reasoning", ["only true"]),
    ("continue-a-user-message", "/v1/chat/completions", chat(continue_final_message=True, add_generation_prompt=False),
     400, "continue_final_message", ["assistant message last"]),
    ("two-constraints-sglang", "/v1/chat/completions", chat(regex="a+", guided_regex="b+"), 400, "regex",
     ["only one output constraint", "guided_regex"]),
]

# What sglang-router 0.3.2 and vllm-router 0.1.17 sent a replica for a plain request (captured by a
# replica that logs bodies): SGLang's fields, each at the value that changes nothing.
ROUTED_BODIES = [
    ("/v1/chat/completions", {"messages": CHAT, "model": "default", "logprobs": False, "max_completion_tokens": 3,
                              "stream": False, "no_stop_trim": False, "ignore_eos": False,
                              "continue_final_message": False, "skip_special_tokens": True,
                              "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
                              "include_reasoning": True}),
    ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 3, "stream": False, "echo": False,
                         "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                         "return_hidden_states": False}),
]


@pytest.mark.parametrize("path,body", ROUTED_BODIES, ids=["chat", "completions"])
def test_what_the_routers_add_passes_strict_fields(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    assert "x-fastdeploy-lp-ignored-fields" not in r.headers


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_named_and_the_server_keeps_serving(server, case):
    _, path, body, status, param, words = case
    r = post(server, path, content=body) if isinstance(body, bytes) else post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err["message"]
    assert_serves(server)


def test_bad_inputs_through_the_sdk_raise_bad_request_errors(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[], max_tokens=3)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=CHAT, max_tokens=3,
                                       extra_body={"logits_processors_args": {"logit_bias": {"70000": 2}}})
    assert "70000" in e.value.body["message"]
    assert_serves(server)


def test_wrong_or_missing_api_key_is_401_and_health_stays_open(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = post(server, "/v1/chat/completions", chat(), headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    bad = openai_client(server, "nope")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url("/health"), timeout=5).status_code == 200
    assert httpx.get(server.url("/metrics"), timeout=5).status_code == 200
    assert_serves(server)


def test_unknown_model_and_unknown_route_are_404(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "gpt-4o" in e.value.body["message"]
    r = httpx.get(server.url("/v1/nothing-here"), headers=AUTH, timeout=5)
    assert r.status_code == 404 and "/v1/nothing-here" in r.json()["error"]["message"]
    assert_serves(server)


def test_full_queue_is_429_then_serves_again(server):
    """Two slow requests hold both slots; with no waiting allowed a third is turned away."""
    slow = chat(max_tokens=40, stream=True, ignore_eos=True, logits_processors_args={"slow_ms": 100})
    with httpx.Client(timeout=60, headers=AUTH) as c:
        streams = [c.stream("POST", server.url("/v1/chat/completions"), json=slow) for _ in range(2)]
        responses = [s.__enter__() for s in streams]
        try:
            lines = [r.iter_lines() for r in responses]
            for it in lines:
                wait_for_tokens(it)  # both are in slots now
            r = post(server, "/v1/chat/completions", chat())
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "queue_full"
            assert r.headers["retry-after"] == "1"
        finally:
            for s in streams:
                s.__exit__(None, None, None)  # disconnect: both are aborted
    deadline = time.monotonic() + 10
    while server.metric("fastdeploy_lp:num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("fastdeploy_lp:num_requests_running") == 0
    assert_serves(server)


def test_not_serving_is_503_on_health_and_generation():
    """An in-process server whose engine thread stops: /health and generation answer 503."""
    from fastdeploy_lp.config import EngineArgs, FDConfig
    from fastdeploy_lp.engine.engine import LLMEngine
    from fastdeploy_lp.entrypoints.openai.api_server import build_app, settings_from_args
    from fastdeploy_lp.entrypoints.openai.args import ServerArgs

    engine = LLMEngine(FDConfig.create(QWEN2, max_num_seqs=2, guided_decoding_backend="off"))
    app = build_app(engine, settings_from_args(ServerArgs(served_model_name=["q"]), EngineArgs(QWEN2)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 30)
        assert httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10).status_code == 200
        app.state.async_engine.shutdown()
        r = httpx.get(base + "/health", timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_serving"
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "response_format": {"type": "json_object"}},
                       timeout=10)
        assert r.status_code == 503  # not serving comes first
    finally:
        server.should_exit = True
        thread.join(10)


def test_constraints_are_refused_when_guided_decoding_is_off():
    """With --guided-decoding-backend off a constrained request is a 400, never an unconstrained answer."""
    s = start_server("--guided-decoding-backend", "off")
    try:
        r = httpx.post(s.url("/v1/chat/completions"),
                       json=chat(response_format={"type": "json_object"}), timeout=30)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "response_format"
        assert "--guided-decoding-backend off" in r.json()["error"]["message"]
        assert httpx.post(s.url("/v1/chat/completions"), json=chat(), timeout=30).status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize("fields", [{"guided_regex": "(unclosed"},
                                    {"response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
                                    {"guided_grammar": "root ::= \"a\" ("},
                                    {"response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "x", "schema": False}}}],
                         ids=["regex", "json-schema", "grammar", "schema-false"])
def test_a_constraint_the_grammar_engine_rejects_is_a_400(server, fields):
    r = post(server, "/v1/chat/completions", chat(**fields))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(next(iter(fields))), r.json()  # the field the request used
    assert_serves(server)
