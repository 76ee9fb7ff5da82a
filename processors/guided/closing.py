"""Close-on-length: a JSON-constrained output that runs out of `max_tokens` still parses.

Asked for with `GuidedDecodingParams(close_on_length=True)` (server: `"structured_outputs":
{"close_on_length": true}`, or `--guided-close-on-length` as the default):

    params = SamplingParams(max_tokens=24, guided_decoding=GuidedDecodingParams(
        json={"type": "object", "properties": {"bio": {"type": "string"}}, "required": ["bio"]},
        close_on_length=True))
    out = LLM().generate("Bio: ", params)[0].outputs
    json.loads(out.text); out.finish_reason, out.closed_on_length     # ('length', True)

`ClosingSearch.closing` finds a short completion from a matcher's state to an accepting one (the
string cut and closed, open arrays and objects closed, required keys given short valid values):
a walk that, at each step, takes the grammar's forced tokens or else the first byte the grammar
allows from a list that `JsonSyntax` (where in the JSON text the output is) ranks by how directly
it closes: `"` in a string, `}` / `]` after a value, `0` where a value starts. Every byte is checked
against the matcher's mask, so the closing is always valid; schema rules the ranking does not know
(a minLength, a pattern, an enum) make it take the allowed byte it has used least, so it does not
go round in circles. The bytes are then re-tokenized into fewer tokens when the matcher accepts them.

`LengthCloser` is one request's use of it: the closing's length is the reserve. Under a reasoning
parser, while the model thinks, the reserve is the end tag plus the answer's shortest closing, and
the end tag is forced when the budget comes down to it, so the answer still gets its closing. Its walk runs only
in the last stretch of the budget (remaining <= 4 x closing + 64 tokens, so long requests do no
work for most of their steps), and reuses the previous closing when the output followed it. When
the remaining budget equals the reserve, the closing becomes the request's forced tokens and the
output ends with them at `max_tokens` ("length"). In the last `ZONE` tokens before that, one
sampled token could open more than the budget can close (`{` of an object with required keys): there
the processor keeps only tokens whose own closing still fits (`safe_tokens`, checked for the
`TOP_K` most likely tokens and the closing's first token, which always fits).
"""

from __future__ import annotations

import copy
import logging

import llguidance as llg
import numpy as np

logger = logging.getLogger(__name__)

MAX_CLOSING_TOKENS = 256  # a longer closing is not searched for: the request ends as without the option
ZONE = 16  # tokens before the reserve where each sampled token must leave a closing that fits
TOP_K = 8  # candidate tokens checked per step in that zone

_VALUE = b'0"[{nft-123456789'  # shortest JSON values first: 0, "", [], {}, null, false, true
_PREFERENCES = {
    "string": b'"', "key_string": b'"', "escape": b"n\"\\/", "unicode": b"0", "colon": b":",
    "key": b'"}', "object_start": b'}"', "array_start": b"]" + _VALUE, "value": _VALUE,
}


class JsonSyntax:
    """Where a JSON text is, byte by byte: the open containers, and what may come next. Only a
    ranking hint for the closing walk (the matcher decides what is valid), so it is lenient."""

    __slots__ = ("stack", "mode", "hex_left")

    def __init__(self):
        self.stack: list[int] = []  # the closing bytes of the open containers: ord("}") or ord("]")
        self.mode = "value"
        self.hex_left = 0

    def copy(self) -> "JsonSyntax":
        other = JsonSyntax()
        other.stack, other.mode, other.hex_left = list(self.stack), self.mode, self.hex_left
        return other

    def feed(self, data: bytes) -> None:
        for b in data:
            if self.mode in ("string", "key_string", "escape", "unicode"):
                self._in_string(b)
            else:
                self._outside_string(b)

    def _in_string(self, b: int) -> None:
        if self.mode == "unicode":
            self.hex_left -= 1
            if self.hex_left <= 0:
                self.mode = "string"
        elif self.mode == "escape":
            self.mode, self.hex_left = ("unicode", 4) if b == ord("u") else ("string", 0)
        elif b == ord("\\"):
            self.mode = "escape"
        elif b == ord('"'):
            self.mode = "colon" if self.mode == "key_string" else "after"

    def _outside_string(self, b: int) -> None:
        c = chr(b)
        if c in " \t\r\n":
            if self.mode in ("number", "literal"):
                self.mode = "after"
        elif c in "{[":
            self.stack.append(ord("}") if c == "{" else ord("]"))
            self.mode = "object_start" if c == "{" else "array_start"
        elif c in "}]":
            if self.stack:
                self.stack.pop()
            self.mode = "after"
        elif c == '"':
            self.mode = "key_string" if self.mode in ("key", "object_start") else "string"
        elif c == ":":
            self.mode = "value"
        elif c == ",":
            self.mode = "key" if self.stack and self.stack[-1] == ord("}") else "value"
        elif self.mode != "number":
            self.mode = "number" if c in "-0123456789" else "literal"

    def preferences(self) -> bytes:
        """The bytes to try next, most closing first."""
        if self.mode in ("after", "number", "literal"):
            return (bytes([self.stack[-1]]) if self.stack else b"") + b","
        return _PREFERENCES[self.mode]


class ClosingSearch:
    """Short completions to an accepting state, for one vocabulary (see the module docstring)."""

    def __init__(self, lltokenizer: llg.LLTokenizer, token_bytes: list[bytes]):
        self.lltokenizer = lltokenizer
        self.token_bytes = token_bytes
        single = np.full(256, -1, dtype=np.int64)  # byte -> a token that is exactly that byte
        for token in range(len(token_bytes) - 1, -1, -1):  # the lowest id wins
            data = token_bytes[token]
            if len(data) == 1 and not lltokenizer.is_special_token(token):
                single[data[0]] = token
        self.has_byte = single >= 0
        self.byte_token = np.where(self.has_byte, single, 0)
        # Printable bytes before the rest when nothing ranked fits: whitespace and control bytes last.
        self.fallback_order = np.array(list(range(33, 127)) + list(range(128, 256)) + list(range(0, 33)) + [127])

    def closing(self, matcher: llg.LLMatcher, syntax: JsonSyntax, limit: int = MAX_CLOSING_TOKENS) -> list[int] | None:
        """Tokens that take `matcher` (left unchanged) to an accepting state, at most `limit`, or None."""
        m, s = matcher.deep_copy(), syntax.copy()
        tokens: list[int] = []  # mostly one byte each until `_fewer_tokens`: the walk may take 4x the limit
        used = np.zeros(256, dtype=np.int64)
        while not m.is_accepting():
            if len(tokens) >= 4 * limit or m.is_error():
                return None
            forced = m.compute_ff_tokens()
            if not forced:
                byte = self._next_byte(m, s, used)
                if byte is None:
                    return None
                used[byte] += 1
                forced = [int(self.byte_token[byte])]
            if not m.consume_tokens(forced):
                return None
            s.feed(b"".join(self.token_bytes[t] for t in forced))
            tokens += forced
        tokens = self._fewer_tokens(matcher, tokens)
        return tokens if len(tokens) <= limit else None

    def _next_byte(self, m: llg.LLMatcher, s: JsonSyntax, used: np.ndarray) -> int | None:
        words = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
        ids = self.byte_token
        allowed = self.has_byte & ((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)
        for byte in s.preferences():
            if allowed[byte]:
                return byte
        order = self.fallback_order[allowed[self.fallback_order]]
        if not len(order):
            return None
        return int(order[np.argmin(used[order])])  # the least used (first of equals): no loop on one byte

    def _fewer_tokens(self, matcher: llg.LLMatcher, tokens: list[int]) -> list[int]:
        """The same bytes in the tokenizer's own (usually fewer) tokens, if the matcher takes them."""
        if len(tokens) < 2:
            return tokens
        retokenized = self.lltokenizer.tokenize_bytes(b"".join(self.token_bytes[t] for t in tokens))
        if len(retokenized) >= len(tokens):
            return tokens
        probe = matcher.deep_copy()
        if probe.consume_tokens(retokenized) and probe.is_accepting():
            return retokenized
        return tokens


class LengthCloser:
    """One request's close-on-length state, fed the tokens its matcher consumes (see the module
    docstring). `reserve` is the length of the known closing (None: not computed, or none found)."""

    def __init__(self, search: ClosingSearch):
        self.search = search
        self.matched: list[int] = []  # the tokens the matcher has consumed
        self.syntax = JsonSyntax()
        self.plan: list[int] | None = None  # a closing from the matcher's current state
        self.reserve: int | None = None
        self.closed = False  # the closing was forced: nothing more to do

    def consumed(self, tokens: list[int]) -> None:
        self.matched += tokens
        self.syntax.feed(b"".join(self.search.token_bytes[t] for t in tokens))
        plan, self.plan = self.plan, None
        if plan is not None and plan[:len(tokens)] == list(tokens):  # the output followed the closing
            self.plan = plan[len(tokens):]

    def copy(self) -> "LengthCloser":
        """An independent copy (a verify pass walks drafts with one)."""
        other = copy.copy(self)
        other.matched, other.syntax = list(self.matched), self.syntax.copy()
        return other

    def dormant(self, budget: int) -> bool:
        """Whether, with `budget` tokens left, nothing is due: the closing was forced, or the budget
        is far beyond the known reserve."""
        return self.closed or (self.reserve is not None and budget > 4 * self.reserve + 64)

    def rolled_back(self, n: int) -> None:
        del self.matched[len(self.matched) - n:]
        self.syntax = JsonSyntax()
        self.syntax.feed(b"".join(self.search.token_bytes[t] for t in self.matched))
        self.plan = None

    def closing_due(self, matcher: llg.LLMatcher, budget: int) -> list[int] | None:
        """The closing to force now (the remaining `budget` equals the reserve), or None. Keeps
        `reserve` current in the last stretch of the budget."""
        if self.dormant(budget):
            return None
        if self.plan is None:
            self.plan = self.search.closing(matcher, self.syntax)
        self.reserve = None if self.plan is None else len(self.plan)
        if self.plan is None or budget > len(self.plan) or not self.plan:
            return None
        if len(self.plan) > budget:  # a single token opened more than the budget could close
            logger.warning("close_on_length: the closing needs %d tokens, %d are left: the output is cut",
                           len(self.plan), budget)
        self.closed = True
        return self.plan

    def thinking_end_due(self, matcher: llg.LLMatcher, budget: int, end_ids: list[int]) -> list[int]:
        """While a reasoning model thinks (the matcher has consumed nothing of the answer yet): the
        end tag's tokens to force now, once the budget left is the tag plus the answer's shortest
        closing, so that the answer still closes; else []. Keeps `reserve` as tag + closing."""
        if self.closed:
            return []
        if self.plan is None:
            self.plan = self.search.closing(matcher, self.syntax)
        if self.plan is None:
            return []
        self.reserve = len(end_ids) + len(self.plan)
        return list(end_ids) if budget <= self.reserve else []

    def in_zone(self, budget: int) -> bool:
        """Whether the next sampled token must be checked (see `safe_tokens`)."""
        return not self.closed and self.reserve is not None and budget <= self.reserve + ZONE

    def safe_tokens(self, matcher: llg.LLMatcher, candidates: list[int], budget: int, eos: set[int]) -> list[int]:
        """The candidates after which a closing still fits the budget that remains (`budget` - 1)."""
        safe = [self.plan[0]] if self.plan else []
        for token in candidates:
            if token in eos or token in safe:  # EOS is allowed only where the output is complete
                safe.append(token)
                continue
            probe = matcher.deep_copy()
            if not probe.consume_token(token):
                continue
            if self.plan and self._still_closes(probe):  # a string's content: the same closing fits
                safe.append(token)
                continue
            syntax = self.syntax.copy()
            syntax.feed(self.search.token_bytes[token])
            if self.search.closing(probe, syntax, limit=budget - 1) is not None:
                safe.append(token)
        return safe

    def _still_closes(self, probe: llg.LLMatcher) -> bool:
        """Whether the current closing also closes `probe` (consumed by the check)."""
        return probe.validate_tokens(self.plan) == len(self.plan) and probe.consume_tokens(self.plan) \
            and probe.is_accepting()
