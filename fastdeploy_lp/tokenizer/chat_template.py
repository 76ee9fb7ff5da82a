"""Chat templates: the checkpoint's Jinja template rendered the way `transformers` renders it."""

from __future__ import annotations

import json
import os
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fastdeploy_lp.tokenizer.text import check_text


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None):
        self.source = source
        self._template = None
        if source:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(source)

    @classmethod
    def from_model_dir(cls, model_dir: str, tokenizer_config: dict[str, Any]) -> "ChatTemplate":
        path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return cls(f.read())
        source = tokenizer_config.get("chat_template")
        if isinstance(source, list):  # named templates: take the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        return cls(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        if self._template is None:
            raise ValueError("messages: this model has no chat template; use a completion prompt instead")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **kwargs)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"messages: the chat template rejected the conversation: {e}") from e


RESERVED_BY_REQUEST = ("messages", "tools", "add_generation_prompt")
RESERVED_BY_TOKENIZER = ("bos_token", "eos_token")


def render_chat_prompt(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                       tools: list[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of one conversation: the one chat renderer (the server and `LLM.chat`).

    `tokenizer` is the engine's `Tokenizer` (its template, BOS and EOS). `chat_template_kwargs` are
    extra template variables (e.g. `enable_thinking`); they may not set what the call itself sets
    (`messages`, `tools`, `add_generation_prompt`) or what the tokenizer does (`bos_token`,
    `eos_token`). Every failure is a `ValueError` naming the field, including a template that fails
    on odd input. The template writes any BOS it wants, as transformers does for chat prompts, so
    encode the result with `add_special_tokens=False`.
    """
    check_text(messages, "messages")
    check_text(tools, "tools")
    check_text(chat_template_kwargs, "chat_template_kwargs")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in RESERVED_BY_REQUEST:
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs.{reserved}: set by the request itself, not here")
    for reserved in RESERVED_BY_TOKENIZER:
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs.{reserved}: set by the tokenizer; it cannot be overridden")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **kwargs)
    except ValueError:
        raise
    except Exception as e:  # a template may fail in any way on odd input (e.g. None + str)
        raise ValueError(f"messages: the chat template failed: {type(e).__name__}: {e}") from None
