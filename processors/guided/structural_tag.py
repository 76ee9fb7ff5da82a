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
what follows it (`Ctx.after`): a literal (a tag's `end`, the next `const_string` or tag `begin` in a
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

**Qwen XML parameters** (`qwen_xml_parameter`, or `json_schema` with `style: "qwen_xml"`) are
compiled by `qwen_xml.py`; the builder, `Ctx` and the field readers all parts share are in
`lark_builder.py`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import llguidance as llg
from llguidance.gbnf_to_lark import any_to_lark

from fastdeploy_lp.processors.guided.grammar_text import is_gbnf
from fastdeploy_lp.processors.guided.json_schema import schema_depth
from fastdeploy_lp.processors.guided.lark_builder import (END, Ctx, LarkBuilder, check_fields, check_regex, json_rule,
                                                          lark_lit, lark_lits, lark_regex, lark_seq, read_count,
                                                          read_flag, read_list, read_strings, read_text,
                                                          request_schema, text_without, validate_grammar)
from fastdeploy_lp.processors.guided.qwen_xml import qwen_xml_parameters

FIELD = "structural_tag"
MAX_DEPTH = 160  # JSON nesting of a whole request: nodes, and the schemas in them (64 levels each)
MAX_CHARS_LIMIT = 32768  # any_text.max_chars above this overflows llguidance's lexer mid-generation

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


class _At(dict):
    """A node converted from the older form, carrying the path to name in its errors."""

    where: str = ""


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
        check_fields(value, FIELD, {"type", "format"}, "structural tag with 'format'")
        fmt, where = value["format"], f"{FIELD}.format"
    elif "structures" in value:
        check_fields(value, FIELD, {"type", "structures", "triggers"}, "structural tag with 'structures'")
        fmt, where = _from_structures(value), FIELD
    else:
        raise ValueError(f"{FIELD}: needs 'format' (or the older 'structures' with 'triggers')")
    builder = LarkBuilder(whitespace_pattern)
    expr, _ = _node(builder, fmt, where, Ctx())
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
        check_fields(s, where, {"begin", "schema", "end"}, "structure")
        content = _At(type="json_schema", json_schema=s["schema"])
        content.where = f"{where}.schema"
        tag = _At(begin=s.get("begin"), end=s.get("end", ""), content=content)
        tag.where = where
        tags.append(tag)
    node = _At(type="triggered_tags", triggers=triggers, tags=tags)
    node.where = FIELD
    return node


def _alternatives(tags) -> str:
    """`begin body | ...` for (begin literal, body expression) pairs ("" for an empty one)."""
    return " | ".join(lark_seq(lark_lit(begin), body) or '""' for begin, body in tags)


def _close(expr: str, absorbed: bool, after) -> str:
    """`expr` followed by the literal `after` when `expr` did not absorb it."""
    if absorbed or not isinstance(after, tuple):
        return expr
    return lark_seq(expr, lark_lits(after))


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
def _node(b: LarkBuilder, node: Any, where: str, ctx: Ctx, strip: str = "") -> tuple[str, bool]:
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
    check_fields(node, where, _NODE_FIELDS[kind], f"{kind} node")
    if kind == "const_string":
        value = read_text(node.get("value"), f"{where}.value")
        return lark_lit(value[len(strip):]), False
    if kind == "tag":
        return _tag(b, node, where, ctx, strip)
    if kind == "json_schema":
        return _json_node(b, node, where, ctx)
    if kind == "qwen_xml_parameter":
        return qwen_xml_parameters(b, node.get("json_schema"), f"{where}.json_schema", None, ctx)
    if kind == "regex":
        pattern = read_text(node.get("pattern"), f"{where}.pattern", allow_empty=False)
        check_regex(pattern, f"{where}.pattern")
        return b.rule(lark_regex(pattern), "re"), False
    if kind == "grammar":
        return _side_grammar(b, read_text(node.get("grammar"), f"{where}.grammar", allow_empty=False), where), False
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


def _sequence(b: LarkBuilder, node: dict, where: str, ctx: Ctx) -> tuple[str, bool]:
    elements = read_list(node, "elements", where)
    parts, strip, absorbed = [], "", False
    for i, element in enumerate(elements):
        last = i == len(elements) - 1
        following = None if last else _leading_literal(elements[i + 1])
        after = ctx.after if last else ((following,) if following else None)
        expr, absorbed = _node(b, element, f"{where}.elements[{i}]", replace(ctx, after=after), strip)
        parts.append(expr)
        strip = following if (absorbed and not last) else ""
    return b.rule(lark_seq(*parts), "seq"), absorbed


def _or(b: LarkBuilder, node: dict, where: str, ctx: Ctx) -> tuple[str, bool]:
    results = [_node(b, e, f"{where}.elements[{i}]", ctx) for i, e in enumerate(read_list(node, "elements", where))]
    if any(absorbed for _, absorbed in results):  # then every alternative ends with ctx.after
        return b.rule(" | ".join(_close(e, a, ctx.after) or '""' for e, a in results), "or"), True
    return b.rule(" | ".join(e or '""' for e, _ in results), "or"), False


def _repeat(b: LarkBuilder, node: dict, where: str, ctx: Ctx, kind: str) -> tuple[str, bool]:
    if "content" not in node:
        raise ValueError(f"{where}.content: required")
    if kind == "optional":  # what follows the optional part follows its content too
        expr, absorbed = _node(b, node["content"], f"{where}.content", ctx)
        if absorbed:
            return b.rule(f"{expr} | {lark_lits(ctx.after)}", "opt"), True
        return b.rule(f"({expr or chr(34) * 2})?", "opt"), False
    expr, _ = _node(b, node["content"], f"{where}.content", replace(ctx, after=None))
    expr = expr or '""'
    if kind == "star":
        return b.rule(f"({expr})*", "star"), False
    if kind == "plus":
        return b.rule(f"({expr})+", "plus"), False
    low = read_count(node, "min", where)
    high = read_count(node, "max", where, minimum=-1)
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


def _tag(b: LarkBuilder, tag: Any, where: str, ctx: Ctx, strip: str = "") -> tuple[str, bool]:
    """`begin content end`, without `strip` (a prefix of begin that the caller already matched)."""
    begin, body, absorbed = _tag_parts(b, tag, where, ctx)
    return b.rule(lark_seq(lark_lit(begin[len(strip):]), body), "tag"), absorbed


def _tag_parts(b: LarkBuilder, tag: Any, where: str, ctx: Ctx) -> tuple[str, str, bool]:
    """(begin, the expression for content + end, whether it absorbed `ctx.after`)."""
    where = getattr(tag, "where", "") or where
    if not isinstance(tag, dict):
        raise ValueError(f"{where}: must be a tag {{begin, content, end}}")
    if tag.get("type", "tag") != "tag":
        raise ValueError(f"{where}.type: must be 'tag', got {tag.get('type')!r}")
    check_fields(tag, where, _NODE_FIELDS["tag"], "tag")
    if isinstance(tag.get("begin"), dict):
        raise ValueError(f"{where}.begin: token-level begins are not supported; use a string")
    begin = read_text(tag.get("begin"), f"{where}.begin")
    end = tag.get("end", "")
    if isinstance(end, dict):
        raise ValueError(f"{where}.end: token-level ends are not supported; use a string")
    if isinstance(end, list):
        if not end:
            raise ValueError(f"{where}.end: must be a string or a non-empty list of strings")
        ends = [read_text(e, f"{where}.end[{i}]") for i, e in enumerate(end)]
    else:
        ends = [read_text(end, f"{where}.end")]
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
    return begin, lark_seq(content, f"{lark_lits(filled)}?"), False


def _json_node(b: LarkBuilder, node: dict, where: str, ctx: Ctx) -> tuple[str, bool]:
    style = node.get("style") or "json"
    if node.get("any_order") not in (None, False):
        raise ValueError(f"{where}.any_order: only false is supported (llguidance keeps the declared "
                         "property order)")
    max_ws = read_count(node, "max_whitespace_cnt", where)
    if "json_schema" not in node:
        raise ValueError(f"{where}.json_schema: required")
    path = where if isinstance(node, _At) else f"{where}.json_schema"  # the older form's `schema`
    if style == "qwen_xml":
        return qwen_xml_parameters(b, node["json_schema"], path, max_ws, ctx)
    if style != "json":
        raise ValueError(f"{where}.style: {style!r} is not supported; use 'json' or 'qwen_xml'")
    return json_rule(b, request_schema(node["json_schema"], path), path, max_ws), False


def _side_grammar(b: LarkBuilder, text: str, where: str) -> str:
    if is_gbnf(text):
        try:
            text = any_to_lark(text)
        except Exception as e:  # the converter raises plain Exceptions on bad input
            raise ValueError(f"{where}.grammar: invalid GBNF grammar: {e}") from None
    validate_grammar(llg.LLMatcher.grammar_from_lark(text), f"{where}.grammar: invalid or unsupported")
    name = b.name("grammar")
    b.side_grammars.append({"name": name, "lark_grammar": text})
    return f"@{name}"


# -- free text ---------------------------------------------------------------------------------
def _ctx_ends(ctx: Ctx) -> tuple:
    """The strings free text at `ctx` must not contain: the enclosing tag's ends and what follows."""
    return (*ctx.tag_ends, *(ctx.after if isinstance(ctx.after, tuple) else ()))


def _free_end(b: LarkBuilder, text: str, ctx: Ctx, where: str, what: str) -> tuple[str, bool]:
    """Free text (the terminal `text`) where `ctx.after` says it ends: (expression, absorbed)."""
    if isinstance(ctx.after, tuple):
        return b.rule(f"{text} {lark_lits(ctx.after)}", "until", lazy=True), True
    if ctx.after is END:
        return text, False
    raise ValueError(f"{where}: {what} must be followed by a literal (a tag's non-empty end, a const_string "
                     "or a tag) or end the output: the grammar engine cannot tell where free text ends "
                     "before anything else")


def _any_text(b: LarkBuilder, node: dict, where: str, ctx: Ctx) -> tuple[str, bool]:
    excludes = read_strings(node, "excludes", where)
    if node.get("max_tokens") is not None:
        raise ValueError(f"{where}.max_tokens: not supported (a token budget inside the grammar would "
                         "disable llguidance's rollback); use max_chars or the request's max_tokens")
    max_chars = read_count(node, "max_chars", where)
    if max_chars is not None and max_chars > MAX_CHARS_LIMIT:
        raise ValueError(f"{where}.max_chars: at most {MAX_CHARS_LIMIT} is supported")
    text = text_without([*excludes, *_ctx_ends(ctx)])
    if max_chars is not None:
        text = f"{lark_regex(f'(?s:.){{0,{max_chars}}}')} & ({text})"
    return _free_end(b, b.terminal(text, "TEXT"), ctx, where, "any_text")


def _triggered(b: LarkBuilder, node: dict, where: str, ctx: Ctx) -> tuple[str, bool]:
    where = getattr(node, "where", "") or where
    tags_key = "structures" if isinstance(node, _At) else "tags"
    triggers = read_strings(node, "triggers", where, required=True)
    for i, t in enumerate(triggers):
        for j, u in enumerate(triggers):
            if i != j and u.startswith(t) and (len(u) > len(t) or j > i):
                raise ValueError(f"{where}.triggers[{j}]: {u!r} starts with another trigger, {t!r}")
    tags = node.get("tags")
    if not isinstance(tags, list) or not tags:
        raise ValueError(f"{where}.{tags_key}: must be a non-empty list of tags")
    excludes = read_strings(node, "excludes", where)
    at_least_one, stop_after_first = read_flag(node, "at_least_one", where), read_flag(node, "stop_after_first", where)

    # Each tag: its trigger, begin and (content + end), compiled once.
    groups: dict[str, list] = {t: [] for t in triggers}
    for i, tag in enumerate(tags):
        tag_where = getattr(tag, "where", "") or f"{where}.tags[{i}]"
        begin, body, _ = _tag_parts(b, tag, tag_where, Ctx(after=None))
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
    free = b.terminal(text_without([*triggers, *excludes, *_ctx_ends(ctx)]), "FREE_TEXT")
    calls = []
    for t, members in groups.items():
        # Free text then the trigger, one lexeme, ended lazily at the trigger's first occurrence.
        lead = b.rule(f"{free} {lark_lit(t)}", "until_trigger", lazy=True)
        rests = _alternatives((begin[len(t):], body) for begin, body in members)
        calls.append(f"{lead} ({rests})")
    call = b.rule(" | ".join(calls), "call")
    tail, absorbed = _free_end(b, free, ctx, where, "triggered_tags")
    if stop_after_first:  # free text, or free text then one tag
        return b.rule(f"{_close(call, False, ctx.after) if absorbed else call} | {tail}", "calls"), absorbed
    if at_least_one:
        return b.rule(f"{first} {call}* {tail}", "calls"), absorbed
    return b.rule(f"{call}* {tail}", "calls"), absorbed


def _separated(b: LarkBuilder, node: dict, where: str) -> str:
    tags = read_list(node, "tags", where)
    sep = read_text(node.get("separator", ""), f"{where}.separator")
    at_least_one, stop_after_first = read_flag(node, "at_least_one", where), read_flag(node, "stop_after_first", where)
    # A tag without an end is followed by the separator or by what follows the node: ambiguous.
    parts = [_tag_parts(b, t, f"{where}.tags[{i}]", Ctx(after=None))[:2] for i, t in enumerate(tags)]
    bodies = [b.rule(body, "body") if body else "" for _, body in parts]
    one = b.rule(_alternatives((begin, body) for (begin, _), body in zip(parts, bodies)), "tags")
    if stop_after_first:
        return one if at_least_one else b.rule(f"{one}?", "tags")
    # The separator and the next begin are one literal: as separate lexemes, a separator that also
    # starts what follows the node ("\n" then "\n</x>") would be lost once the lexer took "\n<".
    nxt = b.rule(_alternatives((sep + begin, body) for (begin, _), body in zip(parts, bodies)), "tags")
    many = b.rule(f"{one} {nxt}*", "tags")
    return many if at_least_one else b.rule(f"{many}?", "tags")

