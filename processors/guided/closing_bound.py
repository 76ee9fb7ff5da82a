"""How much one step of a JSON output can lengthen its shortest closing, read from the schema.

close_on_length (`closing.py`) keeps back the tokens the closing needs. Far from `max_tokens` it does
not search for the closing at every step: it only needs to know that the next token cannot make
the closing longer than the budget. This module gives the bound it uses: `step_bound(schema)`, in
bytes, the most one *event* of the output can add to the closing, where an event is a value, key or
array item started, or bytes written inside one string, number or key. A token with `n` of the
bytes `{ [ " , :` takes part in at most `n + 1` events, so it adds at most `(n + 1) * step_bound`.

    step_bound({"type": "object", "properties": {"d": {"type": "string", "format": "date"}},
                "required": ["d"]})   # 21: `{"d": "` then 10 bytes of date, `"}`, and slack

The bound is the largest of: the shortest document of every branch a value may start in (an object
with its required keys, `minProperties` distinct keys, an array with `minItems` items, the longest
`enum` value — the shortest document of a child counts, as the closing picks it); a key with its
value; an array item; the most a string may still need from anywhere inside it (`minLength`, plus
what its `format` or `pattern` needs, read from the regex); a number's digits. Validation keywords
llguidance does not implement are refused by it before this runs, and the keys it ignores are
ignored here; a schema this module cannot read (a remote `$ref`, a regex Python cannot parse, a
`format` it has no length for) gives None, and the request checks every token instead.
"""

from __future__ import annotations

import json
import math
import re
import re._parser as sre
from typing import Any

# The most bytes a string of each format may still need from anywhere inside it, its closing quote
# excluded (llguidance's regexes, probed with the closing search; generous).
FORMAT_BYTES = {"date": 10, "time": 24, "date-time": 36, "duration": 24, "email": 8, "hostname": 8,
                "ipv4": 15, "ipv6": 45, "uuid": 36, "uri": 12}
_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
# The keywords llguidance implements (any other key is refused by it, or an annotation it ignores).
_VALIDATION = {
    "type", "properties", "required", "additionalProperties", "patternProperties", "minProperties",
    "maxProperties", "items", "prefixItems", "additionalItems", "minItems", "maxItems", "anyOf", "oneOf", "allOf",
    "$ref", "enum", "const", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
_ESCAPE = 6  # `\u0000`: what an escape started inside a string may still need


class Unreadable(Exception):
    """The schema uses something the bound does not model."""


def step_bound(schema: Any) -> int | None:
    """The most bytes one event of the output can add to the shortest closing (module docstring);
    None if the schema cannot be read."""
    try:
        return _Bound(schema).step()
    except (Unreadable, RecursionError):
        return None


class _Bound:
    def __init__(self, root: Any):
        self.root = root
        options = root.get("x-guidance", {}) if isinstance(root, dict) else {}
        flexible = options.get("whitespace_flexible", True)
        self.item_sep = 1 if flexible else len(options.get("item_separator", ","))
        self.key_sep = 1 if flexible else len(options.get("key_separator", ":"))
        self.nodes = self._reachable()
        self.doc = {id(n): math.inf for n in self.nodes}
        self.entries: dict[int, float] = {}
        for _ in range(len(self.nodes) + 1):  # shortest documents, to a fixed point ($ref cycles)
            changed = False
            for node in reversed(self.nodes):  # children mostly before their parents
                value = self._doc(node)
                if value < self.doc[id(node)]:
                    self.doc[id(node)], changed = value, True
            if not changed:
                break

    # -- the graph of subschemas ---------------------------------------------------------------
    def _reachable(self) -> list:
        seen, order, stack = set(), [], [self.root]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            order.append(node)
            stack.extend(self._children(node))
        return order

    def _children(self, node) -> list:
        if isinstance(node, bool):
            return []
        if not isinstance(node, dict):
            raise Unreadable("a subschema that is not an object")
        out = list((node.get("properties") or {}).values()) + list((node.get("patternProperties") or {}).values())
        for key in ("additionalProperties", "items", "additionalItems"):
            if isinstance(node.get(key), (dict, bool)):
                out.append(node[key])
        for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
            out += list(node.get(key) or [])
        if isinstance(node.get("items"), list):  # draft 4's tuple form
            out += node["items"]
        if "$ref" in node:
            out.append(self._target(node["$ref"]))
        return out

    def _target(self, ref) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise Unreadable(f"$ref {ref!r}")
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise Unreadable(f"$ref {ref!r}")
        return node

    # -- shortest documents ----------------------------------------------------------------------
    def _doc(self, node) -> float:
        """Bytes of a short document of `node` (an upper bound on its shortest one)."""
        if node is True:
            return 1
        if node is False:
            return math.inf
        if _says_nothing(node):
            return 1
        own = self._own(node, min)
        return own + self._combined(node, lambda sub: self.doc[id(sub)], min)

    def _own(self, node: dict, pick) -> float:
        """The node's own keywords: the shortest (pick=min) or the longest (max) branch a value of
        it may start in; 0 when it says nothing of its own."""
        if "const" in node or "enum" in node:
            values = [node["const"]] if "const" in node else list(node["enum"])
            return pick((self._dumped(v) for v in values), default=math.inf)
        types = node.get("type", _TYPES if set(node) & _TYPED else ())
        types = [types] if isinstance(types, str) else list(types)
        return pick((self._type_doc(node, t, pick) for t in types), default=0)

    def _combined(self, node: dict, size, pick) -> float:
        """What `allOf` / `anyOf` / `oneOf` / `$ref` beside the node's own keywords add (their
        documents merged with the node's: at most the sum)."""
        total = sum(size(sub) for sub in node.get("allOf") or [])
        for key in ("anyOf", "oneOf"):
            if node.get(key):
                total += pick(size(sub) for sub in node[key])
        if "$ref" in node:
            total += size(self._target(node["$ref"]))
        return total

    def _type_doc(self, node: dict, kind: str, pick) -> float:
        if kind == "null":
            return 4
        if kind == "boolean":
            return 5 if pick is max else 4
        if kind in ("integer", "number"):
            return self._number_start(node)
        if kind == "string":
            return 2 + self._string_bytes(node)
        if kind == "array":
            return self._array_doc(node)
        if kind == "object":
            return self._object_doc(node)
        raise Unreadable(f"type {kind!r}")

    def _dumped(self, value) -> int:
        text = json.dumps(value, separators=("," + " " * (self.item_sep - 1), ":" + " " * (self.key_sep - 1)))
        return len(text.encode())

    def _number_start(self, node: dict) -> int:
        """A number that meets the bounds: `0`, or the digits a positive minimum (negative maximum)
        forces."""
        return 1 + self._forced_digits(node)

    @staticmethod
    def _forced_digits(node: dict) -> int:
        digits = 0
        for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            value = node.get(key)
            forcing = (key.endswith("inimum") and value > 0) or (key.endswith("aximum") and value < 0) \
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else False
            if forcing:
                digits = max(digits, len(str(int(abs(value)))) + 2)
        return digits

    def _number_bytes(self, node: dict) -> int:
        """The most a number may still need from inside it: a sign or point needs a digit, a
        forced magnitude its digits, a `multipleOf` fraction its decimals."""
        step = node.get("multipleOf")
        decimals = 0
        if isinstance(step, (int, float)) and not isinstance(step, bool) and 0 < step < 1:
            decimals = len(f"{step:.20f}".rstrip("0").split(".")[1])
        return 3 + self._forced_digits(node) + decimals

    def _string_bytes(self, node: dict) -> float:
        """The most a string may still need from anywhere inside it, its closing quote excluded."""
        need = node.get("minLength", 0) if isinstance(node.get("minLength"), int) else 0
        if "format" in node:
            if node["format"] not in FORMAT_BYTES:
                raise Unreadable(f"format {node['format']!r}")
            need += FORMAT_BYTES[node["format"]]
        if isinstance(node.get("pattern"), str):
            need += regex_bytes(node["pattern"])
        return need

    def _array_doc(self, node: dict) -> float:
        count = node.get("minItems", 0) if isinstance(node.get("minItems"), int) else 0
        prefix, rest_schema = _items(node)
        prefix = prefix[:count]
        total = 2 + sum(self._child(sub) for sub in prefix) + max(0, count - 1) * self.item_sep
        rest = count - len(prefix)
        if rest > 0:
            total += rest * self._child(rest_schema)
        return total

    def _object_doc(self, node: dict) -> float:
        required = [r for r in node.get("required") or [] if isinstance(r, str)]
        extra = max(0, (node.get("minProperties") or 0) - len(required))
        total = 2 + sum(self._key(r) + self.key_sep + self._child(self._value(node, r)) for r in required)
        if extra:
            total += extra * (self._extra_key(node) + self.key_sep + self._extra_value(node))
        return total + max(0, len(required) + extra - 1) * self.item_sep

    def _child(self, sub) -> float:
        if isinstance(sub, bool):
            return 1 if sub else math.inf
        return self.doc[id(sub)] if isinstance(sub, dict) else math.inf

    def _value(self, node: dict, key: str):
        if key in (node.get("properties") or {}):
            return node["properties"][key]
        for pattern, sub in (node.get("patternProperties") or {}).items():
            if re.search(pattern, key):
                return sub
        return node.get("additionalProperties", True)

    @staticmethod
    def _key(name: str) -> int:
        return len(json.dumps(name))

    def _extra_key(self, node: dict) -> float:
        """A key the closing adds for `minProperties`: distinct, short (`""`, `"0"`, ...)."""
        count = node.get("minProperties") or 0
        keys = [2 + len(str(count))] + [2 + regex_bytes(p) for p in node.get("patternProperties") or {}]
        if node.get("additionalProperties", True) is False:
            keys += [self._key(k) for k in node.get("properties") or {}]
        return max(keys)

    def _extra_value(self, node: dict) -> float:
        values = [self._child(s) for s in (node.get("patternProperties") or {}).values()]
        if node.get("additionalProperties", True) is not False:
            values.append(self._child(node.get("additionalProperties", True)))
        else:
            values += [self._child(s) for s in (node.get("properties") or {}).values()]
        return max(values, default=math.inf)

    # -- the bound -------------------------------------------------------------------------------
    def step(self) -> int:
        events = [_ESCAPE + 2]
        for node in self.nodes:
            if isinstance(node, bool) or _says_nothing(node):
                events.append(8)  # any value: `false` where `0` was planned, a key and `0` in an object
                continue
            # A value that starts in a longer branch than the closing planned for it.
            events.append(self._entry(node) - self.doc[id(node)])
            if "properties" in node or "patternProperties" in node or node.get("type") == "object" or \
                    "additionalProperties" in node or "minProperties" in node:
                events.append(self._member(node) + self.item_sep)
            if node.get("type") == "array" or "items" in node or "prefixItems" in node:
                prefix, rest = _items(node)
                events.append(self.item_sep + max(self._entry(s) for s in [*prefix, rest]))
            events.append(2 + self._string_bytes(node) + _ESCAPE)
            events.append(self._number_bytes(node))
        finite = [e for e in events if e != math.inf]
        return math.ceil(max(finite))

    def _entry(self, sub) -> float:
        """The longest branch a value of `sub` may start in (through its combinators and `$ref`)."""
        if isinstance(sub, bool) or _says_nothing(sub):
            return math.inf if sub is False else 5
        if id(sub) not in self.entries:
            self.entries[id(sub)] = self.doc[id(sub)]  # a cycle of combinators adds nothing
            self.entries[id(sub)] = self._own(sub, max) + self._combined(sub, self._entry, max)
        return self.entries[id(sub)]

    def _member(self, node: dict) -> float:
        """A key the output starts that the closing did not plan (not a required one), and its
        value: the longest such key and its value's shortest document."""
        props = node.get("properties") or {}
        required = set(node.get("required") or [])
        keys = [self._key(k) + self.key_sep + self._child(v) for k, v in props.items() if k not in required]
        keys += [2 + regex_bytes(p) + self.key_sep + self._child(s)
                 for p, s in (node.get("patternProperties") or {}).items()]
        if node.get("additionalProperties", True) is not False:
            keys.append(self._extra_key(node) + self.key_sep + self._child(node.get("additionalProperties", True)))
        return max(keys, default=0)


_TYPED = {"properties", "required", "additionalProperties", "patternProperties", "minProperties", "maxProperties",
          "items", "prefixItems", "additionalItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "minimum",
          "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}


def _says_nothing(node) -> bool:
    """Whether a schema object allows any value (no validation keyword)."""
    return isinstance(node, dict) and not (set(node) & _VALIDATION)


def _items(node: dict) -> tuple[list, Any]:
    """(the schemas of the first items, the schema of the rest), in draft 2020's or draft 4's form."""
    if isinstance(node.get("items"), list):
        return list(node["items"]), node.get("additionalItems", True)
    return list(node.get("prefixItems") or []), node.get("items", True)


def regex_bytes(pattern: str) -> int:
    """The most bytes a match of `pattern` may still need from anywhere inside it (an upper bound:
    a sequence needs at most the sum of its parts, a repeat its body plus its minimum count of
    bodies, a character at most 4 bytes, 2 when JSON escapes it). Unparsable: `Unreadable`."""
    try:
        tree = sre.parse(pattern)
    except Exception as e:  # noqa: BLE001 - re.error, and anything Python's parser makes of an ECMA regex
        raise Unreadable(f"pattern {pattern!r}: {e}") from None
    return _regex_bytes(list(tree))


def _regex_bytes(items: list) -> int:
    total = 0
    for op, arg in items:
        name = str(op)
        if name == "LITERAL":
            total += 2 if arg in (0x22, 0x5C) else 6 if arg < 0x20 else len(chr(arg).encode())
        elif name in ("ANY", "IN", "NOT_LITERAL", "CATEGORY"):
            total += 4 if name == "IN" and _non_ascii_set(arg) else 1
        elif name == "SUBPATTERN":
            total += _regex_bytes(list(arg[-1]))
        elif name == "BRANCH":
            total += max(_regex_bytes(list(b)) for b in arg[1])
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, _, body = arg
            total += _regex_bytes(list(body)) * (1 + min(low, 1 << 20))
        elif name in ("AT", "ASSERT", "ASSERT_NOT"):
            continue
        elif name == "ATOMIC_GROUP":
            total += _regex_bytes(list(arg))
        else:
            raise Unreadable(f"regex construct {name}")
    return total


def _non_ascii_set(items) -> bool:
    """Whether a character set holds no ASCII character (the closing then writes a wider one)."""
    for op, arg in items:
        name = str(op)
        if name == "NEGATE" or name == "CATEGORY":
            return False
        if name == "LITERAL" and arg < 0x80:
            return False
        if name == "RANGE" and arg[0] < 0x80:
            return False
    return True
