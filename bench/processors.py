"""Cost of the logits-processor pipeline per decode step, against the decode step itself.

    python bench/make_bench_model.py      # once (optional): the Qwen2.5-0.5B-shaped random checkpoint
    python bench/processors.py --batch 32 --vocab 151936 --steps 20

A batch of `--batch` running requests, each with a `--prompt-len` prompt and `--output-len` tokens
generated so far, lives in a real `share_inputs` (`new_share_inputs`); every measured step appends
one token to every row and then times `pipeline.update_state` + `pipeline.apply` on a `[batch,
vocab]` float32 logits tensor (synchronised on GPU). Configurations:

* `empty`            no processors registered;
* `registered-idle`  LogitBias + BadWords + NoRepeatNGram registered, no request uses them;
* `batched`          the same three active on every row (20 biases, 8 one-token and 8 multi-token
                     banned sequences, no_repeat_ngram_size=3);
* `naive-loop`       the same three written the obvious way: a Python loop over rows, the whole
                     history rebuilt every step, one indexed write per banned token.

The step it is compared with is a real batched decode forward pass of the bench model at the same
batch and context length (`ModelRunner.forward`, one token per slot), when the checkpoint exists.
Prints a table, then the same numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import paddle

from fastdeploy_lp.config import EngineArgs, FDConfig, ModelConfig
from fastdeploy_lp.engine.scheduler import new_share_inputs
from fastdeploy_lp.processors import EngineContext, LogitsProcessor, LogitsProcessorArgs, LogitsProcessorPipeline
from fastdeploy_lp.processors.builtin.bad_words import banned_next_tokens

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "qwen2.5-0.5b-random")
BATCHED = ["LogitBiasLogitsProcessor", "BadWordsLogitsProcessor", "NoRepeatNGramLogitsProcessor"]


# -- the same three processors, written naively -----------------------------------------------------
class _NaiveRows(LogitsProcessor):
    def update_state(self, share_inputs):
        flags = share_inputs["stop_flags"]
        self.rows = [(share_inputs["logits_processors_args"][s],
                      share_inputs["prompt_ids"][s].tolist() + list(share_inputs["output_ids"][s]))
                     for s in range(len(flags)) if not flags[s]]


class NaiveLogitBias(_NaiveRows):
    def apply(self, logits):
        for i, (args, _) in enumerate(self.rows):
            for token, bias in (args.logit_bias or {}).items():
                logits[i, int(token)] += bias
        return logits


class NaiveBadWords(_NaiveRows):
    def apply(self, logits):
        for i, (args, history) in enumerate(self.rows):
            for token in banned_next_tokens(history, args.bad_words_token_ids or []):
                logits[i, token] = float("-inf")
        return logits


class NaiveNoRepeatNGram(_NaiveRows):
    def apply(self, logits):
        for i, (args, history) in enumerate(self.rows):
            n = args.no_repeat_ngram_size
            if not n:
                continue
            ngrams: dict[tuple, list[int]] = {}
            for j in range(len(history) - n + 1):
                ngrams.setdefault(tuple(history[j:j + n - 1]), []).append(history[j + n - 1])
            for token in ngrams.get(tuple(history[len(history) - n + 1:]), []):
                logits[i, token] = float("-inf")
        return logits


# -- setup ----------------------------------------------------------------------------------------------
class IdsOnlyTokenizer:
    """The synthetic config's tokenizer: the bench's requests name token ids, never words."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text, add_special_tokens=True):
        raise ValueError("bench requests name token ids (bad_words_token_ids), not text")


def bench_context(vocab: int, batch: int, max_len: int, model_dir: str | None) -> EngineContext:
    if model_dir:
        return EngineContext.load(FDConfig.create(model_dir, max_num_seqs=batch, max_model_len=max_len,
                                                  device=paddle.get_device()))
    model = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "vocab_size": vocab, "hidden_size": 64,
                                   "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 1,
                                   "num_key_value_heads": 1,
                                   "max_position_embeddings": max_len})
    args = EngineArgs(max_num_seqs=batch, max_model_len=max_len, device=paddle.get_device())
    return EngineContext(args.create_engine_config(model), IdsOnlyTokenizer(vocab), {}, {})


def request_args(rng: np.random.Generator, vocab: int) -> dict:
    ids = lambda n: [int(t) for t in rng.integers(0, vocab, n)]  # noqa: E731
    return {"logit_bias": {t: float(b) for t, b in zip(ids(20), rng.normal(0, 2, 20))},
            "bad_words_token_ids": [[t] for t in ids(8)] + [ids(int(k)) for k in rng.integers(2, 5, 8)],
            "no_repeat_ngram_size": 3}


def fill_batch(engine_context, batch, prompt_len, output_len, with_args, seed=0):
    rng = np.random.default_rng(seed)
    vocab = engine_context.config.model_config.vocab_size
    share = new_share_inputs(batch)
    validator = LogitsProcessorPipeline(engine_context, BATCHED)
    for slot in range(batch):
        share["stop_flags"][slot] = False
        share["req_ids"][slot] = f"req-{slot}"
        share["logits_processors_args"][slot] = (validator.validate_args(request_args(rng, vocab)) if with_args
                                                 else LogitsProcessorArgs())
        share["prompt_ids"][slot] = rng.integers(0, vocab, prompt_len).astype(np.int64)
        share["prompt_lens"][slot] = prompt_len
        share["output_ids"][slot] = [int(t) for t in rng.integers(0, vocab, output_len)]
        share["step_idx"][slot] = output_len
        share["next_tokens"][slot] = share["output_ids"][slot][-1]
    return share, rng


def sync():
    if paddle.device.is_compiled_with_cuda() and paddle.get_device().startswith("gpu"):
        paddle.device.synchronize()


def time_pipeline(pipeline, share, rng, logits, steps, warmup=2) -> list[float]:
    times = []
    vocab = logits.shape[-1]
    for step in range(warmup + steps):
        for slot in range(len(share["stop_flags"])):  # one decode step: every row gets a token
            token = int(rng.integers(0, vocab))
            share["output_ids"][slot].append(token)
            share["step_idx"][slot] += 1
            share["next_tokens"][slot] = token
        if step == warmup:  # per-processor timings cover the measured steps only
            pipeline.timings = {name: type(t)() for name, t in pipeline.timings.items()}
        sync()
        start = time.perf_counter()
        pipeline.update_state(share)
        out, failures = pipeline.apply(logits, share, all_greedy=True)
        assert not failures, failures
        sync()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times


def time_forward(fd_config, batch, context, steps) -> list[float] | None:
    from fastdeploy_lp.model.runner import ModelRunner, SequenceFeed

    runner = ModelRunner(fd_config)
    per_seq = context // runner.block_size + 1  # blocks holding positions 0..context
    if batch * per_seq >= runner.num_blocks:
        raise SystemExit(f"{batch} x {context + 1} tokens need {batch * per_seq} KV blocks; the pool has "
                         f"{runner.num_blocks - 1}")
    # Distinct blocks per sequence (block 0 is the null block); their contents do not matter for timing.
    feeds = [SequenceFeed(list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)), [1 + s], context)
             for s in range(batch)]
    times = []
    for i in range(steps + 1):
        sync()
        start = time.perf_counter()
        logits = runner.forward(feeds)
        float(logits[0, 0])  # wait for the result
        if i:
            times.append(time.perf_counter() - start)
    return times


def summary(times: list[float]) -> dict:
    return {"mean_ms": 1e3 * statistics.fmean(times), "median_ms": 1e3 * statistics.median(times),
            "min_ms": 1e3 * min(times), "steps": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=151936, help="used when no model is given")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--naive-steps", type=int, default=5)
    ap.add_argument("--forward-steps", type=int, default=3)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint for the decode step; 'none' to skip")
    args = ap.parse_args()

    model_dir = args.model if args.model != "none" and os.path.isfile(os.path.join(args.model, "config.json")) else None
    context = args.prompt_len + args.output_len
    max_len = context + 2 + max(args.steps, args.naive_steps) + 8
    engine_context = bench_context(args.vocab, args.batch, max_len, model_dir)
    fd_config = engine_context.config
    vocab = fd_config.model_config.vocab_size
    logits = paddle.to_tensor(np.random.default_rng(1).standard_normal((args.batch, vocab)).astype(np.float32))

    configs = {
        "empty": (lambda: LogitsProcessorPipeline(engine_context, []), False, args.steps),
        "registered-idle": (lambda: LogitsProcessorPipeline(engine_context, BATCHED), False, args.steps),
        "batched": (lambda: LogitsProcessorPipeline(engine_context, BATCHED), True, args.steps),
        "naive-loop": (lambda: LogitsProcessorPipeline(engine_context, [], leading=[
            NaiveLogitBias(fd_config), NaiveBadWords(fd_config), NaiveNoRepeatNGram(fd_config)]), True,
            args.naive_steps),
    }
    results = {"device": paddle.get_device(), "batch": args.batch, "vocab": vocab, "context": context,
               "model": os.path.basename(model_dir) if model_dir else None, "pipeline": {}}
    for name, (make, with_args, steps) in configs.items():
        share, rng = fill_batch(engine_context, args.batch, args.prompt_len, args.output_len, with_args)
        pipeline = make()
        results["pipeline"][name] = summary(time_pipeline(pipeline, share, rng, logits.clone(), steps))
        results["pipeline"][name]["per_processor_ms"] = {
            p: 1e3 * (t.update_state_seconds + t.apply_seconds) / steps for p, t in pipeline.timings.items()}

    forward = time_forward(fd_config, args.batch, context, args.forward_steps) if model_dir else None
    results["forward"] = summary(forward) if forward else None
    if forward:
        step = results["forward"]["median_ms"]
        for name, r in results["pipeline"].items():
            r["fraction_of_step"] = r["median_ms"] / (step + r["median_ms"])

    print(f"logits processors, batch {args.batch}, vocab {vocab}, context {context}, device {results['device']}")
    print(f"{'configuration':<18}{'median ms':>11}{'mean ms':>10}{'min ms':>9}{'of step':>9}")
    for name, r in results["pipeline"].items():
        frac = f"{100 * r['fraction_of_step']:.2f}%" if "fraction_of_step" in r else "-"
        print(f"{name:<18}{r['median_ms']:>11.3f}{r['mean_ms']:>10.3f}{r['min_ms']:>9.3f}{frac:>9}")
    for name in ("batched", "naive-loop"):
        parts = ", ".join(f"{p.replace('LogitsProcessor', '')} {ms:.3f}"
                          for p, ms in results["pipeline"][name]["per_processor_ms"].items())
        print(f"  {name} per processor (ms): {parts}")
    if forward:
        f = results["forward"]
        print(f"{'decode forward':<18}{f['median_ms']:>11.3f}{f['mean_ms']:>10.3f}{f['min_ms']:>9.3f}"
              f"   ({results['model']}, {args.batch} x 1 token at position {context})")
    else:
        print("decode forward: not measured (no bench model; run bench/make_bench_model.py)")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
