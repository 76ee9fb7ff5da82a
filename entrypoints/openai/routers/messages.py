"""POST /v1/messages (Anthropic's Messages API) and POST /v1/messages/count_tokens: parse, hand to
`serving_messages.py`, and answer every failure in Anthropic's error shape
(`{"type": "error", "error": {"type", "message"}}`). `anthropic-version` and the other
`anthropic-*` headers are accepted and not needed; `x-api-key` is checked by the API-key middleware."""

from __future__ import annotations

import functools
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from fastdeploy_lp.engine.protocol import EngineNotServingError
from fastdeploy_lp.entrypoints.openai.errors import RETRY_LATER, OpenAIError
from fastdeploy_lp.entrypoints.openai.errors_anthropic import anthropic_error_body
from fastdeploy_lp.entrypoints.openai.middleware import RequestTooLarge, too_large
from fastdeploy_lp.entrypoints.openai.protocol_anthropic import AnthropicCountTokensRequest, AnthropicMessagesRequest
from fastdeploy_lp.entrypoints.openai.request_body import ignored_fields_header, inline_body_doc, parse_body
from fastdeploy_lp.entrypoints.openai.routers.health import require_serving
from fastdeploy_lp.entrypoints.openai.serving_engine import ClientDisconnected
from fastdeploy_lp.entrypoints.openai.serving_messages import AnthropicServingMessages

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1")

_ERROR = {"content": {"application/json": {"example": {"type": "error", "error": {
    "type": "invalid_request_error", "message": "max_tokens: this field is required"}}}}}
_ERRORS = {code: _ERROR for code in (400, 401, 404, 413, 429, 500, 503)}


def anthropic_errors(handler):
    """Answer what `handler` raises as an Anthropic error (a client that went away stays a 499)."""

    @functools.wraps(handler)
    async def wrapped(request: Request):
        try:
            return await handler(request)
        except OpenAIError as e:
            error = e
        except RequestTooLarge:
            error = too_large(request.app.state.settings.max_request_body_bytes)
        except EngineNotServingError as e:
            error = OpenAIError(503, f"not serving: {e}", headers=RETRY_LATER)
        except ClientDisconnected:
            raise
        except Exception as e:  # noqa: BLE001 - every failure gets the API's error shape
            logger.exception("unhandled error")
            error = OpenAIError(500, f"internal error: {type(e).__name__}: {e}")
        return JSONResponse(anthropic_error_body(error), status_code=error.status, headers=error.headers)

    return wrapped


@router.post("/messages", openapi_extra=inline_body_doc(AnthropicMessagesRequest), responses=_ERRORS)
@anthropic_errors
async def create_message(request: Request):
    """Anthropic Messages; `stream: true` answers with Anthropic's server-sent events."""
    require_serving(request)
    body = await parse_body(request, AnthropicMessagesRequest)
    headers = ignored_fields_header(request, body)
    return await AnthropicServingMessages(request.app.state.chat).create(body, request, headers)


@router.post("/messages/count_tokens", openapi_extra=inline_body_doc(AnthropicCountTokensRequest), responses=_ERRORS)
@anthropic_errors
async def count_message_tokens(request: Request):
    """`{"input_tokens"}`: the prompt tokens /v1/messages would run for the same body."""
    body = await parse_body(request, AnthropicCountTokensRequest)
    headers = ignored_fields_header(request, body)
    return await AnthropicServingMessages(request.app.state.chat).count_tokens(body, headers)
