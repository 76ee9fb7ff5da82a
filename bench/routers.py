"""Replicas behind the field's request routers, against one replica alone on the same cores.

    python bench/routers.py --requests 200 --groups 20 --prefix-tokens 1000 --json out.json

Each configuration starts its own servers on the built-in model (or `--model`) and sends the same
load: `--requests` completions in `--groups` groups whose prompts share a `--prefix-tokens` prefix
(then a short unique question), all arriving at once, streamed, `--output-tokens` each. Per
configuration it prints the prefix-cache hit rate (prompt tokens found cached / looked up, summed
over the replicas' /metrics), TTFT p50 and p99, output tokens per second over the whole run, and
the share of requests each replica served (the largest is `max share`).

Configurations, each skipped when its router is not installed (`pip install sglang-router
vllm-router`; the test extras have both):

    single            one replica with --cpu-threads = all the cores
    sglang-rr         two replicas (one core each, pinned) behind sglang-router --policy round_robin
    sglang-cache      the same behind sglang-router --policy cache_aware
    vllm-cache        the same behind vllm-router --policy cache_aware
    vllm-kv           the same behind vllm-router --policy kv_aware, the replicas publishing KV events
                      (--kv-events-config) that the router subscribes to

The CPU model and its AVX-512 features are printed in the header: write them beside the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORDS = ("river stone market engine forest window silver garden letter winter planet harbor signal "
         "copper meadow violet thunder canyon lantern orchard").split()


def cpu_header() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU")
    flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags")
                    for f in line.split() if f.startswith("avx512")})
    return f"{model}, {os.cpu_count()} cores, avx512: {' '.join(flags) or 'none'}"


def start_replica(port: int, threads: int, cores: list[int] | None, args, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fastdeploy_lp.entrypoints.openai.api_server", "--host", "127.0.0.1",
           "--port", str(port), "--cpu-threads", str(threads), "--max-num-seqs", str(args.max_num_seqs), *extra]
    if args.model:
        cmd += ["--model", args.model]
    preexec = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=preexec)


def start_router(kind: str, policy: str, port: int, workers: list[str], kv_sources: list[tuple[str, str]],
                 model_dir: str) -> subprocess.Popen:
    if kind == "sglang":
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--policy", policy, "--prometheus-port", str(port + 1000), "--worker-urls", *workers]
    else:
        cmd = [str(BIN / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--prometheus-port", str(port + 1000), "--worker-urls", *workers]
        for worker, (source, replay) in zip(workers, kv_sources):
            cmd += ["--kv-event-source", f"{worker}={source}", "--kv-event-replay-source", f"{worker}={replay}"]
        if kv_sources:  # the router hashes prompts into blocks as the replicas do: their block size
            cmd += ["--kv-event-block-size", "16", "--kv-event-model", "default"]
    # kv_aware tokenizes with the model's tokenizer.json
    env = {**os.environ, "VLLM_ROUTER_TOKENIZER": model_dir}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def wait_ready(url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up in {timeout:.0f}s")


def make_prompts(args, base_url: str) -> list[str]:
    """`requests` prompts in `groups` groups; each group's prefix is about `prefix_tokens` tokens."""
    rng = random.Random(0)
    prompts = []
    for g in range(args.groups):
        words = [rng.choice(WORDS) for _ in range(args.prefix_tokens)]
        prefix = f"Document {g}: " + " ".join(words)
        while len(httpx.post(f"{base_url}/tokenize", json={"prompt": prefix}, timeout=30).json()["tokens"]) > \
                args.prefix_tokens:
            words = words[:-8]
            prefix = f"Document {g}: " + " ".join(words)
        prompts += [f"{prefix}\nQuestion {i}: what is word {i}?" for i in range(args.requests // args.groups)]
    rng.shuffle(prompts)
    return prompts


def prefix_counters(replica_urls: list[str]) -> list[tuple[float, float, float]]:
    """Per replica: (prefix tokens looked up, found, finished sequences), summed over their labels."""
    names = ("fastdeploy_lp:prefix_cache_queries_total", "fastdeploy_lp:prefix_cache_hits_total",
             "fastdeploy_lp:request_finished_total")
    out = []
    for url in replica_urls:
        totals = dict.fromkeys(names, 0.0)
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
        out.append(tuple(totals[name] for name in names))
    return out


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, args, t0: float) -> tuple[float, int]:
    body = {"model": "default", "prompt": prompt, "max_tokens": args.output_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    first, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                first = first or time.perf_counter() - t0
                tokens += 1
    return first, tokens


async def load(url: str, prompts: list[str], args) -> tuple[list[float], int, float]:
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1200.0), limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, p, args, t0) for p in prompts))
        elapsed = time.perf_counter() - t0
    return [r[0] for r in results], sum(r[1] for r in results), elapsed


def run_config(name: str, args, prompts_cache: dict) -> dict | None:
    single = name == "single"
    router_kind, policy = {"sglang-rr": ("sglang", "round_robin"), "sglang-cache": ("sglang", "cache_aware"),
                           "vllm-cache": ("vllm", "cache_aware"), "vllm-kv": ("vllm", "kv_aware")}.get(name, (None, None))
    if router_kind == "sglang" and shutil.which("sglang-router", path=str(BIN)) is None:
        return None
    if router_kind == "vllm" and not (BIN / "vllm-router").exists():
        return None
    cores = sorted(os.sched_getaffinity(0))
    with ExitStack() as stack:
        def spawn(proc):
            stack.callback(lambda: (proc.terminate(), proc.wait(30)))
            return proc
        if single:
            urls = [f"http://127.0.0.1:{args.port}"]
            spawn(start_replica(args.port, len(cores), None, args, []))
        else:
            urls, kv_sources = [], []
            for i in range(2):
                port = args.port + 1 + i
                extra = []
                if name == "vllm-kv":  # topic "": the one vllm-router's static event sources read
                    events = {"enable_kv_cache_events": True, "publisher": "zmq",
                              "endpoint": f"tcp://*:{port + 2000}", "replay_endpoint": f"tcp://*:{port + 2100}"}
                    extra = ["--kv-events-config", json.dumps(events)]
                    kv_sources.append((f"tcp://127.0.0.1:{port + 2000}", f"tcp://127.0.0.1:{port + 2100}"))
                urls.append(f"http://127.0.0.1:{port}")
                spawn(start_replica(port, 1, [cores[i % len(cores)]], args, extra))
        for url in urls:
            wait_ready(f"{url}/health")
        front = urls[0]
        if router_kind is not None:
            front = f"http://127.0.0.1:{args.port + 10}"
            model_dir = args.model or str(ROOT / "fastdeploy_lp" / "default_model")
            spawn(start_router(router_kind, policy, args.port + 10, urls, kv_sources, model_dir))
            wait_ready(f"{front}/v1/models")
            time.sleep(2)  # the router's first health round
        if "prompts" not in prompts_cache:
            prompts_cache["prompts"] = make_prompts(args, urls[0])
        before = prefix_counters(urls)
        ttfts, tokens, elapsed = asyncio.run(load(front, prompts_cache["prompts"], args))
        after = prefix_counters(urls)
    queried = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    served = [a[2] - b[2] for a, b in zip(after, before)]
    ttfts.sort()
    return {"config": name, "hit_rate": hits / queried if queried else 0.0,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "output_tok_s": tokens / elapsed, "elapsed_s": elapsed,
            "max_share": max(served) / sum(served) if sum(served) else 0.0, "served": served}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--groups", type=int, default=20)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument("--configs", nargs="+",
                        default=["single", "sglang-rr", "sglang-cache", "vllm-cache", "vllm-kv"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"# {cpu_header()}")
    print(f"# {args.requests} requests, {args.groups} groups sharing {args.prefix_tokens}-token prefixes, "
          f"{args.output_tokens} output tokens, all at once")
    print(f"{'config':<14}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'out tok/s':>11}{'max share':>11}")
    rows, prompts = [], {}
    for name in args.configs:
        row = run_config(name, args, prompts)
        if row is None:
            print(f"{name:<14}  skipped (router not installed)")
            continue
        rows.append(row)
        print(f"{name:<14}{row['hit_rate']:>9.1%}{row['ttft_p50_s']:>9.2f}s{row['ttft_p99_s']:>9.2f}s"
              f"{row['output_tok_s']:>11.1f}{row['max_share']:>11.0%}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_header(), "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
