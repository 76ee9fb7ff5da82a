"""POST /v1/responses, GET /v1/responses/{id}, DELETE /v1/responses/{id}: OpenAI's Responses API,
served by `serving_responses.py` (on the chat path) from `app.state.responses`."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from fastdeploy_lp.entrypoints.openai.protocol import ErrorResponse
from fastdeploy_lp.entrypoints.openai.protocol_responses import ResponsesRequest
from fastdeploy_lp.entrypoints.openai.request_body import body_doc, ignored_fields_header, parse_body
from fastdeploy_lp.entrypoints.openai.routers.health import require_serving

router = APIRouter(prefix="/v1")

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


@router.post("/responses", openapi_extra=body_doc(ResponsesRequest), dependencies=[Depends(require_serving)],
             responses={200: {"content": {"text/event-stream": {}}}, **_ERRORS})
async def create_response(request: Request):
    """OpenAI Responses; `stream: true` answers with typed server-sent events."""
    body = await parse_body(request, ResponsesRequest)
    return await request.app.state.responses.create(body, request, ignored_fields_header(request, body))


@router.get("/responses/{response_id}", responses={404: {"model": ErrorResponse}})
async def retrieve_response(response_id: str, request: Request):
    """A stored response (one created with `store: true`, not yet deleted or evicted)."""
    return request.app.state.responses.retrieve(response_id)


@router.delete("/responses/{response_id}", responses={404: {"model": ErrorResponse}})
async def delete_response(response_id: str, request: Request):
    """Forget a stored response."""
    return request.app.state.responses.delete(response_id)
