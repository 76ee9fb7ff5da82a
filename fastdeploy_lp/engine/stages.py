"""The sampling stages in the order they run: `STAGES` is the one place that order is written.

Every step hands its rows (`StepRows`: the logits and each row's request and position) once
through the stages, first to last. docs/logits_processors.md and its Chinese version print the
list from here (`stage_order_markdown`, `stage_order_line`; tests/test_sampling_stages.py keeps them
in step), so adding, removing or moving a stage is one edit.

How a stage's failure is contained belongs to its definition:
  * the processor stages isolate each processor: one that raises fails the requests that enabled
    it (`StepRows.failures`) and the other rows go on;
  * the sampler's stages from `min_tokens` to the draw (`retried_row_by_row`) run again one row at
    a time when they raise for the batch, so only the rows whose data raise fail;
  * a stage that raises otherwise (the penalties) fails the step's pass, as any bug does there.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import paddle

from fastdeploy_lp.engine.request import Logprob, Request
from fastdeploy_lp.engine.sampler import Sampler
from fastdeploy_lp.engine.draft_inputs import draft_share_inputs
from fastdeploy_lp.engine.step_rows import StepRows
from fastdeploy_lp.processors.base import ShareInputs
from fastdeploy_lp.processors.pipeline import LogitsProcessorPipeline
from fastdeploy_lp.processors.registry import SAMPLING_PARAMS_PROCESSORS

logger = logging.getLogger(__name__)


class SamplingStage(ABC):
    """One stage of the sampling path, over every row of a step at once."""

    name: ClassVar[str]
    summary: ClassVar[str]                        # its entry in the docs' stage list
    runs_processors: ClassVar[bool] = False       # it runs logits processors (needs the pipeline)
    retried_row_by_row: ClassVar[bool] = False    # see the module docstring

    def __init__(self, sampler: Sampler, pipeline: LogitsProcessorPipeline | None,
                 share_inputs: ShareInputs | None):
        self.sampler = sampler
        self.pipeline = pipeline
        self.share_inputs = share_inputs

    @abstractmethod
    def apply(self, rows: StepRows) -> None:
        """Replace `rows.logits` or `rows.probs` (the draw sets `rows.tokens`); a request that cannot
        go on is recorded in `rows.failures`."""


class SamplerStage(SamplingStage):
    """A stage the `Sampler` runs: its method of the stage's name."""

    def apply(self, rows: StepRows) -> None:
        getattr(self.sampler, self.name)(rows)


class LogitsProcessors(SamplingStage):
    name = "logits_processors"
    summary = ("the guided-decoding mask (and the custom guided backends' processors), then the processors "
               "registered with `--logits-processors` / `LLM(logits_processors=...)`, in registration order")
    runs_processors = True

    def apply(self, rows: StepRows) -> None:
        run_by_depth(rows, self.share_inputs, self.pipeline, self.pipeline.apply, sampling_params=False)


def run_by_depth(rows: StepRows, share_inputs: ShareInputs, pipeline: LogitsProcessorPipeline, apply,
                 sampling_params: bool) -> None:
    """Processors over every row: the depth-0 rows (a plain step's) through `apply` as always; in a
    verify pass each further depth's rows through the processors that take part in speculation,
    shown `share_inputs` as of that position (`draft_share_inputs`), and then their state brought
    back to the step's real one. What fails at a draft depth only ends acceptance there; tokens
    forced there are appended as plain decoding would append them (`StepRows.emitted`)."""
    groups = rows.depth_groups()
    drafting = len(groups) > 1 and pipeline.takes_drafts(sampling_params)
    parts = []
    for depth, start, end in groups:
        logits = rows.logits if len(groups) == 1 else rows.logits[start:end]
        greedy = all(rows.greedy[start:end])
        failures = {}
        if depth == 0:
            logits, failures = apply(logits, share_inputs, greedy)
        elif drafting:
            logits, failures, forced = pipeline.apply_draft_depth(
                logits, draft_share_inputs(share_inputs, rows.drafts, depth), greedy, sampling_params)
            rows.force(forced, depth)
        rows.fail_slots(failures, depth)
        parts.append(logits)
    if drafting:
        rows.fail_slots(pipeline.restore_after_drafts(share_inputs, sampling_params))
    rows.logits = parts[0] if len(parts) == 1 else paddle.concat(parts)


class Penalties(SamplerStage):
    name = "penalties"
    summary = "repetition penalty over prompt + output, frequency and presence penalties over output"


class RequestBiasAndBadWords(SamplingStage):
    name = "request_logit_bias_bad_words"
    summary = ("the request's own " + " then ".join(
        f"`SamplingParams.{field}` (through `{processor}`)" for field, processor in SAMPLING_PARAMS_PROCESSORS.items())
        + ", whether or not those processors are registered")
    runs_processors = True

    def apply(self, rows: StepRows) -> None:
        run_by_depth(rows, self.share_inputs, self.pipeline, self.pipeline.apply_sampling_params,
                     sampling_params=True)


class MinTokens(SamplerStage):
    name = "min_tokens"
    summary = "EOS and `stop_token_ids` banned until the request has `min_tokens` tokens"
    retried_row_by_row = True


class Temperature(SamplerStage):
    name = "temperature"
    summary = "softmax of the logits over the row's temperature (greedy rows, temperature 0, skip it)"
    retried_row_by_row = True


class MinP(SamplerStage):
    name = "min_p"
    summary = "probabilities below `min_p` times the row's largest set to zero"
    retried_row_by_row = True


class TopKTopP(SamplerStage):
    name = "top_k_top_p"
    summary = "what the row's own `top_k` and `top_p` leave out set to zero"
    retried_row_by_row = True


class Draw(SamplerStage):
    name = "draw"
    summary = ("the argmax for greedy rows, else a Gumbel-max draw seeded by (request seed, position); "
               "logprobs from the logits after `min_tokens`")
    retried_row_by_row = True


STAGES: tuple[type[SamplingStage], ...] = (
    LogitsProcessors, Penalties, RequestBiasAndBadWords, MinTokens, Temperature, MinP, TopKTopP, Draw)


def stage_order_markdown() -> str:
    """The numbered stage list docs/logits_processors.md prints."""
    return "\n".join(f"{i}. `{stage.name}`: {stage.summary}" for i, stage in enumerate(STAGES, 1))


def stage_order_line() -> str:
    """The stage names in order, as one line (docs/zh/logits_processors.md prints it)."""
    return " → ".join(f"`{stage.name}`" for stage in STAGES)


class SamplingStages:
    """`STAGES` built for one engine, run in one pass per step."""

    def __init__(self, sampler: Sampler, pipeline: LogitsProcessorPipeline | None = None,
                 share_inputs: ShareInputs | None = None):
        """Without a processor pipeline (a sampler used on its own) the processor stages are left out."""
        stages = [cls(sampler, pipeline, share_inputs) for cls in STAGES
                  if pipeline is not None or not cls.runs_processors]
        first = next(i for i, stage in enumerate(stages) if stage.retried_row_by_row)
        self.stages = stages
        self._leading, self._tail = stages[:first], stages[first:]

    def sample(self, logits: paddle.Tensor, requests: list[Request]) -> StepRows:
        """Each request's next token from its row of `logits`."""
        return self.run(StepRows.of(logits, requests))

    def run(self, rows: StepRows) -> StepRows:
        """Hand `rows` through every stage in order; they come back with tokens, logprobs and failures."""
        for stage in self._leading:
            stage.apply(rows)
        logits, probs = rows.logits, rows.probs
        try:
            self._run_tail(rows)
        except Exception:
            if len(rows.requests) == 1:
                raise
            rows.logits, rows.probs = logits, probs
            self._run_tail_row_by_row(rows)
        return rows

    def _run_tail(self, rows: StepRows) -> None:
        for stage in self._tail:
            stage.apply(rows)

    def _run_tail_row_by_row(self, rows: StepRows) -> None:
        """The batch raised in the stages from `min_tokens` on: each row alone, so only rows whose
        data raise fail (rare, so the per-row host work is affordable here)."""
        tokens = np.zeros(len(rows.requests), dtype=np.int64)
        logprobs: list[Logprob | None] = [None] * len(rows.requests)
        for i, request in enumerate(rows.requests):
            one = rows.row(i)
            try:
                self._run_tail(one)
            except Exception as e:
                logger.exception("sampling failed for request %s", request.request_id)
                rows.fail(i, f"sampling failed: {type(e).__name__}: {e}")
                continue
            tokens[i], logprobs[i] = one.tokens[0], one.logprobs[0]
            rows.fail_slots(one.failures)
            for slot, depth in one.truncated.items():
                rows.truncate([slot], depth)
        rows.tokens, rows.logprobs = tokens, logprobs
