"""`AllowedTokenIdsLogitsProcessor`: generate only from a given set of token ids.

Request:

    {"logits_processors_args": {"allowed_token_ids": [11, 12, 13, 2]}}

Every other token of the row is masked to `-inf` (include the EOS id if the answer should be able
to end). Ids outside the vocabulary are a validation error. The batch's mask is one `[rows, vocab]`
boolean tensor on the logits' device: when a request joins, the rows of the others are gathered
to their new places and only the joining row is built; a step is one masked fill, and rows
without the argument are left untouched.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
import paddle
from pydantic import BaseModel, Field, ValidationInfo, field_validator

from fastdeploy_lp.processors.base import AddedRequest, LogitsProcessor, ShareInputs
from fastdeploy_lp.processors.batch_state import BatchTracker, RowEntries
from fastdeploy_lp.processors.tensor_ops import gather_rows, index_tensor
from fastdeploy_lp.processors.validation import check_token_ids


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
    """Generates only from a given set of token ids, per request.

    Every other token of the request's row is masked to `-inf` (include the EOS id if the answer
    should be able to end); rows of requests without the argument are left untouched.

    Args:
        allowed_token_ids (`list[int]`, *optional*):
            The only token ids that may be generated (at least one, each in the vocabulary). Read
            per request from `logits_processors_args`.

    Examples:

    ```python
    >>> from fastdeploy_lp import LLM, SamplingParams
    >>> llm = LLM(logits_processors=["AllowedTokenIdsLogitsProcessor"])  # the built-in default model
    >>> labels = [llm.tokenizer.encode(word)[0] for word in ("Positive", "Negative")]
    >>> params = SamplingParams(temperature=0, max_tokens=1,
    ...                         logits_processors_args={"allowed_token_ids": labels})
    >>> question = [{"role": "user", "content": "Tell me about Paris."}]
    >>> llm.chat(question, params, use_tqdm=False)[0].outputs.text in ("Positive", "Negative")
    True

    ```
    """
    args_model = AllowedTokenIdsArgs
    supports_speculation = True  # a function of each row's history: draft positions are plain rows to it
    runs_in_place = True  # batched tensor work, bounded by the request limits

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._batch = BatchTracker()
        self._allowed = RowEntries()  # (row, allowed id) of every enabled request
        self._masked: paddle.Tensor | None = None  # [rows, vocab] True = set to -inf, on the logits' device

    def update_state(self, share_inputs: ShareInputs) -> None:
        update = self._batch.update(share_inputs)
        if not self._allowed.update(update, self.entries):
            return
        if self._masked is None or not len(self._allowed):
            self._masked = None  # built at the next apply, when the logits' device and width are known
            return
        # Requests that stayed keep their mask rows (one gather); only joining ones are built.
        self._masked = gather_rows(self._masked, update.previous_rows, fill=False)
        self._fill(self._masked, np.isin(self._allowed.slots, [r.slot for r in update.added]))

    def entries(self, request: AddedRequest) -> dict[str, np.ndarray] | None:
        """A joining request's allowed ids (built once per request)."""
        allowed = request.args.allowed_token_ids
        return None if allowed is None else {"token": np.asarray(allowed, dtype=np.int64)}

    def apply(self, logits):
        if not len(self._allowed):
            return logits
        if self._masked is None or self._masked.shape != logits.shape:
            self._masked = paddle.zeros_like(logits, dtype="bool")
            self._fill(self._masked, np.ones(len(self._allowed), dtype=bool))
        return logits.masked_fill_(self._masked, float("-inf"))

    def _fill(self, masked: paddle.Tensor, entries: np.ndarray) -> None:
        """Set the mask rows of the selected entries' requests: all True but their allowed ids."""
        if not entries.any():
            return
        rows, tokens = self._allowed.rows[entries], self._allowed.columns["token"][entries]
        masked[index_tensor(np.unique(rows), masked)] = True
        masked.index_put_((index_tensor(rows, masked), index_tensor(tokens, masked)), paddle.zeros([1], dtype="bool"))
