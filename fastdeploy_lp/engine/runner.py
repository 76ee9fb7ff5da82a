"""The model runner: the decoder, its per-slot KV cache, and one forward pass per engine step.

A step feeds every active slot some new tokens: a whole prompt for a slot that just joined, one
sampled token for a running slot (or several forced tokens). Slots adding the same number of
tokens run together in one pass (all decodes; prompts of equal length). The logits of each slot's last new token come
back as one `[active_slots, vocab]` tensor in increasing slot order (the row convention).
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from ..config import FDConfig
from ..model import AttentionBatch, load_model


@dataclass
class SlotFeed:
    slot: int
    tokens: list[int]
    start: int  # position of tokens[0]; the slot's cache already holds positions < start


class ModelRunner:
    def __init__(self, fd_config: FDConfig):
        cfg = fd_config.model_config
        self.max_len = fd_config.max_model_len
        self.model = load_model(cfg, max_positions=self.max_len)
        shape = [fd_config.max_num_seqs * self.max_len, cfg.num_key_value_heads, cfg.head_dim]
        self.kv_caches = [(paddle.zeros(shape, dtype=cfg.dtype), paddle.zeros(shape, dtype=cfg.dtype))
                          for _ in range(cfg.num_hidden_layers)]
        self.num_forward_passes = 0

    @paddle.no_grad()
    def forward(self, feeds: list[SlotFeed]) -> paddle.Tensor:
        """Logits `[len(feeds), vocab]` (float32) for the last token of each feed, in the feeds' order.

        `feeds` must be in increasing slot order.
        """
        by_length: dict[int, list[SlotFeed]] = {}
        for f in feeds:  # feeds adding the same number of tokens share one pass
            by_length.setdefault(len(f.tokens), []).append(f)
        rows: dict[int, paddle.Tensor] = {}
        for group in by_length.values():
            logits = self._run(group)
            for i, f in enumerate(group):
                rows[f.slot] = logits[i]
        return paddle.stack([rows[f.slot] for f in feeds])

    def _run(self, feeds: list[SlotFeed]) -> paddle.Tensor:
        self.num_forward_passes += 1
        ids, positions, cache_rows = [], [], []
        for f in feeds:
            n = len(f.tokens)
            if f.start + n > self.max_len:
                raise ValueError(f"slot {f.slot} would exceed max_model_len={self.max_len}")
            ids += f.tokens
            positions += range(f.start, f.start + n)
            cache_rows += range(f.slot * self.max_len + f.start, f.slot * self.max_len + f.start + n)
        batch = AttentionBatch(
            positions=paddle.to_tensor(positions, dtype="int64"),
            cache_rows=paddle.to_tensor(cache_rows, dtype="int64"),
            seq_slots=[f.slot for f in feeds], seq_new=[len(f.tokens) for f in feeds],
            seq_lens=[f.start + len(f.tokens) for f in feeds], max_len=self.max_len)
        hidden = self.model(paddle.to_tensor(ids, dtype="int64"), batch, self.kv_caches)
        if len(feeds[0].tokens) > 1:  # keep only the last position of each sequence
            last = paddle.to_tensor([i * len(feeds[0].tokens) + len(feeds[0].tokens) - 1
                                     for i in range(len(feeds))], dtype="int64")
            hidden = paddle.index_select(hidden, last)
        return self.model.logits(hidden)
