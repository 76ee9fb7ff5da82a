"""The `fastdeploy-lp` command.

    fastdeploy-lp demo                      # a short offline demo on the built-in model
    fastdeploy-lp serve --model DIR ...     # the OpenAI-compatible server (see `serve --help`)
    fastdeploy-lp tp-worker --driver H:P    # a tensor-parallel rank, under paddle.distributed.launch

Also runnable as `python -m fastdeploy_lp.entrypoints.cli`.
"""

from __future__ import annotations

import argparse
import json
import sys

from fastdeploy_lp.config import EngineArgs, default_model_path
from fastdeploy_lp.entrypoints.openai.args import add_server_args, missing_model_hint
from fastdeploy_lp.options import add_arguments, from_namespace, options

CAPITAL_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[\\w]+$"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastdeploy-lp",
                                     description="fastdeploy_lp: a Paddle LLM engine with a logits-processor "
                                                 "pipeline and an OpenAI-compatible server.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,demo,tp-worker}")
    serve = sub.add_parser("serve", help="Run the OpenAI-compatible server.",
                           description="Run the OpenAI-compatible server: /v1/chat/completions, /v1/completions, "
                                       "/v1/models, /v1/logits_processors, /health, /metrics.")
    add_server_args(serve)
    demo = sub.add_parser("demo", help="Answer a question offline on the built-in model and print it.",
                          description="Answer a question offline and print it; takes the engine's options "
                                      "(the built-in model unless --model).")
    demo.add_argument("--max-tokens", type=int, default=48, help="Most tokens per answer (default 48).")
    add_arguments(demo, EngineArgs)
    worker = sub.add_parser(
        "tp-worker", help="One tensor-parallel rank of a server on another machine (multi-node).",
        description="One tensor-parallel rank for a driver started with --tensor-parallel-address: run it on each "
                    "machine under `python -m paddle.distributed.launch --nnodes N --rank I --master HOST:PORT "
                    "--nproc_per_node K fastdeploy-lp tp-worker --driver HOST:PORT`, with the driver's "
                    "FDLP_TP_SECRET in the environment. It takes the model and options from the driver. See "
                    "docs/distributed.md.")
    worker.add_argument("--driver", required=True, metavar="HOST:PORT",
                        help="The driver's --tensor-parallel-address, as reachable from this machine.")
    return parser


def run_demo(args: argparse.Namespace) -> int:
    from fastdeploy_lp.engine.llm import LLM
    from fastdeploy_lp.sampling_params import GuidedDecodingParams, SamplingParams

    engine_args = from_namespace(EngineArgs, args)
    model = engine_args.model or default_model_path()
    try:
        llm = LLM(model, **{f.name: getattr(engine_args, f.name) for f in options(EngineArgs)
                            if f.metadata["cli"] and f.name != "model"})
    except (ValueError, OSError) as e:
        print(f"fastdeploy-lp demo: cannot load the model: {e}{missing_model_hint(model)}", file=sys.stderr)
        return 2
    question = "What is the capital of France?"
    out = llm.chat([{"role": "user", "content": question}],
                   SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)[0]
    print(f"Q: {question}\nA: {out.outputs.text.strip()}")

    prompt = f"{question} Answer in JSON with the city's name and its population."
    params = SamplingParams(temperature=0, max_tokens=max(args.max_tokens, 96),
                            guided_decoding=GuidedDecodingParams(json=CAPITAL_SCHEMA))
    out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
    print(f"\nQ: {prompt}\n   (constrained to the JSON schema {json.dumps(CAPITAL_SCHEMA)})\nA: {out.outputs.text.strip()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.command == "serve":
        from fastdeploy_lp.entrypoints.openai.api_server import run_server

        return run_server(args)
    if args.command == "tp-worker":
        import logging

        from fastdeploy_lp.executor.worker import run_launched_worker

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run_launched_worker(args.driver)
    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
