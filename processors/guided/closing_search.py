"""`ClosingSearch`: the shortest closing of a JSON-constrained output, from its matcher's state, for
close-on-length (`closing.py`, which keeps one request's closing within its budget).

`ClosingSearch.closing` finds a short completion from a matcher's state to an accepting one, checked
against the matcher at every byte, so it is always valid: the grammar's forced tokens where it has
them; else the byte `JsonSyntax` (where in the JSON text the output is) ranks as most closing — `"`
in a string, `}` / `]` after a value — with distinct keys where it must add some (`minProperties`);
where a value starts, the value whose completion is shortest (`0`, `""`, `null`, or the shortest of
the values that need more, each walked with a bound); and inside a string, number or key whose
rules the ranking does not know (a `format`, `pattern`, `enum`, `minLength`), the shortest bytes to
where it may end, found breadth-first over one byte of each kind per step (`_lexeme_path`).

Digits are tried 1-9 before 0 and upper-case letters before lower-case, so that where the search
writes a value itself it is one validators accept (`1111-11-11T11:11:11Z`, not year 0000 or `t`/`z`).
"""

from __future__ import annotations

import llguidance as llg
import numpy as np

from fastdeploy_lp.processors.guided.json_syntax import JsonSyntax

MAX_CLOSING_BYTES = 1024  # a longer closing is not searched for: the schema is refused, or kept below it
LEXEME_NODES = 4000  # matcher states one breadth-first lexeme search may visit

_OPENERS = b'{[",:'  # the bytes that start a value, key or item: each may lengthen the closing
_KEY_FILL = b"0123456789abcdefghijklmnopqrstuvwxyz"  # what makes a key the closing adds distinct
_FOLLOW = np.frombuffer(b",]} \t\r\n", dtype=np.uint8)  # what may follow a complete number or literal
# The lexeme search's order within a kind: 1-9 before 0 and upper case before lower, so that a date it
# writes is `1111-11-11T11:11:11Z` (validators reject year 0000 and many reject a lower-case `t`/`z`).
_DIGITS, _LOWER, _UPPER = np.array(list(range(49, 58)) + [48]), np.arange(97, 123), np.arange(65, 91)
_PUNCTUATION = np.array([32] + list(range(33, 48)) + list(range(58, 65)) + list(range(91, 97)) + list(range(123, 127)))


class ClosingSearch:
    """Short completions to an accepting state, for one vocabulary (see the module docstring), and
    the per-token counts of `{ [ " , :` that bound what a token can add to a closing."""

    def __init__(self, lltokenizer: llg.LLTokenizer, token_bytes: list[bytes], vocab_size: int | None = None):
        self.lltokenizer = lltokenizer
        self.token_bytes = token_bytes
        self.eos = lltokenizer.eos_token  # valid exactly where the grammar is complete
        single = np.full(256, -1, dtype=np.int64)  # byte -> a token that is exactly that byte
        for token in range(len(token_bytes) - 1, -1, -1):  # the lowest id wins
            data = token_bytes[token]
            if len(data) == 1 and not lltokenizer.is_special_token(token):
                single[data[0]] = token
        # Where a byte has two tokens, the tokenizer's own: a grammar may allow it and not the byte-fallback
        # `<0x2C>` (after `0` in an integer only the plain `,`), and the search would see the byte as banned.
        for byte in np.flatnonzero(single >= 0).tolist():
            own = lltokenizer.tokenize_bytes(bytes([byte]))
            if len(own) == 1 and 0 <= own[0] < len(token_bytes) and token_bytes[own[0]] == bytes([byte]):
                single[byte] = own[0]
        self.has_byte = single >= 0
        self.byte_token = np.where(self.has_byte, single, 0)
        self._byte_word, self._byte_bit = self.byte_token >> 5, (self.byte_token & 31).astype(np.uint32)
        # Printable bytes before the rest when nothing ranked fits: whitespace and control bytes last.
        self.fallback_order = np.array(list(range(33, 127)) + list(range(128, 256)) + list(range(33)) + [127])
        self.openers = _count_openers(token_bytes, max(vocab_size or 0, len(token_bytes)))
        self.max_openers = int(self.openers.max(initial=0))
        width = -(-len(self.openers) // 32) * 32
        padded = np.full(width, self.max_openers + 1, dtype=np.int32)
        padded[:len(self.openers)] = self.openers
        # Packed masks (llguidance's layout: bit t % 32 of word t // 32) of the tokens with at most k openers.
        self._at_most = [np.packbits(padded <= k, bitorder="little").view(np.uint32)
                         for k in range(self.max_openers + 1)]

    # -- token facts ----------------------------------------------------------------------------
    def bytes_of(self, tokens) -> bytes:
        return b"".join(self.token_bytes[t] if 0 <= t < len(self.token_bytes) else b"" for t in tokens)

    def growth(self, tokens, unit: int) -> int:
        """The most `tokens` (sampled, in order) can add to a closing, in bytes."""
        return sum(int(1 + self.openers[t]) * unit for t in tokens)

    def widest_growth(self, unit: int) -> int:
        return (1 + self.max_openers) * unit

    def closes(self, matcher: llg.LLMatcher, tokens: list[int]) -> bool:
        """Whether `tokens` take `matcher` (unchanged: a validation, no copy) to a complete document."""
        return matcher.validate_tokens(list(tokens) + [self.eos]) == len(tokens) + 1

    def with_openers_at_most(self, k: int) -> np.ndarray:
        """A fresh packed mask of the tokens with at most `k` openers (none for k < 0)."""
        if k < 0:
            return np.zeros_like(self._at_most[0])
        return self._at_most[min(k, self.max_openers)].copy()

    # -- the search -----------------------------------------------------------------------------
    def closing(self, matcher: llg.LLMatcher, syntax: JsonSyntax, limit: int = MAX_CLOSING_BYTES,
                memo: dict | None = None) -> list[int] | None:
        """Tokens that take `matcher` (left unchanged) to an accepting state, at most `limit`, or None.
        `memo` keeps lexeme paths between searches of one request (`_lexeme_path`)."""
        cap = min(4 * max(limit, 0), MAX_CLOSING_BYTES)  # mostly one byte a token until `_fewer_tokens`
        tokens = self._walk(matcher.deep_copy(), syntax.copy(), cap, memo=memo)
        if tokens is None:
            return None
        tokens = self._fewer_tokens(matcher, tokens)
        return tokens if len(tokens) <= limit else None

    def _walk(self, m: llg.LLMatcher, s: JsonSyntax, cap: int, depth: int | None = None,
              memo: dict | None = None) -> list[int] | None:
        """Tokens that take `m` (advanced with `s`) to an accepting state — or, with `depth`, to where
        the value being written at that container depth is complete — at most `cap`, or None."""
        tokens: list[int] = []
        used = np.zeros(256, dtype=np.int64)
        while not m.is_accepting():
            if len(tokens) > cap or m.is_error():
                return None
            forced = m.compute_ff_tokens()
            if forced:
                path = forced
            else:
                allowed = self._allowed(m)
                if depth is not None and self._value_done(s, allowed, depth):
                    return tokens
                byte = self._value_start(m, s, allowed, cap - len(tokens), memo) if s.at_value_start() else None
                if byte is None:
                    byte = self._preferred(s, allowed)
                path = [int(self.byte_token[byte])] if byte is not None else \
                    self._lexeme_path(m, s, allowed, cap - len(tokens), memo)
                if path is None:  # nothing found: the least used allowed byte, so as not to go round in circles
                    order = self.fallback_order[allowed[self.fallback_order]]
                    if not len(order):
                        return None
                    byte = int(order[np.argmin(used[order])])
                    used[byte] += 1
                    path = [int(self.byte_token[byte])]
            if not m.consume_tokens(path):
                return None
            s.feed(self.bytes_of(path))
            tokens += path
        return tokens

    def _allowed(self, m: llg.LLMatcher) -> np.ndarray:
        """Which bytes `m` allows next as single-byte tokens: bool[256]."""
        words = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
        return self.has_byte & ((words[self._byte_word] >> self._byte_bit) & 1).astype(bool)

    def _preferred(self, s: JsonSyntax, allowed: np.ndarray) -> int | None:
        if s.mode == "string" and s.in_key:
            return self._key_byte(s, allowed)
        for byte in s.preferences():
            if allowed[byte]:
                return byte
        return None

    @staticmethod
    def _key_byte(s: JsonSyntax, allowed: np.ndarray) -> int | None:
        """In a key that may end: `"` if the key is new in its object, else a byte that makes it new.
        (Where it may not end yet — property names, a pattern — the lexeme search finds the end.)"""
        if not allowed[ord('"')]:
            return None
        keys = s.objects[-1][0] if s.objects else set()
        if s.key not in keys:
            return ord('"')
        fills = [b for b in _KEY_FILL if allowed[b]]
        return next((b for b in fills if s.key + bytes([b]) not in keys), fills[0] if fills else None)

    @staticmethod
    def _value_done(s: JsonSyntax, allowed: np.ndarray, depth: int) -> bool:
        """Whether the value started at container depth `depth` is complete."""
        if len(s.stack) != depth:
            return False
        if s.mode == "after":
            return True
        return s.mode in ("number", "literal") and bool(allowed[_FOLLOW].any())

    def _value_start(self, m: llg.LLMatcher, s: JsonSyntax, allowed: np.ndarray, cap: int,
                     memo: dict | None = None) -> int | None:
        """Where a value starts: the byte that starts its shortest completion. A value that closes
        right after its start (`0`, `""`, `[]`, `{}`, a literal) costs its length; one that needs more
        (required keys, `minItems`, a `format`) is walked, bounded by the best so far."""
        if s.mode == "array_start" and allowed[ord("]")]:
            return ord("]")
        digits = [b for b in b"123456789" if allowed[b]][:1]
        options = [b for b in b'0"[{nft-' if allowed[b]] + ([] if allowed[ord("0")] else digits)
        if len(options) <= 1:
            return options[0] if options else None
        best, best_cost, needs_more = None, float("inf"), []
        for b in options:
            cost = self._closes_at_once(m, b)
            if cost is None:
                needs_more.append(b)
            elif cost < best_cost:
                best, best_cost = b, cost
        if best_cost <= 2:  # nothing that needs more is shorter than 2 bytes
            return best
        for b in needs_more:
            probe, syntax = m.deep_copy(), s.copy()
            if not probe.consume_token(int(self.byte_token[b])):
                continue
            syntax.feed(bytes([b]))
            bound = cap if best is None else min(cap, int(best_cost) - 2)
            rest = self._walk(probe, syntax, bound, depth=len(s.stack), memo=memo) if bound >= 0 else None
            if rest is not None and 1 + len(rest) < best_cost:
                best, best_cost = b, 1 + len(rest)
        return best if best is not None else needs_more[0]

    def _closes_at_once(self, m: llg.LLMatcher, byte: int) -> int | None:
        """The bytes of the value `byte` starts if it can end right away, else None."""
        if byte in b"nt":
            return 4
        if byte == ord("f"):
            return 5
        if byte == ord("-"):
            return None
        probe = m.deep_copy()
        if not probe.consume_token(int(self.byte_token[byte])):
            return None
        end = {ord('"'): b'"', ord("["): b"]", ord("{"): b"}"}.get(byte)
        allowed = self._allowed(probe)
        if end is not None:
            return 2 if allowed[end[0]] else None
        return 1 if probe.is_accepting() or allowed[_FOLLOW].any() else None

    def _lexeme_path(self, m: llg.LLMatcher, s: JsonSyntax, allowed: np.ndarray, cap: int,
                     memo: dict | None = None) -> list[int] | None:
        """The fewest tokens after which a ranked byte is allowed (or the document is complete), where
        none is now: breadth-first, one byte of each kind per step (`_representatives`) and the tokens
        the grammar forces after it; of the states at a depth with the same next bytes and syntax one
        is kept (a format's position is not visible in them, so a state seen at another depth is not
        the same). A depth's states take turns, those whose next bytes changed first (`@` in an
        email): all ends at a depth are as short, and one is usually found past them. A path found
        from a state with the same signature before (`memo`) is tried first: taken up to its first
        end if the matcher follows it there."""
        key = self._signature(s, allowed, m)
        if memo is not None and key in memo:
            path = self._follow(m, s, memo[key], cap)
            if path is not None:
                return path
        path = self._breadth_first(m, s, allowed, cap)
        if memo is not None and path is not None:
            if len(memo) >= 256:
                memo.clear()
            memo[key] = path
        return path

    def _follow(self, m: llg.LLMatcher, s: JsonSyntax, path: list[int], cap: int) -> list[int] | None:
        """`path` up to the first state where a ranked byte is allowed, if the matcher takes it."""
        m, s = m.deep_copy(), s.copy()
        for i, token in enumerate(path[:cap]):
            if not m.consume_token(token):
                return None
            s.feed(self.bytes_of([token]))
            if self._is_end(m, s, self._allowed(m)):
                return path[:i + 1]
        return None

    def _is_end(self, m: llg.LLMatcher, s: JsonSyntax, allowed: np.ndarray) -> bool:
        """Where a lexeme path ends: the document is complete, or a ranked byte is allowed."""
        return m.is_accepting() or self._preferred(s, allowed) is not None or (s.at_value_start() and allowed.any())

    def _breadth_first(self, m: llg.LLMatcher, s: JsonSyntax, allowed: np.ndarray, cap: int) -> list[int] | None:
        frontier = [(m, s, allowed, [])]
        visits = 0
        while frontier and len(frontier[0][3]) < cap:
            following, seen = [], set()
            choices = [self._representatives(node[2]) for node in frontier]
            for i in range(max(map(len, choices))):
                for (pm, ps, pallowed, path), bytes_ in zip(frontier, choices):
                    if i >= len(bytes_):
                        continue
                    cm, step = pm.deep_copy(), [int(self.byte_token[bytes_[i]])]
                    if not cm.consume_tokens(step):
                        continue
                    forced = cm.compute_ff_tokens()
                    if forced and not cm.consume_tokens(forced):
                        continue
                    step += forced
                    cs = ps.copy()
                    cs.feed(self.bytes_of(step))
                    visits += 1
                    callowed = self._allowed(cm)
                    if self._is_end(cm, cs, callowed):
                        return path + step
                    signature = self._signature(cs, callowed, cm)
                    if signature not in seen:
                        seen.add(signature)
                        moved = not np.array_equal(callowed, pallowed) or cs.mode != ps.mode
                        following.append((not moved, len(following), (cm, cs, callowed, path + step)))
                    if visits >= LEXEME_NODES:
                        return None
            frontier = [node for _, _, node in sorted(following, key=lambda f: f[:2])]
        return None

    @staticmethod
    def _signature(s: JsonSyntax, allowed: np.ndarray, m: llg.LLMatcher) -> tuple:
        return (np.packbits(allowed).tobytes(), s.mode, s.in_key, s.key if s.in_key else b"", len(s.stack),
                m.is_accepting())

    @staticmethod
    def _representatives(allowed: np.ndarray) -> list[int]:
        """One allowed byte of each kind (a digit, an upper-case and a lower-case letter — all of a
        kind when at most two are allowed — each punctuation byte, one non-ASCII byte), in the order
        that makes values validators accept (`_DIGITS`): of paths as short, the first found is kept."""
        out: list[int] = []
        for kind in (_DIGITS, _UPPER, _LOWER):
            present = kind[allowed[kind]]
            out += present.tolist() if len(present) <= 2 else [int(present[0])]
        out += _PUNCTUATION[allowed[_PUNCTUATION]].tolist()
        high = np.flatnonzero(allowed[128:])
        if len(high):
            out.append(128 + int(high[0]))
        return out

    def _fewer_tokens(self, matcher: llg.LLMatcher, tokens: list[int]) -> list[int]:
        """The same bytes in the tokenizer's own (usually fewer) tokens, if the matcher takes them."""
        if len(tokens) < 2:
            return tokens
        retokenized = self.lltokenizer.tokenize_bytes(self.bytes_of(tokens))
        if len(retokenized) < len(tokens) and self.closes(matcher, retokenized):
            return retokenized
        return tokens


def _count_openers(token_bytes: list[bytes], width: int) -> np.ndarray:
    """How many of `{ [ " , :` each token's bytes hold (0 for ids without bytes)."""
    lengths = np.zeros(width, dtype=np.int64)
    lengths[:len(token_bytes)] = [len(b) for b in token_bytes]
    flat = np.frombuffer(b"".join(token_bytes), dtype=np.uint8)
    hits = np.isin(flat, np.frombuffer(_OPENERS, dtype=np.uint8)).astype(np.int32)
    ends = np.cumsum(lengths)
    totals = np.concatenate([[0], np.cumsum(hits)])
    return (totals[ends] - totals[ends - lengths]).astype(np.int32)
