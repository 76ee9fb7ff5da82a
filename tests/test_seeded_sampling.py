"""A seeded request's draw depends only on its seed, its position and its own logits: not on a
neighbour's top-k / top-p / min-p, and not on being preempted and resumed (issue "Hardening II").
Built-in model, real forward passes."""

from __future__ import annotations

import pytest

from fastdeploy_lp import LLM, SamplingParams

PROMPT = "Once upon a time"


def seeded(seed=1, **extra):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, device="cpu")


@pytest.fixture(scope="module")
def alone(llm):
    return {seed: llm.generate(PROMPT, seeded(seed), use_tqdm=False)[0].outputs for seed in (1, 5, 6, 7)}


@pytest.mark.parametrize("neighbour", [dict(top_k=50), dict(top_p=0.5), dict(min_p=0.2),
                                       dict(top_k=5, top_p=0.9, min_p=0.05, temperature=0.7)])
def test_a_neighbours_sampling_options_do_not_shift_a_seeded_request(llm, alone, neighbour):
    params = [seeded(1), SamplingParams(**{"temperature": 1.0, "seed": 9, "max_tokens": 40, **neighbour}),
              seeded(1)]
    outs = [o.outputs for o in llm.generate([PROMPT, "The cat sat on", PROMPT], params, use_tqdm=False)]
    assert outs[0].token_ids == alone[1].token_ids and outs[0].text == alone[1].text
    assert outs[2].token_ids == alone[1].token_ids


def test_a_request_with_its_own_top_k_and_top_p_is_batch_independent_too(llm):
    mine = seeded(3, top_k=20, top_p=0.8)
    by_itself = llm.generate(PROMPT, mine, use_tqdm=False)[0].outputs.token_ids
    beside = llm.generate([PROMPT, "In the morning"], [mine, seeded(4)], use_tqdm=False)[0].outputs.token_ids
    assert beside == by_itself


def test_a_preempted_request_continues_its_random_stream(alone):
    small = LLM(max_num_seqs=4, device="cpu", num_blocks=9, max_num_batched_tokens=48)
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=40, ignore_eos=True)
    outs = [o.outputs for o in small.generate(PROMPT, params, use_tqdm=False)]
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [alone[s].token_ids for s in (5, 6, 7)]
    assert [o.text for o in outs] == [alone[s].text for s in (5, 6, 7)]
