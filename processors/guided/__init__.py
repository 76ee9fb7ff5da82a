"""Guided decoding with llguidance: JSON schema, regex, choice, grammars, structural tags, tool calls.

See docs/guided_decoding.md. `GuidedDecodingLogitsProcessor` is installed by the engine; the
server maps request fields to `GuidedDecodingParams` and tools to `tool_call_constraint`.
"""

from fastdeploy_lp.processors.guided.compiler import GrammarCompiler, GuidedDecodingError
from fastdeploy_lp.processors.guided.processor import GuidedDecodingLogitsProcessor
from fastdeploy_lp.processors.guided.tool_calls import tool_call_constraint

__all__ = ["GrammarCompiler", "GuidedDecodingError", "GuidedDecodingLogitsProcessor", "tool_call_constraint"]
