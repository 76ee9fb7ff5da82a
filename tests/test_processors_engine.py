"""Processors inside the real engine: the row convention with gaps, slot reuse and joins; custom
processors by FQCN (the ported FastDeploy example); order; failure isolation; timings."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import fixture_dir

from fastdeploy_lp import LLM, SamplingParams

MODEL = fixture_dir("qwen3")
NEG_INF = np.float32(-np.inf)


def make_llm(processors, max_num_seqs=8):
    return LLM(MODEL, logits_processors=processors, max_num_seqs=max_num_seqs, device="cpu",
               guided_decoding_backend="off")


def greedy(max_tokens=6, **args):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logits_processors_args=args or None)


def generate(llm, prompts, params):
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


PROMPTS = [[5, 6, 7, 5, 6], [300, 301, 302], [9, 9, 9, 9], [17, 18], [400, 401, 402, 403], [11, 12, 13],
           [700, 5, 700], [21, 22, 23, 24]]


# -- references of the processors the row test registers, in registration order ---------------------
def expected_row(before, args, history):
    out = before.copy()
    for t, b in (args.get("logit_bias") or {}).items():
        out[int(t)] = np.float32(out[int(t)] + np.float32(b))
    n = args.get("no_repeat_ngram_size")
    if n:
        prefix = tuple(history[len(history) - n + 1:])
        for i in range(len(history) - n + 1):
            if tuple(history[i:i + n - 1]) == prefix:
                out[history[i + n - 1]] = NEG_INF
    for seq in args.get("bad_words_token_ids") or []:
        if len(seq) == 1 or history[len(history) - len(seq) + 1:] == seq[:-1]:
            out[seq[-1]] = NEG_INF
    return out


def test_each_request_gets_exactly_its_own_args_with_gaps_slot_reuse_and_joins():
    llm = make_llm(["custom_processors:RecordBefore", "LogitBiasLogitsProcessor", "NoRepeatNGramLogitsProcessor",
                    "BadWordsLogitsProcessor", "custom_processors:RecordAfter"])
    engine = llm.engine
    before, after = engine.pipeline.processors[0], engine.pipeline.processors[-1]
    args = {"r0": {"bad_words_token_ids": [[7, 5], [6]]}, "r3": {"no_repeat_ngram_size": 2},
            "r7": {"logit_bias": {"5": 2.5, "900": -1.0}, "bad_words_token_ids": [[5, 5], [700]]},
            "j1": {"logit_bias": {"8": 4.0}}, "j2": {"no_repeat_ngram_size": 1}, "j3": {}}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, greedy(max_tokens=4 if i == 0 else 12, **args.get(f"r{i}", {})), f"r{i}")
    engine.step()
    for rid in ("r1", "r2", "r4", "r5", "r6"):
        engine.abort_request(rid)
    engine.step()
    occupancy = lambda: [r.request_id if r else None for r in engine.scheduler.slots]  # noqa: E731
    assert occupancy() == ["r0", None, None, "r3", None, None, None, "r7"]  # rows are slots 0, 3, 7
    engine.add_request(PROMPTS[1], greedy(max_tokens=12, **args["j1"]), "j1")
    engine.step()
    assert occupancy() == ["r0", "j1", None, "r3", None, None, None, "r7"]  # joined between running slots
    engine.step()  # r0's fourth token: it finishes and frees slot 0
    engine.add_request(PROMPTS[2], greedy(max_tokens=12, **args["j2"]), "j2")
    engine.add_request(PROMPTS[4], greedy(max_tokens=12), "j3")
    engine.step()
    assert occupancy() == ["j2", "j1", "j3", "r3", None, None, None, "r7"]  # slot 0 reused
    while engine.has_unfinished_requests():
        engine.step()

    assert len(before.steps) == len(after.steps) > 6
    checked = {rid: 0 for rid in args}
    for seen_before, seen_after in zip(before.steps, after.steps):
        assert seen_before.keys() == seen_after.keys()
        for rid, (history, logits_in) in seen_before.items():
            logits_out = seen_after[rid][1]
            if not args.get(rid):
                assert logits_out.tobytes() == logits_in.tobytes(), f"{rid}: a row without args changed"
            else:
                np.testing.assert_array_equal(logits_out, expected_row(logits_in, args[rid], history), err_msg=rid)
                checked[rid] += int(not np.array_equal(logits_out, logits_in))
    assert all(checked[rid] > 0 for rid, a in args.items() if a), checked  # every effect was exercised


def test_rows_without_args_generate_what_an_engine_without_processors_does():
    prompts, plain = PROMPTS[:4], [greedy(8)] * 4
    baseline = generate(make_llm([]), prompts, plain)
    mixed = [greedy(8, logit_bias={"5": 50.0}), greedy(8), greedy(8, no_repeat_ngram_size=1), greedy(8)]
    out = generate(make_llm(["LogitBiasLogitsProcessor", "NoRepeatNGramLogitsProcessor"]), prompts, mixed)
    assert out[1].token_ids == baseline[1].token_ids and out[3].token_ids == baseline[3].token_ids
    assert out[0].token_ids == [5] * 8
    assert len(set(out[2].token_ids) | set(prompts[2])) == len(out[2].token_ids) + len(set(prompts[2]))


def test_ported_fastdeploy_example_loads_by_fqcn_and_forces_its_token():
    prompts = PROMPTS[:3]
    baseline = generate(make_llm([]), prompts, [greedy(8)] * 3)
    llm = make_llm(["custom_processors:YourLogitsProcessor"])
    out = generate(llm, prompts, [greedy(8), greedy(8, enable_your_logits_processor=True), greedy(8)])
    assert out[1].token_ids == [42] * 8
    assert out[0].token_ids == baseline[0].token_ids and out[2].token_ids == baseline[2].token_ids
    assert type(llm.engine.pipeline.processors[0]).__module__ == "custom_processors"


def test_registration_order_changes_the_result_when_processors_do_not_commute():
    params = greedy(6, logit_bias={"8": 1000.0}, ban_argmax=True)
    bias_then_ban = generate(make_llm(["LogitBiasLogitsProcessor", "custom_processors:BanArgmaxLogitsProcessor"]),
                             [PROMPTS[0]], params)[0]
    ban_then_bias = generate(make_llm(["custom_processors:BanArgmaxLogitsProcessor", "LogitBiasLogitsProcessor"]),
                             [PROMPTS[0]], params)[0]
    assert ban_then_bias.token_ids == [8] * 6
    assert 8 not in bias_then_ban.token_ids


@pytest.mark.parametrize("where", ["update_state", "apply"])
def test_a_raising_processor_fails_only_its_requests_and_the_engine_goes_on(where):
    llm = make_llm(["custom_processors:RaisingLogitsProcessor", "LogitBiasLogitsProcessor"])
    survivors = [greedy(8), greedy(8, logit_bias={"9": 100.0})]
    alone = generate(llm, [PROMPTS[0], PROMPTS[3]], survivors)
    out = generate(llm, PROMPTS[:4], [survivors[0], greedy(8, raise_in=where), greedy(8, raise_in=where),
                                      survivors[1]])
    for failed in out[1:3]:
        assert failed.finish_reason == "error"
        assert "RaisingLogitsProcessor" in failed.error and f"boom in {where}" in failed.error
    assert [o.finish_reason for o in (out[0], out[3])] == ["length", "length"]
    assert out[0].error is None and out[3].error is None
    assert out[0].token_ids == alone[0].token_ids and out[3].token_ids == alone[1].token_ids == [9] * 8
    again = generate(llm, [PROMPTS[0]], greedy(8))[0]  # the engine serves a new request normally
    assert again.finish_reason == "length" and again.token_ids == alone[0].token_ids
    assert not llm.engine.has_unfinished_requests() and llm.engine.num_running == 0


def test_processor_timings_count_each_processor_separately():
    llm = make_llm(["LogitBiasLogitsProcessor", "NoRepeatNGramLogitsProcessor"])
    generate(llm, [PROMPTS[0], PROMPTS[1]], [greedy(5, logit_bias={"5": 1.0}), greedy(5)])
    timings = llm.engine.processor_timings()
    assert list(timings) == ["LogitBiasLogitsProcessor", "NoRepeatNGramLogitsProcessor"]
    bias, ngram = timings["LogitBiasLogitsProcessor"], timings["NoRepeatNGramLogitsProcessor"]
    assert bias["calls"] == 5 and bias["apply_seconds"] > 0 and bias["update_state_seconds"] > 0
    assert ngram["calls"] == 0 and ngram["apply_seconds"] == 0 and ngram["update_state_seconds"] > 0
    generate(llm, [PROMPTS[2]], greedy(3, no_repeat_ngram_size=2))
    later = llm.engine.processor_timings()
    assert later["NoRepeatNGramLogitsProcessor"]["calls"] == 3 and later["LogitBiasLogitsProcessor"]["calls"] == 5
    assert later["LogitBiasLogitsProcessor"]["update_state_seconds"] > bias["update_state_seconds"]


def test_allowed_tokens_and_thinking_budget_through_generate():
    llm = make_llm(["AllowedTokenIdsLogitsProcessor", "ThinkingBudgetLogitsProcessor"])
    tok = llm.tokenizer
    thinking = tok.encode("question<think>")
    out = generate(llm, [PROMPTS[0], thinking, thinking + tok.encode("ok</think>")], [
        greedy(10, allowed_token_ids=[3, 4, 5]),
        greedy(16, thinking_budget=2, think_stop_sentence="Done."),
        greedy(12, thinking_budget=0)])
    assert set(out[0].token_ids) <= {3, 4, 5}
    forced = tok.encode("Done.") + tok.encode("</think>")
    assert out[1].token_ids[2:2 + len(forced)] == forced
    assert tok.decode(forced) == "Done.</think>"
    closed = generate(llm, [thinking + tok.encode("ok</think>")], greedy(12))[0]
    assert out[2].token_ids == closed.token_ids  # thinking already closed in the prompt: untouched
