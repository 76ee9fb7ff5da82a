"""Command-line flags of the OpenAI-compatible server (`fastdeploy-lp serve` and
`python -m fastdeploy_lp.entrypoints.openai.api_server` take the same ones)."""

from __future__ import annotations

import argparse
import os

from fastdeploy_lp.config import CacheConfig, default_model_path
from fastdeploy_lp.engine.async_engine import DEFAULT_STALL_TIMEOUT_S
from fastdeploy_lp.entrypoints.openai.connections import (DEFAULT_KEEP_ALIVE_TIMEOUT_S, DEFAULT_LIMIT_CONCURRENCY,
                                                          DEFAULT_REQUEST_READ_TIMEOUT_S)
from fastdeploy_lp.entrypoints.openai.limits import RequestLimits
from fastdeploy_lp.processors.custom_backends import TRUST_ENV
from fastdeploy_lp.reasoning import REASONING_PARSERS
from fastdeploy_lp.sampling_params import MAX_N

API_KEY_ENV = "FASTDEPLOY_LP_API_KEY"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0..65535), got {text}")
    return value


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    model = parser.add_argument_group("model and engine")
    _add_engine_args(model)
    _add_decoding_args(model)
    _add_cache_args(parser.add_argument_group("KV cache and scheduling"))
    _add_http_args(parser.add_argument_group("HTTP server"))
    _add_compat_args(parser.add_argument_group(
        "FastDeploy compatibility (accepted, unused: ranks talk over pipes and Paddle's process group)"))
    return parser


def _add_engine_args(model) -> None:
    """The checkpoint, its names, and the engine's size and device."""
    model.add_argument("--model", default=default_model_path(),
                       help="Directory of a Hugging Face checkpoint (config.json, safetensors, tokenizer). "
                            "Default: the model that ships with the package.")
    model.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="Name(s) clients use in the 'model' field; the first is reported. "
                            "Default: the model directory's name. 'default' is always accepted too.")
    model.add_argument("--max-num-seqs", type=_positive_int, default=8,
                       help="Engine slots: sequences decoded together in one batch.")
    model.add_argument("--max-model-len", type=_positive_int, default=None,
                       help="Most tokens (prompt + output) per sequence. Default: the model's "
                            "max_position_embeddings, at most 4096.")
    model.add_argument("--device", default=None,
                       help="Paddle device, e.g. 'cpu', 'gpu', 'gpu:1'. Default: gpu when available, else cpu.")
    model.add_argument("--dtype", default="auto",
                       help="Weight dtype: auto (the checkpoint's), float32, bfloat16 or float16. GPUs compute in "
                            "it; CPUs keep the weights in it (2 bytes each for 16-bit) and compute in float32.")
    model.add_argument("--quantization", default=None, choices=["wint8", "none"],
                       help="wint8: linear weights int8 per output channel, quantized at load (CPU); the "
                            "embedding and LM head stay in --dtype.")
    model.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1, metavar="N",
                       help="Split the model over N worker processes (GPUs from --device on, NCCL; or CPU, "
                            "gloo): heads, MLP columns, vocabulary and KV cache per rank. See docs/distributed.md.")


def _add_decoding_args(model) -> None:
    """Logits processors, guided decoding, reasoning and tools."""
    model.add_argument("--logits-processors", nargs="*", default=[], metavar="NAME",
                       help="Logits processors, applied in this order: a built-in name "
                            "(e.g. LogitBiasLogitsProcessor) or 'package.module:ClassName'. Requests enable "
                            "them through 'logits_processors_args'.")
    model.add_argument("--guided-decoding-backend", default="llguidance", metavar="NAME",
                       help="Default backend for response_format / guided_* / tools: llguidance, 'off' "
                            "(constrained requests then get a 400), or the name of a custom backend loaded "
                            "with --custom-guided-decoding-backends. Requests may pick another with "
                            "nvext.guided_decoding_backend or guided_decoding_backend.")
    model.add_argument("--guided-whitespace-pattern", default=None, metavar="REGEX",
                       help="Whitespace allowed between JSON tokens in constrained output when a request sets "
                            "none: a regex, or '' for none. Default: json.dumps' layout ({\"a\": 1, \"b\": 2}), "
                            "which cannot run on as newlines.")
    model.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS), metavar="NAME",
                       help="For reasoning models (qwen3, deepseek_r1): return the <think> part as "
                            "reasoning_content, apart from content, and apply output constraints (JSON, "
                            "tools) from the end of the reasoning.")
    model.add_argument("--custom-guided-decoding-backends", default=None, metavar="DIR",
                       help="Directory of custom backends, one DIR/NAME/backend.py each (NVIDIA NIM's "
                            "layout; wheels beside it are installed offline into a private directory). "
                            "Needs --trust-custom-code.")
    model.add_argument("--trust-custom-code", action="store_true",
                       help=f"Allow loading code from --custom-guided-decoding-backends (also "
                            f"{TRUST_ENV}=1).")
    model.add_argument("--tool-functions", default=None, metavar="pkg.module:REGISTRY",
                       help="A dict of name -> callable that ToolExecutionLogitsProcessor may run when "
                            "the model writes <function>name(args)</function>. Requests never name code.")


def _add_http_args(server) -> None:
    """The HTTP server: address, auth, limits, shutdown, logging."""
    server.add_argument("--host", default="0.0.0.0", help="Address to listen on.")
    server.add_argument("--port", type=_port, default=8000, help="Port of the OpenAI-compatible API.")
    server.add_argument("--metrics-port", type=_port, default=None,
                        help="Also serve Prometheus /metrics on this port (it is always on --port too).")
    server.add_argument("--api-key", default=None,
                        help=f"Require 'Authorization: Bearer KEY' on /v1/* (also from ${API_KEY_ENV}). "
                             "/health and /metrics stay open.")
    server.add_argument("--max-waiting-requests", type=_non_negative_int, default=1024,
                        help="Most sequences waiting for a free slot (a request with n=k counts k); more "
                             "get 429 with Retry-After.")
    server.add_argument("--max-request-body-bytes", type=_positive_int, default=8 << 20,
                        help="Larger request bodies get 413 before they are read.")
    server.add_argument("--shutdown-timeout", type=_non_negative_float, default=30.0, metavar="SECONDS",
                        help="On SIGTERM/SIGINT: refuse new requests (503), let running ones finish for up to "
                             "this long, then end the rest with an error (streams: an error event and [DONE]).")
    server.add_argument("--engine-stall-timeout", type=_non_negative_float, default=DEFAULT_STALL_TIMEOUT_S,
                        metavar="SECONDS",
                        help="If requests wait and the engine computes no token and finishes no request for this "
                             "long, /health says 503 and those requests end with an error, until it makes "
                             "progress again. 0: no watchdog. Default: %(default)s (a 7B prefill chunk on a "
                             "small CPU takes minutes).")
    server.add_argument("--logits-processor-timeout", type=_non_negative_float, default=2.0, metavar="SECONDS",
                        help="A logits processor taking longer than this in one step fails the requests that "
                             "enabled it (the step itself is not interrupted). 0: no limit.")
    _add_limit_args(server)
    server.add_argument("--strict-fields", action="store_true",
                        help="Reject requests with unknown top-level fields (400) instead of listing them "
                             "in the x-fastdeploy-lp-ignored-fields response header.")
    server.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="Log level of the server and uvicorn.")


def _add_limit_args(server) -> None:
    """What one request may ask for, and how long a connection may take to ask (docs/server.md)."""
    limits = RequestLimits()
    server.add_argument("--max-messages", type=_positive_int, default=limits.max_messages,
                        help="Most messages in one chat request; more get a 400 before any templating.")
    server.add_argument("--max-n", type=_positive_int, default=limits.max_n,
                        help=f"Most choices (n) per request (at most {MAX_N}); more get a 400.")
    server.add_argument("--max-sequences-per-request", type=_positive_int, default=limits.max_sequences_per_request,
                        help="Most sequences one request submits at once: prompts x n (a completions batch of "
                             "P prompts with n choices is P*n); more get a 400.")
    server.add_argument("--max-stop", type=_positive_int, default=limits.max_stop,
                        help="Most entries in stop and in stop_token_ids (each; both are checked after every "
                             "token); more get a 400.")
    server.add_argument("--max-bad-words", type=_positive_int, default=limits.max_bad_words,
                        help="Most entries in bad_words, logits_processors_args.bad_words and "
                             "logits_processors_args.bad_words_token_ids (each); more get a 400.")
    server.add_argument("--max-bad-word-length", type=_positive_int, default=limits.max_bad_word_length,
                        help="Most characters of one bad word, or token ids of one banned sequence; longer get a 400.")
    server.add_argument("--limit-concurrency", type=_positive_int, default=DEFAULT_LIMIT_CONCURRENCY, metavar="N",
                        help="Most open connections; a connection beyond it gets a JSON 503 and is closed.")
    server.add_argument("--request-read-timeout", type=_positive_float, default=DEFAULT_REQUEST_READ_TIMEOUT_S,
                        metavar="SECONDS",
                        help="A connection must send a request's headers within this long of opening (or of its "
                             "first byte after an idle keep-alive); the body gets the same time plus 1 s per "
                             "64 KiB. Else the connection is closed.")
    server.add_argument("--keep-alive-timeout", type=_positive_float, default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                        metavar="SECONDS", help="An idle connection between requests is closed after this long.")


def request_limits_from_args(args: argparse.Namespace) -> RequestLimits:
    if args.max_n > MAX_N:
        raise ValueError(f"--max-n: at most {MAX_N}, got {args.max_n}")
    return RequestLimits(max_messages=args.max_messages, max_bad_words=args.max_bad_words,
                         max_bad_word_length=args.max_bad_word_length, max_n=args.max_n,
                         max_sequences_per_request=args.max_sequences_per_request, max_stop=args.max_stop)


def _add_cache_args(cache) -> None:
    """The paged KV cache and the per-step token budget (docs/kv_cache.md)."""
    cache.add_argument("--block-size", type=_positive_int, default=16,
                       help="Tokens per KV cache block.")
    cache.add_argument("--kv-cache-memory", type=_positive_float, default=4.0, metavar="GIB",
                       help="KV cache size on CPU, in GiB (never more than --max-num-seqs full-length "
                            "sequences need).")
    cache.add_argument("--gpu-memory-utilization", type=_positive_float, default=0.9, metavar="FRACTION",
                       help="On GPU: the fraction of the device's memory for the model and its KV cache.")
    cache.add_argument("--num-blocks", type=_positive_int, default=None,
                       help="KV cache blocks, overriding the memory sizing.")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="Reuse the KV cache of full blocks shared with earlier requests.")
    cache.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="Split long prompts across steps so running requests keep decoding.")
    cache.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                       help="Tokens one step may compute (default: 2048 with chunked prefill, else no limit).")


def cache_config_from_args(args: argparse.Namespace) -> CacheConfig:
    return CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                       gpu_memory_utilization=args.gpu_memory_utilization, num_blocks=args.num_blocks,
                       enable_prefix_caching=args.enable_prefix_caching,
                       enable_chunked_prefill=args.enable_chunked_prefill,
                       max_num_batched_tokens=args.max_num_batched_tokens)


def _add_compat_args(compat) -> None:
    """FastDeploy's multi-process flags, so its launch commands run unchanged."""
    compat.add_argument("--engine-worker-queue-port", type=_port, default=None,
                        help="Accepted so FastDeploy launch commands run; unused.")
    compat.add_argument("--cache-queue-port", type=_port, default=None,
                        help="Accepted so FastDeploy launch commands run; unused.")


def missing_model_hint(model: str) -> str:
    """Extra words for a start-up failure when the built-in model is not installed."""
    if os.path.abspath(model) == os.path.abspath(default_model_path()) and \
            not os.path.isfile(os.path.join(model, "config.json")):
        return " (the built-in model is not installed in this checkout; pass --model DIR with a Hugging Face checkpoint)"
    return ""


def trust_custom_code(args: argparse.Namespace) -> bool:
    return args.trust_custom_code or os.environ.get(TRUST_ENV, "").lower() in ("1", "true", "yes")


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The flag, else the environment variable (read after parsing so --help never shows it)."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="OpenAI-compatible server for fastdeploy_lp: /v1/chat/completions, "
                               "/v1/completions, /v1/models, /v1/logits_processors, /health, /metrics.")
    return add_server_args(parser)
