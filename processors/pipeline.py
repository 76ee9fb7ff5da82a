"""The ordered processor pipeline the engine runs every step.

It validates request args against the registered processors, calls `update_state` before the
forward pass and `apply` after it in registration order, times both per processor, and isolates
failures: a processor that raises fails only the requests that enabled it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import paddle
from pydantic import ValidationError

from .base import LogitsProcessor, LogitsProcessorArgs, RequestFailures, active_slots
from .registry import resolve_processors

logger = logging.getLogger(__name__)


@dataclass
class ProcessorTiming:
    update_state_seconds: float = 0.0
    apply_seconds: float = 0.0
    calls: int = 0
    failures: int = 0      # steps in which the processor raised
    timeouts: int = 0      # steps in which it ran past the time limit


def _raised(error: BaseException) -> bool:
    """A processor's exception to isolate: anything but an interrupt from the keyboard (SystemExit
    included — a processor must not be able to stop the server)."""
    return not isinstance(error, KeyboardInterrupt)


class LogitsProcessorPipeline:
    def __init__(self, fd_config, names: list[str], leading: list[LogitsProcessor] | None = None):
        """`names` are the registered processors; `leading` ones (guided decoding) run first."""
        self.fd_config = fd_config
        self.processors: list[LogitsProcessor] = list(leading or [])
        self.processors += [cls(fd_config) for cls in resolve_processors(names)]
        self.names = [type(p).__name__ for p in self.processors]
        self.timings = {name: ProcessorTiming() for name in self.names}
        self._open = any(type(p).declared_keys() is None for p in self.processors)
        self._enabled: list[bool] = [False] * len(self.processors)
        self._step_seconds = [0.0] * len(self.processors)  # this step's update_state + apply
        self.timeout_s = getattr(fd_config, "logits_processor_timeout_s", None)

    # -- admission ------------------------------------------------------------------------------
    def validate(self, params) -> LogitsProcessorArgs:
        """Validate a request for every processor; return its normalised args."""
        args = self.validate_args(params.logits_processors_args)
        for p in self.processors:
            p.validate_request(params)
        return args

    def validate_args(self, args: dict | None) -> LogitsProcessorArgs:
        """Check one request's `logits_processors_args`; return them normalised by the processors' models.

        A key that no registered processor declares is an error, unless a registered processor
        does not declare its keys (FastDeploy-style processors read whatever they like).
        """
        if args is None:
            return LogitsProcessorArgs()
        if not isinstance(args, dict):
            raise ValueError(f"logits_processors_args: must be a JSON object, got {type(args).__name__}")
        registered = ", ".join(self.names) or "none"
        claimed: set[str] = set()
        out = LogitsProcessorArgs(args)
        for i, p in enumerate(self.processors):
            keys = type(p).declared_keys()
            if keys is None:
                continue
            mine = {k: v for k, v in args.items() if k in keys}
            claimed |= mine.keys()
            if not mine:
                continue
            try:
                parsed = type(p).args_model.model_validate(mine, context={"fd_config": self.fd_config})
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(x) for x in err["loc"]) or ", ".join(mine)
                raise ValueError(f"logits_processors_args.{where}: {err['msg']} (read by {self.names[i]}; "
                                 f"registered processors: {registered})") from None
            out.update(parsed.model_dump(include=set(mine)))
        unknown = [k for k in args if k not in claimed]
        if unknown and not self._open:
            raise ValueError(f"logits_processors_args.{unknown[0]}: no registered logits processor reads this "
                             f"key; registered processors: {registered}")
        return out

    # -- each step ------------------------------------------------------------------------------
    def update_state(self, share_inputs: dict) -> dict[int, str]:
        """Run every `update_state`; return {slot: error message} for requests to fail."""
        failures: dict[int, str] = {}
        rows = self._active_rows(share_inputs)
        for i, p in enumerate(self.processors):
            self._enabled[i] = any(type(p).is_enabled_by(a, sp) for _, a, sp in rows)
            start = time.perf_counter()
            try:
                p.update_state(share_inputs)
            except BaseException as e:
                if not _raised(e):
                    raise
                self._record_failure(i, e, rows, failures)
            elapsed = time.perf_counter() - start
            self.timings[self.names[i]].update_state_seconds += elapsed
            self._step_seconds[i] = elapsed
            self._check_time(i, rows, failures)
        return failures

    def apply(self, logits: paddle.Tensor, share_inputs: dict, all_greedy: bool) -> tuple[paddle.Tensor, dict[int, str]]:
        """Run `apply` in order on `[active, vocab]` logits; return them and {slot: error} failures."""
        failures: dict[int, str] = {}
        todo = [i for i, p in enumerate(self.processors)
                if self._enabled[i] and not (all_greedy and type(p).argmax_invariant)]
        if not todo:
            return logits, failures
        rows = self._active_rows(share_inputs)
        for i in todo:
            start = time.perf_counter()
            try:
                out = self.processors[i].apply(logits)
                if not isinstance(out, paddle.Tensor) or out.shape != logits.shape:
                    raise TypeError(f"apply() must return the logits tensor of shape {logits.shape}")
                logits = out
            except BaseException as e:
                if not _raised(e):
                    raise
                # By contract a processor writes only the rows it is enabled for, and those
                # requests are failed, so the rest of the batch is still good.
                self._record_failure(i, e, rows, failures)
            elapsed = time.perf_counter() - start
            timing = self.timings[self.names[i]]
            timing.apply_seconds += elapsed
            timing.calls += 1
            self._step_seconds[i] += elapsed
            self._check_time(i, rows, failures)
        return logits, failures

    def _check_time(self, i, rows, failures) -> None:
        """Fail the requests that enabled processor i if it has used more than its time this step.

        The step is not interrupted (Python cannot preempt a running call), but the requests that
        asked for a slow processor stop paying for it — and stop making everyone else pay."""
        if self.timeout_s is None or self._step_seconds[i] <= self.timeout_s:
            return
        name = self.names[i]
        self.timings[name].timeouts += 1
        logger.warning("logits processor %s took %.2f s in one step (limit %g s); failing its requests",
                       name, self._step_seconds[i], self.timeout_s)
        self._step_seconds[i] = 0.0  # counted once per step
        message = (f"logits processor {name} took longer than the per-step limit of {self.timeout_s:g} s "
                   "(--logits-processor-timeout)")
        for slot, args, params in rows:
            if type(self.processors[i]).is_enabled_by(args, params):
                failures.setdefault(slot, message)

    @staticmethod
    def _active_rows(share_inputs):
        """(slot, args, sampling params) of each active slot, in row order."""
        return [(s, share_inputs["logits_processors_args"][s], share_inputs["sampling_params"][s])
                for s in active_slots(share_inputs).tolist()]

    def _record_failure(self, i, error, rows, failures):
        name = self.names[i]
        if isinstance(error, RequestFailures):  # the processor named the requests that failed
            for slot, message in error.failures.items():
                failures.setdefault(slot, f"logits processor {name}: {message}")
            return
        timing = self.timings[name]
        timing.failures += 1
        if timing.failures == 1:  # one traceback; a processor failing every step would flood the log
            logger.error("logits processor %s failed (later failures are counted, not traced)", name,
                         exc_info=error)
        elif _is_power_of_ten(timing.failures):
            logger.error("logits processor %s has failed %d times; latest: %s: %s", name, timing.failures,
                         type(error).__name__, error)
        message = f"logits processor {name} failed: {type(error).__name__}: {error}"
        for slot, args, params in rows:
            if type(self.processors[i]).is_enabled_by(args, params):
                failures.setdefault(slot, message)


def _is_power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1
