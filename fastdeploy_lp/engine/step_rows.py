"""`StepRows`: one step's logits rows and the per-row state the sampling stages hand along.

A row is one position to sample for one request. A plain step has one row per running request, in
slot order (the processors' row convention). A speculative verify pass (engine/speculation.py)
gives a request with k drafts k+1 rows, one per position, each at its own `position` and `depth`
(the drafts before it): the rows are grouped by depth, depth 0 first (exactly a plain step's
rows), then the depth-1 rows of the requests with a draft, and so on, each group in slot order.
Stages read and replace `logits` (and, once temperature ran, `probs`) for all rows at once:
per-row values come in as columns, never as a Python loop over rows or over the vocabulary.
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
    depths: np.ndarray | None = None       # int64 [rows]: drafts before the row's position (None: all 0)
    drafts: dict[int, list[int]] = field(default_factory=dict)    # slot -> the drafts this pass verifies
    truncated: dict[int, int] = field(default_factory=dict)       # slot -> first depth whose row is unusable
    forced: dict[int, dict[int, tuple[int, ...]]] = field(default_factory=dict)  # slot -> depth -> tokens forced there
    rows_of: list[list[int]] = field(default_factory=list)        # per request (given order): its rows by depth

    @classmethod
    def of(cls, logits: paddle.Tensor, requests: list[Request]) -> StepRows:
        """The rows of a step that samples each request's next output token."""
        return cls(logits, list(requests), np.array([len(r.output_ids) for r in requests], dtype=np.int64),
                   rows_of=[[i] for i in range(len(requests))])

    @classmethod
    def verify(cls, logits: paddle.Tensor, requests: list[Request], drafts: dict[int, list[int]]) -> StepRows:
        """The rows of a verify pass: `logits` holds each request's 1 + len(drafts[slot]) rows in
        position order, request after request (the runner's order); they are regrouped by depth."""
        counts = np.array([1 + len(drafts.get(r.slot, ())) for r in requests], dtype=np.int64)
        depths = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
        owner = np.repeat(np.arange(len(requests)), counts)
        order = np.lexsort((owner, depths))
        new_row = np.empty_like(order)
        new_row[order] = np.arange(len(order))
        starts = np.cumsum(counts) - counts
        outputs = np.array([len(r.output_ids) for r in requests], dtype=np.int64)
        return cls(paddle.index_select(logits, paddle.to_tensor(order)), [requests[i] for i in owner[order]],
                   outputs[owner[order]] + depths[order], depths=depths[order], drafts=dict(drafts),
                   rows_of=[new_row[s:s + c].tolist() for s, c in zip(starts, counts)])

    @property
    def greedy(self) -> list[bool]:
        return [r.params.greedy for r in self.requests]

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy)

    def depth_groups(self) -> list[tuple[int, int, int]]:
        """(depth, first row, end row) of each depth's rows; one group of every row without drafts."""
        if self.depths is None:
            return [(0, 0, len(self.requests))]
        bounds = np.flatnonzero(np.diff(self.depths)) + 1
        starts, ends = np.r_[0, bounds], np.r_[bounds, len(self.depths)]
        return [(int(self.depths[s]), int(s), int(e)) for s, e in zip(starts, ends)]

    def fail(self, row: int, message: str) -> None:
        """Fail row `row`'s request, unless an earlier stage already did (its message is the cause).
        A draft position's row only ends what the request accepts there: plain decoding would have
        reached it only if the drafts before it were right, so the next step decides again."""
        depth = 0 if self.depths is None else int(self.depths[row])
        if depth:
            self.truncate({self.requests[row].slot: message}, depth)
        else:
            self.failures.setdefault(self.requests[row].slot, message)

    def fail_slots(self, failures: dict[int, str], depth: int = 0) -> None:
        """Fail the requests of these slots (their rows at `depth`), each unless an earlier stage already did."""
        if depth:
            self.truncate(failures, depth)
            return
        for slot, message in failures.items():
            self.failures.setdefault(slot, message)

    def truncate(self, slots, depth: int) -> None:
        """Rows of these slots from `depth` on are not to be used."""
        for slot in slots:
            self.truncated[slot] = min(depth, self.truncated.get(slot, depth))

    def force(self, forced: dict[int, tuple[int, ...]], depth: int) -> None:
        """Processors forced these tokens ({slot: tokens}) at the rows of `depth`."""
        for slot, tokens in forced.items():
            self.forced.setdefault(slot, {})[depth] = tokens

    def emitted(self, i: int) -> list[tuple[int, int | None]]:
        """(token, row) of each token request `i` (in the order given) appends: a plain step's one
        row; in a verify pass each depth's row while its token equals the draft there, then the
        first that differs (or the row after the last draft). Where processors forced tokens at a
        depth, all of them are appended unsampled (row None), as plain decoding's fast-forward
        would, and the walk goes on past them only if the drafts there were those very tokens.
        Each row used saw exactly the history before it."""
        rows, slot = self.rows_of[i], self.requests[self.rows_of[i][0]].slot
        draft, forced = self.drafts.get(slot, []), self.forced.get(slot, {})
        usable = min(len(rows), self.truncated.get(slot, len(rows)))
        out: list[tuple[int, int | None]] = []
        depth = 0
        while depth < usable:
            run = forced.get(depth)
            if run:
                out += [(token, None) for token in run]
                if list(draft[depth:depth + len(run)]) != list(run):
                    break
                depth += len(run)
                continue
            token = int(self.tokens[rows[depth]])
            out.append((token, rows[depth]))
            if depth == len(draft) or token != draft[depth]:
                break
            depth += 1
        return out

    def draft_history(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, token) of every draft before each row's position: the history a row has beyond
        its request's output."""
        pairs = [(row, token) for row, (r, depth) in enumerate(zip(self.requests, self._depths()))
                 for token in self.drafts.get(r.slot, [])[:depth]]
        return (np.array([p[0] for p in pairs], dtype=np.int64), np.array([p[1] for p in pairs], dtype=np.int64))

    def row(self, i: int) -> StepRows:
        """Row `i` alone, as the stages had handed it along so far."""
        probs = None if self.probs is None else self.probs[i:i + 1]
        depths = None if self.depths is None else self.depths[i:i + 1]
        return StepRows(self.logits[i:i + 1], self.requests[i:i + 1], self.positions[i:i + 1], probs,
                        depths=depths, drafts=self.drafts)

    def _depths(self) -> np.ndarray:
        return np.zeros(len(self.requests), dtype=np.int64) if self.depths is None else self.depths
