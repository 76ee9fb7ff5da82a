"""Per-step engine timing while a long prompt joins running decodes (offline; evidence for the
long-join numbers of bench/serving.py).

    python bench/join_steps.py                              # default model, 4 streams, 2,000-token join
    python bench/join_steps.py --budgets 2048 256 64 --join-prompt 1500 --model bench/models/qwen2.5-0.5b-random

For each token budget (`--max-num-batched-tokens`; 0 = chunking off) it builds an engine, starts
`--streams` requests, lets them decode `--warm` steps, adds the long prompt, and times every
`LLMEngine.step()` until the long prompt's first token. Prints a Markdown table, one row per budget:
the median decode-only step, the join's steps (count, prompt tokens per step, total), the median
of its first and last tenth of steps (the context grows from 0 to the prompt's length), the worst
step, and the worst step / median decode step. Not a test.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fastdeploy_lp import SamplingParams
from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.engine.llm import build_engine


def timed_steps(engine, n: int | None, joiner: str | None = None) -> list[tuple[float, int, int]]:
    """(seconds, joiner's prompt tokens computed, its context before them) per step: `n` steps, or
    until the joiner's prompt is done."""
    out, done = [], 0
    while n is None or len(out) < n:
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        req = next((r for r in engine.scheduler.holding if r.request_id == joiner), None)
        now = req.cached_len if req is not None else 0
        out.append((dt, now - done, done))
        done = now
        if joiner is not None and req is not None and req.active:
            break
    return out


def run_budget(args, budget: int) -> dict:
    engine = build_engine(EngineArgs(args.model, max_num_seqs=8, enable_chunked_prefill=budget > 0,
                                     max_num_batched_tokens=budget or None, guided_decoding_backend="off"))
    rng = np.random.default_rng(0)
    long_params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for _ in range(args.streams):
        engine.add_request(rng.integers(100, 3000, 32).tolist(), long_params)
    timed_steps(engine, 3)  # prefill + warm
    decode = timed_steps(engine, args.warm)
    joiner = engine.add_request(rng.integers(100, 3000, args.join_prompt).tolist(),
                                SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    join = timed_steps(engine, None, joiner)
    med = float(np.median([d for d, _, _ in decode]))
    ms = [d * 1000 for d, _, _ in join]
    tenth = max(1, len(ms) // 10)
    return {"budget": budget or "off", "decode_ms_p50": round(med * 1000, 1), "join_steps": len(ms),
            "join_total_ms": round(sum(ms)), "tokens_per_step": int(np.median([k for _, k, _ in join])),
            "first_steps_ms": round(float(np.median(ms[:tenth])), 1),
            "last_steps_ms": round(float(np.median(ms[-tenth:])), 1), "worst_ms": round(max(ms), 1),
            "worst_over_decode": round(max(ms) / (med * 1000), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--budgets", type=int, nargs="+", default=[2048, 256, 128, 64, 32, 0])
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--join-prompt", type=int, default=2000)
    p.add_argument("--warm", type=int, default=20)
    args = p.parse_args()
    keys = ["budget", "decode_ms_p50", "join_steps", "tokens_per_step", "join_total_ms", "first_steps_ms",
            "last_steps_ms", "worst_ms", "worst_over_decode"]
    print("| " + " | ".join(keys) + " |")
    print("|" + "|".join("---:" for _ in keys) + "|")
    for budget in args.budgets:
        r = run_budget(args, budget)
        print("| " + " | ".join(str(r[k]) for k in keys) + " |", flush=True)

if __name__ == "__main__":
    main()
