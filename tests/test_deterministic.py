"""`deterministic=True` (issue 38): a probe request gives the same tokens and logprobs bit for bit
(`==`, never a tolerance) alone and among random neighbours: neighbours of random lengths and
sampling options, prefix cache hits, chunk sizes, preemption forced by a small KV pool, n=2 and
n-gram speculation (`bench/deterministic.py` draws the mixes; it runs 500 of them). Without the
flag the same mixes change the probe's logprobs: the kernel chosen per row count, the one-row GEMV,
Paddle's GEMM and the norms sum in orders that depend on the batch. Built-in model."""

from __future__ import annotations

import os
import random
import sys

import paddle
import pytest

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.model import cpu_kernels, linear

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import deterministic as mixes  # noqa: E402  (bench/deterministic.py)


@pytest.fixture(autouse=True)
def _kernels():
    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels are not built here (no C compiler)")


def _mismatched(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["matched"]]


def test_the_probe_is_bit_identical_in_every_mix():
    rows = mixes.run_mixes(True, 30, seed=38)
    assert _mismatched(rows) == []
    # the mixes did reach what they are meant to: preemption, speculation, n=2, both probes
    assert any(r["preemptions"] for r in rows) and any(r["spec"] for r in rows) and any(r["n"] == 2 for r in rows)
    assert {r["probe"] for r in rows} == {"greedy", "seeded", "guided"} and len({r["chunk"] for r in rows}) > 1


@pytest.mark.parametrize("weights", [dict(dtype="bfloat16"), dict(quantization="wint8"), dict(quantization="wint4"),
                                     dict(kv_cache_dtype="bfloat16")])
def test_every_weight_format_is_batch_invariant(weights):
    assert _mismatched(mixes.run_mixes(True, 6, seed=5, **weights)) == []


def test_bfloat16_activations_on_avx512_bf16_are_batch_invariant():
    """Where the CPU has AVX-512 BF16 a bfloat16 model's linear layers multiply activations rounded to
    bfloat16 (`vdpbf16ps`) with the flag too, in dot_bf16.h's order at every row count (the suite
    runs with FDLP_CPU_BF16_DOT=0, so it is switched on here)."""
    kernels = cpu_kernels.load()
    before = kernels.bf16_dot
    kernels.set_bf16_dot(True)
    try:
        if not kernels.bf16_dot:
            pytest.skip("this CPU has no AVX-512 BF16")
        runner = mixes.Mixes(True, dtype="bfloat16")
        assert _mismatched([runner.mix(6 * 100_000 + i) for i in range(6)]) == []
        kernels.set_bf16_dot(False)  # the probe's logprobs move: the mixes ran the rounded activations
        assert mixes.Mixes(True, dtype="bfloat16").alone("greedy") != runner.alone("greedy")
    finally:
        kernels.set_bf16_dot(before)


def test_draft_model_speculation_keeps_the_probe_batch_invariant():
    """Every mix's engine drafts with a draft model (the built-in model as its own draft; the draft
    cost fixed, so a slow machine does not stop drafting): a verified position is a plain step's,
    so the probe is still the probe alone."""
    from fastdeploy_lp.model_config import default_model_path
    draft = {"method": "draft_model", "model": default_model_path(), "num_speculative_tokens": 3,
             "draft_row_cost": 0.05}
    runner = mixes.Mixes(True, speculative=draft, spec_rate=1.0)
    rows = [runner.mix(9 * 100_000 + i) for i in range(4)]
    assert _mismatched(rows) == []
    assert sum(llm.speculative_stats()["accepted_tokens"] for llm in runner.engines.values()) > 0


def test_a_model_with_query_and_key_norms_is_batch_invariant():
    """Qwen3's per-head q/k RMSNorm (the C norm under the flag) and its rotary on Paddle's elementwise
    ops: the tiny Qwen3 fixture's probe is the probe alone in every mix."""
    qwen3 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf", "qwen3")
    assert _mismatched(mixes.run_mixes(True, 6, seed=11, model=qwen3)) == []


def test_without_the_flag_the_same_mixes_change_the_probe():
    """What the flag removes (on the main this was written on, 30 of 30 mixes differed, by up to ~2e-6
    in a logprob): if this starts passing without the flag, the default path became batch-invariant."""
    assert len(_mismatched(mixes.run_mixes(False, 4, seed=38))) > 0


def test_lora_adapters_keep_the_probe_batch_invariant(tmp_path):
    """A probe on one adapter, among neighbours on another adapter and on the base: the C update
    sums each row alone, so its tokens and logprobs are those it gets alone, bit for bit."""
    from fastdeploy_lp import LoRARequest, SamplingParams
    from test_lora import BASE, make_adapter
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    mine = LoRARequest("mine", 1, make_adapter(tmp_path / "mine", rank=8, targets=every, seed=3, scale=0.4))
    theirs = LoRARequest("theirs", 2, make_adapter(tmp_path / "theirs", rank=4, targets=("q_proj", "down_proj"), seed=4))
    llm = LLM(BASE, device="cpu", deterministic=True, enable_lora=True, max_num_seqs=8, num_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    probe = "The little dog ran to the"
    alone = llm.generate([probe], params, use_tqdm=False, lora_request=mine)[0].outputs
    for k in range(3):
        neighbours = ["Once upon a time " * (k + 1), "Tom and Lily", "x y z " * (3 * k + 1)][:k + 1]
        outs = llm.generate([neighbours[0], probe, *neighbours[1:]], params, use_tqdm=False,
                            lora_request=[theirs, mine, None, theirs][:k + 2])
        assert outs[1].outputs.token_ids == alone.token_ids
        assert repr(outs[1].outputs.logprobs) == repr(alone.logprobs)


def test_the_result_does_not_depend_on_the_thread_count():
    runner = mixes.Mixes(True)
    want = runner.alone("greedy"), runner.alone("seeded")
    threads = cpu_kernels.threads()
    try:
        paddle.base.core.set_num_threads(1)
        cpu_kernels.set_threads(1)
        again = mixes.Mixes(True)
        assert (again.alone("greedy"), again.alone("seeded")) == want
    finally:
        paddle.base.core.set_num_threads(threads)
        cpu_kernels.set_threads(threads)


def test_tensor_parallel_ranks_add_their_parts_in_rank_order():
    """Four ranks over gloo (on however many cores): each row-parallel layer's parts are gathered and
    added rank 0 first, so the probe among neighbours, in prompt chunks and after its own prefix was
    cached, is the probe alone on the same engine, bit for bit."""
    llm = LLM(device="cpu", deterministic=True, tensor_parallel_size=4, max_num_seqs=8, max_model_len=256,
              max_num_batched_tokens=48, logits_processors=mixes.PROCESSORS)
    try:
        vocab = llm.engine.fd_config.model_config.vocab_size
        probe = mixes.probe_prompt(vocab)
        for kind in ("greedy", "seeded"):
            alone = mixes.result(llm.generate([probe], mixes.probe_params(kind), use_tqdm=False)[0].outputs)
            for seed in range(2):
                rng = random.Random(seed)
                prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 90))]
                           for _ in range(rng.randint(2, 6))]
                params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True)
                          for _ in prompts]
                at = rng.randint(0, len(prompts))
                outs = llm.generate(prompts[:at] + [probe] + prompts[at:],
                                    params[:at] + [mixes.probe_params(kind)] + params[at:], use_tqdm=False)
                assert mixes.result(outs[at].outputs) == alone, (kind, seed)
    finally:
        llm.engine.runner.close()


def test_what_cannot_be_made_invariant_is_refused_at_start_up():
    with pytest.raises(ValueError, match="deterministic: .*device is gpu"):
        LLM(device="gpu", deterministic=True)


def test_kernels_switched_off_are_refused(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_mode", "0")
    with pytest.raises(RuntimeError, match="deterministic: .*FDLP_CPU_KERNELS=0"):
        LLM(device="cpu", deterministic=True)
    assert not linear.batch_invariant()


def test_the_mode_holds_only_over_a_deterministic_engines_passes():
    """An engine without the flag in the same process keeps the measured dispatch."""
    LLM(device="cpu", deterministic=True).generate("Once upon a time", mixes.probe_params("greedy"), use_tqdm=False)
    assert not linear.batch_invariant()
    assert linear.kernels_for(paddle.zeros([64, 8]), "linear", 64) is cpu_kernels.for_op("linear", 64)


@pytest.mark.parametrize("replicas", [1, 2])
def test_through_the_server_alone_and_among_concurrent_neighbours(replicas):
    """`--deterministic` on the server: /v1/models and the start-up line say so, and a completion's
    logprobs are the same alone and while other requests are decoding beside it; with two engine
    processes (`--data-parallel-size 2`, each request to the less loaded one), the same whichever
    engine serves it: the probes sent in pairs land on both."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from server_harness import start_server

    server = start_server("--deterministic", "--max-model-len", "256", "--log-level", "info",
                          "--data-parallel-size", str(replicas))
    try:
        card = httpx.get(server.url("/v1/models"), timeout=10).json()["data"][0]
        assert card["deterministic"] is True
        assert "deterministic (batch-invariant)" in server.log()

        def complete(prompt: str, seed: int | None = None) -> dict:
            body = {"prompt": prompt, "max_tokens": 16, "logprobs": 2, "ignore_eos": True,
                    "temperature": 0 if seed is None else 0.9, "seed": seed}
            answer = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["logprobs"]

        probe = "The capital of France is"
        alone = complete(probe), complete(probe, seed=7)
        neighbours = [f"Neighbour {i} writes" + " a longer line" * i for i in range(6)]
        with ThreadPoolExecutor(8) as pool:
            pairs = [[pool.submit(complete, probe, seed) for _ in range(2)] for seed in (None, 7)]
            assert [f.result() for f in pairs[0]] == [alone[0]] * 2 and [f.result() for f in pairs[1]] == [alone[1]] * 2
            busy = [pool.submit(complete, text, i) for i, text in enumerate(neighbours)]
            beside = pool.submit(complete, probe).result(), pool.submit(complete, probe, 7).result()
            [f.result() for f in busy]
        assert beside == alone
    finally:
        server.stop()
