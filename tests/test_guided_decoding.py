"""Guided decoding end to end: real llguidance, real Paddle forward passes on the qwen2 fixture
(random weights) at temperature 1, so every token of a constrained output is the mask's doing."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
from conftest import fixture_dir

from fastdeploy_lp import LLM, FDConfig, GuidedDecodingParams, LLMEngine, SamplingParams
from fastdeploy_lp.config import default_model_path
from fastdeploy_lp.processors.guided import GuidedDecodingLogitsProcessor

CAPITAL_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[\\w]+$"},
                                                   "population": {"type": "integer"}},
                  "required": ["name", "population"], "additionalProperties": False}
CITY_EBNF = """root ::= description
description ::= city " is " status
city ::= london | paris | berlin | rome
london ::= "London"
paris ::= "Paris"
berlin ::= "Berlin"
rome ::= "Rome"
status ::= "the capital of " country
country ::= england | france | germany | italy
england ::= "England"
france ::= "France"
germany ::= "Germany"
italy ::= "Italy"
"""
CITY_RE = r"(London|Paris|Berlin|Rome) is the capital of (England|France|Germany|Italy)"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}
DATE = {"type": "object", "properties": {"timezone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["timezone"], "additionalProperties": False}
WEATHER_DATE_TAG = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
    {"begin": "<function=get_date>", "schema": DATE, "end": "</function>"}]}
CALL = re.compile(r"<function=(get_weather|get_date)>(.*?)</function>", re.S)
PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm():
    return LLM(fixture_dir("qwen2"), max_num_seqs=8, device="cpu")


def _guide(llm) -> GuidedDecodingLogitsProcessor:
    return llm.engine.pipeline.processors[0]


def _params(gd, seed, max_tokens=48, **kw):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, guided_decoding=gd, **kw)


def _assert_fits(llm, gd, out):
    """A fresh matcher accepts every generated token; a finished output is a complete match."""
    ids = list(out.outputs.token_ids)
    finished = out.outputs.finish_reason == "stop"
    if finished:
        assert ids[-1] in llm.engine.eos_token_ids
        ids = ids[:-1]
    matcher = _guide(llm).compiler.compile(gd).new_matcher()
    assert matcher.consume_tokens(ids), matcher.get_error()
    if finished:
        assert matcher.is_accepting()
    return finished


def _weather_date_calls_valid(text: str, finished: bool) -> int:
    """Every trigger in the text starts a valid call (the last may be cut off by max_tokens)."""
    calls, at = 0, 0
    while (p := text.find("<function=", at)) >= 0:
        m = CALL.match(text, p)
        if m is None:
            assert not finished, text
            rest = text[p:]
            assert any(rest.startswith(b) or b.startswith(rest) for b in ("<function=get_weather>",
                                                                          "<function=get_date>")), rest
            return calls
        jsonschema.validate(json.loads(m.group(2)), WEATHER if m.group(1) == "get_weather" else DATE)
        calls, at = calls + 1, m.end()
    return calls


# -- the TensorRT-LLM examples ------------------------------------------------------------------
def test_capital_json_schema_outputs_validate(llm):
    gd = GuidedDecodingParams(json=CAPITAL_SCHEMA)
    outs = llm.generate([PROMPT] * 8, [_params(gd, s, max_tokens=64) for s in range(8)], use_tqdm=False)
    for out in outs:
        if _assert_fits(llm, gd, out):
            jsonschema.validate(json.loads(out.outputs.text), CAPITAL_SCHEMA)
        else:
            assert out.outputs.finish_reason == "length"


def test_paris_london_regex_always_finishes_with_stop(llm):
    gd = GuidedDecodingParams(regex="(Paris|London)")
    outs = llm.generate([PROMPT] * 8, [_params(gd, s) for s in range(8)], use_tqdm=False)
    assert {o.outputs.finish_reason for o in outs} == {"stop"}
    assert all(re.fullmatch("(Paris|London)", o.outputs.text) for o in outs)


def test_city_country_ebnf_grammar(llm):
    gd = GuidedDecodingParams(grammar=CITY_EBNF)
    outs = llm.generate([PROMPT] * 8, [_params(gd, s) for s in range(8)], use_tqdm=False)
    for out in outs:
        assert _assert_fits(llm, gd, out)
        assert re.fullmatch(CITY_RE, out.outputs.text), out.outputs.text


def test_weather_date_structural_tag_calls_validate(llm):
    gd = GuidedDecodingParams(structural_tag=WEATHER_DATE_TAG)
    outs = llm.generate([PROMPT] * 8, [_params(gd, s, max_tokens=64) for s in range(8)], use_tqdm=False)
    for out in outs:
        _weather_date_calls_valid(out.outputs.text, _assert_fits(llm, gd, out))


def test_text_reaching_a_trigger_can_only_continue_as_a_valid_tag(llm):
    # Bias the model towards writing the trigger so it does, often; the tag must then be valid.
    trigger_ids = llm.tokenizer.encode("<function=")
    gd = GuidedDecodingParams(structural_tag=WEATHER_DATE_TAG)
    params = [_params(gd, s, max_tokens=80, logit_bias={t: 8.0 for t in trigger_ids}) for s in range(16)]
    outs = llm.generate([PROMPT] * 16, params, use_tqdm=False)
    triggered = calls = 0
    for out in outs:
        text = out.outputs.text
        triggered += "<function=" in text
        calls += _weather_date_calls_valid(text, _assert_fits(llm, gd, out))
    assert triggered >= 6 and calls >= 2


def test_new_structural_tag_form_and_all_kinds_compile_and_fit(llm):
    forms = [
        GuidedDecodingParams(structural_tag={"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<function="], "stop_after_first": True, "at_least_one": True,
            "tags": [{"begin": "<function=get_weather>", "content": {"type": "json_schema", "json_schema": WEATHER},
                      "end": "</function>"}]}}),
        GuidedDecodingParams(json=json.dumps(CAPITAL_SCHEMA)),
        GuidedDecodingParams(json_object=True),
        GuidedDecodingParams(choice=["Paris", "Lyon", "Marseille"]),
        GuidedDecodingParams(grammar='start: CITY " " NUM\nCITY: "Paris" | "Nice"\nNUM: /[1-9][0-9]?/'),
        GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                   "additionalProperties": False}, whitespace_pattern=" ?"),
    ]
    outs = llm.generate([PROMPT] * len(forms), [_params(gd, 7, max_tokens=40) for gd in forms], use_tqdm=False)
    for gd, out in zip(forms, outs):
        _assert_fits(llm, gd, out)
    if outs[0].outputs.finish_reason == "stop":  # at least one call, and nothing after the first
        assert re.fullmatch(r"[^<]*<function=get_weather>.*</function>", outs[0].outputs.text, re.S)
    assert outs[3].outputs.text in ("Paris", "Lyon", "Marseille")
    assert re.fullmatch(r"(Paris|Nice) [1-9][0-9]?", outs[4].outputs.text)
    if outs[5].outputs.finish_reason == "stop":
        assert "\n" not in outs[5].outputs.text and "  " not in outs[5].outputs.text


@pytest.mark.skipif(not os.path.isfile(os.path.join(default_model_path(), "config.json")),
                    reason="the built-in model is not in fastdeploy_lp/default_model/ yet")
def test_tensorrt_llm_examples_on_the_built_in_model():
    llm = LLM(max_num_seqs=8)
    examples = [GuidedDecodingParams(json=CAPITAL_SCHEMA), GuidedDecodingParams(regex="(Paris|London)"),
                GuidedDecodingParams(grammar=CITY_EBNF), GuidedDecodingParams(structural_tag=WEATHER_DATE_TAG)]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = [_params(gd, seed, max_tokens=96) for gd in examples for seed in (0, 1)]
    outs = llm.chat([messages] * len(params), params, use_tqdm=False)
    for p, out in zip(params, outs):
        gd, text = p.guided_decoding, out.outputs.text
        finished = _assert_fits(llm, gd, out)
        if gd.json and finished:
            jsonschema.validate(json.loads(text), CAPITAL_SCHEMA)
        elif gd.regex:
            assert finished and re.fullmatch("(Paris|London)", text)
        elif gd.grammar:
            assert finished and re.fullmatch(CITY_RE, text)
        elif gd.structural_tag:
            _weather_date_calls_valid(text, finished)


# -- batches ------------------------------------------------------------------------------------
KINDS = [
    GuidedDecodingParams(json=CAPITAL_SCHEMA),
    GuidedDecodingParams(regex="[0-9]{3}-[a-z]{2,4}"),
    GuidedDecodingParams(choice=["alpha", "beta", "gamma delta"]),
    GuidedDecodingParams(grammar=CITY_EBNF),
    GuidedDecodingParams(structural_tag=WEATHER_DATE_TAG),
    None,
]


@pytest.mark.parametrize("seed", range(6))
def test_mixed_batch_keeps_every_request_to_its_own_constraint(llm, seed):
    kinds = [KINDS[(seed + i) % len(KINDS)] for i in range(8)]
    outs = llm.generate([PROMPT] * 8, [_params(gd, seed * 100 + i, max_tokens=40) for i, gd in enumerate(kinds)],
                        use_tqdm=False)
    for gd, out in zip(kinds, outs):
        if gd is None:
            continue
        finished = _assert_fits(llm, gd, out)
        text = out.outputs.text
        if gd.regex:
            assert finished and re.fullmatch("[0-9]{3}-[a-z]{2,4}", text)
        elif gd.choice:
            assert finished and text in gd.choice
        elif gd.grammar:
            assert finished and re.fullmatch(CITY_RE, text)
        elif gd.json and finished:
            jsonschema.validate(json.loads(text), CAPITAL_SCHEMA)
        elif gd.structural_tag:
            _weather_date_calls_valid(text, finished)


def test_unconstrained_rows_are_untouched_by_the_mask(llm):
    plain = SamplingParams(temperature=1.0, seed=42, max_tokens=16)
    alone = llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs.token_ids
    mixed = llm.generate([PROMPT] * 4, [_params(KINDS[0], 1), plain, _params(KINDS[2], 2), plain], use_tqdm=False)
    assert mixed[1].outputs.token_ids == alone and mixed[3].outputs.token_ids == alone


def test_rows_follow_slots_with_gaps_reuse_and_mid_batch_joins():
    engine = LLMEngine(FDConfig.create(fixture_dir("qwen2"), max_num_seqs=8, device="cpu"))
    # Slots 0..7 start; the short unconstrained ones finish and leave gaps that constrained
    # requests joining later reuse, while long constrained ones keep running around them.
    lengths = [30, 2, 2, 30, 2, 2, 2, 30]
    plan = {}
    for i, n in enumerate(lengths):
        gd = KINDS[i % 4] if n == 30 else None
        plan[f"a{i}"] = gd
        engine.add_request(PROMPT, SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=gd is None,
                                                  guided_decoding=gd), request_id=f"a{i}")
    results = {}
    for step in range(60):
        if step in (3, 5, 9):
            for j in range(3):
                rid = f"b{step}-{j}"
                plan[rid] = KINDS[(step + j) % 5]
                engine.add_request(PROMPT, SamplingParams(temperature=1.0, seed=step * 10 + j, max_tokens=24,
                                                          guided_decoding=plan[rid]), request_id=rid)
        results.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert set(results) == set(plan)
    for rid, gd in plan.items():
        out = results[rid]
        assert out.outputs.finish_reason in ("stop", "length"), out.outputs.error
        if gd is not None:
            ids = list(out.outputs.token_ids)
            if out.outputs.finish_reason == "stop":
                ids = ids[:-1]
            matcher = engine.pipeline.processors[0].compiler.compile(gd).new_matcher()
            assert matcher.consume_tokens(ids), (rid, matcher.get_error())


# -- ending -------------------------------------------------------------------------------------
def test_complete_grammar_stops_and_max_tokens_first_gives_length(llm):
    done = llm.generate([PROMPT], _params(GuidedDecodingParams(choice=["Paris is lovely"]), 0), use_tqdm=False)[0]
    assert (done.outputs.text, done.outputs.finish_reason) == ("Paris is lovely", "stop")
    cut = llm.generate([PROMPT], _params(GuidedDecodingParams(choice=["Paris is lovely"]), 0, max_tokens=2),
                       use_tqdm=False)[0]
    assert cut.outputs.finish_reason == "length" and "Paris is lovely".startswith(cut.outputs.text)


def test_a_constraint_that_leaves_nothing_to_sample_fails_only_that_request(llm):
    # min_tokens bans EOS after the grammar has ended: no token is left, and nothing is sampled.
    stuck = _params(GuidedDecodingParams(choice=["Paris"]), 0, min_tokens=8)
    fine = _params(GuidedDecodingParams(regex="(Paris|London)"), 1)
    plain = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    outs = llm.generate([PROMPT] * 3, [stuck, fine, plain], use_tqdm=False)
    assert outs[0].outputs.finish_reason == "error" and "no token can be sampled" in outs[0].outputs.error
    assert outs[1].outputs.finish_reason == "stop" and outs[1].outputs.text in ("Paris", "London")
    assert outs[2].outputs.finish_reason == "length" and len(outs[2].outputs.token_ids) == 6


# -- hostile inputs -----------------------------------------------------------------------------
def _nested(depth):
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE = [
    (GuidedDecodingParams(json=_nested(200)), "guided_json", "nested"),
    (GuidedDecodingParams(json="[" * 100_000), "guided_json", "nested too deeply"),
    (GuidedDecodingParams(json={"enum": [f"value-{i}-xyz" for i in range(100_000)]}), "guided_json", "characters long"),
    (GuidedDecodingParams(json="{not json"), "guided_json", "invalid JSON"),
    (GuidedDecodingParams(json={"type": "object", "dependentRequired": {"a": ["b"]}}), "guided_json", "dependentRequired"),
    (GuidedDecodingParams(json={"type": "strnig"}), "guided_json", "strnig"),
    (GuidedDecodingParams(json={"type": "string", "pattern": "(?=x)a"}), "guided_json", "look-around"),
    (GuidedDecodingParams(regex="(unclosed"), "guided_regex", "unclosed group"),
    (GuidedDecodingParams(grammar="root ::= city |"), "guided_grammar", "city"),
    (GuidedDecodingParams(grammar="start: foo"), "guided_grammar", "foo"),
    (GuidedDecodingParams(structural_tag={"type": "structural_tag", "format": {"type": "bogus"}}),
     "structural_tag.format.type", "bogus"),
    (GuidedDecodingParams(json={"type": "object"}, whitespace_pattern="("), "guided_whitespace_pattern", "unclosed"),
]


@pytest.mark.parametrize("gd,field,words", HOSTILE, ids=[f"{h[1]}-{i}" for i, h in enumerate(HOSTILE)])
def test_hostile_constraint_is_a_value_error_naming_the_field_and_the_engine_still_serves(llm, gd, field, words):
    with pytest.raises(ValueError) as info:
        llm.generate([PROMPT], _params(gd, 0), use_tqdm=False)
    assert str(info.value).startswith(field) and words in str(info.value), str(info.value)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([PROMPT], _params(GuidedDecodingParams(regex="(Paris|London)"), 0), use_tqdm=False)[0]
    assert out.outputs.text in ("Paris", "London")


@pytest.mark.parametrize("regex", [r"(a+)+b", r"(a|aa)*c", r"(\w+\s?)*!", r"(x+x+)+y", r"(.*a){12}"])
def test_backtracking_bombs_are_served_in_linear_time(llm, regex):
    gd = GuidedDecodingParams(regex=regex)
    outs = llm.generate([PROMPT] * 2, [_params(gd, s, max_tokens=24) for s in range(2)], use_tqdm=False)
    for out in outs:
        if _assert_fits(llm, gd, out):
            assert re.fullmatch(regex, out.outputs.text)


def test_regex_whose_automaton_explodes_is_refused_by_the_compile_time_limit(llm, monkeypatch):
    # Harmless for backtracking, but its first mask alone takes llguidance about a second.
    monkeypatch.setattr(_guide(llm).compiler, "compile_timeout_s", 0.2)
    with pytest.raises(ValueError, match=r"^guided_regex: compiling the constraint took longer than 0.2 s"):
        llm.generate([PROMPT], _params(GuidedDecodingParams(regex="a{100000}{10}"), 0), use_tqdm=False)
    out = llm.generate([PROMPT], _params(GuidedDecodingParams(regex="(Paris|London)"), 0), use_tqdm=False)[0]
    assert out.outputs.text in ("Paris", "London")


# -- forced tokens ------------------------------------------------------------------------------
def test_forced_tokens_give_the_same_output_with_and_without_fast_forward_in_fewer_steps():
    kinds = [GuidedDecodingParams(json=CAPITAL_SCHEMA), GuidedDecodingParams(regex="The capital is (Paris|Rome)"),
             GuidedDecodingParams(grammar=CITY_EBNF), GuidedDecodingParams(structural_tag=WEATHER_DATE_TAG), None]
    params = [_params(kinds[i % 5], i, max_tokens=40) for i in range(10)]
    tokens, steps = {}, {}
    for ff in (True, False):
        llm = LLM(fixture_dir("qwen2"), max_num_seqs=8, device="cpu", fast_forward=ff)
        outs = llm.generate([PROMPT] * 10, params, use_tqdm=False)
        tokens[ff], steps[ff] = [o.outputs.token_ids for o in outs], llm.engine.num_steps
        for gd, out in zip([kinds[i % 5] for i in range(10)], outs):
            if gd is not None:
                _assert_fits(llm, gd, out)
    assert tokens[True] == tokens[False]
    assert steps[True] < steps[False]
