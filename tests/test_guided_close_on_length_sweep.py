"""close_on_length over every budget from 1 to 60 tokens, for the schema shapes whose closings are
hard to size (formats, a pattern, nested arrays with minItems, minProperties, enums, nested objects,
json_object), on the built-in model at temperature 1: every output parses and validates, every
output cut by max_tokens was closed, and every budget below the shortest document is refused up
front — with and without n-gram speculative decoding (issue 35, item 5)."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest

from fastdeploy_lp import LLM, GuidedDecodingParams, SamplingParams
from fastdeploy_lp.config import default_model_path
from fastdeploy_lp.tokenizer.chat_template import render_chat_prompt

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(default_model_path(), "config.json")),
                                reason="the built-in model is not in fastdeploy_lp/default_model/ yet")

SCHEMAS = {
    "date_email": {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                                    "e": {"type": "string", "format": "email"}}, "required": ["d", "e"]},
    "uri_uuid_date_time": {"type": "object", "properties": {
        "u": {"type": "string", "format": "uri"}, "i": {"type": "string", "format": "uuid"},
        "t": {"type": "string", "format": "date-time"}}, "required": ["u"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                                 "n": {"type": "integer"}}, "required": ["code"]},
    "nested_arrays": {"type": "object", "properties": {"m": {"type": "array", "minItems": 2, "items": {
        "type": "array", "minItems": 2, "items": {"type": "integer"}}}}, "required": ["m"]},
    "min_properties": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["small", "medium", "extra-large"]},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "minItems": 1}}, "required": ["color", "size"]},
    "nested_objects": {"type": "object", "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "geo": {
            "type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"]}}, "required": ["city", "geo"]},
        "extra": {"type": "object", "properties": {"note": {"type": "string", "minLength": 3}}, "required": ["note"]}},
        "required": ["name", "address"]},
    "json_object": None,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "max_verify_tokens": 64,
        "draft_row_cost": 0.05}
EOS_BANNED = {5: -100.0, 2: -100.0}  # the long requests: the model must go on until the grammar ends or max_tokens


def _params(name: str, max_tokens: int, **kw) -> SamplingParams:
    schema = SCHEMAS[name]
    guided = GuidedDecodingParams(json=schema, close_on_length=True) if schema else \
        GuidedDecodingParams(json_object=True, close_on_length=True)
    return SamplingParams(temperature=1.0, seed=max_tokens, max_tokens=max_tokens, guided_decoding=guided, **kw)


def _run(llm: LLM, cases: list[tuple[str, int, SamplingParams]]) -> tuple[dict, dict]:
    """({(name, max_tokens): output}, {(name, max_tokens): refusal message}); refusals found up front."""
    prompt = render_chat_prompt(llm.tokenizer, MESSAGES)
    accepted, refused = [], {}
    for name, max_tokens, params in cases:
        try:
            llm.engine.make_requests(prompt, params, add_special_tokens=False)  # validation only
            accepted.append((name, max_tokens, params))
        except ValueError as e:
            refused[name, max_tokens] = str(e)
    outs = llm.generate([prompt] * len(accepted), [p for _, _, p in accepted], use_tqdm=False)
    return {(name, mt): out.outputs for (name, mt, _), out in zip(accepted, outs)}, refused


def _assert_closed_and_valid(name: str, o) -> None:
    assert o.finish_reason in ("stop", "length"), (name, o)
    assert (o.finish_reason == "length") == bool(o.closed_on_length), (name, o.finish_reason, o.text)
    value = json.loads(o.text)
    if SCHEMAS[name] is None:
        assert isinstance(value, dict)
    else:
        jsonschema.validate(value, SCHEMAS[name])


@pytest.fixture(scope="module")
def plain():
    return LLM(max_num_seqs=64)


@pytest.fixture(scope="module")
def swept(plain):
    return _run(plain, [(name, mt, _params(name, mt)) for name in SCHEMAS for mt in range(1, 61)])


def test_every_budget_from_1_to_60_ends_closed_and_valid_or_is_refused_up_front(plain, swept):
    outputs, refused = swept
    guide = plain.engine.pipeline.processors[0]
    for name in SCHEMAS:
        shortest = min(mt for mt in range(1, 61) if (name, mt) not in refused)  # the shortest document
        compiled = guide.compiler.compile(guide._with_server_defaults(_params(name, 1).guided_decoding))
        assert len(compiled.derived["shortest_closing"]) == shortest, name
        assert all((name, mt) in refused for mt in range(1, shortest)), name
        for mt in range(1, shortest):
            assert refused[name, mt].startswith("max_tokens: close_on_length needs room"), refused[name, mt]
        for mt in range(shortest, 61):
            _assert_closed_and_valid(name, outputs[name, mt])
    closed = sum(o.closed_on_length is True for o in outputs.values())
    assert len(outputs) > 300 and closed > 150, (len(outputs), closed)


def test_with_speculative_decoding_the_same_closed_documents(plain, swept):
    """Every third budget, and longer ones with EOS banned (where the closing is far off for a while,
    so the requests draft): the same tokens as without speculation, closed and valid."""
    spec = LLM(max_num_seqs=32, speculative_config=SPEC)
    outputs, refused = swept
    cases = [(name, mt, _params(name, mt)) for name in SCHEMAS for mt in range(2, 61, 3)]
    long = [(name, mt, _params(name, mt, logit_bias=EOS_BANNED)) for name in SCHEMAS for mt in (100,)]
    long_plain, _ = _run(plain, long)
    drafted = spec.speculative_stats()["accepted_tokens"]
    got, spec_refused = _run(spec, cases + long)
    assert spec_refused == {key: refused[key] for key in refused if key[1] % 3 == 2}
    for (name, mt), o in got.items():
        expected = long_plain[name, mt] if mt > 60 else outputs[name, mt]
        assert list(o.token_ids) == list(expected.token_ids), (name, mt, o.text, expected.text)
        _assert_closed_and_valid(name, o)
    assert spec.speculative_stats()["accepted_tokens"] > drafted
