"""Every built-in processor documents itself (what it does, its `logits_processors_args` keys, a
runnable example), the examples run, and `GET /v1/logits_processors` shows the documentation."""

from __future__ import annotations

import doctest
import importlib
import inspect

import httpx
import pytest
from server_harness import start_server

from fastdeploy_lp.processors.registry import BUILTIN_PROCESSORS


def builtin(name: str) -> type:
    return getattr(importlib.import_module(BUILTIN_PROCESSORS[name]), name)


@pytest.mark.parametrize("name", list(BUILTIN_PROCESSORS))
def test_each_builtin_documents_what_it_does_its_args_and_an_example(name):
    cls = builtin(name)
    doc = cls.__dict__.get("__doc__")
    assert doc, f"{name} has no docstring of its own"
    doc = inspect.cleandoc(doc)
    summary, _, body = doc.partition("\n\n")
    assert summary and "\n" not in summary, "the first paragraph is a one-line summary"
    assert "\nArgs:\n" in body and "\nExamples:\n" in body and ">>> " in body
    args = body.split("\nArgs:\n")[1].split("\nExamples:\n")[0]
    for key in cls.args_model.model_fields:
        assert f"\n    {key} (`" in "\n" + args, f"Args does not describe {key}"
    assert f'logits_processors=["{name}"]' in body, "the example registers the processor it documents"


@pytest.mark.parametrize("name", list(BUILTIN_PROCESSORS))
def test_each_builtin_example_runs_as_written(name):
    tests = doctest.DocTestFinder(recurse=False).find(builtin(name), name, globs={})
    runner, report = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS), []
    for test in tests:
        runner.run(test, out=report.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(report)
    assert result.attempted >= 4


def test_logits_processors_endpoint_shows_each_processors_docstring():
    names = [*BUILTIN_PROCESSORS, "server_processors:ForceTokenLogitsProcessor"]
    server = start_server("--logits-processors", *names)
    try:
        data = httpx.get(server.url("/v1/logits_processors"), timeout=10).json()["data"]
    finally:
        server.stop()
    listed = {d["name"]: d for d in data}
    assert [d["name"] for d in data if d["source"] == "--logits-processors"] == \
        [*BUILTIN_PROCESSORS, "ForceTokenLogitsProcessor"]
    for name in BUILTIN_PROCESSORS:
        entry, doc = listed[name], inspect.cleandoc(builtin(name).__doc__)
        assert entry["builtin"] is True
        assert entry["doc"] == doc
        assert entry["description"] == doc.split("\n\n")[0]
        assert "Args:" in entry["doc"] and ">>> " in entry["doc"]
    force = listed["ForceTokenLogitsProcessor"]
    assert force["builtin"] is False and force["doc"] == force["description"] == \
        'Makes a request emit one token id forever: `{"force_token": 7}`.'
    if "GuidedDecodingLogitsProcessor" in listed:  # installed by the engine; documented by its module
        assert listed["GuidedDecodingLogitsProcessor"]["doc"]
