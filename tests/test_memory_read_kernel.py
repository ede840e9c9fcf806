"""The read kernel behind the decode floor (``KernelLibrary.read_sum``, memory_read.cpp): every
word is read, whatever the size, thread count and vector width (tests/attention's portable-build
test runs this file on the x86-64-v2 and AVX2 builds too)."""

from __future__ import annotations

import pytest
import torch

from pagellm import kernels

KERNELS = kernels.default()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C++ compiler: the kernels are not built")


def _wrapping_sum(words: torch.Tensor) -> int:
    return sum(int(w) for w in words.tolist()) % (1 << 64)


@pytest.mark.parametrize("nbytes", [64, 7 * 64, 256 * 3 + 64, (1 << 20) + 192])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_sum_reads_every_word(nbytes: int, threads: int) -> None:
    words = torch.randint(-(1 << 62), 1 << 62, (nbytes // 8,), generator=torch.Generator().manual_seed(nbytes))
    assert KERNELS.read_sum(words, threads) == _wrapping_sum(words)


def test_read_sum_rejects_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        KERNELS.read_sum(torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 64"):
        KERNELS.read_sum(torch.zeros(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        KERNELS.read_sum(torch.zeros(16, 16, dtype=torch.int64).t())
