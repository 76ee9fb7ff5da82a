"""GGUF files of the bench models, for `bench/throughput.py --gguf`.

    python bench/make_gguf.py --model bench/models/qwen2.5-0.5b-random --types Q8_0 Q4_0 Q4_K_M
    python bench/make_gguf.py --shape qwen2.5-7b --types Q4_K_M

From a checkpoint (`bench/make_bench_model.py`): written as F16 by the tests' GGUF writer
(`tests/gguf_files.py`, llama.cpp's `gguf` package), then quantized by llama.cpp's own quantizer
(`llama_model_quantize` of llama-cpp-python), so both engines read the bytes llama.cpp users have:
`<model>-F16.gguf`, `<model>-Q4_K_M.gguf`, ... beside the checkpoint. In the 0.5B shape the rows of
896 are not whole 256-weight blocks, so llama.cpp's Q4_K_M falls back to Q5_0/Q8_0 for those
tensors as it does for the real Qwen2.5-0.5B.

`--shape qwen2.5-7b`: a 7B-shaped Q4_K_M file (28 layers of 3584, 18944 MLP columns, vocabulary
152064, untied head) of random blocks with llama.cpp's Q4_K_M type mix (Q6_K for the head, and for
v and down in the first and last eighth and every third layer between), written block by block
without any float weights: 4.7 GB, for the load-memory check (`bench/load_memory.py`); the
bench model's synthetic tokenizer. Nothing the model writes means anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import gguf  # noqa: E402
from gguf_files import _add_tokenizer, write_gguf  # noqa: E402

HERE = os.path.dirname(__file__)
SEVEN_B = dict(hidden=3584, layers=28, heads=28, kv_heads=4, inter=18944, vocab=152064)


def from_checkpoint(model: str, types: list[str]) -> None:
    import llama_cpp

    base = f"{model.rstrip('/')}-F16.gguf"
    if not os.path.isfile(base):
        write_gguf(model, base + ".partial", types=lambda name, w: "F16", pre="qwen2")
        os.replace(base + ".partial", base)
        print(f"wrote {base}")
    for kind in types:
        out = f"{model.rstrip('/')}-{kind}.gguf"
        if os.path.isfile(out) or kind == "F16":
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
        params.nthread = len(os.sched_getaffinity(0))
        if llama_cpp.llama_model_quantize(base.encode(), (out + ".partial").encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {base} to {kind}")
        os.replace(out + ".partial", out)
        print(f"wrote {out}")


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random quants with float16 factors of a trained model's size (0.01 and 0.002)."""
    sizes = {"Q4_K": 144, "Q6_K": 210}
    blocks = rng.integers(0, 256, size=(rows * cols // 256, sizes[kind]), dtype=np.uint8)
    d = np.full(len(blocks), 0.0005, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    for at in ((0, 2) if kind == "Q4_K" else (208,)):
        blocks[:, at:at + 2] = d
    return blocks.reshape(rows, -1)


def seven_b(out: str, tokenizer_dir: str) -> None:
    s, rng = SEVEN_B, np.random.default_rng(0)
    head_dim = s["hidden"] // s["heads"]
    writer = gguf.GGUFWriter(out + ".partial", "qwen2")
    for add, value in ((writer.add_block_count, s["layers"]), (writer.add_context_length, 32768),
                       (writer.add_embedding_length, s["hidden"]), (writer.add_feed_forward_length, s["inter"]),
                       (writer.add_head_count, s["heads"]), (writer.add_head_count_kv, s["kv_heads"]),
                       (writer.add_rope_dimension_count, head_dim)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    _add_tokenizer(writer, tokenizer_dir, "qwen2", vocab_size=s["vocab"])
    tensors = {"token_embd.weight": ("Q4_K", s["vocab"], s["hidden"]), "output.weight": ("Q6_K", s["vocab"], s["hidden"]),
               "output_norm.weight": ("F32", s["hidden"], 0)}
    n = s["layers"]
    for i in range(n):
        more_bits = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
        q, kv = s["hidden"], s["kv_heads"] * head_dim
        for name, rows, cols in (("attn_q", q, s["hidden"]), ("attn_k", kv, s["hidden"]), ("attn_v", kv, s["hidden"]),
                                 ("attn_output", s["hidden"], q), ("ffn_gate", s["inter"], s["hidden"]),
                                 ("ffn_up", s["inter"], s["hidden"]), ("ffn_down", s["hidden"], s["inter"])):
            kind = "Q6_K" if more_bits and name in ("attn_v", "ffn_down") else "Q4_K"
            tensors[f"blk.{i}.{name}.weight"] = (kind, rows, cols)
        for bias, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            tensors[f"blk.{i}.{bias}.bias"] = ("F32", rows, 0)
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = ("F32", s["hidden"], 0)
    for name, (kind, rows, cols) in tensors.items():  # shapes first: the writer needs every tensor's info
        shape = (rows,) if kind == "F32" else (rows, cols // 256 * {"Q4_K": 144, "Q6_K": 210}[kind])
        writer.add_tensor_info(name, shape, np.dtype(np.float32 if kind == "F32" else np.uint8),
                               rows * 4 if kind == "F32" else shape[0] * shape[1], raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, (kind, rows, cols) in tensors.items():
        data = (np.ones(rows, np.float32) if kind == "F32" else random_blocks(kind, rows, cols, rng))
        writer.write_tensor_data(data)
    writer.close()
    os.replace(out + ".partial", out)
    print(f"wrote {out} ({os.path.getsize(out) / 1e9:.2f} GB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(HERE, "models", "qwen2.5-0.5b-random"))
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q4_K_M"])
    ap.add_argument("--shape", choices=["qwen2.5-7b"], help="a random file of this shape instead (Q4_K_M)")
    ap.add_argument("--out", help="with --shape: the file to write")
    args = ap.parse_args()
    if args.shape:
        seven_b(args.out or os.path.join(HERE, "models", "qwen2.5-7b-random-Q4_K_M.gguf"), args.model)
    else:
        from_checkpoint(args.model, args.types)


if __name__ == "__main__":
    main()
