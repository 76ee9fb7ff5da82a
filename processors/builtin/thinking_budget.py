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

State is per slot (numpy), set from the whole history when a request joins (the only per-request
work; the others' rows are re-indexed) and advanced one token a step, for all rows at once, by
comparing the tail of each row with the markers.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import BaseModel, Field, model_validator

from fastdeploy_lp.config import FDConfig
from fastdeploy_lp.processors.base import AddedRequest, LogitsProcessor, ShareInputs
from fastdeploy_lp.processors.batch_state import BatchTracker, RowEntries
from fastdeploy_lp.processors.context import EngineContext
from fastdeploy_lp.processors.tensor_ops import fill_at, index_tensor
from fastdeploy_lp.processors.token_history import TokenHistory

_EMPTY = np.zeros(0, dtype=np.int64)


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
    """Caps how long a reasoning model thinks, per request.

    For models whose template wraps reasoning in `<think>` ... `</think>`. Once `thinking_budget`
    tokens were generated since `<think>` opened (in the prompt or in the output), it forces the
    tokens of `think_stop_sentence` (if given) and then `</think>`, one per step. A request whose
    prompt or output already closed thinking is left alone. The markers are the tokenizer's
    `<think>`/`</think>` tokens, or the tokens that spell them.

    Args:
        thinking_budget (`int`, *optional*):
            Most tokens (>= 0) generated inside `<think>` before `</think>` is forced.
        think_stop_sentence (`str`, *optional*):
            Text forced before `</think>` once the budget is spent; needs `thinking_budget`.
            Both keys are read per request from `logits_processors_args`.

    Examples:

    ```python
    >>> from fastdeploy_lp import LLM, SamplingParams
    >>> llm = LLM(logits_processors=["ThinkingBudgetLogitsProcessor"])  # the built-in default model
    >>> question = [{"role": "user", "content": "What is 17 times 23?"}]
    >>> params = SamplingParams(temperature=0, max_tokens=40, logits_processors_args={
    ...     "thinking_budget": 5, "think_stop_sentence": " Time to answer."})
    >>> text = llm.chat(question, params, chat_template_kwargs={"enable_thinking": True},
    ...                 use_tqdm=False)[0].outputs.text
    >>> text.split("</think>")[0].endswith(" Time to answer.")
    True

    ```
    """
    args_model = ThinkingBudgetArgs
    uses_engine_context = True  # the tokenizer: <think> markers and stop sentences

    def __init__(self, fd_config: FDConfig, context: EngineContext):
        super().__init__(fd_config)
        self.tokenizer = tokenizer = context.tokenizer
        self._open = np.array(marker_ids(tokenizer, "<think>"), np.int64)
        self._close = np.array(marker_ids(tokenizer, "</think>"), np.int64)
        self._batch = BatchTracker()
        self._history = TokenHistory()
        self._budgets = RowEntries(forced=-1)  # per enabled request: budget; stop sentence + </think>, right-aligned
        self._opened = self._seen = _EMPTY  # per slot: output index where thinking began (-1); tokens seen
        self._closed = np.zeros(0, bool)
        self._force = (_EMPTY, _EMPTY)  # (rows, token) to force this step

    def update_state(self, share_inputs: ShareInputs) -> None:
        update = self._batch.update(share_inputs)
        if len(self._closed) != len(share_inputs["stop_flags"]):
            n = len(share_inputs["stop_flags"])
            self._opened, self._seen, self._closed = np.full(n, -1, np.int64), np.zeros(n, np.int64), np.zeros(n, bool)
        self._budgets.update(update, self.entries)
        self._force = (_EMPTY, _EMPTY)
        slots = self._budgets.slots
        if len(slots) == 0:
            return
        self._history.update(share_inputs, slots)
        for slot in np.intersect1d([r.slot for r in update.added], slots):  # joined: read the whole history
            self._scan(share_inputs, slot)
        step_idx = share_inputs["step_idx"]
        grew = step_idx[slots] - self._seen[slots]
        for slot in slots[(grew != 0) & (grew != 1)]:  # rare: several tokens since the last step
            self._scan(share_inputs, slot)
        self._advance(slots[grew == 1], step_idx)
        budget, count, forced = (self._budgets.columns[k] for k in ("budget", "count", "forced"))
        step, opened = step_idx[slots], self._opened[slots]
        done = step - opened - budget  # forced tokens emitted so far, once the budget is spent
        force = np.flatnonzero((opened >= 0) & ~self._closed[slots] & (done >= 0) & (done < count))
        self._force = (self._budgets.rows[force], forced[force, forced.shape[1] - count[force] + done[force]])

    def entries(self, request: AddedRequest) -> dict[str, np.ndarray] | None:
        """A joining request's budget and the tokens it forces once the budget is spent."""
        args = request.args
        if args.thinking_budget is None:
            return None
        sentence = self.tokenizer.encode(args.think_stop_sentence) if args.think_stop_sentence else []
        forced = list(sentence) + self._close.tolist()
        return {"budget": np.array([args.thinking_budget], np.int64), "count": np.array([len(forced)], np.int64),
                "forced": np.array([forced], np.int64)}

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
