"""Every exception the app can meet, answered as an OpenAI-shaped error (`EXCEPTION_HANDLERS`,
given to `FastAPI(exception_handlers=...)`)."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdeploy_lp.engine.protocol import EngineNotServingError
from fastdeploy_lp.entrypoints.openai.errors import RETRY_LATER, OpenAIError, from_error_dicts
from fastdeploy_lp.entrypoints.openai.middleware import RequestTooLarge, too_large
from fastdeploy_lp.entrypoints.openai.serving_engine import ClientDisconnected

logger = logging.getLogger(__name__)


async def openai_error(_, exc: OpenAIError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def request_too_large(request: Request, exc: RequestTooLarge):
    err = too_large(request.app.state.settings.max_request_body_bytes)
    return JSONResponse(err.body(), status_code=413, headers={"connection": "close"})


async def validation_error(_, exc: RequestValidationError):  # query/path parameters
    err = from_error_dicts(list(exc.errors()), drop_prefix="query")
    return JSONResponse(err.body(), status_code=err.status)


async def http_error(request: Request, exc: StarletteHTTPException):
    message = (f"no route {request.method} {request.url.path}" if exc.status_code == 404
               else str(exc.detail))
    err = OpenAIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def engine_stopped(_, exc: EngineNotServingError):  # the engine stopped while we waited
    err = OpenAIError(503, f"not serving: {exc}", code="not_serving")
    return JSONResponse(err.body(), status_code=503, headers=RETRY_LATER)


async def client_gone(request, exc: ClientDisconnected):
    # Routine (a closed tab, a client timeout): one line, no traceback; its requests were aborted.
    logger.info("%s %s: the client disconnected before the response; its requests were aborted",
                request.method, request.url.path)
    return Response(status_code=499)


async def internal_error(_, exc: Exception):
    logger.exception("unhandled error")
    err = OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
    return JSONResponse(err.body(), status_code=500)


EXCEPTION_HANDLERS = {
    OpenAIError: openai_error,
    RequestTooLarge: request_too_large,
    RequestValidationError: validation_error,
    StarletteHTTPException: http_error,
    EngineNotServingError: engine_stopped,
    ClientDisconnected: client_gone,
    Exception: internal_error,
}
