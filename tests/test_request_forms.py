"""Every request form that names a constraint is honoured or refused (never a header-only warning):
OpenAI's response_format, the guided_* fields, NVIDIA NIM's nvext.guided_*, and vLLM's
structured_outputs — through the official openai SDK against a real server on the built-in model."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from server_harness import start_server

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer"}},
          "required": ["city", "rank"]}
CLOSED = dict(SCHEMA, additionalProperties=False)
MESSAGES = [{"role": "user", "content": "Name a city and its rank as JSON."}]


@pytest.fixture(scope="module")
def server():
    from fastdeploy_lp.config import default_model_path

    s = start_server("--max-num-seqs", "4", model=default_model_path())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=60)


def outside_strings(text: str) -> str:
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def ask(client, seed=0, max_tokens=120, **extra_body):
    r = client.chat.completions.with_raw_response.create(
        model="default", messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=max_tokens, extra_body=extra_body)
    assert "x-fastdeploy-lp-ignored-fields" not in r.headers, r.headers
    return r.parse().choices[0]


@pytest.mark.parametrize("body", [
    {"nvext": {"guided_choice": ["Paris", "Rome"]}},
    {"structured_outputs": {"choice": ["Paris", "Rome"]}},
    {"guided_choice": ["Paris", "Rome"]},
])
def test_choice_forms(client, body):
    for seed in range(3):
        choice = ask(client, seed, **body)
        assert choice.message.content in ("Paris", "Rome") and choice.finish_reason == "stop"


@pytest.mark.parametrize("body", [
    {"nvext": {"guided_json": SCHEMA}}, {"nvext": {"guided_json": json.dumps(SCHEMA)}},
    {"structured_outputs": {"json": SCHEMA}}, {"structured_outputs": {"json": json.dumps(SCHEMA)}},
])
def test_json_forms(client, body):
    for seed in range(3):
        choice = ask(client, seed, **body)
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@pytest.mark.parametrize("body, pattern", [
    ({"nvext": {"guided_regex": "[A-Z][a-z]{2,8}"}}, "[A-Z][a-z]{2,8}"),
    ({"structured_outputs": {"regex": "(yes|no)-[0-9]{3}"}}, "(yes|no)-[0-9]{3}"),
    ({"nvext": {"guided_grammar": 'root ::= "a" [0-9] [0-9]'}}, "a[0-9]{2}"),
    ({"structured_outputs": {"grammar": 'start: "b" /[0-9]/'}}, "b[0-9]"),
])
def test_regex_and_grammar_forms(client, body, pattern):
    for seed in range(3):
        choice = ask(client, seed, **body)
        assert re.fullmatch(pattern, choice.message.content), choice.message.content


def test_json_object_form(client):
    choice = ask(client, 1, structured_outputs={"json_object": True})
    assert isinstance(json.loads(choice.message.content), dict)


def test_structural_tag_form(client):
    tag = {"type": "structural_tag", "structures": [{"begin": "<x>", "schema": SCHEMA, "end": "</x>"}],
           "triggers": ["<x>"]}
    choice = ask(client, 2, max_tokens=60, structured_outputs={"structural_tag": json.dumps(tag)})
    assert choice.finish_reason in ("stop", "length")


def test_no_whitespace_and_closed_objects(client):
    for seed in range(3):
        compact = ask(client, seed, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True,
                                                        "disable_additional_properties": True})
        value = json.loads(compact.message.content)
        jsonschema.validate(value, CLOSED)
        assert not re.search(r"\s", outside_strings(compact.message.content))


def test_whitespace_pattern_forms(client):
    for body in ({"nvext": {"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"}},
                 {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " ?"}}):
        text = ask(client, 4, **body).message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        assert not re.search(r"\n|  ", outside_strings(text))


def test_json_whitespace_is_bounded_by_default(client):
    """The default layout is json.dumps': one space after ':' and ',', no newlines, nothing else."""
    for seed in range(3):
        text = ask(client, seed, response_format={"type": "json_schema", "json_schema": {
            "name": "city", "schema": SCHEMA, "strict": True}}).message.content
        jsonschema.validate(json.loads(text), CLOSED)
        layout = outside_strings(text)
        assert not re.search(r"\s", layout.replace(", ", ",").replace(": ", ":")), text


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"json": SCHEMA, "lookahead": 3}}, "structured_outputs.lookahead"),
    ({"structured_outputs": {"regex": "a+"}, "nvext": {"guided_choice": ["a"]}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"nvext": {"guided_json": {"type": "nonsense"}}}, "nvext.guided_json"),
    ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}, "structured_outputs.disable_any_whitespace"),
    ({"nvext": {"guided_json": SCHEMA, "guided_whitespace_pattern": "("}}, "nvext.guided_whitespace_pattern"),
])
def test_constraints_that_cannot_be_applied_are_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, **body)
    assert info.value.body["param"] == param, info.value.body


def test_models_retrieve(client, server):
    listed = client.models.list().data
    model = client.models.retrieve(listed[0].id)
    assert model.id == listed[0].id and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


# -- structured output real clients rely on, on the built-in model ----------------------------------
def test_strict_json_schema_ends_in_valid_json_over_20_seeds(client):
    """Bounded whitespace by default: at temperature 1 the tiny built-in model cannot run on as
    newlines, so every seed ends with 'stop' and a valid object within 200 tokens."""
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for seed in range(20):
        r = client.chat.completions.create(model="default", messages=MESSAGES, temperature=1.0, seed=seed,
                                           max_tokens=200, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", (seed, r.choices[0].message.content)
        jsonschema.validate(json.loads(r.choices[0].message.content), CLOSED)
        assert r.usage.completion_tokens <= 200


def test_sdk_parse_with_a_pydantic_model_over_seeds(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=12)
        rank: int

    for seed in range(5):
        completion = client.beta.chat.completions.parse(model="default", messages=MESSAGES, temperature=1.0,
                                                        seed=seed, max_tokens=120, response_format=City)
        assert isinstance(completion.choices[0].message.parsed, City), completion


def test_every_constraint_field_is_a_chat_field():
    """The list other APIs refuse by is the chat request's own constraint fields."""
    from fastdeploy_lp.entrypoints.openai.protocol import ChatCompletionRequest
    from fastdeploy_lp.entrypoints.openai.protocol_constraints import CONSTRAINT_FIELDS

    assert set(CONSTRAINT_FIELDS) <= set(ChatCompletionRequest.model_fields)
