"""`LLMEngine`: requests in, one continuous-batching step at a time, `RequestOutput`s out.

One step: admit waiting requests into free slots → `pipeline.update_state(share_inputs)` (its
typed result: forced tokens and failures, `_prepare`) → one forward pass over every active slot
(prompts of new slots, the tokens of running ones not computed yet) → the sampling stages in one
pass (`engine/stages.py`: processors, penalties, request-level bias and bad words, sampler) →
append tokens, detokenize, check stops, free finished slots.

`add_request` and `abort_request` may be called from any thread (the server's event loop);
`step` runs on one engine thread. A step never raises an `Exception`: what no request's isolation
caught fails the requests the step was running (`fail_running`), and the next step starts clean.
`last_progress` tells a watchdog when the engine last computed a token or finished a request.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
import uuid
import weakref
from typing import Any

import numpy as np

from fastdeploy_lp.config import FDConfig
from fastdeploy_lp.executor.tensor_parallel import TensorParallelRunner
from fastdeploy_lp.engine.kv_cache import BlockPool
from fastdeploy_lp.engine import prompt_logprobs
from fastdeploy_lp.engine.kv_events import KVEventLog, KVEventPublisher
from fastdeploy_lp.engine.request import FinishReason, Logprob, Request, RequestOutput
from fastdeploy_lp.engine.sampler import Sampler
from fastdeploy_lp.engine.scheduler import Chunk, SlotScheduler
from fastdeploy_lp.engine.speculation import SpeculativeStats, Speculator, build_proposer
from fastdeploy_lp.engine.stages import SamplingStages
from fastdeploy_lp.engine.step_rows import StepRows
from fastdeploy_lp.model.lora import LORA_ADAPTER, LORA_NAME
from fastdeploy_lp.model.runner import ModelRunner, SequenceFeed
from fastdeploy_lp.processors.context import EngineContext
from fastdeploy_lp.processors.custom_backends import RequestLogitsProcessorAdapter
from fastdeploy_lp.processors.guided import GuidedDecodingLogitsProcessor
from fastdeploy_lp.processors.pipeline import LogitsProcessorPipeline, ProcessorResults
from fastdeploy_lp.sampling_params import SamplingParams
from fastdeploy_lp.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


def leading_processors(context: EngineContext) -> list:
    """Processors the engine installs ahead of the registered ones: guided decoding (unless its
    backend is "off") and, when custom backends are loaded, the adapter that runs theirs."""
    fd_config = context.config
    leading = []
    if fd_config.guided_decoding_backend != "off":
        leading.append(GuidedDecodingLogitsProcessor(fd_config, context))
    if context.custom_guided_decoding_backends:
        leading.append(RequestLogitsProcessorAdapter(fd_config))
    return leading


def forced_logprob(request: Request, token: int) -> Logprob | None:
    """A token appended without a sampling step had probability 1 under the constrained
    distribution: its logprob is 0 (and it is its own only alternative)."""
    if request.params.logprobs is None:
        return None
    return Logprob(token, 0.0, {token: 0.0} if request.params.logprobs else {})


def build_runner(fd_config: FDConfig) -> ModelRunner | TensorParallelRunner:
    """The runner `fd_config` asks for: the model in this process, or split over
    `tensor_parallel_size` processes behind the same interface."""
    if fd_config.tensor_parallel_size > 1:
        return TensorParallelRunner(fd_config)
    return ModelRunner(fd_config)


class LLMEngine:
    """`context` holds the runtime objects beside `fd_config` (tokenizer, tool functions, custom
    backends); without one, the checkpoint's tokenizer and no tools or backends.
    `data_parallel_rank`: this engine's place among the server's data-parallel engines (its KV
    events go to the configured port + rank and carry the rank, as vLLM's do)."""

    def __init__(self, fd_config: FDConfig, context: EngineContext | None = None, *, data_parallel_rank: int = 0):
        if context is not None and context.config is not fd_config:
            raise ValueError("context: must be the EngineContext of this fd_config")
        self.fd_config = fd_config
        self.context = context or EngineContext.load(fd_config)
        cfg = fd_config.model_config
        self.tokenizer = self.context.tokenizer
        eos = list(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.kv_events = None  # the KV-cache event publisher (--kv-events-config), engine/kv_events.py
        if fd_config.kv_events_config is not None:  # before the weights load: a bad endpoint fails fast
            self.kv_events = KVEventPublisher(fd_config.kv_events_config, data_parallel_rank)
            weakref.finalize(self, self.kv_events.shutdown)
        self.runner = build_runner(fd_config)
        cache = fd_config.cache_config
        self.block_pool = BlockPool(self.runner.num_blocks, cache.block_size, cache.enable_prefix_caching)
        if self.kv_events is not None:
            self.block_pool.events = KVEventLog(cache.block_size)
        self.pipeline = LogitsProcessorPipeline(self.context, fd_config.logits_processors,
                                                leading=leading_processors(self.context))
        self.scheduler = SlotScheduler(fd_config.max_num_seqs, self.block_pool, cache.token_budget,
                                       cache.enable_chunked_prefill,
                                       None if fd_config.lora_config is None else fd_config.lora_config.max_loras)
        self.sampler = Sampler(fd_config.max_num_seqs, cfg.vocab_size, eos, fd_config.deterministic)
        self.stages = SamplingStages(self.sampler, self.pipeline, self.scheduler.share_inputs)
        spec = fd_config.speculative_config
        self.speculator = None if spec is None else Speculator(spec, self.pipeline, self.scheduler,
                                                               build_proposer(fd_config, self.tokenizer.vocab_size))
        self._incoming: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self.num_steps = 0
        self.last_progress = time.monotonic()  # last time a step computed tokens or finished a request

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, add_special_tokens: bool = True) -> list[str]:
        """Validate and queue one prompt; returns the ids of its `params.n` sequences.

        Raises `ValueError` naming the offending field; nothing is queued then.
        """
        requests = self.make_requests(prompt, params, request_id, add_special_tokens)
        self.enqueue(requests)
        return [r.request_id for r in requests]

    def make_requests(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, add_special_tokens: bool = True) -> list[Request]:
        """Validate one prompt and build its `params.n` requests without queueing them."""
        params = params or SamplingParams()
        self.fd_config.sequence_limits.check(params)  # counting only: before any tokenizing
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens,
                                                      limit=self.fd_config.max_model_len)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            text, ids = None, [int(t) for t in prompt]
        else:
            raise ValueError("prompt: must be a string or a list of token ids")
        params = self._check(ids, params)
        self._check_adapter(params)
        args = self.pipeline.validate(params)
        request_id = request_id or uuid.uuid4().hex
        requests = []
        for i in range(params.n):
            seed = secrets.randbits(64) if params.seed is None else params.seed + i
            requests.append(Request(
                request_id=request_id if params.n == 1 else f"{request_id}-{i}", group_id=request_id,
                prompt_ids=ids, params=params, prompt=text, index=i, args=args,
                detokenizer=IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.include_stop_str_in_output,
                                                   params.skip_special_tokens),
                seed=seed))
        return requests

    def enqueue(self, requests: list[Request]) -> None:
        for r in requests:
            self._incoming.put(r)
        with self._lock:
            if self._pending == 0:  # idle until now: time without progress counts from here
                self.last_progress = time.monotonic()
            self._pending += len(requests)

    # -- LoRA adapters -----------------------------------------------------------------------------
    def lora_adapters(self) -> dict[str, str]:
        """The adapters served, name -> path (empty with LoRA off)."""
        loras = getattr(self.runner, "loras", None)
        return {} if loras is None else loras.names()

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Read and check a PEFT adapter and serve it as `name`: from any thread (the files are read
        outside the registry's lock), so a server loads it off the step loop."""
        loras = getattr(self.runner, "loras", None)
        if loras is None:
            raise ValueError("lora_name: LoRA is off on this engine (--enable-lora)")
        loras.load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        loras = getattr(self.runner, "loras", None)
        if loras is None:
            raise ValueError("lora_name: LoRA is off on this engine (--enable-lora)")
        loras.unload(name)

    def _check_adapter(self, params: SamplingParams) -> None:
        """A request naming a LoRA adapter (`SamplingParams.extra[LORA_NAME]`) needs it loaded; it
        holds the adapter from here on (`LORA_ADAPTER`: evicted or unloaded meanwhile, it still runs)."""
        name = params.extra.get(LORA_NAME)
        if name is None:
            return
        loras = getattr(self.runner, "loras", None)
        if loras is None:
            raise ValueError(f"model: {name!r} is a LoRA adapter and LoRA is off on this engine (enable_lora)")
        params.extra[LORA_ADAPTER] = loras.get(name)  # a ValueError naming it when it is not loaded

    def _check(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        vocab, limit = self.fd_config.model_config.vocab_size, self.fd_config.max_model_len
        if not ids:
            raise ValueError("prompt: must not be empty")
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt: token ids must be in 0..{vocab - 1}")
        if len(ids) >= limit:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within max_model_len={limit}")
        params.check_vocab(vocab)
        if params.guided_decoding is not None and not self.pipeline.serves_guided_decoding:
            raise ValueError("guided_decoding: guided decoding is off on this engine (guided_decoding_backend='off')")
        if params.max_tokens is not None and params.max_tokens > limit - len(ids):
            raise ValueError(f"max_tokens: {params.max_tokens} plus the prompt's {len(ids)} tokens exceeds "
                             f"max_model_len={limit}; at most {limit - len(ids)} tokens can be generated")
        capacity = self.block_pool.capacity_tokens  # the whole KV cache: a request must fit it alone
        if len(ids) + (params.max_tokens or 1) > capacity:
            field = "max_tokens" if params.max_tokens is not None and len(ids) < capacity else "prompt"
            raise ValueError(f"{field}: the prompt's {len(ids)} tokens plus {params.max_tokens or 1} to generate "
                             f"need more KV cache than the engine has ({capacity} tokens; see --kv-cache-memory, "
                             f"--num-blocks)")
        if params.max_tokens is None:
            return params.clone(max_tokens=min(limit, capacity) - len(ids))
        return params

    def abort_request(self, request_id: str) -> None:
        """Cancel a request (and its `n` siblings); its slot is freed at the next step."""
        self._aborts.put(request_id)

    def abort_now(self, request_ids: list[str]) -> None:
        """Cancel requests at once, on the thread that runs the steps (offline, when `generate`
        is interrupted): their slots and blocks are free before this returns."""
        for request_id in request_ids:
            self._aborts.put(request_id)
        self._drain_inbox([])

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self._pending > 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.holding)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self._incoming.qsize()

    def speculative_stats(self) -> dict[str, Any]:
        """Speculative decoding's counters since start (`SpeculativeStats.as_dict`); method None when off."""
        return (self.speculator.stats if self.speculator else SpeculativeStats(None)).as_dict()

    def processor_timings(self) -> dict[str, Any]:
        return {name: vars(t).copy() for name, t in self.pipeline.timings.items()}

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step; the outputs of every request it touched."""
        try:
            return self._step()
        except Exception as e:  # a bug below the request isolation: fail that batch, keep serving
            logger.exception("engine step failed; failing the requests it was running")
            return self.fail_running(e)
        finally:
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """The KV-cache events recorded since the last call, as one batch (queued, never blocking)."""
        if self.kv_events is not None:
            self.kv_events.publish(self.block_pool.events.take())

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (on the engine's thread, between steps)."""
        self.block_pool.reset_prefix_cache()
        self._publish_kv_events()

    def _step(self) -> list[RequestOutput]:
        finished: list[Request] = []
        self._drain_inbox(finished)
        chunks = self._schedule_prompts(finished)
        self._prepare(finished)
        running = self.scheduler.running
        chunks = [c for c in chunks if c.request.slot is not None]  # a preempted request's chunk waits
        started = time.perf_counter()  # a step's drafting counts in its time (a draft model's passes)
        drafts = self.speculator.propose(running, chunks) if self.speculator else {}
        if running or chunks:
            try:
                self._decode(running, chunks, finished, drafts)
                if self.speculator and not chunks:
                    self.speculator.observe_step(time.perf_counter() - started, sum(map(len, drafts.values())))
            except Exception as e:  # no row of this pass can be trusted; the engine itself goes on
                logger.exception("forward pass failed; failing the %d requests in it", len(running) + len(chunks))
                self._fail(running + [c.request for c in chunks], e, finished)
        self.num_steps += 1
        return [r.to_output() for r in self._touched(running, finished)]

    def _schedule_prompts(self, finished: list[Request]) -> list[Chunk]:
        """Admit waiting requests and plan prompt chunks; a request whose data cannot be set up fails alone."""
        chunks, joined, rejected = self.scheduler.schedule_prompts()
        for request in joined:
            try:
                self.sampler.on_admit(request)
            except Exception as e:
                rejected.append((request, e))
        for request, error in rejected:
            logger.exception("request %s could not be admitted", request.request_id, exc_info=error)
            self._finish(request, FinishReason.ERROR, finished,
                         f"the request could not be admitted: {type(error).__name__}: {error}")
        return chunks

    def fail_running(self, error: BaseException) -> list[RequestOutput]:
        """After a step raised outside the isolation above: fail the requests it was running, so
        the next step starts from a clean batch instead of repeating the failure."""
        finished: list[Request] = []
        victims = self.scheduler.holding
        if not victims:  # it failed before any request ran: the waiting ones are what it was handling
            victims = list(self.scheduler.waiting)
            self.scheduler.waiting.clear()
        self._fail(victims, error, finished)
        return [self._final_output(r) for r in finished]

    @staticmethod
    def _final_output(request: Request) -> RequestOutput:
        try:
            return request.to_output()
        except Exception:  # the detokenizer may be what failed: the error reaches the caller without text
            logger.exception("request %s: its output could not be detokenized", request.request_id)
            return request.to_output(detokenize=False)

    def _fail(self, requests: list[Request], error: BaseException, finished: list[Request]) -> None:
        for r in requests:
            self._finish(r, FinishReason.ERROR, finished, f"the engine step failed: {type(error).__name__}: {error}")

    def _prepare(self, finished: list[Request]) -> None:
        """Bring the processors' state to the batch this step's pass computes.

        A round runs every `update_state` and applies its result: failed requests leave, forced
        tokens join their requests' queues (with fast-forward they are appended now), and blocks
        are reserved for what the pass computes, which may preempt requests. Processors must see
        each of these before `apply` (rows that left; output that grew, which may close a tool
        call or finish a request; `RequestFailures` promises a call for the smaller batch), so a
        round that changed anything is followed by another. Each such round ends a request or
        appends tokens, so the rounds are bounded by the batch's remaining `max_tokens`.
        """
        while True:
            result = self.pipeline.update_state(self.scheduler.share_inputs)
            for slot, message in result.failures.items():
                self._finish(self.scheduler.slots[slot], FinishReason.ERROR, finished, message)
            appended = self._take_forced_tokens(result, finished)
            preempted = self.scheduler.reserve_running()
            if not result.failures and not appended and not preempted:
                return

    def _take_forced_tokens(self, result: ProcessorResults, finished: list[Request]) -> bool:
        """Queue the tokens the processors declared certain; with fast-forward, append them now.

        Returns True if any were appended. Without fast-forward a queued token takes the place of
        one sampled token per step, and processors see the queue in `forced_tokens[slot]`.
        """
        for slot, tokens in result.forced.items():
            request = self.scheduler.slots[slot]
            if request is not None and not request.finished:
                request.forced_queue.extend(tokens)
        if not self.fd_config.fast_forward:
            return False
        appended = False
        for request in self.scheduler.running:
            queue = list(request.forced_queue)
            if not queue:
                continue
            request.forced_queue.clear()  # in place: share_inputs shows this list
            now = time.monotonic()
            for token in queue:
                if request.finished:
                    break
                self._append(request, token, forced_logprob(request, token), now, finished)
            appended = True
        return appended

    def _decode(self, running: list[Request], chunks: list[Chunk], finished: list[Request],
                drafts: dict[int, list[int]]) -> None:
        # Active requests: every token not in their blocks yet (a prompt's last chunk, one sampled
        # token, or forced ones) and their drafts, with logits for the last token and each draft;
        # then prompt chunks of requests still joining, without.
        # Requests asking for prompt logprobs also get the rows of their prompt positions (after these).
        feeds = [SequenceFeed(r.blocks, r.tokens(r.cached_len, r.total_len) + drafts.get(r.slot, []), r.cached_len,
                              num_logits=1 + len(drafts.get(r.slot, [])),
                              prompt_logits=prompt_logprobs.feed_rows(r, r.cached_len, r.total_len - r.cached_len),
                              lora=r.params.extra.get(LORA_ADAPTER))
                 for r in running]
        feeds += [SequenceFeed(c.request.blocks, c.tokens, c.start, logits=False,
                               prompt_logits=prompt_logprobs.feed_rows(c.request, c.start, len(c.tokens)),
                               lora=c.request.params.extra.get(LORA_ADAPTER))
                  for c in chunks]
        logits = self.runner.forward(feeds, self.block_pool.take_fresh())
        logits = prompt_logprobs.take(logits, feeds, running + [c.request for c in chunks])
        for feed, request in zip(feeds, running + [c.request for c in chunks]):
            self.scheduler.commit(request, len(feed.tokens) - feed.num_logits + 1)  # drafts: once accepted
        self.last_progress = time.monotonic()
        if not running:
            return
        if self.tokenizer.vocab_size < logits.shape[-1]:
            # Checkpoints pad the embedding matrix past the tokenizer: those ids are no tokens.
            logits[:, self.tokenizer.vocab_size:] = float("-inf")
        rows = self.stages.run(StepRows.verify(logits, running, drafts) if drafts else StepRows.of(logits, running))
        now = time.monotonic()
        for row, request in enumerate(running):
            if request.slot in rows.failures:
                self._finish(request, FinishReason.ERROR, finished, rows.failures[request.slot])
            elif request.forced_queue:  # fast-forward off: a forced token takes this step's place
                token = request.forced_queue.pop(0)
                self._append(request, token, forced_logprob(request, token), now, finished)
            else:
                self._append_rows(request, rows, rows.emitted(row), now, finished)

    def _append_rows(self, request: Request, rows: StepRows, emitted: list[tuple[int, int | None]], now: float,
                     finished: list[Request]) -> None:
        """Append a request's `emitted` tokens in order, until one finishes it: each sampled row's
        token, and tokens processors forced at a draft depth (row None) as fast-forward appends
        them. While each token equals the draft at its position it is an accepted draft: this pass
        computed its keys and values, so they are committed, except the last token appended, which
        the next step feeds for its logits."""
        draft = rows.drafts.get(request.slot, [])
        accepted = appended = 0
        for token, row in emitted:
            logprob = forced_logprob(request, token) if row is None else rows.logprobs[row]
            self._append(request, token, logprob, now, finished)
            accepted += accepted == appended < len(draft) and token == draft[appended]
            appended += 1
            if request.finished:
                break
        if not request.finished:
            self.scheduler.commit(request, min(accepted, appended - 1))
        if draft:
            self.speculator.record(request, len(draft), accepted, sum(row is None for _, row in emitted[:appended]))

    def _append(self, request: Request, token: int, logprob, now: float, finished: list[Request]) -> None:
        p = request.params
        request.output_ids.append(token)
        if logprob is not None:
            request.logprobs.append(logprob)
        if request.first_token_time is None:
            request.first_token_time = now
        self.scheduler.record_token(request, token)
        self.sampler.record_token(request, token)
        stop_token = (token in p.stop_token_ids) or (token in self.eos_token_ids and not p.ignore_eos)
        if not stop_token:
            request.detokenizer.add(token)
        if stop_token or request.detokenizer.stopped_on is not None:
            self._finish(request, FinishReason.STOP, finished)
        elif len(request.output_ids) >= p.max_tokens:
            self._finish(request, FinishReason.LENGTH, finished)

    def _finish(self, request: Request, reason: FinishReason, finished: list[Request], error: str | None = None):
        if request.finished:
            return
        request.finish_reason = reason
        request.error = error
        self.scheduler.free(request)
        finished.append(request)
        with self._lock:
            self._pending -= 1
        self.last_progress = time.monotonic()

    def _drain_inbox(self, finished: list[Request]) -> None:
        # Aborts first: a request is queued before its abort can be sent, so every abort read here
        # finds its request among those read next (or earlier); read the other way round, an abort
        # that arrives between the two reads would find nothing and be lost.
        aborted = set()
        while not self._aborts.empty():
            aborted.add(self._aborts.get())
        while not self._incoming.empty():
            self.scheduler.waiting.append(self._incoming.get())
        if not aborted:
            return
        matches = lambda r: r.request_id in aborted or r.group_id in aborted  # noqa: E731
        for r in [r for r in self.scheduler.waiting if matches(r)]:
            self.scheduler.waiting.remove(r)
            self._finish(r, FinishReason.ABORT, finished)
        for r in [r for r in self.scheduler.holding if matches(r)]:
            self._finish(r, FinishReason.ABORT, finished)

    @staticmethod
    def _touched(running: list[Request], finished: list[Request]) -> list[Request]:
        seen, out = set(), []
        for r in running + finished:
            if id(r) not in seen:
                seen.add(id(r))
                out.append(r)
        return out
