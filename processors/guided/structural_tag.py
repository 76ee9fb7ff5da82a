"""Structural tags → one llguidance Lark grammar.

Two request shapes are accepted:

    {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="],
        "tags": [{"type": "tag", "begin": "<function=get_weather>",
                  "content": {"type": "json_schema", "json_schema": {...}}, "end": "</function>"}]}}
    {"type": "structural_tag", "triggers": ["<function="],
        "structures": [{"begin": "<function=get_weather>", "schema": {...}, "end": "</function>"}]}

The first is xgrammar's current format; the second, the older TensorRT-LLM / vLLM one, means
`triggered_tags` with `json_schema` contents. `format` is a tree of these nodes (xgrammar's
vocabulary; every field is checked, and a field or node that would constrain the output in a way
this module cannot express is refused, never ignored):

| type                  | fields                                                       | matches               |
|-----------------------|--------------------------------------------------------------|-----------------------|
| `const_string`        | value                                                        | that text             |
| `json_schema`         | json_schema, style (`json`, `qwen_xml`), max_whitespace_cnt  | a JSON value          |
| `qwen_xml_parameter`  | json_schema (an object schema)                               | <parameter=k>v</parameter>... |
| `regex`               | pattern                                                      | the regex             |
| `grammar`             | grammar (GBNF or Lark)                                       | the grammar           |
| `any_text`            | excludes, max_chars                                          | any text              |
| `sequence`, `or`      | elements                                                     | all in order / one    |
| `optional`, `star`, `plus`, `repeat` | content (repeat: min, max)                    | 0-1 / 0+ / 1+ / min-max |
| `tag`                 | begin, content, end (a string or a list of strings)          | begin content end     |
| `triggered_tags`      | triggers, tags, at_least_one, stop_after_first, excludes     | free text with tags   |
| `tags_with_separator` | tags, separator, at_least_one, stop_after_first              | tags only             |

**Where free text ends.** llguidance's lexer is greedy and never backtracks, so free text (any_text,
the text between triggered tags) must know the literal that ends it. Each node is compiled knowing
what follows it (`_Ctx.after`): a literal (a tag's `end`, the next `const_string` or tag `begin` in a
sequence), the end of the output, or something else. Free text followed by a literal becomes one
lazy lexeme "text without that literal, then the literal", which ends exactly where the literal
first completes, even in the middle of a token; the node then reports that it consumed (absorbed)
the literal so the caller does not emit it twice. Free text at the end of the output is a greedy
lexeme. Free text followed by anything else (JSON, a regex) has no findable end in llguidance and
is refused. As in xgrammar, free text inside a tag also never contains that tag's `end`.
For the same reason a short lexeme must not be followed by a choice between lexemes that extend it
differently (a "\n" separator, then either "<tag>" or a following "\n</end>": once the lexer has
taken "\n<", the way to "<tag>" is lost), so separators are one literal with the next tag's begin,
and Qwen XML whitespace one lexeme with the next `<parameter=...>` or with what follows the list.

**Triggered tags.** Free text may contain no trigger except as the start of a complete tag:
"free text without any trigger, then the trigger" is a single lazy lexeme, after which the parser
admits only the rest of a tag that begins with that trigger; after the tag's end, free text again.
With `at_least_one` the output starts with a tag (no free text before it); with `stop_after_first`
it ends after the first tag; with both it is exactly one tag.

**Qwen XML parameters** (`qwen_xml_parameter`, or `json_schema` with `style: "qwen_xml"`; Qwen3-Coder's
tool-call arguments): the object schema's properties in their declared order, each as
`<parameter=NAME>VALUE</parameter>`, required ones present, whitespace between them. A string VALUE
is raw text up to `</parameter>` (minLength/maxLength/pattern/enum/const and the formats date, time,
date-time, uuid, ipv4 apply to that raw text); any other type is JSON (`%json`) with optional
whitespace around it. Extra parameters follow the declared ones when `additionalProperties` allows
them (JSON Schema semantics: allowed unless it is false). A value that may be either a constrained
raw string or JSON (`"type": ["string", "integer"], "maxLength": 3`) is lexed as one or the other
from its first bytes on, so a few values valid for the JSON branch can be refused where the raw
branch ran longer (never the other way round: nothing invalid is accepted).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import llguidance as llg
from llguidance.gbnf_to_lark import any_to_lark

from fastdeploy_lp.processors.guided.grammar_text import clean_error, is_gbnf
from fastdeploy_lp.processors.guided.json_schema import (check_depth, drop_custom_formats, json_format_options,
                                                         schema_depth)

FIELD = "structural_tag"
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
_ANY = "(?s:.*)"
MAX_DEPTH = 160  # JSON nesting of a whole request: nodes, and the schemas in them (64 levels each)
MAX_CHARS_LIMIT = 32768  # any_text.max_chars above this overflows llguidance's lexer mid-generation
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

_NODE_FIELDS = {
    "const_string": {"value"},
    "json_schema": {"json_schema", "style", "any_order", "max_whitespace_cnt"},
    "qwen_xml_parameter": {"json_schema"},
    "regex": {"pattern"},
    "grammar": {"grammar"},
    "any_text": {"excludes", "max_chars", "max_tokens"},
    "sequence": {"elements"},
    "or": {"elements"},
    "optional": {"content"},
    "star": {"content"},
    "plus": {"content"},
    "repeat": {"content", "min", "max"},
    "tag": {"begin", "content", "end"},
    "triggered_tags": {"triggers", "tags", "at_least_one", "stop_after_first", "excludes"},
    "tags_with_separator": {"tags", "separator", "at_least_one", "stop_after_first"},
}
_UNSUPPORTED = {
    "dispatch": "use triggered_tags (each rule's pattern as both trigger and tag begin)",
    "token": "token-level formats need token ids in the grammar; use string tags",
    "exclude_token": "token-level formats are not supported; use string tags",
    "any_tokens": "token-level formats are not supported; use any_text",
    "token_triggered_tags": "token-level formats are not supported; use triggered_tags with string triggers",
    "token_dispatch": "token-level formats are not supported; use triggered_tags",
}


class _End:
    """`_Ctx.after` when nothing follows: the output ends there."""

    def __repr__(self) -> str:
        return "END"


END = _End()


@dataclass(frozen=True)
class _Ctx:
    """What surrounds a node: `after` is what follows it — a tuple of alternative non-empty
    literals, END, or None (something else or unknown); `tag_ends`, the end strings of the nearest
    enclosing tag (free text never contains them)."""

    after: Any = END
    tag_ends: tuple = ()


class _At(dict):
    """A node converted from the older form, carrying the path to name in its errors."""

    where: str = ""


class _LarkBuilder:
    def __init__(self, whitespace_pattern: str | None):
        self.rules: list[str] = []
        self.side_grammars: list[dict] = []
        self.whitespace_pattern = whitespace_pattern
        self._n = 0

    def name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n}"

    def rule(self, body: str, prefix: str = "r", lazy: bool = False) -> str:
        name = self.name(prefix)
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body or chr(34) * 2}")
        return name

    def terminal(self, body: str, prefix: str = "T") -> str:
        name = self.name(prefix).upper()
        self.rules.append(f"{name}: {body}")
        return name

    def grammar(self, start: str) -> str:
        lark = "\n".join([f"start: {start or chr(34) * 2}", *self.rules]) + "\n"
        if not self.side_grammars:
            return llg.LLMatcher.grammar_from_lark(lark)
        return json.dumps({"grammars": [{"name": "structural_tag", "lark_grammar": lark}, *self.side_grammars]})


def structural_tag_grammar(value: dict, whitespace_pattern: str | None = None) -> str:
    """The llguidance grammar for a structural tag request (either shape); ValueError names the field."""
    if not isinstance(value, dict):
        raise ValueError(f"{FIELD}: must be a JSON object")
    depth = schema_depth(value)
    if depth > MAX_DEPTH:
        raise ValueError(f"{FIELD}: is nested {depth} levels deep; at most {MAX_DEPTH} are supported")
    if value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{FIELD}.type: must be 'structural_tag', got {value.get('type')!r}")
    if "format" in value:
        _known(value, FIELD, {"type", "format"}, "structural tag with 'format'")
        fmt, where = value["format"], f"{FIELD}.format"
    elif "structures" in value:
        _known(value, FIELD, {"type", "structures", "triggers"}, "structural tag with 'structures'")
        fmt, where = _from_structures(value), FIELD
    else:
        raise ValueError(f"{FIELD}: needs 'format' (or the older 'structures' with 'triggers')")
    builder = _LarkBuilder(whitespace_pattern)
    expr, _ = _node(builder, fmt, where, _Ctx())
    return builder.grammar(expr)


def _from_structures(value: dict) -> dict:
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{FIELD}.structures: must be a non-empty list of {{begin, schema, end}}")
    if not isinstance(triggers, list) or not triggers:
        raise ValueError(f"{FIELD}.triggers: must be a non-empty list of strings")
    tags = []
    for i, s in enumerate(structures):
        where = f"{FIELD}.structures[{i}]"
        if not isinstance(s, dict) or "schema" not in s:
            raise ValueError(f"{where}: must be {{begin, schema, end}}")
        _known(s, where, {"begin", "schema", "end"}, "structure")
        content = _At(type="json_schema", json_schema=s["schema"])
        content.where = f"{where}.schema"
        tag = _At(begin=s.get("begin"), end=s.get("end", ""), content=content)
        tag.where = where
        tags.append(tag)
    node = _At(type="triggered_tags", triggers=triggers, tags=tags)
    node.where = FIELD
    return node


# -- small helpers ------------------------------------------------------------------------------
def _known(node: dict, where: str, fields: set, what: str) -> None:
    for key in node:
        if key != "type" and key not in fields:
            raise ValueError(f"{where}.{key}: unknown field for a {what}; it has {', '.join(sorted(fields))}")


def _text(value: Any, where: str, allow_empty: bool = True) -> str:
    if not isinstance(value, str) or (not allow_empty and not value):
        raise ValueError(f"{where}: must be a {'non-empty ' if not allow_empty else ''}string")
    return value


def _flag(node: dict, key: str, where: str) -> bool:
    value = node.get(key)
    if value is None:  # absent (or null, as some clients send defaults)
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key}: must be true or false")
    return value


def _count(node: dict, key: str, where: str, default=None, minimum: int = 0) -> int | None:
    value = node.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{where}.{key}: must be an integer >= {minimum}")
    return value


def _list(node: dict, key: str, where: str) -> list:
    value = node.get(key)
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}.{key}: must be a non-empty list")
    return value


def _strings(node: dict, key: str, where: str, required: bool = False) -> list[str]:
    """A list of non-empty strings (`excludes`, `triggers`)."""
    value = node.get(key)
    if value is None and not required:
        value = []
    if not isinstance(value, list) or (required and not value):
        raise ValueError(f"{where}.{key}: must be a {'non-empty ' if required else ''}list of strings")
    return [_text(v, f"{where}.{key}[{i}]", allow_empty=False) for i, v in enumerate(value)]


def _lit(text: str) -> str:
    """A Lark string literal ("" for nothing)."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def _lits(options) -> str:
    """Alternative literals as one Lark expression."""
    options = list(dict.fromkeys(options))
    if len(options) == 1:
        return _lit(options[0]) or '""'
    return "(" + " | ".join(_lit(o) or '""' for o in options) + ")"


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _escape(text: str) -> str:
    """`text` as a literal in Rust regex syntax."""
    out = []
    for c in text:
        if c in _REGEX_META:
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{{{ord(c):x}}}")
        else:
            out.append(c)
    return "".join(out)


def _re(regex: str) -> str:
    """A Rust regex as a Lark `/.../` regex."""
    return f"/{llg.regex_to_lark(regex, '')}/"


def _without(banned) -> str:
    """A Lark terminal expression for any text that contains none of `banned`."""
    banned = list(dict.fromkeys(banned))
    if not banned:
        return _re(_ANY)
    return f"{_re(_ANY)} & ~{_re(_ANY + '(?:' + '|'.join(_escape(t) for t in banned) + ')' + _ANY)}"


def _validate(grammar: str, failure: str) -> None:
    """ValueError `failure: <llguidance's error>` unless llguidance accepts `grammar`."""
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{failure}: {clean_error(error)}")


def _check_regex(pattern: str, where: str) -> None:
    _validate(llg.LLMatcher.grammar_from_regex(pattern), f"{where}: invalid or unsupported regex")


def _alternatives(tags) -> str:
    """`begin body | ...` for (begin literal, body expression) pairs ("" for an empty one)."""
    return " | ".join(_seq(_lit(begin), body) or '""' for begin, body in tags)


def _close(expr: str, absorbed: bool, after) -> str:
    """`expr` followed by the literal `after` when `expr` did not absorb it."""
    if absorbed or not isinstance(after, tuple):
        return expr
    return _seq(expr, _lits(after))


def _leading_literal(node: Any) -> str | None:
    """The literal a node starts with, which free text before it may absorb."""
    if not isinstance(node, dict):
        return None
    if node.get("type") == "const_string" and isinstance(node.get("value"), str) and node["value"]:
        return node["value"]
    if node.get("type") == "tag" and isinstance(node.get("begin"), str) and node["begin"]:
        return node["begin"]
    return None


# -- nodes -------------------------------------------------------------------------------------
def _node(b: _LarkBuilder, node: Any, where: str, ctx: _Ctx, strip: str = "") -> tuple[str, bool]:
    """Add rules for `node`; return (the Lark expression that matches it, whether that expression
    also matched `ctx.after`). `strip`: the node's leading literal, already matched by free text."""
    where = getattr(node, "where", "") or where
    if not isinstance(node, dict) or not isinstance(node.get("type"), str):
        raise ValueError(f"{where}: must be an object with a 'type'")
    kind = node["type"]
    if kind in _UNSUPPORTED:
        raise ValueError(f"{where}.type: {kind!r} is not supported: {_UNSUPPORTED[kind]}")
    if kind not in _NODE_FIELDS:
        raise ValueError(f"{where}.type: unknown structural tag format {kind!r}; use "
                         f"{', '.join(sorted(_NODE_FIELDS))}")
    _known(node, where, _NODE_FIELDS[kind], f"{kind} node")
    if kind == "const_string":
        value = _text(node.get("value"), f"{where}.value")
        return _lit(value[len(strip):]), False
    if kind == "tag":
        return _tag(b, node, where, ctx, strip)
    if kind == "json_schema":
        return _json_node(b, node, where, ctx)
    if kind == "qwen_xml_parameter":
        return _qwen_xml(b, node.get("json_schema"), f"{where}.json_schema", None, ctx)
    if kind == "regex":
        pattern = _text(node.get("pattern"), f"{where}.pattern", allow_empty=False)
        _check_regex(pattern, f"{where}.pattern")
        return b.rule(_re(pattern), "re"), False
    if kind == "grammar":
        return _side_grammar(b, _text(node.get("grammar"), f"{where}.grammar", allow_empty=False), where), False
    if kind == "any_text":
        return _any_text(b, node, where, ctx)
    if kind == "sequence":
        return _sequence(b, node, where, ctx)
    if kind == "or":
        return _or(b, node, where, ctx)
    if kind in ("optional", "star", "plus", "repeat"):
        return _repeat(b, node, where, ctx, kind)
    if kind == "triggered_tags":
        return _triggered(b, node, where, ctx)
    return _separated(b, node, where), False


def _sequence(b: _LarkBuilder, node: dict, where: str, ctx: _Ctx) -> tuple[str, bool]:
    elements = _list(node, "elements", where)
    parts, strip, absorbed = [], "", False
    for i, element in enumerate(elements):
        last = i == len(elements) - 1
        following = None if last else _leading_literal(elements[i + 1])
        after = ctx.after if last else ((following,) if following else None)
        expr, absorbed = _node(b, element, f"{where}.elements[{i}]", replace(ctx, after=after), strip)
        parts.append(expr)
        strip = following if (absorbed and not last) else ""
    return b.rule(_seq(*parts), "seq"), absorbed


def _or(b: _LarkBuilder, node: dict, where: str, ctx: _Ctx) -> tuple[str, bool]:
    results = [_node(b, e, f"{where}.elements[{i}]", ctx) for i, e in enumerate(_list(node, "elements", where))]
    if any(absorbed for _, absorbed in results):  # then every alternative ends with ctx.after
        return b.rule(" | ".join(_close(e, a, ctx.after) or '""' for e, a in results), "or"), True
    return b.rule(" | ".join(e or '""' for e, _ in results), "or"), False


def _repeat(b: _LarkBuilder, node: dict, where: str, ctx: _Ctx, kind: str) -> tuple[str, bool]:
    if "content" not in node:
        raise ValueError(f"{where}.content: required")
    if kind == "optional":  # what follows the optional part follows its content too
        expr, absorbed = _node(b, node["content"], f"{where}.content", ctx)
        if absorbed:
            return b.rule(f"{expr} | {_lits(ctx.after)}", "opt"), True
        return b.rule(f"({expr or chr(34) * 2})?", "opt"), False
    expr, _ = _node(b, node["content"], f"{where}.content", replace(ctx, after=None))
    expr = expr or '""'
    if kind == "star":
        return b.rule(f"({expr})*", "star"), False
    if kind == "plus":
        return b.rule(f"({expr})+", "plus"), False
    low = _count(node, "min", where)
    high = _count(node, "max", where, minimum=-1)
    if low is None or high is None:
        raise ValueError(f"{where}: repeat needs 'min' and 'max' (-1 for no upper bound)")
    if high != -1 and high < low:
        raise ValueError(f"{where}.max: must be -1 or >= min ({low})")
    if high == 0:
        return "", False
    if high == -1:
        body = f"({expr})*" if low == 0 else f"({expr}) ~ {low} ({expr})*"
    else:
        body = f"({expr}) ~ {low}" + ("" if high == low else f"..{high}")
    return b.rule(body, "rep"), False


def _tag(b: _LarkBuilder, tag: Any, where: str, ctx: _Ctx, strip: str = "") -> tuple[str, bool]:
    """`begin content end`, without `strip` (a prefix of begin that the caller already matched)."""
    begin, body, absorbed = _tag_parts(b, tag, where, ctx)
    return b.rule(_seq(_lit(begin[len(strip):]), body), "tag"), absorbed


def _tag_parts(b: _LarkBuilder, tag: Any, where: str, ctx: _Ctx) -> tuple[str, str, bool]:
    """(begin, the expression for content + end, whether it absorbed `ctx.after`)."""
    where = getattr(tag, "where", "") or where
    if not isinstance(tag, dict):
        raise ValueError(f"{where}: must be a tag {{begin, content, end}}")
    if tag.get("type", "tag") != "tag":
        raise ValueError(f"{where}.type: must be 'tag', got {tag.get('type')!r}")
    _known(tag, where, _NODE_FIELDS["tag"], "tag")
    if isinstance(tag.get("begin"), dict):
        raise ValueError(f"{where}.begin: token-level begins are not supported; use a string")
    begin = _text(tag.get("begin"), f"{where}.begin")
    end = tag.get("end", "")
    if isinstance(end, dict):
        raise ValueError(f"{where}.end: token-level ends are not supported; use a string")
    if isinstance(end, list):
        if not end:
            raise ValueError(f"{where}.end: must be a string or a non-empty list of strings")
        ends = [_text(e, f"{where}.end[{i}]") for i, e in enumerate(end)]
    else:
        ends = [_text(end, f"{where}.end")]
    if "content" not in tag:
        raise ValueError(f"{where}.content: required")
    filled = tuple(e for e in ends if e)
    if len(filled) == len(ends):  # the content ends at one of the end strings
        inner = replace(ctx, after=filled, tag_ends=filled)
    elif not filled:  # no end: what follows the tag follows the content
        inner = replace(ctx, tag_ends=())
    else:
        inner = replace(ctx, after=None, tag_ends=filled)
    content, absorbed = _node(b, tag["content"], f"{where}.content", inner)
    if len(filled) == len(ends):
        return begin, _close(content, absorbed, filled), False
    if not filled:
        return begin, content, absorbed
    return begin, _seq(content, f"{_lits(filled)}?"), False


def _json_node(b: _LarkBuilder, node: dict, where: str, ctx: _Ctx) -> tuple[str, bool]:
    style = node.get("style") or "json"
    if node.get("any_order") not in (None, False):
        raise ValueError(f"{where}.any_order: only false is supported (llguidance keeps the declared "
                         "property order)")
    max_ws = _count(node, "max_whitespace_cnt", where)
    if "json_schema" not in node:
        raise ValueError(f"{where}.json_schema: required")
    path = where if isinstance(node, _At) else f"{where}.json_schema"  # the older form's `schema`
    if style == "qwen_xml":
        return _qwen_xml(b, node["json_schema"], path, max_ws, ctx)
    if style != "json":
        raise ValueError(f"{where}.style: {style!r} is not supported; use 'json' or 'qwen_xml'")
    return _json(b, _schema(node["json_schema"], path), path, max_ws), False


def _schema(schema: Any, where: str) -> Any:
    """A JSON schema from a request (a dict, true, or JSON text), checked and without custom formats."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{where}: invalid JSON: {e}") from None
    if schema is True:
        return {}
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: must be a JSON schema object (or true)")
    check_depth(schema, where)
    return drop_custom_formats(schema)


def _whitespace(b: _LarkBuilder, max_ws: int | None) -> str | None:
    if max_ws is not None:
        return f"[ \\n\\t]{{0,{max_ws}}}"
    return b.whitespace_pattern


def _json(b: _LarkBuilder, schema: dict, where: str, max_ws: int | None = None) -> str:
    """`%json` for a schema, checked on its own first so that an error names its place."""
    # The same bounded default as plain JSON constraints (json_format_options), tool-call arguments included.
    schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **json_format_options(_whitespace(b, max_ws))}}
    _validate(llg.LLMatcher.grammar_from_json_schema(json.dumps(schema)), f"{where}: invalid or unsupported")
    return b.rule(f"%json {json.dumps(schema)}", "json")


def _side_grammar(b: _LarkBuilder, text: str, where: str) -> str:
    if is_gbnf(text):
        try:
            text = any_to_lark(text)
        except Exception as e:  # the converter raises plain Exceptions on bad input
            raise ValueError(f"{where}.grammar: invalid GBNF grammar: {e}") from None
    _validate(llg.LLMatcher.grammar_from_lark(text), f"{where}.grammar: invalid or unsupported")
    name = b.name("grammar")
    b.side_grammars.append({"name": name, "lark_grammar": text})
    return f"@{name}"


# -- free text ---------------------------------------------------------------------------------
def _ctx_ends(ctx: _Ctx) -> tuple:
    """The strings free text at `ctx` must not contain: the enclosing tag's ends and what follows."""
    return (*ctx.tag_ends, *(ctx.after if isinstance(ctx.after, tuple) else ()))


def _free_end(b: _LarkBuilder, text: str, ctx: _Ctx, where: str, what: str) -> tuple[str, bool]:
    """Free text (the terminal `text`) where `ctx.after` says it ends: (expression, absorbed)."""
    if isinstance(ctx.after, tuple):
        return b.rule(f"{text} {_lits(ctx.after)}", "until", lazy=True), True
    if ctx.after is END:
        return text, False
    raise ValueError(f"{where}: {what} must be followed by a literal (a tag's non-empty end, a const_string "
                     "or a tag) or end the output: the grammar engine cannot tell where free text ends "
                     "before anything else")


def _any_text(b: _LarkBuilder, node: dict, where: str, ctx: _Ctx) -> tuple[str, bool]:
    excludes = _strings(node, "excludes", where)
    if node.get("max_tokens") is not None:
        raise ValueError(f"{where}.max_tokens: not supported (a token budget inside the grammar would "
                         "disable llguidance's rollback); use max_chars or the request's max_tokens")
    max_chars = _count(node, "max_chars", where)
    if max_chars is not None and max_chars > MAX_CHARS_LIMIT:
        raise ValueError(f"{where}.max_chars: at most {MAX_CHARS_LIMIT} is supported")
    text = _without([*excludes, *_ctx_ends(ctx)])
    if max_chars is not None:
        text = f"{_re(f'(?s:.){{0,{max_chars}}}')} & ({text})"
    return _free_end(b, b.terminal(text, "TEXT"), ctx, where, "any_text")


def _triggered(b: _LarkBuilder, node: dict, where: str, ctx: _Ctx) -> tuple[str, bool]:
    where = getattr(node, "where", "") or where
    tags_key = "structures" if isinstance(node, _At) else "tags"
    triggers = _strings(node, "triggers", where, required=True)
    for i, t in enumerate(triggers):
        for j, u in enumerate(triggers):
            if i != j and u.startswith(t) and (len(u) > len(t) or j > i):
                raise ValueError(f"{where}.triggers[{j}]: {u!r} starts with another trigger, {t!r}")
    tags = node.get("tags")
    if not isinstance(tags, list) or not tags:
        raise ValueError(f"{where}.{tags_key}: must be a non-empty list of tags")
    excludes = _strings(node, "excludes", where)
    at_least_one, stop_after_first = _flag(node, "at_least_one", where), _flag(node, "stop_after_first", where)

    # Each tag: its trigger, begin and (content + end), compiled once.
    groups: dict[str, list] = {t: [] for t in triggers}
    for i, tag in enumerate(tags):
        tag_where = getattr(tag, "where", "") or f"{where}.tags[{i}]"
        begin, body, _ = _tag_parts(b, tag, tag_where, _Ctx(after=None))
        mine = [t for t in triggers if begin.startswith(t)]
        if not mine:
            raise ValueError(f"{tag_where}.begin: must start with one of the triggers {triggers}")
        groups[mine[0]].append((begin, b.rule(body, "body") if body else ""))
    for t, members in groups.items():
        if not members:
            raise ValueError(f"{where}.triggers[{triggers.index(t)}]: {t!r} starts no tag's begin")

    first = b.rule(_alternatives(m for ms in groups.values() for m in ms), "first")
    if at_least_one and stop_after_first:  # exactly one tag, no free text
        return first, False
    free = b.terminal(_without([*triggers, *excludes, *_ctx_ends(ctx)]), "FREE_TEXT")
    calls = []
    for t, members in groups.items():
        # Free text then the trigger, one lexeme, ended lazily at the trigger's first occurrence.
        lead = b.rule(f"{free} {_lit(t)}", "until_trigger", lazy=True)
        rests = _alternatives((begin[len(t):], body) for begin, body in members)
        calls.append(f"{lead} ({rests})")
    call = b.rule(" | ".join(calls), "call")
    tail, absorbed = _free_end(b, free, ctx, where, "triggered_tags")
    if stop_after_first:  # free text, or free text then one tag
        return b.rule(f"{_close(call, False, ctx.after) if absorbed else call} | {tail}", "calls"), absorbed
    if at_least_one:
        return b.rule(f"{first} {call}* {tail}", "calls"), absorbed
    return b.rule(f"{call}* {tail}", "calls"), absorbed


def _separated(b: _LarkBuilder, node: dict, where: str) -> str:
    tags = _list(node, "tags", where)
    sep = _text(node.get("separator", ""), f"{where}.separator")
    at_least_one, stop_after_first = _flag(node, "at_least_one", where), _flag(node, "stop_after_first", where)
    # A tag without an end is followed by the separator or by what follows the node: ambiguous.
    parts = [_tag_parts(b, t, f"{where}.tags[{i}]", _Ctx(after=None))[:2] for i, t in enumerate(tags)]
    bodies = [b.rule(body, "body") if body else "" for _, body in parts]
    one = b.rule(_alternatives((begin, body) for (begin, _), body in zip(parts, bodies)), "tags")
    if stop_after_first:
        return one if at_least_one else b.rule(f"{one}?", "tags")
    # The separator and the next begin are one literal: as separate lexemes, a separator that also
    # starts what follows the node ("\n" then "\n</x>") would be lost once the lexer took "\n<".
    nxt = b.rule(_alternatives((sep + begin, body) for (begin, _), body in zip(parts, bodies)), "tags")
    many = b.rule(f"{one} {nxt}*", "tags")
    return many if at_least_one else b.rule(f"{many}?", "tags")


# -- Qwen XML parameters -----------------------------------------------------------------------
def _qwen_xml(b: _LarkBuilder, schema: Any, where: str, max_ws: int | None, ctx: _Ctx) -> tuple[str, bool]:
    """`<parameter=NAME>VALUE</parameter>` for each property of an object schema (see module doc).

    The whitespace before a parameter is part of the lexeme `<parameter=NAME>`, and the whitespace
    after the last one part of the literal that follows (absorbed, when known): a separate
    whitespace lexeme would be lost to a following literal that starts with whitespace too (an
    end like "\n</function>"), and the lexer cannot go back to it when `<parameter=` comes instead."""
    if schema is None:
        raise ValueError(f"{where}: required")
    root = _schema(schema, where)
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
    ws = _whitespace(b, max_ws)
    xml = _Xml(b, root, ws if ws is not None else _XML_WS, max_ws)
    lead = f"(?:{xml.ws_re})" if xml.ws_re else ""
    parts = []
    for name, sub in properties.items():
        key = b.terminal(_re(lead + _escape(f"<parameter={name}>")), "XML_KEY")
        param = b.rule(_seq(key, xml.value(sub, f"{where}.properties.{name}")), "param")
        parts.append(param if name in required else f"{param}?")
    if extra is not False:
        key = _re(lead + "<parameter=[A-Za-z_][A-Za-z0-9_]*>")
        if properties:
            key += " & ~" + _re(lead + "<parameter=(?:" + "|".join(_escape(n) for n in properties) + ")>")
        value = xml.value(extra, f"{where}.additionalProperties")
        parts.append(f"{b.rule(_seq(b.terminal(key, 'XML_KEY'), value), 'param')}*")
    if isinstance(ctx.after, tuple):  # trailing whitespace and what follows: one lexeme
        tail = "|".join(_escape(a) for a in dict.fromkeys(ctx.after))
        parts.append(b.terminal(_re(f"{lead}(?:{tail})"), "XML_END"))
        return b.rule(_seq(*parts), "xml"), True
    parts.append(xml.ws)
    return b.rule(_seq(*parts), "xml"), False


class _Xml:
    """Builds parameter values for one Qwen XML object schema (`root`, for `$ref`s)."""

    def __init__(self, b: _LarkBuilder, root: dict, ws: str, max_ws: int | None):
        self.b, self.root, self.ws_re, self.max_ws = b, root, ws, max_ws
        self.defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
        # optional whitespace: a non-empty whitespace lexeme, or none
        self.ws = b.terminal(f"{_re(ws)} & {_re('(?s:.+)')}", "XML_WS") + "?" if ws else ""

    def value(self, schema: Any, where: str) -> str:
        """VALUE</parameter> for a property schema. The whitespace before a value is one optional
        lexeme shared by every alternative (raw text or JSON), so the lexer never has to choose
        between them before the value itself starts."""
        return self.b.rule(_seq(self.ws, self._value(schema, where)), "value")

    def _value(self, schema: Any, where: str) -> str:
        if schema is True or schema == {}:
            return self._raw([_ANY])
        if schema is False:
            raise ValueError(f"{where}: false admits no value")
        if not isinstance(schema, dict):
            raise ValueError(f"{where}: must be a JSON schema object")
        resolved = self._resolve(schema, where)
        keys = set(resolved) - _ANNOTATIONS
        if not keys:
            return self._raw([_ANY])
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
        json_rule = _json(self.b, {**self.defs, **schema}, where, self.max_ws)
        return self.b.rule(_seq(json_rule, self.ws, _lit(_XML_END)), "json_value")

    def _raw(self, regexes: list[str]) -> str:
        """Raw text matching every regex in `regexes`, optional whitespace, then </parameter>: one
        lazy lexeme, so the value ends at the first </parameter>."""
        if regexes == [_ANY]:
            return self.b.rule(f"{_re(_ANY)} {_lit(_XML_END)}", "text_value", lazy=True)
        body = " & ".join([*(_re(r) for r in regexes), "~" + _re(_ANY + _escape(_XML_END) + _ANY)])
        value = self.b.terminal(body, "XML_VALUE")
        return self.b.rule(_seq(value, _re(self.ws_re) if self.ws_re else "", _lit(_XML_END)), "text_value",
                           lazy=True)

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
        return self._raw(["|".join(_escape(t) for t in dict.fromkeys(texts))])

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
            parts.append(_search(_text(pattern, f"{where}.pattern"), f"{where}.pattern"))
        low = _count(schema, "minLength", where) or 0
        high = _count(schema, "maxLength", where)
        if low or high is not None:
            parts.append(f"(?s:.){{{low},{'' if high is None else high}}}")
        return parts or [_ANY]


def _search(pattern: str, where: str) -> str:
    """A JSON Schema `pattern` (which matches anywhere unless anchored) as a whole-text regex."""
    body, start, end = pattern, _ANY, _ANY
    if body.startswith("^"):
        body, start = body[1:], ""
    if body.endswith("$") and not _escaped_at(body, len(body) - 1):
        body, end = body[:-1], ""
    if _has_anchor(body):
        raise ValueError(f"{where}: anchors (^, $) are supported only at the start and end of the pattern")
    _check_regex(body, where)
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
