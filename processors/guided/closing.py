"""Close-on-length: a JSON-constrained output that runs out of `max_tokens` still parses and validates.

Asked for with `GuidedDecodingParams(close_on_length=True)` (server: `"structured_outputs":
{"close_on_length": true}`, or `--guided-close-on-length` as the default):

    params = SamplingParams(max_tokens=24, guided_decoding=GuidedDecodingParams(
        json={"type": "object", "properties": {"bio": {"type": "string"}}, "required": ["bio"]},
        close_on_length=True))
    out = LLM().generate("Bio: ", params)[0].outputs
    json.loads(out.text); out.finish_reason, out.closed_on_length     # ('length', True)

`ClosingSearch.closing` (`closing_search.py`) finds a short completion from a matcher's state to
an accepting one, checked against the matcher at every byte, so it is always valid.

`LengthCloser` is one request's use of it. The invariant: the closing from the output's current state
fits the budget left (`max_tokens` minus the output). It knows an upper bound on the closing's bytes
(`bound`, exact while it has a closing, `plan`) and, from the schema, on what one sampled token can
add to it: `(1 + n) * unit` bytes for a token with `n` of the bytes `{ [ " , :` (`closing_bound.py`).
While the bound plus what the most such token can add fits the budget left, nothing is done
(`dormant`: far from the end, no search). Past that, the closing is kept exact — reused while the
output follows it or it still closes the output, else searched again — and each step's mask keeps
only the tokens after which a closing still fits: those whose possible growth fits (one vectorised
compare over the vocabulary by their count of such bytes), plus the most likely others (of the
`TOP_K`, in order, until they hold `CANDIDATE_MASS` of their probability) and the closing's first
token, each checked by a closing from the state after it; the checked closing of the token sampled
becomes the plan. When the budget left equals the closing, the closing becomes
the request's forced tokens and the output ends with them at `max_tokens` ("length"). Under a
reasoning parser, while the model thinks, the end tag is forced when the budget left is the tag plus
the answer's closing. A closing that cannot be found or does not fit (it would take a search that
misses a much shorter one) fails the request with a message: never a silently invalid output.
"""

from __future__ import annotations

import copy

import llguidance as llg
import numpy as np

from fastdeploy_lp.processors.guided.closing_search import MAX_CLOSING_BYTES, ClosingSearch
from fastdeploy_lp.processors.guided.json_syntax import JsonSyntax

MARGIN = 8  # bytes kept beyond the bound, for a search that finds a slightly longer closing than the shortest
TOP_K = 8  # the most likely tokens checked per step when their growth does not fit
CANDIDATE_MASS = 0.99  # ... checked in order of likelihood until they hold this much of the TOP_K's probability


class ClosingFailed(Exception):
    """The closing does not fit the budget left: the request fails (its message says so)."""


class LengthCloser:
    """One request's close-on-length state, fed the tokens its matcher consumes (see the module
    docstring). `plan` is a closing from the current state (None: not known); `bound` an upper bound
    on the bytes of the shortest one (None: not known); `unit` what one event adds at most."""

    def __init__(self, search: ClosingSearch, unit: int, plan: list[int] | None = None):
        self.search = search
        self.unit = max(1, unit)
        self.matched: list[int] = []  # the tokens the matcher has consumed
        self.syntax = JsonSyntax()
        self.plan = None if plan is None else list(plan)
        self.stale: list[int] | None = None  # the last plan, which may still close (checked when needed)
        self.bound = None if plan is None else len(search.bytes_of(plan))
        self.verified: dict[int, list[int]] = {}  # token -> the closing after it, checked this step
        self.memo: dict = {}  # the search's lexeme paths (`ClosingSearch._lexeme_path`)
        self.closed = False  # the closing was forced: nothing more to do

    def consumed(self, tokens: list[int], forced: bool = False) -> None:
        """The matcher consumed `tokens` (`forced`: the grammar's own, which never lengthen a closing)."""
        tokens = list(tokens)
        self.matched += tokens
        self.syntax.feed(self.search.bytes_of(tokens))
        plan, verified = self.plan, self.verified
        self.plan, self.verified = None, {}
        if plan is not None and plan[:len(tokens)] == tokens:  # the output followed the closing
            self.plan = plan[len(tokens):]
        elif len(tokens) == 1 and tokens[0] in verified:  # a token checked in the mask
            self.plan = verified[tokens[0]]
        else:
            self.stale = plan if plan is not None else self.stale
            if self.bound is not None and not forced:
                self.bound += self.search.growth(tokens, self.unit)
        if self.plan is not None:
            self.stale = None
            self.bound = len(self.search.bytes_of(self.plan))

    def copy(self) -> LengthCloser:
        """An independent copy (a verify pass walks drafts with one)."""
        other = copy.copy(self)
        other.matched, other.syntax = list(self.matched), self.syntax.copy()
        return other

    def rolled_back(self, n: int) -> None:
        del self.matched[len(self.matched) - n:]
        self.syntax = JsonSyntax()
        self.syntax.feed(self.search.bytes_of(self.matched))
        self.plan = self.stale = self.bound = None
        self.verified = {}

    def _room(self, budget: int) -> int:
        """The bytes a closing may take with `budget` tokens left (it is also kept searchable)."""
        return min(budget, MAX_CLOSING_BYTES) - MARGIN

    def dormant(self, budget: int) -> bool:
        """Whether, with `budget` tokens left, nothing is due: the closing was forced, or whatever the
        next token is, the closing after it still fits."""
        return self.closed or (self.bound is not None and
                               self.bound + self.search.widest_growth(self.unit) <= self._room(budget - 1))

    def closing_due(self, matcher: llg.LLMatcher, budget: int) -> list[int] | None:
        """The closing to force now (the remaining `budget` equals it), or None. Outside `dormant`
        keeps `plan` exact; raises ClosingFailed if no closing fits."""
        if self.dormant(budget):
            return None
        plan = self.current_plan(matcher, budget)
        if len(plan) > budget:
            raise ClosingFailed(f"close_on_length: the closing needs {len(plan)} tokens and {budget} are left")
        if not plan or len(plan) < budget:
            return None
        self.closed = True
        return plan

    def current_plan(self, matcher: llg.LLMatcher, budget: int) -> list[int]:
        if self.plan is None and self.stale is not None and len(self.stale) <= budget and \
                self.search.closes(matcher, self.stale):
            self.plan = self.stale
        if self.plan is None:
            self.plan = self.search.closing(matcher, self.syntax, limit=min(budget, MAX_CLOSING_BYTES), memo=self.memo)
        self.stale = None
        if self.plan is None:
            raise ClosingFailed(f"close_on_length: no closing of at most {budget} tokens was found")
        self.bound = len(self.search.bytes_of(self.plan))
        return self.plan

    def thinking_end_due(self, matcher: llg.LLMatcher, budget: int, end_ids: list[int]) -> list[int]:
        """While a reasoning model thinks (the matcher has consumed nothing of the answer yet): the
        end tag's tokens to force now, once the budget left is the tag plus the answer's shortest
        closing, so that the answer still closes; else []."""
        if self.closed:
            return []
        if self.plan is None:
            self.plan = self.search.closing(matcher, self.syntax, memo=self.memo)
        if self.plan is None:
            return []
        return list(end_ids) if budget <= len(end_ids) + len(self.plan) else []

    def in_zone(self, budget: int) -> bool:
        """Whether the next sampled token must be checked (see `keep_words`)."""
        return not self.dormant(budget) and self.plan is not None

    def keep_words(self, matcher: llg.LLMatcher, candidates: list[tuple[int, float]], budget: int,
                   eos) -> np.ndarray:
        """The packed mask of the tokens after which a closing still fits the budget that remains
        (`budget` - 1): those whose growth fits, EOS, the closing's first token, and the candidates
        (token, probability; most likely first) a closing from the state after them was found for
        (kept in `verified`), checked until those looked at hold `CANDIDATE_MASS`."""
        after = budget - 1
        k = (self._room(after) - self.bound) // self.unit - 1  # (1 + openers) * unit fits: unchecked
        words = self.search.with_openers_at_most(k)
        safe = [t for t in eos if t < 32 * len(words)]
        if self.plan:
            self.verified[self.plan[0]] = self.plan[1:]
        mass = 0.0
        for token, p in candidates:
            if mass >= CANDIDATE_MASS:
                break
            mass += p
            if token in eos or token in self.verified or self.search.openers[token] <= k:
                continue
            closing = self._closing_after(matcher, token, after)
            if closing is not None:
                self.verified[token] = closing
        safe = np.asarray(safe + list(self.verified), dtype=np.int64)
        np.bitwise_or.at(words, safe >> 5, np.left_shift(np.uint32(1), (safe & 31).astype(np.uint32)))
        return words

    def _closing_after(self, matcher: llg.LLMatcher, token: int, after: int) -> list[int] | None:
        # The closing, or one found for another token this step, may close this one too (a
        # string's content; another digit of a date): validated without a copy.
        known = [self.plan] if self.plan is not None else []
        for closing in known + [list(c) for c in dict.fromkeys(map(tuple, self.verified.values()))][:4]:
            if len(closing) <= after and self.search.closes(matcher, [token] + closing):
                return list(closing)
        probe = matcher.deep_copy()
        if not probe.consume_token(token):
            return None
        syntax = self.syntax.copy()
        syntax.feed(self.search.bytes_of([token]))
        return self.search.closing(probe, syntax, limit=min(after, MAX_CLOSING_BYTES), memo=self.memo)
