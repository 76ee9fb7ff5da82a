"""`AsyncLLMEngine`: the engine loop on a background thread, its outputs delivered to asyncio.

The HTTP server's event loop never runs a step. One engine thread calls `LLMEngine.step()` while
there is work and sleeps on an event when there is none; after each step it hands that step's
outputs to the event loop in one `loop.call_soon_threadsafe` call, which routes each output to the
`RequestStream` (an `asyncio.Queue`) of its request.

    engine = AsyncLLMEngine(LLMEngine(fd_config))
    engine.start()                                  # inside a running event loop
    stream = await engine.add_request("Hello", SamplingParams(max_tokens=8))
    async for out in stream:                        # one RequestOutput per step, per choice
        print(out.outputs.delta_text, end="")

Cancelling: `stream.abort()` (or leaving the `async for` early and calling it, as the server does
when a client disconnects) aborts the request and its `n` siblings; the engine frees their slots at
its next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Any, Callable

from fastdeploy_lp.engine.engine import LLMEngine
from fastdeploy_lp.engine.protocol import (SHUTDOWN_WAIT_S, EngineNotServingError, KVCacheStats, QueueFullError,
                                           RequestStream)
from fastdeploy_lp.engine.request import Request, RequestOutput
from fastdeploy_lp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# Longer than any step that works: one 2,048-token prefill chunk of a 7B model takes minutes on a
# 2-core CPU, and a watchdog that fires on it would fail every request of a healthy server.
DEFAULT_STALL_TIMEOUT_S = 600.0


class AsyncLLMEngine:
    """Runs `engine.step()` on a daemon thread; `add_request` and streams live on the event loop.
    It is the server's `EngineClient` (`protocol.py`): the only engine object the server holds.

    A watchdog thread checks that the engine makes progress: if requests wait and no step computed
    a token or finished a request for `stall_timeout_s` (a step that hangs, or steps that achieve
    nothing), the engine is *stalled*: `is_serving` is False (the server's /health says 503, with
    the reason), new requests are refused, and the waiting ones end with `EngineNotServingError` and
    are aborted in the engine. Once a step makes progress again the engine serves again.

    `max_waiting_requests` bounds the sequences that wait for a free slot (a request with `n=k`
    counts `k`); a request that would exceed it raises `QueueFullError` (the server's 429).
    `observer`, if given, is called on the event loop as `observer(output, now, stream)` for every
    output before it is routed (the server's metrics); `stream` is None for an abandoned request.
    """

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int | None = None,
                 observer: Callable[[RequestOutput, float, RequestStream | None], None] | None = None,
                 stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S):
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests: must be >= 0, got {max_waiting_requests!r}")
        if stall_timeout_s is not None and not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s: must be > 0 (or None for no watchdog), got {stall_timeout_s!r}")
        self.engine = engine
        self.fd_config, self.tokenizer = engine.fd_config, engine.tokenizer
        self.stall_timeout_s = stall_timeout_s
        self.stalled: str | None = None  # why the engine counts as stuck, while it does
        self.max_waiting_requests = max_waiting_requests
        self.observer = observer
        self._streams: dict[str, RequestStream] = {}  # child id -> stream
        self._admitting = 0          # sequences whose constraint compiles, not yet queued in the engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None  # what stopped the engine thread, if anything
        self.num_requests = 0  # admitted since start

    # -- life cycle -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine already started")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="fastdeploy-lp-engine", daemon=True)
        self._thread.start()
        if self.stall_timeout_s is not None:
            threading.Thread(target=self._watch, name="fastdeploy-lp-engine-watchdog", daemon=True).start()

    def shutdown(self, timeout: float = SHUTDOWN_WAIT_S, reason: str = "the engine has shut down") -> None:
        """Stop the engine thread after its current step; pending streams get `EngineNotServingError`."""
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, EngineNotServingError(reason))

    @property
    def is_serving(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stop.is_set()
                and self.stalled is None)

    # -- state, read from any thread ------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._admitting

    def processor_timings(self) -> dict[str, Any]:
        return self.engine.processor_timings()

    def speculative_stats(self) -> dict[str, Any]:
        return self.engine.speculative_stats()

    def kv_cache_stats(self) -> KVCacheStats:
        pool = self.engine.block_pool
        return KVCacheStats(blocks_in_use=pool.num_used, blocks_total=pool.num_blocks - 1,  # less the null block
                            prefix_queried_tokens=pool.stats.queried_tokens, prefix_hit_tokens=pool.stats.hit_tokens,
                            preemptions=self.engine.scheduler.num_preemptions)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def engine_loads(self) -> list[dict[str, Any]]:
        return [{"engine": 0, "num_running_reqs": self.num_running, "num_waiting_reqs": self.num_waiting,
                 "num_requests_total": self.num_requests, "serving": self.is_serving,
                 "not_serving_reason": self.not_serving_reason()}]

    # -- what requests may use ------------------------------------------------------------------
    @property
    def processors(self) -> list:
        return self.engine.pipeline.processors

    @property
    def serves_guided_decoding(self) -> bool:
        return self.engine.pipeline.serves_guided_decoding

    @property
    def custom_guided_decoding_backends(self) -> dict:
        return dict(self.engine.context.custom_guided_decoding_backends)

    @property
    def weight_bytes(self) -> int:
        return self.engine.runner.weight_bytes

    # -- LoRA adapters: read and checked on a worker thread, never on the step loop -----------------
    def lora_adapters(self) -> dict[str, str]:
        return self.engine.lora_adapters()

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await asyncio.to_thread(self.engine.load_lora_adapter, name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        self.engine.unload_lora_adapter(name)

    # -- requests (event loop) ------------------------------------------------------------------
    async def add_request(self, prompt: str | list[int], params: SamplingParams,
                          request_id: str | None = None) -> RequestStream:
        """Validate and queue a request; returns its stream.

        Raises `ValueError("field: ...")` for a bad request, `QueueFullError`, or
        `EngineNotServingError`. Validation runs here, on the event loop: it takes microseconds
        (tokenizing a prompt that fits the context, checking ids and processor args) and, for
        `tokenizer.json` tokenizers, holds the GIL either way. The one exception is an output
        constraint: compiling it waits for a compile worker, up to the compile time limit, so that
        request alone is validated on a worker thread while the loop serves everyone else.
        """
        if not self.is_serving:
            raise EngineNotServingError(self.not_serving_reason())
        n = params.n
        if self.max_waiting_requests is not None:
            free = self.engine.fd_config.max_num_seqs - self.num_running
            if self.num_waiting + n - free > self.max_waiting_requests:
                raise QueueFullError(f"too many requests waiting for a slot (limit {self.max_waiting_requests}); "
                                     "retry later")
        request_id = request_id or uuid.uuid4().hex
        child_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        if any(c in self._streams for c in child_ids):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        stream = RequestStream(request_id, child_ids, self.abort)
        for c in child_ids:  # registered before the engine can produce anything for them
            self._streams[c] = stream
        try:
            if params.guided_decoding is None:
                requests = self.engine.make_requests(prompt, params, request_id)
            else:
                requests = await self._validate_on_worker(prompt, params, request_id, n)
        except BaseException:  # a cancelled caller included: nothing was queued, so nothing to abort
            self._unregister(child_ids)
            raise
        if [r.request_id for r in requests] != child_ids:  # the engine's id convention is part of this contract
            self._unregister(child_ids)
            raise RuntimeError(f"engine returned ids {[r.request_id for r in requests]}, expected {child_ids}")
        self.engine.enqueue(requests)
        self.num_requests += 1
        self._wakeup.set()
        return stream

    async def _validate_on_worker(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                                  n: int) -> list[Request]:
        self._admitting += n  # counted as waiting while it compiles, so backpressure sees it
        try:
            return await self._loop.run_in_executor(None, self.engine.make_requests, prompt, params, request_id)
        finally:
            self._admitting -= n

    def abort(self, request_id: str) -> None:
        """Cancel a request (all its choices); its slot is freed at the engine's next step."""
        self.engine.abort_request(request_id)
        self._wakeup.set()

    def _unregister(self, child_ids: list[str]) -> None:
        for c in child_ids:
            self._streams.pop(c, None)

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            if not engine.has_unfinished_requests():
                self._wakeup.wait(0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()  # fails the batch, not the engine, on any Exception
            except BaseException as e:  # KeyboardInterrupt and the like: stop serving, say why
                logger.exception("engine step failed; the engine stops serving")
                self.error = e
                self._stop.set()
                self._loop.call_soon_threadsafe(
                    self._fail_all, EngineNotServingError(f"the engine stopped: {type(e).__name__}: {e}"))
                return
            if outputs:
                try:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
                except RuntimeError:  # the event loop is closed: nobody is listening any more
                    return

    def _watch(self) -> None:
        """The watchdog thread: marks the engine stalled, and serving again, as it (stops) making progress."""
        while not self._stop.wait(min(1.0, self.stall_timeout_s / 4)):
            engine = self.engine
            idle = time.monotonic() - engine.last_progress
            busy = engine.has_unfinished_requests()
            if busy and idle > self.stall_timeout_s and self.stalled is None:
                self.stalled = (f"the engine made no progress for {idle:.1f} s while requests waited "
                                f"(stall timeout {self.stall_timeout_s:g} s)")
                logger.error("%s; failing the requests it holds", self.stalled)
                try:
                    self._loop.call_soon_threadsafe(self._fail_stalled, self.stalled)
                except RuntimeError:  # the event loop is closed: nobody is listening any more
                    return
            elif self.stalled is not None and (not busy or idle <= self.stall_timeout_s):
                logger.warning("the engine makes progress again; serving")
                self.stalled = None

    def _fail_stalled(self, reason: str) -> None:
        for request_id in {s.request_id for s in self._streams.values()}:
            self.engine.abort_request(request_id)  # freed whenever the engine thread gets to them
        self._fail_all(EngineNotServingError(reason))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if self.observer is not None:
                try:
                    self.observer(out, now, stream)
                except Exception:
                    logger.exception("output observer failed")
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream._put(out)

    def _fail_all(self, error: BaseException) -> None:
        streams = {id(s): s for s in self._streams.values()}
        self._streams.clear()
        for s in streams.values():
            s._put(error)

    def not_serving_reason(self) -> str | None:
        if self.is_serving:
            return None
        if self.stalled is not None:
            return self.stalled
        if self.error is not None:
            return f"the engine stopped: {type(self.error).__name__}: {self.error}"
        if self._thread is None:
            return "the engine has not started yet"
        return "the engine has shut down"
