"""Serving benchmark: the OpenAI-compatible server over HTTP (streaming), with the paged KV cache's
prefix caching and chunked prefill turned on and off in one run.

    python bench/serving.py --json serving.json              # default model, every workload, 4 configs
    python bench/serving.py --quick                          # smoke run: tiny sizes
    python bench/serving.py --model bench/models/qwen2.5-0.5b-random --workloads shared-prefix long-join \\
        --configs cache+chunk:64 no-cache:64 no-chunk --prefix-requests 4 --prefix-rate 0.1 --join-warm 6
    python bench/serving.py --url http://127.0.0.1:8180      # workloads only, on a running server

For every configuration (`--configs`: cache+chunk = the server's defaults, no-cache, no-chunk,
no-cache-no-chunk; `NAME:N` adds `--max-num-batched-tokens N`, e.g. cache+chunk:16) the script
starts `api_server` on a free loopback port, runs the workloads against it, and stops it:

* `random`: Poisson arrivals at each `--rates` (req/s); prompts of random token ids and output
  lengths drawn uniformly from `--prompt-len` / `--output-len` (`/v1/completions`).
* `shared-prefix`: one ~`--prefix-tokens`-token system prompt of tool definitions (JSON function
  schemas) and a distinct short question per request, Poisson arrivals (`/v1/chat/completions`).
* `long-join`: `--join-streams` requests decode steadily, then a `--join-prompt`-token prompt
  arrives; the streams' inter-token gaps while it joins are compared with their gaps before it.

Every request streams with `ignore_eos` and a `max_tokens`, so output lengths are as drawn, and
with a `logit_bias` that keeps greedy output on a few ASCII tokens, so that each token is one
text chunk (`--no-word-bias` drops it). The RNG is seeded: every configuration sees the same
requests. Per configuration and workload it prints TTFT, inter-token latency (ITL: the gaps
between a request's streamed text chunks) and end-to-end latency at p50/p99, throughput, the
prefix-cache hit rate (from `/metrics`, this workload's prompt tokens only) and the peak KV blocks
in use (sampled from `/metrics` every 0.1 s; in MiB when the model's config.json is at hand), then
the two aims: shared-prefix TTFT p50 with caching <= 0.25x without, and, while the long prompt
joins, the running streams' ITL p99 <= 3x their median before it. `--json PATH` writes the same
numbers. A benchmark, not a test: nothing passes or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

logging.getLogger("httpx").setLevel(logging.WARNING)  # importing fastdeploy_lp sets INFO logging

# name -> (prefix caching, chunked prefill)
CONFIGS = {"cache+chunk": (True, True), "no-cache": (False, True), "no-chunk": (True, False),
           "no-cache-no-chunk": (False, False)}
WORKLOADS = ("random", "shared-prefix", "long-join")
TOKEN_IDS = (100, 3000)  # random prompt ids: ordinary tokens in any vocabulary of >= 3,000
TTFT_AIM, JOIN_AIM = 0.25, 3.0


# -- server ---------------------------------------------------------------------------------------

def parse_config(spec: str) -> dict:
    name, _, budget = spec.partition(":")
    if name not in CONFIGS:
        raise SystemExit(f"--configs: unknown {name!r}; known: {', '.join(CONFIGS)} (NAME:N sets the token budget)")
    prefix, chunk = CONFIGS[name]
    flags = [] if prefix else ["--no-enable-prefix-caching"]
    flags += [] if chunk else ["--no-enable-chunked-prefill"]
    if budget:
        flags += ["--max-num-batched-tokens", budget]
    return {"name": spec, "prefix_caching": prefix, "chunked_prefill": chunk,
            "max_num_batched_tokens": int(budget) if budget else None, "flags": flags}


def start_server(args, flags: list[str]) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "fastdeploy_lp.entrypoints.openai.api_server", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
           "--block-size", str(args.block_size), "--log-level", "warning", *flags]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.device:
        cmd += ["--device", args.device]
    log = tempfile.NamedTemporaryFile("w", prefix="bench-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); log: {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not start; log: {log.name}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def kv_block_mib(args) -> float | None:
    """Bytes of one KV block (keys and values of every layer) from the model's config.json, in MiB;
    float32 on CPU, the checkpoint's dtype otherwise. None when the config is not at hand."""
    path = os.path.join(args.model or "", "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    on_cpu = (args.device or "").startswith("cpu") or not args.device and not gpu_present()
    dtype_bytes = 4 if on_cpu or cfg.get("torch_dtype") in (None, "float32") else 2
    return 2 * cfg["num_hidden_layers"] * kv_heads * args.block_size * head_dim * dtype_bytes / 2**20


def gpu_present() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


# -- metrics --------------------------------------------------------------------------------------

async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The unlabelled series of /metrics, by name (`fastdeploy_lp:kv_cache_blocks_in_use`, ...)."""
    out = {}
    for line in (await client.get(url + "/metrics")).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def with_kv_metrics(url: str, workload) -> tuple[object, dict]:
    """Run `workload` (a coroutine) while sampling /metrics; returns its result and the KV numbers:
    prefix-cache hits / queries during it, peak blocks in use, pool size."""
    P = "fastdeploy_lp:"
    async with httpx.AsyncClient(timeout=30) as client:
        before = await scrape(client, url)
        done, peak = asyncio.Event(), [0.0]

        async def sample():
            while not done.is_set():
                peak[0] = max(peak[0], (await scrape(client, url)).get(P + "kv_cache_blocks_in_use", 0.0))
                try:
                    await asyncio.wait_for(done.wait(), 0.1)
                except asyncio.TimeoutError:
                    pass

        sampler = asyncio.create_task(sample())
        try:
            result = await workload
        finally:
            done.set()
            await sampler
        after = await scrape(client, url)
    queries = after.get(P + "prefix_cache_queries_total", 0) - before.get(P + "prefix_cache_queries_total", 0)
    hits = after.get(P + "prefix_cache_hits_total", 0) - before.get(P + "prefix_cache_hits_total", 0)
    kv = {"prefix_hit_rate": round(hits / queries, 3) if queries else 0.0, "kv_blocks_peak": int(peak[0]),
          "kv_blocks_total": int(after.get(P + "kv_cache_blocks_total", 0)),
          "preemptions": int(after.get(P + "num_preemptions_total", 0) - before.get(P + "num_preemptions_total", 0))}
    return result, kv


# -- one streamed request -------------------------------------------------------------------------

def chunk_text(data: dict) -> str:
    choices = data.get("choices") or [{}]
    return choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""


async def stream_request(client: httpx.AsyncClient, url: str, path: str, body: dict,
                         rec: dict | None = None, stop: asyncio.Event | None = None) -> dict:
    """POST one streaming request; `rec` fills in as chunks arrive: `start`, `chunks` (arrival time
    of every non-empty text chunk), `tokens` (usage, else the chunk count), `end`, `error`. The
    stream is closed (the server aborts the request) at the first chunk after `stop` is set."""
    rec = {} if rec is None else rec
    rec.update(start=time.perf_counter(), chunks=[], tokens=0, error=None)
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        rec["error"] = f"stream error: {data['error']}"
                        break
                    if data.get("usage"):
                        rec["tokens"] = data["usage"]["completion_tokens"]
                    if chunk_text(data):
                        rec["chunks"].append(time.perf_counter())
                    if stop is not None and stop.is_set():
                        break
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end"] = time.perf_counter()
    rec["tokens"] = rec["tokens"] or len(rec["chunks"])
    return rec


def completion_body(prompt: list[int], max_tokens: int, extra: dict) -> dict:
    return {"prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **extra}


def chat_body(messages: list[dict], max_tokens: int, extra: dict) -> dict:
    body = completion_body([], max_tokens, extra)
    del body["prompt"]
    return {"messages": messages, **body}


def word_bias(tokenizer) -> dict:
    """`logit_bias` +100 on the tokens of a short ASCII sentence: greedy output then stays on whole
    tokens that decode to text on their own, so every token streams as one chunk (random-weight
    models otherwise emit partial UTF-8 bytes, which the server holds back and sends merged)."""
    if tokenizer is None:
        return {}
    return {"logit_bias": {str(i): 100 for i in sorted(set(tokenizer.encode("the cat sat on a mat")))}}


def new_client(connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4)
    return httpx.AsyncClient(timeout=httpx.Timeout(900, connect=30), limits=limits)


async def run_poisson(url: str, path: str, bodies: list[dict], rate: float, seed: int) -> tuple[list, float]:
    """Send `bodies` with exponential gaps of mean 1/rate (the first at once); all results, wall time."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(bodies))
    offsets = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    async with new_client(len(bodies)) as client:
        t0 = time.perf_counter()

        async def fire(offset: float, body: dict) -> dict:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await stream_request(client, url, path, body)

        results = await asyncio.gather(*(fire(o, b) for o, b in zip(offsets, bodies)))
    return list(results), max(r["end"] for r in results) - t0


# -- workloads ------------------------------------------------------------------------------------

def random_bodies(args, rate_index: int) -> list[dict]:
    rng = np.random.default_rng(args.seed + 1000 * rate_index)
    bodies = []
    for _ in range(args.random_requests):
        n_in = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1)
        n_out = rng.integers(args.output_len[0], args.output_len[1] + 1)
        bodies.append(completion_body(rng.integers(*TOKEN_IDS, n_in).tolist(), n_out, args.extra_body))
    return bodies


TOOLS = [
    ("get_weather", "Current weather and a forecast for a place.",
     {"location": ("string", "City and country, e.g. Paris, France"), "days": ("integer", "Forecast days, 1-10"),
      "unit": ("string", "celsius or fahrenheit")}),
    ("search_flights", "Search scheduled flights between two airports.",
     {"origin": ("string", "IATA code of the departure airport"), "destination": ("string", "IATA code of the "
      "arrival airport"), "date": ("string", "Departure date, YYYY-MM-DD"), "passengers": ("integer", "1-9")}),
    ("book_hotel", "Reserve a hotel room.", {"hotel_id": ("string", "From search_hotels"), "check_in": (
        "string", "YYYY-MM-DD"), "nights": ("integer", "Number of nights"), "guests": ("integer", "Adults")}),
    ("search_hotels", "Find hotels near a place with prices per night.",
     {"near": ("string", "Address or landmark"), "max_price": ("number", "Per night, in EUR"),
      "stars": ("integer", "Minimum star rating, 1-5")}),
    ("convert_currency", "Convert an amount between currencies at today's rate.",
     {"amount": ("number", "The amount"), "from": ("string", "ISO 4217 code"), "to": ("string", "ISO 4217 code")}),
    ("send_email", "Send an email from the user's account.",
     {"to": ("string", "Recipient addresses, comma separated"), "subject": ("string", "Subject line"),
      "body": ("string", "Plain-text body"), "cc": ("string", "Optional copies")}),
    ("create_calendar_event", "Add an event to the user's calendar.",
     {"title": ("string", "Event title"), "start": ("string", "ISO 8601 start time"),
      "duration_minutes": ("integer", "Length"), "attendees": ("string", "Emails, comma separated")}),
    ("translate_text", "Translate text between languages.",
     {"text": ("string", "The text"), "target_language": ("string", "BCP 47 code, e.g. de, ja")}),
    ("get_stock_quote", "Latest price and day range of a listed stock.",
     {"symbol": ("string", "Ticker symbol"), "exchange": ("string", "Exchange code, optional")}),
    ("run_sql_query", "Run a read-only SQL query on the analytics warehouse.",
     {"query": ("string", "One SELECT statement"), "limit": ("integer", "Most rows to return")}),
]
QUESTIONS = ["What's the weather in Lisbon this weekend?", "Find me a flight from Berlin to Rome on Friday.",
             "How much is 250 dollars in yen?", "Book two nights near the Louvre under 200 euros.",
             "Email Sam that the meeting moved to 3pm.", "Translate 'good morning' into Japanese.",
             "What is Apple trading at right now?", "Schedule a 30 minute sync with Ana tomorrow at 10.",
             "How many orders did we ship last week?", "Is it going to rain in Oslo tomorrow?",
             "Find a 4-star hotel in Madrid for three nights.", "Convert 80 pounds to euros.",
             "Cheapest flight from Tokyo to Seoul next Monday?", "Translate this into German: see you soon.",
             "Send the quarterly report to finance.", "What was Nvidia's day range today?"]


def tool_json(name: str, description: str, params: dict) -> str:
    props = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    return json.dumps({"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": list(params)[:2]}}})


def system_prompt(tokenizer, target_tokens: int) -> tuple[str, int]:
    """A tools-style system prompt (JSON function schemas) of about `target_tokens` tokens."""
    head = ("You are the assistant of a travel and office suite. Answer briefly. When a tool can answer, "
            "call it.\n\n# Tools\n\nYou can call these functions, each described as JSON:\n")
    tail = "\nTo call a function, reply only with <function=NAME>{JSON arguments}</function>."
    lines: list[str] = []
    while True:
        name, desc, params = TOOLS[len(lines) % len(TOOLS)]
        round_ = len(lines) // len(TOOLS)
        lines.append(tool_json(f"{name}_v{round_ + 1}" if round_ else name, desc, params))
        text = head + "\n".join(lines) + tail
        n = len(tokenizer.encode(text)) if tokenizer else len(text) // 4
        if n >= target_tokens or len(lines) > 200:
            return text, n


def prefix_bodies(args, system: str) -> list[dict]:
    rng = np.random.default_rng(args.seed + 7)
    bodies = []
    for i in range(args.prefix_requests):
        q = QUESTIONS[i % len(QUESTIONS)] + (f" (request {i})" if i >= len(QUESTIONS) else "")
        messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        bodies.append(chat_body(messages, rng.integers(args.prefix_output[0], args.prefix_output[1] + 1),
                                args.extra_body))
    return bodies


async def wait_until(condition, timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    while not condition():
        if time.perf_counter() > deadline:
            raise TimeoutError("long-join: the running streams stopped making progress")
        await asyncio.sleep(0.005)


async def long_join(url: str, args) -> tuple[list[dict], dict, float, int]:
    """`--join-streams` requests decode; once each has `--join-warm` chunks, one `--join-prompt`-token
    prompt arrives; when it has finished and every stream has `--join-warm` more chunks, the streams
    are closed. Returns the streams' records, the joiner's, the wall time and the joiner's length."""
    rng = np.random.default_rng(args.seed + 99)
    async with httpx.AsyncClient(timeout=30) as c:
        max_len = (await c.get(url + "/v1/models")).json()["data"][0]["max_model_len"]
    join_len = min(args.join_prompt, max_len - args.join_output)
    stream_out = max_len - args.join_stream_prompt - 1  # never finishes before it is closed
    recs: list[dict] = [{} for _ in range(args.join_streams)]
    stop = asyncio.Event()
    async with new_client(args.join_streams + 1) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(stream_request(client, url, "/v1/completions", completion_body(
            rng.integers(*TOKEN_IDS, args.join_stream_prompt).tolist(), stream_out, args.extra_body), rec, stop))
            for rec in recs]

        def progressed(marks: list[int]) -> bool:
            return all(t.done() or len(r.get("chunks", ())) >= m + args.join_warm
                       for r, t, m in zip(recs, tasks, marks))

        await wait_until(lambda: progressed([0] * len(recs)), 600)
        join_ids = rng.integers(*TOKEN_IDS, join_len).tolist()
        joiner = await stream_request(client, url, "/v1/completions", completion_body(
            join_ids, args.join_output, args.extra_body))
        marks = [len(r["chunks"]) for r in recs]
        await wait_until(lambda: progressed(marks), 600)
        stop.set()
        await asyncio.gather(*tasks)
    return recs, joiner, max(r["end"] for r in recs + [joiner]) - t0, join_len


def join_stats(recs: list[dict], joiner: dict, join_len: int) -> dict:
    """The streams' gaps that overlap [joiner sent, its first token] against their gaps before it."""
    sent = joiner["start"]
    first = joiner["chunks"][0] if joiner["chunks"] else joiner["end"]
    steady, during = [], []
    for r in recs:
        for a, b in zip(r["chunks"], r["chunks"][1:]):
            if b <= sent:
                steady.append(b - a)
            elif a < first:
                during.append(b - a)
    med, p99 = pct(steady, 50), pct(during, 99)
    return {"join_prompt_tokens": join_len, "join_ttft_ms": round((first - sent) * 1000, 1),
            "steady_itl_ms_p50": med, "join_itl_ms_p50": pct(during, 50), "join_itl_ms_p99": p99,
            "join_itl_ms_max": pct(during, 100), "join_gaps": len(during),
            "join_ratio": round(p99 / med, 2) if med and p99 else None, "joiner_error": joiner["error"]}


# -- results --------------------------------------------------------------------------------------

def pct(seconds: list[float], q: float) -> float | None:
    return round(float(np.percentile(seconds, q)) * 1000, 1) if len(seconds) else None


def summarize(config: str, workload: str, results: list[dict], wall: float, kv: dict,
              block_mib: float | None) -> dict:
    ok = [r for r in results if not r["error"]]
    ttft = [r["chunks"][0] - r["start"] for r in ok if r["chunks"]]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    e2e = [r["end"] - r["start"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    row = {"config": config, "workload": workload, "requests": len(results), "errors": len(results) - len(ok),
           "wall_s": round(wall, 2), "req_per_s": round(len(ok) / wall, 2), "out_tok_per_s": round(tokens / wall, 1),
           "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99), "itl_ms_p50": pct(itl, 50),
           "itl_ms_p99": pct(itl, 99), "e2e_ms_p50": pct(e2e, 50), "e2e_ms_p99": pct(e2e, 99), **kv,
           "out_tokens": tokens, "text_chunks": sum(len(r["chunks"]) for r in ok),
           "kv_mib_peak": round(kv["kv_blocks_peak"] * block_mib, 1) if block_mib else None}
    if len(ok) < len(results):
        row["first_error"] = next(r["error"] for r in results if r["error"])
    return row


ROW_COLUMNS = [("config", "config"), ("workload", "workload"), ("requests", "reqs"), ("errors", "err"),
               ("req_per_s", "req/s"), ("out_tok_per_s", "out tok/s"), ("ttft_ms_p50", "TTFT p50 ms"),
               ("ttft_ms_p99", "TTFT p99 ms"), ("itl_ms_p50", "ITL p50 ms"), ("itl_ms_p99", "ITL p99 ms"),
               ("e2e_ms_p50", "E2E p50 ms"), ("e2e_ms_p99", "E2E p99 ms"), ("prefix_hit_rate", "prefix hit"),
               ("kv_blocks_peak", "KV blocks peak"), ("kv_blocks_total", "KV blocks total"),
               ("kv_mib_peak", "KV MiB peak"), ("preemptions", "preempt")]
JOIN_COLUMNS = [("config", "config"), ("join_prompt_tokens", "join prompt"), ("join_ttft_ms", "join TTFT ms"),
                ("steady_itl_ms_p50", "ITL before, p50 ms"), ("join_itl_ms_p50", "ITL during, p50 ms"),
                ("join_itl_ms_p99", "ITL during, p99 ms"), ("join_itl_ms_max", "max ms"), ("join_gaps", "gaps"),
                ("join_ratio", "p99 / p50 before")]


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """A Markdown table (pastes into docs/benchmarks.md as it is)."""
    cells = [[("-" if r.get(k) is None else str(r[k])) for k, _ in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h) in enumerate(columns)]
    print("| " + " | ".join(h.ljust(w) for (_, h), w in zip(columns, widths)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" if i > 1 else "-" * (w + 2) for i, w in enumerate(widths)) + "|")
    for c in cells:
        print("| " + " | ".join(x.rjust(w) if i > 1 else x.ljust(w) for i, (x, w) in enumerate(zip(c, widths))) + " |")


def aims(rows: list[dict], joins: list[dict], configs: list[dict]) -> list[dict]:
    """Shared-prefix TTFT p50 of each caching-on config over the caching-off config with the same
    chunking and token budget (when one ran), and every long join's ratio."""
    out = []
    ttft = {r["config"]: r["ttft_ms_p50"] for r in rows if r["workload"].startswith("shared-prefix") and r["ttft_ms_p50"]}
    for c in configs:
        base = next((b["name"] for b in configs if b["prefix_caching"] is False and b["name"] in ttft
                     and (b["chunked_prefill"], b["max_num_batched_tokens"]) ==
                     (c["chunked_prefill"], c["max_num_batched_tokens"])), None)
        if c["prefix_caching"] and c["name"] in ttft and base:
            ratio = round(ttft[c["name"]] / ttft[base], 3)
            out.append({"aim": f"shared-prefix TTFT p50, caching on / off <= {TTFT_AIM}",
                        "configs": f"{c['name']} / {base}", "value": ratio, "met": ratio <= TTFT_AIM})
    for j in joins:
        if j["join_ratio"] is not None:
            out.append({"aim": f"long join: streams' ITL p99 while it joins / their p50 before <= {JOIN_AIM}",
                        "configs": j["config"], "value": j["join_ratio"], "met": j["join_ratio"] <= JOIN_AIM})
    return out


# -- one configuration ----------------------------------------------------------------------------

async def warm_up(url: str, extra: dict) -> None:
    async with new_client(1) as client:
        for path, body in (("/v1/completions", completion_body([7] * 4, 2, extra)),
                           ("/v1/chat/completions", chat_body([{"role": "user", "content": "Hi"}], 2, extra))):
            rec = await stream_request(client, url, path, body)
            if rec["error"]:
                raise SystemExit(f"warm-up {path} failed: {rec['error']}")


async def run_workloads(url: str, args, config: str, system: str, block_mib: float | None):
    """Every selected workload against one server: (table rows, long-join stats)."""
    rows, joins = [], []
    await warm_up(url, args.extra_body)
    if "random" in args.workloads:
        for i, rate in enumerate(args.rates):
            (res, wall), kv = await with_kv_metrics(url, run_poisson(
                url, "/v1/completions", random_bodies(args, i), rate, args.seed + i))
            rows.append(summarize(config, f"random {rate:g}/s", res, wall, kv, block_mib))
            log(f"{config}: random {rate:g}/s done in {wall:.1f} s")
    if "shared-prefix" in args.workloads:
        (res, wall), kv = await with_kv_metrics(url, run_poisson(
            url, "/v1/chat/completions", prefix_bodies(args, system), args.prefix_rate, args.seed + 50))
        rows.append(summarize(config, f"shared-prefix {args.prefix_rate:g}/s", res, wall, kv, block_mib))
        log(f"{config}: shared-prefix done in {wall:.1f} s")
    if "long-join" in args.workloads:
        (recs, joiner, wall, join_len), kv = await with_kv_metrics(url, long_join(url, args))
        rows.append(summarize(config, "long-join", recs + [joiner], wall, kv, block_mib))
        joins.append({"config": config, **join_stats(recs, joiner, join_len)})
        log(f"{config}: long-join done in {wall:.1f} s")
    return rows, joins


def log(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


# -- command line ---------------------------------------------------------------------------------

QUICK = {"rates": [4.0], "random_requests": 4, "prompt_len": [16, 64], "output_len": [4, 16],
         "prefix_tokens": 300, "prefix_requests": 4, "prefix_rate": 4.0, "prefix_output": [4, 8],
         "join_streams": 2, "join_prompt": 300, "join_warm": 5}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default=None, help="Model for the started servers (default: the built-in model); with --url, "
                                    "only its tokenizer and config.json are read.")
    a("--url", default=None, help="Run the workloads on this running server instead of starting servers.")
    a("--configs", nargs="+", default=["cache+chunk", "cache+chunk:16", "no-cache", "no-chunk"], metavar="NAME[:N]",
      help=f"Server configurations, one server each: {', '.join(CONFIGS)}; ':N' adds --max-num-batched-tokens N.")
    a("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    a("--quick", action="store_true", help="Tiny sizes for a smoke run (overrides the size flags).")
    a("--max-num-seqs", type=int, default=8)
    a("--max-model-len", type=int, default=None)
    a("--block-size", type=int, default=16)
    a("--device", default=None)
    a("--seed", type=int, default=0)
    a("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="random: Poisson arrival rates, req/s.")
    a("--random-requests", type=int, default=20, help="random: requests per rate.")
    a("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    a("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    a("--prefix-tokens", type=int, default=1000, help="shared-prefix: system prompt length, tokens.")
    a("--prefix-requests", type=int, default=16)
    a("--prefix-rate", type=float, default=2.0, help="shared-prefix: Poisson arrival rate, req/s.")
    a("--prefix-output", type=int, nargs=2, default=[16, 48], metavar=("MIN", "MAX"))
    a("--join-streams", type=int, default=4, help="long-join: requests decoding when the long prompt arrives.")
    a("--join-stream-prompt", type=int, default=32)
    a("--join-prompt", type=int, default=2000, help="long-join: the joining prompt (capped by max_model_len).")
    a("--join-output", type=int, default=8)
    a("--join-warm", type=int, default=20, help="long-join: stream chunks before the join and after it.")
    a("--no-word-bias", dest="word_bias", action="store_false",
      help="Do not send the logit_bias that keeps every output token a chunk of its own (see word_bias).")
    a("--json", default=None, help="Also write the results to this file.")
    args = p.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.model is None:
        from fastdeploy_lp.config import default_model_path

        args.model = default_model_path()
    return args


def load_tokenizer(model: str):
    try:
        from fastdeploy_lp.tokenizer import Tokenizer

        return Tokenizer(model)
    except Exception as e:  # a --url server with no local model: estimate 4 characters a token
        log(f"no tokenizer for {model!r} ({e}); sizing the system prompt at 4 characters a token")
        return None


def main() -> None:
    args = parse_args()
    args.load_avg_start = os.getloadavg()
    configs = [{"name": "url", "prefix_caching": None, "chunked_prefill": None, "max_num_batched_tokens": None,
                "flags": []}] if args.url else \
        [parse_config(spec) for spec in args.configs]
    tokenizer = load_tokenizer(args.model)
    system, system_tokens = system_prompt(tokenizer, args.prefix_tokens)
    args.extra_body = word_bias(tokenizer) if args.word_bias else {}
    block_mib = kv_block_mib(args)
    rows, joins = [], []
    for config in configs:
        proc, url = None, args.url
        if url is None:
            proc, url, server_log = start_server(args, config["flags"])
            log(f"{config['name']}: server on {url} ({' '.join(config['flags']) or 'defaults'}), log {server_log}")
        try:
            r, j = asyncio.run(run_workloads(url, args, config["name"], system, block_mib))
        finally:
            if proc is not None:
                stop_server(proc)
        rows += r
        joins += j
    report_out(args, configs, rows, joins, system_tokens, block_mib)


def report_out(args, configs, rows, joins, system_tokens: int, block_mib: float | None) -> None:
    print_table(rows, ROW_COLUMNS)
    if joins:
        print()
        print_table(joins, JOIN_COLUMNS)
    results = aims(rows, joins, configs)
    print()
    for a in results:
        print(f"aim {'met' if a['met'] else 'NOT met'}: {a['aim']}: {a['configs']} = {a['value']}")
    for r in rows:
        if r.get("first_error"):
            print(f"errors in {r['config']} / {r['workload']}: {r['errors']}, first: {r['first_error']}")
    sizes = {k: getattr(args, k) for k in ("max_num_seqs", "block_size", "seed", "rates", "random_requests",
                                            "prompt_len", "output_len", "prefix_tokens", "prefix_requests",
                                            "prefix_rate", "prefix_output", "join_streams", "join_stream_prompt",
                                            "join_prompt", "join_output", "join_warm")}
    report = {"benchmark": "serving", "model": args.model if args.url is None else f"{args.url} ({args.model})",
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_avg_start": args.load_avg_start,
              "load_avg_end": os.getloadavg(),
              "system_prompt_tokens": system_tokens, "kv_block_mib": block_mib, **sizes,
              "configs": [{k: v for k, v in c.items() if k != "flags"} | {"flags": c["flags"]} for c in configs],
              "results": rows, "long_join": joins, "aims": results}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
