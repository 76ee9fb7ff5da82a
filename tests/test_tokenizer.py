"""Tokenizers, chat templates and incremental detokenization against the `transformers` reference."""

from __future__ import annotations

import json
import os

import pytest
from conftest import FIXTURES, fixture_dir

from fastdeploy_lp.tokenizer import ChatTemplate, IncrementalDetokenizer, Tokenizer


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
