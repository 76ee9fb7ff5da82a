"""structured_outputs.close_on_length through the server, with the openai SDK (extra_body), on the
built-in model; the server runs with --guided-close-on-length, so JSON requests close by default."""

from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest
from server_harness import start_server
from test_guided_close_on_length import DATE_EMAIL, MESSAGES, MIN_PROPERTIES, PERSON
from test_guided_close_on_length_sweep import SCHEMAS

from fastdeploy_lp.config import default_model_path

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(default_model_path(), "config.json")),
                                reason="the built-in model is not in fastdeploy_lp/default_model/ yet")
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.fixture(scope="module")
def client():
    server = start_server("--guided-close-on-length", model=default_model_path())
    yield openai.OpenAI(base_url=server.url("/v1"), api_key="EMPTY_API_KEY", max_retries=0, timeout=60)
    server.stop()


def _chat(client, max_tokens=60, seed=0, **kw):
    return client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=max_tokens,
                                          temperature=1.0, seed=seed, **kw)


def test_response_format_with_close_on_length_parses_at_length(client):
    for seed in range(3):
        r = _chat(client, seed=seed, response_format=SCHEMA_FORMAT,
                  extra_body={"structured_outputs": {"close_on_length": True}})
        choice = r.choices[0]
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert (choice.finish_reason, getattr(choice, "closed_on_length", None)) in (("length", True), ("stop", None))


def test_streamed_final_chunk_says_closed(client):
    chunks = list(_chat(client, stream=True, response_format=SCHEMA_FORMAT,
                        extra_body={"structured_outputs": {"close_on_length": True}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    last = chunks[-1].choices[0]
    jsonschema.validate(json.loads(text), PERSON)
    assert last.finish_reason == "length" and last.closed_on_length is True


def test_server_default_closes_json_object_and_false_opts_out(client):
    closed = _chat(client, max_tokens=20, response_format={"type": "json_object"})
    assert isinstance(json.loads(closed.choices[0].message.content), dict)
    cut = _chat(client, max_tokens=20, response_format={"type": "json_object"},
                extra_body={"structured_outputs": {"close_on_length": False}})
    assert cut.choices[0].finish_reason == "length" and getattr(cut.choices[0], "closed_on_length", None) is None
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.choices[0].message.content)


def test_completions_endpoint_closes_structured_outputs_json(client):
    r = client.completions.create(model="default", prompt="Person: ", max_tokens=64, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"json": PERSON, "close_on_length": True}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"close_on_length": True}},                            # nothing to close
    {"structured_outputs": {"regex": "[a-z]+", "close_on_length": True}},         # not JSON
    {"structured_outputs": {"json_object": True, "close_on_length": "yes"}},      # not a boolean
])
def test_misuse_is_a_400_naming_the_field(client, extra):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, extra_body=extra)
    assert "structured_outputs.close_on_length" in str(e.value)


def test_a_budget_below_the_shortest_document_is_a_400_on_max_tokens(client):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=10, response_format=SCHEMA_FORMAT)
    assert e.value.body["param"] == "max_tokens" and "close_on_length" in e.value.body["message"]


def test_responses_text_format_closes_on_length_as_chat_does(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON}
    closed = 0
    for seed in range(3):
        r = client.responses.create(model="default", input=MESSAGES[0]["content"], max_output_tokens=60,
                                    temperature=1.0, text={"format": fmt},
                                    extra_body={"seed": seed, "structured_outputs": {"close_on_length": True}})
        jsonschema.validate(json.loads(r.output_text), PERSON)
        flag = (r.model_extra or {}).get("closed_on_length")
        assert (r.status, flag) in (("incomplete", True), ("completed", None)), (r.status, flag)
        closed += flag is True
    assert closed
    cut = client.responses.create(model="default", input=MESSAGES[0]["content"], max_output_tokens=20,
                                  temperature=1.0, text={"format": {"type": "json_object"}},
                                  extra_body={"seed": 0, "structured_outputs": {"close_on_length": False}})
    assert cut.status == "incomplete" and "closed_on_length" not in (cut.model_extra or {})
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.output_text)


@pytest.mark.parametrize("schema, max_tokens", [
    (DATE_EMAIL, 44), (MIN_PROPERTIES, 11), (SCHEMAS["nested_arrays"], 25), (SCHEMAS["enums"], 30),
    (SCHEMAS["uri_uuid_date_time"], 20)])
def test_streamed_and_not_the_same_closed_document_that_validates(client, schema, max_tokens):
    """Issue 35 item 5 through the server: the budgets that ended inside an email, or with one key
    twice, close the same way whether streamed or not, and the result validates."""
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}}
    whole = _chat(client, max_tokens=max_tokens, seed=max_tokens, response_format=fmt,
                  extra_body={"structured_outputs": {"close_on_length": True}}).choices[0]
    chunks = list(_chat(client, max_tokens=max_tokens, seed=max_tokens, response_format=fmt, stream=True,
                        extra_body={"structured_outputs": {"close_on_length": True}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    last = [c.choices[0] for c in chunks if c.choices][-1]
    assert text == whole.message.content
    assert (last.finish_reason, getattr(last, "closed_on_length", None)) == \
        (whole.finish_reason, getattr(whole, "closed_on_length", None))
    assert (whole.finish_reason, getattr(whole, "closed_on_length", None)) in (("length", True), ("stop", None))
    jsonschema.validate(json.loads(text), schema)
