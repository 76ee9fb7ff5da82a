"""Custom logits processors the tests register by FQCN (`custom_processors:ClassName`).

pytest puts `tests/` on `sys.path` (rootdir-relative test modules without `__init__.py`), so this
module imports as `custom_processors`, exactly as a user's own module would.
"""

from __future__ import annotations

import time
from typing import Literal

import numpy as np
import paddle
from paddle import Tensor
from pydantic import BaseModel

from fastdeploy_lp.config import FDConfig
from fastdeploy_lp.openai.logits_processor import LogitsProcessor
from fastdeploy_lp.processors import AddedRequest, BatchTracker, BatchUpdate, RequestFailures, ShareInputs
from fastdeploy_lp.processors.builtin.allowed_token_ids import AllowedTokenIdsLogitsProcessor
from fastdeploy_lp.processors.builtin.bad_words import BadWordsLogitsProcessor
from fastdeploy_lp.processors.builtin.logit_bias import LogitBiasLogitsProcessor
from fastdeploy_lp.processors.builtin.no_repeat_ngram import NoRepeatNGramLogitsProcessor
from fastdeploy_lp.processors.builtin.thinking_budget import ThinkingBudgetLogitsProcessor
from fastdeploy_lp.processors.tensor_ops import gather_rows


# -- The FastDeploy documentation's example, ported by renaming `fastdeploy` to `fastdeploy_lp`. --
class YourLogitsProcessor(LogitsProcessor):
    FORCED_TOKEN = 42  # what "enabled" does here: a bias large enough to force this token

    def __init__(self, fd_config: FDConfig) -> None:
        # Initialize your state variables here, for example obtain dtype, device, etc.
        # from fd_config. You can freely set the state variables you need, and update them
        # during each step of inference update_state()
        self.enabled = None
        return

    def update_state(self, share_inputs: dict) -> None:
        """Called when there are new output tokens, prior to each forward pass."""
        stop_flags = share_inputs["stop_flags"]
        logits_processors_args = share_inputs["logits_processors_args"]
        logits_processors_args = [a for a, f in zip(logits_processors_args, stop_flags) if not f]
        self.enabled = [a.enable_your_logits_processor for a in logits_processors_args]
        return

    def apply(self, logits: Tensor) -> Tensor:
        """Apply LogitsProcessor to batch logits tensor. The updated tensor must be returned but may be
        modified in-place."""
        for i, e in enumerate(self.enabled):
            if e:
                logits[i, self.FORCED_TOKEN] += 1000.0
        return logits


# -- Test instruments --------------------------------------------------------------------------------
class RecordArgs(BaseModel):
    record: bool | None = None


class _Recorder(LogitsProcessor):
    """Snapshots, every step, each row's request id, history and logits (a copy, on the host)."""

    args_model = RecordArgs

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self.steps: list[dict[str, tuple[list[int], np.ndarray]]] = []
        self._rows: list[tuple[str, list[int]]] = []

    @classmethod
    def is_enabled_by(cls, args, params=None) -> bool:
        return True  # sees every row of every step

    def update_state(self, share_inputs):
        s = share_inputs
        self._rows = [(s["req_ids"][i], [int(t) for t in s["prompt_ids"][i]] + list(s["output_ids"][i]))
                      for i in range(len(s["stop_flags"])) if not s["stop_flags"][i]]

    def apply(self, logits):
        values = logits.numpy().copy()
        self.steps.append({rid: (history, values[row]) for row, (rid, history) in enumerate(self._rows)})
        return logits


class RecordBefore(_Recorder):
    """Register first: the logits as the model produced them."""


class RecordAfter(_Recorder):
    """Register last: the logits the sampler receives."""


class RaiseArgs(BaseModel):
    raise_in: Literal["update_state", "apply"] | None = None


class RaisingLogitsProcessor(LogitsProcessor):
    """Raises in `update_state` or `apply` while a row that asked for it is in the batch."""

    args_model = RaiseArgs

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._where: set[str] = set()

    def update_state(self, share_inputs):
        self._where = {a.raise_in for a, f in zip(share_inputs["logits_processors_args"], share_inputs["stop_flags"])
                       if not f and a.raise_in}
        if "update_state" in self._where:
            raise RuntimeError("boom in update_state")

    def apply(self, logits):
        if "apply" in self._where:
            raise RuntimeError("boom in apply")
        return logits


class BanArgmaxArgs(BaseModel):
    ban_argmax: bool | None = None


class BanArgmaxLogitsProcessor(LogitsProcessor):
    """Bans each enabled row's current best token: its result depends on what ran before it."""

    args_model = BanArgmaxArgs

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._rows: list[int] = []

    def update_state(self, share_inputs):
        active = [a for a, f in zip(share_inputs["logits_processors_args"], share_inputs["stop_flags"]) if not f]
        self._rows = [i for i, a in enumerate(active) if a.ban_argmax]

    def apply(self, logits):
        if self._rows:
            rows = paddle.to_tensor(self._rows, dtype="int64")
            best = paddle.argmax(paddle.index_select(logits, rows), axis=-1)
            logits.index_put_((rows, best), paddle.full([1], float("-inf"), logits.dtype))
        return logits


class NotAProcessor:
    """Has the right methods but does not subclass LogitsProcessor."""

    def __init__(self, fd_config):
        pass

    def update_state(self, share_inputs):
        pass

    def apply(self, logits):
        return logits


class HostileArgs(BaseModel):
    write: Literal["nan", "-inf"] | None = None
    exit_in: Literal["update_state", "apply"] | None = None
    sleep_s: float | None = None
    blame_empty_slot: bool | None = None


class HostileLogitsProcessor(LogitsProcessor):
    """Misbehaves for the rows that ask: writes NaN or -inf over the whole row, raises SystemExit,
    or sleeps. The engine must fail exactly those requests and serve the rest."""

    args_model = HostileArgs

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self._active = []

    def update_state(self, share_inputs):
        self._active = [a for a, f in zip(share_inputs["logits_processors_args"], share_inputs["stop_flags"]) if not f]
        if any(a.exit_in == "update_state" for a in self._active):
            raise SystemExit(3)
        if any(a.blame_empty_slot for a in self._active):  # a slot no request is in
            raise RequestFailures({len(share_inputs["stop_flags"]): "not a request"})

    def apply(self, logits):
        if any(a.exit_in == "apply" for a in self._active):
            raise SystemExit(3)
        sleep = max((a.sleep_s or 0.0 for a in self._active), default=0.0)
        if sleep:
            time.sleep(sleep)
        for row, a in enumerate(self._active):
            if a.write:
                logits[row] = float(a.write)
        return logits


# -- The typed contract: per-row state kept in step with BatchUpdates --------------------------------
class TypedBiasArgs(BaseModel):
    typed_token: int | None = None


class TypedBiasLogitsProcessor(LogitsProcessor):
    """Adds 2000 to `typed_token` of each enabled row, written against the typed contract:
    one `[rows, vocab]` bias tensor whose rows follow the batch (`gather_rows` when rows move; only
    joining rows are written). Records the changes it saw."""

    args_model = TypedBiasArgs

    def __init__(self, fd_config: FDConfig) -> None:
        super().__init__(fd_config)
        self.batch = BatchTracker()
        self.bias = paddle.zeros([0, fd_config.model_config.vocab_size])
        self.updates: list[BatchUpdate] = []

    def update_state(self, share_inputs: ShareInputs) -> None:
        update = self.batch.update(share_inputs)
        if not update.changed:
            return
        self.updates.append(update)
        self.bias = gather_rows(self.bias, update.previous_rows, fill=0.0)
        for request in update.added:
            if request.args.typed_token is not None:
                self.bias[request.row, request.args.typed_token] = 2000.0

    def apply(self, logits: Tensor) -> Tensor:
        rows = paddle.nonzero(self.bias.abs().sum(axis=1)).flatten()
        if rows.shape[0]:
            logits[rows] = paddle.index_select(logits, rows) + paddle.index_select(self.bias, rows)
        return logits


# -- The built-ins, counting the per-request state they build (`entries`, called when a request joins) --
class _CountBuilds:
    def __init__(self, fd_config, *context):  # the built-ins that need the engine context take it too
        super().__init__(fd_config, *context)
        self.built: list[str] = []  # request ids, in build order

    def entries(self, request: AddedRequest):
        self.built.append(request.req_id)
        return super().entries(request)


class CountingLogitBias(_CountBuilds, LogitBiasLogitsProcessor):
    pass


class CountingBadWords(_CountBuilds, BadWordsLogitsProcessor):
    pass


class CountingNoRepeatNGram(_CountBuilds, NoRepeatNGramLogitsProcessor):
    pass


class CountingAllowedTokenIds(_CountBuilds, AllowedTokenIdsLogitsProcessor):
    pass


class CountingThinkingBudget(_CountBuilds, ThinkingBudgetLogitsProcessor):
    pass


class MissingUpdateState(LogitsProcessor):
    """Subclasses the base but leaves out the abstract `update_state`: refused at start-up."""

    def apply(self, logits):
        return logits
