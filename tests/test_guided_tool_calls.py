"""Tools in chat: `tool_call_constraint` for every `tool_choice` and `parallel_tool_calls`, the grammars
checked token by token on real tokenizers, `ToolCallParser` / `parse_tool_calls` (calls read the way
the grammar writes them: `</function>` inside a JSON string stays in the string; streamed pieces join
to the whole), and generation under them on the qwen2 fixture (random weights, temperature 1)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import fixture_dir

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.entrypoints.openai.tool_parser import ToolCallParser, parse_tool_calls
from fastdeploy_lp.processors.guided.tool_calls import no_tool_call_constraint, tool_call_constraint

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


def test_none_forbids_the_call_syntax_and_missing_tools_mean_no_constraint():
    assert tool_call_constraint(TOOLS, "none") == no_tool_call_constraint()
    assert tool_call_constraint(None, None) is None and tool_call_constraint([], None) is None
    assert tool_call_constraint([], "none") is None
    assert tool_call_constraint(TOOLS, None) == tool_call_constraint(TOOLS, "auto")
    assert tool_call_constraint(TOOLS, "auto", parallel=None) == tool_call_constraint(TOOLS, "auto")


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
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}', "complete": True},
                     {"name": "get_date", "arguments": '{"timezone":"UTC"}', "complete": True}]  # the JSON as written
    assert parse_tool_calls("  plain answer ") == ("plain answer", [])
    assert parse_tool_calls("") == (None, [])
    assert parse_tool_calls('<function=f> {"a": 1}\n</function>') == (
        None, [{"name": "f", "arguments": '{"a": 1}', "complete": True}])
    # cut by max_tokens: a call with what was written, as streamed; a header cut inside a tool's
    # name is syntax, neither a call nor content; a name no tool has is text
    cut = {"name": "get_date", "arguments": '{"timezone": "U', "complete": False}
    assert parse_tool_calls('x <function=get_date>{"timezone": "U') == ("x", [cut])
    assert parse_tool_calls('x <function=get_da', names=["get_date"]) == ("x", [])
    assert parse_tool_calls('x <function=nope', names=["get_date"]) == ("x <function=nope", [])


def test_strict_function_closes_its_objects():
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": loose, "strict": True}}]
    tag = tool_call_constraint(tools, "required").structural_tag["format"]["tags"][0]
    assert tag["content"]["json_schema"]["additionalProperties"] is False
    assert "additionalProperties" not in loose


def _check_calls(calls, finish="stop"):
    """Complete calls are valid; only max_tokens may leave one cut."""
    for call in calls:
        if call["complete"]:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        else:
            assert finish == "length" and call is calls[-1], calls


def test_required_gives_only_valid_calls(llm):
    outs = _chat(llm, "required", range(6))
    for out in outs:
        content, calls = parse_tool_calls(out.outputs.text, names=SCHEMAS)
        if out.outputs.finish_reason == "stop":
            assert content is None and calls, out.outputs.text
        _check_calls(calls, out.outputs.finish_reason)
    assert any(out.outputs.finish_reason == "stop" for out in outs)


def test_named_function_gives_exactly_that_call(llm):
    outs = _chat(llm, {"type": "function", "function": {"name": "get_date"}}, range(6))
    for out in outs:
        assert out.outputs.finish_reason == "stop", out.outputs.text
        content, calls = parse_tool_calls(out.outputs.text, names=SCHEMAS)
        assert content is None and [c["name"] for c in calls] == ["get_date"]
        _check_calls(calls)


def test_auto_allows_text_and_any_call_is_valid(llm):
    bias = {t: 8.0 for t in llm.tokenizer.encode("<function=")}
    outs = _chat(llm, "auto", range(8), logit_bias=bias)
    for out in outs:
        _, calls = parse_tool_calls(out.outputs.text, names=SCHEMAS)
        _check_calls(calls, out.outputs.finish_reason)
    for out in _chat(llm, "auto", range(2), max_tokens=12):  # unbiased: just text
        content, calls = parse_tool_calls(out.outputs.text, names=SCHEMAS)
        assert content and not calls


# -- reading calls the way the grammar writes them -----------------------------------------------
HOSTILE = ('Sure. <function=get_weather>{"city": "a</function>b\\"</function>", "unit": "celsius"}</function>'
           '<function=get_date>{"timezone": "UTC"}</function> done')


def test_end_tag_inside_a_json_string_stays_in_the_string():
    content, calls = parse_tool_calls(HOSTILE, names=SCHEMAS)
    assert content == "Sure.  done"
    assert [c["name"] for c in calls] == ["get_weather", "get_date"]
    assert json.loads(calls[0]["arguments"]) == {"city": 'a</function>b"</function>', "unit": "celsius"}
    _check_calls(calls[1:])
    # the old string split would have cut here; the scanner reads one JSON value, then the end tag
    assert parse_tool_calls('<function=f>"</function>"</function>')[1] == [
        {"name": "f", "arguments": '"</function>"', "complete": True}]
    assert parse_tool_calls('<function=f>[1, {"a": "}]"}]</function>')[1] == [
        {"name": "f", "arguments": '[1, {"a": "}]"}]', "complete": True}]


@pytest.mark.parametrize("text", [
    '<function=f>{"a": 1} x</function>',        # something between the value and the end tag
    '<function=f>{"a": 1}}</function>',          # not one JSON value
    '<function=f>{"a": NaN}</function>',         # not JSON (Python's json would take it)
    "<function=f>{'a': 1}</function>",
    '<function=f>{"a": "\x01"}</function>',      # a raw control character in a string
    '<function=f>hello</function>',
    '<function=bad name>{}</function>', '<function=>{}</function>',
])
def test_text_that_is_not_a_call_is_not_returned_as_one(text):
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == text.strip()


def test_only_named_tools_and_at_most_max_calls_are_read():
    text = '<function=other>{}</function><function=get_date>{"timezone": "UTC"}</function>' \
           '<function=get_date>{"timezone": "CET"}</function>'
    content, calls = parse_tool_calls(text, names=SCHEMAS)
    assert content == "<function=other>{}</function>" and len(calls) == 2
    content, calls = parse_tool_calls(text, names=SCHEMAS, max_calls=1)
    assert [json.loads(c["arguments"]) for c in calls] == [{"timezone": "UTC"}]
    assert content == '<function=other>{}</function><function=get_date>{"timezone": "CET"}</function>'


def _stream(text: str, pieces, **kw) -> tuple[ToolCallParser, list[tuple]]:
    parser, events, pos = ToolCallParser(**kw), [], 0
    for size in pieces:
        events += parser.feed(text[pos:pos + size])
        pos += size
    events += parser.feed(text[pos:])
    return parser, events + parser.finish()


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 1000])
def test_incremental_events_join_to_the_whole_parse(chunk):
    import itertools

    text = "  " + HOSTILE + "\n"
    parser, events = _stream(text, itertools.repeat(chunk, len(text)), names=SCHEMAS)
    content, calls = parse_tool_calls(text, names=SCHEMAS)
    assert "".join(e[1] for e in events if e[0] == "content") == content
    assert [(e[1], e[2]) for e in events if e[0] == "call"] == [(k, c["name"]) for k, c in enumerate(calls)]
    for k, call in enumerate(calls):
        assert "".join(e[2] for e in events if e[0] == "arguments" and e[1] == k) == call["arguments"]
    assert [e[1] for e in events if e[0] == "end"] == [0, 1] and parser.all_calls_complete
    # order: the header before its arguments, content before the call that follows it
    kinds = [e[0] for e in events]
    assert kinds.index("call") < kinds.index("arguments") and kinds[0] == "content"


def test_content_streams_at_once_but_never_a_partial_opening_tag():
    parser = ToolCallParser(keep_text=True)
    assert parser.feed("Hi <") == [("content", "Hi")]          # " <" could start the tag: held back
    assert parser.feed("func") == []
    assert parser.feed("tor") == [("content", " <functor")]     # it did not: sent
    assert parser.feed(" <fun") == []
    assert parser.feed("ction=f>") == [("call", 0, "f")]        # it did: never sent as content
    assert parser.feed('{"a": "</function>') == [("arguments", 0, '{"a": "</function>')]
    assert parser.feed('"}') == [("arguments", 0, '"}')]
    assert parser.feed("</func") == [] and not parser.calls[0].complete
    assert parser.feed("tion> bye <fu") == [("end", 0), ("content", "  bye")]  # with the space held before the call
    assert parser.finish() == [("content", " <fu")]             # the end: held text is content
    assert parser.all_calls_complete and parser.content() == "Hi <functor  bye <fu"


def test_a_cut_call_is_started_but_not_complete():
    parser, events = _stream('<function=get_date>{"timezone": "U', [5, 10, 3], names=SCHEMAS, keep_text=True)
    assert ("call", 0, "get_date") in events and not parser.calls[0].complete
    assert not parser.all_calls_complete
    assert parse_tool_calls(parser.text)[1] == [{"name": "get_date", "arguments": '{"timezone": "U', "complete": False}]


# -- the grammars, token by token on real tokenizers ---------------------------------------------
@pytest.fixture(scope="module", params=["default", "qwen2"])
def lltok(request):
    from fastdeploy_lp.config import ModelConfig, default_model_path
    from fastdeploy_lp.processors.guided.tokenizer import build_lltokenizer
    from fastdeploy_lp.tokenizer import Tokenizer

    path = default_model_path() if request.param == "default" else fixture_dir("qwen2")
    tok = Tokenizer(path)
    return tok, build_lltokenizer(tok, tok.vocab_size, ModelConfig.from_pretrained(path).eos_token_ids)


def _accepts(lltok, gd, text: str) -> bool:
    """Whether the grammar of `gd` takes `text` (as the tokenizer encodes it) and may end there."""
    import llguidance as llg

    from fastdeploy_lp.processors.guided.compiler import grammar_source

    tok, lltokenizer = lltok
    matcher = llg.LLMatcher(lltokenizer, grammar_source(gd)[1], log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) \
        and matcher.is_accepting()


W = '<function=get_weather>{"city": "Paris", "unit": "celsius"}</function>'
D = '<function=get_date>{"timezone": "UTC"}</function>'


@pytest.mark.parametrize("choice,parallel,text,ok", [
    ("auto", True, W + D, True), ("auto", True, "Two: " + W + " and " + D + ".", True),
    ("auto", False, "One: " + W, True), ("auto", False, W + D, False), ("auto", False, W + " more", False),
    ("auto", True, "plain text", True), ("auto", False, "plain text", True),
    ("required", True, W + "\n" + D, True), ("required", False, W, True), ("required", False, W + "\n" + D, False),
    ("required", True, "text " + W, False),
    ({"type": "function", "function": {"name": "get_date"}}, True, D, True),
    ({"type": "function", "function": {"name": "get_date"}}, True, D + "\n" + D, False),
    ("none", True, "Hello <b> </function> <function", True),
    ("none", True, "Calling " + W, False), ("none", True, "x <" + "function=get_date>", False),
])
def test_grammar_admits_what_tool_choice_and_parallel_allow(lltok, choice, parallel, text, ok):
    assert _accepts(lltok, tool_call_constraint(TOOLS, choice, parallel=parallel), text) is ok


NOTE = [{"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"], "additionalProperties": False}}}]


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "note"}}])
def test_grammar_lets_the_end_tag_into_a_string_and_the_parser_keeps_it_there(lltok, choice):
    for value in ["</function>", 'a</function>b\\"</function>', "</function><function=note>{}"]:
        text = f"<function=note>{json.dumps({'text': value})}</function>"
        assert _accepts(lltok, tool_call_constraint(NOTE, choice), text), text
        _, calls = parse_tool_calls(text, names=["note"])
        assert [json.loads(c["arguments"]) for c in calls] == [{"text": value}]


def test_required_and_parallel_off_is_exactly_one_call_in_generation(llm):
    bias = {t: 6.0 for t in llm.tokenizer.encode("\n<function=")}  # push towards a second call
    gd = tool_call_constraint(TOOLS, "required", parallel=False)
    params = [SamplingParams(temperature=1.3, seed=s, max_tokens=80, guided_decoding=gd, logit_bias=bias)
              for s in range(4)]
    for out in llm.chat([MESSAGES] * 4, params, use_tqdm=False, tools=TOOLS):
        content, calls = parse_tool_calls(out.outputs.text, names=SCHEMAS)
        assert len(calls) <= 1
        if out.outputs.finish_reason == "stop":
            assert content is None and len(calls) == 1, out.outputs.text
            _check_calls(calls)


def test_random_calls_with_hostile_strings_read_back_exactly_whole_and_streamed():
    """Calls with JSON arguments full of end tags, quotes and backslashes between noise text, some
    cut short: whole, every complete call comes back as written; streamed in random pieces, the
    events agree with the whole parse."""
    import random

    rng = random.Random(7)
    atoms = ["</function>", "<function=f>", '"', "\\", "}", "]", "{", "x", " ", "\n", "é", "😀", "<", "</"]

    def text_atom():
        return "".join(rng.choice(atoms) for _ in range(rng.randint(0, 6)))

    def value(depth=0):
        r = rng.random()
        if depth > 2 or r < 0.3:
            return text_atom()
        if r < 0.4:
            return rng.choice([1, -2.5, 3e10, True, None])
        if r < 0.7:
            return {text_atom(): value(depth + 1) for _ in range(rng.randint(0, 3))}
        return [value(depth + 1) for _ in range(rng.randint(0, 3))]

    def noise():
        return "".join(rng.choice(["Hi", " ", "<", "<fun", "</function>", "\n"]) for _ in range(rng.randint(0, 4)))

    checked = 0
    for _ in range(400):
        parts, expected = [], []
        for _ in range(rng.randint(0, 3)):
            name = rng.choice(["f", "g"])
            args = json.dumps(value(), ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
            parts += [noise(), f"<function={name}>{rng.choice(['', ' ', chr(10)])}{args}{rng.choice(['', ' '])}</function>"]
            expected.append((name, args))
        text = "".join(parts + [noise()])
        cut = rng.random() < 0.3
        if cut:
            text = text[:rng.randint(0, len(text))]
        content, calls = parse_tool_calls(text, names=["f", "g"])
        got = [(c["name"], c["arguments"]) for c in calls if c["complete"]]
        assert got == (expected[:len(got)] if cut else expected), text
        assert all(c["complete"] for c in calls[:-1])
        checked += len(got)
        parser, events, pos = ToolCallParser(names=["f", "g"]), [], 0
        while pos < len(text):
            step = rng.randint(1, 8)
            events += parser.feed(text[pos:pos + step])
            pos += step
        events += parser.finish()
        ended = [e[1] for e in events if e[0] == "end"]
        assert [(parser.calls[k].name, "".join(e[2] for e in events if e[0] == "arguments" and e[1] == k))
                for k in ended] == got
        assert "".join(e[1] for e in events if e[0] == "content") == (content or ""), text
        assert [c["arguments"] for c in calls] == [  # a cut call's arguments too, as streamed
            "".join(e[2] for e in events if e[0] == "arguments" and e[1] == k) for k in range(len(parser.calls))
            if not parser.calls[k].failed]
    assert checked > 300
