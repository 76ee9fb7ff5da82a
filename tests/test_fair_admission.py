"""A call with a large `n` takes turns for the slots with other calls instead of holding every
slot until all its choices end (issue "Hardening II"). Built-in model, real engine steps."""

from __future__ import annotations

from fastdeploy_lp import LLM, SamplingParams


def test_a_request_behind_a_large_n_gets_the_first_free_slot():
    engine = LLM(max_num_seqs=4, device="cpu").engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    big = engine.add_request("Once upon a time", params.clone(n=16))
    (small,) = engine.add_request("The cat sat on", params)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert sorted(order) == sorted(big + [small])
    # The first four choices held the slots; the small request took the first one that freed.
    assert order.index(small) < 8, order


def test_choices_of_one_call_still_run_in_order_when_alone():
    engine = LLM(max_num_seqs=4, device="cpu").engine
    ids = engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=3, n=8, ignore_eos=True))
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order[:4] == ids[:4] and sorted(order[4:]) == sorted(ids[4:])
