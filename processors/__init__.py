"""Logits processors: the base class, the registry of built-ins, and the per-step pipeline."""

from fastdeploy_lp.processors.base import (SHARE_INPUTS_VERSION, AddedRequest, BatchUpdate, LogitsProcessor,
                                           LogitsProcessorArgs, RequestFailures, ShareInputs, active_slots)
from fastdeploy_lp.processors.batch_state import BatchTracker, RowEntries
from fastdeploy_lp.processors.context import EngineContext, build_processor
from fastdeploy_lp.processors.pipeline import LogitsProcessorPipeline
from fastdeploy_lp.processors.registry import BUILTIN_PROCESSORS, ProcessorLoadError, resolve_processors

__all__ = ["BUILTIN_PROCESSORS", "SHARE_INPUTS_VERSION", "AddedRequest", "BatchTracker", "BatchUpdate",
           "EngineContext", "LogitsProcessor", "LogitsProcessorArgs", "LogitsProcessorPipeline",
           "ProcessorLoadError", "RequestFailures", "RowEntries", "ShareInputs", "active_slots", "build_processor",
           "resolve_processors"]
