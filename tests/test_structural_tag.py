"""Structural tags in xgrammar's current format (and the older forms), compiled to llguidance and
checked with a real matcher on the qwen2 fixture's tokenizer: for every node type, outputs it must
accept and outputs it must reject; triggered tags, separators, Qwen XML parameters; error paths."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance as llg
import pytest
from conftest import fixture_dir

from fastdeploy_lp.processors.guided.structural_tag import structural_tag_grammar

TOK = llg.LLTokenizer(f"{fixture_dir('qwen2')}/tokenizer.json", eos_token=2)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
DATE = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
TAGS = [{"type": "tag", "begin": "<function=get_weather>", "content": {"type": "json_schema", "json_schema": WEATHER},
         "end": "</function>"},
        {"type": "tag", "begin": "<function=get_date>", "content": {"type": "json_schema", "json_schema": DATE},
         "end": "</function>"}]
W_CALL = '<function=get_weather>{"city": "Paris"}</function>'
D_CALL = '<function=get_date>{"tz": "UTC"}</function>'


def _grammar(fmt, ws=None) -> str:
    return structural_tag_grammar({"type": "structural_tag", "format": fmt}, ws)


def _matcher(grammar: str) -> llg.LLMatcher:
    m = llg.LLMatcher(TOK, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def _accepts(grammar: str, text: str) -> bool:
    """The whole of `text` is a complete output of the grammar (fed as the tokenizer splits it)."""
    m = _matcher(grammar)
    return m.consume_tokens(TOK.tokenize_str(text)) and m.is_accepting()


def _check(fmt, good, bad, ws=None):
    g = _grammar(fmt, ws)
    for text in good:
        assert _accepts(g, text), text
    for text in bad:
        assert not _accepts(g, text), text


def _error(fmt) -> str:
    with pytest.raises(ValueError) as info:
        _grammar(fmt)
    return str(info.value)


# -- one node type at a time --------------------------------------------------------------------
def test_const_string():
    _check({"type": "const_string", "value": "Answer: é｜\n"}, ["Answer: é｜\n"],
           ["Answer: é｜", "Answer: é｜\nx", ""])


def test_json_schema_node():
    fmt = {"type": "json_schema", "json_schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                  "required": ["n"]}}
    # The default JSON layout is json.dumps' (bounded whitespace): `{"n":3}` and newlines are out.
    _check(fmt, ['{"n": 3}'], ['{"n": "3"}', '{}', '{"n": 3} x', '{"n":3}', '{\n"n": 3}'])
    _check({**fmt, "max_whitespace_cnt": 2}, ['{"n":3}', '{ "n" :  3}'], ['{"n":   3}'])
    _check({**fmt, "style": "json"}, ['{"n": 3}'], ['{"n": 3.5}'])
    _check({"type": "json_schema", "json_schema": json.dumps({"type": "boolean"})}, ["true"], ["1"])
    _check({"type": "json_schema", "json_schema": True}, ["[1, null]"], ["nul"])


def test_json_schema_max_whitespace_cnt():
    fmt = {"type": "json_schema", "json_schema": {"type": "array"}, "max_whitespace_cnt": 1}
    _check(fmt, ["[1, 2]", "[1,2]"], ["[1,  2]", "[1,\n\n2]"])


def test_regex_node():
    _check({"type": "regex", "pattern": "[A-Z]{3}-[0-9]{4}"}, ["ABC-1234"], ["ABC-123", "abc-1234", "ABC-12345"])


def test_grammar_node_gbnf_and_lark():
    _check({"type": "grammar", "grammar": 'root ::= ("yes" | "no")'}, ["yes", "no"], ["maybe", "yesno"])
    _check({"type": "grammar", "grammar": 'start: "a" NUM\nNUM: /[0-9]+/'}, ["a42"], ["a", "b42"])


def test_any_text_alone_excludes_and_max_chars():
    _check({"type": "any_text"}, ["", "anything <at all>\n"], [])
    _check({"type": "any_text", "excludes": ["</end>", "STOP"]}, ["a < b </en"], ["x</end>", "STOP"])
    _check({"type": "any_text", "max_chars": 5}, ["", "héllo"], ["héllo!"])


def test_sequence_any_text_ends_at_the_next_literal():
    fmt = {"type": "sequence", "elements": [
        {"type": "any_text", "excludes": ["<"]}, {"type": "const_string", "value": "END"},
        {"type": "regex", "pattern": "[0-9]+"}]}
    _check(fmt, ["abc END42", "END7"], ["abcEND", "abc<END1", "aENDbEND1"])


def test_or_node():
    fmt = {"type": "or", "elements": [{"type": "const_string", "value": "yes"},
                                      {"type": "json_schema", "json_schema": {"type": "integer"}}]}
    _check(fmt, ["yes", "12"], ["no", "yes12", "1.5"])


def test_tag_with_any_text_stops_at_its_end_and_end_lists():
    fmt = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}
    _check(fmt, ["<think>a < b\n</thin k</think>", "<think></think>"], ["<think>a</think>b", "<think>a", "a</think>"])
    fmt = {"type": "tag", "begin": "<r>", "content": {"type": "any_text"}, "end": ["</r>", "</answer>"]}
    _check(fmt, ["<r>x</r>", "<r>x</answer>"], ["<r>x</r></answer>", "<r>x"])
    fmt = {"type": "tag", "begin": "<n>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
           "end": "</n>"}
    _check(fmt, ["<n>42</n>"], ["<n>x</n>", "<n>42"])


def test_nested_sequence_and_or():
    fmt = {"type": "sequence", "elements": [
        {"type": "or", "elements": [
            {"type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
             "end": "</a>"},
            {"type": "sequence", "elements": [{"type": "const_string", "value": "b:"},
                                              {"type": "regex", "pattern": "[a-z]+"}]}]},
        {"type": "const_string", "value": ";"},
        {"type": "tag", "begin": "<t>", "end": "</t>", "content": {"type": "sequence", "elements": [
            {"type": "any_text"}, {"type": "const_string", "value": "|"},
            {"type": "or", "elements": [{"type": "const_string", "value": "x"}, {"type": "any_text"}]}]}}]}
    _check(fmt, ["<a>1</a>;<t>hi|x</t>", "b:zz;<t>|free text</t>"],
           ["<a>z</a>;<t>|x</t>", "b:ZZ;<t>|x</t>", "b:z<t>|x</t>", "b:z;<t>hi</t>", "b:z;<t>|x</t>y"])


def test_optional_star_plus_repeat():
    x = {"type": "const_string", "value": "x"}
    _check({"type": "sequence", "elements": [{"type": "optional", "content": x},
                                             {"type": "const_string", "value": "!"}]},
           ["x!", "!"], ["xx!"])
    _check({"type": "star", "content": x}, ["", "xxx"], ["y"])
    _check({"type": "plus", "content": x}, ["x", "xx"], [""])
    _check({"type": "repeat", "min": 2, "max": 3, "content": x}, ["xx", "xxx"], ["x", "xxxx"])
    _check({"type": "repeat", "min": 2, "max": -1, "content": x}, ["xx", "xxxxx"], ["x"])
    _check({"type": "repeat", "min": 0, "max": 2, "content": x}, ["", "xx"], ["xxx"])


# -- triggered tags -----------------------------------------------------------------------------
def test_triggered_tags_free_text_with_calls():
    fmt = {"type": "triggered_tags", "triggers": ["<function="], "tags": TAGS}
    _check(fmt, ["", "just text < >", "x <functio n <function", f"a {W_CALL} b {D_CALL}", W_CALL + D_CALL],
           ["<function=other>{}</function>", '<function=get_date>{"tz": "PST"}</function>', "x <function=get_date>"])
    g = _grammar(fmt)
    m = _matcher(g)  # at the trigger, only the rest of a tag's begin may follow
    assert m.consume_tokens(TOK.tokenize_str("Sure. <function="))
    assert not m.is_accepting()
    assert not m.try_consume_tokens(TOK.tokenize_str("foo")) and m.consume_tokens(TOK.tokenize_str("get_"))


def test_triggered_tags_at_least_one_and_stop_after_first():
    base = {"type": "triggered_tags", "triggers": ["<function="], "tags": TAGS}
    _check({**base, "at_least_one": True}, [W_CALL, f"{W_CALL} then {D_CALL} end"], ["", "text", f"hi {W_CALL}"])
    _check({**base, "stop_after_first": True}, ["", "text", f"hi {W_CALL}"], [f"{W_CALL} more", W_CALL + D_CALL])
    _check({**base, "at_least_one": True, "stop_after_first": True}, [W_CALL, D_CALL],
           ["", f"hi {W_CALL}", f"{W_CALL} ", W_CALL + D_CALL])
    g = _grammar({**base, "at_least_one": True, "stop_after_first": True})
    m = _matcher(g)
    assert m.consume_tokens(TOK.tokenize_str(W_CALL)) and m.is_stopped()  # only EOS is left


def test_triggered_tags_excludes_several_triggers_and_end_detection():
    tags = [{"begin": "<a>", "content": {"type": "regex", "pattern": "[0-9]+"}, "end": "</a>"},
            {"begin": "[b]", "content": {"type": "const_string", "value": "ok"}, "end": "[/b]"}]
    fmt = {"type": "triggered_tags", "triggers": ["<a>", "[b]"], "tags": tags, "excludes": ["DONE"]}
    _check(fmt, ["x<a>1</a>y[b]ok[/b]z", "< a> [ b]"], ["<a>x</a>", "[b]no[/b]", "DONE", "x<a>1</a>DONE"])
    # inside a tag, free text and tags run until the tag's end (xgrammar's end detection)
    fmt = {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<response>", "end": "</response>", "content": {
            "type": "triggered_tags", "triggers": ["<function="], "tags": TAGS}},
        {"type": "const_string", "value": "!"}]}
    _check(fmt, [f"<response>a {W_CALL} b</response>!", "<response></response>!"],
           ["<response>a</response>b</response>!", f"<response>{W_CALL}", "<response>x</response>"])


# -- tags with separator ------------------------------------------------------------------------
def test_tags_with_separator():
    base = {"type": "tags_with_separator", "tags": TAGS, "separator": "\n"}
    _check(base, ["", W_CALL, f"{W_CALL}\n{D_CALL}\n{W_CALL}"], [f"{W_CALL}{D_CALL}", f"x{W_CALL}", f"{W_CALL}\n"])
    _check({**base, "at_least_one": True}, [W_CALL, f"{W_CALL}\n{D_CALL}"], [""])
    _check({**base, "stop_after_first": True}, ["", D_CALL], [f"{W_CALL}\n{D_CALL}"])
    _check({**base, "at_least_one": True, "stop_after_first": True}, [D_CALL], ["", f"{W_CALL}\n{D_CALL}"])
    # what follows may start with the separator: the lexer must not lose the way to the next tag
    fmt = {"type": "sequence", "elements": [base, {"type": "const_string", "value": "\n<end>"}]}
    _check(fmt, [f"{W_CALL}\n{D_CALL}\n<end>", "\n<end>"], [f"{W_CALL}\n<end>\n{D_CALL}"])


# -- Qwen XML parameters ------------------------------------------------------------------------
PARAMS = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
    "unit": {"enum": ["celsius", "fahrenheit"]}, "where": {"type": "object", "properties": {"lat": {"type": "number"}},
                                                        "required": ["lat"], "additionalProperties": False}},
    "required": ["city", "days"], "additionalProperties": False}


def test_qwen_xml_parameter_accepts_a_valid_list_and_rejects_wrong_types():
    fmt = {"type": "qwen_xml_parameter", "json_schema": PARAMS}
    good = ["<parameter=city>Paris</parameter><parameter=days>3</parameter>",
            # Qwen3-Coder's layout: newlines around values and between parameters
            "\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "<parameter=unit>\ncelsius\n</parameter>\n<parameter=where>\n{\"lat\": 1.5}\n</parameter>\n",
            # a string is raw text up to </parameter>: quotes, <, &, newlines and all
            '<parameter=city>"a" < b & c\nline 2</parameter><parameter=days>10</parameter>']
    bad = ["<parameter=city>Paris</parameter><parameter=days>three</parameter>",  # wrong type
           "<parameter=city>Paris</parameter><parameter=days>0</parameter>",  # minimum
           "<parameter=city>Paris</parameter>",  # days is required
           "<parameter=days>3</parameter><parameter=city>Paris</parameter>",  # declared order
           "<parameter=city>P</parameter><parameter=days>3</parameter><parameter=unit>kelvin</parameter>",
           "<parameter=city>P</parameter><parameter=days>3</parameter><parameter=where>{\"lat\": \"x\"}</parameter>",
           "<parameter=city>P</parameter><parameter=days>3</parameter><parameter=extra>1</parameter>",
           "<parameter=city>P</parameter>x<parameter=days>3</parameter>"]
    _check(fmt, good, bad)
    # the current spelling: a json_schema node with style qwen_xml
    _check({"type": "json_schema", "style": "qwen_xml", "json_schema": PARAMS}, good, bad)


def test_qwen_xml_strings_types_and_extra_parameters():
    schema = {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"}, "note": {"type": ["string", "null"], "maxLength": 4},
        "day": {"type": "string", "format": "date"}, "flag": {"$ref": "#/$defs/flag"}},
        "$defs": {"flag": {"type": "boolean"}}}
    fmt = {"type": "qwen_xml_parameter", "json_schema": schema}
    _check(fmt, ["", "<parameter=code>ABC</parameter>", "<parameter=code>\nABC\n</parameter>",
                 "<parameter=note>null</parameter><parameter=day>2024-02-29</parameter>",
                 "<parameter=note>abcd</parameter><parameter=flag>true</parameter>",
                 "<parameter=flag>false</parameter><parameter=other>anything</parameter>"],
           ["<parameter=code>ABCD</parameter>", "<parameter=note>abcde</parameter>",
            "<parameter=day>2024-02-30</parameter>", "<parameter=flag>yes</parameter>",
            "<parameter=code>ABC</parameter></parameter>"])
    # the request's whitespace pattern governs the whitespace around parameters and JSON values
    _check({"type": "qwen_xml_parameter", "json_schema": {"properties": {"n": {"type": "integer"}}}},
           ["<parameter=n>1</parameter>"], ["<parameter=n> 1</parameter>", "\n<parameter=n>1</parameter>"], ws="")


def test_qwen3_coder_tool_calls_as_triggered_tags():
    fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [
        {"type": "tag", "begin": "<tool_call>\n<function=get_weather>\n",
         "content": {"type": "qwen_xml_parameter", "json_schema": PARAMS}, "end": "</function>\n</tool_call>"}]}
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    _check(fmt, ["", f"Let me look.\n{call}", call + "\n" + call],
           [call.replace("2", "two"), "<tool_call>\n<function=other>\n</function>\n</tool_call>"])
    # an end that starts with whitespace, like the whitespace allowed before another parameter
    fmt = {"type": "tag", "begin": "<function=f>\n", "end": "\n</function>",
           "content": {"type": "qwen_xml_parameter", "json_schema": PARAMS}}
    one = "<parameter=city>\nParis\n</parameter>"
    _check(fmt, [f"<function=f>\n{one}\n<parameter=days>\n2\n</parameter>\n</function>"],
           [f"<function=f>\n{one}\n</function>", f"<function=f>\n{one}\n<parameter=days>2</parameter></function>"])


# -- the older forms ----------------------------------------------------------------------------
def test_older_structures_form_and_tags_without_type():
    legacy = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": t["begin"], "schema": t["content"]["json_schema"], "end": t["end"]} for t in TAGS]}
    untyped = [{k: v for k, v in t.items() if k != "type"} for t in TAGS]
    g = structural_tag_grammar(legacy)
    assert g == _grammar({"type": "triggered_tags", "triggers": ["<function="], "tags": untyped})
    assert _accepts(g, f"a {W_CALL} b") and not _accepts(g, "<function=x>")


# -- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, message", [
    ({"type": "sequence", "elements": [{"type": "const_string", "value": "a"}, {"type": "tag", "begin": 3}]},
     "structural_tag.format.elements[1].begin: must be a string"),
    ({"type": "const_string"}, "structural_tag.format.value: must be a string"),
    ({"type": "bogus"}, "structural_tag.format.type: unknown structural tag format 'bogus'"),
    ({"type": "or", "elements": []}, "structural_tag.format.elements: must be a non-empty list"),
    ({"type": "const_string", "value": "a", "vale": 1}, "structural_tag.format.vale: unknown field"),
    ({"type": "regex", "pattern": "(x"}, "structural_tag.format.pattern: invalid or unsupported regex"),
    ({"type": "grammar", "grammar": "root ::= foo"}, "structural_tag.format.grammar: invalid GBNF grammar"),
    ({"type": "json_schema", "json_schema": {"type": "wat"}},
     "structural_tag.format.json_schema: invalid or unsupported"),
    ({"type": "json_schema", "json_schema": {}, "style": "glm_xml"}, "structural_tag.format.style: 'glm_xml'"),
    ({"type": "json_schema", "json_schema": {}, "any_order": True}, "structural_tag.format.any_order"),
    ({"type": "tag", "begin": "<a>", "content": {"type": "regex"}, "end": "</a>"},
     "structural_tag.format.content.pattern: must be a non-empty string"),
    ({"type": "tags_with_separator", "separator": ",", "tags": [{"begin": "<a>", "content": {"type": "any_text"},
                                                                  "end": ""}]},
     "structural_tag.format.tags[0].content: any_text must be followed by a literal"),
    ({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "json_schema", "json_schema": {}}]},
     "structural_tag.format.elements[0]: any_text must be followed"),
    ({"type": "any_text", "max_tokens": 5}, "structural_tag.format.max_tokens: not supported"),
    ({"type": "any_text", "excludes": [""]}, "structural_tag.format.excludes[0]: must be a non-empty string"),
    ({"type": "triggered_tags", "triggers": ["<f"], "tags": [TAGS[0], {**TAGS[1], "begin": "[x]"}]},
     "structural_tag.format.tags[1].begin: must start with one of the triggers"),
    ({"type": "triggered_tags", "triggers": ["<function=", "<f"], "tags": TAGS},
     "structural_tag.format.triggers[0]: '<function=' starts with another trigger"),
    ({"type": "triggered_tags", "triggers": ["<function="], "tags": TAGS, "at_least_one": "yes"},
     "structural_tag.format.at_least_one: must be true or false"),
    ({"type": "triggered_tags", "triggers": ["<f"], "tags": [{**TAGS[0], "type": "or"}]},
     "structural_tag.format.tags[0].type: must be 'tag'"),
    ({"type": "tags_with_separator", "separator": 1, "tags": TAGS},
     "structural_tag.format.separator: must be a string"),
    ({"type": "tags_with_separator", "separator": ",", "tags": [{**TAGS[0], "end": ["</a>", 2]}]},
     "structural_tag.format.tags[0].end[1]: must be a string"),
    ({"type": "qwen_xml_parameter", "json_schema": {"type": "array"}},
     "structural_tag.format.json_schema.type: Qwen XML parameters need an object schema"),
    ({"type": "qwen_xml_parameter", "json_schema": {"properties": {"a": {"type": "integer"}}, "required": ["b"]}},
     "structural_tag.format.json_schema.required: 'b' is not among the properties"),
    ({"type": "qwen_xml_parameter", "json_schema": {"properties": {"a": {"type": "string", "format": "email"}}}},
     "structural_tag.format.json_schema.properties.a.format: 'email' is not supported"),
    ({"type": "qwen_xml_parameter", "json_schema": {"properties": {"a": {"type": "integer", "minimum": "x"}}}},
     "structural_tag.format.json_schema.properties.a: invalid or unsupported"),
    ({"type": "qwen_xml_parameter", "json_schema": {"minProperties": 1}},
     "structural_tag.format.json_schema.minProperties: not supported"),
    ({"type": "dispatch", "rules": []}, "structural_tag.format.type: 'dispatch' is not supported"),
    ({"type": "tag", "begin": {"type": "token", "token": 5}, "content": {"type": "any_text"}, "end": "x"},
     "structural_tag.format.begin: token-level begins are not supported"),
])
def test_malformed_nodes_name_their_path(fmt, message):
    assert _error(fmt).startswith(message), _error(fmt)


def test_top_level_and_older_form_errors():
    deep = {"type": "const_string", "value": "x"}
    for _ in range(200):
        deep = {"type": "sequence", "elements": [deep]}
    for value, message in [
        ({"type": "structural_tag", "format": deep}, "structural_tag: is nested 403 levels deep; at most"),
        ({"type": "structural_tag"}, "structural_tag: needs 'format'"),
        ({"type": "other", "format": {}}, "structural_tag.type: must be 'structural_tag'"),
        ({"type": "structural_tag", "format": {"type": "any_text"}, "extra": 1}, "structural_tag.extra: unknown field"),
        ({"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<a"]},
         "structural_tag.structures[0]"),
        ({"type": "structural_tag", "structures": [{"begin": 1, "schema": {}}], "triggers": ["<a"]},
         "structural_tag.structures[0].begin: must be a string"),
        ({"type": "structural_tag", "structures": [{"begin": "<b>", "schema": {}}], "triggers": ["<a"]},
         "structural_tag.structures[0].begin: must start with one of the triggers"),
        ({"type": "structural_tag", "structures": [{"begin": "<a>", "schema": "{x"}], "triggers": ["<a"]},
         "structural_tag.structures[0].schema: invalid JSON"),
    ]:
        with pytest.raises(ValueError) as info:
            structural_tag_grammar(value)
        assert str(info.value).startswith(message), str(info.value)


# -- end to end ---------------------------------------------------------------------------------
def _qwen_arguments(text: str, schema: dict) -> dict:
    """Parse `<parameter=k>v</parameter>`... the way a Qwen3-Coder tool parser does."""
    args, pos = {}, 0
    item = re.compile(r"\s*<parameter=(\w+)>(.*?)</parameter>", re.S)
    while m := item.match(text, pos):
        raw = m.group(2).strip()
        args[m.group(1)] = raw if schema["properties"][m.group(1)].get("type") == "string" else json.loads(raw)
        pos = m.end()
    assert not text[pos:].strip(), text
    return args


def test_engine_generates_valid_qwen_xml_calls():
    from fastdeploy_lp import LLM, GuidedDecodingParams, SamplingParams

    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    gd = GuidedDecodingParams(structural_tag={"type": "structural_tag", "format": {
        "type": "tag", "begin": "<function=get_weather>\n", "end": "</function>",
        "content": {"type": "json_schema", "style": "qwen_xml", "json_schema": schema, "max_whitespace_cnt": 1}}})
    llm = LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=128, guided_decoding=gd) for s in range(4)]
    outs = llm.generate(["Weather in Paris?"] * 4, params, use_tqdm=False)
    assert all(o.outputs.finish_reason == "stop" for o in outs), [o.outputs.text for o in outs]
    for out in outs:
        text = out.outputs.text
        assert text.startswith("<function=get_weather>\n") and text.endswith("</function>"), text
        args = _qwen_arguments(text[len("<function=get_weather>\n"):-len("</function>")], schema)
        jsonschema.validate(args, schema)
