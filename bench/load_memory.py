"""Peak memory and load time of one checkpoint in each weight format, each in a fresh process.

    python bench/make_bench_model.py --shape qwen2.5-7b --dtype bfloat16 --out bench/models/qwen2.5-7b-random
    python bench/load_memory.py --model bench/models/qwen2.5-7b-random --weights bfloat16 wint8 wint4
    python bench/make_gguf.py --shape qwen2.5-7b       # a 7B-shaped Q4_K_M GGUF file of random blocks
    python bench/load_memory.py --model bench/models/qwen2.5-7b-random-Q4_K_M.gguf --weights gguf

Each format loads in its own process (so one's memory does not count against the next), answers
one 16-token prompt with 8 greedy tokens, and reports the weight bytes it holds, the time to load,
the decode rate and its peak resident memory (`ru_maxrss`: loading included, so a path that
held a float32 copy of all weights would show here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from throughput import FORMATS  # the same formats as the speed table

from fastdeploy_lp.model import cpu_features

CHILD = """
import json, resource, sys, time
from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.model.loader import weight_bytes
start = time.perf_counter()
llm = LLM(sys.argv[1], max_num_seqs=1, max_model_len=256, kv_cache_memory=0.25, device="cpu", **json.loads(sys.argv[2]))
loaded = time.perf_counter() - start
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
llm.generate([list(range(100, 116))], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
start = time.perf_counter()
out = llm.generate([list(range(100, 116))], params, use_tqdm=False)[0]
seconds = time.perf_counter() - start
print("RESULT", json.dumps({"load_s": loaded, "tokens": len(out.outputs.token_ids), "generate_s": seconds,
                            "weight_gb": weight_bytes(llm.engine.runner.model) / 1e9,
                            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "models", "qwen2.5-7b-random"))
    ap.add_argument("--weights", nargs="+", default=["bfloat16", "wint8"], choices=[*FORMATS, "gguf"],
                    help="gguf: a GGUF file's weights as stored")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    rows = []
    for weights in args.weights:
        done = subprocess.run([sys.executable, "-c", CHILD, args.model, json.dumps(FORMATS.get(weights, {}))],
                              capture_output=True, text=True)
        if done.returncode:
            rows.append({"weights": weights, "error": done.stderr.strip().splitlines()[-1]})
        else:
            rows.append({"weights": weights, **json.loads(done.stdout.split("RESULT", 1)[1])})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nCPU: {cpu_features.detect().describe()}; model {args.model}\n")
    print(f"{'weights':<9} | {'held GB':>7} | {'peak RSS GiB':>12} | {'load s':>6} | {'generate tok/s':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['weights']:<9} | {r['error']}")
            continue
        print(f"{r['weights']:<9} | {r['weight_gb']:>7.2f} | {r['peak_rss_gib']:>12.2f} | {r['load_s']:>6.1f} | "
              f"{r['tokens'] / r['generate_s']:>14.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "cpu": cpu_features.detect().describe(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
