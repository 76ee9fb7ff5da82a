"""The C decode kernels (`fastdeploy_lp.model.cpu_kernels`) against Paddle and numpy references,
for every vector width this CPU can execute (AVX-512, AVX2 and portable builds of one source), and
the engine's fallback to Paddle's kernels when they are off or cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.model import cpu_features, cpu_kernels

paddle.set_device("cpu")

# Every build this CPU can run: its own and the narrower ones (AVX-512 hosts run the AVX2 build too).
RUNNABLE = {"avx512": ["avx512", "avx2", "portable"], "avx2": ["avx2", "portable"],
            "portable": ["portable"]}[cpu_features.detect().isa]
LANES = {"avx512": 16, "avx2": 8, "portable": 4}


@pytest.fixture(scope="module", params=RUNNABLE)
def kernels(request):
    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels cannot be built here (no C compiler?)")
    built = cpu_kernels.CpuKernels(cpu_kernels.build(request.param))
    assert built.lanes == LANES[request.param]
    return built


@pytest.mark.parametrize("rows", [1, 3, 8, 12, 17, 40])  # from 16 rows x is packed in panels (xpanel.h, AVX-512)
@pytest.mark.parametrize("k", [64, 100, 903])  # 100, 903: tails of 2 vectors + 4 and of 7 floats
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_paddle(kernels, rows, k, with_bias):
    rng = np.random.default_rng(rows * k)
    x, w = (paddle.to_tensor(rng.standard_normal(s, dtype=np.float32)) for s in ((rows, k), (131, k)))
    bias = paddle.to_tensor(rng.standard_normal(131, dtype=np.float32)) if with_bias else None
    want = paddle.matmul(x, w, transpose_y=True) + (0 if bias is None else bias)
    np.testing.assert_allclose(kernels.linear(x, w, bias).numpy(), want.numpy(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int8"])
@pytest.mark.parametrize("rows", [1, 5, 12])
@pytest.mark.parametrize("k", [64, 117, 903])  # 117: past the bfloat16 GEMV's pairs, a whole vector and a tail
def test_linear_with_half_and_int8_weights_matches_their_float32_values(kernels, dtype, rows, k):
    """Weights widened in registers give the float32 product of the values they hold."""
    rng = np.random.default_rng(rows + k)
    x = paddle.to_tensor(rng.standard_normal((rows, k), dtype=np.float32))
    bias = paddle.to_tensor(rng.standard_normal(131, dtype=np.float32))
    scale = None
    if dtype == "int8":
        w = paddle.to_tensor(rng.integers(-127, 128, (131, k), dtype=np.int8))
        scale = paddle.to_tensor(rng.uniform(0.001, 0.02, 131).astype(np.float32))
    else:
        w = paddle.to_tensor(rng.standard_normal((131, k), dtype=np.float32)).astype(dtype)
    want = paddle.matmul(x, w.astype("float32"), transpose_y=True) * (1 if scale is None else scale) + bias
    before = kernels.bf16_dot
    kernels.set_bf16_dot(False)
    try:
        got = kernels.linear(x, w, bias, scale)
    finally:
        kernels.set_bf16_dot(before)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-4)


def _round_to_bfloat16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as `vcvtne2ps2bf16` rounds."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("rows", [1, 5, 8, 12, 17, 40])  # from 16 rows in panels: 17 (one and a bit), 40
@pytest.mark.parametrize("k", [64, 117, 903])  # 117, 903: a weight line cut short, an odd last weight
def test_bfloat16_weights_on_avx512_bf16_multiply_activations_rounded_to_bfloat16(kernels, rows, k):
    """Where the build has `vdpbf16ps` (dot_bf16.h), bfloat16 weights give the float32-summed product of
    x rounded to bfloat16, every row count alike; switched off, the product of x as it is."""
    rng = np.random.default_rng(rows * 1000 + k)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    w = paddle.to_tensor(rng.standard_normal((131, k), dtype=np.float32)).astype("bfloat16")
    bias = rng.standard_normal(131, dtype=np.float32)
    w64 = w.astype("float32").numpy().astype(np.float64).T
    before = kernels.bf16_dot
    try:
        kernels.set_bf16_dot(True)
        if not kernels.bf16_dot:
            pytest.skip("this build has no AVX-512 BF16")
        rounded = kernels.linear(paddle.to_tensor(x), w, paddle.to_tensor(bias)).numpy()
        kernels.set_bf16_dot(False)
        unrounded = kernels.linear(paddle.to_tensor(x), w, paddle.to_tensor(bias)).numpy()
    finally:
        kernels.set_bf16_dot(before)
    np.testing.assert_allclose(rounded, _round_to_bfloat16(x) @ w64 + bias, rtol=1e-5, atol=1e-4)
    assert np.abs(rounded - (x @ w64 + bias)).max() > 1e-3  # the rounding is there: not the float32 product
    np.testing.assert_allclose(unrounded, x @ w64 + bias, rtol=1e-5, atol=1e-4)



@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
@pytest.mark.parametrize("k", [64, 903])  # 903: every build's lanes end in a tail
def test_batch_invariant_many_rows_matches_each_row_alone_bit_for_bit(kernels, dtype, k):
    """In batch-invariant mode 70 rows run the packed kernel (invariant.h) and one row `rows_times`:
    the same sums, so every bit agrees, with a panel of weight rows cut short (37 of 2 x lanes)."""
    w, scale = _narrow_weight(dtype, k) if dtype != "float32" else (
        paddle.to_tensor(np.random.default_rng(k).standard_normal((37, 131), dtype=np.float32)), None)
    w = (paddle.concat([w] * 7, axis=1)[:, :k] if k > 131 else w[:, :k]).contiguous()
    rng = np.random.default_rng(k + 1)
    x = paddle.to_tensor(rng.standard_normal((70, k), dtype=np.float32))
    bias = paddle.to_tensor(rng.standard_normal(37, dtype=np.float32))
    kernels.set_batch_invariant(1)
    try:
        together = kernels.linear(x, w, bias, scale).numpy()
        alone = np.concatenate([kernels.linear(x[i:i + 1], w, bias, scale).numpy() for i in range(70)])
    finally:
        kernels.set_batch_invariant(0)
    assert together.view(np.uint32).tolist() == alone.view(np.uint32).tolist()
    want = paddle.matmul(x, w.astype("float32"), transpose_y=True) * (1 if scale is None else scale) + bias
    np.testing.assert_allclose(together, want.numpy(), rtol=1e-5, atol=1e-4)


# 117, 903: a weight line cut short, an odd last weight; 65541: rows this long are rounded 48 at a time
# (the copy kept within the thread's buffer), so the 70 rows run in two slices
@pytest.mark.parametrize("k", [64, 117, 903, 65541])
def test_batch_invariant_bfloat16_activations_match_each_row_alone_bit_for_bit(kernels, k):
    """With `vdpbf16ps` (AVX-512 BF16 builds), batch-invariant mode keeps bfloat16 activations and
    takes dot_bf16.h's rows at every row count, never the panels: 70 rows together, or in slices of
    20, give every row as it comes alone. Without the mode 70 rows run the panels, another order."""
    rng = np.random.default_rng(k + 2)
    w = paddle.to_tensor(rng.standard_normal((37, k), dtype=np.float32)).astype("bfloat16")
    x = paddle.to_tensor(rng.standard_normal((70, k), dtype=np.float32))
    bias = paddle.to_tensor(rng.standard_normal(37, dtype=np.float32))
    before = kernels.bf16_dot
    kernels.set_bf16_dot(True)
    try:
        if not kernels.bf16_dot:
            pytest.skip("this build has no AVX-512 BF16")
        panels = kernels.linear(x, w, bias).numpy()
        kernels.set_batch_invariant(1)
        together = kernels.linear(x, w, bias).numpy()
        slices = np.concatenate([kernels.linear(x[i:i + 20], w, bias).numpy() for i in range(0, 70, 20)])
        alone = np.concatenate([kernels.linear(x[i:i + 1], w, bias).numpy() for i in range(70)])
    finally:
        kernels.set_batch_invariant(0)
        kernels.set_bf16_dot(before)
    assert together.view(np.uint32).tolist() == alone.view(np.uint32).tolist() == slices.view(np.uint32).tolist()
    assert together.view(np.uint32).tolist() != panels.view(np.uint32).tolist()
    w64 = w.astype("float32").numpy().astype(np.float64).T
    want = _round_to_bfloat16(x.numpy()) @ w64 + bias.numpy()
    np.testing.assert_allclose(together, want, rtol=1e-5, atol=1e-4 * max(1, k // 1000))  # float32 sums of k terms


def test_batch_invariant_rows_and_panels_taken_in_groups_match_each_row_alone(kernels):
    """Past the packed kernel's groups (about 2 MB of x's rows against about 4 MB of weight panels at
    a time), on two threads, every row still comes out as it does alone."""
    rng = np.random.default_rng(5)
    x = paddle.to_tensor(rng.standard_normal((140, 4000), dtype=np.float32))  # 2 slices of x in every build
    w = paddle.to_tensor(rng.standard_normal((600, 4000), dtype=np.float32)).astype("float16")  # 2 groups a thread
    kernels.set_batch_invariant(1)
    threads = cpu_kernels.threads()
    cpu_kernels.set_threads(2)
    try:
        together = kernels.linear(x, w).numpy()
        alone = np.concatenate([kernels.linear(x[i:i + 1], w).numpy() for i in range(140)])
    finally:
        kernels.set_batch_invariant(0)
        cpu_kernels.set_threads(threads)
    assert together.view(np.uint32).tolist() == alone.view(np.uint32).tolist()

def _narrow_weight(dtype: str, seed: int) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """A [37, 131] weight in `dtype`, with a per-row scale for int8 (else None)."""
    rng = np.random.default_rng(seed)
    if dtype != "int8":
        return paddle.to_tensor(rng.standard_normal((37, 131), dtype=np.float32)).astype(dtype), None
    return (paddle.to_tensor(rng.integers(-127, 128, (37, 131), dtype=np.int8)),
            paddle.to_tensor(rng.uniform(0.001, 0.02, 37).astype(np.float32)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int8"])
def test_widen_gives_the_float32_values_of_a_weight(kernels, dtype):
    w, scale = _narrow_weight(dtype, seed=7)
    want = w.astype("float32") * (1 if scale is None else scale.unsqueeze(1))
    np.testing.assert_array_equal(kernels.widen(w, scale).numpy(), want.numpy())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int8"])
def test_embed_widens_the_rows_it_looks_up_and_refuses_ids_outside_them(kernels, dtype):
    w, scale = _narrow_weight(dtype, seed=8)
    ids = paddle.to_tensor([5, 0, 36, 5], dtype="int64")
    want = paddle.nn.functional.embedding(ids, w).astype("float32")
    if scale is not None:
        want = want * paddle.nn.functional.embedding(ids, scale.unsqueeze(-1))
    np.testing.assert_array_equal(kernels.embed(ids, w, scale).numpy(), want.numpy())
    for bad in (37, -1):
        with pytest.raises(IndexError, match="outside the embedding's 37 rows"):
            kernels.embed(paddle.to_tensor([3, bad], dtype="int64"), w, scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_quantize_rows_matches_the_paddle_arithmetic(kernels, dtype):
    from fastdeploy_lp.model.loader import paddle_quantize_rows
    w = paddle.to_tensor(np.random.default_rng(5).standard_normal((37, 131), dtype=np.float32)).astype(dtype)
    w[3] = 0  # an all-zero row keeps scale 1
    q, scale = kernels.quantize_rows(w)
    want_q, want_scale = paddle_quantize_rows(w)
    np.testing.assert_array_equal(scale.numpy(), want_scale.numpy())
    # Paddle's CPU division is not always correctly rounded, so a value a hair from .5 may round
    # the other way: one step, on a few elements at most.
    diff = np.abs(q.numpy().astype(np.int32) - want_q.numpy())
    assert diff.max() <= 1 and (diff > 0).mean() < 0.005


def test_linear_reads_a_row_slice_where_it_starts(kernels):
    x = paddle.randn([6, 32])
    w = paddle.randn([20, 32])
    np.testing.assert_allclose(kernels.linear(x[2:5], w).numpy(), (x[2:5] @ w.T).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 6])  # one row is split between the threads
def test_argmax_takes_the_first_largest_and_flags_rows_nothing_can_be_drawn_from(kernels, rows):
    x = paddle.randn([6, 151936])
    x[1] = float("-inf")
    x[2, 7], x[2, 9000], x[2, 140000] = 1e9, 1e9, 1e9  # ties, in both halves of the row: the first
    x[3, 0], x[3, 5] = float("nan"), 1e9          # NaN is never the largest
    x[4, 150000] = float("inf")
    x[5] = 3e38                                   # finite, though their sum is not: usable
    x[5, 151935] = float("-inf")
    got, unusable = kernels.argmax(x[:rows] if rows == 6 else x[2:3])
    if rows == 1:
        assert got.tolist() == [7] and unusable.tolist() == [False]
        return
    assert got[0] == paddle.argmax(x[0]).item() and got[1] == 0 and got[2] == 7 and got[3] == 5
    assert got[4] == 150000 and got[5] == 0
    assert unusable.tolist() == [False, True, False, True, True, False]


@pytest.mark.parametrize("shape", [(1, 5), (13, 151), (64, 4864)])
def test_transpose_copies_exactly(kernels, shape):
    x = paddle.randn(list(shape))
    np.testing.assert_array_equal(kernels.transpose(x).numpy(), x.numpy().T)


@pytest.mark.parametrize("rows,width", [(1, 37), (7, 1024), (300, 4864)])
def test_swiglu_matches_paddle_including_extremes(kernels, rows, width):
    x = paddle.randn([rows, 2 * width]) * 8
    x[0, :4] = paddle.to_tensor([-200.0, 200.0, float("nan"), 0.0])  # clamped exp, NaN kept
    got, want = kernels.swiglu(x).numpy(), paddle.nn.functional.swiglu(x).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    assert np.isnan(got[0, 2]) and np.isfinite(np.delete(got, 2, axis=1)).all()


def test_rotary_cache_write_matches_apply_rotary_and_scatter(kernels):
    from fastdeploy_lp.model.layers import apply_rotary
    heads, kv_heads, dim, tokens = 6, 2, 64, 5
    cos, sin = paddle.randn([40, dim]), paddle.randn([40, dim])
    positions = paddle.to_tensor([0, 3, 17, 39, 4], dtype="int64")
    rows = paddle.to_tensor(np.random.default_rng(0).permutation(30)[: tokens * kv_heads], dtype="int64")
    qkv = paddle.randn([tokens, (heads + 2 * kv_heads) * dim])
    q, k, v = paddle.split(qkv.reshape([tokens, -1, dim]), [heads, kv_heads, kv_heads], axis=1)
    c, sn = paddle.index_select(cos, positions).unsqueeze(1), paddle.index_select(sin, positions).unsqueeze(1)
    want_q, want_k = apply_rotary(q, c, sn), apply_rotary(k, c, sn)
    k_cache, v_cache = paddle.zeros([30, dim]), paddle.zeros([30, dim])
    kernels.rotary_cache_write(qkv, cos, sin, positions, rows, k_cache, v_cache, heads, kv_heads)
    got = qkv.reshape([tokens, -1, dim])
    np.testing.assert_allclose(got[:, :heads].numpy(), want_q.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k_cache.numpy()[rows.numpy()], want_k.reshape([-1, dim]).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(v_cache.numpy()[rows.numpy()], v.reshape([-1, dim]).numpy())


def test_a_position_past_the_rotary_table_is_refused_not_read(kernels, monkeypatch):
    """The C rotary indexes its table without bounds checks, so the layer checks the pass first."""
    from fastdeploy_lp import FDConfig
    from fastdeploy_lp.model import AttentionBatch, load_model
    monkeypatch.setattr(cpu_kernels, "_mode", "1")
    model = load_model(FDConfig.create(device="cpu").model_config, max_positions=32)
    cfg = model.config
    shape = [4 * cfg.num_key_value_heads * 16, cfg.head_dim]
    caches = [(paddle.zeros(shape), paddle.zeros(shape)) for _ in model.layers]
    batch = AttentionBatch.paged([([1, 2, 3], 40, 1)], 16, cfg.num_key_value_heads,
                                 cfg.num_attention_heads // cfg.num_key_value_heads)
    with paddle.no_grad(), pytest.raises(ValueError, match="position 40 outside the rotary table"):
        model(paddle.to_tensor([5], dtype="int64"), batch, caches)


def reference_attention(q, k_cache, v_cache, tables, lens, new, block_size, scale):
    """numpy: gather each sequence's keys block by block; its j-th new token attends to keys
    [0, len - new + j], softmax(q k^T * scale) v per head."""
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    out = np.zeros_like(q)
    for row in range(tokens):
        s, j = divmod(row, new)
        t = np.arange(lens[s] - new + j + 1)
        keys = k_cache[tables[s][t // block_size], :, t % block_size]  # [len, kv_heads, dim]
        values = v_cache[tables[s][t // block_size], :, t % block_size]
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = keys[:, g] @ q[row, h] * scale
            p = np.exp(scores - scores.max())
            out[row, h] = (p / p.sum()) @ values[:, g]
    return out


@pytest.mark.parametrize("new", [1, 3, 11])  # decode; the causal mask among a pass's tokens; two query tiles
# 40: no 16-lane rows; 80: an odd number of 16-lane vectors; 7 and 8 query heads a KV head: more than one group of them
@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (4, 4, 128), (4, 2, 40), (16, 2, 80)])
def test_paged_attention_matches_a_gather_reference(kernels, heads, kv_heads, dim, new):
    rng = np.random.default_rng(heads)
    block_size, blocks = 4, 12
    k_cache, v_cache = (rng.standard_normal((blocks, kv_heads, block_size, dim), dtype=np.float32) for _ in "kv")
    lens = np.array([0, 4, 10, 29], dtype=np.int64) + new  # partial blocks; blocks out of order; 16+ keys
    tables = np.array([[9, 0, 0, 0, 0, 0, 0, 0, 0, 0], [3, 11, 0, 0, 0, 0, 0, 0, 0, 0],
                       [5, 1, 8, 2, 0, 0, 0, 0, 0, 0], [4, 10, 0, 6, 7, 2, 1, 11, 3, 9]], dtype=np.int64)
    q = rng.standard_normal((4 * new, heads, dim), dtype=np.float32)
    got = kernels.paged_attention(paddle.to_tensor(q), paddle.to_tensor(k_cache).reshape([-1, dim]),
                                  paddle.to_tensor(v_cache).reshape([-1, dim]), paddle.to_tensor(tables),
                                  paddle.to_tensor(lens), new, int(lens.max()), kv_heads, block_size, 0.125)
    want = reference_attention(q, k_cache, v_cache, tables, lens, new, block_size, 0.125)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_greedy_tokens_and_logprobs_are_the_same_with_the_kernels_on_off_and_auto(monkeypatch):
    llm = LLM(max_num_seqs=4, device="cpu")
    prompts = ["Once upon a time", "The capital of France", "1, 2, 3,", "def main("]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = {}
    for mode in ("1", "0", "auto"):
        monkeypatch.setattr(cpu_kernels, "_mode", mode)
        runs[mode] = llm.generate(prompts, params, use_tqdm=False)
    for mode in ("0", "auto"):
        for a, b in zip(runs["1"], runs[mode]):
            assert list(a.outputs.token_ids) == list(b.outputs.token_ids)
            np.testing.assert_allclose([p.logprob for p in a.outputs.logprobs],
                                       [p.logprob for p in b.outputs.logprobs], atol=1e-4)


def serve_one(env: dict[str, str]) -> subprocess.CompletedProcess:
    snippet = ("import logging; logging.basicConfig(level=logging.INFO);"
               "from fastdeploy_lp import LLM, SamplingParams;"
               "out = LLM(max_num_seqs=1, device='cpu').generate(['Hello'], SamplingParams(max_tokens=3));"
               "print('TOKENS', len(out[0].outputs.token_ids))")
    return subprocess.run([sys.executable, "-c", snippet], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=180)


def test_without_a_compiler_the_engine_uses_paddle_and_says_so(tmp_path):
    done = serve_one({"CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "TOKENS 3" in done.stdout
    assert "CPU kernels unavailable" in done.stderr and "using Paddle's kernels" in done.stderr


def test_the_switch_turns_them_off():
    done = serve_one({cpu_kernels.SWITCH: "0"})
    assert done.returncode == 0, done.stderr
    assert "CPU kernels: off" in done.stderr
