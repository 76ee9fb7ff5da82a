"""`JsonSyntax`: where a JSON text is, byte by byte — the open containers (with each object's keys)
and what may come next — and the bytes that close it fastest from there. The close-on-length search
(`closing.py`) ranks its next byte with it; the matcher alone decides what is valid."""

from __future__ import annotations

_VALUE = b'0"[{nft-123456789'  # where a value starts: the shortest JSON values first
_PREFERENCES = {
    "string": b'"', "escape": b"n\"\\/", "unicode": b"0", "colon": b":", "key": b'"}', "object_start": b'}"',
    "array_start": b"]" + _VALUE, "value": _VALUE,
}


class JsonSyntax:
    """Where a JSON text is, byte by byte: the open containers (with each object's keys), and what
    may come next. Only a ranking hint for the closing walk (the matcher decides what is valid), so
    it is lenient."""

    __slots__ = ("hex_left", "in_key", "key", "mode", "objects", "stack")

    def __init__(self):
        self.stack: list[int] = []  # the closing bytes of the open containers: ord("}") or ord("]")
        self.objects: list[list] = []  # each open object's [keys written, keys written twice not yet made up]
        self.mode = "value"
        self.hex_left = 0
        self.in_key = False  # the string being written is a key
        self.key = b""  # ... and its bytes so far

    def copy(self) -> JsonSyntax:
        other = JsonSyntax()
        other.stack, other.mode, other.hex_left = list(self.stack), self.mode, self.hex_left
        other.objects = [[set(keys), debt] for keys, debt in self.objects]
        other.in_key, other.key = self.in_key, self.key
        return other

    def feed(self, data: bytes) -> None:
        for b in data:
            if self.mode in ("string", "escape", "unicode"):
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
            if self.in_key:
                self._key_written()
            self.mode = "colon" if self.in_key else "after"
            self.in_key = False
            return
        if self.in_key:
            self.key += bytes([b])

    def _key_written(self) -> None:
        if not self.objects:
            return
        entry = self.objects[-1]
        if self.key in entry[0]:
            entry[1] += 1  # parsed, the object has one property fewer than the grammar counted
        else:
            entry[0].add(self.key)
            entry[1] = max(0, entry[1] - 1)

    def _outside_string(self, b: int) -> None:
        c = chr(b)
        if c in " \t\r\n":
            if self.mode in ("number", "literal"):
                self.mode = "after"
        elif c in "{[":
            self.stack.append(ord("}") if c == "{" else ord("]"))
            if c == "{":
                self.objects.append([set(), 0])
            self.mode = "object_start" if c == "{" else "array_start"
        elif c in "}]":
            if self.stack and self.stack.pop() == ord("}") and self.objects:
                self.objects.pop()
            self.mode = "after"
        elif c == '"':
            self.in_key, self.key = self.mode in ("key", "object_start"), b""
            self.mode = "string"
        elif c == ":":
            self.mode = "value"
        elif c == ",":
            self.mode = "key" if self.in_object() else "value"
        elif self.mode != "number":
            self.mode = "number" if c in "-0123456789" else "literal"

    def in_object(self) -> bool:
        return bool(self.stack) and self.stack[-1] == ord("}")

    def at_value_start(self) -> bool:
        return self.mode in ("value", "array_start")

    def preferences(self) -> bytes:
        """The bytes to try next, most closing first (keys: see `ClosingSearch._key_byte`)."""
        if self.mode in ("after", "number", "literal"):
            close = bytes([self.stack[-1]]) if self.stack else b""
            if self.in_object() and self.objects and self.objects[-1][1]:
                return b"," + close  # a key was written twice: one more distinct key before `}`
            return close + b","
        return _PREFERENCES[self.mode]
