"""The logits-processor interface.

A processor is registered once per server (`--logits-processors`) and sees the whole batch. Before
each forward pass `update_state(share_inputs)` gets the per-slot engine state; after it,
`apply(logits)` gets one row per active slot, in increasing slot order, i.e. the order of
`[x for x, f in zip(share_inputs[field], share_inputs["stop_flags"]) if not f]`.

Example (the FastDeploy example, unchanged but for the package name):

    class YourLogitsProcessor(LogitsProcessor):
        def __init__(self, fd_config):
            self.enabled = None

        def update_state(self, share_inputs):
            args = [a for a, f in zip(share_inputs["logits_processors_args"], share_inputs["stop_flags"]) if not f]
            self.enabled = [a.enable_your_logits_processor for a in args]

        def apply(self, logits):
            for i, e in enumerate(self.enabled):
                if e:
                    logits[i] = ...
            return logits
"""

from __future__ import annotations

from functools import cache
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel


class LogitsProcessorArgs(dict):
    """One request's `logits_processors_args`: a dict whose missing keys read as None.

    `a["x"]`, `a.get("x")` and `a.x` all work, as FastDeploy processors expect.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)

    def __getitem__(self, key: str) -> Any:
        return self.get(key)


def active_slots(share_inputs: dict) -> np.ndarray:
    """The slots that have a logits row this step, in row order: row i is slot `active_slots(...)[i]`."""
    return np.flatnonzero(~np.asarray(share_inputs["stop_flags"], dtype=bool))


def batch_key(share_inputs: dict, slots: np.ndarray) -> tuple:
    """A value that changes exactly when the batch's composition does (a request joins, leaves or
    moves), so a processor can rebuild its index tensors only then. Admission ids are never reused,
    unlike request ids (a client may send one again) or `id()` of args objects (Python reuses them)."""
    admissions = share_inputs["admission_ids"]
    return tuple((int(s), int(admissions[s])) for s in slots)


class RequestFailures(Exception):
    """Raised by `update_state` to fail only some requests: `{slot: message}`.

    The pipeline finishes those requests with finish reason "error" and the message, and calls
    `update_state` again for the smaller batch; every other request goes on.
    """

    def __init__(self, failures: dict[int, str]):
        super().__init__("; ".join(f"slot {s}: {m}" for s, m in failures.items()))
        self.failures = dict(failures)


class LogitsProcessor:
    """Base class of batch-level logits processors.

    Class attributes a processor may set:
      * `args_model`: a pydantic model of the request keys it reads. Requests are validated
        against it before admission; a request enables the processor by setting any of them.
      * `argmax_invariant`: True if `apply` never changes which token has the highest logit
        (then it is skipped for all-greedy batches).
    """

    args_model: ClassVar[type[BaseModel] | None] = None
    argmax_invariant: ClassVar[bool] = False

    def __init__(self, fd_config) -> None:
        self.fd_config = fd_config

    def validate_request(self, params) -> None:
        """Check one request's `SamplingParams` before it is admitted; raise `ValueError` naming
        the field. Runs on the caller's thread, so slow checks (compiling a grammar) belong here."""

    def update_state(self, share_inputs: dict) -> None:
        """Called before each forward pass with the engine's per-slot state."""

    def apply(self, logits):
        """Modify the `[active_slots, vocab]` logits (in place allowed) and return them."""
        return logits

    @classmethod
    def declared_keys(cls) -> frozenset[str] | None:
        """The request keys this processor reads, or None if it does not declare them."""
        return None if cls.args_model is None else _model_keys(cls.args_model)

    @classmethod
    def is_enabled_by(cls, args: LogitsProcessorArgs, params=None) -> bool:
        """Whether a request with these args (and `SamplingParams`) uses this processor."""
        keys = cls.declared_keys()
        if keys is None:
            return bool(args)
        return any(args.get(k) is not None for k in keys)


@cache
def _model_keys(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(model.model_fields)
