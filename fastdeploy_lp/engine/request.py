"""A request's life in the engine, and what the engine hands back (`RequestOutput`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable


from fastdeploy_lp.sampling_params import CLOSED_ON_LENGTH, SamplingParams
from fastdeploy_lp.tokenizer import IncrementalDetokenizer


class FinishReason(str, Enum):
    STOP = "stop"          # EOS, a stop token id, a stop string, or a grammar that ended
    LENGTH = "length"      # max_tokens or the context limit
    ABORT = "abort"        # cancelled by the client
    ERROR = "error"        # a logits processor failed for this request


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the `logprobs` most likely alternatives, token id -> logprob
    rank: int | None = None  # prompt logprobs: 1 + how many tokens were more likely than this one


class PrefixView(Sequence):
    """The first `n` items of an append-only list, without copying them: what an output reports
    of a request's tokens and logprobs, so emitting it each step costs O(1), not O(length)."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int | None = None):
        self._items, self._n = items, len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            return self._items[start:stop:step]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("index out of range")
        return self._items[i]

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == self._n and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return repr(self._items[:self._n])


class CompletionOutput:
    """FastDeploy's shape: `request_output.outputs.text`.

    `token_ids` and `logprobs` are read-only views of everything generated up to this output; `text`
    is joined when read. `delta_text` / `delta_token_ids` are what this output adds. `stop_reason`
    is the stop string that ended the output (vLLM's field; None for EOS, a stop token or a limit),
    which the Anthropic API reports as `stop_sequence`. `closed_on_length` is True when guided
    decoding's close_on_length ended the output at `max_tokens` with a complete JSON document.
    """

    def __init__(self, index: int, text: str | Callable[[], str], token_ids: Sequence[int],
                 finish_reason: str | None, logprobs: Sequence[Logprob] | None = None, error: str | None = None,
                 delta_text: str = "", delta_token_ids: list[int] | None = None, stop_reason: str | None = None,
                 closed_on_length: bool = False):
        self.index = index
        self._text = text
        self.token_ids = token_ids
        self.finish_reason = finish_reason
        self.logprobs = logprobs
        self.error = error
        self.delta_text = delta_text
        self.delta_token_ids = delta_token_ids if delta_token_ids is not None else []
        self.stop_reason = stop_reason
        self.closed_on_length = closed_on_length

    @property
    def text(self) -> str:
        if callable(self._text):
            self._text = self._text()
        return self._text

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids!r}, "
                f"finish_reason={self.finish_reason!r}, error={self.error!r})")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: CompletionOutput
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    # with `prompt_logprobs`: None for the first prompt token, then each next one's Logprob (vLLM's field)
    prompt_logprobs: Sequence[Logprob | None] | None = None

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
    seed: int = 0                       # the draw of output token i depends only on (seed, i): sampler.py
    cached_len: int = 0                 # tokens of prompt + output whose keys/values are in `blocks`
    blocks: list[int] = field(default_factory=list)  # block table: KV blocks in position order
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of the full blocks
    registered: int = 0                 # leading full blocks made findable in the prefix cache
    admission: int = 0                  # admission order (the most recent is preempted first)
    active: bool = False                # in share_inputs: prompt computed, generating
    resumed: bool = False               # preempted at least once
    forced_queue: list[int] = field(default_factory=list)  # forced tokens not appended yet (fast-forward off)
    prompt_logprobs: list[Logprob | None] | None = None  # with params.prompt_logprobs: filled in prompt order
    _reported_tokens: int = 0

    def __post_init__(self):
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no context to be scored in

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens `[start, end)` of prompt + output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - n):end - n]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_output(self, detokenize: bool = True) -> RequestOutput:
        """This step's output. `detokenize=False` (for a request failed because its detokenizer
        raised) reports the tokens and the error without text."""
        new_ids = self.output_ids[self._reported_tokens:]
        self._reported_tokens = len(self.output_ids)
        detokenizer = self.detokenizer
        delta = detokenizer.take_delta(final=self.finished) if detokenize else ""
        released = detokenizer.released_length if detokenize else 0
        out = CompletionOutput(
            index=self.index, text=(lambda: detokenizer.released_text[:released]) if detokenize else "",
            token_ids=PrefixView(self.output_ids),
            finish_reason=self.finish_reason.value if self.finish_reason else None,
            logprobs=PrefixView(self.logprobs) if self.params.logprobs is not None else None,
            error=self.error, delta_text=delta, delta_token_ids=new_ids,
            stop_reason=detokenizer.stopped_on if detokenize else None,
            closed_on_length=self.finish_reason == FinishReason.LENGTH
            and self.request_id in self.params.extra.get(CLOSED_ON_LENGTH, ()))
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, out, self.finished, metrics,
                             None if self.prompt_logprobs is None else PrefixView(self.prompt_logprobs))
