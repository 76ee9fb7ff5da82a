"""`DraftModelProposer`: drafts from a smaller checkpoint with the same tokenizer (the `draft_model`
method), proposed greedily with its own paged KV cache.

The draft model runs in the engine's process on its own `ModelRunner` and `BlockPool`, its weights
held and computed as the main model's are (same dtype and quantization). Each running request keeps
a sequence in that cache: the tokens it has computed keys and values for (`cached`) and its blocks.
A step's drafting is k batched passes over every request that drafts: the first feeds each
request's tokens the draft cache lacks (its whole prompt the first time, then the tokens appended
since, which overwrite the keys and values of the drafts before them) and takes the argmax of the
last position; each next pass feeds the draft just taken. The drafts are deterministic, so the
engine's exact verification (engine/speculation.py) applies to them unchanged: accepted or not,
the output is what plain decoding gives.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import paddle

from fastdeploy_lp.config import FDConfig
from fastdeploy_lp.engine.kv_cache import BlockPool
from fastdeploy_lp.engine.request import Request
from fastdeploy_lp.model.runner import ModelRunner, SequenceFeed
from fastdeploy_lp.model_config import ModelConfig


@dataclass
class _DraftSequence:
    cached: int = 0  # tokens of the request with keys and values in the draft cache
    blocks: list[int] = field(default_factory=list)


class DraftModelProposer:
    def __init__(self, fd_config: FDConfig, vocab_size: int):
        main = fd_config.model_config
        draft = dataclasses.replace(ModelConfig.from_pretrained(fd_config.speculative_config.model),
                                    dtype=main.dtype, weight_dtype=main.weight_dtype, quantization=main.quantization)
        # Sized as the main cache is (the same memory setting, at most max_num_seqs full sequences).
        self.runner = ModelRunner(dataclasses.replace(fd_config, model_config=draft, speculative_config=None))
        self.pool = BlockPool(self.runner.num_blocks, fd_config.cache_config.block_size, False)
        self.vocab = min(vocab_size, draft.vocab_size)  # ids past the tokenizer's are no tokens
        self._sequences: dict[int, _DraftSequence] = {}  # by admission

    def keep(self, admissions: set[int]) -> None:
        """Free the draft cache of every request not in `admissions` (finished or preempted)."""
        for admission in [a for a in self._sequences if a not in admissions]:
            self.pool.release(self._sequences.pop(admission).blocks)

    def propose_many(self, requests: list[Request], ks: list[int], budget: int) -> list[list[int]]:
        """`ks[i]` greedy drafts for each of `requests` while `budget` lasts (the draft passes are
        not free, so no request drafts what the step could not verify), in k batched passes."""
        granted, feeds = [], {}
        for i, (request, k) in enumerate(zip(requests, ks)):
            granted.append(self._reserve(request, k, budget))
            budget -= granted[-1]
            if granted[-1]:
                seq = self._sequences[request.admission]
                context = request.prompt_ids + request.output_ids
                feeds[i] = SequenceFeed(seq.blocks, context[seq.cached:], seq.cached)
                # The drafts' keys and values past the context are overwritten by what is appended.
                seq.cached = len(context)
        drafts: list[list[int]] = [[] for _ in requests]
        for depth in range(max(granted, default=0)):
            feeds = {i: f for i, f in feeds.items() if granted[i] > depth}
            logits = self.runner.forward(list(feeds.values()), self.pool.take_fresh())
            tokens = paddle.argmax(logits[:, :self.vocab], axis=-1).numpy().tolist()
            for i, token in zip(feeds, tokens):
                drafts[i].append(int(token))
            feeds = {i: SequenceFeed(f.blocks, [int(t)], f.start + len(f.tokens))
                     for (i, f), t in zip(feeds.items(), tokens)}
        return drafts

    def _reserve(self, request: Request, k: int, budget: int) -> int:
        """How many drafts `request` makes: `k` within `budget`, if the draft cache has room for them."""
        k = max(0, min(k, budget))
        seq = self._sequences.setdefault(request.admission, _DraftSequence())
        needed = self.pool.blocks_for(len(request.prompt_ids) + len(request.output_ids) + k) - len(seq.blocks)
        if k and needed > 0:
            blocks = self.pool.allocate(needed)
            if blocks is None:
                return 0
            seq.blocks += blocks
        return k
