"""How the engine runs a checkpoint: `EngineArgs` (every option, its default and its help, written
once) and what is derived from it: `FDConfig` with its `CacheConfig`.

`EngineArgs` is the one place an engine option and its default are written: the server's flags
(`fastdeploy-lp serve --help`), the keyword arguments of `LLM()` and the flag table of
`docs/server.md` are generated from its fields. `EngineArgs.create_engine_config()` checks the values
against the checkpoint and returns the `FDConfig` every `LogitsProcessor` receives, as in FastDeploy
(`fd_config.model_config.vocab_size`, `.dtype`, `fd_config.device`, ...).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from fastdeploy_lp.block_formats import wint4_format
from fastdeploy_lp.distributed.checks import check_launched_ranks, check_tensor_parallel
from fastdeploy_lp.kv_events_config import KVEventsConfig, parse_kv_events_config
from fastdeploy_lp.model_config import ModelConfig, default_model_path, normalize_dtype, normalize_quantization
from fastdeploy_lp.options import (non_negative_float, non_negative_int, option, port_number, positive_float,
                                   positive_int)
from fastdeploy_lp.reasoning import REASONING_PARSERS
from fastdeploy_lp.sampling_params import MAX_N
from fastdeploy_lp.sequence_limits import SequenceLimits
from fastdeploy_lp.speculative_config import SpeculativeConfig, parse_speculative_config

logger = logging.getLogger(__name__)

# Tokens one step computes with chunked prefill when --max-num-batched-tokens is not given.
CHUNKED_PREFILL_TOKEN_BUDGET = 2048
MAX_MODEL_LEN_CAP = 4096  # --max-model-len's default: the model's context, at most this
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


def default_device() -> str:
    import paddle

    return "gpu" if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0 else "cpu"


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache and the per-step token budget (docs/kv_cache.md); `EngineArgs` documents
    each field.

    The pool holds `num_blocks` blocks of `block_size` positions. Unless `num_blocks` is given, it is
    sized by memory: `kv_cache_memory` GiB on CPU, `gpu_memory_utilization` of the GPU's memory less
    what the model already uses on GPU, and never more than `max_num_seqs` full-length sequences need.
    """

    block_size: int
    kv_cache_dtype: str  # auto (the dtype the model computes in), float32 or bfloat16
    kv_cache_memory: float  # GiB, CPU
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    max_num_batched_tokens: int | None  # tokens per step; None: CHUNKED_PREFILL_TOKEN_BUDGET with chunking
    num_blocks: int | None  # overrides the memory sizing (tests, benchmarks)

    def __post_init__(self):
        checks = {"block_size": isinstance(self.block_size, int) and 1 <= self.block_size <= 1024,
                  "kv_cache_dtype": self.kv_cache_dtype in KV_CACHE_DTYPES,
                  "kv_cache_memory": isinstance(self.kv_cache_memory, (int, float)) and self.kv_cache_memory > 0,
                  "gpu_memory_utilization": isinstance(self.gpu_memory_utilization, (int, float))
                  and 0 < self.gpu_memory_utilization <= 1,
                  "max_num_batched_tokens": self.max_num_batched_tokens is None
                  or (isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1),
                  "num_blocks": self.num_blocks is None or (isinstance(self.num_blocks, int) and self.num_blocks >= 2)}
        wanted = {"block_size": "an integer in 1..1024", "kv_cache_dtype": " or ".join(KV_CACHE_DTYPES),
                  "kv_cache_memory": "a positive number of GiB",
                  "gpu_memory_utilization": "a fraction in (0, 1]", "max_num_batched_tokens": "a positive integer",
                  "num_blocks": "an integer >= 2"}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}: must be {wanted[name]}, got {getattr(self, name)!r}")

    def dtype_for(self, compute_dtype: str) -> str:
        """What the cache holds for a model computing in `compute_dtype`."""
        return compute_dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def token_budget(self) -> int | None:
        """Tokens one step may compute; None: no limit (whole prompts in one pass)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CHUNKED_PREFILL_TOKEN_BUDGET if self.enable_chunked_prefill else None


# Objects that were `FDConfig` fields once and now live in the engine's `EngineContext`.
RUNTIME_OBJECTS = ("tokenizer", "tool_functions", "custom_guided_decoding_backends")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA serving (`enable_lora`; docs/lora.md): the adapters loaded at start-up as (name, path)
    pairs, and the limits every adapter is checked against."""

    modules: tuple[tuple[str, str], ...]
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None
    dtype: str  # what adapters are held in: float32, bfloat16 or float16 (the update is float32)

    @classmethod
    def from_args(cls, args: "EngineArgs", model_config: ModelConfig) -> "LoRAConfig | None":
        if not args.enable_lora:
            if args.lora_modules:
                raise ValueError("lora_modules: needs enable_lora (--enable-lora)")
            return None
        modules = []
        for entry in args.lora_modules or ():
            name, sep, path = str(entry).partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: {entry!r} is not name=path")
            if name in dict(modules):
                raise ValueError(f"lora_modules: {name!r} is given twice")
            modules.append((name, path))
        for field_name in ("max_loras", "max_lora_rank"):
            value = getattr(args, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field_name}: must be a positive integer, got {value!r}")
        if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
            raise ValueError(f"max_cpu_loras: {args.max_cpu_loras} is fewer than max_loras={args.max_loras}")
        dtype = args.lora_dtype
        if dtype == "auto":  # vLLM's: the model's; weights in int8, 4-bit or GGUF blocks compute from float32
            dtype = model_config.weight_dtype if model_config.weight_dtype in ("bfloat16", "float16") else "float32"
        return cls(tuple(modules), args.max_loras, args.max_lora_rank, args.max_cpu_loras, dtype)


@dataclass(frozen=True)
class FDConfig:
    """Everything the engine and the logits processors need to know about one deployment, derived
    from `EngineArgs` (which documents each field) and checked against the checkpoint. Frozen: a
    change is a new config (`dataclasses.replace`). It holds values only, so it pickles to
    tensor-parallel workers; the tokenizer, tool functions and custom backends are in the engine's
    `EngineContext` (`fastdeploy_lp.processors.context`)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    max_num_seqs: int
    max_model_len: int
    device: str
    logits_processors: tuple[str, ...]
    guided_decoding_backend: str
    fast_forward: bool
    cpu_threads: int | None
    logits_processor_timeout_s: float | None  # None: no limit
    guided_whitespace_pattern: str | None
    guided_close_on_length: bool
    guided_json_number_digits: int
    reasoning_parser: str | None
    tensor_parallel_size: int
    tensor_parallel_address: str | None  # None: the ranks are spawned here; else where launched ranks connect
    speculative_config: SpeculativeConfig | None  # None: no speculative decoding
    tokenizer_dir: str | None  # Hugging Face tokenizer files replacing the model's own (`--tokenizer`)
    sequence_limits: SequenceLimits  # what one request may ask of every step, checked before it is queued
    kv_events_config: KVEventsConfig | None  # None: no KV-cache events published
    deterministic: bool  # batch-invariant kernels (docs/deterministic.md)
    lora_config: LoRAConfig | None  # None: LoRA off

    @classmethod
    def create(cls, model: str | None = None, **kwargs: Any) -> "FDConfig":
        """`EngineArgs(model, **kwargs).create_engine_config()`: the config of those options."""
        return EngineArgs(model, **kwargs).create_engine_config()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are no field: processors written against the old config
        # learn where the runtime objects went instead of reading a bare AttributeError.
        if name in RUNTIME_OBJECTS:
            raise AttributeError(
                f"FDConfig.{name}: runtime objects are no longer part of the config; a logits processor that "
                f"needs the engine's {name} sets `uses_engine_context = True` and is built as "
                f"cls(fd_config, context), reading context.{name} (docs/logits_processors.md)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


MODEL, DECODING, CACHE = "model and engine", "decoding: processors, guided decoding, reasoning, tools", \
    "KV cache and scheduling"
LIMITS = "request limits (docs/server.md#limits; LLM() checks them too)"
COMPAT = "FastDeploy compatibility (accepted, unused: ranks talk over pipes and Paddle's process group)"


@dataclass
class EngineArgs:
    """Every engine option, its default and its help, written once. `LLM(**kwargs)` takes these
    fields, `fastdeploy-lp serve` has a flag for each (`--max-num-seqs` for `max_num_seqs`), and
    `create_engine_config()` turns them into the `FDConfig` of a checkpoint.

        >>> args = EngineArgs(max_num_seqs=4, device="cpu")
        >>> args.create_engine_config().max_num_seqs
        4
    """

    model: str | None = option(
        None, "Directory of a Hugging Face checkpoint (config.json, safetensors, tokenizer), or a GGUF file (the "
              "first part of a split one; or a directory holding one), its weights kept in their blocks (CPU). "
              "Default: the model that ships with the package.", group=MODEL, metavar="PATH")
    tokenizer: str | None = option(
        None, "Directory of Hugging Face tokenizer files (tokenizer.json or tokenizer.model, tokenizer_config.json) "
              "to use instead of the model's own, e.g. for a GGUF file. Default: the model's.", group=MODEL,
        metavar="DIR")
    max_num_seqs: int = option(8, "Engine slots: sequences decoded together in one batch.", group=MODEL,
                               parse=positive_int, metavar="N")
    max_model_len: int | None = option(
        None, f"Most tokens (prompt + output) per sequence. Default: the model's max_position_embeddings, at most "
              f"{MAX_MODEL_LEN_CAP}.", group=MODEL, parse=positive_int, metavar="N")
    device: str | None = option(None, "Paddle device, e.g. 'cpu', 'gpu', 'gpu:1'. Default: gpu when available, "
                                      "else cpu.", group=MODEL)
    dtype: str = option("auto", "Weight dtype: auto (the checkpoint's), float32, bfloat16 or float16. GPUs compute "
                                "in it; CPUs keep the weights in it (2 bytes each for 16-bit) and compute in "
                                "float32, except that with bfloat16 weights on a CPU with AVX-512 BF16 the linear "
                                "layers round their input to bfloat16 (float32 sums; FDLP_CPU_BF16_DOT=0: "
                                "float32).", group=MODEL)
    quantization: str | None = option(
        None, "wint8: int8 weights per output channel, quantized at load. CPU: linear layers, embedding and LM "
              "head. GPU (dtype bfloat16 or float16): linear layers through Paddle's weight_only_linear, embedding "
              "and LM head in dtype; not run by this project's tests, which have no GPU. wint4 (CPU): 4-bit linear "
              "layers, a scale per --wint4-group-size weights, embedding and LM head in Q8_0. none: as dtype says. "
              "A GGUF model is already quantized: none.",
        group=MODEL, choices=("wint8", "wint4", "none"))
    wint4_group_size: int = option(128, "Weights per scale under --quantization wint4: 128 (4.125 bits a weight) or "
                                        "32 (GGML's Q4_0, 4.5 bits).", group=MODEL, parse=positive_int,
                                   choices=(32, 128), metavar="N")
    tensor_parallel_size: int = option(
        1, "Split the model over N worker processes (GPUs from the device on, NCCL; or CPU, gloo): heads, MLP "
           "columns, vocabulary and KV cache per rank. See docs/distributed.md.", group=MODEL, parse=positive_int,
        aliases=("-tp",), metavar="N")
    tensor_parallel_address: str | None = option(
        None, "Multi-node tensor parallelism: start no ranks here, but wait at HOST:PORT for the "
              "--tensor-parallel-size ranks that `python -m paddle.distributed.launch ... fastdeploy-lp tp-worker "
              "--driver HOST:PORT` starts on each machine (every machine needs the model at the same path). The "
              "driver and the ranks share the secret in FDLP_TP_SECRET. See docs/distributed.md.", group=MODEL,
        metavar="HOST:PORT")
    data_parallel_size: int = option(
        1, "The server runs N engine processes, each with the whole model, behind its one HTTP port, and sends each "
           "request to the least loaded. On CPU each engine gets its own cores (--cpu-threads is per engine; "
           "default: the cores split evenly). Not with --tensor-parallel-size > 1, custom guided-decoding "
           "backends or --kv-events-config; LLM() runs one engine. See docs/distributed.md.", group=MODEL, parse=positive_int,
        aliases=("-dp",), metavar="N")
    cpu_threads: int | None = option(None, "Threads for CPU math. Default: every core this process may use (split "
                                           "between tensor-parallel ranks, or data-parallel engines).", group=MODEL,
                                     parse=positive_int, metavar="N")
    deterministic: bool = option(
        False, "Batch-invariant inference: a request's tokens and logprobs are the same bit for bit whatever it is "
               "batched with (neighbours, prefix cache hits, prompt chunks, preemption, n, speculation), on the same "
               "model, weights, flags and CPU ISA; every op on the CPU kernels in one fixed summation order (tensor-"
               "parallel ranks' parts added in rank order). CPU, a silu MLP; slower prefill. See "
               "docs/deterministic.md.", group=MODEL)
    logits_processors: list[str] = option(
        default_factory=list, help="Logits processors, applied in this order: a built-in name (e.g. "
        "LogitBiasLogitsProcessor) or 'package.module:ClassName'. Requests enable them through "
        "'logits_processors_args'.", group=DECODING, nargs="*", metavar="NAME")
    logits_processor_timeout_s: float | None = option(
        2.0, "Seconds one logits processor may take in one step: its calls run on a thread of its own, and beyond "
             "it the requests that enabled it fail in that step, which goes on without waiting for the call. 0 or "
             "None: no limit (calls run in place).", group=DECODING,
        flag="--logits-processor-timeout", parse=non_negative_float, metavar="SECONDS")
    fast_forward: bool = option(True, "Append the tokens processors declare certain (a grammar's only "
                                      "continuation) in one pass instead of one step each.", group=DECODING)
    guided_decoding_backend: str = option(
        "llguidance", "Default backend for response_format / guided_* / tools: llguidance, 'off' (constrained "
                      "requests then get a 400), or the name of a custom backend. Requests may pick another with "
                      "nvext.guided_decoding_backend or guided_decoding_backend.", group=DECODING, metavar="NAME")
    guided_whitespace_pattern: str | None = option(
        None, "Whitespace allowed between JSON tokens in constrained output when a request sets none: a regex, or "
              "'' for none. Default: json.dumps' layout ({\"a\": 1, \"b\": 2}), which cannot run on as newlines.",
        group=DECODING, metavar="REGEX")
    guided_close_on_length: bool = option(
        False, "Close JSON-constrained output (response_format json_schema / json_object, guided_json, tools "
               "excluded) that reaches max_tokens with a short valid completion, for requests that do not set "
               "structured_outputs.close_on_length. Off: OpenAI's behaviour (the output is cut).", group=DECODING)
    guided_json_number_digits: int = option(
        15, "The most digits a number in JSON-constrained output (guided_json, response_format) may have before its "
            "decimal point; at most min(N, 10) follow it, and no exponent. Without a cap a model can write one "
            "endless number until max_tokens. 15 keeps every integer exact in a float64. 0: no cap.",
        group=DECODING, parse=non_negative_int, metavar="N")
    reasoning_parser: str | None = option(
        None, "For reasoning models (qwen3, deepseek_r1): return the <think> part as reasoning_content, apart from "
              "content, and apply output constraints (JSON, tools) from the end of the reasoning.",
        group=DECODING, choices=tuple(sorted(REASONING_PARSERS)), metavar="NAME")
    custom_guided_decoding_backends: str | dict | None = option(
        None, "Directory of custom guided-decoding backends, one DIR/NAME/backend.py each (NVIDIA NIM's layout; "
              "wheels beside it are installed offline into a private directory), or (offline) a dict of loaded "
              "backends. Needs trust_custom_code.", group=DECODING, metavar="DIR")
    trust_custom_code: bool = option(False, "Allow loading code from custom_guided_decoding_backends (also "
                                            "FDLP_TRUST_CUSTOM_CODE=1).", group=DECODING)
    tool_functions: str | dict | None = option(
        None, "A dict of name -> callable that ToolExecutionLogitsProcessor may run when the model writes "
              "<function>name(args)</function>, as 'pkg.module:REGISTRY' (or, offline, the dict). Requests never "
              "name code.", group=DECODING, metavar="pkg.module:REGISTRY")
    speculative_config: str | dict | None = option(
        None, "Speculative decoding, as a JSON object: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1} drafts the tokens that followed the latest "
              "match of the last n tokens in prompt + output; {\"method\": \"draft_model\", \"model\": DIR, "
              "\"num_speculative_tokens\": 4} drafts greedily with a smaller checkpoint sharing the tokenizer. "
              "Drafts are verified in one pass; outputs stay exactly those of plain decoding; max_verify_tokens (8) "
              "caps a pass's decode tokens, so large batches back off, and a request whose drafts keep being "
              "rejected pauses drafting. Default: off. See docs/speculative_decoding.md.", group=DECODING,
        parse=parse_speculative_config, metavar="JSON")
    block_size: int = option(16, "Tokens per KV cache block.", group=CACHE, parse=positive_int, metavar="N")
    kv_cache_dtype: str = option("auto", "What the KV cache holds: auto (the dtype the model computes in: float32 on "
                                         "CPU), float32 or bfloat16. bfloat16 halves the cache's bytes: twice the "
                                         "tokens in --kv-cache-memory, and decode over long contexts reads half as "
                                         "much (keys and values rounded to bfloat16 as they are stored; on CPU "
                                         "products and sums stay float32).", group=CACHE, choices=KV_CACHE_DTYPES)
    kv_cache_memory: float = option(4.0, "KV cache size on CPU, in GiB (never more than max_num_seqs full-length "
                                         "sequences need).", group=CACHE, parse=positive_float, metavar="GIB")
    gpu_memory_utilization: float = option(0.9, "On GPU: the fraction of the device's memory for the model and its "
                                                "KV cache.", group=CACHE, parse=positive_float, metavar="FRACTION")
    num_blocks: int | None = option(None, "KV cache blocks, overriding the memory sizing.", group=CACHE,
                                    parse=positive_int, metavar="N")
    enable_prefix_caching: bool = option(True, "Reuse the KV cache of full blocks shared with earlier requests.",
                                         group=CACHE)
    enable_chunked_prefill: bool = option(True, "Split long prompts across steps so running requests keep "
                                                "decoding.", group=CACHE)
    max_num_batched_tokens: int | None = option(
        None, f"Tokens one step may compute. Default: {CHUNKED_PREFILL_TOKEN_BUDGET} with chunked prefill, else no "
              f"limit.", group=CACHE, parse=positive_int, metavar="N")
    kv_events_config: str | dict | None = option(
        None, "Publish KV-cache events (blocks stored in and removed from the prefix cache) for KV-aware routers "
              "(vllm-router's kv_aware policy, Dynamo, llm-d), as vLLM's JSON object and wire format: "
              "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
              "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv-events\", \"buffer_steps\": 10000, "
              "\"hwm\": 100000}. Needs prefix caching. Default: off. See docs/distributed.md.", group=CACHE,
        parse=parse_kv_events_config, metavar="JSON")
    max_n: int = option(16, f"Most choices (n) per request (at most {MAX_N}); more get a 400 (offline: a "
                            "ValueError).", group=LIMITS, parse=positive_int, metavar="N")
    max_stop: int = option(64, "Most entries in stop and in stop_token_ids (each; both are checked after every "
                               "token); more get a 400 (offline: a ValueError).", group=LIMITS, parse=positive_int,
                           metavar="N")
    max_bad_words: int = option(128, "Most entries in bad_words, logits_processors_args.bad_words and "
                                     "logits_processors_args.bad_words_token_ids (each); more get a 400 (offline: a "
                                     "ValueError).", group=LIMITS, parse=positive_int, metavar="N")
    max_bad_word_length: int = option(128, "Most characters of one bad word, or token ids of one banned sequence; "
                                           "longer get a 400 (offline: a ValueError).", group=LIMITS,
                                      parse=positive_int, metavar="N")
    enable_lora: bool = option(False, "Serve LoRA adapters (Hugging Face PEFT format) on top of the base model: "
                                      "a request's model picks one. See docs/lora.md.", group=MODEL)
    lora_modules: list[str] | None = option(
        None, "Adapters loaded at start-up, as name=path (a PEFT directory); requests name them as their model.",
        group=MODEL, nargs="+", metavar="NAME=PATH")
    max_loras: int = option(4, "Most different adapters in one step; requests on others wait.", group=MODEL,
                            parse=positive_int, metavar="N")
    max_lora_rank: int = option(16, "Highest adapter rank (r) accepted; larger adapters are refused.", group=MODEL,
                                parse=positive_int, metavar="N")
    max_cpu_loras: int | None = option(None, "Adapters held in memory (default: no limit); past it the least "
                                             "recently used leaves and is read again when asked for.", group=MODEL,
                                       parse=positive_int, metavar="N")
    lora_dtype: str = option("auto", "What adapters are held in: auto (the weights' dtype if bfloat16 or float16, "
                                     "else float32), float32, bfloat16 or float16. The update is computed in float32.",
                             group=MODEL, choices=("auto", "float32", "bfloat16", "float16"))
    engine_worker_queue_port: int | None = option(None, "Accepted so FastDeploy launch commands run; unused.",
                                                  group=COMPAT, parse=port_number, metavar="PORT")
    cache_queue_port: int | None = option(None, "Accepted so FastDeploy launch commands run; unused.",
                                          group=COMPAT, parse=port_number, metavar="PORT")

    @property
    def model_path(self) -> str:
        """The checkpoint directory: `model`, else the model that ships with the package."""
        return self.model or default_model_path()

    def create_cache_config(self) -> CacheConfig:
        return CacheConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(CacheConfig)})

    def create_engine_config(self, model_config: ModelConfig | None = None) -> FDConfig:
        """The `FDConfig` of these options and the checkpoint (or of `model_config`, a config built
        without one: benchmarks); a `ValueError` names a bad value (an `OSError` a missing model).
        Tensor parallelism is checked before any weight loads."""
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be a positive integer, got {self.max_num_seqs!r}")
        timeout = self.logits_processor_timeout_s
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"logits_processor_timeout_s: must be >= 0 (0 or None: no limit), got {timeout!r}")
        limits = self.sequence_limits()
        cache_config = self.create_cache_config()
        device = self.device or default_device()
        model_config = model_config or ModelConfig.from_pretrained(self.model_path)
        check_tensor_parallel(model_config, device, self.tensor_parallel_size,  # before any weight loads
                              launched=self.tensor_parallel_address is not None)
        if self.tensor_parallel_address is not None:
            check_launched_ranks(self.tensor_parallel_address, self.tensor_parallel_size)
        model_config = _with_dtype(model_config, self.dtype, self.quantization, device)
        if self.deterministic:
            _check_deterministic(model_config, device)
        if model_config.quantization == "wint4":
            wint4_format(self.wint4_group_size)  # refuses another group size, naming it
            model_config = dataclasses.replace(model_config, wint4_group=self.wint4_group_size)
        return FDConfig(model_config=model_config, cache_config=cache_config, max_num_seqs=self.max_num_seqs,
                        max_model_len=_max_model_len(model_config, self.max_model_len), device=device,
                        logits_processors=tuple(self.logits_processors or ()),
                        guided_decoding_backend=self.guided_decoding_backend, fast_forward=self.fast_forward,
                        cpu_threads=self.cpu_threads, logits_processor_timeout_s=timeout or None,
                        guided_whitespace_pattern=self.guided_whitespace_pattern,
                        guided_close_on_length=self.guided_close_on_length,
                        guided_json_number_digits=self.guided_json_number_digits,
                        reasoning_parser=self.reasoning_parser, tensor_parallel_size=self.tensor_parallel_size,
                        tensor_parallel_address=self.tensor_parallel_address,
                        speculative_config=SpeculativeConfig.from_value(self.speculative_config),
                        kv_events_config=KVEventsConfig.from_value(self.kv_events_config, self.enable_prefix_caching),
                        tokenizer_dir=self.tokenizer, sequence_limits=limits, deterministic=self.deterministic,
                        lora_config=LoRAConfig.from_args(self, model_config))

    def sequence_limits(self) -> SequenceLimits:
        """The request limits of these options; a `ValueError` names a bad one."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(SequenceLimits)}
        for name, value in values.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.max_n > MAX_N:
            raise ValueError(f"max_n: at most {MAX_N}, got {self.max_n}")
        return SequenceLimits(**values)


def _check_deterministic(model_config: ModelConfig, device: str) -> None:
    """Refuse what `--deterministic` cannot make batch-invariant, naming why (docs/deterministic.md)."""
    why = None
    if not device.startswith("cpu"):
        why = f"it runs on this engine's CPU kernels, and the device is {device}"
    elif model_config.hidden_act not in ("silu", "swish"):
        why = (f"hidden_act={model_config.hidden_act!r} runs in Paddle's elementwise ops, whose split between "
               f"vector and scalar code depends on the tensor's size (the kernels' swiglu covers silu only)")
    if why:
        raise ValueError(f"deterministic: cannot be batch-invariant here: {why}")


def _with_dtype(model_config: ModelConfig, dtype: str | None, quantization: str | None, device: str) -> ModelConfig:
    """The checkpoint's config with how its weights are held and the dtype the engine computes in."""
    quantization = normalize_quantization(quantization)
    if model_config.file_format == "gguf":
        return _gguf_dtype(model_config, dtype, quantization, device)
    weight_dtype = normalize_dtype(model_config.checkpoint_dtype if dtype in (None, "auto") else dtype)
    if quantization == "wint4" and not device.startswith("cpu"):
        raise ValueError(f"quantization: wint4 runs on cpu (its kernels are CPU kernels), not on {device}")
    if quantization and not device.startswith(("cpu", "gpu")):
        raise ValueError(f"quantization: {quantization} runs on cpu and gpu, not on {device}; "
                         f"there use dtype bfloat16 or float16")
    if quantization and device.startswith("gpu") and weight_dtype not in ("bfloat16", "float16"):
        # Paddle's weight_only_linear multiplies float16/bfloat16 activations only.
        raise ValueError(f"quantization: {quantization} on GPU computes in bfloat16 or float16, and dtype is "
                         f"{weight_dtype}; pass dtype bfloat16 (--dtype bfloat16) or float16")
    compute = weight_dtype
    if device.startswith("cpu") and weight_dtype != "float32":
        # Paddle's CPU matmul has no bfloat16/float16 kernels: compute in float32, keep the
        # weights as they are (the CPU linear kernels widen them in registers).
        logger.info("dtype %s: weights held as %s, computing in float32 on CPU", weight_dtype, weight_dtype)
        compute = "float32"
    return dataclasses.replace(model_config, dtype=compute, weight_dtype=weight_dtype, quantization=quantization)


def _gguf_dtype(model_config: ModelConfig, dtype: str | None, quantization: str | None, device: str) -> ModelConfig:
    """A GGUF file's weights stay in the file's types and the engine computes in float32, on CPU."""
    if not device.startswith("cpu"):
        raise ValueError(f"model: GGUF weights run on cpu (their kernels are CPU kernels), not on {device}; "
                         f"pass --device cpu")
    if dtype not in (None, "auto") and normalize_dtype(dtype) != "float32":
        raise ValueError(f"dtype: a GGUF model keeps its weights in the file's types ({', '.join(model_config.tensor_types)}) "
                         f"and computes in float32; pass dtype auto, not {dtype!r}")
    if quantization:
        raise ValueError(f"quantization: a GGUF model is already quantized ({', '.join(model_config.tensor_types)}); "
                         f"pass none, not {quantization!r}")
    held = next((kind for kind in model_config.tensor_types if kind != "F32"), "F32")
    return dataclasses.replace(model_config, dtype="float32", weight_dtype=held, quantization="gguf")


def _max_model_len(model_config: ModelConfig, wanted: int | None) -> int:
    """The context length: `wanted`, else the model's at most MAX_MODEL_LEN_CAP; within a sliding window."""
    limit = model_config.max_position_embeddings
    max_model_len = wanted or min(limit, MAX_MODEL_LEN_CAP)
    window = model_config.sliding_window
    if window is not None and max_model_len > window:
        # Every layer attends to the whole context here; capping the length keeps that exact.
        logger.warning("the checkpoint uses sliding-window attention (%d); max_model_len %d is capped to it",
                       window, max_model_len)
        max_model_len = window
    if not isinstance(max_model_len, int) or not 1 < max_model_len <= limit:
        raise ValueError(f"max_model_len: must be an integer in 2..{limit} (the model's "
                         f"max_position_embeddings), got {max_model_len!r}")
    return max_model_len
