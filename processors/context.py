"""`EngineContext`: the engine's runtime objects, beside its frozen `FDConfig`.

The config says how the engine runs and pickles to tensor-parallel workers; the tokenizer, the
operator's tool functions and the loaded custom guided-decoding backends are live objects of one
process, so they live here instead. A processor that needs them declares `uses_engine_context` and
is built as `cls(fd_config, context)`; every other processor keeps FastDeploy's `cls(fd_config)`:

    class EchoTokenizer(LogitsProcessor):
        uses_engine_context = True

        def __init__(self, fd_config: FDConfig, context: EngineContext) -> None:
            super().__init__(fd_config)
            self.eos = context.tokenizer.eos_token_id
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fastdeploy_lp.config import FDConfig
from fastdeploy_lp.processors.base import LogitsProcessor
from fastdeploy_lp.processors.custom_backends import CustomBackend
from fastdeploy_lp.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineContext:
    """One engine's config and the runtime objects that are no part of it. Built once per engine
    (`LLMEngine.context`); the mappings are read-only views, and the context never leaves the process."""

    config: FDConfig
    tokenizer: Tokenizer
    tool_functions: Mapping[str, Callable[..., Any]]  # for ToolExecutionLogitsProcessor
    custom_guided_decoding_backends: Mapping[str, CustomBackend]  # name -> backend

    def __post_init__(self) -> None:
        # Copies behind read-only views: a caller's dict changed later must not change the engine.
        object.__setattr__(self, "tool_functions", MappingProxyType(dict(self.tool_functions)))
        object.__setattr__(self, "custom_guided_decoding_backends",
                           MappingProxyType(dict(self.custom_guided_decoding_backends)))

    @classmethod
    def load(cls, config: FDConfig, tool_functions: Mapping[str, Callable[..., Any]] | None = None,
             custom_guided_decoding_backends: Mapping[str, CustomBackend] | None = None) -> "EngineContext":
        """The context of `config` with its checkpoint's tokenizer (and no tools or backends unless given)."""
        return cls(config, Tokenizer(config.tokenizer_dir or config.model_config.model), tool_functions or {},
                   custom_guided_decoding_backends or {})


def build_processor(cls: type[LogitsProcessor], context: EngineContext) -> LogitsProcessor:
    """An instance of `cls`: `cls(fd_config, context)` if it declares `uses_engine_context`, else
    FastDeploy's `cls(fd_config)`, so processors written for FastDeploy run unchanged."""
    if cls.uses_engine_context:
        return cls(context.config, context)
    return cls(context.config)
