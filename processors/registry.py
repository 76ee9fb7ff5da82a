"""Turning `--logits-processors` names into processor classes.

A bare name is a built-in; `pkg.module:ClassName` is imported. Only the operator's start-up
configuration names code: requests can switch registered processors on, never load new ones.
"""

from __future__ import annotations

import importlib
import inspect

from fastdeploy_lp.processors.base import LogitsProcessor

BUILTIN_PROCESSORS: dict[str, str] = {
    "LogitBiasLogitsProcessor": "fastdeploy_lp.processors.builtin.logit_bias",
    "BadWordsLogitsProcessor": "fastdeploy_lp.processors.builtin.bad_words",
    "NoRepeatNGramLogitsProcessor": "fastdeploy_lp.processors.builtin.no_repeat_ngram",
    "AllowedTokenIdsLogitsProcessor": "fastdeploy_lp.processors.builtin.allowed_token_ids",
    "ThinkingBudgetLogitsProcessor": "fastdeploy_lp.processors.builtin.thinking_budget",
    "ToolExecutionLogitsProcessor": "fastdeploy_lp.processors.builtin.tool_execution",
}

# `SamplingParams` fields that are applied by a built-in processor (the one named), in this order,
# in a stage of their own (engine/stages.py); the request's value reads as that processor's key of the same name.
SAMPLING_PARAMS_PROCESSORS: dict[str, str] = {
    "logit_bias": "LogitBiasLogitsProcessor",
    "bad_words": "BadWordsLogitsProcessor",
}


class ProcessorLoadError(ValueError):
    """A `--logits-processors` entry that cannot be used; the message says what to change."""


def _fail(name: str, why: str) -> ProcessorLoadError:
    return ProcessorLoadError(f"logits_processors: cannot load {name!r}: {why}. Built-in processors: "
                              f"{', '.join(BUILTIN_PROCESSORS)}; custom ones are given as "
                              "'package.module:ClassName'.")


def resolve_processor(name: str) -> type[LogitsProcessor]:
    if not isinstance(name, str) or not name.strip():
        raise _fail(str(name), "not a name")
    name = name.strip()
    if name in BUILTIN_PROCESSORS:
        module_name, attr = BUILTIN_PROCESSORS[name], name
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        if not module_name or not attr.isidentifier():
            raise _fail(name, "expected 'package.module:ClassName'")
    else:
        raise _fail(name, "unknown built-in")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail in any way; report it at start-up
        raise _fail(name, f"importing {module_name!r} failed ({type(e).__name__}: {e})") from e
    cls = getattr(module, attr, None)
    if cls is None:
        raise _fail(name, f"module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise _fail(name, "not a subclass of fastdeploy_lp.processors.LogitsProcessor")
    if inspect.isabstract(cls):
        raise _fail(name, f"it does not implement {', '.join(sorted(cls.__abstractmethods__))}")
    if cls.uses_engine_context and not _takes_context(cls):
        # Typically a subclass of a built-in that needs the tokenizer, written for the old
        # `cls(fd_config)`: without this it would fail later with a bare TypeError.
        raise _fail(name, "it sets uses_engine_context (or inherits it) but its __init__ does not take "
                          "(fd_config, context); take the context and pass it to super().__init__")
    return cls


def _takes_context(cls: type[LogitsProcessor]) -> bool:
    try:
        inspect.signature(cls).bind(None, None)
    except TypeError:
        return False
    return True


def resolve_processors(names: list[str]) -> list[type[LogitsProcessor]]:
    classes = []
    for name in names:
        cls = resolve_processor(name)
        if cls in classes:
            raise _fail(name, "registered twice")
        classes.append(cls)
    return classes
