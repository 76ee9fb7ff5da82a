"""`from fastdeploy_lp.openai.logits_processor import LogitsProcessor`, FastDeploy's import path."""

from fastdeploy_lp.processors.base import (SHARE_INPUTS_VERSION, BatchUpdate, LogitsProcessor, LogitsProcessorArgs,
                                          ShareInputs)
from fastdeploy_lp.processors.batch_state import BatchTracker

__all__ = ["SHARE_INPUTS_VERSION", "BatchTracker", "BatchUpdate", "LogitsProcessor", "LogitsProcessorArgs",
           "ShareInputs"]
