"""`BadWordsLogitsProcessor`: never generate the given words or token sequences.

Request:

    {"logits_processors_args": {"bad_words": ["Paris", " London"], "bad_words_token_ids": [[11, 12]]}}

A one-token word is banned outright. A longer sequence is banned only as a whole, as
`transformers`' `NoBadWordsLogitsProcessor` does: its last token is masked when the text so far
(prompt and output) ends with the rest of it. Each word is banned as written and with a leading
space, since tokenizers spell a word differently mid-sentence.

The sequences of the batch form one table, rebuilt when a request joins or leaves. Each step
compares the table's prefixes with the last tokens of each row (a `TokenHistory` tail, never the
whole prompt) in one numpy operation, and masks the banned tokens in one indexed write.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import BaseModel, Field, ValidationInfo, field_validator

from ..base import LogitsProcessor, active_slots, batch_key
from ..tensor_ops import fill_at, index_tensor
from ..token_history import TokenHistory
from ..validation import check_token_ids

StrictInt = Annotated[int, Field(strict=True)]


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
    args_model = BadWordsArgs

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._history = TokenHistory()
        self._key = None
        self._single = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # (rows, ids) banned whatever the history
        self._single_tensors = None       # the same on the logits' device, built at the first apply
        self._multi = None                # slots, rows, right-aligned prefixes [M, K] (-2 = none), last ids
        self._hits = self._single         # (rows, ids) of multi-token sequences completed this step

    def update_state(self, share_inputs):
        slots = active_slots(share_inputs)
        key = batch_key(share_inputs, slots)
        if key != self._key:
            self._rebuild(share_inputs, slots)
            self._key = key
        if self._multi is None:
            return
        m_slots, m_rows, prefixes, last = self._multi
        self._history.update(share_inputs, np.unique(m_slots))
        tails = self._history.tails(m_slots, prefixes.shape[1])
        hit = np.all((tails == prefixes) | (prefixes == -2), axis=1)
        self._hits = (m_rows[hit], last[hit])

    def _rebuild(self, share_inputs, slots):
        rows, singles, multi = [], [], []
        for row, slot in enumerate(slots):
            args = share_inputs["logits_processors_args"][slot]
            if not (args.bad_words or args.bad_words_token_ids):
                continue
            seqs = word_sequences(self.fd_config.tokenizer, args.bad_words or []) + list(args.bad_words_token_ids or [])
            for seq in seqs:
                if len(seq) == 1:
                    rows.append(row)
                    singles.append(seq[0])
                else:
                    multi.append((slot, row, seq))
        self._single = (np.array(rows, np.int64), np.array(singles, np.int64))
        self._single_tensors = None
        self._hits = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        if not multi:
            self._multi = None
            return
        width = max(len(seq) for _, _, seq in multi) - 1
        prefixes = np.full((len(multi), width), -2, dtype=np.int64)
        for i, (_, _, seq) in enumerate(multi):
            prefixes[i, width - len(seq) + 1:] = seq[:-1]
        self._multi = (np.array([m[0] for m in multi]), np.array([m[1] for m in multi]), prefixes,
                       np.array([m[2][-1] for m in multi], np.int64))

    def apply(self, logits):
        if len(self._single[0]):
            if self._single_tensors is None:
                self._single_tensors = tuple(index_tensor(x, logits) for x in self._single)
            fill_at(logits, *self._single_tensors)
        return fill_at(logits, *self._hits)
