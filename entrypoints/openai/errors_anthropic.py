"""Anthropic-shaped errors for /v1/messages: `{"type": "error", "error": {"type", "message"}}`.

Everything below the server speaks `OpenAIError` (status, message, param); this is the one place
that re-shapes it, so the Messages API reports the same 4xx as the other endpoints in its own form.
Field names in messages are the Messages API's where the chat request calls them otherwise.
"""

from __future__ import annotations

import re

from fastdeploy_lp.entrypoints.openai.errors import OpenAIError

MESSAGES_PATH = "/v1/messages"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
          529: "overloaded_error"}

# the chat request's field → the Messages request's (the rest are spelled alike)
_FIELDS = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
           "max_completion_tokens": "max_tokens"}
_TOOL_PARAMETERS = re.compile(r"^tools\[(\d+)\]\.function\.parameters")


def serves_messages(path: str) -> bool:
    """Whether `path` is the Messages API's, whose errors take Anthropic's shape."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_body(error: OpenAIError) -> dict:
    return {"type": "error", "error": {"type": _TYPES.get(error.status, "api_error"),
                                       "message": _messages_fields(error.message)}}


def error_body(path: str, error: OpenAIError) -> dict:
    """The body of `error` on `path`: Anthropic's shape on the Messages API, OpenAI's elsewhere."""
    return anthropic_error_body(error) if serves_messages(path) else error.body()


def _messages_fields(message: str) -> str:
    field, sep, rest = message.partition(": ")
    if not sep:
        return message
    root, dot, tail = field.partition(".")
    if root in _FIELDS:
        return f"{_FIELDS[root]}{dot}{tail}: {rest}"
    return _TOOL_PARAMETERS.sub(r"tools[\1].input_schema", field) + sep + rest
