"""JSON number length cap and the empty schema `{}`: real llguidance on the qwen2 fixture's
vocabulary, then the built-in model pushed towards endless digits."""

from __future__ import annotations

import json
import os

import llguidance as llg
import pytest
from conftest import fixture_dir

from fastdeploy_lp import LLM, GuidedDecodingParams, SamplingParams
from fastdeploy_lp.config import EngineArgs, default_model_path
from fastdeploy_lp.processors.guided.compiler import grammar_source

TOK = llg.LLTokenizer(f"{fixture_dir('qwen2')}/tokenizer.json", eos_token=2)


def _accepts(gd: GuidedDecodingParams, text: str) -> bool:
    _, grammar = grammar_source(gd)
    matcher = llg.LLMatcher(TOK, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    tokens = TOK.tokenize_str(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


def _capped(schema, digits=15, **kw) -> GuidedDecodingParams:
    return GuidedDecodingParams(json=schema, max_number_digits=digits, **kw)


@pytest.mark.parametrize("schema", [{"type": "number"}, {"type": ["number", "null"]}, {"type": "integer"}])
def test_a_number_has_at_most_the_cap_of_integer_digits(schema):
    assert _accepts(_capped(schema), "9" * 15)
    assert _accepts(_capped(schema), "-" + "9" * 15)
    assert not _accepts(_capped(schema), "1" + "0" * 15)
    assert _accepts(_capped(schema, 0), "1" + "0" * 40)  # 0: no cap


def test_a_fraction_has_at_most_ten_digits_and_no_exponent():
    assert _accepts(_capped({"type": "number"}), "-3.1415926535")
    assert not _accepts(_capped({"type": "number"}), "3.14159265358")
    assert _accepts(_capped({"type": "number"}, 4), "0.1234") and not _accepts(_capped({"type": "number"}, 4), "0.12345")
    assert not _accepts(_capped({"type": "number"}), "1e5")


def test_the_schema_own_tighter_bounds_and_step_stay():
    schema = {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}
    assert _accepts(_capped(schema), "9.5") and not _accepts(_capped(schema), "10.5")
    assert not _accepts(_capped(schema), "-1") and not _accepts(_capped(schema), "0.25")


@pytest.mark.parametrize("schema", [{}, True, "{}"])
def test_empty_schema_is_any_json_value_with_numbers_capped(schema):
    for text in ('{"a": [1, 2.5, {"b": null}], "c": "x"}', "[true, false]", '"text"', "12", "null"):
        assert _accepts(_capped(schema), text), text
    for text in ("1" * 16, '{"a": ' + "1" * 16 + "}", "[[" + "2" * 16 + "]]", "0.12345678901"):
        assert not _accepts(_capped(schema), text), text


def test_any_value_positions_inside_a_schema_are_capped():
    schema = {"type": "object", "properties": {"meta": {}, "list": {"type": "array", "items": True}},
              "additionalProperties": {"type": "number"}}
    assert _accepts(_capped(schema), '{"meta": {"k": [1]}, "list": [1, "a"], "z": 3.5}')
    assert not _accepts(_capped(schema), '{"meta": ' + "7" * 16 + "}")
    assert not _accepts(_capped(schema), '{"list": [' + "7" * 16 + "]}")
    assert not _accepts(_capped(schema), '{"z": ' + "7" * 16 + "}")


def test_json_object_values_are_capped():
    gd = GuidedDecodingParams(json_object=True, max_number_digits=15)
    assert _accepts(gd, '{"a": {"b": [1.5]}}')
    assert not _accepts(gd, '{"a": {"b": [' + "1" * 16 + "]}}")
    assert not _accepts(gd, "[1]")


def test_strict_schema_with_a_cap_keeps_its_closed_objects():
    schema = {"name": "n", "strict": True, "schema": {"type": "object", "properties": {"v": {"type": "number"}}}}
    assert _accepts(_capped(schema), '{"v": 2}')
    assert not _accepts(_capped(schema), '{"v": 2, "w": 1}')


def test_bad_cap_values_are_refused_naming_the_field():
    for bad in (-1, 1.5, "3", True, 301):
        with pytest.raises(ValueError, match="max_number_digits"):
            GuidedDecodingParams(json={}, max_number_digits=bad)


@pytest.mark.parametrize("bound", [{"minimum": 10**16}, {"exclusiveMinimum": 1e15}, {"maximum": -1e20}])
def test_a_bound_past_the_cap_names_the_cap_not_a_bound_the_user_never_wrote(bound):
    with pytest.raises(ValueError, match=r"^guided_json: a (minimum|maximum) of .* needs more than the 15 digits .*"
                                         r"--guided-json-number-digits"):
        grammar_source(GuidedDecodingParams(json={"type": "integer", **bound}, max_number_digits=15))
    grammar_source(GuidedDecodingParams(json={"type": "integer", **bound}, max_number_digits=0))  # no cap: fine


def test_the_server_default_is_fifteen_digits_and_written_once():
    assert EngineArgs().guided_json_number_digits == 15


needs_model = pytest.mark.skipif(not os.path.isfile(os.path.join(default_model_path(), "config.json")),
                                 reason="the built-in model is not in fastdeploy_lp/default_model/ yet")


@needs_model
def test_a_model_pushed_to_endless_digits_stops_at_the_cap_and_parses():
    """Every digit token biased up: without the cap the number runs to max_tokens; with the
    engine's default cap the number ends and the output is a JSON value that parses."""
    llm = LLM(max_num_seqs=4)
    digits = [t for t in range(llm.tokenizer.vocab_size)
              if llm.tokenizer.decode([t]).strip() in list("0123456789")]
    assert digits
    bias = {t: 30.0 for t in digits}
    prompt = [{"role": "user", "content": "A number, as JSON."}]

    def run(schema, cap):
        gd = GuidedDecodingParams(json=schema, max_number_digits=cap)
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=96, logit_bias=bias, guided_decoding=gd)
                  for s in range(4)]
        return [o.outputs for o in llm.chat([prompt] * len(params), params, use_tqdm=False)]

    for out in run({"type": "number"}, 0):
        assert out.finish_reason == "length", out.text
    for schema in ({"type": "number"}, {}):
        for out in run(schema, None):  # None: the engine's default, 15
            assert out.finish_reason == "stop", out.text
            value = json.loads(out.text)
            if isinstance(value, (int, float)):
                assert abs(value) < 1e15
