"""Bounded connections: uvicorn's h11 protocol with a request-read timeout and a connection cap,
and a loop exception handler that reports running out of file descriptors once a second.

uvicorn closes a connection that idles *between* requests (`timeout_keep_alive`), but one that
never finishes sending a request — nothing at all, half its headers, a trickled body — is kept
forever, so a few thousand such sockets use up the file descriptors and nobody else gets in.
`BoundedH11Protocol` closes a connection whose request is not complete `read_timeout_s` after its
first chance to send it (the body gets one more second per 64 KiB, so a large body on a slow link
is not cut), and answers connections beyond `max_connections` with a JSON 503 and closes them
at once, which frees their descriptor in the same loop iteration.

The asyncio accept loop logs every failed `accept()` (up to the listen backlog per wake-up, with
a traceback each) when descriptors run out; `throttle_accept_errors` turns that into one line a
second. asyncio itself pauses accepting for a second and then retries, so the server serves
again as soon as descriptors are free.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import time
from dataclasses import dataclass

try:
    import resource
except ImportError:  # Windows: no open-file limit to fit
    resource = None

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from fastdeploy_lp.entrypoints.openai.errors import RETRY_LATER, OpenAIError

logger = logging.getLogger(__name__)

BODY_BYTES_PER_EXTRA_SECOND = 64 << 10
_READING = (h11.IDLE, h11.SEND_BODY)  # the client's side of h11 while a request is still arriving
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
DEFAULT_BACKLOG = 2048  # uvicorn's
BACKLOGS_IN_FLIGHT = 4  # accepted sockets not yet refused and closed, in backlogs (measured: 2 to 3)
FD_MARGIN = 64  # descriptors the server may still open while serving (logs, compile workers' pipes)


@dataclass(frozen=True)
class ConnectionLimits:
    """The connection cap and the request-read time limit (`--limit-concurrency`,
    `--request-read-timeout`; `ServerArgs` holds their defaults)."""

    max_connections: int
    read_timeout_s: float


def _refusal() -> bytes:
    body = json.dumps(OpenAIError(503, "too many open connections; retry later (--limit-concurrency)",
                                  code="too_many_connections").body()).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: {RETRY_LATER['Retry-After']}\r\n"
            f"connection: close\r\n\r\n")
    return head.encode() + body


_REFUSAL = _refusal()


class _Throttled:
    """A log line at most once a second, with the number of events since the last one."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self._last = float("-inf")
        self._count = 0

    def __call__(self, level: int, message: str, *args) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            logger.log(level, message + " [%d such events since the last report]", *args, self._count)
            self._last, self._count = now, 0


_refused_log = _Throttled()


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with the connection cap and the request-read timeout."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._refused = False
        self._read_timer = None
        self._read_deadline = 0.0

    def connection_made(self, transport) -> None:
        if len(self.connections) >= self.limits.max_connections:
            self._refused, self.transport = True, transport
            transport.write(_REFUSAL)
            transport.close()
            _refused_log(logging.WARNING, "refusing connections: %d are open (--limit-concurrency)",
                         len(self.connections))
            return
        super().connection_made(transport)
        self._arm_read_timer()

    def connection_lost(self, exc) -> None:
        if self._refused:
            return
        self._disarm_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing() or self.conn.their_state not in _READING:
            self._disarm_read_timer()
        elif self._read_timer is None:  # the first bytes of a request after a keep-alive pause
            self._arm_read_timer()
        else:
            self._read_deadline += len(data) / BODY_BYTES_PER_EXTRA_SECOND

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a broken request line, a head unfinished after 16 KiB): the JSON
        error body every other answer has, where uvicorn sends plain text."""
        body = json.dumps(OpenAIError(400, f"malformed HTTP request: {msg}", code="invalid_http").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _arm_read_timer(self) -> None:
        self._read_deadline = self.loop.time() + self.limits.read_timeout_s
        self._read_timer = self.loop.call_at(self._read_deadline, self._read_timed_out)

    def _disarm_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or self.conn.their_state not in _READING:
            return
        if self.loop.time() < self._read_deadline:  # the body kept coming: its extra time is not up
            self._read_timer = self.loop.call_at(self._read_deadline, self._read_timed_out)
            return
        logger.debug("closing a connection that sent no complete request within %g s", self.limits.read_timeout_s)
        self.transport.close()


def bounded_protocol(limits: ConnectionLimits):
    """The `http` protocol class to give `uvicorn.Config`."""
    return functools.partial(BoundedH11Protocol, limits=limits)


_accept_log = _Throttled()


def throttle_accept_errors(loop) -> None:
    """Report failed accepts (out of descriptors or memory) at most once a second; other loop
    errors go where they went before."""
    previous = loop.get_exception_handler()

    def handler(loop, context):
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_RESOURCES and "accept" in context.get("message", ""):
            _accept_log(logging.ERROR, "cannot accept connections: %s; lower --limit-concurrency or raise the "
                                       "open-file limit (ulimit -n)", exc)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def fit_to_open_file_limit(max_connections: int) -> tuple[int, int]:
    """(connections, listen backlog) that fit the open-file limit, raising the soft limit toward
    the hard one first. asyncio accepts up to a backlog of sockets at each wake-up before any of
    them can be refused, so a few backlogs' worth of descriptors must stay free beyond the
    connections; what the process already has open (model files, threads, pipes) is kept too."""
    backlog = DEFAULT_BACKLOG
    if resource is None:
        return max_connections, backlog
    want = _open_descriptors() + FD_MARGIN + max_connections + BACKLOGS_IN_FLIGHT * backlog
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= want:
        return max_connections, backlog
    free = max(2, soft - _open_descriptors() - FD_MARGIN)
    backlog = max(1, min(backlog, free // (2 * BACKLOGS_IN_FLIGHT)))
    fitted = max(1, min(max_connections, free - BACKLOGS_IN_FLIGHT * backlog))
    logger.warning("--limit-concurrency %d does not fit the open-file limit %d; serving at most %d connections "
                   "(listen backlog %d)", max_connections, soft, fitted, backlog)
    return fitted, backlog


def _open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: assume a server's usual share
        return 256
