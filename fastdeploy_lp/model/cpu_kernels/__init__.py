"""CPU kernels for the forward pass, in C (`kernels.c`), built with the system compiler at first use.

Why hand-written: on the bench model's shapes every CPU BLAS tried here (Paddle's MKL, PyTorch's,
numpy's OpenBLAS) reads the weight at about half its GEMV speed once a product has 2 to 16 rows,
so a batch-8 decode step spent ~145 ms in GEMMs whose weights a GEMV streams in ~73 ms; and
Paddle's CPU kernels around the GEMMs (swiglu, rotary, argmax, transposes, attention over gathered
blocks) were single-threaded or scalar.

* `linear`: `x @ W^T` for up to 12 rows, each weight row streamed once for all rows of x.
* `paged_attention`: causal attention reading the KV blocks where they are, one call per layer
  (prefill chunks and decode), instead of a gather, two matmuls, a mask add and a softmax.
* `rotary_cache_write`: rotary on q/k and the cache write, in place in the fused q/k/v rows.
* `swiglu`, `argmax`, `transpose`: Paddle's ops, vectorised (exp) and on every core.

The library is compiled once per source, compiler and CPU (`-O3 -march=native`) into
`$XDG_CACHE_HOME/fastdeploy_lp` (default `~/.cache`) and linked against the OpenMP runtime next to
Paddle (`libiomp5`), so its threads are MKL's threads; two runtimes spinning on two cores made a
step several times slower. Without a C compiler, or with `FDLP_CPU_KERNELS=0`, `load()` returns
None and the model uses Paddle's kernels. Numerics: float32 accumulation, only the summation
order differs from MKL's.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import paddle

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
SWITCH = "FDLP_CPU_KERNELS"  # "0" keeps Paddle's kernels
_threads = 1
_loaded: CpuKernels | None | bool = False  # False: not tried yet


def set_threads(threads: int) -> None:
    """Threads the kernels use; the runner sets it with Paddle's own CPU thread count."""
    global _threads
    _threads = max(1, int(threads))


class CpuKernels:
    """ctypes bindings of `kernels.c`, taking and returning float32 Paddle CPU tensors."""

    def __init__(self, library: ctypes.CDLL):
        ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._linear = library.fdlp_linear
        self._linear.argtypes = [ptr] * 4 + [i64] * 3 + [c_int]
        self._attention = library.fdlp_paged_attention
        self._attention.argtypes = [ptr] * 7 + [i64] * 8 + [ctypes.c_float, c_int]
        self._swiglu = library.fdlp_swiglu
        self._swiglu.argtypes = [ptr] * 2 + [i64] * 2 + [c_int]
        self._rotary_write = library.fdlp_rotary_cache_write
        self._rotary_write.argtypes = [ptr] * 7 + [i64] * 4 + [c_int]
        self._transpose = library.fdlp_transpose
        self._transpose.argtypes = [ptr] * 2 + [i64] * 2 + [c_int]
        self._argmax = library.fdlp_argmax
        self._argmax.argtypes = [ptr] * 2 + [i64] * 2 + [c_int]
        for fn in (self._linear, self._attention, self._swiglu, self._rotary_write, self._transpose, self._argmax):
            fn.restype = None

    def linear(self, x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None = None) -> paddle.Tensor:
        """`x @ weight^T + bias` for x `[M, K]` and weight `[N, K]`: `[M, N]`."""
        x = x if x.is_contiguous() else x.contiguous()
        (rows, k), n = x.shape, weight.shape[0]
        out = paddle.empty([rows, n], dtype=x.dtype)
        self._linear(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                     rows, n, k, _threads)
        return out

    def argmax(self, x: paddle.Tensor) -> paddle.Tensor:
        """`paddle.argmax(x, axis=-1)` of a 2-D float32 tensor (first index of the largest value),
        10x faster: Paddle's CPU argmax took 10 ms for 32 x 151,936 on one core."""
        x = x if x.is_contiguous() else x.contiguous()
        out = paddle.empty([x.shape[0]], dtype="int64")
        self._argmax(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], _threads)
        return out

    def transpose(self, x: paddle.Tensor) -> paddle.Tensor:
        """`x.T` of a contiguous 2-D tensor, as a new contiguous tensor (Paddle's CPU `contiguous()`
        of a transpose copied ~1 GB/s here)."""
        assert x.is_contiguous()
        out = paddle.empty([x.shape[1], x.shape[0]], dtype=x.dtype)
        self._transpose(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], _threads)
        return out

    def swiglu(self, gate_up: paddle.Tensor) -> paddle.Tensor:
        """`silu(gate) * up` for `gate_up` `[M, 2 * I]` holding gate then up, as `F.swiglu`: `[M, I]`."""
        gate_up = gate_up if gate_up.is_contiguous() else gate_up.contiguous()
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = paddle.empty([rows, width], dtype=gate_up.dtype)
        self._swiglu(gate_up.data_ptr(), out.data_ptr(), rows, width, _threads)
        return out

    def rotary_cache_write(self, qkv: paddle.Tensor, cos: paddle.Tensor, signed_sin: paddle.Tensor,
                           positions: paddle.Tensor, write_rows: paddle.Tensor, k_cache: paddle.Tensor,
                           v_cache: paddle.Tensor, heads: int, kv_heads: int) -> None:
        """Rotate the q and k heads of `qkv` `[T, (H + 2 KV) * D]` in place (tables `[positions, D]`,
        the sign in `signed_sin`, as `layers.RotaryEmbedding`) and copy k and v to `write_rows` of
        the caches viewed as `[-1, D]` (token-major, as `AttentionBatch.write_rows`)."""
        assert qkv.is_contiguous()
        dim = cos.shape[-1]
        self._rotary_write(qkv.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), positions.data_ptr(),
                           write_rows.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), qkv.shape[0], heads,
                           kv_heads, dim, _threads)

    def paged_attention(self, q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor, tables: paddle.Tensor,
                        lens: paddle.Tensor, new: int, max_len: int, kv_heads: int, block_size: int,
                        scale: float) -> paddle.Tensor:
        """Causal attention of each sequence's `new` last tokens over its cached keys (already
        written): q `[S * new, H, D]` rotated, sequence-major; scores times `scale`; caches holding
        `[blocks, kv_heads, block_size, D]` (any view of that memory); tables `[S, width]` and lens
        `[S]` (tokens after this pass) int64, every len <= max_len. Returns `[S * new, H, D]`."""
        q = q if q.is_contiguous() else q.contiguous()
        tokens, heads, dim = q.shape
        out = paddle.empty_like(q)
        scratch = paddle.empty([_threads, heads // kv_heads, max_len], dtype="float32")
        self._attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                        out.data_ptr(), scratch.data_ptr(), tokens // new, new, heads, kv_heads, dim, block_size,
                        tables.shape[1], max_len, scale, _threads)
        return out


def load() -> CpuKernels | None:
    """The kernels, built on first call; None where they cannot be (logged once)."""
    global _loaded
    if _loaded is False:
        _loaded = None
        if os.environ.get(SWITCH, "1") == "0":
            logger.info("CPU kernels: off (%s=0); Paddle's kernels", SWITCH)
        else:
            try:
                _loaded = CpuKernels(ctypes.CDLL(str(_build())))
                logger.info("CPU kernels: built-in linear, swiglu, rotary and paged attention")
            except (OSError, subprocess.SubprocessError) as e:
                logger.warning("CPU kernels unavailable (%s); using Paddle's kernels", e)
    return _loaded or None


def _openmp_flags() -> tuple[list[str], list[str]]:
    """Link against Paddle's libiomp5 when it ships one, so MKL and these loops share threads."""
    libs = Path(paddle.__file__).parent / "libs"
    if (libs / "libiomp5.so").exists():
        return ["-fopenmp", "-c"], ["-L", str(libs), "-liomp5", f"-Wl,-rpath,{libs}"]
    return ["-fopenmp", "-c"], ["-fopenmp"]


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    compile_flags, link_flags = _openmp_flags()
    flags = ["-O3", "-march=native", "-fPIC", "-std=gnu11"]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, _cpu_flags(), *flags, *link_flags])
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


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
