"""Environment variables: every one the package reads, under the one prefix `FDLP_`, declared once
here with its default and meaning (`docs/server.md`'s table is generated from `ENV_VARS`).

Some were named `FASTDEPLOY_LP_…` before the prefix was settled; those names still work, with a
warning logged once per process, and lose to the `FDLP_` name when both are set.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PREFIX = "FDLP_"
_OLD_PREFIX = "FASTDEPLOY_LP_"


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, the value used when it is unset, and what it does."""

    name: str
    default: str
    help: str
    has_old_name: bool = False  # also read as FASTDEPLOY_LP_<suffix>, with a deprecation warning

    @property
    def old_name(self) -> str | None:
        return _OLD_PREFIX + self.name[len(PREFIX):] if self.has_old_name else None


ENV_VARS = {v.name: v for v in (
    EnvVar("FDLP_API_KEY", "", "The server's API key when `--api-key` is not given (read after parsing, so "
           "`--help` never shows it).", has_old_name=True),
    EnvVar("FDLP_TRUST_CUSTOM_CODE", "0", "`1`, `true` or `yes`: as `--trust-custom-code`.", has_old_name=True),
    EnvVar("FDLP_GUIDED_COMPILE_TIMEOUT_S", "5", "Longest time, in seconds, one request's constraint may take to "
           "compile, from arrival to answer (waiting for a compile worker included); custom backends' request "
           "hooks get the same.", has_old_name=True),
    EnvVar("FDLP_GUIDED_COMPILE_WORKERS", "2", "Guided-decoding compile-worker processes (per model, per "
           "process); `0` compiles in the server process, without isolation.", has_old_name=True),
    EnvVar("FDLP_GUIDED_CACHE_SIZE", "128", "Compiled constraints kept (LRU; errors are cached too, timeouts "
           "are not).", has_old_name=True),
    EnvVar("FDLP_TP_START_TIMEOUT", "900", "Seconds the tensor-parallel ranks get to start and load the "
           "model.", has_old_name=True),
    EnvVar("FDLP_TP_SECRET", "", "The secret a driver with `--tensor-parallel-address` and the ranks launched for it "
           "(`fastdeploy-lp tp-worker`) share; each side proves it knows it before any message is read. Required "
           "there."),
    EnvVar("FDLP_CPU_KERNELS", "auto", "The CPU C kernels: `auto` uses each where it measured faster than "
           "Paddle's op, `1` always, `0` never."),
    EnvVar("FDLP_HUGE_PAGES", "1", "`0`: leave the weights on the 4 KiB pages they get by default; else large "
           "CPU weights are placed on 2 MiB transparent huge pages where the kernel allows (10-20% faster "
           "batch-1 decode; see `model/huge_pages.py`)."),
    EnvVar("FDLP_CPU_BF16_DOT", "1", "`0`: bfloat16 weights multiply float32 activations on every CPU; else, "
           "where the CPU has AVX-512 BF16, the linear kernels round activations to bfloat16 and multiply with "
           "`vdpbf16ps` (twice the products per instruction; float32 sums)."),
    EnvVar("FDLP_CPU_ISA", "", "`avx2` or `portable`: act as on a CPU with fewer instruction sets than this "
           "one (tests, benchmarks); empty: what the CPU has."),
)}

_warned: set[str] = set()


def get(name: str) -> str:
    """The variable's value: `FDLP_…`, else its old name (warning once), else its default."""
    var = ENV_VARS[name]
    if name in os.environ:
        return os.environ[name]
    old = var.old_name
    if old is not None and old in os.environ:
        if old not in _warned:
            _warned.add(old)
            logger.warning("%s is deprecated; set %s instead", old, name)
        return os.environ[old]
    return var.default


def get_float(name: str) -> float:
    return float(get(name))


def get_int(name: str) -> int:
    return int(get(name))


def get_flag(name: str) -> bool:
    return get(name).strip().lower() in ("1", "true", "yes")


def markdown_table() -> str:
    """The docs' table of environment variables."""
    rows = ["| variable | default | meaning |", "|----------|---------|---------|"]
    for var in ENV_VARS.values():
        old = f" (formerly `{var.old_name}`, still read)" if var.old_name else ""
        rows.append(f"| `{var.name}` | {f'`{var.default}`' if var.default else 'unset'} | {var.help}{old} |")
    return "\n".join(rows) + "\n"
