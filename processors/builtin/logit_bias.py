"""`LogitBiasLogitsProcessor`: add a fixed bias to chosen token ids.

Request:

    {"logits_processors_args": {"logit_bias": {"128": 5.0, "50256": -10.0}}}

Keys are token ids (JSON strings are accepted, as in the OpenAI API); values are finite numbers.
A large positive bias forces a token, a large negative one bans it.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ValidationInfo, field_validator

from ..base import LogitsProcessor
from ..tensor_ops import add_at
from ..validation import check_token_ids


class LogitBiasArgs(BaseModel):
    logit_bias: dict[int, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _in_vocab_and_finite(cls, value, info: ValidationInfo):
        if value is None:
            return value
        check_token_ids(value.keys(), info)
        bad = [k for k, v in value.items() if not math.isfinite(v)]
        if bad:
            raise ValueError(f"bias for token {bad[0]} is not a finite number")
        return value


class LogitBiasLogitsProcessor(LogitsProcessor):
    args_model = LogitBiasArgs

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._batch_key = None
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._values: list[float] = []

    def update_state(self, share_inputs):
        flags = share_inputs["stop_flags"]
        active = [(rid, a) for rid, a, f in zip(share_inputs["req_ids"], share_inputs["logits_processors_args"], flags)
                  if not f]
        key = tuple(rid for rid, _ in active)
        if key == self._batch_key:  # biases are fixed per request: rebuild only when the batch changes
            return
        self._batch_key = key
        self._rows, self._cols, self._values = [], [], []
        for row, (_, args) in enumerate(active):
            for token, bias in (args.logit_bias or {}).items():
                self._rows.append(row)
                self._cols.append(int(token))
                self._values.append(float(bias))

    def apply(self, logits):
        return add_at(logits, self._rows, self._cols, self._values)
