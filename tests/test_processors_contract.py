"""The typed, versioned processor contract (issue 13): `ShareInputs` and its version, the batch
changes processors see (`BatchUpdate`), FastDeploy-style and typed processors side by side, the
built-ins building only a joining request's state, and `SamplingParams.logit_bias` / `bad_words`
running through the built-ins after the penalties. Real engines and forward passes."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from processor_harness import HandBatch, context_for
from test_processors_engine import PROMPTS, generate, greedy, make_llm

from fastdeploy_lp import SamplingParams
from fastdeploy_lp.engine import scheduler
from fastdeploy_lp.processors import (SHARE_INPUTS_VERSION, BatchTracker, LogitsProcessor, LogitsProcessorPipeline,
                                      ProcessorLoadError, ShareInputs, resolve_processors)
from fastdeploy_lp.processors.builtin.bad_words import word_sequences
from fastdeploy_lp.processors.pipeline import ProcessorResults

NEG_INF = np.float32(-np.inf)


@pytest.fixture(scope="module")
def context():
    return context_for("qwen3")


# -- the contract --------------------------------------------------------------------------------
def test_share_inputs_holds_exactly_the_typed_fields_of_its_version():
    assert SHARE_INPUTS_VERSION == 1
    assert getattr(scheduler, "SHARE_INPUTS_VERSION", SHARE_INPUTS_VERSION) == SHARE_INPUTS_VERSION
    assert set(scheduler.new_share_inputs(3)) == set(ShareInputs.__annotations__)


def test_a_processor_without_update_state_is_refused_at_start_up():
    with pytest.raises(ProcessorLoadError, match="does not implement update_state"):
        resolve_processors(["custom_processors:MissingUpdateState"])


def test_guided_decoding_is_on_exactly_when_a_processor_serves_it(context):
    class Serves(LogitsProcessor):
        serves_guided_decoding = True

        def update_state(self, share_inputs):
            pass

    assert not LogitsProcessorPipeline(context, ["LogitBiasLogitsProcessor"]).serves_guided_decoding
    assert LogitsProcessorPipeline(context, [], leading=[Serves(context.config)]).serves_guided_decoding
    llm = make_llm([])  # guided_decoding_backend="off"
    with pytest.raises(ValueError, match="^guided_decoding: guided decoding is off"):
        llm.generate([PROMPTS[0]], SamplingParams(guided_decoding=_json_object()), use_tqdm=False)


def _json_object():
    from fastdeploy_lp import GuidedDecodingParams
    return GuidedDecodingParams(json_object=True)


def test_batch_tracker_reports_joins_leaves_slot_reuse_and_moved_rows(context):
    batch, tracker = HandBatch(context), BatchTracker()
    a, b, c = batch.place(0, [5]), batch.place(3, [6], {"logit_bias": {"5": 1.0}}), batch.place(7, [7])
    first = tracker.update(batch.share)
    assert [(r.slot, r.row, r.req_id) for r in first.added] == [(0, 0, a), (3, 1, b), (7, 2, c)]
    assert first.added[1].args.logit_bias == {5: 1.0} and first.removed == () and first.moved == ()
    batch.append(0, 9)
    assert not tracker.update(batch.share).changed  # a step without joins or leaves
    batch.free(3)
    d, e = batch.place(3, [8]), batch.place(5, [9])  # slot 3 reused; slot 5 joins between 3 and 7
    update = tracker.update(batch.share)
    assert update.removed == (3,)
    assert [(r.slot, r.row, r.req_id) for r in update.added] == [(3, 1, d), (5, 2, e)]
    assert update.moved == ((2, 3),)  # slot 7's request: row 2 -> row 3
    assert update.previous_rows.tolist() == [0, -1, -1, 2] and update.slots.tolist() == [0, 3, 5, 7]
    assert update.rows_of([7, 0]).tolist() == [3, 0]
    again = tracker.update(batch.share)  # idempotent within a step
    assert not again.changed and again.previous_rows.tolist() == [0, 1, 2, 3]
    batch.free(0)
    batch.free(5)
    last = tracker.update(batch.share)
    assert last.removed == (0, 5) and last.added == () and last.moved == ((1, 0), (3, 1))


# -- FastDeploy-style and typed processors, side by side ----------------------------------------------
def _drive_gaps_reuse_and_joins(engine, args, max_tokens=12):
    """Slots 0, 3 and 7 run; a request joins between them; slot 0 is freed and reused; another joins.
    Returns each request's last output."""
    outputs = {}
    occupancy = lambda: [r.request_id if r else None for r in engine.scheduler.slots]  # noqa: E731
    step = lambda: outputs.update({o.request_id: o.outputs for o in engine.step()})  # noqa: E731
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, greedy(max_tokens=4 if i == 0 else max_tokens, **args.get(f"r{i}", {})), f"r{i}")
    step()
    for rid in ("r1", "r2", "r4", "r5", "r6"):
        engine.abort_request(rid)
    step()
    assert occupancy() == ["r0", None, None, "r3", None, None, None, "r7"]
    engine.add_request(PROMPTS[1], greedy(max_tokens=max_tokens, **args.get("j1", {})), "j1")
    step()
    assert occupancy() == ["r0", "j1", None, "r3", None, None, None, "r7"]  # joined between running slots
    step()  # r0's fourth token: it finishes and frees slot 0
    engine.add_request(PROMPTS[2], greedy(max_tokens=max_tokens, **args.get("j2", {})), "j2")
    engine.add_request(PROMPTS[4], greedy(max_tokens=max_tokens, **args.get("j3", {})), "j3")
    step()
    assert occupancy() == ["j2", "j1", "j3", "r3", None, None, None, "r7"]  # slot 0 reused
    while engine.has_unfinished_requests():
        step()
    return outputs


def test_fastdeploy_style_and_typed_processors_run_side_by_side_with_gaps_reuse_and_joins():
    llm = make_llm(["custom_processors:RecordBefore", "custom_processors:YourLogitsProcessor",
                    "custom_processors:TypedBiasLogitsProcessor", "custom_processors:RecordAfter"])
    engine = llm.engine
    before, _, typed, after = engine.pipeline.processors
    args = {"r0": {"typed_token": 30}, "r3": {"enable_your_logits_processor": True},
            "r7": {"enable_your_logits_processor": True, "typed_token": 31},
            "j1": {"typed_token": 32}, "j2": {"enable_your_logits_processor": True}, "j3": {}}
    outputs = _drive_gaps_reuse_and_joins(engine, args)

    join = next(u for u in typed.updates if [r.req_id for r in u.added] == ["j1"])
    assert (join.added[0].slot, join.added[0].row, join.removed, join.moved) == (1, 1, (), ((1, 2), (2, 3)))
    reuse = next(u for u in typed.updates if [r.req_id for r in u.added] == ["j2", "j3"])
    assert reuse.removed == (0,) and [(r.slot, r.row) for r in reuse.added] == [(0, 0), (2, 2)]
    assert len(before.steps) == len(after.steps) > 6
    seen = set()
    for seen_before, seen_after in zip(before.steps, after.steps):
        assert seen_before.keys() == seen_after.keys()
        for rid, (_, logits_in) in seen_before.items():
            expected = logits_in.copy()
            if args.get(rid, {}).get("enable_your_logits_processor"):
                expected[42] += np.float32(1000.0)
            if args.get(rid, {}).get("typed_token") is not None:
                expected[args[rid]["typed_token"]] += np.float32(2000.0)
            assert seen_after[rid][1].tobytes() == expected.tobytes(), rid
            seen.add(rid)
    assert set(args) <= seen
    assert outputs["r3"].token_ids == outputs["j2"].token_ids[:len(outputs["r3"].token_ids)] == [42] * 12
    assert [outputs[r].token_ids[0] for r in ("r0", "r7", "j1")] == [30, 31, 32]


# -- the built-ins build only a joining request's state -----------------------------------------------
COUNTED = ["LogitBias", "BadWords", "NoRepeatNGram", "AllowedTokenIds", "ThinkingBudget"]
EVERY_BUILTIN = {"logit_bias": {"5": 1.5, "40": -1.0}, "bad_words": ["ab"], "bad_words_token_ids": [[7, 8], [11]],
                 "no_repeat_ngram_size": 3, "allowed_token_ids": list(range(3, 60)), "thinking_budget": 2}


def _join_and_leave(engine):
    """Three requests run; one joins; one leaves. Returns each request's tokens."""
    for i in range(3):
        engine.add_request(PROMPTS[i], greedy(10, **EVERY_BUILTIN), f"r{i}")
    yield "started"
    engine.step()
    engine.step()
    yield "steady"
    engine.add_request(PROMPTS[3], greedy(10, **EVERY_BUILTIN), "join")
    engine.step()
    yield "joined"
    engine.abort_request("r1")
    engine.step()
    yield "left"


def test_a_join_builds_only_the_joining_requests_state_in_the_builtins():
    counted = make_llm([f"custom_processors:Counting{n}" for n in COUNTED])
    plain = make_llm([f"{n}LogitsProcessor" for n in COUNTED])
    processors = counted.engine.pipeline.processors
    expected_builds = {"started": [], "steady": ["r0", "r1", "r2"], "joined": ["r0", "r1", "r2", "join"],
                       "left": ["r0", "r1", "r2", "join"]}
    for phase, _ in zip(_join_and_leave(counted.engine), _join_and_leave(plain.engine)):
        for p in processors:
            assert p.built == expected_builds[phase], (type(p).__name__, phase)
    tokens = []
    for llm in (counted, plain):
        outs = {}
        while llm.engine.has_unfinished_requests():
            outs.update({o.request_id: o.outputs.token_ids for o in llm.engine.step()})
        tokens.append(outs)
    assert tokens[0] == tokens[1] and set(tokens[0]) == {"r0", "r2", "join"}  # as a rebuild decides
    assert all(p.built == expected_builds["left"] for p in processors)  # leaving builds nothing either


# -- SamplingParams.logit_bias and bad_words run through the built-ins ----------------------------------
def test_request_logit_bias_and_bad_words_match_the_registered_builtins_without_registration():
    tok = make_llm([]).tokenizer
    word = tok.decode([37]).strip() or "ab"
    bias = {5: 4.0, 9: 2.5}
    unregistered = make_llm([])
    via_params = generate(unregistered, PROMPTS[:3], [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias, bad_words=[word]),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word])])
    via_args = generate(make_llm(["LogitBiasLogitsProcessor", "BadWordsLogitsProcessor"]), PROMPTS[:3], [
        greedy(8, logit_bias=bias, bad_words=[word]), greedy(8), greedy(8, bad_words=[word])])
    assert [o.token_ids for o in via_params] == [o.token_ids for o in via_args]
    banned = {seq[-1] for seq in word_sequences(tok, [word]) if len(seq) == 1}
    assert banned and not banned & set(list(via_params[0].token_ids) + list(via_params[2].token_ids))
    stage = unregistered.engine.pipeline.sampling_stage
    assert [t.calls for t in stage.timings.values()] == [8, 8]  # applied in every step they were set
    assert list(unregistered.engine.processor_timings()) == []  # the registered pipeline is unchanged


def test_request_logit_bias_and_bad_words_apply_after_the_penalties():
    """Logprobs report the logits the sampler draws from; RecordAfter saw them before the penalties."""
    llm = make_llm(["custom_processors:RecordAfter"])
    tok = llm.tokenizer
    after = llm.engine.pipeline.processors[0]
    word, bias = tok.decode([37]).strip() or "ab", {5: 8.0, 6: -3.0}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, repetition_penalty=1.7, logit_bias=bias,
                            bad_words=[word], logprobs=5)
    out = generate(llm, [PROMPTS[0]], params)[0]
    banned = [seq[-1] for seq in word_sequences(tok, [word]) if len(seq) == 1]
    for step, logprob in enumerate(out.logprobs):
        history, x = after.steps[step][next(iter(after.steps[step]))]
        x = x.astype(np.float64)
        seen = sorted(set(history))
        x[seen] = np.where(x[seen] > 0, x[seen] / np.float32(1.7), x[seen] * np.float32(1.7))  # penalty first
        for t, b in bias.items():
            x[t] += b
        x[banned] = -np.inf
        ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
        top = np.argsort(-ref, kind="stable")[:5]
        assert logprob.token_id == top[0] == 5
        assert list(logprob.top) == top.tolist()
        np.testing.assert_allclose(list(logprob.top.values()), ref[top], atol=1e-4)


def test_sampling_params_stage_fails_only_its_requests_and_leaves_other_rows_alone(context):
    """The stage is a pipeline stage: rows of requests that set neither field come back bit for bit."""
    pipeline = LogitsProcessorPipeline(context, [])
    batch = HandBatch(context)
    batch.place(1, [5, 7])
    batch.place(4, [5, 7])
    batch.share["sampling_params"][1] = SamplingParams(logit_bias={3: 2.5}, bad_words=["ab"])
    batch.share["sampling_params"][4] = SamplingParams()
    assert pipeline.update_state(batch.share) == ProcessorResults()  # nothing forced, nobody failed
    x = np.random.default_rng(0).standard_normal((2, 1024)).astype(np.float32)
    out, failures = pipeline.apply_sampling_params(paddle.to_tensor(x.copy()), batch.share, all_greedy=True)
    out = out.numpy()
    assert not failures and out[1].tobytes() == x[1].tobytes()
    expected = x[0].copy()
    expected[3] += np.float32(2.5)
    for seq in word_sequences(context.tokenizer, ["ab"]):
        if len(seq) == 1 or [7] == seq[:-1]:
            expected[seq[-1]] = NEG_INF
    np.testing.assert_array_equal(out[0], expected)
