"""`GuidedDecodingParams` → a compiled llguidance matcher template: checked, cached, time-limited.

Compiling happens on the caller's thread at admission (`validate_request`), so every problem is a
`GuidedDecodingError` (a `ValueError` whose message starts with the request field) before the
request reaches a slot:

| GuidedDecodingParams | field in messages   | grammar                                              |
|----------------------|---------------------|------------------------------------------------------|
| json                 | guided_json         | JSON schema (dict or JSON text)                      |
| json_object          | response_format     | any JSON object                                      |
| regex                | guided_regex        | regex (Rust `regex` syntax, whole output)            |
| choice               | guided_choice       | one of the strings                                   |
| grammar              | guided_grammar      | GBNF (`root ::= ...`) or Lark (`start: ...`)         |
| structural_tag       | structural_tag      | see `structural_tag.py`                              |
| whitespace_pattern   | guided_whitespace_pattern | JSON whitespace regex (json, json_object, tags) |

`json` may also be OpenAI's `response_format.json_schema` object, `{"name", "schema", "strict"}`;
with `"strict": true` every object that does not say otherwise gets `additionalProperties: false`.
A plain schema is used as written (JSON Schema semantics: extra keys allowed unless forbidden),
except that `format` values JSON Schema does not define (`topic`, `byte`) are dropped: they are
annotations no validator checks. Keywords llguidance does not implement are refused, never ignored.

A compiled constraint is the matcher in its start state with its first mask computed (so limits
that only bite at the first step are found here too); each request gets a `deep_copy`. Results,
errors included, are kept in an LRU cache keyed by the grammar text. Compiling runs on a helper
thread (llguidance releases the GIL) and is abandoned after `compile_timeout_s`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance as llg
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from .json_schema import check_depth, drop_custom_formats, strict_schema
from .structural_tag import structural_tag_grammar

logger = logging.getLogger(__name__)

FIELDS = {"json": "guided_json", "json_object": "response_format", "regex": "guided_regex",
          "choice": "guided_choice", "grammar": "guided_grammar", "structural_tag": "structural_tag"}
MAX_CONSTRAINT_CHARS = 1 << 20
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z_][A-Za-z0-9_-]*\s*::=")
_OPENAI_WRAPPER_KEYS = {"name", "description", "schema", "strict"}


class GuidedDecodingError(ValueError):
    """A constraint that cannot be used; `field` is the request field to blame."""

    def __init__(self, field: str, message: str):
        super().__init__(message if message.startswith(field) else f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class CompiledConstraint:
    kind: str
    template: llg.LLMatcher
    compile_seconds: float

    def new_matcher(self) -> llg.LLMatcher:
        return self.template.deep_copy()


def is_gbnf(text: str) -> bool:
    """llama.cpp GBNF (`root ::= ...`) rather than Lark (`start: ...`)."""
    return bool(_GBNF_RULE.search(text))


def grammar_source(gd) -> tuple[str, str]:
    """(field, llguidance grammar text) for a `GuidedDecodingParams`; raises GuidedDecodingError."""
    kind = gd.kinds()[0]
    field = FIELDS[kind]
    ws = gd.whitespace_pattern
    if ws is not None:
        if not isinstance(ws, str) or not ws:
            raise GuidedDecodingError("guided_whitespace_pattern", "must be a non-empty regex")
        error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_regex(ws))
        if error:
            raise GuidedDecodingError("guided_whitespace_pattern", f"invalid regex: {clean_error(error)}")
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else _schema(gd.json, field)
            options = {"whitespace_pattern": ws} if ws is not None else None
            return field, llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        if kind == "regex":
            return field, llg.LLMatcher.grammar_from_regex(_bounded(gd.regex, field))
        if kind == "choice":
            return field, llg.grammar_from("choice", json.dumps(gd.choice))
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


def clean_error(message: str) -> str:
    """llguidance's message without the grammar excerpt it appends, on one line."""
    kept = []
    for line in message.strip().splitlines():
        if re.match(r"^\s*\d+ \| ", line) or line.strip() == "<state>":
            break
        kept.append(line.strip())
    text = re.sub(r"\s+", " ", " ".join(k for k in kept if k)).strip()
    return text[:500] or "invalid constraint"


class GrammarCompiler:
    """Compiles constraints for one tokenizer, with an LRU cache and a per-compile time limit."""

    def __init__(self, lltokenizer: llg.LLTokenizer, cache_size: int | None = None,
                 compile_timeout_s: float | None = None, limits: llg.LLParserLimits | None = None):
        self.lltokenizer = lltokenizer
        self.cache_size = cache_size or int(os.environ.get("FASTDEPLOY_LP_GUIDED_CACHE_SIZE", 128))
        self.compile_timeout_s = compile_timeout_s or float(
            os.environ.get("FASTDEPLOY_LP_GUIDED_COMPILE_TIMEOUT_S", 5.0))
        self.limits = limits
        self._cache: OrderedDict[str, CompiledConstraint | GuidedDecodingError] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, gd) -> CompiledConstraint:
        field, grammar = grammar_source(gd)
        with self._lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
                self.hits += 1
        if cached is None:
            self.misses += 1
            cached = self._compile_with_timeout(field, grammar, gd.kinds()[0])
            with self._lock:
                self._cache[grammar] = cached
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(cached, GuidedDecodingError):
            raise GuidedDecodingError(cached.field, str(cached))
        return cached

    def _compile_with_timeout(self, field: str, grammar: str, kind: str):
        box: dict = {}
        worker = threading.Thread(target=lambda: box.update(result=self._build(field, grammar, kind)),
                                  name="guided-compile", daemon=True)
        worker.start()
        worker.join(self.compile_timeout_s)
        if worker.is_alive():  # not cached: the time depends on load; the thread finishes on its own
            raise GuidedDecodingError(field, f"compiling the constraint took longer than {self.compile_timeout_s:g} s; "
                                             "simplify it")
        return box["result"]

    def _build(self, field: str, grammar: str, kind: str) -> CompiledConstraint | GuidedDecodingError:
        start = time.perf_counter()
        try:
            matcher = llg.LLMatcher(self.lltokenizer, grammar, log_level=0, limits=self.limits)
            if not matcher.is_error():
                first_mask = allocate_token_bitmask(1, self.lltokenizer.vocab_size)
                fill_next_token_bitmask(matcher, first_mask, 0)
        except Exception as e:  # API-level failures still blame the request, not the engine
            return GuidedDecodingError(field, f"cannot compile: {e}")
        if matcher.is_error():
            return GuidedDecodingError(field, f"invalid or unsupported: {clean_error(matcher.get_error())}")
        for warning in matcher.get_grammar_warnings():
            logger.info("%s: %s", field, warning)
        return CompiledConstraint(kind, matcher, time.perf_counter() - start)
