"""`LogitBiasLogitsProcessor`: add a fixed bias to chosen token ids.

Request:

    {"logits_processors_args": {"logit_bias": {"128": 5.0, "50256": -10.0}}}

Keys are token ids (JSON strings are accepted, as in the OpenAI API); values are finite numbers.
A large positive bias forces a token, a large negative one bans it. The biases of the whole batch
are one `RowEntries` table: a request's entries are built when it joins, the others only move to
their new rows; a step is one indexed add.

The engine also runs this processor for `SamplingParams.logit_bias` (OpenAI's field), after the
penalties; see `LogitsProcessorPipeline`.
"""

from __future__ import annotations

import math
from typing import Annotated

import numpy as np
from pydantic import BaseModel, Field, ValidationInfo, field_validator

from fastdeploy_lp.processors.base import AddedRequest, LogitsProcessor, ShareInputs
from fastdeploy_lp.processors.batch_state import BatchTracker, RowEntries
from fastdeploy_lp.processors.tensor_ops import add_at
from fastdeploy_lp.processors.validation import check_token_ids
from fastdeploy_lp.sampling_params import token_id_key

FLOAT32_MAX = 3.4028234663852886e38


class LogitBiasArgs(BaseModel):
    logit_bias: dict[int, Annotated[float, Field(strict=True)]] | None = Field(
        None, description="token id -> bias added to its logit; ids in the vocabulary, finite biases")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _keys_are_token_ids(cls, value):
        """As the top-level `logit_bias` reads them (pydantic alone also reads "1_0" or "+5")."""
        for key in value if isinstance(value, dict) else ():
            token_id_key(key)
        return value

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
    """Adds a fixed bias to chosen token ids, per request.

    A large positive bias makes a token (nearly) certain, a large negative one bans it; rows of
    requests that set no `logit_bias` are left untouched. Unlike the OpenAI `logit_bias` field
    (clamped to [-100, 100]), any finite float32 bias is accepted.

    Args:
        logit_bias (`dict[int, float]`, *optional*):
            Token id -> bias added to that token's logit at every step. Ids must be in the
            vocabulary (JSON string keys such as `"128"` are accepted, as in the OpenAI API);
            biases must be finite float32 numbers. Read per request from `logits_processors_args`.

    Examples:

    ```python
    >>> from fastdeploy_lp import LLM, SamplingParams
    >>> llm = LLM(logits_processors=["LogitBiasLogitsProcessor"])  # the built-in default model
    >>> question = [{"role": "user", "content": "What is the capital of France?"}]
    >>> paris = llm.tokenizer.encode(" Paris")[0]
    >>> params = SamplingParams(temperature=0, max_tokens=16,
    ...                         logits_processors_args={"logit_bias": {paris: -100.0}})
    >>> "Paris" in llm.chat(question, params, use_tqdm=False)[0].outputs.text
    False

    ```

    Online: `--logits-processors LogitBiasLogitsProcessor`, then
    `{"logits_processors_args": {"logit_bias": {"1844": -100}}}` in the request body.
    """
    args_model = LogitBiasArgs
    supports_speculation = True  # a function of each row's history: draft positions are plain rows to it
    runs_in_place = True  # batched tensor work, bounded by the request limits

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._batch = BatchTracker()
        self._biases = RowEntries()  # (row, token id, bias) of every enabled request

    def update_state(self, share_inputs: ShareInputs) -> None:
        self._biases.update(self._batch.update(share_inputs), self.entries)

    def entries(self, request: AddedRequest) -> dict[str, np.ndarray] | None:
        """A joining request's biases (built once per request)."""
        bias = request.args.logit_bias
        if not bias:
            return None
        return {"token": np.fromiter(bias.keys(), np.int64, len(bias)),
                "bias": np.fromiter(bias.values(), np.float32, len(bias))}

    def apply(self, logits):
        if not len(self._biases):
            return logits
        return add_at(logits, *self._biases.on_device(logits, "token", "bias"))
