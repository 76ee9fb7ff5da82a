"""The engine's `Tokenizer` as an llguidance `LLTokenizer`, built once per engine.

llguidance needs each token id's bytes (`Tokenizer.token_bytes`: byte-level BPE stand-ins decoded,
sentencepiece `▁` as a space and `<0xNN>` pieces as that byte), the special ids (which no grammar
text can produce) and the EOS ids (allowed when the grammar is complete). The vocabulary is padded
with empty tokens to the model's logits width, so padded ids are never allowed.

The tokenize callback is only used for forced-token fast-forward (`LLMatcher.compute_ff_tokens`);
it drops the dummy-prefix space sentencepiece puts before text.
"""

from __future__ import annotations

import llguidance as llg


class _EngineTokenizer:
    """The attributes `llguidance.TokenizerWrapper` reads, over the engine's tokenizer."""

    def __init__(self, tokenizer, width: int, eos_token_ids: list[int]):
        self._tokenizer = tokenizer
        raw = list(tokenizer.token_bytes)
        self.tokens = raw + [b""] * max(0, width - len(raw))
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(set(tokenizer.special_token_ids) | set(eos_token_ids))
        self._by_bytes: dict[bytes, int] = {}
        for i, b in enumerate(raw):
            if b and i not in self.special_token_ids:
                self._by_bytes.setdefault(b, i)

    def __call__(self, text) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = self._tokenizer.encode(data.decode("utf-8", errors="replace"))
        if not ids or b"".join(self.tokens[i] for i in ids) == data:
            return ids
        first = self.tokens[ids[0]]
        if first.startswith(b" ") and not data.startswith(b" "):  # sentencepiece's dummy prefix
            return self._spell(first[1:]) + ids[1:]
        return ids

    def _spell(self, data: bytes) -> list[int]:
        """Ids for `data`: one token if the vocabulary has it, else byte by byte (byte fallback)."""
        if not data:
            return []
        if data in self._by_bytes:
            return [self._by_bytes[data]]
        return [self._by_bytes[bytes([b])] for b in data if bytes([b]) in self._by_bytes]


def build_lltokenizer(tokenizer, width: int, eos_token_ids: list[int]) -> llg.LLTokenizer:
    """An `LLTokenizer` over `tokenizer` with `width` ids (the model's logits width) and these EOS ids."""
    if not eos_token_ids:
        raise ValueError("guided decoding needs the model's EOS token id (config.json eos_token_id)")
    width = max(width, tokenizer.vocab_size)
    wrapper = llg.TokenizerWrapper(_EngineTokenizer(tokenizer, width, eos_token_ids))
    return llg.LLTokenizer(wrapper, n_vocab=width, eos_token=list(eos_token_ids))
