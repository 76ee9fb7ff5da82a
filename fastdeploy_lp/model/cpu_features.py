"""What this CPU can execute, as the process sees it: the one place the engine asks.

Features come from numpy's runtime table, which numpy fills with CPUID at import, in this
process. Not from `/proc/cpuinfo` (under an emulator or in some VMs it describes another CPU) and
not from `-march=native` in a child compiler (a child may run on a different CPU model than the one
this process is shown, as under `qemu-x86_64 -cpu EPYC-Rome`). The vendor and model name are read
from `/proc/cpuinfo` for the logs and benchmarks only; nothing that chooses instructions uses them.

The instruction set families the engine distinguishes:

| `isa`      | needs                                      | C kernels' vector   | Paddle's `fused_rms_norm` |
|------------|--------------------------------------------|---------------------|---------------------------|
| `avx512`   | AVX-512 F, BW, DQ, VL (+ AVX2, FMA, F16C)  | 16 floats, 32 regs  | yes                       |
| `avx2`     | AVX2, FMA, F16C                            | 8 floats, 16 regs   | no: the plain formula     |
| `portable` | anything else (older x86-64, aarch64, ...) | 4 floats            | no: the plain formula     |
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

_AVX512 = ("AVX512F", "AVX512BW", "AVX512DQ", "AVX512VL", "AVX2", "FMA3", "F16C")
_AVX2 = ("AVX2", "FMA3", "F16C")
COMPILE_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "portable": [],
}


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU as this process sees it. `flags` holds numpy's names of the features present
    (`AVX2`, `FMA3`, `AVX512F`, `AVX512BF16`, `NEON`, ...)."""

    machine: str
    flags: frozenset[str]
    vendor: str = ""
    model: str = ""

    @property
    def isa(self) -> str:
        """`avx512`, `avx2` or `portable` (see the module docstring)."""
        if self.machine in ("x86_64", "AMD64") and all(f in self.flags for f in _AVX512):
            return "avx512"
        if self.machine in ("x86_64", "AMD64") and all(f in self.flags for f in _AVX2):
            return "avx2"
        return "portable"

    @property
    def compile_flags(self) -> list[str]:
        """C compiler flags for exactly the detected vector ISA (never `-march=native`)."""
        return list(COMPILE_FLAGS[self.isa])

    @property
    def has_avx512f(self) -> bool:
        return "AVX512F" in self.flags

    def describe(self) -> str:
        """One line for logs and benchmark tables: model, vendor and ISA."""
        extras = [f.lower() for f in ("AVX512BF16", "AVX512VNNI", "AVX512FP16") if f in self.flags]
        name = self.model or self.vendor or self.machine
        return f"{name} [{self.isa}{' + ' + ', '.join(extras) if extras else ''}]"


@functools.cache
def detect() -> CpuFeatures:
    """This process's CPU features, read once."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as table
    except ImportError:  # numpy < 2
        from numpy.core._multiarray_umath import __cpu_features__ as table
    vendor, model = _cpuinfo("vendor_id"), _cpuinfo("model name")
    return CpuFeatures(platform.machine(), frozenset(k for k, v in table.items() if v), vendor, model)


def _cpuinfo(key: str) -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
