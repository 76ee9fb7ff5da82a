"""The Llama-family decoder in Paddle and its Hugging Face checkpoint loader."""

from ..config import UnsupportedCheckpointError
from .decoder import DecoderForCausalLM
from .layers import AttentionBatch, SequenceGroup
from .loader import expected_tensors, load_model, save_pretrained

__all__ = ["AttentionBatch", "SequenceGroup", "DecoderForCausalLM", "UnsupportedCheckpointError", "expected_tensors",
           "load_model", "save_pretrained"]
