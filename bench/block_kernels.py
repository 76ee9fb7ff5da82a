"""The block formats' linear kernels alone: GMAC/s by format, weight shape and rows of x.

    python bench/block_kernels.py
    python bench/block_kernels.py --formats Q4_0 Q6_K --rows 1 8 64 512 --json out.json

For each format, a [N, K] weight of random quants (float16 scales of a trained model's size) is
multiplied by `rows` random rows of x, in three ways, interleaved, best of `--repeats`:

* **kernels**: `CpuKernels.linear` as the engine dispatches it without `--deterministic`: the
  integer kernel for few rows, the unit order (`invariant_blocks.h`) from `fdlp_block_unit_rows`;
* **deterministic**: the same call in batch-invariant mode (the unit order at every row count);
* **MKL widened**: `linear.widened_linear`, 8 MB tiles of the weight widened to float32 and
  multiplied by MKL's GEMM, which `cpu_dispatch` weighs against the kernels for a prefill.

`--cold` cycles through 24 copies of each weight (more than the L3 of the machines at hand), so
a decode-sized call reads its weight from memory as a decode step does. The CPU (model and
AVX-512 flags) heads the output: write it beside any number taken from here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import paddle

sys.path.insert(0, os.path.dirname(__file__))
from deterministic import cpu_line  # noqa: E402

from fastdeploy_lp.block_formats import FORMATS, WeightLayout  # noqa: E402
from fastdeploy_lp.model import cpu_kernels  # noqa: E402
from fastdeploy_lp.model.linear import widened_linear  # noqa: E402

SCALES = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "W4G128": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of each block's float16 factors


def random_weight(name: str, n: int, k: int, rng: np.random.Generator) -> paddle.Tensor:
    fmt = FORMATS[name]
    blocks = rng.integers(0, 256, size=(n * k // fmt.elems, fmt.bytes), dtype=np.uint8)
    for at in SCALES[name]:
        blocks[:, at:at + 2] = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return paddle.to_tensor(blocks.reshape(-1))


def best_seconds(run, calls: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            run(i)
        times.append((time.perf_counter() - start) / calls)
    return min(times)


def measure(kernels, name: str, n: int, k: int, rows: int, args) -> dict:
    rng = np.random.default_rng(0)
    weights = [random_weight(name, n, k, rng)]
    if args.cold:
        weights += [paddle.to_tensor(weights[0].numpy().copy()) for _ in range(23)]
    layout = WeightLayout(((name, n),), k)
    x = paddle.to_tensor(rng.standard_normal((rows, k), dtype=np.float32))
    calls = max(len(weights), min(50, int(2e9 // (rows * n * k))))
    ways = {"kernels": lambda i: kernels.linear(x, weights[i % len(weights)], layout=layout)}
    ways["deterministic"] = ways["kernels"]
    if rows > cpu_kernels.KERNEL_ROWS:
        ways["MKL widened"] = lambda i: widened_linear(kernels, x, weights[i % len(weights)], None, layout)
    seconds = {way: float("inf") for way in ways}
    for _ in range(args.repeats):  # interleaved, so the machine's drift falls on every way alike
        for way, run in ways.items():
            kernels.set_batch_invariant(way == "deterministic")
            seconds[way] = min(seconds[way], best_seconds(run, calls, 1))
    kernels.set_batch_invariant(False)
    return {way: rows * n * k / s / 1e9 for way, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=["Q4_0", "Q8_0", "Q4_K", "Q6_K"], choices=sorted(SCALES))
    parser.add_argument("--shapes", nargs="+", default=["4864x1024", "1024x4864"], help="N x K of the weight")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="read each weight from memory, as a decode step does")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    kernels = cpu_kernels.load()
    if kernels is None:
        sys.exit("the CPU kernels cannot be built here (no C compiler?)")
    cpu_kernels.set_threads(args.threads)
    print(f"{cpu_line()}; {args.threads} threads{', weights read cold' if args.cold else ''}\n")
    print("| format | N x K | rows | kernels | deterministic | time on / off | MKL widened |")
    print("|---|---|---:|---:|---:|---:|---:|")
    results = []
    for name in args.formats:
        for shape in args.shapes:
            n, k = (int(v) for v in shape.split("x"))
            for rows in args.rows:
                speed = measure(kernels, name, n, k, rows, args)
                mkl = f"{speed['MKL widened']:.1f}" if "MKL widened" in speed else "-"
                print(f"| {name} | {shape} | {rows} | {speed['kernels']:.1f} | {speed['deterministic']:.1f} | "
                      f"{speed['kernels'] / speed['deterministic']:.2f} | {mkl} |", flush=True)
                results.append({"format": name, "shape": shape, "rows": rows, "gmac_s": speed})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_line(), "threads": args.threads, "cold": args.cold, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
