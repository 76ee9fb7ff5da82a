"""A request's life in the engine, and what the engine hands back (`RequestOutput`)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from ..sampling_params import SamplingParams
from ..tokenizer import IncrementalDetokenizer


class FinishReason(str, Enum):
    STOP = "stop"          # EOS, a stop token id, a stop string, or a grammar that ended
    LENGTH = "length"      # max_tokens or the context limit
    ABORT = "abort"        # cancelled by the client
    ERROR = "error"        # a logits processor failed for this request
    TOOL_CALLS = "tool_calls"


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the `logprobs` most likely alternatives, token id -> logprob


@dataclass
class CompletionOutput:
    """FastDeploy's shape: `request_output.outputs.text`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Logprob] | None = None
    error: str | None = None
    delta_text: str = ""            # text produced since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: CompletionOutput
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    args: dict
    prompt: str | None = None
    group_id: str = ""                  # the id the caller gave; shared by the `n` choices
    index: int = 0                      # which of the `n` choices this is
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    slot: int | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    rng: np.random.Generator | None = None  # per-request stream, so a seed is batch-independent
    bad_word_ids: list[list[int]] = field(default_factory=list)  # SamplingParams.bad_words, tokenized
    cached_len: int = 0                 # tokens of prompt + output whose keys/values are in the slot cache
    pending_forced: deque = field(default_factory=deque)  # tokens processors declared certain
    _reported_tokens: int = 0

    def recent_tokens(self, n: int) -> list[int]:
        """The last `n` tokens of prompt + output, without copying either whole."""
        if n <= 0:
            return []
        tail = self.output_ids[-n:]
        return self.prompt_ids[max(0, len(self.prompt_ids) - (n - len(tail))):] + tail if len(tail) < n else tail

    @property
    def max_bad_word_len(self) -> int:
        return max((len(s) for s in self.bad_word_ids), default=1)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_output(self) -> RequestOutput:
        new_ids = self.output_ids[self._reported_tokens:]
        self._reported_tokens = len(self.output_ids)
        delta = self.detokenizer.take_delta(final=self.finished)
        out = CompletionOutput(
            index=self.index, text=self.detokenizer.released_text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason.value if self.finish_reason else None,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            error=self.error, delta_text=delta, delta_token_ids=new_ids)
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, out, self.finished, metrics)
