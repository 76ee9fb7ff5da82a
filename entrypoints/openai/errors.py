"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Everything below the server raises `ValueError("field: what is wrong")` (SamplingParams, the
engine, the processor pipeline); `from_value_error` turns that into a 400 whose `param` is the
field. Pydantic's `ValidationError` becomes a 400 naming the first failing field.
"""

from __future__ import annotations

import re

from pydantic import ValidationError

RETRY_LATER = {"Retry-After": "1"}  # with 429 and 503: the queue drains and restarts take seconds

_FIELD = re.compile(r"^[A-Za-z_][\w.\[\]-]*$")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error",
          503: "service_unavailable"}


class OpenAIError(Exception):
    """An error the client gets back as `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def from_value_error(error: ValueError, renames: dict[str, str] | None = None) -> OpenAIError:
    """`ValueError("max_tokens: must be ...")` → 400 with `param="max_tokens"`.

    `renames` maps engine field names to the request's (a chat request's `prompt` is its `messages`);
    a key with a path (`structural_tag.format.tags[1].content.json_schema`) renames that prefix.
    """
    message = str(error).replace(": Value error, ", ": ")  # pydantic's prefix, from processor args models
    field, sep, rest = message.partition(": ")
    if not sep or not _FIELD.match(field):
        return bad_request(message)
    renames, named = renames or {}, field
    path = next((k for k in renames if "." in k and field.startswith(k) and field[len(k):len(k) + 1] in ("", ".", "[")),
                None)
    if path is not None:
        field = renames[path] + field[len(path):]
    else:
        root, dot, tail = field.partition(".")
        field = renames.get(root, root) + dot + tail
        if field != named:  # "max_tokens: ... max_tokens is 2" names the field twice
            rest = re.sub(rf"\b{re.escape(root)}\b", renames[root], rest)
    return bad_request(f"{field}: {rest}", param=field)


def renamed(error: OpenAIError, param: str) -> OpenAIError:
    """`error` naming `param` instead of its own `param`, in the message too (an API that spells a
    field otherwise, or the part of a request a shared check could not tell apart)."""
    old = error.param
    message = error.message
    if old:
        message = re.sub(rf"(?<![\w.\[]){re.escape(old)}(?![\w\[])", lambda _: param, message)
    return OpenAIError(error.status, message, param=param, code=error.code, type=error.type, headers=error.headers)


def loc_to_param(loc: tuple) -> str:
    """('messages', 0, 'role') → 'messages[0].role'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def from_validation_error(error: ValidationError) -> OpenAIError:
    return from_error_dicts(error.errors(include_url=False))


def from_error_dicts(errors: list[dict], drop_prefix: str | None = None) -> OpenAIError:
    """One of pydantic's error dicts as a 400; `drop_prefix` strips FastAPI's 'body' location.

    A value that fails a union gets one error per member; the deepest one is the member the value
    was meant for (a list of content parts, not a string), so it is the one reported.
    """
    def clean(err):
        loc = tuple(err.get("loc", ()))
        if drop_prefix is not None and loc and loc[0] == drop_prefix:
            loc = loc[1:]
        # The first part is always a field name, even one spelled like a type tag ("model").
        return loc[:1] + tuple(p for p in loc[1:] if not _is_type_tag(p))

    first = max(errors, key=lambda e: len(clean(e)))
    return _from_error_dict(first, clean(first))


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "function-after", "function-before",
              "function-wrap", "literal", "model", "json-or-python"}


def _is_type_tag(part) -> bool:
    """Union members appear in error locations as 'str', 'list[int]', 'NamedToolChoice', ..."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS or part[:1].isupper())


def _from_error_dict(err: dict, loc: tuple) -> OpenAIError:
    param = loc_to_param(loc) or None
    msg = str(err.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if param is None and err.get("type") == "value_error":  # a model-level check: "field: what is wrong"
        return from_value_error(ValueError(msg))
    if param is None and err.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        return bad_request("the request body must be a JSON object")
    if err.get("type") == "missing":
        return bad_request(f"{param}: this field is required", param=param, code="missing_required_parameter")
    if err.get("type") == "extra_forbidden":
        return bad_request(f"{param}: unknown field", param=param, code="unknown_parameter")
    if err.get("type") not in ("value_error", "assertion_error") and "input" in err:
        shown = repr(err["input"])
        if len(shown) > 80:
            shown = shown[:77] + "..."
        msg = f"{msg}, got {shown}"
    if msg.startswith(f"{param}: "):
        return bad_request(msg, param=param)
    return bad_request(f"{param}: {msg}" if param else msg, param=param)
