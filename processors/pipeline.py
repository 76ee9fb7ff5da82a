"""The ordered processor pipeline the engine runs every step.

It validates request args against the registered processors, calls `update_state` before the
forward pass and `apply` after it in registration order, times both per processor, and isolates
failures: a processor that raises fails only the requests that enabled it. Under a time limit
(`logits_processor_timeout_s`) each processor's calls run on a thread of its own
(`processor_thread.py`) and are waited for until the processor's time this step is up: one that
passes it fails its requests in that very step, and the step goes on without waiting for it.
Processors whose own code bounds every call (`runs_in_place`: the built-ins, custom backends'
adapter) are called in place and checked after each call.

Processors never see the engine's `ShareInputs`: each gets its own step view (`step_view.py`), and
what it appends to that view's `forced_tokens` is its result, checked (`ForcedTokens`) before it
counts. `update_state` hands the engine what a round of processors produced as one typed value
(`ProcessorResults`: forced tokens and failures per slot); nothing is written back into
`share_inputs`. A processor whose result breaks the contract fails like one that raised, and none
of its tokens are used.

Request-level `SamplingParams.logit_bias` and `bad_words` run through the same built-in processors
as `logits_processors_args`, in a second stage of their own, whether or not the operator registered
those processors by name. That stage sees `share_inputs` with each slot's args read from its `SamplingParams`, so the built-ins
need no second code path. Where both stages run among the others: `engine/stages.py`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import paddle
from pydantic import ValidationError

from fastdeploy_lp.processors.base import (LogitsProcessor, LogitsProcessorArgs, RequestFailures, ShareInputs,
                                           active_slots)
from fastdeploy_lp.processors.context import EngineContext, build_processor
from fastdeploy_lp.processors.processor_thread import CallTimedOut, ProcessorLate, ProcessorThread
from fastdeploy_lp.processors.registry import SAMPLING_PARAMS_PROCESSORS, resolve_processors
from fastdeploy_lp.processors.step_view import ForcedTokens, ForcedTokensError, ReadOnlyArgs, StepView

logger = logging.getLogger(__name__)


@dataclass
class ProcessorTiming:
    update_state_seconds: float = 0.0
    apply_seconds: float = 0.0
    calls: int = 0
    failures: int = 0      # steps in which the processor raised
    timeouts: int = 0      # steps in which it ran past the time limit


@dataclass(frozen=True)
class ProcessorResults:
    """What one round of `update_state` hands the engine: per slot, the tokens the processors
    declared certain to come next (checked, in order, after those already queued), and the
    requests to fail with their messages."""

    forced: dict[int, tuple[int, ...]] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)


def _raised(error: BaseException) -> bool:
    """A processor's exception to isolate: anything but an interrupt from the keyboard (SystemExit
    included — a processor must not be able to stop the server). Only the main thread gets Ctrl-C:
    on any other (the server's engine thread) a KeyboardInterrupt is raised by code, and isolated."""
    return not isinstance(error, KeyboardInterrupt) or threading.current_thread() is not threading.main_thread()


class LogitsProcessorPipeline:
    """The registered processors (after the `leading` ones the engine installs: guided decoding),
    and the built-ins that apply `SamplingParams.logit_bias` and `bad_words` (`sampling_stage`,
    `apply_sampling_params`; where each runs: `engine/stages.py`)."""

    def __init__(self, context: EngineContext, names: Sequence[str], leading: list[LogitsProcessor] | None = None):
        self.fd_config = context.config
        processors = list(leading or []) + [build_processor(cls, context) for cls in resolve_processors(names)]
        self.registered = _Stage(processors, [type(p).__name__ for p in processors], context)
        stage = resolve_processors(list(SAMPLING_PARAMS_PROCESSORS.values()))
        names = [f"{name}(SamplingParams.{field})" for field, name in SAMPLING_PARAMS_PROCESSORS.items()]
        self.sampling_stage = _Stage([build_processor(cls, context) for cls in stage], names, context)
        self._open = any(type(p).declared_keys() is None for p in processors)
        self._view = StepView()
        self._draft_view = StepView()  # the draft depths' views, kept apart from the step's own
        self._sampling_args: list[ReadOnlyArgs] = []  # per slot: its SamplingParams fields as args
        self._sampling_admissions = np.zeros(0, dtype=np.int64)  # ... of the admission they were read for

    @property
    def processors(self) -> list[LogitsProcessor]:
        """The leading and registered processors, in order."""
        return self.registered.processors

    @property
    def names(self) -> list[str]:
        return self.registered.names

    @property
    def timings(self) -> dict[str, ProcessorTiming]:
        return self.registered.timings

    @timings.setter
    def timings(self, value: dict[str, ProcessorTiming]) -> None:
        self.registered.timings = value

    @property
    def serves_guided_decoding(self) -> bool:
        """Whether a processor enforces `SamplingParams.guided_decoding` (else such requests are refused)."""
        return any(type(p).serves_guided_decoding for p in self.processors)

    # -- admission ------------------------------------------------------------------------------
    def validate(self, params) -> ReadOnlyArgs:
        """Validate a request for every processor; return its normalised args."""
        args = self.validate_args(params.logits_processors_args)
        for p in self.processors:
            p.validate_request(params)
        return args

    def validate_args(self, args: dict | None) -> ReadOnlyArgs:
        """Check one request's `logits_processors_args`; return them normalised by the processors' models.

        A key that no registered processor declares is an error, unless a registered processor
        does not declare its keys (FastDeploy-style processors read whatever they like).
        """
        if args is None:
            return ReadOnlyArgs()
        if not isinstance(args, dict):
            raise ValueError(f"logits_processors_args: must be a JSON object, got {type(args).__name__}")
        registered = ", ".join(self.names) or "none"
        claimed: set[str] = set()
        out = dict(args)
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
        return ReadOnlyArgs(out)

    # -- each step ------------------------------------------------------------------------------
    def update_state(self, share_inputs: ShareInputs) -> ProcessorResults:
        """Run every `update_state` (both stages) on step views of the engine's `share_inputs`;
        return the forced tokens that pass the checks and the requests to fail."""
        failures: dict[int, str] = {}
        engine_queues = share_inputs["forced_tokens"]
        queues = [list(q) for q in engine_queues]  # a processor sees what those before it forced
        view = self._view.build(share_inputs)
        self.registered.update_state(share_inputs, view, queues, failures)
        sampling = self._sampling_view(share_inputs)
        self.sampling_stage.update_state(sampling, {**view, "logits_processors_args": tuple(self._sampling_args)},
                                         queues, failures)
        forced = {slot: tuple(q[len(engine_queues[slot]):]) for slot, q in enumerate(queues)
                  if len(q) > len(engine_queues[slot])}
        return ProcessorResults(forced, failures)

    def apply(self, logits: paddle.Tensor, share_inputs: ShareInputs,
              all_greedy: bool) -> tuple[paddle.Tensor, dict[int, str]]:
        """Run the registered processors' `apply` in order on `[active, vocab]` logits; return them
        and {slot: error} failures."""
        failures: dict[int, str] = {}
        return self.registered.apply(logits, share_inputs, all_greedy, failures), failures

    def apply_sampling_params(self, logits: paddle.Tensor, share_inputs: ShareInputs,
                              all_greedy: bool) -> tuple[paddle.Tensor, dict[int, str]]:
        """Apply `SamplingParams.logit_bias`, then `bad_words`, through the built-in processors;
        return the logits and {slot: error} failures."""
        failures: dict[int, str] = {}
        return self.sampling_stage.apply(logits, self._sampling_view(share_inputs), all_greedy, failures), failures

    # -- the draft depths of a speculative verify pass (engine/stages.py: run_by_depth) -----------
    def speculation_blockers(self, args, params) -> list[str]:
        """The processors a request with these args and params enables that cannot take part in
        speculative decoding (`LogitsProcessor.supports_speculation_for`): it decodes without drafts."""
        return [name for stage in (self.registered, self.sampling_stage)
                for name, p in zip(stage.names, stage.processors)
                if type(p).is_enabled_by(args, params) and not p.supports_speculation_for(params)]

    def refine_drafts(self, slot: int, args, params, drafts: list[int], limit: int) -> list[int]:
        """A request's drafts through `refine_drafts` of each registered processor it enables; one
        that raises, runs past its time, or returns anything but token ids, is passed by (drafts
        only change speed)."""
        stage = self.registered
        for i, (name, p) in enumerate(zip(stage.names, stage.processors)):
            if not type(p).is_enabled_by(args, params) or not p.supports_speculation_for(params):
                continue
            refined, error = stage.call(i, p.refine_drafts, slot, list(drafts), limit)
            if error is not None:
                if not isinstance(error, ProcessorLate):
                    logger.error("logits processor %s failed to refine drafts; keeping them", name, exc_info=error)
                continue
            if isinstance(refined, list) and all(type(t) is int and 0 <= t < self.registered.vocab_size
                                                 for t in refined):
                drafts = refined[:limit]
        return drafts

    def takes_drafts(self, sampling_params: bool) -> bool:
        """Whether a processor of the stage that takes part serves a request this step (else the
        draft depths pass it by)."""
        return (self.sampling_stage if sampling_params else self.registered).takes_drafts()

    def apply_draft_depth(self, logits: paddle.Tensor, draft_inputs: ShareInputs, all_greedy: bool,
                          sampling_params: bool) -> tuple[paddle.Tensor, dict[int, str], dict[int, tuple[int, ...]]]:
        """The rows of one draft depth through the registered processors (or, with `sampling_params`,
        the request-level logit_bias / bad_words stage) that take part, shown `draft_inputs`;
        returns the logits, {slot: why} for rows that cannot be used and {slot: tokens} forced there."""
        stage, inputs = self._stage_inputs(draft_inputs, sampling_params)
        return stage.apply_draft(logits, inputs, self._draft_view.build(inputs), all_greedy)

    def restore_after_drafts(self, share_inputs: ShareInputs, sampling_params: bool) -> dict[int, str]:
        """Bring the processors that saw draft depths back to the step's real `share_inputs`;
        returns {slot: error} for the requests of a processor that failed to."""
        stage, inputs = self._stage_inputs(share_inputs, sampling_params)
        return stage.restore(inputs, self._draft_view.build(inputs))

    def _stage_inputs(self, share_inputs: ShareInputs, sampling_params: bool) -> tuple[_Stage, ShareInputs]:
        if sampling_params:
            return self.sampling_stage, self._sampling_view(share_inputs)
        return self.registered, share_inputs

    def _sampling_view(self, share_inputs: ShareInputs) -> ShareInputs:
        """`share_inputs` as the sampling stage sees it: each slot's args are its request's
        `SamplingParams` fields that the stage applies, read once per admission."""
        admissions = np.asarray(share_inputs["admission_ids"], dtype=np.int64)
        if len(self._sampling_admissions) != len(admissions):
            self._sampling_args = [ReadOnlyArgs() for _ in admissions]
            self._sampling_admissions = np.full(len(admissions), -2, dtype=np.int64)
        for slot in np.flatnonzero(admissions != self._sampling_admissions):
            params = share_inputs["sampling_params"][slot]
            values = {f: getattr(params, f, None) for f in SAMPLING_PARAMS_PROCESSORS}
            self._sampling_args[slot] = ReadOnlyArgs({k: v for k, v in values.items() if v is not None})
            self._sampling_admissions[slot] = admissions[slot]
        return {**share_inputs, "logits_processors_args": self._sampling_args}


class _Stage:
    """Processors that run together, in order: their calls, timings, time limit and failure isolation.

    Under a time limit each processor's calls run on its own `ProcessorThread`, waited for until its
    time this step is up (update_state and apply share it; each draft depth, and the return from
    the drafts, get it anew). A processor that `runs_in_place` is called on this thread and its time
    checked after each call: a slow call fails its requests once it returned."""

    def __init__(self, processors: list[LogitsProcessor], names: list[str], context: EngineContext):
        fd_config = context.config
        self.processors = processors
        self.names = names
        self.timings = {name: ProcessorTiming() for name in names}
        self.timeout_s = fd_config.logits_processor_timeout_s
        self.max_forced = fd_config.max_model_len  # no request can take more tokens than this
        # Checkpoints may pad the embedding past the tokenizer: those ids are no tokens.
        self.vocab_size = min(fd_config.model_config.vocab_size, context.tokenizer.vocab_size)
        self._threads = [None if self.timeout_s is None or type(p).runs_in_place else ProcessorThread(name)
                         for p, name in zip(processors, names)]
        self._enabled: list[bool] = [False] * len(processors)
        self._step_seconds = [0.0] * len(processors)  # this step's update_state + apply
        self._drafted = [False] * len(processors)  # saw a draft depth this step: restore() is due

    def update_state(self, share_inputs: ShareInputs, view: dict, queues: list[list[int]],
                     failures: dict[int, str]) -> None:
        """Each processor's `update_state` on its own copy of `view`; its forced tokens, once
        checked, join `queues` (this round's, where the next processor sees them)."""
        rows = _active_rows(share_inputs)
        for i, p in enumerate(self.processors):
            self._enabled[i] = any(type(p).is_enabled_by(a, sp) for _, a, sp in rows)
            mine = StepView.for_processor(view, queues)
            published = mine["forced_tokens"]  # read from here: the processor may drop the key
            start = time.perf_counter()
            _, error = self.call(i, p.update_state, mine)
            if isinstance(error, ProcessorLate):  # its call may still write `published`: none of it is read
                self._fail_enabled(i, rows, str(error), failures)
            else:
                for e in self._take_forced(i, error, published, rows, queues):
                    self._record_failure(i, e, rows, failures)
            elapsed = time.perf_counter() - start
            self.timings[self.names[i]].update_state_seconds += elapsed
            self._step_seconds[i] = elapsed
            self._check_time(i, rows, failures)

    def _take_forced(self, i, error, published, rows, queues) -> list[BaseException]:
        """Queue processor i's forced tokens if its result passes the checks; return its failures.

        A processor that failed as a whole publishes nothing. One that failed only some of its
        requests (`RequestFailures`) still publishes for the others: it may already count on them."""
        failed = set(error.failures) if isinstance(error, RequestFailures) else set()
        if error is not None and not failed:
            return [error]
        try:
            result = ForcedTokens.read(self.names[i], queues, published).without(failed)
            if result.tokens or failed:
                enabled = self._enabled_slots(i, rows)
                if not failed <= enabled:  # it blamed requests it does not serve: its own failure
                    return [error]
                result.check(enabled - failed, self.vocab_size, queues, self.max_forced)
        except ForcedTokensError as e:
            return [x for x in (error, e) if x is not None]
        result.append_to(queues)
        return [] if error is None else [error]

    def apply(self, logits: paddle.Tensor, share_inputs: ShareInputs, all_greedy: bool,
              failures: dict[int, str]) -> paddle.Tensor:
        todo = [i for i, p in enumerate(self.processors)
                if self._enabled[i] and not (all_greedy and type(p).argmax_invariant)]
        if not todo:
            return logits
        rows = _active_rows(share_inputs)
        for i in todo:
            start = time.perf_counter()
            out, error = self.call(i, _applied, self.processors[i], logits, spent_s=self._step_seconds[i])
            # By contract a processor writes only the rows it is enabled for, and when it fails (or is
            # left running) those requests fail, so the rest of the batch is still good.
            if error is None:
                logits = out
            else:
                self._isolate(i, error, rows, failures)
            elapsed = time.perf_counter() - start
            timing = self.timings[self.names[i]]
            timing.apply_seconds += elapsed
            timing.calls += 1
            self._step_seconds[i] += elapsed
            self._check_time(i, rows, failures)
        return logits

    def takes_drafts(self) -> bool:
        return any(on and type(p).supports_speculation for on, p in zip(self._enabled, self.processors))

    def apply_draft(self, logits: paddle.Tensor, share_inputs: ShareInputs, view: dict,
                    all_greedy: bool) -> tuple[paddle.Tensor, dict[int, str], dict[int, tuple[int, ...]]]:
        """One draft depth: each processor that takes part and serves a row here gets
        `update_draft_state` on `view`, then `apply`. Returns the logits, the rows that cannot be
        used ({slot: why}: a processor raised there, or named them in `RequestFailures` from
        `update_draft_state` and still applies to the others, so acceptance stops before them) and the
        tokens forced there ({slot: tokens}: plain decoding would append them unsampled at this
        position, so the engine does; tokens two processors force at one position are unusable)."""
        unusable: dict[int, str] = {}
        forced_here: dict[int, tuple[int, ...]] = {}
        rows = _active_rows(share_inputs)
        for i, p in enumerate(self.processors):
            enabled = self._enabled_slots(i, rows)
            if not enabled or not type(p).supports_speculation:
                continue
            self._drafted[i] = True
            mine = StepView.for_processor(view, [[] for _ in share_inputs["stop_flags"]])
            published, start = mine["forced_tokens"], time.perf_counter()
            _, error = self.call(i, p.update_draft_state, mine)
            if isinstance(error, RequestFailures) and error.failures.keys() <= enabled:
                for slot, message in error.failures.items():  # rows it cannot serve here; it serves the others
                    unusable.setdefault(slot, f"logits processor {self.names[i]}: {message}")
                error = None
            if error is None:
                self._take_draft_forced(i, published, enabled, forced_here, unusable)
                if not (all_greedy and type(p).argmax_invariant):
                    out, error = self.call(i, _applied, p, logits, spent_s=time.perf_counter() - start)
                    logits = logits if error is not None else out
            if error is not None:  # left running: restore() fails its requests
                for slot in enabled:
                    unusable.setdefault(slot, f"logits processor {self.names[i]} failed at a draft: {error}")
            self.timings[self.names[i]].apply_seconds += time.perf_counter() - start
        return logits, unusable, {slot: run for slot, run in forced_here.items() if slot not in unusable}

    def _take_draft_forced(self, i, published, enabled, forced_here, unusable) -> None:
        """Processor i's forced tokens at a draft depth, checked as a round's are; tokens that break
        the contract, or a second processor forcing the same row, make the rows unusable instead."""
        empty = [[] for _ in published] if isinstance(published, list) else []
        try:
            result = ForcedTokens.read(self.names[i], empty, published)
            result.check(enabled, self.vocab_size, empty, self.max_forced)
        except ForcedTokensError:
            for slot in enabled:
                unusable.setdefault(slot, f"logits processor {self.names[i]} forced tokens it may not here")
            return
        for slot, run in result.tokens.items():
            if slot in forced_here:
                unusable.setdefault(slot, f"logits processors {self.names[i]} and another forced tokens here")
            else:
                forced_here[slot] = tuple(int(t) for t in run)

    def restore(self, share_inputs: ShareInputs, view: dict) -> dict[int, str]:
        """`end_drafts` with the step's real state for each processor that saw a draft depth (its
        forced tokens are ignored: the step's own round took them); {slot: error} of those that raise."""
        failures: dict[int, str] = {}
        rows = _active_rows(share_inputs)
        for i in [i for i, drafted in enumerate(self._drafted) if drafted]:
            self._drafted[i] = False
            queues = [list(q) for q in share_inputs["forced_tokens"]]
            _, error = self.call(i, self.processors[i].end_drafts, StepView.for_processor(view, queues))
            if error is not None:
                self._isolate(i, error, rows, failures)
        return failures

    def call(self, i, fn, *args, spent_s: float = 0.0) -> tuple[object, BaseException | None]:
        """`fn(*args)` for processor i: on its thread, with what is left of its time this step
        (`spent_s` of it used), or in place. Returns (result, None) or (None, the exception to
        isolate: what it raised, or `ProcessorLate`)."""
        thread, limit = self._threads[i], self._limit(i)
        try:
            return (fn(*args) if thread is None else thread.call(limit, limit - spent_s, fn, *args)), None
        except BaseException as e:
            if not _raised(e):
                raise
            if isinstance(e, CallTimedOut):
                self.timings[self.names[i]].timeouts += 1
            return None, e

    def _limit(self, i) -> float | None:
        """Seconds processor i may use in one step: the stage's limit, or its own when longer."""
        own = self.processors[i].step_time_limit_s
        return self.timeout_s if self.timeout_s is None or own is None else max(self.timeout_s, own)

    def _isolate(self, i, error, rows, failures) -> None:
        if isinstance(error, ProcessorLate):  # its message says which: over the limit now, or still running
            self._fail_enabled(i, rows, str(error), failures)
        else:
            self._record_failure(i, error, rows, failures)

    def _check_time(self, i, rows, failures) -> None:
        """A processor called in place (not on its thread): fail the requests that enabled it if it
        has used more than its time this step, once the call that did returned."""
        limit = self._limit(i)
        if self._threads[i] is not None or limit is None or self._step_seconds[i] <= limit:
            return
        name = self.names[i]
        self.timings[name].timeouts += 1
        logger.warning("logits processor %s took %.2f s in one step (limit %g s); failing its requests",
                       name, self._step_seconds[i], limit)
        self._step_seconds[i] = 0.0  # counted once per step
        message = (f"logits processor {name} took longer than the per-step limit of {limit:g} s "
                   "(--logits-processor-timeout)")
        self._fail_enabled(i, rows, message, failures)

    def _record_failure(self, i, error, rows, failures):
        name = self.names[i]
        if isinstance(error, RequestFailures) and set(error.failures) <= self._enabled_slots(i, rows):
            # it named requests it serves: those fail, with its messages
            for slot, message in error.failures.items():
                failures.setdefault(slot, f"logits processor {name}: {message}")
            return
        # Anything else, a RequestFailures naming a slot that did not enable it (or holds no request)
        # included, is the processor's own failure: the requests that enabled it fail, no others.
        timing = self.timings[name]
        timing.failures += 1
        if timing.failures == 1:  # one traceback; a processor failing every step would flood the log
            logger.error("logits processor %s failed (later failures are counted, not traced)", name,
                         exc_info=error)
        elif _is_power_of_ten(timing.failures):
            logger.error("logits processor %s has failed %d times; latest: %s: %s", name, timing.failures,
                         type(error).__name__, error)
        self._fail_enabled(i, rows, f"logits processor {name} failed: {type(error).__name__}: {error}", failures)

    def _enabled_slots(self, i, rows) -> set[int]:
        """The active slots whose requests enabled processor i."""
        return {slot for slot, args, params in rows if type(self.processors[i]).is_enabled_by(args, params)}

    def _fail_enabled(self, i, rows, message, failures) -> None:
        for slot in self._enabled_slots(i, rows):
            failures.setdefault(slot, message)


def _applied(processor: LogitsProcessor, logits: paddle.Tensor) -> paddle.Tensor:
    """`processor.apply(logits)`, which must return a tensor of the logits' shape."""
    out = processor.apply(logits)
    if not isinstance(out, paddle.Tensor) or out.shape != logits.shape:
        raise TypeError(f"apply() must return the logits tensor of shape {logits.shape}")
    return out


def _active_rows(share_inputs: ShareInputs) -> list[tuple[int, LogitsProcessorArgs, object]]:
    """(slot, args, sampling params) of each active slot, in row order."""
    return [(s, share_inputs["logits_processors_args"][s], share_inputs["sampling_params"][s])
            for s in active_slots(share_inputs).tolist()]


def _is_power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1
