"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat path.

A request is translated into a chat completion request (`protocol_responses.py`) and submitted by
`OpenAIServingChat.start`, so it is validated, templated, constrained (tools, `text.format`) and
generated exactly as chat; an error names the Responses field (`input`, `text.format`,
`max_output_tokens`, `tools[0].parameters`). The generated text becomes output items
(`response_output.py`): as one JSON response, or as typed server-sent events (`event: TYPE` and
`data: {...}` with a `sequence_number`) from `response.created` to `response.completed`
(`response.incomplete` when cut by `max_output_tokens`, `response.failed` when generation fails).

With `store` (the default, as in OpenAI) the finished response and its conversation are kept in
the bounded `ResponseStore`; `previous_response_id` continues that conversation (its instructions
are not carried over, as in OpenAI).
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastdeploy_lp.engine.request import RequestOutput
from fastdeploy_lp.entrypoints.openai.errors import OpenAIError, bad_request, from_validation_error, renamed
from fastdeploy_lp.entrypoints.openai.protocol import ChatCompletionRequest
from fastdeploy_lp.entrypoints.openai.protocol_responses import (ResponsesRequest, prompt_items,
                                                                 responses_param)
from fastdeploy_lp.entrypoints.openai.response_output import OutputBuilder, new_id
from fastdeploy_lp.entrypoints.openai.responses_store import ResponseStore
from fastdeploy_lp.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from fastdeploy_lp.entrypoints.openai.serving_engine import SSEResponse, final_outputs
from fastdeploy_lp.entrypoints.openai.tool_parser import ToolCallParser
from fastdeploy_lp.reasoning import ReasoningStream
from fastdeploy_lp.sampling_params import SamplingParams

_STATUS = {"stop": "completed", "length": "incomplete", "error": "failed", "abort": "incomplete"}


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore):
        self.chat, self.store = chat, store

    async def create(self, req: ResponsesRequest, raw: Request, headers: dict[str, str]) -> Response:
        history = self._history(req.previous_response_id)
        chat_req = _chat_request(req, history)
        backend = self.chat.custom_backend(chat_req)
        if backend is not None and backend.constrained_generator is not None:
            raise bad_request(f"custom guided decoding backend {backend.name!r} rewrites chat completions; "
                              "it cannot serve /v1/responses", param="guided_decoding_backend")
        try:
            run = await self.chat.start(chat_req)
        except OpenAIError as e:
            blamed = self.chat.blame(e, "instructions", req.instructions)
            raise (blamed if blamed is not e else _renamed(e)) from None
        shape = _Shape(self, req, history, run)
        if req.stream:
            return SSEResponse(shape.events(), [run.stream], headers=headers)
        final = (await final_outputs([run.stream], raw))[0][0]
        shape.builder.feed(final.outputs.text)
        response = shape.finish(final)
        return JSONResponse(response, headers=headers)

    def render(self, req: ResponsesRequest) -> tuple[list[int], SamplingParams]:
        """The chat request `req` becomes, rendered (POST /v1/responses/render); nothing is run."""
        try:
            return self.chat.render(_chat_request(req, self._history(req.previous_response_id)))
        except OpenAIError as e:
            blamed = self.chat.blame(e, "instructions", req.instructions)
            raise (blamed if blamed is not e else _renamed(e)) from None

    def retrieve(self, response_id: str) -> dict[str, Any]:
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _history(self, previous_id: str | None) -> list[dict[str, Any]]:
        if previous_id is None:
            return []
        entry = self.store.get(previous_id)
        if entry is None:
            raise bad_request(f"previous_response_id: no stored response {previous_id!r} (never stored with "
                              "store: true, deleted, or evicted from the bounded store)",
                              param="previous_response_id", code="previous_response_not_found")
        return entry.conversation


class _Shape:
    """One response's object, output items and events, from the engine's outputs."""

    def __init__(self, serving: OpenAIServingResponses, req: ResponsesRequest, history: list[dict], run: ChatRun):
        self.serving, self.req, self.run = serving, req, run
        self.conversation = history + prompt_items(req.input_items())
        chat = serving.chat
        reasoning = ReasoningStream(chat.reasoning, run.thinking) if run.thinking is not None else None
        self.builder = OutputBuilder(reasoning, ToolCallParser(**run.reader) if run.reader is not None else None)
        self.response = _response_object(req, run.answer_model)
        self.closing: list[dict[str, Any]] = []  # the events `finish` ended the output with
        self.sequence = 0

    def finish(self, final: RequestOutput) -> dict[str, Any]:
        """Close the output, fill in status and usage, store the response; the events of the end."""
        o = final.outputs
        status = _STATUS.get(o.finish_reason, "completed")
        self.closing = self.builder.finish("incomplete" if status == "incomplete" else "completed")
        r = self.response
        r.update(status=status, output=self.builder.items, completed_at=int(time.time()),
                 usage=self._usage(len(final.prompt_token_ids), len(o.token_ids)))
        if status == "incomplete":
            r["incomplete_details"] = {"reason": "max_output_tokens"}
        if o.closed_on_length:  # structured_outputs.close_on_length closed the JSON: the text parses
            r["closed_on_length"] = True
        elif status == "failed":
            r["error"] = {"code": "server_error", "message": o.error or "generation failed"}
        if self.req.store:
            self.serving.store.put(r, self.conversation + prompt_items(self.builder.items))
        return r

    def _usage(self, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
        thought = self.builder.reasoning_text()
        # re-tokenized: the engine does not tell which output tokens were reasoning
        reasoning_tokens = len(self.serving.chat.tokenizer.encode(thought, add_special_tokens=False)) if thought else 0
        return {"input_tokens": prompt_tokens, "output_tokens": output_tokens,
                "total_tokens": prompt_tokens + output_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output_tokens)}}

    async def events(self) -> AsyncIterator[str]:
        in_progress = dict(self.response, status="in_progress")
        yield self._event({"type": "response.created", "response": in_progress})
        yield self._event({"type": "response.in_progress", "response": in_progress})
        final = None
        try:
            async for out in self.run.stream:
                for event in self.builder.feed(out.outputs.delta_text):
                    yield self._event(event)
                final = out
        except Exception as e:  # the engine stopped under us: tell the client and end the stream
            yield self._event({"type": "error", "code": "server_error", "message": str(e) or type(e).__name__,
                               "param": None})
            return
        if final is None:
            return
        response = self.finish(final)
        for event in self.closing:
            yield self._event(event)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response["status"], "response.failed")
        yield self._event({"type": kind, "response": response})

    def _event(self, event: dict[str, Any]) -> str:
        event["sequence_number"] = self.sequence
        self.sequence += 1
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event['type']}\ndata: {data}\n\n"


def _chat_request(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(req.chat_body(history))
    except ValidationError as e:
        raise _renamed(from_validation_error(e)) from None


def _renamed(error: OpenAIError) -> OpenAIError:
    """An error from the chat path, naming the Responses request's field."""
    return error if error.param is None else renamed(error, responses_param(error.param))


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"response_id: no stored response {response_id!r} (never stored, deleted, or evicted "
                            "from the bounded store)", param="response_id", code="response_not_found")


def _response_object(req: ResponsesRequest, model: str) -> dict[str, Any]:
    tc = req.tool_choice
    return {"id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": model, "output": [], "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "temperature": req.temperature, "top_p": req.top_p,
            "tools": req.tools_out(), "tool_choice": tc.model_dump() if hasattr(tc, "model_dump") else (tc or "auto"),
            "parallel_tool_calls": req.parallel_tool_calls is not False, "text": req.text_out(),
            "reasoning": req.reasoning.model_dump(exclude_none=True) if req.reasoning else None,
            "store": bool(req.store), "metadata": req.metadata or {}, "user": req.user, "truncation": "disabled",
            "usage": None}
