"""The reasoning parser: where thinking ends, from the prompt and the output, whole and streamed."""

from __future__ import annotations

import random

import pytest

from fastdeploy_lp.reasoning import REASONING_PARSERS, ReasoningState, ReasoningStream, get_reasoning_parser

P = REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize("prompt, state", [
    ("<|im_start|>assistant\n", ReasoningState.UNDECIDED),
    ("<|im_start|>assistant\n<think>\n", ReasoningState.REASONING),            # DeepSeek-R1's template
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", ReasoningState.ANSWER),  # Qwen3, thinking off
    ("<think>old</think> user <|im_start|>assistant\n<think>\n", ReasoningState.REASONING),
])
def test_prompt_state(prompt, state):
    assert P.prompt_state(prompt) == state


@pytest.mark.parametrize("text, state, expected", [
    ("<think>\nIt is Paris.\n</think>\n\nParis", ReasoningState.UNDECIDED, ("It is Paris.", "Paris")),
    ("Paris", ReasoningState.UNDECIDED, (None, "Paris")),
    ("It is Paris.\n</think>\n\n{\"a\": 1}", ReasoningState.REASONING, ("It is Paris.", "{\"a\": 1}")),
    ("still thinking", ReasoningState.REASONING, ("still thinking", "")),
    ("{\"a\": 1}", ReasoningState.ANSWER, (None, "{\"a\": 1}")),
    ("<think>a</think>b</think>c", ReasoningState.UNDECIDED, ("a", "b</think>c")),
])
def test_split(text, state, expected):
    assert P.split(text, state) == expected


@pytest.mark.parametrize("text, state", [
    ("<think>\nIt is Paris.\n\n</think>\n\nParis is it", ReasoningState.UNDECIDED),
    ("<thin", ReasoningState.UNDECIDED), ("Paris</think>", ReasoningState.UNDECIDED),
    ("\n\nreason</thi", ReasoningState.REASONING), ("x\n</think>\n\n\n{\"a\": \"</think>\"}", ReasoningState.REASONING),
    ("\n\n{}", ReasoningState.ANSWER),
])
def test_streamed_deltas_add_up_to_the_split(text, state):
    whole_reasoning, whole_answer = P.split(text, state)
    rng = random.Random(len(text))
    for _ in range(20):
        stream, got_r, got_a, i = ReasoningStream(P, state), "", "", 0
        while i < len(text):
            j = min(len(text), i + rng.randint(1, 4))
            r, a = stream.feed(text[i:j])
            got_r, got_a, i = got_r + r, got_a + a, j
        r, a = stream.feed("", final=True)
        got_r, got_a = got_r + r, got_a + a
        assert (got_r or None, got_a) == (whole_reasoning or None, whole_answer)


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="reasoning_parser: unknown parser 'nope'; available: qwen3, deepseek_r1"):
        get_reasoning_parser("nope")
