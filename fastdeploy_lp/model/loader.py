"""Hugging Face safetensors checkpoints in and out of `DecoderForCausalLM`.

Reads one `model.safetensors` or the shards listed in `model.safetensors.index.json`, in float32,
bfloat16 or float16, transposes `[out, in]` linear weights to Paddle's `[in, out]`, and fuses
q/k/v and gate/up. `save_pretrained` does the reverse, so the project's own training script
writes checkpoints that any Hugging Face tool reads.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import paddle
from safetensors import safe_open

from ..config import ModelConfig
from .decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)

_ATTN = "model.layers.{i}.self_attn."
_MLP = "model.layers.{i}.mlp."


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, s) for s in shards]
    else:
        files = [os.path.join(model_dir, "model.safetensors")]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"model: checkpoint file(s) missing in {model_dir!r}: "
                                f"{', '.join(os.path.basename(m) for m in missing)}")
    return files


def _read_tensors(model_dir: str) -> dict[str, paddle.Tensor]:
    tensors = {}
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="paddle") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def load_model(config: ModelConfig, max_positions: int | None = None) -> DecoderForCausalLM:
    """Build the decoder in `config.dtype` on the current Paddle device and load its weights."""
    paddle.set_default_dtype(config.dtype)
    try:
        model = DecoderForCausalLM(config, max_positions)
    finally:
        paddle.set_default_dtype("float32")
    model.eval()
    raw = _read_tensors(config.model)

    def take(name: str) -> paddle.Tensor:
        if name not in raw:
            raise ValueError(f"model: weight {name!r} missing from the checkpoint in {config.model!r}")
        return raw.pop(name).astype(config.dtype)

    def linear(name: str) -> paddle.Tensor:  # HF [out, in] -> Paddle [in, out]
        return take(name).T

    state = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    for i in range(config.num_hidden_layers):
        attn, mlp, p = _ATTN.format(i=i), _MLP.format(i=i), f"layers.{i}."
        state[p + "self_attn.qkv_weight"] = paddle.concat(
            [linear(attn + f"{x}_proj.weight") for x in "qkv"], axis=1)
        if config.attention_bias:
            state[p + "self_attn.qkv_bias"] = paddle.concat([take(attn + f"{x}_proj.bias") for x in "qkv"])
        state[p + "self_attn.o_weight"] = linear(attn + "o_proj.weight")
        if config.qk_norm:
            state[p + "self_attn.q_norm.weight"] = take(attn + "q_norm.weight")
            state[p + "self_attn.k_norm.weight"] = take(attn + "k_norm.weight")
        state[p + "mlp.gate_up_weight"] = paddle.concat(
            [linear(mlp + "gate_proj.weight"), linear(mlp + "up_proj.weight")], axis=1)
        state[p + "mlp.down_weight"] = linear(mlp + "down_proj.weight")
        state[p + "input_layernorm.weight"] = take(f"model.layers.{i}.input_layernorm.weight")
        state[p + "post_attention_layernorm.weight"] = take(f"model.layers.{i}.post_attention_layernorm.weight")
    if not config.tie_word_embeddings:
        state["lm_head"] = take("lm_head.weight")
    raw.pop("lm_head.weight", None)  # some tied checkpoints store the shared matrix twice
    if raw:
        logger.warning("ignoring %d unexpected checkpoint tensors, e.g. %s", len(raw), next(iter(raw)))

    expected = set(model.state_dict().keys())
    missing = expected - set(state)
    if missing:
        raise ValueError(f"model: no weights for {sorted(missing)[:5]}")
    model.set_state_dict(state)
    return model


def hf_state_dict(model: DecoderForCausalLM) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face names and layouts, as float32 numpy arrays."""
    cfg = model.config
    state = {k: v.astype("float32").numpy() for k, v in model.state_dict().items()}
    out = {"model.embed_tokens.weight": state["embed_tokens.weight"], "model.norm.weight": state["norm.weight"]}
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        attn, mlp, p = _ATTN.format(i=i), _MLP.format(i=i), f"layers.{i}."
        wq, wk, wv = np.split(state[p + "self_attn.qkv_weight"], [q, q + kv], axis=1)
        for name, w in zip("qkv", (wq, wk, wv)):
            out[attn + f"{name}_proj.weight"] = w.T
        if cfg.attention_bias:
            for name, b in zip("qkv", np.split(state[p + "self_attn.qkv_bias"], [q, q + kv])):
                out[attn + f"{name}_proj.bias"] = b
        out[attn + "o_proj.weight"] = state[p + "self_attn.o_weight"].T
        if cfg.qk_norm:
            out[attn + "q_norm.weight"] = state[p + "self_attn.q_norm.weight"]
            out[attn + "k_norm.weight"] = state[p + "self_attn.k_norm.weight"]
        gate, up = np.split(state[p + "mlp.gate_up_weight"], 2, axis=1)
        out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = gate.T, up.T
        out[mlp + "down_proj.weight"] = state[p + "mlp.down_weight"].T
        out[f"model.layers.{i}.input_layernorm.weight"] = state[p + "input_layernorm.weight"]
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = state[p + "post_attention_layernorm.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = state["lm_head"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_pretrained(model: DecoderForCausalLM, out_dir: str) -> None:
    """Write `model.safetensors` (float32) in the Hugging Face layout."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(hf_state_dict(model), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
