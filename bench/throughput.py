"""Decode throughput and time to first token, fastdeploy_lp vs. `transformers`, same checkpoint, same run.

    python bench/make_bench_model.py            # once: the Qwen2.5-0.5B-shaped random checkpoint
    python bench/throughput.py --batch-sizes 1 8 32 --prompt-len 128 --output-len 128

For each batch size, all requests arrive together with random prompts of `--prompt-len` tokens
and generate exactly `--output-len` tokens (EOS ignored, greedy). TTFT is measured per request
from submission to its first token; decode tokens/s counts the tokens generated after each
request's first one, over the time between the first and the last token of the batch.
`transformers`' `generate()` runs on the same checkpoint (PyTorch, CPU, float32) when torch and
transformers are importable; its TTFT is the time of a 1-token `generate()` of the same batch.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from fastdeploy_lp import LLM, SamplingParams

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
    except ImportError:
        return None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        total = time.perf_counter() - start
    return {"ttft_s": ttft, "decode_tok_s": len(prompts) * (output_len - 1) / max(total - ttft, 1e-9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    llm = LLM(args.model, max_num_seqs=max(args.batch_sizes), max_model_len=args.prompt_len + args.output_len + 8)
    vocab = llm.tokenizer.vocab_size
    rows = []
    for batch in args.batch_sizes:
        prompts = [rng.integers(0, vocab - 3, args.prompt_len).tolist() for _ in range(batch)]
        bench_fastdeploy(llm, prompts[:1], 4)  # warm-up
        ours = bench_fastdeploy(llm, prompts, args.output_len)
        theirs = bench_transformers(args.model, prompts, args.output_len)
        row = {"batch": batch, "fastdeploy_lp": ours, "transformers": theirs}
        if theirs:
            row["decode_speedup"] = ours["decode_tok_s"] / theirs["decode_tok_s"]
        rows.append(row)

    print(f"{'batch':>5} | {'fdlp tok/s':>10} | {'fdlp TTFT s':>11} | {'hf tok/s':>8} | {'hf TTFT s':>9} | speedup")
    for r in rows:
        hf = r["transformers"] or {}
        print(f"{r['batch']:>5} | {r['fastdeploy_lp']['decode_tok_s']:>10.1f} | {r['fastdeploy_lp']['ttft_s']:>11.3f} | "
              f"{hf.get('decode_tok_s', float('nan')):>8.1f} | {hf.get('ttft_s', float('nan')):>9.3f} | "
              f"{r.get('decode_speedup', float('nan')):.2f}x")
    result = {"model": args.model, "prompt_len": args.prompt_len, "output_len": args.output_len, "rows": rows}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
