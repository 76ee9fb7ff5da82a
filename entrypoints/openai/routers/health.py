"""GET /health (is the engine serving?) and GET /metrics (Prometheus), and the `require_serving`
dependency that gates generation the same way /health reports it."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fastdeploy_lp.entrypoints.openai.errors import RETRY_LATER, OpenAIError
from fastdeploy_lp.entrypoints.openai.protocol import ErrorResponse

router = APIRouter()


def not_serving_reason(request: Request) -> str | None:
    """Why the server cannot take a request now (None: it can)."""
    if request.app.state.draining:
        return "the server is shutting down"
    return request.app.state.async_engine.not_serving_reason()


def require_serving(request: Request) -> None:
    """A dependency: 503 with Retry-After unless the engine serves."""
    reason = not_serving_reason(request)
    if reason is not None:
        raise OpenAIError(503, f"not serving: {reason}", code="not_serving", headers=RETRY_LATER)


@router.get("/health", responses={503: {"model": ErrorResponse}}, dependencies=[Depends(require_serving)])
async def health(request: Request):
    """200 while the engine serves, 503 otherwise (starting, shutting down, or stopped by an error).
    With data parallelism, 200 while one engine serves; `engines_not_serving` says why the others do not."""
    down = [e["not_serving_reason"] for e in request.app.state.async_engine.engine_loads() if not e["serving"]]
    return {"status": "ok", "engines_not_serving": down} if down else {"status": "ok"}


@router.get("/metrics", response_class=Response)
async def prometheus_metrics(request: Request):
    """Prometheus text format; see `entrypoints/openai/metrics.py` for the metrics."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
