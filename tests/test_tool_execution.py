"""ToolExecutionLogitsProcessor: calls in the generated text run, and their results are forced in."""

from __future__ import annotations

import time

import pytest
from conftest import fixture_dir, load_reference

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.processors import LogitsProcessor
from fastdeploy_lp.processors.builtin.tool_execution import load_tool_functions, parse_call


def _fail(x):
    raise RuntimeError(f"cannot handle {x}")


TOOLS = {"multiply": lambda a, b: a * b, "add": lambda a, b: a + b, "fail": _fail,
         "slow": lambda: time.sleep(5), "nap": lambda: time.sleep(0.5) or "rested"}


class ForceText(LogitsProcessor):
    """Test stand-in for a model that writes calls: forces `force_text[i]` once the output holds
    i results."""

    uses_engine_context = True

    def __init__(self, fd_config, context):
        super().__init__(fd_config)
        self.tokenizer = context.tokenizer
        self.forced: dict[str, int] = {}

    def update_state(self, share_inputs):
        tok = self.tokenizer
        for slot, stopped in enumerate(share_inputs["stop_flags"]):
            rid, args = share_inputs["req_ids"][slot], share_inputs["logits_processors_args"][slot]
            if stopped or not args.force_text:
                continue
            done = self.forced.get(rid, 0)
            results = tok.decode(share_inputs["output_ids"][slot]).count("</results>")
            if done < len(args.force_text) and results == done and not share_inputs["forced_tokens"][slot]:
                share_inputs["forced_tokens"][slot].extend(tok.encode(args.force_text[done]))
                self.forced[rid] = done + 1


@pytest.fixture(scope="module", params=[True, False], ids=["fast-forward", "step-by-step"])
def llm(request):
    return LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu", fast_forward=request.param,
               tool_functions=TOOLS, logits_processors=["test_tool_execution:ForceText", "ToolExecutionLogitsProcessor"])


def _params(*texts, max_tokens=60, **extra):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          logits_processors_args={"force_text": list(texts), "tool_execution": True, **extra})


def test_calls_run_and_results_are_forced_into_the_text(llm):
    prompt = load_reference("qwen2")[0][0]
    outs = llm.generate([prompt, prompt], [_params("<function>multiply(3, 302)</function>"),
                                           _params("<function>add(3, 302)</function>")], use_tqdm=False)
    assert "<function>multiply(3, 302)</function><results>906</results>" in outs[0].outputs.text
    assert "<function>add(3, 302)</function><results>305</results>" in outs[1].outputs.text


def test_errors_become_result_text_and_rows_stay_independent(llm):
    prompt = load_reference("qwen2")[0][1]
    plain = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    params = [_params("<function>nope(1)</function>"), _params("<function>fail(7)</function>", max_tokens=90),
              _params("<function>slow()</function>", tool_timeout=0.2), plain]
    outs = llm.generate([prompt] * 4, params, use_tqdm=False)
    assert "<results>error: unknown function 'nope'</results>" in outs[0].outputs.text
    assert "<results>error: RuntimeError: cannot handle 7</results>" in outs[1].outputs.text
    assert "<results>error: slow timed out after 0.2s</results>" in outs[2].outputs.text
    alone = llm.generate([prompt], plain, use_tqdm=False)[0]
    assert outs[3].outputs.token_ids == alone.outputs.token_ids
    assert all(o.outputs.finish_reason == "length" for o in outs)


def test_several_calls_in_one_generation(llm):
    prompt = load_reference("qwen2")[0][2]
    out = llm.generate([prompt], _params("<function>add(1, 2)</function>", " then <function>multiply(4, 5)</function>",
                                         max_tokens=90), use_tqdm=False)[0].outputs.text
    assert "<function>add(1, 2)</function><results>3</results> then " in out
    assert "<function>multiply(4, 5)</function><results>20</results>" in out


def test_calls_accept_only_literals():
    assert parse_call("multiply(3, b=302)") == ("multiply", [3], {"b": 302})
    with pytest.raises(ValueError):
        parse_call("multiply(__import__('os').getcwd(), 1)")
    with pytest.raises(ValueError, match="tool_functions"):
        load_tool_functions("no_such_module_xyz:REGISTRY")


def test_a_call_within_its_tool_timeout_is_not_cut_by_the_step_time_limit():
    """The server's per-step processor limit (here 0.2 s) does not apply to a call its request
    allowed longer (`tool_timeout`); another processor over that limit still fails its requests."""
    llm = LLM(fixture_dir("qwen2"), max_num_seqs=2, device="cpu", tool_functions=TOOLS, logits_processor_timeout_s=0.2,
              logits_processors=["test_tool_execution:ForceText", "ToolExecutionLogitsProcessor"])
    out = llm.generate([load_reference("qwen2")[0][0]], _params("<function>nap()</function>", tool_timeout=2),
                       use_tqdm=False)[0].outputs
    assert "<function>nap()</function><results>rested</results>" in out.text and out.finish_reason == "length"
