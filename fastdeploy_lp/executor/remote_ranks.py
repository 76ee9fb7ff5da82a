"""Tensor-parallel ranks started elsewhere: multi-node tensor parallelism.

With `--tensor-parallel-address HOST:PORT` the driver does not spawn its ranks. On each node the
operator starts them with Paddle's launcher, which forms the process group across the nodes:

    python -m paddle.distributed.launch --nnodes 2 --rank 0 --master 10.0.0.1:29500 \\
        --nproc_per_node 1 fastdeploy-lp tp-worker --driver 10.0.0.1:29600

and every rank connects to the driver at HOST:PORT twice: once for the passes (the same messages a
spawned rank reads from its pipe, `worker.py`) and once as its *liveness* channel, on which it never
writes, so that the driver's end turns readable exactly when the rank's process or machine is gone:
the driver waits on it as it waits on a local process's sentinel.

Messages are pickles, so both ends first prove they hold the secret in `FDLP_TP_SECRET`
(multiprocessing's HMAC challenge, in both directions) before anything is unpickled. Each
connection is greeted on a thread of its own: a client that connects and says nothing delays no
one.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import threading
import time
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge

from fastdeploy_lp import envs
from fastdeploy_lp.distributed.checks import parse_address, secret

logger = logging.getLogger(__name__)

GREETING_TIMEOUT_S = 30.0  # a connection silent this long while it authenticates and says who it is is dropped
RETRY_S = 0.5  # a launched rank retries a driver not yet listening this often
# A machine that crashes or drops off the network sends no FIN: TCP keepalive probes find it after
# about IDLE + INTERVAL * COUNT seconds of silence, and data left unacknowledged for USER_TIMEOUT ms
# (a large logits reply) fails the send instead of ~15 minutes of retransmission.
KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3, "TCP_USER_TIMEOUT": 30_000}
CHANNELS = ("passes", "liveness")


class RemoteRank:
    """A launched rank as the driver sees it, with the part of `multiprocessing.Process`'s interface
    the tensor-parallel runner uses (`pid`, `sentinel`, `is_alive`, `join`, `kill`)."""

    def __init__(self, rank: int, host: str, pid: int, liveness: Connection):
        self.rank, self.host, self.pid = rank, host, pid
        self._liveness = liveness
        self.sentinel = liveness.fileno()

    def is_alive(self) -> bool:
        return not self.join(0)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the rank is gone or `timeout` passes; True if it is gone."""
        try:
            return self._liveness.poll(timeout)  # readable: end of file, the rank never writes here
        except (OSError, ValueError):  # closed by `kill`
            return True

    def kill(self) -> None:
        """Let go of it: a launched rank exits as soon as its liveness channel closes."""
        _shut(self._liveness)  # close() alone sends no FIN while another thread polls the socket
        self._liveness.close()

    def describe_exit(self) -> str:
        return (f"on {self.host} closed its connection (it exited, or its machine or the network "
                f"failed; its log is in paddle.distributed.launch's --log_dir on that machine)")


def accept_ranks(address: str, size: int, deadline: float) -> tuple[list[Connection], list[RemoteRank]]:
    """Wait at `address` until ranks 0..size-1 have both connected; their passes connections and
    `RemoteRank`s, in rank order. A `TimeoutError` names the ranks still missing at `deadline`."""
    key = secret()
    listener = socket.create_server(parse_address(address))
    greeted: queue.Queue = queue.Queue()
    threading.Thread(target=_accept, args=(listener, key, greeted), name="fastdeploy-lp-tp-accept",
                     daemon=True).start()
    logger.info("tensor parallel: waiting at %s for %d ranks started with paddle.distributed.launch", address, size)
    joined: dict[tuple[int, str], tuple[Connection, tuple]] = {}
    try:
        while len(joined) < 2 * size or _drop_dead(joined):
            try:
                conn, hello = greeted.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted({r for r in range(size) for c in CHANNELS if (r, c) not in joined})
                raise TimeoutError(f"tensor parallel: rank(s) {', '.join(map(str, missing))} of {size} did not "
                                   f"connect to {address} in time (FDLP_TP_START_TIMEOUT)") from None
            known = joined.get((hello[1], hello[5])) if isinstance(hello, tuple) and len(hello) == 6 else None
            if known is not None and known[0].poll(0):  # that rank died before the group formed: relaunched
                known[0].close()
                del joined[hello[1], hello[5]]
            refusal = _refusal(hello, size, joined)
            if refusal:
                logger.warning("tensor parallel: refused a rank's connection: %s", refusal)
                _refuse(conn, refusal)
                continue
            joined[hello[1], hello[5]] = conn, hello
    except BaseException:
        for conn, _ in joined.values():
            conn.close()
        raise
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread; the port is free again
        listener.close()
    conns = [joined[r, "passes"][0] for r in range(size)]
    ranks = [RemoteRank(r, joined[r, "passes"][1][3], joined[r, "passes"][1][4], joined[r, "liveness"][0])
             for r in range(size)]
    return conns, ranks


def _drop_dead(joined: dict) -> bool:
    """Close and forget the connections whose rank has gone since it joined; True if there were any.
    The greeting threads hand over connections in any order, so a dead launch's connection can come
    in after its relaunch's twin and would otherwise complete the group."""
    dead = [key for key, (conn, _) in joined.items() if conn.poll(0)]  # readable: end of file
    for key in dead:
        logger.warning("tensor parallel: rank %d's %s connection closed before the group formed; waiting for "
                       "its relaunch", *key)
        joined.pop(key)[0].close()
    return bool(dead)


def _refusal(hello, size: int, joined: dict) -> str | None:
    if not (isinstance(hello, tuple) and len(hello) == 6 and hello[0] == "hello"):
        return f"not a rank's greeting: {hello!r:.200}"
    _, rank, world, host, pid, channel = hello
    if world != size:
        return f"rank {rank} on {host} belongs to a group of {world} ranks; this driver has tensor_parallel_size={size}"
    if not (isinstance(rank, int) and 0 <= rank < size) or channel not in CHANNELS:
        return f"bad rank {rank!r} or channel {channel!r} from {host}"
    if (rank, channel) in joined:
        return f"rank {rank} connected twice (again from {host}, pid {pid}): two launches with the same --rank?"
    passes = joined.get((rank, "passes"))
    if channel == "liveness" and passes is not None and passes[1][3:5] != (host, pid):
        return f"rank {rank}'s liveness channel came from {host} pid {pid}, its passes from {passes[1][3]} pid {passes[1][4]}"
    return None


def _refuse(conn: Connection, reason: str) -> None:
    try:
        conn.send(("refused", reason))
    except OSError:
        pass
    conn.close()


def _accept(listener: socket.socket, key: bytes, greeted: queue.Queue) -> None:
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:  # shut down: every rank is in
            return
        conn = Connection(sock.detach())
        threading.Thread(target=_greet, args=(conn, key, greeted), name="fastdeploy-lp-tp-greet", daemon=True).start()


def _greet(conn: Connection, key: bytes, greeted: queue.Queue) -> None:
    """What `Listener(authkey=key).accept()` does, then the rank's hello, off the accepting thread."""
    try:
        _keep_alive(conn)
        _receive_timeout(conn, GREETING_TIMEOUT_S)  # a peer that stops answering mid-handshake is dropped
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
        hello = conn.recv()
        _receive_timeout(conn, 0)
        greeted.put((conn, hello))
    except Exception as e:  # noqa: BLE001 - a stranger or a rank with another secret: logged, dropped
        logger.warning("tensor parallel: dropped a connection that did not authenticate as a rank (not a rank, "
                       "or one with another FDLP_TP_SECRET): %s", e)
        conn.close()


def connect(driver: str, rank: int, size: int) -> tuple[Connection, Connection]:
    """A launched rank's passes and liveness connections to the driver at `driver` (HOST:PORT),
    retried until the driver listens or FDLP_TP_START_TIMEOUT passes."""
    address, key = parse_address(driver, "--driver"), secret()
    deadline = time.monotonic() + envs.get_float("FDLP_TP_START_TIMEOUT")
    conns = []
    for channel in CHANNELS:
        while True:
            try:
                conn = Client(address, authkey=key)
                break
            except OSError as e:  # not listening yet, the name not resolving yet, its machine still booting
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not reach {driver}: {e}") from None
                time.sleep(RETRY_S)
        _keep_alive(conn)
        conn.send(("hello", rank, size, socket.gethostname(), os.getpid(), channel))
        conns.append(conn)
    return conns[0], conns[1]


def _keep_alive(conn: Connection) -> None:
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the option is the socket's, shared by both fds
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in KEEPALIVE.items():
            if hasattr(socket, name):  # Linux; elsewhere the system's defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _receive_timeout(conn: Connection, seconds: float) -> None:
    """Reads on `conn` fail after `seconds` without data (0: never): SO_RCVTIMEO, since a
    Connection reads its descriptor directly and a Python socket timeout would make it non-blocking."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), 0))


def _shut(conn: Connection) -> None:
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass
