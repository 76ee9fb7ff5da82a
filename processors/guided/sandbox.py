"""Compile workers: untrusted constraints are compiled first in a separate process.

llguidance is native code. A grammar of a few thousand chained rules (`r0: "a" r1`, ...) makes it
recurse past the end of its thread's stack while it builds the matcher, and that is a segfault: no
exception reaches Python, the process dies. A GBNF grammar with thousands of rules spends tens of
seconds in the GBNF → Lark converter (pure Python, holding the GIL), and a compile that runs too
long cannot be stopped inside a process. So every constraint the cache has not seen is compiled
first by one of a few persistent worker processes:

* the worker converts the request's constraint (schema preparation, GBNF → Lark), builds the
  matcher on a thread with `WORKER_STACK_BYTES` of stack and takes its first steps the way the
  engine does (masks filled on an `LLExecutor`'s threads), then replies with the final grammar
  text (so the server never runs the converter) or the error;
* a worker that dies (a crash) gives that constraint an error, and is replaced;
* a worker still busy at the compile deadline is killed (its CPU stops at once) and replaced.

`CompileSandbox.run` is the whole protocol seen from the server. Workers are started with
`subprocess` (fork + exec of `sys.executable`: no forking of the threaded server) from a short
bootstrap that imports this folder's modules under their own names inside empty stand-ins for the
packages above it (whose `__init__`s import Paddle and the engine), so a worker imports llguidance
and numpy only (not Paddle, not the engine) and starts in a fraction of a second. Requests go to
the worker pickled (the server is trusted); replies come back as JSON (a worker that parsed hostile
input is not trusted to send pickles). Workers run at a lower CPU priority, ignore Ctrl-C (the
server decides when they stop), and exit when their stdin closes or their parent process goes
away; the server kills them when the pool is garbage-collected and at exit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref

import llguidance as llg

from fastdeploy_lp.processors.guided.constraint import (FIELDS, GuidedDecodingError, PlainConstraint, build_constraint,
                                                        grammar_source)
from fastdeploy_lp.processors.guided.tokenizer import lltokenizer_from_spec

logger = logging.getLogger(__name__)

WORKER_STACK_BYTES = 8 << 20  # the usual default thread stack on Linux; the server builds with more
WORKER_NICENESS = 10  # compile workers yield the CPU to the engine
START_TIMEOUT_S = 60.0  # a worker that is not ready by then is killed (import + vocabulary)
RESPAWN_BACKOFF_S = 1.0  # after a worker failed to start, wait this long before trying again
MAX_REPLY_BYTES = 256 << 20

_FRAME = struct.Struct(">I")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# `fastdeploy_lp`, `fastdeploy_lp.processors`, `fastdeploy_lp.processors.guided`: in a worker, empty
# modules, the last one finding its modules in this folder (the only one a worker reads).
_PACKAGES = [__package__.rsplit(".", i)[0] for i in range(__package__.count("."), -1, -1)]
_BOOTSTRAP = (
    "import importlib, sys, types\n"
    f"for name in {_PACKAGES!r}:\n"
    "    sys.modules[name] = types.ModuleType(name); sys.modules[name].__path__ = []\n"
    f"sys.modules[{__package__!r}].__path__ = [sys.argv[1]]\n"
    f"importlib.import_module({__name__!r}).worker_main()\n"
)


class SandboxTimeout(Exception):
    """No worker was free (`queued`), or the worker did not finish, before the deadline (it was killed)."""

    def __init__(self, queued: bool = False):
        super().__init__("no compile worker was free" if queued else "the compile worker ran out of time")
        self.queued = queued


class SandboxCrashed(Exception):
    """The worker died while compiling (the message says how: the signal or the exit status).

    `deterministic`: it was a native fault (SIGSEGV, SIGBUS, SIGILL, SIGABRT, SIGFPE), which the
    same constraint will cause again; anything else (SIGKILL from the OOM killer or an operator,
    an exit) may not be the constraint's doing."""

    def __init__(self, how: str, deterministic: bool):
        super().__init__(how)
        self.deterministic = deterministic


_NATIVE_FAULTS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT, signal.SIGFPE}


class SandboxUnavailable(RuntimeError):
    """Compile workers cannot be started (the server's problem, not the request's)."""


class _WorkerDied(Exception):
    pass


class _Worker:
    """One worker process and its two pipes."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.pid = proc.pid

    def send(self, payload: bytes) -> None:
        data = _FRAME.pack(len(payload)) + payload
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.proc.stdin.fileno(), view):]
        except OSError as e:  # BrokenPipeError: it died
            raise _WorkerDied(str(e)) from None

    def receive(self, deadline: float) -> dict:
        """The worker's next reply; SandboxTimeout at the deadline, _WorkerDied on end of file."""
        size = _FRAME.unpack(self._read(_FRAME.size, deadline))[0]
        if size > MAX_REPLY_BYTES:
            raise _WorkerDied(f"reply of {size} bytes")
        try:
            reply = json.loads(self._read(size, deadline))
        except ValueError:
            raise _WorkerDied("unreadable reply") from None
        if not isinstance(reply, dict):
            raise _WorkerDied("unreadable reply")
        return reply

    def _read(self, n: int, deadline: float) -> bytes:
        fd, chunks, got = self.proc.stdout.fileno(), [], 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise SandboxTimeout()
            chunk = os.read(fd, n - got)
            if not chunk:
                raise _WorkerDied("end of output")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def how_it_ended(self) -> SandboxCrashed:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # closed its output but lingers: make sure it is gone
            self.kill()
            return SandboxCrashed("the compile worker stopped answering", False)
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return SandboxCrashed(f"the compile worker was killed by {name}", -code in _NATIVE_FAULTS)
        return SandboxCrashed(f"the compile worker exited with status {code}", False)

    def close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    def kill(self) -> None:
        """SIGKILL and reap (no zombie is left)."""
        try:
            self.proc.kill()
        except OSError:
            pass
        self.close_pipes()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignored
            logger.error("compile worker %d did not exit after SIGKILL", self.pid)


class CompileSandbox:
    """A pool of compile workers for one vocabulary. `run(request, deadline)` compiles in a worker.

    Waiting for a free worker counts against the request's deadline (the compile limit covers the
    whole compile, queueing included); a request that finds none free in time gets SandboxTimeout.
    Workers start in the background when the pool is made, and again whenever one is lost."""

    _shared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, tokenizer_spec: dict, workers: int) -> "CompileSandbox":
        """The pool for this vocabulary (and size): engines and processors with the same tokenizer
        share it, so a process has one small pool per model, however many engines it makes."""
        key = (_digest(tokenizer_spec), workers)
        with cls._shared_lock:
            pool = cls._shared.get(key)
            if pool is None or pool.closed:
                pool = cls._shared[key] = cls(tokenizer_spec, workers)
            return pool

    def __init__(self, tokenizer_spec: dict, workers: int = 2):
        if workers < 1:
            raise ValueError("a compile sandbox needs at least one worker")
        self.size = workers
        self._init = pickle.dumps({"tokenizer": tokenizer_spec, "stack_bytes": WORKER_STACK_BYTES},
                                  protocol=pickle.HIGHEST_PROTOCOL)
        self._cond = threading.Condition()
        self._live: set[_Worker] = set()
        self._idle: list[_Worker] = []
        self._starting = 0
        self._start_error: str | None = None
        self._failed_at = float("-inf")
        self.closed = False
        self.crashed = self.killed = 0  # counters, for /metrics-style inspection and tests
        self._finalizer = weakref.finalize(self, _stop_all, self._live)
        _POOLS.add(self)
        with self._cond:
            self._ensure_workers()

    # -- the server's side ----------------------------------------------------------------------
    def run(self, request: dict, deadline: float) -> dict:
        """Compile `request` in a worker: its reply (`{"grammar", "build_s"}` or
        `{"field", "error"}`). Raises SandboxTimeout, SandboxCrashed or SandboxUnavailable."""
        payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        while True:
            worker = self._acquire(deadline)
            try:
                worker.send(payload)
            except _WorkerDied:  # it had died while idle (not this request's doing): try another
                logger.warning("guided decoding: %s while idle", worker.how_it_ended())
                self._retire(worker, killed=False)
                continue
            except BaseException:
                self._retire(worker, killed=True)
                raise
            break
        try:
            reply = worker.receive(deadline)
        except SandboxTimeout:
            self._retire(worker, killed=True)
            raise
        except _WorkerDied:
            crash = worker.how_it_ended()
            self._retire(worker, killed=False)
            raise crash from None
        except BaseException:
            self._retire(worker, killed=True)  # its state is unknown
            raise
        with self._cond:
            self._idle.append(worker)
            self._cond.notify()
        return reply

    def worker_pids(self) -> list[int]:
        with self._cond:
            return sorted(w.pid for w in self._live)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> bool:
        """Wait until every worker has started (tests and benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._idle) < self.size and not self.closed:
                self._ensure_workers()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1))
        return True

    def close(self) -> None:
        """Kill every worker now (also done when the pool is garbage-collected, and at exit)."""
        with self._cond:
            self.closed = True
            self._idle.clear()
            self._cond.notify_all()
        self._finalizer()

    def _forget_workers(self) -> None:
        """In a child forked from this process: the workers are the parent's; neither use nor kill them."""
        for worker in self._live:
            worker.close_pipes()
        self._live.clear()
        self._idle.clear()
        self._starting = 0
        self._cond = threading.Condition()

    def _acquire(self, deadline: float) -> _Worker:
        with self._cond:
            while not self._idle:
                if self.closed:
                    raise SandboxUnavailable("the compile workers have been shut down")
                self._ensure_workers()
                if self._start_error and not self._live and not self._starting:
                    raise SandboxUnavailable(f"guided decoding compile workers cannot start: {self._start_error}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SandboxTimeout(queued=True)
                self._cond.wait(min(remaining, RESPAWN_BACKOFF_S))
            return self._idle.pop()

    def _retire(self, worker: _Worker, killed: bool) -> None:
        worker.kill()
        with self._cond:
            self._live.discard(worker)
            if killed:
                self.killed += 1
            else:
                self.crashed += 1
            self._ensure_workers()

    def _ensure_workers(self) -> None:
        """Start workers in the background up to the pool size (call with the lock held)."""
        if self.closed or time.monotonic() - self._failed_at < RESPAWN_BACKOFF_S:
            return
        while len(self._live) + self._starting < self.size:
            self._starting += 1
            threading.Thread(target=self._start_worker, name="guided-compile-spawn", daemon=True).start()

    def _start_worker(self) -> None:
        worker, error = None, None
        try:
            proc = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, _PACKAGE_DIR], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, bufsize=0, env=_worker_env(), close_fds=True,
                                    start_new_session=True)
            worker = _Worker(proc)
            with self._cond:  # from now on the pool's finalizer kills it too
                self._starting -= 1
                self._live.add(worker)
            worker.send(self._init)
            reply = worker.receive(time.monotonic() + START_TIMEOUT_S)
            if not reply.get("ready"):
                raise RuntimeError(reply.get("error") or f"unexpected reply {reply!r:.200}")
        except SandboxTimeout:
            error = f"a compile worker was not ready after {START_TIMEOUT_S:g} s"
        except _WorkerDied:
            error = f"{worker.how_it_ended()} while starting"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        with self._cond:
            if worker is None:
                self._starting -= 1
            # The pool's finalizer (process exit) killed the worker as it started: nothing to report.
            stopped = worker is not None and worker not in self._live
            if error is None and not self.closed and not stopped:
                self._idle.append(worker)
                self._start_error = None
            else:
                self._live.discard(worker)
                if error is not None and not self.closed and not stopped:
                    self._start_error, self._failed_at = error, time.monotonic()
                    logger.error("guided decoding: %s", error)
            self._cond.notify_all()
        if worker is not None and (error is not None or self.closed):
            worker.kill()


def _stop_all(live: set) -> None:
    """Kill the pool's workers (a child forked from the server has forgotten its parent's ones)."""
    workers = list(live)
    live.clear()  # first: a worker's start thread woken by the kill then knows it was stopped
    for worker in workers:
        worker.kill()


_POOLS: weakref.WeakSet = weakref.WeakSet()


def _forget_pools_after_fork() -> None:
    for pool in list(_POOLS):
        pool._forget_workers()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_after_fork)


def _digest(spec: dict) -> str:
    data = (list(spec["tokens"]), list(spec["eos_token_ids"]), spec["bos_token_id"], sorted(spec["special_token_ids"]))
    return hashlib.sha256(pickle.dumps(data, protocol=4)).hexdigest()


def _worker_env() -> dict:
    env = dict(os.environ)
    paths = [p for p in sys.path if p and os.path.isdir(p)]  # find llguidance where this process does
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.pop("PYTHONSTARTUP", None)
    return env


# -- the worker's side -----------------------------------------------------------------------------
def worker_main() -> None:
    """Entry point of a compile worker (run by `_BOOTSTRAP`): serve requests until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(WORKER_NICENESS)
    except OSError:
        pass
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    try:  # stray output (prints, native logging) must not corrupt the reply stream
        os.dup2(2, 1)
    except OSError:  # no stderr
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    sys.stdout = sys.stderr
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    init = _read_request(requests)
    if init is None:
        return
    threading.stack_size(init["stack_bytes"])  # the compile thread's stack: what "too deep" means
    server = threading.Thread(target=_serve, args=(requests, replies, init), name="guided-compile")
    server.start()
    server.join()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def _read_request(stream):
    header = stream.read(_FRAME.size)
    if len(header) < _FRAME.size:
        return None
    (size,) = _FRAME.unpack(header)
    data = stream.read(size)
    return pickle.loads(data) if len(data) == size else None


def _write_reply(stream, reply: dict) -> None:
    data = json.dumps(reply).encode("utf-8")
    stream.write(_FRAME.pack(len(data)) + data)
    stream.flush()


def _serve(requests, replies, init: dict) -> None:
    try:
        lltokenizer = lltokenizer_from_spec(init["tokenizer"])
        executor = llg.LLExecutor(1)
        warm_up = {"constraint": {"kind": "json_object", "fields": {"json_object": True}}}
        _compile(warm_up, lltokenizer, executor)  # the first request does not pay for lazy initialisation
    except Exception as e:
        _write_reply(replies, {"ready": False, "error": f"{type(e).__name__}: {e}"})
        return
    _write_reply(replies, {"ready": True})
    while (request := _read_request(requests)) is not None:
        _write_reply(replies, _compile(request, lltokenizer, executor))


def _compile(request: dict, lltokenizer, executor) -> dict:
    gd = PlainConstraint(request["constraint"])
    field = FIELDS.get(gd.kinds()[0], "guided_decoding")
    try:
        limits = llg.LLParserLimits(**request["limits"]) if request.get("limits") else None
        field, grammar = grammar_source(gd)
        converted = time.perf_counter()
        result = build_constraint(lltokenizer, grammar, field, limits, executor)
    except GuidedDecodingError as e:
        return {"field": e.field, "error": str(e)}
    except Exception as e:  # whatever it is, it is this constraint's problem
        return {"field": field, "error": f"{field}: cannot compile: {type(e).__name__}: {e}"}
    if isinstance(result, GuidedDecodingError):
        return {"field": result.field, "error": str(result)}
    del result  # dropped here too: what the server will drop later
    return {"grammar": grammar, "build_s": time.perf_counter() - converted}
