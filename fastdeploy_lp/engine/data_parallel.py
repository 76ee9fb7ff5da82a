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
import os
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for
from typing import Any, Callable

from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.engine.data_parallel_engines import (EngineHandle, engine_placements,
                                                       spawn_engines, stop_engines, wait_until_ready, exit_status)
from fastdeploy_lp.engine.data_parallel_worker import OutputDecoder
from fastdeploy_lp.engine.engine import leading_processors
from fastdeploy_lp.engine.llm import build_context
from fastdeploy_lp.engine.protocol import SHUTDOWN_WAIT_S, EngineNotServingError, KVCacheStats, RequestStream
from fastdeploy_lp.engine.request import RequestOutput
from fastdeploy_lp.engine.speculation import SpeculativeStats
from fastdeploy_lp.processors.pipeline import LogitsProcessorPipeline
from fastdeploy_lp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

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
        self._adapters = {} if self.fd_config.lora_config is None else dict(self.fd_config.lora_config.modules)
        self._lora_calls: dict[str, tuple[EngineHandle, asyncio.Future]] = {}  # call id -> its engine, answer
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
        """The adapters every live engine process serves: `--lora-modules`, then those loaded since."""
        return dict(self._adapters)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load on every live engine; if one refuses, those that loaded it unload it again, and
        its error is raised (`ValueError("lora_name: ...")` and the like)."""
        if self.fd_config.lora_config is None:
            raise ValueError("lora_name: LoRA is off on this engine (--enable-lora)")
        live = [e for e in self.engines if e.dead is None]
        results = await self._on_every_engine(live, "load", name, path)
        failed = [r for r in results if r is not None]
        if failed:
            loaded = [e for e, r in zip(live, results) if r is None]
            await self._on_every_engine(loaded, "unload", name, None)
            raise failed[0]
        self._adapters[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        if self.fd_config.lora_config is None:
            raise ValueError("lora_name: LoRA is off on this engine (--enable-lora)")
        results = await self._on_every_engine([e for e in self.engines if e.dead is None], "unload", name, None)
        self._adapters.pop(name, None)
        if any(r is not None for r in results):
            raise next(r for r in results if r is not None)

    async def _on_every_engine(self, engines: list[EngineHandle], op: str, name: str, path: str | None) -> list:
        """Each engine's answer to a LoRA command (None: done, else its error), in order; an engine
        that dies meanwhile answers with why."""
        calls = []
        for engine in engines:
            call_id = uuid.uuid4().hex
            self._lora_calls[call_id] = (engine, self._loop.create_future())
            calls.append(call_id)
            try:
                engine.send(("lora", call_id, op, name, path))
            except (OSError, ValueError):  # its pipe broke: it died
                self._lora_calls[call_id][1].set_result(EngineNotServingError(f"data-parallel engine {engine.rank} "
                                                                              "is gone"))
        try:
            return await asyncio.gather(*(self._lora_calls[c][1] for c in calls))
        finally:
            for c in calls:
                self._lora_calls.pop(c, None)

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
                      f"{exit_status(engine.process)}")
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
        if kind == "lora_done":
            call = self._lora_calls.get(message[1])
            if call is not None and not call[1].done():
                call[1].set_result(message[2])
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
        for dead_engine, answer in self._lora_calls.values():
            if dead_engine is engine and not answer.done():
                answer.set_result(EngineNotServingError(reason))
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
