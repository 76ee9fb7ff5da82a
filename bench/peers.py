"""The engines `bench/throughput.py` compares against, each timed the way the engine is, in the
weight format matching each of fastdeploy_lp's.

Each `*_engine(model_dir, max_batch, max_len, formats)` returns one `Peer` per fastdeploy_lp weight
format in `formats` (`float32`, `bfloat16`, `float16`, `wint8`): `run(prompts, output_len) ->
{"ttft_s", "decode_tok_s"}` (greedy, exactly `output_len` new tokens per prompt, all prompts
submitted together), or a `skipped` reason where the peer has no such format on this CPU; None when
the peer is not installed. Conversions of the checkpoint are written beside it once
(`<model>-f32.gguf`, `<model>-q8_0.gguf`, `<model>-ct2-int8/`, ...).
"""

from __future__ import annotations

import glob
import json
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

THREADS = len(os.sched_getaffinity(0))


@dataclass
class Peer:
    name: str  # engine and its own name for the format: "llama.cpp q8_0"
    weights: str  # the fastdeploy_lp format it is paired with: "wint8"
    run: Callable | None = None
    skipped: str | None = None


def _convert_once(out: str, convert: Callable[[str], None]) -> str:
    """`convert(path)` writes a conversion; it goes to a temporary name first so that an interrupted
    run does not leave a truncated file that the next run takes as cached."""
    if not os.path.exists(out):
        partial = out + ".partial"
        convert(partial)
        os.replace(partial, out)
    return out


def transformers_engine(model_dir: str, max_batch: int, max_len: int, formats: list[str]) -> list[Peer] | None:
    if not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")):
        return None
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """generate() hands the prompt, then each step's tokens, to its streamer: their times."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def runner(dtype):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

        def run(prompts: list[list[int]], output_len: int) -> dict:
            ids = torch.tensor(prompts)
            clock = Clock()
            with torch.inference_mode():
                start = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                               eos_token_id=None, max_new_tokens=output_len, min_new_tokens=output_len,
                               streamer=clock)
            first, last = clock.times[1], clock.times[-1]  # times[0]: the prompt
            return {"ttft_s": first - start, "decode_tok_s": len(prompts) * (output_len - 1) / (last - first)}

        return run

    peers = []
    for weights in formats:
        if weights in ("wint8", "wint4"):
            # Its quantizers (bitsandbytes, torchao, ...) are separate packages, and torch's own dynamic
            # quantization also quantizes activations: neither is the model as transformers runs it.
            peers.append(Peer(f"transformers {weights.removeprefix('w')}", weights,
                              skipped="no int8 weights of its own on CPU (its quantizers are separate packages)"))
        else:
            peers.append(Peer(f"transformers {weights}", weights, runner(getattr(torch, weights))))
    return peers


CT2_TYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "wint8": "int8"}


def ctranslate2_engine(model_dir: str, max_batch: int, max_len: int, formats: list[str]) -> list[Peer] | None:
    if not (importlib.util.find_spec("ctranslate2") and importlib.util.find_spec("transformers")):
        return None
    import ctranslate2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    supported = ctranslate2.get_supported_compute_types("cpu")

    def runner(ct2_type: str):
        out = _convert_once(model_dir.rstrip("/") + f"-ct2-{ct2_type}", lambda path: ctranslate2.converters.
                            TransformersConverter(model_dir).convert(path, quantization=ct2_type, force=True))
        generator = ctranslate2.Generator(out, device="cpu", compute_type=ct2_type, intra_threads=THREADS)

        def generate(tokens: list[list[str]], length: int) -> float:
            start = time.perf_counter()
            generator.generate_batch(tokens, max_length=length, min_length=length, sampling_topk=1,
                                     include_prompt_in_result=False, end_token=[])
            return time.perf_counter() - start

        def run(prompts: list[list[int]], output_len: int) -> dict:
            tokens = [tokenizer.convert_ids_to_tokens(p) for p in prompts]
            first = generate(tokens, 1)  # no per-token stream for a batch: a one-token run is the TTFT
            full = generate(tokens, output_len)
            return {"ttft_s": first, "decode_tok_s": len(prompts) * (output_len - 1) / max(full - first, 1e-9)}

        return run

    peers = []
    for weights in formats:
        ct2_type = CT2_TYPES.get(weights)
        if ct2_type is None:
            peers.append(Peer(f"CTranslate2 {weights}", weights, skipped="no 4-bit weights on CPU"))
            continue
        name = f"CTranslate2 {ct2_type}"
        # Asked for a compute type the CPU build lacks, CTranslate2 refuses it; computing in another
        # type instead would time a different format under this one's name.
        if ct2_type in supported:
            peers.append(Peer(name, weights, runner(ct2_type)))
        else:
            peers.append(Peer(name, weights, skipped=f"no {ct2_type} compute on this CPU "
                                                     f"(has {', '.join(sorted(supported))})"))
    return peers


GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "wint8": "q8_0", "wint4": "q4_0"}


def llama_cpp_engine(model_dir: str, max_batch: int, max_len: int, formats: list[str]) -> list[Peer] | None:
    if not importlib.util.find_spec("llama_cpp"):
        return None
    peers = []
    for weights in formats:
        outtype = GGUF_TYPES[weights]
        gguf = model_dir.rstrip("/") + f"-{outtype}.gguf"
        script = _gguf_converter()
        if not os.path.isfile(gguf) and script is None:
            peers.append(Peer(f"llama.cpp {outtype}", weights, skipped="no GGUF and no convert_hf_to_gguf.py "
                              "(set LLAMA_CPP_CONVERTER to llama-cpp-python's sdist vendor/llama.cpp/ one)"))
            continue
        _convert_once(gguf, lambda path: subprocess.run(
            [sys.executable, "-c", _CONVERT, script, model_dir, "--outtype", outtype, "--outfile", path], check=True))
        # On a CPU with AMX (Xeon, llama-cpp-python 0.3.36) `llama_decode` segfaults on a q8_0 model
        # whose weights sit in llama.cpp's extra buffer types (AMX or CPU_REPACK), so there it keeps
        # them in plain CPU buffers, and the row says so.
        extra = outtype != "q8_0" or not _has_amx()
        name = f"llama.cpp {outtype}" + ("" if extra else " (no repack: AMX CPU)")
        peers.append(Peer(name, weights, _LlamaBatch(gguf, max_batch, max_len, extra).run))
    return peers


def _has_amx() -> bool:
    import llama_cpp

    return "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode()


# llama.cpp's converter names the pre-tokenizer by hashing the tokenizer's output, and refuses one
# it does not know, as the bench model's synthetic BPE is: it is a Qwen2-style byte-level BPE, so
# it is declared as such (decode speed does not depend on it).
_CONVERT = """
import os, runpy, sys
script = sys.argv[1]
sys.path[:0] = [os.path.dirname(script), os.path.join(os.path.dirname(script), "gguf-py")]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def _gguf_converter() -> str | None:
    path = os.environ.get("LLAMA_CPP_CONVERTER")
    if path:
        return path
    found = glob.glob(os.path.join(os.path.dirname(__file__), "..", "**", "convert_hf_to_gguf.py"), recursive=True)
    return found[0] if found else None


def llama_cpp_on_gguf(path: str, weights: str, max_batch: int, max_len: int) -> Peer | None:
    """llama.cpp on a GGUF file as it is (`bench/throughput.py --gguf`): the same bytes both engines read."""
    if not importlib.util.find_spec("llama_cpp"):
        return None
    return Peer(f"llama.cpp {weights}", weights, _LlamaBatch(path, max_batch, max_len).run)


class _LlamaBatch:
    """Batched greedy decode with llama.cpp's batch API: one sequence id per request, a prompt pass
    per sequence, then one `llama_decode` per step over every sequence's last token.

    In the settings `llama-server` runs with by default (llama.cpp's context defaults): flash
    attention `auto` (on for the CPU), a KV cache per sequence (not one unified cache), batches of
    2048 and micro-batches of 512 tokens. The earlier unified cache with flash attention off cost it
    ~22% at batch 8."""

    def __init__(self, gguf: str, max_batch: int, max_len: int, extra_bufts: bool = True):
        import llama_cpp
        from llama_cpp._logger import set_verbose

        self.lib = llama_cpp
        set_verbose(False)
        model_params = llama_cpp.llama_model_default_params()
        model_params.use_extra_bufts = extra_bufts
        self.model = llama_cpp.llama_model_load_from_file(gguf.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max = max_batch * max_len, max_batch
        params.n_threads = params.n_threads_batch = THREADS
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(max(512, max_batch), 0, max_batch)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,))
        return int(logits.argmax())

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        last, first_times = [], []
        for s, prompt in enumerate(prompts):
            for a in range(0, len(prompt), 512):
                chunk = prompt[a:a + 512]
                self._decode([(t, a + j, s, a + j == len(prompt) - 1) for j, t in enumerate(chunk)])
            last.append(self._argmax(len(prompt) - 1 - (len(prompt) - 1) // 512 * 512))
            first_times.append(time.perf_counter() - start)
        decode_start = time.perf_counter()
        for step in range(1, output_len):
            self._decode([(last[s], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
            last = [self._argmax(s) for s in range(len(prompts))]
        decode = time.perf_counter() - decode_start
        return {"ttft_s": float(np.mean(first_times)), "decode_tok_s": len(prompts) * (output_len - 1) / decode}


VLLM_DTYPES = ("float32", "bfloat16", "float16")  # fastdeploy_lp's names are vLLM's


def vllm_cpu_engine(python: str | None, model_dir: str, max_batch: int, max_len: int,
                    formats: list[str]) -> list[Peer] | None:
    """vLLM's CPU backend in its own environment (`python`: that environment's interpreter; see
    `bench/vllm_worker.py`), one worker process per format, started at its first run and kept."""
    if not python or not os.path.exists(python):
        return None
    peers = []
    for weights in formats:
        if weights not in VLLM_DTYPES:
            peers.append(Peer("vLLM CPU", weights, skipped="vLLM quantizes only pre-quantized checkpoints "
                              "(AWQ, GPTQ, compressed-tensors), not at load"))
            continue
        peers.append(Peer(f"vLLM CPU {weights}", weights, _VllmWorker(python, model_dir, weights, max_batch, max_len).run))
    return peers


class _VllmWorker:
    def __init__(self, python: str, model_dir: str, dtype: str, max_batch: int, max_len: int):
        self.command = [python, os.path.join(os.path.dirname(__file__), "vllm_worker.py"), "--model", model_dir,
                        "--dtype", dtype, "--max-num-seqs", str(max_batch), "--max-model-len", str(max_len)]
        self.process: subprocess.Popen | None = None

    def _start(self) -> None:
        env = dict(os.environ)
        # vLLM's CPU guide: Intel's OpenMP and TCMalloc preloaded (libiomp5 ships with its intel-openmp).
        prefix = os.path.dirname(os.path.dirname(self.command[0]))
        preload = glob.glob(os.path.join(prefix, "lib", "libiomp5.so"))
        preload += [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",) if os.path.exists(p)]
        env["LD_PRELOAD"] = ":".join(preload + [env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else preload)
        env.pop("OMP_NUM_THREADS", None)  # paddle sets 1 on import; vLLM binds its own threads
        self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        ready = self.process.stdout.readline()
        if not ready:
            raise RuntimeError(f"vLLM worker exited before it was ready: {' '.join(self.command)}")

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        if self.process is None:
            self._start()
        self.process.stdin.write(json.dumps({"prompts": prompts, "output_len": output_len}) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError("the vLLM worker exited; its log is above")
        return json.loads(answer)
