"""`--kv-cache-dtype bfloat16`: the KV cache holds bfloat16, the attention kernels widen it as they
read, and the Paddle path (no kernels, or GPU) stores and reads the same values."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from conftest import fixture_dir
from test_cpu_kernels import kernels, reference_attention  # noqa: F401  (the fixture: every runnable build)

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.model import cpu_kernels

@pytest.mark.parametrize("new", [1, 3])
# 40: the scalar tails; 80: an odd number of 16-lane vectors; 6 heads a KV head: a group of 4 and one of 2
@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (4, 2, 40), (16, 2, 80), (12, 2, 64)])
def test_attention_over_a_bfloat16_cache_is_the_float32_kernel_over_its_values(kernels, heads, kv_heads, dim, new):  # noqa: F811
    """Widening is exact and the vector sums run in the same order, so the results are equal bit for
    bit; where a row is not whole vectors, the scalar tail may contract its products differently."""
    rng = np.random.default_rng(dim)
    block_size, blocks = 4, 12
    k16, v16 = (paddle.to_tensor(rng.standard_normal((blocks * kv_heads * block_size, dim), dtype=np.float32))
                .astype("bfloat16") for _ in "kv")
    lens = np.array([1, 10, 29], dtype=np.int64) + new
    tables = paddle.to_tensor(np.array([[9, 0, 0, 0, 0, 0, 0, 0], [5, 1, 8, 0, 0, 0, 0, 0],
                                        [4, 10, 0, 6, 7, 2, 1, 11]], dtype=np.int64))
    q = paddle.to_tensor(rng.standard_normal((3 * new, heads, dim), dtype=np.float32))
    run = [kernels.paged_attention(q, k, v, tables, paddle.to_tensor(lens), new, int(lens.max()), kv_heads,
                                   block_size, 0.125) for k, v in ((k16, v16), (k16.astype("float32"), v16.astype("float32")))]
    if dim % kernels.lanes == 0:
        np.testing.assert_array_equal(run[0].numpy(), run[1].numpy())
    np.testing.assert_allclose(run[0].numpy(), run[1].numpy(), rtol=1e-6, atol=1e-6)
    want = reference_attention(q.numpy(), k16.astype("float32").numpy().reshape(blocks, kv_heads, block_size, dim),
                               v16.astype("float32").numpy().reshape(blocks, kv_heads, block_size, dim),
                               tables.numpy(), lens, new, block_size, 0.125)
    np.testing.assert_allclose(run[0].numpy(), want, rtol=1e-5, atol=1e-5)


def test_the_cache_write_rounds_as_paddle_casts(kernels):  # noqa: F811
    """Round to nearest, ties to even: the kernel's stored keys and values are Paddle's cast of the
    float32 ones, including values exactly between two bfloat16s."""
    heads, kv_heads, dim, tokens = 4, 2, 64, 3
    cos, sin = paddle.ones([8, dim]), paddle.zeros([8, dim])  # rotary is the identity: k is stored as given
    qkv = paddle.randn([tokens, (heads + 2 * kv_heads) * dim])
    ties = 1.0 + np.arange(1, 9, dtype=np.float32) * 2.0 ** -7 + 2.0 ** -8  # exactly halfway between two bfloat16s
    qkv[0, heads * dim:heads * dim + 8] = paddle.to_tensor(ties)
    rows = paddle.to_tensor([5, 0, 3, 7, 1, 6], dtype="int64")
    positions = paddle.to_tensor([0, 1, 2], dtype="int64")
    want_k, want_v = (paddle.zeros([8, dim]) for _ in "kv")
    kernels.rotary_cache_write(qkv.clone(), cos, sin, positions, rows, want_k, want_v, heads, kv_heads)
    k16, v16 = (paddle.zeros([8, dim], dtype="bfloat16") for _ in "kv")
    kernels.rotary_cache_write(qkv.clone(), cos, sin, positions, rows, k16, v16, heads, kv_heads)
    for got, want in ((k16, want_k), (v16, want_v)):
        np.testing.assert_array_equal(got.astype("float32").numpy(), want.astype("bfloat16").astype("float32").numpy())
    # to even: 4 distinct values (truncation, or ties away from zero, would give 8)
    assert len(set(k16.astype("float32").numpy()[5, :8].tolist())) == 4


def test_a_cache_of_another_dtype_is_refused(kernels):  # noqa: F811
    q, cache = paddle.zeros([1, 2, 64]), paddle.zeros([16, 64], dtype="float16")
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        kernels.paged_attention(q, cache, cache, paddle.zeros([1, 1], dtype="int64"),
                                paddle.ones([1], dtype="int64"), 1, 1, 1, 16, 0.125)


def _prompt_logprobs(llm: LLM, inputs: list) -> list[np.ndarray]:
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)
    return [np.array([p.logprob for p in o.prompt_logprobs[1:]]) for o in outs]


def test_bfloat16_cache_runs_alike_on_the_kernels_and_on_paddle(monkeypatch):
    """Every prompt position's logprob, keys and values read back from the cache chunk after chunk of
    the prefill: the kernels and Paddle's ops agree, both stay near the float32 cache's (which
    tests/test_prompt_logprobs.py holds to `transformers`), and differ from it (the values really are
    rounded)."""
    rng = np.random.default_rng(0)
    inputs = [rng.integers(3, 1000, n).tolist() for n in (45, 23, 60)]
    runs = {}
    for kv in ("auto", "bfloat16"):
        llm = LLM(fixture_dir("qwen2"), max_num_seqs=4, device="cpu", kv_cache_dtype=kv, block_size=4,
                  max_num_batched_tokens=16)
        for mode in ("1", "0"):
            monkeypatch.setattr(cpu_kernels, "_mode", mode)
            runs[kv, mode] = _prompt_logprobs(llm, inputs)
    assert all(c.dtype == paddle.bfloat16 for pair in llm.engine.runner.kv_caches for c in pair)
    for got_kernel, got_paddle, full in zip(runs["bfloat16", "1"], runs["bfloat16", "0"], runs["auto", "1"]):
        np.testing.assert_allclose(got_kernel, got_paddle, atol=1e-4)
        np.testing.assert_allclose(got_kernel, full, atol=1e-2)  # measured: up to 1.1e-3
        assert np.abs(got_kernel - full).max() > 1e-5


def test_bfloat16_cache_holds_twice_the_blocks_in_the_same_memory():
    blocks = {dtype: LLM(max_num_seqs=512, max_model_len=2048, device="cpu", kv_cache_dtype=dtype,
                         kv_cache_memory=0.01).engine.runner.num_blocks for dtype in ("auto", "bfloat16")}
    assert blocks["bfloat16"] in (2 * blocks["auto"], 2 * blocks["auto"] + 1)


def test_an_unknown_cache_dtype_names_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int8").create_engine_config()
