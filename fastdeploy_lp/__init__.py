"""fastdeploy_lp: a Paddle LLM inference engine whose sampling path is a registered pipeline of
logits processors, with an OpenAI-compatible server and an offline API."""

from fastdeploy_lp._source_tree import find_top_level_folders

find_top_level_folders()
from fastdeploy_lp.config import FDConfig, ModelConfig
from fastdeploy_lp.engine import LLM, LLMEngine, RequestOutput
from fastdeploy_lp.model.lora import LoRARequest
from fastdeploy_lp.sampling_params import GuidedDecodingParams, SamplingParams

__all__ = ["FDConfig", "GuidedDecodingParams", "LLM", "LLMEngine", "LoRARequest", "ModelConfig", "RequestOutput",
           "SamplingParams"]
__version__ = "0.1.0"
