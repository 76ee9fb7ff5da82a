"""The engine config is frozen values; the runtime objects (tokenizer, tool functions, custom
backends) live in the engine's `EngineContext`, and a processor gets them by declaring
`uses_engine_context` (docs/logits_processors.md)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from conftest import fixture_dir

from fastdeploy_lp import LLM, FDConfig, SamplingParams
from fastdeploy_lp.processors import EngineContext, LogitsProcessor, build_processor
from fastdeploy_lp.tokenizer import Tokenizer

TOOLS = {"double": lambda x: 2 * x}


class TokenizerReader(LogitsProcessor):
    """A custom processor written the documented way: it asks for the engine context."""

    uses_engine_context = True

    def __init__(self, fd_config: FDConfig, context: EngineContext) -> None:
        super().__init__(fd_config)
        self.context = context
        self.tokenizer = context.tokenizer
        self.seen: list[str] = []

    def update_state(self, share_inputs):
        for ids, stopped in zip(share_inputs["output_ids"], share_inputs["stop_flags"]):
            if not stopped:
                self.seen.append(self.tokenizer.decode(list(ids)))


class FastDeployStyle(LogitsProcessor):
    """FastDeploy's signature, unchanged: built as `cls(fd_config)`."""

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self.vocab_size = fd_config.model_config.vocab_size

    def update_state(self, share_inputs):
        pass


class OldTokenizerAccess(LogitsProcessor):
    """A processor written against the old config, which carried the tokenizer."""

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self.tokenizer = fd_config.tokenizer

    def update_state(self, share_inputs):
        pass


@pytest.fixture(scope="module")
def config() -> FDConfig:
    return FDConfig.create(fixture_dir("qwen2"), max_num_seqs=2, device="cpu")


def test_fd_config_is_frozen_and_a_change_is_a_new_config(config):
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.fast_forward = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tokenizer = object()
    changed = dataclasses.replace(config, fast_forward=not config.fast_forward)
    assert changed.fast_forward != config.fast_forward and isinstance(config.logits_processors, tuple)


def test_fd_config_holds_no_runtime_objects_and_pickles_for_tensor_parallel_workers(config):
    fields = {f.name for f in dataclasses.fields(FDConfig)}
    assert not fields & {"tokenizer", "tool_functions", "custom_guided_decoding_backends"}
    assert pickle.loads(pickle.dumps(config)) == config


def test_the_old_fd_config_tokenizer_access_names_the_new_way(config):
    with pytest.raises(AttributeError, match=r"uses_engine_context = True.*context\.tokenizer"):
        OldTokenizerAccess(config)
    assert getattr(config, "tokenizer", None) is None  # defensive readers see it absent
    with pytest.raises(AttributeError, match="no attribute 'no_such_field'"):
        config.no_such_field


def test_a_custom_processor_gets_the_engines_tokenizer_and_tools_through_the_context():
    llm = LLM(fixture_dir("qwen2"), max_num_seqs=2, device="cpu", tool_functions=TOOLS,
              logits_processors=["test_engine_context:TokenizerReader", "test_engine_context:FastDeployStyle"])
    reader, plain = llm.engine.pipeline.processors[-2:]
    assert reader.tokenizer is llm.tokenizer and reader.context is llm.engine.context
    assert reader.context.config is llm.fd_config and reader.fd_config is llm.fd_config
    assert reader.context.tool_functions["double"](21) == 42
    assert plain.vocab_size == llm.fd_config.model_config.vocab_size
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert reader.seen[-1] == llm.tokenizer.decode(list(out.outputs.token_ids[:-1]))


def test_the_context_is_read_only_and_never_shares_the_callers_dicts(config):
    tools = dict(TOOLS)
    context = EngineContext(config, Tokenizer(config.model_config.model), tools, {})
    tools["late"] = print
    assert "late" not in context.tool_functions
    with pytest.raises(TypeError):
        context.tool_functions["late"] = print
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.tokenizer = None
    assert isinstance(build_processor(TokenizerReader, context), TokenizerReader)
    assert isinstance(build_processor(FastDeployStyle, context), FastDeployStyle)
