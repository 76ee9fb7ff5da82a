"""`from fastdeploy_lp.openai.logits_processor import LogitsProcessor`, FastDeploy's import path."""

from fastdeploy_lp.processors.base import LogitsProcessor, LogitsProcessorArgs

__all__ = ["LogitsProcessor", "LogitsProcessorArgs"]
