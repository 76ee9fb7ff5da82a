"""Bounded connections, with raw sockets against a real uvicorn server: idle, half-header and
half-body connections are closed by the request-read timeout, idle keep-alive connections by the
keep-alive timeout, connections beyond --limit-concurrency get a JSON 503, a flood never exhausts
the open files (nor floods the log), and the server serves as soon as the flood ends."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import re
import selectors
import socket
import time

import httpx
import pytest

from fastdeploy_lp.config import default_model_path
from fastdeploy_lp.entrypoints.openai.args import make_parser
from fastdeploy_lp.entrypoints.openai.connections import throttle_accept_errors
from server_harness import start_server

LIMIT = 60
OPEN_FILES = 400  # below what --limit-concurrency 1024 needs: the server must fit itself to it


@pytest.fixture(scope="module")
def server():
    s = start_server("--max-num-seqs", "2", "--limit-concurrency", str(LIMIT), model=default_model_path())
    yield s
    s.stop()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def closed_within(socks: list[socket.socket], seconds: float) -> dict[socket.socket, float]:
    """When the server closed each socket (EOF or reset), seconds from now; sockets still open
    after `seconds` are missing."""
    start, closed = time.monotonic(), {}
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        while len(closed) < len(socks) and time.monotonic() - start < seconds:
            for key, _ in sel.select(0.2):
                try:
                    data = key.fileobj.recv(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    closed[key.fileobj] = time.monotonic() - start
                    sel.unregister(key.fileobj)
    return closed


def open_many(port: int, count: int, seconds: float = 20) -> list[socket.socket]:
    """`count` connections opened at once (as a flood opens them), those connected in `seconds`."""
    pending = []
    for _ in range(count):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        pending.append(s)
    connected, start = [], time.monotonic()
    with selectors.DefaultSelector() as sel:
        for s in pending:
            sel.register(s, selectors.EVENT_WRITE)
        while len(connected) < count and time.monotonic() - start < seconds:
            for key, _ in sel.select(0.2):
                sel.unregister(key.fileobj)
                connected.append(key.fileobj)
    for s in set(pending) - set(connected):
        s.close()
    return connected


def completion(server) -> httpx.Response:
    return httpx.post(server.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 2}, timeout=30)


def test_the_defaults_bound_every_connection():
    args = make_parser().parse_args([])
    assert args.request_read_timeout <= 30 and args.keep_alive_timeout <= 30 and args.limit_concurrency <= 4096


def test_idle_half_header_and_half_body_connections_are_closed_within_30_s(server):
    idle = [connect(server) for _ in range(15)]
    half_header = [connect(server) for _ in range(15)]
    for s in half_header:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    half_body = [connect(server) for _ in range(10)]
    for s in half_body:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
    assert completion(server).status_code == 200  # they hold sockets, not the server
    socks = idle + half_header + half_body
    try:
        closed = closed_within(socks, 30)
        assert len(closed) == 40, f"{40 - len(closed)} of 40 connections still open after 30 s"
    finally:
        for s in socks:
            s.close()
    assert completion(server).status_code == 200


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(server):
    s = connect(server)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert s.recv(65536).startswith(b"HTTP/1.1 200")
    try:
        closed = closed_within([s], 15)
        assert s in closed and closed[s] < 5 + 2, closed  # the default --keep-alive-timeout is 5 s
    finally:
        s.close()


@pytest.mark.parametrize("request_head", [b"NOT HTTP AT ALL\r\n\r\n",
                                          b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000],
                         ids=["garbage", "unfinished-head-over-16KiB"])
def test_a_request_http_cannot_parse_gets_a_json_400(server, request_head):
    with connect(server) as s:
        s.sendall(request_head)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, answer[:300]
    assert json.loads(body)["error"]["code"] == "invalid_http"


def test_connections_beyond_the_limit_get_a_json_503_and_service_resumes_when_they_close(server):
    held = [connect(server) for _ in range(LIMIT)]
    try:
        time.sleep(0.2)
        r = completion(server)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "too_many_connections" and r.headers["retry-after"]
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert completion(server).status_code == 200


def test_a_flood_beyond_the_open_file_limit_is_refused_quietly_and_the_server_serves_after_it():
    s = start_server("--max-num-seqs", "2", model=default_model_path(), open_files=OPEN_FILES)
    flood: list[socket.socket] = []
    try:
        start = time.monotonic()
        flood = open_many(s.port, 1500)  # far more than the 400 descriptors the server may open
        during = completion(s)
        assert during.status_code == 503 and during.json()["error"]["code"] == "too_many_connections"
        for sock in flood:
            sock.close()
        flood = []
        time.sleep(0.2)
        assert completion(s).status_code == 200
        log = s.log()
        flooded_s = time.monotonic() - start
    finally:
        for sock in flood:
            sock.close()
        s.stop()
    assert "Too many open files" not in log
    assert "does not fit the open-file limit" in log
    refusals = len(re.findall("refusing connections", log))
    assert 1 <= refusals <= flooded_s + 2, (refusals, flooded_s)


def test_running_out_of_descriptors_is_logged_at_most_once_a_second(caplog):
    """What asyncio's accept loop does when accept() fails: report it through the loop's
    exception handler, once per connection waiting in the backlog."""
    loop = asyncio.new_event_loop()
    try:
        throttle_accept_errors(loop)
        error = OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        with caplog.at_level(logging.ERROR):
            for _ in range(2048):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": error})
            loop.call_exception_handler({"message": "something else", "exception": RuntimeError("other")})
    finally:
        loop.close()
    accept_lines = [r for r in caplog.records if "cannot accept connections" in r.getMessage()]
    assert len(accept_lines) == 1 and "Too many open files" in accept_lines[0].getMessage()
    assert any("something else" in r.getMessage() for r in caplog.records)
