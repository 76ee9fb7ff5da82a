"""Prompt logprobs (issue 39 item 3): `SamplingParams(prompt_logprobs=k)` offline, `prompt_logprobs`
in the request body, and `echo` with `logprobs` on /v1/completions (lm-evaluation-harness's
loglikelihood request), computed in the prefill pass.

References are computed independently: the `transformers` float32 logits of every prompt position
shipped with the fixtures (log-softmaxed here in float64), and the engine's own plain full forward
of the prompt (`full_logits`). Chunked prefill and prefix-cache hits must give what an unchunked,
uncached prefill gives."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import numpy as np
import paddle
import pytest
from conftest import fixture_dir, load_reference
from gguf_files import float_weights
from safetensors.numpy import save_file

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.engine.prompt_logprobs import log_softmax
from server_harness import openai_client, serving, start_server


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def _check_against(entries, ids: list[int], ref: np.ndarray, k: int, atol: float) -> None:
    """`entries` (one per prompt token) against the log-softmax `ref` of the prompt's logits."""
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        row, lp = ref[p - 1], entries[p]
        assert lp.token_id == ids[p]
        assert abs(lp.logprob - row[ids[p]]) < atol
        assert lp.rank == 1 + int((row > row[ids[p]] + atol).sum())  # ties within atol: no fixture has any
        best = np.argsort(-row, kind="stable")[:k]
        assert sorted(lp.top) == sorted(best.tolist())
        np.testing.assert_allclose([lp.top[t] for t in best], row[best], atol=atol)


@pytest.fixture(scope="module")
def qwen2():
    inputs, ref = load_reference("qwen2")
    return inputs, ref, LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu")


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_offline_prompt_logprobs_match_transformers_at_every_position(name):
    inputs, ref = load_reference(name)
    llm = LLM(fixture_dir(name), max_num_seqs=4, device="cpu")
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4), use_tqdm=False)
    for i, (ids, out) in enumerate(zip(inputs, outs)):
        _check_against(out.prompt_logprobs, ids, _log_softmax(ref[f"logits_{i}"]), 4, 1e-4)
        assert out.outputs.token_ids == ref[f"greedy_{i}"].tolist()[:3]  # generation is unchanged


def _plain(llm, ids) -> np.ndarray:
    """The engine's model run once over the whole prompt (no cache, no engine)."""
    return _log_softmax(llm.engine.runner.model.full_logits(ids).numpy())


def _long_prompt(inputs) -> list[int]:
    return (inputs[1] * 5)[:37]  # 37 tokens: several blocks and chunks at odd sizes


def test_zero_alternatives_and_requests_without_prompt_logprobs(qwen2):
    inputs, _, llm = qwen2
    ids = _long_prompt(inputs)
    asked, plain = llm.generate([ids, ids], [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
                                             SamplingParams(temperature=0, max_tokens=2)], use_tqdm=False)
    assert plain.prompt_logprobs is None
    assert all(lp.top == {} for lp in asked.prompt_logprobs[1:])
    assert asked.outputs.token_ids == plain.outputs.token_ids
    _check_against(asked.prompt_logprobs, ids, _plain(llm, ids), 0, 1e-5)


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 5, "block_size": 4},    # the prompt in 8 chunks, none on a block edge
    {"max_num_batched_tokens": 16, "block_size": 16},
    {"max_num_batched_tokens": 3, "block_size": 2, "enable_prefix_caching": False},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_chunked_prefill_gives_the_values_of_one_plain_prefill(qwen2, options):
    inputs, _, plain_llm = qwen2
    ids = _long_prompt(inputs)
    llm = LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu", **options)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
    # with a short prompt beside it, so the chunks share steps with other requests' rows
    chunked, short = llm.generate([ids, inputs[0]], params, use_tqdm=False)
    whole = plain_llm.generate([ids], params, use_tqdm=False)[0]
    _check_against(chunked.prompt_logprobs, ids, _plain(plain_llm, ids), 3, 1e-5)
    _check_against(short.prompt_logprobs, inputs[0], _plain(plain_llm, inputs[0]), 3, 1e-5)
    for a, b in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert a.rank == b.rank and a.top.keys() == b.top.keys() and abs(a.logprob - b.logprob) < 1e-5
    assert chunked.outputs.token_ids == whole.outputs.token_ids


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(qwen2):
    inputs, _, _ = qwen2
    ids = _long_prompt(inputs)
    llm = LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu", block_size=4)
    first = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    stats = llm.engine.block_pool.stats
    hits = stats.hit_tokens
    again = llm.generate([ids + [5, 6]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                         use_tqdm=False)[0]
    assert stats.hit_tokens == hits  # the cached blocks were there; the request computed its whole prompt
    _check_against(again.prompt_logprobs, ids + [5, 6], _plain(llm, ids + [5, 6]), 2, 1e-5)
    later = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert stats.hit_tokens > hits and later.outputs.token_ids == first.outputs.token_ids  # others still hit


def test_preempted_prompt_keeps_one_entry_per_token(qwen2):
    """A pool too small for both requests preempts one mid-way; its entries are neither lost nor doubled."""
    inputs, _, plain_llm = qwen2
    ids = _long_prompt(inputs)
    llm = LLM(fixture_dir("qwen2"), max_num_seqs=2, device="cpu", block_size=4, num_blocks=16,
              max_num_batched_tokens=8)
    outs = llm.generate([ids, ids[::-1]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                         prompt_logprobs=1), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for ids_, out in zip([ids, ids[::-1]], outs):
        _check_against(out.prompt_logprobs, ids_, _plain(plain_llm, ids_), 1, 1e-5)


def test_tensor_parallel_ranks_return_the_prompt_rows_too(qwen2):
    """The rows pass the ranks' pipe (more rows than the shared logits buffer's max_num_seqs)."""
    inputs, _, plain_llm = qwen2
    ids = _long_prompt(inputs)
    llm = LLM(fixture_dir("qwen2"), max_num_seqs=2, device="cpu", tensor_parallel_size=2, max_num_batched_tokens=9)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    outs = llm.generate([ids, inputs[0]], params, use_tqdm=False)
    for prompt, out in zip([ids, inputs[0]], outs):
        _check_against(out.prompt_logprobs, prompt, _plain(plain_llm, prompt), 2, 1e-5)


def test_speculative_decoding_keeps_prompt_rows_apart_from_draft_rows(qwen2):
    """A repetitive prompt gets n-gram drafts: prompt logprobs and the generated tokens are those of
    plain decoding."""
    inputs, _, plain_llm = qwen2
    ids = inputs[1] * 4
    llm = LLM(fixture_dir("qwen2"), max_num_seqs=2, device="cpu",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    out = llm.generate([ids], params, use_tqdm=False)[0]
    _check_against(out.prompt_logprobs, ids, _plain(plain_llm, ids), 2, 1e-5)
    assert out.outputs.token_ids == plain_llm.generate([ids], params, use_tqdm=False)[0].outputs.token_ids
    assert llm.engine.speculative_stats()["drafted_tokens"] > 0


def test_bad_values_name_the_field():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_log_softmax_of_a_wide_row_is_exact_to_the_float32_rounding():
    """Paddle's float32 `logsumexp` on CPU adds a row one term after another: over 151,936 tokens it
    left every value too high by ~2e-4. `log_softmax` sums in float64."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((4, 151936)) * 3).astype(np.float32)
    logits[:, 7] += 12  # peaked, as a model's rows are
    error = log_softmax(paddle.to_tensor(logits)).numpy() - _log_softmax(logits)
    assert np.abs(error).max() < 5e-6 and abs(error.mean()) < 1e-7


# -- the server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    yield from serving("--max-num-seqs", "8", "--served-model-name", "tiny-qwen2", "--max-num-batched-tokens", "7",
                       "--block-size", "4")


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, "EMPTY_API_KEY")


def test_lm_eval_request_echo_logprobs_max_tokens_0(client, qwen2):
    """What lm-evaluation-harness's local-completions sends to score a continuation."""
    inputs, _, llm = qwen2
    ids = _long_prompt(inputs)
    out = client.completions.create(model="tiny-qwen2", prompt=ids, echo=True, logprobs=2, max_tokens=0,
                                    temperature=0)
    choice, ref = out.choices[0], _plain(llm, ids)
    lp = choice.logprobs
    assert choice.text == llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], ref[np.arange(len(ids) - 1), ids[1:]], atol=1e-5)
    for p in range(1, len(ids)):
        assert lp.tokens[p] in lp.top_logprobs[p] and 2 <= len(lp.top_logprobs[p]) <= 3  # the token itself too
    assert lp.text_offset == sorted(lp.text_offset)
    # vLLM's field beside it: token id -> {logprob, rank, decoded_token}
    vllm = choice.model_extra["prompt_logprobs"]
    assert vllm[0] is None and vllm[1][str(ids[1])]["logprob"] == lp.token_logprobs[1]
    assert {e["rank"] for e in vllm[1].values()} >= {1, 2}


def test_lm_eval_local_completions_batch_scores_as_a_plain_forward(client, qwen2):
    """lm-evaluation-harness's loglikelihood payload (max_tokens 1, logprobs 1, echo, a batch of
    token-id prompts) read the way its `parse_logprobs` reads it: the continuation's values are
    `token_logprobs[ctxlen:-1]` (the last entry is the generated token) and it is greedy when each
    value is the largest of its `top_logprobs`."""
    inputs, _, llm = qwen2
    contexts = [_long_prompt(inputs)[:20], inputs[1]]
    greedy_tokens = llm.generate([inputs[1]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                 use_tqdm=False)[0].outputs.token_ids
    continuations = [_long_prompt(inputs)[20:26], list(greedy_tokens)]  # the second is the model's greedy one
    prompts = [c + x for c, x in zip(contexts, continuations)]
    out = client.completions.create(model="tiny-qwen2", prompt=prompts, temperature=0, max_tokens=1, logprobs=1,
                                    seed=1234, echo=True)
    for choice, ctx, ids in zip(sorted(out.choices, key=lambda c: c.index), contexts, prompts):
        values = choice.logprobs.token_logprobs[len(ctx):-1]
        tops = choice.logprobs.top_logprobs[len(ctx):-1]
        ref = _plain(llm, ids)
        expected = ref[np.arange(len(ctx) - 1, len(ids) - 1), ids[len(ctx):]]
        assert len(values) == len(ids) - len(ctx)
        assert abs(sum(values) - expected.sum()) < 1e-4
        greedy = all(v == max(top.values()) for v, top in zip(values, tops))
        assert greedy == all(ref[p - 1].argmax() == ids[p] for p in range(len(ctx), len(ids)))
        assert greedy == (ctx is contexts[1])


def test_echo_logprobs_then_generated_tokens_streaming_and_not_with_n_and_batches(client, qwen2):
    inputs, _, llm = qwen2
    prompts = [_long_prompt(inputs), inputs[1]]
    out = client.completions.create(model="tiny-qwen2", prompt=prompts, echo=True, logprobs=1, max_tokens=3,
                                    temperature=0, n=2)
    assert len(out.choices) == 4
    for choice in out.choices:
        ids = prompts[choice.index // 2]
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], _plain(llm, ids)[np.arange(len(ids) - 1), ids[1:]],
                                   atol=1e-5)
        assert all(v is not None for v in lp.token_logprobs[len(ids):])
    streamed: dict[int, list] = {}
    for c in client.completions.create(model="tiny-qwen2", prompt=prompts, echo=True, logprobs=1, max_tokens=3,
                                       temperature=0, n=2, stream=True):
        for ch in c.choices:
            if ch.logprobs is not None:
                streamed.setdefault(ch.index, []).extend(ch.logprobs.token_logprobs)
    for choice in out.choices:
        np.testing.assert_allclose([np.nan if v is None else v for v in streamed[choice.index]],
                                   [np.nan if v is None else v for v in choice.logprobs.token_logprobs], atol=1e-6)


def test_streamed_echo_with_max_tokens_0_is_the_prompt_alone(client, server, qwen2):
    inputs, _, llm = qwen2
    ids = inputs[1]
    chunks = list(client.completions.create(model="tiny-qwen2", prompt=ids, echo=True, logprobs=0, max_tokens=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.text for c in chunks for ch in c.choices)
    assert text == llm.tokenizer.decode(ids, skip_special_tokens=False)
    finals = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finals == ["length"] and chunks[-1].usage.completion_tokens == 0
    values = [v for c in chunks for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert len(values) == len(ids) and values[0] is None


def test_prompt_logprobs_field_on_completions_and_chat(server, qwen2):
    inputs, _, llm = qwen2
    ids = inputs[1]
    r = httpx.post(server.url("/v1/completions"), json={"prompt": ids, "max_tokens": 2, "temperature": 0,
                                                        "prompt_logprobs": 2}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None and choice["prompt_logprobs"][0] is None
    ref = _plain(llm, ids)
    for p in range(1, len(ids)):
        entry = choice["prompt_logprobs"][p]
        assert abs(entry[str(ids[p])]["logprob"] - ref[p - 1, ids[p]]) < 1e-5
        assert sorted(e["rank"] for t, e in entry.items() if t != str(ids[p]) or e["rank"] <= 2)[:2] == [1, 2]
    r = httpx.post(server.url("/v1/chat/completions"), json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 1}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(e) in (1, 2) for e in body["prompt_logprobs"][1:])  # the token, and its one alternative


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 21},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}, "max_tokens"),
])
def test_bad_values_are_a_400_naming_the_field(server, path, body, field):
    r = httpx.post(server.url(path), json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]



@pytest.fixture(scope="module")
def wide_vocab(tmp_path_factory):
    """The qwen2 fixture in float32 with its vocabulary widened to 65,536 (random rows past the
    tokenizer's 1,024): each softmax sums 65,536 terms, spread as a real model's logits are (a few
    large, a long tail: std ~4 here), the tail's terms far below the running sum. Served, and
    loaded here for the reference."""
    out = tmp_path_factory.mktemp("wide-vocab")
    weights = float_weights(fixture_dir("qwen2"))
    embed = weights["model.embed_tokens.weight"]
    extra = np.random.default_rng(0).standard_normal((65536 - len(embed), embed.shape[1])) * embed.std() * 10
    weights["model.embed_tokens.weight"] = np.concatenate([embed, extra.astype(np.float32)])  # tied: the head too
    save_file(weights, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(fixture_dir("qwen2"), name), out)
    with open(os.path.join(fixture_dir("qwen2"), "config.json")) as f:
        config = {**json.load(f), "vocab_size": 65536, "dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config))
    server = start_server("--max-num-seqs", "4", "--served-model-name", "wide", model=str(out))
    try:
        yield server, LLM(str(out), max_num_seqs=1, device="cpu")
    finally:
        server.stop()


def test_lm_eval_scores_over_a_wide_vocabulary_are_those_of_an_exact_log_softmax(wide_vocab, qwen2):
    """lm-evaluation-harness's loglikelihood request (a batch of token-id prompts, `echo`, `logprobs: 1`,
    `max_tokens: 1`) over 65,536 tokens: each prompt token's value within 1e-5 of the float64
    log-softmax of the engine's own logits, each prompt's sum within 1e-4, as lm-eval sums it.
    A float32 logsumexp, adding the tail's terms one by one to a sum they are far below, lost
    them: every value too high, here by up to 1e-4 and 3e-3 over the longest prompt."""
    server, llm = wide_vocab
    inputs = qwen2[0]
    prompts = [_long_prompt(inputs), inputs[0], inputs[1]]
    out = openai_client(server).completions.create(model="wide", prompt=prompts, echo=True, logprobs=1,
                                                   max_tokens=1, temperature=0, seed=1234)
    assert len(out.choices) == len(prompts)
    for choice in out.choices:
        ids = prompts[choice.index]
        exact = _plain(llm, ids)[np.arange(len(ids) - 1), ids[1:]]
        values = np.array(choice.logprobs.token_logprobs[1:len(ids)])
        assert np.abs(values - exact).max() < 1e-5
        assert abs(values.sum() - exact.sum()) < 1e-4
