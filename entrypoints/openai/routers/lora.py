"""POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter (vLLM's paths and bodies): serve a
PEFT adapter as a model name, or stop serving it, while the server runs (docs/lora.md). The files
are read and checked on a worker thread, so the step loop and the event loop go on meanwhile; an
adapter that does not fit the base model is a 400 naming the field."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from fastdeploy_lp.entrypoints.openai.errors import bad_request
from fastdeploy_lp.entrypoints.openai.protocol import ErrorResponse
from fastdeploy_lp.entrypoints.openai.request_body import parse_body
from fastdeploy_lp.entrypoints.openai.serving_engine import value_errors_as_400

router = APIRouter(prefix="/v1")

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401)}


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body may carry it; the name decides


@router.post("/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
async def load_lora_adapter(request: Request):
    """`{"lora_name", "lora_path"}`: serve the PEFT adapter at `lora_path` as model `lora_name`."""
    body = await parse_body(request, LoadLoRAAdapterRequest)
    state = request.app.state
    if not body.lora_name.strip():
        raise bad_request("lora_name: must not be empty", param="lora_name")
    if body.lora_name in state.completion.model_aliases or body.lora_name in state.async_engine.lora_adapters():
        raise bad_request(f"lora_name: {body.lora_name!r} is already served", param="lora_name")
    with value_errors_as_400():
        await state.async_engine.load_lora_adapter(body.lora_name, body.lora_path)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
async def unload_lora_adapter(request: Request):
    """`{"lora_name"}`: stop serving that adapter (requests already queued on it finish)."""
    body = await parse_body(request, UnloadLoRAAdapterRequest)
    with value_errors_as_400():
        await request.app.state.async_engine.unload_lora_adapter(body.lora_name)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
