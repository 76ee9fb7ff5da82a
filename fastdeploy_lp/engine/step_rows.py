"""`StepRows`: one step's logits rows and the per-row state the sampling stages hand along.

A row is one position to sample for one request. Today a step has one row per running request, in
slot order (the processors' row convention); a verify pass of speculative decoding will give a
request several rows, each at its own `position`. Stages read and replace `logits` (and, once
temperature ran, `probs`) for all rows at once: per-row values come in as columns, never as a
Python loop over rows or over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle

from fastdeploy_lp.engine.request import Logprob, Request


@dataclass
class StepRows:
    logits: paddle.Tensor                  # [rows, vocab]
    requests: list[Request]                # the request of each row
    positions: np.ndarray                  # int64 [rows]: output tokens before the row's token
    probs: paddle.Tensor | None = None     # [rows, vocab] what the draw samples from (None: every row greedy)
    tokens: np.ndarray | None = None       # int64 [rows], set by the draw; undefined for failed rows
    logprobs: list[Logprob | None] = field(default_factory=list)  # per row, for requests that asked
    failures: dict[int, str] = field(default_factory=dict)        # slot -> why its request cannot go on

    @classmethod
    def of(cls, logits: paddle.Tensor, requests: list[Request]) -> StepRows:
        """The rows of a step that samples each request's next output token."""
        return cls(logits, list(requests), np.array([len(r.output_ids) for r in requests], dtype=np.int64))

    @property
    def greedy(self) -> list[bool]:
        return [r.params.greedy for r in self.requests]

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy)

    def fail(self, row: int, message: str) -> None:
        """Fail row `row`'s request, unless an earlier stage already did (its message is the cause)."""
        self.failures.setdefault(self.requests[row].slot, message)

    def fail_slots(self, failures: dict[int, str]) -> None:
        """Fail the requests of these slots, each unless an earlier stage already did."""
        for slot, message in failures.items():
            self.failures.setdefault(slot, message)

    def row(self, i: int) -> StepRows:
        """Row `i` alone, as the stages had handed it along so far."""
        probs = None if self.probs is None else self.probs[i:i + 1]
        return StepRows(self.logits[i:i + 1], self.requests[i:i + 1], self.positions[i:i + 1], probs)
