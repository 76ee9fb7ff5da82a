"""JSON-schema coverage on JSONSchemaBench: which real-world schemas compile, how fast, and whether
the documents generated under them are valid.

    python bench/jsonschema_coverage.py [--limit 16] [--model tests/fixtures/hf/qwen2] [--json out.json]

The schemas are read in place from `../shared/bench/jsonschemabench/<Subset>.jsonl` (relative to
the repository; never copied into it). Per subset:
  * compile: every schema through the guided-decoding compiler (llguidance's JSON-schema support
    plus this project's checks: nesting depth, size, time limit), time p50/p99, and the most
    common reasons for refusal;
  * generate: `--limit` compiled schemas sampled per subset (seeded), one document each at
    temperature 1 with at most `--max-tokens` tokens; how many finish (the grammar completed and
    the model stopped) and how many of those validate with `jsonschema` (formats checked too).
A finished document that fails validation is a bug; unfinished ones are cut by `--max-tokens`
(random weights write long strings).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "bench", "jsonschemabench"))
FIXTURE = os.path.join(HERE, "..", "tests", "fixtures", "hf", "qwen2")


def load_subsets(data: str, only: list[str] | None) -> dict[str, list[dict]]:
    subsets = {}
    for name in sorted(os.listdir(data)):
        if name.endswith(".jsonl") and (not only or name[:-6] in only):
            with open(os.path.join(data, name), encoding="utf-8") as f:
                subsets[name[:-6]] = [json.loads(line) for line in f if line.strip()]
    return subsets


def reason(message: str) -> str:
    """A short bucket for a refusal message."""
    text = message.split(": ", 1)[-1]
    for pattern, bucket in [(r"Unimplemented keys: \[([^\]]*)\]", "unimplemented {}"),
                            (r"Unknown format: (\S+)", "unknown format {}"),
                            (r"nested (\d+) levels", "nesting over the limit"),
                            (r"characters long", "over the size limit"),
                            (r"took longer than", "compile time over the limit"),
                            (r"look-around|backreference", "regex feature (look-around/backref)"),
                            (r"\$ref", "$ref not resolvable"),
                            (r"oneOf", "oneOf")]:
        m = re.search(pattern, text)
        if m:
            return bucket.format(*m.groups()) if m.groups() else bucket
    return text[:60]


def validator_for(schema):
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--model", default=FIXTURE, help="model whose tokenizer compiles and which generates")
    ap.add_argument("--subsets", nargs="*", help="only these subsets")
    ap.add_argument("--limit", type=int, default=16, help="schemas generated per subset")
    ap.add_argument("--compile-limit", type=int, default=0, help="schemas compiled per subset (0 = all)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from fastdeploy_lp import LLM, GuidedDecodingParams, SamplingParams

    llm = LLM(args.model, max_num_seqs=8, device="cpu")
    guide = llm.engine.pipeline.processors[0]
    subsets = load_subsets(args.data, args.subsets)
    rng = random.Random(args.seed)
    results = {"model": args.model, "max_tokens": args.max_tokens, "subsets": {}}
    for name, rows in subsets.items():
        if args.compile_limit:
            rows = rng.sample(rows, min(args.compile_limit, len(rows)))
        times, compiled, reasons = [], [], collections.Counter()
        for row in rows:
            gd = GuidedDecodingParams(json=row["schema"]) if isinstance(row["schema"], dict) else None
            start = time.perf_counter()
            try:
                if gd is None:
                    raise ValueError("guided_json: not a JSON object")
                guide.compiler.compile(gd)
                compiled.append(row)
            except ValueError as e:
                reasons[reason(str(e))] += 1
            times.append(time.perf_counter() - start)
        picked = rng.sample(compiled, min(args.limit, len(compiled)))
        gen_start = time.perf_counter()
        params = [SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=args.max_tokens,
                                 guided_decoding=GuidedDecodingParams(json=row["schema"])) for i, row in enumerate(picked)]
        outs = llm.generate(["Write a JSON document:"] * len(picked), params, use_tqdm=False) if picked else []
        finished = valid = 0
        invalid = []
        for row, out in zip(picked, outs):
            if out.outputs.finish_reason != "stop":
                continue
            finished += 1
            try:
                doc = json.loads(out.outputs.text)
                errors = sorted(validator_for(row["schema"]).iter_errors(doc), key=lambda e: e.path)
            except Exception as e:  # a document that is not JSON at all counts as invalid
                errors = [e]
            if errors:
                invalid.append({"id": row["id"], "error": str(getattr(errors[0], "message", errors[0]))[:200],
                                "text": out.outputs.text[:300]})
            else:
                valid += 1
        results["subsets"][name] = {
            "schemas": len(rows), "compiled": len(compiled), "compile_ms_p50": 1e3 * float(np.percentile(times, 50)),
            "compile_ms_p99": 1e3 * float(np.percentile(times, 99)), "refusals": dict(reasons.most_common(6)),
            "generated": len(picked), "finished": finished, "valid": valid, "invalid_examples": invalid[:5],
            "generate_s": time.perf_counter() - gen_start}
        r = results["subsets"][name]
        print(f"{name}: {r['compiled']}/{r['schemas']} compile, {r['finished']}/{r['generated']} finished, "
              f"{r['valid']} valid", flush=True)

    print("\n| subset | schemas | compile | compile p50 ms | compile p99 ms | generated | finished | valid "
          "| top refusals |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, r in results["subsets"].items():
        top = "; ".join(f"{k} ({v})" for k, v in list(r["refusals"].items())[:3])
        print(f"| {name} | {r['schemas']} | {r['compiled']} ({100 * r['compiled'] / max(r['schemas'], 1):.0f}%) | "
              f"{r['compile_ms_p50']:.2f} | {r['compile_ms_p99']:.1f} | {r['generated']} | {r['finished']} | "
              f"{r['valid']} | {top} |")
    print("\n" + json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
