"""POST /v1/chat/completions and POST /v1/completions: parse the body, hand it to the serving
object on `app.state` (`serving_chat.py`, `serving_completion.py`), which submits it to the engine
and shapes the JSON or SSE answer."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from fastdeploy_lp.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                                       CompletionResponse, ErrorResponse)
from fastdeploy_lp.entrypoints.openai.request_body import body_doc, ignored_fields_header, parse_body
from fastdeploy_lp.entrypoints.openai.routers.health import require_serving

router = APIRouter(prefix="/v1", dependencies=[Depends(require_serving)])

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


@router.post("/chat/completions", openapi_extra=body_doc(ChatCompletionRequest),
             responses={200: {"model": ChatCompletionResponse, "content": {"text/event-stream": {}}}, **_ERRORS})
async def create_chat_completion(request: Request):
    """OpenAI chat completions; `stream: true` answers with server-sent events."""
    body = await parse_body(request, ChatCompletionRequest)
    return await request.app.state.chat.create(body, request, ignored_fields_header(request, body))


@router.post("/completions", openapi_extra=body_doc(CompletionRequest),
             responses={200: {"model": CompletionResponse, "content": {"text/event-stream": {}}}, **_ERRORS})
async def create_completion(request: Request):
    """OpenAI (legacy) completions; `stream: true` answers with server-sent events."""
    body = await parse_body(request, CompletionRequest)
    return await request.app.state.completion.create(body, request, ignored_fields_header(request, body))
