"""Shared test fixtures: paths to the reference checkpoints shipped in tests/fixtures."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

# The reference logits (transformers, float32) check the float32 arithmetic: bfloat16 weights multiply
# float32 activations in every test process and server the tests start, unless a test switches
# AVX-512 BF16's bfloat16 activations on itself (test_cpu_kernels.py, test_weight_formats.py).
os.environ.setdefault("FDLP_CPU_BF16_DOT", "0")

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
FIXTURE_MODELS = ["llama", "llama3-rope", "qwen2", "qwen3"]


def fixture_dir(name: str) -> str:
    return os.path.join(FIXTURES, name)


def load_reference(name: str) -> tuple[list[list[int]], np.lib.npyio.NpzFile]:
    with open(os.path.join(fixture_dir(name), "reference.json"), encoding="utf-8") as f:
        inputs = json.load(f)["inputs"]
    return inputs, np.load(os.path.join(fixture_dir(name), "reference.npz"))


@pytest.fixture(scope="session")
def qwen2_dir() -> str:
    return fixture_dir("qwen2")
