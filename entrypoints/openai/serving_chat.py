"""POST /v1/chat/completions: render the chat template, generate, answer as JSON or SSE chunks.

With `tools` (and `tool_choice` other than "none") the output is constrained and parsed by the
guided-decoding module's `tool_call_constraint` / `parse_tool_calls`; a parsed call comes back as
OpenAI `tool_calls` with `finish_reason: "tool_calls"`. While tools are active a streamed answer
is buffered and sent at the end (content delta, then the tool_calls delta), because a call can
only be recognised once its text is complete.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.async_engine import RequestStream
from .protocol import ChatCompletionRequest
from .serving_engine import (SSE_DONE, OpenAIServing, SSEResponse, choice_error, engine_error_event,
                             final_outputs, sse, usage, value_errors_as_400)

from ...processors.guided.tool_calls import parse_tool_calls, tool_call_constraint


class OpenAIServingChat(OpenAIServing):
    async def create(self, req: ChatCompletionRequest, raw: Request, headers: dict[str, str]) -> Response:
        self.check_model(req.model)
        backend = self.custom_backend(req)
        tools_active = bool(req.tools) and req.tool_choice != "none"
        with value_errors_as_400():
            tool_guided = self._tool_constraint(req) if tools_active and backend is None else None
            guided = req.guided_decoding(tool_guided)
            if backend is None:
                self.check_guided(guided, "tools" if tool_guided is not None else req.constraint_field())
            max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            params = req.sampling_params(max_tokens=req.max_new_tokens, logprobs=req.num_logprobs,
                                         defaults=self.generation_defaults, guided=guided)
            prompt_ids = await asyncio.to_thread(self._prompt_ids, req)
        if backend is not None:
            await self.use_custom_backend(backend, req, params)
        if params.logprobs is not None:
            await self.warm_token_table()
        renames = self.guided_renames("tools" if tool_guided is not None else req.constraint_field(),
                                      req.whitespace_field())
        renames.update({"prompt": "messages", "max_tokens": max_field})
        stream = await self.submit(prompt_ids, params, renames=renames)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prefix = _echo_prefix(req)
        parse = parse_tool_calls if tools_active else None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(request_id, stream, params.n, prefix, parse, include_usage, req.logprobs)
            return SSEResponse(await self.finish_with_backend(backend, body, raw), [stream], headers=headers)
        finals = (await final_outputs([stream], raw))[0]
        response = await self.finish_with_backend(backend, self._response(request_id, finals, prefix, parse), raw)
        return JSONResponse(response, headers=headers)

    # -- request → prompt -----------------------------------------------------------------------
    def _prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        messages = [m.for_template() for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        for reserved in ("messages", "tools", "add_generation_prompt"):
            if reserved in kwargs:
                raise ValueError(f"chat_template_kwargs.{reserved}: set by the request itself, not here")
        for reserved in ("bos_token", "eos_token"):
            if reserved in kwargs:
                raise ValueError(f"chat_template_kwargs.{reserved}: set by the tokenizer; it cannot be overridden")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                      tools=req.tools_for_template(), **kwargs)
        except ValueError:
            raise
        except Exception as e:  # a template may fail in any way on odd input (e.g. None + str)
            raise ValueError(f"messages: the chat template failed: {type(e).__name__}: {e}") from None
        # The template already wrote any BOS it wants, as transformers does for chat prompts.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _tool_constraint(self, req: ChatCompletionRequest):
        choice = req.tool_choice_value()
        constraint = tool_call_constraint(req.tools_for_template(), choice)
        if constraint is not None and not self.guided_available and choice == "auto":
            return None  # the model may still answer in the tool-call format; it is parsed either way
        return constraint

    # -- non-streaming --------------------------------------------------------------------------
    def _response(self, request_id: str, finals: dict[int, Any], prefix: str, parse) -> dict:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for index in sorted(finals):
            out = finals[index]
            o = out.outputs
            prompt_tokens = len(out.prompt_token_ids)
            completion_tokens += len(o.token_ids)
            content, tool_calls, finish = _split_tool_calls(prefix + o.text, o.finish_reason, parse)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": index, "message": message,
                      "logprobs": self.chat_logprobs(o.logprobs) if o.logprobs is not None else None,
                      "finish_reason": finish}
            if (err := choice_error(o)) is not None:
                choice["error"] = err
            choices.append(choice)
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    # -- streaming ------------------------------------------------------------------------------
    async def _stream(self, request_id: str, stream: RequestStream, n: int, prefix: str, parse,
                      include_usage: bool, want_logprobs: bool) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.model_name

        def chunk(index, delta, finish_reason=None, logprobs=None, error=None):
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            if error is not None:
                choice["error"] = error
            data = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [choice]}
            if include_usage:
                data["usage"] = None
            return sse(data)

        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
            if prefix and parse is None:
                yield chunk(i, {"content": prefix})
        buffered = [prefix] * n
        sent_logprobs = [0] * n
        prompt_tokens, completion = 0, [0] * n
        try:
            async for out in stream:
                o = out.outputs
                i = o.index
                prompt_tokens = len(out.prompt_token_ids)
                completion[i] = len(o.token_ids)
                if parse is not None:  # tools: keep everything until the end
                    buffered[i] += o.delta_text
                else:
                    logprobs = None
                    if want_logprobs and o.logprobs is not None:
                        logprobs = self.chat_logprobs(o.logprobs[sent_logprobs[i]:])
                        sent_logprobs[i] = len(o.logprobs)
                    if o.delta_text or (logprobs and logprobs["content"]):
                        yield chunk(i, {"content": o.delta_text}, logprobs=logprobs)
                if not out.finished or o.finish_reason == "abort":
                    continue
                finish = o.finish_reason
                if parse is not None:
                    content, tool_calls, finish = _split_tool_calls(buffered[i], finish, parse)
                    logprobs = self.chat_logprobs(o.logprobs) if want_logprobs and o.logprobs is not None else None
                    if content or logprobs:
                        yield chunk(i, {"content": content or ""}, logprobs=logprobs)
                    if tool_calls:
                        yield chunk(i, {"tool_calls": [dict(c, index=k) for k, c in enumerate(tool_calls)]})
                yield chunk(i, {}, finish_reason=finish, error=choice_error(o))
        except Exception as e:  # the engine stopped under us: tell the client, then end the stream
            yield engine_error_event(e)
            yield SSE_DONE
            return
        if include_usage:
            yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_tokens, sum(completion))})
        yield SSE_DONE


def _echo_prefix(req: ChatCompletionRequest) -> str:
    last = req.messages[-1]
    if req.echo and last.role == "assistant":
        return last.for_template()["content"]
    return ""


def _split_tool_calls(text: str, finish: str | None, parse) -> tuple[str | None, list[dict] | None, str | None]:
    """(content, OpenAI tool_calls or None, finish_reason) of one finished choice."""
    if parse is None or finish in ("error", "abort"):
        return text, None, finish
    content, calls = parse(text)
    if not calls:
        return text, None, finish
    tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                   "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    return content, tool_calls, "tool_calls" if finish == "stop" else finish
