"""Incremental detokenization with stop strings.

Decoding one token at a time is wrong for byte-level and byte-fallback vocabularies (a Chinese
character or an emoji can span several tokens) and for sentencepiece (a piece's leading space
depends on what came before). `IncrementalDetokenizer` decodes a short sliding window, the way
vLLM does, and releases text only once it no longer ends in a partial character.
"""

from __future__ import annotations

from fastdeploy_lp.tokenizer.tokenizer import Tokenizer

_CONTEXT = 6  # prompt tokens kept as left context so the first output piece decodes as in the middle


class IncrementalDetokenizer:
    """Text of one request's output, released as it becomes certain.

    Each step costs the new token's work, not the output's length: released text is kept as
    pieces (joined only when read), and stop strings are searched in the unreleased tail, which
    always holds the last `len(longest stop) - 1` characters.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._released: list[str] = []   # text handed out, in pieces
        self._released_len = 0
        self._joined = ""                 # cache of "".join(self._released)
        self._pending = ""                # decoded text not handed out yet
        self.stopped_on: str | None = None

    def add(self, token_id: int) -> None:
        """Feed one generated token; may find a stop string (then `stopped_on` is set)."""
        self._ids.append(int(token_id))
        before, after = self._decode_window()
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return  # a multi-byte character is not complete yet
        self._release(after[len(before):])

    def finish(self) -> None:
        """The request ended: release what is still held back, incomplete characters included
        (as U+FFFD, the way `decode` of the whole output shows them)."""
        if self.stopped_on is not None or self._read == len(self._ids):
            return
        before, after = self._decode_window()
        self._release(after[len(before):])

    def _decode_window(self) -> tuple[str, str]:
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        return (decode(self._ids[self._prefix:self._read], skip_special_tokens=skip),
                decode(self._ids[self._prefix:], skip_special_tokens=skip))

    def _release(self, new: str) -> None:
        self._prefix, self._read = self._read, len(self._ids)
        if self.stopped_on is not None:
            return
        start = max(0, len(self._pending) - self._hold)
        self._pending += new
        found = [(at, s) for s in self.stop if (at := self._pending.find(s, start)) >= 0]
        if found:
            at, self.stopped_on = min(found)
            self._pending = self._pending[:at + (len(self.stopped_on) if self.include_stop else 0)]

    @property
    def text(self) -> str:
        """All text decoded so far (the stop string cut off once found)."""
        return self.released_text + self._pending

    @property
    def released_text(self) -> str:
        if len(self._joined) != self._released_len:
            self._joined = "".join(self._released)
            self._released = [self._joined]
        return self._joined

    @property
    def released_length(self) -> int:
        return self._released_len

    def take_delta(self, final: bool) -> str:
        """Text not handed out yet. While running, keep back a tail that could start a stop string."""
        if final:
            self.finish()
        keep = 0 if final or self.stopped_on is not None else self._hold
        cut = max(0, len(self._pending) - keep)
        delta, self._pending = self._pending[:cut], self._pending[cut:]
        if delta:
            self._released.append(delta)
            self._released_len += len(delta)
        return delta
