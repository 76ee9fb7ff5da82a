"""What LoRA costs a decode step: batch 8 on 8 different adapters against 8 base-model requests.

    python bench/make_bench_model.py            # once: the Qwen2.5-0.5B-shaped random checkpoint
    python bench/lora.py --model bench/models/qwen2.5-0.5b-random --rank 16 --weights bfloat16

Writes `--adapters` random rank-`--rank` PEFT adapters on every projection (q/k/v/o, gate/up/down)
into a temporary directory, then times greedy decoding of `--batch` random prompts of
`--prompt-len` tokens: decode tokens/s is measured between a run of `--output-len` tokens and a run
of 1 token, so prefill cancels out. Configurations: the base model alone, every request on one
adapter, one adapter per request; `--repeats` rounds interleaved, the median reported. Prints a
table, then the same numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

from fastdeploy_lp import LLM, LoRARequest, SamplingParams

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection, from a Llama-family `config.json`."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def write_adapter(path: str, config: dict, rank: int, seed: int, scale: float = 0.01) -> str:
    rng, tensors = np.random.default_rng(seed), {}
    for layer in range(config["num_hidden_layers"]):
        for name, (out, inp) in projection_shapes(config).items():
            part = "self_attn" if name[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[key + ".lora_A.weight"] = rng.standard_normal((rank, inp), dtype=np.float32) * scale
            tensors[key + ".lora_B.weight"] = rng.standard_normal((out, rank), dtype=np.float32) * scale
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(PROJECTIONS)}, f)
    return path


def decode_rate(llm: LLM, prompts: list[list[int]], output_len: int, lora_request) -> float:
    """Decode tokens/s of the batch, the engine stepped as `bench/throughput.py` does: (output_len - 1)
    tokens a request, from the last first token to the last token, so prefill is left out."""
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    per_prompt = llm._with_adapters(len(prompts), params, lora_request) if lora_request else [params] * len(prompts)
    engine, first, last = llm.engine, {}, 0.0
    for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
        engine.add_request(prompt, p, request_id=str(i))
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = time.perf_counter()
            first.setdefault(out.request_id, last)
    return len(prompts) * (output_len - 1) / (last - max(first.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench/models/qwen2.5-0.5b-random")
    parser.add_argument("--weights", default="bfloat16", help="float32, bfloat16 or wint8")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lora-dtype", help="what adapters are held in (default: the engine's auto)")
    args = parser.parse_args()
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    weights = {"quantization": "wint8"} if args.weights == "wint8" else {"dtype": args.weights}
    if args.lora_dtype:
        weights["lora_dtype"] = args.lora_dtype
    llm = LLM(args.model, enable_lora=True, max_lora_rank=args.rank, max_loras=args.adapters,
              max_num_seqs=args.batch, device="cpu", guided_decoding_backend="off", **weights)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 10000, args.prompt_len).tolist() for _ in range(args.batch)]
    with tempfile.TemporaryDirectory() as root:
        requests = [LoRARequest(f"a{i}", i + 1, write_adapter(os.path.join(root, f"a{i}"), config, args.rank, i))
                    for i in range(args.adapters)]
        configurations = {"base": None, "one adapter": [requests[0]] * args.batch,
                          f"{args.adapters} adapters": [requests[i % args.adapters] for i in range(args.batch)]}
        decode_rate(llm, prompts, 3, configurations[f"{args.adapters} adapters"])  # warm-up: adapters loaded
        rates = {name: [] for name in configurations}
        for _ in range(args.repeats):
            for name, lora_request in configurations.items():
                rates[name].append(decode_rate(llm, prompts, args.output_len, lora_request))
    median = {name: float(np.median(r)) for name, r in rates.items()}
    print(f"{args.model} {args.weights}, batch {args.batch}, rank-{args.rank} adapters on every projection held in "
          f"{args.lora_dtype or 'auto'}, median of {args.repeats}:\n\n"
          "| requests | decode tok/s | vs base | runs |\n|---|---:|---:|---|")
    for name, rate in median.items():
        print(f"| {name} | {rate:.1f} | {rate / median['base']:.2f}x | {', '.join(f'{r:.1f}' for r in rates[name])} |")
    print(json.dumps({"model": args.model, "weights": args.weights, "lora_dtype": args.lora_dtype or "auto",
                      "batch": args.batch, "rank": args.rank,
                      "tok_s": median, "runs": rates}))

if __name__ == "__main__":
    main()
