"""Tools in chat: `tool_call_constraint` for every `tool_choice`, `parse_tool_calls`, and generation
under them on the qwen2 fixture (random weights, temperature 1)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import fixture_dir

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.processors.guided.tool_calls import parse_tool_calls, tool_call_constraint

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
DATE = {"type": "object", "properties": {"timezone": {"enum": ["UTC", "CET"]}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_date", "parameters": DATE}}]
SCHEMAS = {"get_weather": WEATHER, "get_date": DATE}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(fixture_dir("qwen2"), max_num_seqs=8, device="cpu")


def _chat(llm, tool_choice, seeds, max_tokens=80, **kw):
    gd = tool_call_constraint(TOOLS, tool_choice)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, guided_decoding=gd, **kw) for s in seeds]
    return llm.chat([MESSAGES] * len(seeds), params, use_tqdm=False, tools=TOOLS)


def test_none_and_missing_tools_mean_no_constraint():
    assert tool_call_constraint(TOOLS, "none") is None
    assert tool_call_constraint(None, None) is None and tool_call_constraint([], None) is None
    assert tool_call_constraint(TOOLS, None) == tool_call_constraint(TOOLS, "auto")


@pytest.mark.parametrize("tools,choice,message", [
    ([], "required", "tool_choice: 'required' needs at least one entry in tools"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice: function 'nope' is not among tools"),
    (TOOLS, "sometimes", "tool_choice: must be"),
    (TOOLS, {"type": "function"}, "tool_choice: a named choice is"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto", "tools[0].function.parameters"),
    (TOOLS + TOOLS[:1], "auto", "tools[2].function.name: 'get_weather' appears twice"),
])
def test_malformed_tools_or_choice_are_value_errors_naming_the_field(tools, choice, message):
    with pytest.raises(ValueError) as info:
        tool_call_constraint(tools, choice)
    assert str(info.value).startswith(message), str(info.value)


def test_parse_tool_calls_splits_content_and_calls():
    text = 'Let me check. <function=get_weather>{"city": "Paris", "unit": "celsius"}</function>\n' \
           '<function=get_date>{"timezone":"UTC"}</function>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                     {"name": "get_date", "arguments": '{"timezone": "UTC"}'}]
    assert parse_tool_calls("  plain answer ") == ("plain answer", [])
    assert parse_tool_calls("") == (None, [])
    assert parse_tool_calls('<function=f>{"a": 1}</function>') == (None, [{"name": "f", "arguments": '{"a": 1}'}])
    unfinished = 'x <function=get_date>{"timezone": "U'
    assert parse_tool_calls(unfinished) == (unfinished, [])


def test_strict_function_closes_its_objects():
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": loose, "strict": True}}]
    tag = tool_call_constraint(tools, "required").structural_tag["format"]["tags"][0]
    assert tag["content"]["json_schema"]["additionalProperties"] is False
    assert "additionalProperties" not in loose


def _check_calls(calls):
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_required_gives_only_valid_calls(llm):
    outs = _chat(llm, "required", range(6))
    for out in outs:
        content, calls = parse_tool_calls(out.outputs.text)
        if out.outputs.finish_reason == "stop":
            assert content is None and calls, out.outputs.text
        _check_calls(calls)
    assert any(out.outputs.finish_reason == "stop" for out in outs)


def test_named_function_gives_exactly_that_call(llm):
    outs = _chat(llm, {"type": "function", "function": {"name": "get_date"}}, range(6))
    for out in outs:
        assert out.outputs.finish_reason == "stop", out.outputs.text
        content, calls = parse_tool_calls(out.outputs.text)
        assert content is None and [c["name"] for c in calls] == ["get_date"]
        _check_calls(calls)


def test_auto_allows_text_and_any_call_is_valid(llm):
    bias = {t: 8.0 for t in llm.tokenizer.encode("<function=")}
    outs = _chat(llm, "auto", range(8), logit_bias=bias)
    for out in outs:
        _, calls = parse_tool_calls(out.outputs.text)
        _check_calls(calls)
        tail = out.outputs.text
        for _ in calls:
            tail = tail[tail.index("</function>") + len("</function>"):]
        if "<function=" in tail:  # an unfinished call: only max_tokens may cut it
            assert out.outputs.finish_reason == "length"
    for out in _chat(llm, "auto", range(2), max_tokens=12):  # unbiased: just text
        content, calls = parse_tool_calls(out.outputs.text)
        assert content and not calls
