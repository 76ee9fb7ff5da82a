"""Request and response models of the OpenAI-compatible API; the models are the documentation.

Requests are validated strictly (no "10" for 10, no "true" for true): a wrong type is a 400 naming
the field. Unknown top-level fields are kept in `model_extra` so the server can report them
(`x-fastdeploy-lp-ignored-fields` header, or a 400 with `--strict-fields`).

Beyond OpenAI's fields a request may carry vLLM/FastDeploy's sampling extensions (`top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `bad_words`, ...), the per-request
`logits_processors_args` object read by the registered logits processors, and one output
constraint (`response_format` or one of the `guided_*` fields), mapped to
`SamplingParams.guided_decoding` by `protocol_constraints.py`, where those fields are defined.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# JsonSchemaSpec: the constraint models stay importable from here, where they were defined at first.
from fastdeploy_lp.entrypoints.openai.protocol_constraints import (JsonSchemaSpec, NvExt, ResponseFormat,
                                                                   StructuredOutputs, constraint_sources,
                                                                   request_constraint, whitespace_rule)
from fastdeploy_lp.sampling_params import MAX_LOGPROBS, GuidedDecodingParams, SamplingParams

_REQUEST = ConfigDict(extra="allow", strict=True, populate_by_name=True)
_NESTED = ConfigDict(extra="allow", strict=True, populate_by_name=True)

# -- pieces ---------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = _NESTED
    include_usage: bool | None = Field(None, description="Send a last chunk with the request's token usage.")


class TextContentPart(BaseModel):
    model_config = _NESTED
    type: str = Field(description="Only 'text' parts are supported (the models are text-only).")
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"content part type {self.type!r} is not supported; this server is text-only")
        if self.text is None:
            raise ValueError("a text content part needs 'text'")
        return self


class ChatMessage(BaseModel):
    model_config = _NESTED
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="An assistant turn's earlier tool calls.")
    tool_call_id: str | None = Field(None, description="The call a 'tool' message answers.")

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, value, info):
        """Only an assistant turn may leave it out (a turn that called tools); OpenAI refuses the rest."""
        if value is None and info.data.get("role") not in (None, "assistant"):
            raise ValueError(f"a {info.data['role']} message needs content")
        return value

    def for_template(self) -> dict[str, Any]:
        """The dict a chat template reads; text parts are joined into one string."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(p.text or "" for p in self.content)
        elif self.content is None:  # tool-call turns keep None, which tool-aware templates test for
            out["content"] = None if self.tool_calls else ""
        if self.role == "developer":  # OpenAI's newer name for the system turn
            out["role"] = "system"
        return out


class FunctionDefinition(BaseModel):
    model_config = _NESTED
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments.")
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = _NESTED
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _NESTED
    name: str


class NamedToolChoice(BaseModel):
    model_config = _NESTED
    type: Literal["function"] = "function"
    function: NamedFunction


# -- requests -------------------------------------------------------------------------------------
class _SamplingRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = _REQUEST

    model: str | None = Field(None, description="The served model name (see GET /v1/models); "
                                                "'default' or leaving it out means the served model.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0, description="0 is greedy. Default: the model's "
                                                              "generation_config, else 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128, description="Number of choices.")
    stop: str | list[str] | None = Field(None, description="Stop strings (not included in the output).")
    seed: int | None = Field(None, description="Makes sampling reproducible for this request.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) → bias in [-100, 100], added to the logits.")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None
    # vLLM / FastDeploy sampling extensions
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables.")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0, description="EOS and stop tokens are banned until this many.")
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = Field(None, description="Words never generated.")
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logits_processors_args: dict[str, Any] | None = Field(
        None, description="Per-request arguments of the registered logits processors, e.g. "
                          '{"logit_bias": {"128": 5.0}}; see GET /v1/logits_processors.')
    # output constraints (at most one)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | bool | None = Field(None, description="A JSON schema (object or string).")
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = Field(None, description="EBNF (GBNF `root ::= ...`) or Lark grammar.")
    structural_tag: dict[str, Any] | str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's current constraint form.")
    regex: str | None = Field(None, description="SGLang's name for guided_regex (SGLang's router forwards it).")
    ebnf: str | None = Field(None, description="SGLang's name for guided_grammar (SGLang's router forwards it).")
    # custom guided-decoding backends and constraints in NVIDIA NIM's form
    nvext: NvExt | None = None
    guided_decoding_backend: str | None = Field(
        None, description="A backend loaded with --custom-guided-decoding-backends, or 'llguidance'.")
    # SGLang's fields, which SGLang's and vLLM's routers add to every request they forward
    no_stop_trim: bool | None = Field(None, description="SGLang's name for include_stop_str_in_output.")
    return_hidden_states: bool | None = Field(None, description="Only false: hidden states are not returned.")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="vLLM's: each prompt token's logprob after the first, its rank and "
                                                 "this many alternatives, as `prompt_logprobs` (not with stream).")

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream true (as in vLLM)")
        if self.return_hidden_states:
            raise ValueError("return_hidden_states: not supported by this server (only false)")
        return self

    # -- mapping to the engine ------------------------------------------------------------------
    def requested_backend(self) -> tuple[str | None, str]:
        """The guided-decoding backend this request names, and the field that named it."""
        if self.guided_decoding_backend is not None:
            return self.guided_decoding_backend, "guided_decoding_backend"
        if self.nvext is not None and self.nvext.guided_decoding_backend is not None:
            return self.nvext.guided_decoding_backend, "nvext.guided_decoding_backend"
        return None, "guided_decoding_backend"

    def unknown_fields(self) -> list[str]:
        """Fields this server does not read, top-level and inside nested objects (`messages[0].foo`,
        `stream_options.foo`); `nvext` is excluded, its other keys are for custom backends."""
        return sorted(_unknown_fields(self, "", skip={"nvext"}))

    def constraint_field(self) -> str:
        """The field that carries this request's output constraint (for error messages)."""
        sources = constraint_sources(self)
        return sources[0][0] if sources else "response_format"

    def whitespace_field(self) -> str:
        """The field that set the JSON whitespace rule (for error messages)."""
        return whitespace_rule(self)[0] or "guided_whitespace_pattern"

    def guided_decoding(self, tool_constraint: GuidedDecodingParams | None = None) -> GuidedDecodingParams | None:
        """The one output constraint this request asks for, or None (`protocol_constraints`)."""
        return request_constraint(self, tool_constraint)

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any], guided: GuidedDecodingParams | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams for this request; `defaults` are the model's generation_config values."""

        def pick(name, fallback):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            n=self.n or 1, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), repetition_penalty=pick("repetition_penalty", 1.0),
            frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
            max_tokens=max_tokens, min_tokens=self.min_tokens or 0, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output or self.no_stop_trim), seed=self.seed, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
            logit_bias=self.logit_bias or None,  # validated by SamplingParams (and its check_vocab at admission)
            bad_words=self.bad_words, logits_processors_args=self.logits_processors_args, guided_decoding=guided)


def _unknown_fields(model: BaseModel, path: str, skip: set[str] = frozenset()) -> list[str]:
    prefix = f"{path}." if path else ""
    found = [prefix + k for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if name in skip or value is None:
            continue
        if isinstance(value, BaseModel):
            found += _unknown_fields(value, prefix + name)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    found += _unknown_fields(item, f"{prefix}{name}[{i}]")
    return found


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Most tokens to generate "
                                                                      "(OpenAI's newer name for max_tokens).")
    logprobs: bool | None = Field(False, description="Return the log probability of each output token.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token (needs logprobs).")
    tools: list[ToolDefinition] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="'auto' (the default with tools): text or calls; 'required': one or more calls only; "
                          "{'type': 'function', 'function': {'name': X}}: exactly one call of X; 'none': no call "
                          "(the call syntax cannot be generated). Enforced by the output grammar.")
    parallel_tool_calls: bool | None = Field(
        None, description="Whether one answer may hold several tool calls (default true, as in OpenAI); false "
                          "allows at most one. Enforced by the output grammar.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (e.g. enable_thinking).")
    add_generation_prompt: bool | None = Field(True, description="End the prompt with the assistant turn's header.")
    echo: bool | None = Field(False, description="Prepend the last message's content when it is the "
                                                 "assistant's (continuing a partial answer).")
    continue_final_message: bool | None = Field(
        False, description="End the prompt inside the last (assistant) message, so the answer continues it; "
                           "needs add_generation_prompt false.")
    # reasoning output (with --reasoning-parser): vLLM's and SGLang's switches, which the routers add
    include_reasoning: bool | None = Field(True, description="False drops reasoning_content from the answer.")
    separate_reasoning: bool | None = Field(True, description="False leaves the reasoning in content, unsplit.")
    stream_reasoning: bool | None = Field(True, description="Only true: reasoning is streamed as it is generated.")

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs to be true")
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise ValueError("continue_final_message: needs add_generation_prompt false and an assistant message last")
        if self.stream_reasoning is False and self.stream:
            raise ValueError("stream_reasoning: only true is supported (reasoning is streamed as it is generated)")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice: only allowed when tools are given")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice: no tool named {self.tool_choice.function.name!r} "
                                 f"(tools: {', '.join(names)})")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tools_for_template(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_choice_value(self):
        tc = self.tool_choice
        return tc.model_dump() if isinstance(tc, NamedToolChoice) else (tc or "auto")


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text, token ids, or a batch of either (one choice group per prompt).")
    max_tokens: int | None = Field(None, ge=0, description="Most tokens to generate; 0 only with echo (the "
                                                         "prompt alone, e.g. to score it with logprobs).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Return this many alternatives per token "
                                                                          "(with echo, the prompt's tokens too).")
    echo: bool | None = Field(False, description="Prepend the prompt to the output.")
    suffix: str | None = Field(None, description="Not supported (400 when set).")
    best_of: int | None = Field(None, ge=1, description="Only best_of == n is supported.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        if isinstance(value, str):
            return value
        ok = isinstance(value, list) and value and (
            all(isinstance(p, str) for p in value)
            or all(isinstance(t, int) and not isinstance(t, bool) for t in value)
            or all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                   for p in value))
        if not ok:
            raise ValueError("must be a string, a non-empty list of strings, a non-empty list of token ids, "
                             "or a list of non-empty token-id lists")
        return value

    @model_validator(mode="after")
    def _completion_checks(self):
        if self.suffix is not None:
            raise ValueError("suffix: not supported by this server")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of: only best_of equal to n is supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo true (the answer is the prompt alone)")
        return self

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Prompt logprobs to compute: `prompt_logprobs`, else with echo `logprobs` (vLLM's reading)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


# -- responses (documentation for the OpenAPI schema; handlers build the same shapes) ------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON string.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    reasoning_content: str | None = Field(None, description="With --reasoning-parser: the model's <think> part.")
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChoiceError(BaseModel):
    message: str
    type: str = "generation_error"


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "error", "abort"] | None = None
    error: ChoiceError | None = Field(None, description="Set when finish_reason is 'error'.")
    closed_on_length: bool | None = Field(None, description="True when structured_outputs.close_on_length closed "
                                                            "the JSON at max_tokens (finish_reason 'length').")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "error", "abort"] | None = None
    error: ChoiceError | None = None
    closed_on_length: bool | None = Field(None, description="As in chat completions.")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fastdeploy_lp"
    root: str | None = None
    max_model_len: int | None = None
    weight_dtype: str | None = None  # how linear weights are held ("bfloat16" on CPU computes in float32)
    quantization: str | None = None  # "wint8", "wint4", "gguf: Q4_K x168, ..." (the file's types) or None
    weight_bytes: int | None = None  # resident weight bytes, every tensor-parallel rank's together
    deterministic: bool = False  # --deterministic: batch-invariant outputs (docs/deterministic.md)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for the base itself


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
