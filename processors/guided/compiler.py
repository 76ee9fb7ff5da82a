"""`GuidedDecodingParams` → a compiled llguidance matcher template: checked, cached, time-limited.

Compiling happens on the caller's thread at admission (`validate_request`), so every problem is a
`GuidedDecodingError` (a `ValueError` whose message starts with the request field) before the
request reaches a slot. What a constraint means (its grammar, the matcher, its first steps, its
errors) is `constraint.py`; this module decides where that work runs and keeps its results.

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

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance as llg

from fastdeploy_lp import envs
# The constraint model lived here before it moved below the sandbox (constraint.py, grammar_text.py);
# its names stay importable from this module, where code outside the package found them.
from fastdeploy_lp.processors.guided.constraint import (FIELDS, MAX_CONSTRAINT_CHARS, CompiledConstraint,
                                                        GuidedDecodingError, PlainConstraint, allows_other_than,
                                                        build_constraint, choice_grammar, constraint_data, dead_end,
                                                        grammar_source, request_key)
from fastdeploy_lp.processors.guided.grammar_text import clean_error, is_gbnf
from fastdeploy_lp.processors.guided.sandbox import CompileSandbox, SandboxCrashed, SandboxTimeout
from fastdeploy_lp.processors.processor_thread import run_to_future

__all__ = ["BUILD_STACK_BYTES", "FIELDS", "MAX_CONSTRAINT_CHARS", "CompiledConstraint", "GrammarCompiler",
           "GuidedDecodingError", "PlainConstraint", "allows_other_than", "build_constraint", "choice_grammar",
           "clean_error", "constraint_data", "dead_end", "default_compile_timeout_s", "grammar_source", "is_gbnf",
           "request_key"]

logger = logging.getLogger(__name__)

BUILD_STACK_BYTES = 32 << 20  # in-process builds: 4x a compile worker's stack (sandbox.WORKER_STACK_BYTES)


def default_compile_timeout_s() -> float:
    """The time limit of preparing one request's constraint (custom backends' hooks too)."""
    return envs.get_float("FDLP_GUIDED_COMPILE_TIMEOUT_S")


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
            task = self._tasks.get()
            run_to_future(*task)
            del task  # do not keep the last matcher alive until the next task


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
    `workers` (env FDLP_GUIDED_COMPILE_WORKERS, `fastdeploy_lp.envs`) is the size of the worker pool,
    which compilers with the same vocabulary share. With `workers=0` or no spec, everything is
    compiled in this process, on a large-stack thread abandoned at the time limit: no isolation."""

    def __init__(self, lltokenizer: llg.LLTokenizer, cache_size: int | None = None,
                 compile_timeout_s: float | None = None, limits: llg.LLParserLimits | None = None,
                 tokenizer_spec: dict | None = None, workers: int | None = None):
        self.lltokenizer = lltokenizer
        self.cache_size = cache_size or envs.get_int("FDLP_GUIDED_CACHE_SIZE")
        self.compile_timeout_s = compile_timeout_s or default_compile_timeout_s()
        self.limits = limits
        if workers is None:
            workers = envs.get_int("FDLP_GUIDED_COMPILE_WORKERS")
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
