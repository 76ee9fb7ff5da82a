"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

    python -m fastdeploy_lp.entrypoints.openai.api_server --model DIR --port 8180 \\
        --logits-processors LogitBiasLogitsProcessor

Start-up builds the engine before the socket opens, so a bad `--model` or `--logits-processors`
exits non-zero with the reason. The engine then steps on its own thread (`AsyncLLMEngine`); the
handlers only parse, submit, and shape the answer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...config import FDConfig
from ...engine.async_engine import AsyncLLMEngine, EngineNotServingError
from ...engine.engine import LLMEngine
from ...processors.builtin.tool_execution import load_tool_functions
from ...processors.custom_backends import load_custom_backends
from ...processors.registry import BUILTIN_PROCESSORS
from .args import check_guided_decoding_backend, make_parser, missing_model_hint, resolve_api_key, trust_custom_code
from .errors import RETRY_LATER, OpenAIError, bad_request, from_error_dicts, from_validation_error
from .metrics import ServerMetrics
from .middleware import ApiKeyMiddleware, BodySizeLimitMiddleware, RequestTooLarge, too_large
from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                       ErrorResponse, ModelCard, ModelList)
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_engine import ClientDisconnected

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-fastdeploy-lp-ignored-fields"
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}
MAX_JSON_DEPTH = 128  # far beyond any real request (a JSON schema nests ~2 levels per level)


@dataclass
class ServerSettings:
    served_model_names: list[str]
    model_path: str
    api_key: str | None = None
    strict_fields: bool = False
    max_waiting_requests: int | None = 1024
    model_aliases: set[str] = field(default_factory=set)
    max_request_body_bytes: int = 8 << 20
    shutdown_timeout_s: float = 30.0


def build_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine`; the engine thread runs for the app's lifespan."""
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=settings.max_waiting_requests)
    metrics = ServerMetrics(async_engine)
    async_engine.observer = metrics.observe
    aliases = settings.model_aliases | {"default", settings.model_path}
    chat = OpenAIServingChat(async_engine, settings.served_model_names, aliases)
    completion = OpenAIServingCompletion(async_engine, settings.served_model_names, aliases)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        logger.info("serving %s (%s) with logits processors: %s", settings.served_model_names[0],
                    settings.model_path, ", ".join(engine.pipeline.names) or "none")
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="fastdeploy_lp OpenAI-compatible API", version="0.1.0", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.draining = False
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)

    def not_serving_reason() -> str | None:
        if app.state.draining:
            return "the server is shutting down"
        return None if async_engine.is_serving else async_engine._not_serving_reason()

    def serving() -> None:
        reason = not_serving_reason()
        if reason is not None:
            raise OpenAIError(503, f"not serving: {reason}", code="not_serving",
                              headers=RETRY_LATER)

    def check_fields(body) -> dict[str, str]:
        unknown = body.unknown_fields()
        if not unknown:
            return {}
        if settings.strict_fields:
            raise bad_request(f"{unknown[0]}: unknown field (the server runs with --strict-fields); "
                              f"unknown fields: {', '.join(unknown)}", param=unknown[0], code="unknown_parameter")
        return {IGNORED_FIELDS_HEADER: ",".join(unknown)}

    # -- routes ---------------------------------------------------------------------------------
    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        """200 while the engine serves, 503 otherwise (starting, shutting down, or stopped by an error)."""
        serving()
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics():
        """Prometheus text format; see `entrypoints/openai/metrics.py` for the metrics."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1")

    started = int(time.time())

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": "fastdeploy_lp",
                "root": settings.model_path, "max_model_len": engine.fd_config.max_model_len}

    @v1.get("/models", response_model=ModelList)
    async def list_models():
        return {"object": "list", "data": [model_card(name) for name in settings.served_model_names]}

    @v1.get("/models/{model:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
    async def retrieve_model(model: str):
        """One served model, as OpenAI's `GET /v1/models/{model}` (ids may contain '/')."""
        if model not in settings.served_model_names:
            raise OpenAIError(404, f"model: {model!r} is not served here; served: "
                                   f"{', '.join(settings.served_model_names)}", param="model", code="model_not_found")
        return model_card(model)

    @v1.get("/logits_processors")
    async def list_logits_processors():
        """The processors every request runs through, in order, with the JSON schema of the
        `logits_processors_args` keys each one reads (None: it does not declare them)."""
        processors = engine.pipeline.processors
        leading = len(processors) - len(engine.fd_config.logits_processors)
        data = []
        for position, p in enumerate(processors):
            cls = type(p)
            model = getattr(cls, "args_model", None)
            data.append({
                "name": cls.__name__, "position": position,
                "class": f"{cls.__module__}:{cls.__qualname__}",
                "source": "engine" if position < leading else "--logits-processors",
                "builtin": cls.__name__ in BUILTIN_PROCESSORS,
                "description": _summary(cls),
                "args_schema": model.model_json_schema() if model is not None else None})
        return {"object": "list", "data": data}

    @v1.post("/chat/completions", dependencies=[Depends(serving)], openapi_extra=_body_doc(ChatCompletionRequest),
             responses={200: {"model": ChatCompletionResponse, "content": {"text/event-stream": {}}}, **_ERRORS})
    async def create_chat_completion(request: Request):
        """OpenAI chat completions; `stream: true` answers with server-sent events."""
        body = await parse_body(request, ChatCompletionRequest)
        return await chat.create(body, request, check_fields(body))

    @v1.post("/completions", dependencies=[Depends(serving)], openapi_extra=_body_doc(CompletionRequest),
             responses={200: {"model": CompletionResponse, "content": {"text/event-stream": {}}}, **_ERRORS})
    async def create_completion(request: Request):
        """OpenAI (legacy) completions; `stream: true` answers with server-sent events."""
        body = await parse_body(request, CompletionRequest)
        return await completion.create(body, request, check_fields(body))

    app.include_router(v1)
    _document_request_models(app, (ChatCompletionRequest, CompletionRequest))

    # -- errors ---------------------------------------------------------------------------------
    @app.exception_handler(OpenAIError)
    async def openai_error(_, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestTooLarge)
    async def request_too_large(_, exc: RequestTooLarge):
        err = too_large(settings.max_request_body_bytes)
        return JSONResponse(err.body(), status_code=413, headers={"connection": "close"})

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):  # query/path parameters
        err = from_error_dicts(list(exc.errors()), drop_prefix="query")
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = (f"no route {request.method} {request.url.path}" if exc.status_code == 404
                   else str(exc.detail))
        err = OpenAIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(EngineNotServingError)
    async def engine_stopped(_, exc: EngineNotServingError):  # the engine stopped while we waited
        err = OpenAIError(503, f"not serving: {exc}", code="not_serving")
        return JSONResponse(err.body(), status_code=503, headers=RETRY_LATER)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_, exc: ClientDisconnected):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        logger.exception("unhandled error")
        err = OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    return app


def _summary(cls) -> str | None:
    """First paragraph of the class's own docstring, else of its module's."""
    doc = cls.__dict__.get("__doc__") or getattr(sys.modules.get(cls.__module__), "__doc__", None)
    return inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ") if doc else None


async def parse_body(request: Request, model: type[BaseModel]):
    """The JSON body validated by `model`. Content-Type is not required (curl -d sends a form type)."""
    raw = await request.body()
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise _too_deep() from None
    except UnicodeDecodeError as e:
        raise bad_request(f"malformed JSON in the request body: not UTF-8 ({e.reason})", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise bad_request(f"malformed JSON in the request body: {e.msg} (line {e.lineno}, column {e.colno})",
                          code="invalid_json") from None
    except ValueError as e:
        raise bad_request(f"malformed JSON in the request body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    if json_depth(data) > MAX_JSON_DEPTH:
        raise _too_deep()
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def json_depth(value) -> int:
    """Nesting depth of parsed JSON, without recursion (the point is to refuse deep input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in node if isinstance(child, (dict, list)))
    return deepest


def _too_deep() -> OpenAIError:
    return bad_request(f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep", code="invalid_json")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _body_doc(model: type[BaseModel]) -> dict:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _document_request_models(app: FastAPI, models) -> None:
    """Put the request models (parsed by hand, for OpenAI-shaped errors) into the OpenAPI schema."""
    base = app.openapi

    def openapi():
        if app.openapi_schema is None:
            schema = base()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in models:
                s = m.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(s.pop("$defs", {}))
                components[m.__name__] = s
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def build_engine(args: argparse.Namespace) -> LLMEngine:
    custom = {}
    if args.custom_guided_decoding_backends:
        custom = load_custom_backends(args.custom_guided_decoding_backends, trust_custom_code(args))
    check_guided_decoding_backend(args.guided_decoding_backend, custom)
    fd_config = FDConfig.create(args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                device=args.device, dtype=args.dtype, logits_processors=list(args.logits_processors),
                                guided_decoding_backend=args.guided_decoding_backend,
                                logits_processor_timeout_s=args.logits_processor_timeout or None)
    fd_config.custom_guided_decoding_backends = custom
    fd_config.guided_whitespace_pattern = args.guided_whitespace_pattern
    fd_config.reasoning_parser = args.reasoning_parser
    fd_config.tool_functions = load_tool_functions(args.tool_functions)
    return LLMEngine(fd_config)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    names = args.served_model_name or [os.path.basename(os.path.normpath(args.model))]
    return ServerSettings(served_model_names=names, model_path=args.model, api_key=resolve_api_key(args),
                          strict_fields=args.strict_fields, max_waiting_requests=args.max_waiting_requests,
                          model_aliases={args.model}, max_request_body_bytes=args.max_request_body_bytes,
                          shutdown_timeout_s=args.shutdown_timeout)


class GracefulServer(uvicorn.Server):
    """uvicorn, with a drain before it stops.

    The first SIGTERM/SIGINT marks the app as draining (new requests and /health get 503), waits up
    to `shutdown_timeout_s` for the running requests, then shuts the engine down: what is still
    running ends with an error (an error event and [DONE] on streams, a JSON 503 otherwise). Only
    then does uvicorn close the connections, and the process exits 0. A second signal skips the wait.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.app = app
        self._drain: asyncio.Task | None = None
        self._signalled = False

    def handle_exit(self, sig, frame) -> None:
        if self._signalled:  # asked twice: stop now
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
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
        engine: AsyncLLMEngine = self.app.state.async_engine
        deadline = time.monotonic() + self.app.state.settings.shutdown_timeout_s
        while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.engine.has_unfinished_requests():
            logger.warning("shutdown timeout: ending %d running and %d waiting requests",
                           engine.num_running, engine.num_waiting)
        await asyncio.to_thread(engine.shutdown, reason="the server is shutting down")
        await asyncio.sleep(0.1)  # let the handlers write those last answers


def run_server(args: argparse.Namespace) -> int:
    """Build the engine, then serve until interrupted. Returns the process exit status."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.metrics_port is not None and args.metrics_port == args.port:
        print("fastdeploy-lp: cannot start: --metrics-port must differ from --port", file=sys.stderr)
        return 2
    try:
        engine = build_engine(args)
    except (ValueError, OSError, ImportError) as e:  # bad processor name, missing model, bad flag value
        print(f"fastdeploy-lp: cannot start: {e}{missing_model_hint(args.model)}", file=sys.stderr)
        return 2
    app = build_app(engine, settings_from_args(args))
    metrics_server = None
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        try:
            metrics_server = start_http_server(args.metrics_port, addr=args.host, registry=app.state.metrics.registry)
        except OSError as e:
            print(f"fastdeploy-lp: cannot start: --metrics-port {args.metrics_port}: {e}", file=sys.stderr)
            return 2
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30,
                            timeout_graceful_shutdown=5)
    server = GracefulServer(config, app)
    try:
        server.run()
    finally:
        if isinstance(metrics_server, tuple):
            metrics_server[0].shutdown()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(prog="python -m fastdeploy_lp.entrypoints.openai.api_server")
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
