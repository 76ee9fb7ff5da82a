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
0 elsewhere), with no host round trip. Rows are grouped by n (a loop over distinct sizes only).
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
import paddle
from pydantic import BaseModel, Field

from ..base import LogitsProcessor, active_slots, batch_key
from ..tensor_ops import index_tensor
from ..token_history import TokenHistory


class NoRepeatNGramArgs(BaseModel):
    no_repeat_ngram_size: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None, description="n: no n-gram of prompt + output may occur twice")


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    args_model = NoRepeatNGramArgs

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._history = TokenHistory(device=True)
        self._key = None
        self._groups: list[tuple[int, np.ndarray, np.ndarray]] = []  # (n, rows, slots) per distinct n
        self._slots = np.zeros(0, np.int64)
        self._group_tensors = None

    def update_state(self, share_inputs):
        slots = active_slots(share_inputs)
        key = batch_key(share_inputs, slots)
        if key != self._key:
            sizes = {}
            for row, slot in enumerate(slots):
                n = share_inputs["logits_processors_args"][slot].no_repeat_ngram_size
                if n is not None:
                    sizes.setdefault(int(n), []).append((row, slot))
            self._groups = [(n, np.array([r for r, _ in rs]), np.array([s for _, s in rs])) for n, rs in sizes.items()]
            self._slots = np.array(sorted(s for _, _, g in self._groups for s in g), dtype=np.int64)
            self._group_tensors = None
            self._key = key
        self._history.update(share_inputs, self._slots)

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
            row_ids = rows_t.unsqueeze(1).expand(banned.shape)
            logits.index_put_((row_ids.flatten(), banned.flatten()), penalty.flatten(), accumulate=True)
        return logits
