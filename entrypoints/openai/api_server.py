"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

    python -m fastdeploy_lp.entrypoints.openai.api_server --model DIR --port 8000 \\
        --logits-processors LogitBiasLogitsProcessor

Start-up builds the engine before the socket opens, so a bad `--model` or `--logits-processors`
exits non-zero with the reason. The engine then steps on its own thread (`AsyncLLMEngine`); the
handlers (`routers/`: health, models, generation) only parse, submit, and shape the answer.

Here: `build_app` (the app factory: `app.state`, middleware, routers, error handlers),
`settings_from_args` (the `ServerArgs` flags → `ServerSettings`), `GracefulServer` (drain on
SIGTERM) and `run_server` (the `EngineArgs` flags → `build_engine`, the builder `LLM()` uses too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from fastdeploy_lp.executor.tensor_parallel import TensorParallelError
from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.engine.async_engine import AsyncLLMEngine
from fastdeploy_lp.engine.data_parallel import DataParallelEngineClient
from fastdeploy_lp.engine.data_parallel_engines import DataParallelError
from fastdeploy_lp.engine.engine import LLMEngine
from fastdeploy_lp.engine.llm import build_engine
from fastdeploy_lp.engine.protocol import EngineClient
from fastdeploy_lp.entrypoints.openai.args import ServerArgs, make_parser, missing_model_hint
from fastdeploy_lp.entrypoints.openai.connections import (ConnectionLimits, bounded_protocol, fit_to_open_file_limit,
                                                          throttle_accept_errors)
from fastdeploy_lp.entrypoints.openai.exception_handlers import EXCEPTION_HANDLERS
from fastdeploy_lp.entrypoints.openai.limits import RequestLimits
from fastdeploy_lp.entrypoints.openai.metrics import ServerMetrics
from fastdeploy_lp.entrypoints.openai.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware
from fastdeploy_lp.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fastdeploy_lp.entrypoints.openai.protocol_responses import ResponsesRequest
from fastdeploy_lp.entrypoints.openai.request_body import document_request_models
from fastdeploy_lp.entrypoints.openai.responses_store import ResponseStore
from fastdeploy_lp.entrypoints.openai.routers import ROUTERS
from fastdeploy_lp.entrypoints.openai.serving_chat import OpenAIServingChat
from fastdeploy_lp.entrypoints.openai.serving_completion import OpenAIServingCompletion
from fastdeploy_lp.entrypoints.openai.serving_responses import OpenAIServingResponses
from fastdeploy_lp.options import from_namespace

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """What the HTTP side needs, derived from `ServerArgs` (which documents each field and holds the
    defaults) by `settings_from_args`; the engine's options go to `build_engine`."""

    served_model_names: list[str]
    model_path: str
    api_key: str | None
    strict_fields: bool
    max_waiting_requests: int | None
    model_aliases: set[str]
    max_request_body_bytes: int
    shutdown_timeout_s: float
    engine_stall_timeout_s: float | None  # no progress this long while requests wait: /health 503; None: off
    limits: RequestLimits
    responses_store_size: int  # responses kept for GET and previous_response_id
    responses_store_bytes: int  # and the memory they may hold


def build_app(engine: LLMEngine | EngineClient, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine` (an `LLMEngine`, run by an `AsyncLLMEngine`, or a client
    already built: `DataParallelEngineClient`); the engine thread runs for the app's lifespan.

    `app.state` holds what the routers (`routers/`) read: `settings`, `request_limits` (the
    flags' limits and the engine's context length), `async_engine`, `metrics`, the `chat` and
    `completion` serving objects, `started` (the models' creation time) and `draining` (set by
    `GracefulServer` on the first shutdown signal).
    """
    app = FastAPI(title="fastdeploy_lp OpenAI-compatible API", version="0.1.0", lifespan=_lifespan,
                  exception_handlers=EXCEPTION_HANDLERS)
    state = app.state
    state.settings, state.draining, state.started = settings, False, int(time.time())
    state.request_limits = dataclasses.replace(settings.limits, max_model_len=engine.fd_config.max_model_len)
    state.async_engine = engine if not isinstance(engine, LLMEngine) else AsyncLLMEngine(
        engine, max_waiting_requests=settings.max_waiting_requests, stall_timeout_s=settings.engine_stall_timeout_s)
    state.metrics = ServerMetrics(state.async_engine, settings.served_model_names[0])
    state.async_engine.observer = state.metrics.observe
    # "unknown": what sglang-router writes into a request that names no model (one model is served)
    aliases = settings.model_aliases | {"default", "unknown", settings.model_path}
    state.chat = OpenAIServingChat(state.async_engine, settings.served_model_names, aliases)
    state.completion = OpenAIServingCompletion(state.async_engine, settings.served_model_names, aliases)
    store = ResponseStore(settings.responses_store_size, settings.responses_store_bytes)
    state.responses = OpenAIServingResponses(state.chat, store)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    for router in ROUTERS:
        app.include_router(router)
    document_request_models(app, (ChatCompletionRequest, CompletionRequest, ResponsesRequest))
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    """The engine thread runs while the app does."""
    async_engine, settings = app.state.async_engine, app.state.settings
    async_engine.start()
    throttle_accept_errors(asyncio.get_running_loop())
    logger.info("serving %s (%s)%s with logits processors: %s", settings.served_model_names[0], settings.model_path,
                ", deterministic (batch-invariant)" if async_engine.fd_config.deterministic else "",
                ", ".join(type(p).__name__ for p in async_engine.processors) or "none")
    template = async_engine.tokenizer.chat_template
    if template.source and not template.renders_tools:
        logger.info("the chat template does not render tools: a request's tools go into its system prompt, with "
                    "the <function=NAME>{JSON}</function> call syntax (docs/guided_decoding.md)")
    try:
        yield
    finally:
        async_engine.shutdown()


def settings_from_args(args: ServerArgs, engine_args: EngineArgs) -> ServerSettings:
    """The HTTP side's settings: `args` resolved (names, the API key's environment variable, limits;
    the request limits the engine checks too are `engine_args`')."""
    model_path = engine_args.model_path
    names = args.served_model_name or [os.path.basename(os.path.normpath(model_path))]
    return ServerSettings(served_model_names=names, model_path=model_path, api_key=args.resolve_api_key(),
                          strict_fields=args.strict_fields, max_waiting_requests=args.max_waiting_requests,
                          model_aliases={model_path}, max_request_body_bytes=args.max_request_body_bytes,
                          shutdown_timeout_s=args.shutdown_timeout,
                          engine_stall_timeout_s=args.engine_stall_timeout or None, limits=args.request_limits(engine_args),
                          responses_store_size=args.responses_store_size,
                          responses_store_bytes=args.responses_store_bytes)


class GracefulServer(uvicorn.Server):
    """uvicorn, with a drain before it stops.

    The first SIGTERM/SIGINT marks the app as draining (new requests and /health get 503), waits up
    to `shutdown_timeout_s` for the running requests, then shuts the engine down: what is still
    running ends with an error (an error event and [DONE] on streams, a JSON 503 otherwise). Only
    then does uvicorn close the connections, and the process exits 0. A second signal skips the
    wait, not the answers: the running requests end with their error at once. A third one stops
    without answering them (uvicorn's force exit).
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.app = app
        self._drain: asyncio.Task | None = None
        self._signalled = False
        self._hurry = False  # a second signal: end the running requests now
        self.fatal: str | None = None  # why the server stopped by itself (the exit status is then 1)

    def stop_fatally(self, message: str) -> None:
        """The engine can no longer run the model (a tensor-parallel worker died): refuse new
        requests, end the running ones with an error, and exit with status 1. Any thread."""
        if self.fatal is None:
            self.fatal = message
            logger.critical("the server stops: %s", message)
        self._signalled = True  # no drain: nothing running can finish
        self.app.state.draining = True
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        if self._hurry:  # asked three times: stop without answering
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        if self._signalled:
            self._hurry = True
            logger.info("shutting down now: ending the running requests")
            return
        self._signalled = True
        self.app.state.draining = True
        logger.info("shutting down: draining running requests (up to %gs)", self.app.state.settings.shutdown_timeout_s)

    async def on_tick(self, counter: int) -> bool:
        if self._signalled and self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_engine())
        if self._drain is not None and self._drain.done():
            self.should_exit = True
        return await super().on_tick(counter)

    async def _drain_engine(self) -> None:
        engine: EngineClient = self.app.state.async_engine
        deadline = time.monotonic() + self.app.state.settings.shutdown_timeout_s
        while engine.has_unfinished_requests() and time.monotonic() < deadline and not self._hurry:
            await asyncio.sleep(0.05)
        if engine.has_unfinished_requests():
            logger.warning("shutdown timeout: ending %d running and %d waiting requests",
                           engine.num_running, engine.num_waiting)
        await asyncio.to_thread(engine.shutdown, reason="the server is shutting down")
        await asyncio.sleep(0.1)  # let the handlers write those last answers


# uvicorn's own graceful wait, which starts after GracefulServer's drain (--shutdown-timeout) has
# ended every request: only the last answers are still being written, so it is short and no flag.
CLOSE_CONNECTIONS_S = 5


def uvicorn_config(app: FastAPI, args: ServerArgs) -> uvicorn.Config:
    """uvicorn with bounded connections: the cap, the request-read and keep-alive timeouts."""
    max_connections, backlog = fit_to_open_file_limit(args.limit_concurrency)
    limits = ConnectionLimits(max_connections=max_connections, read_timeout_s=args.request_read_timeout)
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, backlog=backlog,
                          http=bounded_protocol(limits), timeout_keep_alive=args.keep_alive_timeout,
                          timeout_graceful_shutdown=CLOSE_CONNECTIONS_S)


def run_server(namespace: argparse.Namespace) -> int:
    """Build the engine, then serve until interrupted. Returns the process exit status."""
    engine_args, args = from_namespace(EngineArgs, namespace), from_namespace(ServerArgs, namespace)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.metrics_port is not None and args.metrics_port == args.port:
        print("fastdeploy-lp: cannot start: --metrics-port must differ from --port", file=sys.stderr)
        return 2
    try:
        settings = settings_from_args(args, engine_args)
        engine = build_engine(engine_args) if engine_args.data_parallel_size == 1 else DataParallelEngineClient(
            engine_args, max_waiting_requests=settings.max_waiting_requests,
            stall_timeout_s=settings.engine_stall_timeout_s, log_level=args.log_level)
    except (ValueError, OSError, ImportError, TensorParallelError, DataParallelError) as e:  # bad processor name,
        # missing model, bad flag value, a tensor-parallel worker or data-parallel engine that died while starting
        print(f"fastdeploy-lp: cannot start: {e}{missing_model_hint(engine_args.model)}", file=sys.stderr)
        return 2
    app = build_app(engine, settings)
    runner = engine.runner if isinstance(engine, LLMEngine) else engine  # on_failure, close
    metrics_server = None
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        try:
            metrics_server = start_http_server(args.metrics_port, addr=args.host, registry=app.state.metrics.registry)
        except OSError as e:
            print(f"fastdeploy-lp: cannot start: --metrics-port {args.metrics_port}: {e}", file=sys.stderr)
            runner.close()
            return 2
    server = GracefulServer(uvicorn_config(app, args), app)
    runner.on_failure(server.stop_fatally)
    try:
        server.run()
    finally:
        if isinstance(metrics_server, tuple):
            metrics_server[0].shutdown()
        runner.close()  # the tensor-parallel workers or data-parallel engines, if any
    return 0 if server.started and server.fatal is None else 1


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(prog="python -m fastdeploy_lp.entrypoints.openai.api_server")
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
