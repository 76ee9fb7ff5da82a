"""Chat templates: the checkpoint's Jinja template rendered the way `transformers` renders it."""

from __future__ import annotations

import json
import os
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


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
