"""Guided-decoding masks: the packed bitmask expanded on the logits' device (`expand_banned`, used
off the CPU) and numpy's unpack (used on the CPU) give exactly the logits the grammar allows.

The device expansion runs here on the CPU place, so CPU-only machines test it too."""

from __future__ import annotations

import functools

import numpy as np
import paddle
import pytest
from conftest import fixture_dir

from fastdeploy_lp import LLM, FDConfig, GuidedDecodingParams, SamplingParams
from fastdeploy_lp.processors import EngineContext
from fastdeploy_lp.processors.guided import GuidedDecodingLogitsProcessor
from fastdeploy_lp.processors.guided import bitmask, processor
from fastdeploy_lp.processors.guided.bitmask import banned_mask, expand_banned, mask_logits, words_for

VOCABS = [1, 31, 32, 33, 1024, 32005, 151935, 151936]  # 151,935 and 32,005: not multiples of 32


def _random_bits(rng, rows: int, words: int) -> np.ndarray:
    bits = rng.integers(-2**31, 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    bits[rng.random(bits.shape) < 0.2] = 0  # whole words off, and on: runs as in real masks
    bits[rng.random(bits.shape) < 0.2] = -1
    return bits


def _allowed_reference(bits: np.ndarray, width: int) -> np.ndarray:
    """numpy unpackbits, cut to `width`; columns past the bitmask are not allowed."""
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :width].astype(bool)
    return np.pad(allowed, ((0, 0), (0, width - allowed.shape[1])))


def _masked_reference(logits: np.ndarray, bits: np.ndarray, rows) -> np.ndarray:
    out = logits.copy()
    rows = list(range(logits.shape[0])) if rows is None else rows
    out[rows] = np.where(_allowed_reference(bits, logits.shape[1]), out[rows], np.float32(-np.inf))
    return out


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_device_expansion_equals_numpy_unpackbits(vocab, rows):
    rng = np.random.default_rng(vocab * 31 + rows)
    bits = _random_bits(rng, rows, words_for(vocab))
    for width in (vocab, vocab + 1, vocab + 77, max(vocab - 5, 1)):  # wider logits, and narrower
        reference = _allowed_reference(bits, width)
        got = expand_banned(paddle.to_tensor(bits), width)
        assert got.dtype == paddle.bool and got.shape == [rows, width]
        assert np.array_equal(got.numpy(), ~reference), width
        for packed in (True, False):
            mask = banned_mask(bits, width, paddle.CPUPlace(), packed=packed)
            assert np.array_equal(mask.numpy(), ~reference), (width, packed)


@pytest.mark.parametrize("vocab", [33, 32005, 151936])
@pytest.mark.parametrize("packed", [True, False])
def test_mask_logits_matches_numpy_for_all_rows_and_row_subsets(vocab, packed):
    rng = np.random.default_rng(vocab)
    batch = 6
    for width in (vocab, vocab + 40):
        logits = rng.standard_normal((batch, width)).astype(np.float32)
        logits[0, :3] = [np.inf, -np.inf, 0.0]
        for rows in (None, [0], [1, 4], [0, 2, 3, 5]):
            n = batch if rows is None else len(rows)
            bits = _random_bits(rng, n, words_for(vocab))
            out = mask_logits(paddle.to_tensor(logits), bits, rows, packed=packed)
            assert np.array_equal(out.numpy(), _masked_reference(logits, bits, rows)), (width, rows)


def test_packed_path_is_the_default_off_the_cpu_only(monkeypatch):
    class FakePlace:  # a non-CPU place; no tensor can live there, so the upload itself fails
        def is_cpu_place(self):
            return False

    unpacked = []
    original = bitmask.unpack_banned_numpy
    monkeypatch.setattr(bitmask, "unpack_banned_numpy", lambda *a: unpacked.append(1) or original(*a))
    bits = _random_bits(np.random.default_rng(0), 2, words_for(100))
    banned_mask(bits, 100, paddle.CPUPlace())
    assert unpacked == [1]  # CPU: numpy's unpack
    with pytest.raises(Exception):
        banned_mask(bits, 100, FakePlace())
    assert unpacked == [1]  # elsewhere: the packed words, never the host unpack


@pytest.fixture(scope="module")
def guide():
    cfg = FDConfig.create(fixture_dir("qwen2"), max_num_seqs=8, device="cpu")
    return GuidedDecodingLogitsProcessor(cfg, EngineContext.load(cfg))


@pytest.mark.parametrize("packed", [True, False])
def test_processor_apply_masks_constrained_rows_only(guide, monkeypatch, packed):
    monkeypatch.setattr(processor, "mask_logits", functools.partial(mask_logits, packed=packed))
    rng = np.random.default_rng(7)
    matcher = guide.compiler.compile(GuidedDecodingParams(regex="[a-z]+")).new_matcher
    for rows, batch, width in (([0, 1, 2, 3], 4, guide.vocab_size), ([1, 3], 5, guide.vocab_size + 50)):
        bits = _random_bits(rng, len(rows), guide._bitmask.shape[1])
        guide._bitmask[:len(rows)] = bits
        guide._rows, guide._row_slots, guide._row_matchers = rows, rows, [matcher() for _ in rows]
        logits = rng.standard_normal((batch, width)).astype(np.float32)
        try:
            out = guide.apply(paddle.to_tensor(logits))
        finally:
            guide._rows, guide._row_slots, guide._row_matchers = [], [], []
        assert np.array_equal(out.numpy(), _masked_reference(logits, bits, rows))


def test_generation_is_the_same_with_the_packed_device_path(monkeypatch):
    """The engine on CPU with the packed expansion forced: the same seeded outputs, mixed batch."""
    llm = LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu")
    gd = GuidedDecodingParams(json={"type": "object", "properties": {"name": {"type": "string"}},
                                    "required": ["name"], "additionalProperties": False})
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, guided_decoding=gd if i != 2 else None)
              for i in range(4)]
    outputs = {}
    for packed in (False, True):
        monkeypatch.setattr(processor, "mask_logits", functools.partial(mask_logits, packed=packed))
        outputs[packed] = [o.outputs.token_ids for o in llm.generate(["Name:"] * 4, params, use_tqdm=False)]
    assert outputs[True] == outputs[False]
