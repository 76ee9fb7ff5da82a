"""The model runner: the decoder, its paged KV cache, and one forward pass per engine step.

A step feeds every scheduled sequence some new tokens: a prompt chunk, one sampled token for a
running request, several forced tokens, or a token and its speculative drafts. All of them run in
one forward pass; the logits of the last new token (the last `num_logits` for a verify pass) of each
feed that asks for them come back as one `[rows, vocab]` tensor in the feeds' order (the engine
passes the active slots in increasing slot order: the row convention). A feed may also ask for the
logits of a run of its prompt tokens (`prompt_logits`, for prompt logprobs): those rows follow all
the sampling rows, feed after feed, so the sampling rows are the tensor's first ones either way.

It sits with the model, below `distributed/`: each tensor-parallel rank runs one, and the engine
picks it or the tensor-parallel runner (`engine.engine.build_runner`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import paddle

from fastdeploy_lp.config import FDConfig
from fastdeploy_lp.distributed.shard import TensorShard
from fastdeploy_lp.model import AttentionBatch, cpu_dispatch, cpu_features, cpu_kernels, load_model, lora
from fastdeploy_lp.model.linear import batch_invariant_mode
from fastdeploy_lp.model.loader import weight_bytes

logger = logging.getLogger(__name__)


@dataclass
class SequenceFeed:
    """New tokens of one sequence for a pass: `tokens` go at positions `start..` of its `blocks`
    (which cover them); `logits` asks for the scores of the last `num_logits` tokens (more than one
    when a speculative verify pass scores each draft position). `prompt_logits` = (first, count)
    asks as well for the scores of `count` tokens from `tokens[first]` on, returned after every
    feed's sampling rows (prompt logprobs, engine/prompt_logprobs.py)."""

    blocks: list[int]
    tokens: list[int]
    start: int
    logits: bool = True
    num_logits: int = 1
    prompt_logits: tuple[int, int] = (0, 0)
    lora: lora.LoRAAdapter | None = None  # the LoRA adapter these tokens run with; None: the base model


def use_device(fd_config: FDConfig) -> None:
    """Put Paddle on the configured device; every tensor the engine and processors make lands there."""
    paddle.set_device(fd_config.device)
    if fd_config.device.startswith("cpu"):
        tune_cpu_math()
        # Paddle pins CPU math to one thread (it sets OMP_NUM_THREADS=1 on import), while decode GEMVs
        # run ~2x faster on two cores.
        threads = fd_config.cpu_threads or len(os.sched_getaffinity(0))
        paddle.base.core.set_num_threads(threads)
        cpu_kernels.set_threads(threads)


MKL_CPU_TYPE = "MKL_DEBUG_CPU_TYPE"
_cpu_math_logged = False


def tune_cpu_math() -> str:
    """Let the MKL bundled with Paddle's CPU wheel use its AVX2 kernels on AMD CPUs.

    On a non-Intel CPU that MKL takes a generic code path: float32 GEMM ran at ~75 GFLOP/s on these
    AMD EPYC machines against ~180 with `MKL_DEBUG_CPU_TYPE=5`, which MKL reads at its first call
    (setting it in-process works as long as no matmul ran before). Only where this process can run
    AVX2 and FMA (the value forces those kernels). A value the user set is left alone. Returns the
    path taken, logged once per process.
    """
    global _cpu_math_logged
    cpu = cpu_features.detect()
    if os.environ.get(MKL_CPU_TYPE) is not None:
        path = f"{MKL_CPU_TYPE}={os.environ[MKL_CPU_TYPE]} as set by the user"
    elif cpu.vendor == "AuthenticAMD" and cpu.isa != "portable":
        os.environ[MKL_CPU_TYPE] = "5"
        path = f"AMD CPU: {MKL_CPU_TYPE}=5, MKL's AVX2 kernels"
    else:
        path = f"{cpu.vendor or 'unknown'} CPU: MKL's own dispatch"
    if not _cpu_math_logged:
        _cpu_math_logged = True
        logger.info("CPU math: %s; %s", cpu.describe(), path)
    return path


def pool_blocks(fd_config: FDConfig, block_bytes: int) -> int:
    """Blocks in the KV pool: the configured number, or as many as the memory budget holds, but
    no more than `max_num_seqs` sequences of `max_model_len` need (plus the null block).

    Under tensor parallelism `block_bytes` is one rank's share (its KV heads): on GPU each rank
    sizes by its own device's memory; on CPU the ranks share the host, so each gets
    `kv_cache_memory / tensor_parallel_size` and the pool holds as many blocks as with one rank.
    """
    cache = fd_config.cache_config
    if cache.num_blocks is not None:
        return cache.num_blocks
    if fd_config.device.startswith("gpu"):
        total = paddle.device.cuda.get_device_properties().total_memory
        budget = cache.gpu_memory_utilization * total - paddle.device.cuda.memory_allocated()
        where = f"gpu_memory_utilization={cache.gpu_memory_utilization}"
    else:
        budget = cache.kv_cache_memory * 2**30 / fd_config.tensor_parallel_size
        where = f"kv_cache_memory={cache.kv_cache_memory} GiB"
    full = fd_config.max_num_seqs * -(-fd_config.max_model_len // cache.block_size) + 1
    blocks = min(int(budget // block_bytes), full)
    if blocks < 2:
        raise ValueError(f"{where} leaves no room for the KV cache ({block_bytes / 2**20:.1f} MiB per block)")
    tokens = (blocks - 1) * cache.block_size
    logger.info("KV cache: %d blocks of %d tokens in %s (%.2f GiB, %d tokens) from %s", blocks, cache.block_size,
                cache.dtype_for(fd_config.model_config.dtype), blocks * block_bytes / 2**30, tokens, where)
    if tokens < fd_config.max_model_len:
        logger.warning("the KV cache holds %d tokens, fewer than max_model_len=%d: longer requests are refused",
                       tokens, fd_config.max_model_len)
    return blocks


class ModelRunner:
    """The decoder and its paged KV cache: one `[blocks * kv_heads * block_size, head_dim]` tensor
    for the keys and one for the values of each layer (layers.AttentionBatch says how it is read).

    The engine runs this class when the model runs in the engine's process, and
    `executor.tensor_parallel.TensorParallelRunner` (same interface) when it is split over
    `tensor_parallel_size` processes (`engine.engine.build_runner`). Each of those processes runs a
    `ModelRunner` with a `shard`: its slice of the model, its KV heads' slice of the cache (same
    block ids everywhere).
    """

    failure: str | None = None  # why passes can no longer run (a tensor-parallel rank died); None here

    def __init__(self, fd_config: FDConfig, shard: TensorShard | None = None):
        use_device(fd_config)
        cfg = fd_config.model_config
        self.model = load_model(cfg, max_positions=fd_config.max_model_len, shard=shard)
        self.weight_bytes = weight_bytes(self.model)  # resident: /v1/models and the start-up log say it
        cache = fd_config.cache_config
        self.block_size = cache.block_size
        self.kv_heads = cfg.num_key_value_heads // (1 if shard is None else shard.size)
        self.per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
        self.kv_cache_dtype = cache.dtype_for(cfg.dtype)
        dtype_bytes = paddle.to_tensor([], dtype=self.kv_cache_dtype).element_size()
        block_bytes = 2 * cfg.num_hidden_layers * self.kv_heads * self.block_size * cfg.head_dim * dtype_bytes
        self.num_blocks = pool_blocks(fd_config, block_bytes)
        if shard is not None:  # the block ids the engine hands out must exist on every rank
            self.num_blocks = shard.agree_min(self.num_blocks)
        shape = [self.num_blocks * self.kv_heads * self.block_size, cfg.head_dim]
        # empty, not zeros: pages are committed as blocks are used, and every block is zeroed when
        # it is handed out (AttentionBatch.zero_rows), the null block here.
        self.kv_caches = [(paddle.empty(shape, dtype=self.kv_cache_dtype), paddle.empty(shape, dtype=self.kv_cache_dtype))
                          for _ in range(cfg.num_hidden_layers)]
        null_rows = self.kv_heads * self.block_size
        for pair in self.kv_caches:
            for c in pair:
                c[:null_rows] = 0
        self.loras = self._load_loras(fd_config, shard)
        self.deterministic = fd_config.deterministic
        if self.deterministic:  # every op on the kernels: no plan to measure
            with batch_invariant_mode(True) as kernels:  # refuses here where the kernels cannot run
                logger.info("deterministic: batch-invariant CPU kernels for every op (%s, %d floats per vector)",
                            cpu_features.detect().describe(), kernels.lanes)
        else:
            cpu_dispatch.prepare(self.model, self.block_size, self.kv_cache_dtype)

    def forward(self, feeds: list[SequenceFeed], fresh_blocks: list[int] = ()) -> paddle.Tensor:
        """Logits `[rows, vocab]` (float32) for the last `num_logits` tokens of the feeds asking for
        them, in the feeds' order (a feed's rows in position order), then the `prompt_logits` rows of
        each feed asking, in the same order: `_forward` in this engine's kernel mode (a process may hold engines with and without `deterministic`)."""
        with batch_invariant_mode(self.deterministic):
            return self._forward(feeds, fresh_blocks)

    @paddle.no_grad()
    def _forward(self, feeds: list[SequenceFeed], fresh_blocks: list[int] = ()) -> paddle.Tensor:
        """`forward`'s pass. All feeds run in one pass, laid out group by group (feeds adding the same
        number of tokens); `fresh_blocks` are zeroed first."""
        order = sorted(range(len(feeds)), key=lambda i: len(feeds[i].tokens))
        ids, last = [], {}
        for i in order:
            ids += feeds[i].tokens
            last[i] = len(ids) - 1
        batch = AttentionBatch.paged([(feeds[i].blocks, feeds[i].start, len(feeds[i].tokens)) for i in order],
                                     self.block_size, self.kv_heads, self.per_kv, fresh_blocks)
        hidden = self._run_model(paddle.to_tensor(ids, dtype="int64"), batch, [feeds[i] for i in order])
        rows = [last[i] - f.num_logits + 1 + j for i, f in enumerate(feeds) if f.logits for j in range(f.num_logits)]
        rows += [last[i] - len(f.tokens) + 1 + f.prompt_logits[0] + j
                 for i, f in enumerate(feeds) for j in range(f.prompt_logits[1])]
        if not rows:
            return paddle.zeros([0, self.model.config.vocab_size], dtype="float32")
        if rows != list(range(len(ids))):  # else every row, in order (a plain decode step): no copy
            hidden = paddle.index_select(hidden, paddle.to_tensor(rows, dtype="int64"))
        return self.model.logits(hidden)

    def _run_model(self, ids: paddle.Tensor, batch: AttentionBatch, feeds: list[SequenceFeed]) -> paddle.Tensor:
        """The decoder over `ids` (`feeds`' tokens in that order), with each feed's LoRA adapter on its rows."""
        if all(f.lora is None for f in feeds):
            return self.model(ids, batch, self.kv_caches)
        with lora.rows_of_pass([f.lora for f in feeds for _ in f.tokens]):
            return self.model(ids, batch, self.kv_caches)

    def _load_loras(self, fd_config: FDConfig, shard: TensorShard | None) -> lora.LoRAManager | None:
        """The adapter registry when LoRA is on, with `--lora-modules` loaded (a bad one: a `ValueError`)."""
        config = fd_config.lora_config
        if config is None:
            return None
        manager = lora.LoRAManager(fd_config.model_config, config, shard)
        for name, path in config.modules:
            manager.load(name, path)
        return manager

    def on_failure(self, callback) -> None:
        """`callback(message)` runs if the runner can no longer run passes; one process never gets there."""

    def close(self) -> None:
        """Release what the runner started (the tensor-parallel workers); nothing here."""
