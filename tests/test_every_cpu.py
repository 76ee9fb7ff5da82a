"""The engine on a CPU without AVX-512, whatever CPU runs the tests: `qemu-x86_64 -cpu EPYC-Rome`
(Debian's `qemu-user`) emulates an AVX2-only AMD EPYC and cannot execute an AVX-512 instruction,
so a kernel or Paddle op that assumes AVX-512 dies there (SIGILL) or hangs. Before the CPU features
were read in-process, the default model's first forward pass did (Paddle's `fused_rms_norm`).

`.ci/run` installs qemu-user; outside CI these tests skip without it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastdeploy_lp.model import cpu_kernels

QEMU = shutil.which("qemu-x86_64")
EMULATED = [QEMU, "-cpu", "EPYC-Rome"]
ROOT = Path(__file__).resolve().parents[1]

if platform.machine() != "x86_64":
    pytest.skip("qemu-x86_64 emulates an x86-64 CPU on x86-64 hosts here", allow_module_level=True)
if QEMU is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI needs qemu-x86_64 (apt-get install qemu-user) to prove the AVX2 path")
    pytest.skip("qemu-x86_64 not installed (apt-get install qemu-user)", allow_module_level=True)

GREEDY = """
import json
from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.model import cpu_features, cpu_kernels
llm = LLM(max_num_seqs=2, device="cpu")
outs = llm.generate(["Once upon a time", "The capital of France"],
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0), use_tqdm=False)
kernels = cpu_kernels.load()
print("RESULT", json.dumps({"isa": cpu_features.detect().isa, "lanes": kernels and kernels.lanes,
                            "tokens": [list(o.outputs.token_ids) for o in outs],
                            "logprobs": [[p.logprob for p in o.outputs.logprobs] for o in outs]}))
"""


def run(prefix: list[str], args: list[str], mode: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, cpu_kernels.SWITCH: mode, "PYTHONPATH": str(ROOT)}
    return subprocess.run([*prefix, sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def greedy(prefix: list[str], mode: str) -> dict:
    try:
        done = run(prefix, ["-c", GREEDY], mode)
    except subprocess.TimeoutExpired:
        if not prefix:
            raise
        # qemu-user now and then hangs a multi-threaded process (one CI run in seven: 300 s where the
        # run takes 30-55), which the same code natively never did: the emulated run gets one more try
        done = run(prefix, ["-c", GREEDY], mode)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT", 1)[1])


def test_default_model_decodes_the_same_tokens_on_an_avx2_only_cpu():
    """Every C kernel forced on (mode 1), so each op runs this project's AVX2 build; with Paddle's
    ops only (mode 0) the emulated run tested Paddle's own CPU dispatch, not this code, and took
    40 s of the suite."""
    mode = "1"
    native, emulated = greedy([], mode), greedy(EMULATED, mode)
    assert emulated["isa"] == "avx2"
    if native["lanes"] is not None:
        assert emulated["lanes"] == 8  # built for what the process sees, not for the host
    assert emulated["tokens"] == native["tokens"]
    for a, b in zip(emulated["logprobs"], native["logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


# One emulated pytest process for both files: each start under qemu imports Paddle at emulated speed
# (~20 s of the suite per process).
KERNEL_TESTS = ("(test_cpu_kernels and (matches or argmax or transpose or refused or slice)) or "
                "(test_block_formats and (Q4_0 or Q4_K or Q6_K or dequantize or several or embedding) and not W4G128)")


def test_kernel_unit_tests_pass_on_an_avx2_only_cpu():
    """The dense kernels' unit tests, and the GGUF block formats' AVX2 and portable builds where the
    process sees no AVX-512: every format's dequantization, the integer GEMV and widened panels of
    the K formats, mixed parts."""
    done = run(EMULATED, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cpu_kernels.py",
                          "tests/test_block_formats.py", "-k", KERNEL_TESTS], mode="1", timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    passed = re.search(r"\b(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 300 and "failed" not in done.stdout, done.stdout[-500:]
