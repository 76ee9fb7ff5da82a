"""Guided decoding on the bench model (a 151,936-token vocabulary): compile time, mask time per
token, applying the mask, and decode throughput constrained vs. unconstrained at batch 1 and 16.

    python bench/make_bench_model.py            # once: bench/models/qwen2.5-0.5b-random
    python bench/guided.py [--model DIR] [--json results.json] [--skip-decode] [--tokens 16 --reps 2]

Sections (each prints a table; all numbers are also printed, and optionally written, as JSON):
  * compile  — cold compile (fresh compiler, so no cache) of each constraint kind, and a cache hit;
  * mask     — one matcher's bitmask fill per token along random walks through its grammar, for
               the hand-written constraint kinds and for a seeded sample of JSONSchemaBench schemas
               (read in place from ../shared/bench/jsonschemabench/, never copied; schemas that do
               not compile are skipped and counted), and the batch-16 parallel fill of mixed kinds;
  * apply    — masking `[16, 151936]` float32 logits: the processor's `apply`, the host numpy
               unpack (the CPU path) and the packed upload + device expansion (the path off the
               CPU, run here on the CPU place), each also without the fill, and the code before
               the packed path (unpack, upload a bool mask, `paddle.where`);
  * decode   — `LLM.generate` tokens/s at temperature 1, unconstrained vs. the capital-of-France
               JSON schema, with fast-forward off (one sampled token per step, so the comparison
               is the mask's cost alone) and on; the processor's own update_state/apply time per
               step, and the throughput ratio that time implies against the unconstrained step;
  * aims     — mask p50 <= 50 us and p99 <= 500 us per token on JSONSchemaBench, constrained >= 95%
               of unconstrained tokens/s at batch 16; each row says "met" or "NOT MET".
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
SCHEMAS = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "bench", "jsonschemabench"))
AIMS = {"mask_p50_us": 50.0, "mask_p99_us": 500.0, "constrained_vs_unconstrained": 0.95}

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
        print("| " + " | ".join(fmt(c) for c in r) + " |")


def fmt(c) -> str:
    if not isinstance(c, float):
        return str(c)
    if c != c:  # nan
        return "–"
    return f"{c:.0f}" if abs(c) >= 100 else f"{c:.3g}"


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


def _walk(matcher, rng, fill, allowed_of, steps, sink):
    """Random walk along allowed tokens (`allowed_of` gives them, EOS left out); `sink(seconds)` gets
    each fill's time."""
    for _ in range(steps):
        start = time.perf_counter()
        fill(matcher)
        sink(time.perf_counter() - start)
        choices = allowed_of(matcher)
        if not len(choices) or matcher.is_stopped():
            return False
        if not matcher.consume_token(int(rng.choice(choices))):
            return False
    return True


def _single_row_mask(guide):
    """(fill, allowed_of) over a one-row bitmask of the guide's vocabulary."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    vocab = guide.vocab_size
    eos = np.asarray(sorted(set(guide.fd_config.model_config.eos_token_ids) | set(guide.eos_token_ids)))
    bits = allocate_token_bitmask(1, vocab)

    def fill(m):
        fill_next_token_bitmask(m, bits, 0)

    def allowed_of(m):
        row = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].view(bool)
        row[eos[eos < vocab]] = False
        return np.flatnonzero(row)

    return fill, allowed_of


def bench_mask(guide, steps: int) -> dict:
    fill, allowed_of = _single_row_mask(guide)
    rng = random.Random(0)
    out = {}
    for name, gd in constraints().items():
        compiled = guide.compiler.compile(gd)
        times: list[float] = []
        while len(times) < steps:
            _walk(compiled.new_matcher(), rng, fill, allowed_of, steps - len(times), times.append)
        out[name] = {"p50_us": 1e6 * pct(times, 50), "p99_us": 1e6 * pct(times, 99), "n": len(times)}
    table("mask time per token, hand-written constraints (random walks through each grammar)",
          ["", "p50 µs", "p99 µs", "tokens"], [[k, v["p50_us"], v["p99_us"], v["n"]] for k, v in out.items()])
    return out


def sample_schemas(data: str, count: int, seed: int) -> list[dict]:
    """A fixed, seeded sample of `count` schemas across all JSONSchemaBench subsets, read in place."""
    from jsonschema_coverage import load_subsets

    pool = [dict(row, subset=name) for name, rows in load_subsets(data, None).items() for row in rows]
    return random.Random(seed).sample(pool, min(count, len(pool)))


def bench_schema_masks(guide, data: str, count: int, steps: int, seed: int) -> dict:
    """Mask time per token along random walks through each sampled schema's grammar, pooled."""
    from fastdeploy_lp import GuidedDecodingParams

    fill, allowed_of = _single_row_mask(guide)
    rng = random.Random(seed)
    pooled: list[float] = []
    per_schema, failed = [], 0
    compile_s = []
    for row in sample_schemas(data, count, seed):
        start = time.perf_counter()
        try:
            if not isinstance(row["schema"], dict):
                raise ValueError("not a JSON object")
            compiled = guide.compiler.compile(GuidedDecodingParams(json=row["schema"]))
        except Exception:  # refused (unsupported keyword, oneOf, limits): skipped, counted
            failed += 1
            continue
        compile_s.append(time.perf_counter() - start)
        times: list[float] = []
        walks = 0
        while len(times) < steps and walks < 4 * steps:
            walks += 1
            _walk(compiled.new_matcher(), rng, fill, allowed_of, steps - len(times), times.append)
        pooled += times
        per_schema.append({"id": f"{row['subset']}/{row['id']}", "n": len(times), "p50_us": 1e6 * pct(times, 50),
                           "p99_us": 1e6 * pct(times, 99), "max_us": 1e6 * max(times)})
    worst = sorted(per_schema, key=lambda r: -r["max_us"])[:5]
    out = {"schemas_sampled": len(per_schema) + failed, "schemas_compiled": len(per_schema),
           "schemas_failed": failed, "tokens_per_schema": steps, "seed": seed, "n": len(pooled),
           "p50_us": 1e6 * pct(pooled, 50), "p90_us": 1e6 * pct(pooled, 90), "p99_us": 1e6 * pct(pooled, 99),
           "max_us": 1e6 * max(pooled) if pooled else float("nan"),
           "share_over_500us": float(np.mean(np.asarray(pooled) > 500e-6)) if pooled else float("nan"),
           "schemas_with_p99_over_500us": sum(r["p99_us"] > 500 for r in per_schema),
           "compile_ms_p50": 1e3 * pct(compile_s, 50), "compile_ms_p99": 1e3 * pct(compile_s, 99),
           "slowest_schemas": worst}
    table(f"mask time per token, JSONSchemaBench ({out['schemas_compiled']} of {out['schemas_sampled']} sampled "
          f"schemas compiled; seed {seed}; up to {steps} tokens each)",
          ["", "p50 µs", "p90 µs", "p99 µs", "max µs", "tokens", "share > 500 µs"],
          [["all tokens, pooled", out["p50_us"], out["p90_us"], out["p99_us"], out["max_us"], out["n"],
            out["share_over_500us"]]]
          + [[f"slowest: {r['id']}", r["p50_us"], float("nan"), r["p99_us"], r["max_us"], r["n"], ""] for r in worst])
    return out


def _apply_before_packed(bits: np.ndarray, logits, rows: list[int]):
    """`apply` before the packed path (for comparison): numpy unpack, upload a bool mask, `paddle.where`."""
    import paddle

    width = logits.shape[-1]
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :width]
    if allowed.shape[1] < width:
        allowed = np.pad(allowed, ((0, 0), (0, width - allowed.shape[1])))
    mask = paddle.to_tensor(allowed.astype(bool), place=logits.place)
    banned = paddle.full([1], float("-inf"), dtype=logits.dtype)
    if len(rows) == logits.shape[0]:
        return paddle.where(mask, logits, banned)
    index = paddle.to_tensor(rows, dtype="int64", place=logits.place)
    part = paddle.where(mask, paddle.index_select(logits, index), banned)
    return paddle.scatter(logits, index, part, overwrite=True)


def bench_apply(guide, steps: int) -> dict:
    """Batch 16 of mixed matchers: the parallel fill, then each way of masking `[16, vocab]` logits,
    interleaved within each step so load drifts hit them alike."""
    import llguidance as llg
    import paddle
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    from fastdeploy_lp.processors.guided.bitmask import banned_mask, mask_logits

    vocab = guide.vocab_size
    eos = np.asarray(sorted(set(guide.fd_config.model_config.eos_token_ids) | set(guide.eos_token_ids)))
    rng = random.Random(0)
    kinds = list(constraints().values())
    matchers = [guide.compiler.compile(kinds[i % len(kinds)]).new_matcher() for i in range(16)]
    executor, bits = llg.LLExecutor(), allocate_token_bitmask(16, vocab)
    logits = paddle.randn([16, vocab], dtype="float32")
    place = logits.place
    rows = list(range(16))
    cases = {
        "processor apply (default path here)": lambda x: guide.apply(x),
        "mask_logits, numpy unpack (CPU path)": lambda x: mask_logits(x, bits, packed=False),
        "mask_logits, packed + device expansion": lambda x: mask_logits(x, bits, packed=True),
        "mask only: numpy unpack + upload bool": lambda x: banned_mask(bits, vocab, place, packed=False),
        "mask only: upload packed + expand": lambda x: banned_mask(bits, vocab, place, packed=True),
        "before: unpack + upload + paddle.where": lambda x: _apply_before_packed(bits, x, rows),
    }
    times = {"batch 16 fill (parallel)": []} | {k: [] for k in cases}
    for _ in range(steps):
        start = time.perf_counter()
        fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bits)
        times["batch 16 fill (parallel)"].append(time.perf_counter() - start)
        guide._bitmask[:16] = bits
        for name, run in cases.items():
            x = logits.clone()
            guide._rows = rows
            start = time.perf_counter()
            run(x)
            times[name].append(time.perf_counter() - start)
        for i, m in enumerate(matchers):
            row = np.flatnonzero(np.unpackbits(bits[i:i + 1].view(np.uint8), axis=1, bitorder="little")[0, :vocab])
            row = row[~np.isin(row, eos)]
            if m.is_stopped() or not len(row) or not m.consume_token(int(rng.choice(row))):
                matchers[i] = guide.compiler.compile(kinds[i % len(kinds)]).new_matcher()
    guide._rows = []
    out = {k: {"p50_us": 1e6 * pct(v, 50), "p99_us": 1e6 * pct(v, 99), "n": len(v)} for k, v in times.items()}
    table(f"batch 16 × {vocab}: fill and apply (float32 logits on {place})", ["", "p50 µs", "p99 µs", "steps"],
          [[k, v["p50_us"], v["p99_us"], v["n"]] for k, v in out.items()])
    return out


# -- decode -----------------------------------------------------------------------------------------
def bench_decode(model: str, batches: list[int], tokens: int, reps: int) -> dict:
    """tokens/s per case; cases alternate within each repetition so load drifts hit them alike."""
    from fastdeploy_lp import LLM, GuidedDecodingParams, SamplingParams

    prompt = "Give the capital of France as JSON:"
    # fast_forward is part of the frozen engine config: one engine with it and one without.
    llms = {ff: LLM(model, max_num_seqs=max(batches), device="cpu", max_model_len=512, fast_forward=ff)
            for ff in (False, True)}
    for llm in llms.values():
        llm.generate([prompt] * max(batches), SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    cases = [("unconstrained", None, False), ("json capital", GuidedDecodingParams(json=CAPITAL), False),
             ("json capital +fast-forward", GuidedDecodingParams(json=CAPITAL), True)]
    results = {}
    for batch in batches:
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in cases}
        for _ in range(reps):
            for name, gd, ff in cases:
                llm = llms[ff]
                timing = llm.engine.pipeline.timings[llm.engine.pipeline.names[0]]
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


def aims(results: dict) -> list[dict]:
    """Each aim with its measured value and whether it is met."""
    rows = []
    schemas = results.get("schema_mask")
    if schemas:
        label = f"mask p50 per token, JSONSchemaBench ({schemas['schemas_compiled']} schemas)"
        rows.append({"aim": label, "target": f"<= {AIMS['mask_p50_us']:g} µs", "measured": schemas["p50_us"],
                     "unit": "µs", "met": schemas["p50_us"] <= AIMS["mask_p50_us"]})
        rows.append({"aim": label.replace("p50", "p99"), "target": f"<= {AIMS['mask_p99_us']:g} µs",
                     "measured": schemas["p99_us"], "unit": "µs", "met": schemas["p99_us"] <= AIMS["mask_p99_us"]})
    decode = results.get("decode", {})
    r = decode.get("json capital @ batch 16")
    if r:
        target = f">= {AIMS['constrained_vs_unconstrained']:g}"
        rows.append({"aim": "constrained / unconstrained tokens/s @ batch 16 (measured)", "target": target,
                     "measured": r["vs_unconstrained"], "unit": "",
                     "met": r["vs_unconstrained"] >= AIMS["constrained_vs_unconstrained"]})
        rows.append({"aim": "constrained / unconstrained @ batch 16 (from the processor's own ms/step)",
                     "target": target, "measured": r["vs_unconstrained_from_guided_ms"], "unit": "",
                     "met": r["vs_unconstrained_from_guided_ms"] >= AIMS["constrained_vs_unconstrained"]})
    r = decode.get("json capital +fast-forward @ batch 16")
    if r:
        rows.append({"aim": "constrained +fast-forward / unconstrained tokens/s @ batch 16 (measured)",
                     "target": f">= {AIMS['constrained_vs_unconstrained']:g}", "measured": r["vs_unconstrained"],
                     "unit": "", "met": r["vs_unconstrained"] >= AIMS["constrained_vs_unconstrained"]})
    table("aims", ["aim", "target", "measured", "verdict"],
          [[a["aim"], a["target"], f"{a['measured']:.3g} {a['unit']}".strip(), "met" if a["met"] else "**NOT MET**"]
           for a in rows])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--mask-steps", type=int, default=300, help="tokens timed per hand-written constraint kind")
    ap.add_argument("--schemas-dir", default=SCHEMAS, help="JSONSchemaBench *.jsonl (read in place)")
    ap.add_argument("--schemas", type=int, default=100, help="JSONSchemaBench schemas sampled (seeded)")
    ap.add_argument("--schema-tokens", type=int, default=64, help="tokens timed per sampled schema")
    ap.add_argument("--seed", type=int, default=0, help="schema sample and random walks")
    ap.add_argument("--apply-steps", type=int, default=30, help="batch-16 fill + apply steps")
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
    from fastdeploy_lp.model.runner import use_device
    from fastdeploy_lp.processors import EngineContext
    from fastdeploy_lp.processors.guided import GuidedDecodingLogitsProcessor

    cfg = FDConfig.create(args.model, device="cpu", max_num_seqs=16, max_model_len=512)
    use_device(cfg)  # as the engine runs: CPU threads and MKL settings
    start = time.perf_counter()
    guide = GuidedDecodingLogitsProcessor(cfg, EngineContext.load(cfg))
    results = {"model": args.model, "vocab_size": guide.vocab_size,
               "tokenizer_build_s": time.perf_counter() - start, "args": vars(args)}
    print(f"vocabulary {guide.vocab_size}; llguidance tokenizer built in {results['tokenizer_build_s']:.2f} s")
    results["compile"] = bench_compile(guide, args.compile_reps)
    results["mask"] = bench_mask(guide, args.mask_steps)
    if os.path.isdir(args.schemas_dir):
        results["schema_mask"] = bench_schema_masks(guide, args.schemas_dir, args.schemas, args.schema_tokens, args.seed)
    else:
        print(f"\nno JSONSchemaBench data at {args.schemas_dir}: schema mask times skipped")
    results["apply"] = bench_apply(guide, args.apply_steps)
    if not args.skip_decode:
        results["decode"] = bench_decode(args.model, args.batches, args.tokens, args.reps)
    results["aims"] = aims(results)
    print("\n" + json.dumps(results, indent=1, ensure_ascii=False))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
