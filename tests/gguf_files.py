"""GGUF files for the tests, written with the `gguf` package (llama.cpp's own writer) the way
llama.cpp's `convert_hf_to_gguf.py` writes them: metadata from `config.json`, the byte-level BPE
tokenizer from `tokenizer.json`, llama's q/k rows permuted for its interleaved RoPE, each tensor in
the type asked for.

`gguf.quants.quantize` writes the 32-weight formats; the K formats (Q4_K, Q5_K, Q6_K) are
quantized here by a plain round-to-nearest (llama.cpp's quantizer searches scales; the tests only
need valid blocks near the float weights, and read them back through `gguf.quants.dequantize`).
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
from safetensors.numpy import save_file

T = gguf.GGMLQuantizationType
ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    for key, name in LAYER_NAMES.items():
        if rest.startswith(key):
            return f"blk.{layer}.{name}{rest[len(key):]}"
    raise KeyError(hf)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: rotate-half rows to llama.cpp's interleaved order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """`w` (float32 `[rows, cols]` or a vector) as GGML `kind`: the bytes, `[rows, row bytes]`."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if kind == "F32":
        return w
    if kind == "F16":
        return w.astype(np.float16)
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        return _k_quant(w.reshape(-1, 256), kind).reshape(w.shape[0], -1)
    return gguf.quants.quantize(w, getattr(T, kind))


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _k_quant(blocks: np.ndarray, kind: str) -> np.ndarray:
    n = len(blocks)
    if kind == "Q6_K":
        sub = blocks.reshape(n, 16, 16)
        scale = np.abs(sub).max(axis=-1) / 31  # per 16: q in [-32, 31]
        d = np.maximum(np.abs(scale).max(axis=-1), 1e-12) / 127
        sc = np.clip(np.rint(scale / d[:, None]), 1, 127).astype(np.int8)
        step = (d.astype(np.float16).astype(np.float32)[:, None] * sc)[:, :, None]
        q = (np.clip(np.rint(sub / step), -32, 31) + 32).astype(np.uint8).reshape(n, 8, 32)
        ql, qh = np.zeros((n, 128), np.uint8), np.zeros((n, 64), np.uint8)
        for j in range(8):
            lo = (q[:, j] & 15) << (4 * ((j % 4) // 2))
            ql[:, 64 * (j // 4) + 32 * (j % 2): 64 * (j // 4) + 32 * (j % 2) + 32] |= lo
            qh[:, 32 * (j // 4): 32 * (j // 4) + 32] |= (q[:, j] >> 4) << (2 * (j % 4))
        return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)
    levels = 15 if kind == "Q4_K" else 31
    groups = blocks.reshape(n, 8, 32)
    low = np.minimum(groups.min(axis=-1), 0)
    scale = (groups.max(axis=-1) - low) / levels
    d = np.maximum(scale.max(axis=-1), 1e-12) / 63
    dmin = np.maximum((-low).max(axis=-1), 1e-12) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d16[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(-low / dmin16[:, None]), 0, 63).astype(np.uint8)
    q = np.clip(np.rint((groups + (dmin16[:, None] * m)[:, :, None]) / (d16[:, None] * sc)[:, :, None]), 0, levels)
    q = q.astype(np.uint8)
    packed = np.zeros((n, 12), np.uint8)  # the inverse of k_scale_min
    packed[:, 0:4] = sc[:, 0:4] | (sc[:, 4:8] >> 4) << 6
    packed[:, 4:8] = m[:, 0:4] | (m[:, 4:8] >> 4) << 6
    packed[:, 8:12] = (sc[:, 4:8] & 15) | (m[:, 4:8] & 15) << 4
    qs = np.zeros((n, 128), np.uint8)
    for j in range(8):
        qs[:, 32 * (j // 2): 32 * (j // 2) + 32] |= (q[:, j] & 15) << (4 * (j % 2))
    parts = [_f16_bytes(d), _f16_bytes(dmin), packed]
    if kind == "Q5_K":
        qh = np.zeros((n, 32), np.uint8)
        for j in range(8):
            qh |= (q[:, j] >> 4) << j
        parts.append(qh)
    return np.concatenate(parts + [qs], axis=1)


def write_gguf(hf_dir: str, path: str, types=None, weights: dict | None = None, arch: str | None = None,
               split_max_tensors: int = 0, extra_tensors: dict | None = None, pre: str = "gpt-2") -> str:
    """The checkpoint in `hf_dir` (or `weights`, Hugging Face names -> float32, with its config and
    tokenizer) as a GGUF file at `path`. `types(hf_name, array) -> GGML type name` picks each
    tensor's type (default: F32); `pre` names the BPE pre-tokenizer (llama.cpp's names)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    weights = weights if weights is not None else float_weights(hf_dir)
    arch = arch or ARCH[cfg["architectures"][0]]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    scaling = cfg.get("rope_scaling") or {}
    if arch == "llama" and scaling.get("rope_type") == "llama3":  # as the converter: per-frequency factors
        extra_tensors = {"rope_freqs.weight": llama3_rope_factors(cfg, head_dim), **(extra_tensors or {})}
    _add_tokenizer(writer, hf_dir, pre)
    for hf, value in weights.items():
        kind = "F32" if types is None or value.ndim == 1 else types(hf, value)
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            value = permute(value, heads if ".q_proj." in hf else kv)
        data = quantize(value, kind)
        writer.add_tensor(gguf_name(hf), data, raw_dtype=getattr(T, kind))
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def float_weights(hf_dir: str) -> dict[str, np.ndarray]:
    """A safetensors checkpoint's tensors (one file or shards) as float32, bfloat16 ones too (numpy
    cannot read those)."""
    import glob

    from safetensors import safe_open

    out = {}
    for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        with safe_open(path, framework="paddle") as f:
            out.update({name: f.get_tensor(name).astype("float32").numpy() for name in f.keys()})
    return out


def llama3_rope_factors(cfg: dict, head_dim: int) -> np.ndarray:
    """What convert_hf_to_gguf.py writes as `rope_freqs.weight` for Llama 3.x RoPE scaling."""
    scaling = cfg["rope_scaling"]
    freqs = 1.0 / (np.float32(cfg.get("rope_theta", 10000.0)) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _add_tokenizer(writer: gguf.GGUFWriter, hf_dir: str, pre: str, vocab_size: int | None = None) -> None:
    """`hf_dir`'s tokenizer, its token list padded to the embedding's `vocab_size` rows (default:
    its config's)."""
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    with open(os.path.join(hf_dir, "config.json")) as f:
        size = vocab_size or json.load(f)["vocab_size"]
    vocab = tok["model"]["vocab"]
    added = {t["id"]: t for t in tok["added_tokens"]}
    tokens = [f"[PAD{i}]" for i in range(max(size, len(vocab), max(added, default=0) + 1))]  # as the converter pads
    for text, i in vocab.items():
        tokens[i] = text
    for i, t in added.items():
        tokens[i] = t["content"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in added and added[i]["special"] else 1 if i in added or t in vocab else 5
                            for i, t in enumerate(tokens)])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_eos_token_id(tokens.index(tok_cfg["eos_token"]))
    writer.add_add_bos_token(False)
    template = os.path.join(hf_dir, "chat_template.jinja")
    if os.path.isfile(template):
        with open(template) as f:
            writer.add_chat_template(f.read())


def float_checkpoint(gguf_path: str, hf_dir: str, out_dir: str) -> str:
    """The GGUF file's weights dequantized by `gguf.quants.dequantize`, as a float32 safetensors
    checkpoint (with `hf_dir`'s config and tokenizer): the float path the engine is compared with."""
    import shutil

    reader = gguf.GGUFReader(gguf_path)
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    back = {gguf_name(n): n for n in _hf_names(cfg)}
    state = {}
    for t in reader.tensors:
        hf = back[t.name]
        value = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(
            [int(n) for n in reversed(t.shape.tolist())])
        if reader.fields["general.architecture"].contents() == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            n = heads if ".q_proj." in hf else kv
            value = value.reshape(n, value.shape[0] // n // 2, 2, *value.shape[1:]).swapaxes(1, 2).reshape(value.shape)
        state[hf] = np.ascontiguousarray(value)
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copy(os.path.join(hf_dir, name), out_dir)
    return out_dir


def _hf_names(cfg: dict) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        for key in LAYER_NAMES:
            for suffix in ((".weight", ".bias") if not key.endswith(".weight") else ("",)):
                names.append(f"model.layers.{i}.{key}{suffix}")
    return names


def random_checkpoint(hf_dir: str, out_dir: str, hidden: int = 256, intermediate: int = 512, layers: int = 2,
                      seed: int = 0) -> str:
    """A Llama checkpoint with `hf_dir`'s tokenizer and random weights, wide enough (rows of 256)
    for the K formats."""
    import shutil

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, head_dim=64,
               num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, tie_word_embeddings=False)
    rng = np.random.default_rng(seed)
    vocab, q, kv = cfg["vocab_size"], hidden, hidden // 2

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    state = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden),
             "model.norm.weight": 1 + w(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": w(q, hidden), p + "self_attn.k_proj.weight": w(kv, hidden),
                      p + "self_attn.v_proj.weight": w(kv, hidden), p + "self_attn.o_proj.weight": w(hidden, q),
                      p + "mlp.gate_proj.weight": w(intermediate, hidden), p + "mlp.up_proj.weight": w(intermediate, hidden),
                      p + "mlp.down_proj.weight": w(hidden, intermediate),
                      p + "input_layernorm.weight": 1 + w(hidden), p + "post_attention_layernorm.weight": 1 + w(hidden)})
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(hf_dir, name), out_dir)
    return out_dir
