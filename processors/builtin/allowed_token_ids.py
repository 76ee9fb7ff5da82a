"""`AllowedTokenIdsLogitsProcessor`: generate only from a given set of token ids.

Request:

    {"logits_processors_args": {"allowed_token_ids": [11, 12, 13, 2]}}

Every other token of the row is masked to `-inf` (include the EOS id if the answer should be able
to end). Ids outside the vocabulary are a validation error. The batch's mask is one `[rows, vocab]`
boolean tensor built on the logits' device when a request joins or leaves; a step is one masked
fill, and rows without the argument are left untouched.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
import paddle
from pydantic import BaseModel, Field, ValidationInfo, field_validator

from ..base import LogitsProcessor, active_slots, batch_key
from ..tensor_ops import index_tensor
from ..validation import check_token_ids


class AllowedTokenIdsArgs(BaseModel):
    allowed_token_ids: Annotated[list[Annotated[int, Field(strict=True)]], Field(min_length=1)] | None = Field(
        None, description="the only token ids that may be generated")

    @field_validator("allowed_token_ids")
    @classmethod
    def _in_vocab(cls, value, info: ValidationInfo):
        if value is not None:
            check_token_ids(value, info)
        return value


class AllowedTokenIdsLogitsProcessor(LogitsProcessor):
    args_model = AllowedTokenIdsArgs

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._key = None
        self._allowed: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # rows, (row, id) pairs
        self._masked: paddle.Tensor | None = None  # [rows, vocab] True = set to -inf

    def update_state(self, share_inputs):
        slots = active_slots(share_inputs)
        key = batch_key(share_inputs, slots)
        if key == self._key:
            return
        rows, pair_rows, pair_ids = [], [], []
        for row, slot in enumerate(slots):
            allowed = share_inputs["logits_processors_args"][slot].allowed_token_ids
            if allowed is not None:
                rows.append(row)
                pair_rows += [row] * len(allowed)
                pair_ids += [int(t) for t in allowed]
        self._allowed = (np.array(rows, np.int64), np.array(pair_rows, np.int64), np.array(pair_ids, np.int64))
        self._masked = None
        self._key = key

    def apply(self, logits):
        if self._allowed is None or len(self._allowed[0]) == 0:
            return logits
        if self._masked is None or self._masked.shape != logits.shape:
            rows, pair_rows, pair_ids = (index_tensor(x, logits) for x in self._allowed)
            masked = paddle.zeros_like(logits, dtype="bool")
            masked[rows] = True
            self._masked = masked.index_put_((pair_rows, pair_ids), paddle.zeros([1], dtype="bool"))
        return logits.masked_fill_(self._masked, float("-inf"))
