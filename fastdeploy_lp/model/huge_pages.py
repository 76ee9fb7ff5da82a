"""Weights on 2 MiB pages (Linux transparent huge pages), for the CPU's sake.

A batch-1 decode step streams every weight from memory once. On 4 KiB pages that is a TLB miss and
a page walk every 4 KiB, and the reads ran 10-20% slower than over the same bytes on 2 MiB pages
(the bench model, Xeon AVX-512, 2 cores: every linear weight read at 22 -> 26 GB/s in float32,
18 -> 22 bfloat16, 15 -> 19 int8; a decode step 17% faster in bfloat16). Most distributions set
transparent huge pages to `madvise`: only memory marked `MADV_HUGEPAGE` gets them.

Only whole 2 MiB pages inside one mapping can be huge, and each tensor of its own would have at most
its aligned interior on them: none of a 1 MB q/k/v or o projection of the bench model in int8, half
of a 4.4 MB down projection: 46% of its int8 decoder layers stayed on 4 KiB pages, and the layers
read at 26 GB/s where the LM head, nearly all on huge pages, read at 30. So the loader moves the
parameters, before it writes the checkpoint into them, into one buffer per dtype that starts on a
2 MiB boundary and is marked `MADV_HUGEPAGE` before anything is written (`pack`): every weight
matrix is then on 2 MiB pages (a dtype filling less than one, like the bench model's 1.8 MB of
int8 scales, stays where it was) and a batch-1 wint8 decode of the bench model ran 52.1 -> 55.4
tok/s (medians of 12 interleaved runs, Xeon AVX-512, 2 cores; bfloat16 4% faster, float32, whose
matrices are larger, unchanged). Where the kernel says no (not Linux, huge pages off), nothing
changes.
"""

from __future__ import annotations

import ctypes
import sys

import paddle

from fastdeploy_lp import envs

HUGE_PAGE = 2 << 20
MADV_DONTNEED, MADV_HUGEPAGE = 4, 14


def _madvise():
    if not sys.platform.startswith("linux") or not envs.get_flag("FDLP_HUGE_PAGES") or _thp_never():
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def _thp_never() -> bool:
    """Transparent huge pages switched off: `MADV_HUGEPAGE` still succeeds, and would change nothing."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as mode:
            return "[never]" in mode.read()
    except OSError:
        return False


def advise_before_writing(tensors: list[paddle.Tensor]) -> int:
    """Mark the 2 MiB-aligned interior of each CPU tensor for huge pages and drop its current (zero)
    pages, so that the writes that follow fault in huge pages. The tensors must hold zeros and
    nothing else may read them meanwhile (they read as zeros either way). Returns the bytes marked."""
    madvise = _madvise()
    if madvise is None:
        return 0
    marked = 0
    for t in tensors:
        if not t.place.is_cpu_place():
            continue
        start = t.data_ptr()
        end = start + t.size * t.element_size()
        first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if last <= first:
            continue
        if madvise(first, last - first, MADV_HUGEPAGE) != 0:  # huge pages off, or an old kernel
            return marked
        if madvise(first, last - first, MADV_DONTNEED) == 0:
            marked += last - first
    return marked


def pack(tensors: list[paddle.Tensor]) -> int:
    """Move the CPU tensors into one buffer per dtype laid on 2 MiB pages, each keeping its shape (a
    64-byte aligned slice sharing the buffer's memory), so the writes that follow fault in huge
    pages. Their values are not kept: moved tensors read as zeros until written (the loader writes
    every one). A dtype whose tensors fill less than one huge page stays where it is. Returns the
    bytes marked."""
    if _madvise() is None:
        return 0
    groups: dict = {}
    for t in tensors:
        if t.place.is_cpu_place() and t.size:
            groups.setdefault(t.dtype, []).append(t)
    marked = 0
    for dtype, group in groups.items():
        size = group[0].element_size()
        offsets, total = [], 0
        for t in group:
            offsets.append(total)
            total += -(-t.size * size // 64) * 64 // size
        if total * size < HUGE_PAGE:
            continue
        span = -(-total * size // HUGE_PAGE) * HUGE_PAGE
        buffer = paddle.empty([(span + HUGE_PAGE) // size], dtype=dtype)
        if advise_before_writing([buffer]) < span:  # the kernel refused: the tensors stay where they are
            return marked
        start = -buffer.data_ptr() % HUGE_PAGE // size
        for t, offset in zip(group, offsets):
            shape = t.shape
            buffer._slice(start + offset, start + offset + t.size)._share_buffer_to(t)
            t.get_tensor()._set_dims(shape)
        marked += span
    release_freed()
    return marked


def release_freed() -> None:
    """Give freed memory back to the system: glibc keeps freed blocks of its heap mapped, and tensors
    under its mmap threshold (up to 32 MiB) live there: the tensors `pack` moved, the loader's
    temporaries (160 MB of the bench model's load in wint8)."""
    if sys.platform.startswith("linux"):
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; not musl's
        if trim is not None:
            trim(0)
