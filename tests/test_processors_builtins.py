"""Each built-in processor, called directly on a hand-built `share_inputs`, against a small numpy
reference written independently of it: with non-contiguous slots, a slot reused after a finish and
a request joining mid-batch; rows without args must come back bit for bit."""

from __future__ import annotations

import os

import numpy as np
import paddle
import pytest
from processor_harness import HandBatch, context_for

from fastdeploy_lp.processors import LogitsProcessorPipeline, build_processor
from fastdeploy_lp.processors.builtin.thinking_budget import marker_ids
from fastdeploy_lp.processors.registry import resolve_processor

NEG_INF = np.float32(-np.inf)
ALPHABET = [5, 6, 7, 8, 9]  # the driver prefers these tokens, so n-grams and word prefixes repeat


@pytest.fixture(scope="module")
def context():
    return context_for("qwen3")


# -- references ---------------------------------------------------------------------------------
def ref_logit_bias(x, args, history, prompt_len, tok):
    out = x.copy()
    for t, b in args.logit_bias.items():
        out[int(t)] = np.float32(out[int(t)] + np.float32(b))
    return out


def ref_bad_words(x, args, history, prompt_len, tok):
    seqs = []
    for w in args.bad_words or []:
        seqs += [tok.encode(w), tok.encode(" " + w.lstrip(" "))]
    seqs += args.bad_words_token_ids or []
    out = x.copy()
    for seq in seqs:
        k = len(seq) - 1
        if k == 0 or (len(history) >= k and history[len(history) - k:] == list(seq[:-1])):
            out[seq[-1]] = NEG_INF
    return out


def ref_no_repeat_ngram(x, args, history, prompt_len, tok):
    """transformers' `_get_ngrams` + `_get_generated_ngrams`, over prompt and output together."""
    n, out = args.no_repeat_ngram_size, x.copy()
    if len(history) + 1 < n:
        return out
    seen: dict[tuple, set] = {}
    for i in range(len(history) - n + 1):
        seen.setdefault(tuple(history[i:i + n - 1]), set()).add(history[i + n - 1])
    for t in seen.get(tuple(history[len(history) - n + 1:]), ()):
        out[t] = NEG_INF
    return out


def ref_allowed(x, args, history, prompt_len, tok):
    out = np.full_like(x, NEG_INF)
    out[args.allowed_token_ids] = x[args.allowed_token_ids]
    return out


def marker_ends(history, marker):
    return [i + len(marker) for i in range(len(history) - len(marker) + 1) if history[i:i + len(marker)] == marker]


def ref_thinking(x, args, history, prompt_len, tok):
    """Open from the prompt's last <think> with no </think> after it, else from the output's first
    <think>; the first </think> closes it for good."""
    opens, closes = marker_ends(history, tok.encode("<think>")), marker_ends(history, tok.encode("</think>"))
    prompt_open = max([e for e in opens if e <= prompt_len], default=-1)
    prompt_close = max([e for e in closes if e <= prompt_len], default=-1)
    output_opens = [e for e in opens if e > prompt_len]
    opened = prompt_len if prompt_open > prompt_close else (output_opens[0] if output_opens else -1)
    if opened < 0 or prompt_close > prompt_open or any(e > prompt_len for e in closes):
        return x.copy()
    spent = len(history) - opened - args.thinking_budget
    forced = (tok.encode(args.think_stop_sentence) if args.think_stop_sentence else []) + tok.encode("</think>")
    if not 0 <= spent < len(forced):
        return x.copy()
    out = np.full_like(x, NEG_INF)
    out[forced[spent]] = 0.0
    return out


# (reference, args of requests A, C, D, E; prompts are drawn from ALPHABET unless given)
SCENARIOS = {
    "LogitBiasLogitsProcessor": (ref_logit_bias, [
        {"logit_bias": {"5": 3.5, "100": -2.0}}, {"logit_bias": {7: 1e3}},
        {"logit_bias": {"5": -1.25}}, {"logit_bias": {"1023": 0.5, "0": 7.0}}]),
    "BadWordsLogitsProcessor": (ref_bad_words, [
        {"bad_words_token_ids": [[5, 6], [7, 8, 9], [9]]}, {"bad_words": ["hello", " world"]},
        {"bad_words_token_ids": [[6, 5], [8]], "bad_words": ["ab"]}, {"bad_words_token_ids": [[5, 5, 5, 5]]}]),
    "NoRepeatNGramLogitsProcessor": (ref_no_repeat_ngram, [
        {"no_repeat_ngram_size": 2}, {"no_repeat_ngram_size": 3}, {"no_repeat_ngram_size": 2},
        {"no_repeat_ngram_size": 3}]),  # same sizes, different lengths: rows of one group differ
    "AllowedTokenIdsLogitsProcessor": (ref_allowed, [
        {"allowed_token_ids": [5, 6, 2]}, {"allowed_token_ids": [7]}, {"allowed_token_ids": [1023, 0, 9, 9]},
        {"allowed_token_ids": list(range(300, 700))}]),
    "ThinkingBudgetLogitsProcessor": (ref_thinking, [
        {"thinking_budget": 2, "think_stop_sentence": "ok."}, {"thinking_budget": 0},
        {"thinking_budget": 1, "think_stop_sentence": "Answer now"}, {"thinking_budget": 3}]),
}


def thinking_prompts(tok):
    opened = [5, 6] + tok.encode("<think>")
    return {"A": opened, "B": opened, "C": [7] + tok.encode("<think>") + [8],
            "D": opened + [9] + tok.encode("</think>"), "E": opened}


def check_step(proc, batch, reference, rng, tok):
    proc.update_state(batch.share)
    vocab = batch.fd_config.model_config.vocab_size
    x = rng.standard_normal((len(batch.slots), vocab)).astype(np.float32)
    out = proc.apply(paddle.to_tensor(x.copy())).numpy()
    for row, slot in enumerate(batch.slots):
        args, history = batch.args(slot), batch.history(slot)
        if not proc.is_enabled_by(args):
            assert out[row].tobytes() == x[row].tobytes(), f"row {row} (slot {slot}, no args) changed"
        else:
            expected = reference(x[row], args, history, int(batch.share["prompt_lens"][slot]), tok)
            np.testing.assert_array_equal(out[row], expected, err_msg=f"row {row} slot {slot} {dict(args)} {history}")
        bonus = np.where(np.isin(np.arange(vocab), ALPHABET), 100.0, 0.0)
        batch.append(slot, int(np.argmax(out[row] + bonus)))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_matches_numpy_reference_with_gaps_slot_reuse_and_joins(name, context):
    reference, (args_a, args_c, args_d, args_e) = SCENARIOS[name]
    tok = context.tokenizer
    proc = build_processor(resolve_processor(name), context)
    batch, rng = HandBatch(context), np.random.default_rng(0)
    prompts = thinking_prompts(tok) if name.startswith("Thinking") else \
        {k: list(rng.choice(ALPHABET, n)) for k, n in zip("ABCDE", (6, 3, 9, 2, 5))}

    batch.place(0, prompts["A"], args_a)
    batch.place(3, prompts["B"])              # no args: untouched
    batch.place(7, prompts["C"], args_c)      # active slots 0, 3, 7
    for _ in range(4):
        check_step(proc, batch, reference, rng, tok)
    batch.free(3)
    batch.place(3, prompts["D"], args_d)      # slot 3 reused by a request with args
    batch.place(5, prompts["E"], args_e)      # joins between running slots
    for _ in range(4):
        check_step(proc, batch, reference, rng, tok)
    batch.free(0)
    batch.free(7)
    batch.place(7, prompts["B"])              # slot 7 reused by a request without args
    for _ in range(3):
        check_step(proc, batch, reference, rng, tok)


def drive(proc, batch, tokens_per_step, vocab=1024):
    """Run steps appending the given tokens to slot 0; return the processed row of each step."""
    rows = []
    for token in tokens_per_step:
        proc.update_state(batch.share)
        rows.append(proc.apply(paddle.zeros([len(batch.slots), vocab])).numpy()[batch.slots.index(0)])
        batch.append(0, token)
    return rows


def banned(row):
    return sorted(np.flatnonzero(np.isneginf(row)).tolist())


@pytest.mark.parametrize("n", [1, 4])
def test_no_repeat_ngram_sizes_one_and_four(n, context):
    proc = build_processor(resolve_processor("NoRepeatNGramLogitsProcessor"), context)
    batch, rng = HandBatch(context), np.random.default_rng(n)
    batch.place(1, [5, 6, 7, 5, 6, 7, 5, 6], {"no_repeat_ngram_size": n})
    batch.place(4, [5, 6], {"no_repeat_ngram_size": n})
    for _ in range(5):
        check_step(proc, batch, ref_no_repeat_ngram, rng, context.tokenizer)


def test_no_repeat_ngram_keeps_a_ban_that_thousands_of_windows_name(context):
    """Thousands of windows name the same (row, token), half of them hits. The processor used to
    add -inf and 0 with an accumulating index_put_, whose CPU kernel races on repeated indices
    (a direct check lost the -inf in 37 of 200 trials); the mask it writes now is idempotent."""
    paddle.base.core.set_num_threads(max(2, len(os.sched_getaffinity(0))))  # as the engine runs
    proc = build_processor(resolve_processor("NoRepeatNGramLogitsProcessor"), context)
    batch = HandBatch(context)
    batch.place(0, [1, 5, 2, 5] * 1000 + [1], {"no_repeat_ngram_size": 2})  # "1 5" bans 5; "2 5" does not
    proc.update_state(batch.share)
    for _ in range(30):
        assert banned(proc.apply(paddle.zeros([1, 1024])).numpy()[0]) == [5]


def test_no_repeat_ngram_bans_across_the_prompt_output_boundary(context):
    proc = build_processor(resolve_processor("NoRepeatNGramLogitsProcessor"), context)
    batch = HandBatch(context)
    batch.place(0, [1, 2, 3, 9, 1], {"no_repeat_ngram_size": 3})
    rows = drive(proc, batch, [2, 4, 9, 1])
    assert banned(rows[0]) == []           # history ...9 1: "9 1" not seen before as a prefix
    assert banned(rows[1]) == [3]          # ...1 2: "1 2 3" in the prompt
    assert banned(rows[2]) == []           # ...2 4
    assert banned(rows[3]) == []           # ...4 9
    proc.update_state(batch.share)         # ...9 1: "9 1 2" spans the prompt/output boundary
    assert banned(proc.apply(paddle.zeros([1, 1024])).numpy()[0]) == [2]


def test_multi_token_bad_words_are_banned_only_as_a_whole_sequence(context):
    proc = build_processor(resolve_processor("BadWordsLogitsProcessor"), context)
    batch = HandBatch(context)
    batch.place(0, [4, 7], {"bad_words_token_ids": [[7, 8, 9], [3]]})
    rows = drive(proc, batch, [8, 1, 7, 8])
    assert banned(rows[0]) == [3]          # ...7: "7 8 9" not yet completable
    assert banned(rows[1]) == [3, 9]       # ...7 8 (7 from the prompt, 8 generated)
    assert banned(rows[2]) == [3]
    assert banned(rows[3]) == [3]
    proc.update_state(batch.share)
    assert banned(proc.apply(paddle.zeros([1, 1024])).numpy()[0]) == [3, 9]


def test_bad_words_tokenizes_words_with_and_without_a_leading_space(context):
    tok = context.tokenizer
    proc = build_processor(resolve_processor("BadWordsLogitsProcessor"), context)
    batch = HandBatch(context)
    batch.place(0, [5], {"bad_words": ["e"]})
    proc.update_state(batch.share)
    out = proc.apply(paddle.zeros([1, 1024])).numpy()[0]
    assert banned(out) == sorted({tok.encode("e")[-1], tok.encode(" e")[-1]})


def forced(row):
    finite = np.flatnonzero(np.isfinite(row))
    return int(finite[0]) if len(finite) == 1 else None


def test_thinking_budget_forces_stop_sentence_then_close_after_the_budget(context):
    tok = context.tokenizer
    proc = build_processor(resolve_processor("ThinkingBudgetLogitsProcessor"), context)
    batch = HandBatch(context)
    batch.place(0, [5] + tok.encode("<think>"), {"thinking_budget": 3, "think_stop_sentence": "ok."})
    plan = tok.encode("ok.") + tok.encode("</think>")
    rows = drive(proc, batch, [11, 12, 13] + plan + [14, 15])
    assert [forced(r) for r in rows] == [None] * 3 + plan + [None, None]


def test_thinking_budget_counts_from_a_think_opened_in_the_output(context):
    tok = context.tokenizer
    proc = build_processor(resolve_processor("ThinkingBudgetLogitsProcessor"), context)
    batch = HandBatch(context)
    batch.place(0, [5, 6], {"thinking_budget": 1})
    opening, close = tok.encode("<think>"), tok.encode("</think>")
    rows = drive(proc, batch, [20] + opening + [21] + close + [22])
    assert [forced(r) for r in rows] == [None] * (1 + len(opening) + 1) + close + [None]


def test_thinking_budget_leaves_closed_thinking_alone(context):
    tok = context.tokenizer
    proc = build_processor(resolve_processor("ThinkingBudgetLogitsProcessor"), context)
    batch = HandBatch(context)
    batch.place(0, tok.encode("<think>") + [7] + tok.encode("</think>"), {"thinking_budget": 0})
    assert [forced(r) for r in drive(proc, batch, [1, 2, 3])] == [None] * 3
    batch.free(0)  # thinking the model closed itself, before the budget
    batch.place(0, tok.encode("<think>"), {"thinking_budget": 50})
    rows = drive(proc, batch, [1] + tok.encode("</think>") + list(range(60, 120)))
    assert all(forced(r) is None for r in rows)


def test_thinking_budget_reads_several_tokens_at_once_as_it_reads_them_one_by_one(context):
    """Accepted drafts arrive several tokens a step: a second `<think>` neither restarts the budget
    nor, after `</think>`, reopens thinking, exactly as when the same tokens come one per step."""
    tok = context.tokenizer
    opening, close = tok.encode("<think>"), tok.encode("</think>")
    output = [20] + opening + [21] + opening + [22] * 6 + close + opening + [23] * 8
    for prompt, budget in (([5, 6], 4), ([5] + opening, 2), ([5] + opening + [6] + close, 0)):
        seen = {}
        for every in (1, 2, 3):  # update_state after every token, every second, every third
            proc = build_processor(resolve_processor("ThinkingBudgetLogitsProcessor"), context)
            batch = HandBatch(context)
            batch.place(0, prompt, {"thinking_budget": budget})
            for i, token in enumerate(output):
                if i % every == 0:
                    proc.update_state(batch.share)
                    row = proc.apply(paddle.zeros([1, 1024])).numpy()[0]
                    seen.setdefault(i, set()).add(forced(row))
                    assert forced(row) == forced(ref_thinking(np.zeros(1024, np.float32), proc.args_model(
                        thinking_budget=budget), prompt + output[:i], len(prompt), tok)), (prompt, every, i)
                batch.append(0, token)
        assert all(len(v) == 1 for v in seen.values()), (prompt, seen)


def test_thinking_budget_uses_single_think_tokens_when_the_vocabulary_has_them():
    class Vocab:
        def token_to_id(self, t):
            return {"<think>": 1000, "</think>": 1001}.get(t)

        def encode(self, text):
            raise AssertionError("markers that are tokens must not be spelled out")

    assert marker_ids(Vocab(), "<think>") == [1000] and marker_ids(Vocab(), "</think>") == [1001]


def test_registration_order_matters_for_processors_that_do_not_commute(context):
    """Forcing sets the forced token's logit; a bias adds to it: bias→force != force→bias."""
    tok = context.tokenizer
    close = tok.encode("</think>")
    args = {"thinking_budget": 0, "logit_bias": {close[0]: 5.0}}
    results = []
    for names in (["LogitBiasLogitsProcessor", "ThinkingBudgetLogitsProcessor"],
                  ["ThinkingBudgetLogitsProcessor", "LogitBiasLogitsProcessor"]):
        pipeline = LogitsProcessorPipeline(context, names)
        batch = HandBatch(context)
        batch.place(2, tok.encode("<think>"), args)
        pipeline.update_state(batch.share)
        out, failures = pipeline.apply(paddle.zeros([1, 1024]), batch.share, all_greedy=True)
        assert not failures
        results.append(out.numpy()[0, close[0]])
    assert results == [0.0, 5.0]
