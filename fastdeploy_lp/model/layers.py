"""Building blocks of the Llama-family decoder: RMSNorm, rotary embeddings, attention over a slot KV cache.

Linear weights are stored `[in, out]` (Paddle's convention) so every projection is one `matmul`;
q/k/v and gate/up are fused into one weight each, which halves the kernel launches per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import paddle
import paddle.nn.functional as F
from paddle import nn

from ..config import ModelConfig
from .activations import activation


_FEW_ROWS = 64  # up to this many tokens, a CPU GEMM streams the weight faster as weight @ x^T


def linear(x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None = None) -> paddle.Tensor:
    """`x @ weight^T + bias` for a weight in Hugging Face's `[out, in]` layout.

    With a few rows (decode) Paddle's CPU GEMM ran 1.4-1.6x faster as `(weight @ x^T)^T` than as
    `x @ weight^T` on this model's shapes (bench: 32 rows, 285-320 vs 186-214 GFLOP/s); with many
    rows (prefill) both are alike, and other devices get the plain product.
    """
    if x.shape[0] <= _FEW_ROWS and x.place.is_cpu_place():
        out = paddle.matmul(weight, x, transpose_y=True).T
    else:
        out = paddle.matmul(x, weight, transpose_y=True)
    return out if bias is None else out + bias


class RMSNorm(nn.Layer):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([size], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
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
        self.register_buffer("sin", emb.sin(), persistable=False)

    def tables(self, positions: paddle.Tensor, dtype) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos/sin of shape [tokens, 1, head_dim] for a flat list of positions."""
        cos = paddle.index_select(self.cos, positions).unsqueeze(1).astype(dtype)
        sin = paddle.index_select(self.sin, positions).unsqueeze(1).astype(dtype)
        return cos, sin


def apply_rotary(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    half = x.shape[-1] // 2
    rotated = paddle.concat([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


_EXPANDED_MASK_LIMIT = 1 << 26  # elements (256 MB of float32) of a per-pass expanded attention mask


@dataclass
class SequenceGroup:
    """Sequences of one pass that each add `new` tokens; their tokens are `[start, end)` of the pass.

    `slots[s]` is sequence s's slot and `lens[s]` its total length after this pass.
    """

    start: int
    new: int
    slots: list[int]
    lens: list[int]
    max_len: int

    def __post_init__(self):
        # Shared by every layer, so built once per forward pass.
        self.end = self.start + self.new * len(self.slots)
        self.span = max(self.lens)
        # Read the cache through a view of the slots' range; gather only when slots have gaps.
        lo, hi = min(self.slots), max(self.slots) + 1
        self.slot_range = (lo, hi)
        self.slot_index = (None if hi - lo == len(self.slots)
                           else paddle.to_tensor([s - lo for s in self.slots], dtype="int64"))
        self.mask = self._mask()
        self._expanded: dict[tuple[int, int], paddle.Tensor | None] = {}

    def scores_mask(self, kv_heads: int, per_kv: int) -> paddle.Tensor | None:
        """The mask laid out like the scores, [S, kv_heads, new * per_kv, L], built once per pass and
        shared by every layer: a same-shape add ran 5x faster on CPU than broadcasting the 5-D mask.
        None when it would pass `_EXPANDED_MASK_LIMIT` elements (long prefills): the caller then
        broadcasts `mask`."""
        key = (kv_heads, per_kv)
        if key not in self._expanded:
            size = len(self.slots) * kv_heads * self.new * per_kv * self.span
            self._expanded[key] = None if size > _EXPANDED_MASK_LIMIT else self.mask.expand(
                [len(self.slots), kv_heads, self.new, per_kv, self.span]).contiguous().reshape(
                [len(self.slots), kv_heads, self.new * per_kv, self.span])
        return self._expanded[key]

    def _mask(self) -> paddle.Tensor:
        """Additive mask [S, 1, new, 1, L]: key j is visible to new token i of sequence s when
        j <= (len_s - new) + i, which is both the causal rule and the sequence's length."""
        lens = paddle.to_tensor(self.lens, dtype="int64").reshape([-1, 1, 1])
        i = paddle.arange(self.new, dtype="int64").reshape([1, -1, 1])
        j = paddle.arange(self.span, dtype="int64").reshape([1, 1, -1])
        visible = j <= lens - self.new + i
        mask = paddle.where(visible, paddle.zeros([1], "float32"), paddle.full([1], float("-inf"), "float32"))
        return mask.unsqueeze(1).unsqueeze(3)


@dataclass
class AttentionBatch:
    """Where the tokens of one forward pass sit in the KV cache.

    Tokens are flattened: `positions[i]` is token i's absolute position and `cache_rows[i]` its
    place `slot * max_len + position` in the slot cache. Each layer's cache is `[slots, kv_heads,
    max_len, head_dim]` stored flat as `[slots * kv_heads * max_len, head_dim]`, so a slot's keys
    for one head are contiguous rows that attention reads without copying. The projections and MLPs run over all
    tokens at once; attention runs per `SequenceGroup` (sequences adding equally many tokens), so
    prompts, decodes and forced tokens of any mix share one pass. No groups means a plain causal
    pass over one sequence (training and reference tests).
    """

    positions: paddle.Tensor
    cache_rows: paddle.Tensor | None = None
    groups: list[SequenceGroup] | None = None
    _rotary: tuple | None = field(default=None, init=False, repr=False)
    _head_rows: paddle.Tensor | None = field(default=None, init=False, repr=False)

    def rotary_tables(self, rotary: "RotaryEmbedding", dtype):
        if self._rotary is None:
            self._rotary = rotary.tables(self.positions, dtype)
        return self._rotary

    def head_rows(self, kv_heads: int) -> paddle.Tensor:
        """Flat cache row of every (token, kv head), token-major: where `k.reshape([-1, head_dim])` goes."""
        if self._head_rows is None:
            max_len = self.groups[0].max_len
            slot, pos = self.cache_rows // max_len, self.cache_rows % max_len
            heads = paddle.arange(kv_heads, dtype="int64").unsqueeze(0)
            self._head_rows = ((slot.unsqueeze(1) * kv_heads + heads) * max_len + pos.unsqueeze(1)).reshape([-1])
        return self._head_rows


class Attention(nn.Layer):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        hidden = config.hidden_size
        self.qkv_weight = self.create_parameter([self.q_size + 2 * self.kv_size, hidden])  # [out, in]
        self.qkv_bias = (self.create_parameter([self.q_size + 2 * self.kv_size], is_bias=True)
                         if config.attention_bias else None)
        self.o_weight = self.create_parameter([hidden, self.q_size])
        self.o_bias = self.create_parameter([hidden], is_bias=True) if config.o_proj_bias else None
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def forward(self, x, batch: AttentionBatch, rotary: RotaryEmbedding, kv_cache):
        # x: [tokens, hidden] (the batch is flattened to tokens)
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = paddle.split(qkv, [self.q_size, self.kv_size, self.kv_size], axis=-1)
        q = q.reshape([-1, self.num_heads, self.head_dim])
        k = k.reshape([-1, self.num_kv_heads, self.head_dim])
        v = v.reshape([-1, self.num_kv_heads, self.head_dim])
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = batch.rotary_tables(rotary, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        if kv_cache is None:
            out = self._causal(q, k, v)
        else:
            k_cache, v_cache = kv_cache
            rows = batch.head_rows(self.num_kv_heads)
            k_cache.scatter_(rows, k.reshape([-1, self.head_dim]), overwrite=True)
            v_cache.scatter_(rows, v.reshape([-1, self.head_dim]), overwrite=True)
            out = paddle.concat([self._cached(q[g.start:g.end], g, k_cache, v_cache) for g in batch.groups])
        return linear(out.reshape([-1, self.q_size]), self.o_weight, self.o_bias)

    def _slot_view(self, cache, group: SequenceGroup):
        """[S, Hkv, span, D]: a strided view of the cache when the group's slots are contiguous."""
        lo, hi = group.slot_range
        view = cache.reshape([-1, self.num_kv_heads, group.max_len, self.head_dim])[lo:hi, :, :group.span]
        return view if group.slot_index is None else paddle.index_select(view, group.slot_index)

    def _causal(self, q, k, v):
        """One sequence, all positions (training and tests): [T, H, D] -> [T, H, D]."""
        return F.scaled_dot_product_attention(
            q.unsqueeze(0), self._repeat_kv(k).unsqueeze(0), self._repeat_kv(v).unsqueeze(0),
            is_causal=True).squeeze(0)

    def _repeat_kv(self, x):
        group = self.num_heads // self.num_kv_heads
        return x if group == 1 else paddle.repeat_interleave(x, group, axis=1)

    def _cached(self, q, group: SequenceGroup, k_cache, v_cache):
        """Attention of new tokens over their sequences' cached keys (prefill or batched decode).

        Heads sharing a KV head are folded into the query-length axis, so each product is one
        batched matmul over [sequences, kv heads] that reads the cache views in place.
        """
        seqs, new, span = len(group.slots), group.new, group.span
        hkv, per_kv, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        keys, values = (self._slot_view(c, group) for c in (k_cache, v_cache))              # [S, Hkv, L, D]
        # Scale q, not the scores: they are span/dim times larger, and every pass over them counts.
        q = (q * self.scale).reshape([seqs, new, hkv, per_kv, dim]).transpose([0, 2, 1, 3, 4])
        scores = paddle.matmul(q.reshape([seqs, hkv, new * per_kv, dim]), keys, transpose_y=True)
        if scores.dtype != paddle.float32:
            scores = scores.astype("float32")
        mask = group.scores_mask(hkv, per_kv)
        if mask is not None:
            scores = scores + mask
        else:
            scores = (scores.reshape([seqs, hkv, new, per_kv, span]) + group.mask).reshape([seqs, hkv, new * per_kv, span])
        probs = F.softmax(scores, axis=-1)
        if probs.dtype != q.dtype:
            probs = probs.astype(q.dtype)
        out = paddle.matmul(probs, values).reshape([seqs, hkv, new, per_kv, dim])
        return out.transpose([0, 2, 1, 3, 4]).reshape([-1, self.num_heads, dim])


class MLP(nn.Layer):
    """Gated MLP: `down(act(gate(x)) * up(x))`, `act` the config's `hidden_act`, biases with `mlp_bias`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.act = activation(config.hidden_act)
        # silu(gate) * up in one fused kernel that also splits gate_up: 2x faster than split, silu, mul
        self.fused_swiglu = config.hidden_act in ("silu", "swish")
        self.gate_up_weight = self.create_parameter([2 * config.intermediate_size, config.hidden_size])  # [out, in]
        self.down_weight = self.create_parameter([config.hidden_size, config.intermediate_size])
        self.gate_up_bias = (self.create_parameter([2 * config.intermediate_size], is_bias=True)
                             if config.mlp_bias else None)
        self.down_bias = self.create_parameter([config.hidden_size], is_bias=True) if config.mlp_bias else None

    def forward(self, x):
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)
        if self.fused_swiglu:
            hidden = F.swiglu(gate_up)
        else:
            gate, up = paddle.split(gate_up, 2, axis=-1)
            hidden = self.act(gate) * up
        return linear(hidden, self.down_weight, self.down_bias)
