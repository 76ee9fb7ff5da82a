"""The offline API's contract: prompts in every form, chat prompts, and refusing what it cannot do."""

from __future__ import annotations

import pytest
from conftest import fixture_dir

from fastdeploy_lp import LLM, GuidedDecodingParams, SamplingParams

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(fixture_dir("qwen2"), max_num_seqs=2, device="cpu", guided_decoding_backend="off")


def test_generate_takes_a_string_a_list_token_ids_and_per_prompt_params(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    one = llm.generate("Hello world", greedy, use_tqdm=False)
    ids = llm.tokenizer.encode("Hello world")
    assert one[0].prompt_token_ids == ids and one[0].prompt == "Hello world"
    by_ids = llm.generate(ids, greedy, use_tqdm=False)
    assert by_ids[0].outputs.token_ids == one[0].outputs.token_ids
    many = llm.generate(["Hello world", ids], [greedy, greedy.clone(max_tokens=2)], use_tqdm=False)
    assert [len(o.outputs.token_ids) for o in many] == [4, 2]
    assert many[0].num_prompt_tokens == len(ids)


def test_chat_prompt_is_the_template_without_extra_special_tokens(llm):
    out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    template = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(template, add_special_tokens=False)
    assert len(llm.chat([MESSAGES, MESSAGES], use_tqdm=False)) == 2


def test_guided_request_is_refused_when_guided_decoding_is_off(llm):
    with pytest.raises(ValueError, match="^guided_decoding:"):
        llm.generate("Hello", SamplingParams(guided_decoding=GuidedDecodingParams(regex="(Paris|London)")),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_ids_past_the_tokenizer_are_never_sampled(tmp_path):
    import json
    import shutil

    model = tmp_path / "padded"
    shutil.copytree(fixture_dir("qwen2"), model)
    tok = json.loads((model / "tokenizer.json").read_text())
    keep = {t: i for t, i in tok["model"]["vocab"].items() if i < 600}
    tok["model"]["vocab"] = keep
    tok["model"]["merges"] = [m for m in tok["model"]["merges"]
                              if "".join(m if isinstance(m, list) else m.split(" ")) in keep]
    (model / "tokenizer.json").write_text(json.dumps(tok))
    llm = LLM(str(model), max_num_seqs=4, device="cpu")
    assert llm.tokenizer.vocab_size == 600 < llm.fd_config.model_config.vocab_size
    outs = llm.generate(["Hello"] * 4, SamplingParams(temperature=5.0, seed=3, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)
    assert all(t < 600 for o in outs for t in o.outputs.token_ids)
