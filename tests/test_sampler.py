"""Sampler semantics against small numpy references."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from conftest import fixture_dir, load_reference

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.engine.request import Request
from fastdeploy_lp.engine.sampler import Sampler, seeded_uniforms
from fastdeploy_lp.engine.stages import SamplingStages
from fastdeploy_lp.engine.step_rows import StepRows
from fastdeploy_lp.model import cpu_kernels
from fastdeploy_lp.processors.tensor_ops import add_at

V = 12


class _NoDetok:
    text = ""


def _request(slot, prompt=(1, 2), output=(), seed=0, **params):
    return Request(request_id=f"r{slot}", prompt_ids=list(prompt), params=SamplingParams(**params),
                   detokenizer=_NoDetok(), args={}, slot=slot, output_ids=list(output), seed=seed)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    p = _softmax(logits / temperature)
    keep = np.ones_like(p, dtype=bool)
    if min_p:
        keep &= p >= min_p * p.max()
    order = np.argsort(-p, kind="stable")
    if top_k:
        keep[order[top_k:]] = False
    masked = np.where(keep, p, 0.0)
    sorted_p = masked[order]
    before = np.cumsum(sorted_p) - sorted_p
    drop = order[(before >= top_p) & (np.arange(len(p)) > 0)]
    masked[drop] = 0
    return masked / masked.sum()


@pytest.fixture(scope="module")
def logits_row():
    return np.random.default_rng(0).normal(size=V).astype(np.float32) * 2


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(top_k=3), dict(top_p=0.6), dict(min_p=0.2),
                                    dict(temperature=1.5, top_k=5, top_p=0.8)])
def test_sampling_distribution_matches_numpy_reference(logits_row, params):
    n = 6000
    sampler = Sampler(n, V, eos_token_ids=[0], deterministic=False)
    requests = [_request(i, seed=i, **params) for i in range(n)]
    tokens = SamplingStages(sampler).sample(paddle.to_tensor(np.tile(logits_row, (n, 1))), requests).tokens
    freq = np.bincount(tokens, minlength=V) / n
    ref = _reference_probs(logits_row.astype(np.float64), **params)
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(ref))
    np.testing.assert_allclose(freq, ref, atol=0.025)


def test_penalties_match_reference(logits_row):
    sampler = Sampler(2, V, eos_token_ids=[0], deterministic=False)
    prompt, output = [1, 2, 2], [3, 3, 4]
    r = _request(0, prompt=prompt, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    sampler.on_admit(r)
    for t in output:  # let the sampler count the output tokens as it would have produced them
        sampler.record_token(r, t)
    sampler.flush_counts()  # the penalties stage does this first
    r.output_ids = output
    got = sampler._apply_penalties(paddle.to_tensor(logits_row[None]), [r]).numpy()[0]
    ref = logits_row.astype(np.float64).copy()
    counts = np.bincount(output, minlength=V)
    seen = (counts > 0) | (np.bincount(prompt, minlength=V) > 0)
    ref[seen] = np.where(ref[seen] > 0, ref[seen] / 1.3, ref[seen] * 1.3)
    ref -= 0.5 * counts + 0.25 * (counts > 0)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_min_tokens_stage():
    """EOS and stop tokens are banned until min_tokens. (SamplingParams.logit_bias and bad_words run
    through the built-in processors: test_processors_contract.py checks that stage.)"""
    sampler = Sampler(2, V, eos_token_ids=[0], deterministic=False)
    r = _request(0, output=[5], min_tokens=2, stop_token_ids=[7], logit_bias={3: 2.5})
    rows = StepRows.of(paddle.zeros([1, V]), [r])
    sampler.min_tokens(rows)
    expected = np.zeros(V)
    expected[[0, 7]] = -np.inf
    np.testing.assert_array_equal(rows.logits.numpy()[0], expected)
    r.output_ids = [5, 6]  # min_tokens reached: nothing is banned
    rows = StepRows.of(paddle.zeros([1, V]), [r])
    sampler.min_tokens(rows)
    assert not rows.logits.numpy().any()


def test_greedy_rows_take_argmax_and_logprobs_are_normalised(logits_row):
    sampler = Sampler(2, V, eos_token_ids=[0], deterministic=False)
    rows = [_request(0, temperature=0, logprobs=3), _request(1, temperature=1.0)]
    result = SamplingStages(sampler).sample(paddle.to_tensor(np.stack([logits_row, logits_row])), rows)
    assert result.tokens[0] == int(np.argmax(logits_row))
    lp = result.logprobs[0]
    ref = np.log(_softmax(logits_row.astype(np.float64)))
    assert lp.logprob == pytest.approx(ref.max(), abs=1e-5)
    assert list(lp.top) == list(np.argsort(-ref)[:3])
    assert result.logprobs[1] is None


@pytest.mark.parametrize("kernels", ["1", "0"])  # the CPU argmax kernel's check, and Paddle's ops'
def test_greedy_rows_nothing_can_be_drawn_from_fail_and_huge_finite_ones_do_not(kernels):
    huge = np.full(V, 3e38, dtype=np.float32)  # sums far past float32's range: still a usable row
    nan, pos_inf = huge.copy(), huge.copy()
    nan[3], pos_inf[4] = np.nan, np.inf
    all_neg_inf, one_left = np.full(V, -np.inf, np.float32), np.full(V, -np.inf, np.float32)
    one_left[5] = 1.0
    logits = paddle.to_tensor(np.stack([huge, nan, pos_inf, all_neg_inf, one_left]))
    cpu_kernels.set_mode(kernels)
    try:
        result = SamplingStages(Sampler(5, V, eos_token_ids=[0], deterministic=False)).sample(
            logits, [_request(slot, temperature=0) for slot in range(5)])
    finally:
        cpu_kernels.set_mode("auto")
    assert sorted(result.failures) == [1, 2, 3]
    assert result.tokens[0] == 0 and result.tokens[4] == 5


@pytest.fixture(scope="module")
def llm():
    return LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu")


@pytest.fixture(scope="module")
def prompts():
    return load_reference("qwen2")[0]


def test_seed_gives_same_text_whatever_shares_the_batch(llm, prompts):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs.token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate(prompts, [seeded, others, others, others], use_tqdm=False)[0].outputs.token_ids
    assert mixed == alone


def test_n_choices_differ_and_are_reproducible(llm, prompts):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    first = llm.generate([prompts[1]], params, use_tqdm=False)
    assert [o.outputs.index for o in first] == [0, 1]
    assert first[0].outputs.token_ids != first[1].outputs.token_ids
    again = llm.generate([prompts[1]], params, use_tqdm=False)
    assert [o.outputs.token_ids for o in again] == [o.outputs.token_ids for o in first]


def test_stop_string_ends_generation_and_is_cut(llm, prompts):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    text = llm.generate([prompts[0]], greedy, use_tqdm=False)[0].outputs.text
    stop = text[5:8]
    out = llm.generate([prompts[0]], greedy.clone(stop=[stop]), use_tqdm=False)[0].outputs
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]


def test_min_tokens_holds_back_eos_then_eos_stops(llm, prompts):
    forced_eos = SamplingParams(temperature=0, max_tokens=10, min_tokens=3, logit_bias={2: 100.0})
    out = llm.generate([prompts[0]], forced_eos, use_tqdm=False)[0].outputs
    assert out.finish_reason == "stop"
    assert len(out.token_ids) == 4 and out.token_ids[-1] == 2 and 2 not in out.token_ids[:3]


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_k", -2), ("min_p", 2),
                                         ("n", 0), ("max_tokens", 0), ("logprobs", 50), ("stop", [1])])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})


def test_bad_requests_name_the_field_and_queue_nothing(llm, prompts):
    with pytest.raises(ValueError, match="^max_tokens:.*max_model_len"):
        llm.generate([prompts[0]], SamplingParams(max_tokens=10**6), use_tqdm=False)
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate([[10**6]], use_tqdm=False)
    with pytest.raises(ValueError, match="^logit_bias:.*outside the vocabulary"):
        llm.generate([prompts[0]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="^sampling_params:"):
        llm.generate(prompts[:2], [SamplingParams()], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="^bogus:"):
        LLM(fixture_dir("qwen2"), bogus=1)


def test_repeated_pairs_add_up_exactly_on_every_core():
    """Penalty counts add one per appended token, and fast-forward can append the same token
    several times in a step. Paddle's CPU accumulating index_put_ lost some of those adds."""
    paddle.base.core.set_num_threads(2)
    for _ in range(20):
        counts = paddle.zeros([4, 100])
        add_at(counts, [1] * 1000 + [3], [7] * 1000 + [2], [1.0] * 1000 + [0.5])
        assert float(counts[1, 7]) == 1000 and float(counts[3, 2]) == 0.5 and float(counts.sum()) == 1000.5


def test_the_two_level_draw_matches_the_distribution_across_buckets():
    vocab = 1300  # three buckets of 512 ids, the last one padded
    logits = np.random.default_rng(1).normal(size=vocab).astype(np.float32) * 1.5
    n = 6000
    sampler = Sampler(n, vocab, eos_token_ids=[0], deterministic=False)
    requests = [_request(i, seed=i, temperature=1.0) for i in range(n)]
    tokens = SamplingStages(sampler).sample(paddle.to_tensor(np.tile(logits, (n, 1))), requests).tokens
    ref = _softmax(logits.astype(np.float64))
    groups = np.arange(vocab) // 100  # 13 groups of ids, spread over the buckets
    np.testing.assert_allclose(np.bincount(groups[tokens], minlength=13) / n, np.bincount(groups, weights=ref),
                               atol=0.02)
    top = np.argsort(-ref)[:5]
    np.testing.assert_allclose((tokens[:, None] == top).mean(axis=0), ref[top], atol=0.015)


def test_a_rows_draw_ignores_its_neighbours_sampling_options():
    vocab, n = 700, 300
    rng = np.random.default_rng(2)
    mine = rng.normal(size=(n, vocab)).astype(np.float32)
    neighbour = rng.normal(size=(n, vocab)).astype(np.float32)
    sampler = Sampler(2 * n, vocab, eos_token_ids=[0], deterministic=False)
    alone = SamplingStages(sampler).sample(paddle.to_tensor(mine), [_request(i, seed=i, temperature=1.0) for i in range(n)]).tokens
    mixed = np.stack([mine, neighbour], axis=1).reshape(2 * n, vocab)
    requests = [r for i in range(n) for r in (_request(2 * i, seed=i, temperature=1.0),
                                              _request(2 * i + 1, seed=7, top_k=3, top_p=0.5, min_p=0.1))]
    beside = SamplingStages(sampler).sample(paddle.to_tensor(mixed), requests).tokens[0::2]
    assert (beside == alone).all()


def test_a_1e_5_change_of_the_logits_rarely_changes_the_draw():
    """Logits of one row can differ by ~1e-5 with its batch or after a preemption (the forward pass
    is not bit-identical); an inverse CDF turned ~1 draw in 1000 into another token."""
    vocab, n, batches = 3072, 2000, 8
    sampler = Sampler(n, vocab, eos_token_ids=[0], deterministic=False)
    rng = np.random.default_rng(3)
    changed = 0
    for b in range(batches):
        logits = rng.normal(size=(n, vocab)).astype(np.float32) * 2.5
        noisy = logits + rng.normal(size=logits.shape).astype(np.float32) * 1e-5
        requests = [_request(i, seed=b * n + i, temperature=1.0) for i in range(n)]
        first = SamplingStages(sampler).sample(paddle.to_tensor(logits), requests).tokens
        changed += int((SamplingStages(sampler).sample(paddle.to_tensor(noisy), requests).tokens != first).sum())
    assert changed <= 2, f"{changed} of {n * batches} draws changed"


def test_seeded_uniforms_stay_inside_zero_and_one():
    """At seed 991198, position 23, the 488th number is SplitMix64's largest 24-bit value: float32
    rounded it to 1.0, whose Gumbel noise (+inf) drew a token the grammar had masked."""
    u = seeded_uniforms(np.array([991198]), np.array([23]), 8192)
    assert 0.0 < u.min() and u.max() < 1.0 and u[0, 487] == np.float32(1.0 - 2.0 ** -24)
