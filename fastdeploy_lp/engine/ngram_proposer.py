"""`NgramProposer`: prompt-lookup drafts (vLLM's `ngram` method, llama.cpp's lookup decoding).

The drafts for a sequence are the tokens that followed the latest earlier occurrence of its last n
tokens, for the longest n from `prompt_lookup_max` down to `prompt_lookup_min` that occurs. They
cost no model: a wrong draft only costs its row in the verify pass, and an exact verifier
(engine/speculation.py) decides what is kept.

The search is numpy over the whole context at once: the candidates are the positions holding the
last token, and each is extended backwards one offset at a time (a loop over n, never over the
context or the vocabulary).
"""

from __future__ import annotations

import numpy as np

from fastdeploy_lp.engine.request import Request
from fastdeploy_lp.speculative_config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.max_n = config.prompt_lookup_max
        self.min_n = config.min_n

    def propose_many(self, requests: list[Request], ks: list[int], budget: int) -> list[list[int]]:
        """Up to `ks[i]` drafts for each of `requests`. A lookup is cheap next to a step, so each
        request drafts its full k; the caller trims them to `budget` in turn."""
        return [self.propose(np.asarray(r.prompt_ids + r.output_ids, dtype=np.int64), k) for r, k in zip(requests, ks)]

    def keep(self, admissions: set[int]) -> None:
        """Nothing is kept per request."""

    def propose(self, context: np.ndarray, k: int) -> list[int]:
        """Up to `k` drafts to follow `context` (int64 token ids); [] when no n-gram recurs."""
        length = len(context)
        if k <= 0 or length < self.min_n + 1:
            return []
        # Match ends: earlier positions holding the last token, each with a token after it.
        ends = np.flatnonzero(context[:-1] == context[-1])
        n = 1
        while len(ends) and n < self.max_n:
            longer = ends[ends >= n]
            longer = longer[context[longer - n] == context[length - 1 - n]]
            if not len(longer):
                break
            ends, n = longer, n + 1
        if not len(ends) or n < self.min_n:
            return []
        start = int(ends[-1]) + 1  # the latest match: the most recent text is the likeliest to repeat
        return context[start:start + k].tolist()
