"""`NoRepeatNGramLogitsProcessor`: never repeat an n-gram of the text so far.

Request:

    {"logits_processors_args": {"no_repeat_ngram_size": 3}}

As `transformers`' `NoRepeatNGramLogitsProcessor`: the n-grams are those of the prompt and the
output together (so one that spans the prompt/output boundary counts), and a token is banned when
it would complete an n-gram that already occurs, i.e. when the last n-1 tokens equal the first
n-1 of an earlier n-gram. With n=1 every token seen so far is banned.

The histories live on the logits' device (`TokenHistory(device=True)`, one small upload a step);
`apply` finds every earlier occurrence of each row's last n-1 tokens with n-1 shifted compares
and masks the tokens that followed them with one accumulating indexed add (`-inf` where matched,
0 elsewhere; `add_at`). Rows are grouped by n (a loop over distinct sizes only).
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
import paddle
from pydantic import BaseModel, Field

from fastdeploy_lp.processors.base import AddedRequest, LogitsProcessor, ShareInputs
from fastdeploy_lp.processors.batch_state import BatchTracker, RowEntries
from fastdeploy_lp.processors.tensor_ops import add_at, index_tensor
from fastdeploy_lp.processors.token_history import TokenHistory
from fastdeploy_lp.sampling_params import INT32_MAX


class NoRepeatNGramArgs(BaseModel):
    no_repeat_ngram_size: Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)] | None = Field(
        None, description="n: no n-gram of prompt + output may occur twice")


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Never repeats an n-gram of the text so far, per request.

    As `transformers`' `NoRepeatNGramLogitsProcessor`: the n-grams are those of the prompt and the
    output together (one spanning the prompt/output boundary counts), and a token is banned when it
    would complete an n-gram that already occurs. With n=1 every token seen so far is banned.

    Args:
        no_repeat_ngram_size (`int`, *optional*):
            n (>= 1): no n-gram of prompt + output may occur twice. Read per request from
            `logits_processors_args`.

    Examples:

    ```python
    >>> from fastdeploy_lp import LLM, SamplingParams
    >>> llm = LLM(logits_processors=["NoRepeatNGramLogitsProcessor"])  # the built-in default model
    >>> question = [{"role": "user", "content": "Tell me about Paris."}]
    >>> greedy = SamplingParams(temperature=0, max_tokens=24)
    >>> "Paris." in llm.chat(question, greedy, use_tqdm=False)[0].outputs.text
    True
    >>> params = SamplingParams(temperature=0, max_tokens=24,
    ...                         logits_processors_args={"no_repeat_ngram_size": 2})
    >>> "Paris." in llm.chat(question, params, use_tqdm=False)[0].outputs.text  # a 2-gram of the prompt
    False

    ```
    """
    args_model = NoRepeatNGramArgs
    supports_speculation = True  # a function of each row's history: draft positions are plain rows to it
    runs_in_place = True  # batched tensor work, bounded by the request limits

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._batch = BatchTracker()
        self._history = TokenHistory(device=True)
        self._sizes = RowEntries()  # (row, n) of every enabled request
        self._groups: list[tuple[int, np.ndarray, np.ndarray]] = []  # (n, rows, slots) per distinct n
        self._slots = np.zeros(0, np.int64)
        self._group_tensors = None

    def update_state(self, share_inputs: ShareInputs) -> None:
        if self._sizes.update(self._batch.update(share_inputs), self.entries):
            sizes = self._sizes.columns.get("n", np.zeros(0, np.int64))
            self._groups = [(int(n), self._sizes.rows[sizes == n], self._sizes.slots[sizes == n])
                            for n in np.unique(sizes)]
            self._slots = np.sort(self._sizes.slots)
            self._group_tensors = None
        self._history.update(share_inputs, self._slots)

    def entries(self, request: AddedRequest) -> dict[str, np.ndarray] | None:
        """A joining request's n (its history is copied by `TokenHistory` when it joins)."""
        n = request.args.no_repeat_ngram_size
        return None if n is None else {"n": np.array([n], dtype=np.int64)}

    def apply(self, logits):
        if self._group_tensors is None:
            self._group_tensors = [(index_tensor(rows, logits), index_tensor(slots, logits))
                                   for _, rows, slots in self._groups]
        for (n, _, slots), (rows_t, slots_t) in zip(self._groups, self._group_tensors):
            lengths = self._history.lengths[slots]
            width = int(lengths.max())
            windows = width - n + 1  # start positions of n-grams in the longest row
            if windows <= 0:
                continue
            history = paddle.index_select(self._history.tensor[:, :width], slots_t)        # [R, width]
            lens = index_tensor(lengths, logits).unsqueeze(1)                              # [R, 1]
            hit = paddle.arange(windows, dtype="int64").unsqueeze(0) < lens - n + 1        # complete n-grams
            if n > 1:
                last = paddle.take_along_axis(                                            # last n-1 tokens
                    history, paddle.clip(lens - n + 1 + paddle.arange(n - 1, dtype="int64"), min=0), axis=1)
                for j in range(n - 1):
                    hit = hit & (history[:, j:j + windows] == last[:, j:j + 1])
            banned = paddle.clip(history[:, n - 1:n - 1 + windows], min=0)                 # token after each prefix
            penalty = paddle.where(hit, paddle.full([1], float("-inf"), logits.dtype),
                                   paddle.zeros([1], logits.dtype))
            add_at(logits, rows_t.unsqueeze(1).expand(banned.shape).flatten(), banned.flatten(), penalty.flatten())
        return logits
