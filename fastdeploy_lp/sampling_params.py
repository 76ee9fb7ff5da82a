"""What a user asks of one generation: `SamplingParams` and `GuidedDecodingParams`.

Both validate in their constructors and raise `ValueError` naming the field, so a bad value is
caught where it enters (the offline call or the HTTP request), never in the engine loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from fastdeploy_lp.tokenizer.text import check_text

MAX_N = 128
MAX_TEMPERATURE = 100.0
GREEDY_TEMPERATURE = 1e-5
MAX_REPETITION_PENALTY = 100.0
INT32_MAX = 2**31 - 1
MAX_SEED = 2**64 - 1
MAX_LOGPROBS = 20  # alternatives per token, for logprobs and prompt_logprobs (the server's limit too)


_JSON_OPTIONS = ("whitespace_pattern", "disable_additional_properties", "close_on_length", "max_number_digits")
_CLOSABLE = ("json", "json_object")
# `SamplingParams.extra` key of the set of request ids whose output guided decoding closed at
# `max_tokens` (close_on_length); present when the requests close on length. Outputs report it.
CLOSED_ON_LENGTH = "guided_decoding.closed_on_length"


@dataclass
class GuidedDecodingParams:
    """One output constraint; exactly one field is set."""

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    # JSON options: the whitespace allowed between tokens (None: the server's default, "": none),
    # and objects closed to keys their schema does not list (vLLM's disable_additional_properties).
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False
    # At max_tokens, end the JSON with the shortest completion found (strings cut, arrays and objects
    # closed, required keys given short values) instead of cutting it. None: the engine's default.
    close_on_length: bool | None = None
    # The most digits a JSON number may have before its point (and, up to 10, after it), so an
    # endless number cannot use up the budget. None: the engine's default; 0: no cap.
    max_number_digits: int | None = None

    def __post_init__(self):
        if self.json is False:  # a JSON Schema of its own, which no document satisfies (not "unset")
            raise ValueError("guided_json: the schema false allows no output")
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError("guided_decoding: exactly one of json, json_object, regex, choice, grammar, "
                             f"structural_tag must be set, got {kinds or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("guided_choice: must be a non-empty list of strings")
        check_text(getattr(self, kinds[0]), f"guided_decoding.{kinds[0]}")
        check_text(self.whitespace_pattern, "guided_decoding.whitespace_pattern")
        if self.close_on_length is not None and not isinstance(self.close_on_length, bool):
            raise ValueError(f"close_on_length: must be a boolean, got {self.close_on_length!r}")
        digits = self.max_number_digits
        if digits is not None and (not isinstance(digits, int) or isinstance(digits, bool) or not 0 <= digits <= 300):
            raise ValueError(f"max_number_digits: must be an integer from 0 (no cap) to 300, got {digits!r}")
        if self.close_on_length and kinds[0] not in _CLOSABLE:
            raise ValueError(f"close_on_length: only applies to a JSON constraint (json, json_object); this request "
                             f"sets {kinds[0]}")

    def kinds(self) -> list[str]:
        return [f.name for f in fields(self) if f.name not in _JSON_OPTIONS
                and getattr(self, f.name) not in (None, False)]


@dataclass
class SamplingParams:
    """Sampling controls for one request, as in vLLM and FastDeploy.

    `temperature=0` (or below 1e-5) is greedy. `seed` makes sampling reproducible for this request whatever else
    shares the batch. `logits_processors_args` is the JSON object the registered logits processors
    read (e.g. `{"logit_bias": {"128": 5.0}}`). `prompt_logprobs=k` (vLLM's): the output's
    `prompt_logprobs` holds None for the first prompt token, then for each next one its logprob given
    the tokens before it, its rank and the `k` most likely alternatives (engine/prompt_logprobs.py).
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
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob (after the first) and k alternatives
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
        _check(all(isinstance(s, str) for s in self.stop), "stop", "must be a string or a list of strings", self.stop)
        _check("" not in self.stop, "stop", "must not contain an empty string", self.stop)  # it would match nothing
        check_text(self.stop, "stop")
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(all(_integer(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be a list of token ids (non-negative integers)", self.stop_token_ids)
        _check(_integer(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in 1..{MAX_N}", self.n)
        _check(_finite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
               f"must be in [0, {MAX_TEMPERATURE}]", self.temperature)
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(_integer(self.top_k) and -1 <= self.top_k <= INT32_MAX, "top_k",
               f"must be -1 or 0 (off), or a positive integer up to {INT32_MAX}", self.top_k)
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(_finite(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
               "repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY}]", self.repetition_penalty)
        _check(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
               "must be in [-2, 2]", self.frequency_penalty)
        _check(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
               "must be in [-2, 2]", self.presence_penalty)
        _check(self.max_tokens is None or (_integer(self.max_tokens) and 1 <= self.max_tokens <= INT32_MAX),
               "max_tokens", f"must be an integer in 1..{INT32_MAX}", self.max_tokens)
        _check(_integer(self.min_tokens) and 0 <= self.min_tokens <= INT32_MAX, "min_tokens",
               f"must be an integer in 0..{INT32_MAX}", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               "must not exceed max_tokens", self.min_tokens)
        # The n choices use seed, seed + 1, ...: all of them must be valid generator seeds.
        _check(self.seed is None or (_integer(self.seed) and 0 <= self.seed <= MAX_SEED - self.n), "seed",
               f"must be an integer in 0..{MAX_SEED - self.n}", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_integer(value) and 0 <= value <= MAX_LOGPROBS), name,
                   f"must be an integer in 0..{MAX_LOGPROBS}", value)
        _check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "must be a boolean",
               self.skip_special_tokens)
        _check(self.logits_processors_args is None or isinstance(self.logits_processors_args, dict),
               "logits_processors_args", "must be a JSON object", self.logits_processors_args)
        check_text(self.logits_processors_args, "logits_processors_args")
        if self.logit_bias is not None:
            self.logit_bias = _token_biases(self.logit_bias)
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, list) and all(isinstance(w, str) and w for w in self.bad_words),
                   "bad_words", "must be a list of non-empty strings", self.bad_words)
            check_text(self.bad_words, "bad_words")
        if isinstance(self.guided_decoding, dict):  # vLLM accepts the mapping form too
            unknown = sorted(set(self.guided_decoding) - {f.name for f in fields(GuidedDecodingParams)})
            _check(not unknown, "guided_decoding", f"unknown keys {unknown}", self.guided_decoding)
            self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
        _check(self.guided_decoding is None or isinstance(self.guided_decoding, GuidedDecodingParams),
               "guided_decoding", "must be a GuidedDecodingParams or a dict of its fields", self.guided_decoding)

    def check_vocab(self, vocab_size: int) -> None:
        """The model-dependent half of this object's validation, made at admission: token ids in
        `logit_bias` and `stop_token_ids` must be in the vocabulary. Raises ValueError naming the field."""
        for name, tokens in (("logit_bias", (self.logit_bias or {}).keys()), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in tokens if t >= vocab_size]  # negative ids were refused at construction
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")

    @property
    def greedy(self) -> bool:
        """Temperatures this small would overflow `logits / temperature`; they mean greedy."""
        return self.temperature < GREEDY_TEMPERATURE

    def clone(self, **changes) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["extra"] = dict(self.extra)
        values.update(changes)
        return SamplingParams(**values)


def _token_biases(value) -> dict[int, float]:
    """`{token id: bias}` from ints or decimal strings ("128", as JSON keys are); biases in [-100, 100]."""
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias: must map token ids to numbers, got {value!r}")
    out = {}
    for key, bias in value.items():
        token = token_id_key(key, "logit_bias")
        if not (_finite(bias) and -100 <= bias <= 100):
            raise ValueError(f"logit_bias: bias for token {token} must be a number in [-100, 100], got {bias!r}")
        out[token] = float(bias)
    return out


def token_id_key(key, field: str | None = None) -> int:
    """A token id written as a JSON object key: an int, or a string of ASCII digits ("128"; not
    "1_0" or "+5", which `int()` and pydantic would also read). Else a ValueError naming `field`
    (pydantic models name it themselves)."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    if _integer(key) and key >= 0:
        return key
    raise ValueError(f"{field + ': ' if field else ''}keys must be token ids (non-negative integers), got {key!r}")


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{name}: {rule}, got {value!r}")
