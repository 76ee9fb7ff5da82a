"""Requests, slot scheduling, the model runner, the sampler, the engine loop and the offline `LLM`."""

from fastdeploy_lp.engine.engine import LLMEngine
from fastdeploy_lp.engine.llm import LLM
from fastdeploy_lp.engine.request import CompletionOutput, FinishReason, Logprob, RequestOutput

__all__ = ["LLM", "CompletionOutput", "FinishReason", "LLMEngine", "Logprob", "RequestOutput"]
