"""The engine applies the MKL remedy on AMD CPUs by itself, and never overrides a user's value."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fastdeploy_lp.model.runner import MKL_CPU_TYPE
from fastdeploy_lp.model import cpu_features

SNIPPET = ("import os, logging; logging.basicConfig(level=logging.INFO);"
           "from fastdeploy_lp import LLM; LLM(max_num_seqs=1, device='cpu');"
           f"print('VALUE', os.environ.get('{MKL_CPU_TYPE}'))")


def run(env_value: str | None) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != MKL_CPU_TYPE}
    if env_value is not None:
        env[MKL_CPU_TYPE] = env_value
    done = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    value = [line for line in done.stdout.splitlines() if line.startswith("VALUE")][0].split()[1]
    return value, done.stderr


@pytest.mark.skipif(cpu_features.detect().vendor != "AuthenticAMD", reason="the remedy is for AMD CPUs")
def test_amd_cpu_gets_the_remedy_and_says_so():
    value, log = run(None)
    assert value == "5"
    assert log.count("CPU math: ") == 1 and "AMD CPU: MKL_DEBUG_CPU_TYPE=5" in log


def test_a_value_the_user_set_is_kept():
    value, log = run("2")
    assert value == "2" and "MKL_DEBUG_CPU_TYPE=2 as set by the user" in log
