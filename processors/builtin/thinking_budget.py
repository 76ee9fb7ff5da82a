"""`ThinkingBudgetLogitsProcessor`: cap how long a reasoning model thinks.

Request:

    {"logits_processors_args": {"thinking_budget": 256, "think_stop_sentence": "Time to answer."}}

For models whose template wraps reasoning in `<think>` ... `</think>`. The processor counts the
tokens generated since `<think>` opened (in the prompt, when the chat template opens thinking, or
in the output); once `thinking_budget` of them are spent it forces the tokens of
`think_stop_sentence` (if given) and then `</think>`, one per step, by masking every other token.
Thinking is open from the prompt's last `<think>` when no `</think>` follows it, or else from the
output's first `<think>`; the first `</think>` closes it for good, so a request whose prompt or output
already closed thinking is left alone (a later `<think>`, say inside a JSON string of the answer,
does not reopen it). The markers are the tokenizer's `<think>`/`</think>` tokens, or the tokens that spell
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
from fastdeploy_lp.sampling_params import INT32_MAX

_EMPTY = np.zeros(0, dtype=np.int64)


class ThinkingBudgetArgs(BaseModel):
    thinking_budget: Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)] | None = Field(
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


def marker_ends(history: np.ndarray, marker: list[int]) -> np.ndarray:
    """The positions just after each occurrence of `marker` in `history`, ascending."""
    k = len(marker)
    if len(history) < k:
        return _EMPTY
    windows = np.lib.stride_tricks.sliding_window_view(history, k)
    return np.flatnonzero(np.all(windows == np.asarray(marker), axis=1)) + k


class ThinkingBudgetLogitsProcessor(LogitsProcessor):
    """Caps how long a reasoning model thinks, per request.

    For models whose template wraps reasoning in `<think>` ... `</think>`. Once `thinking_budget`
    tokens were generated since `<think>` opened (in the prompt or in the output), it forces the
    tokens of `think_stop_sentence` (if given) and then `</think>`, one per step. A request whose
    prompt or output already closed thinking is left alone, even if `<think>` comes again. The markers are the tokenizer's
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
    supports_speculation = True  # accepted drafts are read as `_advance` reads one token at a time
    runs_in_place = True  # batched tensor work, bounded by the request limits
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
        """Set the slot's state from its whole history, as `_advance` would have reached it token by
        token from the prompt's: the prompt opened thinking if its last `<think>` comes after its last
        `</think>`; in the output, the first `</think>` closes it for good and, while it is neither open
        nor closed, the first `<think>` opens it. (Accepted drafts arrive several tokens at once: both
        readings must agree, or a draft would change where `</think>` is forced.)"""
        history = self._history.ids[slot, : self._history.lengths[slot]]
        prompt_len = int(share_inputs["prompt_lens"][slot])
        opens, closes = marker_ends(history, self._open.tolist()), marker_ends(history, self._close.tolist())
        prompt_opened, prompt_closed = (int(e[-1]) if len(e) else -1 for e in
                                        (opens[opens <= prompt_len], closes[closes <= prompt_len]))
        output_opens = opens[opens > prompt_len]
        self._closed[slot] = prompt_closed > prompt_opened or (closes > prompt_len).any()
        if prompt_opened > prompt_closed:
            self._opened[slot] = 0
        else:
            self._opened[slot] = int(output_opens[0]) - prompt_len if len(output_opens) else -1
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
