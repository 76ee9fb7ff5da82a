"""POST /v1/responses (OpenAI's Responses API) driven by the official `openai` SDK against a real
server (the tiny qwen2 fixture, so greedy outputs run to their token limit unless a grammar ends
them; function calls with the built-in default model, which is trained to make them): plain and streamed answers agree with each other and with chat, `text.format` JSON parses,
function calls round-trip through `function_call_output` and `previous_response_id`, the store
answers GET/DELETE and evicts past its bounds, processor arguments apply, a client that goes away
frees its slot, what is not served is a 400 naming the field, and an `openai-agents` agent runs its function tool against the server."""

from __future__ import annotations

import asyncio
import json
import re
import tracemalloc
from typing import Literal

import agents
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from fastdeploy_lp.config import default_model_path
from fastdeploy_lp.entrypoints.openai.protocol_responses import ResponsesRequest, prompt_items
from fastdeploy_lp.entrypoints.openai.responses_store import ResponseStore
from server_harness import start_server
from test_server_concurrency import check_leaving_aborts
from test_server_openai import client  # noqa: F401  (the fixture, over this module's `server`)

ASK = "What is the capital of France?"
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": CITY}]


@pytest.fixture(scope="module")
def server():
    s = start_server("--max-num-seqs", "8", "--served-model-name", "tiny-qwen2",
                     "--logits-processors", "LogitBiasLogitsProcessor", "server_processors:SlowLogitsProcessor")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tool_client():
    """The built-in default model: trained to call tools, with a chat template for tool turns."""
    s = start_server("--max-num-seqs", "4", "--served-model-name", "default-model", model=default_model_path())
    yield openai.OpenAI(base_url=s.url("/v1"), api_key="unused", max_retries=0, timeout=60)
    s.stop()


def _error(server, body: dict) -> dict:
    r = httpx.post(server.url("/v1/responses"), json=body, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_plain_response_is_the_chat_answer_with_usage_and_a_cut_status(client):
    out = client.responses.create(model="tiny-qwen2", instructions="Answer briefly.", input=ASK,
                                  max_output_tokens=10, temperature=0)
    chat = client.chat.completions.create(model="tiny-qwen2", max_tokens=10, temperature=0,
                                          messages=[{"role": "system", "content": "Answer briefly."},
                                                    {"role": "user", "content": ASK}])
    assert out.object == "response" and out.id.startswith("resp_") and out.model == "tiny-qwen2"
    assert out.output_text == chat.choices[0].message.content
    assert [item.type for item in out.output] == ["message"]
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens == 10
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].status == "incomplete" and out.instructions == "Answer briefly."


def test_streamed_events_come_in_order_and_join_to_the_plain_answer(client):
    plain = client.responses.create(model="tiny-qwen2", input=ASK, max_output_tokens=10, temperature=0, store=False)
    events = list(client.responses.create(model="tiny-qwen2", input=ASK, max_output_tokens=10, temperature=0,
                                          stream=True, store=False))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.incomplete"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    assert "".join(d.delta for d in deltas) == plain.output_text
    assert events[-1].response.output_text == plain.output_text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens


def test_json_schema_strict_output_parses_plain_streamed_and_with_parse(client):
    fmt = {"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}}
    out = client.responses.create(model="tiny-qwen2", input=ASK, text=fmt, max_output_tokens=40, temperature=0)
    jsonschema.validate(json.loads(out.output_text), VERDICT)
    assert out.status == "completed" and out.text.format.type == "json_schema"
    with client.responses.stream(model="tiny-qwen2", input=ASK, text=fmt, max_output_tokens=40,
                                 temperature=0) as stream:
        final = stream.get_final_response()
    assert final.output_text == out.output_text

    class Verdict(BaseModel):
        ok: bool

    parsed = client.responses.parse(model="tiny-qwen2", input=ASK, text_format=Verdict, max_output_tokens=40,
                                    temperature=1, extra_body={"seed": 3})
    assert isinstance(parsed.output_parsed, Verdict)
    anything = client.responses.create(model="tiny-qwen2", input=ASK, text={"format": {"type": "json_object"}},
                                       max_output_tokens=60, temperature=0)
    assert anything.status == "incomplete" or isinstance(json.loads(anything.output_text), dict)


def test_function_call_round_trips_by_previous_response_id_and_by_items(tool_client):
    client = tool_client
    first = client.responses.create(model="default-model", input="Weather in Paris?", tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=40,
                                    temperature=0)
    call = first.output[-1]
    assert first.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}
    chained = client.responses.create(model="default-model", previous_response_id=first.id, input=[result],
                                      tools=TOOLS, max_output_tokens=8, temperature=0)
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             result]
    stateless = client.responses.create(model="default-model", input=items, tools=TOOLS, max_output_tokens=8,
                                        temperature=0, store=False)
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == stateless.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == stateless.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stateless.id)  # store: false keeps nothing


def test_streamed_function_call_arguments_join_to_the_call(tool_client):
    client = tool_client
    kwargs = dict(model="default-model", input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=40, temperature=0, store=False)
    plain = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert events[2].type == "response.output_item.added" and events[2].item.type == "function_call"
    assert len(done) == 1 and "".join(pieces) == done[0].arguments == plain.output[-1].arguments
    assert final.output[-1].arguments == plain.output[-1].arguments and events[-1].type == "response.completed"


def test_an_openai_agents_agent_calls_its_function_tool_and_answers(tool_client):
    """The Agents SDK's default model is the Responses API: plain and streamed runs both call the
    tool, send its output back as function_call_output, and end with the model's message."""
    agents.set_tracing_disabled(True)  # traces would go to OpenAI's servers
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Weather in a city."""
        calls.append(city)
        return "Sunny, 21 C"

    async def run():
        client = openai.AsyncOpenAI(base_url=str(tool_client.base_url), api_key="unused", max_retries=0, timeout=60)
        agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                             model=agents.OpenAIResponsesModel("default-model", client),
                             model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=40))
        plain = await agents.Runner.run(agent, "Weather in Paris?", max_turns=4)
        streamed = agents.Runner.run_streamed(agent, "Weather in Rome?", max_turns=4)
        events = [e async for e in streamed.stream_events()]
        await client.close()
        return plain, streamed, events

    plain, streamed, events = asyncio.run(run())
    for result in (plain, streamed):
        kinds = [item.type for item in result.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
        assert isinstance(result.final_output, str) and result.final_output
        first, last = result.raw_responses[0], result.raw_responses[-1]
        assert last.usage.input_tokens > first.usage.input_tokens  # the tool's output went back in
    assert calls and set(calls) <= {"Paris", "Rome"} and calls[0] == "Paris"
    streamed_items = [e.name for e in events if e.type == "run_item_stream_event"]
    assert streamed_items[:2] == ["tool_called", "tool_output"] and "message_output_created" in streamed_items
    assert any(e.type == "raw_response_event" and e.data.type == "response.output_text.delta" for e in events)


def test_stored_response_is_retrieved_and_deleted(client):
    out = client.responses.create(model="tiny-qwen2", input=ASK, max_output_tokens=4, temperature=0,
                                  metadata={"run": "7"})
    got = client.responses.retrieve(out.id)
    assert got.id == out.id and got.output_text == out.output_text and got.metadata == {"run": "7"}
    client.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny-qwen2", input=ASK, previous_response_id=out.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_store_evicts_the_least_recently_used_past_its_bounds():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for k in range(3):
        if k == 2:
            assert store.get("r0") is not None  # a use: r1 is now the oldest
        store.put({"id": f"r{k}"}, [])
    assert store.get("r1") is None and store.get("r0") is not None and store.get("r2") is not None
    pad = 9_990 - 512 - len('{"id":"big","pad":""}[]')  # stored size: the JSON of both and 512 bytes of overhead
    store.put({"id": "big", "pad": "x" * pad}, [])  # within the byte bound only alone
    assert len(store) == 1 and store.get("big") is not None
    store.put({"id": "huge", "pad": "x" * 20_000}, [])  # larger than the bound: not kept
    assert store.get("huge") is None and store.get("big") is not None


def test_store_bound_holds_the_memory_of_hostile_items():
    """Items padded with what the model never sees (unknown keys, annotations, reasoning items,
    a junk tool schema the response echoes) cost their JSON, not their Python objects (25x more)."""
    junk = [[] for _ in range(60_000)]
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi", "annotations": junk}],
                       "junk": junk},
                      {"type": "reasoning", "summary": [], "junk": junk}],
            "tools": [{"type": "function", "name": "f", "parameters": {"junk": junk}}], "metadata": {"k": "v"}}
    bound = 2 << 20
    store = ResponseStore(max_entries=1000, max_bytes=bound)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k in range(8):  # ~0.7 MB of JSON each: the bound is passed, and evicts, by the third
            req = ResponsesRequest.model_validate(body)
            store.put({"id": f"r{k}", "tools": req.tools_out(), "metadata": req.metadata},
                      prompt_items(req.input_items()))
            del req
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store._bytes <= bound and held <= 1.5 * bound, (store._bytes, held)
    assert store.get("r7").conversation == [{"type": "message", "role": "user", "content": "hi"}]


def test_logits_processors_args_apply_and_are_validated(server, client):
    plain = client.responses.create(model="tiny-qwen2", input=ASK, max_output_tokens=4, temperature=0, store=False)
    chat = client.chat.completions.create(model="tiny-qwen2", messages=[{"role": "user", "content": ASK}],
                                          max_tokens=4, temperature=0,
                                          extra_body={"logits_processors_args": {"logit_bias": {"300": 100.0}}})
    biased = client.responses.create(model="tiny-qwen2", input=ASK, max_output_tokens=4, temperature=0, store=False,
                                     extra_body={"logits_processors_args": {"logit_bias": {"300": 100.0}}})
    assert biased.output_text == chat.choices[0].message.content != plain.output_text
    err = _error(server, {"input": ASK, "logits_processors_args": {"no_such_key": 1}})
    assert err["param"].startswith("logits_processors_args") and "no_such_key" in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0]"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]}, "tools"),
    ({"previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),  # stored with the response: OpenAI's bounds
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"response_format": {"type": "json_object"}}, "response_format"),  # a constraint it does not read: never ignored
    ({"guided_json": {"type": "object"}}, "guided_json"),
])
def test_unsupported_or_bad_fields_are_a_400_naming_the_field(server, body, param):
    err = _error(server, {"model": "tiny-qwen2", "input": ASK, **body})
    assert err["param"] is not None and err["param"].startswith(param), err
    assert err["message"].startswith(err["param"]) or param in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"instructions": "word " * 20_000}, "instructions"),
    ({"instructions": "Be brief.", "input": "word " * 20_000}, "input"),
    ({"tools": [{"type": "function", "name": "f", "description": "word " * 20_000}]}, "tools"),
    ({"max_output_tokens": 2, "text": {"format": {"type": "json_schema", "name": "v", "schema": VERDICT}},
      "structured_outputs": {"close_on_length": True}}, "max_output_tokens"),
])
def test_a_400_names_the_field_as_the_responses_request_spells_it(server, body, param):
    err = _error(server, {"model": "tiny-qwen2", "input": ASK, **body})
    assert err["param"] == param and err["message"].startswith(param + ":"), err
    assert not re.search(r"\b(messages|max_tokens|max_completion_tokens)\b", err["message"]), err


def test_closing_a_stream_midway_or_giving_up_on_an_answer_aborts_the_request(server, client):
    long = {"model": "tiny-qwen2", "input": ASK, "max_output_tokens": 400, "store": False,  # 400 slow tokens, no EOS
            "extra_body": {"logits_processors_args": {"slow_ms": 20, "logit_bias": {"1000": 100.0}}}}
    check_leaving_aborts(server, lambda: client.responses.stream(**long),
                         lambda: client.with_options(timeout=0.5).responses.create(**long), openai.APITimeoutError)
