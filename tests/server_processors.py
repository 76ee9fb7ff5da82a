"""Logits processors the server tests register by their fully qualified name
(`--logits-processors server_processors:ForceTokenLogitsProcessor`; the tests put this folder on
the server's PYTHONPATH)."""

from __future__ import annotations

import time

import paddle
from pydantic import BaseModel, Field

from fastdeploy_lp.processors import LogitsProcessor


class ForceTokenArgs(BaseModel):
    force_token: int | None = Field(None, ge=0, description="Token id every step must produce.")


class ForceTokenLogitsProcessor(LogitsProcessor):
    """Makes a request emit one token id forever: `{"force_token": 7}`."""

    args_model = ForceTokenArgs

    def update_state(self, share_inputs):
        args = [a for a, f in zip(share_inputs["logits_processors_args"], share_inputs["stop_flags"]) if not f]
        self.rows = [(row, a.force_token) for row, a in enumerate(args) if a.force_token is not None]

    def apply(self, logits):
        if not self.rows:
            return logits
        rows = paddle.to_tensor([r for r, _ in self.rows], dtype="int64")
        tokens = paddle.to_tensor([[t] for _, t in self.rows], dtype="int64")
        forced = paddle.full([len(self.rows), logits.shape[1]], float("-inf"), dtype=logits.dtype)
        forced = paddle.put_along_axis(forced, tokens, paddle.zeros([len(self.rows), 1], dtype=logits.dtype), axis=1)
        return paddle.scatter(logits, rows, forced, overwrite=True)


class SlowArgs(BaseModel):
    slow_ms: int | None = Field(None, ge=0, le=1000, description="Sleep this long in every step it is enabled.")


class SlowLogitsProcessor(LogitsProcessor):
    """Holds each step for `{"slow_ms": N}` milliseconds, so tests can keep a slot busy."""

    args_model = SlowArgs

    def update_state(self, share_inputs):
        args = [a for a, f in zip(share_inputs["logits_processors_args"], share_inputs["stop_flags"]) if not f]
        self.delay = max((a.slow_ms or 0 for a in args), default=0) / 1000

    def apply(self, logits):
        if self.delay:
            time.sleep(self.delay)
        return logits


class FailingArgs(BaseModel):
    fail: bool | None = None


class FailingLogitsProcessor(LogitsProcessor):
    """Raises for the requests that set `{"fail": true}`; the engine fails only those."""

    args_model = FailingArgs

    def update_state(self, share_inputs):
        args = [a for a, f in zip(share_inputs["logits_processors_args"], share_inputs["stop_flags"]) if not f]
        self.failing = any(a.fail for a in args)

    def apply(self, logits):
        if self.failing:
            raise RuntimeError("asked to fail")
        return logits
