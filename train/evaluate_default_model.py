"""Held-out evaluation of the default model (or any model trained by `train_default_model.py`).

    PYTHONPATH=. python train/evaluate_default_model.py [--model DIR] [--backend reference|engine]

Sets come from `build_corpus.build_heldout` (see its docstring for what is held out):

- capital exact match: the greedy answer equals "The capital of X is Y." (`contains` counts an
  answer that names the right city at all), for unseen countries and for unseen wordings, plus a
  sample of training questions for reference;
- JSON: the greedy answer to "... Answer in JSON." parses as a JSON object with the keys `name`,
  `country`, `population`, and `name` is the right city (no constrained decoding);
- sentiment accuracy on reviews built from phrases never seen in training;
- tool calls: with the weather and date tools offered, "What's the weather in X?" must give
  exactly `<function=get_weather>{"city": "X"}</function>`, for cities used in training and for
  cities that never appear in the corpus;
- perplexity of held-out plain text (an unseen sentence pattern) and of the reference answers of
  the held-out capital questions given their prompts.

Answers are greedy, through the chat template with thinking off. `--backend reference` decodes
with `DecoderForCausalLM.full_logits` (no engine involved); `--backend engine` uses
`fastdeploy_lp.LLM`. Perplexity always uses the reference path. Prints a table, then the same
numbers as one JSON object (also written to `--json-out`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import paddle

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from build_corpus import (CAPITAL_QUESTIONS, DATE_TOOL, EXTRA_CITIES, HELDOUT_CITIES, WEATHER_TOOL,  # noqa: E402
                          build_corpus, capital_answer, the)
from train_default_model import ChatTokenizer, greedy  # noqa: E402

from fastdeploy_lp.config import ModelConfig, default_model_path  # noqa: E402
from fastdeploy_lp.model import load_model  # noqa: E402


class ReferenceBackend:
    def __init__(self, model, tok: ChatTokenizer):
        self.model, self.tok = model, tok

    def answers(self, questions: list[str], max_tokens: int, tools: list | None = None) -> list[str]:
        return [self.tok.decode(greedy(self.model, self.tok.chat_ids([{"role": "user", "content": q}], tools),
                                       self.tok.eos_ids, max_tokens)) for q in questions]


class EngineBackend:
    def __init__(self, model_dir: str):
        from fastdeploy_lp import LLM, SamplingParams

        self.llm = LLM(model=model_dir, device="cpu")
        self.params = SamplingParams

    def answers(self, questions: list[str], max_tokens: int, tools: list | None = None) -> list[str]:
        conversations = [[{"role": "user", "content": q}] for q in questions]
        outs = self.llm.chat(conversations, self.params(temperature=0, max_tokens=max_tokens), use_tqdm=False,
                             tools=tools)
        return [o.outputs.text for o in outs]


@paddle.no_grad()
def nll(model, ids: list[int], weights: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of the weighted tokens, and their count."""
    logp = paddle.nn.functional.log_softmax(model.full_logits(ids[:-1]), axis=-1).numpy()
    total, count = 0.0, 0
    for pos, (token, w) in enumerate(zip(ids[1:], weights[1:])):
        if w:
            total -= float(logp[pos, token])
            count += 1
    return total, count


def perplexity(model, pairs) -> float:
    total = count = 0
    for ids, weights in pairs:
        t, n = nll(model, ids, weights)
        total, count = total + t, count + n
    return math.exp(total / max(count, 1))


def capital_scores(items: list[dict], answers: list[str]) -> dict:
    exact = sum(a.strip() == it["expected"] for it, a in zip(items, answers))
    contains = sum(it["capital"] in a for it, a in zip(items, answers))
    return {"n": len(items), "exact_match": exact / len(items), "contains_capital": contains / len(items)}


def json_scores(items: list[dict], answers: list[str]) -> dict:
    valid = keys = right = 0
    for it, a in zip(items, answers):
        try:
            obj = json.loads(a)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        valid += 1
        if {"name", "country", "population"} <= set(obj):
            keys += 1
            right += obj.get("name") == it["capital"]
    n = len(items)
    return {"n": n, "valid_json": valid / n, "has_keys": keys / n, "correct_name": right / n}


def evaluate(model_dir: str, backend: str = "reference", seed: int = 0, limit: int = 0,
             show: int = 3) -> dict:
    paddle.set_device("cpu")
    start = time.time()
    model = load_model(ModelConfig.from_pretrained(model_dir))
    tok = ChatTokenizer.from_model_dir(model_dir)
    runner = ReferenceBackend(model, tok) if backend == "reference" else EngineBackend(model_dir)
    corpus = build_corpus(seed)
    heldout = corpus["heldout"]
    cut = (lambda xs: xs[:limit]) if limit else (lambda xs: xs)
    unseen_names = {it["country"] for it in heldout["capital_unseen_countries"]}
    countries = [c for c in _countries() if c["name"] not in unseen_names]
    trained = [{"country": c["name"], "capital": c["capital"], "expected": capital_answer(c),
                "question": CAPITAL_QUESTIONS[i % 2].format(c=the(c["name"]))}
               for i, c in enumerate(random.Random(seed + 7).sample(countries, 40))]

    results, examples = {}, {}
    for name, items in [("capital_unseen_countries", heldout["capital_unseen_countries"]),
                        ("capital_heldout_phrasings", heldout["capital_heldout_phrasings"]),
                        ("capital_training_questions", trained)]:
        items = cut(items)
        answers = runner.answers([it["question"] for it in items], 32)
        results[name] = capital_scores(items, answers)
        examples[name] = [(it["question"], a) for it, a in zip(items, answers)][:show]
    json_items = heldout["json_capital"]
    unseen_json = [it for it in json_items if it["country"] in unseen_names]
    for name, items in [("json_capital", json_items), ("json_capital_unseen_countries", unseen_json),
                        ("json_capital_heldout_wording", [it for it in json_items if it not in unseen_json])]:
        items = cut(items)
        answers = runner.answers([it["question"] for it in items], 48)
        results[name] = json_scores(items, answers)
        examples[name] = [(it["question"], a) for it, a in zip(items, answers)][:show]
    items = cut(heldout["sentiment"])
    answers = runner.answers([it["question"] for it in items], 8)
    results["sentiment"] = {"n": len(items),
                            "accuracy": sum(a.strip() == it["label"] for it, a in zip(items, answers)) / len(items)}
    examples["sentiment"] = [(it["review"], a) for it, a in zip(items, answers)][:show]

    for name, cities in [("tool_calls_training_cities", EXTRA_CITIES[:10]), ("tool_calls_unseen_cities", HELDOUT_CITIES)]:
        cities = cut(cities)
        answers = runner.answers([f"What's the weather in {city}?" for city in cities], 32, [WEATHER_TOOL, DATE_TOOL])
        expected = [f'<function=get_weather>{{"city": "{city}"}}</function>' for city in cities]
        results[name] = {"n": len(cities), "exact_call": sum(a.strip() == e for a, e in zip(answers, expected)) / len(cities),
                         "calls_get_weather": sum(a.startswith("<function=get_weather>") for a in answers) / len(cities)}
        examples[name] = list(zip(cities, answers))[:show]

    texts = [tok.encode(t) + [tok.sp.eos_id()] for t in cut(heldout["text"])]
    answer_pairs = []
    for it in cut(heldout["capital_unseen_countries"]) + cut(heldout["capital_heldout_phrasings"]):
        prompt = tok.chat_ids([{"role": "user", "content": it["question"]}])
        target = tok.encode(it["expected"]) + [tok.im_end]
        answer_pairs.append((prompt + target, [0] * len(prompt) + [1] * len(target)))
    results["perplexity"] = {
        "heldout_text": perplexity(model, [(ids, [1] * len(ids)) for ids in texts]),
        "heldout_capital_answers": perplexity(model, answer_pairs),
    }
    france = runner.answers(["What is the capital of France?"], 32)[0]
    results["france"] = {"answer": france, "contains_paris": "Paris" in france}
    results["meta"] = {"model": model_dir, "backend": backend, "seed": seed,
                       "seconds": round(time.time() - start, 1)}
    results["examples"] = examples
    return results


def _countries() -> list[dict]:
    from build_corpus import load_countries

    return load_countries()


def print_table(r: dict) -> None:
    rows = [
        ("capital, unseen countries", "exact match", r["capital_unseen_countries"]["exact_match"],
         r["capital_unseen_countries"]["n"]),
        ("capital, unseen countries", "names the capital", r["capital_unseen_countries"]["contains_capital"],
         r["capital_unseen_countries"]["n"]),
        ("capital, unseen wordings", "exact match", r["capital_heldout_phrasings"]["exact_match"],
         r["capital_heldout_phrasings"]["n"]),
        ("capital, unseen wordings", "names the capital", r["capital_heldout_phrasings"]["contains_capital"],
         r["capital_heldout_phrasings"]["n"]),
        ("capital, training questions", "exact match", r["capital_training_questions"]["exact_match"],
         r["capital_training_questions"]["n"]),
        ("JSON capital answers", "valid JSON object", r["json_capital"]["valid_json"], r["json_capital"]["n"]),
        ("JSON capital answers", "name/country/population", r["json_capital"]["has_keys"], r["json_capital"]["n"]),
        ("JSON capital answers", "correct name", r["json_capital"]["correct_name"], r["json_capital"]["n"]),
        ("  unseen countries", "correct name", r["json_capital_unseen_countries"]["correct_name"],
         r["json_capital_unseen_countries"]["n"]),
        ("  unseen JSON wording", "correct name", r["json_capital_heldout_wording"]["correct_name"],
         r["json_capital_heldout_wording"]["n"]),
        ("sentiment, unseen reviews", "accuracy", r["sentiment"]["accuracy"], r["sentiment"]["n"]),
        ("weather call, training cities", "exact call", r["tool_calls_training_cities"]["exact_call"],
         r["tool_calls_training_cities"]["n"]),
        ("weather call, unseen cities", "exact call", r["tool_calls_unseen_cities"]["exact_call"],
         r["tool_calls_unseen_cities"]["n"]),
        ("weather call, unseen cities", "calls get_weather", r["tool_calls_unseen_cities"]["calls_get_weather"],
         r["tool_calls_unseen_cities"]["n"]),
    ]
    print(f"{'set':<30}{'metric':<26}{'value':>8}{'n':>6}")
    for name, metric, value, n in rows:
        print(f"{name:<30}{metric:<26}{value:>8.3f}{n:>6}")
    print(f"{'held-out text':<30}{'perplexity':<26}{r['perplexity']['heldout_text']:>8.2f}")
    print(f"{'held-out capital answers':<30}{'perplexity':<26}{r['perplexity']['heldout_capital_answers']:>8.3f}")
    print(f"France: {r['france']['answer']!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Evaluate the default model on its held-out sets.")
    parser.add_argument("--model", default=default_model_path())
    parser.add_argument("--backend", choices=["reference", "engine"], default="reference")
    parser.add_argument("--seed", type=int, default=0, help="the corpus seed the model was trained with")
    parser.add_argument("--limit", type=int, default=0, help="evaluate only the first N items of each set")
    parser.add_argument("--show", type=int, default=3, help="example answers to print per set")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    results = evaluate(args.model, args.backend, args.seed, args.limit, args.show)
    print_table(results)
    for name, pairs in results["examples"].items():
        for question, answer in pairs:
            print(f"  [{name}] {question!r} -> {answer!r}")
    print(json.dumps(results, ensure_ascii=False))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(results, f, ensure_ascii=False, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
