"""POST /tokenize and /detokenize (vLLM's shape) against a real server: the count is what the
generation endpoints count, ids read back to the text, and bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from fastdeploy_lp.tokenizer.tokenizer import Tokenizer
from server_harness import QWEN2, start_server

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def http():
    """A client of the one server this module starts."""
    server = start_server("--max-num-seqs", "4", "--served-model-name", "tiny-qwen2", "--max-model-len", "512")
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            yield client
    finally:
        server.stop()


def test_chat_count_equals_the_prompt_tokens_of_the_same_chat_request(http):
    for extra in ({}, {"tools": TOOLS}):
        counted = http.post("/tokenize", json={"model": "tiny-qwen2", "messages": CHAT, **extra}).json()
        chat = http.post("/v1/chat/completions", json={"model": "tiny-qwen2", "messages": CHAT, "max_tokens": 1,
                                                       **extra}).json()
        assert counted["count"] == chat["usage"]["prompt_tokens"] == len(counted["tokens"])
        assert counted["max_model_len"] == 512


def test_prompt_count_equals_the_prompt_tokens_of_the_same_completion_request(http):
    counted = http.post("/tokenize", json={"model": "tiny-qwen2", "prompt": "The capital of France is"}).json()
    done = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 1}).json()
    assert counted["count"] == done["usage"]["prompt_tokens"]
    assert counted["tokens"] == Tokenizer(QWEN2).encode("The capital of France is", add_special_tokens=True)


def test_detokenize_reads_tokenized_text_back(http):
    text = "Grüße, 世界! <|im_end|>"
    tokens = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert http.post("/detokenize", json={"model": "tiny-qwen2", "tokens": tokens}).json() == {"prompt": text}


def test_a_rendered_chat_reads_back_with_its_special_tokens(http):
    without = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    with_prompt = http.post("/tokenize", json={"messages": CHAT}).json()
    assert with_prompt["tokens"][:without["count"]] == without["tokens"]
    text = http.post("/detokenize", json={"tokens": with_prompt["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_token_strs_are_the_vocabulary_entries(http):
    out = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert len(out["token_strs"]) == out["count"] and out["token_strs"][-1] == "Ġworld"


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [1, 2, 10 ** 9]}, "tokens[2]"),
    ("/detokenize", {"tokens": [5, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [5, "6"]}, "tokens[1]"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": "a", "tools": TOOLS}, "tools"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
])
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(param)


def test_an_unknown_model_is_a_404(http):
    r = http.post("/tokenize", json={"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_openapi_documents_both_bodies(http):
    paths = http.get("/openapi.json").json()["paths"]
    body = paths["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "messages", "add_special_tokens"} <= set(body["properties"])
    assert "$ref" not in str(body)
    detokenize = paths["/detokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "tokens" in detokenize["properties"]
