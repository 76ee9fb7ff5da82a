"""Logits processors: the base class, the registry of built-ins, and the per-step pipeline."""

from .base import (SHARE_INPUTS_VERSION, AddedRequest, BatchUpdate, LogitsProcessor, LogitsProcessorArgs,
                   RequestFailures, ShareInputs, active_slots)
from .batch_state import BatchTracker, RowEntries
from .pipeline import LogitsProcessorPipeline
from .registry import BUILTIN_PROCESSORS, ProcessorLoadError, resolve_processors

__all__ = ["BUILTIN_PROCESSORS", "SHARE_INPUTS_VERSION", "AddedRequest", "BatchTracker", "BatchUpdate",
           "LogitsProcessor", "LogitsProcessorArgs", "LogitsProcessorPipeline", "ProcessorLoadError",
           "RequestFailures", "RowEntries", "ShareInputs", "active_slots", "resolve_processors"]
