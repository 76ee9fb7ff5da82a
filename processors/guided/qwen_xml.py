"""Qwen XML parameters (Qwen3-Coder's tool-call arguments): a structural tag's `qwen_xml_parameter`
node, or `json_schema` with `style: "qwen_xml"`, as rules of the tag's Lark grammar.

The object schema's properties in their declared order, each as `<parameter=NAME>VALUE</parameter>`,
required ones present, whitespace between them. A string VALUE is raw text up to `</parameter>`
(minLength/maxLength/pattern/enum/const and the formats date, time, date-time, uuid, ipv4 apply to
that raw text); any other type is JSON (`%json`) with optional whitespace around it. Extra
parameters follow the declared ones when `additionalProperties` allows them (JSON Schema semantics:
allowed unless it is false). A value that may be either a constrained raw string or JSON (`"type":
["string", "integer"], "maxLength": 3`) is lexed as one or the other from its first bytes on, so a
few values valid for the JSON branch can be refused where the raw branch ran longer (never the other
way round: nothing invalid is accepted).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance as llg

from fastdeploy_lp.processors.guided.lark_builder import (ANY, Ctx, LarkBuilder, check_regex, json_rule, lark_lit,
                                                          lark_regex, lark_seq, read_count, read_text, regex_escape,
                                                          request_schema, whitespace_regex)

_XML_WS = "[ \\n\\t]*"  # xgrammar's whitespace around Qwen XML parameters and their JSON values
_XML_END = "</parameter>"
# JSON-schema keywords that constrain nothing; everything else is either handled or refused.
_ANNOTATIONS = frozenset("title description default examples $comment deprecated readOnly writeOnly "
                         "$id $schema $anchor contentEncoding contentMediaType".split())
_STRING_KEYS = frozenset({"minLength", "maxLength", "pattern", "format"})
# Keywords that constrain only non-string values (those go to llguidance with the JSON part).
_OTHER_TYPE_KEYS = frozenset("minimum maximum exclusiveMinimum exclusiveMaximum multipleOf properties required "
                             "additionalProperties patternProperties propertyNames minProperties maxProperties "
                             "items prefixItems additionalItems contains minContains maxContains minItems maxItems "
                             "uniqueItems $defs definitions".split())
_JSON_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
# String formats for raw Qwen XML values (JSON values use llguidance's own).
_DATE = ("[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         "|02-(?:0[1-9]|1[0-9]|2[0-9]))")
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\\.[0-9]+)?(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_XML_FORMATS = {"date": _DATE, "time": _TIME, "date-time": f"{_DATE}[tT]{_TIME}",
                "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
                "ipv4": f"(?:{_OCTET}\\.){{3}}{_OCTET}"}


def qwen_xml_parameters(b: LarkBuilder, schema: Any, where: str, max_ws: int | None,
                        ctx: Ctx) -> tuple[str, bool]:
    """`<parameter=NAME>VALUE</parameter>` for each property of an object schema (see the module doc).

    The whitespace before a parameter is part of the lexeme `<parameter=NAME>`, and the whitespace
    after the last one part of the literal that follows (absorbed, when known): a separate
    whitespace lexeme would be lost to a following literal that starts with whitespace too (an
    end like "\n</function>"), and the lexer cannot go back to it when `<parameter=` comes instead."""
    if schema is None:
        raise ValueError(f"{where}: required")
    root = request_schema(schema, where)
    allowed = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "$defs", "definitions"}
    for key in root:
        if key not in allowed:
            raise ValueError(f"{where}.{key}: not supported for Qwen XML parameters (supported: properties, "
                             "required, additionalProperties, $defs)")
    if root.get("type", "object") != "object":
        raise ValueError(f"{where}.type: Qwen XML parameters need an object schema, got {root.get('type')!r}")
    properties = root.get("properties", {})
    if not isinstance(properties, dict):
        raise ValueError(f"{where}.properties: must be an object")
    required = root.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}.required: must be a list of property names")
    for name in required:
        if name not in properties:
            raise ValueError(f"{where}.required: {name!r} is not among the properties")
    extra = root.get("additionalProperties", True)
    if not isinstance(extra, (bool, dict)):
        raise ValueError(f"{where}.additionalProperties: must be a boolean or a schema")
    ws = whitespace_regex(b, max_ws)
    xml = _Xml(b, root, ws if ws is not None else _XML_WS, max_ws)
    lead = f"(?:{xml.ws_re})" if xml.ws_re else ""
    parts = []
    for name, sub in properties.items():
        key = b.terminal(lark_regex(lead + regex_escape(f"<parameter={name}>")), "XML_KEY")
        param = b.rule(lark_seq(key, xml.value(sub, f"{where}.properties.{name}")), "param")
        parts.append(param if name in required else f"{param}?")
    if extra is not False:
        key = lark_regex(lead + "<parameter=[A-Za-z_][A-Za-z0-9_]*>")
        if properties:
            key += " & ~" + lark_regex(lead + "<parameter=(?:" + "|".join(regex_escape(n) for n in properties) + ")>")
        value = xml.value(extra, f"{where}.additionalProperties")
        parts.append(f"{b.rule(lark_seq(b.terminal(key, 'XML_KEY'), value), 'param')}*")
    if isinstance(ctx.after, tuple):  # trailing whitespace and what follows: one lexeme
        tail = "|".join(regex_escape(a) for a in dict.fromkeys(ctx.after))
        parts.append(b.terminal(lark_regex(f"{lead}(?:{tail})"), "XML_END"))
        return b.rule(lark_seq(*parts), "xml"), True
    parts.append(xml.ws)
    return b.rule(lark_seq(*parts), "xml"), False


class _Xml:
    """Builds parameter values for one Qwen XML object schema (`root`, for `$ref`s)."""

    def __init__(self, b: LarkBuilder, root: dict, ws: str, max_ws: int | None):
        self.b, self.root, self.ws_re, self.max_ws = b, root, ws, max_ws
        self.defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
        # optional whitespace: a non-empty whitespace lexeme, or none
        self.ws = b.terminal(f"{lark_regex(ws)} & {lark_regex('(?s:.+)')}", "XML_WS") + "?" if ws else ""

    def value(self, schema: Any, where: str) -> str:
        """VALUE</parameter> for a property schema. The whitespace before a value is one optional
        lexeme shared by every alternative (raw text or JSON), so the lexer never has to choose
        between them before the value itself starts."""
        return self.b.rule(lark_seq(self.ws, self._value(schema, where)), "value")

    def _value(self, schema: Any, where: str) -> str:
        if schema is True or schema == {}:
            return self._raw([ANY])
        if schema is False:
            raise ValueError(f"{where}: false admits no value")
        if not isinstance(schema, dict):
            raise ValueError(f"{where}: must be a JSON schema object")
        resolved = self._resolve(schema, where)
        keys = set(resolved) - _ANNOTATIONS
        if not keys:
            return self._raw([ANY])
        types = resolved.get("type", list(_JSON_TYPES))
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not all(t in _JSON_TYPES for t in types):
            raise ValueError(f"{where}.type: must be a JSON type or a list of them")
        if "const" in resolved or "enum" in resolved:
            return self._choices(resolved, types, where)
        if "string" not in types:  # no raw text: the value is JSON
            return self._json(schema, where)
        if keys == {"anyOf"} and isinstance(resolved["anyOf"], list) and resolved["anyOf"]:
            options = [self._value(s, f"{where}.anyOf[{i}]") for i, s in enumerate(resolved["anyOf"])]
            return self.b.rule(" | ".join(options), "value")
        unknown = sorted(keys - _STRING_KEYS - _OTHER_TYPE_KEYS - {"type"})
        if unknown:  # combinators, $ref with siblings, keywords this module does not know
            raise ValueError(f"{where}.{unknown[0]}: not supported for a value that may be a (raw text) string "
                             "in Qwen XML parameters")
        raw = self._raw(self._string_regex(resolved, where))
        others = [t for t in types if t != "string"]
        if not others:
            return raw
        rest = {k: v for k, v in resolved.items() if k not in _STRING_KEYS}
        return self.b.rule(f"{raw} | {self._json({**rest, 'type': others}, where)}", "value")

    def _resolve(self, schema: dict, where: str) -> dict:
        for _ in range(32):
            ref = schema.get("$ref")
            if not isinstance(ref, str) or set(schema) - _ANNOTATIONS != {"$ref"}:
                return schema
            target: Any = self.root
            if not ref.startswith("#"):
                raise ValueError(f"{where}.$ref: only local references (#/...) are supported")
            for part in [p for p in ref[1:].split("/") if p]:
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    raise ValueError(f"{where}.$ref: {ref!r} does not resolve")
                target = target[part]
            if target is True:
                return {}
            if not isinstance(target, dict):
                raise ValueError(f"{where}.$ref: {ref!r} is not a schema object")
            schema = target
        raise ValueError(f"{where}.$ref: too many chained references")

    def _json(self, schema: dict, where: str) -> str:
        value = json_rule(self.b, {**self.defs, **schema}, where, self.max_ws)
        return self.b.rule(lark_seq(value, self.ws, lark_lit(_XML_END)), "json_value")

    def _raw(self, regexes: list[str]) -> str:
        """Raw text matching every regex in `regexes`, optional whitespace, then </parameter>: one
        lazy lexeme, so the value ends at the first </parameter>."""
        if regexes == [ANY]:
            return self.b.rule(f"{lark_regex(ANY)} {lark_lit(_XML_END)}", "text_value", lazy=True)
        body = " & ".join([*(lark_regex(r) for r in regexes), "~" + lark_regex(ANY + regex_escape(_XML_END) + ANY)])
        value = self.b.terminal(body, "XML_VALUE")
        ws = lark_regex(self.ws_re) if self.ws_re else ""
        return self.b.rule(lark_seq(value, ws, lark_lit(_XML_END)), "text_value", lazy=True)

    def _choices(self, schema: dict, types: list[str], where: str) -> str:
        """const / enum: strings as raw text, other values as compact JSON."""
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values:
            raise ValueError(f"{where}.enum: must be a non-empty list")
        extra = set(schema) - _ANNOTATIONS - {"type", "const", "enum", "minLength", "maxLength"}
        if extra:
            raise ValueError(f"{where}.{sorted(extra)[0]}: not supported together with const/enum in Qwen XML "
                             "parameters")
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        texts = []
        for v in values:
            kind = _json_type(v)
            if kind not in types and not (kind == "integer" and "number" in types):
                continue
            if kind == "string" and (len(v) < low or (high is not None and len(v) > high)):
                continue
            texts.append(v if kind == "string" else json.dumps(v, separators=(",", ":"), ensure_ascii=False))
        if not texts:
            raise ValueError(f"{where}: no value of the const/enum satisfies the schema")
        return self._raw(["|".join(regex_escape(t) for t in dict.fromkeys(texts))])

    def _string_regex(self, schema: dict, where: str) -> list[str]:
        """The regexes raw string text must match (JSON Schema's minLength, maxLength, pattern, format)."""
        parts = []
        fmt = schema.get("format")
        if fmt is not None:
            if fmt not in _XML_FORMATS:
                raise ValueError(f"{where}.format: {fmt!r} is not supported for raw Qwen XML string values "
                                 f"(supported: {', '.join(sorted(_XML_FORMATS))})")
            parts.append(_XML_FORMATS[fmt])
        pattern = schema.get("pattern")
        if pattern is not None:
            parts.append(_search(read_text(pattern, f"{where}.pattern"), f"{where}.pattern"))
        low = read_count(schema, "minLength", where) or 0
        high = read_count(schema, "maxLength", where)
        if low or high is not None:
            parts.append(f"(?s:.){{{low},{'' if high is None else high}}}")
        return parts or [ANY]


def _search(pattern: str, where: str) -> str:
    """A JSON Schema `pattern` (which matches anywhere unless anchored) as a whole-text regex."""
    body, start, end = pattern, ANY, ANY
    if body.startswith("^"):
        body, start = body[1:], ""
    if body.endswith("$") and not _escaped_at(body, len(body) - 1):
        body, end = body[:-1], ""
    if _has_anchor(body):
        raise ValueError(f"{where}: anchors (^, $) are supported only at the start and end of the pattern")
    check_regex(body, where)
    return f"{start}(?:{llg.regex_to_lark(body, 'dw')}){end}"


def _escaped_at(text: str, i: int) -> bool:
    n = 0
    while i - n - 1 >= 0 and text[i - n - 1] == "\\":
        n += 1
    return n % 2 == 1


def _has_anchor(regex: str) -> bool:
    """Whether `regex` has an unescaped ^ or $ outside a character class."""
    depth, i = 0, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            if depth == 0 and regex[i + 1:i + 2] == "^":
                i += 1
            depth += 1
        elif c == "]" and depth:
            depth -= 1
        elif c in "^$" and depth == 0:
            return True
        i += 1
    return False


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "array" if isinstance(value, list) else "object"
