"""GET /v1/models and /v1/models/{model} (what is served) and GET /v1/logits_processors (the
pipeline every request runs through, with each processor's documentation and args schema)."""

from __future__ import annotations

import inspect
import sys

from fastapi import APIRouter, Request

from fastdeploy_lp.entrypoints.openai.errors import OpenAIError
from fastdeploy_lp.entrypoints.openai.protocol import ErrorResponse, ModelCard, ModelList
from fastdeploy_lp.processors.registry import BUILTIN_PROCESSORS

router = APIRouter(prefix="/v1")


@router.get("/models", response_model=ModelList)
async def list_models(request: Request):
    state = request.app.state
    names = state.settings.served_model_names
    return {"object": "list", "data": [_model_card(state, name) for name in names]
            + [_adapter_card(state, name, path) for name, path in _adapters(state)]}


@router.get("/models/{model:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
async def retrieve_model(model: str, request: Request):
    """One served model, as OpenAI's `GET /v1/models/{model}` (ids may contain '/')."""
    names = request.app.state.settings.served_model_names
    adapters = dict(_adapters(request.app.state))
    if model in adapters:
        return _adapter_card(request.app.state, model, adapters[model])
    if model not in names:
        raise OpenAIError(404, f"model: {model!r} is not served here; served: {', '.join(names)}",
                          param="model", code="model_not_found")
    return _model_card(request.app.state, model)


@router.get("/logits_processors")
async def list_logits_processors(request: Request):
    """The processors every request runs through, in order: `description` (the docstring's first
    paragraph), `doc` (the whole docstring: arguments and an example), and the JSON schema of the
    `logits_processors_args` keys each one reads (`args_schema`; None: it does not declare them)."""
    engine = request.app.state.async_engine
    processors = engine.processors
    leading = len(processors) - len(engine.fd_config.logits_processors)
    return {"object": "list", "data": [_processor_card(type(p), position, position < leading)
                                       for position, p in enumerate(processors)]}


def _model_card(state, name: str) -> dict:
    engine = state.async_engine
    model = engine.fd_config.model_config
    quantization = model.quantization
    if model.file_format == "gguf":  # the file's type mix: "gguf: Q4_K x168, Q6_K x25, F32 x65"
        quantization = "gguf: " + ", ".join(f"{kind} x{count}" for kind, count in model.tensor_types.items())
    return {"id": name, "object": "model", "created": state.started, "owned_by": "fastdeploy_lp",
            "root": state.settings.model_path, "max_model_len": engine.fd_config.max_model_len,
            "weight_dtype": model.weight_dtype, "quantization": quantization,
            "weight_bytes": engine.weight_bytes, "deterministic": engine.fd_config.deterministic}


def _adapters(state) -> list[tuple[str, str]]:
    """The LoRA adapters served (`--lora-modules`, `/v1/load_lora_adapter`), as (name, path)."""
    return list(state.async_engine.lora_adapters().items())


def _adapter_card(state, name: str, path: str) -> dict:
    """A LoRA adapter as vLLM lists it: its path as `root`, the base model's name as `parent`."""
    return {"id": name, "object": "model", "created": state.started, "owned_by": "fastdeploy_lp", "root": path,
            "parent": state.settings.served_model_names[0],
            "max_model_len": state.async_engine.fd_config.max_model_len}


def _processor_card(cls: type, position: int, installed_by_engine: bool) -> dict:
    model = getattr(cls, "args_model", None)
    doc = _docstring(cls)
    return {"name": cls.__name__, "position": position, "class": f"{cls.__module__}:{cls.__qualname__}",
            "source": "engine" if installed_by_engine else "--logits-processors",
            "builtin": cls.__name__ in BUILTIN_PROCESSORS,
            "description": doc.split("\n\n")[0].replace("\n", " ") if doc else None,
            "doc": doc,
            "args_schema": model.model_json_schema() if model is not None else None}


def _docstring(cls: type) -> str | None:
    """The class's own docstring, else its module's, without the indentation."""
    doc = cls.__dict__.get("__doc__") or getattr(sys.modules.get(cls.__module__), "__doc__", None)
    return inspect.cleandoc(doc) if doc else None
