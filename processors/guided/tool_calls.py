"""OpenAI tools in chat: the output constraint for `tool_choice`.

The model writes a call as

    <function=get_weather>{"city": "Paris"}</function>

and `tool_call_constraint` turns `tools` + `tool_choice` (+ `parallel_tool_calls`) into a
`GuidedDecodingParams` structural tag that guarantees exactly that shape, with arguments valid
against the function's `parameters`:

| tool_choice                                   | constraint                                                  |
|-----------------------------------------------|-------------------------------------------------------------|
| None without tools                            | None (free text)                                            |
| `"none"` with tools                           | free text that cannot contain `<function=` (no call syntax) |
| `"auto"`, or None with tools                  | free text; once it writes `<function=`, a valid call        |
| `"required"`                                  | one or more calls, separated by newlines, nothing else      |
| `{"type":"function","function":{"name":X}}`   | exactly one call of X                                       |

`parallel=False` (OpenAI's `parallel_tool_calls: false`) allows at most one call under "auto" and
exactly one under "required"; with `parallel=True` (OpenAI's default) the grammar admits any number.

The server reads the calls back out of the text with `entrypoints/openai/tool_parser.py`
(`ToolCallParser`, `parse_tool_calls`), offline too:

    params = SamplingParams(guided_decoding=tool_call_constraint(tools, "required"))
    text = llm.chat(messages, params, tools=tools)[0].outputs.text
    content, calls = parse_tool_calls(text)   # calls: [{"name": ..., "arguments": "{...}", "complete": True}]

A function with `"strict": true` gets OpenAI strict semantics (objects without an explicit
`additionalProperties` admit no extra keys); without it the `parameters` schema is used as written.
"""

from __future__ import annotations

import re
from typing import Any

from fastdeploy_lp.processors.guided.json_schema import strict_schema
from fastdeploy_lp.sampling_params import GuidedDecodingParams

CALL_BEGIN = "<function="
CALL_END = "</function>"
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_call_constraint(tools: list[dict] | None, tool_choice: Any,
                         parallel: bool | None = True) -> GuidedDecodingParams | None:
    """The constraint that makes the model's output follow `tool_choice` over `tools` (see module doc).

    `parallel` False allows at most one call (None means OpenAI's default, True). Raises
    `ValueError` naming `tools` or `tool_choice` when they are malformed or disagree.
    """
    tools = list(tools or [])
    choice = _plain(tool_choice)
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        if tools:
            _functions(tools)  # still checked: the template renders them
            return no_tool_call_constraint()
        return None
    functions = _functions(tools)
    if not functions:
        raise ValueError(f"tool_choice: {choice if isinstance(choice, str) else 'a named function'!r} "
                         "needs at least one entry in tools")
    one = parallel is False
    if isinstance(choice, dict):
        name = _named_choice(choice)
        if name not in functions:
            raise ValueError(f"tool_choice: function {name!r} is not among tools ({', '.join(functions)})")
        return _structural({"type": "tag", **_tag(name, functions[name])})
    if choice == "required":
        return _structural({"type": "tags_with_separator", "separator": "\n", "at_least_one": True,
                            "stop_after_first": one, "tags": [_tag(n, s) for n, s in functions.items()]})
    if choice == "auto":
        return _structural({"type": "triggered_tags", "triggers": [CALL_BEGIN], "stop_after_first": one,
                            "tags": [_tag(n, s) for n, s in functions.items()]})
    raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or "
                     f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")


def no_tool_call_constraint() -> GuidedDecodingParams:
    """Free text in which the call syntax cannot start (`tool_choice: "none"` with tools).

    One lexeme, "any text that does not contain `<function=`" (a structural tag's `any_text` with
    `excludes`): llguidance checks it byte by byte, so neither a `<function=` token nor `<` +
    `function` + `=` in pieces can be written, while `<`, `<function`, `</function>` stay possible
    and the text may end anywhere.
    """
    return _structural({"type": "any_text", "excludes": [CALL_BEGIN]})


# -- helpers ------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """Pydantic models (the server's protocol objects) as plain dicts."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    return value


def _functions(tools: list) -> dict[str, dict]:
    """name -> arguments schema, checking the OpenAI tool shape."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        tool = _plain(tool)
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{where}: must be {{'type': 'function', 'function': {{...}}}}")
        fn = _plain(tool.get("function"))
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}.function.name: must be a non-empty string")
        name = fn["name"]
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ValueError(f"{where}.function.name: {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if name in out:
            raise ValueError(f"{where}.function.name: {name!r} appears twice")
        schema = fn.get("parameters")
        if schema is None:
            schema = _NO_PARAMETERS
        if not isinstance(schema, dict):
            raise ValueError(f"{where}.function.parameters: must be a JSON schema object")
        out[name] = strict_schema(schema) if fn.get("strict") else schema
    return out


def parameters_paths(tools: list, tool_choice: Any) -> dict[str, str]:
    """Where each tool's parameters schema sits in `tool_call_constraint`'s structural tag (one tag
    per tool, in order; a named choice's tag alone) → the request's `tools[i].function.parameters`,
    so a schema the grammar engine refuses is blamed on the tool that holds it. Call after
    `tool_call_constraint` accepted the same arguments."""
    paths = {f"structural_tag.format.tags[{i}].content.json_schema": f"tools[{i}].function.parameters"
             for i in range(len(tools or ()))}
    choice = _plain(tool_choice)
    if isinstance(choice, dict):
        names = list(_functions(tools))
        paths["structural_tag.format.content.json_schema"] = \
            f"tools[{names.index(_named_choice(choice))}].function.parameters"
    return paths


def _named_choice(choice: dict) -> str:
    fn = _plain(choice.get("function"))
    if choice.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"tool_choice: a named choice is {{'type': 'function', 'function': {{'name': ...}}}}, "
                         f"got {choice!r}")
    return fn["name"]


def _tag(name: str, schema: dict) -> dict:
    return {"begin": f"{CALL_BEGIN}{name}>", "content": {"type": "json_schema", "json_schema": schema},
            "end": CALL_END}


def _structural(fmt: dict) -> GuidedDecodingParams:
    return GuidedDecodingParams(structural_tag={"type": "structural_tag", "format": fmt})
