"""The pieces a structural tag is compiled from: `LarkBuilder` (the grammar being written), `Ctx`
(what surrounds the node being compiled), readers for request fields whose errors name the field,
and Lark/regex text helpers, JSON schemas included (`json_rule`). Used by the node compiler
(`structural_tag.py`) and the Qwen XML parameters (`qwen_xml.py`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance as llg

from fastdeploy_lp.processors.guided.grammar_text import clean_error
from fastdeploy_lp.processors.guided.json_schema import check_depth, drop_custom_formats, json_format_options

_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
ANY = "(?s:.*)"


class _End:
    """`Ctx.after` when nothing follows: the output ends there."""

    def __repr__(self) -> str:
        return "END"


END = _End()


@dataclass(frozen=True)
class Ctx:
    """What surrounds a node: `after` is what follows it — a tuple of alternative non-empty
    literals, END, or None (something else or unknown); `tag_ends`, the end strings of the nearest
    enclosing tag (free text never contains them)."""

    after: Any = END
    tag_ends: tuple = ()


class LarkBuilder:
    """Collects the rules of one grammar under fresh names, and the grammars it embeds (`@name`)."""

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


# -- reading request fields (each error names the field) ----------------------------------------
def check_fields(node: dict, where: str, fields: set, what: str) -> None:
    for key in node:
        if key != "type" and key not in fields:
            raise ValueError(f"{where}.{key}: unknown field for a {what}; it has {', '.join(sorted(fields))}")


def read_text(value: Any, where: str, allow_empty: bool = True) -> str:
    if not isinstance(value, str) or (not allow_empty and not value):
        raise ValueError(f"{where}: must be a {'non-empty ' if not allow_empty else ''}string")
    return value


def read_flag(node: dict, key: str, where: str) -> bool:
    value = node.get(key)
    if value is None:  # absent (or null, as some clients send defaults)
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key}: must be true or false")
    return value


def read_count(node: dict, key: str, where: str, default=None, minimum: int = 0) -> int | None:
    value = node.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{where}.{key}: must be an integer >= {minimum}")
    return value


def read_list(node: dict, key: str, where: str) -> list:
    value = node.get(key)
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}.{key}: must be a non-empty list")
    return value


def read_strings(node: dict, key: str, where: str, required: bool = False) -> list[str]:
    """A list of non-empty strings (`excludes`, `triggers`)."""
    value = node.get(key)
    if value is None and not required:
        value = []
    if not isinstance(value, list) or (required and not value):
        raise ValueError(f"{where}.{key}: must be a {'non-empty ' if required else ''}list of strings")
    return [read_text(v, f"{where}.{key}[{i}]", allow_empty=False) for i, v in enumerate(value)]


# -- Lark and regex text ------------------------------------------------------------------------
def lark_lit(text: str) -> str:
    """A Lark string literal ("" for nothing)."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def lark_lits(options) -> str:
    """Alternative literals as one Lark expression."""
    options = list(dict.fromkeys(options))
    if len(options) == 1:
        return lark_lit(options[0]) or '""'
    return "(" + " | ".join(lark_lit(o) or '""' for o in options) + ")"


def lark_seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def regex_escape(text: str) -> str:
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


def lark_regex(regex: str) -> str:
    """A Rust regex as a Lark `/.../` regex."""
    return f"/{llg.regex_to_lark(regex, '')}/"


def text_without(banned) -> str:
    """A Lark terminal expression for any text that contains none of `banned`."""
    banned = list(dict.fromkeys(banned))
    if not banned:
        return lark_regex(ANY)
    return f"{lark_regex(ANY)} & ~{lark_regex(ANY + '(?:' + '|'.join(regex_escape(t) for t in banned) + ')' + ANY)}"


def validate_grammar(grammar: str, failure: str) -> None:
    """ValueError `failure: <llguidance's error>` unless llguidance accepts `grammar`."""
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{failure}: {clean_error(error)}")


def check_regex(pattern: str, where: str) -> None:
    validate_grammar(llg.LLMatcher.grammar_from_regex(pattern), f"{where}: invalid or unsupported regex")


def request_schema(schema: Any, where: str) -> Any:
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


def whitespace_regex(b: LarkBuilder, max_ws: int | None) -> str | None:
    if max_ws is not None:
        return f"[ \\n\\t]{{0,{max_ws}}}"
    return b.whitespace_pattern


def json_rule(b: LarkBuilder, schema: dict, where: str, max_ws: int | None = None) -> str:
    """`%json` for a schema, checked on its own first so that an error names its place."""
    # The same bounded default as plain JSON constraints (json_format_options), tool-call arguments included.
    options = json_format_options(whitespace_regex(b, max_ws))
    schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **options}}
    validate_grammar(llg.LLMatcher.grammar_from_json_schema(json.dumps(schema)), f"{where}: invalid or unsupported")
    return b.rule(f"%json {json.dumps(schema)}", "json")
