"""The Llama-family decoder in Paddle and its Hugging Face checkpoint loader."""

from fastdeploy_lp.model_config import UnsupportedCheckpointError
from fastdeploy_lp.model.decoder import DecoderForCausalLM
from fastdeploy_lp.model.layers import AttentionBatch, SequenceGroup
from fastdeploy_lp.model.loader import expected_tensors, load_model, save_pretrained

__all__ = ["AttentionBatch", "SequenceGroup", "DecoderForCausalLM", "UnsupportedCheckpointError", "expected_tensors",
           "load_model", "save_pretrained"]
