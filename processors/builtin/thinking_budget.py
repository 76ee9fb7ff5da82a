"""`ThinkingBudgetLogitsProcessor`: cap how long a reasoning model thinks.

Request:

    {"logits_processors_args": {"thinking_budget": 256, "think_stop_sentence": "Time to answer."}}

For models whose template wraps reasoning in `<think>` ... `</think>`. The processor counts the
tokens generated since `<think>` opened (in the prompt, when the chat template opens thinking, or
in the output); once `thinking_budget` of them are spent it forces the tokens of
`think_stop_sentence` (if given) and then `</think>`, one per step, by masking every other token.
A request whose prompt or output already closed thinking (`</think>` after the last `<think>`) is
left alone. The markers are the tokenizer's `<think>`/`</think>` tokens, or the tokens that spell
them when the vocabulary has no such tokens.

State is per slot (numpy), set from the whole history when a request joins and advanced one token
a step, for all rows at once, by comparing the tail of each row with the markers.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import BaseModel, Field, model_validator

from ..base import LogitsProcessor, active_slots, batch_key
from ..tensor_ops import fill_at, index_tensor
from ..token_history import TokenHistory


class ThinkingBudgetArgs(BaseModel):
    thinking_budget: Annotated[int, Field(strict=True, ge=0)] | None = Field(
        None, description="most tokens generated inside <think> before </think> is forced")
    think_stop_sentence: Annotated[str, Field(strict=True)] | None = Field(
        None, description="text forced before </think> when the budget is spent")

    @model_validator(mode="after")
    def _budget_given(self):
        if self.think_stop_sentence is not None and self.thinking_budget is None:
            raise ValueError("think_stop_sentence needs thinking_budget")
        return self


def marker_ids(tokenizer, marker: str) -> list[int]:
    """The id of `marker` if it is one token of the vocabulary, else the ids that spell it."""
    token = tokenizer.token_to_id(marker)
    return [token] if token is not None else tokenizer.encode(marker)


def last_end(history: np.ndarray, marker: list[int]) -> int:
    """The position just after the last occurrence of `marker` in `history`, or -1."""
    k = len(marker)
    if len(history) < k:
        return -1
    windows = np.lib.stride_tricks.sliding_window_view(history, k)
    hits = np.flatnonzero(np.all(windows == np.asarray(marker), axis=1))
    return int(hits[-1]) + k if len(hits) else -1


class ThinkingBudgetLogitsProcessor(LogitsProcessor):
    args_model = ThinkingBudgetArgs

    def __init__(self, fd_config):
        super().__init__(fd_config)
        tokenizer = fd_config.tokenizer
        self._open = np.array(marker_ids(tokenizer, "<think>"), np.int64)
        self._close = np.array(marker_ids(tokenizer, "</think>"), np.int64)
        self._history = TokenHistory()
        self._key = None
        self._rows = self._slots = self._budget = np.zeros(0, np.int64)
        self._forced = np.zeros((0, 1), np.int64)  # per enabled row: stop sentence + </think>, -1 padded
        self._forced_len = np.zeros(0, np.int64)
        self._owner: list = []  # per slot: the request whose state the arrays below hold
        self._opened = self._seen = np.zeros(0, np.int64)  # per slot: output index where thinking began (-1)
        self._closed = np.zeros(0, bool)
        self._force = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # (rows, token) to force this step

    def update_state(self, share_inputs):
        slots = active_slots(share_inputs)
        key = batch_key(share_inputs, slots)
        if key != self._key:
            self._rebuild(share_inputs, slots)
            self._key = key
        self._force = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        if len(self._slots) == 0:
            return
        self._history.update(share_inputs, self._slots)
        step_idx = share_inputs["step_idx"]
        grew = step_idx[self._slots] - self._seen[self._slots]
        for slot in self._slots[(grew != 0) & (grew != 1)]:  # rare: several tokens since the last step
            self._scan(share_inputs, slot)
        self._advance(self._slots[grew == 1], step_idx)
        step, opened = step_idx[self._slots], self._opened[self._slots]
        done = step - opened - self._budget  # forced tokens emitted so far, once the budget is spent
        force = np.flatnonzero((opened >= 0) & ~self._closed[self._slots] & (done >= 0) & (done < self._forced_len))
        self._force = (self._rows[force], self._forced[force, done[force]])

    def _rebuild(self, share_inputs, slots):
        n = len(share_inputs["stop_flags"])
        if len(self._owner) != n:
            self._owner = [None] * n
            self._opened, self._seen, self._closed = np.full(n, -1, np.int64), np.zeros(n, np.int64), np.zeros(n, bool)
        rows, enabled, budgets, forced = [], [], [], []
        for row, slot in enumerate(slots):
            args = share_inputs["logits_processors_args"][slot]
            if args.thinking_budget is None:
                continue
            rows.append(row)
            enabled.append(slot)
            budgets.append(int(args.thinking_budget))
            sentence = self.fd_config.tokenizer.encode(args.think_stop_sentence) if args.think_stop_sentence else []
            forced.append(list(sentence) + self._close.tolist())
        self._rows, self._slots = np.array(rows, np.int64), np.array(enabled, np.int64)
        self._budget = np.array(budgets, np.int64)
        self._forced_len = np.array([len(f) for f in forced], np.int64)
        self._forced = np.full((len(forced), max(self._forced_len, default=1)), -1, np.int64)
        for i, f in enumerate(forced):
            self._forced[i, : len(f)] = f
        self._history.update(share_inputs, self._slots)
        for slot in self._slots:  # a request new to its slot: read its state from the whole history
            owner = int(share_inputs["admission_ids"][slot])
            if self._owner[slot] != owner:
                self._owner[slot] = owner
                self._scan(share_inputs, slot)

    def _scan(self, share_inputs, slot):
        """Set the slot's state from its whole history (when it joins)."""
        history = self._history.ids[slot, : self._history.lengths[slot]]
        prompt_len = int(share_inputs["prompt_lens"][slot])
        opened, closed = last_end(history, self._open.tolist()), last_end(history, self._close.tolist())
        self._closed[slot] = closed > opened
        self._opened[slot] = max(opened - prompt_len, 0) if opened > closed else -1
        self._seen[slot] = share_inputs["step_idx"][slot]

    def _advance(self, slots, step_idx):
        """Slots that generated one token since the last step: did it complete a marker?"""
        if len(slots) == 0:
            return
        tails = self._history.tails(slots, max(len(self._open), len(self._close)))
        opens = np.all(tails[:, tails.shape[1] - len(self._open):] == self._open, axis=1)
        closes = np.all(tails[:, tails.shape[1] - len(self._close):] == self._close, axis=1)
        self._closed[slots] |= closes
        starts = opens & (self._opened[slots] < 0) & ~self._closed[slots]
        self._opened[slots[starts]] = step_idx[slots[starts]]
        self._seen[slots] = step_idx[slots]

    def apply(self, logits):
        rows, tokens = self._force
        if len(rows) == 0:
            return logits
        logits[index_tensor(rows, logits)] = float("-inf")
        return fill_at(logits, rows, tokens, 0.0)
