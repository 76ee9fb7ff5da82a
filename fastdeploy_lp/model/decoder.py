"""The Llama-family decoder: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norm) in one class.

The architectures on the Hub differ only in switches that `ModelConfig` reads (q/k/v, o_proj and
MLP biases, q/k norm, `hidden_act`, RoPE scaling, tied head) and refuses when it does not
implement them, so one `DecoderForCausalLM` covers them all.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy_lp.model_config import ModelConfig
from fastdeploy_lp.distributed.shard import TensorShard
from fastdeploy_lp.model import cpu_kernels, lora
from fastdeploy_lp.model.fused_layer import fused_layer_kernels, run_fused_layers
from fastdeploy_lp.model.layers import MLP, Attention, AttentionBatch, RMSNorm, RotaryEmbedding
from fastdeploy_lp.model.linear import linear, linear_weight


class DecoderLayer(nn.Layer):
    def __init__(self, config: ModelConfig, shard: TensorShard | None = None, prefix: str = ""):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, shard, prefix + "self_attn.")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, shard, prefix + "mlp.")

    def forward(self, x, batch, rotary, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), batch, rotary, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class TokenEmbedding(nn.Layer):
    """The token embedding `[vocab, hidden]`, held like a linear weight (`linear_weight`): in the
    checkpoint's dtype, or on CPU int8 with a float32 scale per row under `wint8`, where a lookup
    widens only the rows it reads. As the tied LM head, the int8 rows are read by the same kernels
    as every linear layer: the bench model's head is 28% of the bytes a decode step reads. On GPU
    it stays in the compute dtype under `wint8` (`gpu_weight_only`). In block formats (GGUF, wint4)
    a lookup dequantizes the rows it reads."""

    def __init__(self, vocab: int, config: ModelConfig):
        super().__init__()
        self.weight, self.weight_scale, self.weight_layout = linear_weight(
            self, [vocab, config.hidden_size], config, vocabulary=True, key="embed_tokens.weight")

    def forward(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        if self.weight_layout is not None:
            return cpu_kernels.required(self.weight_layout.describe()).embed_blocks(input_ids, self.weight,
                                                                                   self.weight_layout)
        narrow = (self.weight.dtype in (paddle.bfloat16, paddle.float16, paddle.int8)
                  and self.weight.place.is_cpu_place())
        kernels = cpu_kernels.for_op("widen", input_ids.shape[0]) if narrow and input_ids.ndim == 1 else None
        if kernels is not None:  # one call, where the ops below are up to four
            return kernels.embed(input_ids, self.weight, self.weight_scale)
        x = F.embedding(input_ids, self.weight)
        if self.weight_scale is None:
            return x
        return x.astype("float32") * F.embedding(input_ids, self.weight_scale.unsqueeze(-1))


class DecoderForCausalLM(nn.Layer):
    """`forward(input_ids, batch, kv_caches)` returns hidden states; `logits(hidden)` the scores.

    Without a cache (`kv_caches=None`) the input is one sequence run causally, which is what
    training and the reference tests use; the engine always passes the slot cache.

    With a `shard` (tensor parallelism, `fastdeploy_lp.distributed`) every rank builds the same
    decoder over its slice: `1/size` of the heads and MLP columns (layers.Attention, layers.MLP)
    and rows `vocab_range` of the embedding and LM head (one shard serves both when they are
    tied). All ranks run `forward` on the same inputs; `logits` gives every rank the full vocabulary.
    """

    def __init__(self, config: ModelConfig, max_positions: int | None = None, shard: TensorShard | None = None):
        super().__init__()
        self.config = config
        self.shard = shard
        self.vocab_range = (0, config.vocab_size) if shard is None else shard.part(config.vocab_size)
        vocab = self.vocab_range[1] - self.vocab_range[0]
        self.embed_tokens = TokenEmbedding(vocab, config)
        self.layers = nn.LayerList([DecoderLayer(config, shard, f"layers.{i}.") for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions or config.max_position_embeddings)
        self.lm_head, self.lm_head_scale, self.lm_head_layout = (  # [vocab, hidden], like the embedding
            (None, None, None) if config.tie_word_embeddings
            else linear_weight(self, [vocab, config.hidden_size], config, vocabulary=True, key="lm_head"))

    def embed(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        """Token embeddings; sharded, each rank looks up the ids in its rows (zeros for the others)
        and the ranks' results are summed."""
        if self.shard is None:
            return self._lookup(input_ids)
        start, end = self.vocab_range
        mine = (input_ids >= start) & (input_ids < end)
        x = self._lookup(paddle.where(mine, input_ids - start, paddle.zeros_like(input_ids)))
        return self.shard.all_reduce(x * mine.unsqueeze(-1).astype(x.dtype))

    def _lookup(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        x = self.embed_tokens(input_ids)
        return x if x.dtype == self.norm.weight.dtype else x.astype(self.norm.weight.dtype)

    def forward(self, input_ids: paddle.Tensor, batch: AttentionBatch, kv_caches=None) -> paddle.Tensor:
        x = self.embed(input_ids)
        # Every layer has the same shape and this pass's rows: whether they all run in one kernel
        # call is decided once per pass.
        fused = None if kv_caches is None else fused_layer_kernels(self.layers[0], x, batch, kv_caches[0])
        if fused is not None:
            return run_fused_layers(fused, self.layers, x, batch, self.rotary, kv_caches, self.norm, lora.active())
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, self.rotary, None if kv_caches is None else kv_caches[i])
        return self.norm(x)

    def logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        head = self.embed_tokens if self.lm_head is None else None
        weight, scale, layout = ((head.weight, head.weight_scale, head.weight_layout) if head is not None
                                 else (self.lm_head, self.lm_head_scale, self.lm_head_layout))
        # CPU: the decode kernels, or MKL streaming the wide [vocab, hidden] matrix
        out = linear(hidden, weight, scale=scale, layout=layout)
        out = out if out.is_contiguous() else out.contiguous()
        if self.shard is not None:  # each rank scored its rows of the vocabulary
            out = self.shard.all_gather(out, axis=-1)
        return out if out.dtype == paddle.float32 else out.astype("float32")  # a cast to float32 copies

    def full_logits(self, input_ids: list[int]) -> paddle.Tensor:
        """Logits at every position of one sequence, without a cache: [len, vocab] float32."""
        ids = paddle.to_tensor(input_ids, dtype="int64")
        batch = AttentionBatch(positions=paddle.arange(len(input_ids), dtype="int64"))
        return self.logits(self.forward(ids, batch))
