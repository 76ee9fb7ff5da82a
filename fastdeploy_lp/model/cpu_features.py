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

`FDLP_CPU_ISA=avx2` (or `portable`) makes the process act as on a narrower CPU: the features above
it are dropped, so the kernels, Paddle's fused ops and the benchmarks all take that path (to
measure it, or to step around a CPU bug). A wider ISA than the CPU has is refused.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

from fastdeploy_lp import envs

ISA_SWITCH = "FDLP_CPU_ISA"
ISAS = ("avx512", "avx2", "portable")  # widest first
_AVX512 = ("AVX512F", "AVX512BW", "AVX512DQ", "AVX512VL", "AVX2", "FMA3", "F16C")
_AVX2 = ("AVX2", "FMA3", "F16C")
COMPILE_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "portable": [],
}
# Extensions an ISA's build also targets where this CPU has them: AVX-512 BF16's `vdpbf16ps`
# multiplies bfloat16 weights by bfloat16 activations (cpu_kernels/dot_bf16.h).
EXTENSION_FLAGS = {"avx512": {"AVX512BF16": "-mavx512bf16"}}


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

    def compile_flags(self, isa: str | None = None) -> list[str]:
        """C compiler flags for exactly `isa` (default: the detected one) and the extensions of it
        this CPU has (never `-march=native`)."""
        isa = isa or self.isa
        extras = [flag for name, flag in EXTENSION_FLAGS.get(isa, {}).items() if name in self.flags]
        return [*COMPILE_FLAGS[isa], *extras]

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
    cpu = CpuFeatures(platform.machine(), frozenset(k for k, v in table.items() if v), vendor, model)
    cap = envs.get(ISA_SWITCH).strip().lower()
    if not cap:
        return cpu
    if cap not in ISAS or ISAS.index(cap) < ISAS.index(cpu.isa):
        raise ValueError(f"{ISA_SWITCH}={cap!r}: this CPU runs {', '.join(ISAS[ISAS.index(cpu.isa):])}")
    dropped = {"avx512": (), "avx2": ("AVX512",), "portable": ("AVX512", "AVX2", "FMA3", "F16C")}[cap]
    return CpuFeatures(cpu.machine, frozenset(f for f in cpu.flags if not f.startswith(dropped)), vendor, model)


def _cpuinfo(key: str) -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
