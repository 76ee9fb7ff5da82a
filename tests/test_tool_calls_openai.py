"""Tool calls through the official `openai` SDK against a real server running the built-in default
model (trained to call tools as `<function=NAME>{JSON}</function>`), sampled hot (temperature 1.3)
over many seeds, streamed and not:

- whenever `finish_reason` is "tool_calls", every `arguments` is JSON valid for its tool's schema,
  also when the model writes `</function>` inside a string argument;
- a call cut by `max_tokens` is `finish_reason: "length"` with the call, arguments as far as written,
  in `tool_calls`, the same streamed and not, and one shape on /v1/messages and /v1/responses too;
- `tool_choice: "none"` never lets the call syntax into the content;
- `parallel_tool_calls` true lets two calls through, false at most one;
- streamed calls arrive in OpenAI's shape (a header delta, then argument pieces) and accumulate,
  by hand, with the SDK's `ChatCompletionStreamState` and with `client.chat.completions.stream`,
  to the non-streamed answer;
- a two-turn conversation (call, tool result, answer) works.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel

from fastdeploy_lp.config import default_model_path
from fastdeploy_lp.tokenizer import Tokenizer
from server_harness import anthropic_client, start_server
from test_server_openai import client  # noqa: F401  (the fixture, over this module's `server`)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
DATE = {"type": "object", "properties": {}}
NOTE = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_date": DATE, "take_note": NOTE}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_date", "description": "Get today's date",
                                           "parameters": DATE}},
         {"type": "function", "function": {"name": "take_note", "description": "Write a note",
                                           "parameters": NOTE}}]
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SEEDS = range(20)
HOT = 1.3


@pytest.fixture(scope="module")
def server():
    s = start_server("--max-num-seqs", "16", "--served-model-name", "default-model", model=default_model_path())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def token_id():
    tok = Tokenizer(default_model_path())

    def one(text: str) -> str:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1, (text, ids)
        return str(ids[0])
    return one


def _many(fn, seeds):
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, seeds))


def _stream(client, **kw) -> tuple[list, object]:
    """All chunks of a streamed answer, and the SDK's own accumulation of them (None when the SDK
    refuses a `length` finish)."""
    chunks = list(client.chat.completions.create(stream=True, **kw))
    state = ChatCompletionStreamState(input_tools=kw.get("tools", openai.NOT_GIVEN))
    for c in chunks:
        state.handle_chunk(c)
    try:
        return chunks, state.get_final_completion()
    except openai.LengthFinishReasonError:
        return chunks, None


def _calls_by_hand(chunks) -> tuple[str, dict[int, dict], str | None]:
    """(content, {index: {"id", "name", "arguments"}}, finish_reason) from the deltas, checking the
    OpenAI shape: a first delta with id, type, name and arguments "", then argument pieces only."""
    content, calls, finish = "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        choice = c.choices[0]
        if choice.finish_reason:
            assert finish is None
            finish = choice.finish_reason
        delta = choice.delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            assert finish is None, "a tool-call delta after the finish chunk"
            if tc.index not in calls:
                assert tc.id and tc.id.startswith("call_") and tc.type == "function"
                assert tc.function.name and tc.function.arguments == ""
                assert tc.index == len(calls)  # indexes count up from 0
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": "", "pieces": 0}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
                calls[tc.index]["pieces"] += 1
    return content, calls, finish


def _valid(name: str, arguments: str) -> dict:
    value = json.loads(arguments)
    jsonschema.validate(value, SCHEMAS[name])
    return value


# -- valid arguments, whatever the sampling -------------------------------------------------------
@pytest.mark.parametrize("tool_choice", [NAMED, "required", "auto"], ids=["named", "required", "auto"])
def test_hot_sampling_over_seeds_gives_only_schema_valid_calls_streamed_and_not(client, tool_choice):
    kw = dict(model="default-model", messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=HOT,
              max_tokens=64)

    def both(seed):
        return client.chat.completions.create(seed=seed, **kw), _stream(client, seed=seed, **kw)

    results = _many(both, SEEDS)
    n_calls = 0
    for seed, (full, (chunks, accumulated)) in zip(SEEDS, results):
        choice = full.choices[0]
        if tool_choice != "auto":
            assert choice.finish_reason in ("tool_calls", "length"), (seed, choice)
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls
            for call in choice.message.tool_calls:
                _valid(call.function.name, call.function.arguments)
                n_calls += 1
            if tool_choice == NAMED:
                assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        else:  # a call cut by max_tokens is in tool_calls, as streamed
            assert choice.finish_reason == "length" or not choice.message.tool_calls
        # the stream: same seed, same answer; the deltas join to the same content and calls
        content, calls, finish = _calls_by_hand(chunks)
        assert finish == choice.finish_reason, seed
        assert content == (choice.message.content or ""), seed
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []], seed
        if finish == "tool_calls":
            assert all(c["pieces"] > 1 for c in calls.values())  # streamed as generated, not in one piece
            sdk = accumulated.choices[0].message.tool_calls
            assert [(c.id, c.function.name, c.function.arguments) for c in sdk] == \
                [(c["id"], c["name"], c["arguments"]) for c in calls.values()]
    assert n_calls >= len(SEEDS) // 2  # the model does call tools


def test_end_tag_inside_a_string_argument_stays_in_the_string(client, token_id):
    """`</function>` pushed up (logit bias) so the model writes it inside the note's text."""
    kw = dict(model="default-model", messages=[{"role": "user", "content": "Take a note: buy milk"}],
              tools=TOOLS, tool_choice={"type": "function", "function": {"name": "take_note"}}, temperature=HOT,
              max_tokens=64, logit_bias={token_id("</function>"): 8})

    def both(seed):
        return client.chat.completions.create(seed=seed, **kw), _stream(client, seed=seed, **kw)

    inside = 0
    for full, (chunks, accumulated) in _many(both, SEEDS):
        choice = full.choices[0]
        assert choice.finish_reason in ("tool_calls", "length")
        if choice.finish_reason == "length":
            continue
        [call] = choice.message.tool_calls
        value = _valid("take_note", call.function.arguments)
        inside += "</function>" in value["text"]
        [sdk] = accumulated.choices[0].message.tool_calls
        assert sdk.function.arguments == call.function.arguments
        assert _calls_by_hand(chunks)[2] == "tool_calls"
    assert inside >= 1  # at least one answer had the end tag inside its string argument


@pytest.mark.parametrize("max_tokens", [3, 6, 9, 11])
def test_a_cut_call_has_one_shape_streamed_and_not_on_every_api(server, client, max_tokens):
    """Cut by max_tokens after its name, a call is a call with the arguments written so far, the same
    streamed and not: chat `tool_calls` (finish "length"), a Messages `tool_use` block whose input is
    the partial JSON read as Anthropic's SDK reads it (stop "max_tokens"), a Responses
    `function_call` item with status "incomplete". Cut inside its name, it is nothing: the call
    syntax never reaches the content."""
    kw = dict(model="default-model", messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0,
              max_tokens=max_tokens)
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, finish = _calls_by_hand(_stream(client, **kw)[0])
    assert whole.finish_reason == finish == "length"
    assert (whole.message.content or "") == content
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []] == \
        [(c["name"], c["arguments"]) for c in calls.values()]
    cut = bool(calls)
    assert cut == (max_tokens > 3)  # three tokens end inside "<function=get_weather>"
    assert "<function" not in content

    claude = anthropic_client(server)
    mkw = dict(model="default-model", max_tokens=max_tokens, messages=ASK, extra_body={"temperature": 0},
               tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS],
               tool_choice={"type": "tool", "name": "get_weather"})
    message = claude.messages.create(**mkw)
    with claude.messages.stream(**mkw) as stream:
        streamed = stream.get_final_message()
    assert message.stop_reason == streamed.stop_reason == "max_tokens"
    shape = [(b.type, getattr(b, "name", None), getattr(b, "input", None), getattr(b, "text", None))
             for b in message.content]
    assert shape == [(b.type, getattr(b, "name", None), getattr(b, "input", None), getattr(b, "text", None))
                     for b in streamed.content]
    assert [b.type for b in message.content] == (["tool_use"] if cut else ["text"])
    assert all("<function" not in (getattr(b, "text", None) or "") for b in message.content)

    rkw = dict(model="default-model", input=ASK[0]["content"], max_output_tokens=max_tokens, temperature=0,
               tools=[{"type": "function", **t["function"]} for t in TOOLS],
               tool_choice={"type": "function", "name": "get_weather"}, store=False)
    response = client.responses.create(**rkw)
    rstreamed = list(client.responses.create(stream=True, **rkw))[-1].response  # response.incomplete's
    assert response.status == rstreamed.status == "incomplete"
    items = [(i.type, i.status, getattr(i, "name", None), getattr(i, "arguments", None)) for i in response.output]
    assert items == [(i.type, i.status, getattr(i, "name", None), getattr(i, "arguments", None))
                     for i in rstreamed.output]
    assert all("<function" not in str(getattr(i, "content", "")) for i in response.output)
    if cut:  # an item is complete once its arguments are (11 tokens end before "</function>")
        status = "completed" if max_tokens == 11 else "incomplete"
        assert items == [("function_call", status, "get_weather", calls[0]["arguments"])]


# -- tool_choice "none" ---------------------------------------------------------------------------
def test_tool_choice_none_never_writes_the_call_syntax(client, token_id):
    """The model is trained to call here and is pushed further towards `<function=`; "auto" shows
    the push works, "none" shows the grammar stops it."""
    bias = {token_id("<function="): 8}
    kw = dict(model="default-model", messages=ASK, tools=TOOLS, temperature=HOT, max_tokens=40, logit_bias=bias)
    auto = _many(lambda s: client.chat.completions.create(seed=s, tool_choice="auto", **kw), range(4))
    assert sum(bool(r.choices[0].message.tool_calls) for r in auto) >= 3

    def none(seed):
        full = client.chat.completions.create(seed=seed, tool_choice="none", **kw)
        chunks, _ = _stream(client, seed=seed, tool_choice="none", **kw)
        return full, chunks

    for full, chunks in _many(none, SEEDS):
        choice = full.choices[0]
        assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
        assert "<function=" not in choice.message.content
        content, calls, finish = _calls_by_hand(chunks)
        assert "<function=" not in content and not calls and finish in ("stop", "length")


# -- parallel_tool_calls --------------------------------------------------------------------------
ASK_TWO = [{"role": "user", "content": "What's the weather in Paris and in London?"}]


def test_parallel_tool_calls_true_gives_two_calls_and_false_at_most_one(client, token_id):
    # min_tokens keeps EOS away after the first call: under "required" the grammar then allows only
    # the separator and a second call. parallel_tool_calls is left at OpenAI's default (true).
    kw = dict(model="default-model", messages=ASK_TWO, tools=TOOLS, tool_choice="required", temperature=HOT,
              max_tokens=80)
    two = _many(lambda s: client.chat.completions.create(seed=s, extra_body={"min_tokens": 16}, **kw), range(8))
    doubles = [r for r in two if r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 2]
    assert doubles, [r.choices[0].message for r in two]
    for r in doubles:
        calls = r.choices[0].message.tool_calls
        assert len({c.id for c in calls}) == 2
        for c in calls:
            _valid(c.function.name, c.function.arguments)
    seed = two.index(doubles[0])
    chunks, accumulated = _stream(client, seed=seed, extra_body={"min_tokens": 16}, **kw)
    _, calls, finish = _calls_by_hand(chunks)
    assert finish == "tool_calls" and sorted(calls) == [0, 1]
    assert [c["arguments"] for c in calls.values()] == [c.function.arguments for c in doubles[0].choices[0].message.tool_calls]
    assert len(accumulated.choices[0].message.tool_calls) == 2

    # The same push with true and with false: true gives second calls, false never does. "required":
    # the separator pushed up hard (no JSON whitespace, so the bias acts only between calls);
    # "auto": the call tag pushed up and EOS kept away (min_tokens; with false the grammar then
    # has only EOS left, which min_tokens forbids: finish "error", and still no second call).
    pushes = {"required": dict(logit_bias={token_id("\n"): 30}, extra_body={"guided_whitespace_pattern": ""}),
              "auto": dict(logit_bias={token_id("<function="): 8},
                           extra_body={"guided_whitespace_pattern": "", "min_tokens": 20})}
    for choice, push in pushes.items():
        def counts(parallel, choice=choice, push=push):
            return [(len(r.choices[0].message.tool_calls or []), r.choices[0]) for r in _many(
                lambda s: client.chat.completions.create(seed=s, parallel_tool_calls=parallel,
                                                         **dict(kw, tool_choice=choice, **push)), range(8))]
        assert any(n >= 2 for n, _ in counts(True)), choice
        for n, c in counts(False):
            assert n <= 1, c.message
            if c.finish_reason == "tool_calls":
                assert n == 1
                _valid(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)


# -- the SDK's stream helper and a whole tool conversation ----------------------------------------
class GetWeather(BaseModel):
    city: str


def test_sdk_stream_helper_parses_the_streamed_arguments(client):
    tools = [openai.pydantic_function_tool(GetWeather, name="get_weather")]
    for seed in range(4):
        try:
            with client.chat.completions.stream(model="default-model", messages=ASK, tools=tools,
                                                tool_choice="required", temperature=HOT, max_tokens=64,
                                                seed=seed) as stream:
                events = list(stream)
                final = stream.get_final_completion()
        except openai.LengthFinishReasonError:
            continue  # cut by max_tokens
        choice = final.choices[0]
        assert choice.finish_reason == "tool_calls"
        deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
        done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
        assert len(deltas) > 1 and len(done) == len(choice.message.tool_calls)
        for call, event in zip(choice.message.tool_calls, done):
            assert isinstance(call.function.parsed_arguments, GetWeather)
            assert event.arguments == call.function.arguments == "".join(
                d.arguments_delta for d in deltas if d.index == event.index)


def test_two_turn_tool_conversation(client):
    first = client.chat.completions.create(model="default-model", messages=ASK, tools=TOOLS, temperature=0,
                                           max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    result = json.dumps({"city": "Paris", "temperature": 18, "unit": "celsius", "condition": "sunny"})
    messages = ASK + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = client.chat.completions.create(model="default-model", messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=64)
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "18" in answer.message.content and "<function=" not in answer.message.content


def test_streamed_tool_calls_carry_every_token_logprob_once(client):
    kw = dict(model="default-model", messages=ASK, tools=TOOLS, tool_choice="auto", temperature=HOT, max_tokens=64,
              seed=1, logprobs=True)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in full.choices[0].logprobs.content]
    assert len(streamed) == chunks[-1].usage.completion_tokens == full.usage.completion_tokens


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_date"}}, "required", "auto"],
                         ids=["named", "required", "auto"])
def test_a_bad_parameters_schema_is_a_400_naming_that_tool(client, tool_choice):
    """Not the constraint's inner path (`tools.format.tags[1].content.json_schema`; probe)."""
    tools = [TOOLS[0], {"type": "function", "function": {"name": "get_date", "parameters": {
        "type": "object", "properties": {"day": {"type": "nope"}}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default-model", messages=ASK, tools=tools, tool_choice=tool_choice)
    assert e.value.body["param"] == "tools[1].function.parameters", e.value.body
    assert e.value.body["message"].startswith("tools[1].function.parameters: "), e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default-model", input="Hi", tools=[
            {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
            for t in tools])
    assert e.value.body["param"] == "tools[1].parameters", e.value.body
