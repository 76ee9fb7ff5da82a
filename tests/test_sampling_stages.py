"""The sampling stages: one list in code (`engine/stages.py: STAGES`) that the engine runs and the
docs print."""

from __future__ import annotations

import os
import re

import numpy as np
import paddle
import pytest
from conftest import fixture_dir

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.engine.request import Request
from fastdeploy_lp.engine.sampler import Sampler
from fastdeploy_lp.engine.stages import STAGES, SamplingStages, stage_order_line, stage_order_markdown

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")
V = 12


def _generated_block(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    found = re.findall(r"<!-- stages[^>]*-->(.*?)<!-- /stages -->", text, flags=re.S)
    assert len(found) == 1, f"{path}: expected one <!-- stages --> ... <!-- /stages --> block"
    return "\n".join(line.strip() for line in found[0].strip().splitlines())


def test_the_docs_print_the_stage_order_from_the_code():
    assert _generated_block(os.path.join(DOCS, "logits_processors.md")) == stage_order_markdown(), (
        "docs/logits_processors.md: replace the stages block with stage_order_markdown()'s output")
    assert _generated_block(os.path.join(DOCS, "zh", "logits_processors.md")) == stage_order_line(), (
        "docs/zh/logits_processors.md: replace the stages block with stage_order_line()'s output")


def test_the_engine_runs_exactly_the_stage_list_in_order():
    llm = LLM(fixture_dir("qwen2"), max_num_seqs=2, device="cpu", logits_processors=["LogitBiasLogitsProcessor"])
    assert [type(stage) for stage in llm.engine.stages.stages] == list(STAGES)
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, logit_bias={7: 100.0}),
                       use_tqdm=False)[0].outputs
    assert out.token_ids == [7, 7, 7]  # the request-level bias stage reached the draw


def test_stage_names_are_unique_and_the_row_by_row_stages_end_the_list_with_the_draw():
    assert len({stage.name for stage in STAGES}) == len(STAGES)
    retried = [stage.retried_row_by_row for stage in STAGES]
    first = retried.index(True)
    assert all(retried[first:]) and STAGES[-1].name == "draw"


class _NoDetok:
    text = ""


def _request(slot, seed, **params):
    return Request(request_id=f"r{slot}", prompt_ids=[1, 2], params=SamplingParams(**params), detokenizer=_NoDetok(),
                   args={}, slot=slot, seed=seed)


def test_a_row_whose_sampling_raises_fails_alone_and_the_others_draw_as_without_it(monkeypatch):
    logits = np.random.default_rng(0).normal(size=(3, V)).astype(np.float32)
    sampler = Sampler(3, V, eos_token_ids=[0], deterministic=False)
    requests = [_request(0, 1, temperature=1.0, top_k=4), _request(1, 13, temperature=1.0), _request(2, 2, logprobs=2)]
    alone = SamplingStages(sampler).sample(paddle.to_tensor(logits[[0, 2]]), [requests[0], requests[2]])
    top_k_top_p = sampler.top_k_top_p

    def raising_for_seed_13(rows):
        if any(r.seed == 13 for r in rows.requests):
            raise RuntimeError("bad row")
        top_k_top_p(rows)

    monkeypatch.setattr(sampler, "top_k_top_p", raising_for_seed_13)
    rows = SamplingStages(sampler).sample(paddle.to_tensor(logits), requests)
    assert rows.failures == {1: "sampling failed: RuntimeError: bad row"}
    assert list(rows.tokens[[0, 2]]) == list(alone.tokens)
    assert rows.logprobs[2] == alone.logprobs[1] and rows.logprobs[0] is None


def test_one_row_whose_sampling_raises_fails_the_pass(monkeypatch):
    sampler = Sampler(1, V, eos_token_ids=[0], deterministic=False)
    monkeypatch.setattr(sampler, "draw", lambda rows: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        SamplingStages(sampler).sample(paddle.zeros([1, V]), [_request(0, 1)])
