"""The engines `bench/throughput.py` compares against, each timed the way the engine is.

Each `*_engine(model_dir, max_batch, max_len)` returns `{name: run}` where
`run(prompts, output_len) -> {"ttft_s", "decode_tok_s"}` (greedy, exactly `output_len` new tokens per
prompt, all prompts submitted together), or None when the peer is not installed. Conversions of the
checkpoint are written beside it once (`<model>-gguf-f32.gguf`, `<model>-ct2-float32/`).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import time

import numpy as np

THREADS = len(os.sched_getaffinity(0))


def transformers_engine(model_dir: str, max_batch: int, max_len: int) -> dict | None:
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

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(prompts: list[list[int]], output_len: int) -> dict:
        ids = torch.tensor(prompts)
        clock = Clock()
        with torch.inference_mode():
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                           eos_token_id=None, max_new_tokens=output_len, min_new_tokens=output_len, streamer=clock)
        first, last = clock.times[1], clock.times[-1]  # times[0]: the prompt
        return {"ttft_s": first - start, "decode_tok_s": len(prompts) * (output_len - 1) / (last - first)}

    return {"transformers float32": run}


def ctranslate2_engine(model_dir: str, max_batch: int, max_len: int) -> dict | None:
    if not (importlib.util.find_spec("ctranslate2") and importlib.util.find_spec("transformers")):
        return None
    import ctranslate2
    from transformers import AutoTokenizer

    out = model_dir.rstrip("/") + "-ct2-float32"
    if not os.path.isfile(os.path.join(out, "model.bin")):
        ctranslate2.converters.TransformersConverter(model_dir).convert(out, quantization="float32", force=True)
    generator = ctranslate2.Generator(out, device="cpu", compute_type="float32", intra_threads=THREADS)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

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

    return {"CTranslate2 float32": run}


def llama_cpp_engine(model_dir: str, max_batch: int, max_len: int) -> dict | None:
    if not importlib.util.find_spec("llama_cpp"):
        return None
    gguf = model_dir.rstrip("/") + "-f32.gguf"
    if not os.path.isfile(gguf):
        script = _gguf_converter()
        if script is None:
            print("llama.cpp: no convert_hf_to_gguf.py found (set LLAMA_CPP_CONVERTER to the one in "
                  "llama-cpp-python's source package, vendor/llama.cpp/)", file=sys.stderr)
            return None
        subprocess.run([sys.executable, "-c", _CONVERT, script, model_dir, "--outtype", "f32", "--outfile", gguf],
                       check=True)
    return {"llama.cpp f32": _LlamaBatch(gguf, max_batch, max_len).run}


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


class _LlamaBatch:
    """Batched greedy decode with llama.cpp's batch API: one sequence id per request, a prompt pass
    per sequence, then one `llama_decode` per step over every sequence's last token."""

    def __init__(self, gguf: str, max_batch: int, max_len: int):
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(gguf, n_ctx=max_len, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
        params = self.llm.context_params  # the high-level object opens one sequence; the batch needs more
        params.n_ctx, params.n_batch, params.n_ubatch = max_batch * max_len, max(512, max_batch), 512
        params.n_seq_max, params.kv_unified = max_batch, True
        self.ctx = llama_cpp.llama_init_from_model(self.llm._model.model, params)
        self.vocab = self.llm.n_vocab()
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
