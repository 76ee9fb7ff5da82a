"""CPU features read in-process, kernels built for exactly them, and each kernel used only where it
was measured faster than Paddle's op (`fastdeploy_lp.model.cpu_dispatch`)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import numpy as np
import paddle
import pytest

from fastdeploy_lp import FDConfig
from fastdeploy_lp.model import cpu_dispatch, cpu_features, cpu_kernels, layers, load_model

paddle.set_device("cpu")


def test_features_come_from_the_process_and_map_to_one_isa():
    from numpy._core._multiarray_umath import __cpu_features__ as table
    cpu = cpu_features.detect()
    assert cpu.flags == {k for k, v in table.items() if v}
    assert cpu.isa in ("avx512", "avx2", "portable")
    assert "-march=native" not in cpu.compile_flags()
    if cpu.isa == "avx2":
        assert not any(f.startswith("-mavx512") for f in cpu.compile_flags())
    assert ("-mavx512bf16" in cpu.compile_flags()) == (cpu.isa == "avx512" and "AVX512BF16" in cpu.flags)
    assert "-mavx512bf16" not in cpu.compile_flags("avx2")


@pytest.mark.parametrize("flags,isa", [
    ({"AVX2", "FMA3", "F16C"}, "avx2"),
    ({"AVX2", "FMA3", "F16C", "AVX512F", "AVX512BW", "AVX512DQ", "AVX512VL"}, "avx512"),
    ({"AVX512F", "AVX2", "FMA3", "F16C"}, "avx2"),  # AVX-512 without BW/DQ/VL (Xeon Phi): the AVX2 build
    ({"SSE2", "AVX"}, "portable"),
])
def test_isa_of_a_feature_set(flags, isa):
    assert cpu_features.CpuFeatures("x86_64", frozenset(flags)).isa == isa
    with_bf16 = cpu_features.CpuFeatures("x86_64", frozenset(flags | {"AVX512BF16"}))
    assert ("-mavx512bf16" in with_bf16.compile_flags()) == (isa == "avx512")
    assert cpu_features.CpuFeatures("aarch64", frozenset(flags | {"NEON"})).isa == "portable"


def test_each_isa_is_its_own_library():
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    assert len({cpu_kernels.build(isa) for isa in ("avx2", "portable")}) == 2


def test_rms_norm_without_the_fused_op_gives_the_same_values(monkeypatch):
    """Where AVX-512F is missing, RMSNorm runs the plain formula (Paddle's fused op would SIGILL)."""
    norm = layers.RMSNorm(896, 1e-6)
    norm.weight.set_value(paddle.rand([896]) + 0.5)
    x = paddle.randn([5, 896]) * 3
    with paddle.no_grad():
        monkeypatch.setattr(layers, "_FUSED_RMS_NORM_ON_CPU", False)
        plain = norm(x).numpy()
        if not cpu_features.detect().has_avx512f:
            pytest.skip("this CPU cannot run the fused op to compare with")
        monkeypatch.setattr(layers, "_FUSED_RMS_NORM_ON_CPU", True)
        fused = norm(x).numpy()
    np.testing.assert_allclose(plain, fused, rtol=1e-5, atol=1e-5)


def test_the_plan_decides_per_op_and_bucket(monkeypatch):
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_kernels, "_mode", "auto")
    monkeypatch.setattr(cpu_kernels, "_plan", {"linear:2-8": True, "linear:1": False})
    assert cpu_kernels.for_op("linear", 5) is not None
    assert cpu_kernels.for_op("linear", 1) is None
    assert cpu_kernels.for_op("linear", 12) is None  # never measured: Paddle's
    monkeypatch.setattr(cpu_kernels, "_mode", "1")
    assert cpu_kernels.for_op("linear", 1) is not None
    monkeypatch.setattr(cpu_kernels, "_mode", "0")
    assert cpu_kernels.for_op("linear", 5) is None


def test_buckets():
    assert [cpu_kernels.bucket("linear", r) for r in (1, 2, 8, 9, 16, 17, 32, 33)] == \
        ["1", "2-8", "2-8", "9-16", "9-16", "17-32", "17-32", "prefill"]
    assert cpu_kernels.bucket("swiglu", 32) == "decode" and cpu_kernels.bucket("swiglu", 33) == "prefill"
    assert cpu_kernels.bucket("argmax", 500) == "all"


def test_calibration_measures_every_op_and_is_cached(tmp_path, monkeypatch, caplog):
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_kernels, "_mode", "auto")
    library = tmp_path / "cpu_kernels-x.so"
    monkeypatch.setattr(kernels, "path", library)
    monkeypatch.setattr(cpu_dispatch, "_logged", set())
    monkeypatch.setattr(cpu_dispatch, "_other_processes_load", lambda: lambda: 0.0)  # a quiet machine
    model = load_model(FDConfig.create(device="cpu").model_config, max_positions=100)  # a context under 256
    with caplog.at_level(logging.INFO, logger="fastdeploy_lp.model.cpu_dispatch"):
        plan = cpu_dispatch.prepare(model, 16)
        assert cpu_dispatch.prepare(model, 16) == plan  # read back from the file
    buckets = [name for _, name in cpu_kernels.LINEAR_BUCKETS]
    assert set(plan) == {f"linear:{b}" for b in [*buckets, "prefill"]} | {"argmax:all"} | {
        f"{op}:{b}" for op in ("transpose", "swiglu", "rotary", "attention") for b in ("decode", "prefill")}
    assert all(isinstance(v, bool) for v in plan.values())
    assert (tmp_path / "cpu_kernels-x.plans.json").exists()
    assert "measured in" in caplog.text and caplog.text.count("CPU kernels for") == 1
    assert cpu_kernels._plan == plan


def test_a_plan_timed_on_a_busy_machine_is_used_but_not_cached(tmp_path, monkeypatch, caplog):
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_kernels, "_mode", "auto")
    monkeypatch.setattr(kernels, "path", tmp_path / "cpu_kernels-x.so")
    monkeypatch.setattr(cpu_dispatch, "_other_processes_load", lambda: lambda: 0.5)
    model = load_model(FDConfig.create(device="cpu").model_config, max_positions=100)
    with caplog.at_level(logging.INFO, logger="fastdeploy_lp.model.cpu_dispatch"):
        plan = cpu_dispatch.prepare(model, 16)
    assert cpu_kernels._plan == plan and plan
    assert not (tmp_path / "cpu_kernels-x.plans.json").exists()
    assert "other processes used 50% of the CPUs" in caplog.text


def test_the_load_of_other_processes_is_read_from_the_machine():
    share = cpu_dispatch._other_processes_load()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:  # this process's own work is not counted
        pass
    assert 0.0 <= share() < 1.0


def test_a_bad_mode_is_refused_at_start():
    snippet = "from fastdeploy_lp import LLM; LLM(max_num_seqs=1, device='cpu')"
    done = subprocess.run([sys.executable, "-c", snippet], env={**os.environ, cpu_kernels.SWITCH: "yes"},
                          capture_output=True, text=True, timeout=180)
    assert done.returncode != 0 and "FDLP_CPU_KERNELS='yes': expected one of auto, 0, 1" in done.stderr



@pytest.fixture
def isa_switch(monkeypatch):
    """Set FDLP_CPU_ISA for one `detect()` call; the cached features come back after."""
    def detect(value: str) -> cpu_features.CpuFeatures:
        monkeypatch.setenv(cpu_features.ISA_SWITCH, value)
        cpu_features.detect.cache_clear()
        return cpu_features.detect()
    yield detect
    monkeypatch.delenv(cpu_features.ISA_SWITCH, raising=False)
    cpu_features.detect.cache_clear()


def test_a_narrower_isa_can_be_asked_for(isa_switch):
    narrow = isa_switch("portable")
    assert narrow.isa == "portable" and not narrow.has_avx512f and narrow.compile_flags() == []


def test_a_wider_or_unknown_isa_is_refused(isa_switch):
    native = cpu_features.detect().isa
    with pytest.raises(ValueError, match="FDLP_CPU_ISA='sse9'"):
        isa_switch("sse9")
    if native != "avx512":
        with pytest.raises(ValueError, match="this CPU runs"):
            isa_switch("avx512")


def test_a_kernel_within_the_edge_of_paddles_op_wins_and_one_past_it_loses():
    """`edge` is the share by which a kernel may be slower and still win (the linear kernel's, for
    the one-call decoder layer it enables); without it only a faster kernel wins."""
    def taking(seconds):
        return lambda: time.sleep(seconds)

    assert cpu_dispatch._kernel_wins(taking(0.0104), taking(0.010), edge=0.2)
    assert not cpu_dispatch._kernel_wins(taking(0.0104), taking(0.010))
    assert not cpu_dispatch._kernel_wins(taking(0.015), taking(0.010), edge=cpu_dispatch.FUSED_LAYER_EDGE)
