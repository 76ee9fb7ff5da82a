"""POST /v1/messages: an Anthropic Messages request, run as the chat request it translates to
(`protocol_anthropic.py`), answered as a Message or as Anthropic's server-sent events.

The chat path validates and submits (`OpenAIServingChat.start`); the answer is shaped here from
the engine's outputs with the chat path's readers: the reasoning parser's split (thinking blocks)
and the tool-call grammar's parser (tool_use blocks whose input is the JSON the grammar let
through). Streamed, the events are

    message_start → (content_block_start → content_block_delta* → content_block_stop)* →
    message_delta (stop_reason, stop_sequence, usage) → message_stop

with `text_delta`, `thinking_delta` and `input_json_delta` deltas; a failure after the stream
started is an `error` event. `message_start` waits for the first output so its `usage.input_tokens`
is the prompt the engine ran.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, AsyncIterator

from pydantic import ValidationError
from pydantic_core import from_json
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastdeploy_lp.engine.protocol import EngineNotServingError
from fastdeploy_lp.engine.request import RequestOutput
from fastdeploy_lp.entrypoints.openai.errors import OpenAIError, bad_request, from_validation_error
from fastdeploy_lp.entrypoints.openai.errors_anthropic import anthropic_error_body
from fastdeploy_lp.entrypoints.openai.protocol import ChatCompletionRequest
from fastdeploy_lp.entrypoints.openai.protocol_anthropic import AnthropicCountTokensRequest, AnthropicMessagesRequest
from fastdeploy_lp.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat, chat_prompt
from fastdeploy_lp.entrypoints.openai.serving_engine import SSEResponse, final_outputs, value_errors_as_400
from fastdeploy_lp.entrypoints.openai.tool_parser import ToolCallParser, parse_tool_calls
from fastdeploy_lp.reasoning import ReasoningStream
from fastdeploy_lp.sampling_params import SamplingParams


class AnthropicServingMessages:
    """The Messages API over the chat serving object (`app.state.chat`)."""

    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    async def create(self, req: AnthropicMessagesRequest, raw: Request, headers: dict[str, str]) -> Response:
        if req.thinking_budget is not None:
            self._check_thinking_budget()
        chat_req = _chat_request(req)
        backend = self.chat.custom_backend(chat_req)
        if backend is not None and backend.constrained_generator is not None:
            raise bad_request(f"guided_decoding_backend: the server's backend {backend.name!r} rewrites "
                              "OpenAI-shaped answers, which /v1/messages does not give; use /v1/chat/completions")
        try:
            run = await self.chat.start(chat_req)
        except OpenAIError as e:
            raise self.chat.blame(e, "system", req.system_text()) from None
        message_id = f"msg_{uuid.uuid4().hex}"
        if req.stream:
            return SSEResponse(self._events(message_id, run), [run.stream], headers=headers)
        out = (await final_outputs([run.stream], raw))[0][0]
        if out.outputs.finish_reason == "error":
            raise OpenAIError(500, out.outputs.error or "generation failed", code="generation_error")
        return JSONResponse(self._message(message_id, out, run), headers=headers)

    def render(self, req: AnthropicMessagesRequest) -> tuple[list[int], SamplingParams]:
        """The chat request `req` becomes, rendered (POST /v1/messages/render); nothing is run."""
        try:
            return self.chat.render(_chat_request(req))
        except OpenAIError as e:
            raise self.chat.blame(e, "system", req.system_text()) from None

    def _check_thinking_budget(self) -> None:
        """`budget_tokens` is enforced by a processor reading `thinking_budget`; a server without one
        would let the model think past the budget, so the request is refused instead."""
        processors = self.chat.engine.processors
        if not any("thinking_budget" in (type(p).declared_keys() or ()) for p in processors):
            raise bad_request("thinking.budget_tokens: this server enforces no thinking budget; start it with "
                              "--logits-processors ThinkingBudgetLogitsProcessor, or leave budget_tokens out "
                              "(max_tokens then bounds the thinking)", param="thinking.budget_tokens")

    async def count_tokens(self, req: AnthropicCountTokensRequest, headers: dict[str, str]) -> Response:
        """`{"input_tokens"}`: the prompt /v1/messages would run, rendered and encoded the same way."""
        chat_req = _chat_request(req)
        self.chat.check_model(chat_req.model)
        with value_errors_as_400():  # on a worker, as /tokenize: a count may run to megabytes of text
            ids, _ = await asyncio.to_thread(chat_prompt, self.chat.tokenizer, chat_req.messages, chat_req.tools,
                                             chat_template_kwargs=chat_req.chat_template_kwargs)
        return JSONResponse({"input_tokens": len(ids)}, headers=headers)

    def _message(self, message_id: str, out: RequestOutput, run: ChatRun) -> dict:
        o = out.outputs
        thought, text = None, o.text
        if run.thinking is not None:
            thought, text = self.chat.reasoning.split(text, run.thinking)
        calls = []
        if run.reader is not None:
            text, calls = parse_tool_calls(text, **run.reader)
        content = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
        if text or not calls:
            content.append({"type": "text", "text": text or ""})
        content += [{"type": "tool_use", "id": _tool_use_id(), "name": c["name"], "input": _tool_input(c)}
                    for c in calls]
        called = bool(calls) and all(c["complete"] for c in calls)
        stop_reason, stop_sequence = _stop_reason(o.finish_reason, called, o.stop_reason)
        return {"id": message_id, "type": "message", "role": "assistant", "model": run.answer_model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": len(out.prompt_token_ids), "output_tokens": len(o.token_ids)}}

    async def _events(self, message_id: str, run: ChatRun) -> AsyncIterator[str]:
        events = _MessageEvents(self.chat, message_id, run)
        try:
            async for out in run.stream:
                for event in events.output(out):
                    yield event
        except Exception as e:  # the engine stopped under us: say so, and end the stream
            status = 503 if isinstance(e, EngineNotServingError) else 500
            yield _event(anthropic_error_body(OpenAIError(status, str(e) or type(e).__name__)))


class _MessageEvents:
    """Anthropic's stream events for one request, one engine output at a time."""

    def __init__(self, chat: OpenAIServingChat, message_id: str, run: ChatRun):
        self.message_id, self.model = message_id, run.answer_model
        self.reasoning = ReasoningStream(chat.reasoning, run.thinking) if run.thinking is not None else None
        self.parser = ToolCallParser(**run.reader) if run.reader is not None else None
        self.started = False
        self.index = -1          # the newest content block
        self.open: str | None = None  # the type of the block still open

    def output(self, out: RequestOutput) -> list[str]:
        o = out.outputs
        events = [] if self.started else [self._message_start(len(out.prompt_token_ids))]
        self.started = True
        ending = out.finished and o.finish_reason != "abort"
        if ending and o.finish_reason == "error":
            return events + [_event(anthropic_error_body(OpenAIError(500, o.error or "generation failed")))]
        answer = o.delta_text
        if self.reasoning is not None:
            thought, answer = self.reasoning.feed(answer, final=ending)
            if thought:
                events += self._delta("thinking", {"type": "thinking_delta", "thinking": thought})
        if self.parser is None:
            if answer:
                events += self._delta("text", {"type": "text_delta", "text": answer})
        else:
            for kind, *rest in self.parser.feed(answer) + (self.parser.finish() if ending else []):
                events += self._tool_event(kind, rest)
        if ending:
            events += self._finish(out)
        return events

    def _tool_event(self, kind: str, rest: list) -> list[str]:
        if kind == "content":
            return self._delta("text", {"type": "text_delta", "text": rest[0]})
        if kind == "call":
            return self._open("tool_use", {"type": "tool_use", "id": _tool_use_id(), "name": rest[1], "input": {}})
        if kind == "arguments":
            return self._delta("tool_use", {"type": "input_json_delta", "partial_json": rest[1]})
        return []  # "end": the block closes when the next one opens or the message ends

    def _finish(self, out: RequestOutput) -> list[str]:
        o = out.outputs
        events = self._open("text", {"type": "text", "text": ""}) if self.index < 0 else []  # never no content
        events += self._close()
        calls = self.parser is not None and self.parser.all_calls_complete
        stop_reason, stop_sequence = _stop_reason(o.finish_reason, calls, o.stop_reason)
        events.append(_event({"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                                 "stop_sequence": stop_sequence},
                              "usage": {"input_tokens": len(out.prompt_token_ids),
                                        "output_tokens": len(o.token_ids)}}))
        return events + [_event({"type": "message_stop"})]

    def _message_start(self, input_tokens: int) -> str:
        return _event({"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}})

    def _delta(self, kind: str, delta: dict) -> list[str]:
        """`delta` on the open block of `kind`, opening one (an empty text or thinking block) if needed."""
        events = [] if self.open == kind else self._open(kind, {"type": kind, kind: ""} | (
            {"signature": ""} if kind == "thinking" else {}))
        return events + [_event({"type": "content_block_delta", "index": self.index, "delta": delta})]

    def _open(self, kind: str, block: dict) -> list[str]:
        events = self._close()
        self.index += 1
        self.open = kind
        return events + [_event({"type": "content_block_start", "index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event({"type": "content_block_stop", "index": self.index})]


def _chat_request(req: AnthropicMessagesRequest) -> ChatCompletionRequest:
    try:
        return req.to_chat_request()
    except ValidationError as e:  # the chat request's own checks (a tool_choice naming no tool, ...)
        raise from_validation_error(e) from None


def _stop_reason(finish: str | None, called: bool, stop_string: str | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) for the engine's finish reason."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def _tool_input(call: dict[str, str]) -> dict[str, Any]:
    """A tool_use block's `input`. A call cut by `max_tokens` has what its stream's `input_json_delta`
    pieces give when read as partial JSON, as Anthropic's SDK reads them (`{"city": "Par` is `{}`)."""
    if call["complete"]:
        return json.loads(call["arguments"])
    try:
        value = from_json(call["arguments"], allow_partial=True) if call["arguments"] else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _event(data: dict[str, Any]) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"
