"""Guided decoding with llguidance: JSON schema, regex, choice, grammars, structural tags, tool calls."""

from .tool_calls import parse_tool_calls, tool_call_constraint

__all__ = ["parse_tool_calls", "tool_call_constraint"]
