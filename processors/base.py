"""The logits-processor contract (`share_inputs` version `SHARE_INPUTS_VERSION`).

A processor is registered once per server (`--logits-processors`) and sees the whole batch. Before
each forward pass `update_state(share_inputs)` gets the per-slot engine state (`ShareInputs`);
after it, `apply(logits)` gets one row per active slot, in increasing slot order, i.e. the order of
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

Speculative decoding (docs/speculative_decoding.md). A verify pass scores a request's k drafted
tokens and the position after them at once. A processor with `supports_speculation = True` sees
each draft position as a plain step would have shown it: after the step's own `update_state` and
`apply` (depth 0, every active slot), once per depth d = 1..k it gets `update_state` with
`share_inputs` in which the slots with at least d drafts are active and their `output_ids`,
`step_idx` and `next_tokens` hold the first d drafts (the other slots read as stopped), then
`apply` on those slots' rows at that position, in slot order. Then `update_state` once more with
the step's real state (rejected drafts are gone; accepted tokens arrive with the next step, as
several tokens at once). An exception at a depth only stops acceptance there (`RequestFailures`
from `update_draft_state` only for the slots it names: `apply` still runs for the others); tokens forced at a
depth are appended there unsampled, as fast-forward appends them, and acceptance goes on past them
only if the drafts were those tokens. Before the pass, `refine_drafts` lets a processor that knows
tokens for certain (a grammar) correct a request's drafts: cut what it would reject, and draft
what it forces.
A processor with state it can roll back cheaply (a grammar matcher) overrides `update_draft_state`
and `end_drafts` instead of being shown the depths through `update_state`. A processor without
it (the default) is never shown a draft: the requests that enable it decode without speculation.

Threads. Under a time limit (`logits_processor_timeout_s`) the engine calls a processor's
`update_state`, `apply`, and the speculative-decoding methods on a thread of the processor's own,
one call at a time, and waits for each only until the processor's time in the step is up
(`processor_thread.py`); keep no thread-local state between calls. A processor whose own code
bounds every call (`runs_in_place`) is called on the engine's thread instead.

A processor that keeps per-request state asks a `BatchTracker` (`batch_state.py`) what changed
since its previous step — a `BatchUpdate`: requests added, removed, and rows moved — and updates
only that, as vLLM's v1 processors do.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, TypedDict

import numpy as np
import paddle
from pydantic import BaseModel

from fastdeploy_lp.sampling_params import SamplingParams

SHARE_INPUTS_VERSION = 1  # bumped whenever a field is added to `ShareInputs`; fields are never removed


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


class ShareInputs(TypedDict):
    """One entry per engine slot in every field (version `SHARE_INPUTS_VERSION`;
    docs/logits_processors.md describes each field). The engine keeps one of these; `update_state`
    receives a step view of it (`step_view.py`): the processor's own dict, read-only arrays, tuples
    of read-only per-slot values, and its own `forced_tokens` lists, the one field it writes (its
    result, checked before the engine uses it)."""

    stop_flags: np.ndarray                        # bool [slots]: True = free, its request finished, or its
                                                  # prompt is still being prefilled in chunks (no row yet)
    req_ids: Sequence[str | None]                 # the request id in the slot (ids may repeat)
    logits_processors_args: Sequence[LogitsProcessorArgs]  # the request's args (an empty one when none)
    prompt_ids: Sequence[np.ndarray]              # int64: the prompt's token ids
    prompt_lens: np.ndarray                       # int64 [slots]
    output_ids: Sequence[Sequence[int]]           # tokens generated so far (a live view of the request's list)
    step_idx: np.ndarray                          # int64 [slots]: number of tokens generated so far
    next_tokens: np.ndarray                       # int64 [slots]: the last generated token, -1 before
    sampling_params: Sequence[SamplingParams | None]  # the request's full sampling parameters
    admission_ids: np.ndarray                     # int64 [slots]: unique per admission, -1 never used
    forced_tokens: list[list[int]]                # appended to in update_state: tokens certain to come next
    temperature: np.ndarray                       # float32 [slots]: the request's sampling fields ...
    top_p: np.ndarray
    top_k: np.ndarray                             # int64
    min_p: np.ndarray
    repetition_penalty: np.ndarray
    frequency_penalty: np.ndarray
    presence_penalty: np.ndarray


def active_slots(share_inputs: ShareInputs) -> np.ndarray:
    """The slots that have a logits row this step, in row order: row i is slot `active_slots(...)[i]`."""
    return np.flatnonzero(~np.asarray(share_inputs["stop_flags"], dtype=bool))


@dataclass(frozen=True)
class AddedRequest:
    """A request that joined the batch since the processor's previous step."""

    slot: int
    row: int                      # its row in this step's logits
    admission_id: int             # `share_inputs["admission_ids"][slot]`: tells it from the slot's earlier requests
    req_id: str | None
    args: LogitsProcessorArgs     # its `logits_processors_args`
    params: SamplingParams | None


@dataclass(frozen=True)
class BatchUpdate:
    """What changed in the batch since a processor's previous step (vLLM's `BatchUpdate`, by slot).

    A request keeps its slot from admission to finish; rows are the active slots compacted in slot
    order, so a request that joins or leaves shifts the rows after it. A processor with per-request
    state drops the `removed` slots, builds the `added` requests, and re-indexes per-row data with
    `previous_rows` (one gather) instead of rebuilding it. A slot reused by a new request is both
    removed and added.
    """

    slots: np.ndarray                   # int64 [rows]: the active slots; row i is slots[i]
    added: tuple[AddedRequest, ...]     # in row order
    removed: tuple[int, ...]            # slots whose request finished, was aborted or failed
    moved: tuple[tuple[int, int], ...]  # (previous row, row) of requests that stayed and changed row
    previous_rows: np.ndarray           # int64 [rows]: each row's previous row, -1 for an added request
    row_of_slot: np.ndarray             # int64 [slots]: each slot's row, -1 for an inactive slot

    @property
    def changed(self) -> bool:
        """Whether any request joined or left (rows move only then)."""
        return bool(self.added or self.removed)

    def rows_of(self, slots) -> np.ndarray:
        """The rows of active `slots`."""
        return self.row_of_slot[np.asarray(slots, dtype=np.int64)]


class RequestFailures(Exception):
    """Raised by `update_state` to fail only some requests: `{slot: message}`.

    The pipeline finishes those requests with finish reason "error" and the message, and calls
    `update_state` again for the smaller batch; every other request goes on.
    """

    def __init__(self, failures: dict[int, str]):
        super().__init__("; ".join(f"slot {s}: {m}" for s, m in failures.items()))
        self.failures = dict(failures)


class LogitsProcessor(ABC):
    """Base class of batch-level logits processors.

    Class attributes a processor may set:
      * `args_model`: a pydantic model of the request keys it reads. Requests are validated
        against it before admission; a request enables the processor by setting any of them.
      * `argmax_invariant`: True if `apply` never changes which token has the highest logit
        (then it is skipped for all-greedy batches).
      * `supports_speculation`: True if `apply` is a function of each row's `share_inputs`
        history alone, so it can be shown draft positions (module docstring); requests that enable
        a processor without it decode without speculative decoding.
      * `serves_guided_decoding`: True for the processor that enforces
        `SamplingParams.guided_decoding` (the engine accepts such requests only if one is installed).
      * `uses_engine_context`: True if it needs the engine's runtime objects (the tokenizer, tool
        functions, custom backends): it is then built as `cls(fd_config, context)` with the
        engine's `EngineContext` (`context.py`); otherwise as FastDeploy's `cls(fd_config)`.
      * `runs_in_place`: True if its own code bounds the time of every call (the built-ins: batched
        tensor work over what the request limits bound, or calls they run under a deadline of
        their own). It is then called on the engine thread, sparing the hand-over to its thread
        (tens of microseconds a call), and its time is checked after each call instead.
      * `step_time_limit_s`: seconds it may use in one step when that is longer than
        `--logits-processor-timeout`, because a request's own arguments bound its work (tool
        execution: a call may take the request's `tool_timeout`), or because it bounds its own
        calls by that limit and needs a moment more to collect them (an instance may set it from
        its config: custom backends). None: the server's limit.
    """

    args_model: ClassVar[type[BaseModel] | None] = None
    argmax_invariant: ClassVar[bool] = False
    serves_guided_decoding: ClassVar[bool] = False
    supports_speculation: ClassVar[bool] = False
    uses_engine_context: ClassVar[bool] = False
    runs_in_place: ClassVar[bool] = False
    step_time_limit_s: float | None = None

    def __init__(self, fd_config) -> None:
        self.fd_config = fd_config

    def validate_request(self, params: SamplingParams) -> None:
        """Check one request's `SamplingParams` before it is admitted; raise `ValueError` naming
        the field (a 400 on the server). Offline it runs on the caller's thread. On the server it
        runs on the event loop for a request without an output constraint, so it must be fast
        (microseconds): a slow check there stalls every stream. A request with a constraint
        (`SamplingParams.guided_decoding`) is admitted on a worker thread, which is why compiling a
        grammar can happen here. Other per-request setup belongs in `update_state` when the request
        joins (on the engine thread: it delays that step and counts against the time budget)."""

    @abstractmethod
    def update_state(self, share_inputs: ShareInputs) -> None:
        """Called before each forward pass with the engine's per-slot state; it may be called
        again within a step (after requests failed), with the smaller batch."""

    def supports_speculation_for(self, params: SamplingParams | None) -> bool:
        """Whether a request with these params that enables this processor may speculate: by default
        `supports_speculation`; a processor that can take part for some requests only narrows it."""
        return type(self).supports_speculation

    def update_draft_state(self, share_inputs: ShareInputs) -> None:
        """A draft depth of a verify pass (module docstring), before `apply` on its rows. By default
        `update_state`: a function of each row's history needs nothing else."""
        self.update_state(share_inputs)

    def end_drafts(self, share_inputs: ShareInputs) -> None:
        """After the draft depths, with the step's real `share_inputs`: by default `update_state`."""
        self.update_state(share_inputs)

    def refine_drafts(self, slot: int, drafts: list[int], limit: int) -> list[int]:
        """Before a verify pass, the drafts for request `slot`'s next positions (at most `limit`)
        as this processor would make them; called in registration order for the processors a request
        enables that take part, each given what the one before returned. Drafts change how fast
        tokens come, never which. By default unchanged."""
        return drafts

    def apply(self, logits: paddle.Tensor) -> paddle.Tensor:
        """Modify the `[active_slots, vocab]` logits (in place allowed) and return them. A processor
        that only publishes `forced_tokens` need not override it."""
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
