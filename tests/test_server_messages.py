"""POST /v1/messages (Anthropic's Messages API) driven by the official `anthropic` SDK and `httpx`
against a real server: the same greedy text as chat, Anthropic's event order, tool_use and
tool_result over two turns, stop reasons, processor arguments, API keys, the error shape, and a
client that goes away freeing its slot."""

from __future__ import annotations

import json
import types

import anthropic
import httpx
import jsonschema
import pytest

from fastdeploy_lp.engine.request import CompletionOutput, RequestOutput
from fastdeploy_lp.entrypoints.openai.serving_chat import ChatRun
from fastdeploy_lp.entrypoints.openai.serving_messages import _MessageEvents
from fastdeploy_lp.reasoning import REASONING_PARSERS, ReasoningState
from server_harness import start_server
from test_server_concurrency import check_leaving_aborts

MODEL = "tiny-qwen2"
GREEDY = {"temperature": 0}  # the newest SDKs leave sampling fields out of create(); the API still takes them
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                            "additionalProperties": False}}  # short calls: the fixture model rambles in strings


@pytest.fixture(scope="module")
def server():
    s = start_server("--max-num-seqs", "8", "--served-model-name", MODEL, "--logits-processors",
                     "LogitBiasLogitsProcessor", "server_processors:FailingLogitsProcessor",
                     "server_processors:SlowLogitsProcessor")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def greedy_chat(http, messages, **kw) -> dict:
    return http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "temperature": 0,
                                                   **kw}).json()


def events_of(http, body) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed request, checking each event's name is its data's type."""
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.read().decode().split("\n\n") if f.strip()]
    out = []
    for frame in frames:
        name, data = frame.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
        assert out[-1][0] == out[-1][1]["type"]
    return out


def test_plain_message_is_the_greedy_chat_answer_with_its_usage(client, http):
    chat = greedy_chat(http, ASK, max_tokens=12)
    msg = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=ASK)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_") and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat["choices"][0]["message"]["content"]
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    assert msg.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_system_and_text_blocks_count_as_the_chat_they_translate_to(client, http):
    cached = {"type": "text", "text": "Who are you?", "cache_control": {"type": "ephemeral"}}
    blocks = [{"role": "user", "content": [{"type": "text", "text": "Hello. "}, cached]}]
    msg = client.messages.create(model=MODEL, max_tokens=1, system="Be brief.", messages=blocks)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello. Who are you?"}]
    assert msg.usage.input_tokens == http.post("/tokenize", json={"messages": chat}).json()["count"]


def test_count_tokens_is_the_input_tokens_of_the_same_message(client):
    kw = {"model": MODEL, "system": "Be brief.", "messages": ASK, "tools": [WEATHER]}
    counted = client.messages.count_tokens(**kw)
    assert counted.input_tokens == client.messages.create(max_tokens=1, **kw).usage.input_tokens


def test_stream_events_come_in_anthropic_order_and_join_to_the_plain_answer(client, http):
    body = {"model": MODEL, "max_tokens": 10, "temperature": 0, "messages": ASK}
    plain = http.post("/v1/messages", json=body).json()
    events = events_of(http, body)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] == plain["usage"]["input_tokens"]
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == plain["content"][0]["text"]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": plain["stop_reason"], "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == plain["usage"]["output_tokens"]
    with client.messages.stream(model=MODEL, max_tokens=10, extra_body=GREEDY, messages=ASK) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == plain["content"][0]["text"] and final.stop_reason == plain["stop_reason"]
    assert final.usage.output_tokens == plain["usage"]["output_tokens"]


def test_max_tokens_ends_with_stop_reason_max_tokens(client):
    never_ending = {"temperature": 0, "logits_processors_args": {"logit_bias": {"1000": 100.0}}}
    msg = client.messages.create(model=MODEL, max_tokens=3, messages=ASK, extra_body=never_ending)
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None and msg.usage.output_tokens == 3


def test_a_stop_sequence_ends_the_text_before_it_and_is_reported(client, http):
    story = [{"role": "user", "content": "Tell me a story."}]
    text = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 16, "temperature": 0,
                                           "messages": story}).json()["content"][0]["text"]
    at = next(i for i, c in enumerate(text) if c != text[0])  # the fixture model repeats itself
    stop = text[at:at + 2]
    assert text.index(stop) == at
    msg = client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=story,
                                 stop_sequences=["never there", stop])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.content[0].text == text[:at]
    events = events_of(http, {"model": MODEL, "max_tokens": 16, "temperature": 0, "messages": story,
                              "stop_sequences": [stop]})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_processor_arguments_reach_the_processors_and_are_validated(client, http):
    token = http.post("/tokenize", json={"prompt": " Paris", "add_special_tokens": False}).json()["tokens"][0]
    msg = client.messages.create(model=MODEL, max_tokens=3, messages=ASK,
                                 extra_body={"logits_processors_args": {"logit_bias": {str(token): 100.0}}})
    assert msg.content[0].text == http.post("/detokenize", json={"tokens": [token] * 3}).json()["prompt"]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=3, messages=ASK,
                               extra_body={"logits_processors_args": {"no_such_key": 1}})
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "logits_processors_args.no_such_key" in bad.value.body["error"]["message"]


def test_tool_use_then_tool_result_over_two_turns(client):
    turn = client.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                                  tool_choice={"type": "tool", "name": "get_weather"})
    assert turn.stop_reason == "tool_use"
    call = turn.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    history = ASK + [{"role": "assistant", "content": turn.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "Sunny, 21 C"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=history, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.usage.input_tokens > \
        turn.usage.input_tokens


def test_streamed_tool_use_input_json_joins_to_the_plain_input(client, http):
    body = {"model": MODEL, "max_tokens": 60, "temperature": 0, "messages": ASK, "tools": [WEATHER],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    plain = http.post("/v1/messages", json=body).json()
    events = events_of(http, body)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["name"] == "get_weather"
    pieces = "".join(d["delta"]["partial_json"] for n, d in events
                     if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(pieces) == plain["content"][-1]["input"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use" == plain["stop_reason"]
    sdk_body = {k: v for k, v in body.items() if k != "temperature"}
    with client.messages.stream(**sdk_body, extra_body=GREEDY) as stream:
        assert stream.get_final_message().content[-1].input == plain["content"][-1]["input"]


@pytest.mark.parametrize("change, status, kind, names", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"top_k": 2**40}, 400, "invalid_request_error", "top_k: Input should be less than or equal to 2147483647"),
    ({"model": "claude-sonnet-4"}, 404, "not_found_error", "model"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "messages[0].content[0]"),
    ({"messages": ASK + [{"role": "assistant", "content": "The"}]}, 400, "invalid_request_error", "messages[1]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "tools[0]"),
    ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error",
     "tool_choice"),
    ({"stop_sequences": "END"}, 400, "invalid_request_error", "stop_sequences"),
    ({"stop_sequences": ["END", ""]}, 400, "invalid_request_error",
     "stop_sequences: must not contain an empty string"),
    ({"mcp_servers": [{"url": "x"}]}, 400, "invalid_request_error", "mcp_servers"),
    ({"system": "word " * 20_000}, 400, "invalid_request_error", "system: is longer than max_model_len"),
    ({"system": [{"type": "text", "text": "Be brief."}], "messages": [{"role": "user", "content": "word " * 20_000}]},
     400, "invalid_request_error", "messages: is longer than max_model_len"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, 400, "invalid_request_error",
     "output_config.format"),
    ({"structured_outputs": {"json": {"type": "object"}}}, 400, "invalid_request_error", "structured_outputs"),
    ({"response_format": {"type": "json_object"}}, 400, "invalid_request_error", "response_format"),
    ({"guided_regex": "[a-z]+"}, 400, "invalid_request_error", "guided_regex"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error",  # no budget processor
     "thinking.budget_tokens: this server enforces no thinking budget; start it with --logits-processors "
     "ThinkingBudgetLogitsProcessor"),
    ({"thinking": {"type": "disabled", "budget_tokens": 1024}}, 400, "invalid_request_error",
     "thinking: budget_tokens is only for type 'enabled'"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2**63}}, 400, "invalid_request_error",
     "thinking.budget_tokens"),
])
def test_errors_have_anthropic_shape_and_name_the_field(http, change, status, kind, names):
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, **change}
    r = http.post("/v1/messages", json={k: v for k, v in body.items() if v is not None},
                  headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    assert r.json()["error"]["message"].startswith(names), r.json()


def test_a_failed_generation_is_an_api_error_and_a_streamed_one_ends_with_an_error_event(http):
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, "logits_processors_args": {"fail": True}}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
    assert "asked to fail" in r.json()["error"]["message"]
    events = events_of(http, body)
    assert [n for n, _ in events] == ["message_start", "error"] and events[-1][1]["error"]["type"] == "api_error"


def test_malformed_json_and_wrong_method_keep_their_shapes(http):
    r = http.post("/v1/messages", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert http.get("/v1/messages").status_code == 405


def test_closing_a_stream_midway_or_giving_up_on_an_answer_aborts_the_request(server, client):
    long = {"model": MODEL, "max_tokens": 400, "messages": ASK,  # 400 slow tokens, no EOS
            "extra_body": {"logits_processors_args": {"slow_ms": 20, "logit_bias": {"1000": 100.0}}}}
    check_leaving_aborts(server, lambda: client.messages.stream(**long),
                         lambda: client.with_options(timeout=0.5).messages.create(**long), anthropic.APITimeoutError)


@pytest.fixture(scope="module")
def keyed_server():
    s = start_server("--max-num-seqs", "2", "--served-model-name", MODEL, "--api-key", "sk-test",
                     "--max-request-body-bytes", "4096")
    yield s
    s.stop()


def test_x_api_key_is_accepted_and_a_wrong_key_is_an_anthropic_401(keyed_server):
    ok = anthropic.Anthropic(base_url=keyed_server.base_url, api_key="sk-test", max_retries=0)
    assert ok.messages.create(model=MODEL, max_tokens=2, messages=ASK).usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic.Anthropic(base_url=keyed_server.base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=ASK)
    assert denied.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                            "message": denied.value.body["error"]["message"]}}
    openai_shaped = httpx.get(keyed_server.url("/v1/models"), headers={"x-api-key": "wrong"})
    assert openai_shaped.status_code == 401 and openai_shaped.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed_server.url("/v1/models"), headers={"x-api-key": "sk-test"}).status_code == 200
    too_large = httpx.post(keyed_server.url("/v1/messages"), headers={"x-api-key": "sk-test"},
                           json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "a" * 5000}]})
    assert too_large.status_code == 413 and too_large.json()["error"]["type"] == "request_too_large"


def _output(delta: str, text: str, finished: bool, finish: str | None = None) -> RequestOutput:
    o = CompletionOutput(0, text, list(range(len(text))), finish, delta_text=delta)
    return RequestOutput("r", None, [1, 2, 3], o, finished)


def test_reasoning_comes_out_as_a_thinking_block_before_the_text():
    chat = types.SimpleNamespace(model_name=MODEL, reasoning=REASONING_PARSERS["deepseek_r1"])
    run = ChatRun(stream=None, n=1, backend=None, reader=None, thinking=ReasoningState.REASONING, prefix="", answer_model="m")
    events = _MessageEvents(chat, "msg_1", run)
    frames = events.output(_output("Let me think", "Let me think", False))
    frames += events.output(_output("</think>Paris", "Let me think</think>Paris", True, "stop"))
    data = [json.loads(f.split("\ndata: ")[1]) for f in frames]
    assert [d["type"] for d in data] == ["message_start", "content_block_start", "content_block_delta",
                                         "content_block_stop", "content_block_start", "content_block_delta",
                                         "content_block_stop", "message_delta", "message_stop"]
    assert data[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert data[2]["delta"] == {"type": "thinking_delta", "thinking": "Let me think"}
    assert data[4]["content_block"] == {"type": "text", "text": ""} and data[5]["index"] == 1
    assert data[5]["delta"] == {"type": "text_delta", "text": "Paris"}
    assert data[7]["usage"] == {"input_tokens": 3, "output_tokens": len("Let me think</think>Paris")}
