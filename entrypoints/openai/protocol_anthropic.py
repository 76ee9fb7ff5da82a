"""Request models of POST /v1/messages (Anthropic's Messages API), and their translation into the
chat request every other endpoint runs through (`to_chat_request`), so a Messages request meets
the same validators, chat template, tool-call grammar and engine path as /v1/chat/completions.

    system                         → a "system" message first
    user text blocks               → a "user" message (its text blocks joined, as chat text parts are)
    user tool_result blocks        → "tool" messages (tool_call_id = tool_use_id; is_error prefixes "Error: ")
    assistant text / tool_use      → an "assistant" message with content / tool_calls (input as JSON)
    assistant thinking blocks      → dropped (earlier turns' reasoning is not replayed)
    tools[].input_schema           → tools[].function.parameters
    tool_choice auto/any/tool/none → "auto" / "required" / the named function / "none";
                                     disable_parallel_tool_use → parallel_tool_calls false
    stop_sequences, top_k, ...     → stop, top_k, ...
    thinking {"type"}              → chat_template_kwargs.enable_thinking (unless set there)
    thinking.budget_tokens         → logits_processors_args.thinking_budget (ThinkingBudgetLogitsProcessor)

Images, documents, server tools (web search, code execution, ...), `mcp_servers` and `container`
are a 400. `cache_control` is accepted anywhere and needs nothing: prompt prefixes are cached
automatically. `metadata` is accepted and not used.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fastdeploy_lp.entrypoints.openai.protocol import ChatCompletionRequest
from fastdeploy_lp.entrypoints.openai.protocol_constraints import refuse_constraint_fields
from fastdeploy_lp.sampling_params import INT32_MAX

_STRICT = ConfigDict(extra="allow", strict=True, populate_by_name=True)

_BLOCK_FIELDS = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",),
                 "thinking": ("thinking",), "redacted_thinking": ("data",)}


class TextBlock(BaseModel):
    """A text block inside a tool_result (images there are not supported)."""

    model_config = _STRICT
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None


class ContentBlock(BaseModel):
    """One block of a message's content; which fields it needs depends on `type`."""

    model_config = _STRICT
    type: str = Field(description="text, tool_use (assistant), tool_result (user), thinking, redacted_thinking.")
    text: str | None = None
    id: str | None = Field(None, description="tool_use: the call's id, answered by a tool_result's tool_use_id.")
    name: str | None = None
    input: dict[str, Any] | None = Field(None, description="tool_use: the call's arguments.")
    tool_use_id: str | None = None
    content: str | list[TextBlock] | None = Field(None, description="tool_result: text or text blocks.")
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    cache_control: dict[str, Any] | None = Field(None, description="Accepted; prefixes are cached automatically.")

    @model_validator(mode="after")
    def _supported(self):
        if self.type not in _BLOCK_FIELDS:
            raise ValueError(f"{self.type!r} blocks are not supported; this server is text-only and reads "
                             "text, tool_use, tool_result and thinking blocks")
        for name in _BLOCK_FIELDS[self.type]:
            if getattr(self, name) is None:
                raise ValueError(f"a {self.type} block needs {name!r}")
        return self

    def result_text(self) -> str:
        """A tool_result's content as one string."""
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {text}" if self.is_error else text


class AnthropicMessage(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self):
        wrong = {"user": ("tool_use",), "assistant": ("tool_result",)}[self.role]
        for block in self.content if isinstance(self.content, list) else []:
            if block.type in wrong:
                raise ValueError(f"a {block.type} block cannot be in a {self.role} message")
        return self

    def to_chat(self) -> list[dict[str, Any]]:
        """This turn as chat messages (a user turn with tool results becomes several)."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        if self.role == "assistant":
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                     for b in self.content if b.type == "tool_use"]
            text = [{"type": "text", "text": b.text} for b in self.content if b.type == "text"]
            # content "" rather than None with calls: templates that concatenate it would fail on None
            return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
        out, text = [], []
        for block in self.content:  # tool results and text keep their order
            if block.type == "tool_result":
                if text:
                    out.append({"role": "user", "content": text})
                    text = []
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.result_text()})
            elif block.type == "text":
                text.append({"type": "text", "text": block.text})
        if text or not out:
            out.append({"role": "user", "content": text})
        return out


class AnthropicTool(BaseModel):
    model_config = _STRICT
    type: str | None = Field(None, description="'custom' or left out; server tools are not supported.")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="JSON schema of the tool's input (an object).")
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _custom_only(self):
        if self.type not in (None, "custom"):
            raise ValueError(f"server tools ({self.type!r}) are not supported; give custom tools with "
                             "name, description and input_schema")
        return self


class AnthropicToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="With type 'tool': the tool to call.")
    disable_parallel_tool_use: bool | None = Field(None, description="At most one call (exactly one with any/tool).")

    @model_validator(mode="after")
    def _name_for_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("'name' is required with type 'tool', and only then")
        return self


class ThinkingConfig(BaseModel):
    model_config = _STRICT
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="With type 'enabled': most tokens the model thinks "
                                                               "before </think> is forced (needs the server's "
                                                               "ThinkingBudgetLogitsProcessor).")

    @model_validator(mode="after")
    def _budget_when_enabled(self):
        if self.budget_tokens is not None and self.type != "enabled":
            raise ValueError(f"budget_tokens is only for type 'enabled', not {self.type!r}")
        return self


class AnthropicMessagesRequest(BaseModel):
    """POST /v1/messages."""

    model_config = _STRICT

    model: str = Field(description="The served model name (see GET /v1/models), or 'default'.")
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1, description="Most tokens to generate.")
    system: str | list[ContentBlock] | None = Field(None, description="The system prompt: text or text blocks.")
    stop_sequences: list[str] | None = Field(None, description="Stop strings; the one that matched is "
                                                               "`stop_sequence` in the answer.")
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=2**31 - 1, description="0 disables.")
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = Field(None, description="With --reasoning-parser: reasoning comes back as "
                                                              "thinking blocks; this sets the template's "
                                                              "enable_thinking, and budget_tokens the thinking "
                                                              "budget.")
    metadata: dict[str, Any] | None = Field(None, description="Accepted (user_id); not used.")
    cache_control: dict[str, Any] | None = Field(None, description="Accepted; prefixes are cached automatically.")
    service_tier: str | None = Field(None, description="Accepted; there is one tier.")
    mcp_servers: list[Any] | None = Field(None, description="Not supported (400 when set).")
    container: Any = Field(None, description="Not supported (400 when set).")
    output_config: dict[str, Any] | None = Field(None, description="Its `format` (structured output) is not "
                                                                   "supported (400); `effort` is accepted.")
    output_format: dict[str, Any] | None = Field(None, description="Not supported (400 when set).")
    # this server's extensions, as on /v1/chat/completions
    logits_processors_args: dict[str, Any] | None = Field(
        None, description="Per-request arguments of the registered logits processors; see GET /v1/logits_processors.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra variables for the chat template.")

    @model_validator(mode="after")
    def _checks(self):
        for name in ("mcp_servers", "container"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not supported by this server")
        if self.output_format is not None or (self.output_config or {}).get("format") is not None:
            field = "output_format" if self.output_format is not None else "output_config.format"
            raise ValueError(f"{field}: structured output is not supported on /v1/messages; use "
                             "/v1/chat/completions with response_format")
        refuse_constraint_fields(self.model_extra, (), "use /v1/chat/completions with response_format")
        if isinstance(self.system, list) and any(b.type != "text" for b in self.system):
            raise ValueError("system: only text blocks")
        if self.messages[-1].role == "assistant":
            raise ValueError(f"messages[{len(self.messages) - 1}]: continuing a final assistant turn (prefill) is "
                             "not supported; end with a user turn")
        if self.tool_choice is not None and self.tool_choice.type != "none" and not self.tools:
            raise ValueError("tool_choice: only allowed when tools are given")
        given = (self.logits_processors_args or {}).get("thinking_budget")
        if self.thinking_budget is not None and given is not None and given != self.thinking_budget:
            raise ValueError(f"thinking.budget_tokens: {self.thinking_budget} disagrees with "
                             f"logits_processors_args.thinking_budget {given!r}; give one of them")
        return self

    @property
    def thinking_budget(self) -> int | None:
        """`thinking.budget_tokens`, the budget ThinkingBudgetLogitsProcessor enforces."""
        return self.thinking.budget_tokens if self.thinking is not None else None

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat request this one means (see the module doc). Raises pydantic's ValidationError."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:
            kwargs.setdefault("enable_thinking", self.thinking.type != "disabled")
        args = self.logits_processors_args
        if self.thinking_budget is not None:
            args = {**(args or {}), "thinking_budget": self.thinking_budget}
        body = {"model": self.model, "messages": self._chat_messages(), "max_tokens": self.max_tokens,
                "stop": self.stop_sequences, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "logits_processors_args": args,
                "chat_template_kwargs": kwargs or None}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                               "parameters": t.input_schema}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type, {"type": "function", "function": {"name": choice.name}})
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})

    def system_text(self) -> str:
        return self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])

    def _chat_messages(self) -> list[dict[str, Any]]:
        out = []
        if self.system:
            out.append({"role": "system", "content": self.system_text()})
        for message in self.messages:
            out += message.to_chat()
        return out


class AnthropicCountTokensRequest(AnthropicMessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request's fields; `max_tokens` may be left out."""

    max_tokens: int = Field(1, ge=1, description="Not needed to count the prompt.")
