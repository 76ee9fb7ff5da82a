"""`Speculator`: which running requests verify drafted tokens this step, and the counters.

Exactness comes from how a verify pass is sampled, not from here. A request with k drafts feeds its
uncomputed tokens plus the drafts in one pass (a short prefill chunk over its paged KV cache) and
gets k+1 rows (`StepRows.verify`); each row goes through every sampling stage with the drafts before
it as history and is drawn with the seeded noise of its own position. The request then appends row
after row while the drawn token equals the draft there, plus the first token that differs (or the
one after the last draft): each appended token is the one plain decoding would have drawn at that
position. For greedy rows that is "accept while the argmax equals the draft"; for sampled rows it
is the standard rule for a deterministic draft — the draft is kept with probability p(draft), and
otherwise the token is a draw from p without the draft, renormalised — realised with the very
noise plain decoding uses, so a seed gives the same text with speculation on or off.

The KV cache: drafts take blocks only if free ones allow without preempting anyone
(`SlotScheduler.reserve_drafts`); only the keys and values of appended tokens are committed (and
made findable in the prefix cache), and a rejected position's are overwritten by the next pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy_lp.engine.ngram_proposer import NgramProposer
from fastdeploy_lp.engine.request import Request
from fastdeploy_lp.engine.scheduler import Chunk, SlotScheduler
from fastdeploy_lp.processors.pipeline import LogitsProcessorPipeline
from fastdeploy_lp.speculative_config import SpeculativeConfig


@dataclass
class SpeculativeStats:
    method: str | None          # None: speculation is off
    drafted_tokens: int = 0     # drafts verified
    accepted_tokens: int = 0    # of those, appended
    verify_passes: int = 0      # request-steps that verified drafts
    requests_not_speculating: int = 0  # admissions of requests enabling a processor that cannot take part
    # (a preempted request is admitted again when it resumes, and counted again)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def as_dict(self) -> dict:
        return {"method": self.method, "drafted_tokens": self.drafted_tokens,
                "accepted_tokens": self.accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "verify_passes": self.verify_passes, "requests_not_speculating": self.requests_not_speculating}


class Speculator:
    def __init__(self, config: SpeculativeConfig, pipeline: LogitsProcessorPipeline, scheduler: SlotScheduler):
        self.config = config
        self.proposer = NgramProposer(config)
        self.pipeline = pipeline
        self.scheduler = scheduler
        self.stats = SpeculativeStats(config.method)
        self._blocked: dict[int, bool] = {}  # admission -> it enabled a processor that cannot take part
        self._turn = 0

    def propose(self, running: list[Request], chunks: list[Chunk]) -> dict[int, list[int]]:
        """Slot -> drafts for the running requests that verify some this step, within the step's
        token budget, `max_verify_tokens` (a large batch backs off) and the free KV blocks."""
        fed = sum(r.total_len - r.cached_len for r in running)
        budget = self.config.max_verify_tokens - fed
        if self.scheduler.token_budget is not None:
            budget = min(budget, self.scheduler.token_budget - fed - sum(len(c.tokens) for c in chunks))
        self._blocked = {r.admission: self._blocked[r.admission] if r.admission in self._blocked else self._blocks(r)
                         for r in running}
        drafts: dict[int, list[int]] = {}
        self._turn += 1  # when the budget runs out, each request gets its turn to go first
        start = self._turn % len(running) if running else 0
        for request in running[start:] + running[:start]:
            k = min(self.config.num_speculative_tokens, request.params.max_tokens - len(request.output_ids) - 1,
                    budget)
            if k <= 0 or request.forced_queue or self._blocked[request.admission]:
                continue
            context = np.asarray(request.prompt_ids + request.output_ids, dtype=np.int64)
            tokens = self.proposer.propose(context, k)
            tokens = tokens[:self.scheduler.reserve_drafts(request, len(tokens))]
            if tokens:
                drafts[request.slot] = tokens
                budget -= len(tokens)
        self.stats.drafted_tokens += sum(len(d) for d in drafts.values())
        self.stats.verify_passes += len(drafts)
        return drafts

    def record_accepted(self, count: int) -> None:
        self.stats.accepted_tokens += count

    def _blocks(self, request: Request) -> bool:
        """Whether `request` enables a processor that cannot see draft positions (counted once)."""
        blocked = bool(self.pipeline.speculation_blockers(request.args, request.params))
        self.stats.requests_not_speculating += blocked
        return blocked
