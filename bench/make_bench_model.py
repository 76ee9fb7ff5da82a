"""Write a random-weight checkpoint with the Qwen2.5-0.5B (or 7B) shape, for benchmarks.

    python bench/make_bench_model.py --out bench/models/qwen2.5-0.5b-random
    python bench/make_bench_model.py --shape qwen2.5-7b --dtype bfloat16 --out bench/models/qwen2.5-7b-random

0.5B shape: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied
embeddings, q/k/v bias. 7B shape: hidden 3584, 28 layers, 28 heads, 4 KV heads, intermediate 18944,
vocab 152064, untied LM head (15 GB in bfloat16, written in shards of a few layers with an index,
as the Hub ships it, so no step holds the whole model). Weights are float16 unless `--dtype
bfloat16`. The tokenizer is a
byte-level BPE with 151,643 synthetic merges (random concatenations of existing tokens) plus
the ChatML special tokens, so grammar engines see a vocabulary of the real size; its
segmentation of real text is not meaningful, nor is anything the model writes.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_alphabet() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    extra = [b for b in range(256) if b not in bs]
    return [chr(b) for b in bs] + [chr(256 + i) for i in range(len(extra))]


def synthetic_bpe(vocab_size: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    tokens = byte_alphabet()
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    target = vocab_size - len(SPECIALS)
    while len(tokens) < target:
        a, b = tokens[rng.integers(len(tokens))], tokens[rng.integers(min(len(tokens), 4096))]
        new = a + b
        if len(new) > 12 or new in vocab:
            continue
        vocab[new] = len(tokens)
        tokens.append(new)
        merges.append([a, b])
    added = [{"id": target + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in enumerate(SPECIALS)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


class Writer:
    """Random tensors in the asked dtype, written in shards of `per_shard` layers plus an index."""

    def __init__(self, out: str, dtype: str, seed: int):
        self.out, self.dtype, self.rng = out, dtype, np.random.default_rng(seed)
        self.shard: dict[str, np.ndarray] = {}
        self.files: list[tuple[str, list[str]]] = []
        self.parameters = 0

    def random(self, *shape: int) -> np.ndarray:
        return self.encode(self.rng.standard_normal(shape, dtype=np.float32) * 0.02)

    def ones(self, n: int) -> np.ndarray:
        return self.encode(np.ones(n, np.float32))

    def encode(self, x: np.ndarray) -> np.ndarray:
        self.parameters += x.size
        if self.dtype == "float16":
            return x.astype(np.float16)
        return (x.view(np.uint32) + 0x8000 >> 16).astype(np.uint16)  # bfloat16 words, rounded

    def flush(self) -> None:
        if self.shard:
            name = f"model-{len(self.files) + 1:05d}.safetensors"
            self.files.append((name, sorted(self.shard)))
            _save(os.path.join(self.out, name), self.shard, "F16" if self.dtype == "float16" else "BF16")
            self.shard = {}

    def finish(self) -> None:
        self.flush()
        weight_map = {t: name for name, names in self.files for t in names}
        with open(os.path.join(self.out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _save(path: str, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """A safetensors file by hand: numpy has no bfloat16, so 16-bit words are written as they are."""
    header, offset = {}, 0
    for name in sorted(tensors):
        header[name] = {"dtype": dtype, "shape": list(tensors[name].shape), "data_offsets": [offset, offset + tensors[name].nbytes]}
        offset += tensors[name].nbytes
    blob = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).tobytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "models", "qwen2.5-0.5b-random"))
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, help="fewer layers for a quick try")
    ap.add_argument("--layers-per-shard", type=int, default=2)
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    layers = args.layers or shape["num_hidden_layers"]
    os.makedirs(args.out, exist_ok=True)
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    out = Writer(args.out, args.dtype, args.seed)
    out.shard.update({"model.embed_tokens.weight": out.random(v, h), "model.norm.weight": out.ones(h)})
    if not shape["tie_word_embeddings"]:
        out.shard["lm_head.weight"] = out.random(v, h)
    out.flush()
    for n in range(layers):
        p = f"model.layers.{n}."
        out.shard.update({
            p + "self_attn.q_proj.weight": out.random(h, h), p + "self_attn.q_proj.bias": out.random(h),
            p + "self_attn.k_proj.weight": out.random(kv, h), p + "self_attn.k_proj.bias": out.random(kv),
            p + "self_attn.v_proj.weight": out.random(kv, h), p + "self_attn.v_proj.bias": out.random(kv),
            p + "self_attn.o_proj.weight": out.random(h, h),
            p + "mlp.gate_proj.weight": out.random(i, h), p + "mlp.up_proj.weight": out.random(i, h),
            p + "mlp.down_proj.weight": out.random(h, i),
            p + "input_layernorm.weight": out.ones(h), p + "post_attention_layernorm.weight": out.ones(h),
        })
        if (n + 1) % args.layers_per_shard == 0:
            out.flush()
    out.finish()
    eos = v - len(SPECIALS) + 2  # <|im_end|>
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **shape,
              "num_hidden_layers": layers, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 32768, "torch_dtype": args.dtype,
              "bos_token_id": None, "eos_token_id": eos, "hidden_act": "silu"}
    files = {
        "config.json": config,
        "generation_config.json": {"eos_token_id": eos},
        "tokenizer.json": synthetic_bpe(v, args.seed),
        "tokenizer_config.json": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
    }
    for name, content in files.items():
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
            json.dump(content, f, ensure_ascii=False)
    with open(os.path.join(args.out, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(CHATML)
    print(f"wrote {args.out} ({out.parameters / 1e6:.0f}M parameters, {args.dtype})")


if __name__ == "__main__":
    main()
