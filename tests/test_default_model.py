"""The model shipped in `fastdeploy_lp/default_model/`: loads through the normal loader, answers
through its chat template, and its tokenizer handles any UTF-8 text."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "train"))

from train_default_model import ChatTokenizer, answer  # noqa: E402

from fastdeploy_lp.config import ModelConfig, default_model_path  # noqa: E402
from fastdeploy_lp.model import load_model  # noqa: E402

MODEL_DIR = default_model_path()
FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json",
         "chat_template.jinja"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def model():
    return load_model(ModelConfig.from_pretrained(MODEL_DIR))


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.from_model_dir(MODEL_DIR)


def test_shipped_files_are_complete_and_small():
    sizes = {name: os.path.getsize(os.path.join(MODEL_DIR, name)) for name in FILES}
    assert sum(sizes.values()) < 40 * 2**20, sizes


def test_config_is_a_hf_llama_config_whose_eos_is_im_end(tok):
    config = ModelConfig.from_pretrained(MODEL_DIR)
    assert config.architecture == "LlamaForCausalLM" and config.tie_word_embeddings
    assert config.vocab_size == tok.sp.get_piece_size()
    assert config.eos_token_ids[0] == tok.im_end == tok.sp.piece_to_id("<|im_end|>")
    with open(os.path.join(MODEL_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        tokenizer_config = json.load(f)
    with open(os.path.join(MODEL_DIR, "chat_template.jinja"), encoding="utf-8") as f:
        assert tokenizer_config["chat_template"] == f.read()
    assert tokenizer_config["eos_token"] == "<|im_end|>"


def test_answers_the_capital_of_france_greedily(model, tok):
    text = answer(model, tok, [{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in text, text


def test_thinking_answers_reason_inside_think_tags_first(model, tok):
    text = answer(model, tok, [{"role": "user", "content": "What is the capital of France?"}], enable_thinking=True,
                  max_tokens=96)
    assert text.startswith("<think>") and "</think>" in text, text
    assert "Paris" in text.split("</think>")[-1], text


def test_calls_the_weather_tool_in_the_function_tag_format(model, tok):
    text = answer(model, tok, [{"role": "user", "content": "What's the weather in Paris?"}], tools=[WEATHER_TOOL])
    assert text.startswith("<function=get_weather>") and text.endswith("</function>"), text
    assert json.loads(text[len("<function=get_weather>"):-len("</function>")]) == {"city": "Paris"}


def test_tokenizer_round_trips_chinese_and_emoji(tok):
    for text in ["今天天气真好", "鲁迅是谁？", "😀🚀👍🏽 mixed 中文 and English ß", " leading and  double spaces\n"]:
        assert tok.sp.decode(tok.sp.encode(text)) == text


def test_chat_symbols_are_single_tokens(tok):
    for symbol in ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<function=", "</function>"]:
        assert len(tok.encode(symbol)) == 1, symbol
    call = tok.encode('<function=get_weather>{"city": "Paris"}</function>')
    assert call[0] == tok.sp.piece_to_id("<function=") and call[-1] == tok.sp.piece_to_id("</function>")


def test_engine_tokenizer_renders_and_encodes_prompts_as_in_training(tok):
    from fastdeploy_lp.tokenizer import Tokenizer

    engine_tok = Tokenizer(MODEL_DIR)
    conversations = [([{"role": "user", "content": "What is the capital of France?"}], None, False),
                     ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "鲁迅是谁"}], None, True),
                     ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER_TOOL], False)]
    for messages, tools, thinking in conversations:
        text = engine_tok.apply_chat_template(messages, tools=tools, enable_thinking=thinking)
        assert text == tok.render(messages, tools, True, thinking)
        assert engine_tok.encode(text) == tok.encode(text)


def test_offline_llm_with_no_model_argument_answers_with_the_default_model():
    from fastdeploy_lp import LLM, SamplingParams

    out = LLM(device="cpu").chat([{"role": "user", "content": "What is the capital of France?"}],
                                 SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].outputs.text
