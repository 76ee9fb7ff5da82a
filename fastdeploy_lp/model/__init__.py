"""The Llama-family decoder in Paddle and its Hugging Face checkpoint loader."""

from .decoder import DecoderForCausalLM
from .layers import AttentionBatch, SequenceGroup
from .loader import load_model, save_pretrained

__all__ = ["AttentionBatch", "SequenceGroup", "DecoderForCausalLM", "load_model", "save_pretrained"]
