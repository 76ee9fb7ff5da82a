"""Speculative decoding (n-gram drafts): issue 24's table. Decode tokens/s with speculation off and
on, the speed-up and the acceptance rate, for each model (the built-in one, the bench model), each
workload (json, copy, free) and each batch size (1, 4, 16); then, on the bench model, what a
(k+1)-row verify pass costs against a 1-row decode step for k = 1..8.

    python bench/speculative.py                   # the whole table: a few minutes on a quiet machine
    python bench/speculative.py --models builtin --batch-sizes 1 --output-len 8 --repeats 1   # smoke

Workloads (greedy, every request of a batch submitted together):

* `json`: output constrained to a JSON schema (guided decoding takes part: its masks apply at every
  draft position, and the keys it forces are fast-forwarded as always); it ends when the object does;
* `copy`: the answer quotes the prompt (a passage, then "Quote the passage:" and its first words),
  where prompt lookup drafts well (EOS ignored);
* `free`: free text from a short question, where little recurs (EOS ignored): speculation must
  back off here (issue 24's aim: never more than 5% slower).

tok/s counts generated tokens over the wall time of the whole batch (prompts included; they are
short), the best of `--repeats` runs. The built-in model writes text, so its acceptance rates mean
something; the bench model (`bench/models/qwen2.5-0.5b-random`, `python bench/make_bench_model.py`)
has random weights (its output falls into loops, which drafts find; it gets shorter outputs,
`--bench-output-len`, as its steps read 1.98 GB each), and the verify table shows the pass itself:
one sequence's pass of 1 token against one of k+1 tokens at the same context length, the fastest of
`--verify-repeats` interleaved runs. Its last column, (ratio - 1) / k, is what one draft row costs
as a fraction of a step: the value for `speculative_config.draft_row_cost` on this machine.
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
    "json": f"{PASSAGE}\nThe facts above as JSON:\n",
    "copy": f"{PASSAGE}\nQuote the passage word for word:\n{PASSAGE[:40]}",
    "free": "Tell me something about the weather in spring.",
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
    counts = {key: after[key] - before[key] for key in ("drafted_tokens", "accepted_tokens", "backoffs")}
    tokens = sum(len(o.outputs.token_ids) for o in outs)
    drafted = counts["drafted_tokens"]
    return tokens / seconds, dict(counts, acceptance=counts["accepted_tokens"] / drafted if drafted else 0.0)


def verify_costs(llm: LLM, ks: list[int], repeats: int, context: int = 128) -> list[dict]:
    """For each k, the fastest of `repeats` 1-token and (k+1)-token passes of one sequence at
    `context` cached positions, timed in turn so that a busy moment hits both alike."""
    runner, size = llm.engine.runner, llm.fd_config.cache_config.block_size
    blocks = list(range(1, 2 + (context + max(ks) + 1) // size))
    runner.forward([SequenceFeed(blocks, [1] * context, 0, logits=False)])
    rows = []
    for k in ks:
        feeds = [SequenceFeed(blocks, [1] * n, context, num_logits=n) for n in (1, k + 1)]
        best = [float("inf"), float("inf")]
        for _ in range(repeats + 1):  # the first round builds the kernels for this row count
            for i, feed in enumerate(feeds):
                start = time.perf_counter()
                runner.forward([feed])
                best[i] = min(best[i], time.perf_counter() - start)
        rows.append({"k": k, "ms_1_row": best[0] * 1e3, "ms_k1_rows": best[1] * 1e3, "ratio": best[1] / best[0],
                     "draft_row_cost": (best[1] / best[0] - 1) / k})
    return rows


def bench_model(name: str, model: str | None, output_len: int, args) -> tuple[list[dict], list[dict]]:
    """The speed rows of one model, and its verify rows (the bench model only)."""
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max}
    common = dict(model=model, max_num_seqs=max(args.batch_sizes), max_model_len=1024)
    llms = {"off": LLM(**common), "on": LLM(**common, speculative_config=spec)}
    for llm in llms.values():  # the first passes pick and build kernels and compile the schema: no row
        generate(llm, "copy", max(args.batch_sizes), 4)
        generate(llm, "json", 1, 4)
    rows = []
    for workload in WORKLOADS:
        for batch in args.batch_sizes:
            row = {"model": name, "workload": workload, "batch": batch}
            for mode, llm in llms.items():
                row[f"tok_s_{mode}"], counts = best_of(args.repeats, llm, workload, batch, output_len)
            rows.append(dict(row, **counts, speedup=row["tok_s_on"] / row["tok_s_off"]))
    # Last: the verify passes write KV blocks the prefix cache may hold.
    verify = verify_costs(llms["off"], list(range(1, 9)), args.verify_repeats) if name == "bench" else []
    return rows, [dict(r, model=name) for r in verify]


def print_tables(rows: list[dict], verify: list[dict]) -> None:
    print(f"{'model':<8} {'workload':<8} {'batch':>5} {'tok/s off':>10} {'tok/s on':>10} {'speed-up':>9} "
          f"{'acceptance':>11}")
    for r in rows:
        print(f"{r['model']:<8} {r['workload']:<8} {r['batch']:>5} {r['tok_s_off']:>10.1f} {r['tok_s_on']:>10.1f} "
              f"{r['speedup']:>8.2f}x {r['acceptance']:>10.0%}")
    if verify:
        print(f"\nverify pass on the bench model, one sequence at 128 cached positions:")
        print(f"{'k':>3} {'rows':>5} {'1-row ms':>9} {'(k+1)-row ms':>13} {'ratio':>7} {'per draft row':>14}")
        for r in verify:
            print(f"{r['k']:>3} {r['k'] + 1:>5} {r['ms_1_row']:>9.1f} {r['ms_k1_rows']:>13.1f} {r['ratio']:>6.2f}x "
                  f"{r['draft_row_cost']:>14.3f}")
    for r in rows:  # issue 24's aims, where the table has their rows
        if r["batch"] == 1 and r["workload"] in ("copy", "free"):
            aim, ok = ("copy >= 1.8x", r["speedup"] >= 1.8) if r["workload"] == "copy" else \
                ("free >= 0.95x", r["speedup"] >= 0.95)
            print(f"aim {r['model']} batch 1 {aim}: {r['speedup']:.2f}x {'met' if ok else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--output-len", type=int, default=96, help="max tokens per request, built-in model")
    parser.add_argument("--bench-output-len", type=int, default=24, help="max tokens per request, bench model")
    parser.add_argument("--repeats", type=int, default=2, help="runs per row; the fastest counts")
    parser.add_argument("--verify-repeats", type=int, default=5, help="passes per verify row; the fastest counts")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--models", nargs="+", default=["builtin", "bench"], choices=["builtin", "bench"])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows, verify = [], []
    for name in args.models:
        if name == "bench" and not os.path.isdir(BENCH_MODEL):
            print(f"skipping the bench model: {BENCH_MODEL} is missing (python bench/make_bench_model.py)")
            continue
        model, output_len = (None, args.output_len) if name == "builtin" else (BENCH_MODEL, args.bench_output_len)
        speed, costs = bench_model(name, model, output_len, args)
        rows, verify = rows + speed, verify + costs
    print_tables(rows, verify)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"speed": rows, "verify": verify}, f, indent=1)


if __name__ == "__main__":
    main()
