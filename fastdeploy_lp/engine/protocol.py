"""`EngineClient`: everything the HTTP server asks of an engine, in one interface.

The server (`entrypoints/openai/`) holds an `EngineClient` and nothing deeper: it submits and
aborts requests, reads the model's limits, tokenizer and processors, and reads the counters
/health and /metrics serve. `AsyncLLMEngine` implements it over one in-process `LLMEngine`,
`DataParallelEngineClient` (`data_parallel.py`) over several engine processes. vLLM's server
depends on its `EngineClient` (`vllm/engine/protocol.py`) the same way.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from fastdeploy_lp.engine.request import RequestOutput

if TYPE_CHECKING:
    from fastdeploy_lp.config import FDConfig
    from fastdeploy_lp.processors.base import LogitsProcessor
    from fastdeploy_lp.processors.custom_backends import CustomBackend
    from fastdeploy_lp.sampling_params import SamplingParams
    from fastdeploy_lp.tokenizer import Tokenizer


# How long `shutdown` waits for a step in progress to end before it fails the requests anyway (a
# 2,048-token prefill chunk of a 7B model takes minutes on 2 cores: the process may not wait that long).
SHUTDOWN_WAIT_S = 10.0


class EngineNotServingError(RuntimeError):
    """The engine thread is not running (not started yet, shut down, or stopped by an error)."""


class QueueFullError(RuntimeError):
    """Admitting the request would make more sequences wait than `max_waiting_requests` allows."""


class RequestStream:
    """The outputs of one request (all `n` choices), in the order the engine produced them."""

    def __init__(self, request_id: str, child_ids: list[str], abort: Callable[[str], None]):
        self.request_id = request_id
        self.child_ids = child_ids
        self.arrival_time = time.monotonic()
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._unfinished = set(child_ids)
        self._abort = abort

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def abort(self) -> None:
        """Cancel every unfinished choice; a no-op once all have finished."""
        if self._unfinished:
            self._abort(self.request_id)

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item


@dataclass(frozen=True)
class KVCacheStats:
    """The KV cache's block pool and prefix cache, as /metrics reports them."""

    blocks_in_use: int
    blocks_total: int
    prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int      # of those, found there
    preemptions: int            # requests preempted to free blocks

    @property
    def usage(self) -> float:
        return self.blocks_in_use / self.blocks_total if self.blocks_total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


class EngineClient(Protocol):
    fd_config: FDConfig  # the model, its context length and the engine's options
    tokenizer: Tokenizer
    # called on the event loop for every output before it is routed: (output, now, stream or None)
    observer: Callable[[RequestOutput, float, RequestStream | None], None] | None

    # -- life cycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None: ...
    def shutdown(self, timeout: float = SHUTDOWN_WAIT_S, reason: str = ...) -> None: ...

    @property
    def is_serving(self) -> bool: ...
    def not_serving_reason(self) -> str | None:
        """Why requests are refused now (a stall, a stopped engine); None while it serves."""

    # -- requests
    async def add_request(self, prompt: str | list[int], params: SamplingParams,
                          request_id: str | None = None) -> RequestStream: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished_requests(self) -> bool: ...

    # -- LoRA adapters (docs/lora.md)
    def lora_adapters(self) -> dict[str, str]:
        """The adapters served, name -> path (empty with LoRA off)."""
    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter off the step loop; a `ValueError` names what does not fit."""
    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving an adapter (requests already queued finish with it); `ValueError` if unknown."""

    # -- what requests may use
    @property
    def processors(self) -> list[LogitsProcessor]:
        """The logits-processor pipeline, in order (the engine's leading ones first)."""
    @property
    def serves_guided_decoding(self) -> bool: ...
    @property
    def custom_guided_decoding_backends(self) -> dict[str, CustomBackend]: ...
    @property
    def weight_bytes(self) -> int: ...

    # -- counters, read from any thread
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    def processor_timings(self) -> dict[str, Any]: ...
    def speculative_stats(self) -> dict[str, Any]: ...
    def kv_cache_stats(self) -> KVCacheStats: ...
    def engine_loads(self) -> list[dict[str, Any]]:
        """Per engine process (one, or `--data-parallel-size` of them): `engine`, `num_running_reqs`,
        `num_waiting_reqs`, `num_requests_total` (admitted since start), `serving`, `not_serving_reason`."""
