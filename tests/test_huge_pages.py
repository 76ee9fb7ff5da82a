"""Weights on transparent huge pages (model/huge_pages.py): marking, packing, values unchanged."""

from __future__ import annotations

import re
import sys

import numpy as np
import paddle
import pytest

from fastdeploy_lp.model import huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def thp_mode() -> str:
    return re.search(r"\[(\w+)\]", open("/sys/kernel/mm/transparent_hugepage/enabled").read()).group(1)


def test_the_aligned_interior_of_a_zero_tensor_is_marked_and_written_values_read_back():
    if thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this machine")
    t = paddle.zeros([5 << 20], dtype="float32")  # 20 MiB: at least 8 aligned huge pages inside
    start, end = t.data_ptr(), t.data_ptr() + (20 << 20)
    first, last = -(-start // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE, end // huge_pages.HUGE_PAGE * huge_pages.HUGE_PAGE
    assert huge_pages.advise_before_writing([t]) == last - first >= 8 * huge_pages.HUGE_PAGE
    assert "hg" in vm_flags(first)  # MADV_HUGEPAGE: faults here may take 2 MiB pages
    assert not t.numpy().any()  # the dropped pages read as the zeros they held
    values = np.arange(5 << 20, dtype=np.float32)
    t.set_value(paddle.to_tensor(values))
    assert np.array_equal(t.numpy(), values)


def test_small_tensors_and_the_switch_leave_memory_alone(monkeypatch):
    small = paddle.zeros([1000], dtype="float32")
    assert huge_pages.advise_before_writing([small]) == 0
    monkeypatch.setenv("FDLP_HUGE_PAGES", "0")
    assert huge_pages.advise_before_writing([paddle.zeros([5 << 20], dtype="float32")]) == 0


def test_pack_moves_each_dtype_into_one_buffer_on_huge_pages_keeping_shapes_and_values():
    if thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this machine")
    weights = [paddle.zeros(shape, dtype="int8") for shape in ([1152, 896], [896, 896], [9728, 896], [896, 4864])]
    scales = [paddle.zeros([n], dtype="float32") for n in (1152, 896)]  # 8 KB: too little to pack
    where = [t.data_ptr() for t in scales]
    marked = huge_pages.pack(weights + scales)
    assert marked == -(-sum(-(-w.size // 64) * 64 for w in weights) // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE
    assert [t.data_ptr() for t in scales] == where
    start = weights[0].data_ptr()
    assert start % huge_pages.HUGE_PAGE == 0
    for before, after in zip(weights, weights[1:]):  # one after the other, 64-byte aligned
        assert after.data_ptr() == before.data_ptr() + -(-before.size // 64) * 64
    assert [w.shape for w in weights] == [[1152, 896], [896, 896], [9728, 896], [896, 4864]]
    assert "hg" in vm_flags(start) and "hg" in vm_flags(weights[-1].data_ptr() + weights[-1].size - 1)
    assert not any(w.numpy().any() for w in weights)  # zeros, as they came
    rng = np.random.default_rng(0)
    values = [rng.integers(-127, 128, w.shape, dtype=np.int8) for w in weights]
    for w, v in zip(weights, values):  # the loader's write: in place, in the buffer
        at = w.data_ptr()
        w.set_value(paddle.to_tensor(v))
        assert w.data_ptr() == at
    assert all(np.array_equal(w.numpy(), v) for w, v in zip(weights, values))


def test_pack_with_the_switch_off_leaves_tensors_where_they_are(monkeypatch):
    monkeypatch.setenv("FDLP_HUGE_PAGES", "0")
    t = paddle.zeros([4 << 20], dtype="float32")
    at = t.data_ptr()
    assert huge_pages.pack([t]) == 0 and t.data_ptr() == at
