"""Command-line flags of the OpenAI-compatible server (`fastdeploy-lp serve` and
`python -m fastdeploy_lp.entrypoints.openai.api_server` take the same ones).

The flags are generated: the engine's from `EngineArgs` (`fastdeploy_lp.config`, the options
`LLM()` takes too), the HTTP server's from `ServerArgs` below, one default and one help per field.
`docs/server.md`'s flag table is generated from the same fields (`python -m
fastdeploy_lp.entrypoints.openai.args --write-docs docs/server.md`; a test keeps it in step).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass

from fastdeploy_lp import envs
from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.engine.async_engine import DEFAULT_STALL_TIMEOUT_S
from fastdeploy_lp.entrypoints.openai.limits import RequestLimits
from fastdeploy_lp.entrypoints.openai.responses_store import DEFAULT_RESPONSES_STORE_BYTES, DEFAULT_RESPONSES_STORE_SIZE
from fastdeploy_lp.model_config import default_model_path
from fastdeploy_lp.options import (add_arguments, markdown_table, non_negative_float, non_negative_int, option,
                                   port_number, positive_float, positive_int)

HTTP, LIMITS = "HTTP server", "request and connection limits (docs/server.md#limits)"


@dataclass
class ServerArgs:
    """The HTTP server's options (the engine's are `EngineArgs`), written once like them."""

    served_model_name: list[str] | None = option(
        None, "Name(s) clients use in the 'model' field; the first is reported. Default: the model directory's "
              "name. 'default' and the model path are always accepted too.", group=HTTP, nargs="+",
        metavar="NAME")
    host: str = option("0.0.0.0", "Address to listen on.", group=HTTP)
    port: int = option(8000, "Port of the OpenAI-compatible API.", group=HTTP, parse=port_number)
    metrics_port: int | None = option(None, "Also serve Prometheus /metrics on this port (it is always on --port "
                                            "too).", group=HTTP, parse=port_number, metavar="PORT")
    api_key: str | None = option(
        None, "Require 'Authorization: Bearer KEY' on every path but /health and /metrics (the API, /docs, "
              "/redoc, /openapi.json); also from $FDLP_API_KEY.", group=HTTP, metavar="KEY")
    strict_fields: bool = option(False, "Reject requests with unknown top-level fields (400) instead of listing "
                                        "them in the x-fastdeploy-lp-ignored-fields response header.", group=HTTP)
    shutdown_timeout: float = option(
        30.0, "On SIGTERM/SIGINT: refuse new requests (503), let running ones finish for up to this long, then "
              "end the rest with an error (streams: an error event and [DONE]).", group=HTTP,
        parse=non_negative_float, metavar="SECONDS")
    engine_stall_timeout: float = option(
        DEFAULT_STALL_TIMEOUT_S, "If requests wait and the engine computes no token and finishes no request for "
                                 "this long, /health says 503 and those requests end with an error, until it "
                                 "makes progress again. 0: no watchdog.", group=HTTP, parse=non_negative_float,
        metavar="SECONDS")
    log_level: str = option("info", "Log level of the server and uvicorn.", group=HTTP,
                            choices=("debug", "info", "warning", "error"))
    max_waiting_requests: int = option(
        1024, "Most sequences waiting for a free slot (a request with n=k counts k); more get 429 with "
              "Retry-After.", group=LIMITS, parse=non_negative_int, metavar="N")
    max_request_body_bytes: int = option(8 << 20, "Larger request bodies get 413 before they are read.",
                                         group=LIMITS, parse=positive_int, metavar="N")
    responses_store_size: int = option(
        DEFAULT_RESPONSES_STORE_SIZE, "Most responses /v1/responses keeps in memory (store: true) for GET and "
                                      "previous_response_id; past it the least recently used is evicted. 0: none.",
        group=LIMITS, parse=non_negative_int, metavar="N")
    responses_store_bytes: int = option(
        DEFAULT_RESPONSES_STORE_BYTES, "Most bytes of memory those stored responses hold (kept as compact JSON); "
                                       "past it the least recently used are evicted.",
        group=LIMITS, parse=non_negative_int, metavar="N")
    max_messages: int = option(2048, "Most messages in one chat request (input items in one /v1/responses "
                                     "request); more get a 400 before any templating.",
                               group=LIMITS, parse=positive_int, metavar="N")
    max_tools: int = option(128, "Most tool definitions in one request (OpenAI's own limit); more get a 400 before "
                                 "any templating.", group=LIMITS, parse=positive_int, metavar="N")
    max_sequences_per_request: int = option(
        256, "Most sequences one request submits at once: prompts x n (a completions batch of P prompts with n "
             "choices is P*n); more get a 400.", group=LIMITS, parse=positive_int, metavar="N")
    limit_concurrency: int = option(1024, "Most open connections (fitted to the open-file limit); a connection "
                                          "beyond it gets a JSON 503 and is closed.", group=LIMITS,
                                    parse=positive_int, metavar="N")
    request_read_timeout: float = option(
        10.0, "A connection must send a request's headers within this long of opening (or of its first byte after "
              "an idle keep-alive); the body gets the same time plus 1 s per 64 KiB. Else the connection is "
              "closed.", group=LIMITS, parse=positive_float, metavar="SECONDS")
    keep_alive_timeout: float = option(5.0, "An idle connection between requests is closed after this long.",
                                       group=LIMITS, parse=positive_float, metavar="SECONDS")

    def request_limits(self, engine_args: EngineArgs) -> RequestLimits:
        """These limits and the engine's own (`EngineArgs`: n, stop, bad words, which `LLM()` checks too)."""
        engine = engine_args.sequence_limits()
        return RequestLimits(max_messages=self.max_messages, max_bad_words=engine.max_bad_words,
                             max_bad_word_length=engine.max_bad_word_length, max_n=engine.max_n,
                             max_sequences_per_request=self.max_sequences_per_request, max_stop=engine.max_stop,
                             max_tools=self.max_tools)

    def resolve_api_key(self) -> str | None:
        """The flag, else the environment variable (read after parsing so --help never shows it)."""
        return self.api_key or envs.get("FDLP_API_KEY") or None


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    groups = add_arguments(parser, EngineArgs)
    add_arguments(parser, ServerArgs, groups)
    return parser


def missing_model_hint(model: str | None) -> str:
    """Extra words for a start-up failure when the built-in model is not installed."""
    model = model or default_model_path()
    if os.path.abspath(model) == os.path.abspath(default_model_path()) and \
            not os.path.isfile(os.path.join(model, "config.json")):
        return " (the built-in model is not installed in this checkout; pass --model DIR with a Hugging Face checkpoint)"
    return ""


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="OpenAI-compatible server for fastdeploy_lp: /v1/chat/completions, "
                               "/v1/completions, /v1/models, /v1/logits_processors, /health, /metrics.")
    return add_server_args(parser)


# -- the generated parts of docs/server.md ------------------------------------------------------------
GENERATED = {"flags": lambda: markdown_table(EngineArgs, ServerArgs), "environment": envs.markdown_table}


def with_generated_tables(text: str) -> str:
    """`text` (docs/server.md) with each `<!-- generated: NAME -->` ... `<!-- end generated -->`
    block replaced by the table it names."""
    def fill(match: re.Match) -> str:
        return f"{match.group(1)}\n{GENERATED[match.group(2)]()}{match.group(3)}"

    return re.sub(r"(<!-- generated: (\w+) [^>]*-->)\n.*?(<!-- end generated -->)", fill, text, flags=re.S)


def main(argv: list[str]) -> int:
    """`--write-docs PATH`: regenerate the tables of PATH (docs/server.md) in place."""
    if len(argv) != 2 or argv[0] != "--write-docs":
        print("usage: python -m fastdeploy_lp.entrypoints.openai.args --write-docs docs/server.md", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        text = f.read()
    with open(argv[1], "w", encoding="utf-8") as f:
        f.write(with_generated_tables(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
