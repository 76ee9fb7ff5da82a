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

A compiled constraint is the matcher in its start state with its first mask computed the way the
engine computes masks (on an `LLExecutor`'s threads), and a copy taken one step further (the forced
tokens, or else one allowed token) — limits that bite at the first steps are found here, not in a
running request. Each request gets a `deep_copy`.

Where the work runs (docs/guided_decoding.md, "Compile isolation"): the whole conversion (schema
preparation, GBNF → Lark, building the matcher, the first steps) runs first in a compile-worker
process (`sandbox.py`), where a native crash (llguidance overflows its stack on deeply chained
rules) or a runaway compile (killed at the deadline) cannot reach the server. Only a constraint
the worker compiled is then built here, from the worker's final grammar text, on a thread with a
larger stack than the worker's (llguidance releases the GIL while it builds and fills masks). The
limit, `compile_timeout_s`, covers waiting for a worker, the worker and the build here. Results,
errors included, are kept in an LRU cache keyed by the request's constraint; a timeout is not
cached (it depends on load). Identical constraints compiling at the same time are compiled once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import llguidance as llg
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from .json_schema import check_depth, drop_custom_formats, json_format_options, strict_schema
from .sandbox import CompileSandbox, SandboxCrashed, SandboxTimeout
from .structural_tag import structural_tag_grammar

logger = logging.getLogger(__name__)

FIELDS = {"json": "guided_json", "json_object": "response_format", "regex": "guided_regex",
          "choice": "guided_choice", "grammar": "guided_grammar", "structural_tag": "structural_tag"}
MAX_CONSTRAINT_CHARS = 1 << 20
BUILD_STACK_BYTES = 32 << 20  # in-process builds: 4x a compile worker's stack (sandbox.WORKER_STACK_BYTES)
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z_][A-Za-z0-9_-]*\s*::=")
_OPENAI_WRAPPER_KEYS = {"name", "description", "schema", "strict"}


def default_compile_timeout_s() -> float:
    """The time limit of preparing one request's constraint (custom backends' hooks too)."""
    return float(os.environ.get("FASTDEPLOY_LP_GUIDED_COMPILE_TIMEOUT_S", 5.0))


class GuidedDecodingError(ValueError):
    """A constraint that cannot be used; `field` is the request field to blame."""

    def __init__(self, field: str, message: str):
        super().__init__(message if message.startswith(field) else f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class CompiledConstraint:
    template: llg.LLMatcher

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
    options = {f.name: getattr(gd, f.name) for f in dataclasses.fields(gd) if f.name not in FIELDS}
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


def clean_error(message: str) -> str:
    """llguidance's message without the grammar excerpt it appends, on one line."""
    kept = []
    for line in message.strip().splitlines():
        if re.match(r"^\s*\d+ \| ", line) or line.strip() == "<state>":
            break
        kept.append(line.strip())
    text = re.sub(r"\s+", " ", " ".join(k for k in kept if k)).strip()
    for internal, meaning in _ERROR_MEANINGS.items():
        if internal in text:
            text = f"{meaning} ({text})"
    return text[:500] or "invalid constraint"


# llguidance messages that name its internals rather than the problem in the request.
_ERROR_MEANINGS = {
    "NoExtensionBias": "no output can ever satisfy it: a rule or $ref only leads back to itself, with no way to end",
}


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
    return CompiledConstraint(matcher)


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


class _BigStackThreads:
    """A few daemon threads with a known stack size (`threading.stack_size` is process-wide, so it
    is set only while they are created), shared by every compiler of the process."""

    def __init__(self, n: int, stack_bytes: int):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(stack_bytes)
            try:
                for i in range(n):
                    threading.Thread(target=self._serve, name=f"guided-build-{i}", daemon=True).start()
            finally:
                threading.stack_size(previous)

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future

    def _serve(self) -> None:
        while True:
            future, fn, args = self._tasks.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the waiter
                future.set_exception(e)
            del future, fn, args  # do not keep the last matcher alive until the next task


_STACK_SIZE_LOCK = threading.Lock()
_BUILDERS_LOCK = threading.Lock()
_BUILDERS: _BigStackThreads | None = None


def _builders() -> _BigStackThreads:
    global _BUILDERS
    with _BUILDERS_LOCK:
        if _BUILDERS is None:
            _BUILDERS = _BigStackThreads(4, BUILD_STACK_BYTES)
        return _BUILDERS


def _limits_data(limits: llg.LLParserLimits | None) -> dict | None:
    if limits is None:
        return None
    names = ("max_items_in_row", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items", "max_lexer_states",
             "max_grammar_size", "precompute_large_lexemes", "verbose_errors")
    return {n: getattr(limits, n) for n in names}


class GrammarCompiler:
    """Compiles constraints for one tokenizer: sandboxed, time-limited, LRU-cached.

    `tokenizer_spec` (`tokenizer.lltokenizer_spec`) lets compile workers build the same vocabulary;
    `workers` (env FASTDEPLOY_LP_GUIDED_COMPILE_WORKERS, default 2) is the size of the worker pool,
    which compilers with the same vocabulary share. With `workers=0` or no spec, everything is
    compiled in this process, on a large-stack thread abandoned at the time limit: no isolation."""

    def __init__(self, lltokenizer: llg.LLTokenizer, cache_size: int | None = None,
                 compile_timeout_s: float | None = None, limits: llg.LLParserLimits | None = None,
                 tokenizer_spec: dict | None = None, workers: int | None = None):
        self.lltokenizer = lltokenizer
        self.cache_size = cache_size or int(os.environ.get("FASTDEPLOY_LP_GUIDED_CACHE_SIZE", 128))
        self.compile_timeout_s = compile_timeout_s or default_compile_timeout_s()
        self.limits = limits
        if workers is None:
            workers = int(os.environ.get("FASTDEPLOY_LP_GUIDED_COMPILE_WORKERS", 2))
        self.sandbox = CompileSandbox.shared(tokenizer_spec, workers) if tokenizer_spec and workers > 0 else None
        self._executor = llg.LLExecutor(1)
        self._cache: OrderedDict[tuple, CompiledConstraint | GuidedDecodingError] = OrderedDict()
        self._inflight: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, gd) -> CompiledConstraint:
        deadline = time.monotonic() + self.compile_timeout_s
        key = request_key(gd)
        field = FIELDS[key[0]]
        pending = None
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                pending = self._inflight.get(key)
                if pending is None:
                    self.misses += 1
                    self._inflight[key] = mine = Future()
                else:
                    self.hits += 1
        if cached is None and pending is not None:  # the same constraint is being compiled: wait for it
            try:
                cached = pending.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise self._timeout(field) from None
        elif cached is None:
            try:
                cached = self._compile(gd, key, field, deadline)
            except BaseException as e:
                mine.set_exception(e)
                raise
            finally:
                with self._lock:
                    if cached is not None:
                        self._cache[key] = cached
                        while len(self._cache) > self.cache_size:
                            self._cache.popitem(last=False)
                    del self._inflight[key]
            mine.set_result(cached)
        if isinstance(cached, GuidedDecodingError):
            raise GuidedDecodingError(cached.field, str(cached))
        return cached

    def _compile(self, gd, key: tuple, field: str, deadline: float) -> CompiledConstraint | GuidedDecodingError:
        """The result to cache (a constraint or the error it deserves); raises what must not be cached."""
        if self.sandbox is None:
            return self._build_here(_convert_and_build, (self.lltokenizer, gd, self.limits, self._executor),
                                    field, deadline)
        request = {"constraint": constraint_data(gd), "limits": _limits_data(self.limits)}
        try:
            reply = self.sandbox.run(request, deadline)
        except SandboxTimeout as e:
            if e.queued:  # not cached, and not the constraint's fault: the server was busy compiling others
                raise GuidedDecodingError(field, f"not compiled: all {self.sandbox.size} grammar compile workers "
                                                 f"stayed busy for the whole {self.compile_timeout_s:g} s limit; "
                                                 "retry later") from None
            raise self._timeout(field) from None
        except SandboxCrashed as e:
            logger.warning("%s: a compile worker crashed (%s) on a constraint of %d characters", field, e, len(key[1]))
            error = GuidedDecodingError(field, f"the grammar engine crashed compiling it ({e}): the constraint is "
                                               "too large or too deeply nested for it; simplify it")
            if not e.deterministic:  # e.g. the OOM killer: not cached, it may be the load
                raise error from None
            return error
        if isinstance(reply.get("error"), str):
            reported = reply.get("field")
            return GuidedDecodingError(reported if isinstance(reported, str) and reported else field, reply["error"])
        grammar, build_s = reply.get("grammar"), reply.get("build_s")
        if not isinstance(grammar, str) or not isinstance(build_s, (int, float)):
            raise RuntimeError(f"guided decoding: a compile worker sent an unexpected reply: {str(reply)[:200]}")
        if build_s >= deadline - time.monotonic():  # building it here would overrun the limit
            raise self._timeout(field)
        return self._build_here(build_constraint, (self.lltokenizer, grammar, field, self.limits, self._executor),
                                field, deadline)

    def _build_here(self, fn, args, field: str, deadline: float):
        future = _builders().submit(fn, *args)
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:  # not cached: the time depends on load; the build finishes on its own
            raise self._timeout(field) from None

    def _timeout(self, field: str) -> GuidedDecodingError:
        return GuidedDecodingError(field, f"compiling the constraint took longer than {self.compile_timeout_s:g} s; "
                                          "simplify it")


def _convert_and_build(lltokenizer, gd, limits, executor) -> CompiledConstraint | GuidedDecodingError:
    """The whole compile in one call (what a worker does, and what runs here without workers)."""
    try:
        field, grammar = grammar_source(gd)
    except GuidedDecodingError as e:
        return e
    return build_constraint(lltokenizer, grammar, field, limits, executor)
