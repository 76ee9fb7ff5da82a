"""Where one decode step's time goes, at each batch size: the engine's parts timed in place.

    python bench/step_profile.py --model bench/models/qwen2.5-0.5b-random --batch-sizes 1 8 32
    python bench/step_profile.py --model <SmolLM2 .gguf> --weights bfloat16 --json out.json

Requests with random prompts of `--prompt-len` tokens decode greedily (EOS ignored) until every
one is past its prompt; then `--steps` decode steps are timed, each method below wrapped with a
timer, so the parts add up to the step as the engine runs it:

* **forward**: the batch's tensors (`AttentionBatch.paged`, ids), the embedding lookup, the
  decoder layers (one fused kernel call where the plan allows it, else Paddle and kernel ops), the
  LM head;
* **sampling**: each stage of `engine/stages.py` (processors, penalties, ..., the draw);
* **engine**: scheduling and processor `update_state` before the pass; appending tokens,
  detokenizing, stop checks and output building after it (`LLMEngine._append`, `to_output`);
  the rest of `LLMEngine.step` is Python between these calls.

The decoder layers' share is then split by timing each of their kernels alone on the same shapes
(the step's rows, the model's weights in their format, a paged cache as long as the requests'):
the linear layers (weights read), attention, rotary and the cache write, the SwiGLU. What is left of
the fused call (norms, residual adds, copies between the kernels) is the difference.

Prints a table per batch size (milliseconds per step and share) and, with `--json`, writes them.
The CPU (model and vector ISA) heads the output: write it beside any number taken from here.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections import defaultdict

import numpy as np
import paddle

sys.path.insert(0, os.path.dirname(__file__))
from throughput import DEFAULT_MODEL, FORMATS  # noqa: E402

from fastdeploy_lp import LLM, SamplingParams  # noqa: E402
from fastdeploy_lp.config import KV_CACHE_DTYPES  # noqa: E402
from fastdeploy_lp.engine.engine import LLMEngine  # noqa: E402
from fastdeploy_lp.engine.request import Request  # noqa: E402
from fastdeploy_lp.model import cpu_dispatch, cpu_features, cpu_kernels, decoder  # noqa: E402
from fastdeploy_lp.model.layers import AttentionBatch  # noqa: E402
from fastdeploy_lp.model.runner import ModelRunner  # noqa: E402


class Timers:
    """Seconds per named part, collected only while `on`."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, owner, attribute: str, name: str) -> None:
        """Replace `owner.attribute` (a method, or a function on a class or module) with a timed one."""
        inner = getattr(owner, attribute)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - start

        setattr(owner, attribute, timed)


def instrument(llm: LLM, timers: Timers) -> None:
    engine: LLMEngine = llm.engine
    runner: ModelRunner = engine.runner
    model = runner.model
    timers.wrap(engine, "step", "step")
    timers.wrap(engine, "_drain_inbox", "engine: inbox and aborts")
    timers.wrap(engine, "_schedule_prompts", "engine: scheduling")
    timers.wrap(engine, "_prepare", "engine: processors' update_state, block reservation")
    timers.wrap(engine, "_append", "engine: append, detokenize, stop checks")
    timers.wrap(engine.scheduler, "commit", "engine: append, detokenize, stop checks")
    timers.wrap(runner, "forward", "forward")
    timers.wrap(AttentionBatch, "paged", "forward: batch tensors (block tables, positions)")
    timers.wrap(model, "embed", "forward: embedding")
    timers.wrap(model, "logits", "forward: LM head")
    timers.wrap(decoder, "run_fused_layers", "forward: decoder layers")
    for layer in model.layers:  # the unfused path, when the plan does not fuse this pass
        timers.wrap(layer, "forward", "forward: decoder layers")
    for stage in engine.stages.stages:
        timers.wrap(stage, "apply", f"sampling: {type(stage).__name__}")
    timers.wrap(engine.stages, "run", "sampling")
    timers.wrap(Request, "to_output", "engine: output building")


def decoder_parts(llm: LLM, rows: int, context: int) -> dict[str, float]:
    """Seconds per step of each kernel the decoder layers chain, alone, on `rows` rows."""
    runner: ModelRunner = llm.engine.runner
    model = runner.model
    kernels = cpu_kernels.load()
    if kernels is None:
        return {}
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    layers = len(model.layers)
    parts: dict[str, float] = defaultdict(float)

    def best(fn, repeat=5):
        fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    with paddle.no_grad():
        xs = {k: paddle.randn([rows, k]) for k in (attn.o_weight.shape[1] if attn.o_weight_layout is None
                                                   else attn.o_weight_layout.in_features,
                                                   model.config.hidden_size, mlp.intermediate)}

        def every_linear():  # every layer's weights, in model order: read from memory as in a step
            for layer in model.layers:
                a, m = layer.self_attn, layer.mlp
                for w, s, b, lay in ((a.qkv_weight, a.qkv_weight_scale, a.qkv_bias, a.qkv_weight_layout),
                                     (a.o_weight, a.o_weight_scale, a.o_bias, a.o_weight_layout),
                                     (m.gate_up_weight, m.gate_up_weight_scale, m.gate_up_bias, m.gate_up_weight_layout),
                                     (m.down_weight, m.down_weight_scale, m.down_bias, m.down_weight_layout)):
                    k = w.shape[1] if lay is None else lay.in_features
                    kernels.linear(xs[k], w, b, s, lay)

        parts["linear layers (weights read)"] = best(every_linear, 3)
        batch, cache = cpu_dispatch._paged_batch(attn, runner.block_size, rows, 1, context, runner.kv_cache_dtype)
        group = batch.groups[0]
        q = paddle.randn([rows, attn.num_heads, attn.head_dim])
        parts["attention"] = layers * best(lambda: kernels.paged_attention(
            q, *cache, *group.kernel_inputs[:2], 1, group.kernel_inputs[2], attn.num_kv_heads, runner.block_size,
            attn.scale))
        qkv = paddle.randn([rows, attn.q_size + 2 * attn.kv_size])
        if attn.q_norm is None:
            parts["rotary, KV cache write"] = layers * best(
                lambda: attn.rotate_and_store_kernel(kernels, qkv, batch, model.rotary, cache))
        gate_up = paddle.randn([rows, 2 * mlp.intermediate])
        parts["SwiGLU"] = layers * best(lambda: kernels.swiglu(gate_up))
    return dict(parts)


def profile(llm: LLM, timers: Timers, batch: int, prompt_len: int, steps: int, seed: int) -> dict:
    engine = llm.engine
    rng = np.random.default_rng(seed)
    vocab = llm.engine.tokenizer.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(rng.integers(10, vocab - 10, prompt_len).tolist(), params, request_id=f"p{batch}-{i}")
    while any(r.cached_len < len(r.prompt_ids) for r in engine.scheduler.holding) or engine.num_waiting:
        engine.step()
    engine.step()  # one decode step untimed: buffers sized, plan buckets hit
    timers.totals.clear()
    timers.on = True
    for _ in range(steps):
        engine.step()
    timers.on = False
    while engine.has_unfinished_requests():
        engine.step()
    per_step = {name: seconds / steps for name, seconds in timers.totals.items()}
    step = per_step.pop("step")
    forward = per_step.pop("forward")
    sampling = per_step.pop("sampling")
    parts = dict(per_step)
    parts["forward: other (Python, index_select)"] = forward - sum(v for k, v in per_step.items() if k.startswith("forward:"))
    parts["sampling: other"] = sampling - sum(v for k, v in per_step.items() if k.startswith("sampling:"))
    engine_parts = sum(v for k, v in per_step.items() if k.startswith("engine:"))
    parts["engine: rest of step (Python between calls)"] = step - forward - sampling - engine_parts
    layer_parts = decoder_parts(llm, batch, prompt_len + steps // 2)
    return {"batch": batch, "step_ms": step * 1e3, "tok_s": batch / step, "parts_ms": {k: v * 1e3 for k, v in parts.items()},
            "decoder_kernels_ms": {k: v * 1e3 for k, v in layer_parts.items()}}


def print_table(result: dict) -> None:
    step = result["step_ms"]
    print(f"\nbatch {result['batch']}: {step:.2f} ms per step, {result['tok_s']:.1f} tok/s")
    print("| part | ms/step | share |\n|---|---:|---:|")
    for name, ms in sorted(result["parts_ms"].items()):
        print(f"| {name} | {ms:.3f} | {100 * ms / step:.1f}% |")
    decoder = result["parts_ms"].get("forward: decoder layers", 0.0)
    if result["decoder_kernels_ms"]:
        print("| *decoder layers, each kernel alone:* | | |")
        for name, ms in result["decoder_kernels_ms"].items():
            print(f"| &nbsp; {name} | {ms:.3f} | {100 * ms / step:.1f}% |")
        rest = decoder - sum(result["decoder_kernels_ms"].values())
        print(f"| &nbsp; rest (norms, residuals, copies, calls) | {rest:.3f} | {100 * rest / step:.1f}% |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a checkpoint directory or a .gguf file")
    ap.add_argument("--weights", choices=list(FORMATS), help="default: as the checkpoint stores them")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    ap.add_argument("--deterministic", action="store_true", help="LLM(deterministic=True): the batch-invariant kernels")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    kwargs = FORMATS[args.weights] if args.weights else {}
    llm = LLM(model=args.model, max_num_seqs=max(args.batch_sizes), max_model_len=args.prompt_len + args.steps + 64,
              enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype, deterministic=args.deterministic,
              **kwargs)
    cpu = cpu_features.detect()
    kernels = cpu_kernels.load()
    print(f"CPU: {cpu.describe()}; kernels {kernels.lanes if kernels else 0} floats per vector; "
          f"{cpu_kernels.threads()} threads; model {args.model}; weights {args.weights or 'as stored'}; "
          f"KV cache {llm.engine.runner.kv_cache_dtype}; deterministic {args.deterministic}")
    timers = Timers()
    instrument(llm, timers)
    results = [profile(llm, timers, b, args.prompt_len, args.steps, seed=b) for b in args.batch_sizes]
    for r in results:
        print_table(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu.describe(), "model": args.model, "weights": args.weights, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
