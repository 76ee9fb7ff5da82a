"""`fastdeploy-lp serve` / `python -m ...api_server`: every flag documented, start-up failures exit
non-zero with the reason, FastDeploy's launch flags accepted; `fastdeploy-lp demo` prints answers."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from server_harness import QWEN2, TESTS_DIR, free_port, start_server

FLAGS = ["--model", "--host", "--port", "--metrics-port", "--served-model-name", "--max-num-seqs",
         "--max-model-len", "--device", "--dtype", "--logits-processors", "--api-key", "--max-waiting-requests",
         "--strict-fields", "--guided-decoding-backend", "--engine-worker-queue-port", "--cache-queue-port"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=TESTS_DIR)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("entry", [["-m", "fastdeploy_lp.entrypoints.openai.api_server"],
                                   ["-m", "fastdeploy_lp.entrypoints.cli", "serve"]])
def test_help_documents_every_flag(entry):
    out = run(*entry, "--help")
    assert out.returncode == 0, out.stderr
    for flag in FLAGS:
        assert flag in out.stdout, flag
    assert "FDLP_API_KEY" in out.stdout


def test_unknown_processor_exits_nonzero_listing_the_builtins():
    out = run("-m", "fastdeploy_lp.entrypoints.cli", "serve", "--model", QWEN2, "--port", str(free_port()),
              "--logits-processors", "NoSuchProcessor")
    assert out.returncode != 0
    assert "NoSuchProcessor" in out.stderr and "LogitBiasLogitsProcessor" in out.stderr


def test_unimportable_custom_processor_exits_nonzero():
    out = run("-m", "fastdeploy_lp.entrypoints.openai.api_server", "--model", QWEN2, "--port", str(free_port()),
              "--logits-processors", "no_such_module:Proc")
    assert out.returncode != 0 and "no_such_module" in out.stderr


def test_missing_model_exits_nonzero_with_the_path():
    out = run("-m", "fastdeploy_lp.entrypoints.openai.api_server", "--model", "/nonexistent/model",
              "--port", str(free_port()))
    assert out.returncode != 0 and "/nonexistent/model" in out.stderr


def test_fastdeploy_launch_flags_are_accepted():
    s = start_server("--engine-worker-queue-port", "8182", "--cache-queue-port", "8183", "--max-model-len", "256",
                     "--dtype", "float32")
    try:
        models = httpx.get(s.url("/v1/models"), timeout=10).json()["data"]
        assert models[0]["id"] == "qwen2" and models[0]["max_model_len"] == 256
        assert models[0]["weight_dtype"] == "float32" and models[0]["quantization"] is None
    finally:
        s.stop()


def test_the_models_endpoint_says_how_the_weights_are_held():
    """qwen2's checkpoint is bfloat16: held as such by default, and as int8 with --quantization wint8."""
    cards = {}
    for flags in ((), ("--quantization", "wint8")):
        s = start_server("--max-model-len", "256", *flags)
        try:
            cards[flags] = httpx.get(s.url("/v1/models"), timeout=10).json()["data"][0]
        finally:
            s.stop()
    held, quantized = cards[()], cards[("--quantization", "wint8")]
    assert held["weight_dtype"] == "bfloat16" and held["quantization"] is None
    assert quantized["weight_dtype"] == "bfloat16" and quantized["quantization"] == "wint8"
    assert 0 < quantized["weight_bytes"] < held["weight_bytes"]


def test_demo_prints_an_answer():
    out = run("-m", "fastdeploy_lp.entrypoints.cli", "demo", "--model", QWEN2, "--max-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert "Q: What is the capital of France?" in out.stdout and "\nA: " in out.stdout


def test_demo_without_a_model_says_so():
    out = run("-m", "fastdeploy_lp.entrypoints.cli", "demo", "--model", "/nonexistent/model")
    assert out.returncode != 0 and "/nonexistent/model" in out.stderr
