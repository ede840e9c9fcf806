"""Packed weights' memory (``pagellm/kernels/weight_memory.py``): huge-page advised anonymous
memory where the kernel offers transparent huge pages, plain torch memory otherwise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pagellm.kernels import weight_memory


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            if inside:
                break
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
            if inside:
                fields["range"] = line
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def test_a_large_weight_buffer_is_private_memory_advised_for_huge_pages() -> None:
    if not weight_memory.huge_pages_available():
        pytest.skip("no transparent huge pages here (not Linux, or THP set to never)")
    shape = (3, weight_memory.HUGE_PAGE * 2)
    out = weight_memory.empty_weight(shape)
    assert out.shape == shape and out.dtype == torch.uint8 and out.is_contiguous()
    out.fill_(5)
    assert int(out[2, -1]) == 5
    mapping = _mapping_of(out.data_ptr())
    assert " rw-p " in mapping["range"]  # private anonymous (a shared mapping is shmem: no THP)
    assert mapping["THPeligible"] == "1"
    del out  # (the mapping goes with the tensor)


def test_small_buffers_and_hosts_without_huge_pages_take_torch_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    small = weight_memory.empty_weight((16, 1024))
    assert small.shape == (16, 1024) and small.dtype == torch.uint8
    monkeypatch.setattr(weight_memory, "huge_pages_available", lambda: False)
    plain = weight_memory.empty_weight((4, weight_memory.HUGE_PAGE))
    plain.zero_()
    assert plain.shape == (4, weight_memory.HUGE_PAGE) and int(plain.sum()) == 0
