"""Reasoning through /v1/responses and /v1/messages on a real server with `--reasoning-parser`:
the thinking comes back as a `reasoning` item / a `thinking` block before the answer, streamed as
its own events that join to the plain answer, equal to what chat returns as reasoning_content; and
Anthropic's `thinking.budget_tokens` is enforced by the thinking-budget processor. The model is the
qwen3 fixture with a template that opens <think> when thinking is enabled (QwQ / DeepSeek-R1 style)
and closes it empty when disabled (Qwen3 style)."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest
from conftest import fixture_dir

from server_harness import anthropic_client, openai_client, serving
from test_reasoning_models import SCHEMA
from test_reasoning_models import TEMPLATE as OPEN_THINKING_TEMPLATE

MODEL = "thinker"
# thinking opens in the prompt when enabled, not only when asked with open_thinking
TEMPLATE = OPEN_THINKING_TEMPLATE.replace("open_thinking is defined and open_thinking", "enable_thinking is defined")
ASK = "What is 6 times 7?"
THINK = {"chat_template_kwargs": {"enable_thinking": True}, "logits_processors_args": {"thinking_budget": 6}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-thinks") / "model"
    shutil.copytree(fixture_dir("qwen3"), path, ignore=shutil.ignore_patterns("reference*"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    yield from serving("--max-num-seqs", "4", "--served-model-name", MODEL, "--reasoning-parser", "qwen3",
                       "--logits-processors", "ThinkingBudgetLogitsProcessor", model=str(path))


@pytest.fixture(scope="module")
def oai(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic_client(server)


# -- /v1/responses ------------------------------------------------------------------------------
def _respond(oai, seed: int, **kw):
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    return oai.responses.create(model=MODEL, input=ASK, text=fmt, max_output_tokens=80, temperature=1.0,
                                store=False, extra_body={"seed": seed, **THINK}, **kw)


def test_responses_reasoning_item_comes_before_the_message_and_is_chats_reasoning_content(oai):
    for seed in range(2):
        out = _respond(oai, seed)
        chat = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=80, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
            extra_body=THINK).choices[0].message
        reasoning, message = out.output
        assert (reasoning.type, message.type, out.status) == ("reasoning", "message", "completed")
        assert [c.type for c in reasoning.content] == ["reasoning_text"] and reasoning.status == "completed"
        assert reasoning.content[0].text == chat.reasoning_content and "</think>" not in chat.reasoning_content
        assert out.output_text == chat.content
        jsonschema.validate(json.loads(out.output_text), SCHEMA)
        assert 0 < out.usage.output_tokens_details.reasoning_tokens < out.usage.output_tokens


def test_responses_streamed_reasoning_events_come_first_and_join_to_the_item(oai):
    plain = _respond(oai, 3)
    events = list(_respond(oai, 3, stream=True))
    types = [e.type for e in events]
    thought = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    said = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.reasoning_text.delta"] * len(thought)
                     + ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                        "response.output_item.added", "response.content_part.added"]
                     + ["response.output_text.delta"] * len(said)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    assert events[2].item.type == "reasoning" and events[2].output_index == 0
    added = next(e for e in events[3:] if e.type == "response.output_item.added")
    assert added.item.type == "message" and added.output_index == 1
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert "".join(thought) == done.text == plain.output[0].content[0].text
    assert "".join(said) == plain.output_text == events[-1].response.output_text


def test_responses_reasoning_items_go_back_as_input_and_stay_out_of_the_prompt(oai):
    first = _respond(oai, 4)
    turn = [{"role": "user", "content": ASK}]
    again = [{"role": "user", "content": "And 7 times 8?"}]
    replayed = oai.responses.create(model=MODEL, input=turn + [i.model_dump(exclude_none=True) for i in first.output]
                                    + again, max_output_tokens=2, store=False)
    without = oai.responses.create(model=MODEL, input=turn + [first.output[1].model_dump(exclude_none=True)] + again,
                                   max_output_tokens=2, store=False)
    assert replayed.usage.input_tokens == without.usage.input_tokens


# -- /v1/messages -------------------------------------------------------------------------------
def _message(server, budget: int | None, **kw) -> dict:
    thinking = {"type": "enabled", **({"budget_tokens": budget} if budget is not None else {})}
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "thinking": thinking,
            "messages": [{"role": "user", "content": ASK}], **kw}
    r = httpx.post(server.url("/v1/messages"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_messages_thinking_block_is_cut_at_budget_tokens_as_chats_thinking_budget(server, oai):
    budgeted, free = _message(server, 5), _message(server, None)
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=24,
                                       temperature=0, extra_body={**THINK, "logits_processors_args": {
                                           "thinking_budget": 5}}).choices[0].message
    assert [b["type"] for b in budgeted["content"]] == ["thinking", "text"]
    thought, text = budgeted["content"][0]["thinking"], budgeted["content"][1]["text"]
    assert (thought, text) == (chat.reasoning_content, chat.content) and budgeted["content"][0]["signature"] == ""
    # without a budget the same greedy thinking runs on past where the budget forced </think>
    unbounded = free["content"][0]["thinking"].strip()
    assert free["content"][0]["type"] == "thinking" and unbounded.startswith(thought.strip())
    assert len(unbounded) > len(thought.strip())


def test_messages_without_thinking_have_no_thinking_block(server):
    msg = _message(server, None, thinking={"type": "disabled"})
    assert [b["type"] for b in msg["content"]] == ["text"]


def test_messages_streamed_thinking_block_then_text_block_join_to_the_plain_message(server, claude):
    plain = _message(server, 5)
    with httpx.stream("POST", server.url("/v1/messages"), timeout=60, json={
            "model": MODEL, "max_tokens": 24, "temperature": 0, "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 5}, "messages": [{"role": "user", "content": ASK}]}) as r:
        data = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [d["type"] if d["type"] != "content_block_delta" else d["delta"]["type"] for d in data]
    n_thought, n_text = kinds.count("thinking_delta"), kinds.count("text_delta")
    assert kinds == (["message_start", "content_block_start"] + ["thinking_delta"] * n_thought
                     + ["content_block_stop", "content_block_start"] + ["text_delta"] * n_text
                     + ["content_block_stop", "message_delta", "message_stop"])
    assert data[1]["content_block"]["type"] == "thinking" and data[1]["index"] == 0
    assert data[n_thought + 3]["content_block"]["type"] == "text" and data[n_thought + 3]["index"] == 1
    deltas = [d["delta"] for d in data if d["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == plain["content"][0]["thinking"]
    assert "".join(d.get("text", "") for d in deltas) == plain["content"][1]["text"]
    with claude.messages.stream(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": ASK}],
                                thinking={"type": "enabled", "budget_tokens": 5}, extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == plain["content"][0]["thinking"] and final.stop_reason == plain["stop_reason"]


def test_budget_tokens_disagreeing_with_thinking_budget_is_a_400(server):
    r = httpx.post(server.url("/v1/messages"), timeout=60, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": ASK}],
        "thinking": {"type": "enabled", "budget_tokens": 5}, "logits_processors_args": {"thinking_budget": 7}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("thinking.budget_tokens"), r.text


def test_include_and_separate_reasoning_switches(oai):
    """vLLM's include_reasoning=false drops the reasoning; SGLang's separate_reasoning=false leaves it
    in content, unsplit (both routers add these fields, at their defaults, to every chat request)."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=40, temperature=1.0, seed=3)
    split = oai.chat.completions.create(**kw, extra_body=THINK).choices[0].message
    assert split.reasoning_content
    dropped = oai.chat.completions.create(**kw, extra_body={**THINK, "include_reasoning": False}).choices[0].message
    assert getattr(dropped, "reasoning_content", None) is None and dropped.content == split.content
    whole = oai.chat.completions.create(**kw, extra_body={**THINK, "separate_reasoning": False}).choices[0].message
    assert getattr(whole, "reasoning_content", None) is None
    assert split.reasoning_content in whole.content and whole.content.endswith(split.content)
    chunks = oai.chat.completions.create(**kw, stream=True, extra_body={**THINK, "include_reasoning": False})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)
    assert "".join(d.content or "" for d in deltas) == split.content
