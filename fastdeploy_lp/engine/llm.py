"""The offline API: `LLM(...).generate()` and `.chat()`, FastDeploy's shapes and argument names."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from tqdm import tqdm

from fastdeploy_lp.config import CacheConfig, FDConfig
from fastdeploy_lp.engine.engine import LLMEngine
from fastdeploy_lp.engine.request import RequestOutput
from fastdeploy_lp.processors.builtin.tool_execution import load_tool_functions
from fastdeploy_lp.reasoning import get_reasoning_parser
from fastdeploy_lp.sampling_params import SamplingParams
from fastdeploy_lp.tokenizer.chat_template import render_chat_prompt

logger = logging.getLogger(__name__)

Prompt = str | list[int]
BUILTIN_GUIDED_DECODING_BACKENDS = ("llguidance", "off")


def build_engine(model: str | None = None, *, logits_processors: list[str] | tuple[str, ...] | None = None,
                 max_num_seqs: int = 8, max_model_len: int | None = None, device: str | None = None,
                 dtype: str | None = None, guided_decoding_backend: str = "llguidance", fast_forward: bool = True,
                 tool_functions: str | dict | None = None, logits_processor_timeout_s: float | None = 2.0,
                 guided_whitespace_pattern: str | None = None, reasoning_parser: str | None = None,
                 custom_guided_decoding_backends: dict[str, Any] | None = None,
                 cache_config: CacheConfig | None = None, tensor_parallel_size: int = 1,
                 quantization: str | None = None) -> LLMEngine:
    """The one place an engine is built: the server (from its flags) and `LLM()` (from its arguments).

    Cheap checks come first (processor list, guided-decoding backend, reasoning parser, tool
    functions), so a bad value fails before the checkpoint loads. `custom_guided_decoding_backends`
    is a dict of already loaded backends (name -> `CustomBackend`; the server loads them from
    `--custom-guided-decoding-backends`). Every error is a `ValueError` (or `OSError` for a missing
    model) naming the argument. `tensor_parallel_size` > 1 splits the model over that many processes
    (docs/distributed.md); its checks also run before any weight loads.
    """
    if logits_processors is not None and not isinstance(logits_processors, (list, tuple)):
        raise ValueError("logits_processors: must be a list of processor names")
    custom = dict(custom_guided_decoding_backends or {})
    if guided_decoding_backend not in BUILTIN_GUIDED_DECODING_BACKENDS and guided_decoding_backend not in custom:
        raise ValueError(f"guided_decoding_backend: unknown backend {guided_decoding_backend!r}; available: "
                         f"{', '.join([*BUILTIN_GUIDED_DECODING_BACKENDS, *custom])}")
    get_reasoning_parser(reasoning_parser)  # an unknown name fails here, naming the choices
    tools = load_tool_functions(tool_functions)
    fd_config = FDConfig.create(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len, device=device,
                                dtype=dtype, logits_processors=list(logits_processors or []),
                                guided_decoding_backend=guided_decoding_backend, fast_forward=fast_forward,
                                logits_processor_timeout_s=logits_processor_timeout_s,
                                tensor_parallel_size=tensor_parallel_size, quantization=quantization)
    fd_config.custom_guided_decoding_backends = custom
    fd_config.cache_config = cache_config or CacheConfig()
    fd_config.guided_whitespace_pattern = guided_whitespace_pattern
    fd_config.reasoning_parser = reasoning_parser
    fd_config.tool_functions = tools
    return LLMEngine(fd_config)


class LLM:
    """Offline batched generation.

        llm = LLM(logits_processors=["LogitBiasLogitsProcessor"])
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=32))
        print(out[0].outputs.text)

    `model` defaults to the model that ships with the package. `tool_functions` (a dict of
    callables, or `"pkg.module:REGISTRY"`) serves `ToolExecutionLogitsProcessor`. `engine_worker_queue_port` and
    `cache_queue_port` are accepted (and unused) so FastDeploy snippets run.

    `tensor_parallel_size=N` splits the model over N worker processes started with
    `paddle.distributed.spawn` (docs/distributed.md): a script doing that needs the usual
    `if __name__ == "__main__":` guard. If a worker dies, `generate` raises `RuntimeError`; the
    workers stop when the `LLM` is collected or the interpreter exits.
    """

    def __init__(self, model: str | None = None, *, logits_processors: list[str] | None = None,
                 max_num_seqs: int = 8, max_model_len: int | None = None, device: str | None = None,
                 dtype: str | None = None, guided_decoding_backend: str = "llguidance", fast_forward: bool = True,
                 tool_functions: str | dict | None = None, logits_processor_timeout_s: float | None = 2.0,
                 guided_whitespace_pattern: str | None = None, reasoning_parser: str | None = None,
                 engine_worker_queue_port: int | None = None, cache_queue_port: int | None = None,
                 block_size: int = 16, kv_cache_memory: float = 4.0, gpu_memory_utilization: float = 0.9,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 max_num_batched_tokens: int | None = None, num_blocks: int | None = None,
                 tensor_parallel_size: int = 1, quantization: str | None = None, **unsupported: Any):
        if unsupported:
            raise ValueError(f"{next(iter(unsupported))}: not an LLM() argument")
        cache_config = CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                                   gpu_memory_utilization=gpu_memory_utilization,
                                   enable_prefix_caching=enable_prefix_caching,
                                   enable_chunked_prefill=enable_chunked_prefill,
                                   max_num_batched_tokens=max_num_batched_tokens, num_blocks=num_blocks)
        self.engine = build_engine(model, logits_processors=logits_processors, max_num_seqs=max_num_seqs,
                                   max_model_len=max_model_len, device=device, dtype=dtype,
                                   guided_decoding_backend=guided_decoding_backend, fast_forward=fast_forward,
                                   tool_functions=tool_functions, logits_processor_timeout_s=logits_processor_timeout_s,
                                   guided_whitespace_pattern=guided_whitespace_pattern,
                                   reasoning_parser=reasoning_parser, cache_config=cache_config,
                                   tensor_parallel_size=tensor_parallel_size, quantization=quantization)
        self.fd_config = self.engine.fd_config
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One `RequestOutput` per prompt (per choice when `n > 1`), in the order given."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts: must not be empty")
        return self._run(prompts, sampling_params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list of messages or of conversations")
        conversations = messages if isinstance(messages[0], list) else [messages]
        prompts = [render_chat_prompt(self.tokenizer, c, tools=tools, chat_template_kwargs=chat_template_kwargs)
                   for c in conversations]
        # The template writes any BOS itself, so the tokenizer must not add another.
        return self._run(prompts, sampling_params, use_tqdm, add_special_tokens=False)

    def _run(self, prompts, sampling_params, use_tqdm, add_special_tokens=True) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        # Validate every prompt before queueing any, so a bad one leaves the engine untouched.
        requests = [r for prompt, p in zip(prompts, params)
                    for r in self.engine.make_requests(prompt, p, add_special_tokens=add_special_tokens)]
        if self.engine.runner.failure is not None:
            raise RuntimeError(self.engine.runner.failure)
        self.engine.enqueue(requests)
        try:
            return self._collect([r.request_id for r in requests], use_tqdm)
        except BaseException:
            # Interrupted (Ctrl-C) or failed: this call's requests must not run on into the next call.
            self.engine.abort_now([r.request_id for r in requests])
            raise

    def _collect(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        runner = self.engine.runner
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
                if runner.failure is not None:  # a tensor-parallel worker died: nothing more can run
                    raise RuntimeError(runner.failure)
        return [done[i] for i in order]
