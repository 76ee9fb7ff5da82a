"""One tokenizer interface over `tokenizer.json` (Hugging Face `tokenizers`) and `tokenizer.model`
(`sentencepiece`), with the checkpoint's chat template."""

from __future__ import annotations

import json
import os
import re
from functools import cached_property
from typing import Any

from fastdeploy_lp import gguf_file
from fastdeploy_lp.tokenizer import gguf_vocab
from fastdeploy_lp.tokenizer.chat_template import ChatTemplate
from fastdeploy_lp.tokenizer.text import check_text

# transformers >= 5 builds the Qwen2 tokenizer's pre-tokenizer in code (digits one by one, a space
# before a number kept apart) whatever `tokenizer.json` says; we do the same so ids match it.
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
_CODE_DEFINED_PRETOKENIZERS = {"qwen2": _QWEN2_SPLIT, "qwen3": _QWEN2_SPLIT}


ENCODE_SLICE = 1 << 16  # characters encoded at a time when a prompt may be far over the limit
SLACK_PER_CUT = 32  # tokens a cut between slices may add (a special token's text split in two)


class Tokenizer:
    """`encode`/`decode` text, render chats, and expose the vocabulary as bytes (for grammars)."""

    def __init__(self, model_dir: str):
        """The tokenizer of a Hugging Face directory, or of a GGUF file (`gguf_vocab`)."""
        self.model_dir = model_dir
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        self.config: dict[str, Any] = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                self.config = json.load(f)
        json_path = os.path.join(model_dir, "tokenizer.json")
        sp_path = os.path.join(model_dir, "tokenizer.model")
        gguf_files = gguf_file.gguf_files(model_dir)
        if gguf_files is not None:
            built, self.config = gguf_vocab.build(gguf_file.open_model(gguf_files))
            self._hf, self._sp = (None, built) if hasattr(built, "piece_to_id") else (built, None)
            self.vocab_size = self._sp.get_piece_size() if self._sp else self._hf.get_vocab_size(with_added_tokens=True)
        elif os.path.isfile(json_path):
            from tokenizers import Tokenizer as HFTokenizer

            self._hf = HFTokenizer.from_file(json_path)
            _apply_code_defined_pretokenizer(self._hf, _model_type(model_dir))
            self._sp = None
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        elif os.path.isfile(sp_path):
            import sentencepiece as spm

            self._hf = None
            self._sp = spm.SentencePieceProcessor(model_file=sp_path)
            self.vocab_size = self._sp.get_piece_size()
        else:
            raise FileNotFoundError(f"model: no tokenizer.json or tokenizer.model in {model_dir!r}")
        self.chat_template = ChatTemplate.from_model_dir(model_dir, self.config)
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))

    # -- ids ------------------------------------------------------------------------------------
    def token_to_id(self, token: str) -> int | None:
        if self._hf is not None:
            return self._hf.token_to_id(token)
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` as stored (`Ġthe`, `▁the`), not its decoded text."""
        if self._hf is not None:
            return self._hf.id_to_token(token_id) or ""
        return self._sp.id_to_piece(token_id)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token) if self.bos_token else None

    @cached_property
    def special_token_ids(self) -> set[int]:
        if self._hf is not None:
            return {i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}
        sp = self._sp
        return {i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i)}

    # -- text -----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False, limit: int | None = None) -> list[int]:
        """Token ids of `text`. Special-token strings in the text (`<|im_end|>`) map to their ids.

        Text that is not valid Unicode (a lone surrogate) is a `ValueError` naming the prompt: the
        engine encodes prompts with this, and every other text is checked where it enters. With
        `limit`, a text certainly longer than `limit` tokens is a `ValueError` found by encoding only
        as much of it as it takes: a server must not spend seconds encoding 8 MB it will refuse."""
        check_text(text, "prompt")
        if limit is not None and len(text) > max(ENCODE_SLICE, 8 * limit):  # a text that fits is encoded once
            self._check_within(text, limit)
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._hf is not None:
            return self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._encode_sentencepiece(text)
        if add_special_tokens and self.config.get("add_bos_token", True) and self._sp.bos_id() >= 0:
            ids = [self._sp.bos_id()] + ids
        return ids

    def _check_within(self, text: str, limit: int) -> None:
        """Encode `text` a slice at a time; raise once the count is over `limit` by more than what
        the cuts may have added (a word or a special token split in two: a few tokens per cut)."""
        count = 0
        for cuts, start in enumerate(range(0, len(text), ENCODE_SLICE)):
            piece = text[start:start + ENCODE_SLICE]
            count += len(self._encode(piece, add_special_tokens=False))
            if count > limit + SLACK_PER_CUT * cuts:
                raise ValueError(f"prompt: is longer than max_model_len={limit} tokens "
                                 f"(over {count - SLACK_PER_CUT * cuts} in its first {start + len(piece)} characters)")

    @cached_property
    def _special_pattern(self) -> re.Pattern | None:
        """The special-token texts, longest first (so the longest match wins, as in transformers)."""
        specials = sorted((self._sp.id_to_piece(i) for i in self.special_token_ids if not self._sp.is_unknown(i)),
                          key=len, reverse=True)
        specials = [s for s in specials if s]
        return re.compile("|".join(map(re.escape, specials))) if specials else None

    def _encode_sentencepiece(self, text: str) -> list[int]:
        # sentencepiece never maps control-symbol text to its id, so split on them first, in one
        # pass over the text (a chat of 20,000 turns has 40,000 of them).
        if self._special_pattern is None:
            return self._sp.encode(text)
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            if match.start() > start:
                ids += self._sp.encode(text[start:match.start()])
            ids.append(self._sp.piece_to_id(match.group()))
            start = match.end()
        if start < len(text):
            ids += self._sp.encode(text[start:])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
        if not skip_special_tokens:
            pieces, run = [], []
            for i in ids:
                if i in self.special_token_ids:
                    pieces += [self._sp.decode(run), self._sp.id_to_piece(i)]
                    run = []
                else:
                    run.append(i)
            return "".join(pieces + [self._sp.decode(run)])
        return self._sp.decode([i for i in ids if i not in self.special_token_ids])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         **kwargs)

    # -- vocabulary as bytes (grammar engines need it) -------------------------------------------
    @cached_property
    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for when it appears in the middle of a text."""
        if self._hf is not None:
            return _hf_token_bytes(self._hf, self.vocab_size)
        out = []
        for i in range(self.vocab_size):
            piece = self._sp.id_to_piece(i)
            if self._sp.is_byte(i):
                out.append(bytes([int(piece[3:5], 16)]))
            elif self._sp.is_control(i) or self._sp.is_unknown(i):
                out.append(piece.encode("utf-8"))
            else:
                out.append(piece.replace("\u2581", " ").encode("utf-8"))
        return out


def _model_type(model_dir: str) -> str | None:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("model_type")


def _apply_code_defined_pretokenizer(hf, model_type: str | None) -> None:
    pattern = _CODE_DEFINED_PRETOKENIZERS.get(model_type or "")
    if pattern is None:
        return
    from tokenizers import Regex, pre_tokenizers

    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _token_text(token) -> str | None:
    if isinstance(token, dict):  # older configs store AddedToken dicts
        return token.get("content")
    return token


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _hf_token_bytes(hf, vocab_size: int) -> list[bytes]:
    added = {i: t.content for i, t in hf.get_added_tokens_decoder().items()}
    byte_level = "ByteLevel" in json.dumps(json.loads(hf.to_str()).get("decoder") or {})
    table = _bytes_to_unicode()
    out = []
    for i in range(vocab_size):
        tok = hf.id_to_token(i)
        if tok is None:
            out.append(b"")
        elif i in added:
            out.append(added[i].encode("utf-8"))
        elif byte_level:
            out.append(bytes(table[c] for c in tok) if all(c in table for c in tok) else tok.encode("utf-8"))
        elif tok.startswith("<0x") and tok.endswith(">") and len(tok) == 6:
            out.append(bytes([int(tok[3:5], 16)]))
        else:
            out.append(tok.replace("\u2581", " ").encode("utf-8"))
    return out
