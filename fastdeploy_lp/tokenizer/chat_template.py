"""Chat templates: the checkpoint's Jinja template rendered the way `transformers` renders it."""

from __future__ import annotations

import json
import os
from functools import cached_property
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

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the template writes the `tools` it is given into the prompt (many, e.g. SmolLM2's
        and Llama 2's, ignore them); found by rendering a probe tool once."""
        probe = [{"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {"type": "object"}}}]
        try:
            return _PROBE_TOOL in self.render([{"role": "user", "content": "x"}], tools=probe, bos_token="",
                                              eos_token="")
        except ValueError:
            return False

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        if self._template is None:
            raise ValueError("messages: this model has no chat template; use a completion prompt instead")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **kwargs)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"messages: the chat template rejected the conversation: {e}") from e


_PROBE_TOOL = "fastdeploy_lp_probe_tool"
RESERVED_BY_REQUEST = ("messages", "tools", "add_generation_prompt")
RESERVED_BY_TOKENIZER = ("bos_token", "eos_token")


def tools_system_prompt(tools: list[dict]) -> str:
    """The tool list as a system prompt, in the call syntax the tool grammar enforces
    (`<function=NAME>{JSON}</function>`, `processors/guided/tool_calls.py`): what a template that
    does not render tools gets instead, as vLLM's tool-parser templates add it.

    Each tool is one signature line, `- get_weather(city: string, unit?: "c" | "f"): description`:
    small models copy a whole JSON schema into their arguments, and the grammar enforces the schema
    whatever the prompt says."""
    lines = "\n".join(_signature(t.get("function", t)) for t in tools)
    return ("# Tools\n\nYou can call these functions:\n" + lines + "\n\nTo call a function, reply only with "
            "<function=NAME>{JSON arguments}</function>. After a function result arrives, answer in plain text.")


def _signature(function: dict) -> str:
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required") or ())
    args = ", ".join(f"{name}{'' if name in required else '?'}: {_type_name(schema)}"
                     for name, schema in (parameters.get("properties") or {}).items())
    description = function.get("description")
    return f"- {function['name']}({args})" + (f": {description}" if description else "")


def _type_name(schema) -> str:
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list[{_type_name(schema.get('items'))}]"
    return " | ".join(kind) if isinstance(kind, list) else str(kind)


def _with_tools_in_prompt(messages: list[dict], tools: list[dict], system: bool) -> list[dict]:
    """`messages` with the tool list at the start of the system message (a new one if there is
    none), or, for a template without a system role, of the first message."""
    text = tools_system_prompt(tools)
    first = messages[0] if messages else None
    if first is not None and isinstance(first.get("content"), str) and (first.get("role") == "system" or not system):
        return [dict(first, content=f"{text}\n\n{first['content']}")] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def _calls_as_text(messages: list[dict]) -> list[dict]:
    """Assistant turns' `tool_calls` written into their content in the call syntax, for a template
    that only reads `content`."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "".join(f"<function={c['function']['name']}>{_arguments(c['function'].get('arguments'))}</function>"
                            for c in m["tool_calls"])
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": (m.get("content") or "") + calls}
        out.append(m)
    return out


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {}, ensure_ascii=False)


def render_chat_prompt(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                       tools: list[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                       continue_final_message: bool = False) -> str:
    """The prompt text of one conversation: the one chat renderer (the server and `LLM.chat`).

    `tokenizer` is the engine's `Tokenizer` (its template, BOS and EOS). `chat_template_kwargs` are
    extra template variables (e.g. `enable_thinking`); they may not set what the call itself sets
    (`messages`, `tools`, `add_generation_prompt`) or what the tokenizer does (`bos_token`,
    `eos_token`). Every failure is a `ValueError` naming the field, including a template that fails
    on odd input. The template writes any BOS it wants, as transformers does for chat prompts, so
    encode the result with `add_special_tokens=False`. `continue_final_message` ends the text right
    after the last message's content (vLLM's and transformers' meaning), so the answer continues it.
    """
    text = _rendered(tokenizer, messages, add_generation_prompt, tools, chat_template_kwargs)
    if not continue_final_message:
        return text
    final = messages[-1].get("content")
    final = final if isinstance(final, str) else "".join(p.get("text", "") for p in final or [])
    end = text.rfind(final.strip()) if final.strip() else -1
    if end < 0:
        raise ValueError("continue_final_message: the chat template does not write the last message's content "
                         "as given, so the prompt cannot end inside it")
    return text[:end + len(final.strip())]


def _rendered(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
              chat_template_kwargs: dict[str, Any] | None) -> str:
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
    if not tokenizer.chat_template.renders_tools:  # nor, then, earlier turns' tool calls
        messages = _calls_as_text(messages)
    if tools and not tokenizer.chat_template.renders_tools:
        try:
            return tokenizer.apply_chat_template(_with_tools_in_prompt(messages, tools, system=True),
                                                 add_generation_prompt=add_generation_prompt, **kwargs)
        except ValueError:  # a template without a system role (Gemma's, Mistral's first)
            messages, tools = _with_tools_in_prompt(messages, tools, system=False), None
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **kwargs)
    except ValueError:
        raise
    except Exception as e:  # a template may fail in any way on odd input (e.g. None + str)
        raise ValueError(f"messages: the chat template failed: {type(e).__name__}: {e}") from None
