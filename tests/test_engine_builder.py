"""One engine builder (`build_engine`) and one chat-prompt renderer (`render_chat_prompt`), shared by
the server and the offline `LLM`: the same options fail the same way, and a conversation becomes the
same prompt on both paths."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from server_harness import QWEN2, TESTS_DIR, free_port, start_server

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.engine.llm import build_engine
from fastdeploy_lp.tokenizer.chat_template import render_chat_prompt

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def llm():
    return LLM(QWEN2, max_num_seqs=2, device="cpu", logits_processors=["LogitBiasLogitsProcessor"])


def test_llm_is_built_by_the_shared_builder_with_its_arguments(llm):
    engine = build_engine(EngineArgs(QWEN2, max_num_seqs=2, device="cpu", logits_processors=["LogitBiasLogitsProcessor"]))
    assert engine.pipeline.names == llm.engine.pipeline.names
    assert llm.fd_config is llm.engine.fd_config and llm.fd_config.max_num_seqs == 2


def test_an_unknown_guided_decoding_backend_fails_offline_and_at_server_start(llm):
    message = "guided_decoding_backend: unknown backend 'nope'; available: llguidance, off"
    with pytest.raises(ValueError, match=message):
        LLM(QWEN2, guided_decoding_backend="nope")
    env = dict(os.environ, PYTHONPATH=TESTS_DIR)
    out = subprocess.run([sys.executable, "-m", "fastdeploy_lp.entrypoints.openai.api_server", "--model", QWEN2,
                          "--port", str(free_port()), "--guided-decoding-backend", "nope"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and message in out.stderr


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"])
def test_reserved_chat_template_kwargs_are_refused_offline_as_online(llm, key):
    with pytest.raises(ValueError, match=f"chat_template_kwargs.{key}: "):
        llm.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False, chat_template_kwargs={key: "x"})


def test_a_template_that_fails_is_a_value_error_naming_messages(llm):
    with pytest.raises(ValueError, match="messages: the chat template"):
        render_chat_prompt(llm.tokenizer, [{"role": "user", "content": None}, {"role": None}])


def test_server_and_llm_render_the_same_prompt(llm):
    prompt = render_chat_prompt(llm.tokenizer, MESSAGES, chat_template_kwargs={"enable_thinking": False})
    offline = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                       chat_template_kwargs={"enable_thinking": False})[0]
    assert offline.prompt_token_ids == llm.tokenizer.encode(prompt, add_special_tokens=False)
    server = start_server()
    try:
        r = httpx.post(server.url("/v1/chat/completions"), timeout=60,
                       json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                             "chat_template_kwargs": {"enable_thinking": False}})
    finally:
        server.stop()
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
    assert r.json()["choices"][0]["message"]["content"] == offline.outputs.text
