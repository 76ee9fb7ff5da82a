"""One validation path (issue 25): the same bad field is the same 4xx on /v1/chat/completions,
/v1/completions, /v1/responses and /v1/messages, each in its own error shape and naming the field
as that API spells it (a real server on the qwen2 fixture)."""

from __future__ import annotations

import httpx
import pytest
from server_harness import start_server

MODEL = "m"
ASK = [{"role": "user", "content": "hi"}]
# Each surface: its path, a valid body, what it calls the output budget, and its error shape.
SURFACES = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 4}, "max_tokens"),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4}, "max_tokens"),
    "responses": ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4}, "max_output_tokens"),
    "messages": ("/v1/messages", {"model": MODEL, "messages": ASK, "max_tokens": 4}, "max_tokens"),
}
BAD_SCHEMA = {"type": "nope"}
# name -> (the change for a surface's budget field name, status, the field as each surface names it)
CASES = {
    "processor_arg_value": (lambda budget: {"logits_processors_args": {"logit_bias": {"x": 1.0}}}, 400,
                            "logits_processors_args.logit_bias"),
    "processor_arg_unknown": (lambda budget: {"logits_processors_args": {"nope": 1}}, 400,
                              "logits_processors_args.nope"),
    "temperature": (lambda budget: {"temperature": -1}, 400, "temperature"),
    "top_p": (lambda budget: {"top_p": 2}, 400, "top_p"),
    "model": (lambda budget: {"model": "not-served"}, 404, "model"),
    "budget_over_context": (lambda budget: {budget: 100_000}, 400, None),
    "budget_zero": (lambda budget: {budget: 0}, 400, None),
}
# The structured-output form each surface has (Messages has none: a 400 pointing to chat).
SCHEMA_FORMS = {
    "chat": ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": BAD_SCHEMA}}},
             "response_format"),
    "completions": ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": BAD_SCHEMA}}},
                    "response_format"),
    "responses": ({"text": {"format": {"type": "json_schema", "name": "a", "schema": BAD_SCHEMA}}}, "text.format"),
    "messages": ({"output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}}, "output_config.format"),
}


@pytest.fixture(scope="module")
def http():
    server = start_server("--max-num-seqs", "4", "--served-model-name", MODEL, "--max-model-len", "256",
                          "--logits-processors", "LogitBiasLogitsProcessor")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
    server.stop()


def _error(surface: str, r: httpx.Response) -> tuple[str, str | None]:
    """(message, param) from the surface's own error shape, checking the shape on the way."""
    body = r.json()
    if surface == "messages":  # Anthropic: {"type": "error", "error": {"type", "message"}}
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        kind = {400: "invalid_request_error", 404: "not_found_error"}[r.status_code]
        assert body["error"]["type"] == kind, body
        return body["error"]["message"], None
    assert set(body["error"]) == {"message", "type", "param", "code"}, body  # OpenAI's shape
    kind = {400: "invalid_request_error", 404: "not_found_error"}[r.status_code]
    assert body["error"]["type"] == kind, body
    return body["error"]["message"], body["error"]["param"]


@pytest.mark.parametrize("surface", list(SURFACES))
@pytest.mark.parametrize("case", list(CASES) + ["schema"])
def test_a_bad_field_is_the_same_4xx_everywhere_naming_the_field_in_each_api_terms(http, case, surface):
    path, body, budget = SURFACES[surface]
    if case == "schema":
        change, field = SCHEMA_FORMS[surface]
        status = 400
    else:
        make, status, field = CASES[case]
        change, field = make(budget), field or budget
    r = http.post(path, json={**body, **change})
    assert r.status_code == status, r.text
    message, param = _error(surface, r)
    assert message.startswith(field), message
    if param is not None:
        assert param.startswith(field) or field.startswith(param), (param, field)
