"""The model runner: the decoder, its per-slot KV cache, and one forward pass per engine step.

A step feeds every active slot some new tokens: a whole prompt for a slot that just joined, one
sampled token for a running slot, or several forced tokens. All of them run in one forward pass. The logits of each slot's last new token come
back as one `[active_slots, vocab]` tensor in increasing slot order (the row convention).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import paddle

from ..config import FDConfig
from ..model import AttentionBatch, SequenceGroup, load_model


@dataclass
class SlotFeed:
    slot: int
    tokens: list[int]
    start: int  # position of tokens[0]; the slot's cache already holds positions < start


def use_device(fd_config: FDConfig) -> None:
    """Put Paddle on the configured device; every tensor the engine and processors make lands there."""
    paddle.set_device(fd_config.device)
    if fd_config.device.startswith("cpu"):
        # Paddle pins CPU math to one thread (it sets OMP_NUM_THREADS=1 on import), while decode GEMVs
        # run ~2x faster on two cores.
        paddle.base.core.set_num_threads(fd_config.cpu_threads or len(os.sched_getaffinity(0)))


class ModelRunner:
    def __init__(self, fd_config: FDConfig):
        use_device(fd_config)
        cfg = fd_config.model_config
        self.max_len = fd_config.max_model_len
        self.model = load_model(cfg, max_positions=self.max_len)
        shape = [fd_config.max_num_seqs * cfg.num_key_value_heads * self.max_len, cfg.head_dim]
        self.kv_caches = [(paddle.zeros(shape, dtype=cfg.dtype), paddle.zeros(shape, dtype=cfg.dtype))
                          for _ in range(cfg.num_hidden_layers)]

    @paddle.no_grad()
    def forward(self, feeds: list[SlotFeed]) -> paddle.Tensor:
        """Logits `[len(feeds), vocab]` (float32) for the last token of each feed, in the feeds' order.

        All feeds run in one pass: tokens are laid out group by group (feeds adding the same number
        of tokens), and the rows come back in the order the feeds were given.
        """
        by_length: dict[int, list[int]] = {}
        for i, f in enumerate(feeds):
            by_length.setdefault(len(f.tokens), []).append(i)
        order = [i for n in sorted(by_length) for i in by_length[n]]
        ids, positions, cache_rows, groups, last = [], [], [], [], []
        for n in sorted(by_length):
            group = [feeds[i] for i in by_length[n]]
            groups.append(SequenceGroup(start=len(ids), new=n, slots=[f.slot for f in group],
                                        lens=[f.start + n for f in group], max_len=self.max_len))
            for f in group:
                if f.start + n > self.max_len:
                    raise ValueError(f"slot {f.slot} would exceed max_model_len={self.max_len}")
                ids += f.tokens
                positions += range(f.start, f.start + n)
                base = f.slot * self.max_len
                cache_rows += range(base + f.start, base + f.start + n)
                last.append(len(ids) - 1)
        batch = AttentionBatch(positions=paddle.to_tensor(positions, dtype="int64"),
                               cache_rows=paddle.to_tensor(cache_rows, dtype="int64"), groups=groups)
        hidden = self.model(paddle.to_tensor(ids, dtype="int64"), batch, self.kv_caches)
        # One row per feed, put back into the given order.
        back = [0] * len(feeds)
        for row, i in enumerate(order):
            back[i] = last[row]
        return self.model.logits(paddle.index_select(hidden, paddle.to_tensor(back, dtype="int64")))
