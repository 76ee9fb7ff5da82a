"""POST /tokenize and POST /detokenize (vLLM's paths, without /v1): parse, tokenize (or decode) as
the chat path would (`serving_tokenize.py`), answer. Like vLLM's, a count past max_model_len is
answered, so megabytes of text are counted in full: the work and its JSON run on a worker thread,
off the event loop. They need the tokenizer only, so they answer while the engine is busy or
draining too."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from fastdeploy_lp.entrypoints.openai.protocol import ErrorResponse
from fastdeploy_lp.entrypoints.openai.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from fastdeploy_lp.entrypoints.openai.request_body import ignored_fields_header, inline_body_doc, parse_body
from fastdeploy_lp.entrypoints.openai.serving_engine import value_errors_as_400
from fastdeploy_lp.entrypoints.openai.serving_tokenize import detokenize, tokenize

router = APIRouter()

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413)}


@router.post("/tokenize", openapi_extra=inline_body_doc(TokenizeRequest), responses=_ERRORS)
async def tokenize_prompt(request: Request):
    """`{"prompt"}` or `{"messages"}` → `{"count", "max_model_len", "tokens"}`."""
    body = await parse_body(request, TokenizeRequest)
    state = request.app.state
    state.chat.check_model(body.model)
    headers = ignored_fields_header(request, body)
    engine = state.async_engine
    with value_errors_as_400():  # on a worker: counting an 8 MB text takes seconds, and may exceed the limit
        return await _answered_on_a_worker(headers, tokenize, engine.tokenizer, body, engine.fd_config.max_model_len)


@router.post("/detokenize", openapi_extra=inline_body_doc(DetokenizeRequest), responses=_ERRORS)
async def detokenize_tokens(request: Request):
    """`{"tokens"}` → `{"prompt"}`."""
    body = await parse_body(request, DetokenizeRequest)
    request.app.state.chat.check_model(body.model)
    headers = ignored_fields_header(request, body)
    with value_errors_as_400():
        return await _answered_on_a_worker(headers, detokenize, request.app.state.async_engine.tokenizer, body)


async def _answered_on_a_worker(headers: dict[str, str], work, *args) -> Response:
    """`work(*args)` and its JSON encoding off the event loop: millions of ids take a second to encode."""
    def answer() -> bytes:
        return json.dumps(work(*args), ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return Response(await asyncio.to_thread(answer), media_type="application/json", headers=headers)
