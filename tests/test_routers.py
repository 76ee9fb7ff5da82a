"""Two replicas behind the request routers the field runs (`sglang-router`, `vllm-router`; both in
the test extras, each test skipped when its router is absent): what the routers ask the replicas
is answered, requests that share a prefix go to one replica, SGLang's constraint fields survive
sglang-router's rebuilt body and `logits_processors_args` survives vllm-router's forwarded one,
and a replica that drains (SIGTERM) loses no request: the router stops sending to it and takes it
back when it returns on the same port; one killed outright (SIGKILL) loses no non-streaming request
either (the router retries it on the other replica)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server_harness import QWEN2, free_port, start_server

ROUTERS = {"sglang": "sglang_router", "vllm": "vllm_router"}
REPLICA_FLAGS = ("--cpu-threads", "1", "--max-num-seqs", "4", "--served-model-name", "tiny",
                 "--shutdown-timeout", "20", "--logits-processors", "LogitBiasLogitsProcessor")


def _installed(kind: str) -> bool:
    return importlib.util.find_spec(ROUTERS[kind]) is not None


class Router:
    def __init__(self, kind: str, policy: str, workers: list[str]):
        self.port = free_port()
        common = ["--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                  "--prometheus-port", str(free_port()), "--health-check-interval-secs", "1",
                  "--cb-timeout-duration-secs", "5",  # a replica back from a restart is tried again after 5 s
                  "--worker-urls", *workers]
        cmd = ([sys.executable, "-m", "sglang_router.launch_router", *common] if kind == "sglang"
               else [str(Path(sys.executable).parent / "vllm-router"), *common])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.post(self.url("/v1/completions"), json={"model": "tiny", "prompt": "Hi", "max_tokens": 1},
                              timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{kind}-router did not route a request within 60 s")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete(self, prompt: str, **fields) -> httpx.Response:
        return httpx.post(self.url("/v1/completions"), timeout=120,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields})

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


@pytest.fixture(scope="module")
def replicas():
    if not any(_installed(kind) for kind in ROUTERS):
        pytest.skip("neither sglang-router nor vllm-router is installed")
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda _: start_server(*REPLICA_FLAGS, model=QWEN2), range(2)))
    yield servers
    for server in servers:
        server.stop()


def finished(server) -> float:
    return sum(server.metric("fastdeploy_lp:request_finished_total", f'finish_reason="{r}"')
               for r in ("stop", "length"))


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_shared_prefixes_stay_on_one_replica_and_extensions_arrive(replicas, kind):
    if not _installed(kind):
        pytest.skip(f"{kind}-router is not installed")
    router = Router(kind, "cache_aware", [s.base_url for s in replicas])
    try:
        for group in range(3):
            prefix = f"Report {group}: " + " ".join(f"{w}{group}" for w in ("alpha", "beta", "gamma") * 12)
            before = [finished(s) for s in replicas]
            for i in range(4):
                answer = router.complete(f"{prefix} question {i}")
                assert answer.status_code == 200, answer.text
            served = [finished(s) - b for s, b in zip(replicas, before)]
            assert sorted(served) == [0, 4], f"group {group} split over the replicas: {served}"
        if kind == "sglang":  # the body is rebuilt from SGLang's schema: its own constraint fields survive
            text = router.complete("Say it", regex="[xyz]{5}", max_tokens=8).json()["choices"][0]["text"]
            assert re.fullmatch("[xyz]{5}", text), text
        else:  # forwarded as sent
            r = router.complete("Say it", max_tokens=6, logits_processors_args={"logit_bias": {"7": 100}})
            forced = httpx.post(replicas[0].url("/detokenize"), json={"tokens": [7] * 6}, timeout=10).json()["prompt"]
            assert r.json()["choices"][0]["text"] == forced
    finally:
        router.stop()


def test_a_draining_or_dead_replica_loses_no_request_and_comes_back(replicas):
    kind = "sglang" if _installed("sglang") else "vllm"
    leaving, staying = replicas
    router = Router(kind, "round_robin", [s.base_url for s in replicas])
    try:
        with ThreadPoolExecutor(8) as pool:
            running = [pool.submit(router.complete, f"Count to {i}:", max_tokens=64, ignore_eos=True)
                       for i in range(8)]
            time.sleep(1.0)
            leaving.proc.terminate()  # SIGTERM: /health fails at once, running requests finish
            later = [pool.submit(router.complete, f"Then {i}") for i in range(8)]
            answers = [f.result(timeout=180) for f in running + later]
        assert [a.status_code for a in answers] == [200] * 16, [a.text for a in answers if a.status_code != 200]
        assert all(a.json()["usage"]["completion_tokens"] == 64 for a in answers[:8])
        assert leaving.proc.wait(60) == 0  # drained and exited cleanly
        before = finished(staying)
        for i in range(4):
            assert router.complete(f"Alone {i}").status_code == 200
        assert finished(staying) - before == 4
        back = start_server(*REPLICA_FLAGS, model=QWEN2, port=leaving.port)
        replicas[0] = back
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and finished(back) == 0:
            router.complete("Are you back?")
            time.sleep(0.5)
        assert finished(back) > 0, "the router did not take the replica back"
        with ThreadPoolExecutor(8) as pool:  # now killed outright: plain requests are retried elsewhere
            running = [pool.submit(router.complete, f"Count to {i}:", max_tokens=64, ignore_eos=True)
                       for i in range(6)]
            time.sleep(1.0)
            back.proc.kill()
            answers = [f.result(timeout=180) for f in running]
        assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers if a.status_code != 200]
    finally:
        router.stop()
