"""Tensor parallelism (docs/distributed.md) on CPU over gloo, with real rank processes started by
`paddle.distributed.spawn`: TP=2 against TP=1 and the `transformers` references, through the
runner, `LLM.generate` and the server; processors and guided decoding; start-up checks; a rank
that dies; workers stopped on shutdown.

Each TP=2 engine costs a process spawn and a Paddle import per rank, so engines are module-scoped.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import openai
import pytest
from conftest import FIXTURE_MODELS, fixture_dir, load_reference
from server_harness import start_server
from test_lora import make_adapter

from fastdeploy_lp import LLM, GuidedDecodingParams, LoRARequest, SamplingParams
from fastdeploy_lp.model.runner import SequenceFeed
from fastdeploy_lp.entrypoints.openai import api_server

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
TP = 2


def _splits_by(name: str, n: int) -> bool:
    with open(os.path.join(fixture_dir(name), "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    return all(v % n == 0 for v in (heads, cfg.get("num_key_value_heads") or heads, cfg["vocab_size"],
                                    cfg["intermediate_size"]))


MODELS = [m for m in dict.fromkeys([*FIXTURE_MODELS, "llama-bias"]) if _splits_by(m, TP)]
PROCESSORS = ["LogitBiasLogitsProcessor"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids, timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _worker_pids(server_pid: int) -> list[int]:
    """The rank processes of a server: its children started by multiprocessing's spawn."""
    kids = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True).stdout.split()
    pids = []
    for k in kids:
        try:
            with open(f"/proc/{k}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    pids.append(int(k))
        except OSError:
            pass
    return pids


class _Engines:
    """LLMs by (model, tensor_parallel_size), built on first use, shared by the module's tests."""

    def __init__(self):
        self.llms: dict[tuple[str, int, str | None], LLM] = {}

    def __call__(self, name: str, tp: int, quantization: str | None = None) -> LLM:
        if (name, tp, quantization) not in self.llms:
            self.llms[name, tp, quantization] = LLM(fixture_dir(name), device="cpu", max_num_seqs=4,
                                                    tensor_parallel_size=tp, logits_processors=PROCESSORS,
                                                    quantization=quantization, enable_lora=True)
        return self.llms[name, tp, quantization]

    def close(self):
        for llm in self.llms.values():
            llm.engine.runner.close()


@pytest.fixture(scope="module")
def engines():
    e = _Engines()
    yield e
    e.close()


# -- numbers: TP=2 against TP=1 and transformers ------------------------------------------------------
def _runner_logits(runner, inputs: list[list[int]]) -> list[dict[int, np.ndarray]]:
    """Per sequence, {position: logits} from the runner: each prompt's first half in one pass (all
    sequences together), then the rest one token per pass, batched. Blocks are taken from the top
    of the pool, which the engine (low blocks first) has not used."""
    bs = runner.block_size
    blocks, top = [], runner.num_blocks - 1
    for ids in inputs:
        n = -(-len(ids) // bs)
        blocks.append(list(range(top, top - n, -1)))
        top -= n
    fresh = [b for table in blocks for b in table]
    done = [max(1, len(ids) // 2) for ids in inputs]
    out = [dict() for _ in inputs]
    rows = runner.forward([SequenceFeed(blocks[i], ids[:done[i]], 0) for i, ids in enumerate(inputs)], fresh)
    for i, row in enumerate(rows.numpy()):
        out[i][done[i] - 1] = row
    while any(d < len(ids) for d, ids in zip(done, inputs)):
        active = [i for i, ids in enumerate(inputs) if done[i] < len(ids)]
        rows = runner.forward([SequenceFeed(blocks[i], [inputs[i][done[i]]], done[i]) for i in active])
        for i, row in zip(active, rows.numpy()):
            out[i][done[i]] = row
            done[i] += 1
    return out


@pytest.mark.parametrize("name", MODELS)
def test_tp2_runner_logits_match_tp1_and_transformers_in_prefill_and_batched_decode(engines, name):
    inputs, ref = load_reference(name)
    tp2 = _runner_logits(engines(name, TP).engine.runner, inputs)
    tp1 = _runner_logits(engines(name, 1).engine.runner, inputs)
    for i, ids in enumerate(inputs):
        positions = sorted(tp2[i])
        got = np.stack([tp2[i][p] for p in positions])
        assert got.shape == (len(positions), ref[f"logits_{i}"].shape[-1])
        np.testing.assert_allclose(got, np.stack([tp1[i][p] for p in positions]), atol=1e-4, rtol=0)
        np.testing.assert_allclose(got, ref[f"logits_{i}"][positions], atol=1e-4, rtol=0)


def test_tp2_shards_wint8_weights_with_their_scales(engines):
    """Each rank quantizes its own shard: column-parallel rows keep their scales, row-parallel
    o/down columns get scales of their own, applied before the all-reduce. The logits stay within
    int8's error of the float32 model's."""
    name = MODELS[0]
    inputs, _ = load_reference(name)
    quantized = _runner_logits(engines(name, TP, "wint8").engine.runner, inputs)
    full = _runner_logits(engines(name, 1).engine.runner, inputs)
    for q, f in zip(quantized, full):
        for pos in f:
            assert np.abs(q[pos] - f[pos]).max() <= 0.05 * np.abs(f[pos]).max()


@pytest.mark.parametrize("name", MODELS)
def test_tp2_greedy_generation_equals_tp1_and_transformers(engines, name):
    inputs, ref = load_reference(name)
    tp2 = [o.outputs.token_ids for o in engines(name, TP).generate(inputs, GREEDY, use_tqdm=False)]
    tp1 = [o.outputs.token_ids for o in engines(name, 1).generate(inputs, GREEDY, use_tqdm=False)]
    assert tp2 == tp1 == [ref[f"greedy_{i}"].tolist() for i in range(len(inputs))]


def test_tp2_shards_lora_adapters_with_their_layers(engines, tmp_path):
    """Each rank holds its part of an adapter on every projection (B rows of its heads and MLP
    columns, A columns of its o/down inputs, their partial updates summed by the all-reduce): a
    batch mixing the adapter and the base gives what one process gives, token for token, logits
    within 1e-4."""
    name = MODELS[0]
    adapter = make_adapter(tmp_path / "adapter", base=fixture_dir(name), rank=4, seed=5, scale=1.0,
                           targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    inputs, _ = load_reference(name)
    requests = [LoRARequest("tp", 1, adapter) if i % 2 == 0 else None for i in range(len(inputs))]
    tp2, tp1 = engines(name, TP), engines(name, 1)
    got = [o.outputs.token_ids for o in tp2.generate(inputs, GREEDY, use_tqdm=False, lora_request=requests)]
    want = [o.outputs.token_ids for o in tp1.generate(inputs, GREEDY, use_tqdm=False, lora_request=requests)]
    base = [o.outputs.token_ids for o in tp1.generate(inputs, GREEDY, use_tqdm=False)]
    assert got == want and got[0] != base[0] and got[1] == base[1]
    rows = [tp.engine.runner.forward([SequenceFeed([1, 2], inputs[0][:8], 0, lora=tp.engine.runner.loras.get("tp"))],
                                     [1, 2]).numpy() for tp in (tp2, tp1)]
    np.testing.assert_allclose(rows[0], rows[1], atol=1e-4, rtol=0)


def test_processors_guided_decoding_and_seeded_sampling_agree_under_tp2(engines):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}, "age": {"type": "integer",
              "minimum": 0, "maximum": 99}}, "required": ["city", "age"], "additionalProperties": False}
    prompts = ["Give me a person as JSON:", "Hello", "The capital of France is", "1, 2, 3,"]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                       logits_processors_args={"logit_bias": {"17": 8.0, "42": 6.5}}),
        SamplingParams(temperature=0, max_tokens=40, guided_decoding=GuidedDecodingParams(json=schema)),
        SamplingParams(temperature=0.8, seed=11, max_tokens=40, repetition_penalty=1.2,
                       guided_decoding=GuidedDecodingParams(json=schema)),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True,
                       logits_processors_args={"logit_bias": {"7": -100.0}}),
    ]
    tp1 = engines("qwen2", 1).generate(prompts, params, use_tqdm=False)
    tp2 = engines("qwen2", TP).generate(prompts, params, use_tqdm=False)
    assert [o.outputs.token_ids for o in tp2] == [o.outputs.token_ids for o in tp1]
    assert tp2[0].outputs.token_ids.count(17) > 0  # the bias did something
    for out in tp2[1:3]:
        doc = json.loads(out.outputs.text)
        assert doc["city"] in ("Paris", "Lyon") and 0 <= doc["age"] <= 99
    assert 7 not in tp2[3].outputs.token_ids


# -- the server -------------------------------------------------------------------------------------------
def test_server_with_tp2_answers_like_offline_tp1_and_stops_its_workers_on_sigterm(engines):
    server = start_server("--tensor-parallel-size", str(TP), "--logits-processors", *PROCESSORS,
                          "--max-num-seqs", "4")
    try:
        workers = _worker_pids(server.proc.pid)
        assert len(workers) == TP
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused")
        llm = engines("qwen2", 1)
        inputs, ref = load_reference("qwen2")
        for i, ids in enumerate(inputs):
            out = client.completions.create(model="default", prompt=ids, max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs.text
            assert out.usage.completion_tokens == len(ref[f"greedy_{i}"])
        bias = {"logits_processors_args": {"logit_bias": {"17": 8.0}}}
        out = client.completions.create(model="default", prompt="Hello", max_tokens=8, temperature=0,
                                        extra_body=bias)
        offline = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, **bias), use_tqdm=False)
        assert out.choices[0].text == offline[0].outputs.text
        schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}, "ok": {"type": "boolean"}},
                  "required": ["city", "ok"], "additionalProperties": False}
        out = client.completions.create(model="default", prompt="JSON:", max_tokens=30, temperature=0,
                                        extra_body={"guided_json": schema})
        offline = llm.generate("JSON:", SamplingParams(temperature=0, max_tokens=30,
                                                       guided_decoding=GuidedDecodingParams(json=schema)),
                               use_tqdm=False)
        assert out.choices[0].text == offline[0].outputs.text
        assert json.loads(out.choices[0].text)["city"] in ("Paris", "Lyon")
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert _wait_gone(workers) == []
    finally:
        server.stop()


def test_a_killed_worker_ends_the_server_with_a_clear_message():
    server = start_server("--tensor-parallel-size", str(TP))
    try:
        workers = _worker_pids(server.proc.pid)
        assert len(workers) == TP
        os.kill(workers[1], signal.SIGKILL)
        started = time.monotonic()
        assert server.proc.wait(30) == 1
        assert time.monotonic() - started < 30
        log = server.log()
        assert f"tensor-parallel rank 1 (pid {workers[1]}) was killed by SIGKILL" in log
        assert "the server stops" in log
        assert _wait_gone(workers) == []
    finally:
        server.stop()


# -- the offline API's life cycle -------------------------------------------------------------------------
def test_a_killed_worker_makes_generate_raise_and_stops_the_other_ranks():
    llm = LLM(fixture_dir("llama"), device="cpu", max_num_seqs=2, tensor_parallel_size=TP)
    pids = llm.engine.runner.worker_pids
    assert llm.generate([1, 2, 3], GREEDY, use_tqdm=False)[0].outputs.token_ids
    os.kill(pids[0], signal.SIGKILL)
    assert _wait_gone([pids[0]]) == []
    with pytest.raises(RuntimeError, match=rf"rank 0 \(pid {pids[0]}\) was killed by SIGKILL"):
        llm.generate([1, 2, 3], GREEDY, use_tqdm=False)
    assert _wait_gone(pids) == []
    with pytest.raises(RuntimeError, match="was killed by SIGKILL"):  # and again, at once
        llm.generate([4, 5], GREEDY, use_tqdm=False)


def test_collecting_the_llm_stops_its_workers():
    llm = LLM(fixture_dir("llama"), device="cpu", max_num_seqs=2, tensor_parallel_size=TP)
    pids = llm.engine.runner.worker_pids
    assert all(_alive(p) for p in pids)
    del llm
    gc.collect()
    assert _wait_gone(pids) == []


def test_a_checkpoint_error_found_by_the_ranks_is_raised_as_is(tmp_path):
    bad = tmp_path / "llama"
    shutil.copytree(fixture_dir("llama"), bad)
    with open(bad / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["intermediate_size"] = 200  # the file's MLP is 160 wide
    (bad / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    with pytest.raises(ValueError, match=r"wrong shape.*gate_proj"):
        LLM(str(bad), device="cpu", tensor_parallel_size=TP)


# -- start-up checks (no process is started, no weight is read) ---------------------------------------
def _without_weights(tmp_path, name="llama"):
    out = tmp_path / name
    shutil.copytree(fixture_dir(name), out, ignore=shutil.ignore_patterns("*.safetensors"))
    return str(out)


def test_sizes_that_do_not_divide_the_model_are_refused_before_loading(tmp_path):
    model = _without_weights(tmp_path)  # a load would fail with "checkpoint file(s) missing"
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 does not divide the model's "
                                         r"num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, "
                                         r"intermediate_size=160"):
        LLM(model, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 4 does not divide the model's "
                                         r"num_key_value_heads=2;.*sizes that fit: 2"):
        LLM(model, device="cpu", tensor_parallel_size=4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size: must be a positive integer"):
            LLM(model, device="cpu", tensor_parallel_size=bad)


def test_gpu_ranks_need_cuda_nccl_and_enough_devices(tmp_path):
    import paddle

    model = _without_weights(tmp_path)
    if not paddle.is_compiled_with_cuda():
        with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 on device 'gpu' needs the CUDA build"):
            LLM(model, device="gpu", tensor_parallel_size=2)
    else:
        count = paddle.device.cuda.device_count()
        with pytest.raises(ValueError, match=rf"need GPUs 0..{count}, but {count} GPU\(s\) are visible"):
            LLM(model, device="gpu", tensor_parallel_size=count + 1)
    with pytest.raises(ValueError, match=r"runs on 'cpu' \(gloo\) or 'gpu' \(NCCL\), not on 'xpu'"):
        LLM(model, device="xpu", tensor_parallel_size=2)


def test_a_build_without_gloo_is_refused(tmp_path, monkeypatch):
    from paddle.base import core

    monkeypatch.delattr(core, "ProcessGroupGloo")
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 on CPU needs gloo"):
        LLM(_without_weights(tmp_path), device="cpu", tensor_parallel_size=2)


def test_the_server_flag_reports_a_bad_size_and_exits_2(tmp_path, capsys):
    code = api_server.main(["--model", _without_weights(tmp_path), "--device", "cpu", "--tensor-parallel-size", "4"])
    assert code == 2
    assert "cannot start: tensor_parallel_size: 4 does not divide the model's num_key_value_heads=2" in \
        capsys.readouterr().err
