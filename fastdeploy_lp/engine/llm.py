"""The offline API: `LLM(...).generate()` and `.chat()`, FastDeploy's shapes and argument names."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from tqdm import tqdm

from fastdeploy_lp import envs
from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.engine.engine import LLMEngine
from fastdeploy_lp.engine.request import RequestOutput
from fastdeploy_lp.options import options, signature_of
from fastdeploy_lp.processors.builtin.tool_execution import load_tool_functions
from fastdeploy_lp.processors.context import EngineContext
from fastdeploy_lp.processors.custom_backends import load_custom_backends
from fastdeploy_lp.reasoning import get_reasoning_parser
from fastdeploy_lp.model.lora import LORA_NAME, LoRARequest
from fastdeploy_lp.sampling_params import SamplingParams
from fastdeploy_lp.tokenizer.chat_template import render_chat_prompt

logger = logging.getLogger(__name__)

Prompt = str | list[int]
BUILTIN_GUIDED_DECODING_BACKENDS = ("llguidance", "off")


def build_engine(args: EngineArgs, *, data_parallel_rank: int = 0) -> LLMEngine:
    """The one place an engine is built: the server (from its flags) and `LLM()` (from its arguments).

    Cheap checks come first (`build_context`), so a bad value fails before the checkpoint loads.
    `tensor_parallel_size` > 1 splits the model over that many processes (docs/distributed.md);
    its checks also run before any weight loads. One engine: `data_parallel_size` > 1 is the
    server's (`engine/data_parallel.py` runs this in each engine process).
    """
    if args.data_parallel_size != 1:
        raise ValueError(f"data_parallel_size: {args.data_parallel_size} engines run behind the server "
                         "(--data-parallel-size); LLM() and build_engine run one")
    context = build_context(args)
    return LLMEngine(context.config, context, data_parallel_rank=data_parallel_rank)


def build_context(args: EngineArgs) -> EngineContext:
    """The `FDConfig` and runtime objects of `args`, without the model's weights: the checks of the
    processor list, guided-decoding backend, reasoning parser and tool functions, then the config
    and tokenizer. Custom guided-decoding backends are loaded here from their directory (or taken
    as given, a dict of `CustomBackend`s). Every error is a `ValueError` (or `OSError` for a missing
    model) naming the argument."""
    if args.logits_processors is not None and not isinstance(args.logits_processors, (list, tuple)):
        raise ValueError("logits_processors: must be a list of processor names")
    custom = args.custom_guided_decoding_backends or {}
    if isinstance(custom, str):
        custom = load_custom_backends(custom, args.trust_custom_code or envs.get_flag("FDLP_TRUST_CUSTOM_CODE"))
    backend = args.guided_decoding_backend
    if backend not in BUILTIN_GUIDED_DECODING_BACKENDS and backend not in custom:
        raise ValueError(f"guided_decoding_backend: unknown backend {backend!r}; available: "
                         f"{', '.join([*BUILTIN_GUIDED_DECODING_BACKENDS, *custom])}")
    get_reasoning_parser(args.reasoning_parser)  # an unknown name fails here, naming the choices
    tools = load_tool_functions(args.tool_functions)
    fd_config = args.create_engine_config()
    return EngineContext.load(fd_config, tools, custom)


def _engine_args(args: tuple, kwargs: dict[str, Any]) -> EngineArgs:
    """`EngineArgs` of `LLM()`'s arguments (the model may come first, unnamed); a name that is not
    an option is a `ValueError`."""
    known = {f.name for f in options(EngineArgs)}
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        raise ValueError(f"{unknown[0]}: not an LLM() argument")
    if len(args) > 1:
        raise ValueError("LLM(): only model may be given without its name")
    return EngineArgs(*args, **kwargs)


class LLM:
    """Offline batched generation.

        llm = LLM(logits_processors=["LogitBiasLogitsProcessor"])
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=32))
        print(out[0].outputs.text)

    The keyword arguments are `EngineArgs`' fields (`help(EngineArgs)` documents each; the server's
    flags are the same options). `model` defaults to the model that ships with the package.
    `tool_functions` (a dict of callables, or `"pkg.module:REGISTRY"`) serves
    `ToolExecutionLogitsProcessor`. `engine_worker_queue_port` and `cache_queue_port` are accepted
    (and unused) so FastDeploy snippets run.

    `tensor_parallel_size=N` splits the model over N worker processes started with
    `paddle.distributed.spawn` (docs/distributed.md): a script doing that needs the usual
    `if __name__ == "__main__":` guard. If a worker dies, `generate` raises `RuntimeError`; the
    workers stop when the `LLM` is collected or the interpreter exits.
    """

    def __init__(self, *args: Any, **kwargs: Any):  # the signature is EngineArgs' (set below)
        self.engine = build_engine(_engine_args(args, kwargs))
        self.fd_config = self.engine.fd_config
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One `RequestOutput` per prompt (per choice when `n > 1`), in the order given. With
        `lora_request` (vLLM's `LoRARequest`, one for all prompts or one per prompt, None: the base
        model) the prompts run with that adapter, loaded at its first use (needs `enable_lora`)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts: must not be empty")
        if lora_request is not None:
            sampling_params = self._with_adapters(len(prompts), sampling_params, lora_request)
        return self._run(prompts, sampling_params, use_tqdm)

    def _with_adapters(self, count: int, sampling_params, lora_request) -> list[SamplingParams]:
        """Each prompt's parameters naming its adapter (`model/lora.py`), the adapters loaded."""
        loras = getattr(self.engine.runner, "loras", None)
        if loras is None:
            raise ValueError("lora_request: LoRA is off on this engine (LLM(..., enable_lora=True))")
        adapters = [lora_request] * count if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(adapters) != count:
            raise ValueError(f"lora_request: got {len(adapters)} for {count} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * count
        params = []
        for adapter, p in zip(adapters, sampling_params):
            p = p.clone()
            if adapter is not None:
                loras.load(adapter.lora_name, adapter.lora_path)
                p.extra[LORA_NAME] = adapter.lora_name
            params.append(p)
        return params

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate
        (`lora_request` as in `generate`)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list of messages or of conversations")
        conversations = messages if isinstance(messages[0], list) else [messages]
        prompts = [render_chat_prompt(self.tokenizer, c, tools=tools, chat_template_kwargs=chat_template_kwargs)
                   for c in conversations]
        if lora_request is not None:
            sampling_params = self._with_adapters(len(prompts), sampling_params, lora_request)
        # The template writes any BOS itself, so the tokenizer must not add another.
        return self._run(prompts, sampling_params, use_tqdm, add_special_tokens=False)

    def speculative_stats(self) -> dict[str, Any]:
        """Speculative decoding since this `LLM` started: `method` (None when off), `drafted_tokens`,
        `accepted_tokens`, `acceptance_rate`, `verify_passes`, `requests_not_speculating`,
        `backoffs`, `paused_steps`, `forced_tokens` (the numbers /metrics serves)."""
        return self.engine.speculative_stats()

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefix blocks no request holds (between `generate` calls: all), as vLLM's
        `LLM.reset_prefix_cache`; with KV events on, routers hear `AllBlocksCleared`."""
        self.engine.reset_prefix_cache()

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


# `help(LLM)`, IDEs and `inspect.signature(LLM)` show EngineArgs' fields and defaults.
LLM.__init__.__signature__ = signature_of(EngineArgs, first="self")
