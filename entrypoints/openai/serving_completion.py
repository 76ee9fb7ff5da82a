"""POST /v1/completions: text or token-id prompts (or a batch of them), as JSON or SSE chunks.

A batch of `P` prompts with `n` choices each answers with `P * n` choices; choice `p * n + i` is
choice `i` of prompt `p`, as in OpenAI's API.

`echo` with `logprobs` scores the prompt: the choice's `logprobs` cover the prompt's tokens (computed
in the prefill pass as prompt logprobs, `null` for the first token) and then the generated ones; with
`max_tokens: 0` the answer is the prompt alone (one token is computed and dropped, as in vLLM), which
is how lm-evaluation-harness's `local-completions` scores loglikelihood tasks.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastdeploy_lp.engine.protocol import RequestStream
from fastdeploy_lp.entrypoints.openai.protocol import CompletionRequest
from fastdeploy_lp.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, SSEResponse, abort_all,
                                                             choice_error, engine_error_event, final_outputs,
                                                             merge_streams, sse, usage, value_errors_as_400)
from fastdeploy_lp.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request, headers: dict[str, str]) -> Response:
        self.check_model(req.model)
        backend = self.custom_backend(req)
        with value_errors_as_400():
            guided = req.guided_decoding()
            if backend is None:
                self.check_guided(guided, req.constraint_field())
            params = self._params(req, guided)
        self.use_adapter(params, req.model)
        prompts = req.prompts()
        streams: list[RequestStream] = []
        try:
            for k, prompt in enumerate(prompts):
                renames = self.guided_renames(req.constraint_field(), req.whitespace_field())
                if len(prompts) > 1:
                    renames["prompt"] = f"prompt[{k}]"
                prompt_params = params
                if backend is not None:  # each prompt gets its own processor from the backend
                    prompt_params = params.clone()
                    await self.use_custom_backend(backend, req, prompt_params,
                                                  req.constraint_field() if guided is not None else None)
                streams.append(await self.submit(prompt, prompt_params, renames=renames))
        except BaseException:
            abort_all(streams)
            raise
        request_id = f"cmpl-{uuid.uuid4().hex}"
        n = params.n
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(request_id, streams, n, prompts, req, include_usage)
            return SSEResponse(await self.finish_with_backend(backend, body, raw), streams, headers=headers)
        finals = await final_outputs(streams, raw)
        response = await self.finish_with_backend(backend, self._response(request_id, finals, n, prompts, req), raw)
        return JSONResponse(response, headers=headers)

    def render(self, req: CompletionRequest) -> list[tuple[list[int], SamplingParams]]:
        """Per prompt, its token ids and the sampling parameters it would run with, validated as
        `create` validates them; nothing is submitted (POST /v1/completions/render)."""
        self.check_model(req.model)
        with value_errors_as_400():
            guided = req.guided_decoding()
            if self.custom_backend(req) is None:
                self.check_guided(guided, req.constraint_field())
            params = self._params(req, guided)
            limit = self.engine.fd_config.max_model_len
            return [(self.tokenizer.encode(p, add_special_tokens=True, limit=limit) if isinstance(p, str) else list(p),
                     params)
                    for p in req.prompts()]

    def _params(self, req: CompletionRequest, guided) -> SamplingParams:
        # max_tokens 0 (echo only): one token is computed and dropped from the answer, as in vLLM
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens or DEFAULT_MAX_TOKENS
        return req.sampling_params(max_tokens=max_tokens, logprobs=req.logprobs, defaults=self.generation_defaults,
                                   guided=guided, prompt_logprobs=req.num_prompt_logprobs)

    def _choice_logprobs(self, req: CompletionRequest, out, generated, offset: int) -> dict[str, Any] | None:
        """The choice's legacy `logprobs`: with echo, the prompt's and then `generated`'s."""
        if req.logprobs is None:
            return None
        if req.echo:
            return self.echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, generated, offset)
        return self.completion_logprobs(generated or [], offset)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)

    def _response(self, request_id: str, finals: list[dict[int, Any]], n: int, prompts,
                  req: CompletionRequest) -> dict:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        prompt_only = req.max_tokens == 0  # echo alone: the token computed is not part of the answer
        for k, group in enumerate(finals):
            prefix = self._prompt_text(prompts[k]) if req.echo else ""
            for i in sorted(group):
                out = group[i]
                o = out.outputs
                if i == 0:
                    prompt_tokens += len(out.prompt_token_ids)
                completion_tokens += 0 if prompt_only else len(o.token_ids)
                choice = {"index": k * n + i, "text": prefix + ("" if prompt_only else o.text),
                          "logprobs": self._choice_logprobs(req, out, None if prompt_only else o.logprobs,
                                                            len(prefix)),
                          "finish_reason": _finish_reason(o, prompt_only)}
                if out.prompt_logprobs is not None:  # vLLM's field, beside OpenAI's
                    choice["prompt_logprobs"] = self.vllm_prompt_logprobs(out.prompt_logprobs)
                if (err := choice_error(o)) is not None:
                    choice["error"] = err
                if o.closed_on_length:  # structured_outputs.close_on_length closed the JSON at max_tokens
                    choice["closed_on_length"] = True
                choices.append(choice)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.answer_model(req.model),
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    async def _stream(self, request_id: str, streams: list[RequestStream], n: int, prompts, req: CompletionRequest,
                      include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.answer_model(req.model)

        def chunk(index, text, finish_reason=None, lps=None, error=None, closed_on_length=False):
            choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": finish_reason}
            if error is not None:
                choice["error"] = error
            if closed_on_length:
                choice["closed_on_length"] = True
            data = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [choice]}
            if include_usage:
                data["usage"] = None
            return sse(data)

        prompt_only = req.max_tokens == 0  # echo alone: the token computed is not part of the answer
        texts = [self._prompt_text(p) if req.echo else "" for p in prompts]
        # With logprobs the echoed prompt waits for the choice's first output, which carries its logprobs.
        echo_later = [[bool(req.echo) and req.logprobs is not None] * n for _ in streams]
        offsets = [[len(texts[k])] * n for k in range(len(streams))]
        if req.echo and req.logprobs is None:
            for k in range(len(streams)):
                for i in range(n):
                    yield chunk(k * n + i, texts[k])
        sent = [[0] * n for _ in streams]
        prompt_tokens = [0] * len(streams)
        completion = [[0] * n for _ in streams]
        try:
            async for k, out in merge_streams(streams):
                o = out.outputs
                i = o.index
                prompt_tokens[k] = len(out.prompt_token_ids)
                if echo_later[k][i]:
                    echo_later[k][i] = False
                    yield chunk(k * n + i, texts[k], lps=self.echo_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                                             None, 0))
                if not prompt_only:
                    completion[k][i] = len(o.token_ids)
                    lps = None
                    if req.logprobs is not None and o.logprobs is not None:
                        lps = self.completion_logprobs(o.logprobs[sent[k][i]:], offsets[k][i])
                        sent[k][i] = len(o.logprobs)
                    offsets[k][i] += len(o.delta_text)
                    if o.delta_text or (lps and lps["tokens"]):
                        yield chunk(k * n + i, o.delta_text, lps=lps)
                if out.finished and o.finish_reason != "abort":
                    yield chunk(k * n + i, "", finish_reason=_finish_reason(o, prompt_only), error=choice_error(o),
                                closed_on_length=o.closed_on_length)
        except Exception as e:  # the engine stopped under us: tell the client, then end the stream
            yield engine_error_event(e)
            yield SSE_DONE
            return
        if include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage(sum(prompt_tokens), sum(map(sum, completion)))})
        yield SSE_DONE


def _finish_reason(o, prompt_only: bool) -> str | None:
    """The choice's finish reason; an echo-only answer (max_tokens 0) ends on its length unless it failed."""
    if prompt_only and o.finish_reason not in (None, "error", "abort"):
        return "length"
    return o.finish_reason
