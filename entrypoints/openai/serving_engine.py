"""What the chat and completion handlers share: model names, submitting to the engine with errors
mapped to HTTP, logprob formatting, SSE framing, and cancelling on client disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from fastdeploy_lp.engine.protocol import EngineClient, EngineNotServingError, QueueFullError, RequestStream
from fastdeploy_lp.engine.request import Logprob, RequestOutput
from fastdeploy_lp.entrypoints.openai.errors import RETRY_LATER, OpenAIError, bad_request, from_value_error
from fastdeploy_lp.processors.custom_backends import (BackendRequestError, CustomBackend, MalformedBackendResult,
                                                      prepare_request)
from fastdeploy_lp.processors.guided.compiler import default_compile_timeout_s
from fastdeploy_lp.processors.guided.constraint import FIELDS as GUIDED_FIELD_NAMES
from fastdeploy_lp.model.lora import LORA_NAME
from fastdeploy_lp.sampling_params import GuidedDecodingParams, SamplingParams

logger = logging.getLogger(__name__)

_MIN_LOGPROB = -9999.0  # JSON has no -inf; a banned token reports this


class ClientDisconnected(Exception):
    pass


@contextlib.contextmanager
def value_errors_as_400(renames: dict[str, str] | None = None):
    """`ValueError("field: ...")` raised inside → a 400 naming the field."""
    try:
        yield
    except OpenAIError:
        raise
    except ValueError as e:
        raise from_value_error(e, renames) from None


class OpenAIServing:
    def __init__(self, engine: EngineClient, served_model_names: list[str], model_aliases: set[str]):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.token_bytes = self.tokenizer.token_bytes  # logprobs read it; built here, not in a request's turn
        self.served_model_names = served_model_names
        self.model_aliases = model_aliases | set(served_model_names)
        self.generation_defaults = dict(engine.fd_config.model_config.generation_defaults)
        self.guided_available = engine.serves_guided_decoding

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_aliases and name not in self.engine.lora_adapters():
            raise OpenAIError(404, f"model: {name!r} is not served here; use {self.model_name!r} "
                                   "(see GET /v1/models)", param="model", code="model_not_found")

    def answer_model(self, name: str | None) -> str:
        """The `model` an answer names: the LoRA adapter the request named (as vLLM), else the served name.
        `check_model` let the request in, so a name that is not the base's is an adapter's, even one
        unloaded since (the request still runs on it)."""
        return name if name is not None and name not in self.model_aliases else self.model_name

    def use_adapter(self, params: SamplingParams, name: str | None) -> None:
        """A request whose `model` names a LoRA adapter (`--lora-modules`) runs with it (docs/lora.md)."""
        if name is not None and name not in self.model_aliases and name in self.engine.lora_adapters():
            params.extra[LORA_NAME] = name

    def check_guided(self, guided: GuidedDecodingParams | None, field: str) -> None:
        if guided is not None and not self.guided_available:
            raise bad_request(f"{field}: output constraints are not supported: the server runs with "
                              "--guided-decoding-backend off", param=field)

    def custom_backend(self, req) -> CustomBackend | None:
        """The custom backend this request runs under (its own choice, else the server default)."""
        fd_config = self.engine.fd_config
        backends = self.engine.custom_guided_decoding_backends
        name, field = req.requested_backend()
        if name is None:
            name = fd_config.guided_decoding_backend
        elif name != "llguidance" and name not in backends:
            known = ", ".join(["llguidance", *backends])
            raise bad_request(f"{field}: unknown guided decoding backend {name!r}; available: {known}", param=field)
        return backends.get(name)

    async def use_custom_backend(self, backend: CustomBackend, req, params: SamplingParams,
                                 constrained_by: str | None) -> None:
        """Run the backend's request hooks; its processor replaces any llguidance constraint.
        `constrained_by` is the field that asked for a constraint (None: the request asked for none)."""
        if params.guided_decoding is not None and params.guided_decoding.close_on_length:
            field = "structured_outputs.close_on_length"  # an llguidance feature: never silently dropped
            raise bad_request(f"{field}: not available with a custom guided decoding backend", param=field)
        request = req.model_dump(by_alias=True, exclude_none=True)
        try:
            params.extra.update(await prepare_request(backend, request, self.tokenizer, constrained_by=constrained_by,
                                                      timeout_s=default_compile_timeout_s()))
        except BackendRequestError as e:
            raise bad_request(f"guided_decoding_backend: {e}", param="guided_decoding_backend") from None
        except MalformedBackendResult as e:
            raise backend_error(str(e)) from None
        params.guided_decoding = None

    @staticmethod
    async def finish_with_backend(backend: CustomBackend | None, response, raw: Request):
        """The backend's post-processing hook, when it has one, on the final response (which must
        stay a JSON object) or the stream (which must stay a stream of SSE text ending in [DONE])."""
        if backend is None or backend.constrained_generator is None:
            return response
        streaming = not isinstance(response, dict)
        try:
            result = await asyncio.wait_for(backend.constrained_generator(response, raw), default_compile_timeout_s())
        except asyncio.TimeoutError:
            raise backend_error(f"custom guided decoding backend {backend.name!r}: "
                                "get_guided_decoding_constrained_generator did not return in time") from None
        except Exception as e:
            raise backend_error(f"custom guided decoding backend {backend.name!r}: "
                                f"get_guided_decoding_constrained_generator failed: {type(e).__name__}: {e}") from None
        if streaming and hasattr(result, "__aiter__"):
            return _checked_stream(backend.name, result)
        if not streaming and isinstance(result, dict):
            return result
        raise backend_error(f"custom guided decoding backend {backend.name!r}: get_guided_decoding_constrained_generator "
                            f"returned {type(result).__name__}, not " +
                            ("an async iterator of SSE chunks" if streaming else "a response object"))

    @staticmethod
    def guided_renames(field: str, whitespace_field: str = "guided_whitespace_pattern") -> dict[str, str]:
        """Name grammar errors after the fields the request used (`response_format`, `tools`,
        `nvext.guided_json`, `structured_outputs.whitespace_pattern`, ...)."""
        renames = {name: field for name in GUIDED_FIELD_NAMES.values() if name != field}
        renames["guided_whitespace_pattern"] = whitespace_field
        return renames

    async def submit(self, prompt: str | list[int], params: SamplingParams,
                     renames: dict[str, str] | None = None) -> RequestStream:
        try:
            with value_errors_as_400(renames):
                return await self.engine.add_request(prompt, params)
        except QueueFullError as e:
            raise OpenAIError(429, str(e), code="queue_full", headers=RETRY_LATER) from None
        except EngineNotServingError as e:
            raise OpenAIError(503, str(e), code="not_serving", headers=RETRY_LATER) from None

    # -- logprobs -------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.token_bytes[token_id] if 0 <= token_id < len(self.token_bytes) else b""
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat_logprobs(self, entries: list[Logprob]) -> dict[str, Any]:
        content = []
        for lp in entries:
            token, raw = self.token_text(lp.token_id)
            top = []
            for tid, value in sorted(lp.top.items(), key=lambda kv: -kv[1]):
                t, b = self.token_text(tid)
                top.append({"token": t, "logprob": _finite(value), "bytes": b})
            content.append({"token": token, "logprob": _finite(lp.logprob), "bytes": raw, "top_logprobs": top})
        return {"content": content}

    def completion_logprobs(self, entries: list[Logprob], offset: int) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for lp in entries:
            token, _ = self.token_text(lp.token_id)
            tokens.append(token)
            values.append(_finite(lp.logprob))
            tops.append({self.token_text(t)[0]: _finite(v) for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])})
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def echo_logprobs(self, prompt_ids: list[int], entries, generated: list[Logprob] | None,
                      offset: int) -> dict[str, Any]:
        """OpenAI's legacy `logprobs` of an echoed prompt (`entries`: its prompt logprobs, None
        first), then of the `generated` tokens from text offset `offset`: `null` value and
        alternatives for the first prompt token; each other's alternatives include the token itself."""
        tokens, values, tops, offsets = [], [], [], []
        at = 0
        for token_id, lp in zip(prompt_ids, entries or ()):
            token = self.token_text(token_id)[0]
            tokens.append(token)
            offsets.append(at)
            at += len(token)
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(_finite(lp.logprob))
            top = {self.token_text(t)[0]: _finite(v) for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])}
            top.setdefault(token, _finite(lp.logprob))
            tops.append(top)
        out = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
        if generated:
            for key, more in self.completion_logprobs(generated, offset).items():
                out[key] += more
        return out

    def vllm_prompt_logprobs(self, entries) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: None first, then per prompt token {token id: {logprob, rank,
        decoded_token}} for the token itself (its rank among the vocabulary) and its alternatives
        (ranks 1..k)."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for lp in entries:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                        "decoded_token": self.token_text(lp.token_id)[0]}}
            for rank, (t, v) in enumerate(sorted(lp.top.items(), key=lambda kv: -kv[1]), start=1):
                entry.setdefault(str(t), {"logprob": _finite(v), "rank": rank, "decoded_token": self.token_text(t)[0]})
            out.append(entry)
        return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice_error(out) -> dict | None:
    if out.finish_reason != "error":
        return None
    return {"message": out.error or "generation failed", "type": "generation_error"}


def sse(data: dict) -> str:
    return "data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream position, output) from several streams, as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, stream: RequestStream):
        try:
            async for out in stream:
                queue.put_nowait((k, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((k, e))
        finally:
            queue.put_nowait((k, done))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            k, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def final_outputs(streams: list[RequestStream], request: Request) -> list[dict[int, RequestOutput]]:
    """The last output of every choice of every stream; aborts them all if the client goes away."""

    async def drain():
        finals: list[dict[int, RequestOutput]] = [{} for _ in streams]
        async for k, out in merge_streams(streams):
            finals[k][out.outputs.index] = out
        return finals

    work = asyncio.ensure_future(drain())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():  # the client left (or the server is stopping): the task ends cancelled
            work.cancel()
            abort_all(streams)
    if not work.done() or work.cancelled():  # cancel() only asks: its result is never there
        raise ClientDisconnected()
    return work.result()


def abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that aborts its requests however the stream ends
    (finished, client disconnected, server shutting down)."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream], headers: dict | None = None):
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            abort_all(self._streams)  # no-op for finished ones
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


def backend_error(message: str) -> OpenAIError:
    """A custom backend broke its contract: the server's fault, not the request's."""
    return OpenAIError(500, message, code="custom_backend_error")


async def _checked_stream(backend: str, chunks) -> AsyncIterator[str | bytes]:
    """A backend's rewritten stream, cut with an error event and [DONE] at its first item that is
    not SSE text or its first exception, and given its [DONE] if it leaves it out."""
    done = False
    try:
        async for chunk in chunks:
            if not isinstance(chunk, (str, bytes)):
                raise TypeError(f"it yielded {type(chunk).__name__}, not SSE text")
            done = (chunk if isinstance(chunk, str) else chunk.decode("utf-8", "replace")).rstrip().endswith(
                "data: [DONE]")
            yield chunk
    except Exception as e:  # noqa: BLE001 - ends the stream the documented way
        error = backend_error(f"custom guided decoding backend {backend!r}: its stream failed: {type(e).__name__}: {e}")
        yield sse(error.body())
        done = False
    if not done:
        yield SSE_DONE


def engine_error_event(error: BaseException) -> str:
    status = 503 if isinstance(error, EngineNotServingError) else 500
    err = OpenAIError(status, str(error) or type(error).__name__,
                      code="not_serving" if status == 503 else "internal_error")
    return sse(err.body())
