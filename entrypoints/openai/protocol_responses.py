"""The request model of POST /v1/responses (OpenAI's Responses API) and its translation into a chat
completion request, so a Responses request runs the chat path: the same validators, chat template,
tool-call grammar, reasoning parser and engine.

What is served: `input` (a string, or items: messages, `function_call`, `function_call_output`;
`reasoning` items are accepted and left out of the prompt, as chat templates leave out earlier
turns' thinking), `instructions`, `max_output_tokens`, `temperature`, `top_p`, function `tools`
with `tool_choice` and `parallel_tool_calls`, `text.format` (`text`, `json_object`, `json_schema`),
`stream`, `store`, `previous_response_id`, `metadata`, `user`, and through `extra_body` the
engine's extensions (`logits_processors_args`, `seed`, `top_k`, `min_p`, `repetition_penalty`,
`stop`, `chat_template_kwargs`, `structured_outputs`). What a local engine cannot do (built-in tools, `background`,
`conversation`, stored prompts, `include`, `truncation: "auto"`, `top_logprobs`, `max_tool_calls`,
images and files) is a 400 naming the field, never silently dropped.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fastdeploy_lp.entrypoints.openai.protocol import _unknown_fields
from fastdeploy_lp.entrypoints.openai.protocol_constraints import refuse_constraint_fields

_REQUEST = ConfigDict(extra="allow", strict=True, populate_by_name=True)

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "reasoning_text", "summary_text")
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# Fields of OpenAI's request that need what a local engine does not have; each is a 400 when used.
_UNSUPPORTED = {
    "background": "background responses are not supported; send the request and wait (or stream)",
    "conversation": "conversations are not stored here; use previous_response_id",
    "prompt": "stored prompt templates are not supported; send input and instructions",
    "include": "no extra output data can be included",
    "top_logprobs": "log probabilities are not returned by /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "not supported; parallel_tool_calls: false allows at most one call",
}


class ContentPart(BaseModel):
    """A text part of a message (`input_text`, `output_text`, ...); images, files and audio are not
    supported (the models are text-only)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type not in _TEXT_PARTS:
            raise ValueError(f"content part type {self.type!r} is not supported; this server is text-only "
                             f"(supported: {', '.join(_TEXT_PARTS)})")
        if self.text is None and self.type != "refusal":
            raise ValueError(f"a {self.type} part needs 'text'")
        return self


class InputItem(BaseModel):
    """One input item: a message (`type` "message" or left out), a `function_call` the model made
    earlier, a `function_call_output` answering it, or a `reasoning` item (left out of the prompt)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str = "message"
    id: str | None = None
    status: str | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None
    encrypted_content: str | None = None

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in _ITEM_TYPES:
            raise ValueError(f"item type {value!r} is not supported; supported: {', '.join(_ITEM_TYPES)}")
        return value

    @model_validator(mode="after")
    def _shape(self):
        need = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                "function_call_output": ("call_id", "output"), "reasoning": ()}[self.type]
        for name in need:
            if getattr(self, name) is None:
                raise ValueError(f"{name}: required in a {self.type} item")
        return self


class FunctionTool(BaseModel):
    """A function the model may call (`{"type": "function", "name", "parameters", ...}`); built-in
    tools (web search, file search, code interpreter, ...) are not supported."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments.")
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"built-in tool {value!r} is not supported; only 'function' tools are")
        return value

    @model_validator(mode="after")
    def _named(self):
        if self.name is None:
            raise ValueError("name: a function tool needs a name")
        return self


class FunctionToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON matching `schema` (`strict`: every object
    closed, as OpenAI's strict mode)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("schema: required when type is 'json_schema'")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Accepted; not enforced.")


class ReasoningConfig(BaseModel):
    """Accepted for compatibility: how much a model reasons is up to its chat template
    (`chat_template_kwargs`), and reasoning comes back as `reasoning` items with a reasoning parser."""

    model_config = ConfigDict(extra="allow", strict=True)
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = _REQUEST
    model: str | None = Field(None, description="The served model name; 'default' or leaving it out means it.")
    input: str | list[InputItem] = Field(description="Text (one user message) or a list of input items.")
    instructions: str | None = Field(None, description="A system message put before the input (not carried "
                                                       "over by previous_response_id).")
    previous_response_id: str | None = Field(None, description="Continue a stored response's conversation.")
    max_output_tokens: int | None = Field(None, ge=1, description="Most tokens to generate (reasoning included).")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy.")
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = Field(
        None, description="As in chat: enforced by the output grammar.")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true).")
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    store: bool | None = Field(True, description="Keep the response (GET /v1/responses/{id}, previous_response_id) "
                                                 "in the server's bounded in-memory store.")
    metadata: dict[str, str] | None = Field(None, description="At most 16 pairs; keys up to 64 characters, values "
                                                            "up to 512 (OpenAI's limits).")
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    service_tier: str | None = Field(None, description="Accepted; there is one tier.")
    background: bool | None = None
    # the engine's extensions (extra_body), as on /v1/chat/completions
    logits_processors_args: dict[str, Any] | None = Field(
        None, description="Per-request arguments of the registered logits processors; see GET /v1/logits_processors.")
    seed: int | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = Field(
        None, description="As on /v1/chat/completions and validated there: e.g. {\"close_on_length\": true} "
                          "beside text.format json_schema / json_object.")

    @model_validator(mode="after")
    def _supported(self):
        for name, why in _UNSUPPORTED.items():
            value = getattr(self, name, None) if name in type(self).model_fields else (self.model_extra or {}).get(name)
            if value not in (None, False, [], {}):
                raise ValueError(f"{name}: {why}")
        refuse_constraint_fields(self.model_extra, ("structured_outputs",), "use text.format")
        if self.truncation == "auto":
            raise ValueError("truncation: 'auto' is not supported; an input longer than the context is a 400")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ValueError("input: needs at least one item")
        return self

    @field_validator("metadata")
    @classmethod
    def _metadata_bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > 16:
            raise ValueError(f"at most 16 pairs, got {len(value)}")
        for key, text in value.items():
            if len(key) > 64 or len(text) > 512:
                raise ValueError(f"key {key[:64]!r}: keys are at most 64 characters and values at most 512")
        return value

    def unknown_fields(self) -> list[str]:
        return sorted(_unknown_fields(self, ""))

    def input_items(self) -> list[dict[str, Any]]:
        """The input as item dicts (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(exclude_none=True) for item in self.input]

    def tools_out(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def text_out(self) -> dict[str, Any]:
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion request this one runs as; `history` is the items of the stored
        conversation it continues (empty without previous_response_id)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += items_to_messages(history + self.input_items())
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens}
        for name in ("temperature", "top_p", "parallel_tool_calls", "user", "logits_processors_args", "seed",
                     "top_k", "min_p", "repetition_penalty", "stop", "chat_template_kwargs", "structured_outputs"):
            body[name] = getattr(self, name)
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        tc = self.tool_choice
        body["tool_choice"] = {"type": "function", "function": {"name": tc.name}} if isinstance(
            tc, FunctionToolChoice) else tc
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            spec = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in spec.items()
                                                                               if v is not None}}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        return {k: v for k, v in body.items() if v is not None}


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for Responses items (input items and earlier output items alike): consecutive
    function calls join one assistant turn's `tool_calls`, a call's output is a `tool` turn, and
    reasoning items are left out."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = item["role"]
            messages.append({"role": role, "content": _text(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the text before the calls, or an earlier call
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
    return messages


def prompt_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`items` reduced to what `items_to_messages` reads, as a stored conversation keeps them: text
    only, no annotations, ids or unknown keys, and no reasoning items (they never reach the prompt)."""
    kept: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            kept.append({"type": kind, "role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            kept.append({"type": kind, "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"]})
        elif kind == "function_call_output":
            kept.append({"type": kind, "call_id": item["call_id"], "output": _text(item["output"])})
    return kept


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or part.get("refusal") or "" for part in content)


# chat's message index is not the input's (instructions and history come first): `messages[k]` is `input`
_CHAT_PARAMS = ((re.compile(r"^messages[\w.\[\]]*"), "input"),
                (re.compile(r"^max_completion_tokens\b"), "max_output_tokens"),
                (re.compile(r"^max_tokens\b"), "max_output_tokens"), (re.compile(r"^response_format\b"), "text.format"),
                (re.compile(r"^tools\[(\d+)\]\.function\b"), r"tools[\1]"),
                (re.compile(r"^tool_choice\.function\b"), "tool_choice"))


def responses_param(param: str) -> str:
    """A chat request's field name as the Responses request spells it (`messages` → `input`)."""
    for pattern, replacement in _CHAT_PARAMS:
        param = pattern.sub(replacement, param)
    return param
