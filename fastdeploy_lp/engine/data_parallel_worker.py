"""One data-parallel engine process: `build_engine` + `AsyncLLMEngine` on its own event loop, driven
over a pipe by `DataParallelEngineClient` (`data_parallel.py`) in the server's process.

Messages from the front end: `("add", request_id, prompt, params)`, `("abort", request_id)`,
`("lora", call_id, "load" | "unload", name, path)` (answered `("lora_done", call_id, error or None)`),
`("stop",)`. To it: `("ready", info)` or `("failed", error)` once at start; then per request
`("admitted", id)` or `("refused", id, error)`, its outputs in batches `("outputs", [RequestOutput],
load)` (a request's prompt is sent with its first output only), `("error", id, error)` when its
stream fails (a stall, the engine stopping), and `("stats", snapshot)` every `STATS_INTERVAL_S`.

The process ends when the pipe closes (the front end stopped or died) or its parent goes away, so
no engine outlives the server; it exits with `os._exit`, not waiting for the threads it leaves.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import threading
from multiprocessing.connection import Connection
from typing import Any

from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.engine.async_engine import AsyncLLMEngine
from fastdeploy_lp.engine.protocol import EngineNotServingError, QueueFullError
from fastdeploy_lp.engine.request import CompletionOutput, PrefixView, RequestOutput

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25
# What an error that does not pickle (a pydantic ValidationError, a class with its own __init__
# arguments) travels as: the first of these it is an instance of, with its message.
PORTABLE_ERRORS = (QueueFullError, EngineNotServingError, ValueError, OSError, RuntimeError)


def portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling as itself, else the nearest `PORTABLE_ERRORS` type with its message."""
    try:
        if type(pickle.loads(pickle.dumps(error))) is type(error):
            return error
    except Exception:
        pass
    base = next((t for t in PORTABLE_ERRORS if isinstance(error, t)), RuntimeError)
    return base(str(error) if base is not RuntimeError else f"{type(error).__name__}: {error}")


class OutputEncoder:
    """A `RequestOutput` as what it adds: an output's text, tokens and logprobs are views of
    everything so far (cheap in one process, O(length) to pickle each step), so only the new part
    crosses, and the prompt with a choice's first output only. The final output carries the whole
    text (`OutputDecoder` checks nothing: the engine's text is the truth)."""

    def __init__(self):
        self._logprobs_sent: dict[str, int] = {}  # choice id -> logprobs already sent (prompt sent)

    def encode(self, out: RequestOutput) -> tuple:
        o, rid = out.outputs, out.request_id
        first = rid not in self._logprobs_sent
        sent = self._logprobs_sent.pop(rid, 0)
        new_logprobs = None if o.logprobs is None else list(o.logprobs[sent:])
        if not out.finished:
            self._logprobs_sent[rid] = len(o.logprobs) if o.logprobs is not None else 0
        return (rid, (out.prompt, out.prompt_token_ids) if first else None, out.finished, out.metrics,
                o.index, o.finish_reason, o.error, o.delta_text, o.delta_token_ids, o.stop_reason,
                o.closed_on_length, new_logprobs, o.text if out.finished else None)

    def forget(self, choice_id: str) -> None:
        self._logprobs_sent.pop(choice_id, None)


class OutputDecoder:
    """The front end's side of `OutputEncoder`: per open choice, its prompt and what came so far."""

    def __init__(self):
        self._open: dict[str, tuple] = {}  # choice id -> (prompt, prompt ids, token ids, logprobs, texts)

    def decode(self, wire: tuple) -> RequestOutput:
        (rid, prompt, finished, metrics, index, finish_reason, error, delta_text, delta_ids, stop_reason,
         closed, new_logprobs, final_text) = wire
        if prompt is not None or rid not in self._open:  # (not: one the front end has forgotten)
            self._open[rid] = (*(prompt or (None, [])), [], None if new_logprobs is None else [], [])
        text_prompt, prompt_ids, ids, logprobs, texts = self._open.pop(rid) if finished else self._open[rid]
        ids.extend(delta_ids)
        texts.append(delta_text)
        if logprobs is not None:
            logprobs.extend(new_logprobs)
        text = final_text if final_text is not None else (lambda n=len(texts): "".join(texts[:n]))
        out = CompletionOutput(index=index, text=text, token_ids=PrefixView(ids),
                               finish_reason=finish_reason, error=error,
                               logprobs=None if logprobs is None else PrefixView(logprobs),
                               delta_text=delta_text, delta_token_ids=delta_ids, stop_reason=stop_reason,
                               closed_on_length=closed)
        return RequestOutput(rid, text_prompt, prompt_ids, out, finished, metrics)

    def forget(self, choice_id: str) -> None:
        self._open.pop(choice_id, None)


def run_engine_process(rank: int, args: EngineArgs, conn: Connection, cores: list[int] | None,
                       options: dict[str, Any]) -> None:
    """The process's target (spawned): pin to `cores`, build the engine, serve until told to stop."""
    logging.basicConfig(level=options.get("log_level", "WARNING"),
                        format=f"%(asctime)s %(levelname)s engine-{rank} %(name)s: %(message)s")
    if cores:
        os.sched_setaffinity(0, cores)
    from fastdeploy_lp.engine.llm import build_engine  # here: llm.py imports tqdm and the offline API

    try:
        engine = build_engine(args, data_parallel_rank=rank)
    except BaseException as e:  # noqa: BLE001 -- any failure is the front end's start-up error
        conn.send(("failed", portable(e)))
        os._exit(1)
    client = AsyncLLMEngine(engine, max_waiting_requests=options.get("max_waiting_requests"),
                            stall_timeout_s=options.get("stall_timeout_s"))
    conn.send(("ready", {"pid": os.getpid(), "weight_bytes": engine.runner.weight_bytes, "cores": cores,
                         "threads": engine.fd_config.cpu_threads}))
    try:
        asyncio.run(EngineProcess(client, conn, options["parent_pid"]).serve())
    finally:
        os._exit(0)


class EngineProcess:
    """The event loop side of one engine process: commands in, outputs and stats out."""

    def __init__(self, client: AsyncLLMEngine, conn: Connection, parent_pid: int):
        self.client, self.conn, self.parent_pid = client, conn, parent_pid
        self._send_lock = threading.Lock()
        self._outbox: list[tuple] = []
        self._encoder = OutputEncoder()
        self._admitting: set[str] = set()
        self._aborted_early: set[str] = set()  # aborted while admitting: aborted once queued
        self._streams: dict[str, Any] = {}
        self._stop: asyncio.Event | None = None

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.client.start(loop)
        threading.Thread(target=self._read, args=(loop,), name="dp-commands", daemon=True).start()
        threading.Thread(target=self._report, name="dp-stats", daemon=True).start()
        await self._stop.wait()
        self.client.shutdown(timeout=2.0, reason="the engine process is stopping")

    def send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, EOFError, BrokenPipeError):  # the front end is gone
            os._exit(0)

    # -- commands (a reader thread hands them to the loop) -------------------------------------
    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = ("stop",)
            loop.call_soon_threadsafe(self._handle, message)
            if message[0] == "stop":
                return

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            asyncio.ensure_future(self._serve_request(*message[1:]))
        elif kind == "abort":
            self._abort(message[1])
        elif kind == "lora":
            asyncio.ensure_future(self._lora(*message[1:]))
        elif kind == "stop":
            self._stop.set()

    def _abort(self, request_id: str) -> None:
        if request_id in self._admitting:
            self._aborted_early.add(request_id)
        elif request_id in self._streams:
            self._streams[request_id].abort()

    async def _lora(self, call_id: str, op: str, name: str, path: str | None) -> None:
        """Load or unload an adapter here, as the front end asked every engine to."""
        try:
            if op == "load":
                await self.client.load_lora_adapter(name, path)
            else:
                await self.client.unload_lora_adapter(name)
            error = None
        except Exception as e:  # noqa: BLE001 -- the front end raises it to the caller
            error = portable(e)
        self.send(("lora_done", call_id, error))

    async def _serve_request(self, request_id: str, prompt: str | list[int], params) -> None:
        self._admitting.add(request_id)
        try:
            stream = await self.client.add_request(prompt, params, request_id)
        except BaseException as e:  # noqa: BLE001 -- every refusal goes back as the caller's exception
            self.send(("refused", request_id, portable(e)))
            return
        finally:
            self._admitting.discard(request_id)
        self._streams[request_id] = stream
        self.send(("admitted", request_id))
        if request_id in self._aborted_early:
            self._aborted_early.discard(request_id)
            stream.abort()
        try:
            async for out in stream:
                self._queue(out)
        except EngineNotServingError as e:
            self._flush()  # what came before the error first
            self.send(("error", request_id, portable(e)))
        finally:
            del self._streams[request_id]
            for choice in stream.child_ids:
                self._encoder.forget(choice)

    # -- outputs: one message per step ---------------------------------------------------------
    def _queue(self, out: RequestOutput) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(self._encoder.encode(out))

    def _flush(self) -> None:
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self.send(("outputs", batch, (self.client.num_running, self.client.num_waiting)))

    # -- stats (a thread) ----------------------------------------------------------------------
    def _report(self) -> None:
        while True:
            if os.getppid() != self.parent_pid:  # the server died without closing the pipe
                os._exit(0)
            self.send(("stats", self.snapshot()))
            threading.Event().wait(STATS_INTERVAL_S)

    def snapshot(self) -> dict[str, Any]:
        client = self.client
        return {"running": client.num_running, "waiting": client.num_waiting, "serving": client.is_serving,
                "reason": client.not_serving_reason(), "kv": client.kv_cache_stats(),
                "timings": client.processor_timings(), "speculative": client.speculative_stats()}
