"""`LogitBiasLogitsProcessor`: add a fixed bias to chosen token ids.

Request:

    {"logits_processors_args": {"logit_bias": {"128": 5.0, "50256": -10.0}}}

Keys are token ids (JSON strings are accepted, as in the OpenAI API); values are finite numbers.
A large positive bias forces a token, a large negative one bans it. The biases of the whole batch
are one index tensor, rebuilt only when a request joins or leaves; a step is one indexed add.
"""

from __future__ import annotations

import math
from typing import Annotated

import numpy as np
from pydantic import BaseModel, Field, ValidationInfo, field_validator

from ..base import LogitsProcessor, active_slots, batch_key
from ..tensor_ops import add_at, index_tensor
from ..validation import check_token_ids

FLOAT32_MAX = 3.4028234663852886e38


class LogitBiasArgs(BaseModel):
    logit_bias: dict[int, Annotated[float, Field(strict=True)]] | None = Field(
        None, description="token id -> bias added to its logit; ids in the vocabulary, finite biases")

    @field_validator("logit_bias")
    @classmethod
    def _in_vocab_and_finite(cls, value, info: ValidationInfo):
        if value is None:
            return value
        check_token_ids(value.keys(), info)
        bad = [k for k, v in value.items() if not (math.isfinite(v) and abs(v) <= FLOAT32_MAX)]
        if bad:
            raise ValueError(f"bias for token {bad[0]} is not a finite float32 number")
        return value


class LogitBiasLogitsProcessor(LogitsProcessor):
    args_model = LogitBiasArgs

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._key = None
        self._edits: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # rows, token ids, biases
        self._tensors = None  # the same on the logits' device, built at the first apply

    def update_state(self, share_inputs):
        slots = active_slots(share_inputs)
        key = batch_key(share_inputs, slots)
        if key == self._key:  # biases are fixed per request: rebuild only when the batch changes
            return
        rows, cols, values = [], [], []
        for row, slot in enumerate(slots):
            bias = share_inputs["logits_processors_args"][slot].logit_bias or {}
            rows += [row] * len(bias)
            cols += [int(t) for t in bias]
            values += [float(b) for b in bias.values()]
        self._edits = (np.array(rows, np.int64), np.array(cols, np.int64), np.array(values, np.float32))
        self._tensors = None
        self._key = key

    def apply(self, logits):
        if self._edits is None or len(self._edits[0]) == 0:
            return logits
        if self._tensors is None:
            rows, cols, values = self._edits
            self._tensors = (index_tensor(rows, logits), index_tensor(cols, logits),
                             index_tensor(values, logits, logits.dtype))
        return add_at(logits, *self._tensors)
