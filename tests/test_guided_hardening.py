"""Hostile constraints: no grammar crashes or stalls the process, compiles stay within their limit
and stop using CPU when they run out of it, and no constrained request ends with text its
constraint rejects. Real llguidance, real compile-worker processes, the qwen2 fixture tokenizer.

Each hostile case runs once: compile workers take about 0.1 s to start and each case costs at
most the (short) compile limit used here."""

from __future__ import annotations

import gc
import os
import signal
import time

import llguidance as llg
import pytest
from conftest import fixture_dir

from fastdeploy_lp import LLM, GuidedDecodingParams, SamplingParams
from fastdeploy_lp.processors.guided.compiler import GrammarCompiler, GuidedDecodingError
from fastdeploy_lp.processors.guided.sandbox import CompileSandbox
from fastdeploy_lp.processors.guided.tokenizer import build_lltokenizer, lltokenizer_spec
from fastdeploy_lp.tokenizer import Tokenizer

LIMIT_S = 2.0
SLACK_S = 1.5  # a bound on a hang, not a performance target
PROMPT = "What is the capital of France?"


def chained_lark(n: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(n)) + f'\nr{n}: "z"\n'


def chained_gbnf(n: int) -> str:
    return "root ::= r0\n" + "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(n)) + f'\nr{n} ::= "z"\n'


@pytest.fixture(scope="module")
def vocabulary():
    tok = Tokenizer(fixture_dir("qwen2"))
    eos = [tok.eos_token_id]
    return tok, build_lltokenizer(tok, tok.vocab_size, eos), lltokenizer_spec(tok, tok.vocab_size, eos)


@pytest.fixture(scope="module")
def compiler(vocabulary):
    _, lltokenizer, spec = vocabulary
    c = GrammarCompiler(lltokenizer, compile_timeout_s=LIMIT_S, tokenizer_spec=spec, workers=2)
    assert c.sandbox.wait_ready(30)
    return c


@pytest.fixture(scope="module")
def llm():
    return LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _refused(compiler, gd, field: str) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(GuidedDecodingError) as info:
        compiler.compile(gd)
    elapsed = time.monotonic() - start
    assert str(info.value).startswith(f"{field}: "), str(info.value)
    assert elapsed < LIMIT_S + SLACK_S, elapsed
    return str(info.value), elapsed


def _compiles(compiler, other: str) -> None:
    """A normal constraint compiles (`other` makes it one the cache has not seen)."""
    m = compiler.compile(GuidedDecodingParams(regex=f"(Paris|{other})")).new_matcher()
    assert m.consume_tokens(compiler.lltokenizer.tokenize_str("Paris")) and m.is_accepting()


# -- grammars never crash the process ------------------------------------------------------------
def test_deeply_chained_lark_grammar_crashes_a_worker_not_the_process(compiler):
    pids = set(compiler.sandbox.worker_pids())
    crashed = compiler.sandbox.crashed
    message, _ = _refused(compiler, GuidedDecodingParams(grammar=chained_lark(3000)), "guided_grammar")
    assert "too large or too deeply nested" in message and "SIGSEGV" in message
    assert compiler.sandbox.crashed == crashed + 1
    dead = pids - set(compiler.sandbox.worker_pids())
    assert len(dead) == 1 and not _alive(dead.pop())  # reaped: no zombie
    _compiles(compiler, "Rome")  # the pool goes on (a new worker replaces the dead one)
    assert compiler.sandbox.wait_ready(30) and len(compiler.sandbox.worker_pids()) == 2
    # the crash is cached like any other verdict on the grammar: no worker dies for it again
    _refused(compiler, GuidedDecodingParams(grammar=chained_lark(3000)), "guided_grammar")
    assert compiler.sandbox.crashed == crashed + 1


def test_grammar_the_worker_accepted_is_built_in_process(compiler):
    # 2,500 chained rules need ~7 MiB of stack: within a worker's 8 MiB, and the server builds
    # on threads with 32 MiB.
    m = compiler.compile(GuidedDecodingParams(grammar=chained_lark(2500))).new_matcher()
    assert m.consume_tokens(compiler.lltokenizer.tokenize_str("a" * 2500 + "z")) and m.is_accepting()


def test_gbnf_conversion_past_the_limit_is_refused_and_its_worker_killed(compiler):
    # ~50 s of pure-Python GBNF -> Lark conversion: it must end at the limit, and its CPU with it.
    pids = set(compiler.sandbox.worker_pids())
    killed = compiler.sandbox.killed
    message, elapsed = _refused(compiler, GuidedDecodingParams(grammar=chained_gbnf(10000)), "guided_grammar")
    assert "took longer than 2 s" in message and elapsed >= LIMIT_S * 0.9
    assert compiler.sandbox.killed == killed + 1
    dead = pids - set(compiler.sandbox.worker_pids())
    assert len(dead) == 1
    pid = dead.pop()
    assert not _alive(pid) and not os.path.exists(f"/proc/{pid}")  # killed and reaped: no CPU, no zombie
    _compiles(compiler, "Berlin")


def test_queueing_for_a_worker_counts_against_the_limit(vocabulary):
    _, lltokenizer, spec = vocabulary
    c = GrammarCompiler(lltokenizer, compile_timeout_s=LIMIT_S, tokenizer_spec=spec, workers=1)
    assert c.sandbox.wait_ready(30)
    with c.sandbox._cond:
        worker = c.sandbox._idle.pop()  # as if the only worker were busy with another compile
    try:
        message, elapsed = _refused(c, GuidedDecodingParams(regex="x+"), "guided_regex")
        assert "compile workers stayed busy" in message and elapsed >= LIMIT_S * 0.9
    finally:
        with c.sandbox._cond:
            c.sandbox._idle.append(worker)
            c.sandbox._cond.notify()
    c.compile(GuidedDecodingParams(regex="x+"))  # not cached: it compiles once a worker is free


def test_a_worker_killed_while_idle_costs_no_request_its_answer(compiler):
    assert compiler.sandbox.wait_ready(30)
    for pid in compiler.sandbox.worker_pids():  # e.g. the OOM killer, or an operator
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    _compiles(compiler, "Madrid")  # retried on a fresh worker, not blamed on the constraint
    assert compiler.sandbox.wait_ready(30)


def test_workers_are_stopped_when_the_pool_is_collected(vocabulary):
    sandbox = CompileSandbox(vocabulary[2], workers=1)
    assert sandbox.wait_ready(30)
    (pid,) = sandbox.worker_pids()
    with open(f"/proc/{pid}/maps") as f:
        assert "paddle" not in f.read()  # workers load llguidance, not the engine
    del sandbox
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:  # its start-up thread may still hold it briefly
        gc.collect()
        time.sleep(0.05)
    assert not _alive(pid)


# -- no silent constraint violations ------------------------------------------------------------
def _refused_or_correct(llm, gd, field, accepts):
    """Through the engine: a 400-style error at admission, or an output the constraint accepts —
    never an empty 'stop'."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, guided_decoding=gd) for s in range(2)]
    try:
        outs = llm.generate([PROMPT] * 2, params, use_tqdm=False)
    except ValueError as e:
        assert str(e).startswith(f"{field}: "), str(e)
        return str(e)
    for out in outs:
        assert out.outputs.finish_reason in ("stop", "length"), out.outputs.error
        assert out.outputs.text and accepts(out.outputs.text, out.outputs.finish_reason == "stop"), out.outputs.text
    return None


def test_regex_with_a_million_forced_characters_is_refused_or_followed(llm):
    error = _refused_or_correct(llm, GuidedDecodingParams(regex="(a{1000}){1000}"), "guided_regex",
                                lambda text, done: set(text) == {"a"} and not done)
    assert error is None or "lexer" in error  # refused: llguidance's lexer limit, named at compile time


def test_gbnf_with_ten_thousand_alternatives_is_refused_or_followed(llm):
    words = {f"w{i}" for i in range(10000)}
    grammar = "root ::= " + " | ".join(f'"{w}"' for w in sorted(words))
    error = _refused_or_correct(llm, GuidedDecodingParams(grammar=grammar), "guided_grammar",
                                lambda text, done: text in words if done else any(w.startswith(text) for w in words))
    assert error is None or "2000" in error  # refused: llguidance's parser row limit, named


def test_choice_with_many_options_is_followed(llm):
    # llguidance's own choice grammar hits the same row limit past 2,000 options; ours is one lexeme
    options = [f"option {i}" for i in range(5000)]
    gd = GuidedDecodingParams(choice=options)
    outs = llm.generate([PROMPT] * 2, [SamplingParams(temperature=1.0, seed=s, max_tokens=16, guided_decoding=gd)
                                       for s in range(2)], use_tqdm=False)
    assert all(o.outputs.finish_reason == "stop" and o.outputs.text in options for o in outs), \
        [(o.outputs.text, o.outputs.error) for o in outs]


def test_matcher_error_while_filling_a_mask_fails_the_request(llm, monkeypatch):
    # An ambiguous grammar whose Earley items per mask grow with the output: with a low item limit
    # the matcher errs inside a mask fill after ~10 tokens, and llguidance's mask is then EOS
    # alone. The request must fail ("error"), not stop with a text the grammar has not finished.
    # (EOS is biased away so that the model does not end the output on its own before that.)
    monkeypatch.setattr(llm.engine.pipeline.processors[0].compiler, "limits", llg.LLParserLimits(step_max_items=2000))
    gd = GuidedDecodingParams(grammar='start: e\ne: e e | e e e | /[a-z]/\n// mask-limit test')
    no_eos = {t: -100.0 for t in llm.engine.eos_token_ids}
    outs = llm.generate([PROMPT] * 2, [SamplingParams(temperature=1.0, seed=s, max_tokens=64, logit_bias=no_eos,
                                                      guided_decoding=gd) for s in range(2)], use_tqdm=False)
    for out in outs:
        assert out.outputs.finish_reason == "error", (out.outputs.text, out.outputs.finish_reason)
        assert "guided decoding" in out.outputs.error and "Too many items" in out.outputs.error, out.outputs.error
        assert out.outputs.text.isalpha()  # what was generated before the failure fits the grammar


def test_forced_tokens_the_matcher_cannot_take_fail_the_request(llm):
    # Free first tokens (so the compile-time probe passes), then a forced " is w" that enters a rule
    # with 3,000 alternatives: consuming it exceeds llguidance's 2,000 items per row.
    alternatives = " | ".join(f'"w{i}"' for i in range(3000))
    gd = GuidedDecodingParams(grammar=f'start: ("a"|"b") ("a"|"b") ("a"|"b") " is " big\nbig: {alternatives}')
    outs = llm.generate([PROMPT] * 2, [SamplingParams(temperature=1.0, seed=s, max_tokens=30, guided_decoding=gd)
                                       for s in range(2)], use_tqdm=False)
    for out in outs:
        assert out.outputs.finish_reason == "error", (out.outputs.text, out.outputs.finish_reason)
        assert "guided decoding" in out.outputs.error and "2000" in out.outputs.error, out.outputs.error
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=0, max_tokens=16,
                                                guided_decoding=GuidedDecodingParams(regex="(Paris|London)")),
                       use_tqdm=False)[0]
    assert out.outputs.text in ("Paris", "London")  # the engine goes on


@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}])
def test_a_ref_loop_with_no_way_out_says_so(compiler, schema):
    message, _ = _refused(compiler, GuidedDecodingParams(json=schema), "guided_json")
    assert "no output can ever satisfy it" in message, message
