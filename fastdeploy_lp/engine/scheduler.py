"""`SlotScheduler`: a waiting queue, `max_num_seqs` slots, KV blocks, and the `share_inputs` that mirror the slots.

`share_inputs` is the per-slot contract processors read: `processors.base.ShareInputs` types it
and docs/logits_processors.md describes each field; docs/kv_cache.md says when a request joins and
leaves under chunked prefill and preemption. `SlotScheduler` is where it is written.
"""

from __future__ import annotations

import hashlib
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from fastdeploy_lp.engine.kv_cache import BlockPool, block_hashes
from fastdeploy_lp.engine.prompt_logprobs import needs_prompt_logits
from fastdeploy_lp.engine.request import Request
from fastdeploy_lp.model.lora import LORA_ADAPTER, LORA_NAME
from fastdeploy_lp.processors.base import LogitsProcessorArgs, ShareInputs

_SAMPLING_FIELDS = {"temperature": np.float32, "top_p": np.float32, "top_k": np.int64, "min_p": np.float32,
                    "repetition_penalty": np.float32, "frequency_penalty": np.float32,
                    "presence_penalty": np.float32}


def new_share_inputs(max_num_seqs: int) -> ShareInputs:
    s = max_num_seqs
    inputs = {
        "stop_flags": np.ones(s, dtype=bool),
        "req_ids": [None] * s,
        "logits_processors_args": [LogitsProcessorArgs() for _ in range(s)],
        "prompt_ids": [np.zeros(0, dtype=np.int64) for _ in range(s)],
        "prompt_lens": np.zeros(s, dtype=np.int64),
        "output_ids": [[] for _ in range(s)],
        "step_idx": np.zeros(s, dtype=np.int64),
        "next_tokens": np.full(s, -1, dtype=np.int64),
        "sampling_params": [None] * s,
        "admission_ids": np.full(s, -1, dtype=np.int64),
        "forced_tokens": [[] for _ in range(s)],
    }
    for name, dtype in _SAMPLING_FIELDS.items():
        inputs[name] = np.zeros(s, dtype=dtype)
    return inputs


def adapter_of(request: Request) -> str | None:
    """The LoRA adapter `request` runs with (model/lora.py), None for the base model."""
    return request.params.extra.get(LORA_NAME)


def hash_seed(request: Request) -> bytes:
    """The parent of a request's first block hash: b"" for the base model, the adapter's name and
    path hashed for an adapter, so the prefix cache never shares KV computed under different
    adapters (nor under an adapter reloaded from elsewhere under the same name)."""
    adapter = request.params.extra.get(LORA_ADAPTER)
    return b"" if adapter is None else hashlib.sha256(f"lora:{adapter.name}\0{adapter.path}".encode()).digest()


@dataclass
class Chunk:
    """Tokens `[start, start + len(tokens))` of a request to compute in this step's pass."""

    request: Request
    start: int
    tokens: list[int]


class SlotScheduler:
    """Which requests hold slots and KV blocks, and what each computes in the next pass.

    A request holds a slot from admission to its end. While its prompt is computed, chunk by chunk
    within the step's token budget, its slot stays stopped in `share_inputs`; it *joins* (becomes
    active there) in the step that computes its last prompt token, whose logits give its first
    token. Running requests are scheduled before prompts; a free slot goes to the waiting request
    whose call holds the fewest slots (`_next_waiting`). When a running request needs a block and
    none is free, the most recently admitted request is preempted: it leaves its slot (processors
    see it finish), keeps its output, and later rejoins through the waiting queue, recomputing its
    prompt and output (mostly from the prefix cache).
    """

    def __init__(self, max_num_seqs: int, pool: BlockPool, token_budget: int | None = None,
                 chunked_prefill: bool = True, max_loras: int | None = None):
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras  # most different LoRA adapters holding slots at once
        self.pool = pool
        self.token_budget = token_budget
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_num_seqs
        self.share_inputs = new_share_inputs(max_num_seqs)
        self._admissions = 0
        self.num_preemptions = 0

    @property
    def running(self) -> list[Request]:
        """Active requests (prompt computed), in increasing slot order: the row order of the logits."""
        return [r for r in self.slots if r is not None and r.active]

    @property
    def holding(self) -> list[Request]:
        """Every request in a slot, active or still computing its prompt."""
        return [r for r in self.slots if r is not None]

    # -- prompts ------------------------------------------------------------------------------------
    def schedule_prompts(self) -> tuple[list[Chunk], list[Request], list[tuple[Request, Exception]]]:
        """Plan this step's prompt work within the token budget left after one token per running
        request: continue prompts in admission order, then admit waiting requests into free slots.

        Returns (chunks, joined, rejected). A chunk that ends a prompt makes its request join:
        it is placed in `share_inputs` now, so processors see it in this step's `update_state`.
        """
        budget = None if self.token_budget is None else self.token_budget - len(self.running)
        chunks: list[Chunk] = []
        for request in sorted((r for r in self.holding if not r.active), key=lambda r: r.admission):
            if request.slot is None:  # preempted below, for an older request's chunk
                continue
            chunk = self._chunk(request, budget, first=not chunks, preempt=True)
            if chunk is None:
                break
            chunks.append(chunk)
            budget = None if budget is None else budget - len(chunk.tokens)
        rejected = []
        while self.waiting and (budget is None or budget > 0) and None in self.slots:
            request = self._next_waiting()
            if request is None:  # every waiting request needs an adapter past max_loras
                break
            chunk = self._admit(request, budget, first=not chunks)
            if chunk is None:
                break
            self.waiting.remove(request)
            chunks.append(chunk)
            budget = None if budget is None else budget - len(chunk.tokens)
        joined = []
        chunks = [c for c in chunks if c.request.slot is not None]
        for chunk in chunks:
            if chunk.start + len(chunk.tokens) == chunk.request.total_len:
                try:
                    self._place(chunk.request)
                    joined.append(chunk.request)
                except Exception as e:  # a value its slot cannot hold: it fails alone
                    rejected.append((chunk.request, e))
        return [c for c in chunks if not c.request.active], joined, rejected

    def _next_waiting(self) -> Request | None:
        """The waiting request a free slot goes to: the first, in queue order, of those whose call
        (`group_id`, shared by its `n` choices) holds the fewest slots. A call with a large `n`
        then takes turns with the others instead of holding every slot until all its choices end.
        A preempted request, put back at the head, comes first: it already had its turn and was
        taken off, and skipping it could preempt it again and again. Only requests whose LoRA
        adapter fits `max_loras` with the slots' adapters are candidates (None: none fits)."""
        waiting = self.waiting if self.max_loras is None else [r for r in self.waiting if self._adapter_fits(r)]
        if not waiting:
            return None
        if waiting[0].resumed:
            return waiting[0]
        held = Counter(r.group_id for r in self.holding)
        best, fewest = waiting[0], held[waiting[0].group_id]
        for request in waiting:
            if fewest == 0:
                break
            if held[request.group_id] < fewest:
                best, fewest = request, held[request.group_id]
        return best

    def _adapter_fits(self, request: Request) -> bool:
        name = adapter_of(request)
        held = {adapter_of(r) for r in self.holding} - {None}
        return name is None or name in held or len(held) < self.max_loras

    def _chunk(self, request: Request, budget: int | None, first: bool, preempt: bool = False) -> Chunk | None:
        """The next piece of `request`'s prompt that fits the budget and the free blocks (with
        `preempt`, freeing blocks of requests admitted after it: otherwise prompts that filled the
        pool between them could wait for each other forever)."""
        start, remaining = request.cached_len, request.total_len - request.cached_len
        size = remaining if budget is None else min(remaining, budget)
        if size <= 0 or (size < remaining and not self.chunked_prefill and not first):
            return None
        if not self.chunked_prefill:
            size = remaining  # whole prompts; the first of a step may exceed the budget
        while not self._grow(request, start + size):
            victim = max(self.holding, key=lambda r: r.admission) if preempt else request
            if victim is request:
                return None
            self.preempt(victim)
        return Chunk(request, start, request.tokens(start, start + size))

    def _admit(self, request: Request, budget: int | None, first: bool) -> Chunk | None:
        """Give `request` a slot, its cached prefix and blocks for a first chunk; None to wait.
        (Every request fits the pool alone: `LLMEngine._check` refuses the others.)"""
        total = request.total_len
        hashes = request.block_hashes
        if not hashes and self.pool.enable_prefix_caching:
            hashes = block_hashes(request.tokens(0, total), self.pool.block_size, hash_seed(request))
        # At least the last token is computed: its logits are the request's next token. A request
        # still owed prompt logprobs computes its whole prompt (their logits were never cached).
        hit = [] if needs_prompt_logits(request) else self.pool.lookup(hashes, (total - 1) // self.pool.block_size)
        request.blocks, request.cached_len, request.block_hashes = hit, len(hit) * self.pool.block_size, hashes
        chunk = self._chunk(request, budget, first)
        if chunk is None:
            self.pool.release(request.blocks)
            request.blocks, request.cached_len = [], 0
            return None
        if not request.resumed:
            self.pool.record_lookup(total, request.cached_len)
        request.slot = self.slots.index(None)
        self.slots[request.slot] = request
        self._admissions += 1
        request.admission = self._admissions
        return chunk

    def _grow(self, request: Request, tokens: int) -> bool:
        """Blocks for `tokens` positions of `request`; False (nothing taken) when the pool is short."""
        need = self.pool.blocks_for(tokens) - len(request.blocks)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        request.blocks += blocks
        return True

    # -- running requests ---------------------------------------------------------------------------
    def reserve_running(self) -> list[Request]:
        """Blocks for every active request's uncomputed tokens, preempting the most recently
        admitted requests when the pool is short. Returns the preempted active requests (they
        left their slots; processors must see that before the pass)."""
        preempted = []
        for request in self.running:
            while request.active and not self._grow(request, request.total_len):
                victim = max(self.holding, key=lambda r: r.admission)
                if victim.active:
                    preempted.append(victim)
                self.preempt(victim)
        return preempted

    def reserve_drafts(self, request: Request, count: int) -> int:
        """Blocks for `count` drafted positions after `request`'s tokens, taken only from free
        ones (a draft never preempts anyone); returns how many drafts fit."""
        if self._grow(request, request.total_len + count):
            return count
        return max(0, min(count, len(request.blocks) * self.pool.block_size - request.total_len))

    def preempt(self, request: Request) -> None:
        self.free(request)  # its forced tokens still queued (fast-forward off) stay with it, in forced_queue
        request.cached_len = 0
        request.resumed = True
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def commit(self, request: Request, computed: int) -> None:
        """`computed` more tokens of `request` are in its blocks: make newly full blocks findable."""
        request.cached_len += computed
        if not self.pool.enable_prefix_caching:
            return
        size, full = self.pool.block_size, request.cached_len // self.pool.block_size
        have = len(request.block_hashes)
        if full > have:
            parent = request.block_hashes[-1] if have else hash_seed(request)
            request.block_hashes += block_hashes(request.tokens(have * size, full * size), size, parent)
        for i in range(request.registered, full):
            if self.pool.register(request.blocks[i], request.block_hashes[i]) and self.pool.events is not None:
                self.pool.events.stored(request.block_hashes[i], request.block_hashes[i - 1] if i else None,
                                        request.tokens(i * size, (i + 1) * size))
        request.registered = max(request.registered, full)

    # -- share_inputs -------------------------------------------------------------------------------
    def _place(self, request: Request) -> None:
        request.active = True
        slot = request.slot
        s, p = self.share_inputs, request.params
        s["stop_flags"][slot] = False
        s["req_ids"][slot] = request.request_id
        s["logits_processors_args"][slot] = request.args
        s["prompt_ids"][slot] = np.array(request.prompt_ids, dtype=np.int64)
        s["prompt_ids"][slot].flags.writeable = False  # processors share it
        s["prompt_lens"][slot] = len(request.prompt_ids)
        s["output_ids"][slot] = request.output_ids
        s["step_idx"][slot] = len(request.output_ids)
        s["next_tokens"][slot] = request.output_ids[-1] if request.output_ids else -1
        s["sampling_params"][slot] = p
        s["admission_ids"][slot] = request.admission
        s["forced_tokens"][slot] = request.forced_queue  # the engine's queue, shown to processors
        for name in _SAMPLING_FIELDS:
            s[name][slot] = getattr(p, name)

    def record_token(self, request: Request, token: int) -> None:
        s = self.share_inputs
        s["step_idx"][request.slot] = len(request.output_ids)
        s["next_tokens"][request.slot] = token

    def free(self, request: Request) -> None:
        """Take `request` out of its slot and give back its blocks (cached ones stay findable)."""
        self.pool.release(request.blocks)
        request.blocks, request.registered = [], 0
        slot = request.slot
        if slot is None or self.slots[slot] is not request:
            return
        self.slots[slot] = None
        request.slot, request.active = None, False
        s = self.share_inputs
        s["stop_flags"][slot] = True
        s["req_ids"][slot] = None
        s["logits_processors_args"][slot] = LogitsProcessorArgs()
        s["sampling_params"][slot] = None
        s["output_ids"][slot] = []
        s["forced_tokens"][slot] = []
