"""A constrained request's per-slot state in the guided processor: its llguidance matcher and how
far through the output it is (`SlotMatcher`), where a reasoning model's answer starts
(`ReasoningGate`), and its way through a verify pass's drafts (`DraftWalk`)."""

from __future__ import annotations

import copy
from collections import deque

import llguidance as llg

from fastdeploy_lp.processors.guided.closing import ClosingFailed, LengthCloser
from fastdeploy_lp.processors.guided.grammar_text import clean_error
from fastdeploy_lp.reasoning import ReasoningState
from fastdeploy_lp.sampling_params import CLOSED_ON_LENGTH


class ReasoningGate:
    """Where a reasoning model's answer starts (engines with a reasoning parser).

    Tokens before it are the model's own thinking: no mask, and the matcher does not see them. An
    output that may open a reasoning block (`UNDECIDED`) gets, at its first step, the constraint's
    tokens plus the first token of the start tag; picking the latter forces the rest of the tag. The
    end tag is found in the bytes of the tokens, however the model split it into tokens.
    """

    def __init__(self, parser, state: ReasoningState, start_ids: list[int], end_ids: list[int],
                 token_bytes: list[bytes]):
        self.state = state
        # The rest of the start tag follows its first token only where the output opens the block;
        # a prompt that opened it (the template's "<think>\n") needs nothing forced.
        self.start_first = start_ids[0]
        self.forced_start = start_ids[1:] if state == ReasoningState.UNDECIDED else []
        self.end_ids = end_ids  # forced when a request that closes on length must stop thinking
        self._end = parser.end.encode()
        self._token_bytes = token_bytes
        self._tail = b""

    def takes(self, token: int) -> tuple[bool, str | None]:
        """(whether the token is part of the thinking, an error message)."""
        if self.state == ReasoningState.ANSWER:
            return False, None
        if self.state == ReasoningState.UNDECIDED:
            if token == self.start_first:
                self.state = ReasoningState.REASONING
                return True, None
            self.state = ReasoningState.ANSWER
            return False, None
        self._tail += self._token_bytes[token] if 0 <= token < len(self._token_bytes) else b""
        at = self._tail.find(self._end)
        if at < 0:
            self._tail = self._tail[-(len(self._end) - 1):]
            return True, None
        self.state = ReasoningState.ANSWER
        if self._tail[at + len(self._end):].strip():
            return True, ("guided decoding: the end of the reasoning was generated merged with answer text, "
                          "so the constraint cannot start at it")
        return True, None

    def take_forced_start(self) -> list[int]:
        forced, self.forced_start = self.forced_start, []
        return forced


class SlotMatcher:
    """One request's matcher and how far through the request's output it is."""

    def __init__(self, matcher: llg.LLMatcher, output_ids: list[int], gate: ReasoningGate | None = None,
                 closer: LengthCloser | None = None, params=None, req_id: str | None = None):
        self.matcher = matcher
        self.output_ids = output_ids  # the request's live list
        self.gate = gate
        self.closer = closer  # close_on_length: the request's reserve and closing
        self.params = params
        self.req_id = req_id
        self.consumed = 0  # output tokens accounted for
        self.ahead: deque[int] = deque()  # published forced tokens the matcher has consumed already
        self.failure: str | None = None  # set where a failure cannot be raised (refine_drafts)

    @property
    def budget(self) -> int:
        """Tokens the request may still generate after those the matcher has consumed."""
        return self.params.max_tokens - len(self.output_ids) - len(self.ahead)

    @property
    def answering(self) -> bool:
        """Whether the constraint applies now (always, without a reasoning parser)."""
        return self.gate is None or self.gate.state == ReasoningState.ANSWER

    def step(self, forced: list[int] | None) -> str | None:
        """One decode step: `advance`, then `publish_forced` (when the engine takes forced tokens);
        an error message if either fails or the matcher is left in an error state."""
        error = self.failure or self.advance()
        if error is None and forced is not None:
            error = self.publish_forced(forced)
        if error is None and self.matcher.is_error():
            error = f"guided decoding: the grammar engine failed: {self.error()}"
        return error

    def advance(self) -> str | None:
        """Consume the tokens generated since the last call; an error message if one is rejected."""
        for token in self.output_ids[self.consumed:]:
            self.consumed += 1
            if self.gate is not None:
                thinking, error = self.gate.takes(token)
                if error is not None:
                    return error
                if thinking:
                    continue
            if self.ahead and self.ahead[0] == token:  # a forced token we published, now in the output
                self.ahead.popleft()
                continue
            if self.ahead:  # the output went another way: forget what we had assumed
                self.matcher.rollback(len(self.ahead))
                if self.closer is not None:
                    self.closer.rolled_back(len(self.ahead))
                self.ahead.clear()
            if not self.matcher.consume_token(token):
                return f"guided decoding: generated token does not fit the constraint: {self.error()}"
            if self.closer is not None:
                self.closer.consumed([token])
        return None

    def publish_forced(self, forced: list[int]) -> str | None:
        """Append the tokens the grammar forces next to `forced` (share_inputs["forced_tokens"][slot])
        and consume them now, as the engine's contract asks; they come back through `output_ids`.
        An error message if the matcher cannot take them (it hit one of llguidance's limits)."""
        if not self.answering:  # nothing of the constraint yet; after an opened start tag, its rest
            if self.gate.state == ReasoningState.REASONING:
                forced.extend(self.gate.take_forced_start())
                if not forced and self.closer is not None:  # thinking must end while the answer can close
                    forced.extend(self.closer.thinking_end_due(self.matcher, self.budget, self.gate.end_ids))
            return None
        if self.ahead or forced or self.matcher.is_stopped():  # tokens queued ahead of the output: wait
            return None
        try:
            closing = self.closer.closing_due(self.matcher, self.budget) if self.closer is not None else None
        except ClosingFailed as e:  # never a silently invalid output
            return str(e)
        if closing:  # the budget left is the closing's length: it is the rest of the output
            self.params.extra[CLOSED_ON_LENGTH].add(self.req_id)
        tokens = closing or self.matcher.compute_ff_tokens()
        if tokens:
            if not self.matcher.consume_tokens(tokens):
                return f"guided decoding: the grammar engine failed on the forced tokens: {self.error()}"
            if self.closer is not None:
                self.closer.consumed(tokens, forced=not closing)
            self.ahead.extend(tokens)
            forced.extend(tokens)
        return None

    def error(self) -> str:
        return clean_error(self.matcher.get_error()) or "unknown error"


class DraftWalk:
    """One slot's way through its drafts in a verify pass: the drafts taken (`walked`) and those its
    matcher consumed (`consumed`). The slot's reasoning gate and length closer are copies while the
    drafts are walked; `restore` puts the step's own back and rolls the matcher back."""

    def __init__(self, state: SlotMatcher):
        self.gate, self.closer = state.gate, state.closer
        state.gate = copy.copy(state.gate)
        state.closer = None if state.closer is None else state.closer.copy()
        self.walked = self.consumed = 0
        self.rejected = False  # a draft the grammar rejects: the rows after it are never used

    def take(self, state: SlotMatcher, drafts: list[int]) -> str | None:
        """Take the slot's drafts not taken yet; an error message where the gate cannot take one."""
        for token in drafts:
            if self.rejected:
                return None
            if not state.answering:
                thinking, error = state.gate.takes(token)
                if error is not None:
                    return error
                if thinking:
                    self.walked += 1
                    continue
            if not state.matcher.validate_tokens([token]):
                self.rejected = True
                return None
            if not state.matcher.consume_token(token):
                raise RuntimeError(f"the grammar engine failed on a validated draft: {state.error()}")
            if state.closer is not None:
                state.closer.consumed([token])
            self.walked += 1
            self.consumed += 1
        return None

    def near_closing(self, state: SlotMatcher) -> bool:
        """Whether the request closes on length and its closing may be due here, where plain
        decoding decides step by step (`LengthCloser.dormant`)."""
        return state.closer is not None and not state.closer.dormant(state.budget - self.walked)

    def restore(self, state: SlotMatcher) -> bool:
        """The step's own gate and closer back, the matcher rolled back; False if it cannot be."""
        state.gate, state.closer = self.gate, self.closer
        return not self.consumed or state.matcher.rollback(self.consumed)
