"""lm-evaluation-harness against the server: `local-completions` scores equal lm-eval's own `hf` backend.

    pip install 'lm_eval[api]' torch transformers accelerate    # into a separate venv, e.g. /tmp/ref
    python bench/lm_eval_check.py --lm-eval-python /tmp/ref/bin/python [--model DIR] [--json out.json]
    python bench/lm_eval_check.py --lm-eval-python /tmp/ref/bin/python --hf-dtype float32,float64

Writes two local tasks and their documents (JSONL, nothing from the Hub) into a temporary directory:
`fdlp_mc`, multiple choice ("The capital of Chad is" + four capitals from `train/data/countries.json`,
`acc` and `acc_norm`), and `fdlp_ppl`, a `loglikelihood_rolling` perplexity task over short
declarative texts. Then runs `lm_eval` twice on them with `--log_samples`:

    local-completions   this server (`--model DIR`, one started here) on /v1/completions; lm-eval
                        tokenizes with the model's Hugging Face tokenizer and sends token ids, `echo`,
                        `logprobs: 1`, `max_tokens: 1`, `--batch-size` prompts a request
    hf                  transformers on the same directory, once per `--hf-dtype` (float32; add
                        float64 for the exact value the float32 runs round)

and compares every document's scores: each choice's loglikelihood and is_greedy (fdlp_mc) and each
text's total loglikelihood (fdlp_ppl). Exits 1 when a value differs by more than `--atol` (1e-4) or an
is_greedy differs, against any of the hf runs. `--untokenized` sends text instead
(`tokenized_requests=False`): the server then tokenizes with its own tokenizer, which must split the
text as transformers' does for the context lengths lm-eval computes to fall on the same tokens (true
of SmolLM2's `tokenizer.json`, not of the built-in model's `tokenizer.model`, to which transformers 5
adds a prefix space: docs/benchmarks.md).

The CPU model and its AVX-512 features are printed in the header: write them beside the numbers.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from routers import cpu_header, wait_ready  # noqa: E402  (bench/ is sys.path[0])

ROOT = Path(__file__).resolve().parent.parent
SERVED = "fdlp-lm-eval"
TASKS = ("fdlp_mc", "fdlp_ppl")

MC_YAML = """task: fdlp_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""

PPL_YAML = """task: fdlp_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def write_tasks(root: Path, docs: int, seed: int) -> None:
    """`docs` multiple-choice documents and `docs // 2` perplexity texts, with their task YAMLs."""
    with open(ROOT / "train" / "data" / "countries.json", encoding="utf-8") as f:
        countries = json.load(f)["countries"]
    rng = random.Random(seed)
    picked = rng.sample(countries, docs)
    with open(root / "mc.jsonl", "w", encoding="utf-8") as f:
        for c in picked:
            wrong = rng.sample([o["capital"] for o in countries if o["name"] != c["name"]], 3)
            answer = rng.randrange(4)
            choices = wrong[:answer] + [c["capital"]] + wrong[answer:]
            f.write(json.dumps({"question": f"The capital of {c['name']} is", "choices": choices,
                                "answer": answer}) + "\n")
    with open(root / "ppl.jsonl", "w", encoding="utf-8") as f:
        for c in picked[:docs // 2]:
            text = (f"{c['capital']} is the capital of {c['name']}, a country in {c['continent']}. About "
                    f"{c['population']:,} people live in {c['name']}, and {c['capital_population']:,} in its capital.")
            f.write(json.dumps({"text": text}) + "\n")
    (root / "fdlp_mc.yaml").write_text(MC_YAML.format(data=root / "mc.jsonl"))
    (root / "fdlp_ppl.yaml").write_text(PPL_YAML.format(data=root / "ppl.jsonl"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, threads: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fastdeploy_lp.entrypoints.openai.api_server", "--host", "127.0.0.1",
           "--port", str(port), "--model", model, "--served-model-name", SERVED, "--cpu-threads", str(threads)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def run_lm_eval(args, root: Path, backend: str, model_args: str, out: Path) -> float:
    """One `lm_eval run` over both tasks; its samples land under `out`. Returns its wall time."""
    cmd = [args.lm_eval_python, "-m", "lm_eval", "run", "--model", backend, "--model_args", model_args,
           "--tasks", *TASKS, "--include_path", str(root), "--batch_size", str(args.batch_size),
           "--log_samples", "--output_path", str(out), "--seed", "1234"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    with open(root / f"{backend}.log", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"lm_eval --model {backend} failed ({rc}); the last lines of {root / f'{backend}.log'}:\n"
                 + "".join(open(root / f"{backend}.log").readlines()[-30:]))
    return time.perf_counter() - start


def run_server_backend(args, root: Path) -> float:
    """`local-completions` against a server started on `--model`, stopped afterwards."""
    port = args.port or free_port()
    with open(root / "server.log", "w") as log:
        server = start_server(args.model, port, args.threads, log)
        try:
            wait_ready(f"http://127.0.0.1:{port}/health", timeout=300)
            model_args = (f"model={SERVED},base_url=http://127.0.0.1:{port}/v1/completions,"
                          f"tokenizer_backend=huggingface,tokenizer={args.model},max_retries=1,"
                          f"tokenized_requests={not args.untokenized}")
            return run_lm_eval(args, root, "local-completions", model_args, root / "out-server")
        finally:
            server.terminate()
            server.wait(timeout=60)


def load_samples(out: Path, task: str) -> dict[int, dict]:
    """lm-eval's `samples_<task>_*.jsonl` under `out`, by doc_id."""
    files = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    if len(files) != 1:
        sys.exit(f"expected one samples file for {task} under {out}, found {files}")
    with open(files[0], encoding="utf-8") as f:
        return {s["doc_id"]: s for s in map(json.loads, f)}


def scores(sample: dict) -> list[tuple[float, bool | None]]:
    """(loglikelihood, is_greedy) per request of a sample: one per choice, or one rolling total (None)."""
    out = []
    for resp in sample["filtered_resps"]:
        if isinstance(resp, (list, tuple)):
            out.append((float(resp[0]), resp[1] in (True, "True")))
        else:
            out.append((float(resp), None))
    return out


def compare(server: dict[int, dict], hf: dict[int, dict], metric: str) -> dict:
    """Per task: documents, values compared, max |difference|, is_greedy disagreements, `metric` means."""
    if server.keys() != hf.keys():
        sys.exit(f"documents differ: {sorted(server.keys() ^ hf.keys())}")
    diff, values, greedy = 0.0, 0, 0
    for doc_id in server:
        a, b = scores(server[doc_id]), scores(hf[doc_id])
        if len(a) != len(b):
            sys.exit(f"doc {doc_id}: {len(a)} scores from the server, {len(b)} from hf")
        for (va, ga), (vb, gb) in zip(a, b):
            diff, values, greedy = max(diff, abs(va - vb)), values + 1, greedy + (ga != gb)
    mean = (lambda s: sum(float(x[metric]) for x in s.values()) / len(s)) if metric else (lambda s: None)
    return {"documents": len(server), "values": values, "max_abs_diff": diff, "greedy_mismatches": greedy,
            "metric": metric, "server": mean(server), "hf": mean(hf)}


def print_table(rows: dict[str, dict], atol: float) -> None:
    print(f"{'task':<10} {'hf dtype':>8} {'docs':>5} {'values':>7} {'max |diff|':>11} {'greedy !=':>9} "
          f"{'metric':>8} {'server':>8} {'hf':>8}  ok")
    for r in rows.values():
        fmt = (lambda v: f"{v:8.4f}") if r["metric"] else (lambda v: f"{'-':>8}")
        ok = r["max_abs_diff"] <= atol and not r["greedy_mismatches"]
        print(f"{r['task']:<10} {r['hf_dtype']:>8} {r['documents']:>5} {r['values']:>7} {r['max_abs_diff']:>11.2e} "
              f"{r['greedy_mismatches']:>9} {r['metric'] or '-':>8} {fmt(r['server'])} {fmt(r['hf'])}  "
              f"{'yes' if ok else 'NO'}")


def run_all(args, root: Path) -> tuple[dict, dict]:
    """Both backends on the tasks written under `root`: (rows by "task hf-dtype", wall times)."""
    write_tasks(root, args.docs, args.seed)
    times = {"local-completions": run_server_backend(args, root)}
    rows = {}
    for dtype in args.hf_dtype.split(","):
        out = root / f"out-hf-{dtype}"
        times[f"hf {dtype}"] = run_lm_eval(args, root, "hf", f"pretrained={args.model},dtype={dtype}", out)
        for task in TASKS:
            rows[f"{task} {dtype}"] = {"task": task, "hf_dtype": dtype, **compare(
                load_samples(root / "out-server", task), load_samples(out, task), "acc" if task == "fdlp_mc" else None)}
    return rows, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm-eval-python", required=True, help="a Python with lm_eval[api], torch, transformers")
    parser.add_argument("--model", default=str(ROOT / "fastdeploy_lp" / "default_model"),
                        help="a Hugging Face safetensors directory (default: the built-in model)")
    parser.add_argument("--hf-dtype", default="float32", help="the hf backend's dtypes, comma-separated")
    parser.add_argument("--docs", type=int, default=30, help="multiple-choice documents (half as many texts)")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per request / per hf batch")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of the server and of torch")
    parser.add_argument("--untokenized", action="store_true", help="tokenized_requests=False: send text")
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="write the tasks, logs and lm-eval outputs here, and keep them")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    args.model = str(Path(args.model).resolve())
    with tempfile.TemporaryDirectory(prefix="fdlp-lm-eval-") as tmp:
        root = Path(args.keep).resolve() if args.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        rows, times = run_all(args, root)
    print(f"# {cpu_header()}\n# model {args.model}, lm-eval batch {args.batch_size}, "
          f"tokenized_requests={not args.untokenized}, wall s: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    print_table(rows, args.atol)
    result = {"model": args.model, "cpu": cpu_header(), "tokenized_requests": not args.untokenized,
              "batch_size": args.batch_size, "atol": args.atol, "wall_s": times, "rows": list(rows.values()),
              "max_abs_diff": max(r["max_abs_diff"] for r in rows.values()),
              "documents": sum(r["documents"] for r in rows.values() if r["hf_dtype"] == args.hf_dtype.split(",")[0])}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    agree = result["max_abs_diff"] <= args.atol and not any(r["greedy_mismatches"] for r in rows.values())
    sys.exit(0 if agree else 1)


if __name__ == "__main__":
    main()
