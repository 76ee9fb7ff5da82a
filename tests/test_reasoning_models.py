"""Reasoning models: a thinking model thinks freely, then answers in schema; the server returns the
thinking as reasoning_content. The fixture is the qwen3 checkpoint with a Qwen3-style template
that writes <think> (open for DeepSeek-R1's style, closed and empty when thinking is off)."""

from __future__ import annotations

import json
import os
import shutil

import jsonschema
import openai
import pytest
from conftest import fixture_dir

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.reasoning import REASONING_PARSERS
from fastdeploy_lp.sampling_params import GuidedDecodingParams
from server_harness import start_server

TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% elif open_thinking is defined and open_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"],
          "additionalProperties": False}
PARSER = REASONING_PARSERS["qwen3"]
MESSAGES = [{"role": "user", "content": "What is 6 times 7?"}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3-thinking")
    for name in os.listdir(fixture_dir("qwen3")):
        if not name.startswith("reference"):
            shutil.copy(os.path.join(fixture_dir("qwen3"), name), path / name)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def llm(thinking_model):
    return LLM(thinking_model, max_num_seqs=4, device="cpu", reasoning_parser="qwen3",
               logits_processors=["ThinkingBudgetLogitsProcessor"])


def generate(llm, seed, budget=6, bias=None, **template):
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=80, logit_bias=bias,
                            guided_decoding=GuidedDecodingParams(json=SCHEMA),
                            logits_processors_args={"thinking_budget": budget})
    prompt = llm.tokenizer.apply_chat_template(MESSAGES, **template)
    out = llm.generate(llm.tokenizer.encode(prompt), params, use_tqdm=False)[0].outputs
    return out, PARSER.split(out.text, PARSER.prompt_state(prompt))


def test_open_thinking_is_free_then_the_answer_follows_the_schema(llm):
    for seed in range(4):
        out, (reasoning, answer) = generate(llm, seed, open_thinking=True)
        assert out.finish_reason == "stop", out
        assert "</think>" in out.text and reasoning is not None
        assert not out.text.startswith("think>")  # the prompt opened the tag: nothing of it is forced again
        jsonschema.validate(json.loads(answer), SCHEMA)


def test_thinking_off_is_constrained_from_the_first_token(llm):
    for seed in range(3):
        out, (reasoning, answer) = generate(llm, seed, enable_thinking=False)
        assert reasoning is None and out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_the_model_may_open_its_reasoning_or_answer_at_once(llm):
    """With nothing in the prompt, the first step allows the constraint and the start of <think>."""
    lt = llm.tokenizer.encode("<think>")[0]
    opened, (reasoning, answer) = generate(llm, 1, bias={lt: 100})
    assert opened.text.startswith("<think>") and reasoning is not None and opened.finish_reason == "stop"
    jsonschema.validate(json.loads(answer), SCHEMA)
    direct, (reasoning, answer) = generate(llm, 1, bias={lt: -100})
    assert reasoning is None and not direct.text.startswith("<")
    jsonschema.validate(json.loads(direct.text), SCHEMA)


@pytest.mark.parametrize("template", [{"open_thinking": True}, {}])
def test_a_constrained_output_never_ends_while_thinking(llm, template):
    """EOS is banned while the model thinks: an output that stops has answered in schema (a probe
    found outputs ending inside the thinking with finish_reason "stop" and no answer)."""
    eos = llm.tokenizer.eos_token_id
    lt = llm.tokenizer.encode("<think>")[0]
    for seed in range(6):
        out, (reasoning, answer) = generate(llm, seed, budget=40, bias={eos: 6.0, lt: 3.0}, **template)
        assert out.finish_reason in ("stop", "length"), out
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(answer), SCHEMA)


def test_close_on_length_ends_the_thinking_in_time_for_the_answer_to_close(llm):
    """The model would think past max_tokens (its </think> banned): the end tag is forced when the
    budget left is the tag plus the answer's shortest closing, and the answer parses."""
    end = llm.tokenizer.encode("</think>")
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(MESSAGES, open_thinking=True))
    for max_tokens in (24, 30):  # both tags (6 + 7 tokens here) and the shortest answer (11) fit 24
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=max_tokens, logit_bias={end[0]: -100},
                                guided_decoding=GuidedDecodingParams(json=SCHEMA, close_on_length=True))
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs
        reasoning, answer = PARSER.split(out.text, PARSER.prompt_state(llm.tokenizer.decode(prompt)))
        assert out.finish_reason == "length" and out.closed_on_length and len(out.token_ids) == max_tokens, out
        assert "</think>" in out.text and reasoning
        jsonschema.validate(json.loads(answer), SCHEMA)


@pytest.mark.parametrize("template", [{"open_thinking": True}, {}])
def test_close_on_length_needs_room_for_the_reasoning_tags_too(llm, template):
    """With a reasoning parser the model may open its thinking and be thinking when the budget runs
    out (probe): a budget that holds the shortest answer but not both tags is refused up front, and
    the smallest one accepted closes, whether the prompt opened thinking or left it to the model."""
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(MESSAGES, **template))
    lt = llm.tokenizer.encode("<think>")[0]
    refused = SamplingParams(max_tokens=23, guided_decoding=GuidedDecodingParams(json=SCHEMA, close_on_length=True))
    with pytest.raises(ValueError, match=r"max_tokens: .*\(11 tokens\) plus the reasoning tags <think> </think> "
                                         r"\(13 tokens\); max_tokens is 23"):
        llm.generate(prompt, refused, use_tqdm=False)
    for seed in range(3):  # the model pushed to think
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=24, logit_bias={lt: 5.0},
                                guided_decoding=GuidedDecodingParams(json=SCHEMA, close_on_length=True))
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs
        _, answer = PARSER.split(out.text, PARSER.prompt_state(llm.tokenizer.decode(prompt)))
        assert out.finish_reason == "stop" or out.closed_on_length, out
        jsonschema.validate(json.loads(answer), SCHEMA)


@pytest.fixture(scope="module")
def client(thinking_model):
    server = start_server("--max-num-seqs", "4", "--reasoning-parser", "qwen3",
                          "--logits-processors", "ThinkingBudgetLogitsProcessor", model=thinking_model)
    yield openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=60)
    server.stop()


def test_server_returns_reasoning_content_apart_streamed_and_not(client):
    kwargs = dict(model="default", messages=MESSAGES, temperature=1.0, max_tokens=80,
                  response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
                  extra_body={"chat_template_kwargs": {"open_thinking": True},
                              "logits_processors_args": {"thinking_budget": 6}})
    for seed, budget in ((0, 6), (1, 6), (2, 6), (3, 0)):  # budget 0: an empty block, None both ways (probe)
        kwargs["extra_body"]["logits_processors_args"]["thinking_budget"] = budget
        message = client.chat.completions.create(seed=seed, **kwargs).choices[0].message
        assert (message.reasoning_content is None) == (budget == 0), message
        assert "</think>" not in (message.reasoning_content or "")
        jsonschema.validate(json.loads(message.content), SCHEMA)
        chunks = list(client.chat.completions.create(seed=seed, stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        streamed_reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        assert (streamed_reasoning or None) == message.reasoning_content
        assert "".join(d.content or "" for d in deltas) == message.content


def test_server_without_thinking_has_no_reasoning_content(client):
    message = client.chat.completions.create(
        model="default", messages=MESSAGES, temperature=1.0, seed=3, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.reasoning_content is None
    jsonschema.validate(json.loads(message.content), SCHEMA)


def test_speculation_keeps_thinking_then_schema_token_for_token(llm, thinking_model):
    """With drafts, the guided processor walks them through its reasoning gate (thinking: no mask)
    and its matcher (the answer), and puts both back after the pass: the same text as without."""
    spec = LLM(thinking_model, max_num_seqs=4, device="cpu", reasoning_parser="qwen3",
               logits_processors=["ThinkingBudgetLogitsProcessor"], speculative_config={
                   "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "draft_row_cost": 0.05})
    lt = llm.tokenizer.encode("<think>")[0]
    cases = [(seed, budget, bias, template) for seed in range(3) for budget in (2, 12)
             for bias, template in ((None, {"open_thinking": True}), (None, {"enable_thinking": False}),
                                    ({lt: 100}, {}), ({lt: -100}, {}))]
    for seed, budget, bias, template in cases:
        want, _ = generate(llm, seed, budget, bias, **template)
        got, _ = generate(spec, seed, budget, bias, **template)
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (seed, budget, template)
    stats = spec.speculative_stats()
    assert stats["requests_not_speculating"] == 0 and stats["verify_passes"] > 0, stats
