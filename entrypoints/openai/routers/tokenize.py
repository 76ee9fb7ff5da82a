"""POST /tokenize and POST /detokenize (vLLM's paths, without /v1): parse, tokenize on a worker
thread as the chat path would (`serving_tokenize.py`; like vLLM, a count past max_model_len is
answered, so a text of megabytes is counted in full, off the event loop), answer. They need the tokenizer only, so they
answer while the engine is busy or draining too."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

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
    engine = state.async_engine.engine
    with value_errors_as_400():  # on a worker: counting an 8 MB text takes seconds, and may exceed the limit
        out = await asyncio.to_thread(tokenize, engine.tokenizer, body, engine.fd_config.max_model_len)
    return JSONResponse(out, headers=headers)


@router.post("/detokenize", openapi_extra=inline_body_doc(DetokenizeRequest), responses=_ERRORS)
async def detokenize_tokens(request: Request):
    """`{"tokens"}` → `{"prompt"}`."""
    body = await parse_body(request, DetokenizeRequest)
    request.app.state.chat.check_model(body.model)
    headers = ignored_fields_header(request, body)
    with value_errors_as_400():
        out = detokenize(request.app.state.async_engine.engine.tokenizer, body)
    return JSONResponse(out, headers=headers)
