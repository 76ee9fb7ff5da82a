"""Every decoder layer of a pass in one CPU kernel call (`CpuKernels.decoder_layers`), where the pass allows it.

At batch 1 a layer's dozen steps between Python and the kernels (two norms, six kernel calls and
their output tensors, two residual adds) cost ~5 ms per decode step on the bench model: 7% of a
float32 step and 15% of a wint8 one; a call per layer still cost ~1 ms (the structs, pointers and
buffers of 24 calls). The fused call chains the same kernels in C for the whole stack. It runs only
where every kernel it chains was chosen for the pass (`linear.kernels_for`, measured per op and row
bucket), so it never replaces a Paddle op that was measured faster.
"""

from __future__ import annotations

import paddle

from fastdeploy_lp.model import cpu_kernels
from fastdeploy_lp.model.layers import AttentionBatch, RMSNorm, RotaryEmbedding, zero_fresh_blocks
from fastdeploy_lp.model.linear import kernels_for


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


def run_fused_layers(kernels: cpu_kernels.CpuKernels, layers, x: paddle.Tensor, batch: AttentionBatch,
                     rotary: RotaryEmbedding, kv_caches, final_norm: RMSNorm, lora_pass=None) -> paddle.Tensor:
    """Every layer of `layers` (a model's `DecoderLayer`s, `kv_caches` theirs) over `x` and then the
    model's `final_norm` in one call, where `fused_layer_kernels` allows it for the first (all layers
    are alike), with the rows' LoRA adapters (`lora.LoRAPass`, None: none) after each linear. The
    norm as a Paddle op of its own cost a batch-1 step 0.2 ms."""
    rotary.check_table(batch)
    for cache in kv_caches:
        zero_fresh_blocks(batch, cache)
    group = batch.groups[0]
    tables, lens, max_len = group.kernel_inputs
    attn = layers[0].self_attn
    attention = cpu_kernels.PagedAttention(
        cos=rotary.cos, sin=rotary.sin, positions=batch.positions, write_rows=batch.write_rows, tables=tables,
        lens=lens, seqs=len(group.lens), new_tokens=group.new, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
        dim=attn.head_dim, block_size=group.block_size, max_len=max_len, scale=attn.scale)
    return kernels.decoder_layers(x, _stack(layers, kv_caches, final_norm), attention,
                                  None if lora_pass is None else lora_pass.kernel_inputs())


def _stack(layers, kv_caches, final_norm: RMSNorm) -> cpu_kernels.LayerStack:
    """The layers' `LayerStack` for these caches, built at the first fused pass and kept on `layers`
    (weights and caches stay where they are for the model's life)."""
    kept = getattr(layers, "_fused_stack", None)
    if kept is not None and kept[0] is kv_caches:
        return kept[1]
    linears = [[(a.qkv_weight, a.qkv_weight_scale, a.qkv_bias, a.qkv_weight_layout),
                (a.o_weight, a.o_weight_scale, a.o_bias, a.o_weight_layout),
                (m.gate_up_weight, m.gate_up_weight_scale, m.gate_up_bias, m.gate_up_weight_layout),
                (m.down_weight, m.down_weight_scale, m.down_bias, m.down_weight_layout)]
               for a, m in ((layer.self_attn, layer.mlp) for layer in layers)]
    norms = [(layer.input_layernorm.weight, layer.post_attention_layernorm.weight) for layer in layers]
    stack = cpu_kernels.LayerStack.of(norms, linears, [tuple(pair) for pair in kv_caches], final_norm.weight,
                                      layers[0].mlp.intermediate, layers[0].input_layernorm.eps)
    layers._fused_stack = (kv_caches, stack)
    return stack
