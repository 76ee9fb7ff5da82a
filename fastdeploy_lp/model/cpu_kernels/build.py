"""Compiling `kernels.c` for the CPU this process sees: once per source, compiler and flags, into a
private cache directory (see the package docstring)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import paddle

from fastdeploy_lp.model import cpu_features

SOURCE = Path(__file__).with_name("kernels.c")
HEADERS = [Path(__file__).with_name(name) for name in ("linear.h", "invariant.h", "blocks.h", "block_linear.h", "invariant_blocks.h", "layer.h",
                                                                  "dot_bf16.h", "xpanel.h", "attention.h")]


def _openmp_flags() -> tuple[list[str], list[str]]:
    """Link against Paddle's libiomp5 when it ships one, so MKL and these loops share threads."""
    libs = Path(paddle.__file__).parent / "libs"
    if (libs / "libiomp5.so").exists():
        return ["-fopenmp", "-c"], ["-L", str(libs), "-liomp5", f"-Wl,-rpath,{libs}"]
    return ["-fopenmp", "-c"], ["-fopenmp"]


def build(isa: str | None = None, defines: tuple[str, ...] = ()) -> Path:
    """The compiled library for `isa` (default: this CPU's, `cpu_features.detect().isa`), built once
    per source, compiler, flags and `defines` (extra `-D` options, for experiments), and cached."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    compile_flags, link_flags = _openmp_flags()
    isa_flags = cpu_features.detect().compile_flags(isa)
    flags = ["-O3", "-fPIC", "-std=gnu11", *isa_flags, *(f"-D{d}" for d in defines)]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    sources = [SOURCE.read_text(), *(h.read_text() for h in HEADERS)]
    key = hashlib.sha256("\0".join([*sources, compiler, version, *flags, *link_flags])
                         .encode()).hexdigest()[:16]
    for cache in _cache_dirs():
        target = cache / f"cpu_kernels-{key}.so"
        if target.exists() and _private(cache):
            return target
        try:
            cache.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _private(cache):
                continue  # never load a library from a directory someone else can write
            return _compile(compiler, flags, compile_flags, link_flags, cache, target)
        except PermissionError:
            continue  # a read-only home: try the next place
    raise OSError("no writable directory for the compiled kernels")


def _private(directory: Path) -> bool:
    info = directory.stat()
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def _cache_dirs() -> list[Path]:
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastdeploy_lp"
    return [home, Path(tempfile.gettempdir()) / f"fastdeploy_lp-{os.getuid()}"]


def _compile(compiler: str, flags: list[str], compile_flags: list[str], link_flags: list[str], cache: Path,
             target: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        obj, lib = Path(tmp) / "kernels.o", Path(tmp) / "kernels.so"
        for cmd in ([compiler, *flags, *compile_flags, str(SOURCE), "-o", str(obj)],
                    [compiler, "-shared", str(obj), "-o", str(lib), *link_flags]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise OSError(f"{' '.join(cmd[:2])} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, target)  # atomic: concurrent builders (test workers, TP ranks) agree on one file
    return target

