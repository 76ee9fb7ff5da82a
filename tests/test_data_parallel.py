"""`--data-parallel-size 2`: two engine processes behind one real server (`engine/data_parallel.py`).

Each request goes to the least loaded engine, and what comes back is what one engine gives: greedy
text, streams, 400s for bad constraints, logits processors' arguments. An engine that dies fails
only its own requests; stopping the server leaves no engine process behind."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import socket
import signal
import subprocess
import sys
import time

import httpx
import msgpack
import openai
import pytest
import zmq

from fastdeploy_lp import LLM, LoRARequest, SamplingParams
from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.engine.data_parallel_engines import engine_placements
from server_harness import QWEN2, free_port, openai_client, serving, start_server
from test_lora import make_adapter

PROMPTS = ["The capital of France is", "One, two, three,", "Hello", "def main():"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
LONG = {"prompt": "Count:", "max_tokens": 480, "ignore_eos": True, "temperature": 0}


def _two_free_ports() -> int:
    """A port P with P + 1 free too: engine r publishes KV events on P + r."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


EVENTS_PORT = _two_free_ports()


@pytest.fixture(scope="module")
def server():
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{EVENTS_PORT}"}  # "*": the publisher binds
    yield from serving("--data-parallel-size", "2", "--max-num-seqs", "4", "--enable-lora",
                       "--logits-processors", "LogitBiasLogitsProcessor", "--kv-events-config", json.dumps(events))


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def llm():
    return LLM(QWEN2, logits_processors=["LogitBiasLogitsProcessor"], max_num_seqs=4, enable_lora=True)


def engines(server) -> list[dict]:
    return httpx.get(server.url("/get_load"), timeout=10).json()["engines"]


def children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry))
        except OSError:
            continue
    return found


def test_two_engine_processes_on_their_own_cores(server):
    listed = engines(server)
    assert [e["engine"] for e in listed] == [0, 1] and all(e["serving"] for e in listed)
    assert {e["pid"] for e in listed} <= children(server.proc.pid)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # split evenly, each pinned to its share
        share = len(cores) // 2
        assert [e["cores"] for e in listed] == [cores[:share], cores[share:2 * share]]
        assert [sorted(os.sched_getaffinity(e["pid"])) for e in listed] == [e["cores"] for e in listed]


def test_concurrent_requests_reach_both_engines_and_match_one_engine(server, client, llm):
    before = [e["num_requests_total"] for e in engines(server)]
    refs = [o.outputs.text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12),
                                                 use_tqdm=False)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: client.completions.create(model="default", prompt=p, max_tokens=12,
                                                                 temperature=0).choices[0].text, PROMPTS * 2))
    assert outs == refs * 2
    after = [e["num_requests_total"] for e in engines(server)]
    routed = [a - b for a, b in zip(after, before)]
    assert sum(routed) == 8 and min(routed) >= 2, routed


def test_adapters_load_and_unload_at_run_time_on_every_engine(server, client, llm, tmp_path):
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    path = make_adapter(tmp_path / "dp", base=QWEN2, rank=4, targets=every, seed=9, scale=1.0)
    params = SamplingParams(temperature=0, max_tokens=12)
    want = [o.outputs.text for o in llm.generate(PROMPTS, params, use_tqdm=False, lora_request=LoRARequest("dp", 1, path))]
    assert want != [o.outputs.text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    load = httpx.post(server.url("/v1/load_lora_adapter"), json={"lora_name": "dp", "lora_path": path}, timeout=60)
    assert load.status_code == 200, load.text
    before = [e["num_requests_total"] for e in engines(server)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: client.completions.create(model="dp", prompt=p, max_tokens=12,
                                                                 temperature=0).choices[0].text, PROMPTS * 2))
    assert outs == want * 2  # on both engines (each request on the adapter everywhere)
    assert min(a - b for a, b in zip([e["num_requests_total"] for e in engines(server)], before)) >= 2
    bad = httpx.post(server.url("/v1/load_lora_adapter"), json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "x" not in {m.id for m in client.models.list().data}
    assert httpx.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "dp"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="dp", prompt="x", max_tokens=1)


def test_n_choices_stay_on_one_engine(server, client, llm):
    before = [e["num_requests_total"] for e in engines(server)]
    out = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=6, temperature=0, n=3)
    after = [e["num_requests_total"] for e in engines(server)]
    assert sorted(a - b for a, b in zip(after, before)) == [0, 1]
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs.text
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [ref] * 3


def test_streaming_gives_the_same_text(client):
    full = client.chat.completions.create(model="default", messages=CHAT, max_tokens=10, temperature=0,
                                          logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(model="default", messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len(full.choices[0].logprobs.content) == full.usage.completion_tokens


def test_a_bad_schema_is_the_engines_400(server):
    body = {"model": "default", "messages": CHAT, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object",
                                                                        "properties": {"a": {"type": "frobnicate"}}}}}}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "frobnicate" in r.json()["error"]["message"]
    r = httpx.post(server.url("/v1/completions"), timeout=30,
                   json={"model": "default", "prompt": "x", "max_tokens": 4, "logits_processors_args": {"nope": 1}})
    assert r.status_code == 400, r.text


def test_logits_processors_args_reach_the_engine(server, client, llm):
    token = 300
    out = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                    extra_body={"logits_processors_args": {"logit_bias": {str(token): 100.0}}})
    assert out.choices[0].text == llm.tokenizer.decode([token] * 4)
    listed = httpx.get(server.url("/v1/logits_processors"), timeout=10).json()["data"]  # the front end's objects
    assert [p["name"] for p in listed] == ["GuidedDecodingLogitsProcessor", "LogitBiasLogitsProcessor"]


def test_a_client_that_leaves_frees_its_engine(server):
    aborted = ("fastdeploy_lp:request_finished_total", 'finish_reason="abort"')
    before = server.metric(*aborted)
    with httpx.stream("POST", server.url("/v1/completions"), json={**LONG, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    deadline = time.monotonic() + 20  # aborted in its engine, and counted out in the front end
    while httpx.get(server.url("/get_load"), timeout=10).json()["num_reqs"] != 0:
        assert time.monotonic() < deadline, engines(server)
        time.sleep(0.05)
    assert server.metric(*aborted) == before + 1


def test_metrics_give_each_engines_load(server):
    text = httpx.get(server.url("/metrics"), timeout=10).text
    for rank in ("0", "1"):
        assert f'fastdeploy_lp:engine_serving{{engine="{rank}"}} 1.0' in text
        assert re.search(rf'fastdeploy_lp:engine_requests_total{{engine="{rank}"}} [1-9]', text), text
    given = sum(e["num_requests_total"] for e in engines(server))
    assert given == sum(float(v) for v in re.findall(r'^fastdeploy_lp:engine_requests_total{engine="\d"} (\S+)$',
                                                      text, re.M))


def test_counters_sum_the_engines(server):
    metrics = httpx.get(server.url("/metrics"), timeout=10).text
    blocks = float(next(line.split()[-1] for line in metrics.splitlines()
                        if line.startswith("fastdeploy_lp:kv_cache_blocks_total")))
    info = httpx.get(server.url("/get_server_info"), timeout=10).json()
    assert blocks > 0 and info["max_total_num_tokens"] == blocks * 16
    assert httpx.get(server.url("/get_load"), timeout=10).json()["num_reqs"] == 0


def test_each_engine_publishes_its_kv_events_on_its_own_port_with_its_rank(server, client):
    ctx = zmq.Context()
    subs = []
    for rank in range(2):
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(f"tcp://127.0.0.1:{EVENTS_PORT + rank}")
        subs.append(sock)
    time.sleep(0.5)  # PUB/SUB: the subscriptions reach the publishers asynchronously
    try:
        prompts = [f"Story {i}: " + "once upon a time " * 12 for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # concurrent: both engines get some
            list(pool.map(lambda p: client.completions.create(model="default", prompt=p, max_tokens=2), prompts))
        for rank, sock in enumerate(subs):
            ranks = set()
            while sock.poll(2000):
                ranks.add(msgpack.unpackb(sock.recv_multipart()[2])[2])
            assert ranks == {rank}, f"engine {rank}'s port carried batches of ranks {ranks}"
    finally:
        for sock in subs:
            sock.close(linger=0)
        ctx.term()


def test_stopping_the_server_stops_its_engines(server):
    """Last of the tests on the module's server: stops it."""
    pids = [e["pid"] for e in engines(server)]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_dead_engine_fails_only_its_requests_and_the_others_follow_a_killed_server():
    server = start_server("--data-parallel-size", "2", "--max-num-seqs", "1", "--max-waiting-requests", "0")
    try:
        listed = engines(server)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(httpx.post, server.url("/v1/completions"), json=LONG, timeout=60) for _ in range(2)]
            deadline = time.monotonic() + 30
            while not all(e["num_running_reqs"] == 1 for e in engines(server)):
                assert time.monotonic() < deadline, engines(server)
                time.sleep(0.05)
            full = httpx.post(server.url("/v1/completions"), json={**LONG, "max_tokens": 4}, timeout=30)
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full", full.text  # an engine's
            os.kill(listed[0]["pid"], signal.SIGKILL)
            answers = sorted((f.result() for f in futures), key=lambda r: r.status_code)
        assert [r.status_code for r in answers] == [200, 503], [r.text for r in answers]
        assert answers[0].json()["usage"]["completion_tokens"] == 480
        assert "data-parallel engine 0" in answers[1].json()["error"]["message"]
        health = httpx.get(server.url("/health"), timeout=10)  # engine 1 serves on, and it says why 0 does not
        assert health.status_code == 200 and "engine 0" in health.json()["engines_not_serving"][0]
        r = httpx.post(server.url("/v1/completions"), json={**LONG, "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        dead, alive = engines(server)
        assert not dead["serving"] and "killed by signal 9" in dead["not_serving_reason"] and alive["serving"]
        server.proc.kill()  # no shutdown: the engine left notices by itself
        server.proc.wait(10)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{alive['pid']}") and _state(alive["pid"]) != "Z":
            assert time.monotonic() < deadline, "an engine process outlived its killed server"
            time.sleep(0.1)
    finally:
        server.stop()


def test_what_cannot_work_is_refused_at_start():
    with pytest.raises(ValueError, match="data_parallel_size: 3 engines on 2 CPU core"):
        engine_placements(EngineArgs(data_parallel_size=3), "cpu", [0, 1])
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        engine_placements(EngineArgs(data_parallel_size=2, tensor_parallel_size=2), "cpu", [0, 1, 2, 3])
    split = engine_placements(EngineArgs(data_parallel_size=2), "cpu", [0, 1, 2, 3, 4])
    assert [(p.cores, p.args.cpu_threads, p.args.data_parallel_size) for p in split] == [([0, 1], 2, 1), ([2, 3], 2, 1)]
    shared = engine_placements(EngineArgs(data_parallel_size=3, cpu_threads=1), "cpu", [0, 1])
    assert [(p.cores, p.args.cpu_threads) for p in shared] == [(None, 1)] * 3
    with pytest.raises(ValueError, match="data_parallel_size: 2 engines run behind the server"):
        LLM(QWEN2, data_parallel_size=2)
    cores = len(os.sched_getaffinity(0))
    result = subprocess.run([sys.executable, "-m", "fastdeploy_lp.entrypoints.openai.api_server", "--model", QWEN2,
                             "--data-parallel-size", str(cores + 1), "--port", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and f"data_parallel_size: {cores + 1} engines on {cores} CPU core" in result.stderr
