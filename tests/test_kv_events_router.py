"""vllm-router's `kv_aware` policy in front of two replicas publishing KV-cache events
(`--kv-events-config`): a request goes to the replica whose events say it holds the prompt's
prefix, not to the one load alone would pick. Skipped when vllm-router (test extras) is absent."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server_harness import QWEN2, free_port, start_server

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm_router") is None, reason="vllm-router not installed")

SHARED = {  # two prefixes of about ten 16-token blocks
    "rivers": "Instructions: answer briefly. Context: rivers of Europe include the Danube, the Rhine, the Rhone, "
              "the Loire, the Elbe, the Oder, the Vistula and the Volga, which is the longest river of the continent.",
    "birds": "Preamble: we study birds. Facts: swifts spend most of their lives flying, albatrosses glide over the "
             "southern ocean for years, and penguins cannot fly but swim very well in cold water.",
}


def replica():
    pub, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}"}  # topic "": vllm-router's static sources read that one
    server = start_server("--cpu-threads", "1", "--max-num-seqs", "2", "--served-model-name", "tiny",
                          "--kv-events-config", json.dumps(config), model=QWEN2)
    return server, pub, replay


def served(server) -> float:
    return sum(server.metric("fastdeploy_lp:request_finished_total", f'finish_reason="{r}"') for r in ("stop", "length"))


def complete(base_url: str, prompt: str) -> None:
    r = httpx.post(f"{base_url}/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with ThreadPoolExecutor(2) as pool:
        replicas = list(pool.map(lambda _: replica(), range(2)))
    port, log = free_port(), tmp_path_factory.mktemp("router") / "router.log"
    cmd = [str(Path(sys.executable).parent / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
           "--policy", "kv_aware", "--prometheus-port", str(free_port()), "--log-level", "debug",
           "--kv-event-block-size", "16", "--kv-event-model", "tiny",
           "--worker-urls", *[s.base_url for s, _, _ in replicas]]
    for server, pub, replay in replicas:
        cmd += ["--kv-event-source", f"{server.base_url}=tcp://127.0.0.1:{pub}",
                "--kv-event-replay-source", f"{server.base_url}=tcp://127.0.0.1:{replay}"]
    with open(log, "w") as out:
        router = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "VLLM_ROUTER_TOKENIZER": QWEN2})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                complete(url, "Hi")
                break
            except (httpx.HTTPError, AssertionError):
                if time.monotonic() > deadline or router.poll() is not None:
                    raise RuntimeError(f"vllm-router did not route a request:\n{log.read_text()}") from None
                time.sleep(0.5)
        yield [s for s, _, _ in replicas], url, log
    finally:
        router.terminate()
        router.wait(20)
        for server, _, _ in replicas:
            server.stop()


def test_a_shared_prefix_goes_to_the_replica_whose_events_say_it_holds_it(setup):
    (one, two), router, log = setup
    complete(two.base_url, SHARED["rivers"] + " Q0: which is longest?")   # seeded behind the router's back
    complete(one.base_url, SHARED["birds"] + " Q0: which birds fly?")
    time.sleep(1.0)  # the events reach the router
    before = [served(one), served(two)]
    for q in range(3):
        complete(router, SHARED["rivers"] + f" Q{q + 1}: which flows through Vienna?")
    assert [served(one), served(two)] == [before[0], before[1] + 3]
    for q in range(3):
        complete(router, SHARED["birds"] + f" Q{q + 1}: which birds swim?")
    assert [served(one), served(two)] == [before[0] + 3, before[1] + 3]
    # The router credited the cached blocks it learned from the events, not a guess of its own.
    credited = [int(n) for n in re.findall(r"credited_prefix_tokens\W*=\W*(\d+)",
                                           re.sub(r"\x1b\[[0-9;]*m", "", log.read_text()))]
    assert len(credited) >= 6 and all(n >= 128 for n in credited[-6:])
