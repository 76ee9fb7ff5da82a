"""Through the server (issue "Hardening II"): a hostile processor fails only its own request and
never the engine, a stuck engine is 503 on /health and ends its waiting requests with an error,
seeded sampling ignores the neighbours, and a large `n` takes turns with other clients.
Real uvicorn server on the built-in model, real HTTP clients."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from fastdeploy_lp.config import default_model_path
from server_harness import start_server

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server():
    # A processor call past --logits-processor-timeout fails its request at the limit; the stall test
    # hangs one for 6 s under a longer limit, so only the watchdog can end it.
    s = start_server("--max-num-seqs", "4", "--engine-stall-timeout", "2", "--logits-processor-timeout", "10",
                     "--logits-processors", "step_processors:StepAttackLogitsProcessor",
                     "server_processors:SlowLogitsProcessor", model=default_model_path())
    yield s
    s.stop()


def complete(server, **body):
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(server.url("/v1/completions"), json=body, timeout=60)


def stream_beside(server, body, action):
    """Start a streamed completion, run `action` once its first chunk arrived, return the text."""
    body = {"model": "default", "prompt": PROMPT, "ignore_eos": True, "stream": True, **body}
    text = []
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            text.append(json.loads(line[len("data: "):])["choices"][0]["text"])
            if len(text) == 1:
                action()
    return "".join(text)


def assert_serves(server):
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    r = complete(server)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


@pytest.mark.parametrize("attack", [{"force_token": 10**9}, {"force_token": -5}, {"force_others": 7},
                                    {"pop_key": "output_ids"}, {"overwrite": True}, {"interrupt_after": 2}])
def test_a_hostile_processor_changes_nothing_beside_it_and_the_server_serves_on(server, attack):
    innocent = {"max_tokens": 48, "temperature": 0, "logits_processors_args": {"slow_ms": 10}}
    alone = stream_beside(server, innocent, lambda: None)
    hostile = {}
    beside = stream_beside(server, innocent, lambda: hostile.setdefault(
        "r", complete(server, logits_processors_args=attack)))
    assert beside == alone
    r = hostile["r"]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if {"force_token", "force_others", "interrupt_after"} & set(attack):
        assert choice["finish_reason"] == "error" and "StepAttackLogitsProcessor" in choice["error"]["message"]
    else:
        assert choice["finish_reason"] == "length"
    assert_serves(server)


def test_seeded_sampling_ignores_a_neighbours_top_k_top_p_and_min_p(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none")

    def seeded():
        return client.completions.create(model="default", prompt=PROMPT, max_tokens=40, temperature=1.0, seed=1,
                                         extra_body={"ignore_eos": True}).choices[0].text

    alone = seeded()
    for neighbour in ({"top_k": 50}, {"top_p": 0.5}, {"min_p": 0.2}):
        beside = {}
        stream_beside(server, {"max_tokens": 64, "temperature": 1.0, "seed": 9, **neighbour,
                               "logits_processors_args": {"slow_ms": 10}},
                      lambda: beside.setdefault("text", seeded()))
        assert beside["text"] == alone, neighbour


def test_a_large_n_takes_turns_with_other_clients(server):
    done = {}

    def big():
        complete(server, n=12, max_tokens=16, logits_processors_args={"slow_ms": 10})
        done["big"] = time.monotonic()

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.3)  # its first four choices hold every slot
    r = complete(server, max_tokens=4)
    done["small"] = time.monotonic()
    thread.join(60)
    assert r.status_code == 200
    assert done["small"] < done["big"]  # served when a slot freed, not after all twelve choices


def test_a_stuck_engine_is_503_on_health_and_its_requests_end_with_an_error(server):
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("r", complete(
        server, logits_processors_args={"hang_s": 6.0})))
    waiter.start()
    deadline = time.monotonic() + 5
    health = httpx.get(server.url("/health"), timeout=10)
    while health.status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
        health = httpx.get(server.url("/health"), timeout=10)
    assert health.status_code == 503, "a stuck engine must not be healthy"
    assert "no progress" in health.json()["error"]["message"]
    waiter.join(10)
    r = result["r"]
    assert r.status_code == 503 and "no progress" in r.json()["error"]["message"], r.text
    deadline = time.monotonic() + 15
    while httpx.get(server.url("/health"), timeout=10).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert_serves(server)
