"""A decoder layer in one CPU kernel call (`CpuKernels.decoder_layer`), where a pass allows it.

At batch 1 a layer's dozen steps between Python and the kernels (two norms, six kernel calls and
their output tensors, two residual adds) cost ~5 ms per decode step on the bench model: 7% of a
float32 step and 15% of a wint8 one. The fused call chains the same kernels in C. It runs only
where every kernel it chains was chosen for the pass (`layers.kernels_for`, measured per op and row
bucket), so it never replaces a Paddle op that was measured faster.
"""

from __future__ import annotations

import paddle

from fastdeploy_lp.model import cpu_kernels
from fastdeploy_lp.model.layers import AttentionBatch, RotaryEmbedding, kernels_for, zero_fresh_blocks


def fused_layer_kernels(layer, x: paddle.Tensor, batch: AttentionBatch, kv_cache) -> cpu_kernels.CpuKernels | None:
    """The kernels if `layer` (a `DecoderLayer`) can run this pass in one call: a paged pass of up
    to `KERNEL_ROWS` tokens in one sequence group, unsharded, without q/k norm, with a silu MLP,
    and every kernel it chains chosen for these rows."""
    attn, mlp, rows = layer.self_attn, layer.mlp, x.shape[0]
    if (kv_cache is None or rows > cpu_kernels.KERNEL_ROWS or len(batch.groups) != 1 or attn.shard is not None
            or attn.q_norm is not None or not mlp.fused_swiglu):
        return None
    kernels = kernels_for(x, "linear", rows)
    if (kernels is None or kernels_for(x, "rotary", rows) is None or kernels_for(x, "swiglu", rows) is None
            or attn.attention_kernels(x, batch.groups[0]) is None):
        return None
    return kernels


def run_fused_layer(kernels: cpu_kernels.CpuKernels, layer, x: paddle.Tensor, batch: AttentionBatch,
                    rotary: RotaryEmbedding, kv_cache) -> paddle.Tensor:
    """`layer(x, batch, rotary, kv_cache)` in one call (see `fused_layer_kernels` for when)."""
    attn, mlp, group = layer.self_attn, layer.mlp, batch.groups[0]
    rotary.check_table(batch)
    zero_fresh_blocks(batch, kv_cache)
    tables, lens, max_len = group.kernel_inputs
    attention = cpu_kernels.PagedAttention(
        cos=rotary.cos, sin=rotary.sin, positions=batch.positions, write_rows=batch.write_rows, tables=tables,
        lens=lens, k_cache=kv_cache[0], v_cache=kv_cache[1], seqs=len(group.lens), new_tokens=group.new,
        heads=attn.num_heads, kv_heads=attn.num_kv_heads, dim=attn.head_dim, block_size=group.block_size,
        max_len=max_len, scale=attn.scale)
    linears = [(attn.qkv_weight, attn.qkv_weight_scale, attn.qkv_bias), (attn.o_weight, attn.o_weight_scale, attn.o_bias),
               (mlp.gate_up_weight, mlp.gate_up_weight_scale, mlp.gate_up_bias),
               (mlp.down_weight, mlp.down_weight_scale, mlp.down_bias)]
    return kernels.decoder_layer(x, layer.input_layernorm, layer.post_attention_layernorm, linears, attention,
                                 mlp.intermediate)
