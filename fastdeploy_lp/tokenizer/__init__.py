"""Tokenizers (`tokenizer.json` / `tokenizer.model`), chat templates and incremental detokenization."""

from fastdeploy_lp.tokenizer.chat_template import ChatTemplate
from fastdeploy_lp.tokenizer.detokenizer import IncrementalDetokenizer
from fastdeploy_lp.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "Tokenizer"]
