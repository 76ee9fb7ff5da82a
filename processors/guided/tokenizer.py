"""The engine's `Tokenizer` as an llguidance `LLTokenizer`, built once per engine.

llguidance needs each token id's bytes (`Tokenizer.token_bytes`: byte-level BPE stand-ins decoded,
sentencepiece `▁` as a space and `<0xNN>` pieces as that byte), the special ids (which no grammar
text can produce) and the EOS ids (allowed when the grammar is complete). The vocabulary is padded
with empty tokens to the model's logits width, so padded ids are never allowed.

The tokenize callback is only used for forced-token fast-forward (`LLMatcher.compute_ff_tokens`);
it drops the dummy-prefix space sentencepiece puts before text.

Compile workers (`sandbox.py`) get the same vocabulary as plain data (`lltokenizer_spec`) and build
their `LLTokenizer` from it (`lltokenizer_from_spec`) without the engine's tokenizer: masks depend
only on each id's bytes, and a worker's forced tokens only need to spell the forced bytes.
"""

from __future__ import annotations

import llguidance as llg


class _EngineTokenizer:
    """The attributes `llguidance.TokenizerWrapper` reads, over the engine's tokenizer."""

    def __init__(self, tokenizer, width: int, eos_token_ids: list[int]):
        self._tokenizer = tokenizer
        self.tokens, self.bos_token_id, self.special_token_ids = _vocabulary(tokenizer, width, eos_token_ids)
        self.eos_token_id = eos_token_ids[0]
        self._by_bytes: dict[bytes, int] = {}
        special = set(self.special_token_ids)
        for i, b in enumerate(self.tokens):  # the padding is b"": never looked up
            if b and i not in special:
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
    return _lltokenizer(_EngineTokenizer(tokenizer, _width(tokenizer, width, eos_token_ids), eos_token_ids),
                        eos_token_ids)


def lltokenizer_spec(tokenizer, width: int, eos_token_ids: list[int]) -> dict:
    """What `lltokenizer_from_spec` needs to build the same vocabulary in another process (plain data)."""
    tokens, bos, special = _vocabulary(tokenizer, _width(tokenizer, width, eos_token_ids), eos_token_ids)
    return {"tokens": tokens, "eos_token_ids": list(eos_token_ids), "bos_token_id": bos, "special_token_ids": special}


def lltokenizer_from_spec(spec: dict) -> llg.LLTokenizer:
    """An `LLTokenizer` with the vocabulary of `spec` that tokenizes greedily (see the module docstring)."""
    greedy = _GreedyTokenizer(spec)
    greedy.lltokenizer = _lltokenizer(greedy, spec["eos_token_ids"])
    return greedy.lltokenizer


class _GreedyTokenizer:
    def __init__(self, spec: dict):
        self.tokens = list(spec["tokens"])
        self.eos_token_id = spec["eos_token_ids"][0]
        self.bos_token_id = spec["bos_token_id"]
        self.special_token_ids = list(spec["special_token_ids"])
        self.lltokenizer: llg.LLTokenizer | None = None

    def __call__(self, text) -> list[int]:
        if self.lltokenizer is None:  # TokenizerWrapper's probe while the LLTokenizer is being built
            return []
        data = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self.lltokenizer.greedy_tokenize(data)


def _vocabulary(tokenizer, width: int, eos_token_ids: list[int]) -> tuple[list[bytes], int | None, list[int]]:
    """(each id's bytes padded with b"" to `width`, the BOS id, the special ids incl. EOS)."""
    raw = list(tokenizer.token_bytes)
    tokens = raw + [b""] * max(0, width - len(raw))
    return tokens, tokenizer.bos_token_id, sorted(set(tokenizer.special_token_ids) | set(eos_token_ids))


def _width(tokenizer, width: int, eos_token_ids: list[int]) -> int:
    if not eos_token_ids:
        raise ValueError("guided decoding needs the model's EOS token id (config.json eos_token_id)")
    return max(width, tokenizer.vocab_size)


def _lltokenizer(source, eos_token_ids: list[int]) -> llg.LLTokenizer:
    return llg.LLTokenizer(llg.TokenizerWrapper(source), n_vocab=len(source.tokens), eos_token=list(eos_token_ids))
