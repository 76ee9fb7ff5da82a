"""`BadWordsLogitsProcessor`: never generate the given words or token sequences.

Request:

    {"logits_processors_args": {"bad_words": ["Paris", " London"], "bad_words_token_ids": [[11, 12]]}}

A one-token word is banned outright. A longer sequence is banned only as a whole, as
`transformers`' `NoBadWordsLogitsProcessor` does: its last token is masked when the text so far
(prompt and output) ends with the rest of it. Each word is banned as written and with a leading
space, since tokenizers spell a word differently mid-sentence.

The sequences of the batch form `RowEntries` tables: a request's words are tokenized when it
joins, the others only move to their new rows. Each step compares the prefixes with the last
tokens of each row (a `TokenHistory` tail, never the whole prompt) in one numpy operation, and
masks the banned tokens in one indexed write.

The engine also runs this processor for `SamplingParams.bad_words`, after the penalties; see
`LogitsProcessorPipeline`.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import BaseModel, Field, ValidationInfo, field_validator

from fastdeploy_lp.config import FDConfig
from fastdeploy_lp.processors.base import AddedRequest, LogitsProcessor, ShareInputs
from fastdeploy_lp.processors.batch_state import BatchTracker, RowEntries
from fastdeploy_lp.processors.context import EngineContext
from fastdeploy_lp.processors.tensor_ops import fill_at
from fastdeploy_lp.processors.token_history import TokenHistory
from fastdeploy_lp.processors.validation import check_token_ids

StrictInt = Annotated[int, Field(strict=True)]
_EMPTY = np.zeros(0, dtype=np.int64)


class BadWordsArgs(BaseModel):
    bad_words: list[Annotated[str, Field(strict=True, min_length=1)]] | None = Field(
        None, description="words never to generate (each also banned with a leading space)")
    bad_words_token_ids: list[list[StrictInt]] | None = Field(
        None, description="token sequences never to generate, each banned only as a whole")

    @field_validator("bad_words_token_ids")
    @classmethod
    def _in_vocab(cls, value, info: ValidationInfo):
        for seq in value or []:
            if not seq:
                raise ValueError("each banned sequence needs at least one token id")
            check_token_ids(seq, info)
        return value


def word_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    """Token sequences that spell each word, with and without a leading space."""
    seqs = []
    for word in words:
        for variant in (word, " " + word.lstrip(" ")):
            ids = tokenizer.encode(variant)
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


def banned_next_tokens(history: list[int], sequences: list[list[int]]) -> list[int]:
    """Tokens that would complete one of `sequences` right after `history` (the reference rule)."""
    banned = []
    for seq in sequences:
        prefix = seq[:-1]
        if not prefix or (len(history) >= len(prefix) and history[len(history) - len(prefix):] == prefix):
            banned.append(seq[-1])
    return banned


class BadWordsLogitsProcessor(LogitsProcessor):
    """Never generates the given words or token sequences, per request.

    A one-token word is banned outright. A longer one is banned only as a whole, as `transformers`'
    `NoBadWordsLogitsProcessor` does: its last token is masked when the text so far (prompt and
    output) ends with the rest of it. Each word is banned as written and with a leading space,
    since tokenizers spell a word differently mid-sentence.

    Args:
        bad_words (`list[str]`, *optional*):
            Words never to generate (non-empty strings), each also banned with a leading space.
        bad_words_token_ids (`list[list[int]]`, *optional*):
            Token sequences never to generate, each banned only as a whole; ids must be in the
            vocabulary. Both keys are read per request from `logits_processors_args`.

    Examples:

    ```python
    >>> from fastdeploy_lp import LLM, SamplingParams
    >>> llm = LLM(logits_processors=["BadWordsLogitsProcessor"])  # the built-in default model
    >>> question = [{"role": "user", "content": "What is the capital of France?"}]
    >>> params = SamplingParams(temperature=0, max_tokens=16,
    ...                         logits_processors_args={"bad_words": ["Paris"]})
    >>> "Paris" in llm.chat(question, params, use_tqdm=False)[0].outputs.text
    False

    ```
    """
    args_model = BadWordsArgs
    supports_speculation = True  # a function of each row's history: draft positions are plain rows to it
    runs_in_place = True  # batched tensor work, bounded by the request limits
    uses_engine_context = True  # the tokenizer spells the banned words

    def __init__(self, fd_config: FDConfig, context: EngineContext):
        super().__init__(fd_config)
        self.tokenizer = context.tokenizer
        self._batch = BatchTracker()
        self._history = TokenHistory()
        self._single = RowEntries()          # (row, token) banned whatever the history
        self._multi = RowEntries(prefix=-2)  # (row, last token, right-aligned prefix; -2 = none)
        self._hits = (_EMPTY, _EMPTY)        # (rows, tokens) of multi-token sequences completed this step

    def update_state(self, share_inputs: ShareInputs) -> None:
        update = self._batch.update(share_inputs)
        if update.changed:
            built = {request.slot: self.entries(request) for request in update.added}
            self._single.update(update, lambda request: _part(built[request.slot], single=True))
            self._multi.update(update, lambda request: _part(built[request.slot], single=False))
        self._hits = (_EMPTY, _EMPTY)
        if not len(self._multi):
            return
        slots, prefixes = self._multi.slots, self._multi.columns["prefix"]
        self._history.update(share_inputs, np.unique(slots))
        tails = self._history.tails(slots, prefixes.shape[1])
        hit = np.all((tails == prefixes) | (prefixes == -2), axis=1)
        self._hits = (self._multi.rows[hit], self._multi.columns["token"][hit])

    def entries(self, request: AddedRequest) -> dict[str, np.ndarray] | None:
        """A joining request's banned sequences (tokenized once per request): the last token of
        each, and the tokens before it, right-aligned (-2 = none)."""
        args = request.args
        seqs = word_sequences(self.tokenizer, args.bad_words or []) + list(args.bad_words_token_ids or [])
        if not seqs:
            return None
        width = max(len(seq) for seq in seqs) - 1
        prefixes = np.full((len(seqs), width), -2, dtype=np.int64)
        for i, seq in enumerate(seqs):
            prefixes[i, width - len(seq) + 1:] = seq[:-1]
        return {"token": np.array([seq[-1] for seq in seqs], np.int64), "prefix": prefixes}

    def apply(self, logits):
        if len(self._single):
            fill_at(logits, *self._single.on_device(logits, "token"))
        return fill_at(logits, *self._hits)


def _part(entries: dict[str, np.ndarray] | None, single: bool) -> dict[str, np.ndarray] | None:
    """The one-token sequences of a request's entries, or the longer ones (with their prefixes)."""
    if entries is None:
        return None
    pick = np.all(entries["prefix"] == -2, axis=1) == single
    return {"token": entries["token"][pick]} if single else {k: v[pick] for k, v in entries.items()}
