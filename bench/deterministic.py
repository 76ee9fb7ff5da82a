"""Deterministic inference (issue 38): one probe request, alone and then among random neighbours,
must give the same tokens and logprobs bit for bit with `deterministic=True`; and what the flag costs.

    python bench/deterministic.py --mixes 500                 # the random mixes, flag on and off: table + JSON
    python bench/deterministic.py --mixes 0 --speed           # decode tok/s and TTFT, flag off and on, batch 1/8/32
    python bench/deterministic.py --mixes 0 --speed --model bench/models/qwen2.5-0.5b-random --batch-sizes 1 8
    python bench/deterministic.py --mixes 10 --model path/to/SmolLM2-135M-Instruct.Q4_1.gguf   # a real checkpoint

Each mix draws an engine configuration (chunk size `max_num_batched_tokens`, prefix caching on or
off, a KV pool small enough to force preemption or not, n-gram speculation on or off) and 1 to 7
neighbours of random lengths and sampling options (greedy or seeded, top-k / top-p, a repetition
penalty, a logit bias), some sharing the probe's prompt so its blocks are prefix hits; the probe
(greedy, seeded at temperature 0.8, or greedy under a JSON schema, with `logprobs`, sometimes with
n=2; neighbours also use the built-in processors and regex constraints) goes in at a random
place. Its tokens and logprobs (the chosen token's and the top ones') are compared with `==`
against the probe run alone on a fresh engine. Engines are kept per configuration, so later mixes
on one also meet the prefix cache its earlier mixes filled. Built-in model unless `--model`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.sampling_params import GuidedDecodingParams

PROBE_LEN, PROBE_OUT = 45, 24
CHUNKS = (16, 48, 200, None)       # max_num_batched_tokens (None: the default budget)
SMALL_POOL = 14                    # blocks of 16 tokens: 8 slots of long neighbours do not fit, so some are preempted
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
# every built-in processor that needs no model-specific setup; guided decoding is on by default
PROCESSORS = ["LogitBiasLogitsProcessor", "AllowedTokenIdsLogitsProcessor", "NoRepeatNGramLogitsProcessor",
              "BadWordsLogitsProcessor"]
PROBE_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                "required": ["name", "n"]}


def probe_prompt(vocab: int) -> list[int]:
    rng = random.Random(38)
    return [rng.randrange(3, vocab) for _ in range(PROBE_LEN)]


def probe_params(kind: str, n: int = 1) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=PROBE_OUT, logprobs=3, ignore_eos=True, n=n)
    if kind == "guided":  # greedy under a JSON schema: the grammar's mask is in the logprobs too
        return SamplingParams(temperature=0, max_tokens=PROBE_OUT, logprobs=3, n=n,
                              guided_decoding=GuidedDecodingParams(json=PROBE_SCHEMA))
    return SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=PROBE_OUT, logprobs=3,
                          ignore_eos=True, n=n)


def result(output) -> tuple:
    """What must not change: the tokens, each chosen logprob and each top-logprob dict."""
    return (list(output.token_ids), [(lp.token_id, lp.logprob, sorted(lp.top.items())) for lp in output.logprobs])


class Mixes:
    """Engines per configuration, all with the same `deterministic`, and the probe's results."""

    def __init__(self, deterministic: bool, speculative: dict = NGRAM, spec_rate: float = 0.3, **engine_args):
        self.deterministic = deterministic
        self.speculative, self.spec_rate = speculative, spec_rate  # the mixes' speculation and how often
        self.engine_args = engine_args  # for every engine: a weight format (dtype, quantization), ...
        self.engines: dict[tuple, LLM] = {}
        self.reference: dict[str, tuple] = {}

    def engine(self, chunk: int | None, prefix: bool, small: bool, spec: bool) -> LLM:
        key = (chunk, prefix, small, spec)
        if key not in self.engines:
            self.engines[key] = LLM(device="cpu", max_num_seqs=8, max_model_len=256, deterministic=self.deterministic,
                                    logits_processors=PROCESSORS, **self.engine_args, max_num_batched_tokens=chunk, enable_prefix_caching=prefix,
                                    num_blocks=SMALL_POOL if small else None,
                                    speculative_config=self.speculative if spec else None)
        return self.engines[key]

    def alone(self, kind: str) -> tuple:
        """The probe by itself on a fresh engine of the default configuration (built once)."""
        if kind not in self.reference:
            llm = LLM(device="cpu", max_num_seqs=8, max_model_len=256, deterministic=self.deterministic,
                      logits_processors=PROCESSORS, **self.engine_args)
            prompt = probe_prompt(llm.engine.fd_config.model_config.vocab_size)
            self.reference[kind] = result(llm.generate([prompt], probe_params(kind), use_tqdm=False)[0].outputs)
        return self.reference[kind]

    def mix(self, seed: int) -> dict:
        """One random mix; returns its description and whether each probe choice matched."""
        rng = random.Random(seed)
        config = dict(chunk=rng.choice(CHUNKS), prefix=rng.random() < 0.7, small=rng.random() < 0.4,
                      spec=rng.random() < self.spec_rate)
        llm = self.engine(**config)
        vocab = llm.engine.fd_config.model_config.vocab_size
        probe = probe_prompt(vocab)
        kind, n = rng.choice(("greedy", "seeded", "guided")), rng.choice((1, 1, 2))
        prompts, params = [], []
        for _ in range(rng.randint(1, 7)):
            length = rng.randint(1, 120)
            ids = [rng.randrange(3, vocab) for _ in range(length)]
            if rng.random() < 0.3:  # shares the probe's first blocks: a prefix hit for whichever comes later
                ids = probe[:rng.randint(16, PROBE_LEN)] + ids[:40]
            extra = {}
            if rng.random() < 0.3:
                extra["logit_bias"] = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(3)}
            if rng.random() < 0.3:
                extra["repetition_penalty"] = 1.2
            extra.update(_neighbour_processors(rng, vocab))
            greedy = rng.random() < 0.5
            params.append(SamplingParams(temperature=0 if greedy else rng.uniform(0.5, 1.2),
                                         top_k=0 if greedy else rng.choice((0, 20)),
                                         top_p=1.0 if greedy else rng.choice((1.0, 0.9)),
                                         seed=None if greedy else rng.randrange(1 << 20),
                                         max_tokens=rng.randint(1, 40), ignore_eos=True,
                                         logprobs=rng.choice((None, 2)), **extra))
            prompts.append(ids)
        at = rng.randint(0, len(prompts))
        prompts.insert(at, probe)
        params.insert(at, probe_params(kind, n))
        before = llm.engine.scheduler.num_preemptions
        outs = llm.generate(prompts, params, use_tqdm=False)
        first = sum(p.n for p in params[:at])  # generate returns one output per choice, in order
        want = self.alone(kind)
        matched = [result(outs[first + i].outputs) == want for i in range(n)] if kind != "seeded" else \
            [result(outs[first].outputs) == want]  # choice 0 has the probe's seed; choice 1 has seed + 1
        return {"seed": seed, **config, "probe": kind, "n": n, "neighbours": len(prompts) - 1, "at": at,
                "preemptions": llm.engine.scheduler.num_preemptions - before, "matched": all(matched)}


def _neighbour_processors(rng: random.Random, vocab: int) -> dict:
    """Some of the built-in processors' arguments, or an output constraint, for one neighbour."""
    args, extra = {}, {}
    if rng.random() < 0.2:
        args["allowed_token_ids"] = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 50))]
    if rng.random() < 0.2:
        args["no_repeat_ngram_size"] = rng.randint(1, 3)
    if rng.random() < 0.2:
        args["bad_words_token_ids"] = [[rng.randrange(3, vocab)] for _ in range(5)]
    if args:
        extra["logits_processors_args"] = args
    elif rng.random() < 0.25:
        extra["guided_decoding"] = GuidedDecodingParams(regex=rng.choice(("[a-z ]+", "[0-9]{1,8}", "(yes|no)")))
    return extra


def run_mixes(deterministic: bool, mixes: int, seed: int = 0, **engine_args) -> list[dict]:
    """`mixes` random mixes (`Mixes.mix`) drawn from `seed`; `engine_args` as `Mixes` takes them."""
    runner = Mixes(deterministic, **engine_args)
    return [runner.mix(seed * 100_000 + i) for i in range(mixes)]


def one_run(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """(decode tok/s, mean TTFT s) of one batch, stepped as `bench/throughput.py` does: decode from the
    last request's first token to the last token."""
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"speed-{i}")
    first, last = {}, 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = time.perf_counter()
            first.setdefault(out.request_id, last)
    decode = last - max(first.values())
    return len(prompts) * (output_len - 1) / decode, sum(first.values()) / len(first) - start


def speed(batch: int, model: str | None, prompt_len: int, output_len: int, repeats: int = 3,
          **engine_args) -> dict[bool, tuple]:
    """{deterministic: (decode tok/s, TTFT s)} for `batch` greedy requests with random `prompt_len`-token
    prompts (EOS ignored, prefix caching off): each the best of `repeats` runs, the two engines' runs
    interleaved so a busy moment of the machine hits both alike."""
    llms = {flag: LLM(model, device="cpu", max_num_seqs=batch, deterministic=flag, enable_prefix_caching=False,
                      **engine_args)
            for flag in (False, True)}
    vocab = llms[False].engine.fd_config.model_config.vocab_size
    rng = random.Random(7)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    runs: dict[bool, list] = {False: [], True: []}
    for flag in (False, True):
        one_run(llms[flag], prompts, 4)  # warm up
    for _ in range(repeats):
        for flag in (False, True):
            runs[flag].append(one_run(llms[flag], prompts, output_len))
    return {flag: (max(r[0] for r in runs[flag]), min(r[1] for r in runs[flag])) for flag in runs}


def cpu_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU")
    flags = sorted(set(subprocess.run(["grep", "-o", r"avx512[a-z_]*", "/proc/cpuinfo"], capture_output=True,
                                      text=True).stdout.split()))
    return f"{model}, {os.cpu_count()} CPUs, AVX-512: {' '.join(flags) or 'none'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixes", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speed", action="store_true", help="also decode tok/s with the flag off and on")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--model", default=None, help="a checkpoint or GGUF file (default: the built-in model)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="the engines' weight dtype (LLM(dtype=...))")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engines' KV cache dtype")
    args = parser.parse_args()
    report = {"cpu": cpu_line(), "model": args.model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype}
    print(report["cpu"])
    if args.mixes:
        print("\n| deterministic | mixes | probe matched alone | mismatched | with preemption | with speculation | seconds |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for flag in (False, True):
            start = time.perf_counter()
            rows = run_mixes(flag, args.mixes, args.seed, model=args.model, dtype=args.dtype,
                             kv_cache_dtype=args.kv_cache_dtype)
            took = time.perf_counter() - start
            ok = sum(r["matched"] for r in rows)
            print(f"| {'on' if flag else 'off'} | {len(rows)} | {ok} | {len(rows) - ok} | "
                  f"{sum(r['preemptions'] > 0 for r in rows)} | {sum(r['spec'] for r in rows)} | {took:.0f} |")
            report[f"mixes_{'on' if flag else 'off'}"] = {"mixes": len(rows), "matched": ok, "seconds": round(took, 1),
                                                          "mismatched": [r for r in rows if not r["matched"]][:20]}
    if args.speed:
        print(f"\n{args.model or 'built-in model'} (dtype {args.dtype}, KV cache {args.kv_cache_dtype}), "
              f"prompt {args.prompt_len}, {args.output_len} new tokens, greedy\n")
        print("| batch | decode tok/s off | on | on / off | TTFT off | TTFT on |")
        print("|---:|---:|---:|---:|---:|---:|")
        for batch in args.batch_sizes:
            both = speed(batch, args.model, args.prompt_len, args.output_len, args.repeats,
                         dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
            off, on = both[False], both[True]
            print(f"| {batch} | {off[0]:.1f} | {on[0]:.1f} | {on[0] / off[0]:.2f} | {off[1]:.3f} s | {on[1]:.3f} s |")
            report[f"speed_b{batch}"] = {"decode_tok_s": [round(off[0], 1), round(on[0], 1)],
                                         "ttft_s": [round(off[1], 4), round(on[1], 4)]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
