"""Write a random-weight checkpoint with the Qwen2.5-0.5B shape, for benchmarks.

    python bench/make_bench_model.py --out bench/models/qwen2.5-0.5b-random

Shape: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied
embeddings, q/k/v bias. Weights are float16 (the loader upcasts on CPU). The tokenizer is a
byte-level BPE with 151,643 synthetic merges (random concatenations of existing tokens) plus
the ChatML special tokens, so grammar engines see a vocabulary of the real size; its
segmentation of real text is not meaningful, nor is anything the model writes.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from safetensors.numpy import save_file

SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864, vocab_size=151936)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "models", "qwen2.5-0.5b-random"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="fewer layers for a quick try")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    head = h // SHAPE["num_attention_heads"]
    kv = SHAPE["num_key_value_heads"] * head

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    tensors = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": np.ones(h, np.float16)}
    for n in range(args.layers):
        p = f"model.layers.{n}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.q_proj.bias": w(h),
            p + "self_attn.k_proj.weight": w(kv, h), p + "self_attn.k_proj.bias": w(kv),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.v_proj.bias": w(kv),
            p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h), p + "mlp.down_proj.weight": w(h, i),
            p + "input_layernorm.weight": np.ones(h, np.float16),
            p + "post_attention_layernorm.weight": np.ones(h, np.float16),
        })
    save_file(tensors, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    eos = v - len(SPECIALS) + 2  # <|im_end|>
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SHAPE,
              "num_hidden_layers": args.layers, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 32768, "tie_word_embeddings": True, "torch_dtype": "float16",
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
    print(f"wrote {args.out} ({sum(t.size for t in tensors.values()) / 1e6:.0f}M parameters)")


if __name__ == "__main__":
    main()
