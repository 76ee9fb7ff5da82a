"""What a `GuidedDecodingParams` means to llguidance: its grammar text, the matcher built from it,
and why a constraint cannot be used. Nothing here starts a process or a thread or keeps a cache
(that is `compiler.py`), so a compile worker (`sandbox.py`) runs exactly this code.

Every problem is a `GuidedDecodingError` (a `ValueError` whose message starts with the request field):

| GuidedDecodingParams | field in messages   | grammar                                              |
|----------------------|---------------------|------------------------------------------------------|
| json                 | guided_json         | JSON schema (dict or JSON text)                      |
| json_object          | response_format     | any JSON object                                      |
| regex                | guided_regex        | regex (Rust `regex` syntax, whole output)            |
| choice               | guided_choice       | one of the strings                                   |
| grammar              | guided_grammar      | GBNF (`root ::= ...`) or Lark (`start: ...`)         |
| structural_tag       | structural_tag      | see `structural_tag.py`                              |
| whitespace_pattern   | guided_whitespace_pattern | JSON whitespace regex (json, json_object, tags) |
| max_number_digits    | guided_json             | cap on JSON number length (json, json_object)        |

`json` may also be OpenAI's `response_format.json_schema` object, `{"name", "schema", "strict"}`;
with `"strict": true` every object that does not say otherwise gets `additionalProperties: false`.
A plain schema is used as written (JSON Schema semantics: extra keys allowed unless forbidden),
except that `format` values JSON Schema does not define (`topic`, `byte`) are dropped: they are
annotations no validator checks. Keywords llguidance does not implement are refused, never ignored.
With `max_number_digits` (the server sets it, `--guided-json-number-digits`) numbers are capped in
length and every any-value position, the schema `{}` itself included, is a capped any-value
(`json_schema.cap_numbers`): `{}` means any JSON value, as JSON Schema says, never an unbounded one.

A compiled constraint is the matcher in its start state with its first mask computed the way the
engine computes masks (on an `LLExecutor`'s threads), and a copy taken one step further (the forced
tokens, or else one allowed token) — limits that bite at the first steps are found here, not in a
running request. Each request gets a `deep_copy`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from functools import cached_property

import llguidance as llg
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from fastdeploy_lp.processors.guided.closing_bound import step_bound
from fastdeploy_lp.processors.guided.grammar_text import clean_error, is_gbnf
from fastdeploy_lp.processors.guided.json_schema import (cap_numbers, check_depth, drop_custom_formats,
                                                         json_format_options, strict_schema)
from fastdeploy_lp.processors.guided.structural_tag import structural_tag_grammar

logger = logging.getLogger(__name__)

FIELDS = {"json": "guided_json", "json_object": "response_format", "regex": "guided_regex",
          "choice": "guided_choice", "grammar": "guided_grammar", "structural_tag": "structural_tag"}
MAX_CONSTRAINT_CHARS = 1 << 20
_OPENAI_WRAPPER_KEYS = {"name", "description", "schema", "strict"}
_DECODING_ONLY = {"close_on_length"}  # options that leave the grammar as it is: one cache entry for both


class GuidedDecodingError(ValueError):
    """A constraint that cannot be used; `field` is the request field to blame."""

    def __init__(self, field: str, message: str):
        super().__init__(message if message.startswith(field) else f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class CompiledConstraint:
    template: llg.LLMatcher
    grammar: str = ""  # the llguidance grammar text it was built from
    derived: dict = field(default_factory=dict, compare=False, repr=False)  # what users work out once from it

    def new_matcher(self) -> llg.LLMatcher:
        return self.template.deep_copy()

    @cached_property
    def closing_step(self) -> int | None:
        """For a JSON schema, the most bytes one event of the output can add to its shortest closing
        (close_on_length, `closing_bound.py`); None for other grammars or a schema it cannot read."""
        try:
            schema = (json.loads(self.grammar).get("grammars") or [{}])[0].get("json_schema")
        except (ValueError, AttributeError, TypeError):
            return None
        return None if schema is None else step_bound(schema)


def grammar_source(gd) -> tuple[str, str]:
    """(field, llguidance grammar text) for a `GuidedDecodingParams`; raises GuidedDecodingError."""
    kind = gd.kinds()[0]
    field = FIELDS[kind]
    ws = gd.whitespace_pattern
    if ws is not None:
        if not isinstance(ws, str):
            raise GuidedDecodingError("guided_whitespace_pattern", "must be a regex, or \"\" for no whitespace")
        error = ws and llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_regex(ws))
        if error:
            raise GuidedDecodingError("guided_whitespace_pattern", f"invalid regex: {clean_error(error)}")
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else _schema(gd.json, field)
            if gd.disable_additional_properties:
                schema = strict_schema(schema)
            if gd.max_number_digits:
                if kind == "json_object":  # its values are any JSON: made explicit, so they are capped too
                    schema.setdefault("additionalProperties", True)
                schema = cap_numbers(schema, gd.max_number_digits)
            return field, llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=json_format_options(ws))
        if kind == "regex":
            return field, llg.LLMatcher.grammar_from_regex(_bounded(gd.regex, field))
        if kind == "choice":
            return field, choice_grammar(gd.choice, field)
        if kind == "grammar":
            text = _bounded(gd.grammar, field)
            if is_gbnf(text):
                try:
                    text = any_to_lark(text)
                except Exception as e:  # the converter raises plain Exceptions on bad input
                    raise GuidedDecodingError(field, f"invalid GBNF grammar: {e}") from None
            return field, llg.LLMatcher.grammar_from_lark(text)
        value = gd.structural_tag
        if isinstance(value, str):
            value = _parse_json(_bounded(value, field), field)
        _bounded(json.dumps(value), field)
        return field, structural_tag_grammar(value, ws)
    except GuidedDecodingError:
        raise
    except (ValueError, TypeError, RecursionError) as e:
        raise GuidedDecodingError(field, clean_error(str(e))) from None


def choice_grammar(options, field: str = "guided_choice") -> str:
    """One of `options`, as a single lexeme (an alternation of literals).

    llguidance's own choice grammar makes each option a separate alternative of the start rule,
    and its parser allows at most 2,000 items in a row: with more options every request failed at
    its second token. One lexeme is the same language, and the lexer handles 100,000 options."""
    if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
        raise GuidedDecodingError(field, "must be a non-empty list of strings")
    _bounded(json.dumps(options), field)
    words = list(dict.fromkeys(o for o in options if o))
    if not words:  # only the empty string
        return llg.LLMatcher.grammar_from_lark('start: ""')
    optional = "?" if "" in options else ""
    alternatives = " | ".join(json.dumps(w) for w in words)
    return llg.LLMatcher.grammar_from_lark(f"start: CHOICE{optional}\nCHOICE: {alternatives}")


def constraint_data(gd) -> dict:
    """A `GuidedDecodingParams` as plain data (every field, whatever this version knows of them):
    what compile workers receive and rebuild with `PlainConstraint`."""
    return {"kind": gd.kinds()[0], "fields": {f.name: getattr(gd, f.name) for f in dataclasses.fields(gd)}}


class PlainConstraint:
    """`GuidedDecodingParams` rebuilt from `constraint_data` where the engine is not imported (a
    compile worker): the same attributes, and `kinds()`; a field it was not given reads as None."""

    def __init__(self, data: dict):
        self.__dict__.update(data["fields"])
        self._kind = data["kind"]

    def kinds(self) -> list[str]:
        return [self._kind]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def request_key(gd) -> tuple[str, str, str]:
    """The cache key of a constraint: its kind, its value as text and its options (whitespace, ...).

    Cheap, and checks the size before any work: a dict and its `json.dumps` text share a key."""
    kind = gd.kinds()[0]
    field, value = FIELDS[kind], getattr(gd, kind)
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except RecursionError:
            raise GuidedDecodingError(field, "the JSON is nested too deeply") from None
        except (TypeError, ValueError) as e:
            raise GuidedDecodingError(field, f"must be JSON data: {e}") from None
    _bounded(text, field)
    options = {f.name: getattr(gd, f.name) for f in dataclasses.fields(gd) if f.name not in FIELDS
               and f.name not in _DECODING_ONLY}
    ws = options.get("whitespace_pattern")
    if isinstance(ws, str):
        _bounded(ws, "guided_whitespace_pattern")
    return kind, text, json.dumps(options, sort_keys=True, default=repr)


def _bounded(text, field: str) -> str:
    if not isinstance(text, str):
        raise GuidedDecodingError(field, f"must be a string, got {type(text).__name__}")
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise GuidedDecodingError(field, f"is {len(text)} characters long; at most {MAX_CONSTRAINT_CHARS} are allowed")
    return text


def _parse_json(text: str, field: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise GuidedDecodingError(field, "the JSON is nested too deeply") from None
    except ValueError as e:
        raise GuidedDecodingError(field, f"invalid JSON: {e}") from None


def _schema(value, field: str) -> dict:
    if isinstance(value, str):
        value = _parse_json(_bounded(value, field), field)
    if value is True:  # the schema `true`: any JSON value
        return {}
    if not isinstance(value, dict):
        raise GuidedDecodingError(field, f"must be a JSON schema object (or true), got {json.dumps(value)[:40]}")
    check_depth(value, field)
    strict = False
    if "schema" in value and set(value) <= _OPENAI_WRAPPER_KEYS:  # OpenAI's json_schema object
        strict, value = bool(value.get("strict")), value["schema"]
        if not isinstance(value, dict):
            raise GuidedDecodingError(field, "'schema' must be a JSON schema object")
    _bounded(json.dumps(value), field)
    return drop_custom_formats(strict_schema(value) if strict else value)


def build_constraint(lltokenizer: llg.LLTokenizer, grammar: str, field: str,
                     limits: llg.LLParserLimits | None = None,
                     executor: llg.LLExecutor | None = None) -> CompiledConstraint | GuidedDecodingError:
    """Build the matcher for a grammar text and take its first steps; the error names `field`."""
    try:
        matcher = llg.LLMatcher(lltokenizer, grammar, log_level=0, limits=limits)
        problem = _first_steps(matcher, lltokenizer, executor or llg.LLExecutor(1))
    except Exception as e:  # API-level failures still blame the request, not the engine
        return GuidedDecodingError(field, f"cannot compile: {e}")
    if problem:
        return GuidedDecodingError(field, problem)
    for warning in matcher.get_grammar_warnings():
        logger.info("%s: %s", field, warning)
    return CompiledConstraint(matcher, grammar)


def _first_steps(matcher: llg.LLMatcher, lltokenizer: llg.LLTokenizer, executor: llg.LLExecutor) -> str | None:
    """Why the matcher cannot be used, found by taking its first steps the way the engine does, or None.

    The template's first mask is filled on the executor's threads (as every mask at run time is);
    then a copy consumes what a request would consume first (the forced tokens, else the first
    allowed token) and fills its next mask. Hitting llguidance's lexer or parser limits there
    (a regex that needs too many states, 10,000 alternatives in one rule) is refused here instead
    of ending a request at its first token."""
    if matcher.is_error():
        return f"invalid or unsupported: {clean_error(matcher.get_error())}"
    bits = allocate_token_bitmask(1, lltokenizer.vocab_size)
    fill_next_token_bitmask_par(executor, [(matcher, 0)], bits)
    problem = dead_end(matcher, bits[0], lltokenizer.eos_tokens)
    if problem:
        return problem
    probe = matcher.deep_copy()
    forced = probe.compute_ff_tokens()
    if forced:
        probe.consume_tokens(forced)
    else:
        eos = set(lltokenizer.eos_tokens)
        allowed = np.flatnonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little"))
        token = next((int(t) for t in allowed if int(t) not in eos), None)
        if token is not None:
            probe.consume_token(token)
    if not probe.is_error() and not probe.is_stopped():
        fill_next_token_bitmask_par(executor, [(probe, 0)], bits)
    problem = dead_end(probe, bits[0], lltokenizer.eos_tokens)
    if problem:
        return f"the grammar engine cannot follow this constraint past its first token: {problem}"
    return None


def dead_end(matcher: llg.LLMatcher, row_bits: np.ndarray, eos_tokens) -> str | None:
    """Why a matcher whose mask is `row_bits` cannot go on, or None: it is in error, or its mask
    allows nothing but EOS although the constraint is not complete (EOS would end the output
    with text the constraint rejects)."""
    if matcher.is_error():
        return clean_error(matcher.get_error())
    if allows_other_than(row_bits, eos_tokens) or matcher.is_accepting():
        return None
    reason = matcher.stop_reason() if matcher.is_stopped() else "no token can continue it"
    return f"the constraint is incomplete but allows no further token ({reason})"


def allows_other_than(bits: np.ndarray, tokens) -> np.ndarray:
    """Whether each row of a packed bitmask (int32 `[..., words]`) allows a token not in `tokens`
    (the EOS ids): one bool per row. The bits of `tokens` are cleared in place while it looks and
    then put back, so the mask is not copied (it runs on the batch's mask every decode step)."""
    words = bits.view(np.uint32)
    clear: dict[int, int] = {}  # word -> the bits of `tokens` in it
    for token in tokens:
        if 0 <= token < 32 * words.shape[-1]:
            clear[token >> 5] = clear.get(token >> 5, 0) | (1 << (token & 31))
    if not clear:
        return words.any(axis=-1)
    columns = np.fromiter(clear, dtype=np.intp, count=len(clear))
    saved = words[..., columns]  # a copy of those few words
    words[..., columns] = saved & ~np.asarray(list(clear.values()), dtype=np.uint32)
    try:
        return words.any(axis=-1)
    finally:
        words[..., columns] = saved
