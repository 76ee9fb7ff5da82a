"""The offline API applies the server's limits on what one request asks of every step — choices,
stop strings and tokens, bad words — as `ValueError`s naming the field, from the same options
(`LLM(max_n=...)` is `--max-n`), before anything is queued (issue 35, item 8)."""

from __future__ import annotations

import pytest
from conftest import fixture_dir

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.config import EngineArgs

MODEL = fixture_dir("qwen3")


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_num_seqs=2, device="cpu", guided_decoding_backend="off",
               logits_processors=["BadWordsLogitsProcessor"])


@pytest.mark.parametrize("values, message", [
    ({"n": 17}, "n: 17 choices are more than this engine allows per request (16, max_n / --max-n)"),
    ({"stop": [f"s{i}" for i in range(65)]}, "stop: 65 entries are more than this engine allows (64, max_stop"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids: 65 entries"),
    ({"bad_words": [f"w{i}" for i in range(129)]}, "bad_words: 129 entries are more than this engine allows (128"),
    ({"bad_words": ["x" * 129]}, "bad_words[0]: 129 characters, more than this engine allows per entry (128"),
    ({"logits_processors_args": {"bad_words": ["a"] * 129}}, "logits_processors_args.bad_words: 129 entries"),
    ({"logits_processors_args": {"bad_words_token_ids": [[5] * 129]}},
     "logits_processors_args.bad_words_token_ids[0]: 129 token ids"),
])
def test_a_request_over_a_limit_is_refused_naming_the_field_and_nothing_runs(llm, values, message):
    for call in (lambda p: llm.generate(["Hi", "there"], [SamplingParams(max_tokens=2), p], use_tqdm=False),
                 lambda p: llm.chat([{"role": "user", "content": "Hi"}], p, use_tqdm=False)):
        with pytest.raises(ValueError) as e:
            call(SamplingParams(max_tokens=2, **values))
        assert message in str(e.value)
        assert not llm.engine.has_unfinished_requests() and llm.engine.num_waiting == 0


def test_at_the_limit_runs_and_the_limits_are_options_of_llm():
    llm = LLM(MODEL, max_num_seqs=2, device="cpu", guided_decoding_backend="off", max_n=20, max_stop=3)
    outs = llm.generate(["Hi"], SamplingParams(n=20, max_tokens=1, temperature=1.0, stop=["a", "b", "c"]),
                        use_tqdm=False)
    assert len(outs) == 20
    with pytest.raises(ValueError, match="^stop: 4 entries .* \\(3, max_stop / --max-stop\\)"):
        llm.generate(["Hi"], SamplingParams(max_tokens=1, stop=["a", "b", "c", "d"]), use_tqdm=False)
    with pytest.raises(ValueError, match="^max_n: at most 128, got 129"):
        EngineArgs(MODEL, max_n=129).sequence_limits()
