"""The OpenAI-compatible server driven by the official `openai` SDK and `httpx`, against a real
uvicorn server on 127.0.0.1 (a fixture model, so it starts in seconds)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from fastdeploy_lp import LLM, SamplingParams
from server_harness import QWEN2, TEST_PROCESSORS, openai_client, serving

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    yield from serving("--max-num-seqs", "32", "--served-model-name", "tiny-qwen2",
                       "--logits-processors", "LogitBiasLogitsProcessor", *TEST_PROCESSORS, metrics_port=True)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, "EMPTY_API_KEY")


@pytest.fixture(scope="module")
def llm():
    return LLM(QWEN2, logits_processors=["LogitBiasLogitsProcessor"], max_num_seqs=4)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


def test_models_lists_the_served_name_and_default_is_accepted(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-qwen2"]
    out = client.chat.completions.create(model="default", messages=CHAT, max_tokens=2)
    assert out.model == "tiny-qwen2"


def test_chat_non_streaming_matches_offline_chat(client, llm):
    out = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=12, temperature=0)
    ref = llm.chat(CHAT, greedy(max_tokens=12), use_tqdm=False)[0]
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.outputs.text
    assert choice.finish_reason == ref.outputs.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_streaming_gives_role_first_then_content_then_finish_and_usage(client):
    full = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streaming_and_not_agree_with_offline_generate(client, llm):
    ref = llm.generate(PROMPT, greedy(max_tokens=10), use_tqdm=False)[0]
    out = client.completions.create(model="tiny-qwen2", prompt=PROMPT, max_tokens=10, temperature=0)
    assert out.object == "text_completion" and out.choices[0].text == ref.outputs.text
    assert out.usage.completion_tokens == len(ref.outputs.token_ids)
    chunks = list(client.completions.create(model="tiny-qwen2", prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.outputs.text
    assert chunks[-1].choices[0].finish_reason == ref.outputs.finish_reason


def test_completions_take_token_ids_and_batches_with_n(client, llm):
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=True)
    by_ids = client.completions.create(model="tiny-qwen2", prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model="tiny-qwen2", prompt=PROMPT, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="tiny-qwen2", prompt=[PROMPT, "Hello"], n=2, max_tokens=4, seed=3)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert 0 < batch.usage.completion_tokens <= 4 * 4
    assert batch.usage.prompt_tokens == len(ids) + len(llm.tokenizer.encode("Hello", add_special_tokens=True))


def test_echo_prepends_the_prompt(client):
    out = client.completions.create(model="tiny-qwen2", prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert out.choices[0].text.startswith(PROMPT)


def test_n2_gives_two_indexed_choices_streaming_and_not(client):
    out = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, n=2, max_tokens=8, temperature=1.0,
                                         seed=11)
    assert [c.index for c in out.choices] == [0, 1]
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(model="tiny-qwen2", messages=CHAT, n=2, max_tokens=8,
                                                temperature=1.0, seed=11, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in out.choices]  # same seed, same choices


def test_chat_logprobs_have_one_entry_per_token_with_sorted_alternatives(client):
    out = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.logprob == pytest.approx(values[0], abs=1e-5)  # greedy picks the most likely token
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    streamed = [e for c in client.chat.completions.create(
        model="tiny-qwen2", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True)
        if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_completion_logprobs(client):
    out = client.completions.create(model="tiny-qwen2", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


def test_logit_bias_in_extra_body_changes_output_exactly_as_offline(client, llm):
    plain = llm.generate(PROMPT, greedy(max_tokens=8), use_tqdm=False)[0]
    first = plain.outputs.token_ids[0]
    bias = {str(first): -100.0, "128": 6.0}
    ref = llm.generate(PROMPT, greedy(max_tokens=8, logits_processors_args={"logit_bias": bias}), use_tqdm=False)[0]
    assert ref.outputs.text != plain.outputs.text  # the bias matters for this prompt
    out = client.completions.create(model="tiny-qwen2", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"logits_processors_args": {"logit_bias": bias}})
    assert out.choices[0].text == ref.outputs.text
    chat_ref = llm.chat(CHAT, greedy(max_tokens=8, logits_processors_args={"logit_bias": bias}), use_tqdm=False)[0]
    chat = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=8, temperature=0,
                                          extra_body={"logits_processors_args": {"logit_bias": bias}})
    assert chat.choices[0].message.content == chat_ref.outputs.text


def test_openai_logit_bias_field_is_applied(client, llm):
    token = 300
    out = client.completions.create(model="tiny-qwen2", prompt=PROMPT, max_tokens=4, temperature=0,
                                    logit_bias={str(token): 100})
    assert out.choices[0].text == llm.tokenizer.decode([token] * 4)


def test_published_fastdeploy_curl_example(server, llm):
    """FastDeploy's docs: POST /v1/chat/completions with string token ids in logit_bias, no model field.

    Its token 50256 is outside the fixture's 1024-token vocabulary, so the body as published is a
    400 naming the id; the same body with an in-vocabulary id runs and matches the offline engine.
    """
    published = {"messages": [{"role": "user", "content": "Who is Lu Xun?"}],
                 "logits_processors_args": {"logit_bias": {"128": 5.0, "50256": -10.0}}}
    r = httpx.post(server.url("/v1/chat/completions"), content=json.dumps(published),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "50256" in err["message"] and "vocabulary" in err["message"]
    assert err["param"].startswith("logits_processors_args.logit_bias")

    body = {"messages": published["messages"], "max_tokens": 10, "temperature": 0,
            "logits_processors_args": {"logit_bias": {"128": 5.0, "1000": -10.0}}}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    ref = llm.chat(published["messages"], greedy(max_tokens=10, logits_processors_args=body["logits_processors_args"]),
                   use_tqdm=False)[0]
    assert r.json()["choices"][0]["message"]["content"] == ref.outputs.text


def test_custom_fqcn_processor_registered_by_flag(client, llm):
    out = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=5,
                                         extra_body={"logits_processors_args": {"force_token": 77}})
    assert out.choices[0].message.content == llm.tokenizer.decode([77] * 5)


def test_logits_processors_endpoint_lists_them_in_order_with_schemas(server):
    data = httpx.get(server.url("/v1/logits_processors"), timeout=10).json()["data"]
    names = [d["name"] for d in data if d["source"] == "--logits-processors"]
    assert names == ["LogitBiasLogitsProcessor", "ForceTokenLogitsProcessor", "SlowLogitsProcessor",
                     "FailingLogitsProcessor"]
    assert [d["position"] for d in data] == list(range(len(data)))
    force = next(d for d in data if d["name"] == "ForceTokenLogitsProcessor")
    assert force["class"] == "server_processors:ForceTokenLogitsProcessor"
    assert "force_token" in force["args_schema"]["properties"]


def test_a_failing_processor_fails_only_its_request(client):
    bad = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=4,
                                         extra_body={"logits_processors_args": {"fail": True}})
    assert bad.choices[0].finish_reason == "error"
    assert "asked to fail" in bad.choices[0].error["message"]
    chunks = list(client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=4, stream=True,
                                                 extra_body={"logits_processors_args": {"fail": True}}))
    last = chunks[-1].choices[0]
    assert last.finish_reason == "error" and "asked to fail" in last.error["message"]
    good = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=4)
    assert good.choices[0].finish_reason in ("stop", "length")


def test_unknown_top_level_fields_are_named_in_a_header(server):
    r = httpx.post(server.url("/v1/completions"), json={"prompt": PROMPT, "max_tokens": 2, "frobnicate": 1,
                                                          "best_effort": True}, timeout=30)
    assert r.status_code == 200
    assert r.headers["x-fastdeploy-lp-ignored-fields"] == "best_effort,frobnicate"
    r = httpx.post(server.url("/v1/completions"), json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
    assert "x-fastdeploy-lp-ignored-fields" not in r.headers


def test_health_metrics_and_metrics_port(server, client):
    assert httpx.get(server.url("/health"), timeout=5).json() == {"status": "ok"}
    client.completions.create(model="tiny-qwen2", prompt=PROMPT, max_tokens=3)
    for url in (server.url("/metrics"), f"http://127.0.0.1:{server.metrics_port}/metrics"):
        text = httpx.get(url, timeout=5).text
        for name in ("fastdeploy_lp:num_requests_running", "fastdeploy_lp:num_requests_waiting",
                     "fastdeploy_lp:time_to_first_token_seconds_bucket", "fastdeploy_lp:inter_token_latency_seconds_bucket",
                     "fastdeploy_lp:prompt_tokens_total", "fastdeploy_lp:generation_tokens_total",
                     'fastdeploy_lp:logits_processor_seconds_total{phase="apply",processor="LogitBiasLogitsProcessor"}'):
            assert name in text, name
    assert server.metric("fastdeploy_lp:generation_tokens_total") >= 3


def test_metrics_under_vllm_names_with_one_label_set_per_metric(server, client):
    """Autoscalers and routers query vLLM's names; a router merging replicas' scrapes needs each
    metric's label names fixed from the first scrape (sglang-router's /engine_metrics failed with
    "Label names should agree" when one replica had finished requests and the other had not)."""
    from prometheus_client.parser import text_string_to_metric_families
    client.completions.create(model="tiny-qwen2", prompt=PROMPT, max_tokens=2)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url("/metrics"), timeout=5).text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions"):
        [sample] = [s for s in families[name].samples if not s.name.endswith("_created")]
        assert sample.labels == {"model_name": "tiny-qwen2"}, name
    assert families["vllm:prefix_cache_queries"].samples[0].value == server.metric(
        "fastdeploy_lp:prefix_cache_queries_total")
    reasons = {s.labels["finish_reason"] for s in families["fastdeploy_lp:request_finished"].samples}
    assert reasons == {"stop", "length", "abort", "error"}  # at zero before any such finish
    for family in families.values():
        label_sets = {frozenset(set(s.labels) - {"le"}) for s in family.samples}
        assert len(label_sets) <= 1, (family.name, label_sets)


def _guided(server) -> bool:
    data = httpx.get(server.url("/v1/logits_processors"), timeout=10).json()["data"]
    return any(d["name"] == "GuidedDecodingLogitsProcessor" for d in data)


def test_response_format_regex_and_json_schema_through_the_sdk(server, client):
    if not _guided(server):
        pytest.skip("guided decoding is not available in this build")
    out = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=10, temperature=1.0, seed=5,
                                         response_format={"type": "regex", "regex": "(Paris|London)"})
    assert out.choices[0].message.content in ("Paris", "London")
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}, "ok": {"type": "boolean"}},
              "required": ["city", "ok"], "additionalProperties": False}
    for stream in (False, True):
        kwargs = dict(model="tiny-qwen2", messages=CHAT, max_tokens=40, temperature=0,
                      response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
                      extra_body={"guided_whitespace_pattern": " ?"})  # the random fixture model loves newlines
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                           if c.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        jsonschema.validate(json.loads(text), schema)


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "London"]}}, "required": ["city"],
    "additionalProperties": False}}}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_come_back_as_openai_tool_calls(server, client, tool_choice):
    if not _guided(server):
        pytest.skip("guided decoding is not available in this build")
    kwargs = dict(model="tiny-qwen2", messages=CHAT, max_tokens=40, temperature=0, tools=WEATHER,
                  tool_choice=tool_choice, extra_body={"guided_whitespace_pattern": " ?"})
    choice = client.chat.completions.create(**kwargs).choices[0]
    # a named choice is exactly one call; "required" lets the random model go on calling until max_tokens
    assert choice.finish_reason == ("tool_calls" if isinstance(tool_choice, dict) else choice.finish_reason)
    assert choice.finish_reason in ("tool_calls", "length")
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "London")
    streamed = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [tc for c in streamed if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    headers = [d for d in deltas if d.id]  # OpenAI's shape: a header per call, then argument pieces
    assert [(d.index, d.function.name, d.function.arguments) for d in headers][:1] == [(0, "get_weather", "")]
    assert "".join(d.function.arguments for d in deltas if d.index == 0 and not d.id) == call.function.arguments
    assert len(headers) >= len(choice.message.tool_calls)  # a call cut by max_tokens was streamed, not returned
    assert streamed[-1].choices[0].finish_reason == choice.finish_reason


def test_the_worker_protocol_request_routers_read(server, client):
    """sglang-router and vllm-router ask a replica what it serves and how loaded it is, and send
    `model: "unknown"` for a request that names none: served, not a 404 (tried with sglang-router
    0.3.2 in front of two replicas: it learns the name from these and forwards)."""
    for path in ("/get_model_info", "/model_info"):
        info = httpx.get(server.url(path), timeout=10).json()
        assert info["served_model_name"] == "tiny-qwen2" and info["is_generation"] is True
        assert info["model_path"] == QWEN2 and info["architectures"] == ["Qwen2ForCausalLM"]
    for path in ("/get_server_info", "/server_info"):
        info = httpx.get(server.url(path), timeout=10).json()
        assert info["max_running_requests"] == 32 and info["context_length"] > 0 and info["max_total_num_tokens"] > 0
    load = httpx.get(server.url("/get_load"), timeout=10).json()
    assert set(load) == {"num_reqs", "num_running_reqs", "num_waiting_reqs", "engines"} and load["num_reqs"] >= 0
    assert [e["engine"] for e in load["engines"]] == [0] and load["engines"][0]["num_requests_total"] >= 0
    answer = client.chat.completions.create(model="unknown", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert answer.model == "tiny-qwen2"


def test_render_answers_the_prompt_ids_and_params_generation_would_use(server, client):
    """vllm-router calls /render before it picks a replica; the ids are the ones generation counts."""
    chat = httpx.post(server.url("/v1/chat/completions/render"), timeout=30,
                      json={"messages": CHAT, "max_tokens": 5, "temperature": 0.5, "logits_processors_args": {"x": 1}})
    assert chat.status_code == 200, chat.text
    rendered = chat.json()
    answer = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=1)
    assert len(rendered["token_ids"]) == answer.usage.prompt_tokens and rendered["model"] == "tiny-qwen2"
    assert rendered["sampling_params"]["temperature"] == 0.5 and rendered["sampling_params"]["max_tokens"] == 5
    assert rendered["sampling_params"]["logits_processors_args"] == {"x": 1}
    tokens = httpx.post(server.url("/tokenize"), json={"messages": CHAT}, timeout=30).json()["tokens"]
    assert rendered["token_ids"] == tokens
    batch = httpx.post(server.url("/v1/completions/render"), json={"prompt": [PROMPT, "Hi"]}, timeout=30).json()
    assert [r["token_ids"] for r in batch] == [httpx.post(server.url("/tokenize"), json={"prompt": p},
                                                          timeout=30).json()["tokens"] for p in (PROMPT, "Hi")]
    ids = httpx.post(server.url("/v1/completions/render"), json={"prompt": [[5, 6, 7], [8]]}, timeout=30).json()
    assert [r["token_ids"] for r in ids] == [[5, 6, 7], [8]]
    for path, body in (("/v1/responses/render", {"input": CHAT}), ("/v1/messages/render",
                                                                    {"messages": CHAT, "max_tokens": 5,
                                                                     "model": "tiny-qwen2"})):
        r = httpx.post(server.url(path), json=body, timeout=30)
        assert r.status_code == 200 and r.json()["token_ids"] == tokens, (path, r.text)
    bad = httpx.post(server.url("/v1/chat/completions/render"), json={"messages": CHAT, "guided_regex": "(",
                                                                        "model": "nope"}, timeout=30)
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "model"


def test_continue_final_message_ends_the_prompt_inside_the_assistant_turn(server):
    partial = [*CHAT, {"role": "assistant", "content": "The capital is"}]
    open_turn = httpx.post(server.url("/v1/chat/completions/render"), timeout=30, json={
        "messages": partial, "add_generation_prompt": False, "continue_final_message": True}).json()["token_ids"]
    closed = httpx.post(server.url("/tokenize"), json={"messages": partial, "add_generation_prompt": False},
                        timeout=30).json()["tokens"]
    assert len(open_turn) < len(closed) and closed[:len(open_turn)] == open_turn  # the end-of-turn is cut
    text = httpx.post(server.url("/detokenize"), json={"tokens": open_turn}, timeout=30).json()["prompt"]
    assert text.endswith("The capital is")


@pytest.mark.parametrize("field,value,pattern", [("regex", "[ab]{3,6}", r"[ab]{3,6}"),
                                                 ("ebnf", 'root ::= "yes" | "no"', r"yes|no")])
def test_sglang_constraint_fields_constrain(client, field, value, pattern):
    """SGLang's `regex` and `ebnf` are what survive sglang-router's rebuilt body: never ignored."""
    import re
    out = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=8, extra_body={field: value})
    assert re.fullmatch(pattern, out.choices[0].message.content), out.choices[0].message.content
