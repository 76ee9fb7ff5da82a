"""close_on_length: a JSON-constrained output that reaches max_tokens ends as a complete document
(the built-in model, temperature 1, real llguidance); without the option nothing changes."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest

from fastdeploy_lp import LLM, GuidedDecodingParams, SamplingParams
from fastdeploy_lp.config import default_model_path
from fastdeploy_lp.processors.guided.closing import ClosingSearch, JsonSyntax

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(default_model_path(), "config.json")),
                                reason="the built-in model is not in fastdeploy_lp/default_model/ yet")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "address", "tags", "ok"]}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=8)


def _params(seed, max_tokens, close, schema=PERSON):
    gd = GuidedDecodingParams(json=schema, close_on_length=close) if schema else \
        GuidedDecodingParams(json_object=True, close_on_length=close)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, guided_decoding=gd)


def test_tight_budget_over_a_nested_schema_always_parses_and_validates_over_20_seeds(llm):
    params = [_params(seed, max_tokens, True) for seed in range(20) for max_tokens in (60, 90)]
    outs = llm.chat([MESSAGES] * len(params), params, use_tqdm=False)
    for p, out in zip(params, outs):
        o = out.outputs
        assert len(o.token_ids) <= p.max_tokens
        if o.finish_reason == "length":
            assert o.closed_on_length, o.text
        else:  # the model ended the document itself, inside the budget
            assert o.finish_reason == "stop" and not o.closed_on_length
        jsonschema.validate(json.loads(o.text), PERSON)
    assert sum(out.outputs.closed_on_length for out in outs) >= len(outs) // 2


def test_json_object_closes_too(llm):
    params = [_params(seed, 24, True, schema=None) for seed in range(6)]
    for out in llm.chat([MESSAGES] * len(params), params, use_tqdm=False):
        assert isinstance(json.loads(out.outputs.text), dict), out.outputs.text
        assert out.outputs.finish_reason == "stop" or out.outputs.closed_on_length


def test_without_the_option_the_output_is_unchanged(llm):
    plain = [_params(seed, 40, None) for seed in range(3)]
    off = [_params(seed, 40, False) for seed in range(3)]
    outs = llm.chat([MESSAGES] * 6, plain + off, use_tqdm=False)
    for a, b in zip(outs[:3], outs[3:]):
        assert list(a.outputs.token_ids) == list(b.outputs.token_ids)
        assert a.outputs.finish_reason == "length" and not a.outputs.closed_on_length
    with pytest.raises(json.JSONDecodeError):
        json.loads(outs[0].outputs.text)


@pytest.mark.parametrize("field", ["regex", "choice", "grammar"])
def test_close_on_length_names_itself_on_a_constraint_that_is_not_json(field):
    value = {"regex": "[a-z]+", "choice": ["a", "b"], "grammar": 'start: "x"'}[field]
    with pytest.raises(ValueError, match="close_on_length: only applies to a JSON constraint"):
        GuidedDecodingParams(**{field: value}, close_on_length=True)
    with pytest.raises(ValueError, match="close_on_length: must be a boolean"):
        GuidedDecodingParams(json_object=True, close_on_length="yes")


@pytest.mark.parametrize("prefix, cut", [
    ('{"name": "Bo', '{"name": "Bo", "age": 0, "address": {"city": "", "zip": "'),  # string cut, keys given
    ('{"name": "B", "age": 1, "address": {"city": "x", "zip": "12', '{"name": "B", "age": 1, "address": {"city": '
                                                                    '"x", "zip": "12'),  # a pattern still met
    ('{"name": "B\\', '{"name": "B\\'),  # inside an escape
    ('{"name": "B", "age": 12', '{"name": "B", "age": 12, '),  # a number ends where it is
])
def test_the_closing_is_valid_from_inside_strings_numbers_and_escapes(llm, prefix, cut):
    guide = llm.engine.pipeline.processors[0]
    matcher = guide.compiler.compile(GuidedDecodingParams(json=PERSON)).new_matcher()
    assert matcher.consume_tokens(guide.tokenizer.encode(prefix, add_special_tokens=False))
    syntax = JsonSyntax()
    syntax.feed(prefix.encode())
    closing = ClosingSearch(guide.compiler.lltokenizer, guide.tokenizer.token_bytes).closing(matcher, syntax)
    text = prefix + guide.tokenizer.decode(closing)
    assert text.startswith(cut), text
    jsonschema.validate(json.loads(text), PERSON)
    assert not matcher.is_accepting()  # the search works on a copy
