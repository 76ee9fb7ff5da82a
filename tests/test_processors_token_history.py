"""`TokenHistory`, the incremental per-slot history the look-back processors share."""

from __future__ import annotations

import numpy as np
import pytest
from processor_harness import HandBatch, context_for

from fastdeploy_lp.processors.token_history import TokenHistory


@pytest.fixture(scope="module")
def context():
    return context_for("qwen3")


def assert_mirrors(history, batch):
    for slot in batch.slots:
        expected = batch.history(slot)
        assert history.lengths[slot] == len(expected)
        assert history.ids[slot, : len(expected)].tolist() == expected
        assert history.tensor.numpy()[slot, : len(expected)].tolist() == expected
        k = 5
        assert history.tails(np.array([slot]), k)[0].tolist() == ([-1] * k + expected)[-k:]


def test_follows_steps_jumps_reuse_and_growth_and_is_idempotent(context):
    batch, rng = HandBatch(context), np.random.default_rng(0)
    history = TokenHistory(capacity=16, device=True)
    batch.place(0, [1, 2, 3])
    batch.place(6, [4])
    for step in range(40):  # grows past the initial capacity
        history.update(batch.share, np.array(batch.slots))
        history.update(batch.share, np.array(batch.slots))  # a second call in the same step changes nothing
        assert_mirrors(history, batch)
        for slot in batch.slots:
            batch.append(slot, int(rng.integers(0, 1000)))
        if step == 10:
            batch.append(6, 7)  # several tokens in one step (forced tokens)
            batch.append(6, 8)
        if step == 20:
            batch.free(0)
            batch.place(0, [9] * 30)  # slot reused by a longer prompt
        if step == 25:
            batch.place(3, [5, 5])  # joins between running slots
    assert history.capacity >= history.lengths.max() > 16
