"""What a user asks of one generation: `SamplingParams` and `GuidedDecodingParams`.

Both validate in their constructors and raise `ValueError` naming the field, so a bad value is
caught where it enters (the offline call or the HTTP request), never in the engine loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class GuidedDecodingParams:
    """One output constraint; exactly one field is set."""

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self):
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError("guided_decoding: exactly one of json, json_object, regex, choice, grammar, "
                             f"structural_tag must be set, got {kinds or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("guided_choice: must be a non-empty list of strings")

    def kinds(self) -> list[str]:
        return [f.name for f in fields(self) if f.name != "whitespace_pattern"
                and getattr(self, f.name) not in (None, False)]


@dataclass
class SamplingParams:
    """Sampling controls for one request, as in vLLM and FastDeploy.

    `temperature=0` is greedy. `seed` makes sampling reproducible for this request whatever else
    shares the batch. `logits_processors_args` is the JSON object the registered logits processors
    read (e.g. `{"logit_bias": {"128": 5.0}}`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    seed: int | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    logits_processors_args: dict[str, Any] | None = None
    guided_decoding: GuidedDecodingParams | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # engine-internal per-request data

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        _check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1", self.n)
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1, 0 (off) or a positive integer", self.top_k)
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "must be > 0",
               self.repetition_penalty)
        _check(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
               "must be in [-2, 2]", self.frequency_penalty)
        _check(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
               "must be in [-2, 2]", self.presence_penalty)
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1), "max_tokens",
               "must be a positive integer", self.max_tokens)
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               "must not exceed max_tokens", self.min_tokens)
        _check(all(isinstance(s, str) for s in self.stop), "stop", "must be a string or a list of strings", self.stop)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer", self.seed)
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs",
               "must be an integer in 0..20", self.logprobs)
        _check(self.logits_processors_args is None or isinstance(self.logits_processors_args, dict),
               "logits_processors_args", "must be a JSON object", self.logits_processors_args)
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise ValueError(f"logit_bias: must map token ids to numbers, got {self.logit_bias!r}") from None
            _check(all(_finite(v) for v in self.logit_bias.values()), "logit_bias", "biases must be finite",
                   self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def clone(self, **changes) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["extra"] = dict(self.extra)
        values.update(changes)
        return SamplingParams(**values)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{name}: {rule}, got {value!r}")
