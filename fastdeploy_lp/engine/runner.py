"""The model runner: the decoder, its per-slot KV cache, and one forward pass per engine step.

A step feeds every active slot some new tokens: a whole prompt for a slot that just joined, one
sampled token for a running slot, or several forced tokens. All of them run in one forward pass. The logits of each slot's last new token come
back as one `[active_slots, vocab]` tensor in increasing slot order (the row convention).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import paddle

from ..config import FDConfig
from ..model import AttentionBatch, SequenceGroup, load_model

logger = logging.getLogger(__name__)


@dataclass
class SlotFeed:
    slot: int
    tokens: list[int]
    start: int  # position of tokens[0]; the slot's cache already holds positions < start


def use_device(fd_config: FDConfig) -> None:
    """Put Paddle on the configured device; every tensor the engine and processors make lands there."""
    paddle.set_device(fd_config.device)
    if fd_config.device.startswith("cpu"):
        tune_cpu_math()
        # Paddle pins CPU math to one thread (it sets OMP_NUM_THREADS=1 on import), while decode GEMVs
        # run ~2x faster on two cores.
        paddle.base.core.set_num_threads(fd_config.cpu_threads or len(os.sched_getaffinity(0)))


MKL_CPU_TYPE = "MKL_DEBUG_CPU_TYPE"
_cpu_math_logged = False


def tune_cpu_math() -> str:
    """Let the MKL bundled with Paddle's CPU wheel use its AVX2 kernels on AMD CPUs.

    On a non-Intel CPU that MKL takes a generic code path: float32 GEMM ran at ~75 GFLOP/s on these
    AMD EPYC machines against ~180 with `MKL_DEBUG_CPU_TYPE=5`, which MKL reads at its first call
    (setting it in-process works as long as no matmul ran before). A value the user set is left
    alone. Returns the path taken, logged once per process.
    """
    global _cpu_math_logged
    if os.environ.get(MKL_CPU_TYPE) is not None:
        path = f"{MKL_CPU_TYPE}={os.environ[MKL_CPU_TYPE]} as set by the user"
    elif cpu_vendor() == "AuthenticAMD":
        os.environ[MKL_CPU_TYPE] = "5"
        path = f"AMD CPU: {MKL_CPU_TYPE}=5, MKL's AVX2 kernels"
    else:
        path = f"{cpu_vendor() or 'unknown'} CPU: MKL's own dispatch"
    if not _cpu_math_logged:
        _cpu_math_logged = True
        logger.info("CPU math: %s", path)
    return path


def cpu_vendor() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


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
