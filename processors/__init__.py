"""Logits processors: the base class, the registry of built-ins, and the per-step pipeline."""

from .base import LogitsProcessor, LogitsProcessorArgs
from .pipeline import LogitsProcessorPipeline
from .registry import BUILTIN_PROCESSORS, ProcessorLoadError, resolve_processors

__all__ = ["BUILTIN_PROCESSORS", "LogitsProcessor", "LogitsProcessorArgs", "LogitsProcessorPipeline",
           "ProcessorLoadError", "resolve_processors"]
