"""Speculative decoding (n-gram drafts) changes how fast tokens come, never which: every test runs
the same requests on an engine without speculation and one with it, on the built-in model."""

from __future__ import annotations

import json

import numpy as np
import paddle
import pytest
from conftest import FIXTURE_MODELS, fixture_dir
from pydantic import BaseModel

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.sampling_params import GuidedDecodingParams
from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.engine.request import Request
from fastdeploy_lp.engine.sampler import Sampler
from fastdeploy_lp.engine.stages import SamplingStages
from fastdeploy_lp.engine.step_rows import StepRows
from fastdeploy_lp.engine.ngram_proposer import NgramProposer
from fastdeploy_lp.processors import LogitsProcessor
from fastdeploy_lp.speculative_config import SpeculativeConfig

# draft_row_cost fixed: the built-in model's measured cost would stop drafting in the batches these
# tests verify exactness with.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "max_verify_tokens": 64,
        "draft_row_cost": 0.05}
PROMPTS = ["one two three four one two three four one two three four one two",
           "The capital of France is Paris. The capital of France is",
           "Repeat after me: the quick brown fox jumps over the lazy dog. the quick brown fox",
           "Tell me about Paris.", "Hello world"]
BUILTINS = ["LogitBiasLogitsProcessor", "BadWordsLogitsProcessor", "NoRepeatNGramLogitsProcessor",
            "AllowedTokenIdsLogitsProcessor"]


class RecordArgs(BaseModel):
    record: bool | None = None


class StepRecorder(LogitsProcessor):
    """A custom processor that does not declare `supports_speculation`: it records the output
    length of each request that enabled it at every step it is shown."""

    args_model = RecordArgs
    seen: list[int] = []

    def update_state(self, share_inputs):
        active = [s for s, f in enumerate(share_inputs["stop_flags"]) if not f]
        self.rows = [bool(share_inputs["logits_processors_args"][s]) for s in active]
        StepRecorder.seen += [int(share_inputs["step_idx"][s]) for s, on in zip(active, self.rows) if on]

    def apply(self, logits):
        return logits


@pytest.fixture(scope="module")
def plain():
    return LLM(max_num_seqs=8, logits_processors=BUILTINS + ["test_speculative_decoding:StepRecorder"])


@pytest.fixture(scope="module")
def spec():
    return LLM(max_num_seqs=8, logits_processors=BUILTINS + ["test_speculative_decoding:StepRecorder"],
               speculative_config=SPEC)


def run(llm, params, prompts=PROMPTS):
    return llm.generate(prompts, params, use_tqdm=False)


def same_tokens(a, b):
    return [x.outputs.token_ids for x in a] == [y.outputs.token_ids for y in b]


def test_greedy_output_is_token_for_token_the_same_and_drafts_are_accepted(plain, spec):
    before = spec.engine.speculator.stats.accepted_tokens
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert same_tokens(run(plain, params), run(spec, params))
    assert spec.engine.speculator.stats.accepted_tokens > before


def test_seeded_sampling_with_penalties_and_logprobs_is_the_same(plain, spec):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=11, max_tokens=48,
                            ignore_eos=True, logprobs=3, repetition_penalty=1.1, frequency_penalty=0.2,
                            presence_penalty=0.1, min_tokens=20)
    a, b = run(plain, params), run(spec, params)
    assert same_tokens(a, b)
    for x, y in zip(a, b):
        assert len(x.outputs.logprobs) == len(y.outputs.logprobs) == len(x.outputs.token_ids)
        for u, v in zip(x.outputs.logprobs, y.outputs.logprobs):
            assert u.token_id == v.token_id and abs(u.logprob - v.logprob) < 1e-4
            assert u.top.keys() == v.top.keys()


def test_builtin_processors_see_each_draft_position_as_history(plain, spec, request):
    before = spec.engine.speculator.stats.verify_passes
    ids = plain.tokenizer.encode(" the capital")
    args = [{"no_repeat_ngram_size": 3}, {"bad_words": ["Paris is", "quick brown"]},
            {"logit_bias": {str(ids[0]): 2.0}}, {"allowed_token_ids": list(range(0, 400))}, {}]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logits_processors_args=a,
                             bad_words=["fox jumps"]) for a in args]
    prompts = PROMPTS[:len(args)]
    assert same_tokens(run(plain, params, prompts), run(spec, params, prompts))
    assert spec.engine.speculator.stats.verify_passes > before


def test_a_request_enabling_a_processor_that_cannot_take_part_decodes_without_drafts(plain, spec):
    stats = spec.engine.speculator.stats
    blocked, passes = stats.requests_not_speculating, stats.verify_passes
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                             logits_processors_args={"record": True} if i == 0 else None) for i in range(3)]
    prompts = [PROMPTS[0]] * 3
    StepRecorder.seen = []
    a = run(plain, params, prompts)
    plain_seen, StepRecorder.seen = StepRecorder.seen, []
    assert same_tokens(a, run(spec, params, prompts))
    # The recorder saw its request at every output length, one token per step, as without speculation.
    assert StepRecorder.seen == sorted(StepRecorder.seen)  # never shown a draft position and then back
    assert sorted(set(StepRecorder.seen)) == sorted(set(plain_seen)) == list(range(32))
    assert stats.requests_not_speculating == blocked + 1
    assert stats.verify_passes > passes  # its neighbours did speculate


def test_guided_decoding_advances_its_matchers_over_drafts_and_rolls_them_back(plain, spec):
    stats = spec.speculative_stats()
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "people": {"type": "integer"}},
              "required": ["city", "people"], "additionalProperties": False}
    forms = [GuidedDecodingParams(json=schema), GuidedDecodingParams(regex=r"(one|two|three)( (one|two|three)){12}"),
             GuidedDecodingParams(grammar='start: "yes" | "no"'), GuidedDecodingParams(regex=r"(one two|two)( \w+){9}")]
    params = [SamplingParams(temperature=t, seed=5, max_tokens=40, guided_decoding=g, logprobs=2)
              for g in forms for t in (0, 0.8)]
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[3], PROMPTS[0]]
    prompts = [p for p in prompts for _ in (0, 1)]
    a, b = run(plain, params, prompts), run(spec, params, prompts)
    assert same_tokens(a, b)
    for x, y in zip(a, b):
        assert all(abs(u.logprob - v.logprob) < 1e-4 for u, v in zip(x.outputs.logprobs, y.outputs.logprobs))
    after = spec.speculative_stats()
    assert after["requests_not_speculating"] == stats["requests_not_speculating"]
    assert after["accepted_tokens"] > stats["accepted_tokens"]

def test_requests_closing_on_length_draft_until_their_closing_may_be_due(plain, spec):
    """Far from the end they speculate; where the closing may be due (decided step by step) the
    rows are unusable and no drafts are made: the same closed JSON as without drafts."""
    stats = spec.speculative_stats()
    listing = {"type": "object", "properties": {"names": {"type": "array", "items": {"type": "string"}}},
               "required": ["names"], "additionalProperties": False}
    params = [SamplingParams(temperature=t, seed=4, max_tokens=n, logprobs=1, guided_decoding=GuidedDecodingParams(
        json=listing, close_on_length=True)) for n in (24, 60, 150) for t in (0, 0.8)]
    prompts = [PROMPTS[0], PROMPTS[2]] * 3
    a, b = run(plain, params, prompts), run(spec, params, prompts)
    assert same_tokens(a, b)
    for x in b:
        assert isinstance(json.loads(x.outputs.text)["names"], list)
    after = spec.speculative_stats()
    assert after["requests_not_speculating"] == stats["requests_not_speculating"]
    assert after["accepted_tokens"] > stats["accepted_tokens"]


CUSTOMERS = {"type": "array", "minItems": 3, "maxItems": 4, "items": {
    "type": "object", "properties": {"customer_full_name": {"type": "string", "maxLength": 12},
                                     "customer_age_in_years": {"type": "integer"},
                                     "preferred_city": {"enum": ["Paris", "Berlin", "Rome"]}},
    "required": ["customer_full_name", "customer_age_in_years", "preferred_city"], "additionalProperties": False}}


def test_tokens_a_grammar_forces_at_draft_positions_are_appended_in_the_same_pass(plain, spec):
    """Repeated JSON keys: the drafts run into spans the schema forces, which the verify pass
    appends as fast-forward would (logprob 0), and goes on past when the drafts were them."""
    stats = spec.speculative_stats()
    params = [SamplingParams(temperature=t, seed=3, max_tokens=120, logprobs=1,
                             guided_decoding=GuidedDecodingParams(json=CUSTOMERS)) for t in (0, 0.7)]
    prompts = ["List customers as JSON: ", "The capital of France is Paris. Customers:"]
    steps = []
    for llm in (plain, spec):
        before = llm.engine.num_steps
        outputs = run(llm, params, prompts)
        steps.append(llm.engine.num_steps - before)
        if llm is plain:
            want = outputs
    assert same_tokens(want, outputs)
    for x, y in zip(want, outputs):
        assert y.outputs.text.startswith('[{"customer_full_name": "')
        assert all(abs(u.logprob - v.logprob) < 1e-4 for u, v in zip(x.outputs.logprobs, y.outputs.logprobs))
    after = spec.speculative_stats()
    assert after["forced_tokens"] - stats["forced_tokens"] > 20
    assert steps[1] < steps[0]


def test_drafts_are_refined_by_the_grammar_cutting_what_it_rejects_and_drafting_what_it_forces(plain, monkeypatch):
    """A drafter that guesses the next token right and then nonsense: the grammar cuts the nonsense
    and drafts what it forces after the guess, so the verify pass finishes the answer a step
    earlier than plain decoding, or than the same drafts unrefined; the output is the same."""
    grammar = GuidedDecodingParams(grammar='start: ("yes" | "no") " and " ("yes" | "no") " indeed"')
    params = SamplingParams(temperature=0, max_tokens=24, guided_decoding=grammar, logprobs=0)
    steps = plain.engine.num_steps
    want = run(plain, params, PROMPTS[3:4])[0]
    steps = plain.engine.num_steps - steps
    llm = LLM(max_num_seqs=2, speculative_config={**SPEC, "num_speculative_tokens": 8})
    nonsense = llm.tokenizer.encode(" zebra zebra")
    monkeypatch.setattr(llm.engine.speculator.proposer, "propose", lambda context, k: [
        want.outputs.token_ids[len(context) - len(want.prompt_token_ids)]] + nonsense)
    for refined in (False, True):
        if not refined:
            monkeypatch.setattr(llm.engine.pipeline, "refine_drafts", lambda slot, args, params, drafts, k: drafts)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(llm.engine.speculator.proposer, "propose", lambda context, k: [
                want.outputs.token_ids[len(context) - len(want.prompt_token_ids)]] + nonsense)
        before, stats = llm.engine.num_steps, llm.speculative_stats()
        got = run(llm, params, PROMPTS[3:4])[0].outputs
        assert (got.token_ids, got.text) == (want.outputs.token_ids, want.outputs.text)
        assert np.allclose([lp.logprob for lp in got.logprobs], [lp.logprob for lp in want.outputs.logprobs], atol=1e-4)
        assert llm.speculative_stats()["forced_tokens"] > stats["forced_tokens"]  # appended by the verify pass
        assert llm.engine.num_steps - before == (steps - 1 if refined else steps)


class MisbehaveArgs(BaseModel):
    misbehave: str | None = None


class MisbehavingAtDrafts(LogitsProcessor):
    """Takes part in speculation, and at draft depths or when refining drafts does what a processor
    must not: forces ids outside the vocabulary, raises, returns drafts that are no token ids."""

    args_model = MisbehaveArgs
    supports_speculation = True

    def update_state(self, share_inputs):
        pass

    def update_draft_state(self, share_inputs):
        how = {s: share_inputs["logits_processors_args"][s].misbehave
               for s in np.flatnonzero(~np.asarray(share_inputs["stop_flags"]))}
        if "raise" in how.values():
            raise RuntimeError("at a draft depth")
        for slot, what in how.items():
            if what == "force":
                share_inputs["forced_tokens"][slot].extend([-1, 10 ** 9])

    def refine_drafts(self, slot, drafts, limit):
        if slot % 2:
            return ["not", "token", "ids"]
        raise ZeroDivisionError("refining drafts")


@pytest.mark.parametrize("how", ["force", "raise"])
def test_a_processor_misbehaving_at_draft_depths_only_stops_acceptance_there(how):
    processors = BUILTINS + ["test_speculative_decoding:MisbehavingAtDrafts"]
    plain, llm = (LLM(max_num_seqs=4, logits_processors=processors, **kw) for kw in ({}, {"speculative_config": SPEC}))
    params = [SamplingParams(temperature=t, seed=8, max_tokens=40, ignore_eos=True,
                             logits_processors_args={"misbehave": how} if i % 2 else None)
              for i, t in enumerate((0, 0, 0.8, 0.8))]
    prompts = PROMPTS[:4]
    a, b = run(plain, params, prompts), run(llm, params, prompts)
    assert same_tokens(a, b) and all(x.outputs.finish_reason == "length" for x in b)
    assert llm.speculative_stats()["accepted_tokens"] > 0


def test_stop_strings_and_max_tokens_inside_accepted_runs(plain, spec):
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    text = run(plain, greedy, PROMPTS[:1])[0].outputs.text
    words = sorted({w for w in text.split() if len(w) > 2})[:6]
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[w]) for w in words]
    params += [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 5, 7, 11)]
    prompts = PROMPTS[:1] * len(params)
    a, b = run(plain, params, prompts), run(spec, params, prompts)
    for x, y in zip(a, b):
        assert (x.outputs.text, x.outputs.token_ids, x.outputs.finish_reason) == \
            (y.outputs.text, y.outputs.token_ids, y.outputs.finish_reason)


def test_no_kv_block_leaks_after_speculation(spec):
    run(spec, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert spec.engine.block_pool.num_used == 0


def test_blocks_written_through_accepted_drafts_serve_later_requests_from_the_prefix_cache(plain, spec):
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    first = run(spec, greedy, PROMPTS[:1])[0]
    follow_up = [list(first.prompt_token_ids) + list(first.outputs.token_ids)]
    hits = spec.engine.block_pool.stats.hit_tokens
    short = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert same_tokens(run(plain, short, follow_up), run(spec, short, follow_up))
    assert spec.engine.block_pool.stats.hit_tokens - hits >= 64  # the output's blocks were found


def test_preemption_under_a_tight_kv_cache_keeps_outputs_exact():
    small = dict(max_num_seqs=4, num_blocks=12, max_num_batched_tokens=48)
    a, b = LLM(**small), LLM(**small, speculative_config=SPEC)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=40, ignore_eos=True)
    assert same_tokens(run(a, params, PROMPTS[:4]), run(b, params, PROMPTS[:4]))
    assert b.engine.scheduler.num_preemptions > 0 and b.speculative_stats()["accepted_tokens"] > 0
    assert b.engine.block_pool.num_used == 0


def test_a_large_batch_backs_off_to_plain_steps():
    llm = LLM(max_num_seqs=8, speculative_config={"method": "ngram", "max_verify_tokens": 8})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    run(llm, params, PROMPTS[:1] * 8)  # eight running requests fill the pass: no drafts
    assert llm.speculative_stats()["verify_passes"] == 0
    run(llm, params, PROMPTS[:2])
    assert llm.speculative_stats()["verify_passes"] > 0


def test_a_request_whose_drafts_are_always_rejected_backs_off_and_its_output_is_unchanged(plain, monkeypatch):
    banned = 7  # every draft is this token, which the request's logit_bias rules out: none is ever accepted
    llm = LLM(max_num_seqs=8, logits_processors=BUILTINS, speculative_config=SPEC)
    monkeypatch.setattr(llm.engine.speculator.proposer, "propose", lambda context, k: [banned] * k)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, logit_bias={banned: -100})
    assert same_tokens(run(plain, params, PROMPTS[:2]), run(llm, params, PROMPTS[:2]))
    stats = llm.speculative_stats()
    assert stats["accepted_tokens"] == 0 and stats["backoffs"] > 0
    # Pauses double: of ~200 steps per request, only a handful verify drafts.
    assert stats["verify_passes"] <= 2 * 14 and stats["paused_steps"] > 2 * 150


def test_the_proposer_drafts_what_followed_the_latest_longest_match():
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_max=3, prompt_lookup_min=2))
    context = np.array([1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 4, 2, 3], dtype=np.int64)
    assert proposer.propose(context, 2) == [7, 8]          # "2 3" last seen before "7 8"
    context = np.array([5, 2, 3, 6, 1, 2, 3, 7, 5, 2, 3], dtype=np.int64)
    assert proposer.propose(context, 3) == [6, 1, 2]       # "5 2 3" (n=3) beats the later "2 3"
    assert proposer.propose(np.array([1, 2, 3, 4], dtype=np.int64), 3) == []


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle"}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}, "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "draft_model": "x"}, "speculative_config.draft_model"),
    ({"num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram", "draft_row_cost": -1}, "speculative_config.draft_row_cost"),
    ("{not json", "speculative_config: not valid JSON"),
])
def test_a_bad_speculative_config_names_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=value).create_engine_config()


def test_speculation_is_off_by_default():
    assert EngineArgs().create_engine_config().speculative_config is None


def test_offline_stats_count_drafts_and_acceptance(spec):
    run(spec, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), PROMPTS[:1])
    stats = spec.speculative_stats()
    assert stats["method"] == "ngram" and stats["drafted_tokens"] >= stats["accepted_tokens"] > 0
    assert stats["acceptance_rate"] == stats["accepted_tokens"] / stats["drafted_tokens"]
    assert LLM().speculative_stats()["method"] is None


def test_server_flag_serves_the_same_text_and_counts_drafts_in_metrics(plain):
    import openai

    from fastdeploy_lp.model_config import default_model_path
    from server_harness import start_server

    server = start_server("--speculative-config", json.dumps(SPEC), "--max-model-len", "512",
                          model=default_model_path())
    try:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="EMPTY", max_retries=0, timeout=60)
        got = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[0], max_tokens=32,
                                        temperature=0, extra_body={"ignore_eos": True})
        want = run(plain, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), PROMPTS[:1])[0].outputs.text
        assert got.choices[0].text == want
        stream = client.completions.create(model=got.model, prompt=PROMPTS[0], max_tokens=32, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want
        assert server.metric("fastdeploy_lp:spec_decode_accepted_tokens_total", 'method="ngram"') > 0
        assert server.metric("fastdeploy_lp:spec_decode_draft_tokens_total", 'method="ngram"') > 0
    finally:
        server.stop()


def test_a_bad_flag_value_stops_the_server_naming_the_field():
    from server_harness import start_server

    with pytest.raises(RuntimeError, match="speculative_config.num_speculative_tokens"):
        start_server("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}')


class _NoText:
    text = ""


def test_sampled_verification_keeps_the_distribution_chi_square():
    """4000 seeded requests verify one unlikely draft against fixed probabilities over 6 tokens: the
    first appended token follows p, the draft is kept with probability p(draft), and a rejected
    draft is replaced by a draw from p without it, renormalised (chi-square, 5 and 4 degrees of
    freedom, far below the 0.1% critical values 20.5 and 18.5)."""
    n, p, draft = 4000, np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05]), 4
    requests = [Request(request_id=f"r{i}", prompt_ids=[1, 2], params=SamplingParams(temperature=1.0),
                        detokenizer=_NoText(), args={}, slot=i, seed=1000 + i) for i in range(n)]
    stages = SamplingStages(Sampler(n, len(p), eos_token_ids=[], deterministic=False))
    logits = paddle.to_tensor(np.tile(np.log(p), (2 * n, 1)).astype(np.float32))  # 2 rows per request
    rows = stages.run(StepRows.verify(logits, requests, {i: [draft] for i in range(n)}))
    first = np.array([rows.emitted(i)[0][0] for i in range(n)])
    kept = first == draft

    def chi_square(counts, probs):
        expected = probs * counts.sum()
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi_square(np.bincount(first, minlength=len(p)), p) < 20.5
    assert abs(kept.mean() - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / n)
    others = np.delete(np.arange(len(p)), draft)
    rejected = np.bincount(first[~kept], minlength=len(p))[others]
    assert chi_square(rejected, p[others] / p[others].sum()) < 18.5
    assert all(len(rows.emitted(i)) == (2 if kept[i] else 1) for i in range(n))


@pytest.mark.parametrize("name", FIXTURE_MODELS)
def test_greedy_parity_on_the_reference_checkpoints(name):
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [3, 7, 11, 19, 3, 7], [2, 4, 6, 8]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain_llm = LLM(fixture_dir(name), max_num_seqs=4)
    spec_llm = LLM(fixture_dir(name), max_num_seqs=4, speculative_config=SPEC)
    assert same_tokens(run(plain_llm, params, prompts), run(spec_llm, params, prompts))
    assert spec_llm.speculative_stats()["verify_passes"] > 0


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_tool_call_constraints_are_the_same_with_drafts(plain, spec, tool_choice):
    from fastdeploy_lp.processors.guided.tool_calls import tool_call_constraint

    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
               "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    messages = [[{"role": "user", "content": "What's the weather in Paris? And in Paris again?"}]] * 2
    constraint = tool_call_constraint(tools, tool_choice)
    params = [SamplingParams(temperature=t, seed=9, max_tokens=48, guided_decoding=constraint) for t in (0, 1.0)]
    a = plain.chat(messages, params, use_tqdm=False, tools=tools)
    b = spec.chat(messages, params, use_tqdm=False, tools=tools)
    assert same_tokens(a, b)


def test_thinking_budget_takes_part_and_forces_the_same_close():
    engines = [LLM(max_num_seqs=4, logits_processors=["ThinkingBudgetLogitsProcessor"], **kw)
               for kw in ({}, {"speculative_config": SPEC})]
    questions = [[{"role": "user", "content": "What is 17 times 23? " * 3}],
                 [{"role": "user", "content": "Tell me about Paris. Paris Paris."}]]
    params = [SamplingParams(temperature=t, seed=1, max_tokens=64, logprobs=1, logits_processors_args={
        "thinking_budget": budget, "think_stop_sentence": " Time to answer. Time to answer."})
        for budget in (0, 3, 10, 30) for t in (0, 0.8)]
    a, b = ([x for p in params for x in llm.chat(questions, p, chat_template_kwargs={"enable_thinking": True},
                                                  use_tqdm=False)] for llm in engines)
    assert same_tokens(a, b)
    assert any(" Time to answer. Time to answer.</think>" in x.outputs.text for x in b)
    stats = engines[1].speculative_stats()
    assert stats["requests_not_speculating"] == 0 and stats["accepted_tokens"] > 0


def test_thinking_budget_counts_from_the_first_of_repeated_thinks_with_drafts():
    """A probe's case: the output opens `<think>` again and again (pushed by `logit_bias`), so drafts
    of it are accepted several at a time; `</think>` is forced where plain decoding forces it."""
    engines = [LLM(max_num_seqs=2, logits_processors=["ThinkingBudgetLogitsProcessor"], **kw)
               for kw in ({}, {"speculative_config": SPEC})]
    think = engines[0].tokenizer.encode("<think>")
    params = [SamplingParams(temperature=t, seed=3, max_tokens=24, logprobs=1, ignore_eos=True,
                             logit_bias={think[0]: bias}, logits_processors_args={"thinking_budget": budget})
              for budget in (3, 7) for bias in (8.0, 12.0) for t in (0, 0.7)]
    prompts = ["one two three four one two three four one two", "<think> a b <think> a b"]
    a, b = ([x for p in params for x in llm.generate(prompts, p, use_tqdm=False)] for llm in engines)
    assert same_tokens(a, b)
    assert any("</think>" in x.outputs.text for x in a)
    assert engines[1].speculative_stats()["accepted_tokens"] > 0


@pytest.mark.parametrize("results", ["(<results>[0-9]+</results>)?", "<results>[0-9]+</results>"])
def test_tool_execution_takes_part_and_never_runs_a_call_for_drafts(results):
    """The model writes three calls; each runs once, at the step plain decoding runs it. (With the
    results in the grammar, fast-forward writes `<results>` itself and no call runs; drafts are
    accepted to the last one and the row after is unusable.)"""
    calls = []

    def multiply(a, b):
        calls.append((a, b))
        return a * b

    call = GuidedDecodingParams(regex=f"(<function>multiply[(][0-9], [0-9]{{1,3}}[)]</function>{results} ){{3}}")
    params = [SamplingParams(temperature=t, seed=2, max_tokens=120, guided_decoding=call, logprobs=1,
                             logits_processors_args={"tool_execution": True}) for t in (0, 0.9)]
    prompts = ["What is 3 times 302? <function>multiply(3, 302)</function>", "Hello"]
    seen = []
    for kw in ({}, {"speculative_config": SPEC}):
        calls.clear()
        llm = LLM(max_num_seqs=4, logits_processors=["ToolExecutionLogitsProcessor"],
                  tool_functions={"multiply": multiply}, **kw)
        seen.append((run(llm, params, prompts), sorted(calls)))
    (a, plain_calls), (b, spec_calls) = seen
    assert same_tokens(a, b) and spec_calls == plain_calls
    assert len(plain_calls) == (6 if "?" in results else 0)
    stats = llm.speculative_stats()
    assert stats["requests_not_speculating"] == 0 and stats["accepted_tokens"] > 0


def test_the_draft_model_method_with_the_model_as_its_own_draft_is_exact_and_accepts_nearly_all(plain):
    from fastdeploy_lp.model_config import default_model_path
    llm = LLM(max_num_seqs=8, logits_processors=BUILTINS, speculative_config={
        "method": "draft_model", "model": default_model_path(), "num_speculative_tokens": 4,
        "max_verify_tokens": 64})
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert same_tokens(run(plain, greedy), run(llm, greedy))
    stats = llm.speculative_stats()
    assert stats["method"] == "draft_model" and stats["drafted_tokens"] > 100 and stats["acceptance_rate"] > 0.9
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=32, ignore_eos=True,
                            repetition_penalty=1.2, logprobs=2, logit_bias={13: 3.0})
    a, b = run(plain, seeded), run(llm, seeded)
    assert same_tokens(a, b)
    for x, y in zip(a, b):  # a verify pass's rows are computed together: equal to float rounding
        assert all(abs(u.logprob - v.logprob) < 1e-4 for u, v in zip(x.outputs.logprobs, y.outputs.logprobs))
    llm.engine.step()  # an idle step: every finished request's draft cache is freed
    assert llm.engine.speculator.proposer.pool.num_used == 0


@pytest.mark.parametrize("value, message", [
    ({"method": "draft_model"}, "required for method draft_model"),
    ({"method": "draft_model", "model": "/no/such/dir"}, "must be a checkpoint directory"),
    ({"method": "ngram", "model": "/tmp"}, "only for method draft_model"),
])
def test_a_bad_draft_model_config_names_the_model_field(value, message):
    with pytest.raises(ValueError, match=f"speculative_config.model: {message}"):
        SpeculativeConfig.from_value(value)


def test_a_different_checkpoint_as_draft_model_keeps_greedy_output_exact():
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [3, 7, 11, 19, 3, 7], [2, 4, 6, 8]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain_llm = LLM(fixture_dir("qwen3"), max_num_seqs=4)
    spec_llm = LLM(fixture_dir("qwen3"), max_num_seqs=4, speculative_config={
        "method": "draft_model", "model": fixture_dir("llama"), "num_speculative_tokens": 3, "max_verify_tokens": 16})
    assert same_tokens(run(plain_llm, params, prompts), run(spec_llm, params, prompts))
    assert spec_llm.speculative_stats()["verify_passes"] > 0


def test_a_draft_row_costs_what_the_steps_measure_and_every_request_of_the_batch_pays_it():
    """observe_step keeps a draft row's cost in plain steps (never below the configured floor), and
    a pass's gain charges it once per running request: drafts that pay at batch 1 stop paying in a
    batch whose every step they slow."""
    from fastdeploy_lp.engine.speculation import Speculator
    from fastdeploy_lp.speculative_config import MIN_DRAFT_ROW_COST, SpeculativeConfig

    config = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4})
    speculator = Speculator(config, pipeline=None, scheduler=None, proposer=None)
    speculator.observe_step(0.010, 0)            # a plain step: 10 ms
    for _ in range(60):
        speculator.observe_step(0.018, 4)        # 4 draft rows: 8 ms more, 0.2 of a step each
    assert abs(speculator.draft_row_cost - 0.2) < 0.01
    speculator.observe_step(0.0101, 4)           # a cheap pass never takes it below the floor
    assert speculator.draft_row_cost >= MIN_DRAFT_ROW_COST
    speculator._batch = 4                        # a batch of 4's plain step takes 20 ms: its own reference
    speculator.observe_step(0.020, 0)
    before = speculator.draft_row_cost
    for _ in range(60):
        speculator.observe_step(0.022, 4)        # 0.025 of a 4-request step per draft row, not 0.3 of a 1-request one
    assert speculator.draft_row_cost < before and abs(speculator.draft_row_cost - MIN_DRAFT_ROW_COST) < 0.01
    speculator._batch, speculator.draft_row_cost = 1, 0.2
    fixed = Speculator(SpeculativeConfig.from_value({"method": "ngram", "draft_row_cost": 0.3}), None, None, None)
    fixed.observe_step(0.010, 0)
    fixed.observe_step(0.050, 4)                 # a fixed cost is not measured
    assert fixed.draft_row_cost == 0.3

    class _Request:
        admission = 1
    from fastdeploy_lp.engine.speculation import _Drafting
    for batch, pauses in ((1, 0), (4, 1)):
        speculator._requests = {1: _Drafting(blocked=False, gain=0.0)}
        speculator._batch, speculator.stats.backoffs = batch, 0
        speculator.record(_Request(), drafted=4, accepted=1)  # gains 1 - 0.2 x 4 x batch
        assert speculator.stats.backoffs == pauses
