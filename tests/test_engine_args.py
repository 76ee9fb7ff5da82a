"""`EngineArgs` and `ServerArgs` are the only place an option's default is written: the server's
flags, `LLM()`'s signature and `docs/server.md`'s tables are generated from them and agree, no other
signature or dataclass of the package repeats one of their options with a default of its own, and
every environment variable is declared once under `FDLP_` (the old names still read, with a warning)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
import os

import pytest
from test_import_graph import package_files

from fastdeploy_lp import LLM, envs
from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.entrypoints.openai.args import ServerArgs, make_parser, with_generated_tables
from fastdeploy_lp.options import default_of, options

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
# Where the options are written: the only modules allowed to give one of them a default.
OWNERS = {"fastdeploy_lp.config", "fastdeploy_lp.entrypoints.openai.args"}
# Names shared with an option that mean something else there (a request field's None is "not set"
# and is not checked at all).
OTHER_MEANING = {
    ("fastdeploy_lp.model_config", "dtype"): "the dtype the engine computes in, derived from the option",
    ("fastdeploy_lp.model.cpu_features", "model"): "the CPU's model name",
    ("fastdeploy_lp.processors.tensor_ops", "dtype"): "a tensor's dtype",
    ("fastdeploy_lp.processors.step_view", "dtype"): "numpy's __array__ protocol",
    ("fastdeploy_lp.processors.token_history", "device"): "whether the history lives on the device",
}


def test_the_docs_tables_are_the_generated_ones():
    with open(os.path.join(DOCS, "server.md"), encoding="utf-8") as f:
        text = f.read()
    assert "<!-- generated: flags" in text and "<!-- generated: environment" in text
    assert with_generated_tables(text) == text, \
        "docs/server.md is out of step: python -m fastdeploy_lp.entrypoints.openai.args --write-docs docs/server.md"


def test_the_parser_has_each_option_with_its_default():
    parsed = vars(make_parser().parse_args([]))
    fields = options(EngineArgs) + options(ServerArgs)
    assert sorted(parsed) == sorted(f.name for f in fields)
    for f in fields:
        assert parsed[f.name] == default_of(f), f.name


def test_llm_takes_exactly_the_engine_args_with_their_defaults():
    params = list(inspect.signature(LLM).parameters.values())
    assert [p.name for p in params] == [f.name for f in options(EngineArgs)]
    assert all(p.default == default_of(f) for p, f in zip(params, options(EngineArgs)))
    with pytest.raises(ValueError, match="^no_such_option: not an LLM\\(\\) argument"):
        LLM(no_such_option=1)


def test_flags_become_engine_args_under_the_same_names():
    from fastdeploy_lp.options import from_namespace

    ns = make_parser().parse_args(["--max-num-seqs", "3", "--no-enable-prefix-caching", "-tp", "2",
                                   "--logits-processor-timeout", "0", "--port", "9"])
    args = from_namespace(EngineArgs, ns)
    assert (args.max_num_seqs, args.enable_prefix_caching, args.tensor_parallel_size) == (3, False, 2)
    assert args.logits_processor_timeout_s == 0 and from_namespace(ServerArgs, ns).port == 9


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _defaults_elsewhere(owned: set[str]) -> list[str]:
    """`module:line name` for each parameter or class field named like an owned option that has a
    default other than None, in a module that does not own the options."""
    found = []
    for module, path in package_files().items():
        if module in OWNERS or module.startswith("fastdeploy_lp.entrypoints.openai.protocol"):
            continue  # the protocol modules hold request fields: what a client sends, not options
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                positional = a.posonlyargs + a.args
                pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
                pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                found += [f"{module}:{arg.lineno} {arg.arg}" for arg, d in pairs
                          if arg.arg in owned and not _is_none(d) and (module, arg.arg) not in OTHER_MEANING]
            elif isinstance(node, ast.ClassDef):
                found += [f"{module}:{s.lineno} {s.target.id}" for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                          and s.value is not None and not _is_none(s.value) and s.target.id in owned
                          and (module, s.target.id) not in OTHER_MEANING]
    return found


def test_no_other_signature_or_dataclass_writes_a_default_of_an_option():
    owned = {f.name for f in options(EngineArgs) + options(ServerArgs)}
    assert _defaults_elsewhere(owned) == []


def test_the_derived_configs_have_no_defaults_of_their_own():
    from fastdeploy_lp.config import CacheConfig, FDConfig
    from fastdeploy_lp.entrypoints.openai.api_server import ServerSettings
    from fastdeploy_lp.entrypoints.openai.limits import RequestLimits

    runtime = {"max_model_len"}  # RequestLimits: the engine's, set when the server starts
    for cls in (CacheConfig, FDConfig, ServerSettings, RequestLimits):
        defaulted = [f.name for f in dataclasses.fields(cls)
                     if (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
                     and f.name not in runtime]
        assert defaulted == [], cls.__name__


def test_every_env_var_has_the_one_prefix_and_an_old_name_still_works_with_one_warning(monkeypatch, caplog):
    assert all(name.startswith(envs.PREFIX) for name in envs.ENV_VARS)
    monkeypatch.delenv("FDLP_GUIDED_CACHE_SIZE", raising=False)
    monkeypatch.setenv("FASTDEPLOY_LP_GUIDED_CACHE_SIZE", "7")
    monkeypatch.setattr(envs, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="fastdeploy_lp.envs"):
        assert envs.get_int("FDLP_GUIDED_CACHE_SIZE") == 7
        assert envs.get_int("FDLP_GUIDED_CACHE_SIZE") == 7
    assert [r.getMessage() for r in caplog.records] == [
        "FASTDEPLOY_LP_GUIDED_CACHE_SIZE is deprecated; set FDLP_GUIDED_CACHE_SIZE instead"]
    monkeypatch.setenv("FDLP_GUIDED_CACHE_SIZE", "9")
    assert envs.get_int("FDLP_GUIDED_CACHE_SIZE") == 9


def test_no_module_reads_an_env_var_of_the_package_by_itself():
    for module, path in package_files().items():
        if module == "fastdeploy_lp.envs":
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for name in envs.ENV_VARS:
            assert f'environ.get("{name}"' not in text and f"getenv(\"{name}\"" not in text, (module, name)
        assert "FASTDEPLOY_LP_" not in text, module
