"""Weights on transparent huge pages (model/huge_pages.py): the marking, and values unchanged."""

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
