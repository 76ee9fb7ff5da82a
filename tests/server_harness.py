"""Start a real `api_server` subprocess on 127.0.0.1 for the server tests, and stop it."""

from __future__ import annotations

import functools
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time

import anthropic
import httpx
import openai

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
QWEN2 = os.path.join(TESTS_DIR, "fixtures", "hf", "qwen2")
TEST_PROCESSORS = ["server_processors:ForceTokenLogitsProcessor", "server_processors:SlowLogitsProcessor",
                   "server_processors:FailingLogitsProcessor"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: str, metrics_port: int | None):
        self.proc = proc
        self.port = port
        self.metrics_port = metrics_port
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics, e.g. metric('fastdeploy_lp:num_requests_running')."""
        text = httpx.get(self.url("/metrics"), timeout=10).text
        pattern = re.escape(name + (("{" + labels + "}") if labels else "")) + r" ([-+0-9.e]+)$"
        m = re.search(pattern, text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_server(*args: str, model: str = QWEN2, metrics_port: bool = False, env: dict | None = None,
                 timeout: float = 90.0, open_files: int | None = None, port: int | None = None) -> RunningServer:
    """`open_files`: the server process's open-file limit (soft and hard), as `ulimit -n` sets it;
    `port`: a given one (a replica restarted where a router expects it), else a free one."""
    port = port or free_port()
    mport = free_port() if metrics_port else None
    cmd = [sys.executable, "-m", "fastdeploy_lp.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *args]
    if mport is not None:
        cmd += ["--metrics-port", str(mport)]
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, full_env.get("PYTHONPATH")) if p)
    full_env.pop("FDLP_API_KEY", None)
    full_env.pop("FASTDEPLOY_LP_API_KEY", None)  # its deprecated name, still read
    full_env.update(env or {})
    log = tempfile.NamedTemporaryFile("w", prefix="fdlp-server-", suffix=".log", delete=False)
    limit = None if open_files is None else functools.partial(
        resource.setrlimit, resource.RLIMIT_NOFILE, (open_files, open_files))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, preexec_fn=limit)
    server = RunningServer(proc, port, log.name, mport)
    if wait_healthy(server.base_url, timeout, alive=lambda: proc.poll() is None):
        return server
    if proc.poll() is not None:
        raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
    server.stop()
    raise RuntimeError(f"server did not become healthy in {timeout}s:\n{server.log()}")


def serving(*args: str, **kwargs):
    """A module fixture's body, `yield from serving(...)`: `start_server(...)`, stopped at teardown."""
    server = start_server(*args, **kwargs)
    try:
        yield server
    finally:
        server.stop()


def wait_healthy(base_url: str, timeout: float, alive=lambda: True) -> bool:
    """Poll `base_url`/health until it answers 200 (True), or `timeout` passes or `alive()` turns
    false (False). For an in-process server too, whose thread answers once uvicorn is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


def openai_client(server: RunningServer, api_key: str = "unused") -> openai.OpenAI:
    """The `openai` SDK on `server`: no retries (a failure shows at once), a 60 s timeout."""
    return openai.OpenAI(base_url=server.url("/v1"), api_key=api_key, max_retries=0, timeout=60)


def anthropic_client(server: RunningServer, api_key: str = "unused") -> anthropic.Anthropic:
    """The `anthropic` SDK on `server`, set up as `openai_client`."""
    return anthropic.Anthropic(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=60)
