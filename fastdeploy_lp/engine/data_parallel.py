"""`DataParallelEngineClient`: N engine processes behind one server, each request to the least loaded.

The server holds one `EngineClient` (`protocol.py`); this one implements it over N child processes
(multiprocessing, spawn), each running `build_engine` + `AsyncLLMEngine` (`data_parallel_worker.py`)
with the whole model. The front end (the server's process) keeps what the server reads without a
model: the `FDConfig`, tokenizer and logits-processor objects (built from the config and tokenizer
alone, no weights), and it routes:

    add_request ──► the live engine with the fewest unfinished sequences (counted here: + n when
                    routed, - 1 per finished output), its `n` choices together
                ──► pipe ──► engine process: AsyncLLMEngine.add_request ──► "admitted" | "refused"
                    (the refusal is raised to the caller as the same exception: 400s, 429, 503)
    outputs     ◄── pipe, one batch per step ◄── a reader thread per engine ──► the event loop
                    (`call_soon_threadsafe`) ──► observer, then the request's `RequestStream`

An engine process that dies fails only its own requests (`EngineNotServingError`, naming it); the
others keep serving, and the server stops serving when none is left. Counters sum the engines'
latest reports (sent every `STATS_INTERVAL_S`). On CPU each engine gets its own cores
(`engine_placements`). vLLM's `DPLBAsyncMPClient` balances the same way, from counts its
coordinator collects; here the front end counts itself, as every request passes through it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for
from typing import Any, Callable

from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.engine.data_parallel_worker import OutputDecoder, run_engine_process
from fastdeploy_lp.engine.engine import leading_processors
from fastdeploy_lp.engine.llm import build_context
from fastdeploy_lp.engine.protocol import SHUTDOWN_WAIT_S, EngineNotServingError, KVCacheStats, RequestStream
from fastdeploy_lp.engine.request import RequestOutput
from fastdeploy_lp.engine.speculation import SpeculativeStats
from fastdeploy_lp.processors.pipeline import LogitsProcessorPipeline
from fastdeploy_lp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a large checkpoint from a slow disk


class DataParallelError(RuntimeError):
    """An engine process died or hung while starting."""


@dataclass(frozen=True)
class Placement:
    """One engine's arguments (its device and thread count set) and the cores it is pinned to."""

    args: EngineArgs
    cores: list[int] | None


def engine_placements(args: EngineArgs, device: str, cores: list[int]) -> list[Placement]:
    """Where each of `args.data_parallel_size` engines runs; a `ValueError` for what cannot work.

    CPU: `cpu_threads` per engine (default: the `cores` split evenly, the rest left to the front
    end), each engine pinned to its own cores when they fit. GPU: engine i on the i-th GPU from
    `device` on."""
    n = args.data_parallel_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"data_parallel_size: must be a positive integer, got {n!r}")
    if args.tensor_parallel_size > 1:
        raise ValueError(f"data_parallel_size: {n} engines cannot each split the model "
                         f"(tensor_parallel_size={args.tensor_parallel_size}); use one of the two")
    if args.custom_guided_decoding_backends:
        raise ValueError("data_parallel_size: custom guided-decoding backends hand the engine per-request objects "
                         "that do not cross to an engine process; serve them with data_parallel_size=1")
    def one(**changes: Any) -> EngineArgs:
        return dataclasses.replace(args, data_parallel_size=1, **changes)

    if not device.startswith("cpu"):
        return [Placement(one(device=gpu), None) for gpu in _gpus(device, n)]
    threads = args.cpu_threads or len(cores) // n
    if threads == 0:
        raise ValueError(f"data_parallel_size: {n} engines on {len(cores)} CPU core(s) leave no core per engine; "
                         f"use at most {len(cores)} (or set cpu_threads to share cores)")
    if threads * n > len(cores):
        logger.warning("data_parallel_size=%d x cpu_threads=%d on %d core(s): the engines share cores (not pinned)",
                       n, threads, len(cores))
        return [Placement(one(device=device, cpu_threads=threads), None) for _ in range(n)]
    return [Placement(one(device=device, cpu_threads=threads), cores[i * threads:(i + 1) * threads])
            for i in range(n)]


def _gpus(device: str, n: int) -> list[str]:
    import paddle

    first = int(device.split(":")[1]) if ":" in device else 0
    count = paddle.device.cuda.device_count()
    if first + n > count:
        raise ValueError(f"data_parallel_size: {n} engines from {device!r} need GPUs {first}..{first + n - 1}, "
                         f"but {count} GPU(s) are visible (CUDA_VISIBLE_DEVICES)")
    return [f"gpu:{first + i}" for i in range(n)]


@dataclass(eq=False)
class EngineHandle:
    """One engine process as the front end sees it."""

    rank: int
    process: Any
    conn: Any
    cores: list[int] | None
    info: dict = field(default_factory=dict)       # its "ready" message: pid, weight_bytes, threads
    load: int = 0                                   # unfinished sequences routed to it
    requests: int = 0                               # requests routed to it since start
    stats: dict | None = None                       # its latest report
    counts: tuple[int, int] = (0, 0)                # (running, waiting) as it last said
    dead: str | None = None                         # why it stopped for good
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)

    @property
    def serving(self) -> bool:
        return self.dead is None and (self.stats is None or self.stats["serving"])

    def reason(self) -> str | None:
        if self.dead is not None:
            return self.dead
        return None if self.serving else self.stats["reason"]


def spawn_engines(placements: list[Placement], options: dict[str, Any]) -> list[EngineHandle]:
    """Start one engine process per placement (spawned: a fresh interpreter, no inherited threads)."""
    context = multiprocessing.get_context("spawn")
    engines = []
    for rank, placement in enumerate(placements):
        ours, theirs = context.Pipe()
        process = context.Process(target=run_engine_process, name=f"fastdeploy-lp-engine-{rank}", daemon=True,
                                  args=(rank, placement.args, theirs, placement.cores, options))
        process.start()
        theirs.close()
        engines.append(EngineHandle(rank, process, ours, placement.cores))
    return engines


def wait_until_ready(engines: list[EngineHandle], timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait until each engine has built its engine; if one fails, its error is raised (a `ValueError`
    or `OSError` as `build_engine` raised it; the caller stops the others)."""
    deadline = time.monotonic() + timeout_s
    for engine in engines:
        engine.info = _wait_ready(engine, deadline)


def _wait_ready(engine: EngineHandle, deadline: float) -> dict:
    ready = wait_for([engine.conn, engine.process.sentinel], max(0.0, deadline - time.monotonic()))
    if engine.conn in ready:
        try:
            kind, payload = engine.conn.recv()
        except (EOFError, OSError):
            kind, payload = "died", None
        if kind == "ready":
            return payload
        if kind == "failed":
            raise payload
    if not ready:
        raise DataParallelError(f"data-parallel engine {engine.rank} did not start within {START_TIMEOUT_S:g} s")
    engine.process.join(5)
    raise DataParallelError(f"data-parallel engine {engine.rank} died while starting: {_exit_status(engine.process)}")


def _exit_status(process) -> str:
    code = process.exitcode
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


def stop_engines(engines: list[EngineHandle], timeout: float) -> None:
    """Ask every engine process to stop, then terminate (and kill) what is left after `timeout`."""
    for engine in engines:
        try:
            engine.send(("stop",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + timeout
    for engine in engines:
        engine.process.join(max(0.0, deadline - time.monotonic()))
        if engine.process.is_alive():
            engine.process.terminate()
            engine.process.join(2)
        if engine.process.is_alive():
            engine.process.kill()
            engine.process.join(2)
        engine.conn.close()


@dataclass(eq=False)
class _Routed:
    """A request routed to an engine: its stream (None once the caller gave up) and open choices."""

    request_id: str
    engine: EngineHandle
    stream: RequestStream | None
    open: set[str]
    admitted: asyncio.Future | None = None


class DataParallelEngineClient:
    """The server's `EngineClient` over `args.data_parallel_size` engine processes (module docstring).

    Built before the server starts: checks the arguments (`build_context`, `engine_placements`),
    starts the engines and waits until every one has loaded the model; a failure stops them and is
    raised. `max_waiting_requests` and `stall_timeout_s` apply to each engine as to one
    `AsyncLLMEngine`. `on_failure(callback)` is called (from a reader thread) when the last engine
    has died."""

    def __init__(self, args: EngineArgs, *, max_waiting_requests: int | None = None,
                 stall_timeout_s: float | None = None, log_level: str | None = None):
        context = build_context(args)
        self.fd_config, self.tokenizer = context.config, context.tokenizer
        placements = engine_placements(args, self.fd_config.device, sorted(os.sched_getaffinity(0)))
        options = {"max_waiting_requests": max_waiting_requests, "stall_timeout_s": stall_timeout_s,
                   "parent_pid": os.getpid(),
                   "log_level": log_level.upper() if log_level else logging.getLevelName(logging.getLogger().level)}
        self.engines = spawn_engines(placements, options)
        try:  # while the engines load their weights
            self._pipeline = LogitsProcessorPipeline(context, self.fd_config.logits_processors,
                                                     leading=leading_processors(context))
            wait_until_ready(self.engines)
        except BaseException:
            stop_engines(self.engines, timeout=2.0)
            raise
        self.observer: Callable[[RequestOutput, float, RequestStream | None], None] | None = None
        self._requests: dict[str, _Routed] = {}   # request id -> its routing, until every choice ends
        self._choices: dict[str, _Routed] = {}    # choice id -> the same
        self._decoder = OutputDecoder()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: str | None = None
        self._failure_callbacks: list[Callable[[str], None]] = []
        logger.info("data parallelism: %s", "; ".join(
            f"engine {e.rank} pid {e.info['pid']} cores {e.cores or 'any'}" for e in self.engines))

    # -- life cycle -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._loop is not None:
            raise RuntimeError("DataParallelEngineClient already started")
        self._loop = loop or asyncio.get_running_loop()
        for engine in self.engines:
            threading.Thread(target=self._read, args=(engine,), name=f"dp-engine-{engine.rank}", daemon=True).start()

    def shutdown(self, timeout: float = SHUTDOWN_WAIT_S, reason: str = "the engine has shut down") -> None:
        """Stop every engine process (none outlives this); pending streams get `EngineNotServingError`."""
        if self._stopped is None:
            self._stopped = reason
            stop_engines(self.engines, timeout)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, EngineNotServingError(reason))

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self._failure_callbacks.append(callback)

    def close(self) -> None:
        """`shutdown`, as the server closes a tensor-parallel runner: idempotent, any thread."""
        self.shutdown(reason="the server has stopped")

    @property
    def is_serving(self) -> bool:
        return self._loop is not None and self._stopped is None and any(e.serving for e in self.engines)

    def not_serving_reason(self) -> str | None:
        if self.is_serving:
            return None
        if self._stopped is not None:
            return self._stopped
        if self._loop is None:
            return "the engine has not started yet"
        return "no data-parallel engine serves: " + "; ".join(f"engine {e.rank}: {e.reason()}" for e in self.engines)

    # -- requests (event loop) ------------------------------------------------------------------
    def lora_adapters(self) -> dict[str, str]:
        """The `--lora-modules` every engine process loaded at start-up."""
        lora_config = self.fd_config.lora_config
        return {} if lora_config is None else dict(lora_config.modules)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        raise ValueError("lora_name: adapters load at run time with one engine only; with --data-parallel-size "
                         "give them as --lora-modules")

    async def unload_lora_adapter(self, name: str) -> None:
        raise ValueError("lora_name: adapters unload at run time with one engine only (--data-parallel-size)")

    async def add_request(self, prompt: str | list[int], params: SamplingParams,
                          request_id: str | None = None) -> RequestStream:
        """Route the request to the least loaded engine and wait for it to be admitted there. Raises
        what the engine's `AsyncLLMEngine.add_request` raised (`ValueError("field: ...")`,
        `QueueFullError`, `EngineNotServingError`)."""
        engine = self._pick()
        request_id = request_id or uuid.uuid4().hex
        choices = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        if request_id in self._requests or any(c in self._choices for c in choices):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        stream = RequestStream(request_id, choices, self.abort)
        routed = _Routed(request_id, engine, stream, set(choices), self._loop.create_future())
        self._requests[request_id] = routed
        self._choices.update(dict.fromkeys(choices, routed))
        engine.load += len(choices)
        engine.requests += 1
        try:
            engine.send(("add", request_id, prompt, params))
        except BaseException as e:
            self._end(routed)
            if isinstance(e, (OSError, EOFError)):  # the pipe broke: the engine died
                raise EngineNotServingError(f"data-parallel engine {engine.rank} is gone") from None
            raise
        try:
            await routed.admitted
        except asyncio.CancelledError:  # the caller left: what the engine admitted is aborted there
            routed.stream = None
            self.abort(request_id)
            raise
        return stream

    def _pick(self) -> EngineHandle:
        live = [e for e in self.engines if e.serving] if self.is_serving else []
        if not live:
            raise EngineNotServingError(self.not_serving_reason())
        return min(live, key=lambda e: (e.load, e.requests))  # then the one given the fewest: turns when idle

    def abort(self, request_id: str) -> None:
        """Cancel a request (all its choices) in the engine running it."""
        routed = self._requests.get(request_id)
        if routed is not None and routed.engine.dead is None:
            try:
                routed.engine.send(("abort", request_id))
            except (OSError, ValueError):  # it died (or stopped): its reader fails the request
                pass

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # -- from the engines (reader threads; the loop) --------------------------------------------
    def _read(self, engine: EngineHandle) -> None:
        conn = engine.conn
        while True:
            try:
                if conn not in wait_for([conn, engine.process.sentinel]):
                    break  # the process ended and left nothing unread
                message = conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "stats":
                engine.stats, engine.counts = message[1], (message[1]["running"], message[1]["waiting"])
                continue
            if message[0] == "outputs":
                engine.counts = message[2]
            if not self._post(self._on_message, engine, message):
                return
        engine.process.join(2)
        if self._stopped is None:
            reason = (f"data-parallel engine {engine.rank} (pid {engine.info.get('pid')}) stopped: "
                      f"{_exit_status(engine.process)}")
            self._post(self._engine_died, engine, reason)

    def _post(self, fn: Callable, *args: Any) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            return False

    def _on_message(self, engine: EngineHandle, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            self._dispatch(message[1])
            return
        routed = self._requests.get(message[1])
        if routed is None:
            return
        if kind == "admitted":
            if not routed.admitted.done():
                routed.admitted.set_result(None)
        elif kind in ("refused", "error"):
            self._end(routed, message[2])

    def _dispatch(self, outputs: list[tuple]) -> None:
        now = time.monotonic()
        for wire in outputs:
            out = self._decoder.decode(wire)
            routed = self._choices.get(out.request_id)
            stream = routed.stream if routed is not None else None
            if self.observer is not None:
                try:
                    self.observer(out, now, stream)
                except Exception:
                    logger.exception("output observer failed")
            if routed is None:
                continue
            if out.finished:
                self._close_choice(routed, out.request_id)
            if stream is not None:
                stream._put(out)

    def _close_choice(self, routed: _Routed, choice: str) -> None:
        routed.open.discard(choice)
        self._decoder.forget(choice)
        self._choices.pop(choice, None)
        routed.engine.load -= 1
        if not routed.open:
            self._requests.pop(routed.request_id, None)

    def _end(self, routed: _Routed, error: BaseException | None = None) -> None:
        """Forget a request's open choices; `error` goes to its caller (admission) or its stream."""
        for choice in list(routed.open):
            self._close_choice(routed, choice)
        self._requests.pop(routed.request_id, None)
        if error is None:
            return
        if routed.admitted is not None and not routed.admitted.done():
            routed.admitted.set_exception(error)
        elif routed.stream is not None:
            routed.stream._put(error)

    def _engine_died(self, engine: EngineHandle, reason: str) -> None:
        engine.dead = reason
        engine.load = 0
        logger.error("%s; failing its requests, the other engines serve on", reason)
        for routed in [r for r in self._requests.values() if r.engine is engine]:
            self._end(routed, EngineNotServingError(reason))
        if all(e.dead is not None for e in self.engines):
            for callback in self._failure_callbacks:
                callback("every data-parallel engine has stopped: " + "; ".join(e.dead for e in self.engines))

    def _fail_all(self, error: BaseException) -> None:
        for routed in list(self._requests.values()):
            self._end(routed, error)

    # -- what requests may use ------------------------------------------------------------------
    @property
    def processors(self) -> list:
        return self._pipeline.processors

    @property
    def serves_guided_decoding(self) -> bool:
        return self._pipeline.serves_guided_decoding

    @property
    def custom_guided_decoding_backends(self) -> dict:
        return {}  # refused with data parallelism (engine_placements)

    @property
    def weight_bytes(self) -> int:
        return sum(e.info["weight_bytes"] for e in self.engines if e.dead is None)

    # -- counters, read from any thread: the engines' latest reports, bounded by the front end's count
    @property
    def num_running(self) -> int:
        return sum(min(e.counts[0], e.load) for e in self.engines if e.dead is None)

    @property
    def num_waiting(self) -> int:
        return sum(e.load for e in self.engines if e.dead is None) - self.num_running

    def engine_loads(self) -> list[dict[str, Any]]:
        return [{"engine": e.rank, "pid": e.info.get("pid"), "cores": e.cores,
                 "num_running_reqs": min(e.counts[0], e.load) if e.dead is None else 0,
                 "num_waiting_reqs": e.load - min(e.counts[0], e.load) if e.dead is None else 0,
                 "num_requests_total": e.requests, "serving": e.serving, "not_serving_reason": e.reason()}
                for e in self.engines]

    def kv_cache_stats(self) -> KVCacheStats:
        stats = [(e.stats["kv"], e.dead is None) for e in self.engines if e.stats is not None]
        return KVCacheStats(blocks_in_use=sum(s.blocks_in_use for s, live in stats if live),
                            blocks_total=sum(s.blocks_total for s, live in stats if live),
                            prefix_queried_tokens=sum(s.prefix_queried_tokens for s, _ in stats),
                            prefix_hit_tokens=sum(s.prefix_hit_tokens for s, _ in stats),
                            preemptions=sum(s.preemptions for s, _ in stats))

    def processor_timings(self) -> dict[str, Any]:
        total: dict[str, dict[str, Any]] = {}
        for e in self.engines:
            for name, timing in (e.stats or {}).get("timings", {}).items():
                into = total.setdefault(name, {})
                for key, value in timing.items():
                    into[key] = into.get(key, 0) + value if isinstance(value, (int, float)) else value
        return total

    def speculative_stats(self) -> dict[str, Any]:
        reports = [e.stats["speculative"] for e in self.engines if e.stats is not None]
        if not reports:
            spec = self.fd_config.speculative_config
            return SpeculativeStats(spec.method if spec is not None else None).as_dict()
        total = SpeculativeStats(reports[0]["method"], **{
            f.name: sum(r[f.name] for r in reports) for f in dataclasses.fields(SpeculativeStats) if f.name != "method"})
        return total.as_dict()
