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
engine appends without sampling — in one pass with fast-forward, one per step without, same output.
`apply` joins it and sets every disallowed logit of the constrained rows to -inf, in place, in one
masked fill (`bitmask.py`): off the CPU the packed bits (1 per token) are uploaded and expanded on
the logits' device; on the CPU numpy unpacks them (faster there). Unconstrained rows are untouched.

Ending: while the grammar is complete the mask admits EOS (the request may stop there); once it
cannot continue, EOS is the only token left, so the request finishes with "stop" — unless
`max_tokens` comes first ("length"). A request never ends with text its constraint rejects: a token
the matcher rejects (another processor or a sampling option overrode the mask), forced tokens it
cannot take, a matcher that enters an error state (llguidance's lexer or parser limits, hit while
consuming or while filling the mask) and a mask that allows nothing but EOS while the grammar is
not complete each fail only that request (finish reason "error", the matcher's message) — from
`update_state` when found there, else from `apply`, which masks every row in place first and then
raises `RequestFailures`, so the failed request is not sampled and the others are still masked.

Compiling (`compiler.py`, `sandbox.py`) happens at admission, in a compile-worker process first.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance as llg
import numpy as np
import paddle
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from fastdeploy_lp.config import FDConfig
from fastdeploy_lp.processors.base import AddedRequest, LogitsProcessor, RequestFailures, ShareInputs, active_slots
from fastdeploy_lp.processors.batch_state import BatchTracker
from fastdeploy_lp.processors.context import EngineContext
from fastdeploy_lp.processors.guided.bitmask import mask_logits, words_for
from fastdeploy_lp.processors.guided.closing import TOP_K, LengthCloser
from fastdeploy_lp.processors.guided.closing_search import MAX_CLOSING_BYTES, ClosingSearch
from fastdeploy_lp.processors.guided.compiler import GrammarCompiler
from fastdeploy_lp.processors.guided.constraint import CompiledConstraint, allows_other_than, dead_end
from fastdeploy_lp.processors.guided.json_syntax import JsonSyntax
from fastdeploy_lp.processors.guided.slot_matcher import DraftWalk, ReasoningGate, SlotMatcher
from fastdeploy_lp.processors.guided.tokenizer import build_lltokenizer, lltokenizer_spec
from fastdeploy_lp.processors.tensor_ops import fill_at
from fastdeploy_lp.reasoning import ReasoningState, get_reasoning_parser
from fastdeploy_lp.sampling_params import CLOSED_ON_LENGTH

logger = logging.getLogger(__name__)

COMPILED = "guided_decoding.compiled"  # key in SamplingParams.extra set at admission
CLOSING = "guided_decoding.closing"  # ... and, for close_on_length, (the shortest closing, the schema's step bound)
_PROMPT_TAIL = 64  # prompt tokens read to tell whether the output starts inside a reasoning block


class GuidedDecodingLogitsProcessor(LogitsProcessor):
    serves_guided_decoding = True
    uses_engine_context = True  # grammars compile against the engine's tokenizer
    supports_speculation = True  # the matchers advance over drafts and roll back: update_draft_state

    def __init__(self, fd_config: FDConfig, context: EngineContext):
        super().__init__(fd_config)
        self.whitespace_pattern = fd_config.guided_whitespace_pattern
        self.close_on_length = fd_config.guided_close_on_length
        self.number_digits = fd_config.guided_json_number_digits
        self._closing_search: ClosingSearch | None = None
        self.tokenizer = tokenizer = context.tokenizer
        self.reasoning = get_reasoning_parser(fd_config.reasoning_parser)
        if self.reasoning is not None:
            self._start_ids = tokenizer.encode(self.reasoning.start, add_special_tokens=False)
            self._end_ids = tokenizer.encode(self.reasoning.end, add_special_tokens=False)
        eos = list(fd_config.model_config.eos_token_ids)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        self.vocab_size = max(fd_config.model_config.vocab_size, tokenizer.vocab_size)
        self.eos_token_ids = eos
        self.compiler = GrammarCompiler(build_lltokenizer(tokenizer, self.vocab_size, eos),
                                        tokenizer_spec=lltokenizer_spec(tokenizer, self.vocab_size, eos))
        self._batch = BatchTracker()
        self._slots: list[SlotMatcher | None] = [None] * fd_config.max_num_seqs
        self._bitmask = allocate_token_bitmask(fd_config.max_num_seqs, self.vocab_size)
        self._executor = llg.LLExecutor()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="guided-mask")
        self._fill: Future | None = None
        self._rows: list[int] = []  # logits rows with a mask this step (bitmask row j <-> self._rows[j])
        self._row_slots: list[int] = []  # ... and their slots
        self._row_matchers: list[llg.LLMatcher] = []  # ... and their matchers
        self._row_extra: list[tuple[int, int]] = []  # (bitmask row, token) also allowed: a reasoning start
        self._zone: list[tuple[int, SlotMatcher]] = []  # (bitmask row, slot) near its closing reserve
        self._thinking_rows: list[int] = []  # logits rows of requests still thinking: EOS is banned there
        self._walks: dict[int, DraftWalk] = {}  # slot -> how far this step's verify pass took it through its drafts

    # -- admission ------------------------------------------------------------------------------
    def validate_request(self, params) -> None:
        """Compile the request's constraint (cached); a bad one raises ValueError naming the field."""
        if params.guided_decoding is not None:
            params.extra[COMPILED] = self.compiler.compile(self._with_server_defaults(params.guided_decoding))
            if self._closes_on_length(params.guided_decoding):
                self._check_room_to_close(params)
                # The requests (ids) whose output was closed: the engine reports it (`closed_on_length`).
                # Made here, on the request's own params; the copies processors get share this set.
                params.extra.setdefault(CLOSED_ON_LENGTH, set())

    def _check_room_to_close(self, params) -> None:
        """A budget smaller than the shortest document the constraint allows could never be closed
        (with a reasoning parser, plus both tags: the model may open its thinking at the first token,
        and be thinking when the budget runs out); nor could a schema whose shortest document is
        longer than the closing search goes. Keeps that closing and the schema's step bound
        (`closing_bound.py`) for the request's closer."""
        compiled = params.extra[COMPILED]
        if "shortest_closing" not in compiled.derived:  # the same for every request with this constraint
            compiled.derived["shortest_closing"] = self._search().closing(compiled.new_matcher(), JsonSyntax())
        closing = compiled.derived["shortest_closing"]
        if closing is None:
            raise ValueError(f"max_tokens: close_on_length cannot close this JSON constraint: its shortest document "
                             f"is longer than {MAX_CLOSING_BYTES} bytes, or it has none")
        tags = len(self._start_ids) + len(self._end_ids) if self.reasoning is not None else 0
        if params.max_tokens is not None and len(closing) + tags > params.max_tokens:
            also = f" plus the reasoning tags {self.reasoning.start} {self.reasoning.end} ({tags} tokens)" if tags else ""
            raise ValueError(f"max_tokens: close_on_length needs room for the shortest output this JSON constraint "
                             f"allows ({len(closing)} tokens){also}; max_tokens is {params.max_tokens}")
        step = compiled.closing_step
        if step is None:  # every token the model picks near the end is then checked by a search
            logger.info("close_on_length: no step bound for this schema; each token is checked near the end")
        params.extra[CLOSING] = (closing, MAX_CLOSING_BYTES if step is None else step)

    def _search(self) -> ClosingSearch:
        if self._closing_search is None:  # built at the first request that closes on length
            self._closing_search = ClosingSearch(self.compiler.lltokenizer, self.tokenizer.token_bytes,
                                                 self.vocab_size)
        return self._closing_search

    def _closes_on_length(self, gd) -> bool:
        """The request's close_on_length, else the server's default for JSON constraints."""
        if gd.close_on_length is not None:
            return gd.close_on_length
        return self.close_on_length and set(gd.kinds()) <= {"json", "json_object"}

    def _with_server_defaults(self, gd):
        """The server's JSON whitespace rule (`--guided-whitespace-pattern`) and number cap
        (`--guided-json-number-digits`) where the request sets none."""
        if gd.whitespace_pattern is None and self.whitespace_pattern is not None:
            gd = dataclasses.replace(gd, whitespace_pattern=self.whitespace_pattern)
        if gd.max_number_digits is None and self.number_digits:
            gd = dataclasses.replace(gd, max_number_digits=self.number_digits)
        return gd

    @classmethod
    def declared_keys(cls) -> frozenset[str]:
        """No `logits_processors_args` keys: requests reach it through `SamplingParams.guided_decoding`.
        (Returning None would make the pipeline accept any unknown key.)"""
        return frozenset()

    @classmethod
    def is_enabled_by(cls, args, params=None) -> bool:
        return params is not None and params.guided_decoding is not None

    # -- each step ------------------------------------------------------------------------------
    def update_state(self, share_inputs: ShareInputs) -> None:
        self._join()
        self._clear_rows()
        update = self._batch.update(share_inputs)
        for slot in update.removed:
            self._slots[slot] = None
        for request in update.added:  # a matcher for each constrained request that joined
            self._slots[request.slot] = self._new_matcher(request, share_inputs)
        failures = {}
        forced = share_inputs.get("forced_tokens")  # the engine appends them (at once with fast-forward)
        for row, slot in enumerate(update.slots.tolist()):
            state = self._slots[slot]
            if state is None:
                continue
            error = state.step(None if forced is None else forced[slot])
            if error is not None:
                failures[slot] = error
                self._slots[slot] = None
            elif state.gate is None or state.gate.state != ReasoningState.REASONING:
                self._add_row(row, slot, state)
                if state.closer is not None and not state.ahead and state.closer.in_zone(state.budget):
                    self._zone.append((len(self._rows) - 1, state))
            else:  # thinking: no mask, but no EOS
                self._thinking_rows.append(row)
        if failures:
            self._clear_rows()
            raise RequestFailures(failures)
        if self._rows:
            work = [(matcher, j) for j, matcher in enumerate(self._row_matchers)]  # bitmask row j
            self._fill = self._worker.submit(fill_next_token_bitmask_par, self._executor, work, self._bitmask)

    def _add_row(self, row: int, slot: int, state: SlotMatcher) -> None:
        """Logits row `row` (slot `slot`) gets a mask this step, from bitmask row `len(self._rows)`."""
        if state.gate is not None and state.gate.state == ReasoningState.UNDECIDED:
            self._row_extra.append((len(self._rows), state.gate.start_first))
        self._rows.append(row)
        self._row_slots.append(slot)
        self._row_matchers.append(state.matcher)

    def _clear_rows(self) -> None:
        self._rows, self._row_slots, self._row_matchers, self._row_extra, self._zone = [], [], [], [], []
        self._thinking_rows = []

    def apply(self, logits: paddle.Tensor) -> paddle.Tensor:
        if self._thinking_rows:  # the output may not end before the answer the constraint asks for
            eos = np.asarray(self.eos_token_ids, dtype=np.int64)
            logits = fill_at(logits, np.repeat(self._thinking_rows, len(eos)), np.tile(eos, len(self._thinking_rows)))
        if not self._rows:
            return logits
        self._join()
        rows = len(self._rows)
        bits = self._bitmask[:rows]
        words = bits.view(np.uint32)
        for j, token in self._row_extra:  # an output that may still open its reasoning block
            words[j, token >> 5] |= np.uint32(1 << (token & 31))
        failures = self._dead_rows(bits)
        # In place, on the logits' device: the packed bits are expanded there (numpy unpacks on CPU).
        masked = mask_logits(logits, bits, None if rows == logits.shape[0] else self._rows)
        if self._zone:
            self._keep_tokens_that_can_close(masked)
        if failures:  # every row is masked in place, then only the dead requests fail (they are not sampled)
            raise RequestFailures(failures)
        return masked

    def _dead_rows(self, bits: np.ndarray) -> dict[int, str]:
        """{slot: message} for rows whose matcher erred while filling its mask, or whose mask allows
        nothing but EOS although the constraint is not complete."""
        more_than_eos = allows_other_than(bits, self.eos_token_ids)
        failures = {}
        for j, matcher in enumerate(self._row_matchers):
            if not more_than_eos[j] or matcher.is_error():
                problem = dead_end(matcher, bits[j], self.eos_token_ids)
                if problem:
                    failures[self._row_slots[j]] = f"guided decoding: the grammar engine failed: {problem}"
        return failures

    def _keep_tokens_that_can_close(self, logits: paddle.Tensor) -> None:
        """Rows in their closing zone (`closing.py`) keep only the tokens after which a closing still
        fits the budget: those whose possible growth fits, and those of their `TOP_K` most likely
        allowed tokens (their probability at the request's temperature) a closing was found for."""
        rows = [self._rows[j] for j, _ in self._zone]
        index = paddle.to_tensor(np.asarray(rows, dtype=np.int64), place=logits.place)
        values, ids = paddle.topk(paddle.index_select(logits, index), min(TOP_K, logits.shape[-1]))
        values, ids = values.numpy(), ids.numpy()
        keep = np.zeros((len(rows), words_for(logits.shape[-1])), dtype=np.uint32)
        eos = set(self.eos_token_ids)
        for i, (_, state) in enumerate(self._zone):
            finite = np.isfinite(values[i])
            scaled = values[i][finite] / max(state.params.temperature or 0.0, 1e-3)  # the request's sampling
            probs = np.exp(scaled - scaled.max()) if len(scaled) else scaled
            candidates = list(zip(ids[i][finite].tolist(), (probs / max(probs.sum(), 1e-30)).tolist()))
            words = state.closer.keep_words(state.matcher, candidates, state.budget, eos)
            keep[i, :len(words)] = words[:keep.shape[1]]
        mask_logits(logits, keep.view(np.int32), rows)

    # -- speculative decoding -----------------------------------------------------------------------
    def update_draft_state(self, share_inputs: ShareInputs) -> None:
        """A draft depth: each constrained slot shown takes its drafts so far as `advance` takes
        output — through its reasoning gate (a copy, put back by `end_drafts`) while the model
        thinks, else consumed by the matcher, which `end_drafts` rolls back — and its row is masked
        as plain decoding would mask it there. A matcher that rejects a draft gets no mask: the row
        before already masked that draft out, so this row is never used. Where the grammar (or a
        reasoning start tag) forces tokens, they are published: plain decoding would append them
        unsampled there, and so does the engine. A draft the gate cannot take (an end tag merged
        with answer text) makes the slot's row unusable, as it would fail the request there."""
        self._join()
        self._clear_rows()
        unusable = {}
        for row, slot in enumerate(active_slots(share_inputs).tolist()):
            state = self._slots[slot]
            if state is None:
                continue
            if state.ahead:  # never drafted: the engine drafts for no request with forced tokens queued
                raise RuntimeError(f"slot {slot}: shown a draft depth with forced tokens still queued")
            walk = self._walks.get(slot)
            if walk is None:
                walk = self._walks[slot] = DraftWalk(state)
            error = walk.take(state, share_inputs["output_ids"][slot][state.consumed + walk.walked:])
            if error is not None:
                unusable[slot] = error
                continue
            if walk.rejected:
                continue
            if walk.near_closing(state):
                unusable[slot] = "close_on_length: its closing may be due here, decided step by step"
                continue
            forced = share_inputs["forced_tokens"][slot]
            if not state.answering:
                if state.gate.state == ReasoningState.REASONING:
                    forced.extend(state.gate.take_forced_start())
                    if not forced:  # thinking: no mask, but no EOS
                        self._thinking_rows.append(row)
                    continue
            elif not state.matcher.is_stopped():
                forced.extend(state.matcher.compute_ff_tokens())
            if not forced:
                self._add_row(row, slot, state)
        if self._rows:
            work = [(matcher, j) for j, matcher in enumerate(self._row_matchers)]
            self._fill = self._worker.submit(fill_next_token_bitmask_par, self._executor, work, self._bitmask)
        if unusable:
            raise RequestFailures(unusable)

    def refine_drafts(self, slot: int, drafts: list[int], limit: int) -> list[int]:
        """Drafts the grammar agrees with: the lookup's drafts while the grammar accepts them, and
        where it forces tokens, those in their place (plain decoding appends them for certain, so
        verifying them costs a row and never fails), up to `limit`. The matcher walks them and is
        rolled back."""
        self._join()  # this step's mask fill reads the matchers
        state = self._slots[slot]
        if state is None or state.ahead or not state.answering:
            return drafts
        if state.closer is not None and not state.closer.dormant(state.budget - 1):
            return []  # its closing may be due at the first draft: no draft row could be used
        matcher, refined, guessed = state.matcher, [], 0
        try:
            while len(refined) < limit and not matcher.is_stopped():
                step = matcher.compute_ff_tokens()
                if step:  # the lookup's guesses past here hold only if they were these very tokens
                    guessed = guessed + len(step) if drafts[guessed:guessed + len(step)] == step else len(drafts)
                elif guessed < len(drafts) and matcher.validate_tokens(drafts[guessed:guessed + 1]):
                    step, guessed = drafts[guessed:guessed + 1], guessed + 1
                elif step := self._forced_bytes_guess(matcher):  # the lookup's guesses no longer line up
                    guessed = len(drafts)
                else:
                    break
                if not matcher.consume_tokens(step):
                    raise RuntimeError(state.error())
                refined += step
        except Exception as e:
            state.failure = f"guided decoding: the grammar engine failed on drafts: {e}"
            raise
        finally:
            if refined and not matcher.rollback(len(refined)):
                state.failure = f"guided decoding: the grammar engine could not roll back drafts: {state.error()}"
        return refined[:limit]

    def _forced_bytes_guess(self, matcher) -> list[int]:
        """Tokens for the bytes the grammar forces but `compute_ff_tokens` leaves out (longer tokens
        start with them: the ` "` before a string value, the space before a number): a guess, not
        forced, since the model may write the same bytes in other tokens; verifying it costs a row."""
        forced = matcher.compute_ff_bytes()
        if not forced:
            return []
        tokens = self.compiler.lltokenizer.tokenize_bytes(forced)
        return tokens[:matcher.validate_tokens(tokens)]

    def end_drafts(self, share_inputs: ShareInputs) -> None:
        """Put every matcher and reasoning gate back where the step left them; the accepted tokens
        reach them through the output at the next step, as any tokens do."""
        self._join()
        self._clear_rows()
        failures = {}
        for slot, walk in self._walks.items():
            state = self._slots[slot]
            if state is not None and not walk.restore(state):
                failures[slot] = (f"guided decoding: the grammar engine could not roll back {walk.consumed} drafts: "
                                  f"{state.error()}")
                self._slots[slot] = None
        self._walks = {}
        if failures:
            raise RequestFailures(failures)

    # -- helpers --------------------------------------------------------------------------------
    def _new_matcher(self, request: AddedRequest, share_inputs: ShareInputs) -> SlotMatcher | None:
        """A matcher for a request that joined, if it is constrained."""
        params = request.params
        if params is None or params.guided_decoding is None:
            return None
        compiled: CompiledConstraint | None = params.extra.get(COMPILED)
        if compiled is None:  # admitted without validate_request: compile now (cached)
            compiled = params.extra[COMPILED] = self.compiler.compile(
                self._with_server_defaults(params.guided_decoding))
        return SlotMatcher(compiled.new_matcher(), share_inputs["output_ids"][request.slot],
                            self._reasoning_gate(share_inputs, request.slot), self._length_closer(params), params,
                            request.req_id)

    def _length_closer(self, params) -> LengthCloser | None:
        """A closer if the request closes on length (decided in `validate_request`)."""
        if CLOSED_ON_LENGTH not in params.extra or params.max_tokens is None:
            return None
        closing, step = params.extra.get(CLOSING) or (None, MAX_CLOSING_BYTES)
        return LengthCloser(self._search(), step, closing)

    def _reasoning_gate(self, share_inputs: dict, slot: int) -> ReasoningGate | None:
        """With a reasoning parser: where this request's output starts, read from its prompt's end."""
        if self.reasoning is None:
            return None
        tail = self.tokenizer.decode(share_inputs["prompt_ids"][slot][-_PROMPT_TAIL:], skip_special_tokens=False)
        return ReasoningGate(self.reasoning, self.reasoning.prompt_state(tail), self._start_ids, self._end_ids,
                              self.tokenizer.token_bytes)

    def _join(self) -> None:
        if self._fill is not None:
            fill, self._fill = self._fill, None
            fill.result()
