"""POST /tokenize and POST /detokenize: the token ids the engine would see for a prompt or a chat,
found by the same calls the generation endpoints make, so `count` is their `prompt_tokens`."""

from __future__ import annotations

from fastdeploy_lp.entrypoints.openai.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from fastdeploy_lp.entrypoints.openai.serving_chat import chat_prompt
from fastdeploy_lp.tokenizer.tokenizer import Tokenizer


def tokenize(tokenizer: Tokenizer, req: TokenizeRequest, max_model_len: int) -> dict:
    """`{"count", "max_model_len", "tokens"}` (+ `token_strs` when asked). Raises ValueError("field: ...")."""
    if req.prompt is not None:  # /v1/completions encodes a text prompt with the special tokens
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        ids, _ = chat_prompt(tokenizer, req.messages, req.tools, add_generation_prompt=req.add_generation_prompt,
                             chat_template_kwargs=req.chat_template_kwargs,
                             add_special_tokens=bool(req.add_special_tokens))
    out = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
    return out


def detokenize(tokenizer: Tokenizer, req: DetokenizeRequest) -> dict:
    """`{"prompt"}`: the ids' text with special tokens kept. Raises ValueError naming the first bad id."""
    vocab = tokenizer.vocab_size
    for i, token in enumerate(req.tokens):
        if not 0 <= token < vocab:
            raise ValueError(f"tokens[{i}]: {token} is not a token id of this model (ids run from 0 to {vocab - 1})")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}
