"""The paged KV cache: block pool bookkeeping, and outputs that do not depend on how the cache is
cut up (block size, prefix caching, chunked prefill, preemption) — checked against the
`transformers` references of the fixtures and against runs without the feature."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import fixture_dir, load_reference

from fastdeploy_lp import LLM, GuidedDecodingParams, SamplingParams
from fastdeploy_lp.engine.kv_cache import NULL_BLOCK, BlockPool, block_hashes

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


# -- the pool ----------------------------------------------------------------------------------------
def test_pool_allocates_low_blocks_first_and_never_the_null_block():
    pool = BlockPool(5, block_size=4, enable_prefix_caching=True)
    assert pool.allocate(4) == [1, 2, 3, 4]
    assert pool.allocate(1) is None
    assert pool.num_free == 0 and NULL_BLOCK not in pool.fresh


def test_released_cached_blocks_stay_findable_until_evicted_least_recently_used_first():
    pool = BlockPool(4, block_size=2, enable_prefix_caching=True)
    a, b = block_hashes([1, 2, 3, 4], 2)
    first = pool.allocate(2)
    pool.register(first[0], a)
    pool.register(first[1], b)
    pool.release(first)
    assert pool.num_free == 3 and pool.refcounts.sum() == 0
    assert pool.lookup([a, b], max_blocks=2) == first      # a later request shares them
    assert list(pool.refcounts[first]) == [1, 1]
    pool.release(first)
    pool.allocate(2)                                        # the free block, then the LRU cached one: b's (tail first)
    assert pool.lookup([a, b], max_blocks=2) == [first[0]]


def test_block_hashes_chain_over_the_whole_prefix():
    one = block_hashes([1, 2, 3, 4, 5], 2)
    assert len(one) == 2                                    # the partial block [5] has none
    assert block_hashes([9, 2, 3, 4], 2)[1] != one[1]       # same block, different prefix
    assert block_hashes([1, 2, 3, 4], 2, parent=b"", start=0) == one


# -- outputs that must not change --------------------------------------------------------------------
def _greedy_outputs(llm, inputs):
    return [o.outputs.token_ids for o in llm.generate(inputs, GREEDY, use_tqdm=False)]


def _expected(ref, n):
    return [ref[f"greedy_{i}"].tolist() for i in range(n)]


@pytest.mark.parametrize("options", [
    {"block_size": 1},
    {"block_size": 3, "enable_prefix_caching": False},
    {"block_size": 2, "max_num_batched_tokens": 3},                       # prompts split at odd sizes
    {"block_size": 5, "max_num_batched_tokens": 7, "enable_prefix_caching": False},
    {"block_size": 2, "enable_chunked_prefill": False, "max_num_batched_tokens": 4},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_greedy_matches_transformers_however_the_cache_is_cut(options):
    inputs, ref = load_reference("qwen2")
    llm = LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu", **options)
    assert _greedy_outputs(llm, inputs) == _expected(ref, len(inputs))
    assert _greedy_outputs(llm, inputs) == _expected(ref, len(inputs))    # again, from the prefix cache
    _assert_no_block_held(llm)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_prefix_cache_hits_and_outputs_equal_with_caching_off(name):
    inputs, ref = load_reference(name)
    shared = inputs[1] * 3                                   # a long shared prefix, then each prompt
    prompts = [shared + ids for ids in inputs]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for caching in (True, False):
        llm = LLM(fixture_dir(name), max_num_seqs=2, device="cpu", block_size=4, enable_prefix_caching=caching)
        outputs[caching] = [o.outputs.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.block_pool.stats
        assert (stats.hit_tokens > 0) == caching
        _assert_no_block_held(llm)
    assert outputs[True] == outputs[False]


def test_preemption_keeps_greedy_and_seeded_outputs():
    inputs, ref = load_reference("qwen2")
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(inputs))]
    roomy = LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu", block_size=2)
    expected_seeded = [o.outputs.token_ids for o in roomy.generate(inputs, seeded, use_tqdm=False)]
    # 4 requests of up to 8 + 24 tokens in 2-token blocks need up to 64 blocks; 17 force preemptions.
    tight = LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu", block_size=2, num_blocks=17)
    assert _greedy_outputs(tight, inputs) == _expected(ref, len(inputs))
    assert [o.outputs.token_ids for o in tight.generate(inputs, seeded, use_tqdm=False)] == expected_seeded
    assert tight.engine.scheduler.num_preemptions > 0
    _assert_no_block_held(tight)


@pytest.mark.parametrize("fast_forward", [True, False])
def test_guided_decoding_and_penalties_survive_preemption(fast_forward):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    params = [SamplingParams(temperature=0.8, seed=3 + i, max_tokens=40, repetition_penalty=1.3,
                             guided_decoding=GuidedDecodingParams(json=schema)) for i in range(4)]
    prompts = ["Give me a person as JSON:"] * 4
    roomy = LLM(max_num_seqs=4, device="cpu", block_size=4, fast_forward=fast_forward)
    tight = LLM(max_num_seqs=4, device="cpu", block_size=4, num_blocks=16 if fast_forward else 20,
                fast_forward=fast_forward)
    expected = [o.outputs.text for o in roomy.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs.text for o in tight.generate(prompts, params, use_tqdm=False)] == expected
    assert tight.engine.scheduler.num_preemptions > 0
    _assert_no_block_held(tight)


def test_a_long_prompt_joins_in_chunks_while_others_decode():
    llm = LLM(max_num_seqs=4, device="cpu", block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), "short")
    engine.step()
    long_prompt = list(range(5, 5 + 100))
    engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), "long")
    short_tokens, steps = [], 0
    while not any(o.request_id == "long" and o.outputs.token_ids for o in engine.step() or []):
        steps += 1
        short = engine.scheduler.slots[0]
        short_tokens.append(len(short.output_ids))
    # 100 prompt tokens at <= 15 a step (one of 16 goes to the running request): >= 7 steps, and
    # the running request got a token in every one of them.
    assert steps >= 6
    assert short_tokens == list(range(short_tokens[0], short_tokens[0] + len(short_tokens)))
    alone = LLM(max_num_seqs=1, device="cpu").generate([long_prompt], SamplingParams(temperature=0, max_tokens=3,
                                                                                   ignore_eos=True), use_tqdm=False)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "long" and out.finished:
                assert list(out.outputs.token_ids) == list(alone[0].outputs.token_ids)


def test_blocks_return_to_the_pool_after_aborts_and_errors():
    llm = LLM(fixture_dir("qwen3"), max_num_seqs=4, device="cpu", block_size=2, max_num_batched_tokens=8,
              logits_processors=["custom_processors:RaisingLogitsProcessor"])
    engine = llm.engine
    cannot_store = SamplingParams(max_tokens=5)
    cannot_store.top_k = 2**70  # fails at admission, past SamplingParams' own check
    engine.add_request(list(range(5, 45)), SamplingParams(max_tokens=50), "aborted-in-prefill")
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=50), "aborted-decoding")
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, logits_processors_args={"raise_in": "apply"}), "raises")
    engine.add_request([8, 9], cannot_store, "cannot-store")
    finish = {}
    for _ in range(3):
        finish.update({o.request_id: o.outputs.finish_reason for o in engine.step() if o.finished})
    engine.abort_request("aborted-in-prefill")
    engine.abort_request("aborted-decoding")
    while engine.has_unfinished_requests():
        finish.update({o.request_id: o.outputs.finish_reason for o in engine.step() if o.finished})
    assert finish == {"aborted-in-prefill": "abort", "aborted-decoding": "abort", "raises": "error",
                      "cannot-store": "error"}
    _assert_no_block_held(llm)


def test_requests_larger_than_the_pool_are_refused():
    llm = LLM(max_num_seqs=2, device="cpu", block_size=4, num_blocks=5)     # 16 tokens
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate(["x" * 40], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["hi"], SamplingParams(max_tokens=20), use_tqdm=False)
    assert llm.generate(["hi"], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs.token_ids


def test_full_context_with_many_slots_reserves_memory_by_use():
    """max_model_len at the model's whole context and 64 slots: the pool is sized by memory, not by
    64 x max_model_len, and the engine serves."""
    llm = LLM(fixture_dir("qwen2"), max_model_len=512, max_num_seqs=64, device="cpu", kv_cache_memory=0.001)
    pool = llm.engine.block_pool
    assert pool.capacity_tokens < 64 * 512 // 10
    outs = llm.generate([[5, 6, 7]] * 64, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs.token_ids) == 3 for o in outs)
    _assert_no_block_held(llm)


def _assert_no_block_held(llm):
    pool = llm.engine.block_pool
    assert not llm.engine.has_unfinished_requests()
    assert pool.refcounts.sum() == 0 and pool.num_used == 0, np.flatnonzero(pool.refcounts)


# -- through the server ------------------------------------------------------------------------------
def test_server_refuses_what_the_pool_cannot_hold_and_reports_the_cache():
    import httpx
    import openai
    from server_harness import start_server

    server = start_server("--max-num-seqs", "2", "--block-size", "4", "--num-blocks", "40")
    try:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="none")
        model = client.models.list().data[0].id
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt=list(range(5, 205)), max_tokens=2)
        assert e.value.body["param"] == "prompt" and "KV cache" in e.value.body["message"]
        prompt = list(range(5, 45))  # 10 full blocks
        first = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        again = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        assert first.choices[0].text == again.choices[0].text
        assert server.metric("fastdeploy_lp:prefix_cache_hits_total") >= 36  # the second prompt, but its last block
        assert server.metric("fastdeploy_lp:kv_cache_blocks_total") == 39
        assert server.metric("fastdeploy_lp:kv_cache_blocks_in_use") == 0
        assert httpx.get(server.url("/health")).status_code == 200
    finally:
        server.stop()


def test_prompts_that_fill_the_pool_between_them_do_not_wait_for_each_other():
    """Two long prompts in small chunks, each needing most of the pool: the later one is preempted
    so the earlier can finish its prompt, instead of both waiting for blocks forever."""
    llm = LLM(fixture_dir("qwen2"), max_num_seqs=2, device="cpu", block_size=2, num_blocks=40,
              max_num_batched_tokens=6, enable_prefix_caching=False)
    prompts = [list(range(5, 65)), list(range(100, 160))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    alone = [LLM(fixture_dir("qwen2"), max_num_seqs=1, device="cpu").generate([p], params, use_tqdm=False)[0]
             for p in prompts]
    assert [o.outputs.token_ids for o in outs] == [a.outputs.token_ids for a in alone]
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_no_block_held(llm)


@pytest.mark.parametrize("fast_forward", [True, False])
@pytest.mark.parametrize("regex", ["<function>multiply[(]3, 302[)]</function>(<results>[0-9]+</results>)?",
                                   "<function>multiply[(]3, 30[0-9][)]</function>(<results>[0-9]+</results>)?"])
def test_forced_tokens_and_tool_calls_survive_preemption(fast_forward, regex):
    """Tool results and grammar-forced tokens still queued (fast-forward off), or a call closed or
    open across a preemption, come out as without preemption."""
    call = GuidedDecodingParams(regex=regex)
    params = SamplingParams(temperature=0, max_tokens=40, guided_decoding=call,
                            logits_processors_args={"tool_execution": True})
    prompts = ["What is 3 times 302?", "What is 3 times 302? Tell me.", "Compute 3 times 302 please", "3*302=?"]

    def run(**options):
        llm = LLM(logits_processors=["ToolExecutionLogitsProcessor"], tool_functions={"multiply": lambda a, b: a * b},
                  max_num_seqs=4, device="cpu", block_size=4, fast_forward=fast_forward, **options)
        outs = [(o.outputs.text, o.outputs.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]
        return outs, llm

    expected, _ = run()
    assert all(reason == "stop" and "</function><results>" in text for text, reason in expected)
    got, tight = run(num_blocks=20)
    assert got == expected
    assert tight.engine.scheduler.num_preemptions > 0
    _assert_no_block_held(tight)
