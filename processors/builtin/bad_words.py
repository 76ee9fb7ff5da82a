"""`BadWordsLogitsProcessor`: never generate the given words or token sequences.

Request:

    {"logits_processors_args": {"bad_words": ["Paris", " London"], "bad_words_token_ids": [[11, 12]]}}

A one-token word is banned outright. A longer sequence is banned only as a whole, as
`transformers`' `NoBadWordsLogitsProcessor` does: its last token is masked when the text so far
(prompt and output) ends with the rest of it. Each word is banned as written and with a leading
space, since tokenizers spell a word differently mid-sentence.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationInfo, field_validator

from ..base import LogitsProcessor
from ..tensor_ops import fill_at
from ..validation import check_token_ids


class BadWordsArgs(BaseModel):
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

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
        for variant in {word, " " + word.lstrip(" ")}:
            ids = tokenizer.encode(variant)
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


def banned_next_tokens(history: list[int], sequences: list[list[int]]) -> list[int]:
    """Tokens that would complete one of `sequences` right after `history`."""
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
        self._sequences: dict[str, list[list[int]]] = {}  # per request id, tokenized once
        self._rows: list[int] = []
        self._cols: list[int] = []

    def update_state(self, share_inputs):
        self._rows, self._cols = [], []
        live = set()
        row = -1
        for slot, stopped in enumerate(share_inputs["stop_flags"]):
            if stopped:
                continue
            row += 1
            args, rid = share_inputs["logits_processors_args"][slot], share_inputs["req_ids"][slot]
            if not (args.bad_words or args.bad_words_token_ids):
                continue
            live.add(rid)
            if rid not in self._sequences:
                words = word_sequences(self.fd_config.tokenizer, args.bad_words or [])
                self._sequences[rid] = words + [list(s) for s in args.bad_words_token_ids or []]
            history = share_inputs["prompt_ids"][slot].tolist() + share_inputs["output_ids"][slot]
            for token in set(banned_next_tokens(history, self._sequences[rid])):
                self._rows.append(row)
                self._cols.append(token)
        self._sequences = {k: v for k, v in self._sequences.items() if k in live}

    def apply(self, logits):
        return fill_at(logits, self._rows, self._cols)
