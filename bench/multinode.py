"""Tensor parallelism with launched ranks (`--tensor-parallel-address`, multi-node) against spawned
ones, on one host: decode tok/s at batch 1 and 8, greedy, 128-token prompts, 64 new tokens.

The two launches of `paddle.distributed.launch --nnodes 2` stand in for two machines; each rank gets
`--cpu-threads` = half the cores, as the spawned ranks do, so the comparison is of the transport
(a socket and pickled logits instead of a pipe and shared memory), not of the threads.

    python bench/multinode.py [--model bench/models/qwen2.5-0.5b-random]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fastdeploy_lp import LLM, SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launches(driver: str, log_dir: str) -> list[subprocess.Popen]:
    cli, master = Path(sys.executable).with_name("fastdeploy-lp"), f"127.0.0.1:{free_port()}"
    return [subprocess.Popen([sys.executable, "-m", "paddle.distributed.launch", "--nnodes", "2", "--rank", str(node),
                              "--master", master, "--nproc_per_node", "1", "--job_id", "fdlp-bench",
                              "--log_dir", f"{log_dir}/node{node}", str(cli), "tp-worker", "--driver", driver],
                             env=dict(os.environ, GLOG_minloglevel="2"), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for node in (0, 1)]


def rates(llm: LLM) -> dict[int, float]:
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [[100 + i] * 128 for i in range(8)]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    out = {}
    for batch in (1, 8):
        start = time.perf_counter()
        done = llm.generate(prompts[:batch], params, use_tqdm=False)
        out[batch] = sum(len(o.outputs.token_ids) for o in done) / (time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench/models/qwen2.5-0.5b-random")
    args = parser.parse_args()
    os.environ.setdefault("FDLP_TP_SECRET", os.urandom(16).hex())
    common = dict(tensor_parallel_size=2, max_num_seqs=8, cpu_threads=max(1, len(os.sched_getaffinity(0)) // 2))
    results = {"spawned": rates(LLM(args.model, **common))}
    address = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as logs:
        nodes = launches(address, logs)
        try:
            results["launched (2 launches)"] = rates(LLM(args.model, tensor_parallel_address=address, **common))
        finally:
            for node in nodes:
                node.wait(60)
    print("| ranks | b1 tok/s | b8 tok/s |\n|---|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r[1]:.1f} | {r[8]:.1f} |")
    print(json.dumps({name: {str(b): round(v, 2) for b, v in r.items()} for name, r in results.items()}))


if __name__ == "__main__":
    main()
