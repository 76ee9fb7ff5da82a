"""ASGI middleware that guards the door: the API key and the request-body size limit.

Both are plain ASGI (not Starlette's `BaseHTTPMiddleware`), so streamed responses pass through
untouched and a refused request is answered before its body is read.
"""

from __future__ import annotations

import hmac
import json

from fastdeploy_lp.entrypoints.openai.errors import OpenAIError
from fastdeploy_lp.entrypoints.openai.errors_anthropic import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})  # what load balancers and scrapers need, without a key


class RequestTooLarge(Exception):
    """Raised from `receive` once a body without Content-Length grows past the limit."""

    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than {limit} bytes (--max-request-body-bytes)")


async def send_error(send, error: OpenAIError, headers: dict[str, str] | None = None, path: str = "") -> None:
    body = json.dumps(error_body(path, error)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, str(RequestTooLarge(limit)), code="request_too_large")


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`: at once from Content-Length, else as soon as the streamed
    body passes the limit (the handler's read raises `RequestTooLarge`, answered as a 413)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = None
            if size is None or size < 0:
                return await send_error(send, OpenAIError(400, "Content-Length is not a number", code="invalid_request"),
                                        path=scope["path"])
            if size > self.max_bytes:
                return await send_error(send, too_large(self.max_bytes), {"connection": "close"}, scope["path"])
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on every path but /health
    and /metrics (the API docs and /openapi.json included: they describe what this deployment runs)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key):
            return await self.app(scope, receive, send)
        if b"x-api-key" in headers and hmac.compare_digest(headers[b"x-api-key"].strip(), self.api_key):
            return await self.app(scope, receive, send)
        await send_error(send, OpenAIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>' "
                                                "or 'x-api-key: <key>'", code="invalid_api_key"),
                         {"www-authenticate": "Bearer"}, scope["path"])
