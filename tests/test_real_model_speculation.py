"""Grammar-forced drafts on a real tokenizer (issue 35, item 7c): SmolLM2-135M-Instruct (GGUF),
prompt-lookup drafts, greedy. Where drafts reach a span the JSON schema forces (repeated keys), the
verify pass appends it and `forced_tokens` counts it; with fixed keys the spans are fast-forwarded
before drafting and count nowhere (docs/speculative_decoding.md), and the bytes the grammar forces
but cannot cut into tokens (the ` "` before a string value) are drafted as a guess. Either way the
output is plain decoding's."""

from __future__ import annotations

import pytest

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.sampling_params import GuidedDecodingParams
from test_real_model import SMOLLM2

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CUSTOMERS = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "object", "properties": {"customer_full_name": {"type": "string", "maxLength": 12},
                                     "customer_age_in_years": {"type": "integer"},
                                     "preferred_city": {"enum": ["Paris", "Berlin", "Rome"]}},
    "required": ["customer_full_name", "customer_age_in_years", "preferred_city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def llms():
    return (LLM(SMOLLM2, max_num_seqs=2, device="cpu"),
            LLM(SMOLLM2, max_num_seqs=2, device="cpu", speculative_config={"method": "ngram",
                                                                           "num_speculative_tokens": 4}))


def run(llm, schema, prompt):
    params = SamplingParams(temperature=0, max_tokens=150, guided_decoding=GuidedDecodingParams(json=schema))
    before, steps = llm.speculative_stats(), llm.engine.num_steps
    out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0].outputs
    after = llm.speculative_stats()
    return out.token_ids, llm.engine.num_steps - steps, {k: after[k] - before[k] for k in after if k != "method"}


def test_drafts_that_reach_repeated_keys_append_their_forced_spans(llms):
    plain, spec = llms
    want, plain_steps, _ = run(plain, CUSTOMERS, "List customers as JSON")
    got, steps, stats = run(spec, CUSTOMERS, "List customers as JSON")
    assert got == want
    assert stats["forced_tokens"] > 10 and steps < plain_steps


def test_fixed_keys_are_fast_forwarded_before_drafting_and_decode_as_plain(llms):
    plain, spec = llms
    want, plain_steps, _ = run(plain, PERSON, "Give me a person as JSON with name and age.")
    got, steps, stats = run(spec, PERSON, "Give me a person as JSON with name and age.")
    assert got == want and steps < plain_steps  # 7 against 8: the forced ` "` drafted and accepted
    assert stats["forced_tokens"] == 0  # no draft reaches a key: each was appended where the request stood
    assert stats["accepted_tokens"] >= 1
