"""Decode throughput and time to first token, fastdeploy_lp vs. `transformers`, same checkpoint, same run.

    python bench/make_bench_model.py            # once: the Qwen2.5-0.5B-shaped random checkpoint
    python bench/throughput.py --batch-sizes 1 8 32 --prompt-lens 128 512 --output-len 64

For each batch size, all requests arrive together with random prompts of `--prompt-len` tokens
and generate exactly `--output-len` tokens (EOS ignored, greedy). TTFT is measured per request
from submission to its first token; decode tokens/s counts the tokens generated after each
request's first one, over the time between the first and the last token of the batch.
`transformers`' `generate()` runs on the same checkpoint (PyTorch, CPU, float32) when torch and
transformers are importable, timed the same way from the token times its streamer receives.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.model import cpu_kernels

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "models", "qwen2.5-0.5b-random")


def bench_fastdeploy(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    first, last = {}, 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last = now
    ttft = [first[str(i)] - start for i in range(len(prompts))]
    decode_time = last - max(ttft) - start if len(prompts) > 1 else last - first["0"]
    return {"ttft_s": float(np.mean(ttft)), "decode_tok_s": len(prompts) * (output_len - 1) / decode_time}


def bench_transformers(model_dir: str, prompts: list[list[int]], output_len: int) -> dict | None:
    try:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.generation.streamers import BaseStreamer
    except ImportError:
        return None

    class Clock(BaseStreamer):
        """generate() hands the prompt, then each step's tokens, to its streamer: their times."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    clock = Clock()
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, streamer=clock, **kwargs)
    first, last = clock.times[1], clock.times[-1]  # times[0]: the prompt
    # The same clock as ours: TTFT from the start, decode from the first token to the last.
    return {"ttft_s": first - start, "decode_tok_s": len(prompts) * (output_len - 1) / (last - first)}


PREFILL_SEQS = 8  # sequences of the prefill-efficiency pass
AIMS = {"decode": {1: 1.1, 8: 1.25, 32: 1.25}, "ttft": {8: 0.9, 32: 0.9}}  # ours/theirs; TTFT lower is better


def prefill_efficiency(llm: LLM, seqs: int, prompt_len: int) -> dict:
    """Achieved prefill GFLOP/s (linear layers and LM head) against Paddle's own GEMM rate on the
    same shapes, measured warm in the same process."""
    from fastdeploy_lp.engine.runner import SequenceFeed

    cfg = llm.engine.fd_config.model_config
    h, inter, q = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]
    tokens = seqs * prompt_len

    def gemm_rate(k, n, reps=3):
        import paddle

        a, b = paddle.randn([tokens, k]), paddle.randn([n, k])
        for _ in range(2):
            paddle.matmul(a, b, transpose_y=True).numpy()
        start = time.perf_counter()
        for _ in range(reps):
            c = paddle.matmul(a, b, transpose_y=True)
        c.numpy()
        return 2 * tokens * k * n * reps / (time.perf_counter() - start) / 1e9

    rates = [gemm_rate(k, n) for k, n in shapes]
    weights = [k * n for k, n in shapes]
    gemm = sum(weights) / sum(w / r for w, r in zip(weights, rates))
    rng = np.random.default_rng(1)
    pool = llm.engine.block_pool
    blocks = [pool.allocate(pool.blocks_for(prompt_len)) for _ in range(seqs)]
    feeds = [SequenceFeed(b, rng.integers(0, cfg.vocab_size - 3, prompt_len).tolist(), 0) for b in blocks]
    llm.engine.runner.forward(feeds[:1], pool.take_fresh())
    start = time.perf_counter()
    llm.engine.runner.forward(feeds).numpy()
    seconds = time.perf_counter() - start
    for b in blocks:
        pool.release(b)
    flops = 2 * (tokens * cfg.num_hidden_layers * sum(weights) + seqs * h * cfg.vocab_size)
    achieved = flops / seconds / 1e9
    return {"seqs": seqs, "prompt_len": prompt_len, "seconds": seconds, "achieved_gflops": achieved,
            "gemm_gflops": gemm, "efficiency": achieved / gemm}


def verdict(kind: str, batch: int, ratio: float | None) -> str:
    aim = AIMS[kind].get(batch)
    if aim is None or ratio is None:
        return ""
    met = ratio >= aim if kind == "decode" else ratio <= aim
    return f"{'met' if met else 'NOT MET'} ({'>=' if kind == 'decode' else '<='}{aim})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--without-cpu-kernels", action="store_true",
                    help="also time the engine with Paddle's kernels only (FDLP_CPU_KERNELS=0) in the same run")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    # Prefix caching off: the warm-up's prompt would otherwise be a cache hit in the timed run.
    llm = LLM(args.model, max_num_seqs=max(*args.batch_sizes, PREFILL_SEQS),
              max_model_len=max(args.prompt_lens) + args.output_len + 8,
              enable_prefix_caching=False)
    vocab = llm.tokenizer.vocab_size
    rows = []
    for prompt_len in args.prompt_lens:
        for batch in args.batch_sizes:
            prompts = [rng.integers(0, vocab - 3, prompt_len).tolist() for _ in range(batch)]
            bench_fastdeploy(llm, prompts[:1], 4)  # warm-up
            ours = bench_fastdeploy(llm, prompts, args.output_len)
            theirs = bench_transformers(args.model, prompts, args.output_len)
            row = {"prompt_len": prompt_len, "batch": batch, "fastdeploy_lp": ours, "transformers": theirs,
                   "cpu_kernels": cpu_kernels.load() is not None}
            if args.without_cpu_kernels:
                kernels, cpu_kernels._loaded = cpu_kernels._loaded, None
                row["fastdeploy_lp_paddle_kernels"] = bench_fastdeploy(llm, prompts, args.output_len)
                cpu_kernels._loaded = kernels
            if theirs:
                row["decode_ratio"] = ours["decode_tok_s"] / theirs["decode_tok_s"]
                row["ttft_ratio"] = ours["ttft_s"] / theirs["ttft_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    prefill = prefill_efficiency(llm, PREFILL_SEQS, max(args.prompt_lens))

    print(f"\n{'prompt':>6} | {'batch':>5} | {'fdlp tok/s':>10} | {'fdlp TTFT s':>11} | {'hf tok/s':>8} | "
          f"{'hf TTFT s':>9} | {'decode ratio':>12} | {'TTFT ratio':>10} | aims")
    for r in rows:
        hf, ours = r["transformers"] or {}, r["fastdeploy_lp"]
        d, t = r.get("decode_ratio"), r.get("ttft_ratio")
        aims = ", ".join(v for v in (verdict("decode", r["batch"], d) and f"decode {verdict('decode', r['batch'], d)}",
                                     verdict("ttft", r["batch"], t) and f"TTFT {verdict('ttft', r['batch'], t)}") if v)
        print(f"{r['prompt_len']:>6} | {r['batch']:>5} | {ours['decode_tok_s']:>10.1f} | {ours['ttft_s']:>11.3f} | "
              f"{hf.get('decode_tok_s', float('nan')):>8.1f} | {hf.get('ttft_s', float('nan')):>9.3f} | "
              f"{d if d is not None else float('nan'):>11.2f}x | {t if t is not None else float('nan'):>9.2f}x | {aims}")
    for r in rows:
        if "fastdeploy_lp_paddle_kernels" in r:
            plain = r["fastdeploy_lp_paddle_kernels"]
            print(f"prompt {r['prompt_len']} batch {r['batch']}: Paddle kernels only {plain['decode_tok_s']:.1f} tok/s, "
                  f"TTFT {plain['ttft_s']:.3f} s (with the C kernels: {r['fastdeploy_lp']['decode_tok_s']:.1f} tok/s)")
    print(f"prefill efficiency ({prefill['seqs']} x {prefill['prompt_len']} tokens): "
          f"{prefill['achieved_gflops']:.0f} GFLOP/s achieved vs {prefill['gemm_gflops']:.0f} GFLOP/s Paddle GEMM "
          f"on the same shapes = {prefill['efficiency']:.0%} (aim >= 85%: "
          f"{'met' if prefill['efficiency'] >= 0.85 else 'NOT MET'})")
    result = {"model": args.model, "output_len": args.output_len, "rows": rows, "prefill": prefill}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
