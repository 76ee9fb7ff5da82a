"""POST /v1/chat/completions/render, /v1/completions/render, /v1/responses/render and
/v1/messages/render (vLLM's paths): a request validated and rendered as its generation endpoint
would, answered with the token ids the engine would see and the sampling parameters it would run
with, in vLLM's `GenerateRequest` shape. Nothing is generated.

vLLM's router (`vllm-router --policy cache_aware` or `kv_aware`) calls these to learn a request's
prompt tokens before it picks a replica; without them it falls back to /tokenize. Rendering needs
the tokenizer only, so like /tokenize they answer while the engine is busy or draining, and the
work runs on a worker thread: a chat of megabytes takes seconds to render and encode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from fastdeploy_lp.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from fastdeploy_lp.entrypoints.openai.protocol_anthropic import AnthropicMessagesRequest
from fastdeploy_lp.entrypoints.openai.protocol_responses import ResponsesRequest
from fastdeploy_lp.entrypoints.openai.request_body import body_doc, ignored_fields_header, inline_body_doc, parse_body
from fastdeploy_lp.entrypoints.openai.serving_messages import AnthropicServingMessages
from fastdeploy_lp.sampling_params import SamplingParams

router = APIRouter(prefix="/v1")

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413)}


@router.post("/chat/completions/render", openapi_extra=body_doc(ChatCompletionRequest), responses=_ERRORS)
async def render_chat_completion(request: Request):
    """A chat request → `{"request_id", "token_ids", "sampling_params", "model", "stream"}`."""
    return await _rendered(request, ChatCompletionRequest, request.app.state.chat.render)


@router.post("/completions/render", openapi_extra=body_doc(CompletionRequest), responses=_ERRORS)
async def render_completion(request: Request):
    """A completions request → one `GenerateRequest` per prompt, in order."""
    return await _rendered(request, CompletionRequest, request.app.state.completion.render)


@router.post("/responses/render", openapi_extra=body_doc(ResponsesRequest), responses=_ERRORS)
async def render_response(request: Request):
    """A Responses request (with its `previous_response_id` history) → its chat prompt's `GenerateRequest`."""
    return await _rendered(request, ResponsesRequest, request.app.state.responses.render)


@router.post("/messages/render", openapi_extra=inline_body_doc(AnthropicMessagesRequest), responses=_ERRORS)
async def render_message(request: Request):
    """An Anthropic Messages request → its chat prompt's `GenerateRequest`."""
    return await _rendered(request, AnthropicMessagesRequest, AnthropicServingMessages(request.app.state.chat).render)


async def _rendered(request: Request, model: type[BaseModel], render) -> JSONResponse:
    """Parse the body as `model`, `render` it on a worker thread, answer one `GenerateRequest` per
    rendered prompt (a list when `render` gives a list)."""
    body = await parse_body(request, model)
    headers = ignored_fields_header(request, body)
    rendered = await asyncio.to_thread(render, body)
    name = request.app.state.chat.answer_model(getattr(body, "model", None))  # the adapter the body named
    if isinstance(rendered, list):
        answer = [_generate_request(name, ids, params, body.stream) for ids, params in rendered]
    else:
        answer = _generate_request(name, *rendered, body.stream)
    return JSONResponse(answer, headers=headers)


def _generate_request(model: str, token_ids: list[int], params: SamplingParams, stream: bool | None) -> dict:
    sampling = dataclasses.asdict(params)
    del sampling["extra"]  # engine-internal
    return {"request_id": uuid.uuid4().hex, "token_ids": token_ids, "sampling_params": sampling,
            "model": model, "stream": bool(stream)}
