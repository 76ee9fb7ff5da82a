"""Start-up registration errors and per-request args validation, each naming what to change."""

from __future__ import annotations

import pytest
from conftest import fixture_dir
from processor_harness import BUILTINS, context_for

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.processors import BUILTIN_PROCESSORS, LogitsProcessorPipeline, ProcessorLoadError, resolve_processors


@pytest.fixture(scope="module")
def context():
    return context_for("qwen3")


def assert_lists_builtins(message: str):
    for name in BUILTIN_PROCESSORS:
        assert name in message
    assert "package.module:ClassName" in message


@pytest.mark.parametrize("names, why", [
    (["LogitBias"], "unknown built-in"),
    (["no_such_package_xyz.mod:Thing"], "importing 'no_such_package_xyz.mod' failed (ModuleNotFoundError"),
    (["custom_processors:Missing"], "module 'custom_processors' has no attribute 'Missing'"),
    (["custom_processors:NotAProcessor"], "not a subclass of fastdeploy_lp.processors.LogitsProcessor"),
    (["custom_processors:"], "expected 'package.module:ClassName'"),
    (["LogitBiasLogitsProcessor", "BadWordsLogitsProcessor", "LogitBiasLogitsProcessor"], "registered twice"),
    (["LogitBiasLogitsProcessor", "fastdeploy_lp.processors.builtin.logit_bias:LogitBiasLogitsProcessor"],
     "registered twice"),
    ([""], "not a name"),
])
def test_bad_registrations_fail_at_start_up_listing_the_builtins(names, why):
    with pytest.raises(ProcessorLoadError) as err:
        resolve_processors(names)
    assert why in str(err.value)
    assert_lists_builtins(str(err.value))


def test_a_module_that_fails_to_import_is_reported_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "broken_processor_mod.py").write_text("raise RuntimeError('missing dependency foo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ProcessorLoadError, match=r"RuntimeError: missing dependency foo") as err:
        resolve_processors(["broken_processor_mod:Whatever"])
    assert_lists_builtins(str(err.value))


def test_llm_start_up_fails_on_an_unknown_processor():
    with pytest.raises(ProcessorLoadError, match="'NoSuchLogitsProcessor': unknown built-in"):
        LLM(fixture_dir("qwen3"), logits_processors=["NoSuchLogitsProcessor"], device="cpu",
            guided_decoding_backend="off")


def test_every_builtin_resolves_to_its_class():
    assert [c.__name__ for c in resolve_processors(BUILTINS)] == BUILTINS


@pytest.mark.parametrize("args, key, why", [
    ({"logit_bias": {"5": 1.0}, "temprature": 0.5}, "temprature", "no registered logits processor reads this key"),
    ({"custom_processors:YourLogitsProcessor": True}, "custom_processors:YourLogitsProcessor",
     "no registered logits processor reads this key"),  # requests never name code to load
    ({"logit_bias": {"5000": 1.0}}, "logit_bias", "token id 5000 is outside the vocabulary (0..1023)"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias", "keys must be token ids (non-negative integers), got '-1'"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias", "keys must be token ids (non-negative integers), got 'x'"),
    ({"logit_bias": {"1_0": 1.0}}, "logit_bias", "got '1_0'"),  # as the top-level logit_bias: digits only
    ({"logit_bias": {"+5": 1.0}}, "logit_bias", "got '+5'"),
    ({"logit_bias": {" 5": 1.0}}, "logit_bias", "got ' 5'"),
    ({"logit_bias": {"5": "big"}}, "logit_bias.5", "valid number"),
    ({"logit_bias": {"5": float("inf")}}, "logit_bias", "not a finite float32 number"),
    ({"logit_bias": {"5": 1e39}}, "logit_bias", "not a finite float32 number"),
    ({"bad_words": "Paris"}, "bad_words", "valid list"),
    ({"bad_words": [""]}, "bad_words.0", "at least 1 character"),
    ({"bad_words_token_ids": [[3, 1024]]}, "bad_words_token_ids", "token id 1024 is outside the vocabulary"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids", "at least one token id"),
    ({"no_repeat_ngram_size": "3"}, "no_repeat_ngram_size", "valid integer"),
    ({"no_repeat_ngram_size": 0}, "no_repeat_ngram_size", "greater than or equal to 1"),
    ({"allowed_token_ids": [1, 2, 1024]}, "allowed_token_ids", "token id 1024 is outside the vocabulary"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "at least 1 item"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids.0", "valid integer"),
    ({"thinking_budget": -1}, "thinking_budget", "greater than or equal to 0"),
    ({"thinking_budget": 1.5}, "thinking_budget", "valid integer"),
    ({"thinking_budget": 2**63}, "thinking_budget", "less than or equal to 2147483647"),  # never an int64 overflow
    ({"no_repeat_ngram_size": 2**63}, "no_repeat_ngram_size", "less than or equal to 2147483647"),
    ({"think_stop_sentence": "Stop."}, "think_stop_sentence", "think_stop_sentence needs thinking_budget"),
])
def test_bad_args_are_a_value_error_naming_the_key_and_the_registered_processors(args, key, why, context):
    pipeline = LogitsProcessorPipeline(context, BUILTINS)
    with pytest.raises(ValueError) as err:
        pipeline.validate_args(args)
    message = str(err.value)
    assert message.startswith(f"logits_processors_args.{key}") and why in message, message
    assert f"registered processors: {', '.join(BUILTINS)}" in message


def test_args_are_normalised_for_the_processors(context):
    args = LogitsProcessorPipeline(context, BUILTINS).validate_args(
        {"logit_bias": {"7": 2}, "no_repeat_ngram_size": 3})
    assert args.logit_bias == {7: 2.0} and args["no_repeat_ngram_size"] == 3 and args.get("bad_words") is None


def test_generate_rejects_bad_args_before_queueing_anything():
    llm = LLM(fixture_dir("qwen3"), logits_processors=["LogitBiasLogitsProcessor"], device="cpu",
              guided_decoding_backend="off")
    good = SamplingParams(temperature=0, max_tokens=2, logits_processors_args={"logit_bias": {"5": 1.0}})
    bad = SamplingParams(temperature=0, max_tokens=2, logits_processors_args={"no_repeat_ngram_size": 2})
    with pytest.raises(ValueError, match="no_repeat_ngram_size: no registered logits processor reads this key; "
                                         "registered processors: LogitBiasLogitsProcessor"):
        llm.generate([[5, 6], [7, 8]], [good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.num_waiting == 0
