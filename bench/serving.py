"""Serving benchmark: N concurrent streaming clients against the OpenAI-compatible server on loopback.

    python bench/serving.py                                 # starts a server on the default model
    python bench/serving.py --model tests/fixtures/hf/qwen2 --concurrency 1 8 32
    python bench/serving.py --url http://127.0.0.1:8180     # an already running server

Every request streams /v1/completions with `ignore_eos` and a fixed `max_tokens`, so all requests
produce the same number of tokens. Per concurrency level it reports requests/s, output tokens/s,
time to first token (TTFT) and inter-token latency (ITL, the gaps between streamed chunks) at
p50/p99, as a table and as JSON. Not a test: nothing passes or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen2")


def default_model() -> str:
    from fastdeploy_lp.config import default_model_path

    path = default_model_path()
    return path if os.path.isfile(os.path.join(path, "config.json")) else FIXTURE


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "fastdeploy_lp.entrypoints.openai.api_server", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
           "--log-level", "warning"]
    if args.device:
        cmd += ["--device", args.device]
    if args.logits_processors:
        cmd += ["--logits-processors", *args.logits_processors]
    log = tempfile.NamedTemporaryFile("w", prefix="bench-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); log: {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not start; log: {log.name}")


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.perf_counter()
    chunk_times, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("choices") and data["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"ttft": chunk_times[0] - start if chunk_times else end - start,
            "itl": list(np.diff(chunk_times)), "tokens": tokens, "latency": end - start}


async def run_level(url: str, concurrency: int, num_requests: int, args) -> dict:
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * max(1, args.prompt_words // 9))
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    queue = list(range(num_requests))
    results = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, dict(body, max_tokens=2))  # warm-up

        async def worker():
            while queue:
                queue.pop()
                results.append(await one_request(client, url, body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ttft = np.array([r["ttft"] for r in results]) * 1000
    itl = np.array([x for r in results for x in r["itl"]] or [0.0]) * 1000
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "wall_s": round(wall, 3),
            "requests_per_s": round(len(results) / wall, 3), "output_tokens_per_s": round(tokens / wall, 1),
            "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 1), "ttft_ms_p99": round(float(np.percentile(ttft, 99)), 1),
            "itl_ms_p50": round(float(np.percentile(itl, 50)), 2), "itl_ms_p99": round(float(np.percentile(itl, 99)), 2)}


def print_table(rows: list[dict]) -> None:
    cols = ["concurrency", "requests", "requests_per_s", "output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99",
            "itl_ms_p50", "itl_ms_p99"]
    heads = ["clients", "requests", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    widths = [max(len(h), *(len(str(r[c])) for r in rows)) for h, c in zip(heads, cols)]
    print(" | ".join(h.rjust(w) for h, w in zip(heads, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="Benchmark this running server instead of starting one.")
    p.add_argument("--model", default=None, help="Model for the started server (default: the built-in model, "
                                                 "else the qwen2 test fixture).")
    p.add_argument("--device", default=None)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--logits-processors", nargs="*", default=[])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=None, help="Requests per level (default: 4 x clients, >= 8).")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=45)
    p.add_argument("--json", default=None, help="Also write the results to this file.")
    args = p.parse_args()
    args.model = args.model or default_model()

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        rows = []
        for c in args.concurrency:
            rows.append(asyncio.run(run_level(url, c, args.requests or max(8, 4 * c), args)))
            print(f"# concurrency {c} done", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    meta = {"model": args.model if args.url is None else url, "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words, "max_num_seqs": args.max_num_seqs, "device": args.device or "auto",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}
    print_table(rows)
    report = {"benchmark": "serving", **meta, "results": rows}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
