"""Building blocks of the Llama-family decoder: RMSNorm, rotary embeddings, attention over a paged KV
cache, the gated MLP. Linear weights and their products are `model/linear.py`'s; q/k/v and gate/up
are fused into one weight each, which halves the kernel launches per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.incubate.nn.functional import fused_rms_norm

from fastdeploy_lp.model_config import ModelConfig
from fastdeploy_lp.distributed.shard import TensorShard
from fastdeploy_lp.model import cpu_features, cpu_kernels, lora
from fastdeploy_lp.model.activations import activation
from fastdeploy_lp.model.linear import FEW_ROWS, batch_invariant, kernels_for, linear, linear_weight


# Paddle's CPU fused_rms_norm is built for AVX-512 and does not check: elsewhere it dies with SIGILL.
_FUSED_RMS_NORM_ON_CPU = cpu_features.detect().has_avx512f


class RMSNorm(nn.Layer):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([size], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if batch_invariant() and (kernels := kernels_for(x, "norm", 0)) is not None:
            return kernels.rms_norm(x, self.weight, self.eps)  # the fused layers' norm, row by row
        if (x.dtype == paddle.float32 and not paddle.is_grad_enabled()
                and (_FUSED_RMS_NORM_ON_CPU or not x.place.is_cpu_place())):
            # One kernel instead of six: 6.5x faster on CPU for a [4096, 896] prefill, same values
            # within 4e-6. Inference only (training needs its gradient).
            return fused_rms_norm(x, self.weight, None, self.eps, x.ndim - 1)[0]
        # Normalise in float32 like the reference implementation, then cast back. x * x, not
        # pow(2): Paddle's generic pow kernel was 6x slower on CPU, and a cast to the same dtype
        # is still a copy.
        x32 = x if x.dtype == paddle.float32 else x.astype("float32")
        x32 = x32 * paddle.rsqrt((x32 * x32).mean(axis=-1, keepdim=True) + self.eps)
        return self.weight * (x32 if x.dtype == paddle.float32 else x32.astype(x.dtype))


def rope_inverse_frequencies(config: ModelConfig) -> paddle.Tensor:
    """Per-pair rotation frequencies, with the `linear` or `llama3` scaling the config asks for."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (paddle.arange(0, dim, 2, dtype="float64") / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "freq_factors":
        inv_freq = inv_freq / paddle.to_tensor(scaling["factors"], dtype="float64")
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = paddle.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = paddle.where(medium, smoothed, scaled)
    return inv_freq.astype("float32")


class RotaryEmbedding(nn.Layer):
    """Precomputed cos/sin tables; `forward` rotates q or k at the given absolute positions."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq = rope_inverse_frequencies(config)
        t = paddle.arange(max_positions, dtype="float32")
        freqs = paddle.outer(t, inv_freq)
        emb = paddle.concat([freqs, freqs], axis=-1)
        self.register_buffer("cos", emb.cos(), persistable=False)
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: the sign lives in the table.
        self.register_buffer("sin", paddle.concat([-freqs.sin(), freqs.sin()], axis=-1), persistable=False)

    def check_table(self, batch: "AttentionBatch") -> None:
        """Refuse a pass reaching past the tables: the CPU kernels index them unchecked."""
        if batch.max_position is None or batch.max_position >= self.cos.shape[0]:
            raise ValueError(f"position {batch.max_position} outside the rotary table ({self.cos.shape[0]} positions)")

    def tables(self, positions: paddle.Tensor, dtype) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos and signed sin (see __init__) of shape [tokens, 1, head_dim] for a flat list of positions."""
        cos = paddle.index_select(self.cos, positions).unsqueeze(1).astype(dtype)
        sin = paddle.index_select(self.sin, positions).unsqueeze(1).astype(dtype)
        return cos, sin


def apply_rotary(x: paddle.Tensor, cos: paddle.Tensor, signed_sin: paddle.Tensor) -> paddle.Tensor:
    """x * cos + rotate_half(x) * sin, in four ops rather than seven (`RotaryEmbedding.tables`)."""
    return x * cos + paddle.roll(x, x.shape[-1] // 2, axis=-1) * signed_sin


_SCORES_LIMIT = 1 << 24  # elements (64 MB of float32) of one attention score tensor
_CAUSAL_CHUNK = 64  # query rows per chunk of a long prompt: later chunks skip the keys their mask hides


@dataclass
class SequenceGroup:
    """Sequences of one pass that each add `new` tokens; their tokens are `[start, end)` of the pass.

    `lens[s]` is sequence s's total length after this pass and `tables[s]` its block table (block
    ids in position order, padded with the null block 0). Long prompts are attended in query chunks
    so a score tensor stays under `_SCORES_LIMIT` elements, and each chunk reads only the blocks its
    causal mask can see.
    """

    start: int
    new: int
    lens: list[int]
    tables: np.ndarray  # [S, blocks] int64
    block_size: int
    kv_heads: int
    per_kv: int  # query heads per KV head

    def __post_init__(self):
        self.end = self.start + self.new * len(self.lens)

    # Both are shared by every layer, so built once per forward pass, and only by the path that reads them.
    @cached_property
    def chunks(self) -> list["QueryChunk"]:
        lens = np.asarray(self.lens, dtype=np.int64)
        seqs, hkv = len(self.lens), self.kv_heads
        per_row = seqs * hkv * self.per_kv * (int(lens.max()) + self.block_size)
        step = max(1, min(self.new, _SCORES_LIMIT // per_row))
        if _CAUSAL_CHUNK and self.new > 2 * _CAUSAL_CHUNK:
            step = min(step, _CAUSAL_CHUNK)
        return [self._chunk(lens, a, min(a + step, self.new)) for a in range(0, self.new, step)]

    @cached_property
    def kernel_inputs(self) -> tuple[paddle.Tensor, paddle.Tensor, int]:
        """Block tables and lengths as tensors, and the longest length, for `cpu_kernels.paged_attention`."""
        return paddle.to_tensor(self.tables), paddle.to_tensor(np.asarray(self.lens, dtype=np.int64)), max(self.lens)

    def _chunk(self, lens: np.ndarray, a: int, b: int) -> "QueryChunk":
        """Queries `[a, b)` of each sequence: which cache rows they read, and their mask."""
        span = int((lens - self.new + b).max())  # the last query of the chunk sees this many keys
        blocks = -(-span // self.block_size)
        table = self.tables[:, :blocks]
        # Row of (sequence, kv head, block) in the cache viewed as [blocks * kv_heads, block_size * dim].
        rows = (table[:, None, :] * self.kv_heads + np.arange(self.kv_heads)[None, :, None]).reshape(-1)
        length = blocks * self.block_size
        i = np.arange(a, b)[None, :, None]
        j = np.arange(length)[None, None, :]
        visible = j <= (lens - self.new)[:, None, None] + i  # causal, and within the sequence
        mask = np.where(visible, np.float32(0), np.float32(-np.inf))  # [S, q, L]
        mask = np.broadcast_to(mask[:, None, :, None, :], (len(lens), self.kv_heads, b - a, self.per_kv, length))
        return QueryChunk(a, b, length, paddle.to_tensor(rows),
                          paddle.to_tensor(np.ascontiguousarray(mask).reshape(len(lens), self.kv_heads, -1, length)))


@dataclass
class QueryChunk:
    a: int
    b: int
    length: int             # keys read: whole blocks up to the furthest one visible
    rows: paddle.Tensor     # cache rows to gather, [S * kv_heads * blocks]
    mask: paddle.Tensor     # additive, laid out like the scores: [S, kv_heads, (b - a) * per_kv, length]


@dataclass
class AttentionBatch:
    """Where the tokens of one forward pass sit in the paged KV cache.

    Tokens are flattened: `positions[i]` is token i's absolute position. Each layer's cache is
    `[blocks, kv_heads, block_size, head_dim]`, stored flat; `write_rows` is where every (token, kv
    head) of the pass goes in its `[-1, head_dim]` view, token-major (the order of
    `k.reshape([-1, head_dim])`). `zero_rows` are rows of the `[blocks * kv_heads, block_size *
    head_dim]` view to clear before writing: blocks handed out since the last pass, which may hold
    another request's stale (or non-finite) values where this one has not written yet. The
    projections and MLPs run over all tokens at once; attention runs per `SequenceGroup`
    (sequences adding equally many tokens), so prompts, prompt chunks, decodes and forced tokens of
    any mix share one pass. No groups means a plain causal pass over one sequence (training and
    reference tests).
    """

    positions: paddle.Tensor
    write_rows: paddle.Tensor | None = None
    groups: list[SequenceGroup] | None = None
    zero_rows: paddle.Tensor | None = None
    max_position: int | None = None  # known for paged passes; the CPU rotary kernel checks its table
    _rotary: tuple | None = field(default=None, init=False, repr=False)

    @classmethod
    def paged(cls, sequences: list[tuple[list[int], int, int]], block_size: int, kv_heads: int, per_kv: int,
              fresh_blocks: list[int] = ()) -> "AttentionBatch":
        """A pass over `sequences`, each `(block_table, start, new)`: `new` tokens at positions
        `start..`, laid out in the order given, where sequences adding equally many tokens must be
        adjacent (each run becomes one `SequenceGroup`)."""
        positions, rows, groups, offset, i = [], [], [], 0, 0
        while i < len(sequences):
            n = sequences[i][2]
            run = sequences[i:]
            run = run[:next((k for k, s in enumerate(run) if s[2] != n), len(run))]
            width = max(-(-(start + n) // block_size) for _, start, _ in run)
            tables = np.zeros((len(run), width), dtype=np.int64)
            for s, (table, start, new) in enumerate(run):
                pos = np.arange(start, start + new)
                blocks = np.asarray(table, dtype=np.int64)
                tables[s, :min(len(blocks), width)] = blocks[:width]
                slot_rows = (blocks[pos // block_size] * kv_heads)[:, None] + np.arange(kv_heads)[None, :]
                rows.append((slot_rows * block_size + (pos % block_size)[:, None]).reshape(-1))
                positions.append(pos)
            groups.append(SequenceGroup(offset, n, [start + new for _, start, new in run], tables,
                                        block_size, kv_heads, per_kv))
            offset += n * len(run)
            i += len(run)
        zero = np.asarray(fresh_blocks, dtype=np.int64)
        zero_rows = (zero[:, None] * kv_heads + np.arange(kv_heads)[None, :]).reshape(-1) if len(zero) else None
        positions = np.concatenate(positions)
        return cls(positions=paddle.to_tensor(positions), max_position=int(positions.max()),
                   write_rows=paddle.to_tensor(np.concatenate(rows)), groups=groups,
                   zero_rows=None if zero_rows is None else paddle.to_tensor(zero_rows))

    def rotary_tables(self, rotary: "RotaryEmbedding", dtype):
        if self._rotary is None:
            self._rotary = rotary.tables(self.positions, dtype)
        return self._rotary


def layer_index(prefix: str) -> int:
    """The decoder layer a weight prefix (`layers.3.mlp.`) belongs to: where its LoRA weights are found."""
    parts = prefix.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() else 0


def zero_fresh_blocks(batch: AttentionBatch, kv_cache) -> None:
    """Clear the blocks handed out since the last pass (`AttentionBatch.zero_rows`)."""
    if batch.zero_rows is None:
        return
    for cache in kv_cache:
        blocks = cache.reshape([-1, cache.shape[-1] * batch.groups[0].block_size])
        store_rows(blocks, batch.zero_rows, paddle.zeros([batch.zero_rows.shape[0], blocks.shape[-1]], cache.dtype))


def store_rows(cache: paddle.Tensor, rows: paddle.Tensor, values: paddle.Tensor) -> None:
    """cache[rows] = values (`[N, width]`, cast to the cache's dtype), in place. Paddle's CPU scatter
    has no bfloat16 kernel, so there a bfloat16 cache and its values are scattered as float32 pairs
    (head_dim is even): the same bits, moved, not converted."""
    values = values if values.dtype == cache.dtype else values.astype(cache.dtype)
    if cache.dtype == paddle.bfloat16 and cache.place.is_cpu_place():
        cache, values = cache.view(paddle.float32), values.contiguous().view(paddle.float32)
    cache.scatter_(rows, values, overwrite=True)


class Attention(nn.Layer):
    """Self-attention with fused q/k/v. With a `shard` (tensor parallelism) this rank holds
    `1/size` of the query and KV heads (their q/k/v rows and o_proj columns) and its slice of the
    KV cache; o_proj's partial sums are all-reduced and its bias added once, after that."""

    def __init__(self, config: ModelConfig, shard: TensorShard | None = None, prefix: str = ""):
        super().__init__()
        self.shard = shard
        ranks = 1 if shard is None else shard.size
        self.num_heads = config.num_attention_heads // ranks
        self.num_kv_heads = config.num_key_value_heads // ranks
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        hidden = config.hidden_size
        self.qkv_weight, self.qkv_weight_scale, self.qkv_weight_layout = linear_weight(
            self, [self.q_size + 2 * self.kv_size, hidden], config, key=prefix + "qkv_weight")
        self.qkv_bias = (self.create_parameter([self.q_size + 2 * self.kv_size], is_bias=True)
                         if config.attention_bias else None)
        self.o_weight, self.o_weight_scale, self.o_weight_layout = linear_weight(
            self, [hidden, self.q_size], config, key=prefix + "o_weight")
        self.o_bias = self.create_parameter([hidden], is_bias=True) if config.o_proj_bias else None
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.layer_index = layer_index(prefix)

    def forward(self, x, batch: AttentionBatch, rotary: RotaryEmbedding, kv_cache):
        # x: [tokens, hidden] (the batch is flattened to tokens)
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.qkv_weight_scale, self.qkv_weight_layout)
        if lora.active() is not None:
            qkv = lora.add(self.layer_index, "qkv", x, qkv)
        if kv_cache is None:
            return self._project(self._causal(*self._rotated(qkv, batch, rotary)))
        kernels = kernels_for(qkv, "rotary", qkv.shape[0]) if self.q_norm is None else None
        if kernels is not None:
            q = self.rotate_and_store_kernel(kernels, qkv, batch, rotary, kv_cache)
        else:
            q = self.rotate_and_store(qkv, batch, rotary, kv_cache)
        outs = [self._cached(q[g.start:g.end], g, *kv_cache) for g in batch.groups]
        return self._project(outs[0] if len(outs) == 1 else paddle.concat(outs))

    def _rotated(self, qkv, batch: AttentionBatch, rotary: RotaryEmbedding):
        """q, k (normed if the model norms them, rotated) and v as `[T, heads, D]`."""
        q, k, v = paddle.split(qkv, [self.q_size, self.kv_size, self.kv_size], axis=-1)
        q = q.reshape([-1, self.num_heads, self.head_dim])
        k = k.reshape([-1, self.num_kv_heads, self.head_dim])
        v = v.reshape([-1, self.num_kv_heads, self.head_dim])
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = batch.rotary_tables(rotary, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def rotate_and_store(self, qkv, batch: AttentionBatch, rotary: RotaryEmbedding, kv_cache) -> paddle.Tensor:
        """Rotary and the cache write in Paddle's ops. Returns the rotated queries `[T, H, D]`."""
        q, k, v = self._rotated(qkv, batch, rotary)
        zero_fresh_blocks(batch, kv_cache)
        store_rows(kv_cache[0], batch.write_rows, k.reshape([-1, self.head_dim]))
        store_rows(kv_cache[1], batch.write_rows, v.reshape([-1, self.head_dim]))
        return q

    def rotate_and_store_kernel(self, kernels: cpu_kernels.CpuKernels, qkv, batch: AttentionBatch, rotary,
                                kv_cache) -> paddle.Tensor:
        """`rotate_and_store` in one CPU kernel call instead of a split, three reshapes, eight rotary
        ops and two scatters (no q/k norm)."""
        rotary.check_table(batch)
        qkv = qkv if qkv.is_contiguous() else qkv.contiguous()
        zero_fresh_blocks(batch, kv_cache)
        kernels.rotary_cache_write(qkv, rotary.cos, rotary.sin, batch.positions, batch.write_rows, *kv_cache,
                                   self.num_heads, self.num_kv_heads)
        return qkv[:, :self.q_size].reshape([-1, self.num_heads, self.head_dim])

    def _project(self, out):
        if self.shard is None:
            out = out.reshape([-1, self.q_size])
            projected = linear(out, self.o_weight, self.o_bias, self.o_weight_scale, self.o_weight_layout)
            return projected if lora.active() is None else lora.add(self.layer_index, "o", out, projected)
        # Row-parallel; each rank's int8 scales are its own columns', applied before the sum, as is
        # its part of an adapter's update (its A columns: the sum of the parts is the update).
        out = out.reshape([-1, self.q_size])
        partial = linear(out, self.o_weight, None, self.o_weight_scale, self.o_weight_layout)
        if lora.active() is not None:
            partial = lora.add(self.layer_index, "o", out, partial)
        out = self.shard.all_reduce(partial)
        return out if self.o_bias is None else out + self.o_bias

    def _causal(self, q, k, v):
        """One sequence, all positions (training and tests): [T, H, D] -> [T, H, D]."""
        return F.scaled_dot_product_attention(
            q.unsqueeze(0), self._repeat_kv(k).unsqueeze(0), self._repeat_kv(v).unsqueeze(0),
            is_causal=True).squeeze(0)

    def _repeat_kv(self, x):
        group = self.num_heads // self.num_kv_heads
        return x if group == 1 else paddle.repeat_interleave(x, group, axis=1)

    def _cached(self, q, group: SequenceGroup, k_cache, v_cache):
        """Attention of new tokens over their sequences' cached keys (prefill chunks or batched
        decode): the CPU kernel, which reads the blocks in place, where it was measured faster."""
        kernels = self.attention_kernels(q, group)
        if kernels is not None:
            tables, lens, max_len = group.kernel_inputs
            return kernels.paged_attention(q, k_cache, v_cache, tables, lens, group.new, max_len,
                                           self.num_kv_heads, group.block_size, self.scale)
        return self.gathered_attention(q, group, k_cache, v_cache)

    @staticmethod
    def attention_kernels(q, group: SequenceGroup) -> cpu_kernels.CpuKernels | None:
        """The CPU kernels if they run this group's attention (decode and prefill are measured apart)."""
        return kernels_for(q, "attention", 1 if group.new == 1 else FEW_ROWS)

    def gathered_attention(self, q, group: SequenceGroup, k_cache, v_cache):
        """`_cached` in Paddle's ops: heads sharing a KV head are folded into the query-length axis,
        so each product is one batched matmul over [sequences, kv heads] on keys gathered block by
        block."""
        seqs, new = len(group.lens), group.new
        hkv, per_kv, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        # Scale q, not the scores: they are span/dim times larger, and every pass over them counts.
        q = (q * self.scale).reshape([seqs, new, hkv, per_kv, dim]).transpose([0, 2, 1, 3, 4])
        outs = []
        for chunk in group.chunks:
            keys, values = (paddle.index_select(c.reshape([-1, group.block_size * dim]), chunk.rows)
                            .reshape([seqs, hkv, chunk.length, dim]).astype(q.dtype) for c in (k_cache, v_cache))
            q_chunk = q if len(group.chunks) == 1 else q[:, :, chunk.a:chunk.b]
            scores = paddle.matmul(q_chunk.reshape([seqs, hkv, -1, dim]), keys, transpose_y=True)
            if scores.dtype != paddle.float32:
                scores = scores.astype("float32")
            probs = F.softmax(scores + chunk.mask, axis=-1)
            if probs.dtype != q.dtype:
                probs = probs.astype(q.dtype)
            outs.append(paddle.matmul(probs, values).reshape([seqs, hkv, chunk.b - chunk.a, per_kv, dim]))
        out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=2)
        return out.transpose([0, 2, 1, 3, 4]).reshape([-1, self.num_heads, dim])


class MLP(nn.Layer):
    """Gated MLP: `down(act(gate(x)) * up(x))`, `act` the config's `hidden_act`, biases with `mlp_bias`.

    With a `shard` this rank holds `1/size` of the MLP columns: gate/up rows stay fused as
    `[gate_shard; up_shard]` (the layout `F.swiglu` splits), down_proj's partial sums are
    all-reduced and its bias added once, after that.
    """

    def __init__(self, config: ModelConfig, shard: TensorShard | None = None, prefix: str = ""):
        super().__init__()
        self.shard = shard
        self.intermediate = config.intermediate_size // (1 if shard is None else shard.size)
        self.act = activation(config.hidden_act)
        # silu(gate) * up in one fused kernel that also splits gate_up: 2x faster than split, silu, mul
        self.fused_swiglu = config.hidden_act in ("silu", "swish")
        self.gate_up_weight, self.gate_up_weight_scale, self.gate_up_weight_layout = linear_weight(
            self, [2 * self.intermediate, config.hidden_size], config, key=prefix + "gate_up_weight")
        self.down_weight, self.down_weight_scale, self.down_weight_layout = linear_weight(
            self, [config.hidden_size, self.intermediate], config, key=prefix + "down_weight")
        self.gate_up_bias = (self.create_parameter([2 * self.intermediate], is_bias=True)
                             if config.mlp_bias else None)
        self.down_bias = self.create_parameter([config.hidden_size], is_bias=True) if config.mlp_bias else None
        self.layer_index = layer_index(prefix)

    def forward(self, x):
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_weight_scale, self.gate_up_weight_layout)
        if lora.active() is not None:
            gate_up = lora.add(self.layer_index, "gate_up", x, gate_up)
        if self.fused_swiglu and (kernels := kernels_for(gate_up, "swiglu", gate_up.shape[0])) is not None:
            hidden = kernels.swiglu(gate_up)  # 25 vs 90 ms for Paddle's CPU swiglu on [4096, 2 x 4864]
        elif self.fused_swiglu:
            hidden = F.swiglu(gate_up)
        else:
            gate, up = paddle.split(gate_up, 2, axis=-1)
            hidden = self.act(gate) * up
        if self.shard is None:
            out = linear(hidden, self.down_weight, self.down_bias, self.down_weight_scale, self.down_weight_layout)
            return out if lora.active() is None else lora.add(self.layer_index, "down", hidden, out)
        partial = linear(hidden, self.down_weight, None, self.down_weight_scale, self.down_weight_layout)
        if lora.active() is not None:  # this rank's part of the update, summed with the partial outputs
            partial = lora.add(self.layer_index, "down", hidden, partial)
        out = self.shard.all_reduce(partial)  # row-parallel
        return out if self.down_bias is None else out + self.down_bias
