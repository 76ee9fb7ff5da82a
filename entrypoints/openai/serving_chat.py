"""POST /v1/chat/completions: render the chat template, generate, answer as JSON or SSE chunks.

With `tools` the output is constrained by the guided-decoding module's `tool_call_constraint`
(`tool_choice` and `parallel_tool_calls` decide the grammar; "none" makes the call syntax
impossible) and, unless `tool_choice` is "none", read by its `ToolCallParser`: the grammar's own
structure (`<function=NAME>`, one JSON value, `</function>`), so a parsed call's arguments are the
JSON the grammar let through. A complete call comes back as OpenAI `tool_calls`, with
`finish_reason: "tool_calls"` when the output ended on its own; a call cut by `max_tokens` is not
in `tool_calls` (`finish_reason: "length"`).

Streamed, a choice with tools follows OpenAI's shape as the text is generated: content deltas for
the text before a call (holding back only what could still become `<function=`, and whitespace
until more text follows), then per call `{"tool_calls": [{"index": k, "id", "type": "function",
"function": {"name", "arguments": ""}}]}` once its name is complete and
`{"tool_calls": [{"index": k, "function": {"arguments": piece}}]}` as its arguments are
generated; the pieces join to the final arguments.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastdeploy_lp.engine.protocol import RequestStream
from fastdeploy_lp.entrypoints.openai.errors import OpenAIError, renamed
from fastdeploy_lp.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ToolDefinition
from fastdeploy_lp.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, SSEResponse, choice_error,
                                                             engine_error_event, final_outputs, sse, usage,
                                                             value_errors_as_400)
from fastdeploy_lp.entrypoints.openai.tool_parser import ToolCallParser, parse_tool_calls
from fastdeploy_lp.processors.custom_backends import CustomBackend
from fastdeploy_lp.processors.guided.tool_calls import parameters_paths, tool_call_constraint
from fastdeploy_lp.reasoning import ReasoningState, ReasoningStream, get_reasoning_parser
from fastdeploy_lp.sampling_params import SamplingParams
from fastdeploy_lp.tokenizer.chat_template import render_chat_prompt
from fastdeploy_lp.tokenizer.tokenizer import Tokenizer


@dataclass
class ChatRun:
    """A chat request on its way through the engine: what shaping its answer needs."""

    stream: RequestStream
    n: int
    backend: CustomBackend | None
    reader: dict | None               # `ToolCallParser` kwargs; None: no calls are read from the output
    thinking: ReasoningState | None   # where the output starts; None: no reasoning parser (or not split)
    prefix: str                       # the echoed partial answer
    answer_model: str                 # the name the answer gives: the served model's, or the adapter's
    include_reasoning: bool = True    # False: the reasoning is split off and dropped


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reasoning = get_reasoning_parser(self.engine.fd_config.reasoning_parser)

    async def create(self, req: ChatCompletionRequest, raw: Request, headers: dict[str, str]) -> Response:
        run = await self.start(req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(request_id, run, include_usage, req.logprobs)
            return SSEResponse(await self.finish_with_backend(run.backend, body, raw), [run.stream], headers=headers)
        finals = (await final_outputs([run.stream], raw))[0]
        parse = functools.partial(parse_tool_calls, **run.reader) if run.reader else None
        response = await self.finish_with_backend(
            run.backend, self._response(request_id, finals, run, parse), raw)
        return JSONResponse(response, headers=headers)

    async def start(self, req: ChatCompletionRequest) -> ChatRun:
        """Validate `req`, submit it to the engine, and return what shaping its answer needs (the
        Responses endpoint shapes a translated chat request through this too)."""
        self.check_model(req.model)
        backend = self.custom_backend(req)
        tools_active = bool(req.tools) and req.tool_choice != "none"  # calls are read from the output
        tool_guided, guided, params, (prompt_ids, prompt_text) = self._prepare(req, backend)
        self.use_adapter(params, req.model)
        max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if backend is not None:
            constrained_by = req.constraint_field() if guided is not None else ("tools" if tools_active else None)
            await self.use_custom_backend(backend, req, params, constrained_by)
        renames = self.guided_renames("tools" if tool_guided is not None else req.constraint_field(),
                                      req.whitespace_field())
        renames.update({"prompt": "messages", "max_tokens": max_field})
        if tool_guided is not None:  # the constraint's tags are the tools, in order: errors name the tool
            renames.update(parameters_paths(req.tools_for_template(), req.tool_choice_value()))
        stream = await self.submit(prompt_ids, params, renames=renames)
        thinking = (self.reasoning.prompt_state(prompt_text)
                    if self.reasoning is not None and req.separate_reasoning is not False else None)
        reader = None
        if tools_active:  # how calls are read: only the tools' names, and one call when parallel is off
            reader = {"names": [t.function.name for t in req.tools],
                      "max_calls": 1 if req.parallel_tool_calls is False else None}
        return ChatRun(stream, params.n, backend, reader, thinking, _echo_prefix(req), self.answer_model(req.model),
                       include_reasoning=req.include_reasoning is not False)

    def render(self, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the sampling parameters `req` would run with, validated as
        `start` validates it; nothing is submitted (POST /v1/chat/completions/render)."""
        self.check_model(req.model)
        _, _, params, (prompt_ids, _) = self._prepare(req, self.custom_backend(req))
        return prompt_ids, params

    def _prepare(self, req: ChatCompletionRequest, backend: CustomBackend | None):
        """(tool constraint, constraint, sampling params, (prompt ids, prompt text)); 400s name the field."""
        with value_errors_as_400():
            tool_guided = self._tool_constraint(req) if req.tools and backend is None else None
            guided = req.guided_decoding(tool_guided)
            if backend is None:
                self.check_guided(guided, "tools" if tool_guided is not None else req.constraint_field())
            params = req.sampling_params(max_tokens=req.max_new_tokens, logprobs=req.num_logprobs,
                                         defaults=self.generation_defaults, guided=guided)
            return tool_guided, guided, params, self._prompt(req)

    # -- request → prompt -----------------------------------------------------------------------
    def _prompt(self, req: ChatCompletionRequest) -> tuple[list[int], str]:
        """The rendered prompt's token ids and text. Too long, the 400 names `tools` when their
        definitions alone fill the context, else `messages`."""
        try:
            with value_errors_as_400({"prompt": "messages"}):
                return chat_prompt(self.tokenizer, req.messages, req.tools,
                                   add_generation_prompt=req.add_generation_prompt,
                                   chat_template_kwargs=req.chat_template_kwargs,
                                   limit=self.engine.fd_config.max_model_len,
                                   continue_final_message=bool(req.continue_final_message))
        except OpenAIError as e:
            tools = json.dumps(req.tools_for_template(), ensure_ascii=False) if req.tools else None
            raise self.blame(e, "tools", tools) from None

    def blame(self, error: OpenAIError, field: str, text: str | None) -> OpenAIError:
        """A prompt too long to run (a 400 on `messages`) named as `field` when `text`, that part of
        the request alone, leaves no room in the context (tools, the Responses `instructions`, the
        Messages `system`); any other error as it is."""
        if error.param != "messages" or not text:
            return error
        limit = self.engine.fd_config.max_model_len
        try:
            fills = len(self.tokenizer.encode(text, limit=limit)) >= limit
        except ValueError:
            fills = True
        return renamed(error, field) if fills else error

    def _tool_constraint(self, req: ChatCompletionRequest):
        choice = req.tool_choice_value()
        if choice == "none":
            if not self.guided_available or req.guided_decoding() is not None:
                return None  # the request's own constraint (or, with guided decoding off, none) decides
            return tool_call_constraint(req.tools_for_template(), "none")
        constraint = tool_call_constraint(req.tools_for_template(), choice,
                                          parallel=req.parallel_tool_calls is not False)
        if constraint is not None and not self.guided_available and choice == "auto":
            return None  # the model may still answer in the tool-call format; it is parsed either way
        return constraint

    # -- non-streaming --------------------------------------------------------------------------
    def _response(self, request_id: str, finals: dict[int, Any], run: ChatRun, parse) -> dict:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for index in sorted(finals):
            out = finals[index]
            o = out.outputs
            prompt_tokens = len(out.prompt_token_ids)
            completion_tokens += len(o.token_ids)
            text, message = run.prefix + o.text, {"role": "assistant"}
            if run.thinking is not None:  # a reasoning parser is on: the answer is what follows the reasoning
                reasoning, text = self.reasoning.split(text, run.thinking)
                if run.include_reasoning:  # as streamed: an empty block sends nothing
                    message["reasoning_content"] = reasoning or None
            content, tool_calls, finish = _split_tool_calls(text, o.finish_reason, parse)
            message["content"] = content
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": index, "message": message,
                      "logprobs": self.chat_logprobs(o.logprobs) if o.logprobs is not None else None,
                      "finish_reason": finish}
            if (err := choice_error(o)) is not None:
                choice["error"] = err
            if o.closed_on_length:  # structured_outputs.close_on_length closed the JSON at max_tokens
                choice["closed_on_length"] = True
            choices.append(choice)
        response = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                    "model": run.answer_model, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}
        first = finals[min(finals)] if finals else None
        if first is not None and first.prompt_logprobs is not None:  # vLLM's field: the prompt is the choices'
            response["prompt_logprobs"] = self.vllm_prompt_logprobs(first.prompt_logprobs)
        return response

    # -- streaming ------------------------------------------------------------------------------
    async def _stream(self, request_id: str, run: ChatRun, include_usage: bool,
                      want_logprobs: bool) -> AsyncIterator[str]:
        chunks = _ChatChunks(self, request_id, run, include_usage, want_logprobs)
        for i in range(run.n):
            for chunk in chunks.opening(i, run.prefix):
                yield chunk
        try:
            async for out in run.stream:
                for chunk in chunks.output(out):
                    yield chunk
        except Exception as e:  # the engine stopped under us: tell the client, then end the stream
            yield engine_error_event(e)
            yield SSE_DONE
            return
        if include_usage:
            yield chunks.usage()
        yield SSE_DONE


class _ChatChunks:
    """The SSE chunks of one streamed chat completion, one `RequestOutput` at a time: per choice,
    reasoning deltas (with a reasoning parser), tool-call deltas (with tools) or content deltas,
    logprobs riding on the next delta sent, and the finish chunk."""

    def __init__(self, serving: OpenAIServingChat, request_id: str, run: ChatRun, include_usage: bool,
                 want_logprobs: bool):
        self.serving = serving
        self.request_id, self.created, self.model = request_id, int(time.time()), run.answer_model
        self.include_usage, self.want_logprobs = include_usage, want_logprobs
        n = run.n
        self.parsers = [ToolCallParser(**run.reader) for _ in range(n)] if run.reader is not None else None
        self.reasoning = ([ReasoningStream(serving.reasoning, run.thinking) for _ in range(n)]
                          if run.thinking is not None else None)
        self.include_reasoning = run.include_reasoning
        self.sent_logprobs = [0] * n
        self.prompt_tokens, self.completion = 0, [0] * n

    def chunk(self, index, delta, finish_reason=None, logprobs=None, error=None, closed_on_length=False) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if error is not None:
            choice["error"] = error
        if closed_on_length:
            choice["closed_on_length"] = True
        data = {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [choice]}
        if self.include_usage:
            data["usage"] = None
        return sse(data)

    def usage(self) -> str:
        return sse({"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "choices": [], "usage": usage(self.prompt_tokens, sum(self.completion))})

    def opening(self, i: int, prefix: str) -> list[str]:
        """Choice `i`'s role chunk, then the echoed prefix (split like the output that follows)."""
        out = [self.chunk(i, {"role": "assistant", "content": ""})]
        prefix_answer = prefix
        if self.reasoning is not None and prefix:
            thought, prefix_answer = self.reasoning[i].feed(prefix)
            if thought and self.include_reasoning:
                out.append(self.chunk(i, {"reasoning_content": thought}))
        if prefix_answer and self.parsers is None:
            out.append(self.chunk(i, {"content": prefix_answer}))
        elif prefix_answer:
            out += [self.chunk(i, delta) for delta in _tool_deltas(self.parsers[i].feed(prefix_answer))]
        return out

    def output(self, out) -> list[str]:
        """The chunks for one engine output of one choice (its finish chunk when it ended)."""
        o = out.outputs
        i = o.index
        self.prompt_tokens = len(out.prompt_token_ids)
        self.completion[i] = len(o.token_ids)
        ending = out.finished and o.finish_reason != "abort"
        answer, chunks = o.delta_text, []
        if self.reasoning is not None:  # reasoning deltas first; the rest is the answer
            thought, answer = self.reasoning[i].feed(answer, final=ending)
            if thought and self.include_reasoning:
                chunks.append(self.chunk(i, {"reasoning_content": thought}, logprobs=self.new_logprobs(o)))
        if self.parsers is not None:  # tools: content and calls as the parser reads them
            events = self.parsers[i].feed(answer)
            if ending:
                events += self.parsers[i].finish()
            for delta in _tool_deltas(events):  # logprobs ride on the next delta sent
                chunks.append(self.chunk(i, delta, logprobs=self.new_logprobs(o)))
        else:
            logprobs = None
            if self.want_logprobs and o.logprobs is not None:
                logprobs = self.serving.chat_logprobs(o.logprobs[self.sent_logprobs[i]:])
                self.sent_logprobs[i] = len(o.logprobs)
            if answer or (logprobs and logprobs["content"]):
                chunks.append(self.chunk(i, {"content": answer}, logprobs=logprobs))
        if ending:
            finish = o.finish_reason
            if self.parsers is not None and finish == "stop" and self.parsers[i].all_calls_complete:
                finish = "tool_calls"
            chunks.append(self.chunk(i, {}, finish_reason=finish, logprobs=self.new_logprobs(o), error=choice_error(o),
                                     closed_on_length=o.closed_on_length))
        return chunks

    def new_logprobs(self, o):
        """The logprobs of choice `o` not sent yet (None when there are none or none were asked for)."""
        if not self.want_logprobs or o.logprobs is None or len(o.logprobs) <= self.sent_logprobs[o.index]:
            return None
        logprobs = self.serving.chat_logprobs(o.logprobs[self.sent_logprobs[o.index]:])
        self.sent_logprobs[o.index] = len(o.logprobs)
        return logprobs


def _echo_prefix(req: ChatCompletionRequest) -> str:
    last = req.messages[-1]
    if req.echo and last.role == "assistant":
        return last.for_template()["content"]
    return ""


def _tool_deltas(events: list[tuple]) -> list[dict]:
    """OpenAI stream deltas for `ToolCallParser` events (an "end" event needs none)."""
    deltas = []
    for event in events:
        kind = event[0]
        if kind == "content":
            deltas.append({"content": event[1]})
        elif kind == "call":
            deltas.append({"tool_calls": [{"index": event[1], "id": _call_id(), "type": "function",
                                           "function": {"name": event[2], "arguments": ""}}]})
        elif kind == "arguments":
            deltas.append({"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]})
    return deltas


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage], tools: list[ToolDefinition] | None, *,
                add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None,
                add_special_tokens: bool = False, limit: int | None = None,
                continue_final_message: bool = False) -> tuple[list[int], str]:
    """The ids and text of a chat's prompt, as /v1/chat/completions renders and encodes it (the
    template writes the special tokens, so none are added by default); /tokenize and
    /v1/messages/count_tokens count with it. `limit`: refuse a text certainly longer than that many
    tokens without encoding all of it. Raises ValueError("field: ...")."""
    text = render_chat_prompt(tokenizer, [m.for_template() for m in messages],
                              add_generation_prompt=add_generation_prompt,
                              tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
                              chat_template_kwargs=chat_template_kwargs,
                              continue_final_message=continue_final_message)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens, limit=limit), text


def _split_tool_calls(text: str, finish: str | None, parse) -> tuple[str | None, list[dict] | None, str | None]:
    """(content, OpenAI tool_calls or None, finish_reason) of one finished choice."""
    if parse is None or finish in ("error", "abort"):
        return text, None, finish
    content, calls = parse(text)  # content: the text outside calls, stripped as streamed
    if not calls:
        return content or "", None, finish
    # a call cut by max_tokens is in tool_calls with the arguments written so far, as streamed
    tool_calls = [{"id": _call_id(), "type": "function",
                   "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    called = finish == "stop" and all(c["complete"] for c in calls)
    return content, tool_calls, "tool_calls" if called else finish
