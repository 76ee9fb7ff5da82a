"""The server's door and its shutdown: body limits, nesting, API-key coverage, field-naming
errors, values that used to stop the engine, and SIGTERM with live streams. Real uvicorn server."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from fastdeploy_lp.config import default_model_path
from server_harness import start_server

KEY = "hardening-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 200_000


@pytest.fixture(scope="module")
def server():
    s = start_server("--max-num-seqs", "4", "--max-request-body-bytes", str(LIMIT),
                     "--logits-processors", "LogitBiasLogitsProcessor", "custom_processors:HostileLogitsProcessor",
                     env={"FDLP_API_KEY": KEY})
    yield s
    s.stop()


def post(server, body=None, *, content=None, path="/v1/chat/completions", headers=AUTH):
    return httpx.post(server.url(path), json=body, content=content, headers=headers, timeout=60)


def chat(**extra):
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}


def assert_serves(server):
    r = post(server, chat())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def error(r, status):
    assert r.status_code == status, r.text
    return r.json()["error"]


# -- limits at the door ----------------------------------------------------------------------------
def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    big = json.dumps(chat(stop=["x" * (LIMIT + 10)])).encode()
    assert "request_too_large" == error(post(server, content=big), 413)["code"]

    def chunks():  # no Content-Length: the limit bites while the body streams in
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]
    r = httpx.post(server.url("/v1/chat/completions"), content=chunks(), headers=AUTH, timeout=60)
    assert error(r, 413)["code"] == "request_too_large"
    assert_serves(server)


@pytest.mark.parametrize("where", ["body", "chat_template_kwargs", "guided_json"])
def test_deep_nesting_is_400_not_500(server, where):
    deep = "[" * 5000 + "]" * 5000
    body = {"body": '{"messages": [{"role": "user", "content": "Hi"}], "x": ' + deep + "}",
            "chat_template_kwargs": json.dumps(chat())[:-1] + ', "chat_template_kwargs": {"a": ' + deep + "}}",
            "guided_json": json.dumps(chat())[:-1] + ', "guided_json": {"items": ' + deep + "}}"}[where]
    err = error(post(server, content=body.encode()), 400)
    assert "nests JSON more than" in err["message"]
    assert_serves(server)


# -- values that used to stop the engine, and errors that name the field ------------------------
@pytest.mark.parametrize("body, param", [
    (chat(top_k=2**70), "top_k"), (chat(seed=-1), "seed"), (chat(model=123), "model"),
    (chat(logit_bias={"٣": 1}), "logit_bias"), (chat(bad_words=[""]), "bad_words"),
    (chat(temperature=1e300), "temperature"),
    (chat(chat_template_kwargs={"bos_token": "<x>"}), "chat_template_kwargs.bos_token"),
])
def test_bad_values_are_400s_naming_the_field_and_the_server_serves_on(server, body, param):
    assert error(post(server, body), 400)["param"] == param
    assert_serves(server)


@pytest.mark.parametrize("args, message", [({"exit_in": "apply"}, "SystemExit"), ({"exit_in": "update_state"}, "SystemExit"),
                                           ({"write": "nan"}, "no token can be sampled")])
def test_a_processor_that_exits_or_writes_nan_fails_only_its_request(server, args, message):
    r = post(server, chat(logits_processors_args=args))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "error" and message in choice["error"]["message"]
    assert_serves(server)
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200


def test_unknown_nested_fields_are_reported_like_top_level_ones(server):
    body = {"messages": [{"role": "user", "content": "Hi", "mood": "curious"}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "verbose": True}, "extra_top": 1}
    with httpx.stream("POST", server.url("/v1/chat/completions"), json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["x-fastdeploy-lp-ignored-fields"] == "extra_top,messages[0].mood,stream_options.verbose"
        r.read()


BODIES = {"/v1/chat/completions": chat(), "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
          "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
          "/v1/messages": {"model": "qwen2", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}}


@pytest.mark.parametrize("path", list(BODIES))
def test_unknown_field_names_of_any_characters_are_percent_encoded_in_the_header(server, path):
    names = ["名前", "a\r\nX-Injected: 1", "nul\x00", "comma,name", "100%"]
    body = {**BODIES[path], **{name: 1 for name in names}}
    r = post(server, content=json.dumps(body).encode(), path=path)
    assert r.status_code == 200, r.text
    assert "x-injected" not in r.headers
    assert set(r.headers["x-fastdeploy-lp-ignored-fields"].split(",")) == {
        "%E5%90%8D%E5%89%8D", "a%0D%0AX-Injected:%201", "nul%00", "comma%2Cname", "100%25"}


def test_a_client_that_leaves_a_non_streamed_request_logs_no_traceback(server):
    before = server.log()
    for _ in range(5):
        with pytest.raises(httpx.TimeoutException):  # the client gives up mid-generation
            httpx.post(server.url("/v1/chat/completions"),  # 0.05 s a step: 2 s of generation
                       json=chat(max_tokens=40, ignore_eos=True, logits_processors_args={"sleep_s": 0.05}),
                       headers=AUTH, timeout=0.3)
    time.sleep(1.0)
    assert_serves(server)
    new = server.log()[len(before):]
    assert "Traceback" not in new and "InvalidStateError" not in new, new


# -- security edges ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/v1/models"])
def test_with_an_api_key_only_health_and_metrics_are_open(server, path):
    assert error(httpx.get(server.url(path), timeout=10), 401)["code"] == "invalid_api_key"
    assert httpx.get(server.url(path), headers=AUTH, timeout=10).status_code == 200
    for open_path in ("/health", "/metrics"):
        assert httpx.get(server.url(open_path), timeout=10).status_code == 200


# -- graceful shutdown ------------------------------------------------------------------------------
def test_sigterm_drains_ends_live_streams_cleanly_and_exits_0():
    s = start_server("--max-num-seqs", "4", "--shutdown-timeout", "1.5",
                     "--logits-processors", "server_processors:SlowLogitsProcessor")
    # ~100 steps of 100 ms: far longer than the 1.5 s the drain waits
    body = chat(max_tokens=100, ignore_eos=True, stream=True, logits_processors_args={"slow_ms": 100})
    events: list[list[str]] = [[] for _ in range(4)]
    started = threading.Barrier(5)

    def consume(i):
        with httpx.stream("POST", s.url("/v1/chat/completions"), json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            for line in lines:
                if line:
                    events[i].append(line)
                    if len(events[i]) == 2:
                        started.wait(30)
                        break
            events[i] += [line for line in lines if line]

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    blocking = {}

    def non_streaming():
        blocking["r"] = httpx.post(s.url("/v1/chat/completions"), json={**body, "stream": False}, timeout=60)

    try:
        for t in threads:
            t.start()
        started.wait(60)
        waiter = threading.Thread(target=non_streaming)
        waiter.start()
        time.sleep(0.3)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(s.url("/v1/chat/completions"), json=chat(), timeout=10)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"]
        assert httpx.get(s.url("/health"), timeout=10).status_code == 503
        for t in threads + [waiter]:
            t.join(60)
        assert s.proc.wait(30) == 0, s.log()
    finally:
        s.stop()
    for lines in events:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2][len("data: "):])
        assert "shutting down" in last["error"]["message"]
    r = blocking["r"]
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]


def test_a_second_sigint_ends_running_requests_at_once_with_json_errors_and_done():
    # A drain of up to 60 s: only the second signal can end these requests within seconds.
    s = start_server("--max-num-seqs", "4", "--shutdown-timeout", "60",
                     "--logits-processors", "server_processors:SlowLogitsProcessor", model=default_model_path())
    body = chat(max_tokens=200, ignore_eos=True, logits_processors_args={"slow_ms": 100})
    results: dict[str, object] = {}
    streaming = {f"stream{i}": threading.Event() for i in range(2)}

    def stream(name):
        with httpx.stream("POST", s.url("/v1/chat/completions"), json={**body, "stream": True}, timeout=60) as r:
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    streaming[name].set()
            results[name] = (r.status_code, lines)

    def blocking():
        results["blocking"] = httpx.post(s.url("/v1/chat/completions"), json=body, timeout=60)

    threads = [threading.Thread(target=stream, args=(f"stream{i}",)) for i in range(2)]
    threads.append(threading.Thread(target=blocking))
    try:
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in streaming.values())
        deadline = time.monotonic() + 60
        # Both streams and the blocking request in engine slots: one not yet admitted would rightly get a 503.
        while s.metric("fastdeploy_lp:num_requests_running") < 3:
            assert time.monotonic() < deadline, "the three requests never ran together"
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while True:  # the signal is handled on the server's loop: a request just before it is still served
            time.sleep(0.5)
            refused = httpx.post(s.url("/v1/chat/completions"), json=chat(), timeout=30)
            if refused.status_code == 503 or time.monotonic() > deadline:
                break
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_serving"
        s.proc.send_signal(signal.SIGINT)
        second = time.monotonic()
        late = []
        while s.proc.poll() is None and time.monotonic() - second < 20:  # new requests while it stops
            try:
                late.append(httpx.post(s.url("/v1/chat/completions"), json=chat(), timeout=10))
            except (httpx.ConnectError, httpx.RemoteProtocolError):  # the listener closed, or closed on it
                break
        for t in threads:
            t.join(30)
        ended_s = time.monotonic() - second
        assert s.proc.wait(30) == 0, s.log()
    finally:
        s.stop()
    assert ended_s < 10, ended_s
    for name in ("stream0", "stream1"):
        status, lines = results[name]
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        assert "shutting down" in json.loads(lines[-2][len("data: "):])["error"]["message"]
    r = results["blocking"]
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    for r in late:
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_serving", r.text
