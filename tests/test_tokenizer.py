"""Tokenizers, chat templates and incremental detokenization against the `transformers` reference."""

from __future__ import annotations

import json
import os

import pytest
from conftest import FIXTURES, fixture_dir

from fastdeploy_lp.tokenizer import ChatTemplate, IncrementalDetokenizer, Tokenizer
from fastdeploy_lp.tokenizer.chat_template import render_chat_prompt


@pytest.fixture(scope="module")
def reference():
    with open(os.path.join(FIXTURES, "tokenizer_reference.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(fixture_dir("qwen2"))


def test_encode_decode_and_chat_prompt_match_transformers(tok, reference):
    for text, ids in reference["encode"].items():
        assert tok.encode(text) == ids, text
    for text, roundtrip in reference["decode_roundtrip"].items():
        assert tok.decode(tok.encode(text)) == roundtrip
    prompt = tok.apply_chat_template(reference["messages"], add_generation_prompt=True)
    assert prompt == reference["chat_prompt_text"]
    assert tok.encode(prompt) == reference["chat_prompt_ids"]
    assert tok.eos_token_id == 2


def _stream(tok, text, stop=None, prompt=()):
    detok = IncrementalDetokenizer(tok, list(prompt), stop)
    pieces = []
    for t in tok.encode(text):
        detok.add(t)
        pieces.append(detok.take_delta(final=False))
        if detok.stopped_on:
            break
    pieces.append(detok.take_delta(final=True))
    return pieces, detok


@pytest.mark.parametrize("text", ["今天天气真好", "emoji 🚀 ok", "鲁迅是谁 and more 🚀🚀"])
def test_incremental_detokenization_never_emits_half_a_character(tok, text):
    pieces, detok = _stream(tok, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert detok.text == text


def test_stop_string_spanning_tokens_is_found_and_cut(tok):
    text = "The capital of France is Paris. More text"
    pieces, detok = _stream(tok, text, stop=["is Par"])
    assert detok.stopped_on == "is Par"
    assert "".join(pieces) == "The capital of France "


def test_streamed_text_never_shows_a_stop_string_prefix_that_later_stops(tok):
    pieces, _ = _stream(tok, "Hello world, capital", stop=["world,"])
    assert "".join(pieces) == "Hello "
    assert not any("world" in p for p in pieces)


def test_sentencepiece_model_encodes_any_utf8(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join([f"the capital of country {i} is city {i * 7}" for i in range(300)] + ["hello world"]), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=300,
                                   byte_fallback=True, user_defined_symbols=["<|im_end|>"], bos_id=-1,
                                   character_coverage=1.0, add_dummy_prefix=False)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tok = Tokenizer(str(tmp_path))
    for text in ["hello 世界 🚀", "paris<|im_end|>"]:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.encode("<|im_end|>") == [tok.eos_token_id]
    pieces, _ = _stream(tok, "the capital 世界 🚀")
    assert "".join(pieces) == "the capital 世界 🚀"


def test_chat_template_gets_tools_and_kwargs():
    template = ChatTemplate(
        "{% if tools %}TOOLS:{{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% if enable_thinking %}<think>{% endif %}{% endif %}")
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    out = template.render([{"role": "user", "content": "hi"}], tools=tools, enable_thinking=True)
    assert out == "TOOLS:get_weather\nuser: hi\nassistant:<think>"
    with pytest.raises(ValueError, match="messages"):
        ChatTemplate("{{ raise_exception('no system role') }}").render([])


class _TemplateOnly:
    """What render_chat_prompt reads of a tokenizer: its template (no BOS or EOS)."""

    def __init__(self, source: str):
        self.chat_template = ChatTemplate(source)

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **kwargs):
        return self.chat_template.render(messages, add_generation_prompt, tools=tools, **kwargs)


CONTENT_ONLY = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
NO_SYSTEM_ROLE = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}"
                  "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("source, first_role", [(CONTENT_ONLY, "system"), (NO_SYSTEM_ROLE, "user")])
def test_a_template_that_ignores_tools_gets_them_in_the_prompt(source, first_role):
    tok = _TemplateOnly(source)
    assert not tok.chat_template.renders_tools
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = render_chat_prompt(tok, history, tools=WEATHER_TOOL)
    assert out.startswith(f"{first_role}: # Tools") and "- get_weather()" in out
    assert "<function=NAME>{JSON arguments}</function>" in out
    assert 'assistant: <function=get_weather>{"city": "Paris"}</function>\ntool: sunny' in out
    assert render_chat_prompt(tok, [{"role": "user", "content": "hi"}]) == "user: hi\n"  # no tools: as written


def test_a_template_that_renders_tools_is_used_as_it_is():
    tok = _TemplateOnly("{% if tools %}T:{{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
                        + CONTENT_ONLY)
    assert tok.chat_template.renders_tools
    assert render_chat_prompt(tok, [{"role": "user", "content": "hi"}], tools=WEATHER_TOOL) == "T:get_weather\nuser: hi\n"


def test_sentencepiece_bos_follows_add_bos_token(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of text" for i in range(300)), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=280,
                                   byte_fallback=True, character_coverage=1.0)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": False}))
    tok = Tokenizer(str(tmp_path))
    assert tok.encode("line 1", add_special_tokens=True) == tok.encode("line 1")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    tok = Tokenizer(str(tmp_path))
    assert tok.encode("line 1", add_special_tokens=True) == [tok.bos_token_id] + tok.encode("line 1")
