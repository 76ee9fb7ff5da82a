"""Reasoning models: where the thinking ends and the answer starts.

Qwen3 and DeepSeek-R1 write their reasoning between `<think>` and `</think>`. With a reasoning
parser (`--reasoning-parser qwen3`, `LLM(reasoning_parser="deepseek_r1")`) the server returns it
as `reasoning_content`, apart from `content`, and output constraints (JSON, tools) apply from the
end of the reasoning, so a model can think freely and then answer in schema.

Where the output starts is read from the prompt the chat template wrote:

* the prompt ends inside an open `<think>` (DeepSeek-R1's template adds it): the output starts
  in the reasoning;
* the prompt's last `<think>` is closed (Qwen3 with `enable_thinking: false` writes an empty
  block): there is no reasoning, the output is all answer;
* otherwise the model decides: an output that starts with `<think>` reasons until `</think>`, one
  that does not is all answer.

    parser = REASONING_PARSERS["qwen3"]
    parser.split("<think>\\nIt is Paris.\\n</think>\\n\\nParis", parser.prompt_state("..."))
    # -> ("It is Paris.", "Paris")
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ReasoningState(str, Enum):
    UNDECIDED = "undecided"      # the output may open a reasoning block first
    REASONING = "reasoning"      # inside the reasoning
    ANSWER = "answer"            # past the reasoning (or none at all)


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"

    def prompt_state(self, prompt: str) -> ReasoningState:
        """Where the output starts, from the end of the rendered prompt."""
        opened = prompt.rfind(self.start)
        if opened < 0:
            return ReasoningState.UNDECIDED
        closed = prompt.rfind(self.end)
        return ReasoningState.ANSWER if closed > opened else ReasoningState.REASONING

    def split(self, text: str, state: ReasoningState) -> tuple[str | None, str]:
        """(reasoning or None, answer) of a whole output that started in `state`."""
        stream = ReasoningStream(self, state)
        reasoning, answer = stream.feed(text, final=True)
        return (reasoning if stream.reasoned else None), answer


class ReasoningStream:
    """Splits streamed text deltas into (reasoning delta, answer delta) as they arrive. What it
    holds back is only what could still change meaning: a suffix that may start a tag, and newlines
    that may turn out to border the reasoning (`split` drops those). The concatenated deltas equal
    `split` of the whole text."""

    def __init__(self, parser: ReasoningParser, state: ReasoningState):
        self.parser = parser
        self.state = state
        self._pending = ""
        self._reasoning_started = False
        self._answer_started = state == ReasoningState.ANSWER  # only an answer after </think> is trimmed
        self.reasoned = state == ReasoningState.REASONING  # whether the output had a reasoning part

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text, self._pending = self._pending + delta, ""
        if self.state == ReasoningState.UNDECIDED:
            stripped = text.lstrip()
            if stripped.startswith(self.parser.start):
                text, self.state = stripped[len(self.parser.start):], ReasoningState.REASONING
                self.reasoned = True
            elif self.parser.start.startswith(stripped) and not final:
                self._pending = text  # may still become the opening tag
                return "", ""
            else:
                self.state, self._answer_started = ReasoningState.ANSWER, True
        reasoning = ""
        if self.state == ReasoningState.REASONING:
            head, found, tail = text.partition(self.parser.end)
            if found:
                reasoning, text, self.state = self._reasoning(head.rstrip("\n")), tail, ReasoningState.ANSWER
            else:
                if final:  # the reasoning never closed: it is all there is
                    return self._reasoning(text.rstrip("\n")), ""
                body = text[:len(text) - _partial_suffix(text, self.parser.end)]
                held = len(body) - len(body.rstrip("\n"))
                self._pending = text[len(body) - held:]
                return self._reasoning(body[:len(body) - held]), ""
        if not self._answer_started:
            text = text.lstrip("\n")
            self._answer_started = bool(text)
        return reasoning, text

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip("\n")
            self._reasoning_started = bool(text)
        return text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


REASONING_PARSERS = {name: ReasoningParser(name) for name in ("qwen3", "deepseek_r1")}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; available: "
                         f"{', '.join(REASONING_PARSERS)}") from None
