"""`SpeculativeConfig`: how the engine drafts tokens to verify (docs/speculative_decoding.md).

Given as vLLM's JSON object, `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4}'` (or `{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}`)
or `LLM(speculative_config={...})`; speculation is off without it.
Every key is checked here, so a bad value is an error naming the key before any weight loads.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, fields
from typing import Any

from fastdeploy_lp.options import json_object

METHODS = ("ngram", "draft_model")


# bench/speculative.py's (k+1)-row pass against a 1-row step, per draft row: 0.04-0.06 on the
# bench model (whose steps are bound by reading the weights); no draft row costs less.
MIN_DRAFT_ROW_COST = 0.05


@dataclass(frozen=True)
class SpeculativeConfig:
    """`ngram` (prompt lookup): match the last n tokens (the longest n from `prompt_lookup_max`
    down to `prompt_lookup_min`) against the prompt and the output so far, and draft the
    `num_speculative_tokens` tokens that followed the latest match. `draft_model`: the checkpoint
    at `model` (same tokenizer) drafts them greedily, with its own KV cache."""

    method: str = "ngram"
    model: str | None = None  # the draft model's checkpoint directory (draft_model only)
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int | None = None  # None: 1 (vLLM's default when only the maximum is given)
    # Decode tokens (running requests' own plus drafts) one pass may verify: drafts stop there. On
    # CPU a pass of up to ~8 rows reads each weight once (bench/speculative.py: 5 rows cost 1.15x one
    # row on the bench model, 10 rows 1.5x, 20 rows 2.2x), so a large batch speculates less or not at all.
    max_verify_tokens: int = 8
    # What one draft row adds to a decode step, as a fraction of a plain step: a request whose
    # drafts gain less pauses drafting (engine/speculation.py). None: the engine measures it, never
    # below MIN_DRAFT_ROW_COST; a number fixes it (tests, or a value bench/speculative.py printed).
    draft_row_cost: float | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name, low, high in (("num_speculative_tokens", 1, 16), ("prompt_lookup_max", 1, 64),
                                ("prompt_lookup_min", 1, 64), ("max_verify_tokens", 2, 4096)):
            value = getattr(self, name)
            if value is None and name == "prompt_lookup_min":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"speculative_config.{name}: must be an integer in {low}..{high}, got {value!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model: " + ("required for method draft_model (the draft "
                             "checkpoint's directory)" if self.model is None else "only for method draft_model"))
        if self.model is not None and not (isinstance(self.model, str) and os.path.isdir(self.model)):
            raise ValueError(f"speculative_config.model: must be a checkpoint directory, got {self.model!r}")
        cost = self.draft_row_cost
        if cost is not None and (not isinstance(cost, (int, float)) or isinstance(cost, bool) or not 0 <= cost <= 4):
            raise ValueError(f"speculative_config.draft_row_cost: must be a number in 0..4, got {cost!r}")
        if self.min_n > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min: must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max}), got {self.prompt_lookup_min}")

    @property
    def measures_draft_cost(self) -> bool:
        return self.draft_row_cost is None

    @property
    def min_n(self) -> int:
        return 1 if self.prompt_lookup_min is None else self.prompt_lookup_min

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """The config of a JSON string, a dict or a config; None (speculation off) for None or {}."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object("speculative_config", value)
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown key; known: {', '.join(sorted(known))}")
        if "method" not in value:
            raise ValueError(f"speculative_config.method: required (one of {', '.join(METHODS)})")
        return cls(**value)


def parse_speculative_config(text: str) -> dict[str, Any]:
    """The command line's JSON object, checked (argparse reports the error with the flag)."""
    try:
        config = SpeculativeConfig.from_value(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return {} if config is None else json.loads(text)
