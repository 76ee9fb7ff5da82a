"""Reading tool calls out of generated text: `<function=NAME>{JSON}</function>`, the syntax
`processors/guided/tool_calls.py` constrains the output to.

Calls are read the way the grammar writes them, never by splitting on the end tag: after
`<function=NAME>` exactly one JSON value is scanned (strings, escapes and nesting tracked, then
checked with `json.JSONDecoder().raw_decode`), and only then is `</function>` expected. A
`</function>` inside a JSON string stays in the string. `ToolCallParser` does this incrementally
for streaming (content, call headers and argument pieces as the text arrives); `parse_tool_calls`
runs the same parser over a whole text, so a whole answer has the calls its stream had:

    content, calls = parse_tool_calls(text)   # calls: [{"name": ..., "arguments": "{...}", "complete": True}]

`arguments` is the JSON value exactly as generated (so streamed pieces concatenate to it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

from fastdeploy_lp.processors.guided.tool_calls import CALL_BEGIN, CALL_END

_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_MAX_NAME = 64
_JSON_WS = " \t\n\r"
_SCALAR_CHARS = frozenset("0123456789+-.eE" "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


@dataclass
class ParsedCall:
    """One call as the parser has read it so far."""

    index: int
    name: str
    start: int                 # offset of its `<function=` in the text
    arguments: str = ""        # the JSON value's text read so far
    end: int | None = None     # offset just past its `</function>` once complete
    failed: bool = False       # the text after the header was not one JSON value then `</function>`

    @property
    def complete(self) -> bool:
        return self.end is not None


_TEXT, _NAME, _VALUE, _END = range(4)


class ToolCallParser:
    """Incremental reader of generated text into content and calls.

    `feed(delta)` returns events, in text order:

    - `("content", text)`: text outside calls. A suffix that could still become `<function=` is
      held back until it cannot; so is trailing whitespace (sent once more text follows), and
      leading whitespace is dropped, so the content pieces join to the stripped content.
    - `("call", index, name)`: a call's header `<function=NAME>` is complete.
    - `("arguments", index, piece)`: more of that call's JSON arguments (the pieces join to the
      value exactly as generated; whitespace around the value is not part of it).
    - `("end", index)`: the call's JSON value was valid JSON and `</function>` followed.

    `finish()` flushes held-back content at the end of the output; a call header cut inside its
    name (`<function=get_wea`, a prefix of one of `names`) is neither content nor a call. A
    `<function=` whose name is not among `names` (or is not a name) is content. A call whose text stops being one JSON value then
    `</function>` is marked `failed` and the parser goes back to reading content (only possible
    without the grammar). At most `max_calls` calls are read; after that `<function=` is content.

    Each `feed` costs O(its delta + what is held back): consumed text is dropped unless
    `keep_text` (then `text` and `content()` have the whole output).
    """

    def __init__(self, names: Iterable[str] | None = None, max_calls: int | None = None, keep_text: bool = False):
        self.names = set(names) if names is not None else None
        self.max_calls = max_calls
        self.keep_text = keep_text
        self.text = ""             # with keep_text: everything fed
        self.calls: list[ParsedCall] = []
        self._buf = ""             # the text from offset _base on; positions below are relative to it
        self._base = 0
        self._i = 0                # first position not yet consumed
        self._state = _TEXT
        self._call: ParsedCall | None = None
        self._call_start = 0
        self._cut_header: int | None = None  # where a call header cut inside its name starts
        self._value_end = 0        # just past the current call's JSON value
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._scalar = False
        self._started = False
        self._content_started = False
        self._held_ws = ""

    # -- public -----------------------------------------------------------------------------------
    def feed(self, delta: str) -> list[tuple]:
        if self.keep_text:
            self.text += delta
        self._buf += delta
        events: list[tuple] = []
        while self._step(events, final=False):
            pass
        self._trim()
        return events

    def finish(self) -> list[tuple]:
        """The end of the output: what was held back as a possible tag start is content after all."""
        events: list[tuple] = []
        while self._step(events, final=True):
            pass
        if self._state == _NAME:  # `<function=` and a name that never closed
            partial = self._buf[self._i:]
            if self.names is None or any(name.startswith(partial) for name in self.names):
                self._cut_header = self._base + self._call_start  # a call's header, cut: syntax, not text
                self._i = len(self._buf)
            else:
                self._content(events, CALL_BEGIN)
            self._state = _TEXT
        if self._state == _TEXT and self._i < len(self._buf):
            self._content(events, self._buf[self._i:])
            self._i = len(self._buf)
        self._trim()
        return events

    @property
    def all_calls_complete(self) -> bool:
        """At least one call, and every call that was started is complete."""
        return bool(self.calls) and all(c.complete for c in self.calls)

    def content(self) -> str | None:
        """The text outside calls, complete or cut, stripped (None when empty), as the "content"
        events stream it: only a failed call's text stays. Needs `keep_text`."""
        if not self.keep_text:
            raise ValueError("ToolCallParser.content() needs keep_text=True")
        parts, pos = [], 0
        for c in self.calls:
            if not c.failed:
                parts.append(self.text[pos:c.start])
                pos = c.end if c.complete else len(self.text)
        parts.append(self.text[pos:self._cut_header])
        return "".join(parts).strip() or None

    # -- states -----------------------------------------------------------------------------------
    def _step(self, events: list, final: bool) -> bool:
        """Consume what can be decided now; True when the state changed (call again)."""
        if self._state == _TEXT:
            return self._read_text(events, final)
        if self._state == _NAME:
            return self._read_name(events)
        if self._state == _VALUE:
            return self._read_value(events)
        return self._read_end(events)

    def _read_text(self, events: list, final: bool) -> bool:
        text, i = self._buf, self._i
        may_call = self.max_calls is None or len(self.calls) < self.max_calls
        j = text.find(CALL_BEGIN, i) if may_call else -1
        if j >= 0:
            self._content(events, text[i:j])
            self._call_start = j
            self._i = j + len(CALL_BEGIN)
            self._state = _NAME
            return True
        keep = 0 if (final or not may_call) else _partial_suffix(text, i, CALL_BEGIN)
        if len(text) - keep > i:
            self._content(events, text[i:len(text) - keep])
            self._i = len(text) - keep
        return False

    def _read_name(self, events: list) -> bool:
        text, i = self._buf, self._i
        j = i
        while j < len(text) and text[j] in _NAME_CHARS and j - i < _MAX_NAME:
            j += 1
        if j == len(text):
            return False  # the name goes on
        name = text[i:j]
        if text[j] != ">" or not name or (self.names is not None and name not in self.names):
            # not a call: `<function=` is text; read on right after it
            self._content(events, CALL_BEGIN)
            self._i = self._call_start + len(CALL_BEGIN)
            self._state = _TEXT
            return True
        call = ParsedCall(index=len(self.calls), name=name, start=self._base + self._call_start)
        self.calls.append(call)
        self._call = call
        events.append(("call", call.index, name))
        self._i = j + 1
        self._state = _VALUE
        self._depth, self._in_string, self._escaped, self._scalar, self._started = 0, False, False, False, False
        return True

    def _read_value(self, events: list) -> bool:
        text, n = self._buf, len(self._buf)
        i = self._i
        if not self._started:
            while i < n and text[i] in _JSON_WS:
                i += 1
            if i == n:
                self._i = i
                return False
            c = text[i]
            if c not in '{["' and c not in _SCALAR_CHARS:
                self._i = i
                return self._fail()
            self._started = True
        begin = i
        i, done = self._scan_value(text, i)
        piece = text[begin:i]
        call = self._call
        if piece:
            call.arguments += piece
            events.append(("arguments", call.index, piece))
        self._i = i
        if not done:
            return False
        self._value_end = i
        if not _is_one_json_value(call.arguments):
            return self._fail()
        self._state = _END
        return True

    def _scan_value(self, text: str, i: int) -> tuple[int, bool]:
        """Scan the JSON value from `i` on, tracking strings, escapes and nesting across calls;
        returns (the position reached, whether the value ended there)."""
        n = len(text)
        while i < n:
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return i + 1, True
            elif self._scalar:
                if c not in _SCALAR_CHARS:
                    return i, True  # this character is not part of the value
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return i + 1, True
            elif self._depth == 0:
                self._scalar = True
                continue  # re-read this character as the scalar's first
            i += 1
        return i, False

    def _read_end(self, events: list) -> bool:
        text, n = self._buf, len(self._buf)
        i = self._i
        while i < n and text[i] in _JSON_WS:
            i += 1
        got = text[i:i + len(CALL_END)]
        if not CALL_END.startswith(got):
            self._i = self._value_end
            return self._fail()
        if len(got) < len(CALL_END):
            return False  # wait for the rest of the end tag
        call = self._call
        self._i = i + len(CALL_END)
        call.end = self._base + self._i
        events.append(("end", call.index))
        self._call = None
        self._state = _TEXT
        return True

    def _trim(self) -> None:
        """Drop consumed text: every state keeps what it may still read at or after `_i`."""
        cut = self._i
        if cut:
            self._buf = self._buf[cut:]
            self._base += cut
            self._i = 0
            self._call_start -= cut
            self._value_end -= cut

    def _fail(self) -> bool:
        """The call in progress is not one (only without the grammar): back to reading text."""
        self._call.failed = True
        self._call = None
        self._state = _TEXT
        return True

    def _content(self, events: list, text: str) -> None:
        if not self._content_started:
            text = text.lstrip()
        if not text:
            return
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body):]
        if body:
            self._content_started = True
            events.append(("content", body))


def parse_tool_calls(text: str, names: Iterable[str] | None = None,
                     max_calls: int | None = None) -> tuple[str | None, list[dict]]:
    """Split generated text into (content, calls), reading it as `ToolCallParser` does, so a whole
    answer has the calls and content its stream had.

    Every `<function=NAME>JSON</function>` becomes `{"name": NAME, "arguments": JSON, "complete":
    True}` (the JSON value as written); `</function>` inside a JSON string does not end the call.
    A call cut after its name (by `max_tokens` or a stop string) is one too, with the arguments
    written so far and `"complete": False`, as its stream sent it. The rest of the text, stripped,
    is the content (None when nothing is left); a call that is not a JSON value followed by
    `</function>` (only possible without the grammar) stays in the content.
    """
    parser = ToolCallParser(names, max_calls, keep_text=True)
    parser.feed(text)
    parser.finish()
    calls = [{"name": c.name, "arguments": c.arguments, "complete": c.complete} for c in parser.calls if not c.failed]
    return parser.content(), calls


def _partial_suffix(text: str, start: int, tag: str) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _is_one_json_value(text: str) -> bool:
    """`text` is exactly one JSON value (strict JSON: no NaN/Infinity, no control characters in strings)."""
    try:
        _, end = _DECODER.raw_decode(text)
    except (ValueError, RecursionError):
        return False
    return end == len(text)
