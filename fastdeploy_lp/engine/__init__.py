"""Requests, slot scheduling, the model runner, the sampler, the engine loop and the offline `LLM`."""

from .engine import LLMEngine
from .llm import LLM
from .request import CompletionOutput, FinishReason, Logprob, RequestOutput

__all__ = ["LLM", "CompletionOutput", "FinishReason", "LLMEngine", "Logprob", "RequestOutput"]
