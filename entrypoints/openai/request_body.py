"""Request bodies: parsed by hand (so every error is OpenAI-shaped), checked for unknown fields, and
put back into the OpenAPI schema that hand-parsing hides from FastAPI."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import quote

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from fastdeploy_lp.entrypoints.openai.errors import OpenAIError, bad_request, from_validation_error
from fastdeploy_lp.entrypoints.openai.limits import RequestLimits
from fastdeploy_lp.entrypoints.openai.serving_engine import ClientDisconnected
from fastdeploy_lp.tokenizer.text import first_unencodable, unencodable_message

IGNORED_FIELDS_HEADER = "x-fastdeploy-lp-ignored-fields"
MAX_JSON_DEPTH = 128  # far beyond any real request (a JSON schema nests ~2 levels per level)
INLINE_PARSE_BYTES = 64 << 10  # larger bodies are parsed off the event loop


async def parse_body(request: Request, model: type[BaseModel]):
    """The JSON body validated by `model`. Content-Type is not required (curl -d sends a form type).

    A large body is parsed on a worker thread: decoding and walking megabytes of JSON would
    otherwise hold the event loop, and every other request with it, for a noticeable time."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone mid-body (or closed by the request-read timeout)
        raise ClientDisconnected() from None
    limits = request.app.state.request_limits
    if len(raw) > INLINE_PARSE_BYTES:
        return await asyncio.to_thread(parse_json_body, raw, model, limits)
    return parse_json_body(raw, model, limits)


def parse_json_body(raw: bytes, model: type[BaseModel], limits: RequestLimits):
    """Decode, check and validate a body, cheapest checks first: the JSON itself, the limits
    (list lengths), the nesting depth, text that is not valid Unicode, then the request model."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise _too_deep() from None
    except UnicodeDecodeError as e:
        raise bad_request(f"malformed JSON in the request body: not UTF-8 ({e.reason})", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise bad_request(f"malformed JSON in the request body: {e.msg} (line {e.lineno}, column {e.colno})",
                          code="invalid_json") from None
    except ValueError as e:
        raise bad_request(f"malformed JSON in the request body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    limits.check(data)
    if json_depth(data) > MAX_JSON_DEPTH:
        raise _too_deep()
    if (found := first_unencodable(data)) is not None:
        where = found[0] or "the request body"  # a top-level key
        raise bad_request(unencodable_message(where, *found[1:]), param=found[0] or None)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def ignored_fields_header(request: Request, body) -> dict[str, str]:
    """The response header naming the body's unknown top-level fields (none: no header); with
    `--strict-fields` an unknown field is a 400 instead."""
    unknown = body.unknown_fields()
    if not unknown:
        return {}
    if request.app.state.settings.strict_fields:
        raise bad_request(f"{unknown[0]}: unknown field (the server runs with --strict-fields); "
                          f"unknown fields: {', '.join(unknown)}", param=unknown[0], code="unknown_parameter")
    return {IGNORED_FIELDS_HEADER: header_value(unknown)}


MAX_IGNORED_HEADER = 2048  # characters: the names past it are counted, not listed
_HEADER_SAFE = "".join(c for c in map(chr, range(0x21, 0x7F)) if c not in ",%")  # printable ASCII but the separator


def header_value(names: list[str]) -> str:
    """`names` comma-separated as a header value that cannot fail to encode or split a response:
    printable ASCII stays as it is, every other character (and `,` and `%`) is percent-encoded as
    UTF-8 (RFC 3986), so a name with CR, LF, NUL or non-latin-1 letters arrives as `%E5%90%8D`.
    Past MAX_IGNORED_HEADER characters the rest is summarised as `...(+N more)`."""
    out, length = [], 0
    for i, name in enumerate(names):
        encoded = quote(name, safe=_HEADER_SAFE)  # bodies with lone surrogates are refused before this
        if length + len(encoded) > MAX_IGNORED_HEADER:
            out.append(f"...(+{len(names) - i} more)")
            break
        out.append(encoded)
        length += len(encoded) + 1
    return ",".join(out)


def json_depth(value) -> int:
    """Nesting depth of parsed JSON, without recursion (the point is to refuse deep input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in node if isinstance(child, (dict, list)))
    return deepest


def _too_deep() -> OpenAIError:
    return bad_request(f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep", code="invalid_json")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def body_doc(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose body `model` is parsed by hand."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def inline_body_doc(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose body `model` is parsed by hand and is not one of the models
    `document_request_models` registers: the schema inline, each nested model written in place of
    its reference (the models are not recursive)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref[len("#/$defs/"):]])
            return {k: resolve(v) for k, v in node.items()}
        return [resolve(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": resolve(schema)}}}}


def document_request_models(app: FastAPI, models) -> None:
    """Put the request models (parsed by hand, for OpenAI-shaped errors) into the OpenAPI schema."""
    base = app.openapi

    def openapi():
        if app.openapi_schema is None:
            schema = base()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in models:
                s = m.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(s.pop("$defs", {}))
                components[m.__name__] = s
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
