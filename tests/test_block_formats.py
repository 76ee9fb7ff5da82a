"""The GGML block formats in the C kernels (`cpu_kernels/blocks.h`): dequantization bit for bit as
llama.cpp's own reader (`gguf.quants.dequantize`) computes it, and linear layers that multiply the
blocks as stored against int16 activations, for every build this CPU can run."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fastdeploy_lp.model import cpu_features, cpu_kernels
from fastdeploy_lp.block_formats import FORMATS, WeightLayout

gguf = pytest.importorskip("gguf")

paddle.set_device("cpu")
RUNNABLE = {"avx512": ["avx512", "avx2", "portable"], "avx2": ["avx2", "portable"],
            "portable": ["portable"]}[cpu_features.detect().isa]
GGML = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
SCALE_OFFSETS = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "W4G128": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
                 "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # where each block's float16 factors sit


@pytest.fixture(scope="module", params=RUNNABLE)
def kernels(request):
    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels cannot be built here (no C compiler?)")
    return cpu_kernels.CpuKernels(cpu_kernels.build(request.param))


def random_blocks(name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """`[rows, row bytes]` of random quants with float16 factors of a trained model's size (any
    bytes are a valid block but for those factors, which must be finite)."""
    fmt, rng = FORMATS[name], np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * k // fmt.elems, fmt.bytes), dtype=np.uint8)
    for at in SCALE_OFFSETS[name]:
        factors = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, at:at + 2] = factors.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference_values(name: str, raw: np.ndarray) -> np.ndarray:
    if name == "W4G128":  # this project's own format: Q4_0's nibbles under one scale per 128
        d = raw.reshape(-1, 66)[:, :2].copy().view(np.float16).astype(np.float32)
        nibbles = raw.reshape(-1, 66)[:, 2:].reshape(-1, 4, 16)
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(-1, 128).astype(np.float32) - 8
        return (d * q).reshape(raw.shape[0], -1)
    return gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).astype(np.float32)


def quantized_activations(x: np.ndarray) -> np.ndarray:
    """x as the kernels multiply it: int16 per 32 (`blocks.h` quantize_x), back to floats."""
    groups = x.reshape(x.shape[0], -1, 32)
    top = np.abs(groups).max(axis=-1, keepdims=True)
    inverse = np.where(top > 0, np.float32(32767) / np.where(top > 0, top, 1), 0).astype(np.float32)
    q = np.clip(np.rint(groups * inverse), -32767, 32767)
    return (q.astype(np.float64) * (top / np.float32(32767)).astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("name", GGML + ["W4G128"])
def test_dequantize_matches_gguf_bit_for_bit(kernels, name):
    raw = random_blocks(name, 24, 512)
    ours = kernels.dequantize(paddle.to_tensor(raw.reshape(-1)), WeightLayout(((name, 24),), 512)).numpy()
    want = reference_values(name, raw)
    assert ours.dtype == np.float32 and np.array_equal(ours.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", GGML + ["W4G128"])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 13, 16, 33, 64, 70])  # integer GEMV and tiles, units, unit GEMM
def test_block_linear_is_the_product_of_the_dequantized_weights_and_the_activations(kernels, name, rows):
    """Int16 activations against the blocks as integers: few rows of x in the integer kernel, more
    in the unit order (`fdlp_block_unit_rows`), many as its packed GEMM. Each the product of the
    dequantized weights and the quantized activations."""
    n, k = 37, 768  # an odd row count: the last pair has one row
    raw, rng = random_blocks(name, n, k, seed=rows), np.random.default_rng(rows)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    bias = rng.standard_normal(n, dtype=np.float32)
    want = quantized_activations(x) @ reference_values(name, raw).astype(np.float64).T + bias
    got = kernels.linear(paddle.to_tensor(x), paddle.to_tensor(raw.reshape(-1)), paddle.to_tensor(bias),
                         layout=WeightLayout(((name, n),), k)).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", GGML + ["W4G128"])
def test_batch_invariant_rows_come_out_as_each_alone_bit_for_bit(kernels, name):
    """In batch-invariant mode 70 rows of x run the packed integer GEMM (invariant_blocks.h), 12 the
    tiles of 8 weight rows, one row alone the same tiles: the same sums, so every bit agrees, on two
    threads, with the last panel of weight rows cut short (37 of 16)."""
    n, k = 37, 768
    raw, rng = random_blocks(name, n, k, seed=3), np.random.default_rng(3)
    x, bias = rng.standard_normal((70, k), dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    layout, weight = WeightLayout(((name, n),), k), paddle.to_tensor(raw.reshape(-1))

    def linear(rows):
        return kernels.linear(paddle.to_tensor(x[rows]), weight, paddle.to_tensor(bias), layout=layout).numpy()

    kernels.set_batch_invariant(1)
    threads = cpu_kernels.threads()
    cpu_kernels.set_threads(2)
    try:
        together, twelve = linear(slice(0, 70)), linear(slice(30, 42))
        alone = np.concatenate([linear(slice(i, i + 1)) for i in range(70)])
    finally:
        kernels.set_batch_invariant(0)
        cpu_kernels.set_threads(threads)
    assert together.view(np.uint32).tolist() == alone.view(np.uint32).tolist()
    assert twelve.view(np.uint32).tolist() == alone[30:42].view(np.uint32).tolist()
    want = quantized_activations(x) @ reference_values(name, raw).astype(np.float64).T + bias
    np.testing.assert_allclose(together, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_batch_invariant_gemm_taking_x_in_slices_gives_each_row_as_alone():
    """The packed GEMM takes x a slice of rows at a time (2 MB; here 16 KB, 8 rows of 768 a slice)."""
    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels cannot be built here (no C compiler?)")
    kernels = cpu_kernels.CpuKernels(cpu_kernels.build(defines=("UNIT_SLICE_BYTES=16384",)))
    n, k = 21, 768
    raw, rng = random_blocks("Q4_1", n, k, seed=4), np.random.default_rng(4)
    x = rng.standard_normal((45, k), dtype=np.float32)
    layout, weight = WeightLayout((("Q4_1", n),), k), paddle.to_tensor(raw.reshape(-1))
    kernels.set_batch_invariant(1)
    try:
        together = kernels.linear(paddle.to_tensor(x), weight, layout=layout).numpy()
        alone = np.concatenate([kernels.linear(paddle.to_tensor(x[i:i + 1]), weight, layout=layout).numpy()
                                for i in range(45)])
    finally:
        kernels.set_batch_invariant(0)
    assert together.view(np.uint32).tolist() == alone.view(np.uint32).tolist()


def test_int16_activations_keep_outliers_and_their_neighbours(kernels):
    """What quantized activations cost against float32 ones (docs/gguf.md states it): with one
    channel a hundred times the others, as LLM activations have, int16 per 32 stays within 1e-4 of
    the largest output where int8 per 32 (llama.cpp's) would lose most bits of the neighbours."""
    raw, rng = random_blocks("Q4_K", 64, 2048), np.random.default_rng(1)
    x = rng.standard_normal((4, 2048), dtype=np.float32)
    x[:, 5] *= 100
    exact = x.astype(np.float64) @ reference_values("Q4_K", raw).astype(np.float64).T
    got = kernels.linear(paddle.to_tensor(x), paddle.to_tensor(raw.reshape(-1)),
                         layout=WeightLayout((("Q4_K", 64),), 2048)).numpy()
    assert np.abs(got - exact).max() / np.abs(exact).max() < 1e-4


def test_a_weight_of_several_formats_is_multiplied_part_by_part(kernels):
    """A q/k/v projection fused from a Q4_K_M file: q and k rows in Q4_K, v in Q6_K, and float16 rows."""
    k, rng = 512, np.random.default_rng(7)
    parts = [("Q4_K", 20), ("Q6_K", 9), ("F16", 5)]
    values, data = [], []
    for name, rows in parts:
        if name == "F16":
            w = (rng.standard_normal((rows, k)) * 0.02).astype(np.float16)
            values.append(w.astype(np.float32))
            data.append(w.view(np.uint8).reshape(-1))
        else:
            raw = random_blocks(name, rows, k, seed=rows)
            values.append(reference_values(name, raw))
            data.append(raw.reshape(-1))
    layout = WeightLayout(tuple(parts), k)
    bias = rng.standard_normal(layout.rows, dtype=np.float32)
    data = paddle.to_tensor(np.concatenate(data))
    for rows in (3, 9):  # Q4_K and Q6_K: the integer kernel, then the unit order
        x = rng.standard_normal((rows, k), dtype=np.float32)
        got = kernels.linear(paddle.to_tensor(x), data, paddle.to_tensor(bias), layout=layout).numpy()
        quantized = quantized_activations(x)
        want = np.concatenate([(quantized if name != "F16" else x.astype(np.float64)) @ v.astype(np.float64).T
                               for (name, _), v in zip(parts, values)], axis=1) + bias
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    np.testing.assert_array_equal(kernels.dequantize(data, layout).numpy(), np.concatenate(values))


def test_embedding_rows_are_dequantized_as_looked_up(kernels):
    raw = random_blocks("Q6_K", 50, 256)
    layout = WeightLayout((("Q6_K", 50),), 256)
    ids = paddle.to_tensor([3, 0, 49, 3], dtype="int64")
    got = kernels.embed_blocks(ids, paddle.to_tensor(raw.reshape(-1)), layout).numpy()
    assert np.array_equal(got, reference_values("Q6_K", raw)[[3, 0, 49, 3]])
    with pytest.raises(IndexError, match="outside the embedding's 50 rows"):
        kernels.embed_blocks(paddle.to_tensor([50], dtype="int64"), paddle.to_tensor(raw.reshape(-1)), layout)


def test_layouts_refuse_rows_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="Q4_K stores rows of whole 256-weight blocks, not 576"):
        WeightLayout((("Q4_K", 4),), 576)
    assert WeightLayout.of([("Q4_K", 8), ("Q4_K", 4), ("Q6_K", 4)], 512).parts == (("Q4_K", 12), ("Q6_K", 4))
