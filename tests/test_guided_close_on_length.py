"""close_on_length: a JSON-constrained output that reaches max_tokens ends as a complete document
(the built-in model, temperature 1, real llguidance); without the option nothing changes."""

from __future__ import annotations

import datetime
import json
import os
import re

import jsonschema
import numpy as np
import pytest

from fastdeploy_lp import LLM, GuidedDecodingParams, SamplingParams
from fastdeploy_lp.config import default_model_path
from fastdeploy_lp.processors.guided.closing_search import ClosingSearch
from fastdeploy_lp.processors.guided.json_syntax import JsonSyntax

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


# Issue 35 item 5: a date and an email at max_tokens 42-44 ended inside the email ("the closing
# needs 26 tokens, 22 are left"); minProperties closed with `{"": 0, "": 0}` (one property parsed).
DATE_EMAIL = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                               "e": {"type": "string", "format": "email"}}, "required": ["d", "e"]}
MIN_PROPERTIES = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}
LINKED = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
          "required": ["v", "next"]}


@pytest.mark.parametrize("schema, budgets", [(DATE_EMAIL, (42, 43, 44)), (MIN_PROPERTIES, (11, 12))])
def test_the_budgets_issue_35_reported_end_in_a_document_that_validates(llm, schema, budgets):
    params = [_params(seed, max_tokens, True, schema=schema) for max_tokens in budgets for seed in range(3)]
    for p, out in zip(params, llm.chat([MESSAGES] * len(params), params, use_tqdm=False)):
        o = out.outputs
        assert o.finish_reason == "stop" or (o.finish_reason == "length" and o.closed_on_length), (p.max_tokens, o)
        jsonschema.validate(json.loads(o.text), schema)


def test_min_properties_in_10_tokens_is_refused_rather_than_closed_with_one_key_twice(llm):
    """`{"": 0, "": 0}` fit 10 tokens but parses to one property; two distinct keys need 11."""
    with pytest.raises(ValueError, match=r"^max_tokens: close_on_length needs room .* \(11 tokens\); max_tokens is 10"):
        llm.chat(MESSAGES, _params(0, 10, True, schema=MIN_PROPERTIES), use_tqdm=False)


@pytest.mark.parametrize("schema, prefix, longest", [
    (DATE_EMAIL, '{"d": "2020-01-01", "e": "population', 4),  # `@0"}`: not every byte but `@` first
    (DATE_EMAIL, '{"d": "20', 20),                            # the date's digits, then the shortest email
    (MIN_PROPERTIES, "{", 12),                                # `{"": 0, "0": 0}`: distinct keys
    (MIN_PROPERTIES, '{"a": 1, "a": 2', 6),                   # a key written twice counts once
    (LINKED, "", 14),                                         # `null`, not one more object forever
    ({"anyOf": [{"type": "integer", "minimum": 1000}, {"type": "string", "format": "uuid"}]}, "", 4),
    ({"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, '"Q', 7),
    ({"enum": ["extra-large", "xl", 12345]}, "", 5),
])
def test_the_closing_is_short_and_valid_where_a_format_key_or_branch_decides(llm, schema, prefix, longest):
    guide = llm.engine.pipeline.processors[0]
    matcher = guide.compiler.compile(GuidedDecodingParams(json=schema)).new_matcher()
    assert not prefix or matcher.consume_tokens(guide.tokenizer.encode(prefix, add_special_tokens=False))
    syntax = JsonSyntax()
    syntax.feed(prefix.encode())
    closing = guide._search().closing(matcher, syntax)
    assert closing is not None and len(closing) <= longest, closing and guide.tokenizer.decode(closing)
    jsonschema.validate(json.loads(prefix + guide.tokenizer.decode(closing)), schema)


def test_one_token_adds_no_more_to_the_closing_than_the_schema_bound_allows(llm):
    """The bound the reserve rests on (`closing_bound.py`), along random walks through each grammar
    (any allowed token, not just what the model likes): after a sampled token the closing is at most
    `(1 + its count of { [ " , :) * unit` bytes longer; after tokens the grammar forces, no longer."""
    guide = llm.engine.pipeline.processors[0]
    search, rng = guide._search(), np.random.default_rng(0)
    for schema in (PERSON, DATE_EMAIL, MIN_PROPERTIES, LINKED, {"type": "object", "properties": {"a": {
            "type": "object", "properties": {"b": {"type": "string", "minLength": 12}, "c": {"type": "array",
            "minItems": 3, "items": {"type": "string", "pattern": "^[a-f]{4}$"}}}, "required": ["b", "c"]}}}):
        compiled = guide.compiler.compile(guide._with_server_defaults(GuidedDecodingParams(json=schema)))
        unit = compiled.closing_step
        for _ in range(3):
            matcher, syntax = compiled.new_matcher(), JsonSyntax()
            before = len(search.bytes_of(search.closing(matcher, syntax)))
            for _ in range(30):
                tokens = matcher.compute_ff_tokens()
                growth = 0
                if not tokens:
                    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
                    allowed = np.setdiff1d(np.flatnonzero(bits[:len(search.openers)]), guide.eos_token_ids)
                    if not len(allowed):
                        break
                    tokens = [int(rng.choice(allowed))]
                    growth = search.growth(tokens, unit)
                assert matcher.consume_tokens(tokens)
                syntax.feed(search.bytes_of(tokens))
                after = len(search.bytes_of(search.closing(matcher, syntax)))
                assert after <= before + growth, (schema, search.bytes_of(tokens), before, after, growth)
                before = after


def test_a_schema_no_budget_can_close_is_refused_up_front_naming_max_tokens(llm):
    long_string = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1100}}, "required": ["s"]}
    with pytest.raises(ValueError, match=r"^max_tokens: close_on_length cannot close this JSON constraint"):
        llm.chat(MESSAGES, _params(0, 1900, True, schema=long_string), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^max_tokens: close_on_length needs room .* \(\d+ tokens\); max_tokens is 5"):
        llm.chat(MESSAGES, _params(0, 5, True, schema=DATE_EMAIL), use_tqdm=False)


def test_a_schema_the_bound_cannot_read_checks_every_step_and_still_closes(llm):
    """`\\p{L}` is llguidance's, not Python's: no step bound, so every step keeps only checked tokens."""
    letters = {"type": "object", "properties": {"w": {"type": "string", "pattern": "^\\p{L}+$"},
                                                "n": {"type": "integer"}}, "required": ["w", "n"]}
    guide = llm.engine.pipeline.processors[0]
    assert guide.compiler.compile(guide._with_server_defaults(GuidedDecodingParams(json=letters))).closing_step is None
    params = [_params(seed, max_tokens, True, schema=letters) for seed in range(2) for max_tokens in (12, 30)]
    for out in llm.chat([MESSAGES] * len(params), params, use_tqdm=False):
        assert out.outputs.finish_reason == "stop" or out.outputs.closed_on_length, out.outputs
        value = json.loads(out.outputs.text)  # (jsonschema's regexes are Python's: checked by hand)
        assert value["w"].isalpha() and isinstance(value["n"], int), value


DATES = {"type": "object", "required": ["d", "t"],
         "properties": {"d": {"type": "string", "format": "date"}, "t": {"type": "string", "format": "date-time"}}}


def _check_dates(value):
    """What real validators ask of a date and a date-time (jsonschema's checker has no date-time
    without rfc3339-validator: fromisoformat and RFC 3339's upper-case `T`/`Z` stand in)."""
    jsonschema.validate(value, DATES, format_checker=jsonschema.FormatChecker())
    datetime.date.fromisoformat(value["d"])
    datetime.datetime.fromisoformat(value["t"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", value["t"]), value


def test_a_closed_date_and_date_time_are_ones_validators_accept(llm):
    """The closing wrote `0000-01-01` and `0000-01-01t00:00:00z`: year 0 fails jsonschema's date check,
    fromisoformat and Pydantic. At 40 tokens the whole document is the closing."""
    out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=40, guided_decoding=GuidedDecodingParams(
        json=DATES, close_on_length=True)), use_tqdm=False)[0].outputs
    assert out.closed_on_length, out
    _check_dates(json.loads(out.text))


@pytest.mark.parametrize("prefix", ['{"d": "', '{"d": "2024-0', '{"d": "2024-02-29", "t": "',
                                    '{"d": "2024-02-29", "t": "2024-', '{"d": "2024-02-29", "t": "2024-02-29T1',
                                    '{"d": "2024-02-29", "t": "2024-02-29T10:00:00'])
def test_a_date_closed_from_inside_is_one_validators_accept(llm, prefix):
    guide = llm.engine.pipeline.processors[0]
    matcher = guide.compiler.compile(GuidedDecodingParams(json=DATES)).new_matcher()
    assert matcher.consume_tokens(guide.tokenizer.encode(prefix, add_special_tokens=False))
    syntax = JsonSyntax()
    syntax.feed(prefix.encode())
    closing = guide._search().closing(matcher, syntax)
    _check_dates(json.loads(prefix + guide.tokenizer.decode(closing)))


# At seed 991198 the closing ends the document at output position 22; at position 23 the mask allows
# only EOS (ids 2 and 5), yet " I" was drawn and the request failed ("generated token does not fit the
# constraint"). Not the mask: the sampler's seeded uniform for token 481 there was 1.0 (float32
# rounds (2**24 - 1 + 0.5) * 2**-24 up), its Gumbel noise +inf, and Paddle's CPU softmax gives the
# -inf logits 1.6e-28 rather than 0, so the masked token won the draw (seeded_uniforms is now < 1).
ONE_STRING = {"type": "object", "required": ["s"],
              "properties": {"s": {"type": "string", "minLength": 10, "maxLength": 12}}}


def test_after_a_closed_document_nothing_but_eos_is_drawn(llm):
    messages = [{"role": "user", "content": "Produce a detailed JSON example with long strings."}]
    params = [SamplingParams(temperature=1.0, seed=991198, max_tokens=max_tokens, guided_decoding=GuidedDecodingParams(
        json=ONE_STRING, close_on_length=True)) for max_tokens in (25, 32, 39)]
    for out in llm.chat([messages] * len(params), params, use_tqdm=False):
        o = out.outputs
        assert o.finish_reason in ("stop", "length"), o
        jsonschema.validate(json.loads(o.text), ONE_STRING)
