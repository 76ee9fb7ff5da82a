"""Guided decoding on the bench model (a 151,936-token vocabulary): compile time, mask time per
token, and decode throughput constrained vs. unconstrained at batch 1 and 16.

    python bench/make_bench_model.py            # once: bench/models/qwen2.5-0.5b-random
    python bench/guided.py [--model DIR] [--json results.json] [--skip-decode]

Sections (each prints a table; all numbers are also printed, and optionally written, as JSON):
  * compile  — cold compile (fresh compiler, so no cache) of each constraint kind, and a cache hit;
  * mask     — one matcher's bitmask fill per token along random walks through its grammar, the
               batch-16 parallel fill of mixed kinds, and `apply` (unpack, upload, where) at batch 16;
  * decode   — `LLM.generate` tokens/s at temperature 1, unconstrained vs. the capital-of-France
               JSON schema, with fast-forward off (one sampled token per step, so the comparison
               is the mask's cost alone) and on; the processor's own update_state/apply time per
               step, and the throughput ratio that time implies against the unconstrained step.
Random weights: what the model writes is meaningless, but every constrained token is masked.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(HERE, "models", "qwen2.5-0.5b-random")

CAPITAL = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[\\w]+$"},
                                            "population": {"type": "integer"}},
           "required": ["name", "population"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "format": "uuid"}, "items": {"type": "array", "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                         "qty": {"type": "integer", "minimum": 1}, "note": {"type": "string"}},
        "required": ["sku", "qty"]}, "minItems": 1},
    "status": {"enum": ["new", "paid", "shipped"]}, "total": {"type": "number"}},
    "required": ["id", "items", "status"], "additionalProperties": False}
CITY_EBNF = ('root ::= city " is the capital of " country\ncity ::= "London" | "Paris" | "Berlin" | "Rome"\n'
             'country ::= "England" | "France" | "Germany" | "Italy"')
WEATHER_DATE = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                                   "required": ["city"]}, "end": "</function>"},
    {"begin": "<function=get_date>", "schema": {"type": "object", "properties": {"timezone": {"type": "string"}},
                                                "required": ["timezone"]}, "end": "</function>"}]}


def constraints():
    from fastdeploy_lp import GuidedDecodingParams as G

    return {"json capital": G(json=CAPITAL), "json order (nested)": G(json=ORDER), "json_object": G(json_object=True),
            "regex": G(regex=r"[0-9]{3}-[0-9]{3}-[0-9]{4}( ext\. [0-9]+)?"), "choice": G(choice=["yes", "no", "maybe"]),
            "ebnf city": G(grammar=CITY_EBNF), "structural tag (free text)": G(structural_tag=WEATHER_DATE)}


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else float("nan")


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n## {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
    for r in rows:
        print("| " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in r) + " |")


# -- compile and mask (no model forward) ----------------------------------------------------------
def bench_compile(guide, reps: int) -> dict:
    from fastdeploy_lp.processors.guided.compiler import GrammarCompiler

    out = {}
    for name, gd in constraints().items():
        times = []
        for _ in range(reps):
            compiler = GrammarCompiler(guide.compiler.lltokenizer)
            start = time.perf_counter()
            compiler.compile(gd)
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.compile(gd)
        hit = time.perf_counter() - start
        out[name] = {"cold_ms_p50": 1e3 * pct(times, 50), "cold_ms_max": 1e3 * max(times), "cached_ms": 1e3 * hit}
    table("compile (cold = matcher build + first mask; 151,936-token vocabulary)",
          ["constraint", "cold p50 ms", "cold max ms", "cache hit ms"],
          [[k, v["cold_ms_p50"], v["cold_ms_max"], v["cached_ms"]] for k, v in out.items()])
    return out


def _walk(matcher, rng, fill, allowed_of, eos, steps, sink):
    """Random walk along allowed tokens; `sink(seconds)` gets each fill's time."""
    for _ in range(steps):
        start = time.perf_counter()
        fill(matcher)
        sink(time.perf_counter() - start)
        choices = [t for t in allowed_of(matcher) if t not in eos]
        if not choices or matcher.is_stopped():
            return False
        if not matcher.consume_token(int(rng.choice(choices))):
            return False
    return True


def bench_mask(guide, steps: int) -> dict:
    import llguidance as llg
    import paddle
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

    vocab = guide.vocab_size
    eos = set(guide.fd_config.model_config.eos_token_ids)
    bits = allocate_token_bitmask(1, vocab)

    def fill(m):
        fill_next_token_bitmask(m, bits, 0)

    def allowed(m):
        return np.flatnonzero(np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[0, :vocab])

    rng = random.Random(0)
    out = {}
    for name, gd in constraints().items():
        compiled = guide.compiler.compile(gd)
        times: list[float] = []
        while len(times) < steps:
            _walk(compiled.new_matcher(), rng, fill, allowed, eos, steps - len(times), times.append)
        out[name] = {"p50_us": 1e6 * pct(times, 50), "p99_us": 1e6 * pct(times, 99), "n": len(times)}

    # A batch of 16 mixed matchers filled in parallel, then applied to [16, vocab] logits.
    kinds = list(constraints().values())
    matchers = [guide.compiler.compile(kinds[i % len(kinds)]).new_matcher() for i in range(16)]
    executor, batch_bits = llg.LLExecutor(), allocate_token_bitmask(16, vocab)
    fills, applies = [], []
    logits = paddle.randn([16, vocab], dtype="float32")
    guide._rows = list(range(16))
    for _ in range(max(20, steps // 10)):
        start = time.perf_counter()
        fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], batch_bits)
        fills.append(time.perf_counter() - start)
        guide._bitmask[:16] = batch_bits
        start = time.perf_counter()
        guide.apply(logits.clone())
        applies.append(time.perf_counter() - start)
        for i, m in enumerate(matchers):
            row = np.flatnonzero(np.unpackbits(batch_bits[i:i + 1].view(np.uint8), axis=1, bitorder="little")[0, :vocab])
            row = [t for t in row if t not in eos]
            if m.is_stopped() or not row or not m.consume_token(int(rng.choice(row))):
                matchers[i] = guide.compiler.compile(kinds[i % len(kinds)]).new_matcher()
    guide._rows = []
    out["batch 16 fill (parallel)"] = {"p50_us": 1e6 * pct(fills, 50), "p99_us": 1e6 * pct(fills, 99), "n": len(fills)}
    out["batch 16 apply (unpack+upload+where)"] = {"p50_us": 1e6 * pct(applies, 50), "p99_us": 1e6 * pct(applies, 99),
                                                   "n": len(applies)}
    table("mask time per token (random walks through each grammar)", ["", "p50 µs", "p99 µs", "tokens"],
          [[k, v["p50_us"], v["p99_us"], v["n"]] for k, v in out.items()])
    return out


# -- decode -----------------------------------------------------------------------------------------
def bench_decode(model: str, batches: list[int], tokens: int, reps: int) -> dict:
    """tokens/s per case; cases alternate within each repetition so load drifts hit them alike."""
    from fastdeploy_lp import LLM, GuidedDecodingParams, SamplingParams

    prompt = "Give the capital of France as JSON:"
    llm = LLM(model, max_num_seqs=max(batches), device="cpu", max_model_len=512)
    timing = llm.engine.pipeline.timings[llm.engine.pipeline.names[0]]
    llm.generate([prompt] * max(batches), SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    cases = [("unconstrained", None, False), ("json capital", GuidedDecodingParams(json=CAPITAL), False),
             ("json capital +fast-forward", GuidedDecodingParams(json=CAPITAL), True)]
    results = {}
    for batch in batches:
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in cases}
        for _ in range(reps):
            for name, gd, ff in cases:
                llm.fd_config.fast_forward = ff  # the engine reads it every step
                params = [SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, guided_decoding=gd,
                                         ignore_eos=gd is None) for i in range(batch)]
                before = (timing.update_state_seconds, timing.apply_seconds, llm.engine.num_steps)
                start = time.perf_counter()
                outs = llm.generate([prompt] * batch, params, use_tqdm=False)
                wall = time.perf_counter() - start
                steps = max(llm.engine.num_steps - before[2], 1)
                runs[name].append({
                    "tokens": sum(len(o.outputs.token_ids) for o in outs), "steps": steps, "seconds": wall,
                    "update_state_ms": 1e3 * (timing.update_state_seconds - before[0]) / steps,
                    "apply_ms": 1e3 * (timing.apply_seconds - before[1]) / steps,
                    "finished_stop": sum(o.outputs.finish_reason == "stop" for o in outs)})
        for name, rs in runs.items():
            med = lambda k: float(np.median([r[k] for r in rs]))  # noqa: E731
            results[f"{name} @ batch {batch}"] = {
                "batch": batch, "reps": len(rs), "tokens": rs[0]["tokens"], "steps": rs[0]["steps"],
                "tokens_per_s": float(np.median([r["tokens"] / r["seconds"] for r in rs])),
                "step_ms": float(np.median([1e3 * r["seconds"] / r["steps"] for r in rs])),
                "guided_update_state_ms": med("update_state_ms"), "guided_apply_ms": med("apply_ms"),
                "finished_stop": rs[0]["finished_stop"]}
        base = results[f"unconstrained @ batch {batch}"]
        for name, _, _ in cases:
            r = results[f"{name} @ batch {batch}"]
            r["vs_unconstrained"] = r["tokens_per_s"] / base["tokens_per_s"]
            # The processor's own time is measured directly; against the unconstrained step it gives
            # the throughput ratio without the machine's load noise.
            r["vs_unconstrained_from_guided_ms"] = base["step_ms"] / (
                base["step_ms"] + r["guided_update_state_ms"] + r["guided_apply_ms"])
    table(f"decode, temperature 1, max_tokens {tokens}, median of {reps} alternating runs (CPU, 2 shared cores)",
          ["run", "tokens", "steps", "tokens/s", "ms/step", "guided update_state ms/step", "guided apply ms/step",
           "tokens/s vs unconstrained", "from guided ms"],
          [[k, r["tokens"], r["steps"], r["tokens_per_s"], r["step_ms"], r["guided_update_state_ms"],
            r["guided_apply_ms"], r["vs_unconstrained"], r["vs_unconstrained_from_guided_ms"]]
           for k, r in results.items()])
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--mask-steps", type=int, default=300, help="tokens timed per constraint kind")
    ap.add_argument("--compile-reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16, help="max_tokens per request in the decode runs")
    ap.add_argument("--reps", type=int, default=2, help="alternating repetitions of each decode case")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        sys.exit(f"no model at {args.model}; run `python bench/make_bench_model.py` first")

    from fastdeploy_lp import FDConfig
    from fastdeploy_lp.processors.guided import GuidedDecodingLogitsProcessor

    cfg = FDConfig.create(args.model, device="cpu", max_num_seqs=16, max_model_len=512)
    start = time.perf_counter()
    guide = GuidedDecodingLogitsProcessor(cfg)
    results = {"model": args.model, "vocab_size": guide.vocab_size,
               "tokenizer_build_s": time.perf_counter() - start}
    print(f"vocabulary {guide.vocab_size}; llguidance tokenizer built in {results['tokenizer_build_s']:.2f} s")
    results["compile"] = bench_compile(guide, args.compile_reps)
    results["mask"] = bench_mask(guide, args.mask_steps)
    if not args.skip_decode:
        results["decode"] = bench_decode(args.model, args.batches, args.tokens, args.reps)
    print("\n" + json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
