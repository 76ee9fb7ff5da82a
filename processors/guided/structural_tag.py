"""Structural tags → one llguidance Lark grammar.

Two request shapes are accepted:

    {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="],
        "tags": [{"begin": "<function=get_weather>", "content": {"type": "json_schema",
                  "json_schema": {...}}, "end": "</function>"}]}}
    {"type": "structural_tag", "triggers": ["<function="],
        "structures": [{"begin": "<function=get_weather>", "schema": {...}, "end": "</function>"}]}

The older `structures` form means `triggered_tags`. `format` is a tree of these nodes:

| type                  | fields                                                     | matches                |
|-----------------------|------------------------------------------------------------|------------------------|
| `const_string`        | value                                                      | that text              |
| `json_schema`         | json_schema                                                | a JSON value           |
| `regex`               | pattern                                                    | the regex              |
| `grammar`             | grammar (Lark or GBNF)                                     | the grammar            |
| `any_text`            |                                                            | any text (in a tag: up to its end) |
| `sequence`, `or`      | elements                                                   | all in order / one     |
| `tag`                 | begin, content, end                                        | begin content end      |
| `triggered_tags`      | triggers, tags, at_least_one, stop_after_first             | free text with tags    |
| `tags_with_separator` | tags, separator, at_least_one, stop_after_first            | tags only              |

**Triggered tags.** Free text may contain no trigger except as the start of a complete tag. The
grammar makes "free text without any trigger, then the trigger" a single lazy lexeme, so the
lexer ends it exactly where the trigger completes — even in the middle of a token — and the parser
then admits only the rest of a tag that begins with that trigger; after the tag's end, free text
again. The final stretch of free text is its own lexeme (text without a trigger), so the output may
end there. (Separate text and trigger lexemes do not work: the lexer does not backtrack, so `<`
would already belong to the text when `function=` arrives.)
"""

from __future__ import annotations

import json
from typing import Any

import llguidance as llg
from llguidance.gbnf_to_lark import any_to_lark

FIELD = "structural_tag"
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


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
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def grammar(self, start: str) -> str:
        lark = "\n".join([f"start: {start}", *self.rules]) + "\n"
        if not self.side_grammars:
            return llg.LLMatcher.grammar_from_lark(lark)
        return json.dumps({"grammars": [{"name": "structural_tag", "lark_grammar": lark}, *self.side_grammars]})


def structural_tag_grammar(value: dict, whitespace_pattern: str | None = None) -> str:
    """The llguidance grammar for a structural tag request (either shape); ValueError names the field."""
    if not isinstance(value, dict):
        raise ValueError(f"{FIELD}: must be a JSON object")
    if value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{FIELD}.type: must be 'structural_tag', got {value.get('type')!r}")
    if "format" in value:
        fmt, where = value["format"], f"{FIELD}.format"
    elif "structures" in value:
        fmt, where = _from_structures(value), FIELD
    else:
        raise ValueError(f"{FIELD}: needs 'format' (or the older 'structures' with 'triggers')")
    builder = _LarkBuilder(whitespace_pattern)
    return builder.grammar(_node(builder, fmt, where))


def _from_structures(value: dict) -> dict:
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{FIELD}.structures: must be a non-empty list of {{begin, schema, end}}")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or "schema" not in s:
            raise ValueError(f"{FIELD}.structures[{i}]: must be {{begin, schema, end}}")
        tags.append({"begin": s.get("begin"), "end": s.get("end", ""),
                     "content": {"type": "json_schema", "json_schema": s["schema"]}})
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


def _text(value: Any, where: str, allow_empty: bool = True) -> str:
    if not isinstance(value, str) or (not allow_empty and not value):
        raise ValueError(f"{where}: must be a {'non-empty ' if not allow_empty else ''}string")
    return value


def _literal(text: str) -> str:
    return json.dumps(text) if text else ""


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _list(node: dict, key: str, where: str) -> list:
    value = node.get(key)
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}.{key}: must be a non-empty list")
    return value


def _no_trigger_text(triggers: list[str]) -> str:
    """A Lark regex for any text that contains none of `triggers`."""
    banned = "|".join(llg.regex_to_lark(_escape(t), "") for t in triggers)
    return f"/(.|\\n)*/ & ~/(.|\\n)*({banned})(.|\\n)*/"


def _escape(text: str) -> str:
    """`text` as a literal in Rust regex syntax."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _node(b: _LarkBuilder, node: Any, where: str) -> str:
    """Add rules for `node`; return the Lark expression that matches it."""
    if not isinstance(node, dict) or not isinstance(node.get("type"), str):
        raise ValueError(f"{where}: must be an object with a 'type'")
    kind = node["type"]
    if kind == "const_string":
        return _literal(_text(node.get("value"), f"{where}.value"))
    if kind == "json_schema":
        return _json(b, node.get("json_schema"), f"{where}.json_schema")
    if kind == "regex":
        pattern = _text(node.get("pattern"), f"{where}.pattern", allow_empty=False)
        return b.rule(f"/{llg.regex_to_lark(pattern, '')}/", "re")
    if kind == "grammar":
        return _side_grammar(b, _text(node.get("grammar"), f"{where}.grammar", allow_empty=False), where)
    if kind == "any_text":
        return b.rule("/(.|\\n)*/", "text")
    if kind in ("sequence", "or"):
        parts = [_node(b, e, f"{where}.elements[{i}]") for i, e in enumerate(_list(node, "elements", where))]
        return b.rule((" " if kind == "sequence" else " | ").join(parts), kind[:3])
    if kind == "tag":
        return _tag(b, node, where)
    if kind == "triggered_tags":
        return _triggered(b, node, where)
    if kind == "tags_with_separator":
        return _separated(b, node, where)
    raise ValueError(f"{where}.type: unknown structural tag format {kind!r}; use const_string, json_schema, "
                     "regex, grammar, any_text, sequence, or, tag, triggered_tags or tags_with_separator")


def _json(b: _LarkBuilder, schema: Any, where: str) -> str:
    from .json_schema import check_depth, drop_custom_formats

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{where}: invalid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: must be a JSON schema object")
    check_depth(schema, where)
    schema = drop_custom_formats(schema)
    if b.whitespace_pattern is not None:
        schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}),
                                           "whitespace_pattern": b.whitespace_pattern}}
    return b.rule(f"%json {json.dumps(schema)}", "json")


def _side_grammar(b: _LarkBuilder, text: str, where: str) -> str:
    from .compiler import is_gbnf

    if is_gbnf(text):
        try:
            text = any_to_lark(text)
        except Exception as e:  # the converter raises plain Exceptions on bad input
            raise ValueError(f"{where}.grammar: invalid GBNF grammar: {e}") from None
    name = b.name("grammar")
    b.side_grammars.append({"name": name, "lark_grammar": text})
    return f"@{name}"


def _tag(b: _LarkBuilder, tag: Any, where: str, begin_after: str = "") -> str:
    """`begin content end`; `begin_after` drops a trigger the caller already matched."""
    if not isinstance(tag, dict):
        raise ValueError(f"{where}: must be {{begin, content, end}}")
    begin = _text(tag.get("begin"), f"{where}.begin")
    end = _text(tag.get("end", ""), f"{where}.end")
    content = tag.get("content")
    if isinstance(content, dict) and content.get("type") == "any_text":
        # Any text up to the end string: one lazy lexeme, so the first `end` closes the tag.
        if not end:
            raise ValueError(f"{where}.end: an any_text tag needs a non-empty end")
        body = b.rule(f"/(.|\\n)*/ {_literal(end)}", "until", lazy=True)
        return b.rule(_seq(_literal(begin[len(begin_after):]), body), "tag")
    inner = _node(b, content, f"{where}.content")
    return b.rule(_seq(_literal(begin[len(begin_after):]), inner, _literal(end)), "tag")


def _triggered(b: _LarkBuilder, node: dict, where: str) -> str:
    triggers = [_text(t, f"{where}.triggers[{i}]", allow_empty=False)
                for i, t in enumerate(_list(node, "triggers", where))]
    tags = _list(node, "tags", where)
    free = b.name("FREE_TEXT").upper()
    b.rules.append(f"{free}: {_no_trigger_text(triggers)}")
    calls = []
    for t in triggers:
        mine = [(i, tag) for i, tag in enumerate(tags) if isinstance(tag, dict)
                and isinstance(tag.get("begin"), str) and tag["begin"].startswith(t)]
        if not mine:
            continue
        # Free text then the trigger, one lexeme, ended lazily at the trigger's first occurrence.
        lead = b.rule(f"{free} {_literal(t)}", "until_trigger", lazy=True)
        bodies = [_tag(b, tag, f"{where}.tags[{i}]", begin_after=t) for i, tag in mine]
        calls.append(f"{lead} ({' | '.join(bodies)})")
    for i, tag in enumerate(tags):
        if not (isinstance(tag, dict) and isinstance(tag.get("begin"), str)
                and any(tag["begin"].startswith(t) for t in triggers)):
            raise ValueError(f"{where}.tags[{i}].begin: must start with one of the triggers {triggers}")
    call = b.rule(" | ".join(calls), "call")
    first, rest = bool(node.get("at_least_one")), not node.get("stop_after_first")
    if first and not rest:
        return b.rule(call, "calls")
    if first:
        return b.rule(f"{call}+ {free}", "calls")
    if not rest:
        return b.rule(f"{call} | {free}", "calls")
    return b.rule(f"{call}* {free}", "calls")


def _separated(b: _LarkBuilder, node: dict, where: str) -> str:
    tags = [_tag(b, t, f"{where}.tags[{i}]") for i, t in enumerate(_list(node, "tags", where))]
    sep = _literal(_text(node.get("separator", ""), f"{where}.separator"))
    one = b.rule(" | ".join(tags), "tags")
    first, rest = bool(node.get("at_least_one")), not node.get("stop_after_first")
    if not rest:
        return one if first else b.rule(f"{one}?", "tags")
    many = b.rule(f"{one} ({_seq(sep, one)})*", "tags")
    return many if first else b.rule(f"{many}?", "tags")
