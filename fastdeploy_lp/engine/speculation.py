"""`Speculator`: which running requests verify drafted tokens this step, and the counters. The
drafts come from prompt lookup (engine/ngram_proposer.py) or a draft model (engine/draft_model.py).

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

Backing off per request: a draft row is not free, so a request whose drafts keep being rejected
would make every step slower for nothing. A draft row costs a fraction of a plain decode step: the
engine measures it (`observe_step`: decode steps with drafts against those without, of the same
batch size; a batch size drafts once its plain step has been timed), never below
`MIN_DRAFT_ROW_COST` (bench/speculative.py's k+1-row pass over a 1-row step on the bench model,
0.05), unless `draft_row_cost` fixes it.
It is paid by every request of the batch, since each waits for the longer step, while the
accepted drafts advance only their own request: a pass gains, in steps of that request, its
accepted drafts minus drafts x cost x batch size. Each request keeps a running average of that;
when it falls below zero the request sits out a pause (4 steps, doubling on each pause in a row up
to 256) and then tries one pass again; a pass that pays halves the next pause. Which drafts are
verified never changes which tokens come out, so this changes speed only. (On the built-in 3.9M
model a step is mostly per-row host work, and a draft row costs several times the bench model's.)
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy_lp.config import FDConfig
from fastdeploy_lp.engine.draft_model import DraftModelProposer
from fastdeploy_lp.engine.ngram_proposer import NgramProposer
from fastdeploy_lp.engine.request import Request
from fastdeploy_lp.engine.scheduler import Chunk, SlotScheduler
from fastdeploy_lp.processors.pipeline import LogitsProcessorPipeline
from fastdeploy_lp.speculative_config import MIN_DRAFT_ROW_COST, SpeculativeConfig


@dataclass
class SpeculativeStats:
    method: str | None          # None: speculation is off
    drafted_tokens: int = 0     # drafts verified
    accepted_tokens: int = 0    # of those, appended
    verify_passes: int = 0      # request-steps that verified drafts
    requests_not_speculating: int = 0  # admissions of requests enabling a processor that cannot take part
    # (a preempted request is admitted again when it resumes, and counted again)
    backoffs: int = 0           # pauses requests took because their drafts did not pay
    paused_steps: int = 0       # request-steps spent in those pauses
    forced_tokens: int = 0      # tokens processors forced at draft depths, appended by verify passes

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def as_dict(self) -> dict:
        return {"method": self.method, "drafted_tokens": self.drafted_tokens,
                "accepted_tokens": self.accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "verify_passes": self.verify_passes, "requests_not_speculating": self.requests_not_speculating,
                "backoffs": self.backoffs, "paused_steps": self.paused_steps, "forced_tokens": self.forced_tokens}


# The running average weighs the latest pass by a quarter: one unlucky pass does not stop a request
# that usually copies; from the hopeful start, about seven rejected ones in a row do.
GAIN_WEIGHT = 0.25
FIRST_PAUSE, LONGEST_PAUSE = 4, 256  # steps; a probe every 256 steps of k rejected rows costs < 0.1%
STEP_WEIGHT = 0.25  # of a step's timing in the running averages of step time and draft-row cost
PLAIN_STEP_EVERY = 16  # a step without drafts this often keeps the plain step's time measured
MAX_DRAFT_ROW_COST = 0.5  # of a plain step, the most a measurement counts


@dataclass
class _Drafting:
    """One admitted request's drafting record."""
    blocked: bool       # it enables a processor that cannot see draft positions
    gain: float = 1.0   # running average of accepted - draft_row_cost * drafted per pass; starts hopeful
    pause: int = 0      # length of its last pause, in steps
    resume_at: int = 0  # the step from which it drafts again


def build_proposer(fd_config: FDConfig, vocab_size: int) -> NgramProposer | DraftModelProposer:
    """The drafter of `fd_config.speculative_config.method` (`vocab_size`: the tokenizer's)."""
    config = fd_config.speculative_config
    return DraftModelProposer(fd_config, vocab_size) if config.method == "draft_model" else NgramProposer(config)


class Speculator:
    """Decides who drafts each step; `proposer` makes the drafts (`propose_many`) and keeps what it
    holds per request only for the admissions it is told to (`keep`)."""

    def __init__(self, config: SpeculativeConfig, pipeline: LogitsProcessorPipeline, scheduler: SlotScheduler,
                 proposer: NgramProposer | DraftModelProposer):
        self.config = config
        self.proposer = proposer
        self.pipeline = pipeline
        self.scheduler = scheduler
        self.stats = SpeculativeStats(config.method)
        self._requests: dict[int, _Drafting] = {}  # by admission
        self._step = 0
        self._batch = 1  # running requests this step: each pays for the step's draft rows
        # running average of a decode step without drafts, per batch size: a draft row is weighed
        # against a plain step of the same batch (steps of 1 and 4 requests differ by 2x on small models)
        self._plain_step_s: dict[int, float] = {}
        # of a plain step: measured (observe_step) unless the config fixes it
        self.draft_row_cost = MIN_DRAFT_ROW_COST if config.measures_draft_cost else config.draft_row_cost

    def propose(self, running: list[Request], chunks: list[Chunk]) -> dict[int, list[int]]:
        """Slot -> drafts for the running requests that verify some this step, within the step's
        token budget, `max_verify_tokens` (a large batch backs off) and the free KV blocks."""
        fed = sum(r.total_len - r.cached_len for r in running)
        budget = self.config.max_verify_tokens - fed
        if self.scheduler.token_budget is not None:
            budget = min(budget, self.scheduler.token_budget - fed - sum(len(c.tokens) for c in chunks))
        self._requests = {r.admission: self._requests.get(r.admission) or _Drafting(self._blocks(r)) for r in running}
        self.proposer.keep(set(self._requests))
        self._batch = max(1, len(running))
        self._step += 1  # when the budget runs out, each request gets its turn to go first
        start = self._step % len(running) if running else 0
        wanted = [(r, min(self.config.num_speculative_tokens, r.params.max_tokens - len(r.output_ids) - 1))
                  for r in running[start:] + running[:start]] if budget > 0 else []
        # A draft gains at most one step of its request and costs draft_row_cost of a step for each
        # running request: at or past cost x batch = 1 no acceptance rate can pay for it.
        pays = self._step % PLAIN_STEP_EVERY != 1 and self.draft_row_cost * len(running) < 1 and \
            (self._batch in self._plain_step_s or not self.config.measures_draft_cost)
        wanted = [(r, k) for r, k in wanted if k > 0 and not r.forced_queue
                  and self._may_draft(self._requests[r.admission])] if pays else []
        proposals = self.proposer.propose_many([r for r, _ in wanted], [k for _, k in wanted], budget)
        drafts: dict[int, list[int]] = {}
        for (request, k), tokens in zip(wanted, proposals):
            tokens = self.pipeline.refine_drafts(request.slot, request.args, request.params, tokens, k)
            tokens = tokens[:max(0, budget)]
            tokens = tokens[:self.scheduler.reserve_drafts(request, len(tokens))]
            if tokens:
                drafts[request.slot] = tokens
                budget -= len(tokens)
        self.stats.drafted_tokens += sum(len(d) for d in drafts.values())
        self.stats.verify_passes += len(drafts)
        return drafts

    def record(self, request: Request, drafted: int, accepted: int, forced: int = 0) -> None:
        """A verify pass of `request` kept `accepted` of its `drafted` drafts and appended `forced`
        tokens processors forced at draft depths: count it, and pause the request's drafting when
        its recent passes cost more than they gained."""
        self.stats.accepted_tokens += accepted
        self.stats.forced_tokens += forced
        state = self._requests.get(request.admission)
        if state is None:
            return
        cost = self.draft_row_cost * drafted * self._batch
        state.gain += GAIN_WEIGHT * (accepted - cost - state.gain)
        if state.gain >= 0:
            state.pause //= 2
            return
        state.pause = min(LONGEST_PAUSE, max(FIRST_PAUSE, 2 * state.pause))
        state.resume_at = self._step + 1 + state.pause
        self.stats.backoffs += 1

    def observe_step(self, seconds: float, draft_rows: int) -> None:
        """A decode step (no prompt chunks) of this step's batch took `seconds` with `draft_rows`
        draft rows: keep the running averages of a plain step's time at that batch size and of a
        draft row's cost in plain steps."""
        if not self.config.measures_draft_cost:
            return
        plain = self._plain_step_s.get(self._batch)
        if not draft_rows:
            self._plain_step_s[self._batch] = seconds if plain is None else plain + STEP_WEIGHT * (seconds - plain)
        elif plain:
            # One slow step (a collection, the OS) must not read as a dear draft row: capped at half a
            # step (the built-in model's rows measure ~0.25), so a lone request always drafts and its
            # own back-off decides.
            measured = min(MAX_DRAFT_ROW_COST, max(0.0, seconds / plain - 1) / draft_rows)
            cost = self.draft_row_cost + STEP_WEIGHT * (measured - self.draft_row_cost)
            self.draft_row_cost = max(MIN_DRAFT_ROW_COST, cost)

    def _may_draft(self, state: _Drafting) -> bool:
        paused = self._step < state.resume_at
        self.stats.paused_steps += paused
        return not (state.blocked or paused)

    def _blocks(self, request: Request) -> bool:
        """Whether `request` enables a processor that cannot see draft positions (counted once)."""
        blocked = bool(self.pipeline.speculation_blockers(request.args, request.params))
        self.stats.requests_not_speculating += blocked
        return blocked
