"""`GuidedDecodingLogitsProcessor`: each constrained request's next token must fit its grammar.

Installed by the engine ahead of the registered processors (unless `guided_decoding_backend` is
"off"); requests turn it on with `SamplingParams(guided_decoding=GuidedDecodingParams(...))`:

    params = SamplingParams(temperature=1.0, max_tokens=64, guided_decoding=GuidedDecodingParams(
        json={"type": "object", "properties": {"population": {"type": "integer"}},
              "required": ["population"], "additionalProperties": False}))
    print(LLM(model).generate("France: ", params)[0].outputs.text)   # {"population": 67}

Per step: `update_state` feeds every constrained slot's newly generated tokens to its llguidance
matcher (one per slot, a copy of the compiled template made when the request joins) and starts
the batch's bitmask fill on a worker thread (llguidance fills the rows in parallel without the
GIL), so it runs while the model computes the logits. Tokens the grammar forces (`{"name": "` after
`{` in a schema with one required key) are published in `share_inputs["forced_tokens"]`, which the
engine appends without sampling — in one pass with fast-forward, one per step without, same output. `apply` joins it, unpacks the bits with
numpy, uploads the `[constrained rows, vocab]` mask once and sets every disallowed logit of those
rows to -inf in one `paddle.where`; unconstrained rows are untouched.

Ending: while the grammar is complete the mask admits EOS (the request may stop there); once it
cannot continue, EOS is the only token left, so the request finishes with "stop" — unless
`max_tokens` comes first ("length"). A token the matcher rejects (another processor or a sampling
option overrode the mask) fails only that request, with the matcher's message.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance as llg
import numpy as np
import paddle
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from ..base import LogitsProcessor, RequestFailures
from .compiler import CompiledConstraint, GrammarCompiler
from .tokenizer import build_lltokenizer

logger = logging.getLogger(__name__)

COMPILED = "guided_decoding.compiled"  # key in SamplingParams.extra set at admission


class _SlotMatcher:
    """One request's matcher and how far through the request's output it is."""

    def __init__(self, matcher: llg.LLMatcher, output_ids: list[int]):
        self.matcher = matcher
        self.output_ids = output_ids  # the request's live list: identifies the request in the slot
        self.consumed = 0  # output tokens accounted for
        self.ahead: deque[int] = deque()  # published forced tokens the matcher has consumed already

    def advance(self) -> str | None:
        """Consume the tokens generated since the last call; an error message if one is rejected."""
        for token in self.output_ids[self.consumed:]:
            self.consumed += 1
            if self.ahead and self.ahead[0] == token:  # a forced token we published, now in the output
                self.ahead.popleft()
                continue
            if self.ahead:  # the output went another way: forget what we had assumed
                self.matcher.rollback(len(self.ahead))
                self.ahead.clear()
            if not self.matcher.consume_token(token):
                return f"guided decoding: generated token does not fit the constraint: {self.matcher.get_error()}"
        return None

    def publish_forced(self, forced: list[int]) -> None:
        """Append the tokens the grammar forces next to `forced` (share_inputs["forced_tokens"][slot])
        and consume them now, as the engine's contract asks; they come back through `output_ids`."""
        if self.ahead or self.matcher.is_stopped():
            return
        tokens = self.matcher.compute_ff_tokens()
        if tokens and self.matcher.consume_tokens(tokens):
            self.ahead.extend(tokens)
            forced.extend(tokens)


class GuidedDecodingLogitsProcessor(LogitsProcessor):
    def __init__(self, fd_config):
        super().__init__(fd_config)
        tokenizer = fd_config.tokenizer
        if tokenizer is None:
            from fastdeploy_lp.tokenizer import Tokenizer

            tokenizer = Tokenizer(fd_config.model_config.model)
        eos = list(fd_config.model_config.eos_token_ids)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        self.vocab_size = max(fd_config.model_config.vocab_size, tokenizer.vocab_size)
        self.compiler = GrammarCompiler(build_lltokenizer(tokenizer, self.vocab_size, eos))
        self._slots: list[_SlotMatcher | None] = [None] * fd_config.max_num_seqs
        self._bitmask = allocate_token_bitmask(fd_config.max_num_seqs, self.vocab_size)
        self._executor = llg.LLExecutor()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="guided-mask")
        self._fill: Future | None = None
        self._rows: list[int] = []  # logits rows with a mask this step (bitmask row j <-> self._rows[j])

    # -- admission ------------------------------------------------------------------------------
    def validate_request(self, params) -> None:
        """Compile the request's constraint (cached); a bad one raises ValueError naming the field."""
        if params.guided_decoding is not None:
            params.extra[COMPILED] = self.compiler.compile(params.guided_decoding)

    @classmethod
    def declared_keys(cls) -> frozenset[str]:
        """No `logits_processors_args` keys: requests reach it through `SamplingParams.guided_decoding`.
        (Returning None would make the pipeline accept any unknown key.)"""
        return frozenset()

    @classmethod
    def is_enabled_by(cls, args, params=None) -> bool:
        return params is not None and params.guided_decoding is not None

    # -- each step ------------------------------------------------------------------------------
    def update_state(self, share_inputs: dict) -> None:
        self._join()
        self._rows = []
        slots = np.flatnonzero(~np.asarray(share_inputs["stop_flags"], dtype=bool))
        live = set(slots.tolist())
        for s in range(len(self._slots)):
            if s not in live:
                self._slots[s] = None
        failures, work = {}, []
        forced = share_inputs.get("forced_tokens")  # the engine appends them (at once with fast-forward)
        for row, slot in enumerate(slots.tolist()):
            state = self._slot(slot, share_inputs)
            if state is None:
                continue
            error = state.advance()
            if error is not None:
                failures[slot] = error
                self._slots[slot] = None
                continue
            if forced is not None:
                state.publish_forced(forced[slot])
            work.append((state.matcher, len(self._rows)))
            self._rows.append(row)
        if failures:
            self._rows = []
            raise RequestFailures(failures)
        if work:
            self._fill = self._worker.submit(fill_next_token_bitmask_par, self._executor, work, self._bitmask)

    def apply(self, logits: paddle.Tensor) -> paddle.Tensor:
        if not self._rows:
            return logits
        self._join()
        rows, width = len(self._rows), logits.shape[-1]
        allowed = np.unpackbits(self._bitmask[:rows].view(np.uint8), axis=1, bitorder="little")[:, :width]
        if allowed.shape[1] < width:  # logits wider than the vocabulary we know: the rest is never allowed
            allowed = np.pad(allowed, ((0, 0), (0, width - allowed.shape[1])))
        mask = paddle.to_tensor(allowed.astype(bool), place=logits.place)
        banned = paddle.full([1], float("-inf"), dtype=logits.dtype)
        if rows == logits.shape[0]:
            return paddle.where(mask, logits, banned)
        index = paddle.to_tensor(self._rows, dtype="int64", place=logits.place)
        part = paddle.where(mask, paddle.index_select(logits, index), banned)
        return paddle.scatter(logits, index, part, overwrite=True)

    # -- helpers --------------------------------------------------------------------------------
    def _slot(self, slot: int, share_inputs: dict) -> _SlotMatcher | None:
        """The slot's matcher, made when a constrained request has just joined it."""
        output_ids = share_inputs["output_ids"][slot]
        state = self._slots[slot]
        if state is not None and state.output_ids is output_ids:
            return state
        params = share_inputs["sampling_params"][slot]
        state = None
        if params is not None and params.guided_decoding is not None:
            compiled: CompiledConstraint | None = params.extra.get(COMPILED)
            if compiled is None:  # admitted without validate_request: compile now (cached)
                compiled = params.extra[COMPILED] = self.compiler.compile(params.guided_decoding)
            state = _SlotMatcher(compiled.new_matcher(), output_ids)
        self._slots[slot] = state
        return state

    def _join(self) -> None:
        if self._fill is not None:
            fill, self._fill = self._fill, None
            fill.result()
