"""Speculative decoding (n-gram drafts): decode tokens/s with speculation off and on, and the
acceptance rate, per model, workload and batch size; and what a k+1-row verify pass costs against
a 1-row decode step.

    python bench/speculative.py                                   # built-in model and the bench model
    python bench/speculative.py --batch-sizes 1 4 16 --output-len 128 --json out.json

Workloads (greedy, EOS ignored, every request of a batch submitted together):

* `copy`: the answer quotes the prompt (a passage, then "Quote the passage:" and its first words),
  where prompt lookup drafts well;
* `free`: free text from a short question, where little recurs;
* `json`: output constrained to a JSON schema (guided decoding takes part: its masks apply at every
  draft position, and the keys it forces are fast-forwarded as always).

tok/s counts generated tokens over the wall time of the whole batch (prompts included; they are
short), the best of `--repeats` runs. The built-in model writes text, so its acceptance rates mean
something; the bench model (`bench/models/qwen2.5-0.5b-random`, `python bench/make_bench_model.py`)
has random weights (its output falls into loops, which drafts find), and the verify rows show the
pass itself: one decode step of one token against one of k+1 tokens at the same context length.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.model.runner import SequenceFeed
from fastdeploy_lp.sampling_params import GuidedDecodingParams

BENCH_MODEL = os.path.join(os.path.dirname(__file__), "models", "qwen2.5-0.5b-random")
PASSAGE = ("The capital of France is Paris. Paris is home to about two million people, and the river Seine "
           "runs through the city from east to west. The Eiffel Tower was built in 1889 for the World's Fair.")
WORKLOADS = {
    "copy": f"{PASSAGE}\nQuote the passage word for word:\n{PASSAGE[:40]}",
    "free": "Tell me something about the weather in spring.",
    "json": f"{PASSAGE}\nThe facts above as JSON:\n",
}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "river": {"type": "string"},
                                           "people": {"type": "integer"}, "facts": {"type": "array",
                                           "items": {"type": "string"}}},
          "required": ["city", "river", "people", "facts"], "additionalProperties": False}


def best_of(repeats: int, llm: LLM, workload: str, batch: int, output_len: int) -> tuple[float, dict]:
    """The fastest of `repeats` runs (the machine may be shared: the others waited on someone else)."""
    runs = [generate(llm, workload, batch, output_len) for _ in range(repeats)]
    return max(runs, key=lambda run: run[0])


def generate(llm: LLM, workload: str, batch: int, output_len: int) -> tuple[float, dict]:
    guided = GuidedDecodingParams(json=SCHEMA) if workload == "json" else None
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=guided is None, guided_decoding=guided)
    before = llm.speculative_stats()
    start = time.perf_counter()
    outs = llm.generate([WORKLOADS[workload]] * batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.speculative_stats()
    drafted = after["drafted_tokens"] - before["drafted_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    tokens = sum(len(o.outputs.token_ids) for o in outs)
    return tokens / seconds, {"drafted": drafted, "accepted": accepted,
                              "acceptance": accepted / drafted if drafted else 0.0}


def verify_cost(llm: LLM, k: int, context: int = 128, repeats: int = 5) -> tuple[float, float]:
    """Seconds of a 1-token and a (k+1)-token pass of one sequence at `context` cached positions."""
    runner, size = llm.engine.runner, llm.fd_config.cache_config.block_size
    blocks = list(range(1, 2 + (context + k + 1) // size))
    runner.forward([SequenceFeed(blocks, [1] * context, 0, logits=False)])
    times = []
    for n in (1, k + 1):
        feed = SequenceFeed(blocks, [1] * n, context, num_logits=n)
        runner.forward([feed])
        start = time.perf_counter()
        for _ in range(repeats):
            runner.forward([feed])
        times.append((time.perf_counter() - start) / repeats)
    return times[0], times[1]


def bench_model(name: str, model: str | None, args) -> list[dict]:
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max}
    common = dict(model=model, max_num_seqs=max(args.batch_sizes), max_model_len=1024)
    llms = {"off": LLM(**common), "on": LLM(**common, speculative_config=spec)}
    for llm in llms.values():  # the first passes pick and build kernels: not part of any row
        generate(llm, "copy", max(args.batch_sizes), 8)
    rows = []
    for workload in WORKLOADS:
        for batch in args.batch_sizes:
            row = {"model": name, "workload": workload, "batch": batch}
            for mode, llm in llms.items():
                row[f"tok_s_{mode}"], counts = best_of(args.repeats, llm, workload, batch, args.output_len)
            row.update(counts, speedup=row["tok_s_on"] / row["tok_s_off"])
            rows.append(row)
    one, many = verify_cost(llms["off"], args.k)
    rows.append({"model": name, "workload": f"verify pass: 1 vs {args.k + 1} tokens", "batch": 1,
                 "step_ms_1": one * 1e3, "step_ms_k1": many * 1e3, "ratio": many / one})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<12} {'workload':<30} {'batch':>5} {'tok/s off':>10} {'tok/s on':>10} {'speedup':>8} "
          f"{'accepted':>9}")
    for r in rows:
        if "ratio" in r:
            print(f"{r['model']:<12} {r['workload']:<30} {r['batch']:>5} {r['step_ms_1']:>9.1f}ms "
                  f"{r['step_ms_k1']:>9.1f}ms {r['ratio']:>7.2f}x")
        else:
            print(f"{r['model']:<12} {r['workload']:<30} {r['batch']:>5} {r['tok_s_off']:>10.1f} "
                  f"{r['tok_s_on']:>10.1f} {r['speedup']:>7.2f}x {r['acceptance']:>8.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the fastest counts")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--models", nargs="+", default=["builtin", "bench"], choices=["builtin", "bench"])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        if name == "bench" and not os.path.isdir(BENCH_MODEL):
            print(f"skipping the bench model: {BENCH_MODEL} is missing (python bench/make_bench_model.py)")
            continue
        rows += bench_model(name, None if name == "builtin" else BENCH_MODEL, args)
    print_table(rows)
    print(json.dumps(rows, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
